"""Chaos: the slot store (PostgreSQL) goes away for a while in the middle of a fleet run.

The workers reach PostgreSQL through a :class:`~tests.integration.fleet.TcpProxy`
that the test closes (connections refused, open ones cut) and reopens; the
machine's shared server is never touched.  What a user checks, measured by the
task bodies in Redis: no task starts while the store is away (admission puts
tasks back), measured concurrency never passes a cap, every task completes
exactly once, the workers stay up and resume by themselves within seconds of
the store's return, and running tasks whose renewals failed keep their slots.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import TcpProxy, mixed_workload, send_workload, wait_for
from tests.services import require_service

pytestmark = [pytest.mark.chaos, pytest.mark.fleet, pytest.mark.postgres, pytest.mark.redis]

PROVIDER_LIMIT = 4
TENANT_LIMIT = 2
TASKS = 300
WORKERS = 3
CONCURRENCY = 4
#: Longer than the outage's effect on a renewed lease: renewals every third of the lease (8 s),
#: and every second after a failed one, so a lease renewed just before the cut still has ~16 s
#: when the store returns after 12 s, and is renewed within a second of its return.
LEASE_SECONDS = 24.0
OUTAGE_SECONDS = 12.0
LONG_TASK_SECONDS = 26.0
#: A run admitted just before the cut may record its start a moment later.
START_GRACE_SECONDS = 1.0


def test_store_outage_runs_nothing_uncapped_loses_nothing_and_recovers(
    postgres_proxy: tuple[TcpProxy, str], make_fleet: FleetFactory
) -> None:
    proxy, caps_url = postgres_proxy
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=caps_url,
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        lease=LEASE_SECONDS,
        backoff_min=0.05,
        backoff_max=1.0,
    )

    # Given three prefork workers whose store is PostgreSQL behind the proxy, three long tasks
    # that will run across the whole outage, and a mixed workload of short ones
    workers = fleet.start(WORKERS, concurrency=CONCURRENCY)
    long_scopes = [uuid.uuid4().hex[:16] for _ in range(3)]
    long_ids = [fleet.app.send_task("fleet.hold", args=[scope, LONG_TASK_SECONDS]).id for scope in long_scopes]
    sent = send_workload(fleet, mixed_workload(TASKS, seed=1101, ms_range=(50, 400)))
    every_id = [*sent, *long_ids]

    def done() -> int:
        record = fleet.record()
        return sum(1 for task_id in every_id if record.done[task_id])

    wait_for(lambda: all(fleet.record().starts[t] for t in long_ids), 30, "the long tasks did not start")
    wait_for(lambda: done() >= TASKS // 4, 60, lambda: f"only {done()} tasks done before the outage")

    # When the store goes away for OUTAGE_SECONDS mid-run
    cut_at = fleet.redis_time()
    done_at_cut = done()
    proxy.close()
    time.sleep(OUTAGE_SECONDS)
    assert all(worker.alive() for worker in workers), fleet.tails()
    done_at_return = done()
    returned_at = fleet.redis_time()
    proxy.open()

    # Then the workers resume by themselves within seconds of the store's return
    def first_start_after_return() -> float | None:
        starts = [run.start for run in fleet.record().runs if run.start >= returned_at]
        return min(starts) if starts else None

    first = wait_for(first_start_after_return, 30, "no task started after the store came back")
    recovery = first - returned_at

    # ... every task completes, exactly once, and no worker died
    wait_for(lambda: done() == len(every_id), 180, lambda: f"{done()} of {len(every_id)} tasks done", interval=0.5)
    assert all(worker.alive() for worker in workers), fleet.tails()
    record = fleet.record()
    not_once = {t: (record.starts[t], record.done[t]) for t in every_id if (record.starts[t], record.done[t]) != (1, 1)}
    assert not_once == {}, "a task was lost or ran twice"

    # ... nothing was admitted while the store was away
    started_in_outage = [
        run for run in record.runs if cut_at + START_GRACE_SECONDS < run.start < returned_at and run.deferrals >= 0
    ]
    assert started_in_outage == [], f"runs started while the store was down: {started_in_outage}"

    # ... the caps held throughout (atomic Lua peaks and rebuilt intervals)
    counters = sorted(counter for counter in record.counters() if not counter.startswith("one:"))
    limits = {counter: PROVIDER_LIMIT if counter == "provider" else TENANT_LIMIT for counter in counters}
    peaks = {counter: record.peaks[counter] for counter in counters}
    interval_peaks = {counter: record.interval_peak(counter) for counter in counters}
    assert all(peaks[c] <= limits[c] and interval_peaks[c] <= limits[c] for c in counters), (peaks, interval_peaks)
    assert peaks["provider"] == PROVIDER_LIMIT, "the provider cap never bound: the test would prove nothing"

    # ... the long tasks' renewals failed during the outage, were logged, and their leases survived
    logs = "\n".join(worker.log() for worker in workers)
    renewal_failures = logs.count("lease renewal failed")
    assert renewal_failures >= 1, "no renewal ran into the outage"
    assert "lost its slot lease" not in logs, "a lease expired although the outage was shorter than it"
    assert "Traceback" not in logs, logs[-4000:]
    failed_releases = logs.count("could not release run")
    retried_releases = logs.count("after an earlier failure")

    # ... and once the work is done, only sentinels are left (failed releases were retried)
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    fleet.sweep_to_sentinels()
    deliveries = sum(record.received[t] for t in every_id)
    print(
        f"\n[chaos outage] {len(every_id)} tasks ({TASKS} short + 3 long of {LONG_TASK_SECONDS:.0f} s) on "
        f"{WORKERS}x-c{CONCURRENCY} prefork, PostgreSQL cut for {OUTAGE_SECONDS:.0f} s after {done_at_cut} done "
        f"({done_at_return - done_at_cut} finished during the outage, 0 started); first start "
        f"{recovery:.2f} s after the store's return; lost 0, twice 0; peaks vs caps "
        f"{', '.join(f'{c}={peaks[c]}/{limits[c]}' for c in counters)}; put-backs {deliveries - len(every_id)}; "
        f"renewal failures logged {renewal_failures}, releases failed {failed_releases} and retried "
        f"{retried_releases}"
    )
    assert recovery < 10, f"the fleet took {recovery:.1f} s to resume after the store came back"
