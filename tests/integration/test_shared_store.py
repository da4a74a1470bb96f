"""Fleet test of issue 38 item 3: two deployments, each on its own broker, sharing one store.

Staging and production run the same project (the same tasks and caps) on brokers of their
own, staging on Redis and production on RabbitMQ, and share one caps store, so one cap of
limit 1 is one slot for both.  Neither sets ``caps_deployment``: each is a deployment of its
own by its ``broker_url``.  Their queues have the same names (one project deployed twice) or
names of their own.  Real prefork workers, no mocks; the task bodies record which worker ran
them and when (``tests.integration.fleetapp.Recorder``, one Redis clock for both fleets).

A release that handed production's task to the next waiter through staging's broker would run
it in staging's fleet (same queue names), or leave its copy in a queue of staging's broker
that nobody consumes until its dispatch expired (queues of their own).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, Record, wait_for
from tests.integration.fleetapp import queue_name
from tests.services import new_prefix, require_service

pytestmark = [pytest.mark.fleet, pytest.mark.redis, pytest.mark.amqp]

#: (store, whether the two deployments' queues have the same names): each store with the same
#: names (one project deployed twice); queues of their own once, on SQLite.
LAYOUTS = [
    pytest.param("sqlite", True, marks=pytest.mark.sqlite, id="sqlite-same-queues"),
    pytest.param("sqlite", False, marks=pytest.mark.sqlite, id="sqlite-own-queues"),
    pytest.param("postgres", True, marks=pytest.mark.postgres, id="postgres-same-queues"),
    pytest.param("redis", True, id="redis-same-queues"),
]

#: Leases and dispatches last this long (``caps_lease_seconds``): a copy lost on the wrong
#: broker would be dispatched again only after it, well after a recovery call (every ~2 s).
LEASE_SECONDS = 10.0


def parked(fleet: Fleet, task_id: str) -> bool:
    return any(waiter.task_id == task_id and not waiter.dispatched for waiter in fleet.store.waiters())


def both_records(*fleets: Fleet) -> Record:
    """The runs of several fleets as one record (their bodies share the recorder's clock)."""
    runs = [run for fleet in fleets for run in fleet.record().runs]
    return Record({}, Counter(), Counter(), Counter(), Counter(), runs)


def log_lines(fleet: Fleet, needle: str) -> list[str]:
    return [line for line in fleet.tails(lines=100_000).splitlines() if needle in line]


@pytest.mark.parametrize(("store", "same_queues"), LAYOUTS)
def test_a_task_waiting_in_production_runs_in_production_when_staging_releases_the_slot(
    make_fleet: FleetFactory, tmp_path: Path, store: str, same_queues: bool
) -> None:
    redis_url, amqp_url = require_service("redis"), require_service("amqp")
    caps_url = f"sqlite:///{tmp_path}/caps.db" if store == "sqlite" else require_service(store)
    # Given staging (broker: Redis) and production (broker: RabbitMQ) sharing a store and their
    # caps' names, so the slot "one:<scope>" (limit 1) is one slot for both, and their queues'
    # names too (or not)
    shared = new_prefix()
    conf = json.dumps({"task_default_queue": queue_name(shared)}) if same_queues else None
    fleets = [
        make_fleet(broker=broker, caps_url=caps_url, strategy="park", lease=LEASE_SECONDS, cap_prefix=shared, conf=conf)
        for broker in (redis_url, amqp_url)
    ]
    staging, production = fleets
    queues = [queue_name(shared)] if same_queues else []
    [staging_worker], [production_worker] = (
        fleet.start(1, concurrency=2, queues=queues, wait=False) for fleet in fleets
    )
    for fleet in fleets:
        fleet.wait_ready(fleet.workers)
    scope = uuid.uuid4().hex[:16]

    # ... a staging task holding the slot for 3 s, and a production task parked behind it
    holder = staging.app.send_task("fleet.hold", args=[scope, 3.0]).id
    wait_for(lambda: staging.record().starts[holder] == 1, 20, "staging's holder never started")
    waiter = production.app.send_task("fleet.hold", args=[scope, 0.3]).id
    wait_for(lambda: parked(production, waiter), 20, "production's task never parked")
    assert staging.record().done[holder] == 0, "staging's holder ended before production's task parked"

    # When staging's task ends and releases the slot
    wait_for(lambda: staging.record().done[holder] == 1, 20, "staging's holder never ended")
    wait_for(
        lambda: production.record().done[waiter] or staging.record().starts[waiter],
        2 * LEASE_SECONDS,
        lambda: f"production's task ran nowhere: {production._missing([waiter])}",
    )
    time.sleep(1.0)  # room for a second, wrong delivery or run to show up

    # Then production's task ran once, in production's fleet, and never in staging's
    runs_in_staging = staging.record().runs_of(waiter)
    assert runs_in_staging == [], f"production's task ran in staging's fleet: {runs_in_staging}"
    record = production.record()
    [run] = record.runs_of(waiter)
    assert (run.hostname, run.completed, record.starts[waiter]) == (production_worker.name, True, 1), run
    assert run.dispatch, "production's task ran from no dispatch (it was not woken from the waiting list)"
    # ... staging's broker never carried it: staging's workers never received it, nor logged its id
    assert staging.record().received[waiter] == 0
    assert waiter not in staging.received_on(staging_worker)
    assert log_lines(staging, waiter) == [], log_lines(staging, waiter)
    assert log_lines(staging, "Received unregistered task") == []
    # ... production's own recovery (every ~2 s) handed it the slot soon after staging's
    # release: no copy of it waited for its dispatch to expire
    [held] = staging.record().runs_of(holder)
    assert held.end is not None
    assert 0 <= run.start - held.end < LEASE_SECONDS / 2, f"it started {run.start - held.end:.1f} s after the release"
    # ... and the cap held across both fleets: never two bodies at once
    assert both_records(staging, production).interval_peak(f"one:{scope}") == 1
    # ... nothing is left in the store, and the two fleets were told apart by their brokers alone
    wait_for(lambda: production.leases() == [], 10, lambda: f"leases left: {production.leases()}")
    assert [waiting for waiting in production.store.waiters() if waiting.slot.startswith(shared)] == []
    assert staging.store.deployment != production.store.deployment
