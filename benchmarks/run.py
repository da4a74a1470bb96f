"""Run the celery-caps benchmarks: ``python benchmarks/run.py [--quick] [--only PARTS] [--json PATH]``.

Parts (``--only`` takes a comma-separated list, all by default):

* ``store``: store operations per store against the floor and the peers;
* ``overhead``: capped vs uncapped tasks through a real worker;
* ``utilisation``: slot utilisation under a binding cap, global and per key;
* ``scaling``: admission cost against contenders, slot names and held leases; renewal;
* ``growth``: step costs against the waiting list's length, the number of keys and of clients.
* ``connections``: the PostgreSQL server connections a 3 x 4 prefork fleet holds.
* ``memory``: the memory of a saturated fleet's processes, capped against uncapped.
* ``handover``: where a hand-over's time goes, step by step.
* ``fairness``: a small tenant's wait behind a big one, first come against fair shares.
* ``soak``: sustained overload: the cap's use and the throughput over minutes.
* ``two-caps``: the hand-over of a task with a global cap and a tenant's, as the backlog grows.

Prints one table and writes the figures, the machine and the arguments as JSON
(``benchmarks/results/latest.json`` by default).  See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Run as a script: make the repository importable, after anything on PYTHONPATH
# (a PYTHONPATH naming a snapshot of celery_caps makes that snapshot the one measured).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    CpuSteal,
    Options,
    Report,
    drop_bench_databases,
    figures_from_json,
    markdown_table,
    new_run_id,
    reachable,
    service_url,
)
from benchmarks.utilisation import STRATEGIES as UTILISATION_STRATEGIES
from benchmarks.utilisation import TASK_MS as UTILISATION_TASK_MS

#: Part -> its module, imported when the part runs (a snapshot of an older celery_caps on
#: PYTHONPATH can then run the parts it has the names for).
PARTS = {
    "store": "store_ops",
    "overhead": "task_overhead",
    "utilisation": "utilisation",
    "scaling": "scaling",
    "growth": "growth",
    "connections": "connections",
    "memory": "memory",
    "handover": "handover",
    "fairness": "fairness",
    "soak": "soak",
    "two-caps": "two_caps",
}
#: The parts that use the shared benchmark databases (dropped at a run's start and end).
_SHARED_DATABASE_PARTS = {"store", "overhead", "utilisation", "scaling", "handover", "fairness", "soak"}
STORES = ("sqlite", "postgresql", "mariadb", "redis")


def _list(text: str, allowed: tuple[str, ...] | list[str], what: str, separator: str = ",") -> list[str]:
    values = [value.strip() for value in text.split(separator) if value.strip()]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(unknown)} (choose from {', '.join(allowed)})")
    return values


def _milliseconds(text: str) -> int:
    """A whole, positive number of milliseconds."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a whole, positive number of milliseconds: {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a short pass (about 3 minutes) with fewer repeats")
    parser.add_argument(
        "--only",
        type=lambda text: _list(text, list(PARTS), "part"),
        default=list(PARTS),
        help=f"comma-separated parts to run: {','.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--stores",
        type=lambda text: _list(text, STORES, "store"),
        default=list(STORES),
        help=f"comma-separated stores: {','.join(STORES)} (default: all; unreachable ones are skipped)",
    )
    parser.add_argument(
        "--worker-stores",
        type=lambda text: _list(text, STORES, "store"),
        default=None,
        help="stores the worker parts (overhead, utilisation) use (default: postgresql and redis for overhead, "
        "postgresql only with --quick; postgresql for utilisation)",
    )
    parser.add_argument(
        "--strategies",
        type=lambda text: _list(text, list(UTILISATION_STRATEGIES), "strategy", separator=";"),
        default=list(UTILISATION_STRATEGIES),
        help="semicolon-separated waiting strategies the utilisation part measures (default: all): "
        + "; ".join(UTILISATION_STRATEGIES),
    )
    parser.add_argument(
        "--task-ms",
        type=_milliseconds,
        default=UTILISATION_TASK_MS,
        help="how long the utilisation part's tasks sleep, ms (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of the store and scaling measurements (default: 1 quick, 3 full)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=RESULTS_DIR / "latest.json",
        help="the JSON file (default: %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument(
        "--markdown-from", type=Path, metavar="JSON", help="print a results file's figures as a Markdown table and exit"
    )
    return parser.parse_args(argv)


def library_version() -> dict[str, str]:
    """Which celery_caps was measured: its path and commit (``CAPS_BENCH_LIBRARY_COMMIT`` names a snapshot's)."""
    import celery_caps

    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        return result.stdout.strip()

    path = Path(celery_caps.__file__).resolve().parent
    version = {"celery_caps_path": str(path)}
    if path.is_relative_to(REPO_ROOT):
        version["library_commit"] = git("log", "-1", "--format=%h", "--", "celery_caps")
        version["library_uncommitted_changes"] = git("status", "--short", "--", "celery_caps") or "none"
    else:
        # A snapshot on PYTHONPATH: only the caller knows what it is a snapshot of.
        version["library_commit"] = os.environ.get("CAPS_BENCH_LIBRARY_COMMIT", "unknown (a copy elsewhere)")
    version["repository_commit"] = git("rev-parse", "--short", "HEAD")
    return version


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.markdown_from:
        print(markdown_table(figures_from_json(args.markdown_from)))
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    sql_servers = [service_url(name) for name in ("postgres", "mysql") if not reachable(service_url(name))]
    if not _SHARED_DATABASE_PARTS.intersection(args.only):
        sql_servers = []  # the growth part makes and drops databases of its own
    for server in sql_servers:
        drop_bench_databases(server)
    try:
        return _run(args, argv, rounds)
    finally:
        for server in sql_servers:
            drop_bench_databases(server)


def _run(args: argparse.Namespace, argv: list[str] | None, rounds: int) -> int:
    with tempfile.TemporaryDirectory(prefix="caps-bench-") as tmp:
        options = Options(
            quick=args.quick,
            rounds=rounds,
            stores=args.stores,
            run_prefix=new_run_id(),
            tmp_dir=Path(tmp),
            verbose=not args.quiet,
            utilisation_strategies=args.strategies,
            utilisation_task_ms=args.task_ms,
        )
        if args.worker_stores is not None:
            options.overhead_stores = args.worker_stores
            options.utilisation_stores = args.worker_stores
        elif args.quick:
            options.overhead_stores = ["postgresql"]
        report = Report(
            {
                "quick": args.quick,
                "only": args.only,
                "stores": args.stores,
                "overhead_stores": options.overhead_stores,
                "utilisation_stores": options.utilisation_stores,
                "utilisation_strategies": options.utilisation_strategies,
                "utilisation_task_ms": options.utilisation_task_ms,
                "rounds": rounds,
                "command": " ".join(["python", "benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]),
            }
        )
        report.machine.update(library_version())
        failed = []
        for part in args.only:
            started = time.monotonic()
            steal = CpuSteal()
            options.log(f"== {part} ==")
            try:
                importlib.import_module(f"benchmarks.{PARTS[part]}").run(report, options)
            except Exception as exc:
                failed.append(part)
                report.note(f"part {part} failed: {type(exc).__name__}: {str(exc)[:300]}")
                # Driver errors quote every parameter of a bulk insert: keep the lines short.
                for line in traceback.format_exception(exc):
                    print(line if len(line) < 1000 else line[:1000] + " ...", end="", file=sys.stderr)
            # How noisy the host was meanwhile (CPU time the hypervisor gave to others).
            stolen = steal.fraction()
            report.note(f"part {part}: CPU steal {stolen:.1%} of the machine's CPU time")
            options.log(f"== {part}: {time.monotonic() - started:.0f} s, CPU steal {stolen:.1%} ==")
            # Write what we have after every part: a long run that fails late keeps its figures.
            report.write_json(args.json)
        report.print_table()
        print(f"results written to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
