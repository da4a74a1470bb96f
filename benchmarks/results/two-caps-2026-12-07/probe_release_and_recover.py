"""A probe: release_and_wake and a worker's recovery pass with N waiters of two caps.

    PROBE_URL=postgresql+psycopg://postgres@127.0.0.1/test python probe_release_and_recover.py 100 1000 4000

Six runs hold a global slot (limit 6); N waiters each need it and one of 20 tenants' slots
(limit 2). Printed per N: the park's mean, a scoped recovery pass's median (five passes, nothing
to dispatch), and the six holders' releases' mean (each dispatches one waiter).

PROBE_URL: a PostgreSQL or MySQL server (a database ``caps_bench_probe_several`` is created and
dropped), a SQLite file URL, or a Redis URL (its database is flushed at the end: use a spare
one). Run from outside the repository with PYTHONPATH at a snapshot of ``celery_caps`` to
measure another revision (the README's before figures: 880b6b4).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[3]))

import redis
import sqlalchemy as sa

from benchmarks.common import bench_database_url
from celery_caps.stores import store_from_url
from celery_caps.stores.base import ParkRequest

DATABASE = "caps_bench_probe_several"


def main(sizes: list[int]) -> None:
    base = os.environ.get("PROBE_URL", "postgresql+psycopg://postgres@127.0.0.1/test")
    url = base if base.startswith(("redis", "sqlite")) else bench_database_url(base, "", name=DATABASE)
    store = store_from_url(url)
    try:
        for size in sizes:
            run = uuid.uuid4().hex[:6]
            cap = f"g{run}"

            def slots(tenant: int, cap: str = cap, run: str = run) -> dict[str, int]:
                return {cap: 6, f"t{run}:{tenant % 20}": 2}

            def request(task_id: str, tenant: int, payload: bytes | None) -> ParkRequest:
                return ParkRequest(
                    slots(tenant), task_id, f"r{task_id}", "probe/1", 300, time.time(), 100_000, "t", payload
                )

            for holder in range(6):
                store.park(request(f"h{holder}{run}", 1000 + holder, None))
            start = time.perf_counter()
            for i in range(size):
                store.park(request(f"w{i}{run}", i, b"x" * 500))
            park_ms = (time.perf_counter() - start) / size * 1000
            passes = []
            for _ in range(5):
                start = time.perf_counter()
                store.recover(60.0, caps=[cap, f"t{run}"], task_names=["t"], readmit_before=None)
                passes.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            for holder in range(6):
                store.release_and_wake(f"rh{holder}{run}", 30)
            release_ms = (time.perf_counter() - start) / 6 * 1000
            print(
                f"n={size} park {park_ms:.2f} ms, recovery pass {statistics.median(passes):.2f} ms, "
                f"release_and_wake {release_ms:.2f} ms",
                flush=True,
            )
    finally:
        store.close()
        if base.startswith("postgresql"):
            with sa.create_engine(base, isolation_level="AUTOCOMMIT").connect() as connection:
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        elif base.startswith("mysql"):
            with sa.create_engine(base, isolation_level="AUTOCOMMIT").connect() as connection:
                connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {DATABASE}")
        elif base.startswith("redis"):
            redis.Redis.from_url(base).flushdb()


if __name__ == "__main__":
    main([int(size) for size in sys.argv[1:]] or [100, 1000, 4000])
