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
A :class:`ParkingStore` also keeps a *waiting list*:
tasks that found their slots full wait there (an opaque payload that publishes the
task again) instead of going back to the broker, and a release hands freed slots
directly to the oldest waiters.  Each task id has at most one *entry*, in one of
three states:

waiting
    In the list, in order of first deferral (then park time).
dispatched
    Handed a *dispatch* under a fresh run id D until a deadline
    (``dispatch_lease_seconds``): with *dispatch leases* (D's leases on every slot
    it needs, held by :data:`DISPATCH_HOLDER`, so no newer task takes the room), or
    without leases for a *readmit* (waited past the maximum wait, drained by an
    operator, or never claimed twice: its copy goes through admission again).  Each
    dispatch counts.
done
    A tombstone (:data:`DONE_SECONDS`) of a claimed entry that was dispatched more
    than once, or whose claim found no live lease (an expired dispatch, a readmit):
    it records that claim (the dispatch and its holder), so that other copies still
    on their way end, and the same claim retried does not.  Never
    walked nor listed; the sweep deletes it.  A task that parks again replaces it,
    and its new entry keeps the count of dispatches.

An entry parked with :data:`OUTSIDE_PAYLOAD` (a message too large for the store) is
*outside*: it waits and is dispatched like any other, but its message is in the broker,
put back again and again by the worker until its turn; the dispatch publishes nothing,
and the message, coming back, reads the entry (``entry``) and claims that dispatch.

The atomic steps:

``park``
    Under the same sentinel locks as ``acquire``: if the task id is waiting or
    dispatched already, change nothing (:data:`PARK_WAITING`: the list answers for
    it); else admit if every slot has room; else (with a payload) record the
    waiter.  Admission and parking are one step, so a release that committed before
    it is seen as room, and one that commits after it sees the waiter.
``release_and_wake`` (and ``release_holder_and_wake``, ``release_task_and_wake``)
    Delete one run's leases (or a dead process's, or a revoked task's) and, in the
    same transaction, dispatch the oldest waiters (by first deferral, then park
    time) whose every slot now has room.  Room is counted against each slot's
    current limit, the one its sentinel holds (the last admission's): an entry
    keeps no limit of its own, so a limit changed by a deploy applies to every
    waiter at once.  A waiter whose slots are not all free is
    passed over, never blocks the ones behind it.  Every release of a store in use
    by parked tasks goes through one of these, so freed room goes to waiters first.
``claim``
    A copy that carries dispatch run id D arrived.  One step decides whether it
    runs, ends, or goes through admission (:class:`ClaimOutcome`); see
    :meth:`SlotStore.claim`.  A copy ends only when the store shows that someone
    else answers for the task: its entry (waiting, or dispatched to another run),
    a live run of D claimed by another copy, or a tombstone.
``forget``
    The task is not to run (revoked, expired): its entry goes (a dispatched one
    becomes a tombstone), its dispatch leases are deleted, and the waiters of the
    slots that frees are dispatched.
``recover``
    What keeps waiters moving when no release does: dispatches whose deadline
    passed go back to waiting (their leases deleted), waiters past the maximum
    wait are readmitted, and every waiter that fits now is dispatched.  A task
    dispatched :data:`LEASED_DISPATCHES` times whose dispatch passed its deadline
    again is readmitted at once, for :func:`unleased_dispatch_seconds`: a copy
    nobody takes (its queue no longer consumed) holds no slot, and the cap's other
    waiters are served meanwhile.  Workers
    call it every few seconds; several at once are safe.
``readmit``
    An operator empties a slot's list: its waiters are dispatched without leases.

Every dispatch is returned as a :class:`Woken` for the caller to publish (the entry
keeps answering for the task until a copy claims it).

Deployments: several deployments (staging and production, each with its broker) may share a
store and its caps.  Each entry records the deployment of the handle that parked it
(:attr:`SlotStore.deployment`), and a handle only ever dispatches entries of its own
deployment, so that a task is only published through its own deployment's broker.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_plus, unquote_plus, urlsplit, urlunsplit

from ..caps import operator_limit
from ..errors import StoreError, StoreInputError
from . import checks


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
    #: How many units of the slot's limit the run takes (``Cap(weight=...)``).
    weight: int = 1


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
    #: Units of the limit the holders take (the sum of their weights, each at most the limit):
    #: None where every holder takes one (it equals ``holders``).
    units: int | None = None

    @property
    def used(self) -> int:
        """Units of the limit in use: what the limit is compared with."""
        return self.holders if self.units is None else self.units


def with_operator_limits(statuses: Iterable[SlotStatus], limits: Mapping[str, int]) -> list[SlotStatus]:
    """``statuses`` with each slot's limit the one its room is counted against: the operator's
    (``limits``, as :meth:`SlotStore.limits` returns them) where set, else the sentinel's."""
    return [
        dataclasses.replace(status, limit=operator_limit(status.slot, limits) or status.limit) for status in statuses
    ]


@dataclass(frozen=True)
class HistoryEvent:
    """One record of the optional history: a put-back or a finished run.

    Times are epoch seconds by the clock of the process that recorded the event.
    """

    #: ``"deferred"`` (slots were full, the task was put back), ``"ran"`` (a run ended) or
    #: ``"limit"`` (an operator set or reset a limit; ``task_id`` is empty).
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
    #: ``limit``: the limit an operator set for the cap or slot in ``slots`` (None: reset to the code's).
    limit: int | None = None


@dataclass(frozen=True)
class Woken:
    """A dispatched waiter to publish (``payload``), its copy carrying ``run_id``."""

    task_id: str
    #: The dispatch's run id (D): the copy's header, which its claim presents.
    run_id: str
    #: The task's message, as parked.
    payload: bytes
    task_name: str | None = None
    #: A dispatch without leases: the copy goes through admission again (maximum wait
    #: passed, or an operator drained its list).
    readmit: bool = False


@dataclass(frozen=True)
class Entry:
    """A task's entry, as :meth:`ParkingStore.entry` reads it."""

    #: Waiting or dispatched; False: a tombstone (a copy claimed it).
    listed: bool
    #: The run id of its dispatch (None while it waits).
    dispatch_run_id: str | None
    #: Parked without its message (:data:`OUTSIDE_PAYLOAD`): the message waits in the broker,
    #: put back with a countdown, and claims the entry's dispatch when it comes back.
    outside: bool


#: The payload of an entry whose message is too large for the store: the message itself waits in
#: the broker (put back with a countdown, again and again) and, when it comes back while its
#: entry is dispatched, claims that dispatch.  Its dispatches publish nothing.
OUTSIDE_PAYLOAD = b""


class ClaimOutcome(enum.Enum):
    """What :meth:`SlotStore.claim` decided for an arriving copy."""

    #: Its dispatch leases are now a run's, under the dispatch's run id: run the body.
    RUN = "run"
    #: Someone else answers for the task (its entry, another live run, a tombstone): end
    #: this copy without running it.
    END = "end"
    #: Nobody else answers: go through admission as a task arriving for the first time.
    ADMIT = "admit"


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
    #: Whether it has been dispatched (its message is on the way; its slots are reserved
    #: unless it was readmitted).
    dispatched: bool
    #: How many units of the slot's limit it needs (``Cap(weight=...)``).
    weight: int = 1
    #: Its fair key in the slot (``Cap(fair_by=...)``), None in a slot of a cap without one.
    fair_key: str | None = None
    #: Its round in the slot's list (0 in a slot of a cap without ``fair_by``): see
    #: :class:`ParkingStore`, "Fair shares".
    fair_round: int = 0


#: The holder of a dispatch lease until the dispatched task claims it.
DISPATCH_HOLDER = "caps-dispatch"


class ParkOutcome(enum.Enum):
    """What :meth:`ParkingStore.park` did."""

    #: Every slot had room: the leases are taken.
    ADMITTED = "admitted"
    #: The task waits in the list now.
    PARKED = "parked"
    #: The task id waits already (waiting or dispatched): nothing changed; the list answers for it.
    WAITING = "waiting"
    #: A slot's waiting list holds ``max_waiters`` already: nothing stored.
    LIST_FULL = "waitlist_full"
    #: A slot is full and the request has no payload: nothing stored (the caller parks with one).
    FULL = "full"
    #: The task id is listed already under another task name: a reused id.  Nothing changed;
    #: the caller fails this copy visibly, never drops it silently.
    ID_IN_USE = "id_in_use"


@dataclass(frozen=True)
class ParkRequest:
    """What :meth:`ParkingStore.park` is asked: admit a run of a task, or park the task."""

    #: Slot name -> limit.
    slots: Mapping[str, int]
    task_id: str
    #: The run the leases are taken for, if admitted.
    run_id: str
    #: Who would run it (``"<node>/<pid>"``, or :data:`DISPATCH_HOLDER` for a task taking its
    #: slots as it is sent).
    holder: str
    #: The leases' length, if admitted, in seconds.
    lease_seconds: float
    #: When the task was first deferred (epoch seconds): its place in the waiting list.
    first_deferred_at: float
    #: A slot whose list holds this many waiters parks no more.
    max_waiters: int
    task_name: str | None = None
    #: The message that publishes the task again (:data:`OUTSIDE_PAYLOAD`: it waits in the
    #: broker); None: admit if there is room, else park nothing.
    payload: bytes | None = None
    #: Slot name -> how many units of its limit the task takes, for the slots where that is
    #: not 1 (see :meth:`SlotStore.acquire`); kept with the entry for its dispatch.
    weights: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Slot name -> the task's fair key there, for the slots of caps with ``fair_by`` (see
    #: :class:`ParkingStore`, "Fair shares"); kept with the entry.
    fair_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)


#: Dispatches of a task with leases (holding its slots for it) before recovery gives up holding
#: them: the next dispatch of a task whose dispatches all passed their deadline unclaimed (its
#: wake queue no longer consumed, its copies stuck or lost) holds no slot.
LEASED_DISPATCHES = 2


def unleased_dispatch_seconds(dispatches: int, dispatch_lease_seconds: float) -> float:
    """The deadline, in seconds, of the dispatch without leases that recovery gives a task
    dispatched ``dispatches`` times already, all unclaimed: twice as long at each miss, up to 64
    dispatch leases, so a copy published into a queue nobody consumes is published again
    seldom, and one lost is published again within the hour (at the default lease)."""
    return dispatch_lease_seconds * 2.0 ** min(max(dispatches - 1, 0), 6)


#: Seconds a claimed entry that was dispatched more than once stays as a tombstone, so that
#: copies of its earlier dispatches still on their way end rather than run it again.
DONE_SECONDS = 3600.0


#: The history kinds a store accepts.
HISTORY_KINDS = ("deferred", "ran")


def _no_check(*args: Any, **kwargs: Any) -> None:
    """Methods without arguments to check (their errors are still wrapped)."""


def _check_at_most(at_most: int | None = None) -> None:
    if at_most is not None:
        checks.count("at_most", at_most)


def _check_park(request: ParkRequest) -> None:
    checks.admission(
        request.slots, request.task_id, request.run_id, request.holder, request.lease_seconds, weights=request.weights
    )
    if request.fair_keys:
        checks.fair_key_map(request.fair_keys, request.slots)
    checks.seconds("first_deferred_at", request.first_deferred_at, positive=False)
    checks.count("max_waiters", request.max_waiters)
    if request.payload is not None and not isinstance(request.payload, bytes):
        raise StoreInputError(f"payload must be bytes or None, got {type(request.payload).__name__}")


def _check_recover(
    dispatch_lease_seconds: float, *, caps: Any = None, task_names: Any = None, readmit_before: Any = None
) -> None:
    checks.seconds("dispatch_lease_seconds", dispatch_lease_seconds)
    if caps is not None:
        checks.names("caps", caps, checks.slot)
    if task_names is not None:
        checks.names("task_names", task_names)
    if readmit_before is not None:
        checks.seconds("readmit_before", readmit_before, positive=False)


def _check_renew(run_ids: Collection[str], lease_seconds: float) -> None:
    checks.names("run_ids", run_ids)
    checks.seconds("lease_seconds", lease_seconds)


def _check_run(run_id: str) -> None:
    checks.text("run_id", run_id)


def _check_task(task_id: str) -> None:
    checks.text("task_id", task_id)


def _check_holder(task_id: str, holder: str) -> None:
    checks.text("task_id", task_id)
    checks.text("holder", holder)


def _check_slot_filter(slot: str | None = None) -> None:
    checks.optional_text("slot", slot)


def _check_prune(prefix: str, *, dry_run: bool = False) -> None:
    checks.slot("prefix", prefix)


def _check_record_history(events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
    checks.history_events(events)
    checks.seconds("keep_seconds", keep_seconds)
    checks.count("max_events", max_events)


def _check_history(since: float, task_id: str | None = None) -> None:
    checks.seconds("since", since, positive=False)
    if task_id is not None:
        checks.text("task_id", task_id)


def _check_run_and_wake(run_id: str, dispatch_lease_seconds: float) -> None:
    checks.text("run_id", run_id)
    checks.seconds("dispatch_lease_seconds", dispatch_lease_seconds)


def _check_holder_and_wake(task_id: str, holder: str, dispatch_lease_seconds: float) -> None:
    _check_holder(task_id, holder)
    checks.seconds("dispatch_lease_seconds", dispatch_lease_seconds)


def _check_task_and_wake(task_id: str, dispatch_lease_seconds: float) -> None:
    checks.text("task_id", task_id)
    checks.seconds("dispatch_lease_seconds", dispatch_lease_seconds)


def _check_claim(task_id: str, run_id: str, holder: str, lease_seconds: float, *, redelivered: bool = False) -> None:
    checks.admission({}, task_id, run_id, holder, lease_seconds)


def _check_set_limit(name: str, limit: int | None) -> None:
    checks.slot("name", name)
    if limit is not None:
        checks.limit("limit", limit)


def _check_readmit(slot: str, dispatch_lease_seconds: float) -> None:
    checks.slot("slot", slot)
    checks.seconds("dispatch_lease_seconds", dispatch_lease_seconds)


#: Contract method -> the check of its arguments (called with them, ``self`` left out).
_CHECKS: dict[str, Callable[..., None]] = {
    "acquire": checks.admission,
    "renew": _check_renew,
    "release": _check_run,
    "release_holder": _check_holder,
    "release_task": _check_task,
    "sweep": _no_check,
    "status": _no_check,
    "keys_per_cap": _check_at_most,
    "leases": _check_slot_filter,
    "prune": _check_prune,
    "record_history": _check_record_history,
    "history": _check_history,
    "set_limit": _check_set_limit,
    "limits": _no_check,
    "park": _check_park,
    "release_and_wake": _check_run_and_wake,
    "release_holder_and_wake": _check_holder_and_wake,
    "release_task_and_wake": _check_task_and_wake,
    "claim": _check_claim,
    "forget": _check_task_and_wake,
    "recover": _check_recover,
    "readmit": _check_readmit,
    "entry": _check_task,
    "waiters": _check_slot_filter,
    "warm_up": _no_check,
    "durability_warning": _no_check,
    "connection_warnings": _no_check,
}


def _guarded(name: str, method: Callable[..., Any], check: Callable[..., None]) -> Callable[..., Any]:
    """``method``, its arguments checked first and its driver's errors wrapped (see :class:`SlotStore`)."""

    @functools.wraps(method)
    def guarded(self: SlotStore, *args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        if name in ("acquire", "park"):
            slots = args[0].slots if name == "park" and args else args[0] if args else kwargs.get("slots")
            if slots is not None and not slots:  # nothing to limit: granted, as on every store
                return Admission(True) if name == "acquire" else ParkOutcome.ADMITTED
        try:
            return method(self, *args, **kwargs)
        except self.driver_errors as exc:
            raise self.store_error(name, exc) from exc

    return guarded


class SlotStore(abc.ABC):
    """What a slot store must do; see the module docstring for the rules.

    Every contract method a subclass defines is wrapped once, when the subclass is created
    (``__init_subclass__``): the input is checked first (:mod:`celery_caps.stores.checks`:
    :class:`StoreInputError` naming the value, the same on every store), an admission of
    no slot at all is granted without a store call, and an error of the store's driver
    (:attr:`driver_errors`) becomes a :class:`StoreError` whose message names the store
    by :attr:`display_url` and holds none of its secrets.
    """

    #: The exceptions of the store's driver that mean "the store failed"; wrapped in StoreError.
    driver_errors: tuple[type[BaseException], ...] = ()
    #: The deployment this handle serves (``caps_deployment``): the entries it parks record it,
    #: and every hand-over it makes (a release's wake, recovery, a readmit) dispatches only
    #: entries of its own deployment, whose copies go to its own broker; the others are passed
    #: over, keeping their place.  The slots themselves are shared: a cap counts every
    #: deployment's holders.
    deployment: str = ""

    @property
    def display_url(self) -> str:
        """Where the store lives, safe to log (no password)."""
        return type(self).__name__

    def secrets(self) -> Sequence[str]:
        """Strings never to show in a message (a password)."""
        return ()

    def store_error(self, operation: str, exc: BaseException) -> StoreError:
        """The :class:`StoreError` for ``exc``, an error of the driver during ``operation``: it
        names the store by :attr:`display_url` and the driver's own error (SQLAlchemy's
        ``orig``), never a secret."""
        reason = getattr(exc, "orig", None) or exc
        message = f"{operation} failed on {self.display_url}: {type(reason).__name__}: {reason}"
        # Each secret as written, and as a URL carries it (a driver may quote the URL back).
        secrets = [secret for secret in self.secrets() if secret]
        forms = {form for secret in secrets for form in (secret, quote(secret, safe=""), quote_plus(secret))}
        for form in sorted(forms, key=len, reverse=True):
            message = message.replace(form, "***")
        return StoreError(message)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, check in _CHECKS.items():
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__isabstractmethod__", False):
                setattr(cls, name, _guarded(name, method, check))

    @abc.abstractmethod
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
        """Take one lease per slot for ``run_id``, all or none, in one atomic step.

        ``slots`` maps slot names to their limits, ``weights`` the slots where the task takes
        more than one unit of the limit to how many it takes (1 elsewhere).  A slot admits
        when ``task_id`` already holds one of its leases (the same task id counts once), or
        when the units its live holders take plus this task's weight are at most its limit,
        every weight counted as at most the limit in force (an operator's lower limit leaves a
        heavy task room to run alone), and its oldest waiter does not need that room (see
        :meth:`ParkingStore.park`).  Leases expire ``lease_seconds`` after now by the store's
        clock; they remember ``task_name``, the weight and when they were taken (store
        clock), for operators.
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
        """Delete expired leases, never sentinels (and, in a store that parks, tombstones past
        :data:`DONE_SECONDS`); returns how many leases were deleted."""

    @abc.abstractmethod
    def status(self) -> list[SlotStatus]:
        """Every known slot name with its limit, live holders and unswept leases."""

    def keys_per_cap(self, at_most: int | None = None) -> dict[str, int]:
        """How many distinct keys each keyed cap has (slot names ``name:key``), for the sweep's
        warning; with ``at_most``, a count stops there (a cap counted ``at_most`` has at least
        that many keys), so that the count costs at most that much per cap however many keys
        there are.  This default reads :meth:`status`; the stores here count without reading
        any lease, without holding up admissions, and stop at ``at_most``."""
        _check_at_most(at_most)  # (the base class's own methods are not guarded)
        counts: dict[str, int] = {}
        for status in self.status():
            name, separator, _key = status.slot.partition(":")
            if separator:
                counts[name] = counts.get(name, 0) + 1
        if at_most is None:
            return counts
        return {name: min(keys, at_most) for name, keys in counts.items()}

    @abc.abstractmethod
    def leases(self, slot: str | None = None) -> list[Lease]:
        """Every lease (of one slot name, if given), live or expired."""

    @abc.abstractmethod
    def prune(self, prefix: str, *, dry_run: bool = False) -> list[str]:
        """Delete the sentinels of slot names starting with ``prefix`` that no live lease holds
        and no parked task waits for (waiting or dispatched: waking needs the sentinel).

        Expired leases and tombstones of those slots go too.  Atomic per slot against admission:
        a slot being admitted into is either kept (its lease is seen) or pruned
        before the admission, which then creates its sentinel again.  With
        ``dry_run`` nothing is deleted.  Returns the slot names pruned (or that
        would be), sorted.
        """

    @abc.abstractmethod
    def set_limit(self, name: str, limit: int | None) -> int | None:
        """Set the operator's limit of ``name`` (a cap, for all its slots, or one slot name
        ``cap:key``), or with None remove it; returns the one it replaces (None if none).

        Every admission and hand-over counts a slot's room against the operator's limit of the
        slot, else of its cap, else the code's (the sentinel's), read after the slot's lock, so
        a change holds fleet-wide from its commit on: no one is admitted above a lowered limit
        (running tasks finish).  Waking the waiters a raised limit makes room for is the
        caller's (:func:`celery_caps.limits.set_limit`)."""

    @abc.abstractmethod
    def limits(self) -> dict[str, int]:
        """The operator's limits, by cap or slot name (see :meth:`set_limit`)."""

    @abc.abstractmethod
    def record_history(self, events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
        """Append ``events`` to the history, then drop events older than ``keep_seconds``
        before the newest one recorded here, and the oldest beyond ``max_events``."""

    @abc.abstractmethod
    def history(self, since: float, task_id: str | None = None) -> list[HistoryEvent]:
        """History events at or after ``since`` (epoch seconds), of one task id if given, oldest first."""

    def warm_up(self, threads: int = 1, renewals: bool = False) -> None:
        """Make the first calls fast: do now what the first call would (check the schema, load
        scripts) and open connections ahead of use, for ``threads`` threads that will call the
        store (a pool process: the one that runs its tasks and its background thread) and,
        with ``renewals``, for the lease renewals.  Called off the hot path, when a pool
        process starts; a store with nothing to prepare does nothing.

        Raises:
            StoreError: the store cannot be reached (the first real call tries again).
        """

    def limit_connections(self, count: int | None) -> None:
        """Open at most ``count`` connections at once in this process (None: as many as its
        threads call at once): a process that runs one task at a time (a prefork pool process)
        asks for one, which its renewals and background releases then share.  A store whose
        client manages its own connections ignores it."""

    def connection_warnings(self) -> list[str]:
        """What in the way this store is reached would break it under load (a PostgreSQL
        pooler that hands server-side prepared statements to other clients, say), for the
        start-up check to report; empty if nothing.

        Raises:
            StoreError: the store cannot be reached.
        """
        return []

    def durability_warning(self) -> str | None:
        """What a restart of the store's server would lose, for a worker to warn about at start
        (a waiting list kept in memory only); None if nothing.

        Raises:
            StoreError: the store cannot be reached.
        """
        return None

    def after_fork(self) -> None:
        """Called in a child process after fork; drop connections inherited from the parent."""

    def close(self) -> None:
        """Release connections this store opened (never ones it was handed)."""


class ParkingStore(SlotStore):
    """A store with a waiting list: what the park strategy needs (see the module docstring).

    A store that is only a :class:`SlotStore` serves the backoff strategy; park falls back
    to backoff on it, with a warning when a worker starts.

    **Weights.**  A slot's room is its limit in force less the units its live holders take
    (dispatch leases included): each task id counts once, at the largest weight of its live
    leases there, and never above the limit.  Against starvation, *the oldest heavy entry of a
    slot (weight above 1 there; waiting, not dispatched; of this deployment), if it needs more
    units than are free, holds them*: an admission (``acquire``, ``park``) of another task id is
    refused at that slot.  A hand-over (release, forget, recover) walks the waiting entries in
    order and, at the first that does not fit a slot's room, gives that slot to no entry after
    it.  A light entry needs more than is free only when the slot is full: with every weight 1
    nothing changes.

    **Fair shares.**  Each entry of a slot's list has a *round* there, and the list is in the
    order (round, first deferral, park time, task id).  An entry parked with fair key ``k`` in
    slot ``E`` (a request's ``fair_keys``) gets round ``max(head, last + 1)``, where ``head`` is
    the smallest round of ``E``'s listed entries (waiting or dispatched) of this deployment, 0 if
    none, and ``last`` the largest round of those with key ``k`` (``head - 1`` if none): keys
    waiting together are served in turn, a key with 1,000 entries taking one place per round
    like a key with 3.  An entry without a fair key there gets the largest round of those
    entries, 0 if none: in a list without fair keys every round is 0 (first come, first served),
    and after a deploy that removed ``fair_by`` new entries queue behind the rounds left.
    (Redis orders one round by park time, not first deferral: they differ only for a task parked
    again; and it puts entries without a fair key after every round, and, while its list holds
    any, parks entries with one without a round, so that after a deploy that added ``fair_by``
    the entries parked before are served first, as the other stores do by their round 0.)  A
    hand-over walk that reads several lists merges them: each list's own order is kept, and an
    entry on several lists is met at its first place among them.
    """

    #: How long a tombstone lasts, in seconds (:data:`DONE_SECONDS`; tests shorten it).
    done_seconds: float = DONE_SECONDS

    @abc.abstractmethod
    def park(self, request: ParkRequest) -> ParkOutcome:
        """Admission for the park strategy, in one atomic step (under the sentinel locks).

        In this order: if the task id is waiting or dispatched already, nothing changes:
        :attr:`~ParkOutcome.WAITING` if that entry has the same task name (a copy of the task,
        whatever slots it asks for now: a deploy may have renamed its cap or changed its key),
        else :attr:`~ParkOutcome.ID_IN_USE` (the id was reused by another task);
        :attr:`~ParkOutcome.ADMITTED` if every slot has room (leases taken for the request's run,
        as ``acquire`` would); :attr:`~ParkOutcome.FULL` if the
        request has no payload (nothing stored); :attr:`~ParkOutcome.LIST_FULL` if a slot's list
        holds ``max_waiters`` (nothing stored); else :attr:`~ParkOutcome.PARKED`: the task waits,
        ordered by ``first_deferred_at`` then the store's clock.  A tombstone of the task id is
        replaced (its count of dispatches kept).
        """

    @abc.abstractmethod
    def release_and_wake(self, run_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        """``release(run_id)``, then dispatch the waiters its slots can now admit, in one
        transaction.  Returns the leases deleted and the woken waiters (oldest first)."""

    @abc.abstractmethod
    def release_holder_and_wake(
        self, task_id: str, holder: str, dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        """``release_holder(task_id, holder)`` (a dead process's leases), then dispatch the
        waiters the freed slots can admit.  Returns the leases deleted and the woken waiters."""

    @abc.abstractmethod
    def release_task_and_wake(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        """``release_task(task_id)`` (revoke), then dispatch the waiters the freed slots can
        admit.  Returns the leases deleted and the woken waiters."""

    @abc.abstractmethod
    def claim(
        self, task_id: str, run_id: str, holder: str, lease_seconds: float, *, redelivered: bool = False
    ) -> ClaimOutcome:
        """A copy of ``task_id`` carrying dispatch run id ``run_id`` arrived; decide, in one step:

        1. Every lease of ``run_id`` is a live dispatch lease: they become the run's (``holder``,
           ``lease_seconds`` from now); the entry is deleted, or becomes a tombstone of this
           claim if it was dispatched more than once.  :attr:`ClaimOutcome.RUN`.
        2. Leases of ``run_id`` are live and claimed already.  By ``holder`` itself: the same
           claim again (retried after its reply was lost), :attr:`~ClaimOutcome.RUN` (renewed).
           By another process (a copy that claimed first): :attr:`~ClaimOutcome.ADMIT` if this
           copy was ``redelivered`` by the broker (the other may have died: admission admits it
           at once, the task holding the slot already), else :attr:`~ClaimOutcome.END`.
        3. Otherwise (no live lease of ``run_id``: it expired, or the dispatch had none), the
           dispatch leases left of ``run_id`` are deleted, and by the task's entry:

           - none: :attr:`~ClaimOutcome.ADMIT`;
           - waiting, or dispatched to another run: :attr:`~ClaimOutcome.END`;
           - dispatched to ``run_id``: the entry becomes a tombstone of this claim (with no
             lease left, nothing else would tell a duplicate copy of this dispatch that the
             task was taken), :attr:`~ClaimOutcome.ADMIT`;
           - a tombstone: :attr:`~ClaimOutcome.ADMIT` only if it records ``run_id`` (the dispatch
             that was claimed, or forgotten) and this copy was ``redelivered`` (that run may have
             died) or ``holder`` made that claim (retried after its reply was lost, its leases
             expired meanwhile); a copy of any other dispatch, redelivered or not, ends:
             :attr:`~ClaimOutcome.END`.

        So a claim is repeatable by the process that made it: retried with the same arguments,
        it never ends a copy whose first try took the task.
        """

    @abc.abstractmethod
    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        """``task_id`` is not to run (revoked, expired): a waiting entry is deleted, a dispatched
        one becomes a tombstone (its copy may be on its way); every dispatch lease of the task
        goes (a release's, or one taken when it was sent; never a run's lease); then the waiters
        of the freed slots are dispatched, in one transaction.  Returns the entries removed (0 or
        1) and the woken waiters."""

    @abc.abstractmethod
    def recover(
        self,
        dispatch_lease_seconds: float,
        *,
        caps: Collection[str] | None = None,
        task_names: Collection[str] | None = None,
        readmit_before: float | None = None,
    ) -> list[Woken]:
        """Keep waiters moving, in one step: dispatched entries whose deadline passed go back to
        waiting at their place (their dispatch leases deleted); with ``readmit_before`` (epoch
        seconds), waiting entries first deferred before it are dispatched without leases (they
        waited too long: their copies go through admission again, and give up there); then every
        waiter that has room now is dispatched, oldest first.  Returns the dispatches, readmits
        first.

        With ``caps`` (cap names) or ``task_names``, only entries waiting for a slot of one of the
        caps (the slot named like the cap, or one of its keys', ``"<cap>:<key>"``), or of a task
        named in ``task_names``, are considered: so a worker recovers the tasks it knows (also
        those whose cap its code renamed or removed), never another app's that shares the store.
        (A slot name given as a cap name matches that slot.)

        Waiters are dispatched against their slots' current limits (the sentinels'), never the
        limits they parked with: a limit lowered since admits no one above it, and a limit raised
        since gives its room to waiters here."""

    @abc.abstractmethod
    def readmit(self, slot: str, dispatch_lease_seconds: float) -> list[Woken]:
        """Dispatch without leases every waiting (not dispatched) entry of ``slot``, oldest first:
        an operator empties its list (the copies go through admission again)."""

    @abc.abstractmethod
    def entry(self, task_id: str) -> Entry | None:
        """The task's entry (a tombstone included), or None: a read, without locks.  A copy of a
        task parked outside (:data:`OUTSIDE_PAYLOAD`) reads which dispatch to claim."""

    @abc.abstractmethod
    def waiters(self, slot: str | None = None) -> list[Waiter]:
        """The waiting list (of one slot name, if given), by slot then position; tombstones
        are not listed."""


# Words that make a URL query parameter a credential: ``password``, ``sslpassword``,
# ``sentinel_password``, ``passwd`` (MySQL drivers), ``pwd``, ``pass``, and ``*secret*``,
# ``*token*``, ``*credential*`` (a driver's own way to pass one).
_SECRET_PARAMETER = re.compile(r"passw(or)?d|pass$|pwd$|secret|token|credential")


def secret_parameter(name: str) -> bool:
    """Whether the URL query parameter ``name`` carries a credential (its value is never shown)."""
    return _SECRET_PARAMETER.search(name.lower()) is not None


def green_threads() -> bool:
    """Whether threads are greenlets here (gevent or eventlet monkey patching)."""
    import sys

    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    return bool(eventlet_patcher is not None and eventlet_patcher.is_monkey_patched("thread"))


def mask_url(url: str) -> str:
    """``url`` with every credential replaced by ``***``, safe for logs: the password of the user
    part, and the value of each query parameter that carries one (:func:`secret_parameter`);
    the rest is left as written."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    masked = url
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)[1]
        masked = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{netloc}"))
    if parts.query:
        # The query's text only, field by field: urlunsplit would also rewrite "scheme:///path".
        head, _, rest = masked.partition("?")
        query, hash_mark, fragment = rest.partition("#")
        fields = []
        for field in query.split("&"):
            name, equals, _value = field.partition("=")
            fields.append(f"{name}=***" if equals and secret_parameter(unquote_plus(name)) else field)
        masked = f"{head}?{'&'.join(fields)}{hash_mark}{fragment}"
    return masked
