"""The slot-store contract, and choosing a store from a URL.

A store does only what must be atomic where the slots live: take a set of slots
all-or-nothing, renew leases, release them, sweep expired ones, and report.  Cap
rules, key derivation, backoff and everything Celery live above it, so a store
could serve any job framework.

Vocabulary
----------
slot name
    ``"email-provider"`` or ``"tenant:acme"``: what a limit applies to.
task id
    The job's identity.  A slot's limit counts *distinct task ids* holding a live
    lease: two runs of one task id count once.
run id
    One execution of a task id (unique per admission).  Each run renews and
    releases only its own leases.
holder
    Who runs it, ``"<worker node name>/<pid>"``; lets a supervisor release a run
    whose process died, and shows operators where a slot is held.
lease
    One row/entry per (slot, run) with an expiry computed by the **store's
    clock**; a lease past its expiry no longer counts and is removed by ``sweep``.
sentinel
    One permanent entry per slot name (with the last limit seen), which
    admission locks before counting; ``sweep`` never removes it.

history
    Optional, bounded records of what happened (a task put back because slots
    were full, a run that ended), written in batches by workers that have
    history enabled and read by operator tools; never on the admission path.

Writing a store
---------------
Subclass :class:`SlotStore` and implement every abstract method (a missing one
fails when the store is created).  ``acquire`` must be atomic and serialised per
slot name: two admissions that compete for the last slot must never both
succeed, and a multi-slot admission takes all its slots or none.  Every method
raises :class:`~celery_caps.errors.StoreError` (wrapping the driver error) when
the store cannot be reached.  Pass an instance as ``caps_url``.

Parking (optional)
------------------
A store that sets :attr:`SlotStore.supports_parking` also keeps a *waiting
list*: tasks that found their slots full park there (an opaque payload that
republishes the task) instead of going back to the broker, and a release hands
freed slots directly to the oldest waiters.  The atomic steps:

``park``
    Under the same sentinel locks as ``acquire``: admit if every slot has room
    now, else record the waiter (one entry per slot it needs).  Admission and
    parking are one step, so a release that committed before it is seen as room,
    and one that commits after it sees the waiter: no waiter is ever stranded.
``release_and_wake`` (and ``release_holder_and_wake``, ``release_task_and_wake``)
    Delete one run's leases (or a dead process's, or a revoked task's) and, in
    the same transaction, *dispatch* the oldest waiters (by first-deferral time,
    then park time) whose every slot now has room: a short *dispatch lease* is
    created under the waiter's task id, held by :data:`DISPATCH_HOLDER` (so no
    newer task can take the room), and its payload is returned for the caller
    to publish.  A waiter whose slots are not all free is passed over, never
    blocks the ones behind it.  Every release of a store in use by parked tasks
    goes through one of these, so freed room always goes to waiters first.
``forget``
    The task is not to run (revoked): remove its waiting entries and dispatch
    leases, and wake the waiters of the slots that frees.
``claim``
    The dispatched task arrived: turn its dispatch lease into a run lease (holder,
    full lease length) and delete its waiter entries.
``wake``
    For the sweep: waiters whose dispatch lease expired unclaimed (the releaser
    died before publishing, the message was lost) go back to waiting at their
    old place, then every waiting slot with room is dispatched again.
``expire_waiters``, ``drain`` and ``settle_published``
    Waiters leave the list without slots (waited too long, an operator drains a
    cap) at least once: they are marked (a dispatch without leases), published,
    and only then deleted; a mark that is not settled expires like a dispatch.

Standby (optional, for a store that parks)
------------------------------------------
A store that sets :attr:`SlotStore.supports_standby` can also signal a dispatch to a
worker process that waits for it, instead of the releaser publishing the message:

``stand_by``
    Put the oldest waiters of some slots *on standby* (a record under a fresh mark,
    for ``hold_seconds``), within a bound per slot and in all; return their payloads.
    The caller publishes a copy of each, which a pool process holds while it waits.
    The waiter keeps its place and its entries: it is dispatched like any other.
``release_and_wake`` and the other dispatching steps
    A woken waiter whose standby is live is *taken* in the same transaction (the
    dispatch run id written to its standby record) and signalled once it commits;
    it comes back with ``Woken.standby`` set, and the caller does not publish it.
``await_standby``
    The waiting process: it records its holder and lease length in its standby
    (a release from then on creates the leases in its name, claimed), then waits
    for the signal until ``timeout`` and returns the dispatch.  On timeout the standby ends, in
    one step against the release: either it ends (None: the copy is dropped, the
    waiter waits on in the list) or a release took it first (its run id).
``claim_dispatch``
    ``claim``, also answering whether other tasks still wait for the claimed slots (in the
    same step), so that a run that starts with waiters behind it can put them on standby.

``warm_up`` (any store) prepares what a first call would (schema, scripts) and connects
ahead of use; a worker's pool processes call it when they start.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import ConfigurationError, MissingDependencyError


@dataclass(frozen=True)
class Admission:
    """The outcome of :meth:`SlotStore.acquire`."""

    granted: bool
    #: The slot names that were full (empty when granted).
    full_slots: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lease:
    """One live or expired lease, as operators see it."""

    slot: str
    task_id: str
    run_id: str
    holder: str
    #: Seconds until the lease expires by the store's clock (negative: expired).
    expires_in: float
    #: The task's name, when the admitting worker gave one (None for leases
    #: taken by older versions or through a schema without the column).
    task_name: str | None = None
    #: Seconds since the lease was taken, by the store's clock (None: unknown).
    age: float | None = None


@dataclass(frozen=True)
class SlotStatus:
    """One slot name's state."""

    slot: str
    #: The limit last used to admit into this slot (None if never recorded).
    limit: int | None
    #: Distinct task ids holding a live lease.
    holders: int
    #: Lease rows past their expiry that the sweep has not removed yet.
    expired: int


@dataclass(frozen=True)
class HistoryEvent:
    """One record of the optional history: a put-back or a finished run.

    Times are epoch seconds by the clock of the process that recorded the event.
    """

    #: ``"deferred"`` (slots were full, the task was put back) or ``"ran"`` (a run ended).
    kind: str
    #: When it happened: the put-back, or the end of the run.
    at: float
    task_id: str
    task_name: str | None
    #: The slots the task needed (``deferred``) or held (``ran``).
    slots: tuple[str, ...]
    #: ``deferred``: the slots that were full.
    full_slots: tuple[str, ...] = ()
    #: Who recorded it (``"<node>/<pid>"``).
    holder: str = ""
    #: ``ran``: when the run was admitted.
    started_at: float | None = None
    #: How many times the task had been put back before this event.
    deferrals: int = 0


@dataclass(frozen=True)
class Woken:
    """A waiter to publish again (``payload``): handed its slots by a release or ``wake``, or
    taken off the list by ``expire_waiters``/``drain``."""

    task_id: str
    #: The run id of the dispatch leases (the arriving task claims them with it), or the
    #: mark of ``expire_waiters``/``drain`` (for ``settle_published``).
    run_id: str
    #: The message (may be empty for a dispatch signalled to its standby: it is not published).
    payload: bytes
    task_name: str | None = None
    #: A dispatch signalled to the waiter's standby process (``await_standby``): not to publish.
    standby: bool = False


@dataclass(frozen=True)
class Standby:
    """One waiter on standby, as operators see it."""

    task_id: str
    #: The waiting process (``"<node>/<pid>"``) once its copy waits; None until then.
    holder: str | None
    #: A release took it for a dispatch (the waiting process runs it).
    taken: bool
    #: Seconds until the standby expires, by the store's clock (negative: expired).
    expires_in: float


@dataclass(frozen=True)
class StandbyDispatch:
    """What :meth:`SlotStore.await_standby` returns once a release took the standby."""

    #: The run id of the waiter's leases.
    run_id: str
    #: True: the release handed the leases over claimed (the waiting process's holder, a full
    #: lease, the task out of the waiting list).  False: a dispatch lease, to claim as usual.
    claimed: bool


@dataclass(frozen=True)
class Claimed:
    """What :meth:`SlotStore.claim_dispatch` did."""

    #: How many leases were claimed (0: the dispatch expired; admit as usual).
    leases: int
    #: Other tasks still wait for one of the claimed slots (read in the same step; a hint for
    #: putting the next of them on standby while this run is young).
    waiters_behind: bool = False
    #: Nothing was claimed, and the task's waiting entry is dispatched again, to another run
    #: whose dispatch is live: another copy of the task is on its way or runs already, and
    #: this one should end (admitted as usual, it would run the task twice).  The entry stays.
    dispatched_elsewhere: bool = False


@dataclass(frozen=True)
class Waiter:
    """One parked task's entry for one slot, as operators see it."""

    slot: str
    task_id: str
    task_name: str | None
    #: When the task was first deferred (epoch seconds, the deferring worker's clock).
    first_deferred_at: float
    #: Seconds since it parked, by the store's clock.
    age: float
    #: 1 for the oldest waiter of the slot.
    position: int
    #: Whether it has been dispatched (its slots are reserved, its message is on the way).
    dispatched: bool


#: The holder of a dispatch lease until the dispatched task claims it.
DISPATCH_HOLDER = "caps-dispatch"

#: ``park`` outcomes: admitted (room after all), parked (or was already), or the
#: slot's waiting list holds ``max_waiters`` already.
PARK_ADMITTED = "admitted"
PARK_PARKED = "parked"
#: ``park(report_first=True)``: parked, first in the waiting list of one of its slots at least
#: (nobody waited there before it; a running holder's claim put no one on standby).
PARK_PARKED_FIRST = "parked_first"
PARK_LIST_FULL = "waitlist_full"
#: ``park(admit=False)``: every slot has room; nothing was taken or stored.
PARK_ROOM = "room"


#: The history kinds a store accepts.
HISTORY_KINDS = ("deferred", "ran")


class SlotStore(abc.ABC):
    """What a slot store must do; see the module docstring for the rules."""

    @abc.abstractmethod
    def acquire(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        task_name: str | None = None,
    ) -> Admission:
        """Take one lease per slot for ``run_id``, all or none, in one atomic step.

        ``slots`` maps slot names to their limits.  A slot admits when fewer than
        its limit distinct task ids hold live leases, or when ``task_id`` already
        holds one (the same task id counts once).  Leases expire ``lease_seconds``
        after now by the store's clock; they remember ``task_name`` and when they
        were taken (store clock), for operators.
        """

    @abc.abstractmethod
    def renew(self, run_ids: Collection[str], lease_seconds: float) -> dict[str, int]:
        """Push the expiry of every live lease of ``run_ids`` to now + ``lease_seconds``.

        Leases already expired are not revived (another task may own their room
        now).  Returns how many leases were renewed per run id; a run missing from
        the result, or with fewer leases than it took, has lost its slot.
        """

    @abc.abstractmethod
    def release(self, run_id: str) -> int:
        """Delete the leases of one run; returns how many were deleted."""

    @abc.abstractmethod
    def release_holder(self, task_id: str, holder: str) -> int:
        """Delete the leases ``holder`` took for ``task_id`` (its process died)."""

    @abc.abstractmethod
    def release_task(self, task_id: str) -> int:
        """Delete every lease of ``task_id``, whatever run or holder (revoke)."""

    @abc.abstractmethod
    def sweep(self) -> int:
        """Delete expired leases, never sentinels; returns how many were deleted."""

    @abc.abstractmethod
    def status(self) -> list[SlotStatus]:
        """Every known slot name with its limit, live holders and unswept leases."""

    @abc.abstractmethod
    def leases(self, slot: str | None = None) -> list[Lease]:
        """Every lease (of one slot name, if given), live or expired."""

    @abc.abstractmethod
    def prune(self, prefix: str, *, dry_run: bool = False) -> list[str]:
        """Delete the sentinels of slot names starting with ``prefix`` that no live lease holds
        and no parked task waits for (waiting or dispatched: waking needs the sentinel).

        Expired leases of those slots go too.  Atomic per slot against admission:
        a slot being admitted into is either kept (its lease is seen) or pruned
        before the admission, which then creates its sentinel again.  With
        ``dry_run`` nothing is deleted.  Returns the slot names pruned (or that
        would be), sorted.
        """

    @abc.abstractmethod
    def record_history(self, events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
        """Append ``events`` to the history, then drop events older than ``keep_seconds``
        before the newest one recorded here, and the oldest beyond ``max_events``."""

    @abc.abstractmethod
    def history(self, since: float, task_id: str | None = None) -> list[HistoryEvent]:
        """History events at or after ``since`` (epoch seconds), of one task id if given, oldest first."""

    # -- parking (optional; see the module docstring) -----------------------------

    #: Whether this store implements the waiting list (``park`` and the methods below).
    supports_parking = False

    def park(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        *,
        payload: bytes,
        first_deferred_at: float,
        max_waiters: int,
        task_name: str | None = None,
        admit: bool = True,
        report_first: bool = False,
    ) -> str:
        """Admit like ``acquire`` if every slot has room; else park the task.  One atomic step.

        Returns :data:`PARK_ADMITTED` (leases taken for ``run_id``), :data:`PARK_PARKED`
        (waiting; also when ``task_id`` was parked already) or :data:`PARK_LIST_FULL`
        (a slot already has ``max_waiters`` waiters; nothing stored).  With ``admit=False``
        (a task being sent, not run) a task with room takes nothing: :data:`PARK_ROOM`.
        With ``report_first``, a task parked now in a slot whose list held no other task
        returns :data:`PARK_PARKED_FIRST` instead of :data:`PARK_PARKED`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    def release_and_wake(self, run_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        """``release(run_id)``, then dispatch the waiters its slots can now admit, in one
        transaction.  Returns the leases deleted and the woken waiters (oldest first)."""
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    def release_holder_and_wake(
        self, task_id: str, holder: str, dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        """``release_holder(task_id, holder)`` (a dead process's leases), then dispatch the
        waiters the freed slots can admit.  Returns the leases deleted and the woken waiters.

        The default runs ``release_holder`` and then, if it deleted a lease, ``wake``: two
        steps, still never stranding a waiter (one that parks in between sees the room and is
        admitted), but ``wake`` looks at every waiting slot; a store should do both in one
        transaction that looks only at the released slots.
        """
        deleted = self.release_holder(task_id, holder)
        return deleted, (self.wake(dispatch_lease_seconds) if deleted and self.supports_parking else [])

    def release_task_and_wake(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        """``release_task(task_id)`` (revoke), then dispatch the waiters the freed slots can admit.
        Returns the leases deleted and the woken waiters.  The default is two steps, as for
        :meth:`release_holder_and_wake`."""
        deleted = self.release_task(task_id)
        return deleted, (self.wake(dispatch_lease_seconds) if deleted and self.supports_parking else [])

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        """``task_id`` is not to run (revoked, expired, dropped by an operator): remove it from
        the waiting list and delete its dispatch leases (never a run's lease), then dispatch the
        waiters the freed slots can admit, in one transaction.  Its standby, if no dispatch took
        it, ends too, and a process waiting on it returns None at once.  Returns the waiting
        entries removed and the woken waiters.

        A no-op for a store without a waiting list.  The default, for a store that parks but
        does not override it, can only delete the dispatch leases (``release_holder`` with
        :data:`DISPATCH_HOLDER`) and wake; the task's waiting entries stay (dispatched again
        by the sweep), so a store with a waiting list should override it.
        """
        if not self.supports_parking:
            return 0, []
        deleted = self.release_holder(task_id, DISPATCH_HOLDER)
        return 0, (self.wake(dispatch_lease_seconds) if deleted else [])

    def claim(self, task_id: str, run_id: str, holder: str, lease_seconds: float) -> int:
        """:meth:`claim_dispatch`, returning only how many leases were claimed."""
        return self.claim_dispatch(task_id, run_id, holder, lease_seconds).leases

    def claim_dispatch(self, task_id: str, run_id: str, holder: str, lease_seconds: float) -> Claimed:
        """A dispatched task arrived: renew the live dispatch leases of ``run_id`` to
        ``lease_seconds`` under ``holder``, and remove ``task_id`` from the waiting list, in
        one step; also tell whether other tasks still wait for one of the claimed slots.

        With nothing claimed (the dispatch expired), the entry is removed too (this copy is
        admitted as usual, and the task must not be dispatched again), unless it is dispatched
        again to another run with a live dispatch: then it stays, for that run's copy, and
        ``dispatched_elsewhere`` says so.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    def wake(self, dispatch_lease_seconds: float, slots: Collection[str] | None = None) -> list[Woken]:
        """Put waiters whose dispatch lease expired unclaimed back to waiting (same place),
        then dispatch every waiter that has room now.  For the sweep and operators.

        With ``slots``, only waiters that wait for one of those slot names are put back
        and considered (with, to keep the order fair, the other waiters of the slots they need).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    def expire_waiters(self, first_deferred_before: float, hold_seconds: float) -> list[Woken]:
        """Take the waiting (not dispatched) tasks first deferred before ``first_deferred_before``
        (epoch seconds) off the list, at least once: mark them as being published (a mark
        that lasts ``hold_seconds`` by the store's clock, each :class:`Woken` carrying it as its
        ``run_id``) and return them, oldest first.  The caller publishes them, then calls
        :meth:`settle_published`; a mark never settled (the caller died) expires, and
        ``wake`` puts the waiter back at its place.  A marked waiter is not dispatched."""
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    def drain(self, slot: str, hold_seconds: float) -> list[Woken]:
        """Take every waiting (not dispatched) task of ``slot`` off the list, at least once, like
        :meth:`expire_waiters` (an operator publishes them again: they re-enter admission)."""
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    def settle_published(self, published: Sequence[Woken], failed: Sequence[Woken] = ()) -> int:
        """End the marks of :meth:`expire_waiters`/:meth:`drain`: delete the waiting entries of
        ``published`` (their messages are on the broker) and put ``failed`` back to waiting at
        their old place.  Matched by task id and mark; returns the entries deleted."""
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        """The waiting list (of one slot name, if given), by slot then position."""
        raise NotImplementedError(f"{type(self).__name__} does not support parking")

    # -- standby (optional; see the module docstring) -----------------------------

    #: Whether this store can signal dispatches to waiting processes (``stand_by`` and below).
    supports_standby = False

    def stand_by(self, slots: Collection[str], per_slot: int, max_total: int, hold_seconds: float) -> list[Woken]:
        """Put waiters of ``slots`` on standby and return them (``run_id``: the standby's mark).

        For each slot name, its oldest waiting (not dispatched, not marked) waiters are put
        on standby until ``min(per_slot, the slot's limit)`` of its waiters are; never more
        than ``max_total`` standbys in the whole store.  A standby lasts ``hold_seconds``
        by the store's clock.  The bounds are counts, not locks: two calls at once may go
        over a slot's bound by one call's worth.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support standby")

    def await_standby(
        self, task_id: str, mark: str, timeout: float, holder: str | None = None, lease_seconds: float | None = None
    ) -> StandbyDispatch | None:
        """Wait up to ``timeout`` seconds for a release to dispatch ``task_id``'s standby ``mark``.

        With ``holder`` (and its ``lease_seconds``), the waiting process says it waits: a
        release from then on hands it the leases claimed.  Returns the dispatch, or None once
        the standby has ended (timed out, or it is no longer this mark's: expired, or the task
        left the list).  ``timeout=0`` without a holder ends a standby nobody will wait for.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support standby")

    def standbys(self) -> list[Standby]:
        """Every standby record (taken or not, live or expired), by task id."""
        raise NotImplementedError(f"{type(self).__name__} does not support standby")

    def warm_up(self, threads: int = 1, renewals: bool = False) -> None:
        """Make the first calls fast: do now what the first call would (check the schema, load
        scripts) and open connections ahead of use, for ``threads`` threads that will call the
        store (a pool process: the one that runs its tasks and its background thread) and,
        with ``renewals``, for the lease renewals.  Called off the hot path, when a pool
        process starts; a store with nothing to prepare does nothing.

        Raises:
            StoreError: the store cannot be reached (the first real call tries again).
        """

    def after_fork(self) -> None:
        """Called in a child process after fork; drop connections inherited from the parent."""

    def close(self) -> None:
        """Release connections this store opened (never ones it was handed)."""


# Query parameters that carry a secret in some drivers' URLs (``unix://...?password=``).
_SECRET_QUERY_PARAMETERS = frozenset({"password", "pass", "pwd", "passwd"})


def green_threads() -> bool:
    """Whether threads are greenlets here (gevent or eventlet monkey patching)."""
    import sys

    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    return bool(eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("thread"))


def mask_url(url: str) -> str:
    """``url`` with any password (in the user part or the query) replaced by ``***``, safe for logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    masked = url
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        masked = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{netloc}"))
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if any(name.lower() in _SECRET_QUERY_PARAMETERS for name, _ in pairs):
        query = urlencode(
            [(name, "***" if name.lower() in _SECRET_QUERY_PARAMETERS else value) for name, value in pairs], safe="*"
        )
        # Replace the query text only: urlunsplit would also rewrite "scheme:///path".
        masked = masked[: masked.index("?") + 1] + query + (f"#{parts.fragment}" if parts.fragment else "")
    return masked


_SQL_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb")
_REDIS_SCHEMES = ("redis", "rediss", "redis+unix", "unix")


def store_from_url(target: Any, *, create_schema: bool = True) -> SlotStore:
    """Build a store from ``caps_url``: a URL, a ready SQLAlchemy ``Engine``, a
    ``redis.Redis`` client, or a :class:`SlotStore` instance (returned as is).

    Raises:
        ConfigurationError: unknown scheme or unsupported object (the message
            names it, never the credentials).
        MissingDependencyError: the store needs an extra that is not installed.

    ``create_schema`` tells the SQL store whether to create its table on first use.
    """
    if isinstance(target, SlotStore):
        return target
    if isinstance(target, str):
        scheme = target.split("://", 1)[0].lower() if "://" in target else ""
        base_scheme = scheme.split("+", 1)[0]
        if scheme == "memory":
            from .memory import MemoryStore

            return MemoryStore()
        if base_scheme in _SQL_SCHEMES:
            return _sqlalchemy_store(target, create_schema)
        if scheme in _REDIS_SCHEMES:
            return _redis_store(target)
        raise ConfigurationError(
            f"caps_url {mask_url(target)!r}: unknown store scheme {scheme or '(none)'!r}; use "
            "sqlite:///path, postgresql+psycopg://..., mysql+pymysql://..., redis://... or memory://"
        )
    type_name = f"{type(target).__module__}.{type(target).__qualname__}"
    if type_name.startswith("sqlalchemy.") and hasattr(target, "dialect"):
        return _sqlalchemy_store(target, create_schema)
    if type_name.startswith("redis."):
        return _redis_store(target)
    raise ConfigurationError(
        f"caps_url must be a store URL, a SQLAlchemy Engine, a redis client or a SlotStore, got {type_name}"
    )


def _sqlalchemy_store(target: Any, create_schema: bool) -> SlotStore:
    try:
        from .sqlalchemy import SQLAlchemyStore
    except ImportError as exc:  # pragma: no cover - sqlalchemy is a core dependency
        raise MissingDependencyError(f"the SQL store needs SQLAlchemy: pip install celery-caps ({exc})") from exc
    return SQLAlchemyStore(target, create_schema=create_schema)


def _redis_store(target: Any) -> SlotStore:
    try:
        from .redis import RedisStore  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise MissingDependencyError(
            f'the Redis store needs redis-py: pip install "celery-caps[redis]" ({exc})'
        ) from exc
    store: SlotStore = RedisStore(target)
    return store
