"""How many store calls park's admission makes (issue 34: at most three per task that waits).

A task whose wait is not stored as ``DEFERRED`` (it ignores its result, has no backend, or
``caps_deferred_state`` is off) sends its message with its first park call: it runs, or waits,
in one call.  A task whose wait is stored asks first without its message, stores ``DEFERRED``
once its slots are full, then parks: the state is written before the entry, since a release may
wake the task, and it may finish, at once.  Neither way parks a task that waited past
``caps_max_wait_seconds`` (it gives up) or whose message is over ``caps_park_max_payload_bytes``
(it waits outside).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_caps import Cap, CappedTask, park
from celery_caps.caps import slots_for
from celery_caps.stores.base import OUTSIDE_PAYLOAD, ParkOutcome, ParkRequest
from celery_caps.stores.memory import MemoryStore
from tests.unit.embedded import embedded_app

SLOT = "provider"
LEASE_SECONDS = 30.0


class CountingStore(MemoryStore):
    """A memory store that keeps every park request it was asked, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.parks: list[ParkRequest] = []

    def park(self, request: ParkRequest) -> ParkOutcome:
        self.parks.append(request)
        return super().park(request)


def _arrival(first_deferred_at: float | None = None) -> park.Arrival:
    return park.Arrival(
        task_id=str(uuid.uuid4()),
        task_name="tasks.call",
        slots={SLOT: 1},
        holder="w1@host/1",
        dispatch_run_id=None,
        redelivered=False,
        first_deferred_at=time.time() if first_deferred_at is None else first_deferred_at,
    )


def _decide(store: CountingStore, arrival: park.Arrival, message: bytes, **options: Any) -> park.Decision:
    built: list[bytes] = []

    def payload() -> bytes:
        built.append(message)
        return message

    decision = park.decide(
        store, arrival, uuid.uuid4().hex, payload, lease_seconds=LEASE_SECONDS, max_waiters=100,
        max_payload_bytes=1000, **options,
    )  # fmt: skip
    assert len(built) <= 1, "the message is built once"
    return decision


@pytest.fixture
def full() -> CountingStore:
    """A store whose only slot is held by another task."""
    store = CountingStore()
    assert store.acquire({SLOT: 1}, "holder-task", "holder-run", "elsewhere", LEASE_SECONDS).granted
    return store


def test_with_the_message_first_a_task_that_waits_parks_in_one_call(full: CountingStore) -> None:
    arrival = _arrival()

    decision = _decide(full, arrival, b"message", payload_first=True)

    assert decision.verdict is park.Verdict.PARKED
    assert [request.payload for request in full.parks] == [b"message"]
    # and the release hands it the slot, with that message
    assert [(woken.task_id, woken.payload) for woken in full.release_and_wake("holder-run", 60)[1]] == [
        (arrival.task_id, b"message")
    ]


def test_with_the_message_first_a_task_with_room_runs_in_one_call() -> None:
    store = CountingStore()

    decision = _decide(store, _arrival(), b"message", payload_first=True)

    assert decision.verdict is park.Verdict.RUN
    assert len(store.parks) == 1 and store.waiters() == []


def test_without_the_message_first_a_task_that_waits_asks_then_parks(full: CountingStore) -> None:
    decision = _decide(full, _arrival(), b"message")

    assert decision.verdict is park.Verdict.PARKED
    assert [request.payload for request in full.parks] == [None, b"message"]


def test_a_task_past_its_maximum_wait_gives_up_and_is_never_parked(full: CountingStore) -> None:
    arrival = _arrival(first_deferred_at=time.time() - 120)

    decision = _decide(full, arrival, b"message", payload_first=True, max_wait_seconds=60)

    assert decision.verdict is park.Verdict.GAVE_UP
    assert [request.payload for request in full.parks] == [None]
    assert full.entry(arrival.task_id) is None


def test_a_message_over_the_payload_bound_waits_outside_whichever_way(full: CountingStore) -> None:
    arrival = _arrival()

    decision = _decide(full, arrival, b"x" * 2000, payload_first=True)

    assert decision.verdict is park.Verdict.OUTSIDE
    assert [request.payload for request in full.parks] == [None, OUTSIDE_PAYLOAD]
    entry = full.entry(arrival.task_id)
    assert entry is not None and entry.outside


# -- through a worker: which way a task parks follows whether its wait is stored -------------


@pytest.fixture
def app() -> Iterator[Celery]:
    with embedded_app("park-calls", backend="cache+memory://", caps_url=CountingStore()) as app:
        yield app


def test_a_worker_sends_the_message_first_unless_it_stores_the_wait(app: Celery) -> None:
    @app.task(base=CappedTask, cap=Cap(SLOT, 1), ignore_result=True, shared=False)
    def ignored(value: int) -> int:
        return value * 2

    @app.task(base=CappedTask, cap=Cap(SLOT, 1), shared=False)
    def kept(value: int) -> int:
        return value * 2

    store = app.conf.caps_url
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        # Given the cap's only slot held by another run
        slots = slots_for(kept._caps, (21,), {})
        assert store.acquire(slots, "other-task", "other-run", "elsewhere", LEASE_SECONDS).granted
        # When a task that ignores its result, then one that keeps it, arrive and park
        results = [ignored.delay(21), kept.delay(21)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(store.waiters()) < 2:
            time.sleep(0.02)
        assert [waiter.task_id for waiter in store.waiters()] == [result.id for result in results]
        states = [app.backend.get_task_meta(result.id)["status"] for result in results]

    # Then the first parked in one call with its message; the second asked first, and stored
    # DEFERRED before it parked
    calls = [[request.payload is not None for request in store.parks if request.task_id == r.id] for r in results]
    assert calls == [[True], [False, True]]
    assert states == ["PENDING", "DEFERRED"]
