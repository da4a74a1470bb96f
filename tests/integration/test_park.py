"""Fleet tests of the park strategy: three real prefork workers, caps full most of the time.

What a user checks: measured concurrency never passes a cap, every task runs
exactly once, each parked task costs exactly one more broker message (its wake),
and nothing is left behind: no lease, no waiter, only sentinels.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery.signals import before_task_publish

from celery_caps.parking import DISPATCH_HEADER, STANDBY_HEADER, WAKE_QUEUE_SUFFIX, publish_woken, sweep_waiters
from celery_caps.stores.base import DISPATCH_HOLDER, PARK_PARKED, SlotStore, store_from_url
from celery_caps.worker import runtime_for
from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, TcpProxy, delete_slot_rows, mixed_workload, send_workload, wait_for
from tests.integration.fleetapp import make_app, queue_name
from tests.services import require_service

pytestmark = pytest.mark.fleet

PROVIDER_LIMIT = 4
TENANT_LIMIT = 2
TASKS = 160
WORKERS = 3
CONCURRENCY = 4


#: ``caps_standby_seconds`` (the default): how long a standby copy waits for its slot.
STANDBY_SECONDS = 10.0


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres-redis"),
        pytest.param("mysql", marks=[pytest.mark.mysql, pytest.mark.redis], id="mysql-redis"),
        pytest.param("sqlite", marks=[pytest.mark.sqlite, pytest.mark.redis], id="sqlite-redis"),
        pytest.param("redis", marks=[pytest.mark.redis], id="redis-redis"),
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

    # ... a parked task came back once: woken through the broker (one publish) or, on a store
    # that signals, handed its slot on standby (its copy published ahead); none for the others
    deliveries = sum(record.received[task_id] for task_id in sent)
    publishes = sum(int(v) for v in fleet.recorder.client.hgetall(fleet.recorder.key("publishes")).values())
    parked = sum(1 for run in record.runs if run.deferrals)
    standby_copies = sum(record.standby_received[task_id] for task_id in sent)
    standby_runs = sum(1 for run in record.runs if run.standby)
    assert all(run.deferrals <= 1 for run in record.runs), "a task was parked twice"
    assert deliveries - len(sent) == publishes, "a delivery that no worker published (a redelivery)"
    assert (publishes - standby_copies) + standby_runs == parked > 0
    unused = standby_copies - standby_runs
    if run_seconds < STANDBY_SECONDS:
        # A copy is left unused only when its standby times out (or its process dies).
        assert unused == 0, f"{unused} standby copies were published for nothing"
    print(
        f"\n[park {store}] {len(sent)} tasks on {WORKERS}x-c{CONCURRENCY}: peaks {peaks}; parked {parked}, "
        f"{standby_runs} handed over on standby ({unused} standby copies unused); "
        f"broker messages per completed task {(len(sent) + publishes) / len(sent):.2f}; run {run_seconds:.1f} s"
    )

    # ... and nothing is left behind: no lease, no waiter; after a sweep only sentinels
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []
    fleet.sweep_to_sentinels()


def test_a_woken_task_overtakes_its_queue_backlog_and_keeps_its_queue(make_fleet: FleetFactory) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), strategy="park")
    scope = uuid.uuid4().hex[:16]
    fleet.start(1, concurrency=2)

    # Given a task holding a slot of limit 1 and another task parked behind it
    holder = fleet.app.send_task("fleet.hold", args=[scope, 1.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 15, "the holder never started")
    woken = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_for(lambda: any(w.task_id == woken for w in fleet.store.waiters()), 10, "the second task was never parked")
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


def test_tasks_sent_while_their_cap_is_full_wait_in_the_store_and_cost_one_message(make_fleet: FleetFactory) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, caps_url=require_service("postgres"), strategy="park")
    scope = uuid.uuid4().hex[:16]
    fleet.start(1, concurrency=2)
    hold = fleet.app.tasks["fleet.hold"]
    sent_here: list[str] = []
    standby_copies_here: list[str] = []

    def count_publish(headers: Any = None, **_: Any) -> None:
        (standby_copies_here if headers.get(STANDBY_HEADER) else sent_here).append(headers["id"])

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

        # ... each is published once: when a release wakes it, or (the first, parked behind a
        # running task) as a standby copy by the sender; and runs exactly once, in order
        wait_for(lambda: all(fleet.record().done[t] for t in waiting), 30, "the parked tasks did not all run")
    finally:
        before_task_publish.disconnect(count_publish)
    record = fleet.record()
    assert [record.starts[t] for t in waiting] == [1] * 5
    starts = [record.runs_of(t)[0].start for t in waiting]
    assert starts == sorted(starts), "woken out of the order they were sent in"
    publishes = sum(int(v) for v in fleet.recorder.client.hgetall(fleet.recorder.key("publishes")).values())
    assert standby_copies_here == waiting[:1], "the sender put the first waiter (only) on standby"
    assert publishes + len(standby_copies_here) == 5, f"{publishes} messages published by the workers"
    assert record.peaks[f"one:{scope}"] == 1
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


def test_a_burst_sent_with_room_takes_its_slots_when_sent_and_costs_one_message_per_task(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=require_service("postgres"),
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        strategy="park",
    )
    fleet.start(2, concurrency=CONCURRENCY)
    both = fleet.app.tasks["fleet.both"]
    sent_headers: dict[str, dict[str, Any]] = {}
    standby_copies_here: list[str] = []

    def count_publish(headers: Any = None, **_: Any) -> None:
        if headers.get(STANDBY_HEADER):
            standby_copies_here.append(headers["id"])  # the sender put a waiter on standby
        else:
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
        # message per task: the sent ones were claimed, not contested; the others published once,
        # woken or as a standby copy (by a worker, or by the sender for a waiter first in its list)
        fleet.wait_all_done(burst, 60)
    finally:
        before_task_publish.disconnect(count_publish)
    record = fleet.record()
    assert {t: (record.starts[t], record.done[t]) for t in burst if (record.starts[t], record.done[t]) != (1, 1)} == {}
    tenants = {f"tenant:{job.tenant}" for job in jobs}
    assert record.interval_peak("provider", distinct=True) == PROVIDER_LIMIT
    assert all(record.interval_peak(tenant, distinct=True) <= TENANT_LIMIT for tenant in tenants)
    publishes = sum(int(v) for v in fleet.recorder.client.hgetall(fleet.recorder.key("publishes")).values())
    assert set(standby_copies_here) <= waiting
    assert len(sent_headers) + len(standby_copies_here) + publishes == len(burst), (
        f"{len(sent_headers)} sent + {len(standby_copies_here)} standby copies sent + {publishes} woken"
    )
    assert sum(record.received[task_id] for task_id in burst) == len(burst)
    print(f"\n[park, admitted when sent] {len(sent_headers)} of {len(burst)} sent with their slots, {publishes} woken")
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


def test_a_task_sent_while_no_worker_runs_holds_its_slot_until_its_dispatch_expires(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(
        broker=require_service("redis"), caps_url=require_service("postgres"), strategy="park", dispatch_lease=1
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
    # ... only the expired dispatch is left (its task was admitted under a run of its own),
    # and the sweep deletes it
    wait_for(
        lambda: [(lease.run_id, lease.expires_in < 0) for lease in fleet.leases()] == [(leases[0].run_id, True)],
        5,
        lambda: f"leases left: {fleet.leases()}",
    )
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []
    assert fleet.sweep_to_sentinels() == 1


def test_a_task_that_took_its_slot_when_sent_and_expired_hands_it_to_the_next_waiter(
    make_fleet: FleetFactory,
) -> None:
    # Long leases and no sweep: the waiter runs soon only if the discarded task's slot is
    # handed on when the worker discards it.
    fleet = make_fleet(broker=require_service("redis"), caps_url=require_service("postgres"), strategy="park", lease=60)
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
    fleet = make_fleet(broker=require_service("redis"), caps_url=require_service("postgres"), strategy="park")
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
    assert woken.task_id == second and publish_woken(fleet.app, [woken]) == [woken]
    # When that dispatch expires (its copy is late) and the sweep dispatches the task again,
    # for a minute, with a second copy
    wait_for(lambda: all(lease.expires_in <= 0 for lease in fleet.leases(slot)), 10, "the dispatch never expired")
    [again] = fleet.store.wake(60.0, [slot])
    assert again.task_id == second and again.run_id != woken.run_id
    assert publish_woken(fleet.app, [again]) == [again]
    fleet.start(1, concurrency=1)

    # Then the second task runs once, by the second copy: the late first copy, finding the task
    # dispatched again, ends without running (before, it took the task off the list and ran it
    # as a task admitted on arrival, and the second copy ran it again)
    wait_for(lambda: fleet.record().done[second] and fleet.record().done[first], 30, "the tasks did not run")
    time.sleep(1.5)  # (each copy is handled within a second of the other)
    record = fleet.record()
    assert (record.starts[first], record.starts[second]) == (1, 1)
    assert "was dispatched again; this copy ends" in fleet.tails()
    wait_for(lambda: fleet.leases(slot) == [], 5, lambda: f"leases left: {fleet.leases(slot)}")
    assert fleet.store.waiters(slot) == []


def test_a_task_whose_publish_fails_gives_back_the_slots_it_took_when_sent(make_fleet: FleetFactory) -> None:
    fleet = make_fleet(broker=require_service("redis"), caps_url=require_service("postgres"), strategy="park")
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
    # (On standby, as the first waiter is: it waits on through the outage.  A standby run
    # leaves the list in the background, as it starts.)
    wait_done(fleet, waiter, 15, "the retried release did not wake the waiter")
    wait_for(lambda: store.leases(fleet.slot(f"one:{scope}")) == [], 10, "leases left")
    wait_for(lambda: not parked(store, waiter), 5, "the woken waiter is still in the waiting list")
    assert fleet.record().starts[waiter] == 1


@pytest.mark.postgres
@pytest.mark.redis
def test_a_task_whose_claim_meets_a_store_outage_claims_its_dispatch_when_it_comes_back(
    postgres_proxy: tuple[TcpProxy, str], make_fleet: FleetFactory, postgres_store: SlotStore
) -> None:
    proxy, caps_url = postgres_proxy
    fleet = make_fleet(
        broker=require_service("redis"), caps_url=caps_url, strategy="park", backoff_min=0.2, backoff_max=0.5
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
        lambda: "put back: slot store error" in fleet.tails(),
        30,
        "the first task never met the outage",
    )
    time.sleep(1.0)
    assert fleet.record().starts[first] == 0, "it ran while the store was away"

    # ... and the store comes back
    proxy.open()

    # Then its put-back copy claims the dispatch it was sent with (admitted afresh under a run
    # of its own, it would leave the dispatch lease holding the slot for 30 s, and the second
    # task waiting behind it); its release hands the slot to the second at once
    wait_for(
        lambda: fleet.record().done[second] >= 1,
        15,
        lambda: f"the second task did not run within 15 s of the store's return:\n{fleet.tails()}",
    )
    record = fleet.record()
    assert (record.starts[first], record.starts[second]) == (1, 1)
    wait_for(lambda: store.leases(fleet.slot(f"one:{scope}")) == [], 5, "leases left")
    assert not parked(store, second)
    # ... and the second's standby copy, which met the outage before its process had ever
    # reached the store, waited on through it instead of failing
    logs = "\n".join(worker.log() for worker in fleet.workers)
    assert "raised unexpected" not in logs and "Traceback" not in logs, logs[-4000:]


@pytest.mark.postgres
def test_a_handed_over_task_that_cannot_leave_the_waiting_list_leaves_it_once_the_store_is_back(
    postgres_proxy: tuple[TcpProxy, str], postgres_store: SlotStore
) -> None:
    from celery import Celery

    proxy, caps_url = postgres_proxy
    store = postgres_store  # straight to PostgreSQL: readable during the outage
    app = Celery("unlist", set_as_current=False)
    app.conf.update(caps_url=caps_url, caps_strategy="park")
    runtime = runtime_for(app)
    scope = uuid.uuid4().hex[:16]
    slot, task_id, again = f"caps-test-{scope}", f"caps-test-{scope}-t", f"caps-test-{scope}-again"
    waiting = {"payload": b"m", "first_deferred_at": time.time(), "max_waiters": 10}
    try:
        # Given a task a release handed over (dispatch run id in its entry), whose process
        # cannot take it off the waiting list: the store is away
        holder_run = uuid.uuid4().hex
        assert store.acquire({slot: 1}, f"{scope}-holder", holder_run, "h", 60).granted
        store.park({slot: 1}, task_id, uuid.uuid4().hex, "h", 60, **waiting)
        store.park({slot: 1}, again, uuid.uuid4().hex, "h", 60, **waiting)
        _, [handed_over, *_] = store.release_and_wake(holder_run, 60)
        assert handed_over.task_id == task_id
        assert runtime.store.waiters(slot)  # (connected through the proxy)
        proxy.close()
        runtime.unlist_handed_over(task_id, handed_over.run_id, "t")
        time.sleep(1.5)
        assert parked(store, task_id)

        # When the store comes back
        proxy.open()

        # Then its entry leaves the list within a second or two (not dispatched again once its
        # dispatch expires, which would run it twice), and nobody else's entry does
        wait_for(lambda: not parked(store, task_id), 5, "the handed-over task is still in the waiting list")
        assert [waiter.task_id for waiter in store.waiters(slot)] == [again]
        assert not runtime.has_failed_calls()

        # ... and a late retry never deletes an entry the task id got since (parked again, by a
        # retry of it, say, once its run ended)
        store.release(handed_over.run_id)
        assert store.acquire({slot: 1}, f"{scope}-holder-2", uuid.uuid4().hex, "h", 60).granted
        assert store.park({slot: 1}, task_id, uuid.uuid4().hex, "h", 60, **waiting) == PARK_PARKED
        runtime.unlist_handed_over(task_id, handed_over.run_id, "t")
        time.sleep(0.5)
        assert parked(store, task_id)
    finally:
        runtime.close()
        delete_slot_rows(store, slot)


# -- standby: a pool process that waits for the next hand-over ----------------------------


def waiting_standby(fleet: Fleet, task_ids: list[str]) -> tuple[str, int] | None:
    """One of ``task_ids`` whose standby copy waits in a pool process, and that process's pid."""
    for standby in fleet.store.standbys():
        if standby.task_id in task_ids and standby.holder and not standby.taken and standby.expires_in > 0:
            return standby.task_id, int(standby.holder.rsplit("/", 1)[1])
    return None


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres-redis"),
        pytest.param("redis", marks=[pytest.mark.redis], id="redis-redis"),
    ],
)
def test_a_standby_process_killed_while_it_waits_loses_no_task_and_the_cap_holds(
    make_fleet: FleetFactory, store: str
) -> None:
    fleet = make_fleet(
        broker=require_service("redis"), caps_url=require_service(store), strategy="park", dispatch_lease=2
    )
    fleet.start(1, concurrency=4)
    scope = uuid.uuid4().hex[:16]
    hold = fleet.app.tasks["fleet.hold"]

    # Given four 2 s tasks for one slot of limit 1, sent at once: the first runs, the others
    # wait in the store, and after the first hand-over the next waiter's copy waits on standby
    tasks = [hold.apply_async(args=[scope, 2.0]).id for _ in range(4)]
    found = wait_for(lambda: waiting_standby(fleet, tasks), 20, "no standby copy waited in a pool process")
    assert found is not None
    standby_task, pid = found

    # When that pool process is killed while it waits (SIGKILL: nothing of it runs any more)
    os.kill(pid, signal.SIGKILL)

    # Then every task still runs exactly once and the cap holds throughout, nothing is left.
    # (The worker notices the dead process late: a release may hand the slot to the dead
    # standby first, in its name.  Its leases are released when the loss is noticed, and the
    # killed copy, given back to the broker, claims like a dispatch, or is admitted as usual,
    # or the sweep dispatches the task again once its dispatch expires.)
    deadline = time.monotonic() + 60
    while not all(fleet.record().done[task_id] for task_id in tasks):
        assert time.monotonic() < deadline, f"not all ran: {dict(fleet.record().done)}"
        if fleet.leases() == [] or all(lease.expires_in < 0 for lease in fleet.leases()):
            run_sweep(fleet)
        time.sleep(0.5)
    record = fleet.record()
    assert [record.starts[task_id] for task_id in tasks] == [1, 1, 1, 1], standby_task
    runs = sorted((run.start, run.end, run.task_id[:6], run.standby) for run in record.runs)
    assert record.interval_peak(f"one:{scope}", distinct=True) == 1, runs
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


@pytest.mark.parametrize("send", ["apply_async", "send_task"])
@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres-redis"),
        pytest.param("redis", marks=[pytest.mark.redis], id="redis-redis"),
    ],
)
def test_a_task_that_waits_behind_one_already_running_is_handed_over_on_standby(
    make_fleet: FleetFactory, store: str, send: str
) -> None:
    fleet = make_fleet(broker=require_service("redis"), caps_url=require_service(store), strategy="park")
    fleet.start(1, concurrency=3)
    scope = uuid.uuid4().hex[:16]
    hold = fleet.app.tasks["fleet.hold"]

    # Given a task running alone in its slot (limit 1): its claim saw nobody waiting behind it,
    # so it put nobody on standby
    first = hold.apply_async(args=[scope, 2.5]).id
    wait_for(lambda: fleet.record().starts[first] == 1, 15, "the first task never started")

    # When the next task for that slot is sent while it runs: parked when sent (apply_async),
    # or parked by the worker it reaches (send_task by name is never parked when sent)
    if send == "apply_async":
        second = hold.apply_async(args=[scope, 0.1]).id
    else:
        second = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id

    # Then, first in its list, it is put on standby at once: a pool process waits for the slot
    # before the first task ends
    wait_for(lambda: waiting_standby(fleet, [second]) is not None, 10, "no standby copy waited in a pool process")
    assert fleet.record().done[first] == 0, "the first task ended before the standby was in place"
    # ... and the hand-over goes through it (no publish), each task once, the cap held
    fleet.wait_all_done([first, second], 20)
    record = fleet.record()
    assert [run.standby for run in record.runs if run.task_id == second] == [True]
    assert (record.starts[first], record.starts[second]) == (1, 1)
    assert record.interval_peak(f"one:{scope}", distinct=True) == 1
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


# -- a revoked waiter leaves the waiting list ---------------------------------------------


def run_sweep(fleet: Fleet) -> None:
    """Run the ``celery_caps.sweep`` task on the fleet's worker and wait until it succeeded."""
    sweep_id = fleet.app.send_task("celery_caps.sweep").id
    wait_for(lambda: f"celery_caps.sweep[{sweep_id}] succeeded" in fleet.workers[0].log(), 15, "the sweep did not run")


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("on_standby", [False, True], ids=["waiting", "on-standby"])
def test_a_revoked_waiter_leaves_the_waiting_list_and_its_slot_goes_to_the_next(
    private_postgres_url: str, make_fleet: FleetFactory, on_standby: bool
) -> None:
    # A schema of its own: the sweep below must see only this test's waiters.
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=redis_url, backend=redis_url, caps_url=private_postgres_url, strategy="park", lease=30,
        standby_per_slot=None if on_standby else 0,
    )  # fmt: skip
    store = fleet.store
    fleet.start(1, concurrency=3)
    scope = uuid.uuid4().hex[:16]

    # Given a task holding its slot (a cap of 1) for 3 s and two waiters parked behind it; the
    # first of them, first in the list, waits on standby in a pool process (unless standby is off)
    holder = fleet.app.send_task("fleet.hold", args=[scope, 3.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    first = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(store, first)
    if on_standby:
        wait_for(lambda: waiting_standby(fleet, [first]) is not None, 10, "the first waiter is not on standby")
    second = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(store, second)

    # When the first waiter is revoked (no terminate: it is not running)
    ended = f"fleet.hold[{first}] ignored"  # a copy of it ending: parked on arrival, or a standby's
    ended_before = fleet.workers[0].log().count(ended)
    revoked_at = time.monotonic()
    replies = fleet.app.control.revoke(first, reply=True, timeout=5, limit=1)
    assert replies, "no worker acknowledged the revoke"
    if on_standby:
        # ... its standby copy stops waiting at once (its pool process is free again), not when
        # its wait (caps_standby_seconds, 10 s) is over
        wait_for(lambda: fleet.workers[0].log().count(ended) > ended_before, 10, "the standby copy never ended")
        assert time.monotonic() - revoked_at < 5, "the revoked task's standby copy waited on"

    # Then it never runs, and the second waiter gets the slot when the holder ends: waiting, its
    # dispatch is discarded by the worker as a revoked message; on standby, the worker that
    # holds its copy takes it off the waiting list
    wait_done(fleet, second, 15, "the slot did not go on to the next waiter after the revoked one")
    discarded = f"Discarding revoked task: fleet.hold[{first}]"
    taken_off = f"revoked task fleet.hold[{first}] taken off the waiting list"
    assert fleet.record().starts[first] == 0
    log = fleet.workers[0].log()
    assert (log.count(discarded), log.count(taken_off)) == ((0, 1) if on_standby else (1, 0))
    assert fleet.app.AsyncResult(first).state == "REVOKED"
    assert not parked(store, first) and not parked(store, second)
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")

    # ... and the sweep does not dispatch it again
    run_sweep(fleet)
    time.sleep(0.5)
    assert fleet.workers[0].log().count(discarded) == (0 if on_standby else 1)
    assert not parked(store, first)
    assert fleet.record().starts[first] == 0


# -- a waiter past caps_max_wait_seconds is published at least once -----------------------------


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres-redis"),
        pytest.param("sqlite", marks=[pytest.mark.sqlite, pytest.mark.redis], id="sqlite-redis"),
    ],
)
def test_a_waiter_past_its_max_wait_is_not_lost_when_its_publish_fails(
    request: pytest.FixtureRequest, tmp_path: Path, store: str
) -> None:
    redis_url = require_service("redis")
    # The sweep sees every waiter of its store: a private SQLite file, or a PostgreSQL schema of
    # this test's own (before make_fleet, so that the fleet is torn down first).
    caps_url = (
        f"sqlite:///{tmp_path}/caps.db" if store == "sqlite" else str(request.getfixturevalue("private_postgres_url"))
    )
    make_fleet: FleetFactory = request.getfixturevalue("make_fleet")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=caps_url, strategy="park", lease=30, max_wait=1)
    fleet.start(1, concurrency=2)
    scope = uuid.uuid4().hex[:16]
    slot = fleet.slot(f"one:{scope}")

    # Given a slot held elsewhere, and a task parked for it longer than caps_max_wait_seconds (1 s)
    assert fleet.store.acquire({slot: 1}, f"{fleet.prefix}elsewhere", uuid.uuid4().hex, "elsewhere/1", 120).granted
    waiter = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(fleet.store, waiter)
    wait_for(lambda: time.time() - fleet.store.waiters(slot)[0].first_deferred_at > 1.1, 5, "max wait not reached")

    # ... and a sweep run where the broker cannot be reached (its port refuses connections)
    redis = urlsplit(redis_url)
    proxy = TcpProxy((redis.hostname or "127.0.0.1", redis.port or 6379))
    sweeper = make_app({**fleet.env, "CAPS_FLEET_BROKER": f"redis://127.0.0.1:{proxy.port}{redis.path}"}, current=False)
    runtime = runtime_for(sweeper)
    try:
        # When the sweep gives up on the waiter but cannot publish it
        assert sweep_waiters(runtime) == 0

        # Then the task stays in the waiting list, waiting at its place
        assert [(w.task_id, w.dispatched) for w in fleet.store.waiters(slot)] == [(waiter, False)]

        # When the broker is back, the next sweep publishes it and only then takes it off the list
        proxy.open()
        assert sweep_waiters(runtime) == 1
        assert fleet.store.waiters(slot) == []

        # ... and a worker receives it and gives up on it with the named error (its slot is still held)
        result = fleet.app.AsyncResult(waiter)
        result.get(timeout=20, propagate=False)
        assert result.state == "FAILURE" and type(result.result).__name__ == "CapWaitExceeded", result.result
        # (Received twice, and once more if its standby copy came: it was first in its list.)
        record = fleet.record()
        assert record.received[waiter] - record.standby_received[waiter] == 2
        assert record.starts[waiter] == 0
    finally:
        runtime.close()
        sweeper.close()
        proxy.close()


@pytest.mark.chaos
@pytest.mark.amqp
def test_releasers_killed_mid_dispatch_lose_nothing_and_the_caps_hold(
    private_postgres_url: str, make_fleet: FleetFactory
) -> None:
    fleet = make_fleet(
        broker=require_service("amqp"),
        caps_url=private_postgres_url,
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        strategy="park",
        lease=3,
    )
    deaths = 3
    # Given a park fleet whose first three releasers that dispatch waiters die right after the
    # store committed the dispatch, before publishing it (a pool process killed at that moment)
    fleet.start(WORKERS, concurrency=CONCURRENCY, extra_env={"CAPS_FLEET_DIE_BEFORE_WAKE": str(deaths)})
    # ... and a sweep every half second, as beat would run it
    sweeping = threading.Event()
    sweep = fleet.app.tasks["celery_caps.sweep"]

    def beat() -> None:
        while not sweeping.wait(0.5):
            sweep.apply()

    beat_thread = threading.Thread(target=beat, name="test-beat", daemon=True)
    beat_thread.start()
    try:
        # When a mixed workload runs
        sent = send_workload(fleet, mixed_workload(120, seed=4242))

        # Then every task completes
        fleet.wait_all_done(sent, 120)
    finally:
        sweeping.set()
        beat_thread.join(timeout=10)
    client = fleet.recorder.client
    stranded = [task_id.decode() for task_id in client.lrange(fleet.recorder.key("died-before-wake"), 0, -1)]
    releasing = {task_id.decode() for task_id in client.lrange(fleet.recorder.key("died-releasing"), 0, -1)}
    record = fleet.record()
    # ... the releasers did die, and the tasks they had dispatched ran once the sweep dispatched them again
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
    # ... and nothing is left: no waiter, no lease after the sweep
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
