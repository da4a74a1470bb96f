"""Fleet tests of the park strategy: real prefork workers, caps full most of the time, no beat.

What a user checks: measured concurrency never passes a cap, every task runs
exactly once (more only after a copy of it was redelivered), each parked task costs
exactly one more broker message (its wake), nothing is left behind (no lease, no
waiter, only sentinels), and waiters move again by themselves after a fault.
``docs/park.md`` has the rules these tests hold the workers to.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery.signals import before_task_publish

from celery_caps.handover import publish_woken
from celery_caps.messages import DISPATCH_HEADER, WAKE_QUEUE_SUFFIX
from celery_caps.runtime import runtime_for
from celery_caps.stores import store_from_url
from celery_caps.stores.base import DISPATCH_HOLDER, SlotStore
from celery_caps.worker import RECOVERY_SECONDS
from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, TcpProxy, mixed_workload, send_workload, wait_for
from tests.integration.fleetapp import make_app, queue_name
from tests.services import require_service

pytestmark = pytest.mark.fleet

PROVIDER_LIMIT = 4
TENANT_LIMIT = 2
TASKS = 160
WORKERS = 3
CONCURRENCY = 4
#: The fleet setting of the tests of admission when sent (``caps_park_on_publish``, off by default).
PARK_ON_PUBLISH = json.dumps({"caps_park_on_publish": True})


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres-redis"),
        pytest.param("mysql", marks=[pytest.mark.mysql, pytest.mark.redis], id="mysql-redis"),
        pytest.param("sqlite", marks=[pytest.mark.sqlite, pytest.mark.redis], id="sqlite-redis"),
        pytest.param("redis", marks=[pytest.mark.redis], id="redis-redis"),
        pytest.param("redis_cluster", marks=[pytest.mark.redis_cluster, pytest.mark.redis], id="redis_cluster-redis"),
        pytest.param(
            "redis_sentinel", marks=[pytest.mark.redis_sentinel, pytest.mark.redis], id="redis_sentinel-redis"
        ),
    ],
)
def test_parked_tasks_are_woken_once_each_and_caps_hold(make_fleet: FleetFactory, tmp_path: Path, store: str) -> None:
    caps_url = f"sqlite:///{tmp_path}/caps.db" if store == "sqlite" else require_service(store)
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=caps_url,
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        strategy="park",
    )

    # Given three prefork workers with caps_strategy = "park" and a mixed, uneven workload
    fleet.start(WORKERS, concurrency=CONCURRENCY)
    jobs = mixed_workload(TASKS, seed=20240611)
    started = time.monotonic()

    # When every task is published at once
    sent = send_workload(fleet, jobs)

    # Then every task completes, exactly once
    fleet.wait_all_done(sent, 120)
    run_seconds = time.monotonic() - started
    record = fleet.record()
    assert {t: (record.starts[t], record.done[t]) for t in sent if (record.starts[t], record.done[t]) != (1, 1)} == {}

    # ... measured concurrency never passed a cap, and the caps really bound
    tenants = sorted({f"tenant:{job.tenant}" for job in jobs})
    limits = {"provider": PROVIDER_LIMIT, **{tenant: TENANT_LIMIT for tenant in tenants}}
    peaks = {counter: record.peaks.get(counter, 0) for counter in limits}
    interval_peaks = {counter: record.interval_peak(counter, distinct=True) for counter in limits}
    assert all(peaks[c] <= limits[c] for c in limits), f"a cap was exceeded: {peaks} vs {limits}"
    assert all(interval_peaks[c] <= limits[c] for c in limits), f"a cap was exceeded: {interval_peaks}"
    assert peaks["provider"] == PROVIDER_LIMIT

    # ... a parked task came back once, woken through the broker (one publish); none for the others
    deliveries = sum(record.received[task_id] for task_id in sent)
    publishes = sum(int(v) for v in fleet.recorder.client.hgetall(fleet.recorder.key("publishes")).values())
    parked = sum(1 for run in record.runs if run.deferrals)
    assert all(run.deferrals <= 1 for run in record.runs), "a task was parked twice"
    assert deliveries - len(sent) == publishes, "a delivery that no worker published (a redelivery)"
    assert publishes == parked > 0
    assert all(run.dispatch for run in record.runs if run.deferrals), "a parked task ran without its dispatch"
    print(
        f"\n[park {store}] {len(sent)} tasks on {WORKERS}x-c{CONCURRENCY}: peaks {peaks}; parked {parked}; "
        f"broker messages per completed task {(len(sent) + publishes) / len(sent):.2f}; run {run_seconds:.1f} s"
    )

    # ... and nothing is left behind: no lease, no waiter; after a sweep only sentinels
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []
    fleet.sweep_to_sentinels()


def _one_worker_with_a_holder_and_a_waiter(make_fleet: FleetFactory, **settings: Any) -> tuple[Fleet, str, str]:
    """One worker (-c 2, PostgreSQL store, park), a task holding a slot of limit 1 for a second,
    and another parked behind it: the fleet and the two task ids."""
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), strategy="park", **settings
    )
    scope = uuid.uuid4().hex[:16]
    fleet.start(1, concurrency=2)
    holder = fleet.app.send_task("fleet.hold", args=[scope, 1.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 15, "the holder never started")
    woken = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_for(lambda: any(w.task_id == woken for w in fleet.store.waiters()), 10, "the second task was never parked")
    return fleet, holder, woken


def test_a_woken_task_overtakes_its_queue_backlog_and_keeps_its_queue(make_fleet: FleetFactory) -> None:
    # Given a task holding a slot of limit 1 and another task parked behind it
    fleet, holder, woken = _one_worker_with_a_holder_and_a_waiter(make_fleet)
    # ... and a backlog of twelve tasks on other slots queued behind it (run one at a time
    # by the worker's other process)
    backlog = [fleet.app.send_task("fleet.hold", args=[uuid.uuid4().hex[:16], 0.3]).id for _ in range(12)]

    # When the holder ends and its release wakes the parked task
    wait_for(lambda: fleet.record().done[woken] == 1, 30, "the woken task never ran")
    wait_for(lambda: all(fleet.record().done[task_id] for task_id in backlog), 30, "the backlog never ran")

    # Then the woken task came through its queue's wake queue, ahead of the backlog still
    # queued when the holder released (queue order would put it behind all of it)
    record = fleet.record()
    released = record.runs_of(holder)[0].end or 0
    woken_start = record.runs_of(woken)[0].start
    backlog_starts = sorted(run.start for task_id in backlog for run in record.runs_of(task_id))
    queued_at_release = [start for start in backlog_starts if start > released]
    overtaken_by = [start for start in queued_at_release if start < woken_start]
    assert len(queued_at_release) >= 3, f"the backlog was nearly done when the holder released: {backlog_starts}"
    assert len(overtaken_by) <= 1, f"{len(overtaken_by)} of {len(queued_at_release)} queued tasks went first"
    queue = queue_name(fleet.prefix)
    delivery = fleet.app.AsyncResult(woken).get(timeout=10)["delivery_info"]
    assert delivery["routing_key"] == f"{queue}{WAKE_QUEUE_SUFFIX}", delivery
    wait_for(lambda: all(fleet.record().done[task_id] for task_id in backlog), 30, "the backlog never ran")
    assert fleet.leases() == []


def test_a_woken_task_overtakes_the_arrivals_in_its_workers_prefetch_buffer(make_fleet: FleetFactory) -> None:
    # Rule: a woken copy's slot is reserved for it from its dispatch on, so the worker starts it
    # before the arrivals that wait in its prefetch buffer for a free pool process.
    # Given a task holding a slot of limit 1, another parked behind it, and a long task on a
    # slot of its own in the worker's other process
    fleet, holder, woken = _one_worker_with_a_holder_and_a_waiter(make_fleet, prefetch=4)
    long_task = fleet.app.send_task("fleet.hold", args=[uuid.uuid4().hex[:16], 3.0]).id
    wait_for(lambda: fleet.record().starts[long_task] == 1, 15, "the long task never started")
    # ... and four short tasks on other slots, received at once into the worker's prefetch
    # buffer (2 processes x 4), where they wait for a free process
    backlog = [fleet.app.send_task("fleet.hold", args=[uuid.uuid4().hex[:16], 0.5]).id for _ in range(4)]
    wait_for(lambda: not fleet.redis_broker_queued(), 10, "the worker never took the short tasks")

    # When the holder ends and its release wakes the parked task
    wait_for(lambda: fleet.record().done[woken] == 1, 30, "the woken task never ran")
    wait_for(lambda: all(fleet.record().done[task_id] for task_id in backlog), 30, "the backlog never ran")

    # Then the woken task started before every short task that still waited in the buffer when
    # its copy came (buffer order would start it after all of them: at least two seconds later)
    record = fleet.record()
    woken_start = record.runs_of(woken)[0].start
    released = record.runs_of(holder)[0].end or 0
    backlog_starts = sorted(run.start for task_id in backlog for run in record.runs_of(task_id))
    waiting_then = [start for start in backlog_starts if start > released + 0.2]
    assert len(waiting_then) >= 2, f"the buffer was nearly done when the holder released: {backlog_starts}"
    assert woken_start < waiting_then[0], f"woken at {woken_start}, after {waiting_then}"
    assert fleet.leases() == []


def test_tasks_sent_while_their_cap_is_full_wait_in_the_store_and_cost_one_message(make_fleet: FleetFactory) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, caps_url=require_service("postgres"), strategy="park", conf=PARK_ON_PUBLISH)
    scope = uuid.uuid4().hex[:16]
    fleet.start(1, concurrency=2)
    hold = fleet.app.tasks["fleet.hold"]
    sent_here: list[str] = []

    def count_publish(headers: Any = None, **_: Any) -> None:
        sent_here.append(headers["id"])

    # Given a task holding a slot of limit 1
    holder = hold.apply_async(args=[scope, 1.5]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 15, "the holder never started")

    # When five more tasks for that slot are sent with apply_async
    before_task_publish.connect(count_publish, weak=False)
    try:
        waiting = [hold.apply_async(args=[scope, 0.1]).id for _ in range(5)]

        # Then none of them went to the broker: they wait in the store, in the order sent
        assert sent_here == []
        parked = [w.task_id for w in fleet.store.waiters(fleet.slot(f"one:{scope}")) if not w.dispatched]
        assert sorted(parked) == sorted(waiting) and len(parked) == 5

        # ... each is published once, when a release wakes it; and runs exactly once, in order
        wait_for(lambda: all(fleet.record().done[t] for t in waiting), 30, "the parked tasks did not all run")
    finally:
        before_task_publish.disconnect(count_publish)
    record = fleet.record()
    assert [record.starts[t] for t in waiting] == [1] * 5
    starts = [record.runs_of(t)[0].start for t in waiting]
    assert starts == sorted(starts), "woken out of the order they were sent in"
    publishes = sum(int(v) for v in fleet.recorder.client.hgetall(fleet.recorder.key("publishes")).values())
    assert publishes == 5, f"{publishes} messages published by the workers"
    assert record.peaks[f"one:{scope}"] == 1
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


def test_a_burst_sent_with_room_takes_its_slots_when_sent_and_costs_one_message_per_task(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(
        conf=PARK_ON_PUBLISH,
        broker=require_service("redis"),
        caps_url=require_service("postgres"),
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        strategy="park",
    )
    fleet.start(2, concurrency=CONCURRENCY)
    both = fleet.app.tasks["fleet.both"]
    sent_headers: dict[str, dict[str, Any]] = {}

    def count_publish(headers: Any = None, **_: Any) -> None:
        sent_headers[headers["id"]] = dict(headers)

    # Given an idle fleet and caps with room (provider 4, tenant 2)
    jobs = mixed_workload(40, seed=20261202)

    # When a burst of tasks for those caps is sent with apply_async
    before_task_publish.connect(count_publish, weak=False)
    try:
        burst = [both.apply_async(args=[job.tenant, 300]).id for job in jobs]

        # Then only the tasks that found room went to the broker, each holding its slots as a
        # dispatch (no more than the global cap), and the rest wait in the store
        assert 1 <= len(sent_headers) <= PROVIDER_LIMIT, f"{len(sent_headers)} of {len(burst)} sent to the broker"
        assert all(headers.get(DISPATCH_HEADER) for headers in sent_headers.values()), sent_headers
        waiting = {w.task_id for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)}
        assert waiting | set(sent_headers) == set(burst) and not waiting & set(sent_headers)

        # ... every task runs exactly once, the caps hold, and the whole burst cost one broker
        # message per task: the sent ones were claimed, not contested; the others published once, woken
        fleet.wait_all_done(burst, 60)
    finally:
        before_task_publish.disconnect(count_publish)
    record = fleet.record()
    assert {t: (record.starts[t], record.done[t]) for t in burst if (record.starts[t], record.done[t]) != (1, 1)} == {}
    tenants = {f"tenant:{job.tenant}" for job in jobs}
    assert record.interval_peak("provider", distinct=True) == PROVIDER_LIMIT
    assert all(record.interval_peak(tenant, distinct=True) <= TENANT_LIMIT for tenant in tenants)
    publishes = sum(int(v) for v in fleet.recorder.client.hgetall(fleet.recorder.key("publishes")).values())
    assert len(sent_headers) + publishes == len(burst), f"{len(sent_headers)} sent + {publishes} woken"
    assert sum(record.received[task_id] for task_id in burst) == len(burst)
    print(f"\n[park, admitted when sent] {len(sent_headers)} of {len(burst)} sent with their slots, {publishes} woken")
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


def test_a_task_sent_while_no_worker_runs_holds_its_slot_until_its_dispatch_expires(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(
        conf=PARK_ON_PUBLISH,
        broker=require_service("redis"),
        caps_url=require_service("postgres"),
        strategy="park",
        lease=1,
    )
    scope = uuid.uuid4().hex[:16]
    hold = fleet.app.tasks["fleet.hold"]

    # Given no worker running, three tasks for one slot of limit 1 sent with apply_async
    tasks = [hold.apply_async(args=[scope, 0.2]).id for _ in range(3)]

    # Then the first took the slot as it was sent (held by the dispatch holder, for the
    # dispatch lease) and the two others wait in the store behind it
    leases = fleet.leases(fleet.slot(f"one:{scope}"))
    assert [(lease.task_id, lease.holder) for lease in leases] == [(tasks[0], DISPATCH_HOLDER)]
    assert 0 < leases[0].expires_in <= 1
    assert sorted(w.task_id for w in fleet.store.waiters(fleet.slot(f"one:{scope}"))) == sorted(tasks[1:])

    # When its dispatch lease expires before any worker starts, and then a worker starts
    fleet.wait_for_expiry(10)
    fleet.start(1, concurrency=2)

    # Then the first task is admitted as usual on arrival, and its release wakes the others
    # in the order they were sent: each runs once, nothing is left behind
    wait_for(lambda: all(fleet.record().done[t] for t in tasks), 30, "the tasks did not all run")
    record = fleet.record()
    assert [record.starts[t] for t in tasks] == [1, 1, 1]
    starts = [record.runs_of(t)[0].start for t in tasks]
    assert starts == sorted(starts), "run out of the order they were sent in"
    assert record.peaks[f"one:{scope}"] == 1
    # ... and nothing is left: the expired dispatch went with the claim that found it expired
    # (its task was admitted under a run of its own)
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []
    assert fleet.sweep_to_sentinels() == 0


def test_a_task_that_took_its_slot_when_sent_and_expired_hands_it_to_the_next_waiter(
    make_fleet: FleetFactory,
) -> None:
    # Long leases and no sweep: the waiter runs soon only if the discarded task's slot is
    # handed on when the worker discards it.
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=require_service("postgres"),
        strategy="park",
        conf=PARK_ON_PUBLISH,
        lease=60,
    )
    scope = uuid.uuid4().hex[:16]
    hold = fleet.app.tasks["fleet.hold"]

    # Given no worker running, a task sent with a short expiry (it takes the slot of limit 1
    # as it is sent) and a second task parked behind it
    expiring = hold.apply_async(args=[scope, 0.1], expires=1.0).id
    waiter = hold.apply_async(args=[scope, 0.1]).id
    assert [lease.task_id for lease in fleet.leases(fleet.slot(f"one:{scope}"))] == [expiring]
    assert [w.task_id for w in fleet.store.waiters(fleet.slot(f"one:{scope}"))] == [waiter]

    # When a worker starts after the expiry and discards the expired message
    time.sleep(1.5)
    fleet.start(1, concurrency=2)

    # Then the expired task never runs, and its slot went to the waiter at once (its
    # dispatch lease would have held it for a minute)
    wait_for(lambda: fleet.record().done[waiter] == 1, 30, "the waiter never ran")
    record = fleet.record()
    assert record.starts[expiring] == 0
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


def test_a_woken_copy_that_comes_after_its_dispatch_expired_and_the_task_was_dispatched_again_does_not_run(
    make_fleet: FleetFactory,
) -> None:
    # One process, taking one message at a time: the copies arrive in the order they were sent.
    fleet = make_fleet(
        broker=require_service("redis"), caps_url=require_service("postgres"), strategy="park", conf=PARK_ON_PUBLISH
    )
    scope = uuid.uuid4().hex[:16]
    slot = fleet.slot(f"one:{scope}")
    hold = fleet.app.tasks["fleet.hold"]

    # Given no worker running, a task holding the slot of limit 1 (taken when sent) and a
    # second task parked behind it
    first = hold.apply_async(args=[scope, 0.2]).id
    second = hold.apply_async(args=[scope, 0.2]).id
    [taken] = fleet.leases(slot)
    assert taken.task_id == first

    # ... whose slot is handed to the second with a dispatch lease of 1 s, its woken copy sent
    _, [woken] = fleet.store.release_and_wake(taken.run_id, 1.0)
    assert woken.task_id == second and publish_woken(runtime_for(fleet.app), [woken]) == [woken]
    # When that dispatch expires (its copy is late) and recovery dispatches the task again,
    # for a minute, with a second copy
    wait_for(lambda: all(lease.expires_in <= 0 for lease in fleet.leases(slot)), 10, "the dispatch never expired")
    [again] = fleet.store.recover(60.0, caps=[slot])
    assert again.task_id == second and again.run_id != woken.run_id
    assert publish_woken(runtime_for(fleet.app), [again]) == [again]
    fleet.start(1, concurrency=1)

    # Then the second task runs once, by the second copy: the late first copy, finding the task
    # dispatched again (or, later, its tombstone), ends without running
    wait_for(lambda: fleet.record().done[second] and fleet.record().done[first], 30, "the tasks did not run")
    time.sleep(1.5)  # (each copy is handled within a second of the other)
    record = fleet.record()
    assert (record.starts[first], record.starts[second]) == (1, 1)
    assert f"fleet.hold[{second}]: the store answers for this task already" in fleet.tails()
    wait_for(lambda: fleet.leases(slot) == [], 5, lambda: f"leases left: {fleet.leases(slot)}")
    assert fleet.store.waiters(slot) == []


def test_a_task_whose_publish_fails_gives_back_the_slots_it_took_when_sent(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(
        broker=require_service("redis"), caps_url=require_service("postgres"), strategy="park", conf=PARK_ON_PUBLISH
    )
    scope = uuid.uuid4().hex[:16]
    # A client whose broker refuses connections (nothing listens on the discard port), without retries
    client = make_app({**fleet.env, "CAPS_FLEET_BROKER": "redis://127.0.0.1:9/0"}, current=False)
    client.conf.update(task_publish_retry=False, broker_connection_retry=False, broker_connection_max_retries=0)
    try:
        # When a task whose slot has room is sent and its publish fails
        with pytest.raises(Exception) as raised:
            client.tasks["fleet.hold"].apply_async(args=[scope, 0.1])
        # Then the caller sees the error, and the slot it took when sent is free again
        assert "refused" in str(raised.value).lower() or "connect" in str(raised.value).lower(), raised.value
        assert fleet.leases(fleet.slot(f"one:{scope}")) == []
    finally:
        client.close()

    # ... so the next task sent for it takes the slot and runs
    fleet.start(1, concurrency=1)
    task_id = fleet.app.tasks["fleet.hold"].apply_async(args=[scope, 0.1]).id
    wait_for(lambda: fleet.record().done[task_id] == 1, 30, "the next task never ran")
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")


# -- releases done for a dead or cut-short run wake the waiters too ------------------------


@pytest.fixture
def postgres_store() -> Iterator[SlotStore]:
    """A store on the test PostgreSQL, straight (not through any proxy), for inspection."""
    store = store_from_url(require_service("postgres"))
    try:
        yield store
    finally:
        store.close()


def parked(store: SlotStore, task_id: str) -> bool:
    return any(waiter.task_id == task_id for waiter in store.waiters())


def wait_parked(store: SlotStore, task_id: str) -> None:
    wait_for(lambda: parked(store, task_id), 20, f"task {task_id} never parked")


def wait_done(fleet: Fleet, task_id: str, timeout: float, why: str) -> None:
    wait_for(lambda: fleet.record().done[task_id] >= 1, timeout, why)


@pytest.mark.postgres
@pytest.mark.redis
def test_releases_by_the_workers_main_process_hand_the_slot_to_the_next_waiter(
    make_fleet: FleetFactory,
) -> None:
    # No sweep runs in this test (caps_sweep_interval_seconds is None in the fleet app) and
    # the leases are long: a waiter runs only if the release itself wakes it.
    fleet = make_fleet(broker=require_service("redis"), caps_url=require_service("postgres"), strategy="park", lease=30)
    store = fleet.store
    fleet.start(1, concurrency=3)
    timed_out, revoked = uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]

    # Given two tasks whose pool processes ignore SIGTERM (only a SIGKILL ends them), each holding
    # its slot (a cap of 1), one with a hard time limit of 4 s, and a waiter parked behind each
    killed_by_limit = fleet.app.send_task("fleet.hard_limited", args=[timed_out], time_limit=4).id
    killed_by_revoke = fleet.app.send_task("fleet.hard_limited", args=[revoked], time_limit=60).id
    for task_id in (killed_by_limit, killed_by_revoke):
        wait_for(lambda task_id=task_id: fleet.record().starts[task_id] == 1, 20, f"{task_id} never started")
    waiters = {scope: fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id for scope in (timed_out, revoked)}
    for task_id in waiters.values():
        wait_parked(store, task_id)

    # When the time limit kills the first pool process, and the second task is revoked with SIGKILL
    fleet.app.control.revoke(killed_by_revoke, terminate=True, signal="SIGKILL")

    # Then the worker's main process releases their slots and hands each to its waiter at once
    started = time.monotonic()
    for scope, task_id in waiters.items():
        wait_done(fleet, task_id, 15, f"the waiter of {scope} was not woken by the main process's release")
    woken_after = time.monotonic() - started
    record = fleet.record()
    assert all(record.starts[task_id] == 1 for task_id in waiters.values())
    assert record.done[killed_by_limit] == record.done[killed_by_revoke] == 0
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    assert not any(parked(store, task_id) for task_id in waiters.values())
    print(f"\n[park, main-process releases] both waiters ran {woken_after:.1f} s after the kills began")


@pytest.mark.postgres
@pytest.mark.redis
def test_a_release_retried_after_a_store_outage_wakes_the_waiter(
    postgres_proxy: tuple[TcpProxy, str], make_fleet: FleetFactory, postgres_store: SlotStore
) -> None:
    proxy, caps_url = postgres_proxy
    fleet = make_fleet(broker=require_service("redis"), caps_url=caps_url, strategy="park", lease=30)
    fleet.store  # noqa: B018 - built now, through the proxy: the fleet deletes its rows at the end
    store = postgres_store  # straight to PostgreSQL: readable during the outage
    fleet.start(1, concurrency=2)
    scope = uuid.uuid4().hex[:16]

    # Given a task holding its slot (a cap of 1) for 2 s and a waiter parked behind it
    holder = fleet.app.send_task("fleet.hold", args=[scope, 2.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    waiter = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(store, waiter)

    # When the store goes away before the holder ends, so that its release fails
    proxy.close()
    wait_done(fleet, holder, 15, "the holder did not finish")
    time.sleep(1.0)
    assert store.leases(fleet.slot(f"one:{scope}")), "the release succeeded despite the outage"

    # ... and comes back
    proxy.open()

    # Then the worker retries the release, which hands the slot to the waiter (no sweep runs)
    wait_done(fleet, waiter, 15, "the retried release did not wake the waiter")
    wait_for(lambda: store.leases(fleet.slot(f"one:{scope}")) == [], 10, "leases left")
    wait_for(lambda: not parked(store, waiter), 5, "the woken waiter is still in the waiting list")
    assert fleet.record().starts[waiter] == 1


@pytest.mark.postgres
@pytest.mark.redis
def test_a_task_whose_claim_meets_a_store_outage_claims_its_dispatch_once_the_store_is_back(
    postgres_proxy: tuple[TcpProxy, str], make_fleet: FleetFactory, postgres_store: SlotStore
) -> None:
    proxy, caps_url = postgres_proxy
    fleet = make_fleet(
        conf=PARK_ON_PUBLISH,
        broker=require_service("redis"),
        caps_url=caps_url,
        strategy="park",
        backoff_min=0.2,
        backoff_max=0.5,
    )
    store = postgres_store  # straight to PostgreSQL: readable during the outage
    scope = uuid.uuid4().hex[:16]
    hold = fleet.app.tasks["fleet.hold"]

    # Given no worker running, a task that took its slot (a cap of 1) as it was sent, for a
    # dispatch lease of 30 s, and a second one parked behind it
    first = hold.apply_async(args=[scope, 0.2]).id
    second = hold.apply_async(args=[scope, 0.2]).id
    [dispatch] = store.leases(fleet.slot(f"one:{scope}"))
    assert (dispatch.task_id, dispatch.holder) == (first, DISPATCH_HOLDER)
    wait_parked(store, second)

    # When a worker receives the first while the store is away, so that its claim fails
    proxy.close()
    fleet.start(1, concurrency=2)
    wait_for(
        lambda: f"fleet.hold[{first}]: claiming its dispatch failed" in fleet.tails(),
        30,
        "the first task never met the outage",
    )
    time.sleep(1.0)
    assert fleet.record().starts[first] == 0, "it ran while the store was away"

    # ... and the store comes back
    proxy.open()

    # Then its copy, waiting in its process, claims the dispatch it was sent with (put back
    # without it, it would leave the dispatch holding the slot for 30 s, and the second task
    # waiting behind it); its release hands the slot to the second at once
    wait_for(
        lambda: fleet.record().done[second] >= 1,
        15,
        lambda: f"the second task did not run within 15 s of the store's return:\n{fleet.tails()}",
    )
    record = fleet.record()
    assert (record.starts[first], record.starts[second]) == (1, 1)
    wait_for(lambda: store.leases(fleet.slot(f"one:{scope}")) == [], 5, "leases left")
    assert not parked(store, second)
    logs = "\n".join(worker.log() for worker in fleet.workers)
    assert "raised unexpected" not in logs and "Traceback" not in logs, logs[-4000:]


@pytest.mark.postgres
@pytest.mark.redis
def test_a_revoked_waiter_leaves_the_waiting_list_and_its_slot_goes_to_the_next(make_fleet: FleetFactory) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), strategy="park", lease=30
    )
    store = fleet.store
    fleet.start(1, concurrency=3)
    scope = uuid.uuid4().hex[:16]

    # Given a task holding its slot (a cap of 1) for 3 s and two waiters parked behind it
    holder = fleet.app.send_task("fleet.hold", args=[scope, 3.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    first = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(store, first)
    second = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(store, second)

    # When the first waiter is revoked (no terminate: it is not running)
    replies = fleet.app.control.revoke(first, reply=True, timeout=5, limit=1)
    assert replies, "no worker acknowledged the revoke"

    # Then it never runs: its dispatch is discarded by the worker as a revoked message, which
    # takes it off the list and hands its slot to the second waiter at once
    wait_done(fleet, second, 15, "the slot did not go on to the next waiter after the revoked one")
    assert fleet.record().starts[first] == 0
    assert f"Discarding revoked task: fleet.hold[{first}]" in fleet.workers[0].log()
    assert fleet.app.AsyncResult(first).state == "REVOKED"
    assert not parked(store, first) and not parked(store, second)
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")

    # ... and recovery never dispatches it again
    time.sleep(RECOVERY_SECONDS * 1.5)
    assert fleet.workers[0].log().count(f"Discarding revoked task: fleet.hold[{first}]") == 1
    assert fleet.record().starts[first] == 0


# -- a waiter past caps_max_wait_seconds gives up, at least once -----------------------------------


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres-redis"),
        pytest.param("sqlite", marks=[pytest.mark.sqlite, pytest.mark.redis], id="sqlite-redis"),
    ],
)
def test_a_waiter_past_its_max_wait_gives_up_with_the_named_error_even_when_a_publish_fails(
    make_fleet: FleetFactory, tmp_path: Path, store: str
) -> None:
    redis_url = require_service("redis")
    caps_url = f"sqlite:///{tmp_path}/caps.db" if store == "sqlite" else require_service(store)
    # A lease of 2 s, and so a dispatch of 2 s: a readmit whose copy is lost is readmitted again that soon.
    fleet = make_fleet(
        conf=PARK_ON_PUBLISH,
        broker=redis_url, backend=redis_url, caps_url=caps_url, strategy="park", lease=2, max_wait=1,
    )  # fmt: skip
    scope = uuid.uuid4().hex[:16]
    slot = fleet.slot(f"one:{scope}")

    # Given a slot held elsewhere, and a task parked for it (no worker runs yet)
    assert fleet.store.acquire({slot: 1}, f"{fleet.prefix}elsewhere", uuid.uuid4().hex, "elsewhere/1", 120).granted
    waiter = fleet.app.tasks["fleet.hold"].apply_async(args=[scope, 0.1]).id
    wait_parked(fleet.store, waiter)
    # ... past caps_max_wait_seconds (1 s), readmitted once by a recovery whose publish is lost
    wait_for(lambda: time.time() - fleet.store.waiters(slot)[0].first_deferred_at > 1.1, 5, "max wait not reached")
    [lost] = fleet.store.recover(2.0, caps=[slot], readmit_before=time.time() - 1)
    assert (lost.task_id, lost.readmit) == (waiter, True)
    assert [(w.task_id, w.dispatched) for w in fleet.store.waiters(slot)] == [(waiter, True)]

    # When a worker starts (its recovery runs every 2 s)
    fleet.start(1, concurrency=2)

    # Then the task is readmitted again once that dispatch expires, and its copy gives up with the
    # named error (its slot is still held), taking it off the list
    result = fleet.app.AsyncResult(waiter)
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE" and type(result.result).__name__ == "CapWaitExceeded", result.result
    assert fleet.record().starts[waiter] == 0
    assert fleet.store.waiters(slot) == []


@pytest.mark.chaos
@pytest.mark.amqp
def test_releasers_killed_mid_dispatch_lose_nothing_and_the_caps_hold(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(
        broker=require_service("amqp"),
        caps_url=require_service("postgres"),
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        strategy="park",
        lease=3,
    )
    deaths = 3
    # Given a park fleet whose first three releasers that dispatch waiters die right after the
    # store committed the dispatch, before publishing it (a pool process killed at that moment),
    # and no beat: the workers' own recovery dispatches again what was never published
    fleet.start(WORKERS, concurrency=CONCURRENCY, extra_env={"CAPS_FLEET_DIE_BEFORE_WAKE": str(deaths)})

    # When a mixed workload runs
    sent = send_workload(fleet, mixed_workload(120, seed=4242))

    # Then every task completes
    fleet.wait_all_done(sent, 120)
    client = fleet.recorder.client
    stranded = [task_id.decode() for task_id in client.lrange(fleet.recorder.key("died-before-wake"), 0, -1)]
    releasing = {task_id.decode() for task_id in client.lrange(fleet.recorder.key("died-releasing"), 0, -1)}
    record = fleet.record()
    # ... the releasers did die, and the tasks they had dispatched ran once recovery dispatched them again
    assert len(releasing) == deaths and stranded, (releasing, stranded)
    assert all(record.done[task_id] == 1 for task_id in stranded)
    # ... every other task exactly once; a dying releaser's own task, whose body had ended but whose
    # message was not yet acknowledged, is delivered again (at least once)
    twice = {t: record.done[t] for t in sent if record.done[t] != 1}
    assert set(twice) <= releasing and all(count == 2 for count in twice.values()), (twice, releasing)
    # ... and the caps held throughout: a releaser dies after its release, nothing over-admits
    tenants = sorted({counter for counter in record.peaks if counter.startswith("tenant:")})
    limits = {"provider": PROVIDER_LIMIT, **{tenant: TENANT_LIMIT for tenant in tenants}}
    interval_peaks = {counter: record.interval_peak(counter, distinct=True) for counter in limits}
    assert all(interval_peaks[c] <= limits[c] for c in limits), f"a cap was exceeded: {interval_peaks}"
    print(
        f"\n[park crash] {len(sent)} tasks, {deaths} releasers killed mid-dispatch stranding {len(stranded)} "
        f"dispatched task(s); peaks {interval_peaks}"
    )
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")


# -- the defaults under the faults a fleet meets: retries, kill -9, outages, prefetch, expiry ------
#
# Celery's defaults where the fleet app sets its own: prefetch multiplier 4, and no beat (the
# fleet app schedules no sweep): whatever keeps waiters moving runs in the workers.

BROKERS = [
    pytest.param("redis", marks=[pytest.mark.redis], id="redis-broker"),
    pytest.param("amqp", marks=[pytest.mark.amqp], id="rabbitmq-broker"),
]


def attempts_started_twice(record: Any, task_ids: Any) -> dict[tuple[str, int], int]:
    """``(task id, retries)`` attempts whose body started more than once, with how often."""
    starts: dict[tuple[str, int], int] = {}
    for run in record.runs:
        if run.task_id in task_ids:
            starts[(run.task_id, run.retries)] = starts.get((run.task_id, run.retries), 0) + 1
    return {attempt: count for attempt, count in starts.items() if count > 1}


@pytest.mark.postgres
@pytest.mark.parametrize("broker", BROKERS)
@pytest.mark.parametrize("task", ["fleet.retrying", "fleet.autoretrying"])
def test_tasks_that_retry_while_others_wait_all_finish_each_attempt_running_once(
    make_fleet: FleetFactory, broker: str, task: str
) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=require_service(broker), backend=redis_url, caps_url=require_service("postgres"), prefetch=4,
        strategy="park",
    )  # fmt: skip
    fleet.start(2, concurrency=3)
    scope = uuid.uuid4().hex[:16]

    # When twelve tasks under a cap of 2 each retry twice (self.retry, or autoretry_for with
    # retry_backoff), most of their retries parking behind the others
    sent = [fleet.app.send_task(task, args=[scope, 2, 150]).id for _ in range(12)]

    # Then every task succeeds, each of its three attempts having run exactly once (states read
    # from the backend, never through AsyncResult: on the Redis backend a fulfilled or
    # garbage-collected AsyncResult unsubscribes its result channel, and one collected during
    # another's unsubscribe re-entered it and hung redis-py 5.3 under Celery 5.4)
    def states() -> dict[str, str]:
        return {task_id: fleet.app.backend.get_task_meta(task_id, cache=False)["status"] for task_id in sent}

    wait_for(lambda: set(states().values()) <= {"SUCCESS", "FAILURE"}, 90, lambda: f"states: {states()}", 0.25)
    assert states() == dict.fromkeys(sent, "SUCCESS")
    record = fleet.record()
    assert attempts_started_twice(record, sent) == {}
    assert sorted({(run.task_id, run.retries) for run in record.runs}) == sorted(
        (task_id, retries) for task_id in sent for retries in range(3)
    )
    assert record.interval_peak(f"duo:{scope}", distinct=True) == 2
    # ... and nothing is left: no lease, no waiter
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


@pytest.mark.postgres
@pytest.mark.amqp
def test_a_worker_killed_while_it_runs_woken_tasks_loses_none_and_they_finish_within_a_lease(
    make_fleet: FleetFactory,
) -> None:
    lease = 5.0
    fleet = make_fleet(
        broker=require_service("amqp"), caps_url=require_service("postgres"), provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT, strategy="park", lease=lease, prefetch=4,
    )  # fmt: skip
    workers = fleet.start(WORKERS, concurrency=CONCURRENCY)
    victim = workers[0]
    both = "fleet.both"

    # Given 60 tasks of 1 s for a global cap of 4, most of them parked and then woken
    sent = {fleet.app.send_task(both, args=[tenant, 1000]).id: tenant for tenant in ["a", "b", "c", "d"] * 15}

    # When a worker is killed (kill -9, its pool with it) while it runs woken tasks
    def running_woken_on_victim() -> list[dict[str, Any]]:
        return [run for run in fleet.live_runs() if run["hostname"] == victim.name and run.get("dispatch")]

    wait_for(running_woken_on_victim, 60, "the victim never ran a woken task")
    kill = fleet.kill_main(victim)
    killed_at = time.monotonic()
    cut_short = {run.task_id for run in fleet.record().runs if run.pid in kill.pids and run.end == kill.moment}

    # Then every task finishes, the ones cut short within a lease (and a task) of the kill
    fleet.wait_all_done(list(sent), 120)
    record = fleet.record()
    for task_id in cut_short:
        finished = max(run.end or 0 for run in record.runs_of(task_id) if run.completed)
        assert finished - kill.moment < lease + 5 + 1, (
            f"{task_id} finished {finished - kill.moment:.1f} s after the kill"
        )
    # ... a body ran again only from a copy the killed worker held unacknowledged, delivered again:
    # one cut short, or one whose body had just ended, its late ack (acks_late) not sent yet
    # (at-least-once, after the fault).  A redelivered copy that found the cap full parked and
    # runs as a woken copy: the broker's mark is then on the delivery that parked
    # (record.redelivered), not on the run's.
    again = {task_id for task_id in sent if record.starts[task_id] > 1}
    for task_id in again:
        first, *later = sorted(record.runs_of(task_id), key=lambda run: run.start)
        from_redelivery = [
            run.redelivered or (run.dispatch is not None and record.redelivered[task_id] > 0) for run in later
        ]
        assert first.pid in kill.pids and all(from_redelivery), [
            (run.hostname, run.pid in kill.pids, round(run.start - kill.moment, 3),
             None if run.end is None else round(run.end - kill.moment, 3), run.completed, run.dispatch,
             run.redelivered)
            for run in (first, *later)
        ]  # fmt: skip
    # ... and the cap held: the killed runs' leases count until they expire, and a redelivered copy
    # runs as the same task id
    assert record.interval_peak("provider", distinct=True) <= PROVIDER_LIMIT
    print(
        f"\n[park kill -9] {len(cut_short)} woken or running tasks cut short, "
        f"all done {time.monotonic() - killed_at:.1f} s later"
    )


@pytest.mark.postgres
@pytest.mark.redis
def test_waiters_move_again_within_seconds_of_the_stores_return_without_beat(
    postgres_proxy: tuple[TcpProxy, str], make_fleet: FleetFactory
) -> None:
    proxy, caps_url = postgres_proxy
    fleet = make_fleet(
        broker=require_service("redis"), caps_url=caps_url, provider_limit=PROVIDER_LIMIT, tenant_limit=TENANT_LIMIT,
        strategy="park", prefetch=4, lease=30,
    )  # fmt: skip
    fleet.start(WORKERS, concurrency=CONCURRENCY)

    # Given 120 tasks of 0.2 s under a global cap of 4 (most wait in the store)
    sent = send_workload(fleet, [job for job in mixed_workload(120, seed=1912, ms_range=(200, 200))])
    wait_for(lambda: sum(1 for t in sent if fleet.record().done[t]) >= 12, 60, "the workload never got going")

    # When the store goes away for 10 s
    proxy.close()
    time.sleep(10)
    proxy.open()
    returned = fleet.redis_time()

    # Then work resumes within 5 s of its return, and every task completes
    def started_since_return() -> bool:
        return any(run.start > returned for run in fleet.record().runs)

    wait_for(started_since_return, 5, "no task started within 5 s of the store's return")
    fleet.wait_all_done(sent, 120)
    record = fleet.record()
    assert attempts_started_twice(record, sent) == {}
    tenants = sorted({f"tenant:{job.tenant}" for job in sent.values()})
    assert record.interval_peak("provider", distinct=True) <= PROVIDER_LIMIT
    assert all(record.interval_peak(tenant, distinct=True) <= TENANT_LIMIT for tenant in tenants)
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")


@pytest.mark.postgres
@pytest.mark.amqp
def test_the_waiter_behind_a_killed_run_runs_once_its_lease_expires_without_beat(make_fleet: FleetFactory) -> None:
    lease = 5.0
    fleet = make_fleet(
        broker=require_service("amqp"), caps_url=require_service("postgres"), strategy="park", lease=lease
    )
    workers = fleet.start(2, concurrency=2)
    scope = uuid.uuid4().hex[:16]

    # Given a task holding its slot (a cap of 1) on one worker (30 s on its first run, 0.2 s when
    # it runs again), and a task parked behind it
    holder = fleet.app.send_task("fleet.hold", args=[scope, 30.0, 0.2]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    received_by = fleet.last_received(holder)
    assert received_by is not None
    [victim] = [worker for worker in workers if worker.name == received_by[0]]
    [survivor] = [worker for worker in workers if worker is not victim]
    waiter = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(fleet.store, waiter)

    # When that worker is killed (kill -9): nothing releases the holder's lease
    kill = fleet.kill_main(victim)

    # Then the holder runs again (its message redelivered, admitted as the same task id) and the
    # waiter runs once the dead run's lease expires, woken by the survivor's recovery: within a
    # lease and a few seconds of the kill
    wait_done(fleet, waiter, lease + 10, "the waiter never ran after the kill")
    record = fleet.record()
    waited = record.runs_of(waiter)[0].start - kill.moment
    assert waited < lease + 5, f"the waiter started {waited:.1f} s after the kill"
    assert record.done[holder] == 1 and record.starts[waiter] == 1
    assert record.interval_peak(f"one:{scope}", distinct=True) == 1
    assert survivor.alive()


@pytest.mark.postgres
@pytest.mark.parametrize("broker", BROKERS)
def test_under_celerys_default_prefetch_no_task_runs_twice_even_longer_than_its_dispatch(
    make_fleet: FleetFactory, broker: str
) -> None:
    # Woken copies wait in prefetch buffers behind running tasks for longer than their dispatch
    # (a lease: 1 s here; 30 s by default against tasks longer than that): recovery dispatches
    # them again.
    fleet = make_fleet(
        broker=require_service(broker), caps_url=require_service("postgres"), tenant_limit=1, strategy="park",
        prefetch=4, lease=1,
    )  # fmt: skip
    fleet.start(3, concurrency=1)

    # When ten tasks of 1.5 s of one tenant (a cap of 1) are sent at once
    sent = [fleet.app.send_task("fleet.tenant_only", args=["a", 1500]).id for _ in range(10)]

    # Then each runs exactly once, never two bodies at a time (no fault: nothing was redelivered)
    fleet.wait_all_done(sent, 120)
    record = fleet.record()
    assert {t: record.starts[t] for t in sent if record.starts[t] != 1} == {}
    assert record.interval_peak("tenant:a") == 1  # bodies, not task ids: what the service behind counts
    dispatched_again = sum(
        1 for line in fleet.tails(lines=10_000).splitlines() if "the store answers for this task" in line
    )
    print(f"\n[park prefetch 4, {broker}] 10 tasks, once each; {dispatched_again} late copies ended")
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("sent_by", ["apply_async", "send_task"])
def test_a_task_whose_expiry_passes_while_it_waits_never_runs(make_fleet: FleetFactory, sent_by: str) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), strategy="park", conf=PARK_ON_PUBLISH
    )
    fleet.start(1, concurrency=3)
    scope = uuid.uuid4().hex[:16]
    hold = fleet.app.tasks["fleet.hold"]

    # Given a task holding its slot (a cap of 1) for 4 s
    holder = hold.apply_async(args=[scope, 4.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")

    # When tasks expiring in 2 s (relative, and absolute) wait behind it (parked when sent by
    # apply_async; parked by the worker when sent by send_task), and one that does not expire
    def send(**options: Any) -> str:
        if sent_by == "apply_async":
            return str(hold.apply_async(args=[scope, 0.1], **options).id)
        return str(fleet.app.send_task("fleet.hold", args=[scope, 0.1], **options).id)

    expiring = [send(expires=2), send(expires=datetime.now(timezone.utc) + timedelta(seconds=2))]
    lasting = send()

    # Then the expiring ones never run and end REVOKED, as Celery ends expired tasks, and the
    # slot goes on to the lasting one
    wait_done(fleet, lasting, 30, "the task behind the expired ones never ran")
    record = fleet.record()
    assert [record.starts[task_id] for task_id in expiring] == [0, 0]
    assert [fleet.app.AsyncResult(task_id).state for task_id in expiring] == ["REVOKED", "REVOKED"]
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("parked", ["when-sent", "on-arrival"])
@pytest.mark.parametrize("routed_by", ["task_default_queue", "task_routes"])
def test_a_woken_task_goes_to_the_wake_queue_of_the_queue_celerys_router_chooses(
    make_fleet: FleetFactory, routed_by: str, parked: str
) -> None:
    redis_url = require_service("redis")
    routed = f"{uuid.uuid4().hex[:8]}-routed"
    settings: dict[str, Any] = (
        {"routes": json.dumps({"fleet.hold": {"queue": routed}})} if routed_by == "task_routes" else {}
    )
    fleet = make_fleet(
        conf=PARK_ON_PUBLISH if parked == "when-sent" else None,
        broker=redis_url,
        backend=redis_url,
        caps_url=require_service("postgres"),
        strategy="park",
        **settings,
    )
    queue = routed if routed_by == "task_routes" else queue_name(fleet.prefix)
    fleet.start(1, concurrency=2, queues=[queue_name(fleet.prefix), routed])
    scope = uuid.uuid4().hex[:16]
    hold = fleet.app.tasks["fleet.hold"]

    # Given a task holding its slot (a cap of 1), a task parked behind it (when sent, or by the
    # worker it reached; apply_async without a queue= of its own), and a backlog of twelve tasks
    # on other slots in the same queue
    holder = hold.apply_async(args=[scope, 1.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 15, "the holder never started")
    woken = hold.apply_async(args=[scope, 0.1]).id
    wait_parked(fleet.store, woken)
    backlog = [hold.apply_async(args=[uuid.uuid4().hex[:16], 0.3]).id for _ in range(12)]

    # When the holder ends and its release wakes the parked task
    wait_for(lambda: fleet.record().done[woken] == 1, 30, "the woken task never ran")

    # Then the woken task came through the wake queue of its queue, ahead of the backlog
    delivery = fleet.app.AsyncResult(woken).get(timeout=10)["delivery_info"]
    assert delivery["routing_key"] == f"{queue}{WAKE_QUEUE_SUFFIX}", delivery
    wait_for(lambda: all(fleet.record().done[task_id] for task_id in backlog), 30, "the backlog never ran")
    record = fleet.record()
    released = record.runs_of(holder)[0].end or 0
    woken_start = record.runs_of(woken)[0].start
    queued_at_release = [run.start for t in backlog for run in record.runs_of(t) if run.start > released]
    assert len(queued_at_release) >= 3, "the backlog was nearly done when the holder released"
    assert sum(1 for start in queued_at_release if start < woken_start) <= 1
    print(f"\n[park {routed_by}] release to start {woken_start - released:.3f} s, with {len(queued_at_release)} queued")
