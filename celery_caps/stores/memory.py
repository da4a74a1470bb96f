"""An in-process slot store for tests and single-process experiments.

It honours the whole store contract (atomic all-or-nothing admission, leases by
the store's own clock, sweep keeping sentinels) but lives in one process's
memory: it cannot cap a fleet.  ``clock`` can be replaced to test expiry.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from .base import (
    DISPATCH_HOLDER,
    PARK_ADMITTED,
    PARK_LIST_FULL,
    PARK_PARKED,
    PARK_PARKED_FIRST,
    PARK_ROOM,
    Admission,
    Claimed,
    HistoryEvent,
    Lease,
    SlotStatus,
    SlotStore,
    Waiter,
    Woken,
)


@dataclass
class _LeaseEntry:
    task_id: str
    holder: str
    expires_at: float
    task_name: str | None
    acquired_at: float


@dataclass
class _WaiterEntry:
    task_id: str
    slots: dict[str, int]
    payload: bytes
    first_deferred_at: float
    parked_at: float
    sequence: int
    task_name: str | None
    dispatch_run_id: str | None = None
    dispatch_expires_at: float = 0.0


class MemoryStore(SlotStore):
    """Slots in a dict guarded by a lock; ``clock`` returns seconds (the store clock)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._limits: dict[str, int] = {}  # the sentinels
        self._leases: dict[str, dict[str, _LeaseEntry]] = {}  # slot -> run id -> lease
        self._history: list[HistoryEvent] = []
        self._waiting: dict[str, _WaiterEntry] = {}  # task id -> waiter
        self._sequence = itertools.count()

    supports_parking = True

    def _live_task_ids(self, slot: str, now: float) -> set[str]:
        return {lease.task_id for lease in self._leases.get(slot, {}).values() if lease.expires_at > now}

    def acquire(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        task_name: str | None = None,
    ) -> Admission:
        with self._lock:
            now = self.clock()
            full = []
            for slot in sorted(slots):
                self._limits[slot] = slots[slot]
                live = self._live_task_ids(slot, now)
                if task_id not in live and len(live) >= slots[slot]:
                    full.append(slot)
            if full:
                return Admission(False, tuple(full))
            for slot in slots:
                self._leases.setdefault(slot, {})[run_id] = _LeaseEntry(
                    task_id, holder, now + lease_seconds, task_name, now
                )
            return Admission(True)

    def _full_slots(self, slots: Mapping[str, int], task_id: str, now: float) -> list[str]:
        full = []
        for slot in sorted(slots):
            live = self._live_task_ids(slot, now)
            if task_id not in live and len(live) >= slots[slot]:
                full.append(slot)
        return full

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
        with self._lock:
            now = self.clock()
            for slot in slots:
                self._limits[slot] = slots[slot]
            if not self._full_slots(slots, task_id, now):
                if not admit:
                    return PARK_ROOM
                for slot in slots:
                    self._leases.setdefault(slot, {})[run_id] = _LeaseEntry(
                        task_id, holder, now + lease_seconds, task_name, now
                    )
                return PARK_ADMITTED
            if task_id in self._waiting:
                return PARK_PARKED
            waiting = {slot: sum(1 for waiter in self._waiting.values() if slot in waiter.slots) for slot in slots}
            if any(count >= max_waiters for count in waiting.values()):
                return PARK_LIST_FULL
            self._waiting[task_id] = _WaiterEntry(
                task_id, dict(slots), payload, first_deferred_at, now, next(self._sequence), task_name
            )
            return PARK_PARKED_FIRST if report_first and 0 in waiting.values() else PARK_PARKED

    def _wake_locked(self, now: float, dispatch_lease_seconds: float, only: set[str] | None = None) -> list[Woken]:
        """Dispatch the oldest waiters (of one of the slots ``only``, if given) that have room
        (the lock is held)."""
        woken = []
        waiting = sorted(
            (
                waiter
                for waiter in self._waiting.values()
                if waiter.dispatch_run_id is None and (only is None or not only.isdisjoint(waiter.slots))
            ),
            key=lambda waiter: (waiter.first_deferred_at, waiter.parked_at, waiter.sequence),
        )
        for waiter in waiting:
            if self._full_slots(waiter.slots, waiter.task_id, now):
                continue
            run_id = uuid.uuid4().hex
            for slot in waiter.slots:
                self._leases.setdefault(slot, {})[run_id] = _LeaseEntry(
                    waiter.task_id, DISPATCH_HOLDER, now + dispatch_lease_seconds, waiter.task_name, now
                )
            waiter.dispatch_run_id = run_id
            waiter.dispatch_expires_at = now + dispatch_lease_seconds
            woken.append(Woken(waiter.task_id, run_id, waiter.payload, waiter.task_name))
        return woken

    def _release_and_wake(
        self, doomed: Callable[[str, _LeaseEntry], bool], dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        with self._lock:
            deleted = self._delete_locked(doomed)
            woken = self._wake_locked(self.clock(), dispatch_lease_seconds) if deleted else []
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

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        with self._lock:
            waiter = self._waiting.pop(task_id, None)
            deleted = self._delete_locked(
                lambda run, lease: lease.task_id == task_id and lease.holder == DISPATCH_HOLDER
            )
            woken = self._wake_locked(self.clock(), dispatch_lease_seconds) if deleted else []
        return (len(waiter.slots) if waiter is not None else 0), woken

    def claim_dispatch(self, task_id: str, run_id: str, holder: str, lease_seconds: float) -> Claimed:
        with self._lock:
            now = self.clock()
            claimed = 0
            for runs in self._leases.values():
                lease = runs.get(run_id)
                if lease is not None and lease.task_id == task_id and lease.expires_at > now:
                    lease.holder = holder
                    lease.expires_at = now + lease_seconds
                    claimed += 1
            entry = self._waiting.get(task_id)
            if (
                not claimed
                and entry is not None
                and entry.dispatch_run_id not in (None, run_id)
                and entry.dispatch_expires_at > now
            ):
                return Claimed(0, dispatched_elsewhere=True)
            self._waiting.pop(task_id, None)
            return Claimed(claimed)

    def wake(self, dispatch_lease_seconds: float, slots: Collection[str] | None = None) -> list[Woken]:
        only = None if slots is None else set(slots)
        with self._lock:
            now = self.clock()
            for waiter in self._waiting.values():
                if only is not None and only.isdisjoint(waiter.slots):
                    continue
                if waiter.dispatch_run_id is not None and waiter.dispatch_expires_at <= now:
                    for runs in self._leases.values():
                        runs.pop(waiter.dispatch_run_id, None)
                    waiter.dispatch_run_id = None
            return self._wake_locked(now, dispatch_lease_seconds, only)

    def _mark_waiting(self, doomed: Callable[[_WaiterEntry], bool], hold_seconds: float) -> list[Woken]:
        mark = uuid.uuid4().hex
        with self._lock:
            now = self.clock()
            marked = sorted(
                (w for w in self._waiting.values() if w.dispatch_run_id is None and doomed(w)),
                key=lambda waiter: (waiter.first_deferred_at, waiter.parked_at, waiter.sequence),
            )
            for waiter in marked:
                waiter.dispatch_run_id = mark
                waiter.dispatch_expires_at = now + hold_seconds
            return [Woken(waiter.task_id, mark, waiter.payload, waiter.task_name) for waiter in marked]

    def expire_waiters(self, first_deferred_before: float, hold_seconds: float) -> list[Woken]:
        return self._mark_waiting(lambda waiter: waiter.first_deferred_at < first_deferred_before, hold_seconds)

    def drain(self, slot: str, hold_seconds: float) -> list[Woken]:
        return self._mark_waiting(lambda waiter: slot in waiter.slots, hold_seconds)

    def settle_published(self, published: Sequence[Woken], failed: Sequence[Woken] = ()) -> int:
        deleted = 0
        with self._lock:
            for woken, done in ((published, True), (failed, False)):
                for marked in woken:
                    waiter = self._waiting.get(marked.task_id)
                    if waiter is None or waiter.dispatch_run_id != marked.run_id:
                        continue
                    if done:
                        del self._waiting[marked.task_id]
                        deleted += len(waiter.slots)
                    else:
                        waiter.dispatch_run_id = None
        return deleted

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        with self._lock:
            now = self.clock()
            ordered = sorted(
                self._waiting.values(), key=lambda waiter: (waiter.first_deferred_at, waiter.parked_at, waiter.sequence)
            )
            result: list[Waiter] = []
            for name in sorted({name for waiter in ordered for name in waiter.slots}):
                if slot is not None and name != slot:
                    continue
                of_slot = [waiter for waiter in ordered if name in waiter.slots]
                result.extend(
                    Waiter(
                        name, waiter.task_id, waiter.task_name, waiter.first_deferred_at, now - waiter.parked_at,
                        position, waiter.dispatch_run_id is not None,
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
        now = self.clock()
        return self._delete(lambda run, lease: lease.expires_at <= now)

    def status(self) -> list[SlotStatus]:
        with self._lock:
            now = self.clock()
            result = []
            for slot in sorted(self._limits):
                runs = self._leases.get(slot, {}).values()
                expired = sum(1 for lease in runs if lease.expires_at <= now)
                result.append(SlotStatus(slot, self._limits[slot], len(self._live_task_ids(slot, now)), expired))
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
                )
                for name, runs in sorted(self._leases.items())
                if slot is None or name == slot
                for run_id, lease in sorted(runs.items(), key=lambda item: item[1].expires_at)
            ]

    def prune(self, prefix: str, *, dry_run: bool = False) -> list[str]:
        with self._lock:
            now = self.clock()
            # A slot with waiters (or dispatches) keeps its sentinel: it is in use.
            waited = {slot for waiter in self._waiting.values() for slot in waiter.slots}
            doomed = sorted(
                slot
                for slot in self._limits
                if slot.startswith(prefix) and slot not in waited and not self._live_task_ids(slot, now)
            )
            if not dry_run:
                for slot in doomed:
                    del self._limits[slot]
                    self._leases.pop(slot, None)
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
