"""Part ``connections``: the PostgreSQL server connections a fleet holds (its connection budget).

Three prefork workers of four processes each run capped tasks on PostgreSQL, their ``caps_url``
carrying an ``application_name`` of this run's own.  ``pg_stat_activity`` is sampled every
0.1 s, and each server connection is traced back to the process that holds it (its client port,
looked up in ``/proc``): a worker's main process, or one of its pool processes.  Three phases:

* **started**: the workers answered ping and had a few seconds to warm up; no task yet;
* **running**: a backlog of 0.2 s tasks under a global cap of 4 drains (park strategy, the
  default), so every pool process admits, parks, releases, renews and hands over;
* **idle**: the same fleet, :data:`IDLE_WAIT_SECONDS` after the last task ended.

Figures are counts, not timings: the most connections held at any sample, in all and per
process kind.  The fleet's own connections only: neither the sampling one nor the sending
process's (the benchmark's own, which warms up its store before it sends, as a sender with
``caps_park_on_publish`` would).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .common import Figure, Options, Report, median, ms, reachable, service_url
from .workers import BenchFleet, child_pids, wait_for

PART = "connections"
WORKERS = 3
CONCURRENCY = 4
GLOBAL_LIMIT = 4
TASK_MS = 200
BACKLOG = 120
#: Seconds the started fleet sits before and while it is sampled.
SETTLE_SECONDS = 3.0
SAMPLE_SECONDS = 3.0
SAMPLE_INTERVAL = 0.1
#: Seconds after the last task before the idle fleet is sampled: past the store's idle-connection
#: time (``caps_store_idle_seconds``, 60 s) and one check of it.
IDLE_WAIT_SECONDS = 75.0


def run(report: Report, options: Options) -> None:
    broker = service_url("redis")
    if "postgresql" not in options.stores:
        return
    if reachable(broker):
        report.note(f"connection benchmarks skipped: {reachable(broker)}")
        return
    server_url = service_url("postgres")
    if reachable(server_url):
        report.note(f"connection benchmarks skip postgresql: {reachable(server_url)}")
        return
    # A database of this run's own (the shared benchmark databases are dropped by any run
    # that starts meanwhile, which would end this fleet's connections).
    name = f"caps-budget-{uuid.uuid4().hex[:8]}"
    database = name.replace("-", "_")
    _admin(server_url, f'CREATE DATABASE "{database}"')
    caps_url = sa.engine.make_url(server_url).set(database=database).render_as_string(hide_password=False)
    fleet_url = sa.engine.make_url(caps_url).update_query_dict({"application_name": name})
    prefix = f"{options.run_prefix}c-"
    env = {
        "CAPS_BENCH_BROKER": broker,
        "CAPS_BENCH_SIDE_URL": broker,
        "CAPS_BENCH_CAPS_URL": fleet_url.render_as_string(hide_password=False),
        "CAPS_BENCH_PREFIX": prefix,
        "CAPS_BENCH_GLOBAL_LIMIT": str(GLOBAL_LIMIT),
        "CAPS_BENCH_PREFETCH": "1",
        "CAPS_BENCH_EXTRA_CONF": "caps_strategy=park",
    }
    try:
        measure_prepared(report, options, caps_url)
    except Exception as exc:  # the fleet still runs
        report.note(f"prepared-statement figures failed: {type(exc).__name__}: {str(exc)[:300]}")
    fleet = BenchFleet(env, Path(options.tmp_dir) / "logs")
    sampler = Sampler(caps_url, name)
    idle_wait = 20.0 if options.quick else IDLE_WAIT_SECONDS
    try:
        options.log(f"[connections] starting {WORKERS} workers x -c {CONCURRENCY}")
        fleet.start(WORKERS, CONCURRENCY)
        time.sleep(SETTLE_SECONDS)
        started = sampler.sample_for(fleet, SAMPLE_SECONDS)
        queue = fleet.new_queue()
        fleet.fill(queue, "bench.global", [("a", TASK_MS)] * BACKLOG)
        fleet.consume(queue)
        began = time.monotonic()
        running = sampler.sample_until(fleet, lambda: fleet.waiting(queue) == (0, 0), timeout=180)
        drained = time.monotonic() - began
        options.log(f"[connections] {BACKLOG} tasks drained in {drained:.1f} s")
        fleet.stop_consuming(queue)
        options.log(f"[connections] drained; waiting {idle_wait:.0f} s for the idle fleet")
        time.sleep(idle_wait)
        idle = sampler.sample_for(fleet, SAMPLE_SECONDS)
        for phase, samples in (("started", started), ("running", running), ("idle", idle)):
            report_phase(report, phase, samples, idle_wait if phase == "idle" else None)
        report.add(Figure(PART, f"{BACKLOG} tasks of {TASK_MS} ms drained (while sampled)", drained, "s"))
    except Exception as exc:
        report.note(f"connection benchmarks failed: {type(exc).__name__}: {str(exc)[:300]}")
        options.log(f"[connections] FAILED: {type(exc).__name__}: {str(exc)[:300]}\n{fleet.tails()}")
    finally:
        sampler.close()
        fleet.close()
        _admin(server_url, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def _admin(server_url: str, statement: str) -> None:
    engine = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(statement)
    finally:
        engine.dispose()


#: Acquire-and-release pairs per round of the prepared-statement comparison, and rounds.
PAIRS = 400
PAIR_ROUNDS = 8


def measure_prepared(report: Report, options: Options, caps_url: str) -> None:
    """What psycopg's server-side prepared statements save on a direct connection (where the
    store keeps them on; through a pooler it turns them off): one client's acquire-and-release
    pairs with ``prepare_threshold`` 5 (psycopg's default) and ``none``, interleaved rounds."""
    from celery_caps.stores import store_from_url

    url = sa.engine.make_url(caps_url)
    stores = {
        variant: store_from_url(url.update_query_dict({"prepare_threshold": variant}).render_as_string(False))
        for variant in ("5", "none")
    }
    slot = f"{options.run_prefix}prepared"
    per_pair: dict[str, list[float]] = {variant: [] for variant in stores}
    try:
        for store in stores.values():
            store.warm_up()
        for number in range(2 if options.quick else PAIR_ROUNDS):
            order = list(stores.items()) if number % 2 == 0 else list(reversed(stores.items()))
            for variant, store in order:
                began = time.perf_counter()
                for _ in range(PAIRS):
                    run_id = uuid.uuid4().hex
                    store.acquire({slot: 4}, run_id, run_id, "bench", 30.0)
                    store.release_and_wake(run_id, 30.0)  # type: ignore[attr-defined]
                per_pair[variant].append((time.perf_counter() - began) / PAIRS)
        store = stores["none"]
        store.prune(slot)
    finally:
        for store in stores.values():
            store.close()
    ratios = [off / on for off, on in zip(per_pair["none"], per_pair["5"], strict=True)]
    prepared = median(per_pair["5"])
    report.add(Figure(PART, "one client, acquire + release pair, prepared statements on", ms(prepared), "ms"))
    report.add(
        Figure(
            PART,
            "one client, acquire + release pair, prepared statements off",
            ms(median(per_pair["none"])),
            "ms",
            versus=f"prepared {ms(prepared):.3f} ms",
            ratio=median(ratios),
            repeats=[ms(value) for value in per_pair["none"]],
        )
    )


#: One sample: connections held, by (worker index, "main" or the pool process's pid).
Sample = Counter[tuple[int, str]]


class Sampler:
    """Reads the fleet's server connections from ``pg_stat_activity`` and finds their processes."""

    def __init__(self, server_url: str, application_name: str) -> None:
        self.engine = sa.create_engine(server_url, poolclass=sa.pool.StaticPool)
        self.application_name = application_name

    def close(self) -> None:
        self.engine.dispose()

    def ports(self) -> list[int | None]:
        with self.engine.connect() as connection:
            rows = connection.execute(
                sa.text("SELECT client_port FROM pg_stat_activity WHERE application_name = :name"),
                {"name": self.application_name},
            )
            return [row[0] for row in rows]

    def sample(self, fleet: BenchFleet) -> Sample:
        owners = socket_owners(fleet)
        sample: Sample = Counter()
        for port in self.ports():
            sample[owners.get(port, (-1, "unknown")) if port is not None else (-1, "unix socket")] += 1
        return sample

    def sample_for(self, fleet: BenchFleet, seconds: float) -> list[Sample]:
        deadline = time.monotonic() + seconds
        return self.sample_until(fleet, lambda: time.monotonic() >= deadline, timeout=seconds + 30)

    def sample_until(self, fleet: BenchFleet, done: Any, timeout: float) -> list[Sample]:
        samples: list[Sample] = []

        def one() -> bool:
            samples.append(self.sample(fleet))
            return bool(done())

        wait_for(one, timeout, "the phase to end", interval=SAMPLE_INTERVAL)
        return samples


def _local_ports() -> dict[int, int]:
    """Socket inode -> local TCP port, of every TCP socket of the machine."""
    ports: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            ports[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return ports


def socket_owners(fleet: BenchFleet) -> dict[int, tuple[int, str]]:
    """Local TCP port -> (worker index, "main" or "pool"+pid) for the fleet's processes."""
    by_inode = _local_ports()
    owners: dict[int, tuple[int, str]] = {}
    for index, worker in enumerate(fleet.workers):
        main = worker.process.pid
        processes = [(main, "main")] + [(child, f"pool {child}") for child in child_pids(main)]
        for pid, kind in processes:
            for fd in Path(f"/proc/{pid}/fd").glob("*"):
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    port = by_inode.get(int(target[8:-1]))
                    if port is not None:
                        owners[port] = (index, kind)
    # The benchmark's own process sends the tasks (it warmed up its store first, as a sender does).
    for fd in Path(f"/proc/{os.getpid()}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            port = by_inode.get(int(target[8:-1]))
            if port is not None:
                owners[port] = (-1, "sender")
    return owners


def report_phase(report: Report, phase: str, samples: list[Sample], idle_wait: float | None) -> None:
    """The most connections at any sample: in all, per main process, per pool process."""
    total = [sum(n for (_, kind), n in sample.items() if kind != "sender") for sample in samples]
    main = [max((n for (_, kind), n in sample.items() if kind == "main"), default=0) for sample in samples]
    pool = [max((n for (_, kind), n in sample.items() if kind.startswith("pool")), default=0) for sample in samples]
    pools_holding = [sum(1 for (_, kind) in sample if kind.startswith("pool")) for sample in samples]
    fleet_kinds = ("pool", "main", "sender")
    unknown = [sum(n for (_, kind), n in sample.items() if not kind.startswith(fleet_kinds)) for sample in samples]
    if phase == "started":
        when = f"{WORKERS} workers x -c {CONCURRENCY} started, no task yet"
    elif phase == "running":
        when = f"running {BACKLOG} tasks of {TASK_MS} ms under a cap of {GLOBAL_LIMIT} (park)"
    else:
        when = f"{idle_wait or 0:.0f} s after the last task"
    detail = {"samples": len(samples), "per_sample_totals": total, "last_sample": _plain(samples[-1])}
    report.add(Figure(PART, f"{when}: server connections, most at once", max(total), "count", detail=detail))
    report.add(Figure(PART, f"{when}: per worker main process, most", max(main), "count"))
    report.add(Figure(PART, f"{when}: per pool process, most", max(pool), "count"))
    report.add(Figure(PART, f"{when}: pool processes holding one, most", max(pools_holding), "count"))
    if any(unknown):
        report.note(f"connections {phase}: {max(unknown)} connection(s) of no fleet process (exiting ones)")


def _plain(sample: Sample) -> dict[str, int]:
    return {f"w{index} {kind}": count for (index, kind), count in sorted(sample.items())}
