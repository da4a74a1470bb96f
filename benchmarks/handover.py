"""Part 7: where the time of a hand-over goes, step by step (issue 34 asks it first).

The utilisation part measures the hand-over gap: from the end of one run's body to the start
of the next run's in the same slot.  This part splits it.  A fleet as the utilisation part's
(two workers ``-c 8``, prefetch 1, park, a global cap of 4) runs a backlog of short tasks with
the step probe on (:mod:`benchmarks.steps`), and every run that was handed its slot (a woken
copy) is joined to the release that woke it:

1. the releasing run's body ends -> its release starts (Celery's and the cap's epilogue);
2. the release transaction: the lease deleted, the next waiter dispatched (store);
3. the woken copy published to its wake queue (broker);
4. -> the worker that takes it receives it (broker, consumer);
5. -> a pool process starts it (the worker's dispatch);
6. -> its claim starts (the cap's prologue);
7. the claim transaction (store);
8. -> its body starts.

Each step is reported as its median over the hand-overs of the trial (the sum of medians is
not the median of the sums: the total is given as measured), and as its share of the median
hand-over; the store's steps next to the store's cheapest transaction measured in the same run
(``SELECT 1`` in a transaction, or ``PING``), the publish next to the same publish from the
benchmark's own quiet process.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from .clients import caps_url_for, drop_slots, vacuum_database
from .common import CpuSteal, Figure, Options, Report, median, percentile, reachable, service_url
from .workers import BenchFleet, fleet_env, wait_for

PART = "handover"
GLOBAL_LIMIT = 4
TASK_MS = 50
WORKERS = 2
CONCURRENCY = 8
PREFETCH = 1
STORES = ("postgresql", "redis")

#: (step, label, from mark, to mark): marks of the releasing run ("end"), of the release, and of
#: the woken run ("start").
STEPS = (
    ("epilogue", "body end -> release starts", "end", "release_start"),
    ("release", "release transaction (store)", "release_start", "publish_start"),
    ("publish", "publish the woken copy (broker)", "publish_start", "publish_end"),
    ("delivery", "-> received by a worker (broker)", "publish_end", "received"),
    ("dispatch", "-> started in a pool process", "received", "prerun"),
    ("prologue", "-> its claim starts", "prerun", "claim_start"),
    ("claim", "claim transaction (store)", "claim_start", "claim_end"),
    ("body", "-> its body starts", "claim_end", "start"),
)


def run(report: Report, options: Options) -> None:
    broker = service_url("redis")
    if reachable(broker):
        report.note(f"hand-over steps skipped: {reachable(broker)}")
        return
    backlog = 60 if options.quick else 200
    repeats = 1 if options.quick else 3
    for store in [name for name in options.stores if name in STORES]:
        caps_url, why = caps_url_for(store, options)
        if caps_url is None:
            report.note(f"hand-over steps skip {store}: {why}")
            continue
        prefix = f"{options.run_prefix}h{store[:2]}-"
        env = fleet_env(
            broker,
            caps_url,
            prefix,
            GLOBAL_LIMIT=GLOBAL_LIMIT,
            PREFETCH=PREFETCH,
            EXTRA_CONF="caps_strategy=park",
            STEPS=1,
        )
        vacuum_database(caps_url)
        fleet = BenchFleet(env, Path(options.tmp_dir) / "logs")
        try:
            options.log(f"[handover] {store}: starting {WORKERS} workers x -c {CONCURRENCY}")
            fleet.start(WORKERS, CONCURRENCY)
            trials = []
            for repeat in range(repeats):
                floor_ms = round_trip_ms(caps_url)
                trial = run_trial(fleet, backlog)
                trial["round_trip_ms"] = floor_ms
                trial["quiet_publish_ms"] = publish_ms(fleet)
                trials.append(trial)
                options.log(
                    f"[handover] {store}: repeat {repeat + 1}/{repeats}: {trial['handovers']} hand-overs, gap p50 "
                    f"{trial['gap_ms']:.2f} ms, round trip {floor_ms:.2f} ms, CPU steal {trial['cpu_steal']:.1%}"
                )
            report_store(report, store, trials)
        except Exception as exc:  # the next store still runs
            report.note(f"hand-over steps on {store} failed: {type(exc).__name__}: {str(exc)[:300]}")
            options.log(f"[handover] {store}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            fleet.redis.delete(fleet.keys["steps"])
            fleet.close()
            drop_slots(caps_url, prefix)


def round_trip_ms(caps_url: str, count: int = 300) -> float:
    """The median time of the store's cheapest transaction: ``SELECT 1`` in a SQLAlchemy
    transaction (checkout, BEGIN, COMMIT), or a Redis ``PING``."""
    samples = []
    if caps_url.startswith("redis"):
        import redis

        client = redis.Redis.from_url(caps_url)
        try:
            for _ in range(count):
                started = time.perf_counter()
                client.ping()
                samples.append(time.perf_counter() - started)
        finally:
            client.close()
    else:
        import sqlalchemy as sa

        engine = sa.create_engine(caps_url)
        try:
            for _ in range(count):
                started = time.perf_counter()
                with engine.begin() as connection:
                    connection.execute(sa.text("SELECT 1"))
                samples.append(time.perf_counter() - started)
        finally:
            engine.dispose()
    return statistics.median(samples[count // 10 :]) * 1000  # the first connects


def publish_ms(fleet: BenchFleet, count: int = 300) -> float:
    """The median time to publish a woken copy as the release does (a signature sent to a wake
    queue with the dispatch header), from this quiet process: the publish step's floor.  The
    copies go to a queue no worker consumes (deleted with the fleet's keys)."""
    from celery_caps.messages import DISPATCH_HEADER, wake_queue, wake_queue_name

    try:
        from celery_caps.messages import wake_route
    except ImportError:  # a library before wake_route: its release named the wake queue's exchange

        def wake_route(queue: str) -> dict[str, Any]:
            wake = wake_queue(wake_queue_name(queue))
            return {"queue": wake, "exchange": wake.exchange.name, "routing_key": wake.routing_key}

    samples = []
    for _ in range(count):
        signature = fleet.app.signature("bench.global", args=("g", TASK_MS))
        signature.options.update(wake_route(f"{fleet.prefix}floor"))
        started = time.perf_counter()
        signature.apply_async(headers={DISPATCH_HEADER: "floor"}, add_to_parent=False)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[count // 10 :]) * 1000  # the first connects


def run_trial(fleet: BenchFleet, backlog: int) -> dict[str, Any]:
    fleet.reset_records()
    queue = fleet.new_queue()
    fleet.consume(queue)
    time.sleep(1.2)  # every worker listening to the new queue (kombu's BRPOP timeout)
    steal = CpuSteal()
    fleet.fill(queue, "bench.global", [("g", TASK_MS)] * backlog)
    wait_for(lambda: fleet.redis.llen(fleet.keys["runs"]) >= backlog, backlog * TASK_MS / 1000 * 10 + 30, "backlog")
    fleet.stop_consuming(queue)
    time.sleep(0.5)  # the main processes' last records
    records = [json.loads(raw) for raw in fleet.redis.lrange(fleet.keys["steps"], 0, -1)]
    result = analyse(fleet.runs(), records)
    result["cpu_steal"] = steal.fraction()
    return result


def analyse(runs: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps of every hand-over to a woken run, joined from the runs and the probe's records."""
    by_task = {run["task_id"]: run for run in runs}
    marks: dict[str, dict[str, Any]] = {}
    received: dict[str, list[float]] = {}
    prerun: dict[str, list[float]] = {}
    for record in records:
        task_id = record["task_id"]
        if "received" in record:
            received.setdefault(task_id, []).append(record["received"])
        elif "prerun" in record:
            prerun.setdefault(task_id, []).append(record["prerun"])
        else:
            marks.setdefault(task_id, {}).update(record)
    handovers = []
    for task_id, mark in marks.items():
        woken, releaser = by_task.get(task_id), by_task.get(mark.get("released_by") or "")
        if woken is None or releaser is None or "claim_start" not in mark or "publish_end" not in mark:
            continue  # not a hand-over from a run's end (recovery, a first arrival's admission)
        # The copy that claimed: the last received, and started, before its claim.
        times = {**mark, "end": releaser["end"], "start": woken["start"]}
        for name, seen in (("received", received), ("prerun", prerun)):
            before = [moment for moment in seen.get(task_id, []) if moment <= mark["claim_start"]]
            if not before:
                break
            times[name] = max(before)
        else:
            handovers.append({step: (times[to] - times[since]) * 1000 for step, _, since, to in STEPS})
            handovers[-1]["gap"] = (times["start"] - times["end"]) * 1000
    result: dict[str, Any] = {"handovers": len(handovers)}
    for step in [*(step for step, *_ in STEPS), "gap"]:
        values = [handover[step] for handover in handovers]
        result[f"{step}_ms"] = statistics.median(values) if values else float("nan")
        result[f"{step}_ms_p90"] = percentile(values, 0.9) if values else float("nan")
    return result


def report_store(report: Report, store: str, trials: list[dict[str, Any]]) -> None:
    gap = median([trial["gap_ms"] for trial in trials])
    floor = median([trial["round_trip_ms"] for trial in trials])
    steal = median([trial["cpu_steal"] for trial in trials])
    report.add(
        Figure(
            PART,
            f"{store}: hand-over gap p50 (body end -> next body start)",
            gap,
            "ms",
            versus=f"bare store round trip {floor:.2f} ms; CPU steal {steal:.1%}",
            ratio=gap / floor if floor else None,
            target="<= 1.5 ms",
            met=gap <= 1.5,
            repeats=[trial["gap_ms"] for trial in trials],
            detail={"trials": trials},
        )
    )
    quiet_publish = median([trial["quiet_publish_ms"] for trial in trials])
    for step, label, _, _ in STEPS:
        values = [trial[f"{step}_ms"] for trial in trials]
        value = median(values)
        versus = f"{value / gap:.0%} of the gap; p90 {median([t[f'{step}_ms_p90'] for t in trials]):.2f} ms"
        if step == "publish":
            versus += f"; from a quiet process {quiet_publish:.2f} ms"
        elif step in ("release", "claim"):
            versus += f"; store round trip {floor:.2f} ms"
        report.add(
            Figure(
                PART,
                f"{store}: {label}",
                value,
                "ms",
                versus=versus,
                ratio=value / gap if gap else None,
                repeats=values,
            )
        )
