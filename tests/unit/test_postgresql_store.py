"""PostgreSQL's own store (``celery_caps/stores/sql/postgresql.py``): its functions, its pool of
hot-path connections, its warm-up.

Each test runs in a schema of its own (``private_sql_url``), so that it can count the
connections it opened and see the functions it created, and nobody else's.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_caps.errors import ConfigurationError, StoreError
from celery_caps.stores import store_from_url
from celery_caps.stores.base import Admission, ParkOutcome, ParkRequest
from celery_caps.stores.sql import SCHEMA_VERSION, SQLStore
from celery_caps.stores.sql.postgresql import (
    WARM_UP_SLOT_PREFIX,
    PostgreSQLStore,
    function_statements,
    functions_digest,
)
from tests.services import private_sql_url

pytestmark = pytest.mark.postgres

LEASE = 120.0
HOLDER = "w1@host/1"


@pytest.fixture
def url() -> Iterator[str]:
    """A URL on a schema of this test's own, with an application name that tells its connections."""
    with private_sql_url("postgres") as private:
        parsed = sa.engine.make_url(private)
        yield parsed.update_query_dict({"application_name": f"caps-{uuid.uuid4().hex[:10]}"}).render_as_string(
            hide_password=False
        )


@pytest.fixture
def store(url: str) -> Iterator[PostgreSQLStore]:
    opened = store_from_url(url)
    assert isinstance(opened, PostgreSQLStore)
    try:
        yield opened
    finally:
        opened.close()


def server_connections(store: SQLStore) -> int:
    """The server sessions this store's URL opened (by its application name), not counting the one asking."""
    name = store.engine.url.query["application_name"]
    # A connection of its own (not from the store's engine, whose pool it would keep busy), named
    # apart so that it does not count itself.
    probe = sa.create_engine(
        store.engine.url.update_query_dict({"application_name": "caps-probe"}), poolclass=sa.pool.NullPool
    )
    try:
        with probe.connect() as connection:
            count = connection.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :name"), {"name": name}
            ).scalar()
    finally:
        probe.dispose()
    return int(count or 0)


def driver_connections(store: SQLStore, expected: int) -> int:
    """The server sessions of the store's driver pool: those of its URL once its engine (which
    the operators' reads and this module's checks use, and which keeps a connection until idle)
    has closed its own; waits up to 10 s for their server processes to exit."""
    store.engine.dispose()
    deadline = time.monotonic() + 10
    while server_connections(store) > expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return server_connections(store)


def admit(store: SQLStore, slot: str, task_id: str) -> str:
    run_id = uuid.uuid4().hex
    assert store.acquire({slot: 1}, task_id, run_id, HOLDER, LEASE) == Admission(True)
    return run_id


def test_the_store_for_postgresql_with_psycopg_is_postgresqls_own_with_its_functions(store: PostgreSQLStore) -> None:
    # When it is first used, it creates its tables and the functions of its schema version
    assert store.status() == []
    assert store.functions
    with store.engine.connect() as connection:
        version = connection.execute(sa.text("SELECT concurrency_slots_schema_version()")).scalar()
    assert version == SCHEMA_VERSION
    # And postgresql.sql holds each function once, the version last (its presence says all are there)
    created = [statement for statement in function_statements() if "CREATE OR REPLACE FUNCTION" in statement]
    names = [statement.split("FUNCTION", 1)[1].split("(", 1)[0].strip() for statement in created]
    assert len(names) == len(set(names)) and names[-1] == "concurrency_slots_schema_version"


def test_functions_another_version_of_the_package_created_are_created_again(store: PostgreSQLStore, url: str) -> None:
    # Given a database whose functions another version of the package created: same schema
    # version, other bodies and parameter names (here an admission that refuses everything), another digest
    assert store.status() == [] and store.functions
    with store.engine.begin() as connection:
        connection.exec_driver_sql(
            "DROP FUNCTION concurrency_slots_acquire("
            "text[], integer[], text, text, text, double precision, text, integer[], text)"
        )
        connection.exec_driver_sql(
            "CREATE FUNCTION concurrency_slots_acquire(slots text[], limits integer[], task_id text, run_id text, "
            "holder text, lease_seconds double precision, task_name text) RETURNS text[] LANGUAGE sql AS "
            "$$ SELECT ARRAY['stale'] $$"
        )
        connection.exec_driver_sql(
            "CREATE OR REPLACE FUNCTION concurrency_slots_functions_digest() RETURNS text LANGUAGE sql AS "
            "$$ SELECT 'older' $$"
        )
    # When a store of this version starts on it
    upgraded = store_from_url(url)
    assert isinstance(upgraded, PostgreSQLStore)
    try:
        # Then it creates its own functions again and admits with them
        admit(upgraded, "digest-slot", "t1")
        assert upgraded.functions
        with upgraded.engine.connect() as connection:
            digest = connection.execute(sa.text("SELECT concurrency_slots_functions_digest()")).scalar()
        assert digest == functions_digest()
    finally:
        upgraded.close()


def test_without_its_functions_the_store_runs_the_portable_steps(url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Given tables created by someone else (a migration of the tables only), and no functions
    from celery_caps.stores.sql import metadata

    engine = sa.create_engine(url)
    metadata.create_all(engine)
    engine.dispose()
    store = store_from_url(url, create_schema=False)
    assert isinstance(store, PostgreSQLStore)
    try:
        # Then every step works, through the portable statements, with a warning that says how to fix it
        run_id = admit(store, "s", "t1")
        parked = store.park(ParkRequest({"s": 1}, "t2", uuid.uuid4().hex, HOLDER, LEASE, 1.0, 10, payload=b"m"))
        assert parked is ParkOutcome.PARKED
        _, [woken] = store.release_and_wake(run_id, LEASE)
        assert woken.task_id == "t2"
        assert not store.functions
        assert "celery caps schema --sql" in caplog.text
    finally:
        store.close()


def test_threads_that_come_and_go_share_a_few_connections_and_keep_none_of_their_own(store: PostgreSQLStore) -> None:
    store.status()  # the schema, first
    store.pool.idle_seconds = 0.5
    # When 40 short-lived threads, one after the other, then 40 at once, each admit and release
    errors: list[BaseException] = []

    def one_task(index: int) -> None:
        try:
            store.release(admit(store, f"s{index}", f"t{index}"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    for index in range(40):
        thread = threading.Thread(target=one_task, args=(index,))
        thread.start()
        thread.join(30)
    assert store.pool.idle == 1
    started = time.monotonic()
    threads = [threading.Thread(target=one_task, args=(index,)) for index in range(40, 80)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    # Then none waited for a connection (no pool limit reached), and once they have all sat
    # unused for the pool's idle time, the next call closes them and keeps its own only
    assert errors == []
    assert time.monotonic() - started < 30
    time.sleep(store.pool.idle_seconds + 0.1)
    one_task(80)
    assert errors == []
    assert store.pool.idle == 1
    # (a closed connection's server process exits a moment later)
    deadline = time.monotonic() + 10
    while server_connections(store) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server_connections(store) == 1
    assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_threads_busy_at_once_keep_their_connections_instead_of_reconnecting(store: PostgreSQLStore) -> None:
    # Given a process whose 8 threads are each in a store call at the same moment, twice (a
    # busy threads pool: calls overlap)
    store.status()
    opened = 0
    connect = store.pool._connect

    def counting_connect() -> Any:
        nonlocal opened
        opened += 1
        return connect()

    store.pool._connect = counting_connect  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def call() -> None:
        try:
            store.pool.execute("SELECT pg_sleep(0.2)", {})
        except BaseException as exc:  # reported below
            errors.append(exc)

    for _ in range(2):
        threads = [threading.Thread(target=call) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    # Then the second burst found the first one's connections kept (for the pool's idle
    # time), and opened none
    assert errors == []
    assert opened == 8, opened
    assert store.pool.idle == 8


def test_a_warm_up_rehearses_each_threads_connection_and_rolls_it_back(store: PostgreSQLStore) -> None:
    # Given a pool process's warm-up from a thread of its own: its task thread, its background
    # thread and its renewals
    warming = threading.Thread(target=lambda: store.warm_up(threads=2, renewals=True))
    warming.start()
    warming.join(30)
    assert store.pool.idle == 3
    assert driver_connections(store, expected=3) == 3

    # Then nothing of the rehearsal was kept, and each connection ended its transaction
    with store.engine.connect() as connection:
        for table in ("concurrency_slots", "concurrency_waiters", "concurrency_waitlists"):
            left = connection.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE slot LIKE :own"), {"own": f"{WARM_UP_SLOT_PREFIX}%"}
            )
            assert left.scalar() == 0, table
        states = connection.execute(
            sa.text(
                "SELECT state, query FROM pg_stat_activity WHERE application_name = :name "
                "AND pid <> pg_backend_pid() AND query = 'ROLLBACK'"
            ),
            {"name": store.engine.url.query["application_name"]},
        ).all()
    assert states == [("idle", "ROLLBACK")] * 3

    # And the tasks' calls then use those connections and open none
    run_id = admit(store, "a", "t1")
    parked = store.park(ParkRequest({"a": 1}, "t2", uuid.uuid4().hex, HOLDER, LEASE, 1.0, 10, payload=b"m"))
    assert parked is ParkOutcome.PARKED
    _, [woken] = store.release_and_wake(run_id, LEASE)
    assert woken.task_id == "t2"
    assert store.renew([woken.run_id], LEASE) == {woken.run_id: 1}
    assert driver_connections(store, expected=3) == 3


def test_a_warm_up_that_fails_midway_closes_its_connection_and_raises_a_store_error(
    store: PostgreSQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.status()

    # Given a rehearsal whose second statement fails on the server
    def failing_rehearsal() -> None:
        store.pool.execute("SELECT 1", {})
        store.pool.execute("SELECT no_such_column FROM concurrency_slots", {})

    monkeypatch.setattr(store, "_rehearse_hot_path", failing_rehearsal)

    # Then warming up raises a StoreError, and keeps no connection inside the failed transaction
    with pytest.raises(StoreError, match="warm_up failed"):
        store.warm_up()
    assert store.pool.idle == 0
    assert server_connections(store) == 0
    monkeypatch.undo()
    # And the next call connects afresh
    assert store.release(uuid.uuid4().hex) == 0
    assert store.pool.idle == 1


def test_a_call_that_fails_closes_its_connection(store: PostgreSQLStore) -> None:
    store.release(uuid.uuid4().hex)
    assert store.pool.idle == 1
    with pytest.raises(Exception, match="no_such_column"):
        store.pool.execute("SELECT no_such_column FROM concurrency_slots", {})
    assert store.pool.idle == 0
    assert store.release(uuid.uuid4().hex) == 0


def test_a_release_hands_over_without_waiting_for_the_wal_flush_but_parks_and_admits_durably(
    store: PostgreSQLStore,
) -> None:
    store.status()  # creates the functions
    slots, limits = ["a"], [1]
    calls: dict[str, tuple[Any, ...]] = {
        # (Each in a transaction rolled back: nothing is kept.)
        "concurrency_slots_acquire": (slots, limits, "t1", uuid.uuid4().hex, HOLDER, LEASE, "t"),
        "concurrency_slots_park": (slots, limits, "t2", uuid.uuid4().hex, HOLDER, LEASE, "t", b"m", 0.0, 10, ""),
        "concurrency_slots_release_and_wake": (uuid.uuid4().hex, LEASE, ""),
    }
    committed_with = {}
    with store.engine.connect() as connection:
        for function, arguments in calls.items():
            with connection.begin() as transaction:
                placeholders = ", ".join(f":a{index}" for index in range(len(arguments)))
                params = {f"a{index}": value for index, value in enumerate(arguments)}
                connection.execute(sa.text(f"SELECT * FROM {function}({placeholders})"), params).all()
                # How the transaction that called it will commit
                committed_with[function] = connection.execute(sa.text("SHOW synchronous_commit")).scalar()
                transaction.rollback()
        assert connection.execute(sa.text("SHOW synchronous_commit")).scalar() == "on"
    # A release (and its hand-over) skips the flush; admission and park wait for it
    assert committed_with == {
        "concurrency_slots_acquire": "on",
        "concurrency_slots_park": "on",
        "concurrency_slots_release_and_wake": "off",
    }


def test_a_forked_child_leaves_the_parents_connections_alone(store: PostgreSQLStore) -> None:
    import multiprocessing

    store.warm_up()
    assert store.pool.idle == 1

    def child() -> None:
        store.after_fork()
        store.release(uuid.uuid4().hex)  # a connection of its own
        store.close()

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == 0
    # The parent's connection still works
    assert store.release(uuid.uuid4().hex) == 0
    assert store.pool.idle == 1


def test_an_idle_process_closes_its_connections_by_itself(store: PostgreSQLStore) -> None:
    # Given a store whose connections close after 0.3 s unused, warmed up and used once
    store.pool.idle_seconds = 0.3
    store.warm_up()
    store.release(uuid.uuid4().hex)
    store.status()  # (the engine's pool, too)
    assert server_connections(store) >= 1

    # When the process makes no further call, then none of its connections is left open
    deadline = time.monotonic() + 10
    while (store.pool.open or server_connections(store)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert store.pool.open == 0
    assert server_connections(store) == 0
    # And the next call connects again
    assert store.release(uuid.uuid4().hex) == 0
    assert store.pool.idle == 1


def test_a_store_made_from_a_url_owns_its_engine_and_keeps_the_engines_connections_until_idle(
    store: PostgreSQLStore,
) -> None:
    # Given a store made from a URL (as every worker's is), whose connections close after 5 s unused
    assert store._owns_engine
    store.pool.idle_seconds = 5.0
    # When its engine's pool lends a connection and takes it back (the operators' reads use it)
    store.status()
    # Then the store knows when it came back: the connection is kept until idle, not closed at
    # once by the next call's check (a store that did not know closed it there)
    assert store._engine_returned > 0
    assert store._close_idle_engine(store.pool.idle_seconds) is True
    assert store.engine.pool.checkedin() >= 1  # type: ignore[attr-defined]


def test_a_process_limited_to_one_connection_shares_it_between_its_threads(store: PostgreSQLStore) -> None:
    # Given a pool process's store: one connection, warmed up
    store.limit_connections(1)
    store.warm_up(threads=2, renewals=True)
    assert store.pool.open == 1
    errors: list[BaseException] = []

    def call() -> None:
        try:
            store.pool.execute("SELECT pg_sleep(0.05)", {})
        except BaseException as exc:  # reported below
            errors.append(exc)

    # When its task thread, background thread and lease keeper call at the same moment
    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    # Then each call ran, one after the other, on the one connection
    assert errors == []
    assert store.pool.open == 1
    assert server_connections(store) == 1


@pytest.mark.parametrize(
    ("query", "threshold"), [("", 5), ("prepare_threshold=0", 0), ("prepare_threshold=none", None)]
)
def test_prepared_statements_follow_the_url_and_are_on_for_a_direct_connection(
    url: str, query: str, threshold: int | None
) -> None:
    opened = store_from_url(f"{url}&{query}" if query else url)
    try:
        assert isinstance(opened, PostgreSQLStore)
        opened.warm_up()
        [(connection, _, _)] = opened.pool._idle
        assert connection.prepare_threshold == threshold
        with opened.engine.connect() as engine_connection:
            assert engine_connection.connection.driver_connection.prepare_threshold == threshold  # type: ignore[union-attr]
    finally:
        opened.close()


def test_a_prepare_threshold_that_is_no_number_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError, match="prepare_threshold='often'"):
        store_from_url(f"{url}&prepare_threshold=often")


@pytest.mark.pgbouncer
def test_through_pgbouncer_the_default_url_keeps_prepared_statements_off() -> None:
    from tests.services import require_service

    opened = store_from_url(require_service("pgbouncer-tx"))
    try:
        assert isinstance(opened, PostgreSQLStore)
        opened.warm_up()
        [(connection, _, _)] = opened.pool._idle
        assert connection.prepare_threshold is None
        with opened.engine.connect() as engine_connection:
            assert engine_connection.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
    finally:
        opened.close()
