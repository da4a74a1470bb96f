"""PostgreSQL's admission: a task's store steps in one round trip each.

:class:`PostgreSQLStore` is the portable :class:`~.waitlist.SQLStore` with the steps every task
takes — admission, park, release (with the hand-over it makes) and a woken copy's claim — run
as the functions of ``postgresql.sql`` on a psycopg connection in autocommit
(:class:`DriverPool`): no BEGIN and COMMIT, no pool checkout and no SQL compilation per call,
about a third of the cost of the same steps through SQLAlchemy Core.  Everything else (the
sweep, recovery, the operators' reads) is the portable store's.

Chosen by ``caps_url = "postgresql+psycopg://..."``; another PostgreSQL driver gets the
portable store.  Without its functions (``caps_create_schema`` off and the functions not
created), it runs as the portable store, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from importlib import resources
from typing import Any, NamedTuple

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..base import Admission, ClaimOutcome, ParkOutcome, ParkRequest, Woken, mask_url
from .dialects import READ_COMMITTED, SESSION_ISOLATION, behind_pooler, read_committed_session
from .leases import _cut
from .schema import SCHEMA_VERSION
from .statements import POSTGRESQL_CALLS
from .waitlist import SQLStore

logger = logging.getLogger(__name__)

#: The slot names a warm-up rehearses the hot path on (in a transaction rolled back: never seen).
WARM_UP_SLOT_PREFIX = "celery-caps-warm-up:"
#: Seconds a connection may sit unused before it is closed (a running task's renewals use it
#: every third of a lease; an idle process keeps none).
IDLE_SECONDS = 30.0
#: Seconds a call waits for one of its process's connections when all are in use (``limit``)
#: before it opens one more anyway: never a deadlock, whatever holds them.
LIMIT_WAIT_SECONDS = 30.0


def function_statements() -> list[str]:
    """The statements of ``postgresql.sql``, in order (a line holding only ``;`` ends one), then
    the function that names their digest (:func:`functions_digest`)."""
    statements: list[str] = []
    current: list[str] = []
    for line in _function_source().splitlines():
        if line.strip() == ";":
            statement = "\n".join(current).strip()
            if any(not part.startswith("--") for part in statement.splitlines() if part.strip()):
                statements.append(statement)
            current = []
        else:
            current.append(line)
    # Before the schema version's function, which stays last: its presence says all are there.
    statements.insert(
        len(statements) - 1,
        "CREATE OR REPLACE FUNCTION concurrency_slots_functions_digest() RETURNS text\n"
        f"LANGUAGE sql IMMUTABLE AS $$ SELECT '{functions_digest()}' $$",
    )
    return statements


def _function_source() -> str:
    return resources.files(__package__).joinpath("postgresql.sql").read_text(encoding="utf-8")


def functions_digest() -> str:
    """A digest of ``postgresql.sql``: the functions in a database are created again whenever
    theirs differs, so that a database set up by another version of the package never runs
    functions this one does not expect (the schema version alone would not change before the
    first release)."""
    return hashlib.sha256(_function_source().encode("utf-8")).hexdigest()[:16]


class Kept(NamedTuple):
    """A connection of :class:`DriverPool` not in use, with the cursor its calls reuse."""

    connection: psycopg.Connection[Any]
    cursor: psycopg.Cursor[Any]
    #: When it was given back (``time.monotonic()``).
    returned: float


#: Driver connections a forked process inherited: kept referenced (a finaliser would close the
#: parent's session), never used.
_INHERITED: list[Any] = []


class DriverPool:
    """psycopg connections in autocommit for the hot path, each checked out for one call, their
    sessions' default isolation READ COMMITTED (set as each is opened, with the check for a
    pooler it makes anyway: :func:`.read_committed_session`).  Through a connection pooler the
    session's default cannot be set (it would reach other clients' sessions): on a server
    whose default is another level, each call there runs in a transaction of its own at READ
    COMMITTED (two more round trips, said once at WARNING).

    A process opens connections as its threads call at once, up to ``limit`` (None: no limit;
    a call beyond it waits for one, at most :data:`LIMIT_WAIT_SECONDS`), and closes each once
    unused for ``idle_seconds``: at the next call, or by a reaper thread of its own while the
    process makes none, so an idle process holds no connection.  The most recently used
    connection is handed out first, so the extra ones age.  A connection whose call failed is
    closed, never reused.  After a fork the parent's connections are left alone.  Connections
    come from the engine (its connect arguments and events) and are detached from its pool at
    once.  ``on_reap`` runs at each of the reaper's rounds (the store closes its engine's idle
    connections there) and returns whether anything is left for it to watch.
    """

    def __init__(
        self,
        engine: Engine,
        idle_seconds: float = IDLE_SECONDS,
        limit: int | None = None,
        on_reap: Callable[[float], bool] | None = None,
    ) -> None:
        self._engine = engine
        self.idle_seconds = idle_seconds
        self.limit = limit
        self._on_reap = on_reap
        # The most recently given back last.
        self._idle: list[Kept] = []
        # A plain lock on the hot path (check-out, check-in); its condition only for a call that
        # waits for room under ``limit`` (``_waiting`` of them: nobody is notified otherwise).
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._waiting = 0
        #: Connections of this process open now (idle or in a call).
        self.open = 0
        self._pid = os.getpid()
        # A rehearsal's connection, used by every call of its thread until it is given back.
        self._pinned = threading.local()
        self._rehearsing = 0  # rehearsals under way: only then may a thread hold a pinned connection
        # The reaper thread while it runs (it clears this itself, under the lock, as it ends).
        self._reaper: threading.Thread | None = None
        self._closed = threading.Event()
        self._said_per_call = False

    def execute(self, sql: str, params: Mapping[str, Any], *, fetch: bool = True) -> tuple[list[tuple[Any, ...]], int]:
        """Run ``sql`` (``%(name)s`` parameters): its rows (``fetch``: a statement that returns
        rows; else none are read) and row count.

        Raises the driver's error, after closing the connection.
        """
        pinned = getattr(self._pinned, "connection", None) if self._rehearsing else None
        if pinned is not None:  # (an error: the rehearsal closes it)
            return _results(pinned.execute(sql, params), fetch)
        connection, cursor = self._checkout()
        try:
            results = _results(cursor.execute(sql, params), fetch)
            if not connection.autocommit:  # (a pooled session at another level: see the class)
                connection.commit()
        except BaseException:
            self._close(connection)
            raise
        self._checkin(connection, cursor)
        return results

    @property
    def idle(self) -> int:
        """Connections kept open for the next calls."""
        return len(self._idle)

    def _checkout(self) -> tuple[psycopg.Connection[Any], psycopg.Cursor[Any]]:
        if os.getpid() != self._pid:
            self._forget_inherited()
        with self._lock:
            if self._idle:
                kept = self._idle.pop()
                return kept.connection, kept.cursor
        connection = self._connect()
        return connection, connection.cursor()

    def _reserve(self) -> bool:
        """Wait for room for one more connection under ``limit``; count it open.  Returns
        whether an idle connection came back meanwhile instead (the caller takes it)."""
        deadline = time.monotonic() + LIMIT_WAIT_SECONDS
        with self._room:
            while self.limit is not None and self.open >= self.limit and not self._idle:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning(
                        "all %d store connection(s) of this process stayed in use for %.0f s: opening one more",
                        self.open, LIMIT_WAIT_SECONDS,
                    )  # fmt: skip
                    break
                self._waiting += 1
                try:
                    self._room.wait(remaining)
                finally:
                    self._waiting -= 1
            if self._idle and self.limit is not None and self.open >= self.limit:
                return True
            self.open += 1
            return False

    def _connect(self, fresh: bool = False) -> psycopg.Connection[Any]:
        """A connection for one call (an idle one if one came back while waiting for room),
        or with ``fresh`` always a new one."""
        while self._reserve():
            if fresh:
                self._close_oldest_idle()
                continue
            with self._lock:
                if self._idle:
                    return self._idle.pop().connection
        try:
            fairy = self._engine.raw_connection()
            connection: psycopg.Connection[Any] = fairy.driver_connection  # type: ignore[assignment]
            # Set when the engine (one built by this package) opened it; else set here.
            isolation = fairy.info.get(SESSION_ISOLATION)
            fairy.detach()  # ours now: the engine's pool forgets it (and its slot)
            connection.autocommit = True
            if isolation is None:
                _pooled, isolation = read_committed_session(connection)
            if isolation != READ_COMMITTED:
                self._transaction_per_call(connection, isolation)
        except BaseException:
            with self._lock:
                self.open -= 1
                self._notify()
            raise
        return connection

    def _transaction_per_call(self, connection: psycopg.Connection[Any], isolation: str) -> None:
        """``connection``'s session runs at ``isolation`` by default: its calls run in transactions
        of their own at READ COMMITTED instead (psycopg names the level in the BEGIN it sends)."""
        connection.autocommit = False
        connection.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        if not self._said_per_call:
            self._said_per_call = True
            logger.warning(
                "%s: sessions reached through a connection pooler default to %s, not READ COMMITTED: each store "
                "call runs in a transaction of its own at READ COMMITTED (two more round trips); set "
                "default_transaction_isolation = 'read committed' for the role or the database (ALTER ROLE ... "
                "IN DATABASE ... SET) to save them",
                mask_url(self._engine.url.render_as_string(hide_password=False)),
                isolation,
            )

    def _close_oldest_idle(self) -> None:
        with self._lock:
            oldest = self._idle.pop(0).connection if self._idle else None
        if oldest is not None:
            self._close(oldest)

    def _checkin(self, connection: psycopg.Connection[Any], cursor: psycopg.Cursor[Any] | None = None) -> None:
        """Keep ``connection`` for the next calls; close those unused for ``idle_seconds``."""
        if cursor is None:
            cursor = connection.cursor()
        now = time.monotonic()
        with self._lock:
            self._idle.append(Kept(connection, cursor, now))
            self._notify()
            stale = self._idle[0].returned <= now - self.idle_seconds
        if stale:
            self.close_idle(self.idle_seconds)
        if self._reaper is None:
            self._ensure_reaper()

    def _notify(self) -> None:
        """Wake one call waiting for room (the lock held)."""
        if self._waiting:
            self._room.notify()

    def close_idle(self, idle_seconds: float) -> int:
        """Close the connections unused for ``idle_seconds`` or more; returns how many."""
        deadline = time.monotonic() - idle_seconds
        stale = []
        with self._lock:
            while self._idle and self._idle[0].returned <= deadline:
                stale.append(self._idle.pop(0).connection)
        for old in stale:
            self._close(old)
        return len(stale)

    def _close(self, connection: psycopg.Connection[Any]) -> None:
        try:
            connection.close()
        except Exception:  # already broken: nothing more to close
            logger.debug("closing a store connection failed", exc_info=True)
        with self._lock:
            self.open = max(0, self.open - 1)
            self._notify()

    def _ensure_reaper(self) -> None:
        """A thread closing idle connections while nobody calls (started on demand, ends when
        nothing is left to close)."""
        if self._reaper is not None:
            return
        with self._lock:
            if self._closed.is_set() or self._reaper is not None:
                return
            self._reaper = threading.Thread(target=self._reap, name="celery-caps-idle-connections", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        pid = os.getpid()
        interval = min(max(self.idle_seconds / 4, 0.05), 10.0)
        closed = self._closed
        try:
            while not closed.wait(interval) and os.getpid() == pid:
                self.close_idle(self.idle_seconds)
                watching = self._on_reap(self.idle_seconds) if self._on_reap is not None else False
                with self._lock:
                    if not self._idle and self.open == 0 and not watching:
                        self._reaper = None
                        return
        finally:
            # Ended otherwise (closed, an error): the next check-in starts another.
            if os.getpid() == pid:
                with self._lock:
                    if self._reaper is threading.current_thread():
                        self._reaper = None

    def watch(self) -> None:
        """Make sure the reaper runs (the store's engine has connections to watch too)."""
        if os.getpid() == self._pid:
            self._ensure_reaper()

    @contextmanager
    def rehearsal(self) -> Iterator[None]:
        """A new connection for this thread's calls inside the block, in a transaction rolled back
        at its end; then kept idle for the next calls.

        A new session compiles each function and plans its statements on its first calls (about
        6 ms for the release-and-wake function alone) and loads the caches of the tables they
        read: the first hand-overs of a freshly started worker would pay all that.  The compiled
        functions and plans outlive the rollback; what was written does not, and nobody saw it.
        """
        if os.getpid() != self._pid:
            self._forget_inherited()
        connection = self._connect(fresh=True)
        self._pinned.connection = connection
        with self._lock:
            self._rehearsing += 1
        try:
            if connection.autocommit:  # (else psycopg begins one itself)
                connection.execute("BEGIN")
            yield
            connection.execute("ROLLBACK")
        except BaseException:
            self._close(connection)  # its transaction goes with it
            raise
        finally:
            self._pinned.connection = None
            with self._lock:
                self._rehearsing = max(0, self._rehearsing - 1)
        if os.getpid() == self._pid:  # (else the parent's, across a fork: left alone)
            self._checkin(connection)

    def _forget_inherited(self) -> None:
        _INHERITED.extend(kept.connection for kept in self._idle)
        self._idle = []
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._waiting = 0
        self.open = 0
        self._pinned = threading.local()
        self._rehearsing = 0
        self._reaper = None
        self._closed = threading.Event()
        self._pid = os.getpid()

    def close(self) -> None:
        if os.getpid() != self._pid:
            self._forget_inherited()
            return
        self._closed.set()
        with self._lock:
            idle, self._idle = self._idle, []
        for kept in idle:
            self._close(kept.connection)
        self._closed = threading.Event()  # (usable again: a store may be used after close)
        self._reaper = None


def _results(cursor: psycopg.Cursor[Any], fetch: bool) -> tuple[list[tuple[Any, ...]], int]:
    # (not cursor.description: psycopg builds its column objects anew at each look)
    return (cursor.fetchall() if fetch else []), cursor.rowcount


class PostgreSQLStore(SQLStore):
    """The SQL store on PostgreSQL with psycopg: see the module docstring."""

    driver_errors: tuple[type[BaseException], ...] = (sa.exc.SQLAlchemyError, psycopg.Error)

    def __init__(self, target: str | Engine, *, create_schema: bool = True) -> None:
        super().__init__(target, create_schema=create_schema)
        self.pool = DriverPool(self._engine, on_reap=self._close_idle_engine)
        # When the engine's pool last took a connection back (time.monotonic()): the hot path
        # never uses it, so what it keeps after the schema check or a sweep is closed once idle.
        self._engine_returned = 0.0
        if self._owns_engine:
            sa.event.listen(self._engine, "checkin", self._engine_checkin)
        #: Whether the functions of this schema version are there (known once prepared).
        self.functions = False

    # -- the schema ---------------------------------------------------------------------------

    def create_schema(self) -> None:
        """The tables, then the functions unless this version's are there already (same schema
        version, same digest)."""
        super().create_schema()
        try:
            with self._engine.begin() as connection:
                connection.exec_driver_sql(POSTGRESQL_CALLS["schema_lock"])
                if self._installed_functions(connection) != (SCHEMA_VERSION, functions_digest()):
                    # Dropped first: CREATE OR REPLACE cannot change a function's parameters.
                    for (drop,) in connection.exec_driver_sql(POSTGRESQL_CALLS["drop_functions"]).all():
                        connection.exec_driver_sql(drop)
                    for statement in function_statements():
                        connection.exec_driver_sql(statement)
        except sa.exc.SQLAlchemyError as exc:
            raise self.store_error("creating the store's functions", exc) from exc

    def schema_statements(self) -> list[str]:
        """The tables' DDL, then the functions of ``postgresql.sql``."""
        return [*super().schema_statements(), *function_statements()]

    @staticmethod
    def _installed_functions(connection: sa.Connection) -> tuple[int, str]:
        """The schema version and the digest of the functions on the search path (0 and "":
        none)."""
        if not connection.exec_driver_sql(POSTGRESQL_CALLS["has_schema_version"]).scalar():
            return 0, ""
        version = int(connection.exec_driver_sql(POSTGRESQL_CALLS["schema_version"]).scalar() or 0)
        if not connection.exec_driver_sql(POSTGRESQL_CALLS["has_functions_digest"]).scalar():
            return version, ""
        return version, str(connection.exec_driver_sql(POSTGRESQL_CALLS["functions_digest"]).scalar() or "")

    def _prepare(self) -> None:
        with self._prepare_lock:
            if self._schema_ready:
                return
            if self._create_schema:
                self.create_schema()
            try:
                with self._engine.connect() as connection:
                    version, digest = self._installed_functions(connection)
                    self._settle_isolation(connection)
            except sa.exc.SQLAlchemyError as exc:
                raise self.store_error("checking the schema", exc) from exc
            self.functions = (version, digest) == (SCHEMA_VERSION, functions_digest())
            if self.functions:
                self._close_idle_engine(0.0)  # the hot path runs on the driver pool from now on
            if not self.functions:
                logger.warning(
                    "%s: the store's functions of schema version %d (digest %s) are missing or out of date (found "
                    "%s; caps_create_schema is off): each step runs as a transaction of several statements instead; "
                    "create them with `celery caps schema --sql`",
                    self.display_url,
                    SCHEMA_VERSION,
                    functions_digest(),
                    f"version {version}, digest {digest or 'none'}" if version else "none",
                )
            self._schema_ready = True

    def _call(self, name: str, params: Mapping[str, Any], *, fetch: bool = True) -> tuple[list[tuple[Any, ...]], int]:
        return self.pool.execute(POSTGRESQL_CALLS[name], params, fetch=fetch)

    def _ready(self) -> bool:
        """Whether the functions are there (preparing first, on first use)."""
        if not self._schema_ready:
            self._prepare()
        return self.functions

    # -- the hot path -----------------------------------------------------------------------

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
        if not self._ready():
            return super().acquire(slots, task_id, run_id, holder, lease_seconds, task_name, weights)
        ordered = sorted(slots)
        rows, _ = self._call(
            "acquire",
            {
                "slots": ordered,
                "limits": [slots[slot] for slot in ordered],
                "task_id": task_id,
                "run_id": run_id,
                "holder": holder,
                "lease_seconds": lease_seconds,
                "task_name": _cut(task_name),
                "weights": [weights.get(slot, 1) if weights else 1 for slot in ordered],
                "deployment": self.deployment,
            },
        )
        full = rows[0][0]
        return Admission(False, tuple(full)) if full else Admission(True)

    def park(self, request: ParkRequest) -> ParkOutcome:
        if not self._ready():
            return super().park(request)
        ordered = sorted(request.slots)
        rows, _ = self._call(
            "park",
            {
                "slots": ordered,
                "limits": [request.slots[slot] for slot in ordered],
                "task_id": request.task_id,
                "run_id": request.run_id,
                "holder": request.holder,
                "lease_seconds": request.lease_seconds,
                "task_name": _cut(request.task_name),
                "payload": request.payload,
                "first_deferred_at": request.first_deferred_at,
                "max_waiters": request.max_waiters,
                "deployment": self.deployment,
                "weights": [request.weights.get(slot, 1) for slot in ordered],
                # (NULL without fair keys: a list of NULLs only has no type for the driver.)
                "fair_keys": [request.fair_keys.get(slot) for slot in ordered] if request.fair_keys else None,
            },
        )
        return ParkOutcome(rows[0][0])

    def renew(self, run_ids: Collection[str], lease_seconds: float) -> dict[str, int]:
        if not run_ids or not self._ready():
            return super().renew(run_ids, lease_seconds)
        rows, _ = self._call("renew", {"run_ids": list(run_ids), "lease_seconds": lease_seconds})
        renewed: dict[str, int] = {}
        for (run_id,) in rows:
            renewed[run_id] = renewed.get(run_id, 0) + 1
        return renewed

    def release(self, run_id: str) -> int:
        if not self._ready():
            return super().release(run_id)
        _, deleted = self._call("release", {"run_id": run_id}, fetch=False)
        return deleted

    def release_and_wake(self, run_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        if not self._ready():
            return super().release_and_wake(run_id, dispatch_lease_seconds)
        # One round trip, whether or not anybody waits for the freed slots.
        params = {"run_id": run_id, "dispatch_lease_seconds": dispatch_lease_seconds, "deployment": self.deployment}
        rows, _ = self._call("release_and_wake", params)
        woken = [
            Woken(str(task_id), str(woken_run_id), bytes(payload), task_name)
            for _, task_id, woken_run_id, payload, task_name in rows
            if task_id is not None
        ]
        return int(rows[0][0]), woken

    # -- the waiting-list walk: the function's, never the portable store's ----------------------

    def _wake_after_release(
        self, connection: sa.Connection, released: list[str], dispatch_lease_seconds: float
    ) -> list[Woken]:
        if not self.functions:
            return super()._wake_after_release(connection, released, dispatch_lease_seconds)
        return self._wake(connection, released, dispatch_lease_seconds)

    def _dispatch(
        self, connection: sa.Connection, locked: list[str], dispatch_lease_seconds: float, touching: set[str] | None
    ) -> list[Woken]:
        if not self.functions:
            return super()._dispatch(connection, locked, dispatch_lease_seconds, touching)
        walked = locked if touching is None else [slot for slot in locked if slot in touching]
        return self._wake(connection, walked, dispatch_lease_seconds)

    def _wake(self, connection: sa.Connection, slots: Collection[str], dispatch_lease_seconds: float) -> list[Woken]:
        """Dispatch the waiters of this deployment that ``slots`` can now admit
        (``concurrency_slots_wake``)."""
        if not slots:
            return []
        params = {
            "slots": sorted(set(slots)),
            "dispatch_lease_seconds": dispatch_lease_seconds,
            "deployment": self.deployment,
        }
        rows = connection.exec_driver_sql(POSTGRESQL_CALLS["wake"], params).all()
        return [
            Woken(str(task_id), str(run_id), bytes(payload), task_name) for task_id, run_id, payload, task_name in rows
        ]

    def claim(
        self, task_id: str, run_id: str, holder: str, lease_seconds: float, *, redelivered: bool = False
    ) -> ClaimOutcome:
        if not self._ready():
            return super().claim(task_id, run_id, holder, lease_seconds, redelivered=redelivered)
        params = {
            "task_id": task_id,
            "run_id": run_id,
            "holder": holder,
            "lease_seconds": lease_seconds,
            "redelivered": redelivered,
            "done_seconds": self.done_seconds,
        }
        rows, _ = self._call("claim", params)
        return ClaimOutcome(rows[0][0])

    # -- life cycle -------------------------------------------------------------------------

    def warm_up(self, threads: int = 1, renewals: bool = False) -> None:
        """Check the schema and open a hot-path connection ahead of use for each of ``threads``
        threads, each rehearsed (:meth:`DriverPool.rehearsal`), and with ``renewals`` one more
        for the renewals."""
        if not self._ready():
            super().warm_up(threads, renewals)
            return
        wanted = threads + (1 if renewals else 0)
        if self.pool.limit is not None:
            wanted = min(wanted, self.pool.limit)
        for _ in range(max(0, wanted - self.pool.idle)):
            with self.pool.rehearsal():
                self._rehearse_hot_path()

    def _rehearse_hot_path(self) -> None:
        """A task's store calls, each path of them once, on a slot of its own (rolled back by the
        caller): admission; a park (new and again); the release that hands the slot over; the
        claims of that dispatch (by its copy, by a second copy) and of an unknown one; and a
        release with nobody waiting."""
        slot = f"{WARM_UP_SLOT_PREFIX}{uuid.uuid4().hex}"
        holder, lease = "celery-caps-warm-up", 60.0
        first_task, first_run, waiter_task, waiter_run, other_task, other_run = (uuid.uuid4().hex for _ in range(6))
        if not self.acquire({slot: 1}, first_task, first_run, holder, lease).granted:
            return  # (cannot happen: nobody else sees this slot)
        request = ParkRequest(
            {slot: 1}, waiter_task, waiter_run, holder, lease, time.time(), max_waiters=10, payload=b""
        )
        for _ in range(2):  # parked, then waiting already
            self.park(request)
        _deleted, woken = self.release_and_wake(first_run, lease)
        for waiter in woken:
            for _ in range(2):  # run, then end (another copy runs it)
                self.claim(waiter.task_id, waiter.run_id, holder, lease)
            self.claim(other_task, other_run, holder, lease)
            self.release_and_wake(waiter.run_id, lease)

    def isolation_levels(self) -> dict[str, str]:
        """The portable store's kinds, and the calls of the functions (the hot path)."""
        levels = super().isolation_levels()
        if self._ready():
            rows, _ = self.pool.execute("SHOW transaction_isolation", {})
            levels["function calls"] = str(rows[0][0]).upper()
        return levels

    def connection_warnings(self) -> list[str]:
        """A connection pooler between the store and PostgreSQL with server-side prepared
        statements on (``prepare_threshold`` set in ``caps_url``): under transaction pooling
        they reach other clients' sessions."""
        fairy = self._engine.raw_connection()
        try:
            driver = fairy.driver_connection
            pooled = behind_pooler(driver)
            threshold = getattr(driver, "prepare_threshold", None)
        finally:
            fairy.close()
        if not pooled or threshold is None:
            return []
        return [
            f"{self.display_url} is reached through a connection pooler (PgBouncer?) with server-side prepared "
            f"statements on (prepare_threshold={threshold}): under transaction pooling they collide with other "
            "clients' statements (DuplicatePreparedStatement, or another statement run); remove prepare_threshold "
            "from caps_url (off through a pooler by default) or set prepare_threshold=none"
        ]

    def limit_connections(self, count: int | None) -> None:
        self.pool.limit = count

    def _engine_checkin(self, _dbapi_connection: Any, _record: Any) -> None:
        self._engine_returned = time.monotonic()
        self.pool.watch()

    def _close_idle_engine(self, idle_seconds: float) -> bool:
        """Close the connections the engine's pool keeps, if none is in use and the last came
        back ``idle_seconds`` ago or more (an engine handed in is left alone).  Returns whether
        it keeps any still (to watch)."""
        if not self._owns_engine:
            return False
        pool = self._engine.pool
        checked_in, checked_out = getattr(pool, "checkedin", None), getattr(pool, "checkedout", None)
        if checked_in is None or checked_out is None or checked_in() == 0:
            return False
        if checked_out() == 0 and time.monotonic() - self._engine_returned >= idle_seconds:
            self._engine.dispose()  # closes what it keeps; a connection taken meanwhile is not affected
            return False
        return True

    def after_fork(self) -> None:
        self.pool.close()  # (in the child: forgets the parent's connections, closes none)
        super().after_fork()

    def close(self) -> None:
        self.pool.close()
        super().close()
