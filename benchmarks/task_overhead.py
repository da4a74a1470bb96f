"""Part 2: what a cap that never binds costs a task, through a real worker.

One ``celery worker -P prefork -c 2`` per store runs twin tasks that differ only
in the cap (a limit of a million: it never binds): a no-op and a 10 ms sleep.
Each trial fills a fresh queue with a backlog, lets the worker drain it and
times it from the first message taken to the last acknowledged (watched on the
broker, nothing in the task bodies).  Capped and uncapped trials alternate
(ABBA), and the figure is the median of per-pair throughput ratios.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import redis

from .clients import caps_url_for, drop_slots
from .common import Figure, Options, Report, at_least, median, ratio, reachable, service_url
from .workers import BenchFleet, fleet_env

PART = "overhead"
CONCURRENCY = 2
#: The issue's reference: Celery alone, no-op tasks, ``-c 2`` on this machine.
CELERY_REFERENCE_PER_SECOND = 1500
#: Capped / uncapped throughput targets, per store.
TARGETS = {"postgresql": {"noop": 0.75, "sleep10": 0.95}, "redis": {"noop": 0.9, "sleep10": 0.98}}
#: What sending a capped task may cost the sender, over a plain task's send.
SEND_TARGET = 1.2
#: ``apply_async`` calls per send trial, and trials (capped and plain alternate).
SEND_CALLS = 200
SEND_TRIALS = 6


def run(report: Report, options: Options) -> None:
    broker = service_url("redis")
    if reachable(broker):
        report.note(f"overhead benchmarks skipped: {reachable(broker)}")
        return
    stores = [name for name in options.stores if name in options.overhead_stores]
    for store in stores:
        caps_url, why = caps_url_for(store, options)
        if caps_url is None:
            report.note(f"overhead benchmarks skip {store}: {why}")
            continue
        measure_sending(report, options, broker, caps_url, store)
        prefix = f"{options.run_prefix}o{store[:2]}-"
        env = fleet_env(broker, caps_url, prefix)
        fleet = BenchFleet(env, Path(options.tmp_dir) / "logs")
        try:
            options.log(f"[overhead] {store}: starting a worker (-c {CONCURRENCY})")
            fleet.start(1, CONCURRENCY)
            measure(report, options, fleet, store)
        except Exception as exc:  # the next store still runs
            report.note(f"overhead benchmarks on {store} failed: {type(exc).__name__}: {str(exc)[:300]}")
            options.log(f"[overhead] {store}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            fleet.close()
            drop_slots(caps_url, prefix)


def measure(report: Report, options: Options, fleet: BenchFleet, store: str) -> None:
    sizes = {"noop": 800, "sleep10": 160} if options.quick else {"noop": 3000, "sleep10": 600}
    tasks = {
        "noop": ("bench.noop", "bench.noop_capped", ()),
        "sleep10": ("bench.sleep", "bench.sleep_capped", (10,)),
    }
    # Warm up: connections, the lease keeper thread, the store's schema check.
    for uncapped, capped, args in tasks.values():
        for name in (uncapped, capped):
            queue = fleet.new_queue()
            fleet.fill(queue, name, [args] * 50)
            fleet.drain(queue, 50, timeout=60)
    throughput: dict[str, dict[str, list[float]]] = {kind: {"capped": [], "uncapped": []} for kind in tasks}
    incomplete = 0
    repeats = 2 if options.quick else options.rounds
    for repeat in range(repeats):
        for kind, (uncapped, capped, args) in tasks.items():
            order = [("capped", capped), ("uncapped", uncapped)]
            if repeat % 2:
                order.reverse()
            for label, name in order:
                queue = fleet.new_queue()
                count = sizes[kind]
                fleet.fill(queue, name, [args] * count)
                drain = fleet.drain(queue, count, timeout=120)
                incomplete += not drain.completed
                throughput[kind][label].append(drain.throughput if drain.completed else math.nan)
        options.log(f"[overhead] {store}: repeat {repeat + 1}/{repeats} done")
    for kind, label in (("noop", "no-op"), ("sleep10", "10 ms")):
        capped, uncapped = throughput[kind]["capped"], throughput[kind]["uncapped"]
        ratios = [ratio(a, b) for a, b in zip(capped, uncapped, strict=True)]
        value = median(ratios)
        target = TARGETS.get(store, {}).get(kind)
        # Worker time a cap adds to each task: -c 2 processes share the work.
        added = [CONCURRENCY * 1000 * (1 / a - 1 / b) for a, b in zip(capped, uncapped, strict=True)]
        report.add(
            Figure(
                PART,
                f"{store}: {label} tasks, capped/uncapped throughput",
                value,
                "ratio",
                versus=f"capped {median(capped):,.0f}/s vs uncapped {median(uncapped):,.0f}/s, same worker -c 2",
                ratio=value,
                target=f">= {target}" if target else "",
                met=at_least(value, target) if target else None,
                repeats=ratios,
                detail={"capped_per_second": capped, "uncapped_per_second": uncapped, "tasks": sizes[kind]},
            )
        )
        report.add(
            Figure(
                PART,
                f"{store}: {label} tasks, worker time a cap adds per task",
                median(added),
                "ms",
                versus="1/capped - 1/uncapped throughput, x2 processes",
                repeats=added,
            )
        )
        if kind == "noop":
            report.add(
                Figure(
                    PART,
                    f"{store} worker: Celery alone, no-op tasks/s (-c 2)",
                    median(uncapped),
                    "/s",
                    versus=f"the issue's reference ~{CELERY_REFERENCE_PER_SECOND:,}/s",
                    ratio=median(uncapped) / CELERY_REFERENCE_PER_SECOND,
                    repeats=uncapped,
                )
            )
    if incomplete:
        report.note(f"overhead {store}: {incomplete} trial(s) did not finish in time (left out)")


def measure_sending(report: Report, options: Options, broker: str, caps_url: str, store: str) -> None:
    """What ``apply_async`` of a capped task costs the sender against a plain task's, no worker
    running: by default (the sender never touches the store) and with ``caps_park_on_publish``
    (a store call per send).  Capped and plain trials alternate; the figure is the median of
    per-pair ratios of the mean time per call."""
    import time

    from celery import Celery

    from celery_caps import Cap, CappedTask

    trials = 2 if options.quick else SEND_TRIALS
    for label, park_on_publish in (("default", False), ("caps_park_on_publish", True)):
        app = Celery(f"{options.run_prefix}send", broker=broker, set_as_current=False)
        queue = f"{options.run_prefix}send-{store}-{int(park_on_publish)}"
        app.conf.update(
            caps_url=caps_url, caps_park_on_publish=park_on_publish, task_default_queue=queue,
            broker_transport_options={"global_keyprefix": f"{options.run_prefix}kombu:"},
        )  # fmt: skip
        cap = Cap(f"{options.run_prefix}send-{store}", 1_000_000)

        @app.task(name="bench.send_plain", shared=False)
        def plain() -> None: ...

        @app.task(name="bench.send_capped", base=CappedTask, cap=cap, shared=False)
        def capped() -> None: ...

        def mean_seconds(task: Any) -> float:
            started = time.perf_counter()
            for _ in range(SEND_CALLS):
                task.apply_async()
            return (time.perf_counter() - started) / SEND_CALLS

        try:
            mean_seconds(plain), mean_seconds(capped)  # connections, the store's schema
            ratios, capped_ms, plain_ms = [], [], []
            for trial in range(trials):
                pair = (capped, plain) if trial % 2 == 0 else (plain, capped)
                seconds = {task.name: mean_seconds(task) for task in pair}
                capped_ms.append(seconds["bench.send_capped"] * 1000)
                plain_ms.append(seconds["bench.send_plain"] * 1000)
                ratios.append(seconds["bench.send_capped"] / seconds["bench.send_plain"])
            value = median(ratios)
            report.add(
                Figure(
                    PART,
                    f"{store}: sending a capped task ({label}), over a plain send",
                    value,
                    "ratio",
                    versus=f"capped {median(capped_ms):.3f} ms vs plain {median(plain_ms):.3f} ms per apply_async",
                    ratio=value,
                    target="" if park_on_publish else f"<= {SEND_TARGET}",
                    met=None if park_on_publish else value <= SEND_TARGET,
                    repeats=ratios,
                )
            )
        finally:
            with app.connection_for_write() as connection:
                connection.default_channel.queue_purge(queue)
            app.close()
            drop_slots(caps_url, cap.name)
            # The queue's bindings, which a purge leaves behind (kombu keeps them under the
            # transport's key prefix).
            broker_client = redis.Redis.from_url(broker)
            try:
                for key in broker_client.scan_iter(match=f"{options.run_prefix}kombu:*", count=1000):
                    broker_client.delete(key)
            finally:
                broker_client.close()
