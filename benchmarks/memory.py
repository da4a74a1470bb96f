"""Part ``memory``: the memory of a saturated fleet's processes, capped against uncapped.

Two prefork workers of four processes each (Redis broker, late acknowledgement, PostgreSQL
store in a database of this run's own, park, the default strategy) are offered more work than
a global cap of 4 lets run: a backlog of :data:`BACKLOG` tasks of :data:`TASK_MS` ms, each with
a :data:`PAYLOAD_BYTES`-byte argument, topped up as tasks complete, for :data:`SECONDS`
seconds.  The same load then runs on a fresh fleet through the uncapped twin of the task (one
body, ``Task`` instead of ``CappedTask``), which runs on all eight processes.  Each pair runs
with ``worker_prefetch_multiplier`` 1 (as the README recommends for capped tasks) and 4
(Celery's default), in the order capped, uncapped, uncapped, capped.

Every :data:`SAMPLE_SECONDS` seconds the resident (RSS), proportional (PSS) and private (USS)
memory of each main and pool process is read from ``/proc/<pid>/smaps_rollup``.  A prefork
child shares its parent's pages until it writes to them, so its USS grows as it warms up
even when nothing leaks; what tells growth from a warm-up is whether it keeps rising after
the first :data:`WARM_UP_SECONDS` seconds.  Reported per variant: the pool processes' RSS
in all at the start (idle), after the warm-up and at the end; the median pool process's
growth after the warm-up, and per thousand tasks; the main processes' RSS; tasks completed.

``--probe`` (running this module directly) also has each pool process report what it holds at
the start and the end (:mod:`benchmarks.memory_probe`: glibc's heap in use and free, Python's
live objects by type, celery-caps's per-process state); ``--tracemalloc`` adds the lines
that allocated what is still alive at the end, traced from the start (slower: a diagnosis, not
a figure)::

    python -m benchmarks.memory --seconds 120 --variants "capped, prefetch 1" --probe --tracemalloc
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from .benchapp import ENV
from .common import (
    Figure,
    Options,
    Report,
    bench_database_url,
    drop_databases,
    new_run_id,
    reachable,
    service_url,
)
from .memory_probe import smaps_rollup
from .workers import BenchFleet, wait_for

PART = "memory"
WORKERS = 2
CONCURRENCY = 4
GLOBAL_LIMIT = 4
TASK_MS = 20
PAYLOAD_BYTES = 1024
#: Tasks sent and not yet completed, kept at least this high (half of it at the start).
BACKLOG = 3000
SECONDS = 240.0
SAMPLE_SECONDS = 5.0
#: Seconds from the first task after which growth no longer counts as the processes' warm-up.
WARM_UP_SECONDS = 60.0
#: Variant -> (task, worker environment).  Run in this order (capped, uncapped, uncapped, capped).
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "capped, prefetch 1": ("bench.load_capped", {"CAPS_BENCH_PREFETCH": "1"}),
    "uncapped, prefetch 1": ("bench.load", {"CAPS_BENCH_PREFETCH": "1"}),
    "uncapped, prefetch 4": ("bench.load", {"CAPS_BENCH_PREFETCH": "4"}),
    "capped, prefetch 4": ("bench.load_capped", {"CAPS_BENCH_PREFETCH": "4"}),
}

#: Process label ("w0 main", "w0 pool 1234") -> kilobytes (rss, pss, uss).
Sample = dict[str, dict[str, int]]


def run(report: Report, options: Options) -> None:
    measure(report, options, list(VARIANTS), seconds=60.0 if options.quick else SECONDS)


def measure(
    report: Report,
    options: Options,
    variants: list[str],
    *,
    seconds: float,
    probe: bool = False,
    tracemalloc: bool = False,
) -> None:
    broker = service_url("redis")
    server_url = service_url("postgres")
    for url in (broker, server_url):
        if reachable(url):
            report.note(f"memory benchmarks skipped: {reachable(url)}")
            return
    database = f"caps_mem_{uuid.uuid4().hex[:8]}"
    caps_url = bench_database_url(server_url, "", name=database)
    try:
        trials = {}
        for number, variant in enumerate(variants):
            task, variant_env = VARIANTS[variant]
            env = {
                **ENV,
                **variant_env,
                "CAPS_BENCH_BROKER": broker,
                "CAPS_BENCH_SIDE_URL": broker,
                "CAPS_BENCH_CAPS_URL": caps_url,
                "CAPS_BENCH_PREFIX": f"{options.run_prefix}m{number}-",
                "CAPS_BENCH_GLOBAL_LIMIT": str(GLOBAL_LIMIT),
                "CAPS_BENCH_EXTRA_CONF": "caps_strategy=park",
            }
            probe_dir = Path(options.tmp_dir) / f"probe{number}"
            if probe:
                probe_dir.mkdir(parents=True, exist_ok=True)
                env["CAPS_BENCH_MEMORY_PROBE"] = str(probe_dir)
            if tracemalloc:
                env["CAPS_BENCH_TRACEMALLOC"] = "1"
            trials[variant] = run_trial(
                BenchFleet(env, Path(options.tmp_dir) / "logs"),
                variant, task, seconds, options, probe_dir if probe else None,
            )  # fmt: skip
        for variant, trial in trials.items():
            report_trial(report, variant, trial, trials.get(_twin(variant)))
    finally:
        drop_databases(server_url, [database])


def _twin(variant: str) -> str:
    capped, _, prefetch = variant.partition(", ")
    return f"{'uncapped' if capped == 'capped' else 'capped'}, {prefetch}"


def sample(fleet: BenchFleet) -> Sample:
    found: Sample = {}
    for index, worker in enumerate(fleet.workers):
        for pid, kind in [(worker.process.pid, "main")] + [(child, "pool") for child in worker.pool_pids()]:
            try:
                found[f"w{index} {kind}" + (f" {pid}" if kind == "pool" else "")] = smaps_rollup(pid)
            except OSError:
                continue  # a process that has just exited
    return found


def _signal_pools(fleet: BenchFleet) -> int:
    signalled = 0
    for worker in fleet.workers:
        for pid in worker.pool_pids():
            try:
                os.kill(pid, signal.SIGUSR2)
                signalled += 1
            except ProcessLookupError:
                continue
    return signalled


def _probe(fleet: BenchFleet, directory: Path, timeout: float) -> None:
    """Have every pool process write a report, and wait for them."""
    before = len(list(directory.glob("*.json")))
    expected = before + _signal_pools(fleet)
    try:
        wait_for(lambda: len(list(directory.glob("*.json"))) >= expected, timeout, "memory reports", interval=0.5)
    except TimeoutError as exc:
        print(f"memory: {exc}", file=sys.stderr)


def run_trial(
    fleet: BenchFleet, variant: str, task_name: str, seconds: float, options: Options, probe_dir: Path | None
) -> dict[str, Any]:
    payload = os.urandom(PAYLOAD_BYTES // 2).hex()
    backlog = BACKLOG // 3 if options.quick else BACKLOG
    samples: list[dict[str, Any]] = []
    try:
        options.log(f"[memory] {variant}: starting {WORKERS} workers x -c {CONCURRENCY}")
        fleet.start(WORKERS, CONCURRENCY)
        time.sleep(3.0)
        if probe_dir is not None:
            _probe(fleet, probe_dir, 30)
        samples.append({"t": 0.0, "done": 0, "sent": 0, "processes": sample(fleet)})
        queue = fleet.new_queue()
        sent = 0

        def top_up() -> None:
            nonlocal sent
            done = int(fleet.redis.get(fleet.keys["done"]) or 0)
            missing = backlog - (sent - done)
            if missing >= backlog // 4:
                fleet.fill(queue, task_name, [(TASK_MS, payload)] * missing)
                sent += missing

        fleet.fill(queue, task_name, [(TASK_MS, payload)] * (backlog // 2))
        sent = backlog // 2
        fleet.consume(queue)
        began = time.monotonic()
        while (elapsed := time.monotonic() - began) < seconds:
            time.sleep(max(0.0, min(SAMPLE_SECONDS - elapsed % SAMPLE_SECONDS, seconds - elapsed)))
            top_up()
            done = int(fleet.redis.get(fleet.keys["done"]) or 0)
            samples.append(
                {"t": round(time.monotonic() - began, 1), "done": done, "sent": sent, "processes": sample(fleet)}
            )
            if len(samples) % 6 == 0:
                pools = [kb["rss"] for name, kb in samples[-1]["processes"].items() if " pool " in name]
                options.log(
                    f"[memory] {variant}: {samples[-1]['t']:.0f} s, {done} done, pool RSS "
                    f"{sum(pools) / 1024:.0f} MB in all"
                )
        if probe_dir is not None:
            _probe(fleet, probe_dir, 120)
        fleet.stop_consuming(queue)
    except Exception:
        options.log(f"[memory] {variant} FAILED\n{fleet.tails()}")
        raise
    finally:
        fleet.close()
    trial: dict[str, Any] = {"samples": samples, "seconds": seconds, "backlog": backlog}
    if probe_dir is not None:
        trial["probes"] = summarise_probes(probe_dir)
    return trial


def summarise_probes(directory: Path) -> dict[str, Any]:
    """Per pool process, its first and last report and what changed between them."""
    reports: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.json"), key=lambda item: [int(part) for part in item.stem.split("-")]):
        data = json.loads(path.read_text())
        reports.setdefault(data["pid"], []).append(data)
    summary: dict[str, Any] = {}
    for pid, found in reports.items():
        first, last = found[0], found[-1]
        types_then, types_now = Counter(dict(first["gc_types"])), Counter(dict(last["gc_types"]))
        grown = {name: types_now[name] - types_then.get(name, 0) for name in types_now}
        summary[str(pid)] = {
            "memory_kb": [first["memory_kb"], last["memory_kb"]],
            "malloc": [first["malloc"], last["malloc"]],
            "python_blocks": [first["python_blocks"], last["python_blocks"]],
            "pymalloc": [first.get("pymalloc", ""), last.get("pymalloc", "")],
            "gc_objects": [first["gc_objects"], last["gc_objects"]],
            "types_grown": sorted(grown.items(), key=lambda item: -item[1])[:15],
            "caps": last["caps"],
            "tracemalloc": last["tracemalloc"],
        }
    return summary


def _mb(kb: float) -> float:
    return kb / 1024


def _pools(processes: Sample, field: str = "rss") -> dict[str, int]:
    return {name: kb[field] for name, kb in processes.items() if " pool " in name}


def _mains(processes: Sample) -> dict[str, int]:
    return {name: kb["rss"] for name, kb in processes.items() if name.endswith(" main")}


def report_trial(report: Report, variant: str, trial: dict[str, Any], twin: dict[str, Any] | None) -> None:
    samples = trial["samples"]
    start, end = samples[0], samples[-1]
    warm = next((item for item in samples if item["t"] >= WARM_UP_SECONDS), samples[len(samples) // 2])
    label = f"{variant}, {WORKERS} x -c {CONCURRENCY}, {trial['seconds']:.0f} s"

    def total(item: dict[str, Any], field: str = "rss") -> float:
        return _mb(sum(_pools(item["processes"], field).values()))

    def growth_after_warm_up(item_from: dict[str, Any], item_to: dict[str, Any], field: str = "rss") -> float:
        then, now = _pools(item_from["processes"], field), _pools(item_to["processes"], field)
        common = [name for name in now if name in then]
        return _mb(statistics.median(now[name] - then[name] for name in common)) if common else float("nan")

    tasks_after = end["done"] - warm["done"]
    per_process = growth_after_warm_up(warm, end)
    versus = ""
    ratio = None
    if twin is not None:
        twin_samples = twin["samples"]
        twin_warm = next((item for item in twin_samples if item["t"] >= WARM_UP_SECONDS), twin_samples[0])
        twin_end = twin_samples[-1]
        versus = f"{_twin(variant)}: pool RSS {total(twin_samples[0]):.0f} -> {total(twin_end):.0f} MB"
        ratio = (total(end) - total(start)) / max(total(twin_end) - total(twin_samples[0]), 1e-9)
        twin_growth = growth_after_warm_up(twin_warm, twin_end)
        versus += f", per process after warm-up {twin_growth:+.1f} MB"
    detail = {
        "tasks_completed": end["done"],
        "pool_rss_mb": {"start": total(start), "warm": total(warm), "end": total(end)},
        "pool_uss_mb": {"start": total(start, "uss"), "warm": total(warm, "uss"), "end": total(end, "uss")},
        "main_rss_mb": {
            "start": _mb(sum(_mains(start["processes"]).values())),
            "end": _mb(sum(_mains(end["processes"]).values())),
        },
        "series": [{"t": item["t"], "done": item["done"], "pool_rss_mb": round(total(item), 1)} for item in samples],
        "samples": samples,
    }
    if "probes" in trial:
        detail["probes"] = trial["probes"]
    report.add(
        Figure(
            PART,
            f"{label}: pool processes' RSS in all, start -> end",
            total(end),
            "MB",
            versus=versus,
            ratio=ratio,
            detail=detail,
        )
    )
    report.add(
        Figure(
            PART,
            f"{label}: pool processes' RSS in all, start / after {WARM_UP_SECONDS:.0f} s",
            total(warm),
            "MB",
            versus=f"start (idle) {total(start):.0f} MB",
        )
    )
    report.add(
        Figure(
            PART,
            f"{label}: median pool process's RSS growth after the warm-up",
            per_process,
            "MB",
            versus=f"{tasks_after} tasks; USS {growth_after_warm_up(warm, end, 'uss'):+.1f} MB",
        )
    )
    report.add(
        Figure(
            PART,
            f"{label}: main processes' RSS in all",
            detail["main_rss_mb"]["end"],
            "MB",
            versus=f"start {detail['main_rss_mb']['start']:.0f} MB",
        )
    )
    report.add(Figure(PART, f"{label}: tasks completed", end["done"], "count"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help="per variant (default: %(default)s)")
    parser.add_argument(
        "--variants",
        default=";".join(VARIANTS),
        help="semicolon-separated, of: " + "; ".join(VARIANTS),
    )
    parser.add_argument("--probe", action="store_true", help="pool processes report what they hold")
    parser.add_argument("--tracemalloc", action="store_true", help="and trace allocations (slower)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    variants = [name.strip() for name in args.variants.split(";") if name.strip()]
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants: {unknown}")
    report = Report({"part": PART, "seconds": args.seconds, "variants": variants, "probe": args.probe})
    from .run import library_version

    report.machine.update(library_version())
    with tempfile.TemporaryDirectory(prefix="caps-memory-") as tmp:
        options = Options(quick=False, rounds=1, stores=["postgresql"], run_prefix=new_run_id(), tmp_dir=Path(tmp))
        measure(
            report, options, variants, seconds=args.seconds, probe=args.probe or args.tracemalloc,
            tracemalloc=args.tracemalloc,
        )  # fmt: skip
    report.print_table()
    if args.json:
        report.write_json(args.json)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
