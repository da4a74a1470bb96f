"""The SQL store's transactions run at the isolation admission needs, whatever the server's default.

Admission locks a slot's sentinel, then counts its holders in a statement after the lock: at
READ COMMITTED that count sees every competitor that committed while it waited; at REPEATABLE
READ it reads the snapshot of before the wait, and grants a slot beyond its limit.  PostgreSQL's
``default_transaction_isolation`` is often ``repeatable read`` for a database or a role, and
MySQL/MariaDB default to REPEATABLE READ: these tests run the store on servers configured so (a
PostgreSQL database and a role of their own, the same database through PgBouncer, the shared
MariaDB's default), through a URL and through a ready ``Engine``, and check what the start-up
check (``celery caps check``) reports.  A private MariaDB with its binary log in
``binlog_format=STATEMENT`` (which refuses writes at READ COMMITTED) must be refused by name.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_caps.errors import StoreError
from celery_caps.health import check_store
from celery_caps.stores import store_from_url
from celery_caps.stores.base import SlotStore
from celery_caps.stores.sql import SQLStore
from celery_caps.stores.sql.postgresql import PostgreSQLStore
from tests.integration.test_worker_start import stop
from tests.services import require_service

#: Clients racing for the last slot, and rounds of the race.
RACERS = 8
ROUNDS = 30
LEASE = 60.0
HOLDER = "celery-caps-check/test"

# -- servers configured as operators do -------------------------------------------------------


@contextlib.contextmanager
def admin_engine() -> Iterator[sa.Engine]:
    """An autocommit engine on the PostgreSQL test server (its database ``test`` as written in the
    variable, no query options), as the variable's user (a superuser)."""
    server = sa.engine.make_url(require_service("postgres")).set(query={})
    engine = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        yield engine
    finally:
        engine.dispose()


@contextlib.contextmanager
def repeatable_read_database(server: sa.engine.URL | None = None) -> Iterator[str]:
    """A URL on a PostgreSQL database of its own whose default isolation is REPEATABLE READ
    (``ALTER DATABASE ... SET default_transaction_isolation``), dropped afterwards; reached at
    ``server`` (a pooler, say) if given, else directly."""
    name = f"caps_iso_{uuid.uuid4().hex[:12]}"
    with admin_engine() as admin:
        with admin.connect() as connection:
            connection.exec_driver_sql(f"CREATE DATABASE {name}")
            connection.exec_driver_sql(f"ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'")
        try:
            yield (server or admin.url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture(name="repeatable_read_url")
def repeatable_read_url_fixture() -> Iterator[str]:
    with repeatable_read_database() as url:
        yield url


@pytest.fixture
def repeatable_read_role() -> Iterator[str]:
    """A URL as a PostgreSQL role of its own whose default isolation is REPEATABLE READ
    (``ALTER ROLE ... SET``), on a database it owns; both dropped afterwards."""
    name = f"caps_iso_{uuid.uuid4().hex[:12]}"
    with admin_engine() as admin:
        with admin.connect() as connection:
            connection.exec_driver_sql(f"CREATE ROLE {name} LOGIN")
            connection.exec_driver_sql(f"ALTER ROLE {name} SET default_transaction_isolation = 'repeatable read'")
            connection.exec_driver_sql(f"CREATE DATABASE {name} OWNER {name}")
        try:
            yield admin.url.set(username=name, database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
                connection.exec_driver_sql(f"DROP ROLE {name}")


def plain_engine(url: str) -> sa.Engine:
    """An engine as a user builds one: no options (its sessions keep the server's default)."""
    return sa.create_engine(url)


def session_default(url: str, query: str = "SHOW default_transaction_isolation") -> str:
    """The isolation a plain session on ``url`` starts with (what the store would run at if it
    set none)."""
    engine = plain_engine(url)
    try:
        with engine.connect() as connection:
            return str(connection.exec_driver_sql(query).scalar())
    finally:
        engine.dispose()


# -- the race --------------------------------------------------------------------------------


def race_for_the_last_slot(stores: list[SlotStore], rounds: int = ROUNDS) -> list[int]:
    """``rounds`` races of every store, each in a thread of its own, released together, for a
    slot of limit 1 whose sentinel row is there already (a slot used before): the number of
    runs granted in each round."""
    prefix = f"race-{uuid.uuid4().hex[:8]}:"
    for store in stores:
        store.warm_up()
    barrier = threading.Barrier(len(stores))
    granted: list[list[str]] = [[] for _ in range(rounds)]
    errors: list[BaseException] = []

    def racer(store: SlotStore) -> None:
        try:
            for number in range(rounds):
                run_id = uuid.uuid4().hex
                barrier.wait(timeout=60)
                if store.acquire({f"{prefix}{number}": 1}, run_id, run_id, HOLDER, LEASE).granted:
                    granted[number].append(run_id)
                barrier.wait(timeout=60)  # every racer has asked: the holders give the slot back
                if run_id in granted[number]:
                    store.release(run_id)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    # Given each round's slot with its sentinel row already there
    first = stores[0]
    for number in range(rounds):
        run_id = uuid.uuid4().hex
        assert first.acquire({f"{prefix}{number}": 1}, run_id, run_id, HOLDER, LEASE).granted
        assert first.release(run_id) == 1
    # When every store asks for it at once, round after round
    threads = [threading.Thread(target=racer, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    first.prune(prefix)
    return [len(runs) for runs in granted]


@contextlib.contextmanager
def racers(make: Callable[[int], SlotStore], count: int = RACERS) -> Iterator[list[SlotStore]]:
    """``count`` stores (``make(number)``), each as a worker process of its own would have it;
    closed afterwards."""
    stores: list[SlotStore] = []
    try:
        for number in range(count):
            stores.append(make(number))
        yield stores
    finally:
        for store in stores:
            store.close()


@contextlib.contextmanager
def engines(url: str, count: int = RACERS) -> Iterator[list[sa.Engine]]:
    made = [plain_engine(url) for _ in range(count)]
    try:
        yield made
    finally:
        for engine in made:
            engine.dispose()


def assert_one_holder_per_round(holders: list[int]) -> None:
    # Then each round had exactly one holder: never two at once, never nobody
    assert max(holders) == 1, holders
    assert min(holders) == 1, holders


def assert_checked_at_read_committed(store: SlotStore) -> None:
    """The start-up check passes, reporting READ COMMITTED, with nothing to warn about."""
    result = check_store(store, HOLDER)
    assert result.warnings == []
    assert result.isolation == "READ COMMITTED"


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.mark.postgres
def test_a_database_whose_default_is_repeatable_read_never_admits_two_to_a_slot_of_limit_1(
    repeatable_read_url: str,
) -> None:
    assert session_default(repeatable_read_url) == "repeatable read"
    with racers(lambda _number: store_from_url(repeatable_read_url)) as stores:
        assert isinstance(stores[0], PostgreSQLStore)
        assert_one_holder_per_round(race_for_the_last_slot(stores))


@pytest.mark.postgres
def test_a_role_whose_default_is_repeatable_read_never_admits_two_to_a_slot_of_limit_1(
    repeatable_read_role: str,
) -> None:
    assert session_default(repeatable_read_role) == "repeatable read"
    with racers(lambda _number: store_from_url(repeatable_read_role)) as stores:
        assert_one_holder_per_round(race_for_the_last_slot(stores))


@pytest.mark.postgres
def test_an_engine_handed_in_on_a_repeatable_read_database_never_admits_two(repeatable_read_url: str) -> None:
    # Given engines built by the user, whose sessions keep the database's REPEATABLE READ
    with engines(repeatable_read_url) as made, racers(lambda number: store_from_url(made[number])) as stores:
        assert isinstance(stores[0], PostgreSQLStore)
        assert_one_holder_per_round(race_for_the_last_slot(stores))
        # and the engine handed in is left as it was: its own transactions keep its level
        engine = stores[0].engine
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SHOW transaction_isolation").scalar() == "repeatable read"


@pytest.mark.postgres
def test_the_portable_store_on_an_engine_handed_in_never_admits_two(repeatable_read_url: str) -> None:
    # Given the portable store (each step a transaction of several statements through SQLAlchemy)
    with engines(repeatable_read_url) as made, racers(lambda number: SQLStore(made[number])) as stores:
        assert_one_holder_per_round(race_for_the_last_slot(stores))


@pytest.mark.postgres
def test_the_store_check_reports_read_committed_on_a_repeatable_read_database(repeatable_read_url: str) -> None:
    engine = plain_engine(repeatable_read_url)
    try:
        for store in (store_from_url(repeatable_read_url), store_from_url(engine), SQLStore(engine)):
            try:
                assert_checked_at_read_committed(store)
                kinds = {"transactions", "single statements", "reads"}
                if isinstance(store, PostgreSQLStore):
                    kinds.add("function calls")
                assert store.isolation_levels() == dict.fromkeys(kinds, "READ COMMITTED")  # type: ignore[attr-defined]
            finally:
                store.close()
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_store_check_fails_loudly_when_an_engine_overrides_the_level(repeatable_read_url: str) -> None:
    # Given an engine whose own event makes every transaction SERIALIZABLE
    engine = plain_engine(repeatable_read_url)

    @sa.event.listens_for(engine, "begin")
    def serializable(connection: sa.Connection) -> None:
        connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")

    store = store_from_url(engine)
    try:
        result = check_store(store, HOLDER)
    finally:
        store.close()
        engine.dispose()
    # Then the check says which of the store's transactions run at which level, and fails
    assert result.isolation == "SERIALIZABLE (transactions, single statements, reads); READ COMMITTED (function calls)"
    [problem] = result.warnings
    assert "transactions and single statements and reads run at SERIALIZABLE, not READ COMMITTED" in problem
    assert "beyond its limit" in problem


@pytest.mark.pgbouncer
@pytest.mark.parametrize("pooler_service", ["pgbouncer-tx", "pgbouncer-session"])
def test_through_a_pooler_a_repeatable_read_database_never_admits_two(
    pooler_service: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a REPEATABLE READ database reached through PgBouncer (in transaction pooling, no session
    # setting of a client lasts beyond its transaction)
    pooler = sa.engine.make_url(require_service(pooler_service)).set(query={})
    with repeatable_read_database(pooler) as url, caplog.at_level(logging.WARNING, "celery_caps"):
        assert session_default(url) == "repeatable read"
        with racers(lambda _number: store_from_url(url)) as stores:
            assert_one_holder_per_round(race_for_the_last_slot(stores))
            assert_checked_at_read_committed(stores[0])
        # and the sessions other clients get from the pooler keep their own default
        assert session_default(url) == "repeatable read"
    # and each store said once what it costs, and how to save it
    said = [record.getMessage() for record in caplog.records if "a transaction of its own" in record.getMessage()]
    assert len(said) == RACERS
    assert "default to REPEATABLE READ" in said[0]
    assert "default_transaction_isolation = 'read committed' for the role or the database" in said[0]


# -- MySQL/MariaDB ---------------------------------------------------------------------------


def admission_levels(store: SlotStore, engine: sa.Engine) -> list[str]:
    """The isolation level the connection is at each time ``store`` admits (read with
    SQLAlchemy's own dialect, on the connection the admission's statements run on), over a
    few admissions and releases."""
    seen: list[str] = []

    def read_level(connection: sa.Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith("INSERT INTO concurrency_slots"):
            seen.append(engine.dialect.get_isolation_level(connection.connection.dbapi_connection))  # type: ignore[arg-type]

    sa.event.listen(engine, "after_cursor_execute", read_level)
    slot = f"iso-{uuid.uuid4().hex[:8]}:a"
    try:
        for _ in range(3):
            run_id = uuid.uuid4().hex
            assert store.acquire({slot: 1}, run_id, run_id, HOLDER, LEASE).granted
            store.release(run_id)
    finally:
        sa.event.remove(engine, "after_cursor_execute", read_level)
        store.prune(slot)
    return seen


@pytest.mark.mysql
@pytest.mark.parametrize("given", ["url", "engine"])
def test_mysql_transactions_run_at_read_committed_whatever_the_sessions_default(given: str) -> None:
    url = require_service("mysql")
    # Given a server whose sessions start at REPEATABLE READ (MariaDB's and MySQL's default)
    if session_default(url, "SELECT @@tx_isolation").upper() != "REPEATABLE-READ":
        pytest.skip("the MySQL test server's default isolation is not REPEATABLE READ")
    user_engine = plain_engine(url)
    store = store_from_url(url if given == "url" else user_engine)
    try:
        # Then the store's transactions run at READ COMMITTED, from a URL and from an engine handed in
        levels = admission_levels(store, store.engine)  # type: ignore[attr-defined]
        assert levels and set(levels) == {"READ COMMITTED"}, levels
        # and its start-up check says so
        assert_checked_at_read_committed(store)
        # and an engine handed in gives its connections back at its own level
        with user_engine.connect() as connection:
            assert str(connection.exec_driver_sql("SELECT @@tx_isolation").scalar()).upper() == "REPEATABLE-READ"
    finally:
        store.close()
        user_engine.dispose()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def statement_binlog_mariadb() -> Iterator[str]:
    """A private MariaDB server (its own data directory and port) with binary logging on in
    ``binlog_format=STATEMENT``; stopped and removed afterwards.  Skips where MariaDB's server
    binaries are not installed."""
    install, server = shutil.which("mariadb-install-db"), shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    if install is None or not Path(server).exists():
        pytest.skip("MariaDB's server (mariadbd, mariadb-install-db) is not installed")
    directory = Path(tempfile.mkdtemp(prefix="caps-mdb-"))
    as_root = ["--user=root"] if Path("/proc/self").stat().st_uid == 0 else []
    port = _free_port()
    process: subprocess.Popen[bytes] | None = None
    try:
        data = f"--datadir={directory}/data"
        # mariadb-install-db failed once in CI (exit 1, py313 while py310 ran the same suite), and
        # passed on the next run: tried up to three times, each in a fresh data directory, and
        # its own output said if all fail.
        for attempt in range(3):
            shutil.rmtree(directory / "data", ignore_errors=True)
            installed = subprocess.run(
                [install, "--no-defaults", data, "--auth-root-authentication-method=normal", *as_root],
                capture_output=True,
                timeout=120,
            )
            if installed.returncode == 0:
                break
            time.sleep(1.0 + attempt)
        else:
            raise AssertionError(
                f"mariadb-install-db failed 3 times (exit {installed.returncode}): "
                f"{installed.stdout.decode(errors='replace')[-2000:]}{installed.stderr.decode(errors='replace')[-2000:]}"
            )
        files = [f"--socket={directory}/s.sock", f"--pid-file={directory}/s.pid", f"--log-error={directory}/error.log"]
        binlog = [f"--log-bin={directory}/data/binlog", "--binlog-format=STATEMENT", "--server-id=1"]
        process = subprocess.Popen(
            [server, "--no-defaults", data, f"--port={port}", "--bind-address=127.0.0.1", *files, *binlog, *as_root],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"mysql+pymysql://root@127.0.0.1:{port}/test"
        probe = sa.create_engine(url)
        deadline = time.monotonic() + 60
        while True:
            try:
                with probe.connect() as connection:
                    connection.exec_driver_sql("CREATE DATABASE IF NOT EXISTS test")
                break
            except sa.exc.OperationalError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
            finally:
                probe.dispose()
        yield url
    finally:
        if process is not None:
            stop(process, timeout=60)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.mysql
def test_a_statement_binlog_is_refused_by_name(statement_binlog_mariadb: str) -> None:
    # Given a MariaDB that logs statements, which refuses writes at READ COMMITTED
    store = store_from_url(statement_binlog_mariadb)
    try:
        # Then the start-up check, and every call, fail naming the setting and what to set
        for attempt in (lambda: check_store(store, HOLDER), lambda: store.acquire({"iso:a": 1}, "t", "r", HOLDER, 9)):
            with pytest.raises(StoreError, match="binlog_format=STATEMENT") as raised:
                attempt()
            assert "set binlog_format=ROW (or MIXED)" in str(raised.value)
    finally:
        store.close()


# -- SQLite ----------------------------------------------------------------------------------


@pytest.mark.sqlite
def test_sqlite_serialises_its_writers_and_says_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/caps.db"
    with racers(lambda _number: store_from_url(url), count=4) as stores:
        assert_one_holder_per_round(race_for_the_last_slot(stores, rounds=10))
        result = check_store(stores[0], HOLDER)
    assert result.warnings == []
    assert result.isolation == "SERIALIZABLE"
