"""A probe: what one capped run costs a PostgreSQL store, piece by piece (issue 34).

    python benchmarks/results/pg-run-cost-2026-12-07/probe_run_cost.py

In a database of its own (created and dropped), one client, a cap that never binds:

- the bare round trip (``SELECT 1``) and a one-row durable ``INSERT`` commit (its WAL flush);
- ``park`` with room (the first store call of every run under park, a 600-byte message) and
  ``release_and_wake`` (the last), each p50 through the store's own calls;
- the same pair run 500 times inside one server-side loop: the server's work alone, without
  round trips or commits.

PROBE_URL: a PostgreSQL server (default the local ``test`` database's server).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[3]))

import psycopg
import sqlalchemy as sa

from benchmarks.common import bench_database_url, drop_databases
from celery_caps.stores import store_from_url
from celery_caps.stores.base import ParkRequest

DATABASE = "caps_bench_probe_run_cost"
CALLS = 1500
WARM_UP = 200
SERVER_LOOP = 500


def p50_ms(call: Callable[[int], object], calls: int = CALLS) -> float:
    times = []
    for index in range(calls):
        start = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARM_UP:]) * 1000


def main() -> None:
    base = os.environ.get("PROBE_URL", "postgresql+psycopg://postgres@127.0.0.1/test")
    url = bench_database_url(base, "", name=DATABASE)
    store = store_from_url(url)
    try:
        store.warm_up()
        libpq_url = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(libpq_url, autocommit=True) as raw:
            cursor = raw.cursor()
            print(f"SELECT 1: p50 {p50_ms(lambda _: cursor.execute('SELECT 1').fetchall()):.3f} ms")
            cursor.execute("CREATE TABLE probe_commit (n integer)")
            insert = p50_ms(lambda n: cursor.execute("INSERT INTO probe_commit VALUES (%s)", (n,)))
            print(f"one-row INSERT, durable commit: p50 {insert:.3f} ms")
            cursor.execute("DROP TABLE probe_commit")

            park_times, release_times = [], []
            for index in range(CALLS):
                run_id = uuid.uuid4().hex
                request = ParkRequest(
                    {"probe": 1_000_000}, uuid.uuid4().hex, run_id, "probe/1", 300.0, time.time(), 10_000,
                    "probe.noop", b"x" * 600,
                )  # fmt: skip
                start = time.perf_counter()
                outcome = store.park(request)
                parked = time.perf_counter()
                store.release_and_wake(run_id, 60.0)
                released = time.perf_counter()
                assert outcome.value == "admitted", outcome
                if index >= WARM_UP:
                    park_times.append(parked - start)
                    release_times.append(released - parked)
            print(
                f"park (room, 600-byte message): p50 {statistics.median(park_times) * 1000:.3f} ms; "
                f"release_and_wake: p50 {statistics.median(release_times) * 1000:.3f} ms"
            )
            cursor.execute("VACUUM concurrency_slots")
            loop = (
                "DO $$ BEGIN FOR i IN 1.." + str(SERVER_LOOP) + " LOOP "
                "PERFORM concurrency_slots_park(ARRAY['probe'], ARRAY[1000000], 't' || i, 'r' || i, 'probe/1', "
                "300.0::float8, 'probe.noop', '\\x00'::bytea, 0.0::float8, 10000, '', ARRAY[1], NULL::text[]); "
                "PERFORM concurrency_slots_release_and_wake('r' || i, 60.0::float8, ''); END LOOP; END $$"
            )
            start = time.perf_counter()
            cursor.execute(loop)
            server = (time.perf_counter() - start) / SERVER_LOOP * 1000
            print(f"park + release_and_wake, server work alone: {server:.3f} ms a pair")
    finally:
        store.close()
        drop_databases(base, [DATABASE])


if __name__ == "__main__":
    main()
