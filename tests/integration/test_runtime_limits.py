"""Limits changed while the fleet runs: ``celery_caps.set_limit`` (what ``celery caps limit`` calls).

Real prefork workers on each store run a tenant's tasks at the code's limit of 4; an operator
cuts the cap to 1 while they run: the running tasks finish, and from then on no task starts
while another runs, as measured by the task bodies (not by the library).  On a store with a
waiting list, a raise to 3 hands the room to two waiting tasks while the task that held the
only place still runs; a reset returns the code's limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_caps import set_limit
from tests.integration.conftest import STORES_AND_STRATEGIES, FleetFactory, start_fleet_on
from tests.integration.fleet import Record, wait_for

pytestmark = [pytest.mark.fleet, pytest.mark.redis]

CODE_LIMIT = 4
TENANT = "acme"
COUNTER = f"tenant:{TENANT}"
#: Runs that start this long after the cut returned were admitted after it: a run admitted
#: before it starts its body within milliseconds, well inside this margin.
ADMITTED_BEFORE_MARGIN = 1.0


def _live_at_start(record: Record, moment: float) -> int:
    """Distinct task ids whose run of COUNTER is live at ``moment``."""
    return len({run.task_id for run in record.live_at(COUNTER, moment)})


@pytest.mark.parametrize(("store", "strategy"), STORES_AND_STRATEGIES)
def test_a_limit_set_while_the_fleet_runs_holds_at_once_on_every_worker(
    make_fleet: FleetFactory, tmp_path: Path, store: str, strategy: str
) -> None:
    fleet = start_fleet_on(make_fleet, tmp_path, store, strategy, tenant_limit=CODE_LIMIT)
    cap = fleet.slot("tenant")

    # Given: a tenant's tasks running at the code's limit of 4
    sent = [fleet.app.send_task("fleet.tenant_only", args=[TENANT, 300]).id for _ in range(20)]
    wait_for(lambda: fleet.record().interval_peak(COUNTER, distinct=True) >= CODE_LIMIT, 30, "4 never ran at once")

    # When: an operator cuts the cap to 1
    change = set_limit(fleet.app, cap, 1)
    cut_at = fleet.redis_time()
    assert (change.previous, change.limit) == (None, 1)
    fleet.wait_all_done(sent, 90)

    # Then: the running tasks finished, and every task admitted after the cut started alone
    record = fleet.record()
    after = [run for run in record.runs if COUNTER in run.counters and run.start > cut_at + ADMITTED_BEFORE_MARGIN]
    crowded = {run.task_id: _live_at_start(record, run.start) for run in after if _live_at_start(record, run.start) > 1}
    print(f"\n[runtime limit {store}/{strategy}] {len(after)} runs after the cut, crowded starts: {crowded}")
    assert len(after) >= 8, f"only {len(after)} runs started after the cut: the check saw too little"
    assert crowded == {}
    assert {task_id: record.done[task_id] for task_id in sent if record.done[task_id] != 1} == {}
    assert fleet.store.limits()[cap] == 1

    if strategy == "park":
        # When: one long task holds the only place and two wait; the operator raises the cap to 3
        first = fleet.app.send_task("fleet.tenant_only", args=[TENANT, 6000]).id
        wait_for(lambda: fleet.record().starts[first] == 1, 30, "the long task never started")
        waiting = [fleet.app.send_task("fleet.tenant_only", args=[TENANT, 500]).id for _ in range(2)]
        wait_for(lambda: len(fleet.store.waiters(fleet.slot(COUNTER))) == 2, 30, "the two tasks never parked")
        set_limit(fleet.app, cap, 3)
        fleet.wait_all_done([first, *waiting], 60)
        # Then: both ran while the long one still held its place
        record = fleet.record()
        [long_run] = record.runs_of(first)
        starts = [run.start for task_id in waiting for run in record.runs_of(task_id)]
        assert len(starts) == 2 and all(start < long_run.end for start in starts), (starts, long_run)

    # When: the operator resets it, the code's limit holds again
    set_limit(fleet.app, cap, None)
    assert cap not in fleet.store.limits()
    again = [fleet.app.send_task("fleet.tenant_only", args=[TENANT, 600]).id for _ in range(8)]
    fleet.wait_all_done(again, 60)
    record = fleet.record()
    reset_peak = max(_live_at_start(record, run.start) for task_id in again for run in record.runs_of(task_id))
    assert 1 < reset_peak <= CODE_LIMIT, reset_peak
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
