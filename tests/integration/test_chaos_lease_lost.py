"""Chaos: a running task loses its lease (an operator deletes it; an outage lets it expire).

The lease keeper finds out at its next renewal and logs it; the task can ask
itself with the fencing check ``self.caps_still_held()`` (one store call, by the
store's clock) before a side effect; ``caps_on_lease_lost`` chooses whether the
task continues (default) or is stopped with ``LeaseLost``.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, wait_for
from tests.services import require_service

pytestmark = [pytest.mark.chaos, pytest.mark.fleet, pytest.mark.postgres, pytest.mark.redis]

LEASE_SECONDS = 2.0


def _take_away_the_lease(fleet: Fleet, task_id: str, slot: str) -> float:
    """Wait until ``task_id`` runs, then delete its lease as an operator would; returns when (monotonic)."""
    wait_for(lambda: fleet.record().starts[task_id] >= 1, 20, "the task never started")
    (lease,) = wait_for(lambda: fleet.leases(slot), 5, "no lease")
    assert lease.task_id == task_id
    assert fleet.store.release(lease.run_id) == 1
    return time.monotonic()


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_lost_lease_is_seen_by_the_fencing_check_and_the_task_continues(make_fleet: FleetFactory, pool: str) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), lease=LEASE_SECONDS)
    (worker,) = fleet.start(1, concurrency=2, pool=pool)
    scope = uuid.uuid4().hex[:16]
    slot = fleet.slot(f"one:{scope}")

    # Given a task that checks caps_still_held() every 0.1 s for 4 s (caps_on_lease_lost=continue)
    task_id = fleet.app.send_task("fleet.fenced", args=[scope, 4.0]).id

    # When an operator deletes its lease while it runs
    taken_at = _take_away_the_lease(fleet, task_id, slot)

    # Then its next fencing check says no, the task carries on to the end, and the loss is logged
    lost_at = wait_for(
        lambda: fleet.recorder.client.hget(fleet.recorder.key("fence-lost"), task_id), 5, "the check never said no"
    )
    detected = time.monotonic() - taken_at
    result = fleet.app.AsyncResult(task_id)
    result.get(timeout=20, propagate=False)
    assert result.state == "SUCCESS", result.result
    assert result.result["held_at_end"] is False and result.result["checks"] > 10
    assert fleet.record().done[task_id] == 1
    wait_for(lambda: "lost its slot lease" in worker.log(), 5, "the loss was not logged")
    assert worker.log().count("lost its slot lease") == 1, "a loss is logged once per run"
    assert fleet.leases(slot) == []
    print(f"\n[lease lost {pool} continue] fencing check said no within {detected:.2f} s ({lost_at!r})")


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_lost_lease_stops_the_task_when_configured(make_fleet: FleetFactory, pool: str) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=redis_url,
        backend=redis_url,
        caps_url=require_service("postgres"),
        lease=LEASE_SECONDS,
        on_lease_lost="stop",
    )
    (worker,) = fleet.start(1, concurrency=2, pool=pool)
    scope = uuid.uuid4().hex[:16]
    slot = fleet.slot(f"one:{scope}")

    # Given a long task that never checks its lease itself (caps_on_lease_lost=stop)
    task_id = fleet.app.send_task("fleet.fenced", args=[scope, 30.0], kwargs={"check": False}).id

    # When an operator deletes its lease while it runs
    taken_at = _take_away_the_lease(fleet, task_id, slot)

    # Then the keeper finds out at its next renewal and stops the task with LeaseLost
    result = fleet.app.AsyncResult(task_id)
    result.get(timeout=20, propagate=False)
    stopped_after = time.monotonic() - taken_at
    assert result.state == "FAILURE" and type(result.result).__name__ == "LeaseLost", result.result
    assert stopped_after < 10, stopped_after
    assert fleet.record().done[task_id] == 0
    assert "lost its slot lease" in worker.log()

    # ... and the worker goes on admitting, running and releasing capped tasks
    after = fleet.app.send_task("fleet.fenced", args=[scope, 0.3]).id
    follow_up = fleet.app.AsyncResult(after)
    follow_up.get(timeout=20, propagate=False)
    assert follow_up.state == "SUCCESS" and follow_up.result["held_at_end"] is True, follow_up.result
    assert worker.alive()
    assert fleet.leases(slot) == []
    print(f"\n[lease lost {pool} stop] task stopped with LeaseLost {stopped_after:.2f} s after its lease was deleted")
