"""An in-process slot store for tests and single-process experiments.

It honours the whole store contract (atomic all-or-nothing admission, leases by
the store's own clock, sweep keeping sentinels) but lives in one process's
memory: it cannot cap a fleet.  ``clock`` can be replaced to test expiry.

It also keeps, for tests of a project's own tasks (:mod:`celery_caps.testing`), what
no other store keeps: the most task ids that ever held each slot at once
(:attr:`MemoryStore.peaks`), and how long each task waited in the waiting list
(:attr:`MemoryStore.waited`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..caps import operator_limit
from .base import (
    DISPATCH_HOLDER,
    LEASED_DISPATCHES,
    OUTSIDE_PAYLOAD,
    Admission,
    ClaimOutcome,
    Entry,
    HistoryEvent,
    Lease,
    ParkingStore,
    ParkOutcome,
    ParkRequest,
    SlotStatus,
    Waiter,
    Woken,
    unleased_dispatch_seconds,
)


@dataclass
class _LeaseEntry:
    task_id: str
    holder: str
    expires_at: float
    task_name: str | None
    acquired_at: float
    weight: int = 1


@dataclass
class _WaiterEntry:
    task_id: str
    #: The slot names it needs (their limits are the slots' own, read when it is dispatched).
    slots: tuple[str, ...]
    payload: bytes
    first_deferred_at: float
    parked_at: float
    sequence: int
    task_name: str | None
    #: Dispatched: the dispatch's run id and deadline (store clock).
    dispatch_run_id: str | None = None
    dispatch_expires_at: float = 0.0
    #: How many times it was dispatched.
    dispatches: int = 0
    #: A tombstone until then (store clock); None for a live entry.
    done_until: float | None = None
    #: A tombstone of a claim: the holder that claimed ``dispatch_run_id``.
    claimed_by: str | None = None
    #: The deployment of the handle that parked it (only that deployment dispatches it).
    deployment: str = ""
    #: Slot name -> the units it takes there, where above 1.
    weights: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Slot name -> its fair key there, where it has one.
    fair_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Slot name -> its round in the slot's list, where not 0.
    rounds: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def round_in(self, slot: str) -> int:
        return self.rounds.get(slot, 0)

    def place_in(self, slot: str) -> tuple[int, float, float, int]:
        """Its place in ``slot``'s list: round, first deferral, park time, then park order."""
        return self.round_in(slot), self.first_deferred_at, self.parked_at, self.sequence

    @property
    def waiting(self) -> bool:
        return self.dispatch_run_id is None and self.done_until is None

    @property
    def listed(self) -> bool:
        """Waiting or dispatched: the list answers for the task."""
        return self.done_until is None


def of_caps(slot: str, caps: Collection[str]) -> bool:
    """Whether ``slot`` belongs to one of ``caps``: named like it, or (a cap name, without ``:``)
    one of its keys'.  A slot name given as a cap is that slot alone, never a longer key."""
    return any(slot == cap or (":" not in cap and slot.startswith(cap + ":")) for cap in caps)


class MemoryStore(ParkingStore):
    """Slots in a dict guarded by a lock; ``clock`` returns seconds (the store clock)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._limits: dict[str, int] = {}  # the sentinels: the code's limits, last admitted with
        self._operator_limits: dict[str, int] = {}  # cap or slot name -> the operator's limit
        self._leases: dict[str, dict[str, _LeaseEntry]] = {}  # slot -> run id -> lease
        self._history: list[HistoryEvent] = []
        self._waiting: dict[str, _WaiterEntry] = {}  # task id -> waiter
        self._sequence = itertools.count()
        #: Slot name -> the most units of its limit its live holders took at once (with every
        #: weight 1: the most distinct task ids that held a lease of it at once).
        self.peaks: dict[str, int] = {}
        #: Task id -> seconds between its park and its claim (store clock), for tasks that waited.
        self.waited: dict[str, float] = {}

    def _live_task_ids(self, slot: str, now: float) -> set[str]:
        return {lease.task_id for lease in self._leases.get(slot, {}).values() if lease.expires_at > now}

    def _units(self, slot: str, limit: int, now: float) -> int:
        """The units of ``slot``'s limit its live holders take: each task id once, at its
        largest weight, at most ``limit``."""
        weights: dict[str, int] = {}
        for lease in self._leases.get(slot, {}).values():
            if lease.expires_at > now:
                weights[lease.task_id] = max(weights.get(lease.task_id, 0), min(lease.weight, limit))
        return sum(weights.values())

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
        with self._lock:
            now = self.clock()
            for slot in slots:
                self._limits[slot] = slots[slot]
            full = self._full_slots(self._current_limits(slots), weights or {}, task_id, now, newcomer=True)
            if full:
                return Admission(False, tuple(full))
            self._add_leases(slots, weights or {}, run_id, task_id, holder, now + lease_seconds, task_name, now)
            return Admission(True)

    def _full_slots(
        self, limits: Mapping[str, int], weights: Mapping[str, int], task_id: str, now: float, *, newcomer: bool
    ) -> list[str]:
        """The slots of ``limits`` (their limits in force) without room for ``task_id`` at
        ``weights``; a ``newcomer`` (an admission, not a dispatch) also finds no room in a
        slot its oldest heavy waiter holds (see :class:`ParkingStore`)."""
        full = []
        for slot in sorted(limits):
            if task_id in self._live_task_ids(slot, now):
                continue
            free = limits[slot] - self._units(slot, limits[slot], now)
            if min(weights.get(slot, 1), limits[slot]) > free or (newcomer and self._held(slot, free, task_id)):
                full.append(slot)
        return full

    def _held(self, slot: str, free: int, task_id: str) -> bool:
        """Whether the oldest heavy waiting entry of ``slot`` needs more than ``free`` units."""
        heavy = self._in_order(
            entry
            for entry in self._waiting.values()
            if entry.waiting
            and entry.deployment == self.deployment
            and entry.weights.get(slot, 1) > 1
            and entry.task_id != task_id
        )
        limit = self._current_limits([slot])[slot]
        return bool(heavy) and min(heavy[0].weights[slot], limit) > free

    def _current_limits(self, slots: Iterable[str]) -> dict[str, int]:
        """The slots' limits now: the operator's, else as their sentinels hold them (the last
        admission's).  A waiter is dispatched against these, never against the limit it parked with."""
        return {slot: operator_limit(slot, self._operator_limits) or self._limits[slot] for slot in slots}

    def set_limit(self, name: str, limit: int | None) -> int | None:
        with self._lock:
            if limit is None:
                return self._operator_limits.pop(name, None)
            previous = self._operator_limits.get(name)
            self._operator_limits[name] = limit
            return previous

    def limits(self) -> dict[str, int]:
        with self._lock:
            return dict(self._operator_limits)

    def park(self, request: ParkRequest) -> ParkOutcome:
        slots, task_id = request.slots, request.task_id
        with self._lock:
            now = self.clock()
            for slot in slots:
                self._limits[slot] = slots[slot]
            entry = self._waiting.get(task_id)
            if entry is not None and entry.listed:
                return ParkOutcome.WAITING if entry.task_name == request.task_name else ParkOutcome.ID_IN_USE
            dispatches = entry.dispatches if entry is not None else 0  # a tombstone's count lives on
            if not self._full_slots(self._current_limits(slots), request.weights, task_id, now, newcomer=True):
                self._add_leases(
                    slots, request.weights, request.run_id, task_id, request.holder, now + request.lease_seconds,
                    request.task_name, now,
                )  # fmt: skip
                return ParkOutcome.ADMITTED
            if request.payload is None:
                return ParkOutcome.FULL
            waiting = {slot: sum(1 for w in self._waiting.values() if w.listed and slot in w.slots) for slot in slots}
            if any(count >= request.max_waiters for count in waiting.values()):
                return ParkOutcome.LIST_FULL
            self._waiting[task_id] = _WaiterEntry(
                task_id, tuple(sorted(slots)), request.payload, request.first_deferred_at, now, next(self._sequence),
                request.task_name, dispatches=dispatches, deployment=self.deployment,
                weights={slot: weight for slot, weight in request.weights.items() if weight > 1},
                fair_keys=dict(request.fair_keys),
                rounds={slot: self._round_for(slot, request.fair_keys.get(slot)) for slot in slots},
            )  # fmt: skip
            return ParkOutcome.PARKED

    def _round_for(self, slot: str, fair_key: str | None) -> int:
        """The round of a new entry in ``slot``'s list (see :class:`ParkingStore`, "Fair shares"):
        of a ``fair_key``, the list's first round or its key's last round's next, whichever is
        later; without one, the list's last round (0 in a list without fair keys)."""
        listed = [
            entry
            for entry in self._waiting.values()
            if entry.listed and entry.deployment == self.deployment and slot in entry.slots
        ]
        if fair_key is None:
            return max((entry.round_in(slot) for entry in listed), default=0)
        head = min((entry.round_in(slot) for entry in listed), default=0)
        last = max(
            (entry.round_in(slot) for entry in listed if entry.fair_keys.get(slot) == fair_key), default=head - 1
        )
        return max(head, last + 1)

    def _add_leases(
        self,
        slots: Collection[str],
        weights: Mapping[str, int],
        run_id: str,
        task_id: str,
        holder: str,
        expires_at: float,
        task_name: str | None,
        now: float,
    ) -> None:
        limits = self._current_limits(slots)
        for slot in slots:
            lease = _LeaseEntry(task_id, holder, expires_at, task_name, now, weights.get(slot, 1))
            self._leases.setdefault(slot, {})[run_id] = lease
            self.peaks[slot] = max(self.peaks.get(slot, 0), self._units(slot, limits[slot], now))

    def _in_order(self, entries: Iterable[_WaiterEntry]) -> list[_WaiterEntry]:
        return sorted(entries, key=lambda waiter: (waiter.first_deferred_at, waiter.parked_at, waiter.sequence))

    def _dispatch_locked(self, entry: _WaiterEntry, now: float, lease_seconds: float, leases: bool) -> Woken:
        run_id = uuid.uuid4().hex
        if leases:
            self._add_leases(
                entry.slots, entry.weights, run_id, entry.task_id, DISPATCH_HOLDER, now + lease_seconds,
                entry.task_name, now,
            )  # fmt: skip
        entry.dispatch_run_id = run_id
        entry.dispatch_expires_at = now + lease_seconds
        entry.dispatches += 1
        return Woken(entry.task_id, run_id, entry.payload, entry.task_name, readmit=not leases)

    def _wake_locked(self, now: float, dispatch_lease_seconds: float, only: set[str] | None = None) -> list[Woken]:
        """Dispatch the oldest waiters of this deployment (of one of the slots ``only``, if given)
        that have room (the lock is held)."""
        woken = []
        # The lists of the slots ``only`` merged: each entry at its first place among them.
        waiting = sorted(
            (
                waiter
                for waiter in self._waiting.values()
                if waiter.waiting
                and waiter.deployment == self.deployment
                and (only is None or not only.isdisjoint(waiter.slots))
            ),
            key=lambda waiter: min(waiter.place_in(slot) for slot in waiter.slots if only is None or slot in only),
        )
        held: set[str] = set()  # slots an earlier waiter of this walk did not fit
        for waiter in waiting:
            full = self._full_slots(
                self._current_limits(waiter.slots), waiter.weights, waiter.task_id, now, newcomer=False
            )
            # A slot its task id holds already takes no units: held or not, it has room.
            takes = [slot for slot in waiter.slots if waiter.task_id not in self._live_task_ids(slot, now)]
            if not full and held.isdisjoint(takes):
                woken.append(self._dispatch_locked(waiter, now, dispatch_lease_seconds, leases=True))
            held.update(full)
        return woken

    def _release_and_wake(
        self, doomed: Callable[[str, _LeaseEntry], bool], dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        with self._lock:
            freed = {slot for slot, runs in self._leases.items() if any(doomed(r, lease) for r, lease in runs.items())}
            deleted = self._delete_locked(doomed)
            woken = self._wake_locked(self.clock(), dispatch_lease_seconds, freed) if deleted else []
        return deleted, woken

    def release_and_wake(self, run_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        return self._release_and_wake(lambda run, lease: run == run_id, dispatch_lease_seconds)

    def release_holder_and_wake(
        self, task_id: str, holder: str, dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        return self._release_and_wake(
            lambda run, lease: lease.task_id == task_id and lease.holder == holder, dispatch_lease_seconds
        )

    def release_task_and_wake(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        return self._release_and_wake(lambda run, lease: lease.task_id == task_id, dispatch_lease_seconds)

    def _settle_locked(self, entry: _WaiterEntry, now: float, holder: str, *, tombstone: bool = False) -> None:
        """A claimed entry leaves the list: a tombstone of ``holder``'s claim if other copies may
        be on their way (it was dispatched more than once) or ``tombstone``, else deleted."""
        if entry.dispatches > 1 or tombstone:
            entry.done_until = now + self.done_seconds
            entry.claimed_by = holder
        else:
            del self._waiting[entry.task_id]

    def claim(
        self, task_id: str, run_id: str, holder: str, lease_seconds: float, *, redelivered: bool = False
    ) -> ClaimOutcome:
        with self._lock:
            now = self.clock()
            leases = [runs[run_id] for runs in self._leases.values() if run_id in runs]
            leases = [lease for lease in leases if lease.task_id == task_id]
            live = [lease for lease in leases if lease.expires_at > now]
            entry = self._waiting.get(task_id)
            claimable = (
                bool(live)
                and len(live) == len(leases)
                and all(lease.holder in (DISPATCH_HOLDER, holder) for lease in live)
            )
            if claimable and self._dispatch_over_limit_locked(run_id, live, now):
                claimable = False  # a cut since the dispatch: its copy goes through admission
            if claimable:
                for lease in live:
                    lease.holder = holder
                    lease.expires_at = now + lease_seconds
                if entry is not None and entry.dispatch_run_id == run_id and entry.listed:
                    self.waited[task_id] = now - entry.parked_at
                    self._settle_locked(entry, now, holder)
                return ClaimOutcome.RUN
            if live and any(lease.holder != DISPATCH_HOLDER for lease in live):
                return ClaimOutcome.ADMIT if redelivered else ClaimOutcome.END
            # No live lease of the dispatch: what is left of it goes.
            self._delete_dispatch_locked(run_id, task_id)
            if entry is None:
                return ClaimOutcome.ADMIT
            if entry.done_until is not None:
                # Only a copy of the dispatch the tombstone records may go on: that claim retried,
                # or its copy redelivered (its run may have died).  A copy of any other dispatch ends.
                same_dispatch = entry.dispatch_run_id == run_id
                return (
                    ClaimOutcome.ADMIT
                    if same_dispatch and (redelivered or entry.claimed_by == holder)
                    else ClaimOutcome.END
                )
            if entry.dispatch_run_id != run_id:
                return ClaimOutcome.END
            self._settle_locked(entry, now, holder, tombstone=True)
            return ClaimOutcome.ADMIT

    def _dispatch_over_limit_locked(self, run_id: str, live: list[_LeaseEntry], now: float) -> bool:
        """Whether the live dispatch leases ``live`` of ``run_id`` (not yet claimed) are in a slot
        holding more live task ids than its limit now: a limit cut since the dispatch."""
        if any(lease.holder != DISPATCH_HOLDER for lease in live):
            return False  # the same claim again: the run is this holder's already
        slots = [slot for slot, runs in self._leases.items() if run_id in runs]
        limits = self._current_limits(slots)
        return any(self._units(slot, limits[slot], now) > limits[slot] for slot in slots)

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        with self._lock:
            now = self.clock()
            entry = self._waiting.get(task_id)
            removed = 0
            if entry is not None and entry.listed:
                removed = 1
                if entry.waiting:
                    del self._waiting[task_id]
                else:
                    entry.done_until = now + self.done_seconds

            def doomed(run: str, lease: _LeaseEntry) -> bool:
                return lease.task_id == task_id and lease.holder == DISPATCH_HOLDER

            freed = {slot for slot, runs in self._leases.items() if any(doomed(r, lease) for r, lease in runs.items())}
            deleted = self._delete_locked(doomed)
            return removed, (self._wake_locked(now, dispatch_lease_seconds, freed) if deleted else [])

    def recover(
        self,
        dispatch_lease_seconds: float,
        *,
        caps: Collection[str] | None = None,
        task_names: Collection[str] | None = None,
        readmit_before: float | None = None,
    ) -> list[Woken]:
        scoped = caps is not None or task_names is not None

        def in_scope(entry: _WaiterEntry) -> bool:
            if not scoped:
                return True
            return any(of_caps(slot, caps or ()) for slot in entry.slots) or entry.task_name in (task_names or ())

        with self._lock:
            now = self.clock()
            considered = [
                entry
                for entry in self._waiting.values()
                if entry.listed and entry.deployment == self.deployment and in_scope(entry)
            ]
            only = {slot for entry in considered for slot in entry.slots} if scoped else None
            missed = []
            for entry in considered:
                if entry.dispatch_run_id is not None and entry.dispatch_expires_at <= now:
                    self._delete_dispatch_locked(entry.dispatch_run_id, entry.task_id)
                    entry.dispatch_run_id = None
                    if entry.dispatches >= LEASED_DISPATCHES:
                        missed.append(entry)
            woken = [
                self._dispatch_locked(
                    entry, now, unleased_dispatch_seconds(entry.dispatches, dispatch_lease_seconds), leases=False
                )
                for entry in self._in_order(missed)
            ]
            if readmit_before is not None:
                overdue = self._in_order(e for e in considered if e.waiting and e.first_deferred_at < readmit_before)
                woken += [self._dispatch_locked(e, now, dispatch_lease_seconds, leases=False) for e in overdue]
            return woken + self._wake_locked(now, dispatch_lease_seconds, only)

    def readmit(self, slot: str, dispatch_lease_seconds: float) -> list[Woken]:
        with self._lock:
            now = self.clock()
            entries = self._in_order(
                e for e in self._waiting.values() if e.waiting and e.deployment == self.deployment and slot in e.slots
            )
            return [self._dispatch_locked(entry, now, dispatch_lease_seconds, leases=False) for entry in entries]

    def entry(self, task_id: str) -> Entry | None:
        with self._lock:
            entry = self._waiting.get(task_id)
            if entry is None:
                return None
            return Entry(entry.listed, entry.dispatch_run_id, entry.payload == OUTSIDE_PAYLOAD)

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        with self._lock:
            now = self.clock()
            ordered = self._in_order(waiter for waiter in self._waiting.values() if waiter.listed)
            result: list[Waiter] = []
            for name in sorted({name for waiter in ordered for name in waiter.slots}):
                if slot is not None and name != slot:
                    continue
                of_slot = sorted(
                    (waiter for waiter in ordered if name in waiter.slots), key=lambda waiter: waiter.place_in(name)
                )
                result.extend(
                    Waiter(
                        name, waiter.task_id, waiter.task_name, waiter.first_deferred_at, now - waiter.parked_at,
                        position, waiter.dispatch_run_id is not None, waiter.weights.get(name, 1),
                        waiter.fair_keys.get(name), waiter.round_in(name),
                    )
                    for position, waiter in enumerate(of_slot, 1)
                )  # fmt: skip
            return result

    def renew(self, run_ids: Collection[str], lease_seconds: float) -> dict[str, int]:
        wanted = set(run_ids)
        renewed: dict[str, int] = {}
        with self._lock:
            now = self.clock()
            for runs in self._leases.values():
                for run_id, lease in runs.items():
                    if run_id in wanted and lease.expires_at > now:
                        lease.expires_at = now + lease_seconds
                        renewed[run_id] = renewed.get(run_id, 0) + 1
        return renewed

    def _delete_dispatch_locked(self, run_id: str, task_id: str) -> int:
        """Delete the dispatch leases (never a claimed run's) of ``task_id``'s dispatch ``run_id``."""
        return self._delete_locked(
            lambda run, lease: run == run_id and lease.task_id == task_id and lease.holder == DISPATCH_HOLDER
        )

    def _delete_locked(self, doomed: Callable[[str, _LeaseEntry], bool]) -> int:
        deleted = 0
        for runs in self._leases.values():
            for run_id in [run_id for run_id, lease in runs.items() if doomed(run_id, lease)]:
                del runs[run_id]
                deleted += 1
        return deleted

    def _delete(self, doomed: Callable[[str, _LeaseEntry], bool]) -> int:
        with self._lock:
            return self._delete_locked(doomed)

    def release(self, run_id: str) -> int:
        return self._delete(lambda run, lease: run == run_id)

    def release_holder(self, task_id: str, holder: str) -> int:
        return self._delete(lambda run, lease: lease.task_id == task_id and lease.holder == holder)

    def release_task(self, task_id: str) -> int:
        return self._delete(lambda run, lease: lease.task_id == task_id)

    def sweep(self) -> int:
        with self._lock:
            now = self.clock()
            for entry in [e for e in self._waiting.values() if e.done_until is not None and e.done_until <= now]:
                del self._waiting[entry.task_id]
            return self._delete_locked(lambda run, lease: lease.expires_at <= now)

    def status(self) -> list[SlotStatus]:
        with self._lock:
            now = self.clock()
            result = []
            for slot in sorted(self._limits):
                runs = self._leases.get(slot, {}).values()
                expired = sum(1 for lease in runs if lease.expires_at <= now)
                live = len(self._live_task_ids(slot, now))
                units = self._units(slot, self._current_limits([slot])[slot], now)
                result.append(SlotStatus(slot, self._limits[slot], live, expired, units if units != live else None))
            return result

    def leases(self, slot: str | None = None) -> list[Lease]:
        with self._lock:
            now = self.clock()
            return [
                Lease(
                    name,
                    lease.task_id,
                    run_id,
                    lease.holder,
                    lease.expires_at - now,
                    lease.task_name,
                    now - lease.acquired_at,
                    lease.weight,
                )
                for name, runs in sorted(self._leases.items())
                if slot is None or name == slot
                for run_id, lease in sorted(runs.items(), key=lambda item: item[1].expires_at)
            ]

    def prune(self, prefix: str, *, dry_run: bool = False) -> list[str]:
        with self._lock:
            now = self.clock()
            # A slot with waiters (or dispatches) keeps its sentinel: it is in use.
            waited = {slot for waiter in self._waiting.values() if waiter.listed for slot in waiter.slots}
            doomed = sorted(
                slot
                for slot in self._limits
                if slot.startswith(prefix) and slot not in waited and not self._live_task_ids(slot, now)
            )
            if not dry_run:
                for slot in doomed:
                    del self._limits[slot]
                    self._leases.pop(slot, None)
                for entry in [
                    e for e in self._waiting.values() if not e.listed and not set(doomed).isdisjoint(e.slots)
                ]:
                    del self._waiting[entry.task_id]
            return doomed

    def record_history(self, events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
        if not events:
            return
        with self._lock:
            self._history.extend(events)
            newest = max(event.at for event in events)
            kept = [event for event in self._history if event.at >= newest - keep_seconds]
            self._history = kept[-max_events:] if max_events > 0 else []

    def history(self, since: float, task_id: str | None = None) -> list[HistoryEvent]:
        with self._lock:
            return sorted(
                (
                    event
                    for event in self._history
                    if event.at >= since and (task_id is None or event.task_id == task_id)
                ),
                key=lambda event: event.at,
            )
