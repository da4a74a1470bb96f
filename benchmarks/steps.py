"""Time the steps of every hand-over in the benchmark workers (``CAPS_BENCH_STEPS=1``).

A hand-over runs through two processes: the pool process whose run ends releases its slot,
and the store hands the room to a waiting task (one transaction) whose copy it publishes to
the wake queue; the worker that receives that copy passes it to a pool process, which claims
the dispatch (a second transaction) and starts the body.  The probe wraps the library's own
functions for those steps (:func:`celery_caps.handover.release`,
:func:`celery_caps.handover.publish_woken`, :func:`celery_caps.park._claim`) and listens to
Celery's ``task_received`` and ``task_prerun``, and writes each step's time, keyed by the task
that is handed the slot, to a Redis list: one JSON object per process and step group, pushed
after the run that recorded it (``task_postrun``), or from the worker's main process by a
thread every 0.2 s, so that the bookkeeping does not lengthen what it measures.

:mod:`benchmarks.handover` reads the list and joins it to the runs' own records.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import signals


def install_step_probe(client: Callable[[], redis.Redis], key: str) -> None:
    """Wrap the hand-over's steps and record them under ``key`` (a Redis list)."""
    from celery_caps import handover, park

    marks: list[dict[str, Any]] = []  # this process's records not yet pushed
    lock = threading.Lock()
    releasing: dict[str, Any] = {}  # the release under way in this process

    def add(record: dict[str, Any]) -> None:
        with lock:
            marks.append(record)

    def push() -> None:
        with lock:
            batch = marks[:]
            marks.clear()
        if batch:
            client().rpush(key, *(json.dumps(record) for record in batch))

    original_release = handover.release
    original_publish = handover.publish_woken
    original_claim = park._claim

    def timed_release(runtime: Any, run_id: str) -> int:
        task = runtime.app.current_worker_task
        releasing.update(start=time.time(), by=getattr(getattr(task, "request", None), "id", None))
        try:
            return original_release(runtime, run_id)
        finally:
            releasing.clear()

    def timed_publish(runtime: Any, woken: Any, **kwargs: Any) -> Any:
        started = time.time()
        try:
            return original_publish(runtime, woken, **kwargs)
        finally:
            ended = time.time()
            if releasing:
                for waiter in woken:
                    add(
                        {
                            "task_id": waiter.task_id,
                            "released_by": releasing.get("by"),
                            "release_start": releasing.get("start"),
                            "publish_start": started,
                            "publish_end": ended,
                        }
                    )

    def timed_claim(store: Any, arrival: Any, dispatch_run_id: str, lease_seconds: float) -> Any:
        started = time.time()
        try:
            return original_claim(store, arrival, dispatch_run_id, lease_seconds)
        finally:
            add({"task_id": arrival.task_id, "claim_start": started, "claim_end": time.time()})

    handover.release = timed_release  # type: ignore[assignment]
    handover.publish_woken = timed_publish  # type: ignore[assignment]
    park._claim = timed_claim  # type: ignore[assignment]

    # Every copy's (the reader keeps the woken ones'): a copy received twice keeps its last.
    @signals.task_received.connect(weak=False)
    def on_received(request: Any = None, **_: Any) -> None:
        add({"task_id": request.id, "received": time.time()})

    @signals.task_prerun.connect(weak=False)
    def on_prerun(task_id: str | None = None, **_: Any) -> None:
        add({"task_id": task_id, "prerun": time.time()})

    @signals.task_postrun.connect(weak=False)
    def on_postrun(**_: Any) -> None:
        push()

    @signals.worker_ready.connect(weak=False)
    def start_pusher(**_: Any) -> None:
        # The main process: task_received's records, pushed off the consumer's path.
        def pusher() -> None:
            while True:
                time.sleep(0.2)
                push()

        threading.Thread(target=pusher, name="bench-steps", daemon=True).start()
