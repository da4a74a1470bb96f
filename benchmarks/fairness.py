"""Part 8: how long a small tenant waits behind a big one under a shared cap (issue 35, item 4).

One tenant sends 1,000 tasks of 50 ms (400 on MariaDB, see :data:`TASK_MS_BY_STORE`; quick:
200); once the workers have taken them all from the queue (parked, or running), nine tenants
send 10 each (quick: 5),
all through one global cap of 8 (``bench.global``: the cap is shared, the tenant is the task's
first argument), on a fleet as the utilisation part's (two workers ``-c 8``, prefetch 1, park).
Reported per store: for each small tenant, the wait of its last task from its send to its
start, in task lengths (the median and the worst over the nine tenants), next to the least
wait a first-come, first-served order gives it (at most the big tenant's backlog ahead of it,
divided by the cap: 1,000 / 8 = 125 task lengths, less what ran while the flood was taken), the
least fair shares give it (a turn a round: the ten tenants' 100 tasks up to its last, / 8 = 12.5
task lengths), and the slot utilisation over the whole run.

Sent all at once, the small tenants' tasks would wait in the broker's queue behind the flood
until the workers take it (their park rate, about 120 tasks a second on this 2-core machine):
fair shares order the store's waiting list, not the broker's queue (``caps_park_on_publish``
parks a task as it is sent, so there it waits in the list at once).

Each trial runs the same sends twice, interleaved (ABBA over the trials): through the cap
``bench.global`` (first come, first served across every key) and through its twin
``bench.global_fair`` (``Cap(fair_by=tenant)``: waiting tasks served in turn across tenants).
The fair figure's ratio is against the first-come one measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .clients import caps_url_for, drop_slots, vacuum_database
from .common import CpuSteal, Figure, Options, Report, median, reachable, service_url
from .workers import BenchFleet, fleet_env, wait_for

PART = "fairness"
GLOBAL_LIMIT = 8
TASK_MS = 50
#: Longer tasks where the fleet takes tasks from the queue slowly: MariaDB's parks about 50 tasks
#: a second, a 50 ms task's cap of 8 runs 160, so the flood ran while it was taken and too little
#: of it was left waiting to show an order (2026-12-07: 29 task lengths first come, first served).
#: At 400 ms the cap runs 20 a second, and most of the flood waits when the small tenants send.
TASK_MS_BY_STORE = {"mariadb": 400}
WORKERS = 2
CONCURRENCY = 8
PREFETCH = 1
STORES = ("postgresql", "mariadb", "redis")
SMALL_TENANTS = 9
#: The task through each cap -> how the report names its order.
TASKS = {"bench.global": "first come, first served", "bench.global_fair": "fair shares"}


def run(report: Report, options: Options) -> None:
    broker = service_url("redis")
    if reachable(broker):
        report.note(f"fairness skipped: {reachable(broker)}")
        return
    big, small = (200, 5) if options.quick else (1000, 10)
    repeats = 1 if options.quick else 2
    for store in [name for name in options.stores if name in STORES]:
        caps_url, why = caps_url_for(store, options)
        if caps_url is None:
            report.note(f"fairness skips {store}: {why}")
            continue
        prefix = f"{options.run_prefix}f{store[:2]}-"
        env = fleet_env(
            broker, caps_url, prefix, GLOBAL_LIMIT=GLOBAL_LIMIT, PREFETCH=PREFETCH, EXTRA_CONF="caps_strategy=park"
        )
        vacuum_database(caps_url)
        fleet = BenchFleet(env, Path(options.tmp_dir) / "logs")
        try:
            options.log(f"[fairness] {store}: starting {WORKERS} workers x -c {CONCURRENCY}")
            fleet.start(WORKERS, CONCURRENCY)
            trials: dict[str, list[dict[str, Any]]] = {task: [] for task in TASKS}
            task_ms = TASK_MS_BY_STORE.get(store, TASK_MS)
            for repeat in range(repeats):
                for task in list(TASKS) if repeat % 2 == 0 else list(TASKS)[::-1]:
                    trial = run_trial(fleet, task, big, small, task_ms)
                    trials[task].append(trial)
                    options.log(
                        f"[fairness] {store} {TASKS[task]}: repeat {repeat + 1}/{repeats}: small tenants' last "
                        f"task waited {trial['small_last_wait_lengths']:.0f} task lengths (median; worst "
                        f"{trial['small_last_wait_lengths_max']:.0f}), utilisation {trial['utilisation']:.3f}, "
                        f"CPU steal {trial['cpu_steal']:.1%}"
                    )
            report_store(report, store, trials, big, small, task_ms)
        except Exception as exc:  # the next store still runs
            report.note(f"fairness on {store} failed: {type(exc).__name__}: {str(exc)[:300]}")
            options.log(f"[fairness] {store}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            fleet.close()
            drop_slots(caps_url, prefix)


def run_trial(fleet: BenchFleet, task: str, big: int, small: int, task_ms: int) -> dict[str, Any]:
    fleet.reset_records()
    queue = fleet.new_queue()
    fleet.consume(queue)
    time.sleep(1.2)  # every worker listening to the new queue (kombu's BRPOP timeout)
    steal = CpuSteal()
    flood = [("big", task_ms)] * big
    calls = [(f"small{number}", task_ms) for number in range(1, SMALL_TENANTS + 1) for _ in range(small)]
    fleet.fill(queue, task, flood)
    # The flood has arrived: every task of it taken from the queue (parked, or running), so the
    # small tenants' tasks, sent now, are not behind it in the broker but in the waiting list.
    wait_for(lambda: fleet.waiting(queue)[0] == 0, 120, "the flood taken from the queue")
    fleet.fill(queue, task, calls)
    sent = big + len(calls)
    ideal_seconds = sent * task_ms / 1000 / GLOBAL_LIMIT
    wait_for(lambda: fleet.redis.llen(fleet.keys["runs"]) >= sent, ideal_seconds * 10 + 30, "backlog")
    fleet.stop_consuming(queue)
    result = analyse(fleet.runs(), sent, task_ms)
    result["cpu_steal"] = steal.fraction()
    return result


def analyse(runs: list[dict[str, Any]], sent: int, task_ms: int) -> dict[str, Any]:
    """Each small tenant's last task: its wait from send to start, in task lengths."""
    task_seconds = task_ms / 1000
    last_waits = []
    for tenant in {run["tenant"] for run in runs} - {"big"}:
        last = max((run for run in runs if run["tenant"] == tenant), key=lambda run: run["published"])
        last_waits.append((last["start"] - last["published"]) / task_seconds)
    first_start = min(run["start"] for run in runs)
    makespan = max(run["end"] for run in runs) - first_start
    return {
        "runs": len(runs),
        "sent": sent,
        "small_last_wait_lengths": statistics.median(last_waits),
        "small_last_wait_lengths_max": max(last_waits),
        "utilisation": sent * task_seconds / GLOBAL_LIMIT / makespan,
    }


def report_store(
    report: Report, store: str, trials: dict[str, list[dict[str, Any]]], big: int, small: int, task_ms: int
) -> None:
    # First come, first served: the big backlog, and the small tenants sent before, ahead of it.
    least_fifo = big / GLOBAL_LIMIT  # at most: part of the flood ran while it was taken
    least_fair = (SMALL_TENANTS + 1) * small / GLOBAL_LIMIT
    fifo_waits = [trial["small_last_wait_lengths"] for trial in trials["bench.global"]]
    for task, order in TASKS.items():
        waits = [trial["small_last_wait_lengths"] for trial in trials[task]]
        worst = median([trial["small_last_wait_lengths_max"] for trial in trials[task]])
        steal = median([trial["cpu_steal"] for trial in trials[task]])
        fair = task == "bench.global_fair"
        report.add(
            Figure(
                PART,
                f"{store}, {order}: a small tenant's last task, send to start ({big} tasks of {task_ms} ms of one "
                f"tenant, then {SMALL_TENANTS} x {small}; cap {GLOBAL_LIMIT})",
                median(waits),
                "task lengths",
                versus=(
                    f"first come, first served in the same run: {median(fifo_waits):.0f}; the least fair shares "
                    f"allow: {least_fair:.1f}"
                    if fair
                    else f"the big backlog / the cap: {least_fifo:.0f}"
                )
                + f"; worst tenant {worst:.0f}; CPU steal {steal:.1%}",
                ratio=median(waits) / (median(fifo_waits) if fair else least_fifo),
                target="a few task lengths" if fair else "",
                met=None,
                repeats=waits,
                detail={"trials": trials[task]},
            )
        )
        utilisation = [trial["utilisation"] for trial in trials[task]]
        report.add(
            Figure(
                PART,
                f"{store}, {order}: slot utilisation over the run",
                median(utilisation),
                "ratio",
                versus=f"ideal: the cap of {GLOBAL_LIMIT} kept full",
                ratio=median(utilisation),
                repeats=utilisation,
            )
        )
