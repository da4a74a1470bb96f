"""A put-back is visible: a ``task-deferred`` event (worker started with ``-E``), the
``DEFERRED`` result state while the task waits, and ``celery caps explain`` / ``holders``
against a real worker.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from celery_caps.cli import caps
from celery_caps.stores import store_from_url
from tests.integration.ops import OpsWorker, ops_env, wait_for
from tests.services import new_prefix, require_service

pytestmark = [pytest.mark.fleet, pytest.mark.redis]


class EventLog:
    """Every event the app's event exchange carries, captured in a thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(connection, handlers={"*": self.events.append})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> None:
        self._thread.start()

        # Ready once a probe event of our own comes back (the receiver's queue is bound).
        def probe_seen() -> bool:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send("caps-test-probe")
            time.sleep(0.1)
            return any(event["type"] == "caps-test-probe" for event in self.events)

        wait_for(probe_seen, 60, "the event receiver never saw its probe")

    def of(self, kind: str, task_id: str) -> list[dict[str, Any]]:
        return [event for event in list(self.events) if event["type"] == kind and event.get("uuid") == task_id]

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True  # seen within a second (the receiver's safety interval)
        self._thread.join(10)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[OpsWorker]:
    redis_url = require_service("redis")
    caps_url = f"sqlite:///{tmp_path}/caps.db"
    ops = OpsWorker(ops_env(new_prefix(), broker=redis_url, backend=redis_url, caps_url=caps_url), tmp_path)
    store = store_from_url(caps_url)
    yield ops
    ops.close(redis_url, store)
    store.close()


def test_a_put_back_task_sends_an_event_and_shows_as_deferred(worker: OpsWorker) -> None:
    gate = f"{worker.prefix}gate"
    worker.start("-E")
    events = EventLog(worker.app)
    events.start()
    try:
        # Given a task holding the gate (limit 1) for a while
        first = worker.send("ops.hold_until", worker.flag("first"), "a")  # until the checks below are done
        wait_for(lambda: events.of("task-started", first.id), 60, "the first task never started")
        # When a second task, and one whose result is ignored, arrive
        second = worker.send("ops.hold", 0.1, "b")
        quiet = worker.send("ops.hold_quietly", 0.1)

        # Then each is put back with a task-deferred event naming the full cap
        [deferred, *_] = wait_for(lambda: events.of("task-deferred", second.id), 60, "no task-deferred event")
        assert deferred["full_slots"] == [gate] and deferred["slots"] == [gate]
        assert deferred["deferrals"] == 1 and deferred["reason"] == "full"
        assert deferred["next_attempt_at"] > deferred["first_deferred_at"]
        assert deferred["hostname"] == worker.name
        wait_for(lambda: events.of("task-deferred", quiet.id), 60, "no task-deferred event for the quiet task")

        # and while it waits its result state is DEFERRED, with the wait in its meta
        assert second.state == "DEFERRED"
        assert second.info["full_slots"] == [gate] and second.info["deferrals"] >= 1
        assert quiet.state == "PENDING"  # results ignored: nothing stored

        # and `celery caps explain` says why, and who holds the slot
        runner = CliRunner()
        report = json.loads(
            runner.invoke(caps, ["explain", second.id, "--json"], obj=worker, catch_exceptions=False).output
        )
        assert report["state"] == "waiting" and report["task_name"] == "ops.hold"
        [slot] = report["slots"]
        assert (slot["slot"], slot["full"]) == (gate, True)
        [holder] = slot["held_by"]
        assert (holder["task_id"], holder["task_name"], holder["worker"]) == (first.id, "ops.hold_until", worker.name)
        holders = runner.invoke(caps, ["holders", gate, "--json"], obj=worker, catch_exceptions=False).output
        assert [lease["task_id"] for lease in json.loads(holders)] == [first.id]

        # Finally the real result overwrites DEFERRED
        worker.open_flag("first")
        assert second.get(timeout=60) == "b" and second.state == "SUCCESS"
        assert first.get(timeout=60) == "a"

        def explained_from_history() -> dict[str, Any] | None:
            # The history reaches the store at the worker's next renewal tick.
            output = runner.invoke(caps, ["explain", second.id, "--json"], obj=worker, catch_exceptions=False).output
            report: dict[str, Any] = json.loads(output)
            return report if report["deferrals"] else None

        report = wait_for(explained_from_history, 30, "the put-backs never reached the history")
        assert report["state"] == "finished (SUCCESS)" and report["deferrals"] >= 1
    finally:
        events.stop()
