"""Calls that are not messages follow Celery's conventions: direct calls and eager runs.

A direct call (``mytask(...)``) is a plain function call; an eager run (``apply()``,
``task_always_eager``) runs without caps and without a store unless ``caps_enforce_eager``;
enforced, a call nested in a capped run of the same cap runs under its caller's admission.
And an app's ``close()`` closes its caps runtime.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_caps import Cap, CappedTask, CapWaitExceeded, StoreError
from celery_caps.runtime import runtime_for
from celery_caps.stores.memory import MemoryStore


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("calls", broker="memory://", set_as_current=False)
    yield app
    app.close()


def capped(app: Celery, limit: int = 1, body: Any = None) -> Any:
    @app.task(base=CappedTask, cap=Cap("provider", limit), shared=False, bind=True)
    def call(self: Any, value: int) -> Any:
        return body(self, value) if body is not None else value * 2

    return call


def test_a_direct_call_and_an_eager_run_need_no_store(app: Celery) -> None:
    # Given an app with no caps_url at all
    task = capped(app)
    # Then a direct call is a plain function call, and apply() and task_always_eager run the body
    assert task(21) == 42
    assert task.apply((21,)).get() == 42
    app.conf.task_always_eager = True
    assert task.delay(21).get() == 42


def test_an_eager_run_takes_its_caps_when_enforced(app: Celery) -> None:
    store = MemoryStore()
    app.conf.update(caps_url=store, caps_enforce_eager=True, caps_backoff_min_seconds=0.01)
    seen: list[list[str]] = []
    task = capped(app, body=lambda task, value: seen.append([lease.task_id for lease in store.leases()]) or value)

    assert task.apply((1,), task_id="eager-1").get() == 1

    # It held its slot while its body ran, and released it after
    assert seen == [["eager-1"]]
    assert store.leases() == []
    assert store.peaks == {"provider": 1}


def test_an_enforced_eager_run_waits_for_its_slot_then_gives_up_at_the_maximum_wait(app: Celery) -> None:
    store = MemoryStore()
    app.conf.update(caps_url=store, caps_enforce_eager=True, caps_max_wait_seconds=0.3, caps_backoff_min_seconds=0.01)
    task = capped(app)
    assert store.acquire({"provider": 1}, "elsewhere", "run-x", "other/1", 60).granted

    result = task.apply((1,))

    assert result.state == "FAILURE" and isinstance(result.result, CapWaitExceeded), result.result


def test_an_eager_call_nested_in_a_run_of_the_same_cap_runs_under_its_callers_admission(app: Celery) -> None:
    # A cap of 1: the nested call would wait for its caller for ever if it took the slot again.
    store = MemoryStore()
    app.conf.update(caps_url=store, caps_enforce_eager=True, caps_max_wait_seconds=5)
    inner = capped(app, body=lambda task, value: value + 1)

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def outer(value: int) -> int:
        return int(inner.apply((value,)).get()) * 10

    started = time.monotonic()
    assert outer.apply((1,)).get() == 20
    assert time.monotonic() - started < 2
    assert store.peaks == {"provider": 1} and store.leases() == []


@pytest.mark.parametrize("policy", ["defer", "run", "fail"])
def test_an_enforced_eager_run_under_a_store_outage_follows_the_store_error_policy(app: Celery, policy: str) -> None:
    class AwayStore(MemoryStore):
        def acquire(self, *args: Any, **kwargs: Any) -> Any:
            raise StoreError("the store is away (simulated)")

    app.conf.update(
        caps_url=AwayStore(), caps_enforce_eager=True, caps_on_store_error=policy, caps_max_wait_seconds=0.3,
        caps_backoff_min_seconds=0.01,
    )  # fmt: skip
    result = capped(app).apply((21,))

    # defer: waits (no broker to put it back to), then gives up; run: runs uncapped; fail: fails
    expected = {"defer": CapWaitExceeded, "fail": StoreError}.get(policy)
    if expected is None:
        assert result.get() == 42
    else:
        assert result.state == "FAILURE" and isinstance(result.result, expected), result.result


def test_closing_the_app_closes_its_caps_runtime(app: Celery, tmp_path: Any) -> None:
    app.conf.update(caps_url=f"sqlite:///{tmp_path}/caps.db", caps_enforce_eager=True)
    task = capped(app)
    assert task.apply((1,)).get() == 2
    runtime = runtime_for(app)
    store = runtime.store
    engine = store.engine  # type: ignore[attr-defined]
    assert engine.pool.checkedin() >= 1  # a connection kept for the next call

    app.close()

    # The store it opened is closed with the app (its pooled connections are gone); the runtime
    # builds a new one if the app is used again
    assert engine.pool.checkedin() == 0
    assert runtime.store is not store
    runtime.close()


def test_a_direct_call_in_another_thread_never_waits_for_a_running_run(app: Celery) -> None:
    # Celery itself calls errbacks directly (Backend._call_task_errbacks): they must not queue
    # behind the cap, whatever holds it.
    store = MemoryStore()
    app.conf.update(caps_url=store)
    task = capped(app)
    assert store.acquire({"provider": 1}, "elsewhere", "run-x", "other/1", 60).granted
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(task(5)))
    thread.start()
    thread.join(5)
    assert done == [10]
