"""What differs between the databases the SQL store runs on, one small object each.

The store's transactions run at READ COMMITTED on PostgreSQL and MySQL/MariaDB, whatever the
server's default (often REPEATABLE READ, per server, database or role): at REPEATABLE READ a
count after a lock reads the snapshot of before the wait and grants a slot beyond its limit.
Each connection gets it once, never a round trip per transaction: an engine built here asks
for it at connect (on PostgreSQL also as the session's default, for statements in autocommit:
:func:`read_committed_session`); an engine handed in is used through
:func:`read_committed_engine`.  MySQL/MariaDB name columns are ``VARBINARY`` so that its case-
and pad-insensitive collations cannot merge two slot names.  SQLite uses WAL, a busy timeout
and ``BEGIN IMMEDIATE`` so that concurrent worker processes on one machine serialise their
writes (it has no ``FOR UPDATE``: the write lock is held already; its transactions are
serializable).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from ...errors import ConfigurationError, MissingDependencyError
from ..base import mask_url

logger = logging.getLogger(__name__)

#: Execution option of a connection whose transactions only read (SQLite: a deferred BEGIN).
READ_ONLY_OPTION = "caps_read_only"

#: The drivers the SQL store is tested with, by backend (a URL naming another is told about them).
TESTED_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql", "sqlite": "pysqlite"}

#: The isolation level admission needs on PostgreSQL and MySQL/MariaDB (as SQLAlchemy names it):
#: each statement sees what committed before it began, so a count after a lock sees every
#: competitor that committed while it waited.
READ_COMMITTED = "READ COMMITTED"

#: A pooled connection's ``info`` key: the session's default isolation once this package's
#: connect listener set it (PostgreSQL with psycopg), upper case.
SESSION_ISOLATION = "celery_caps_session_isolation"


@dataclass(frozen=True)
class Dialect:
    """One database's SQL where it differs."""

    name: str
    #: The store's clock, in seconds since the epoch (never the worker's).
    now: str
    #: Upsert the sentinel rows ``{values}`` and leave them locked by this transaction.
    lock_sentinels: str
    #: Insert (or, for a run admitted again to a slot whose lease it let expire, replace) leases.
    insert_leases: str
    #: Appended to a SELECT that locks its rows (nothing on SQLite).
    for_update: str
    #: The same, skipping rows another transaction holds (never waiting out of slot order).
    for_update_skip_locked: str
    #: The cap of the slot name that ``{slot}`` stands for (the part before its first ``:``; all
    #: of a name without one).
    cap_of_slot: str
    #: Driver error codes worth a second try of the whole transaction (MySQL deadlocks, lock waits).
    retryable_codes: frozenset[Any] = frozenset()
    #: Whether a single statement runs in autocommit (no BEGIN and COMMIT round trips around it).
    autocommit_single_statements: bool = False
    #: Whether the driver takes ``:name`` binds as written (SQLite's does): a statement without a
    #: list bind then goes to it as its text, without SQLAlchemy compiling it on every call (most
    #: of SQLite's time per statement; see :meth:`.Statements.execute`).
    binds_as_written: bool = False
    #: The isolation level the store's transactions must run at.
    isolation: str = READ_COMMITTED
    #: Reads the isolation level of the transaction it runs in (None: SQLAlchemy's dialect
    #: reads it, as MySQL and MariaDB name the variable differently).
    isolation_query: str | None = None
    #: Reads the session's default isolation, which a statement in autocommit runs at (None:
    #: single statements never run in autocommit).
    session_isolation_query: str | None = None
    #: Reads whether this session writes a binary log, and in which format (MySQL/MariaDB).
    binlog_query: str | None = None

    def exact(self, value: str) -> str | bytes:
        """A value for a name column through SQLAlchemy Core: bytes for MySQL's ``VARBINARY``."""
        return value.encode("utf-8") if self.name == "mysql" else value


_LEASE_COLUMNS = "(run_id, slot, task_id, holder, expires_at, task_name, acquired_at, weight)"

POSTGRESQL = Dialect(
    name="postgresql",
    now="CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    # ON CONFLICT DO UPDATE locks the existing row even when its WHERE is false, so an unchanged
    # limit costs a lock, not a new row version.
    lock_sentinels=(
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit) VALUES {values} "
        "ON CONFLICT (run_id, slot) DO UPDATE SET slot_limit = EXCLUDED.slot_limit "
        "WHERE concurrency_slots.slot_limit IS DISTINCT FROM EXCLUDED.slot_limit"
    ),
    insert_leases=(
        f"INSERT INTO concurrency_slots {_LEASE_COLUMNS} VALUES {{values}} ON CONFLICT (run_id, slot) DO UPDATE "
        "SET task_id = EXCLUDED.task_id, holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at, "
        "task_name = EXCLUDED.task_name, acquired_at = EXCLUDED.acquired_at, weight = EXCLUDED.weight"
    ),
    for_update=" FOR UPDATE",
    for_update_skip_locked=" FOR UPDATE SKIP LOCKED",
    cap_of_slot="split_part({slot}, ':', 1)",
    autocommit_single_statements=True,
    isolation_query="SHOW transaction_isolation",
    session_isolation_query="SHOW default_transaction_isolation",
)

MYSQL = Dialect(
    name="mysql",
    now="(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) / 1000000.0)",
    # Unlike INSERT IGNORE (a shared lock that can deadlock when upgraded), this takes the row's
    # exclusive lock at once.
    lock_sentinels=(
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit) VALUES {values} "
        "ON DUPLICATE KEY UPDATE slot_limit = VALUES(slot_limit)"
    ),
    insert_leases=(
        f"INSERT INTO concurrency_slots {_LEASE_COLUMNS} VALUES {{values}} ON DUPLICATE KEY UPDATE "
        "task_id = VALUES(task_id), holder = VALUES(holder), expires_at = VALUES(expires_at), "
        "task_name = VALUES(task_name), acquired_at = VALUES(acquired_at), weight = VALUES(weight)"
    ),
    for_update=" FOR UPDATE",
    for_update_skip_locked=" FOR UPDATE SKIP LOCKED",
    cap_of_slot="SUBSTRING_INDEX({slot}, ':', 1)",
    retryable_codes=frozenset({1213, 1205}),  # deadlock; lock wait timeout
    binlog_query="SELECT @@log_bin, @@sql_log_bin, @@binlog_format",
)

SQLITE = Dialect(
    name="sqlite",
    now="((julianday('now') - 2440587.5) * 86400.0)",
    # BEGIN IMMEDIATE already holds the database's write lock.
    lock_sentinels=(
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit) VALUES {values} "
        "ON CONFLICT (run_id, slot) DO UPDATE SET slot_limit = excluded.slot_limit "
        "WHERE slot_limit IS NOT excluded.slot_limit"
    ),
    insert_leases=(
        f"INSERT INTO concurrency_slots {_LEASE_COLUMNS} VALUES {{values}} ON CONFLICT (run_id, slot) DO UPDATE "
        "SET task_id = excluded.task_id, holder = excluded.holder, expires_at = excluded.expires_at, "
        "task_name = excluded.task_name, acquired_at = excluded.acquired_at, weight = excluded.weight"
    ),
    for_update="",
    for_update_skip_locked="",
    cap_of_slot="substr({slot}, 1, instr({slot} || ':', ':') - 1)",
    binds_as_written=True,
    isolation="SERIALIZABLE",
)

_DIALECTS = {"postgresql": POSTGRESQL, "mysql": MYSQL, "mariadb": MYSQL, "sqlite": SQLITE}


def dialect_of(engine: Engine) -> Dialect:
    """The :class:`Dialect` of ``engine``; a :class:`ConfigurationError` for another database."""
    dialect = _DIALECTS.get(engine.dialect.name)
    if dialect is None:
        raise ConfigurationError(
            f"caps_url {mask_url(engine.url.render_as_string(hide_password=False))!r}: the SQL store supports "
            f"PostgreSQL, MySQL/MariaDB and SQLite, not {engine.dialect.name!r}"
        )
    return dialect


# Bounded waits for connections this store opens, so that a store that vanishes without closing
# them (a network partition, a dead host) turns into a store error instead of a process blocked
# for ever.  What the URL sets itself wins.
_POSTGRESQL_CONNECT_ARGS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30000,
}
_MYSQL_CONNECT_ARGS = {"connect_timeout": 10, "read_timeout": 60, "write_timeout": 60}

#: psycopg's option (and the URL query parameter) for server-side prepared statements.
PREPARE_THRESHOLD = "prepare_threshold"
#: psycopg's own default: a statement is prepared on the server at its sixth execution.
DIRECT_PREPARE_THRESHOLD = 5


def prepare_threshold(url: sa.engine.URL) -> tuple[bool, int | None]:
    """Whether ``url``'s query sets psycopg's ``prepare_threshold``, and its value: a count of
    executions (0: prepare at once) or ``none``/``off`` (never).

    Raises:
        ConfigurationError: the value is neither.
    """
    value = url.query.get(PREPARE_THRESHOLD)
    if value is None:
        return False, None
    text = (value[-1] if isinstance(value, tuple) else value).strip().lower()
    if text in ("", "none", "off", "null"):
        return True, None
    if text.isdigit():
        return True, int(text)
    raise ConfigurationError(
        f"caps_url {mask_url(url.render_as_string(hide_password=False))!r}: {PREPARE_THRESHOLD}={text!r} is neither a "
        "number of executions (0 or more) nor 'none' (never prepare: needed behind a transaction pooler)"
    )


def behind_pooler(dbapi_connection: Any) -> bool:
    """Whether a connection pooler (PgBouncer, say) stands between this psycopg connection and
    PostgreSQL: the backend a pooler hands out is not the one it announced to the client (a
    pooler answers the start-up with a cancel key of its own, whose process id is no
    server's).  Leaves the connection outside any transaction."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SELECT pg_backend_pid()")
        row = cursor.fetchone()
    finally:
        cursor.close()
    if not dbapi_connection.autocommit:
        dbapi_connection.rollback()
    return bool(row is not None and row[0] != dbapi_connection.info.backend_pid)


# One round trip, in autocommit (so that no transaction ends it): whether a pooler stands
# between (see behind_pooler), and the session's default isolation after this statement, which
# sets it on a server session that is this connection's alone.
_READ_COMMITTED_SESSION = (
    "SELECT pg_backend_pid() <> %(pid)s, CASE WHEN pg_backend_pid() = %(pid)s "
    "THEN set_config('default_transaction_isolation', 'read committed', false) "
    "ELSE current_setting('default_transaction_isolation') END"
)


def read_committed_session(dbapi_connection: Any) -> tuple[bool, str]:
    """Make READ COMMITTED the default of this psycopg connection's server session, so that
    statements in autocommit run at it too (they start no BEGIN that could name a level), in
    one round trip; never through a connection pooler, which would hand the setting to other
    clients' transactions (and, pooling transactions, run this connection's on sessions
    without it).  Returns whether a pooler stands between, and the session's default
    isolation now, upper case (``READ COMMITTED`` unless pooled on a server or role whose
    default differs).  Leaves the connection outside any transaction."""
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        row = dbapi_connection.execute(
            _READ_COMMITTED_SESSION, {"pid": dbapi_connection.info.backend_pid}, prepare=False
        ).fetchone()
    finally:
        dbapi_connection.autocommit = autocommit
    return bool(row[0]), str(row[1]).upper()


def _configure_psycopg_sessions(engine: Engine, *, prepare: bool) -> None:
    """Each new connection of ``engine``: READ COMMITTED as its session's default
    (:func:`read_committed_session`, recorded in the pool's ``info`` under
    :data:`SESSION_ISOLATION`); with ``prepare``, server-side prepared statements (psycopg's
    default) on a direct connection only.

    A prepared statement lives in one server session, which a transaction pooler (PgBouncer's
    ``pool_mode = transaction``) hands to another client after each transaction: its name then
    collides with, or runs as, another client's statement.  Connections start with them off
    and get psycopg's default once the server is seen directly; through a pooler, in any mode,
    they stay off (the store's hot-path statements are calls of its functions, whose own plans
    the server caches either way: a prepared call saves only its parse).
    """
    reported: list[bool] = []

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        pooled, isolation = read_committed_session(dbapi_connection)
        record.info[SESSION_ISOLATION] = isolation
        if not prepare:
            return
        if not pooled:
            dbapi_connection.prepare_threshold = DIRECT_PREPARE_THRESHOLD
        elif not reported:
            reported.append(True)
            logger.info(
                "%s: connected through a connection pooler; server-side prepared statements are off",
                mask_url(engine.url.render_as_string(hide_password=False)),
            )


def read_committed_engine(engine: Engine, dialect: Dialect) -> Engine:
    """``engine`` as the store runs its transactions on it: as it is where its connections start
    at the level ``dialect`` needs (SQLite; an engine built by :func:`create_engine`; one
    created with ``isolation_level="READ COMMITTED"``, or on a server whose default it is),
    else a view of it whose transactions run at READ COMMITTED.  SQLAlchemy sets the level as
    each connection is checked out and gives the engine's own back at check-in: on PostgreSQL
    the driver puts it in the BEGIN it sends anyway; on MySQL/MariaDB it costs a statement each
    way (create your engine with ``isolation_level="READ COMMITTED"`` to save them).  Known
    once the engine has connected (``default_isolation_level``); before, the view."""
    starts_at = getattr(engine.dialect, "default_isolation_level", None)
    if dialect.isolation != READ_COMMITTED or starts_at == READ_COMMITTED:
        return engine
    return engine.execution_options(isolation_level=READ_COMMITTED)


def parse_url(url: str) -> sa.engine.URL:
    """``caps_url`` parsed.

    Raises:
        ConfigurationError: it is not a SQLAlchemy URL.
    """
    try:
        return sa.engine.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(f"caps_url {mask_url(url)!r} is not a valid SQLAlchemy URL") from exc


def create_engine(url: str) -> Engine:
    """An engine for ``caps_url``, with each database's options (see the module docstring).

    Raises:
        ConfigurationError: the URL cannot be parsed, or names a driver SQLAlchemy does not know.
        MissingDependencyError: the driver is not installed.
    """
    parsed = parse_url(url)
    backend = parsed.get_backend_name()
    # Every transaction here ends in COMMIT or ROLLBACK; a reset on return would only add a round trip.
    options: dict[str, Any] = {"pool_reset_on_return": None}
    connect_args: dict[str, Any] = {}
    explicit = False
    if backend in ("postgresql", "mysql", "mariadb"):
        options["isolation_level"] = READ_COMMITTED  # set once per connection (the module docstring)
    if backend in ("mysql", "mariadb"):
        options["pool_recycle"] = 3600
        if parsed.get_driver_name() == "pymysql":
            connect_args = dict(_MYSQL_CONNECT_ARGS)
    if backend == "postgresql" and parsed.get_driver_name() in ("psycopg", "psycopg2"):
        connect_args = dict(_POSTGRESQL_CONNECT_ARGS)
        if parsed.get_driver_name() == "psycopg":
            # Read here: a query parameter would reach psycopg as a string it cannot compare.
            explicit, threshold = prepare_threshold(parsed)
            connect_args[PREPARE_THRESHOLD] = threshold
            parsed = parsed.difference_update_query([PREPARE_THRESHOLD])
    if backend == "sqlite":
        connect_args = {"check_same_thread": False, "timeout": 30}
    connect_args = {key: value for key, value in connect_args.items() if key not in parsed.query}
    if connect_args:
        options["connect_args"] = connect_args
    try:
        engine = sa.create_engine(parsed, **options)
    except sa.exc.NoSuchModuleError as exc:
        drivers = ", ".join(f"{name}+{driver}" for name, driver in TESTED_DRIVERS.items() if name != "mariadb")
        raise ConfigurationError(
            f"caps_url {mask_url(url)!r}: unknown database driver {parsed.drivername!r} (a typo?); "
            f"the SQL store is tested with {drivers}"
        ) from exc
    except ImportError as exc:
        extra = {"postgresql": "postgres", "mysql": "mysql", "mariadb": "mysql"}.get(backend, backend)
        raise MissingDependencyError(
            f'caps_url {mask_url(url)!r} needs a database driver: pip install "celery-caps[{extra}]" ({exc})'
        ) from exc
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(f"caps_url {mask_url(url)!r}: {exc}") from exc
    if backend == "sqlite":
        _warn_of_a_relative_path(url, parsed)
        _serialise_sqlite_writers(engine)
    if backend == "postgresql" and parsed.get_driver_name() == "psycopg":
        _configure_psycopg_sessions(engine, prepare=not explicit)
    return engine


def _warn_of_a_relative_path(url: str, parsed: sa.engine.URL) -> None:
    """A relative SQLite path names another database in each working directory: a worker, beat
    and ``celery caps`` started from different places would not share their caps."""
    database = parsed.database or ""
    if not database or database == ":memory:" or database.startswith("file:") or os.path.isabs(database):
        return
    logger.warning(
        "caps_url %r is a relative SQLite path: this process uses %s. A process started from another "
        "directory uses another database, and does not share these caps: use an absolute path "
        "('sqlite:////absolute/path/caps.db')",
        mask_url(url), os.path.abspath(database),
    )  # fmt: skip


def _serialise_sqlite_writers(engine: Engine) -> None:
    """WAL, a busy timeout, and every transaction ``BEGIN IMMEDIATE``: the driver's implicit
    transactions do not serialise writers the way admission needs."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # the driver opens no transaction of its own
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")  # first: the WAL switch below may have to wait
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        # A read-only transaction (the operators' reads, the sweep's count of keys) takes no lock
        # until it reads, and then only a snapshot: writers go on meanwhile.
        read_only = connection.get_execution_options().get(READ_ONLY_OPTION, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
