"""The portable SQL store's leases: admission, renewal, release and the operators' reads.

Admission is one transaction: upsert-and-lock the sentinels of every slot the task needs
(sorted, so tasks with several caps cannot deadlock), *then* count live leases in a second
statement (its snapshot is taken after the locks are granted, so it sees every committed
competitor), then insert the leases.

Lock order, so that no two steps wait for each other in a circle: lease rows before the
waiting-list entry they belong to; a run's lease rows before sentinels (a release); sentinels
in slot order (more of them only with SKIP LOCKED) before the entries a dispatch changes.

The tables are in :mod:`.schema`, the statements in :mod:`.statements`, what differs between
databases in :mod:`.dialects`; the waiting list is :mod:`.waitlist`, PostgreSQL's one-round-trip
steps :mod:`.postgresql`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ...caps import operator_limit
from ...errors import StoreError
from ..base import Admission, HistoryEvent, Lease, SlotStatus, SlotStore, mask_url, secret_parameter
from .dialects import READ_COMMITTED, READ_ONLY_OPTION, create_engine, dialect_of, read_committed_engine
from .schema import (
    HISTORY_TABLE_NAME,
    MAX_TASK_NAME_LENGTH,
    OLD_INDEXES,
    TABLE_NAME,
    WAITERS_TABLE_NAME,
    concurrency_slots_history,
    metadata,
)
from .statements import ADD_COLUMN, DROP_INDEX, Statements, admission_params

logger = logging.getLogger(__name__)

#: Tries of a transaction that a deadlock or a lock wait timeout ended (MySQL).
ATTEMPTS = 3
#: Names bound to one ``IN`` list at most.
BATCH = 500
#: Expired rows the sweep deletes per transaction.
SWEEP_BATCH = 1000
_SCHEMA_ATTEMPTS = 5
#: Columns added to tables after their first release (table, column, its definition as DDL; None:
#: its type as the table has it, per database, and NULL): a store created before gets them at
#: start, with the indexes that hold them.
ADDED_COLUMNS: tuple[tuple[str, str, str | None], ...] = (
    (HISTORY_TABLE_NAME, "slot_limit", "INTEGER NULL"),
    (TABLE_NAME, "weight", "INTEGER NOT NULL DEFAULT 1"),
    (WAITERS_TABLE_NAME, "weight", "INTEGER NOT NULL DEFAULT 1"),
    # (VARBINARY on MySQL, as every name column: see schema._exact_text.)
    (WAITERS_TABLE_NAME, "fair_key", None),
    (WAITERS_TABLE_NAME, "fair_round", "INTEGER NOT NULL DEFAULT 0"),
)

_T = TypeVar("_T")


def as_text(value: Any) -> str:
    """A name column's value: MySQL's ``VARBINARY`` gives bytes."""
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else value


class SQLLeaseStore(SlotStore):
    """Leases in ``concurrency_slots`` on PostgreSQL, MySQL/MariaDB or SQLite.

    Args:
        target: A SQLAlchemy URL (``postgresql+psycopg://``, ``mysql+pymysql://``,
            ``sqlite:///path``) or a ready ``Engine``.  An engine passed in is never
            disposed by :meth:`close`.
        create_schema: Create what is missing of the schema on first use.
    """

    driver_errors: tuple[type[BaseException], ...] = (sa.exc.SQLAlchemyError,)

    def __init__(self, target: str | Engine, *, create_schema: bool = True) -> None:
        if isinstance(target, Engine):
            self._engine, self._owns_engine = target, False
        else:
            self._engine, self._owns_engine = create_engine(target), True
        self.dialect = dialect_of(self._engine)
        self.statements = Statements(self.dialect)
        self._create_schema = create_schema
        self._schema_ready = False
        # A pool process's warm-up thread and its first task may prepare at once: once is enough.
        self._prepare_lock = threading.Lock()
        # Until the first use settles them (_settle_isolation): every kind in a transaction.
        self._use_engines(autocommit=False)

    def _use_engines(self, *, autocommit: bool) -> None:
        """The engines each kind of transaction runs on: transactions at the isolation the dialect
        needs (:func:`.read_committed_engine`); single statements in autocommit where the dialect
        allows it and ``autocommit`` says the sessions' own default is that level (a statement
        in autocommit runs at it: it has no BEGIN to name another), else as transactions; reads
        alone the same way, marked as such (SQLite begins them deferred: in WAL a reader never
        takes the write lock)."""
        self._transaction_engine = read_committed_engine(self._engine, self.dialect)
        self._single_statement_engine = (
            self._engine.execution_options(isolation_level="AUTOCOMMIT")
            if autocommit and self.dialect.autocommit_single_statements
            else self._transaction_engine
        )
        self._read_engine = self._single_statement_engine.execution_options(**{READ_ONLY_OPTION: True})

    def _settle_isolation(self, connection: Connection) -> None:
        """First use, on a connection of the engine (so its sessions' level is known): choose the
        engines (:meth:`_use_engines`) by what its sessions start with; on MySQL/MariaDB, refuse
        a server whose binary log refuses every write at READ COMMITTED.

        Raises:
            StoreError: binary logging is on in ``binlog_format=STATEMENT``.
        """
        dialect = self.dialect
        session_default = None
        if dialect.session_isolation_query is not None:
            session_default = str(connection.exec_driver_sql(dialect.session_isolation_query).scalar()).upper()
        self._use_engines(autocommit=session_default == READ_COMMITTED)
        if dialect.name == "mysql" and self._transaction_engine is not self._engine:
            logger.info(
                "%s: the engine handed in starts its sessions at %s: the store sets READ COMMITTED as it takes a "
                "connection and gives the engine's level back as it returns it (two statements each way, each "
                'transaction); create the engine with isolation_level="READ COMMITTED" to save them',
                self.display_url,
                getattr(self._engine.dialect, "default_isolation_level", None),
            )
        if dialect.binlog_query is not None:
            log_bin, sql_log_bin, binlog_format = connection.exec_driver_sql(dialect.binlog_query).one()
            if int(log_bin) and int(sql_log_bin) and str(binlog_format).upper() == "STATEMENT":
                raise StoreError(
                    f"{self.display_url}: binary logging is on with binlog_format=STATEMENT, which refuses every "
                    "write of a transaction at READ COMMITTED (error 1665), the isolation the store needs; set "
                    "binlog_format=ROW (or MIXED) on the server (SET GLOBAL binlog_format = 'ROW', and in its "
                    "configuration file)"
                )

    @property
    def engine(self) -> Engine:
        """The engine the store runs on."""
        return self._engine

    @property
    def display_url(self) -> str:
        """The engine's URL with every credential masked: its password, and a password (or any
        credential) passed as a query parameter (``?password=``, ``?passwd=``, ...)."""
        return mask_url(self._engine.url.render_as_string(hide_password=False))

    def secrets(self) -> Sequence[str]:
        url = self._engine.url
        found = [url.password] if url.password else []
        for name, value in url.query.items():
            if secret_parameter(name):
                found += [value] if isinstance(value, str) else list(value)
        return tuple(str(secret) for secret in found if secret)

    # -- plumbing ---------------------------------------------------------------------------

    def create_schema(self) -> None:
        """Create what is missing of the schema (tables and indexes), and add the columns added
        since a table was created (:data:`ADDED_COLUMNS`), with their indexes.

        Raises:
            StoreError: the store cannot be reached, or refuses to create it.
        """
        for attempt in range(1, _SCHEMA_ATTEMPTS + 1):
            try:
                metadata.create_all(self._engine, checkfirst=True)
                missing = self._missing_columns()
                if missing:
                    with self._engine.begin() as connection:
                        for table, column, definition in missing:
                            definition = definition or self._nullable_column(table, column)
                            connection.exec_driver_sql(
                                ADD_COLUMN.format(table=table, column=column, definition=definition)
                            )
                        # The indexes that came with the columns (an index of a table created
                        # before is never created by create_all), and without those they replace.
                        for table in sorted({table for table, _column, _definition in missing}):
                            for index in sorted(metadata.tables[table].indexes, key=lambda index: str(index.name)):
                                if self._creates(index):
                                    index.create(connection, checkfirst=True)
                            self._drop_old_indexes(connection, table)
                return
            except sa.exc.SQLAlchemyError as exc:
                # Several workers may race to create it (SQLite may even answer "database is
                # locked" at once); only a missing table or column is an error.  The check
                # connects again, so an unreachable store fails it too.
                try:
                    inspector = sa.inspect(self._engine)
                    if all(inspector.has_table(table.name) for table in metadata.sorted_tables) and (
                        not self._missing_columns()
                    ):
                        return
                except sa.exc.SQLAlchemyError:
                    pass
                if attempt == _SCHEMA_ATTEMPTS or not isinstance(exc, sa.exc.OperationalError):
                    raise self.store_error("creating the schema", exc) from exc
                time.sleep(0.05 * attempt)

    def _nullable_column(self, table: str, column: str) -> str:
        """The DDL of ``table``'s nullable ``column`` as :data:`metadata` defines it, for this
        store's database."""
        return f"{metadata.tables[table].c[column].type.compile(dialect=self._engine.dialect)} NULL"

    def _drop_old_indexes(self, connection: Connection, table: str) -> None:
        """Drop the indexes of an earlier schema that ``table`` still has (:data:`.OLD_INDEXES`):
        their replacements are there, and each costs every write of the table."""
        old = OLD_INDEXES.get(table, ())
        if not old:
            return
        present = {index["name"] for index in sa.inspect(connection).get_indexes(table)}
        template = DROP_INDEX.get(self.dialect.name, DROP_INDEX[""])
        for name in old:
            if name in present:
                connection.exec_driver_sql(template.format(index=name, table=table))

    def _missing_columns(self) -> list[tuple[str, str, str | None]]:
        """The columns of :data:`ADDED_COLUMNS` that the database's tables lack (one read of the
        tables' columns where the database allows it)."""
        tables = sorted({table for table, _column, _definition in ADDED_COLUMNS})
        found = sa.inspect(self._engine).get_multi_columns(filter_names=tables)
        present = {(table, column["name"]) for (_schema, table), columns in found.items() for column in columns}
        return [added for added in ADDED_COLUMNS if (added[0], added[1]) not in present]

    def _creates(self, index: sa.Index) -> bool:
        """Whether ``index`` is created on this store's database (some are one dialect's only)."""
        dialects = index.info.get("dialects")
        return dialects is None or self._engine.dialect.name in dialects

    def schema_statements(self) -> list[str]:
        """The DDL of this schema version for this store's database, in order: what
        :meth:`create_schema` creates, for running by hand or in your own migrations."""
        dialect = self._engine.dialect
        statements = []
        for table in metadata.sorted_tables:
            statements.append(str(sa.schema.CreateTable(table).compile(dialect=dialect)).strip())
            for index in sorted(table.indexes, key=lambda index: str(index.name)):
                if self._creates(index):
                    statements.append(str(sa.schema.CreateIndex(index).compile(dialect=dialect)).strip())
        return statements

    def _prepare(self) -> None:
        """First use in this process: create the schema if asked; settle the isolation
        (:meth:`_settle_isolation`)."""
        with self._prepare_lock:
            if not self._schema_ready:
                if self._create_schema:
                    self.create_schema()
                if self.dialect.isolation == READ_COMMITTED:
                    try:
                        with self._engine.connect() as connection:
                            self._settle_isolation(connection)
                    except sa.exc.SQLAlchemyError as exc:
                        raise self.store_error("checking the isolation", exc) from exc
                self._schema_ready = True

    def _transaction(
        self, work: Callable[[Connection], _T], *, single_statement: bool = False, read_only: bool = False
    ) -> _T:
        """Run ``work`` in one transaction (a single statement in autocommit where the dialect
        allows it; ``read_only``: reads only, which on SQLite take no write lock); a transaction a
        deadlock ended is tried again (:data:`ATTEMPTS`)."""
        if not self._schema_ready:
            self._prepare()
        for attempt in range(1, ATTEMPTS + 1):
            try:
                if single_statement or read_only:
                    engine = self._read_engine if read_only else self._single_statement_engine
                    with engine.connect() as connection:
                        result = work(connection)
                        connection.commit()  # a no-op in autocommit; ends SQLite/MySQL transactions
                        return result
                with self._transaction_engine.begin() as connection:
                    return work(connection)
            except sa.exc.DBAPIError as exc:
                code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
                if attempt == ATTEMPTS or code not in self.dialect.retryable_codes:
                    raise
                logger.debug("retrying after %s", exc.orig)
                time.sleep(0.005 * attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _names(
        self,
        connection: Connection,
        statement: str,
        name: str,
        values: Collection[Any],
        params: Mapping[str, Any] | None = None,
    ) -> set[str]:
        """The first column of ``statement`` run on ``values`` bound to the list ``name`` (and
        ``params``), a batch at a time."""
        found: set[str] = set()
        listed = list(values)
        for start in range(0, len(listed), BATCH):
            batch = {**(params or {}), name: listed[start : start + BATCH]}
            rows = self.statements.execute(connection, statement, batch)
            found.update(as_text(row[0]) for row in rows)
        return found

    # -- admission ------------------------------------------------------------------------

    def _lock_sentinels(self, connection: Connection, slots: Mapping[str, int], params: dict[str, Any]) -> None:
        """Lock the slots' sentinels, in slot order, creating missing ones (recording the limits)."""
        self.statements.execute_for_slots(connection, "lock_sentinels", len(slots), params)

    def _full_slots(
        self, connection: Connection, slots: Mapping[str, int], weights: Mapping[str, int], params: dict[str, Any]
    ) -> list[str]:
        """Count the units live holders take (in a statement after the locks) against each slot's
        limit in force (the operator's if one is set, else ``slots``'s): the slots without room
        for the task at ``weights``, sorted.  A slot the task holds already has room for it; else
        a slot has room when the task's weight (at most the limit) fits what is free, and the
        slot's oldest heavy waiter (see :class:`.ParkingStore`) does not need more than that."""
        full = []
        for row in self.statements.execute_for_slots(connection, "count_live", len(slots), params):
            slot, _holders, units, holds_already, limit, heavy = row
            slot = as_text(slot)
            free = limit - int(units)
            if not holds_already and (
                min(weights.get(slot, 1), limit) > free or (heavy is not None and min(heavy, limit) > free)
            ):
                full.append(slot)
        return sorted(full)

    def _insert_leases(self, connection: Connection, count: int, params: dict[str, Any]) -> None:
        self.statements.execute_for_slots(connection, "insert_leases", count, params)

    def acquire(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        task_name: str | None = None,
        weights: Mapping[str, int] | None = None,
    ) -> Admission:
        weights = weights or {}
        params = admission_params(
            slots, task_id, run_id, holder, lease_seconds, _cut(task_name), weights, self.deployment
        )

        def admit(connection: Connection) -> Admission:
            self._lock_sentinels(connection, slots, params)
            full = self._full_slots(connection, slots, weights, params)
            if full:
                return Admission(False, tuple(full))
            self._insert_leases(connection, len(slots), params)
            return Admission(True)

        return self._transaction(admit)

    def renew(self, run_ids: Collection[str], lease_seconds: float) -> dict[str, int]:
        if not run_ids:
            return {}
        params = {"run_ids": list(run_ids), "lease_seconds": lease_seconds}

        def renew(connection: Connection) -> dict[str, int]:
            self.statements.execute(connection, "renew", params)
            return {run_id: count for run_id, count in self.statements.execute(connection, "renewed", params)}

        return self._transaction(renew)

    # -- release ------------------------------------------------------------------------------

    def _delete(self, statement: str, params: dict[str, Any]) -> int:
        return self._transaction(
            lambda connection: int(self.statements.execute(connection, statement, params).rowcount),
            single_statement=True,
        )

    def release(self, run_id: str) -> int:
        return self._delete("release_run", {"run_id": run_id})

    def release_holder(self, task_id: str, holder: str) -> int:
        return self._delete("release_holder", {"task_id": task_id, "holder": holder})

    def release_task(self, task_id: str) -> int:
        return self._delete("release_task", {"task_id": task_id})

    def sweep(self) -> int:
        statements = self.statements

        def batch(connection: Connection) -> tuple[int, bool]:
            """At most :data:`SWEEP_BATCH` expired leases and as many old tombstones, by the store's
            clock read once (a clock read per row could use no index): the leases deleted, and
            whether more may be left."""
            now = statements.execute(connection, "now").scalar_one()
            params = {"now": now, "batch": SWEEP_BATCH}
            deleted, more = 0, False
            for find, delete, name in (
                ("expired_runs", "sweep", "run_ids"),
                ("old_tombstones", "sweep_tombstones", "task_ids"),
            ):
                rows = statements.execute(connection, find, params).all()
                if rows:
                    found = sorted({row[0] for row in rows})
                    count = int(statements.execute(connection, delete, {**params, name: found}).rowcount)
                    more = more or len(rows) >= SWEEP_BATCH
                    if name == "run_ids":
                        deleted = count
            return deleted, more

        def anything_expired(connection: Connection) -> bool:
            now, lease, tombstone = statements.execute(connection, "next_expiries").one()
            return any(expiry is not None and expiry <= now for expiry in (lease, tombstone))

        if not self._transaction(anything_expired, read_only=True):
            return 0
        total, more = 0, True
        while more:
            deleted, more = self._transaction(batch)
            total += deleted
        return total

    def keys_per_cap(self, at_most: int | None = None) -> dict[str, int]:
        # A skip scan of the sentinels: per cap, its first name, then its keys up to ``at_most``;
        # never a read of every sentinel.  (The reads may see different moments: a count a little
        # off is fine for a warning.  The ranges are by the name column's order: characters on
        # MySQL/MariaDB and SQLite, the database's collation on PostgreSQL, where one that does
        # not order ':' just before ';' (C and C.UTF-8 do) may leave keys out of a count.)
        statements, exact = self.statements, self.dialect.exact
        most = at_most if at_most is not None else 2**31 - 1

        def read(connection: Connection) -> dict[str, int]:
            counts: dict[str, int] = {}
            start = after = ""
            while True:
                row = statements.execute(connection, "next_sentinel", {"start": exact(start), "after": exact(after)})
                found = row.scalar()
                if found is None:
                    return counts
                after = as_text(found)
                cap, separator, _key = after.partition(":")
                start = after
                if separator:
                    # Cap names have no ':', so the names 'cap:...' are those from 'cap:' to 'cap;'.
                    low, high = cap + ":", cap + ";"
                    params = {"low": exact(low), "high": exact(high), "pattern": statements.prefix_pattern(low)}
                    counts[cap] = int(
                        statements.execute(connection, "keys_of_cap", {**params, "most": most}).scalar_one()
                    )
                    start = high

        return self._transaction(read, read_only=True)

    # -- operators ----------------------------------------------------------------------------

    def status(self) -> list[SlotStatus]:
        statements = self.statements

        def read(connection: Connection) -> list[SlotStatus]:
            now = statements.execute(connection, "now").scalar_one()
            rows = [
                (as_text(slot), limit, int(holders), int(expired), int(heaviest or 0))
                for slot, limit, holders, expired, heaviest in statements.execute(connection, "status", {"now": now})
            ]
            # The units of the slots a heavy run holds (None elsewhere: one per holder), each task
            # id at its largest weight, at most the limit in force.
            heavy = [slot for slot, _limit, _holders, _expired, heaviest in rows if heaviest > 1]
            units: dict[str, int] = {}
            if heavy:
                operator_limits = {
                    as_text(name): int(limit) for name, limit in statements.execute(connection, "operator_limits")
                }
                limits = {slot: operator_limit(slot, operator_limits) or limit for slot, limit, *_ in rows}
                for start in range(0, len(heavy), BATCH):
                    batch = {"slots": heavy[start : start + BATCH]}
                    for slot, _task_id, weight in statements.execute(connection, "live", batch):
                        slot = as_text(slot)
                        limit = limits[slot]
                        units[slot] = units.get(slot, 0) + (int(weight) if limit is None else min(int(weight), limit))
            return [
                SlotStatus(slot, limit, holders, expired, units.get(slot))
                for slot, limit, holders, expired, _heaviest in rows
            ]

        return self._transaction(read, read_only=True)

    def leases(self, slot: str | None = None) -> list[Lease]:
        statement, params = ("leases_all", {}) if slot is None else ("leases_of_slot", {"slot": slot})

        def read(connection: Connection) -> list[Lease]:
            rows = self.statements.execute(connection, statement, params)
            return [
                Lease(
                    as_text(name),
                    as_text(task_id),
                    run_id,
                    holder,
                    float(expires_in),
                    task_name,
                    None if age is None else float(age),
                    int(weight),
                )
                for name, task_id, run_id, holder, expires_in, task_name, age, weight in rows
            ]

        return self._transaction(read, read_only=True)

    def prune(self, prefix: str, *, dry_run: bool = False) -> list[str]:
        statements = self.statements
        pattern = statements.prefix_pattern(prefix)

        def prune(connection: Connection) -> list[str]:
            candidates = "prune_candidates" if dry_run else "prune_locked_candidates"
            slots = [row[0] for row in statements.execute(connection, candidates, {"pattern": pattern})]
            held: set[Any] = set()
            for start in range(0, len(slots), BATCH):
                batch = slots[start : start + BATCH]
                held.update(row[0] for row in statements.execute(connection, "prune_live", {"slots": batch}))
                # The slots parked tasks wait for (waiting or dispatched) stay.
                held.update(row[0] for row in statements.execute(connection, "prune_waited", {"slots": batch}))
            doomed = [slot for slot in slots if slot not in held]
            if not dry_run:
                for start in range(0, len(doomed), BATCH):
                    batch = doomed[start : start + BATCH]
                    statements.execute(connection, "prune_delete", {"slots": batch})
                    statements.execute(connection, "prune_waitlists", {"slots": batch})
                    # A tombstone of a task that needed a pruned slot goes whole.
                    tombstones = self._names(connection, "prune_tombstones", "slots", batch)
                    if tombstones:
                        statements.execute(connection, "delete_tombstones", {"task_ids": sorted(tombstones)})
            return sorted(as_text(slot) for slot in doomed)

        return self._transaction(prune)

    # -- limits set by operators --------------------------------------------------------------

    def set_limit(self, name: str, limit: int | None) -> int | None:
        params = {
            "name": self.dialect.exact(name),
            "limit": limit,
            "pattern": self.statements.prefix_pattern(name + ":"),
        }

        def replace(connection: Connection) -> int | None:
            self.statements.execute(connection, "lock_limited_sentinels", params).all()
            previous = self.statements.execute(connection, "operator_limit_of", params).scalar()
            if limit is None:
                self.statements.execute(connection, "delete_operator_limit", params)
            else:
                self.statements.execute(connection, "put_operator_limit", params)
            return None if previous is None else int(previous)

        return self._transaction(replace)

    def limits(self) -> dict[str, int]:
        return self._transaction(
            lambda connection: {
                as_text(name): int(limit) for name, limit in self.statements.execute(connection, "operator_limits")
            }
        )

    def record_history(self, events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
        if not events:
            return
        table = concurrency_slots_history
        rows = [
            {
                "recorded_at": event.at,
                "kind": event.kind,
                "task_id": self.dialect.exact(event.task_id),
                "task_name": _cut(event.task_name),
                "holder": event.holder[:255],
                "slots": json.dumps(list(event.slots)),
                "full_slots": json.dumps(list(event.full_slots)),
                "started_at": event.started_at,
                "deferrals": event.deferrals,
                "slot_limit": event.limit,
            }
            for event in events
        ]
        oldest = max(event.at for event in events) - keep_seconds

        def record(connection: Connection) -> None:
            connection.execute(table.insert(), rows)
            connection.execute(table.delete().where(table.c.recorded_at < oldest))
            # The newest max_events rows stay (ids grow with insertion).
            boundary = connection.execute(
                sa.select(table.c.id).order_by(table.c.id.desc()).limit(1).offset(max_events)
            ).scalar()
            if boundary is not None:
                connection.execute(table.delete().where(table.c.id <= boundary))

        self._transaction(record)

    def history(self, since: float, task_id: str | None = None) -> list[HistoryEvent]:
        table = concurrency_slots_history
        query = sa.select(
            table.c.kind,
            table.c.recorded_at,
            table.c.task_id,
            table.c.task_name,
            table.c.slots,
            table.c.full_slots,
            table.c.holder,
            table.c.started_at,
            table.c.deferrals,
            table.c.slot_limit,
        ).where(table.c.recorded_at >= since)
        if task_id is not None:
            query = query.where(table.c.task_id == self.dialect.exact(task_id))
        query = query.order_by(table.c.recorded_at, table.c.id)

        def read(connection: Connection) -> list[HistoryEvent]:
            return [
                HistoryEvent(
                    kind=kind,
                    at=float(at),
                    task_id=as_text(event_task_id),
                    task_name=task_name,
                    slots=tuple(json.loads(slots)),
                    full_slots=tuple(json.loads(full_slots)),
                    holder=holder,
                    started_at=None if started_at is None else float(started_at),
                    deferrals=int(deferrals),
                    limit=None if limit is None else int(limit),
                )
                for kind, at, event_task_id, task_name, slots, full_slots, holder, started_at, deferrals, limit in (
                    connection.execute(query)
                )
            ]

        return self._transaction(read, read_only=True)

    # -- isolation --------------------------------------------------------------------------

    def check_isolation(self) -> tuple[str, list[str]]:
        """The isolation level the store's transactions run at, read in one of each kind
        (:meth:`isolation_levels`), and what is wrong with it (empty if nothing): for the
        start-up check (:func:`celery_caps.health.check_store`).

        Raises:
            StoreError: the store cannot be reached.
        """
        try:
            levels = self.isolation_levels()
        except self.driver_errors as exc:
            raise self.store_error("reading the isolation level", exc) from exc
        return isolation_report(levels, self.dialect.isolation, self.display_url)

    def isolation_levels(self) -> dict[str, str]:
        """The isolation level of a transaction of each kind the store runs, read inside it, by
        kind (upper case, as SQLAlchemy names them)."""
        return {
            "transactions": self._transaction(self._isolation_of),
            "single statements": self._transaction(self._isolation_of, single_statement=True),
            "reads": self._transaction(self._isolation_of, read_only=True),
        }

    def _isolation_of(self, connection: Connection) -> str:
        """The isolation level of the transaction ``connection`` is in."""
        if self.dialect.isolation_query is not None:
            return str(connection.exec_driver_sql(self.dialect.isolation_query).scalar()).upper()
        dbapi_connection = connection.connection.dbapi_connection
        return str(self._engine.dialect.get_isolation_level(dbapi_connection)).upper()  # type: ignore[arg-type]

    # -- life cycle ---------------------------------------------------------------------------

    def warm_up(self, threads: int = 1, renewals: bool = False) -> None:
        """Check the schema and open a pooled connection ahead of the first task."""
        if not self._schema_ready:
            self._prepare()
        self._transaction(lambda connection: connection.exec_driver_sql("SELECT 1"))

    def after_fork(self) -> None:
        # Connections inherited from the parent must not be used (nor closed) here.
        self._prepare_lock = threading.Lock()  # a thread of the parent may have held it
        self._engine.dispose(close=False)

    def close(self) -> None:
        if self._owns_engine:
            self._engine.dispose()


def isolation_report(levels: Mapping[str, str], needed: str, store: str) -> tuple[str, list[str]]:
    """``levels`` (isolation by kind of transaction) as one line, and a problem for each level
    that is not ``needed``, naming the kinds that run at it."""
    kinds: dict[str, list[str]] = {}
    for kind, level in levels.items():
        kinds.setdefault(level, []).append(kind)
    if list(kinds) == [needed]:
        return needed, []
    line = "; ".join(f"{level} ({', '.join(names)})" for level, names in kinds.items())
    problems = [
        f"{store}: the store's {' and '.join(names)} run at {level}, not {needed}, so admission can grant a "
        "slot beyond its limit (a count after a lock reads a snapshot from before the wait); something "
        "overrides the level the store sets on each connection: an event or option of the engine handed to "
        "it, or a proxy in between. Remove it, or give the store an engine of its own (caps_url as a URL)"
        for level, names in kinds.items()
        if level != needed
    ]
    return line, problems


def _cut(task_name: str | None) -> str | None:
    """A task name as kept with a lease: at most :data:`MAX_TASK_NAME_LENGTH` characters."""
    return None if task_name is None else task_name[:MAX_TASK_NAME_LENGTH]
