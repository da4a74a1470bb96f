"""What operators see of tasks that wait under park: ``celery caps explain`` says how long a
task waited before it ran, and ``celery caps timeline`` counts the tasks that waited, whether
they parked on arrival at a worker or when sent (``caps_park_on_publish``).

A real prefork worker of :mod:`tests.integration.opsapp` with ``caps_strategy="park"`` and
history on, a SQLite store, Redis as broker and result backend.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from celery_caps.cli import caps
from celery_caps.stores import store_from_url
from celery_caps.stores.base import SlotStore
from tests.integration.ops import OpsWorker, ops_env, wait_for
from tests.services import new_prefix, require_service

pytestmark = [pytest.mark.fleet, pytest.mark.redis, pytest.mark.sqlite]


@pytest.fixture
def parking(tmp_path: Path) -> Iterator[tuple[OpsWorker, SlotStore]]:
    redis_url = require_service("redis")
    caps_url = f"sqlite:///{tmp_path}/caps.db"
    env = ops_env(new_prefix(), broker=redis_url, backend=redis_url, caps_url=caps_url, strategy="park")
    worker = OpsWorker(env, tmp_path)
    store = store_from_url(caps_url)
    yield worker, store
    worker.close(redis_url, store)
    store.close()


def invoke(worker: OpsWorker, *args: str) -> str:
    result = CliRunner().invoke(caps, list(args), obj=worker, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_parked_tasks_wait_shows_in_explain_and_in_the_timeline(
    parking: tuple[OpsWorker, SlotStore], tmp_path: Path
) -> None:
    worker, store = parking
    gate = f"{worker.prefix}gate"
    picture = str(tmp_path / "timeline.png")
    worker.start()

    # Given a task holding the gate (limit 1)
    first = worker.send("ops.hold_until", worker.flag("first"), "a")
    wait_for(lambda: store.leases(gate), 60, lambda: f"the first task never took the gate:\n{worker.log()}")
    # When one task parks on arrival at the worker, and another when it is sent
    sent_at = time.time()
    on_arrival = worker.send("ops.hold", 0.1, "b")
    wait_for(lambda: [w for w in store.waiters(gate) if w.task_id == on_arrival.id], 60, "the task never parked")
    worker.app.conf.caps_park_on_publish = True
    when_sent = worker.app.tasks["ops.hold"].apply_async((0.1, "c"))
    assert when_sent.id in {waiter.task_id for waiter in store.waiters(gate)}

    # Then the timeline counts both as waiting
    output = invoke(worker, "timeline", "--since", "5m", "--out", picture, "--cap", gate)
    assert "2 task(s) waited for a slot, 2 waiting now" in output, output

    # When the gate opens and both run
    opened_at = time.time()
    worker.open_flag("first")
    assert [result.get(timeout=60) for result in (first, on_arrival, when_sent)] == ["a", "b", "c"]

    # Then explain says how long each waited before it ran
    for result in (on_arrival, when_sent):

        def explained(task_id: str = result.id) -> dict[str, Any] | None:
            # The history reaches the store at the worker's next renewal tick.
            report: dict[str, Any] = json.loads(invoke(worker, "explain", task_id, "--json"))
            return report if report["deferrals"] and report["runs"] else None

        report = wait_for(explained, 30, f"the wait of {result.id} never reached the history")
        assert report["state"] == "finished (SUCCESS)"
        [run] = report["runs"]
        assert report["waited_seconds"] == pytest.approx(run["started_at"] - report["first_deferred_at"])
        assert opened_at - sent_at - 1.0 < report["waited_seconds"] < run["started_at"] - sent_at + 1.0
        text = invoke(worker, "explain", result.id)
        assert "for its caps before it ran" in text, text

    # and the timeline still counts both, no longer waiting
    output = invoke(worker, "timeline", "--since", "5m", "--out", picture, "--cap", gate)
    assert "2 task(s) waited for a slot, 0 waiting now" in output, output
