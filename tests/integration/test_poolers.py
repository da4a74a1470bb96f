"""Fleet tests through PgBouncer, in transaction and in session pooling, with the default URL.

What an operator checks before putting a pooler between the fleet and PostgreSQL: with
``caps_url`` pointing at the pooler and nothing else changed, no cap is ever exceeded
(measured, not reported by the library), no task is lost and none runs twice, under both
waiting strategies, and the sweep works.  Session pooling has PgBouncer's default pool of 20
server connections per database and user: the fleet (three workers of four processes) must
fit in it, or its first store calls would wait for a server connection that never frees.

Each test has a database of its own (a pooler forwards no ``options``, so no schema of its
own).  ``CAPS_TEST_POOLER_BASELINE=1`` adds the same runs on PostgreSQL directly, for the
durations to compare.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from celery_caps.stores.sql import SQLStore
from celery_caps.stores.sql.dialects import behind_pooler
from tests.integration.conftest import FleetFactory
from tests.integration.fleet import mixed_workload, send_workload, wait_for
from tests.services import private_pooled_url, require_service

pytestmark = [pytest.mark.fleet, pytest.mark.redis]

PROVIDER_LIMIT = 4
TENANT_LIMIT = 2
TASKS = 80
WORKERS = 3
CONCURRENCY = 4

_BASELINE = os.environ.get("CAPS_TEST_POOLER_BASELINE") == "1"
_BASELINE_SKIP = pytest.mark.skipif(not _BASELINE, reason="the direct baseline runs with CAPS_TEST_POOLER_BASELINE=1")


@pytest.fixture
def caps_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store URL through the pooler of ``request.param`` (or PostgreSQL directly: "postgres")
    to a database of this test's own; set up before the fleet, so torn down after it."""
    service: str = request.param
    with private_pooled_url(service, require_service(service)) as url:
        yield url


@pytest.mark.parametrize(
    ("caps_url", "strategy"),
    [
        pytest.param("pgbouncer-tx", "park", marks=pytest.mark.pgbouncer, id="transaction-park"),
        pytest.param("pgbouncer-tx", "backoff", marks=pytest.mark.pgbouncer, id="transaction-backoff"),
        pytest.param("pgbouncer-session", "park", marks=pytest.mark.pgbouncer, id="session-park"),
        pytest.param("pgbouncer-session", "backoff", marks=pytest.mark.pgbouncer, id="session-backoff"),
        pytest.param("postgres", "park", marks=[pytest.mark.postgres, _BASELINE_SKIP], id="direct-park"),
        pytest.param("postgres", "backoff", marks=[pytest.mark.postgres, _BASELINE_SKIP], id="direct-backoff"),
    ],
    indirect=["caps_url"],
)
def test_caps_hold_through_a_connection_pooler_with_the_default_url(
    caps_url: str, make_fleet: FleetFactory, strategy: str, request: pytest.FixtureRequest
) -> None:
    # (caps_url first: its database is dropped after the fleet is cleaned up)
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=caps_url,
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        strategy=strategy,
        backoff_min=0.05,
        backoff_max=1.0,
    )
    store = fleet.store
    assert isinstance(store, SQLStore)
    raw = store.engine.raw_connection()
    try:
        pooled = behind_pooler(raw.driver_connection)
    finally:
        raw.close()
    direct = request.node.callspec.id.startswith("direct")
    assert pooled is not direct, "the URL does not lead through the pooler it names"

    # Given three prefork workers whose caps_url is the pooler's, nothing else changed
    fleet.start(WORKERS, concurrency=CONCURRENCY)
    jobs = mixed_workload(TASKS, seed=20261204)
    started = time.monotonic()

    # When every task is published at once
    sent = send_workload(fleet, jobs)

    # Then every task completes, exactly once (none lost, none twice)
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
    deferred = sum(1 for run in record.runs if run.deferrals)
    assert deferred > 0
    print(
        f"\n[pooler {request.node.callspec.id}] {len(sent)} tasks on {WORKERS}x-c{CONCURRENCY}: peaks {peaks}; "
        f"runs deferred {deferred}; run {run_seconds:.1f} s"
    )

    # ... and the worker logs hold no store error (a prepared statement of another client, say)
    logs = fleet.tails(lines=2000)
    symptoms = (
        "DuplicatePreparedStatement",
        "InvalidSqlStatementName",
        "ProtocolViolation",
        "slot store cannot be used",
    )
    for symptom in symptoms:
        assert symptom not in logs, f"{symptom} in the worker logs"

    # ... nothing is left behind: no lease; after a sweep (through the pooler) only sentinels
    wait_for(lambda: fleet.leases() == [], 5, lambda: f"leases left: {fleet.leases()}")
    fleet.sweep_to_sentinels()
