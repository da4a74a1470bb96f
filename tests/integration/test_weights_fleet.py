"""Weighted slots with real workers: ``Cap("gpu", 5, weight=gpu_units)``.

Two prefork workers of four processes on each store.  The units the running tasks take, summed
from the task bodies' own start and end times and the weights the test sent (not from the
library), never exceed the limit and reach it; a heavy task waiting is not overtaken by the light
tasks sent after it (park); a weight function's bad value fails its task with ``CapKeyError``
naming the function and the value, and takes no unit.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest

from celery_caps.errors import CapKeyError
from tests.integration.conftest import STORES_AND_STRATEGIES, FleetFactory, start_fleet_on
from tests.integration.fleet import Record, wait_for
from tests.integration.fleetapp import GPU_LIMIT

pytestmark = [pytest.mark.fleet, pytest.mark.redis]

TASK_MS = 300
HEAVY, LIGHT = 3, 1
#: Light tasks sent one every 50 ms while the heavy one waits.
STREAM = 24


def units_peak(record: Record, weights: Mapping[str, int]) -> int:
    """The most units the runs of ``weights``' task ids took at once, each task id once."""
    events: list[tuple[float, int, str]] = []
    for run in record.runs:
        if run.task_id in weights:
            events.append((run.start, 1, run.task_id))
            events.append((run.end if run.end is not None else float("inf"), -1, run.task_id))
    events.sort(key=lambda event: (event[0], event[1]))  # an end before a start at the same time
    live: Counter[str] = Counter()
    peak = 0
    for _, change, task_id in events:
        live[task_id] += change
        peak = max(peak, sum(weights[task] for task, runs in live.items() if runs > 0))
    return peak


@pytest.mark.parametrize(("store", "strategy"), STORES_AND_STRATEGIES)
def test_running_tasks_weights_stay_within_the_limit_and_a_heavy_task_is_not_overtaken(
    make_fleet: FleetFactory, tmp_path: Path, store: str, strategy: str
) -> None:
    fleet = start_fleet_on(make_fleet, tmp_path, store, strategy)

    # Given: the cap busy with light tasks, a heavy one (5 of 5 units), then light ones sent one
    # by one while it waits (each free unit is there for the taking), then a mix
    weights: dict[str, int] = {}

    def send(units: int) -> str:
        task_id = fleet.app.send_task("fleet.weighed", args=[units, TASK_MS]).id
        weights[task_id] = units
        return task_id

    for _ in range(8):
        send(LIGHT)
    time.sleep(0.3)  # the light ones took the cap: the heavy one arrives to a full cap
    heavy = send(GPU_LIMIT)  # it needs every unit free at once
    stream = []
    for _ in range(STREAM):
        stream.append(send(LIGHT))
        time.sleep(0.05)
    for units in [HEAVY, LIGHT, HEAVY] * 2:
        send(units)
    # ... and a call whose weight function gives 0
    broken = fleet.app.send_task("fleet.weighed", args=[0, TASK_MS]).id

    # Then: every task runs once
    fleet.wait_all_done(weights, 120)
    record = fleet.record()
    assert {
        t: (record.starts[t], record.done[t]) for t in weights if (record.starts[t], record.done[t]) != (1, 1)
    } == {}

    # ... the units running at once, measured from the bodies, reach the limit and never pass it
    peak = units_peak(record, weights)
    print(f"\n[weights {store}/{strategy}] peak {peak} units of {GPU_LIMIT}")
    assert GPU_LIMIT - 1 <= peak <= GPU_LIMIT, f"peak of {peak} units against a limit of {GPU_LIMIT}"

    # ... and, where tasks wait in the store's list, the heavy task holds the units it needs as
    # they free: most of the light tasks sent while it waited start after it (overtaken, it
    # would start only once they stopped coming)
    if strategy == "park":
        heavy_start = record.runs_of(heavy)[0].start
        before = [task_id for task_id in stream if record.runs_of(task_id)[0].start < heavy_start]
        print(f"[weights {store}/{strategy}] {len(before)} of {STREAM} light tasks sent after it started before it")
        assert len(before) <= STREAM // 2, (
            f"{len(before)} of the {STREAM} light tasks sent after the heavy one overtook it"
        )

    # ... the bad weight failed its task, naming the function and the value, and ran no body
    result = fleet.app.AsyncResult(broken)
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE" and isinstance(result.result, CapKeyError), (result.state, result.result)
    message = str(result.result)
    assert "gpu_units" in message and "must return a positive integer, got int 0" in message, message
    assert record.starts[broken] == 0
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
