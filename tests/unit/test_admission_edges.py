"""Admission at its edges, through a real embedded worker (solo pool, in-memory broker).

A copy put back with backoff waits its countdown, whatever the clock of the worker that
put it back.

Celery turns a countdown into an absolute ETA by the publisher's clock, so a copy put back by
a worker an hour ahead would wait an hour on the others.  The put-back therefore carries its
countdown in a header, and the receiving worker's request waits at most that long (the
chaos test ``test_chaos_clock_skew`` runs the same with workers really an hour apart).

A task whose admission meets input no store can keep (a task id of 300 characters, say)
fails at once, naming the value: it is not deferred as if the store were away.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery, signals
from celery.contrib.testing.worker import start_worker
from kombu.message import Message

from celery_caps import Cap, CappedTask
from celery_caps.caps import slots_for
from celery_caps.messages import COUNTDOWN_HEADER
from celery_caps.stores.memory import MemoryStore
from celery_caps.worker import CappedRequest
from tests.unit.embedded import embedded_app

BACKOFF_SECONDS = 0.2


@pytest.fixture
def app() -> Iterator[Celery]:
    with embedded_app(
        "put-back",
        backend="cache+memory://",
        caps_strategy="backoff",
        caps_backoff_min_seconds=BACKOFF_SECONDS,
        caps_backoff_max_seconds=BACKOFF_SECONDS,
    ) as app:
        yield app


def test_a_put_back_copy_carries_its_countdown_and_waits_no_longer(app: Celery) -> None:
    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def call(value: int) -> int:
        return value * 2

    received: list[Any] = []
    arrived = threading.Event()

    def on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
        received.append(request)
        if len(received) >= 2:
            arrived.set()

    signals.task_received.connect(on_received, weak=False)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            # Given the cap's only slot held by another run
            store = app.conf.caps_url
            held = store.acquire(slots_for(call._caps, (21,), {}), "other-task", "other-run", "elsewhere", 30.0)
            assert held.granted
            # When the task arrives: it is put back with backoff, and its copy returns
            result = call.delay(21)
            assert arrived.wait(10), f"the put-back copy did not arrive ({len(received)} received)"
            copy = received[1]
            # Then the copy carries its countdown, and its ETA is at most that far ahead
            assert copy.id == result.id
            countdown = copy._request_dict.get(COUNTDOWN_HEADER)
            assert isinstance(countdown, float) and 0 < countdown <= BACKOFF_SECONDS, countdown
            assert copy.eta is not None
            assert copy.eta <= datetime.now(timezone.utc) + timedelta(seconds=countdown)

            # ... and the same message, its ETA written by a clock an hour ahead, still waits
            # no longer than its countdown here
            message = copy._message
            skewed_eta = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
            ahead = Message(
                body=message.body,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                delivery_info=message.delivery_info,
                properties=message.properties,
                headers={**message.headers, "eta": skewed_eta, "id": uuid.uuid4().hex},
            )
            request = CappedRequest(ahead, app=app, task=call)
            assert request.eta is not None
            assert request.eta <= datetime.now(timezone.utc) + timedelta(seconds=countdown)

            # ... and once the slot is free the task runs
            store.release("other-run")
            assert result.get(timeout=10) == 42
    finally:
        signals.task_received.disconnect(on_received)


@pytest.mark.parametrize("strategy", ["park", "backoff"])
def test_a_task_id_no_store_can_keep_fails_the_task_naming_it(app: Celery, strategy: str) -> None:
    app.conf.caps_strategy = strategy

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def call(value: int) -> int:
        return value * 2

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        result = call.apply_async((21,), task_id="t" * 300)
        with pytest.raises(Exception) as raised:
            result.get(timeout=10)
        assert result.state == "FAILURE"
        assert type(raised.value).__name__ == "StoreInputError"
        assert "is longer than 255 characters" in str(raised.value)
        # ... and nothing was taken, and a task with a good id runs as usual
        assert app.conf.caps_url.leases() == []
        assert call.delay(2).get(timeout=10) == 4


def test_an_errback_of_the_failed_tasks_own_type_is_a_plain_call(app: Celery) -> None:
    # Celery calls an errback taking (request, exc, traceback) directly, inside the worker,
    # with the failed task's request still current: it must run as a plain call, not go
    # through admission again (a keyed cap would call its key function with those arguments).
    calls: list[tuple[str, Any]] = []

    @app.task(base=CappedTask, cap=Cap("tenant", 1, key=lambda value: f"k{value}"), shared=False)
    def job(*args: Any) -> None:
        if len(args) == 1:
            raise ValueError(args[0])
        calls.append(("errback", args[0].id))

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        result = job.apply_async((1,), link_error=job.s())
        with pytest.raises(ValueError):
            result.get(timeout=10)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls == [("errback", result.id)]
        assert app.conf.caps_url.leases() == []


@pytest.mark.parametrize("strategy", ["park", "backoff"])
def test_a_waiting_task_says_so_once_at_info(app: Celery, strategy: str, caplog: pytest.LogCaptureFixture) -> None:
    # Celery's own line for a copy that waits says only "ignored": celery-caps says, once per wait,
    # that it waits and for what.
    app.conf.caps_strategy = strategy
    caplog.set_level(logging.INFO, logger="celery_caps")

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def call(value: int) -> int:
        return value * 2

    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        # Given the cap's only slot held by another run
        store = app.conf.caps_url
        slots = slots_for(call._caps, (21,), {})
        assert store.acquire(slots, "other-task", "other-run", "elsewhere", 30.0).granted
        # When the task arrives and waits (with backoff, through several put-backs)
        result = call.delay(21)
        waited = time.monotonic() + 10
        while time.monotonic() < waited and not any(
            "waits for a free slot" in record.getMessage() for record in caplog.records
        ):
            time.sleep(0.05)
        time.sleep(4 * BACKOFF_SECONDS)  # room for more put-backs
        # ... and then the slot frees
        handed_over = store.release_and_wake("other-run", 30.0)[1] if strategy == "park" else []
        if strategy == "backoff":
            store.release("other-run")
        elif handed_over:
            from celery_caps import handover
            from celery_caps.runtime import runtime_for

            handover.publish_woken(runtime_for(app), handed_over)
        assert result.get(timeout=10) == 42

    # Then one INFO line said it waits, naming the slot and the task
    waiting = [
        record
        for record in caplog.records
        if record.levelno == logging.INFO and "waits for a free slot" in record.getMessage()
    ]
    assert len(waiting) == 1, [record.getMessage() for record in waiting]
    assert f"[{result.id}]" in waiting[0].getMessage() and "provider" in waiting[0].getMessage()


def test_a_store_outage_is_reported_once_not_at_every_put_back(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    # Given a store that fails every admission until told otherwise (caps_on_store_error "defer":
    # the task is put back, again and again)
    class FlakyStore(MemoryStore):
        away = True

        def _check(self, operation: str) -> None:
            if self.away:
                from celery_caps.errors import StoreError

                raise StoreError(f"{operation} failed on flaky://store: the store is away (simulated)")

        def acquire(self, *args: Any, **kwargs: Any) -> Any:
            self._check("acquire")
            return super().acquire(*args, **kwargs)

        def recover(self, *args: Any, **kwargs: Any) -> Any:  # the worker's recovery meets it too
            self._check("recover")
            return super().recover(*args, **kwargs)

    store = FlakyStore()
    app.conf.caps_url = store
    caplog.set_level(logging.DEBUG, logger="celery_caps")

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def call(value: int) -> int:
        return value * 2

    received: list[Any] = []

    def on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
        received.append(request)

    signals.task_received.connect(on_received, weak=False)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            # When a task meets the outage through several put-backs, then the store answers
            result = call.delay(21)
            deadline = time.monotonic() + 10
            while len(received) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(received) >= 4, f"{len(received)} copies received"
            store.away = False
            assert result.get(timeout=10) == 42
    finally:
        signals.task_received.disconnect(on_received)

    # Then the outage was reported once at WARNING, with the store and the cause, and once when it
    # ended; each put-back said only a short line below WARNING
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "memory://" not in r.getMessage()
    ]
    outage = [m for m in warnings if "the slot store cannot be used" in m]
    assert len(outage) == 1 and "the store is away (simulated)" in outage[0], warnings
    assert len([m for m in warnings if "the slot store answers again" in m]) == 1, warnings
    assert len(warnings) == 2, warnings
    put_backs = [r for r in caplog.records if "put back: the slot store cannot be used" in r.getMessage()]
    assert len(put_backs) >= 3 and all(r.levelno == logging.DEBUG for r in put_backs)
