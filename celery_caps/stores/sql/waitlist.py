"""The portable SQL store's waiting list (the park strategy): ``concurrency_waiters``.

One row per parked task and slot it needs.  Parking and waking lock the same sentinels as
admission, so each is atomic with it; a claim, a forget and recovery's return of an expired
dispatch take a dispatch's leases before its entry (the lock order of :mod:`.leases`).  Every
change of an entry's state is conditional on the state it was read in (a waiting entry is
dispatched only ``WHERE dispatch_run_id IS NULL``, and so on), so a step that lost a race to
another changes nothing.

Each entry records the deployment of the handle that parked it (:attr:`.SlotStore.deployment`),
and every hand-over a handle makes (a release's wake, recovery, a readmit) reads only its own
deployment's entries: the others keep their place, for their own deployment to dispatch.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import uuid
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...errors import StoreError
from ..base import (
    DISPATCH_HOLDER,
    LEASED_DISPATCHES,
    ClaimOutcome,
    Entry,
    ParkingStore,
    ParkOutcome,
    ParkRequest,
    Waiter,
    Woken,
    unleased_dispatch_seconds,
)
from .leases import BATCH, SQLLeaseStore, _cut, as_text
from .schema import MAX_TASK_NAME_LENGTH, concurrency_waiters, concurrency_waitlists
from .statements import admission_params

#: Waiter rows read per batch when a release looks for waiters to dispatch.
WAITING_BATCH = 64
#: Released lists up to this many are each read apart, and merged, by a release's walk (more, as
#: a recovery pass walks, are read together, sorted by the database).
MERGED_LISTS = 4
#: Earlier than any first-deferral or park time (a finite number: MySQL has no infinity).
_BEFORE_ANY_TIME = -1e300
#: Reads of a task's entry by ``forget`` while other steps keep changing it.
_FORGET_ATTEMPTS = 5
#: The payload of a tombstone: the task is gone, and so are its arguments (the column is NOT NULL).
NO_PAYLOAD = b""


def _place(row: Sequence[Any]) -> tuple[Any, ...]:
    """A waiting row's place in its list (``waiting_rows``' order): round, first deferral, park
    time, task id."""
    return (row[3], row[4], row[5], as_text(row[0]))


class SQLStore(SQLLeaseStore, ParkingStore):
    """The SQL store: leases (:class:`.SQLLeaseStore`) and the waiting list, in portable SQL."""

    @property
    def _own(self) -> dict[str, Any]:
        """The bind of this handle's deployment: the entries its hand-overs may dispatch."""
        return {"deployment": self.deployment}

    # -- parking ------------------------------------------------------------------------------

    def park(self, request: ParkRequest) -> ParkOutcome:
        slots = request.slots
        ordered = sorted(slots)
        task_name = _cut(request.task_name)
        weights = request.weights
        params = admission_params(
            slots,
            request.task_id,
            request.run_id,
            request.holder,
            request.lease_seconds,
            task_name,
            weights,
            self.deployment,
        )
        statements = self.statements

        def park(connection: Connection) -> ParkOutcome:
            # The same locks as acquire, then (read after them) the task's entry and the room:
            # parking is atomic with admission.
            self._lock_sentinels(connection, slots, params)
            entry = statements.execute(connection, "task_listed", params).first()
            if entry is not None:
                # A copy of the listed task (the same name, whatever slots and limits it asks for
                # now: a deploy may have renamed its cap or changed its key), or its id reused by
                # another task.
                return ParkOutcome.WAITING if entry[0] == task_name else ParkOutcome.ID_IN_USE
            if not self._full_slots(connection, slots, weights, params):
                self._insert_leases(connection, len(ordered), params)
                return ParkOutcome.ADMITTED
            if request.payload is None:
                return ParkOutcome.FULL
            listed: dict[str, int] = {}
            last_rounds: dict[str, int] = {}  # the last round of each list (0: none)
            for slot, entries, last_round in statements.execute(
                connection, "listed_per_slot", {"slots": ordered, **self._own}
            ):
                listed[as_text(slot)] = int(entries)
                last_rounds[as_text(slot)] = int(last_round or 0)
            if any(entries >= request.max_waiters for entries in listed.values()):
                return ParkOutcome.LIST_FULL
            dispatches = statements.execute(connection, "tombstone_dispatches", params).scalar() or 0
            statements.execute(connection, "delete_tombstone", params)
            # Its round in each slot, read under the sentinel locks: where it has a fair key, the
            # list's first round or its key's next; elsewhere the list's last round (0 in a list
            # without fair keys), so that after a deploy that removed fair_by new entries queue
            # behind the rounds left.  (No statement more without fair keys: listed_per_slot read
            # the last rounds.)
            rounds = {slot: self._fair_round(connection, slot, key) for slot, key in request.fair_keys.items()}
            parked_at: sa.ColumnElement[Any] = sa.literal_column(self.dialect.now)  # the store's clock
            rows = [
                {
                    "slot": self.dialect.exact(slot),
                    "task_id": self.dialect.exact(request.task_id),
                    "slot_count": len(ordered),
                    "first_deferred_at": request.first_deferred_at,
                    "parked_at": parked_at,
                    "task_name": task_name,
                    "deployment": self.dialect.exact(self.deployment),
                    "payload": request.payload,
                    "dispatches": dispatches,
                    "weight": weights.get(slot, 1),
                    "fair_key": self.dialect.exact(request.fair_keys[slot]) if slot in request.fair_keys else None,
                    "fair_round": rounds[slot] if slot in rounds else last_rounds.get(slot, 0),
                }
                for slot in ordered
            ]
            connection.execute(concurrency_waiters.insert().values(rows))
            # The lists' counts last (see listed_per_slot).
            counted = [slot for slot in ordered if slot in listed]
            if counted:
                statements.execute(connection, "list_entry", {"slots": counted})
            uncounted = [{"slot": self.dialect.exact(slot), "entries": 1} for slot in ordered if slot not in listed]
            if uncounted:
                connection.execute(concurrency_waitlists.insert(), uncounted)
            return ParkOutcome.PARKED

        return self._transaction(park)

    def _fair_round(self, connection: Connection, slot: str, fair_key: str) -> int:
        """The round of a new entry of ``fair_key`` in ``slot``'s list (its sentinel locked): the
        list's first round, or the key's last one's next if later (see :class:`.ParkingStore`,
        "Fair shares")."""
        params = {"slot": slot, "fair_key": fair_key, **self._own}
        head, last = self.statements.execute(connection, "fair_rounds", params).one()
        head = int(head or 0)
        return head if last is None else max(head, int(last) + 1)

    # -- waking -------------------------------------------------------------------------------

    def _dispatch(
        self, connection: Connection, locked: list[str], dispatch_lease_seconds: float, touching: set[str] | None
    ) -> list[Woken]:
        """Dispatch, with leases, the first waiters of this deployment of the ``locked`` slots
        (sentinels locked) that have room and (if ``touching`` is given) wait for one of the slots
        ``touching``.

        Room is counted against the slots' limits as their sentinels hold them now (read once:
        they are locked), never the limits the waiters were parked under; a slot without a limit
        counts as full.  A waiter fits a slot it holds already, or whose free units take its weight
        there (at most the limit); the first waiter that does not fit a slot closes that slot for
        the rest of the walk (a heavy waiter's room is not handed to those behind it; with every
        weight 1, a slot it does not fit is full anyway).  Waiters are read from the lists of the
        slots ``touching`` (all of ``locked`` without it) in their order (round, first deferral,
        park time, task id: the lists merged, each list's own order kept) a batch at a time, each
        considered once, at its first place, with its rows of its other slots: their sentinels,
        if not locked yet, are locked then without waiting (a waiter needing one another
        transaction holds is passed over: that slot's release, or recovery, serves it).  A closed
        slot's list is read no further (up to :data:`MERGED_LISTS` lists are each read apart and
        merged here, so that a closed one stops and none is sorted whole), and reading stops once
        every one of those slots is full or closed: a release costs the waiters it passes over,
        never the length of the lists, and never reads the list of another slot (full, it could
        hold any number of rows of earlier rounds).  A waiter passed over keeps its place.
        """
        walked = [slot for slot in locked if touching is None or slot in touching]
        if not walked:
            return []
        statements = self.statements
        limits: dict[str, int] = defaultdict(int)
        live: dict[str, dict[str, int]] = defaultdict(dict)  # slot -> live task id -> its largest weight
        units: dict[str, int] = defaultdict(int)

        def read_room(slots: Sequence[str]) -> None:
            """Read the limits and live holders of ``slots`` (their sentinels just locked)."""
            for slot, limit in statements.execute(connection, "slot_limits", {"slots": slots}):
                limits[as_text(slot)] = int(limit or 0)
            for slot, task_id, weight in statements.execute(connection, "live", {"slots": slots}):
                slot = as_text(slot)
                live[slot][as_text(task_id)] = int(weight)
                units[slot] += min(int(weight), limits[slot])

        read_room(locked)
        held = set(locked)
        unlockable: set[str] = set()  # sentinels another transaction holds (or missing)
        closed: set[str] = set()
        met: set[str] = set()  # the waiters considered (a waiter's rows of other rounds come later)
        chosen: list[tuple[str, str]] = []
        if len(walked) <= MERGED_LISTS:
            lists = [self._list_rows(connection, [slot], closed) for slot in walked]
        else:
            lists = [self._list_rows(connection, walked, closed)]
        rows_in_order = heapq.merge(*lists, key=_place)
        while True:
            rows = list(itertools.islice(rows_in_order, WAITING_BATCH))
            if not rows:
                break
            waiting: dict[str, dict[str, Any]] = {}
            for task_id, slot, slot_count, _round, _first, _parked, task_name, weight in rows:
                task_id = as_text(task_id)
                if task_id in met:
                    continue  # a row of another list, or round, of a waiter considered already
                # (In the order of their first places: a dict keeps it.)
                waiter = waiting.setdefault(task_id, {"slots": {}, "count": slot_count, "task_name": task_name})
                waiter["slots"][as_text(slot)] = int(weight)
            # The waiters of several slots read in part: all their rows, in one read per batch, and
            # the sentinels of their slots not locked yet, locked now if free.
            partial = [task_id for task_id, waiter in waiting.items() if len(waiter["slots"]) < waiter["count"]]
            if partial:
                for task_id, slot, weight in statements.execute(
                    connection, "waiting_rows_of_tasks", {"task_ids": partial}
                ):
                    waiting[as_text(task_id)]["slots"][as_text(slot)] = int(weight)
                wanted = {slot for task_id in partial for slot in waiting[task_id]["slots"]} - held - unlockable
                if wanted:
                    more = [
                        as_text(row[0])
                        for row in statements.execute(connection, "lock_more", {"slots": sorted(wanted)})
                    ]
                    held.update(more)
                    unlockable |= wanted - set(more)
                    if more:
                        read_room(more)
            for task_id, waiter in waiting.items():
                met.add(task_id)
                needed: dict[str, int] = waiter["slots"]  # slot -> the waiter's weight there
                if len(needed) < waiter["count"] or not unlockable.isdisjoint(needed):
                    continue  # one of its slots is not locked here: a later release or recovery
                misfits = {
                    slot
                    for slot, weight in needed.items()
                    if task_id not in live[slot]
                    and (slot in closed or min(weight, limits[slot]) > limits[slot] - units[slot])
                }
                if misfits:
                    closed |= misfits  # passed over; what it needs there goes to nobody behind it
                    continue
                run_id = uuid.uuid4().hex
                params = admission_params(
                    needed, task_id, run_id, DISPATCH_HOLDER, dispatch_lease_seconds, waiter["task_name"], needed
                )
                if not statements.execute(connection, "mark_dispatched", params).rowcount:
                    continue  # no longer waiting: a readmit or a forget took it since it was read
                self._insert_leases(connection, len(needed), params)
                for slot, weight in needed.items():
                    # A task id counts once, at its largest weight: a lease heavier than the one it
                    # holds already adds the difference.
                    before = live[slot].get(task_id, 0)
                    if weight > before:
                        live[slot][task_id] = weight
                        units[slot] += min(weight, limits[slot]) - min(before, limits[slot])
                chosen.append((task_id, run_id))
            if all(slot in closed or units[slot] >= limits[slot] for slot in walked):
                break
        return self._woken(connection, chosen, readmit=False)

    def _list_rows(self, connection: Connection, slots: list[str], closed: set[str]) -> Iterator[Sequence[Any]]:
        """The waiting rows of this deployment of the lists of ``slots``, in their order (merged,
        each list's own order kept), read a batch at a time (keyset: from the last row read on),
        until the lists end, or (one list) its slot is in ``closed``, which the caller fills as it
        goes.  (Several lists, a recovery pass's, are read on: the caller stops when each of
        them is full or closed.)"""
        alone = slots[0] if len(slots) == 1 else None
        after: dict[str, Any] = {"round": -1, "first": _BEFORE_ANY_TIME, "parked": _BEFORE_ANY_TIME, "task_id": ""}
        # The slots of the rows read at the place ``after`` (read again from there: skipped).
        read_at_after: set[str] = set()
        while True:
            # (One more row per row read again, so that every batch brings a new one.)
            batch = WAITING_BATCH + len(read_at_after)
            params = {"slots": slots, "batch": batch, **after, **self._own}
            rows = self.statements.execute(connection, "waiting_rows", params).all()
            last = (after["round"], after["first"], after["parked"], after["task_id"])
            for row in rows:
                if _place(row) == last and as_text(row[1]) in read_at_after:
                    continue
                if alone is not None and alone in closed:
                    return
                yield row
            if len(rows) < batch:
                return
            last_row = rows[-1]
            last = _place(last_row)
            read_at_after = {as_text(row[1]) for row in rows if _place(row) == last}
            after = {"round": last_row[3], "first": last_row[4], "parked": last_row[5], "task_id": last_row[0]}

    def _readmit(self, connection: Connection, deadlines: Sequence[tuple[str, float]]) -> list[Woken]:
        """Dispatch, without leases, those of the tasks of ``deadlines`` (task id, seconds its copy
        has) that still wait, in that order (their sentinels locked)."""
        chosen = []
        for task_id, seconds in deadlines:
            run_id = uuid.uuid4().hex
            params = {"task_id": task_id, "run_id": run_id, "lease_seconds": seconds}
            if self.statements.execute(connection, "mark_dispatched", params).rowcount:
                chosen.append((task_id, run_id))
        return self._woken(connection, chosen, readmit=True)

    def _woken(self, connection: Connection, chosen: Sequence[tuple[str, str]], readmit: bool) -> list[Woken]:
        """The dispatches ``chosen`` (task id, dispatch run id), with their payloads and names."""
        found: dict[str, tuple[bytes, str | None]] = {}
        task_ids = [task_id for task_id, _run_id in chosen]
        for start in range(0, len(task_ids), BATCH):
            batch = task_ids[start : start + BATCH]
            for task_id, payload, task_name in self.statements.execute(connection, "payloads", {"task_ids": batch}):
                found.setdefault(as_text(task_id), (bytes(payload), task_name))
        return [Woken(task_id, run_id, *found[task_id], readmit=readmit) for task_id, run_id in chosen]

    def _lock_existing(self, connection: Connection, slots: Collection[str]) -> list[str]:
        """Lock the sentinels of ``slots`` in slot order, waiting for them; the slots locked."""
        if not slots:
            return []
        rows = self.statements.execute(connection, "lock", {"slots": sorted(slots)})
        return sorted(as_text(row[0]) for row in rows)

    def _wake_after_release(
        self, connection: Connection, released: list[str], dispatch_lease_seconds: float
    ) -> list[Woken]:
        if not released:
            return []
        # Lock the released slots first: a park that counted them full has committed by then,
        # so its waiter is seen here.  (The other slots of waiters of several slots are locked
        # as the walk meets them.)
        locked = self._lock_existing(connection, set(released))
        if not self._names(connection, "slots_waited_for", "slots", locked, self._own):
            return []
        return self._dispatch(connection, locked, dispatch_lease_seconds, touching=set(released))

    def _release_and_wake(
        self, slots_of: str, delete: str, params: dict[str, Any], dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        """Delete the leases ``delete`` selects (``slots_of`` lists their slots), then wake the
        waiters of those slots, in one transaction."""

        def release(connection: Connection) -> tuple[int, list[Woken]]:
            slots = [as_text(row[0]) for row in self.statements.execute(connection, slots_of, params)]
            deleted = int(self.statements.execute(connection, delete, params).rowcount)
            if not deleted:
                return 0, []
            return deleted, self._wake_after_release(connection, slots, dispatch_lease_seconds)

        return self._transaction(release)

    def release_and_wake(self, run_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        return self._release_and_wake("run_slots", "release_run", {"run_id": run_id}, dispatch_lease_seconds)

    def release_holder_and_wake(
        self, task_id: str, holder: str, dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        params = {"task_id": task_id, "holder": holder}
        return self._release_and_wake("holder_slots", "release_holder", params, dispatch_lease_seconds)

    def release_task_and_wake(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        return self._release_and_wake("task_slots", "release_task", {"task_id": task_id}, dispatch_lease_seconds)

    # -- a woken copy's claim ---------------------------------------------------------------

    def claim(
        self, task_id: str, run_id: str, holder: str, lease_seconds: float, *, redelivered: bool = False
    ) -> ClaimOutcome:
        params = {
            "task_id": task_id,
            "run_id": run_id,
            "holder": holder,
            "lease_seconds": lease_seconds,
            "done_seconds": self.done_seconds,
            "no_payload": NO_PAYLOAD,
        }
        statements = self.statements
        other_copy = ClaimOutcome.ADMIT if redelivered else ClaimOutcome.END

        def settle(connection: Connection, *, tombstone: bool) -> None:
            """The entry dispatched to this run leaves the list: a tombstone if dispatched more than
            once (copies of its other dispatches may be on their way), or ``tombstone``."""
            minimum = {**params, "minimum": 0 if tombstone else 2}
            slots = sorted({as_text(row[0]) for row in statements.execute(connection, "settling_slots", params)})
            settled = statements.execute(connection, "settle_tombstone", minimum).rowcount
            settled += statements.execute(connection, "settle_delete", minimum).rowcount
            if settled and slots:
                statements.execute(connection, "unlist_entry", {"slots": slots})

        def claim(connection: Connection) -> ClaimOutcome:
            # The dispatch's leases (locked), then the entry: the order of every step that changes both.
            leases = statements.execute(connection, "claim_leases", params).all()
            live = [lease_holder for lease_holder, alive in leases if alive]
            # (A lease already the run's: the same claim again, its reply lost.)
            claimable = (
                bool(live) and len(live) == len(leases) and all(owner in (DISPATCH_HOLDER, holder) for owner in live)
            )
            if claimable and all(owner == DISPATCH_HOLDER for owner in live):
                # A limit cut since the dispatch: its copy goes through admission (see below).
                claimable = statements.execute(connection, "dispatch_over_limit", params).first() is None
            if claimable:
                statements.execute(connection, "claim", params)
                settle(connection, tombstone=False)
                return ClaimOutcome.RUN
            if any(owner != DISPATCH_HOLDER for owner in live):
                return other_copy  # another copy's run holds the dispatch's slots
            statements.execute(connection, "delete_dispatch_leases", params)
            entry = statements.execute(connection, "lock_entry", params).first()
            if entry is None:
                return ClaimOutcome.ADMIT
            dispatch_run_id, done_until, claimed_by, _slot = entry
            if done_until is not None:
                # Only a copy of the dispatch the tombstone records goes on: redelivered (its run
                # may have died), or this very claim retried (its leases expired meanwhile).  A
                # copy of any other dispatch ends, redelivered or not.
                same_dispatch = dispatch_run_id == run_id
                return (
                    ClaimOutcome.ADMIT if same_dispatch and (redelivered or claimed_by == holder) else ClaimOutcome.END
                )
            if dispatch_run_id != run_id:
                return ClaimOutcome.END  # the list answers for the task
            # No lease is left to tell a duplicate copy of this dispatch that the task was taken.
            settle(connection, tombstone=True)
            return ClaimOutcome.ADMIT

        return self._transaction(claim)

    # -- leaving the list ------------------------------------------------------------------

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        statements = self.statements
        params = {
            "task_id": task_id,
            "holder": DISPATCH_HOLDER,
            "done_seconds": self.done_seconds,
            "no_payload": NO_PAYLOAD,
        }

        def forget(connection: Connection) -> tuple[int, list[Woken]]:
            # Every dispatch lease of the task first (a release's, or one taken when it was sent:
            # that has no entry), as a claim takes them before the entry; never a run's lease,
            # whose holder is the run's.
            freed = [as_text(row[0]) for row in statements.execute(connection, "holder_slots", params)]
            deleted = statements.execute(connection, "release_holder", params).rowcount
            woken = self._wake_after_release(connection, freed, dispatch_lease_seconds) if deleted else []
            # Then the entry.  Each change is conditional on the state just read: one that lost a
            # race (a dispatch, a claim, a recovery in between) changes nothing, and it is read again.
            for _ in range(_FORGET_ATTEMPTS):
                rows = statements.execute(connection, "entry", params).all()
                if not rows or rows[0][1] is not None:
                    return 0, woken  # no entry, or a tombstone
                dispatch_run_id = rows[0][0]
                # (An entry's slots never change: it is made whole by one park.)
                slots = {"slots": sorted({as_text(row[3]) for row in rows})}
                if dispatch_run_id is None:
                    if statements.execute(connection, "delete_waiting", params).rowcount:
                        statements.execute(connection, "unlist_entry", slots)
                        return 1, woken
                    continue
                if statements.execute(connection, "tombstone", {**params, "run_id": dispatch_run_id}).rowcount:
                    statements.execute(connection, "unlist_entry", slots)
                    return 1, woken
            raise StoreError(f"forget failed on {self.display_url}: the entry of {task_id!r} kept changing")

        return self._transaction(forget)

    def _recovery_scope(
        self, connection: Connection, cap_names: Sequence[str], names: Sequence[str]
    ) -> tuple[set[str], set[str]]:
        """A scoped recovery's slots, of this deployment's listed entries: those of the caps
        ``cap_names`` (a cap: its slot and its keys'; a slot name: that slot alone), and every slot
        considered: those, the other slots of their (rare) entries of several slots, and the slots
        with entries of the tasks named ``names``."""
        statements, own = self.statements, self._own
        cap_slots: set[str] = set()
        for cap in cap_names:
            if ":" in cap:
                rows = statements.execute(connection, "listed_slot", {"cap": cap, **own})
            else:
                rows = statements.execute(connection, "cap_slots", {**self._cap_pattern(cap), **own})
            cap_slots.update(as_text(row[0]) for row in rows)
        considered = set(cap_slots)
        if cap_slots:
            considered |= self._names(connection, "several_listed_slots", "slots", cap_slots, own)
        if names:
            considered |= self._names(connection, "named_slots", "task_names", names, own)
        return cap_slots, considered

    def _room_in_scope(self, connection: Connection, cap_names: Sequence[str], names: Sequence[str]) -> set[str]:
        """The slots of a scoped recovery (:meth:`_recovery_scope`) with waiting entries of this
        deployment and room for one, found without listing the caps' keys: a pass with nothing
        to do costs a few reads, not one name per key that waits."""
        statements, own = self.statements, self._own
        room: set[str] = set()
        for cap in cap_names:
            if ":" in cap:
                room |= self._names(connection, "slots_with_room", "slots", [cap], own)
                several = self._names(connection, "several_listed_slots", "slots", [cap], own)
            else:
                pattern = {**self._cap_pattern(cap), **own}
                room.update(as_text(row[0]) for row in statements.execute(connection, "cap_slots_with_room", pattern))
                rows = statements.execute(connection, "several_listed_slots_of_cap", pattern)
                several = {as_text(row[0]) for row in rows}
            if several:
                room |= self._names(connection, "slots_with_room", "slots", several, own)
        if names:
            rows = statements.execute(connection, "named_slots_with_room", {"task_names": names, **own})
            room.update(as_text(row[0]) for row in rows)
        return room

    def _cap_pattern(self, cap: str) -> dict[str, Any]:
        """The parameters of a statement on the slot ``cap`` and its keys'."""
        return {"cap": cap, "pattern": self.statements.prefix_pattern(cap + ":")}

    def recover(
        self,
        dispatch_lease_seconds: float,
        *,
        caps: Collection[str] | None = None,
        task_names: Collection[str] | None = None,
        readmit_before: float | None = None,
    ) -> list[Woken]:
        scoped = caps is not None or task_names is not None
        cap_names = sorted(set(caps or ()))
        names = sorted({name[:MAX_TASK_NAME_LENGTH] for name in task_names or ()})  # as the entries keep them
        if scoped and not cap_names and not names:
            return []
        statements = self.statements

        def recover(connection: Connection) -> list[Woken]:
            own = self._own

            # What a scoped pass considers, read only when something is due or has room: the
            # caps' slots with listed entries (one per waiting key) and every slot considered.
            @functools.cache
            def in_scope() -> tuple[set[str], set[str]]:
                return self._recovery_scope(connection, cap_names, names)

            def of_slots() -> dict[str, Any]:
                return {"slots": sorted(in_scope()[0]), "task_names": names}

            # Dispatches past their deadline wait again at their place: their leases first, as a
            # claim takes them, one dispatch after the other in task order (so concurrent
            # recoveries never wait for each other in a circle).
            now, deadline = statements.execute(connection, "next_dispatch_deadline", own).one()
            due: Sequence[Any] = []
            if deadline is not None and deadline <= now:
                if not scoped:
                    due = statements.execute(connection, "expired_dispatches", {**own, "now": now}).all()
                elif in_scope()[1]:
                    params = {**of_slots(), **own, "now": now}
                    due = statements.execute(connection, "expired_dispatches_of", params).all()
            # A task whose every dispatch passed its deadline unclaimed is readmitted at once (its
            # copy holds no slot), the longer the more it missed.
            missed: list[tuple[str, float]] = []
            for task_id, dispatch_run_id, dispatches in due:
                dispatch = {"task_id": task_id, "run_id": dispatch_run_id}
                statements.execute(connection, "delete_dispatch_leases", dispatch)
                statements.execute(connection, "undispatch", dispatch)
                if dispatches >= LEASED_DISPATCHES:
                    missed.append((as_text(task_id), unleased_dispatch_seconds(dispatches, dispatch_lease_seconds)))
            overdue: list[str] = []
            first = (
                None if readmit_before is None else statements.execute(connection, "first_waiting_since", own).scalar()
            )
            if readmit_before is not None and first is not None and first < readmit_before:
                rows: Iterable[Any] = ()
                if not scoped:
                    rows = statements.execute(connection, "overdue", {"before": readmit_before, **own})
                elif in_scope()[1]:
                    rows = statements.execute(connection, "overdue_of", {"before": readmit_before, **of_slots(), **own})
                overdue = [as_text(row[0]) for row in rows]
            # The slots with room and waiters (read without locks: a slot that gains room after
            # this read is served by its release, or by the next recovery).  Of those, the slots
            # where a waiter may fit, its other slots having room too: a list whose waiters all
            # wait for a full slot (a tenant's, behind a global cap) is that slot's release's to
            # serve, not locked and walked at every pass.  (Past one batch of names, every slot
            # with room is walked.)  The other slots the walk's waiters need are locked as it
            # meets them, as a release's are.
            if scoped:
                room = self._room_in_scope(connection, cap_names, names)
            else:
                room = {as_text(row[0]) for row in statements.execute(connection, "all_slots_with_room", own)}
            if room and len(room) <= BATCH:
                room = self._names(connection, "slots_with_a_fitting_waiter", "slots", room, own)
            # Those sentinels at once, in slot order: readmits and dispatches change waiting
            # entries only under the locks of their slots, as a release's dispatches do.
            readmitted = [*missed, *((task_id, dispatch_lease_seconds) for task_id in overdue)]
            readmitted_ids = [task_id for task_id, _seconds in readmitted]
            overdue_slots = self._names(connection, "slots_of_tasks", "task_ids", readmitted_ids)
            locked = self._lock_existing(connection, room | overdue_slots)
            woken = self._readmit(connection, readmitted)
            if room:
                walk = [slot for slot in locked if slot in room]
                touching = in_scope()[1] if scoped else None
                woken += self._dispatch(connection, walk, dispatch_lease_seconds, touching=touching)
            return woken

        return self._transaction(recover)

    def readmit(self, slot: str, dispatch_lease_seconds: float) -> list[Woken]:
        def readmit(connection: Connection) -> list[Woken]:
            rows = self.statements.execute(connection, "waiting_of_slot", {"slot": slot, **self._own})
            task_ids = [as_text(row[0]) for row in rows]
            if not task_ids:
                return []
            # Under the sentinels of their slots, as every change of a waiting entry.
            self._lock_existing(connection, self._names(connection, "slots_of_tasks", "task_ids", task_ids))
            return self._readmit(connection, [(task_id, dispatch_lease_seconds) for task_id in task_ids])

        return self._transaction(readmit)

    def entry(self, task_id: str) -> Entry | None:
        def read(connection: Connection) -> Entry | None:
            row = self.statements.execute(connection, "entry_state", {"task_id": task_id}).first()
            if row is None:
                return None
            done_until, dispatch_run_id, payload_length = row
            listed = done_until is None
            return Entry(listed, as_text(dispatch_run_id) if dispatch_run_id else None, listed and not payload_length)

        return self._transaction(read, single_statement=True, read_only=True)

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        statement, params = ("waiters_all", {}) if slot is None else ("waiters_of_slot", {"slot": slot})

        def read(connection: Connection) -> list[Waiter]:
            result = []
            positions: dict[str, int] = defaultdict(int)
            for (
                name,
                task_id,
                task_name,
                first,
                age,
                dispatch_run_id,
                weight,
                fair_key,
                fair_round,
            ) in self.statements.execute(connection, statement, params):
                name = as_text(name)
                positions[name] += 1
                dispatched = dispatch_run_id is not None
                result.append(
                    Waiter(
                        name,
                        as_text(task_id),
                        task_name,
                        float(first),
                        float(age),
                        positions[name],
                        dispatched,
                        int(weight),
                        None if fair_key is None else as_text(fair_key),
                        int(fair_round),
                    )
                )
            return result

        return self._transaction(read, read_only=True)
