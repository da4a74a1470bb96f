"""Fair shares with real workers: ``Cap("fair", 2, fair_by=tenant)`` beside its first-come twin.

Two prefork workers of four processes on each store that parks.  One tenant floods the cap with
60 tasks, then three small tenants send 4 each.  Counted from the task bodies' own start times
(not from the library): under fair shares, few of the big tenant's tasks start between a small
tenant's send and the start of its last task (one a round, the tenants taking turns); through the
first-come twin, sent the same way on the same fleet, most of the big backlog starts first.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.conftest import FleetFactory, start_fleet_on
from tests.integration.fleet import Fleet
from tests.integration.fleetapp import FAIR_LIMIT

pytestmark = [pytest.mark.fleet, pytest.mark.redis]

TASK_MS = 100
BIG = 60
SMALL_TENANTS = 3
SMALL = 4


def big_tasks_started_before_the_small_ones_finished(fleet: Fleet, task: str) -> list[int]:
    """Send the flood, then the small tenants; per small tenant, how many big tasks started
    between its first send and its last task's start."""
    big = [fleet.app.send_task(task, args=["big", TASK_MS]).id for _ in range(BIG)]
    time.sleep(1.0)  # the flood is in: the cap is full, the rest of it waits
    small: dict[str, list[str]] = {f"small{n}": [] for n in range(SMALL_TENANTS)}
    sent_at = time.time()
    for _ in range(SMALL):
        for tenant, task_ids in small.items():
            task_ids.append(fleet.app.send_task(task, args=[tenant, TASK_MS]).id)
    every = big + [task_id for task_ids in small.values() for task_id in task_ids]
    fleet.wait_all_done(every, 120)
    record = fleet.record()
    assert {t: record.starts[t] for t in every if record.starts[t] != 1} == {}, "every task runs once"
    big_starts = [record.runs_of(task_id)[0].start for task_id in big]
    overtaken = []
    for task_ids in small.values():
        last_start = max(record.runs_of(task_id)[0].start for task_id in task_ids)
        overtaken.append(sum(1 for start in big_starts if sent_at < start < last_start))
    return overtaken


# Not SQLite: its fair rounds are the portable SQL's, which the MySQL row runs here with real
# contention, and test_fair's store table runs on SQLite (CI's time is bounded: 13 s a row).
@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
def test_small_tenants_take_turns_with_a_flood_instead_of_waiting_behind_it(
    make_fleet: FleetFactory, tmp_path: Path, store: str
) -> None:
    fleet = start_fleet_on(make_fleet, tmp_path, store, "park")
    fair = big_tasks_started_before_the_small_ones_finished(fleet, "fleet.fair_call")
    fifo = big_tasks_started_before_the_small_ones_finished(fleet, "fleet.fifo_call")
    print(f"\n[fair {store}] big tasks started before each small tenant's last: fair {fair}, first come {fifo}")
    # Fair: a turn a round for the big tenant (SMALL rounds), and the runs started or woken
    # when the small tenants arrived
    assert max(fair) <= SMALL + 2 * FAIR_LIMIT, f"fair shares: {fair} big tasks started first"
    # First come: the big backlog left when they were sent starts before them
    assert min(fifo) >= BIG // 2, f"first come, first served: only {fifo} big tasks started first"
