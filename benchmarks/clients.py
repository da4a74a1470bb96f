"""Store clients for the store benchmarks: what they run (adapters) and where (a pool of processes).

An *adapter* gives one way of admitting into a slot the same two calls,
``acquire(slot, limit, token) -> bool`` and ``release(token)``:

* ``caps``: celery-caps' own store (``SlotStore.acquire`` / ``release``);
* ``naive``: the transaction a user would write with SQLAlchemy: lock a sentinel
  row ``FOR UPDATE``, count live leases, insert one (SQLite: ``BEGIN IMMEDIATE``);
* ``naive-raw``: the same statements on the bare driver connection, no SQLAlchemy;
* ``dramatiq``: dramatiq's ``ConcurrentRateLimiter`` on the same Redis;
* ``roundtrip`` / ``roundtrip-sa``: the floor, ``SELECT 1`` (``PING``) on the driver,
  and ``SELECT 1`` in a SQLAlchemy transaction (pool checkout, BEGIN, COMMIT).

Clients run in forked processes (:class:`ClientPool`), as workers would, each
with its own connections; they start together at a common moment, run for a
fixed time and send back their latencies.  Holders of a slot also bump a shared
counter while they hold it, so a cap exceeded during the measurement is seen.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from celery_caps.stores import store_from_url
from celery_caps.stores.base import ParkingStore, SlotStore
from celery_caps.stores.redis import RedisStore
from celery_caps.stores.sql import SQLStore, concurrency_slots

from .common import bench_database_url, percentile, reachable, service_url

#: Lease length used by the store benchmarks (seconds): long enough never to expire mid-run.
LEASE_SECONDS = 60.0
#: A PostgreSQL benchmark table larger than this is rewritten (VACUUM FULL) before a part.
_BLOATED_BYTES = 8 * 1024 * 1024


# -- where the slots live --------------------------------------------------------------


@dataclass
class StoreTarget:
    """One store under test, in two variants: ``main`` (nearly empty) and ``keys`` (10,000 slot names)."""

    name: str
    kind: str  # "sql" or "redis"
    urls: dict[str, str]
    run_prefix: str
    #: Databases created for this target alone (dropped by :meth:`drop_databases`).
    own_databases: bool = False

    def key_prefix(self, variant: str) -> str:
        return f"{self.run_prefix}-{variant}"

    def open(self, variant: str = "main") -> SlotStore:
        if self.kind == "redis":
            return RedisStore(self.urls[variant], key_prefix=self.key_prefix(variant))
        return store_from_url(self.urls[variant])

    def adapter(self, kind: str, variant: str = "main") -> Adapter:
        if kind == "caps":
            return CapsAdapter(self.open(variant))
        if kind == "dramatiq":
            return DramatiqAdapter(self.urls[variant], self.key_prefix(variant) + "-dramatiq")
        if kind == "roundtrip" and self.kind == "redis":
            return PingAdapter(self.urls[variant])
        store = self.open(variant)
        assert isinstance(store, SQLStore)
        if kind == "roundtrip":
            return SelectOneAdapter(store, through_sqlalchemy=False)
        if kind == "roundtrip-sa":
            return SelectOneAdapter(store, through_sqlalchemy=True)
        if kind == "naive":
            return NaiveSqlAdapter(store, raw=False)
        if kind == "naive-raw":
            return NaiveSqlAdapter(store, raw=True)
        raise ValueError(f"unknown adapter {kind!r} for {self.name}")

    def prepare(self) -> None:
        """Create the store's schema and the naive peer's tables in every variant, once."""
        for variant in self.urls:
            store = self.open(variant)
            try:
                if isinstance(store, SQLStore):
                    store.create_schema()
                    naive = NaiveSqlAdapter(store, raw=False)
                    naive.create_schema()
            finally:
                store.close()

    def vacuum(self, *, full: bool = False) -> None:
        """PostgreSQL: ``VACUUM`` the benchmark's tables (see :func:`vacuum_database`)."""
        if self.name == "postgresql":
            for url in self.urls.values():
                vacuum_database(url, full=full)

    def vacuum_store(self, variant: str) -> None:
        """PostgreSQL: ``VACUUM ANALYZE`` the tables of one variant."""
        if self.name == "postgresql":
            vacuum_database(self.urls[variant])

    def drop_databases(self) -> None:
        """Drop the databases created for this target alone (PostgreSQL, MariaDB)."""
        if not self.own_databases or self.name == "sqlite" or self.kind != "sql":
            return
        for url in self.urls.values():
            parsed = sa.engine.make_url(url)
            engine = sa.create_engine(parsed.set(database=_server_database(parsed)), isolation_level="AUTOCOMMIT")
            try:
                with engine.connect() as connection:
                    if parsed.get_backend_name() == "postgresql":
                        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{parsed.database}" WITH (FORCE)')
                    else:
                        connection.exec_driver_sql(f"DROP DATABASE IF EXISTS `{parsed.database}`")
            finally:
                engine.dispose()

    def cleanup(self) -> None:
        """Delete everything this run created (rows under its slot prefix, its Redis keys)."""
        for variant in self.urls:
            if self.kind == "redis":
                client = redis.Redis.from_url(self.urls[variant])
                try:
                    batch = []
                    for key in client.scan_iter(match=f"{self.key_prefix(variant)}*", count=1000):
                        batch.append(key)
                        if len(batch) >= 1000:
                            client.delete(*batch)
                            batch = []
                    if batch:
                        client.delete(*batch)
                finally:
                    client.close()
                continue
            if self.own_databases:
                continue  # dropped whole
            store = self.open(variant)
            assert isinstance(store, SQLStore)
            with store.engine.begin() as connection:
                table = concurrency_slots
                connection.execute(table.delete().where(table.c.slot.like(_name(store, f"{self.run_prefix}%"))))
                for name in ("bench_naive_leases", "bench_naive_sentinels"):
                    if sa.inspect(connection).has_table(name):
                        connection.execute(
                            sa.text(f"DELETE FROM {name} WHERE slot LIKE :p"), {"p": f"{self.run_prefix}%"}
                        )
            store.close()


def store_targets(
    names: list[str], run_prefix: str, tmp_dir: Path, *, growth: bool = False
) -> tuple[list[StoreTarget], list[str]]:
    """The stores to benchmark among ``names``, and a note for each one left out.  ``growth``:
    variants ``waiters``, ``keys`` and ``waiting_keys`` in databases of their own, named after
    ``run_prefix``."""
    targets, skipped = [], []
    variants = ("waiters", "keys", "waiting_keys") if growth else ("main", "keys")
    for name in names:
        if name == "sqlite":
            urls = {variant: f"sqlite:///{tmp_dir / f'{run_prefix}-{variant}.db'}" for variant in variants}
            targets.append(StoreTarget(name, "sql", urls, run_prefix))
            continue
        service = {"postgresql": "postgres", "mariadb": "mysql", "redis": "redis"}[name]
        url = service_url(service)
        why = reachable(url)
        if why:
            skipped.append(f"{name}: {why}")
            continue
        if name == "redis":
            targets.append(StoreTarget(name, "redis", dict.fromkeys(variants, url), run_prefix))
            continue
        try:
            if growth:
                urls = {
                    variant: bench_database_url(url, variant, name=f"caps_growth_{variant}_{run_prefix}".lower())
                    for variant in variants
                }
            else:
                urls = {variant: bench_database_url(url, variant) for variant in variants}
        except sa.exc.SQLAlchemyError as exc:
            skipped.append(f"{name}: cannot create the benchmark databases ({type(exc).__name__}: {exc})")
            continue
        targets.append(StoreTarget(name, "sql", urls, run_prefix, own_databases=growth))
    return targets, skipped


def _server_database(url: sa.engine.URL) -> str:
    """A database to connect to while dropping another: the server's default one."""
    return "postgres" if url.get_backend_name() == "postgresql" else "mysql"


def populate_slot_names(target: StoreTarget, variant: str, names: list[str], limit: int = 4) -> None:
    """Give each of ``names`` a sentinel and one live lease (an hour long) in ``variant``.

    SQL: one bulk insert of the store's own rows; Redis: ``acquire`` per name (its
    data structures are the store's business).
    """
    if not names:
        return
    store = target.open(variant)
    try:
        if isinstance(store, SQLStore):
            store.create_schema()
            expires = time.time() + 3600
            empty = _name(store, "")
            sentinels = [
                {"run_id": "", "slot": _name(store, name), "task_id": empty, "holder": "", "slot_limit": limit}
                | {"expires_at": None}
                for name in names
            ]
            leases = [
                {"run_id": f"r-{name}", "slot": _name(store, name), "task_id": _name(store, f"t-{name}")}
                | {"holder": "bench"}
                | {"slot_limit": None, "expires_at": expires}
                for name in names
            ]
            with store.engine.begin() as connection:
                for rows in (sentinels, leases):
                    for start in range(0, len(rows), 2000):
                        connection.execute(concurrency_slots.insert(), rows[start : start + 2000])
        else:
            for name in names:
                store.acquire({name: limit}, f"t-{name}", f"r-{name}", "bench", 3600)
    finally:
        store.close()


def _name(store: SQLStore, text: str) -> Any:
    """A name column's value: MySQL's columns are VARBINARY (bytes), the others text."""
    return store.dialect.exact(text)


def populate_leases(target: StoreTarget, variant: str, slot: str, task_ids: list[str], limit: int) -> None:
    """Give ``slot`` one live lease (an hour long) per task id in ``task_ids``.

    SQL: the sentinel through ``acquire``, then one bulk insert of lease rows;
    Redis: ``acquire`` per task id.
    """
    store = target.open(variant)
    try:
        if isinstance(store, SQLStore):
            first = task_ids[0]
            if not store.acquire({slot: limit}, first, first, "bench", 3600).granted:
                raise RuntimeError(f"{target.name}: {slot} refused a lease while populating")
            expires = time.time() + 3600
            rows = [
                {"run_id": task_id, "slot": _name(store, slot), "task_id": _name(store, task_id), "holder": "bench"}
                | {"slot_limit": None, "expires_at": expires}
                for task_id in task_ids[1:]
            ]
            with store.engine.begin() as connection:
                for start in range(0, len(rows), 2000):
                    connection.execute(concurrency_slots.insert(), rows[start : start + 2000])
        else:
            for task_id in task_ids:
                if not store.acquire({slot: limit}, task_id, task_id, "bench", 3600).granted:
                    raise RuntimeError(f"{target.name}: {slot} refused a lease while populating")
    finally:
        store.close()


# -- adapters ----------------------------------------------------------------------------


class Adapter:
    """One way of taking and giving back a slot."""

    def prepare(self, slots: list[str], limit: int) -> None:
        """Create whatever the slots need before timing starts."""

    def acquire(self, slot: str, limit: int, token: str) -> bool:
        raise NotImplementedError

    def release(self, token: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CapsAdapter(Adapter):
    def __init__(self, store: SlotStore) -> None:
        self.store = store
        self.holder = f"bench/{os.getpid()}"

    def acquire(self, slot: str, limit: int, token: str) -> bool:
        return self.store.acquire({slot: limit}, token, token, self.holder, LEASE_SECONDS).granted

    def release(self, token: str) -> None:
        self.store.release(token)

    def close(self) -> None:
        self.store.close()


class PingAdapter(Adapter):
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def acquire(self, slot: str, limit: int, token: str) -> bool:
        self.client.ping()
        return True

    def release(self, token: str) -> None:
        pass

    def close(self) -> None:
        self.client.close()


class SelectOneAdapter(Adapter):
    """``SELECT 1``: on an autocommit driver connection, or in a SQLAlchemy ``engine.begin()``."""

    def __init__(self, store: SQLStore, *, through_sqlalchemy: bool) -> None:
        self.store = store
        self.engine = store.engine
        self.through_sqlalchemy = through_sqlalchemy
        self.statement = sa.text("SELECT 1")
        self.raw: Any = None
        if not through_sqlalchemy:
            self.raw = _driver_connection(self.engine, autocommit=True)
            self.cursor = self.raw.cursor()

    def acquire(self, slot: str, limit: int, token: str) -> bool:
        if self.through_sqlalchemy:
            with self.engine.begin() as connection:
                connection.execute(self.statement).fetchall()
        else:
            self.cursor.execute("SELECT 1")
            self.cursor.fetchall()
        return True

    def release(self, token: str) -> None:
        pass

    def close(self) -> None:
        if self.raw is not None:
            with contextlib.suppress(Exception):
                self.raw.close()
        self.store.close()


def _driver_connection(engine: sa.Engine, *, autocommit: bool) -> Any:
    """A new bare DBAPI connection with the engine's connect arguments (no pool, no SQLAlchemy)."""
    pooled = engine.raw_connection()
    connection = pooled.driver_connection
    pooled.detach()  # ours now: the pool forgets it
    dialect = engine.dialect.name
    if dialect == "postgresql":
        connection.autocommit = autocommit
    elif dialect in ("mysql", "mariadb"):
        connection.autocommit(autocommit)
    # SQLite: the store's connect hook already set isolation_level=None (we BEGIN ourselves).
    return connection


_NAIVE_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS bench_naive_sentinels (slot VARCHAR(255) PRIMARY KEY, slot_limit INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS bench_naive_leases (run_id VARCHAR(128) PRIMARY KEY, slot VARCHAR(255) NOT NULL, "
    "expires_at DOUBLE PRECISION NOT NULL)",
)
_NAIVE_INDEX = "CREATE INDEX ix_bench_naive_leases_slot ON bench_naive_leases (slot, expires_at)"


class NaiveSqlAdapter(Adapter):
    """The admission transaction one writes by hand: lock, count, insert; release: delete.

    Lease expiry uses the client's clock (a naive choice, and one round trip
    cheaper than the store's clock); the lock is a ``FOR UPDATE`` on a sentinel
    row (SQLite has no row locks: ``BEGIN IMMEDIATE`` locks the database).
    """

    def __init__(self, store: SQLStore, *, raw: bool) -> None:
        self.store = store
        self.engine = store.engine
        self.dialect = "mysql" if self.engine.dialect.name == "mariadb" else self.engine.dialect.name
        self.raw = raw
        lock = "" if self.dialect == "sqlite" else " FOR UPDATE"
        self.sql = {
            "lock": f"SELECT slot_limit FROM bench_naive_sentinels WHERE slot = :slot{lock}",
            "count": "SELECT COUNT(*) FROM bench_naive_leases WHERE slot = :slot AND expires_at > :now",
            "insert": "INSERT INTO bench_naive_leases (run_id, slot, expires_at) VALUES (:run_id, :slot, :expires)",
            "release": "DELETE FROM bench_naive_leases WHERE run_id = :run_id",
        }
        self.text = {name: sa.text(sql) for name, sql in self.sql.items()}
        placeholder = "?" if self.dialect == "sqlite" else "%s"
        self.driver_sql = {
            name: sql.replace(":slot", placeholder)
            .replace(":now", placeholder)
            .replace(":run_id", placeholder)
            .replace(":expires", placeholder)
            for name, sql in self.sql.items()
        }
        self.connection: Any = None
        if raw:
            self.connection = _driver_connection(self.engine, autocommit=False)
            self.cursor = self.connection.cursor()

    def prepare(self, slots: list[str], limit: int) -> None:
        ignore = {
            "postgresql": "INSERT INTO bench_naive_sentinels VALUES (:slot, :limit) ON CONFLICT DO NOTHING",
            "mysql": "INSERT IGNORE INTO bench_naive_sentinels VALUES (:slot, :limit)",
            "sqlite": "INSERT OR IGNORE INTO bench_naive_sentinels VALUES (:slot, :limit)",
        }[self.dialect]
        with self.engine.begin() as connection:
            for slot in slots:
                connection.execute(sa.text(ignore), {"slot": slot, "limit": limit})

    def create_schema(self) -> None:
        """The naive tables (once, before any client runs: concurrent DDL races)."""
        with self.engine.begin() as connection:
            has_table = sa.inspect(connection).has_table("bench_naive_leases")
            for statement in _NAIVE_SCHEMA:
                connection.exec_driver_sql(statement)
            if not has_table:
                connection.exec_driver_sql(_NAIVE_INDEX)

    def acquire(self, slot: str, limit: int, token: str) -> bool:
        now = time.time()
        if self.raw:
            return self._acquire_raw(slot, limit, token, now)
        with self.engine.begin() as connection:
            connection.execute(self.text["lock"], {"slot": slot}).fetchall()
            held = connection.execute(self.text["count"], {"slot": slot, "now": now}).scalar_one()
            if held >= limit:
                return False
            connection.execute(self.text["insert"], {"run_id": token, "slot": slot, "expires": now + LEASE_SECONDS})
            return True

    def _acquire_raw(self, slot: str, limit: int, token: str, now: float) -> bool:
        cursor, sql = self.cursor, self.driver_sql
        if self.dialect == "sqlite":
            cursor.execute("BEGIN IMMEDIATE")
        try:
            cursor.execute(sql["lock"], (slot,))
            cursor.fetchall()
            cursor.execute(sql["count"], (slot, now))
            (held,) = cursor.fetchone()
            granted = held < limit
            if granted:
                cursor.execute(sql["insert"], (token, slot, now + LEASE_SECONDS))
        except Exception:
            self.connection.rollback()
            raise
        self.connection.commit()
        return granted

    def release(self, token: str) -> None:
        if self.raw:
            if self.dialect == "sqlite":
                self.cursor.execute("BEGIN IMMEDIATE")
            self.cursor.execute(self.driver_sql["release"], (token,))
            self.connection.commit()
            return
        with self.engine.begin() as connection:
            connection.execute(self.text["release"], {"run_id": token})

    def close(self) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                self.connection.close()
        self.store.close()


class DramatiqAdapter(Adapter):
    """dramatiq's ``ConcurrentRateLimiter`` (Redis backend), through its public context manager."""

    def __init__(self, url: str, key_prefix: str) -> None:
        from dramatiq.rate_limits import ConcurrentRateLimiter
        from dramatiq.rate_limits.backends import RedisBackend

        self.client = redis.Redis.from_url(url)
        self.backend = RedisBackend(client=self.client)
        self.limiter_class = ConcurrentRateLimiter
        self.key_prefix = key_prefix
        self.limiters: dict[tuple[str, int], Any] = {}
        self.held: dict[str, Any] = {}

    def acquire(self, slot: str, limit: int, token: str) -> bool:
        limiter = self.limiters.get((slot, limit))
        if limiter is None:
            key = f"{self.key_prefix}:{slot}"
            limiter = self.limiter_class(self.backend, key, limit=limit, ttl=int(LEASE_SECONDS * 1000))
            self.limiters[(slot, limit)] = limiter
        context = limiter.acquire(raise_on_failure=False)
        acquired = bool(context.__enter__())
        if acquired:
            self.held[token] = context
        else:
            context.__exit__(None, None, None)
        return acquired

    def release(self, token: str) -> None:
        self.held.pop(token).__exit__(None, None, None)

    def close(self) -> None:
        self.client.close()


# -- the pool -------------------------------------------------------------------------------


@dataclass
class Job:
    """What the clients of one measurement do."""

    adapter: str
    variant: str = "main"
    #: The slot name; with ``distinct`` each client uses ``slot-<client index>``.
    slot: str = ""
    limit: int = 4
    distinct: bool = False
    #: With ``keys``: each attempt picks one of these slot names (round robin per client).
    keys: list[str] = field(default_factory=list)
    #: Seconds a granted client holds the slot before releasing it.
    hold: float = 0.0
    #: Seconds a refused client waits before trying again.
    retry_pause: float = 0.0
    #: Count holders in the shared counter (to catch a cap exceeded).
    check: bool = False


@dataclass
class Outcome:
    """What the clients of one measurement saw, merged."""

    clients: int
    seconds: float
    granted: array[float]
    refused: array[float]
    released: array[float]
    errors: int
    peak: int
    error_samples: list[str]

    @property
    def attempts(self) -> array[float]:
        return self.granted + self.refused

    def rate(self) -> float:
        """Granted admissions (acquire + release pairs) per second, all clients together."""
        return len(self.granted) / self.seconds if self.seconds else 0.0

    def p(self, which: str, fraction: float) -> float:
        return percentile(getattr(self, which), fraction)


class ClientPool:
    """``size`` forked client processes that run :class:`Job` s together and report latencies."""

    def __init__(self, target: StoreTarget, size: int) -> None:
        context = multiprocessing.get_context("fork")
        self.target = target
        self.inside = context.Value("i", 0)
        self.peak = context.Value("i", 0)
        self.connections: list[multiprocessing.connection.Connection] = []
        self.processes: list[Any] = []
        for index in range(size):
            parent_end, child_end = context.Pipe()
            # The child closes the parent's ends of the earlier children's pipes it inherits:
            # otherwise no child would see EOF (and exit) should this process die.
            inherited = [*self.connections, parent_end]
            process = context.Process(
                target=_client_main, args=(child_end, inherited, target, index, self.inside, self.peak)
            )
            process.daemon = True
            process.start()
            child_end.close()
            self.connections.append(parent_end)
            self.processes.append(process)

    def run(self, clients: int, job: Job, seconds: float, timeout: float = 120.0, attempts: int = 3) -> Outcome:
        """Run ``job`` on the first ``clients`` processes for ``seconds``; merge what they saw.

        A client that cannot get ready (say, the server has no connection left for
        it: other users share it) makes the whole measurement wait a few seconds
        and start again, up to ``attempts`` times.
        """
        chosen = self.connections[:clients]
        for attempt in range(1, attempts + 1):
            with self.inside.get_lock():
                self.inside.value = 0
            with self.peak.get_lock():
                self.peak.value = 0
            for connection in chosen:
                connection.send(("prepare", job))
            # Every client answers each message once: read them all, even after an error.
            ready = [_receive(connection, timeout) for connection in chosen]
            failures = [message[1] for message in ready if message[0] != "ready"]
            if not failures:
                break
            if attempt == attempts:
                raise RuntimeError(f"{len(failures)} benchmark client(s) failed to get ready: {failures[0]}")
            time.sleep(3 * attempt)
        start_at = time.monotonic() + 0.05
        for connection in chosen:
            connection.send(("go", start_at, start_at + seconds))
        replies = [_receive(connection, timeout + seconds) for connection in chosen]
        failures = [message[1] for message in replies if message[0] != "done"]
        if failures:
            raise RuntimeError(f"{len(failures)} benchmark client(s) failed: {failures[0]}")
        results = [message[1] for message in replies]
        outcome = Outcome(clients, seconds, array("d"), array("d"), array("d"), 0, self.peak.value, [])
        elapsed = []
        for result in results:
            outcome.granted.extend(result["granted"])
            outcome.refused.extend(result["refused"])
            outcome.released.extend(result["released"])
            outcome.errors += result["errors"]
            outcome.error_samples.extend(result["error_samples"])
            elapsed.append(result["elapsed"])
        outcome.seconds = max(elapsed)
        return outcome

    def close(self) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError, BrokenPipeError):
                connection.send(("stop",))
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def _receive(connection: multiprocessing.connection.Connection, timeout: float) -> Any:
    if not connection.poll(timeout):
        raise TimeoutError(f"a benchmark client did not answer within {timeout:.0f} s")
    return connection.recv()


def _client_main(
    connection: multiprocessing.connection.Connection,
    inherited: list[multiprocessing.connection.Connection],
    target: StoreTarget,
    index: int,
    inside: Any,
    peak: Any,
) -> None:
    for other in inherited:
        other.close()
    parent = os.getppid()
    current: tuple[str, str] | None = None
    adapter: Adapter | None = None
    job: Job | None = None
    try:
        while True:
            while not connection.poll(1.0):
                if os.getppid() != parent:  # orphaned: the benchmark died
                    return
            message = connection.recv()
            if message[0] == "stop":
                break
            try:
                if message[0] == "prepare":
                    job = message[1]
                    if adapter is None or current != (job.adapter, job.variant):
                        if adapter is not None:
                            adapter.close()
                            adapter = None
                        current = None
                        adapter = target.adapter(job.adapter, job.variant)
                        current = (job.adapter, job.variant)
                    slots = job.keys or [f"{job.slot}-{index}" if job.distinct else job.slot]
                    adapter.prepare(slots[:1] if job.keys else slots, job.limit)
                    # Warm up: connections open, statements prepared, scripts loaded.
                    warm = f"{target.run_prefix}-warm-{index}"
                    adapter.prepare([warm], 1)
                    for attempt in range(3):
                        token = f"{target.run_prefix}-w{index}-{os.getpid()}-{attempt}-{time.monotonic_ns()}"
                        if adapter.acquire(warm, 1, token):
                            adapter.release(token)
                    connection.send(("ready", None))
                elif message[0] == "go":
                    assert adapter is not None and job is not None
                    connection.send(("done", _measure(adapter, job, index, message[1], message[2], inside, peak)))
            except Exception as exc:
                if message[0] == "prepare" and adapter is not None:
                    # Start from a fresh adapter next time: this one may be half set up.
                    with contextlib.suppress(Exception):
                        adapter.close()
                    adapter = None
                text = str(exc).splitlines()[0][:300] if str(exc) else ""
                connection.send(("error", f"client {index} ({current}): {type(exc).__name__}: {text}"))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if adapter is not None:
            with contextlib.suppress(Exception):
                adapter.close()


def _measure(
    adapter: Adapter, job: Job, index: int, start_at: float, end_at: float, inside: Any, peak: Any
) -> dict[str, Any]:
    granted, refused, released = array("d"), array("d"), array("d")
    errors, error_samples = 0, []
    slot = f"{job.slot}-{index}" if job.distinct else job.slot
    keys = job.keys
    token_prefix = f"{job.slot or 'k'}-{index}-{os.getpid()}-{time.monotonic_ns()}-"
    clock = time.perf_counter
    attempt = 0
    delay = start_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    started = time.monotonic()
    while time.monotonic() < end_at:
        token = token_prefix + str(attempt)
        if keys:
            slot = keys[(index * 7919 + attempt) % len(keys)]
        attempt += 1
        before = clock()
        try:
            ok = adapter.acquire(slot, job.limit, token)
        except Exception as exc:
            errors += 1
            if len(error_samples) < 3:
                error_samples.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.01)
            continue
        after = clock()
        if not ok:
            refused.append(after - before)
            if job.retry_pause:
                time.sleep(job.retry_pause)
            continue
        granted.append(after - before)
        if job.check:
            with inside.get_lock():
                inside.value += 1
                if inside.value > peak.value:
                    peak.value = inside.value
        if job.hold:
            time.sleep(job.hold)
        if job.check:
            with inside.get_lock():
                inside.value -= 1
        before = clock()
        try:
            adapter.release(token)
        except Exception as exc:
            errors += 1
            if len(error_samples) < 3:
                error_samples.append(f"release {type(exc).__name__}: {exc}")
            continue
        released.append(clock() - before)
    return {
        "granted": granted,
        "refused": refused,
        "released": released,
        "errors": errors,
        "error_samples": error_samples,
        "elapsed": time.monotonic() - started,
    }


#: The store's tables on PostgreSQL (the waiting list churns like the leases).
STORE_TABLES = ("concurrency_slots", "concurrency_waiters", "concurrency_waitlists")


def vacuum_database(url: str, *, full: bool = False) -> None:
    """``VACUUM ANALYZE`` (``full``: ``VACUUM FULL ANALYZE``) the store's tables and the naive
    peer's tables of a PostgreSQL benchmark database.

    Every admission leaves a dead row behind when it is released; until a vacuum
    removes them, counting a slot's live leases walks their index entries too, and
    hundreds of thousands of them bloat the table and its indexes until the
    planner prefers a sequential scan even to delete one lease by its key.
    Autovacuum prevents that in production (it was off on the server these
    benchmarks were written on), so the benchmarks compact their own tables at
    the start of each part and vacuum them between rounds, rather than measure
    how long ago the last vacuum ran.
    """
    if not url.startswith("postgresql"):
        return
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            rewritten = False
            for table in (*STORE_TABLES, "bench_naive_leases", "bench_naive_sentinels"):
                if not sa.inspect(connection).has_table(table):
                    continue
                size = connection.exec_driver_sql(f"SELECT pg_total_relation_size('{table}')").scalar() or 0
                # Rewriting is only worth it (and only done) for a bloated table.
                rewrite = full and size > _BLOATED_BYTES
                connection.exec_driver_sql(f"VACUUM {'(FULL, ANALYZE)' if rewrite else '(ANALYZE)'} {table}")
                rewritten = rewritten or rewrite
            if rewritten:
                # A rewrite fills the WAL; flush it now rather than under the measurements.
                with contextlib.suppress(sa.exc.DBAPIError):
                    connection.exec_driver_sql("CHECKPOINT")
    finally:
        engine.dispose()


def caps_url_for(store: str, options: Any) -> tuple[str | None, str]:
    """The ``caps_url`` workers use for ``store`` (SQL: the benchmark database), or None and why not."""
    if store == "sqlite":
        return f"sqlite:///{Path(options.tmp_dir) / 'workers.db'}", ""
    service = {"postgresql": "postgres", "mariadb": "mysql", "redis": "redis"}[store]
    url = service_url(service)
    why = reachable(url)
    if why:
        return None, why
    if store == "redis":
        return url, ""
    try:
        bench_url = bench_database_url(url, "main")
        vacuum_database(bench_url, full=True)
        return bench_url, ""
    except sa.exc.SQLAlchemyError as exc:
        return None, f"cannot create the benchmark database ({type(exc).__name__})"


def drop_slots(caps_url: str, prefix: str) -> None:
    """Delete what workers left under slot names starting with ``prefix``, through the store's
    own calls where it has them: the waiters of a trial that did not complete (``forget``, with
    their dispatch leases), stray leases (``release``), then the sentinels."""
    store = store_from_url(caps_url)
    try:
        if isinstance(store, ParkingStore):
            for task_id in sorted({waiter.task_id for waiter in store.waiters() if waiter.slot.startswith(prefix)}):
                store.forget(task_id, 1.0)
        for run_id in sorted({lease.run_id for lease in store.leases() if lease.slot.startswith(prefix)}):
            store.release(run_id)
        if isinstance(store, RedisStore):
            limits = f"{store.key_prefix}:limits"
            for name, _ in store.client.hscan_iter(limits, match=f"{prefix}*"):
                store.client.hdel(limits, name)
            # The index of keyed slot names (a per-key cap's slots join it as they are admitted).
            keyed = f"{store.key_prefix}:keyed"
            for name, _ in store.client.zscan_iter(keyed, match=f"{prefix}*"):
                store.client.zrem(keyed, name)
            return
        assert isinstance(store, SQLStore)
        with store.engine.begin() as connection:
            pattern = _name(store, f"{prefix}%")
            connection.execute(concurrency_slots.delete().where(concurrency_slots.c.slot.like(pattern)))
    finally:
        store.close()
