"""What a copy that ends without running its body leaves behind in the process that ran it.

Under saturation nearly every task ends one copy with ``Ignore`` (it parks, or is put back).
For each, Celery's tracer builds a picklable copy of the traceback (billiard's
``ExceptionInfo``; on Python 3.11+ it copies every instruction position of every frame's
code, hundreds of kilobytes) and keeps the exception in a local of its own frame, which the
exception's traceback points back at: a reference cycle only the garbage collector frees.
Pool processes grew by about 170 MB each that way before their collector caught up
(``benchmarks/memory.py``).  The worker drops the traceback once Celery has used it, so the
copy is freed as its trace returns, by reference counting alone.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from billiard.einfo import ExceptionInfo
from celery import Celery, signals, states
from celery.contrib.testing.worker import start_worker

from celery_caps import Cap, CappedTask
from celery_caps.caps import slots_for
from celery_caps.stores.memory import MemoryStore
from tests.unit.embedded import embedded_app

COPIES = 40


@pytest.fixture
def app() -> Iterator[Celery]:
    with embedded_app("ended-copies", task_ignore_result=True) as app:
        yield app


def _live_exception_infos() -> int:
    return sum(1 for item in gc.get_objects() if type(item) is ExceptionInfo)


def _wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("strategy", ["park", "backoff"])
def test_copies_ended_by_a_full_cap_are_freed_without_the_garbage_collector(app: Celery, strategy: str) -> None:
    # Put-back copies come back after a long countdown: each task ends one copy in the test.
    app.conf.update(caps_strategy=strategy, caps_backoff_min_seconds=60, caps_backoff_max_seconds=60)

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def call(value: int) -> int:
        return value

    store: MemoryStore = app.conf.caps_url
    ended: list[str] = []

    def count_ended(sender: Any = None, task_id: str = "", state: str = "", **_: Any) -> None:
        if getattr(sender, "name", None) == call.name and state == states.IGNORED:
            ended.append(task_id)

    signals.task_postrun.connect(count_ended, weak=False)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            # Given the cap's only slot held by another run, and no garbage collection from now on
            held = store.acquire(slots_for(call._caps, (0,), {}), "other-task", "other-run", "elsewhere", 60.0)
            assert held.granted
            gc.collect()
            before = _live_exception_infos()
            gc.disable()
            try:
                # When COPIES tasks arrive and each ends its copy (parked, or put back)
                for value in range(COPIES):
                    call.delay(value)
                assert _wait_for(lambda: len(ended) >= COPIES, 30), f"{len(ended)} of {COPIES} copies ended"
                # Then the copies' traceback copies are gone as their traces return, with the
                # collector off: at most the one being traced is alive
                assert _wait_for(lambda: _live_exception_infos() - before <= 1, 5), (
                    f"{_live_exception_infos() - before} of Celery's ExceptionInfo alive after {COPIES} ended copies"
                )
            finally:
                gc.enable()
            store.release("other-run")
    finally:
        signals.task_postrun.disconnect(count_ended)
