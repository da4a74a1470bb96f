"""A woken task whose message cannot be published fails alone (``handover.fail_unpublishable``):
its result says so even when the store's reply to taking it off the list is lost."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from celery import Celery, states

from celery_caps import handover
from celery_caps.errors import StoreError
from celery_caps.runtime import runtime_for
from celery_caps.stores.base import ParkOutcome, ParkRequest, Woken
from celery_caps.stores.memory import MemoryStore


class ForgetReplyLost(MemoryStore):
    """A memory store whose ``forget`` runs, then fails as if its reply were lost."""

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        super().forget(task_id, dispatch_lease_seconds)
        raise StoreError("the reply was lost (simulated)")


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("unpublishable", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(caps_url=ForgetReplyLost(), caps_sweep_interval_seconds=None)
    try:
        yield app
    finally:
        app.close()


def test_a_task_failed_for_its_message_keeps_its_failure_when_the_forget_reply_is_lost(app: Celery) -> None:
    runtime = runtime_for(app)
    store = runtime.store
    assert isinstance(store, ForgetReplyLost)
    # Given: a slot of limit 1 held, task T parked behind it, then dispatched by the release
    held = store.acquire({"g": 1}, "holder-task", "holder-run", "w/1", 60.0)
    assert held.granted
    parked = store.park(
        ParkRequest({"g": 1}, "T", "T-run", "w/2", 60.0, time.time(), 100, "proj.task", b"not a message")
    )
    assert parked is ParkOutcome.PARKED
    _, [woken] = store.release_and_wake("holder-run", 30.0)
    assert woken.task_id == "T"
    # When: its message cannot be published, and the forget that takes it off the list loses its reply
    handover.fail_unpublishable(runtime, woken, None, TypeError("an argument too many"))
    # Then: it is off the list, and its result says why it did not run (it used to have none)
    assert [waiter.task_id for waiter in store.waiters()] == []
    result = app.AsyncResult("T")
    assert result.state == states.FAILURE
    assert "an argument too many" in str(result.result)
