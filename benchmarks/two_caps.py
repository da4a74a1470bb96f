"""Part 10: the hand-over of a task with two caps, a global one and a tenant's, as the backlog grows.

``cap=[Cap("provider", 6), Cap("tenant", 2, key=...)]`` is the common shape of a capped task, and
under overload every waiter of it is in two lists: the global slot's and its tenant's. A
release frees one of each, and the wake must find the next waiter that fits both without
reading the whole backlog (issue 34's soak: on PostgreSQL it read every waiter of several slots
at each release, and throughput fell as the backlog grew).

For each store (SQLite, PostgreSQL, MariaDB, Redis), one client, medians: 100, 1,000 and 10,000
waiters (quick: 100 and 1,000), each of the global slot (limit 6) and one of 20 tenants' slots
(limit 2), round robin; six runs hold the global slot. A cycle is the hand-over: the release of
one run (its waiter dispatched: the list's first that fits), the waiter's claim, and a new
waiter's park at the end of the list. Ratios are against the smallest backlog in the same run.
SQL stores get databases of their own (named after the run), dropped at the end.
"""

from __future__ import annotations

import time
import uuid

from celery_caps.stores.base import ParkingStore, ParkOutcome, ParkRequest

from .clients import StoreTarget, store_targets
from .common import Figure, Options, Report, at_most, median, ms, ratio

PART = "two-caps"
BACKLOGS = (100, 1_000, 10_000)
GLOBAL_LIMIT = 6
TENANT_LIMIT = 2
TENANTS = 20
#: Hand-over cycles run before each backlog's measured ones.
WARM_UP_CYCLES = 5
#: Parks of the fill per progress line.
FILL_REPORT_EVERY = 2_000


def run(report: Report, options: Options) -> None:
    backlogs = BACKLOGS[:2] if options.quick else BACKLOGS
    samples = 40 if options.quick else 150
    targets, skipped = store_targets(options.stores, options.run_prefix + "t", options.tmp_dir, growth=True)
    for note in skipped:
        report.note(f"two-caps benchmarks skip {note}")
    for target in targets:
        try:
            target.prepare()
            measure(report, options, target, backlogs, samples)
        except Exception as exc:  # the next store still runs
            report.note(f"two-caps benchmarks on {target.name} failed: {type(exc).__name__}: {str(exc)[:300]}")
            options.log(f"[two-caps] {target.name}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            target.cleanup()
            target.drop_databases()


def measure(report: Report, options: Options, target: StoreTarget, backlogs: tuple[int, ...], samples: int) -> None:
    store = target.open("waiters")
    assert isinstance(store, ParkingStore)
    prefix = f"{target.run_prefix}-2c"
    hand_over: dict[int, list[float]] = {}
    parked = 0

    def slots(tenant: int) -> dict[str, int]:
        return {f"{prefix}-g": GLOBAL_LIMIT, f"{prefix}-t:{tenant % TENANTS}": TENANT_LIMIT}

    def park(task_id: str, tenant: int) -> None:
        outcome = store.park(
            ParkRequest(
                slots(tenant), task_id, uuid.uuid4().hex, "bench", 60.0, time.time(), 10**9, "bench.waiter",
                b"payload",
            )
        )  # fmt: skip
        if outcome is not ParkOutcome.PARKED:
            raise RuntimeError(f"{task_id} did not park: {outcome}")

    try:
        # Six runs of six tenants hold the global slot: every park waits.
        holders = []
        for tenant in range(GLOBAL_LIMIT):
            run_id = uuid.uuid4().hex
            if not store.acquire(slots(tenant), f"{prefix}-h{tenant}", run_id, "bench", 3600.0).granted:
                raise RuntimeError("the holders were not admitted")
            holders.append(run_id)
        for backlog in backlogs:
            options.log(f"[two-caps] {target.name}: parking up to {backlog:,} waiters")
            while parked < backlog:
                park(f"{prefix}-w{parked:07d}", parked)
                parked += 1
                if parked % FILL_REPORT_EVERY == 0:
                    options.log(f"[two-caps] {target.name}: {parked:,} parked")
            target.vacuum_store("waiters")
            timings = []
            for i in range(-WARM_UP_CYCLES, samples):
                holder = holders.pop(0)
                start = time.perf_counter()
                _deleted, woken = store.release_and_wake(holder, 3600.0)
                if len(woken) != 1:
                    raise RuntimeError(f"a release woke {len(woken)} waiters, not one")
                store.claim(woken[0].task_id, woken[0].run_id, "bench", 3600.0)
                park(f"{prefix}-w{parked:07d}", parked)
                if i >= 0:
                    timings.append(ms(time.perf_counter() - start))
                parked += 1
                holders.append(woken[0].run_id)
            hand_over[backlog] = timings
            options.log(f"[two-caps] {target.name}: {backlog:,} waiting: hand-over cycle {median(timings):.3f} ms")
    finally:
        store.close()
    smallest, largest = backlogs[0], backlogs[-1]
    for backlog in backlogs:
        growth = ratio(median(hand_over[backlog]), median(hand_over[smallest]))
        last = backlog == largest and backlog != smallest
        report.add(
            Figure(
                PART,
                f"{target.name}: hand-over of two caps (release, dispatch, claim, park) p50, {backlog:,} waiting",
                median(hand_over[backlog]),
                "ms",
                versus=f"{smallest:,} waiting {median(hand_over[smallest]):.3f} ms",
                ratio=growth,
                target="ratio <= 1.3" if last else "",
                met=at_most(growth, 1.3) if last else None,
                repeats=hand_over[backlog],
            )
        )
