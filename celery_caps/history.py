"""The optional history of put-backs and finished runs, and what operators read from it.

With ``caps_history_seconds`` set, each process that runs capped tasks buffers
two kinds of events in memory: a task put back because its slots were full
(``deferred``), and a run that ended (``ran``, with its start).  Recording is an
append under a lock; the store is not touched on the admission path.  The lease
keeper writes the buffer in one store call per tick (and at process shutdown);
the store keeps at most ``caps_history_max_events`` events, none older than
``caps_history_seconds``.  When the store is unreachable, the buffer keeps the
newest events up to the same count.

``celery caps explain`` reads a task's events; ``celery caps timeline`` rebuilds
slot occupancy from ``ran`` events plus the leases held now, and the tasks waiting
for each slot from ``deferred`` events, the starts of the runs that followed and the
waiting list now.  Event times come
from the recording worker's clock (a picture, not an audit: skew between
machines shifts runs by as much).  A run cut short by a crash records nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .errors import StoreError
from .stores.base import HistoryEvent, Lease, SlotStore, Waiter

logger = logging.getLogger(__name__)


class HistoryRecorder:
    """One process's buffer of history events; see the module docstring."""

    def __init__(self, keep_seconds: float, max_events: int) -> None:
        self.keep_seconds = keep_seconds
        self.max_events = max_events
        self._lock = threading.Lock()
        self._pending: list[HistoryEvent] = []

    def add(self, event: HistoryEvent) -> None:
        with self._lock:
            self._pending.append(event)
            if len(self._pending) > self.max_events:
                del self._pending[: len(self._pending) - self.max_events]

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self, store: SlotStore) -> int:
        """Write the buffered events in one store call; returns how many were written."""
        with self._lock:
            events, self._pending = self._pending, []
        if not events:
            return 0
        try:
            store.record_history(events, self.keep_seconds, self.max_events)
        except StoreError as exc:
            logger.debug("history not written (%s); kept for the next try", exc)
            with self._lock:
                self._pending[:0] = events
                if len(self._pending) > self.max_events:
                    del self._pending[: len(self._pending) - self.max_events]
            return 0
        return len(events)

    def after_fork(self) -> None:
        """In a forked child: the parent's buffer is the parent's to write."""
        self._lock = threading.Lock()
        self._pending = []


@dataclass(frozen=True)
class Occupancy:
    """One slot's level (distinct task ids holding it, or waiting for it) over time:
    ``(time, level from then on)``."""

    slot: str
    steps: list[tuple[float, int]]
    #: The task ids counted at some point.
    tasks: frozenset[str] = frozenset()

    @property
    def peak(self) -> int:
        return max((level for _, level in self.steps), default=0)


def occupancy(
    events: Iterable[HistoryEvent], leases: Iterable[Lease], since: float, now: float
) -> dict[str, Occupancy]:
    """Rebuild each slot's occupancy from ``since`` to ``now`` (epoch seconds).

    Runs come from ``ran`` events (start to end) and from live ``leases`` (from
    ``now - age`` on, still running); a run of one task id seen both ways counts
    once, as a cap counts task ids.
    """
    # slot -> task id -> [(start, end)]
    intervals: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for event in events:
        if event.kind == "ran" and event.started_at is not None and event.at >= since:
            for slot in event.slots:
                intervals[slot][event.task_id].append((max(event.started_at, since), event.at))
    for lease in leases:
        if lease.expires_in > 0:
            start = now - lease.age if lease.age is not None else since
            intervals[lease.slot][lease.task_id].append((max(start, since), now))
    return {slot: Occupancy(slot, _steps(tasks, since, now), frozenset(tasks)) for slot, tasks in intervals.items()}


def waiting(
    events: Iterable[HistoryEvent], waiters: Iterable[Waiter], since: float, now: float
) -> dict[str, Occupancy]:
    """Rebuild how many tasks waited for each slot from ``since`` to ``now`` (epoch seconds).

    A task waits for a slot from a ``deferred`` event that found the slot full (put back, or
    parked: on arrival, or when sent, recorded by the worker that ran it) until the start of
    its next run (a ``ran`` event).  One in the waiting list now (``waiters``, park) waits
    until ``now``; one put back and not seen since is counted until its last put-back (it
    waited at least that long).
    """
    deferred_at: dict[tuple[str, str], list[float]] = defaultdict(list)
    starts: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if event.kind == "deferred":
            for slot in event.full_slots:
                deferred_at[(slot, event.task_id)].append(event.at)
        elif event.kind == "ran" and event.started_at is not None:
            starts[event.task_id].append(event.started_at)
    waiting_now = {(waiter.slot, waiter.task_id): waiter.first_deferred_at for waiter in waiters}
    intervals: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for (slot, task_id), times in deferred_at.items():
        runs = sorted(starts.get(task_id, ()))
        times.sort()
        index = 0
        while index < len(times):
            begin = times[index]
            end = next((start for start in runs if start >= begin), None)
            if end is None:  # no run since: waiting now, or not seen since its last put-back
                intervals[slot][task_id].append((begin, now if (slot, task_id) in waiting_now else times[-1]))
                break
            intervals[slot][task_id].append((begin, end))
            while index < len(times) and times[index] <= end:
                index += 1
    for (slot, task_id), first in waiting_now.items():
        intervals[slot][task_id].append((first, now))
    result = {}
    for slot, tasks in intervals.items():
        seen = {
            task_id: [(max(begin, since), min(end, now)) for begin, end in waits if end > since and end > begin]
            for task_id, waits in tasks.items()
        }
        seen = {task_id: waits for task_id, waits in seen.items() if waits}
        if seen:
            result[slot] = Occupancy(slot, _steps(seen, since, now), frozenset(seen))
    return result


def _steps(tasks: Mapping[str, Sequence[tuple[float, float]]], since: float, now: float) -> list[tuple[float, int]]:
    """The level over time of intervals per task id (a task id counts once at any moment); an
    interval that ends at ``now`` is still under way: no drop."""
    changes: list[tuple[float, int]] = []
    for runs in tasks.values():
        for start, end in _merge(runs):
            changes.append((start, 1))
            if end < now:
                changes.append((end, -1))
    changes.sort(key=lambda change: (change[0], change[1]))  # an end before a start at the same time
    level, steps = 0, [(since, 0)]
    for moment, change in changes:
        level += change
        if steps[-1][0] == moment:
            steps[-1] = (moment, level)
        else:
            steps.append((moment, level))
    if steps[-1][0] < now:
        steps.append((now, level))
    return steps


def _merge(runs: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping runs of one task id as one interval each (a task id counts once)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(runs):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
