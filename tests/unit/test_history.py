"""The history helpers: the per-process buffer, and the occupancy and the waiting tasks rebuilt for
``caps timeline``."""

from __future__ import annotations

from celery_caps.history import HistoryRecorder, occupancy, waiting
from celery_caps.stores import store_from_url
from celery_caps.stores.base import HistoryEvent, Lease, Waiter
from celery_caps.stores.memory import MemoryStore


def ran(task_id: str, start: float, end: float, *slots: str) -> HistoryEvent:
    return HistoryEvent("ran", end, task_id, "proj.t", tuple(slots), (), "w/1", started_at=start)


def test_occupancy_counts_distinct_tasks_from_runs_and_live_leases() -> None:
    events = [
        ran("a", 10, 20, "s"),
        ran("b", 15, 30, "s", "g"),
        ran("a", 18, 25, "s"),  # a second run of task a overlapping its first: still one holder
        ran("old", 0, 5, "s"),  # ended before the window
        HistoryEvent("deferred", 16, "c", "proj.t", ("s",), ("s",), "w/1"),
    ]
    live = [Lease("s", "d", "r1", "w/2", expires_in=10.0, age=8.0), Lease("s", "x", "r2", "w/2", expires_in=-1.0)]

    series = occupancy(events, live, since=8, now=40)

    assert series["s"].steps == [(8, 0), (10, 1), (15, 2), (25, 1), (30, 0), (32, 1), (40, 1)]
    assert series["s"].peak == 2
    assert series["g"].steps == [(8, 0), (15, 1), (30, 0), (40, 0)]


def test_a_run_that_began_before_the_window_starts_at_its_edge() -> None:
    series = occupancy([ran("a", 0, 20, "s")], [], since=10, now=30)
    assert series["s"].steps == [(10, 1), (20, 0), (30, 0)]


def test_the_buffer_keeps_its_events_while_the_store_is_down_and_stays_bounded(tmp_path: object) -> None:
    recorder = HistoryRecorder(keep_seconds=600, max_events=3)
    for number in range(5):
        recorder.add(ran(f"t{number}", number, number + 1, "s"))
    assert recorder.pending() == 3  # the newest three

    down = store_from_url("sqlite:////nonexistent-caps-dir/caps.db")
    try:
        assert recorder.flush(down) == 0
    finally:
        down.close()
    assert recorder.pending() == 3

    store = MemoryStore()
    assert recorder.flush(store) == 3
    assert [event.task_id for event in store.history(0)] == ["t2", "t3", "t4"]
    assert recorder.pending() == 0 and recorder.flush(store) == 0


def deferred(task_id: str, at: float, *slots: str) -> HistoryEvent:
    return HistoryEvent("deferred", at, task_id, "proj.t", tuple(slots), tuple(slots), "w/1")


def test_waiting_counts_each_task_from_its_first_deferral_to_the_run_that_followed() -> None:
    events = [
        deferred("a", 10, "s"),  # put back twice, then ran at 16
        deferred("a", 13, "s"),
        ran("a", 16, 18, "s"),
        deferred("b", 12, "s", "g"),  # parked, woken, ran at 20
        ran("b", 20, 21, "s", "g"),
        deferred("c", 14, "s"),  # put back once, not seen since: at least until then
        deferred("c", 17, "s"),
        deferred("d", 5, "s"),  # ran before the window
        ran("d", 7, 8, "s"),
    ]
    # e waits in the waiting list now (parked when sent: no event of its own yet)
    waiters = [Waiter("s", "e", "proj.t", first_deferred_at=19, age=11.0, position=1, dispatched=False)]

    series = waiting(events, waiters, since=9, now=30)

    assert series["s"].steps == [(9, 0), (10, 1), (12, 2), (14, 3), (16, 2), (17, 1), (19, 2), (20, 1), (30, 1)]
    assert series["s"].tasks == frozenset({"a", "b", "c", "e"})
    assert series["g"].steps == [(9, 0), (12, 1), (20, 0), (30, 0)]


def test_a_task_still_waiting_since_before_the_window_waits_from_its_edge() -> None:
    series = waiting([deferred("a", 2, "s")], [Waiter("s", "a", None, 2, 28.0, 1, dispatched=False)], since=10, now=30)
    assert series["s"].steps == [(10, 1), (30, 1)]
