"""Where one client's acquire and release time goes, on one SQL store (PostgreSQL by default).

    python benchmarks/profile_store.py                       # timing breakdown
    python benchmarks/profile_store.py --pyinstrument        # + a pyinstrument call tree
    python benchmarks/profile_store.py --raw                 # + the same SQL on the bare driver
    py-spy record --idle -r 2000 -f raw -o /tmp/caps.txt -- \\
        python benchmarks/profile_store.py --pairs 20000 --quiet
    python benchmarks/profile_store.py --collapse /tmp/caps.txt   # py-spy samples by layer

The breakdown times every cursor execution through SQLAlchemy's engine events
(``before_cursor_execute`` / ``after_cursor_execute``: the driver call, which is
the network round trip plus the server's work plus the driver's own code) and
connection checkouts, and counts statements per operation.  What is left of an
operation's wall time is SQLAlchemy and celery-caps code in this process.  The
bare ``SELECT 1`` on the driver gives the round-trip floor for comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))

import sqlalchemy as sa
from sqlalchemy import event

from benchmarks.common import bench_database_url, percentile, service_url
from celery_caps.stores import store_from_url
from celery_caps.stores.sql import SQLStore

SERVICES = {"postgresql": "postgres", "mariadb": "mysql"}

#: py-spy frames -> the layer they belong to, first match wins (innermost frame first).
LAYERS = (
    (
        "server + network (driver waiting)",
        ("Connection.wait (psycopg", "wait_c", "waiting.py", "_read_bytes", "recv_into", "_read_packet"),
    ),
    ("driver (psycopg / PyMySQL Python code)", ("psycopg/", "pymysql/")),
    ("SQLAlchemy pool (checkout, return)", ("sqlalchemy/pool/",)),
    ("SQLAlchemy engine (execute, results)", ("sqlalchemy/",)),
    ("celery-caps store", ("celery_caps/",)),
)


class Probe:
    """Engine events: time in the driver per statement, checkouts, statements per operation."""

    def __init__(self, engine: sa.Engine) -> None:
        self.driver_seconds = 0.0
        self.statements: list[str] = []
        self._started = 0.0
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)

    def _before(self, *args: Any) -> None:
        self._started = time.perf_counter()
        self.statements.append(args[2].split()[0].upper() if args[2] else "?")

    def _after(self, *args: Any) -> None:
        self.driver_seconds += time.perf_counter() - self._started

    def reset(self) -> None:
        self.driver_seconds = 0.0
        self.statements = []


def breakdown(store_name: str, pairs: int, quiet: bool, use_pyinstrument: bool) -> None:
    url = bench_database_url(service_url(SERVICES[store_name]), "main")
    store = store_from_url(url)  # PostgreSQL's is the store with its functions
    assert isinstance(store, SQLStore)
    # Under py-spy (quiet) the probe's listeners would show up in the profile.
    probe = None if quiet else Probe(store.engine)
    slot = f"profile-{uuid.uuid4().hex[:8]}"
    # Warm up: schema check, the admission function, pooled connection.
    for _ in range(50):
        run_id = uuid.uuid4().hex
        store.acquire({slot: 4}, run_id, run_id, "profile", 30)
        store.release(run_id)
    raw = store.engine.raw_connection()
    cursor = raw.cursor()
    floor = []
    for _ in range(500):
        started = time.perf_counter()
        cursor.execute("SELECT 1")
        cursor.fetchall()
        floor.append(time.perf_counter() - started)
    raw.rollback()
    raw.close()

    wall: dict[str, list[float]] = defaultdict(list)
    driver: dict[str, list[float]] = defaultdict(list)
    statements: dict[str, Counter[str]] = defaultdict(Counter)
    profiler = None
    if use_pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0001)
        profiler.start()
    for _ in range(pairs):
        run_id = uuid.uuid4().hex
        for operation in ("acquire", "release"):
            if probe is not None:
                probe.reset()
            started = time.perf_counter()
            if operation == "acquire":
                store.acquire({slot: 4}, run_id, run_id, "profile", 30)
            else:
                store.release(run_id)
            wall[operation].append(time.perf_counter() - started)
            if probe is not None:
                driver[operation].append(probe.driver_seconds)
                statements[operation][" + ".join(probe.statements)] += 1
    if profiler is not None:
        profiler.stop()
    store.close()
    if quiet:
        return
    print(f"{store_name}: {pairs} acquire+release pairs, one client, table {store.engine.url.database}")
    print(f"  SELECT 1 on the driver (round-trip floor): p50 {percentile(floor, 0.5) * 1000:.3f} ms")
    for operation in ("acquire", "release"):
        p50_wall = percentile(wall[operation], 0.5) * 1000
        p50_driver = percentile(driver[operation], 0.5) * 1000
        outside = [w - d for w, d in zip(wall[operation], driver[operation], strict=True)]
        print(
            f"  {operation}: wall p50 {p50_wall:.3f} ms (p99 {percentile(wall[operation], 0.99) * 1000:.3f}); "
            f"in driver calls p50 {p50_driver:.3f} ms; outside them p50 {percentile(outside, 0.5) * 1000:.3f} ms"
        )
        for sequence, count in statements[operation].most_common(3):
            print(f"    statements seen by SQLAlchemy: {sequence or '(none)'}  x{count}")
    if profiler is not None:
        print(profiler.output_text(unicode=False, color=False, show_all=False))


def raw_floor(pairs: int) -> None:
    """PostgreSQL only: the store's own acquire and release SQL on a bare autocommit psycopg
    connection (no SQLAlchemy), with ``synchronous_commit`` on (the default) and off: the
    difference is the wait for the WAL flush that makes each commit durable."""
    from celery_caps.stores.sql.statements import POSTGRESQL_CALLS

    url = bench_database_url(service_url("postgres"), "main")
    store = store_from_url(url)
    assert isinstance(store, SQLStore)
    store.acquire({"profile-warm": 4}, "w", "w", "profile", 30)  # creates the schema and function
    store.release("w")
    connection = store.engine.raw_connection().driver_connection
    connection.autocommit = True
    cursor = connection.cursor()
    call_sql, release_sql = POSTGRESQL_CALLS["acquire"], POSTGRESQL_CALLS["release"]
    slot = f"profile-raw-{uuid.uuid4().hex[:8]}"
    for setting in ("on", "off"):
        cursor.execute(f"SET synchronous_commit = {setting}")
        acquire_times, release_times = [], []
        for _ in range(pairs):
            run_id = uuid.uuid4().hex
            params = {
                "slots": [slot], "limits": [4], "task_id": run_id, "run_id": run_id, "holder": "profile",
                "lease_seconds": 30.0, "task_name": "profile",
            }  # fmt: skip
            started = time.perf_counter()
            cursor.execute(call_sql, params)
            cursor.fetchall()
            middle = time.perf_counter()
            cursor.execute(release_sql, {"run_id": run_id})
            acquire_times.append(middle - started)
            release_times.append(time.perf_counter() - middle)
        print(
            f"  bare psycopg, synchronous_commit={setting}: acquire (function call) p50 "
            f"{percentile(acquire_times, 0.5) * 1000:.3f} ms, release (DELETE) p50 "
            f"{percentile(release_times, 0.5) * 1000:.3f} ms"
        )
    connection.close()
    store.close()


def collapse(path: Path) -> None:
    """Attribute py-spy ``--format raw`` samples (collapsed stacks) to layers, innermost frame first."""
    totals: Counter[str] = Counter()
    acquire_release: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        operation = next((op for op in ("acquire", "release") if any(f"{op} (celery_caps" in f for f in frames)), None)
        if operation is None:
            totals["(outside acquire/release)"] += count
            continue
        layer = "other"
        for frame in reversed(frames):
            match = next((name for name, needles in LAYERS if any(needle in frame for needle in needles)), None)
            if match:
                layer = match
                break
        totals[layer] += count
        acquire_release[operation] += count
    inside = sum(acquire_release.values())
    print(f"samples in acquire: {acquire_release['acquire']}, in release: {acquire_release['release']}")
    for layer, count in totals.most_common():
        share = f"{100 * count / inside:5.1f}% of acquire+release" if not layer.startswith("(") else ""
        print(f"  {count:7d}  {layer:45s} {share}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=sorted(SERVICES), default="postgresql")
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--pyinstrument", action="store_true", help="print a pyinstrument call tree too")
    parser.add_argument("--collapse", type=Path, help="summarise a py-spy raw profile instead of measuring")
    parser.add_argument("--quiet", action="store_true", help="measure only (under py-spy)")
    parser.add_argument("--raw", action="store_true", help="PostgreSQL: the same SQL on a bare driver connection too")
    args = parser.parse_args()
    if args.collapse:
        collapse(args.collapse)
    else:
        breakdown(args.store, args.pairs, args.quiet, args.pyinstrument)
        if args.raw and args.store == "postgresql":
            raw_floor(args.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
