"""What a worker says when its slot store cannot be used, and when it can again.

A worker whose store is wrong (a wrong database, a wrong password) or away still starts
and says ``ready.``: its capped tasks wait, are put back or fail, by
``caps_on_store_error``.  So that this is never quiet, a worker's main process checks the
store when it starts, and :class:`StoreHealth` reports what it finds at WARNING: the store
(its URL with the password masked) and the cause, when the store first fails, again at most
once every :data:`REMINDER_SECONDS` while it keeps failing, and once when it answers again.

Store errors name the operation that met them ("creating the schema failed on ..."); the
first call in a process creates the schema, so a store that cannot be reached at all would
be reported as a schema problem.  :func:`describe` says "cannot connect" instead when the
driver failed to open a connection.

What the worker checks at start, and ``celery caps check`` too, is :func:`check_store`: a
round trip of admission and release on a scratch slot; on a SQL store, the isolation level its
transactions run at, read inside one of each kind (admission needs READ COMMITTED on PostgreSQL
and MySQL/MariaDB); and what in the way the store is reached would break it (a PostgreSQL
pooler with prepared statements on).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .errors import StoreError
from .settings import StoreErrorPolicy
from .stores.base import SlotStore

logger = logging.getLogger(__name__)

#: Seconds between two reminders that the store still cannot be used.
REMINDER_SECONDS = 60.0

#: What becomes of capped tasks while the store fails, by ``caps_on_store_error``.
_CONSEQUENCES: dict[str, str] = {
    "defer": "capped tasks wait (put back, caps_on_store_error='defer') until it answers",
    "run": "capped tasks run uncapped (caps_on_store_error='run') until it answers",
    "fail": "capped tasks fail (caps_on_store_error='fail') until it answers",
}


def is_connection_failure(exc: BaseException) -> bool:
    """Whether the driver error behind ``exc`` (its ``__cause__``) is a failure to connect
    (or a lost connection), not a failure of a statement on an open connection."""
    cause = exc.__cause__
    if cause is None:
        return False
    # SQLAlchemy: an error raised while opening a connection carries no statement.
    if hasattr(cause, "statement") and hasattr(cause, "connection_invalidated"):
        return getattr(cause, "statement", "") is None or bool(cause.connection_invalidated)
    # redis-py's ConnectionError (AuthenticationError included) and TimeoutError, the builtins.
    return any(
        kind.__name__ in ("ConnectionError", "TimeoutError") and kind.__module__.split(".")[0] in ("redis", "builtins")
        for kind in type(cause).__mro__
    )


def describe(exc: StoreError) -> str:
    """``exc`` as a worker reports it: ``cannot connect to the slot store <url>: <cause>`` for a
    failure to connect, whatever operation met it; else the store's own message."""
    text = str(exc)
    if not is_connection_failure(exc):
        return text
    # The store's message: "<operation> failed on <masked url>: <driver error>".
    _operation, separator, rest = text.partition(" failed on ")
    return f"cannot connect to the slot store {rest}" if separator else f"cannot connect to the slot store: {text}"


#: The slot names a store check takes and gives back: a fresh one each time, pruned after,
#: which no cap can ever name (cap names have no ``:``; a keyed cap's slot starts with its own).
CHECK_SLOT_PREFIX = "celery-caps-check:"


@runtime_checkable
class ChecksIsolation(Protocol):
    """A store whose transactions run at an isolation level (the SQL stores)."""

    def check_isolation(self) -> tuple[str, list[str]]:
        """The level its transactions run at, read inside one of each kind, as one line; and
        what is wrong with it (empty if nothing).

        Raises:
            StoreError: the store cannot be reached.
        """


@dataclass(frozen=True)
class CheckResult:
    """What :func:`check_store` found: the store's masked URL, the seconds its round trip took,
    what in the way it is reached would break it (empty if nothing), and the isolation level
    its transactions run at (``READ COMMITTED`` on PostgreSQL and MySQL/MariaDB, ``SERIALIZABLE``
    on SQLite; None for a store without transactions: memory, Redis)."""

    store: str
    seconds: float
    warnings: list[str]
    isolation: str | None = None


def check_store(store: SlotStore, holder: str, lease_seconds: float = 30.0) -> CheckResult:
    """Prove ``store`` works as admission needs it: prepare it (its schema), take a scratch slot
    of limit 1, be refused a second run of it, give it back, prune it; read the isolation level
    its transactions run at (:class:`ChecksIsolation`: a level other than the one admission
    needs is a warning, naming the kinds of transaction that run at it); then ask the store
    what in the way it is reached would break it (:meth:`SlotStore.connection_warnings`).  The
    slot is a fresh name under :data:`CHECK_SLOT_PREFIX`, pruned at the end, so it never counts
    against a real cap.

    Raises:
        StoreError: a call failed (the message names the store and the driver's error), or the
            store answered what no working store would.
    """
    started = time.monotonic()
    store.warm_up()
    slot = f"{CHECK_SLOT_PREFIX}{uuid.uuid4().hex}"
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    try:
        if not store.acquire({slot: 1}, first, first, holder, lease_seconds).granted:
            raise StoreError(f"{store.display_url}: a fresh slot of limit 1 was refused to its first run")
        if store.acquire({slot: 1}, second, second, holder, lease_seconds).granted:
            store.release(second)
            raise StoreError(f"{store.display_url}: a slot of limit 1 was granted to two runs at once")
        if store.release(first) != 1:
            raise StoreError(f"{store.display_url}: releasing the run that held a slot released nothing")
    finally:
        try:
            store.release(first)
            store.prune(slot)
        except StoreError:
            logger.debug("cleaning up the store check's slot failed", exc_info=True)
    seconds = time.monotonic() - started
    isolation, warnings = store.check_isolation() if isinstance(store, ChecksIsolation) else (None, [])
    return CheckResult(store.display_url, seconds, [*warnings, *store.connection_warnings()], isolation)


class StoreHealth:
    """One process's account of its store: see the module docstring."""

    def __init__(self, on_store_error: StoreErrorPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self._consequence = _CONSEQUENCES[on_store_error]
        self._clock = clock
        self._lock = threading.Lock()
        #: When the store started failing (clock seconds), None while it answers.
        self._failing_since: float | None = None
        self._failures = 0
        self._last_report = 0.0

    @property
    def failing(self) -> bool:
        return self._failing_since is not None

    def failed(self, exc: StoreError) -> None:
        """A store call failed: warn now if the store answered before (or never was used), and
        at most every :data:`REMINDER_SECONDS` while it keeps failing."""
        with self._lock:
            now = self._clock()
            first = self._failing_since is None
            if first:
                self._failing_since, self._failures = now, 0
            self._failures += 1
            due = first or now - self._last_report >= REMINDER_SECONDS
            if due:
                self._last_report = now
            failing_for, failures = now - (self._failing_since or now), self._failures
        if first:
            logger.warning("celery-caps: the slot store cannot be used: %s; %s", describe(exc), self._consequence)
        elif due:
            logger.warning(
                "celery-caps: the slot store still cannot be used after %.0f s (%d failed attempts): %s; %s",
                failing_for, failures, describe(exc), self._consequence,
            )  # fmt: skip

    def answered(self) -> None:
        """A store call succeeded: say so if the store was failing."""
        if self._failing_since is None:
            return
        with self._lock:
            if self._failing_since is None:
                return
            failing_for = self._clock() - self._failing_since
            self._failing_since = None
        logger.warning("celery-caps: the slot store answers again (it could not be used for %.0f s)", failing_for)
