"""Part 9: sustained overload (issue 34): is the cap still used, and does throughput hold?

Three workers ``-c 4`` run a task under two caps at once, a global cap of 6 and a cap of 2 per
tenant (20 tenants), tasks of 100 ms: the global cap runs at most 60 a second. The sender offers
70 a second, in a burst each second (tenants drawn at random), for :data:`SEND_SECONDS` (quick:
:data:`QUICK_SEND_SECONDS`), so a backlog builds the whole time. Then the fleet drains it.

Run on the PostgreSQL and Redis stores, park, with Celery's default prefetch multiplier (4)
and with 1. Reported:

- the *use of the global cap while sending*: the run time inside the sending window over
  6 x the window (1.0: the cap never idle);
- *throughput held*: the tasks started in the second half of the sending window over those
  started in the first half (1.0: no slowdown as the backlog grows);
- *broker messages per task*: the tasks sent plus every put-back or woken copy the workers
  published, over the tasks completed;
- nothing lost, nothing run twice, and the *peak* runs at once, globally and per tenant, from
  the bodies' own start and end times.

On PostgreSQL, where the store's time goes while sending (``store_activity.py``): the mean busy
backends per statement, on the CPU, waiting for their commit's WAL flush or for a lock, in a note
and in the results file.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .clients import caps_url_for, drop_slots, vacuum_database
from .common import CpuSteal, Figure, Options, Report, at_least, at_most, reachable, service_url
from .store_activity import StoreActivity, summary
from .utilisation import _peak
from .workers import BenchFleet, fleet_env, wait_for

PART = "soak"
GLOBAL_LIMIT = 6
TENANT_LIMIT = 2
TENANTS = 20
TASK_MS = 100
#: Tasks offered per second, in one burst each second: more than the global cap runs.
OFFERED_PER_SECOND = 70
SEND_SECONDS = 240
QUICK_SEND_SECONDS = 60
WORKERS = 3
CONCURRENCY = 4
#: Celery's default prefetch multiplier, and the one the README recommends for capped tasks.
PREFETCHES = (4, 1)
STORES = ("postgresql", "redis")
TASK = "bench.soak"
USE_TARGET = 0.9


def run(report: Report, options: Options) -> None:
    broker = service_url("redis")
    if reachable(broker):
        report.note(f"soak skipped: {reachable(broker)}")
        return
    send_seconds = QUICK_SEND_SECONDS if options.quick else SEND_SECONDS
    for store in [name for name in options.stores if name in STORES]:
        caps_url, why = caps_url_for(store, options)
        if caps_url is None:
            report.note(f"soak skips {store}: {why}")
            continue
        for prefetch in PREFETCHES:
            prefix = f"{options.run_prefix}k{store[:2]}{prefetch}-"
            env = fleet_env(
                broker, caps_url, prefix, GLOBAL_LIMIT=GLOBAL_LIMIT, TENANT_LIMIT=TENANT_LIMIT, PREFETCH=prefetch,
                EXTRA_CONF="caps_strategy=park",
            )  # fmt: skip
            vacuum_database(caps_url)
            fleet = BenchFleet(env, Path(options.tmp_dir) / "logs")
            try:
                options.log(
                    f"[soak] {store}, prefetch {prefetch}: {WORKERS} workers x -c {CONCURRENCY}, "
                    f"{OFFERED_PER_SECOND} tasks/s for {send_seconds} s"
                )
                fleet.start(WORKERS, CONCURRENCY)
                trial = run_trial(fleet, send_seconds, caps_url)
                options.log(
                    f"[soak] {store}, prefetch {prefetch}: use {trial['use']:.3f}, held {trial['held']:.3f}, "
                    f"{trial['messages_per_task']:.2f} messages/task, {trial['completed']}/{trial['sent']} done, "
                    f"CPU steal {trial['cpu_steal']:.1%}"
                )
                report_trial(report, store, prefetch, trial, send_seconds)
                if "store_activity" in trial:
                    report.note(f"soak, {store}, prefetch {prefetch}, store: {summary(trial['store_activity'])}")
            except Exception as exc:  # the next variant still runs
                report.note(f"soak on {store}, prefetch {prefetch} failed: {type(exc).__name__}: {str(exc)[:300]}")
                options.log(f"[soak] {store}, prefetch {prefetch}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                fleet.close()
                drop_slots(caps_url, prefix)


def run_trial(fleet: BenchFleet, send_seconds: int, caps_url: str) -> dict[str, Any]:
    fleet.reset_records()
    queue = fleet.new_queue()
    fleet.consume(queue)
    time.sleep(1.2)  # every worker listening to the new queue (kombu's BRPOP timeout)
    steal = CpuSteal()
    activity = StoreActivity(caps_url).start() if caps_url.startswith("postgresql") else None
    publishes_before = fleet.worker_publishes()
    rng = random.Random(34)
    sent = published = 0
    window_start = time.time()
    for second in range(send_seconds):
        calls = [(f"t{rng.randrange(TENANTS)}", TASK_MS) for _ in range(OFFERED_PER_SECOND)]
        fleet.fill(queue, TASK, calls)
        sent += len(calls)
        published += fleet.last_fill_published
        pause = window_start + second + 1 - time.time()
        if pause > 0:
            time.sleep(pause)
    window_end = time.time()
    sampled = activity.stop() if activity is not None else None
    backlog_seconds = sent * TASK_MS / 1000 / GLOBAL_LIMIT
    drained = True
    try:
        wait_for(lambda: fleet.redis.llen(fleet.keys["runs"]) >= sent, backlog_seconds * 3 + 60, "soak backlog", 0.2)
    except TimeoutError:
        drained = False
    fleet.stop_consuming(queue)
    time.sleep(0.2)  # a put-back published just now is still counted
    result = analyse(fleet.runs(), window_start, window_end, sent)
    result["drained"] = drained
    result["messages_per_task"] = (published + fleet.worker_publishes() - publishes_before) / max(
        result["completed"], 1
    )
    result["cpu_steal"] = steal.fraction()
    if sampled is not None:
        result["store_activity"] = sampled
    return result


def analyse(runs: list[dict[str, Any]], window_start: float, window_end: float, sent: int) -> dict[str, Any]:
    """The cap's use and the throughput's halves over the sending window, and the checks."""
    window = window_end - window_start
    busy = sum(max(0.0, min(run["end"], window_end) - max(run["start"], window_start)) for run in runs)
    middle = window_start + window / 2
    first = sum(1 for run in runs if window_start <= run["start"] < middle)
    second = sum(1 for run in runs if middle <= run["start"] < window_end)
    by_tenant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_tenant[run["tenant"]].append(run)
    task_ids = [run["task_id"] for run in runs]
    return {
        "sent": sent,
        "completed": len(set(task_ids)),
        "ran_twice": len(task_ids) - len(set(task_ids)),
        "window_seconds": window,
        "use": busy / (GLOBAL_LIMIT * window),
        "started_first_half": first,
        "started_second_half": second,
        "held": second / first if first else 0.0,
        "peak_global": _peak(runs),
        "peak_tenant": max((_peak(tenant_runs) for tenant_runs in by_tenant.values()), default=0),
    }


def report_trial(report: Report, store: str, prefetch: int, trial: dict[str, Any], send_seconds: int) -> None:
    name = f"{store}, prefetch {prefetch}"
    load = (
        f"{OFFERED_PER_SECOND} tasks/s of {TASK_MS} ms for {send_seconds} s, caps {GLOBAL_LIMIT} global and "
        f"{TENANT_LIMIT} per tenant ({TENANTS}); CPU steal {trial['cpu_steal']:.1%}"
    )
    report.add(
        Figure(
            PART, f"{name}: use of the global cap while sending", trial["use"], "ratio", versus=load,
            ratio=trial["use"], target=f">= {USE_TARGET}", met=at_least(trial["use"], USE_TARGET), detail=trial,
        )
    )  # fmt: skip
    half_rates = (
        f"{trial['started_first_half'] / (trial['window_seconds'] / 2):.1f} -> "
        f"{trial['started_second_half'] / (trial['window_seconds'] / 2):.1f} tasks/s"
    )
    report.add(
        Figure(
            PART, f"{name}: throughput held, second half of sending / first", trial["held"], "ratio",
            versus=half_rates, ratio=trial["held"], target=">= 0.95", met=at_least(trial["held"], 0.95),
        )
    )  # fmt: skip
    report.add(
        Figure(
            PART, f"{name}: broker messages per task", trial["messages_per_task"], "messages",
            versus="1.0: each task sent once", target="<= 1.1", met=at_most(trial["messages_per_task"], 1.1),
        )
    )  # fmt: skip
    complete = trial["completed"] == trial["sent"] and trial["ran_twice"] == 0
    report.add(
        Figure(
            PART, f"{name}: tasks completed once / sent", trial["completed"] / trial["sent"], "ratio",
            versus=f"{trial['completed']} of {trial['sent']}, {trial['ran_twice']} ran twice", target="1.0, none twice",
            met=complete,
        )
    )  # fmt: skip
    peaks_held = trial["peak_global"] <= GLOBAL_LIMIT and trial["peak_tenant"] <= TENANT_LIMIT
    report.add(
        Figure(
            PART, f"{name}: peak runs at once, global / per tenant", trial["peak_global"], "runs",
            versus=f"per tenant {trial['peak_tenant']}", target=f"<= {GLOBAL_LIMIT} / {TENANT_LIMIT}", met=peaks_held,
        )
    )  # fmt: skip
