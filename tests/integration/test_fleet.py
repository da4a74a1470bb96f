"""Fleet tests: three real prefork workers share caps through one slot store.

What a user checks: measured (not reported-by-the-library) concurrency never
passes a cap, every task runs exactly once, and nothing is left in
``concurrency_slots`` but the sentinels.  The caps must also really bind (peaks
reach the limits, tasks were put back), or the test would pass vacuously.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import TENANT_WEIGHTS, mixed_workload, send_workload, wait_for
from tests.services import require_service

pytestmark = pytest.mark.fleet

PROVIDER_LIMIT = 4
TENANT_LIMIT = 2
TASKS = 160
WORKERS = 3
CONCURRENCY = 4


def _urls(store: str, broker: str, tmp_path: Path) -> tuple[str, str]:
    caps_url = f"sqlite:///{tmp_path}/caps.db" if store == "sqlite" else require_service(store)
    return caps_url, require_service(broker)


@pytest.mark.parametrize(
    ("store", "broker"),
    [
        pytest.param("postgres", "redis", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres-redis"),
        pytest.param("mysql", "amqp", marks=[pytest.mark.mysql, pytest.mark.amqp, pytest.mark.redis], id="mysql-amqp"),
        pytest.param("sqlite", "redis", marks=[pytest.mark.sqlite, pytest.mark.redis], id="sqlite-redis"),
        pytest.param("redis", "amqp", marks=[pytest.mark.redis, pytest.mark.amqp], id="redis-amqp"),
        pytest.param("redis", "redis", marks=[pytest.mark.redis], id="redis-redis"),
        # The topologies production runs: caps_url = "redis+cluster://..." / "sentinel://...".
        pytest.param(
            "redis_cluster", "redis", marks=[pytest.mark.redis_cluster, pytest.mark.redis], id="redis_cluster-redis"
        ),
        pytest.param(
            "redis_sentinel", "redis", marks=[pytest.mark.redis_sentinel, pytest.mark.redis], id="redis_sentinel-redis"
        ),
    ],
)
def test_caps_hold_across_a_fleet(make_fleet: FleetFactory, tmp_path: Path, store: str, broker: str) -> None:
    began = time.monotonic()
    caps_url, broker_url = _urls(store, broker, tmp_path)
    fleet = make_fleet(
        broker=broker_url,
        caps_url=caps_url,
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        backoff_min=0.05,
        backoff_max=1.0,
    )

    # Given three prefork workers and a mixed workload: tasks holding the global
    # provider cap and their tenant's cap, and tasks holding only the tenant cap
    # (so their slot sets do not start with the same slot name).
    fleet.start(WORKERS, concurrency=CONCURRENCY)
    jobs = mixed_workload(TASKS, seed=20240607)
    started = time.monotonic()

    # When every task is published at once
    sent = send_workload(fleet, jobs)

    # Then every task completes
    fleet.wait_all_done(sent, 75)
    run_seconds = time.monotonic() - started
    record = fleet.record()

    # ... exactly once (one body run and one completion per task id)
    assert {t: (record.starts[t], record.done[t]) for t in sent if (record.starts[t], record.done[t]) != (1, 1)} == {}

    # ... measured concurrency never passed a cap (atomic Lua peaks and rebuilt intervals agree)
    tenants = sorted({f"tenant:{job.tenant}" for job in jobs})
    peaks = {counter: record.peaks.get(counter, 0) for counter in ["provider", *tenants]}
    interval_peaks = {counter: record.interval_peak(counter) for counter in peaks}
    limits = {counter: PROVIDER_LIMIT if counter == "provider" else TENANT_LIMIT for counter in peaks}
    deliveries = sum(record.received[task_id] for task_id in sent)
    put_backs = deliveries - len(sent)
    header_deferrals = sum(run.deferrals for run in record.runs)
    print(
        f"\n[fleet {store}+{broker}] {len(sent)} tasks "
        f"({sum(j.task == 'fleet.both' for j in jobs)} provider+tenant, "
        f"{sum(j.task == 'fleet.tenant_only' for j in jobs)} tenant-only; tenants "
        f"{ {t: sum(j.tenant == t for j in jobs) for t in TENANT_WEIGHTS} }) on {WORKERS}x-c{CONCURRENCY}; "
        f"peaks vs caps {', '.join(f'{c}={peaks[c]}/{limits[c]}' for c in peaks)}; "
        f"interval peaks {interval_peaks}; put-backs {put_backs} (deliveries {deliveries}, "
        f"caps_deferrals headers {header_deferrals}); run {run_seconds:.1f} s"
    )
    assert all(peaks[c] <= limits[c] for c in peaks), f"a cap was exceeded: {peaks} vs {limits}"
    assert all(interval_peaks[c] <= limits[c] for c in peaks), f"a cap was exceeded: {interval_peaks}"

    # ... and the caps really bound: peaks reached the limits and tasks were put back
    assert peaks["provider"] == PROVIDER_LIMIT
    assert peaks["tenant:a"] == TENANT_LIMIT
    assert put_backs > 0
    assert header_deferrals == put_backs, "every put-back must be one more delivery of the same task id"

    # ... every lease was released when its task ended, and after a sweep only sentinels remain
    wait_for(lambda: fleet.leases() == [], 3, lambda: f"leases left: {fleet.leases()}")
    fleet.store.sweep()
    assert fleet.leases() == []
    own = {status.slot: status for status in fleet.store.status() if status.slot.startswith(fleet.prefix)}
    assert set(own) == {fleet.slot(counter) for counter in peaks}
    assert all(status.holders == 0 and status.expired == 0 for status in own.values()), own
    print(f"[fleet {store}+{broker}] sentinels left: {len(own)}; wall time {time.monotonic() - began:.1f} s")
