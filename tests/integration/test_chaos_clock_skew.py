"""Chaos: workers whose clocks are an hour ahead and an hour behind, beside a normal one.

The skewed workers run under libfaketime (Debian's ``libfaketime`` package:
``LD_PRELOAD`` of ``libfaketime.so.1`` with ``FAKETIME="+1h"`` / ``"-1h"``).
Leases are computed by the store's clock (PostgreSQL ``now()``), so a skewed
worker must neither stretch nor shorten them, nor admit extra tasks.  The broker
is RabbitMQ: kombu's Redis transport scores unacknowledged messages by the
worker's clock, a Celery/kombu limit outside celery-caps.

Skipped locally when libfaketime is not installed; a failure under
``CAPS_REQUIRE_SERVICES=1`` (CI installs it: ``.ci/run``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import mixed_workload, send_workload, wait_for
from tests.integration.fleetapp import queue_name
from tests.services import REQUIRE_SERVICES_VARIABLE, require_service

pytestmark = [pytest.mark.chaos, pytest.mark.fleet, pytest.mark.postgres, pytest.mark.amqp, pytest.mark.redis]

PROVIDER_LIMIT = 4
TENANT_LIMIT = 2
TASKS = 150
LEASE_SECONDS = 3.0
HOLD_SECONDS = 8.0
SKEWS = {"normal": None, "ahead": "+1h", "behind": "-1h"}
SHIM_DIR = Path(__file__).resolve().parent / "faketime_shim"
LIBFAKETIME_PATHS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)


def libfaketime() -> str:
    """The libfaketime library's path; skips (or fails in CI) when it is not installed."""
    for path in LIBFAKETIME_PATHS:
        if Path(path).exists():
            return path
    reason = "libfaketime is not installed (apt-get install faketime libfaketime)"
    if os.environ.get(REQUIRE_SERVICES_VARIABLE) == "1":
        pytest.fail(f"{reason} ({REQUIRE_SERVICES_VARIABLE}=1)", pytrace=False)
    pytest.skip(reason)


def skewed_env(library: str, offset: str | None) -> dict[str, str]:
    if offset is None:
        return {}
    # Only wall-clock time moves, as on a real skewed machine; the shim works around what
    # libfaketime breaks in Python then (see faketime_shim/sitecustomize.py).
    return {
        "LD_PRELOAD": library,
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
        "PYTHONPATH": str(SHIM_DIR),
    }


def test_skewed_clocks_neither_stretch_nor_shorten_leases_nor_admit_extra(make_fleet: FleetFactory) -> None:
    library = libfaketime()
    # The library really moves a Python process's clock (else the test would prove nothing).
    probe = subprocess.run(
        [sys.executable, "-c", "import time; time.sleep(0.01); print(time.time())"],
        env={**os.environ, **skewed_env(library, "+1h")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert float(probe.stdout) - time.time() > 3500, probe.stdout

    fleet = make_fleet(
        broker=require_service("amqp"),
        caps_url=require_service("postgres"),
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        lease=LEASE_SECONDS,
        backoff_min=0.05,
        backoff_max=1.0,
    )

    # Given three workers on the default queue, each also on a queue of its own: one with the
    # true time, one an hour ahead, one an hour behind
    own_queue = {name: f"{queue_name(fleet.prefix)}-{name}" for name in SKEWS}
    workers = {
        name: fleet.start(
            1, concurrency=4, queues=[queue_name(fleet.prefix), own_queue[name]], extra_env=skewed_env(library, skew)
        )[0]
        for name, skew in SKEWS.items()
    }

    # When each runs a task longer than several leases, and all share a mixed workload
    scopes = {name: uuid.uuid4().hex[:16] for name in SKEWS}
    holds = {
        name: fleet.app.send_task("fleet.hold", args=[scopes[name], HOLD_SECONDS], queue=own_queue[name]).id
        for name in SKEWS
    }
    sent = send_workload(fleet, mixed_workload(TASKS, seed=4242, ms_range=(50, 300)))
    every_id = [*sent, *holds.values()]

    # Then the long tasks' leases, as the store sees them, stay live and never run further
    # ahead than one lease (renewed by the store's clock, whatever the worker's says)
    wait_for(lambda: all(fleet.record().starts[t] for t in holds.values()), 30, "the long tasks did not start")
    hold_slots = {fleet.slot(f"one:{scope}"): name for name, scope in scopes.items()}
    samples = 0
    worst = {name: (LEASE_SECONDS, 0.0) for name in SKEWS}  # (smallest, largest) expires_in
    deadline = time.monotonic() + HOLD_SECONDS + 60
    while not all(fleet.record().done[t] for t in holds.values()):
        assert time.monotonic() < deadline, "the long tasks did not finish"
        record = fleet.record()
        for lease in fleet.leases():
            name = hold_slots.get(lease.slot)
            if name is None or record.done[lease.task_id]:
                continue
            low, high = worst[name]
            worst[name] = (min(low, lease.expires_in), max(high, lease.expires_in))
            assert 0 < lease.expires_in <= LEASE_SECONDS + 0.5, (name, lease)
            samples += 1
        time.sleep(0.2)
    assert samples > 20

    # ... every task completes exactly once
    fleet.wait_all_done(every_id, 120, interval=0.5)
    record = fleet.record()
    assert {t: record.done[t] for t in every_id if record.done[t] != 1} == {}

    # ... the caps held, and each skewed worker really took part
    counters = sorted(counter for counter in record.counters() if not counter.startswith("one:"))
    limits = {counter: PROVIDER_LIMIT if counter == "provider" else TENANT_LIMIT for counter in counters}
    peaks = {counter: record.peaks[counter] for counter in counters}
    assert all(peaks[c] <= limits[c] and record.interval_peak(c) <= limits[c] for c in counters), peaks
    per_worker = {name: sum(1 for run in record.runs if run.hostname == workers[name].name) for name in SKEWS}
    assert all(count > 0 for count in per_worker.values()), per_worker
    for name, worker in workers.items():
        assert "lost its slot lease" not in worker.log(), name
    assert fleet.leases() == []
    print(
        f"\n[chaos clock skew] {len(every_id)} tasks on 3 workers (true time, +1 h, -1 h; runs {per_worker}); "
        f"lost 0, twice 0; peaks vs caps {', '.join(f'{c}={peaks[c]}/{limits[c]}' for c in counters)}; "
        f"long tasks' lease expires_in by the store over {samples} samples (min, max) "
        f"{ {name: (round(low, 2), round(high, 2)) for name, (low, high) in worst.items()} } "
        f"for a {LEASE_SECONDS:.0f} s lease"
    )
