"""Fleet tests of the changes of issue 33: what a fleet lives through without a fault.

Real prefork workers (``tests.integration.fleetapp``) on a fresh SQLite store per test, no
mocks.  Each test checks what a user would: a task's body ran exactly once, the peak
concurrency the bodies themselves measured, the task's final result state, and that every
other task finished.

* a deploy (warm shutdown) returns a woken copy that waited in a prefetch buffer past its
  dispatch while the task ran from the next dispatch: the returned copy ends;
* a waiting task whose copy cannot be published again fails alone, visibly;
* tasks parked before a switch of ``caps_strategy`` to ``"backoff"`` still run;
* a body that goes on after ``self.retry(throw=False)`` (or after catching
  ``MaxRetriesExceededError``) keeps its slot until it ends;
* a task routed by exchange and routing key is woken through its queue's wake queue.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, wait_for
from tests.integration.fleetapp import queue_name
from tests.services import require_service

pytestmark = [pytest.mark.fleet, pytest.mark.sqlite, pytest.mark.redis]

#: A woken task is published to ``<its queue>`` + this suffix (``docs/park.md``).
WAKE_SUFFIX = ".caps-wake"


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/caps.db"


def parked(fleet: Fleet, task_id: str) -> bool:
    return any(waiter.task_id == task_id and not waiter.dispatched for waiter in fleet.store.waiters())


def wait_parked(fleet: Fleet, task_id: str, timeout: float = 20) -> None:
    wait_for(lambda: parked(fleet, task_id), timeout, f"task {task_id} never parked")


def state_of(fleet: Fleet, task_id: str) -> dict[str, Any]:
    """The task's result meta as the backend holds it now (never through a cached AsyncResult)."""
    return dict(fleet.app.backend.get_task_meta(task_id, cache=False))


def lines_with(fleet: Fleet, *needles: str) -> list[str]:
    """Worker log lines that contain every one of ``needles``."""
    return [line for line in fleet.tails(lines=100_000).splitlines() if all(needle in line for needle in needles)]


def nothing_left(fleet: Fleet) -> None:
    """No lease and no waiting entry of this fleet is left in the store."""
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


# -- 1. a deploy never runs a task twice without a fault --------------------------------------


@pytest.mark.amqp
def test_a_woken_copy_returned_by_a_warm_shutdown_after_the_task_ran_from_a_later_dispatch_ends(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    redis_url = require_service("redis")
    # Dispatches last 2 s (caps_lease_seconds); each worker takes two messages at a time.
    fleet = make_fleet(
        broker=require_service("amqp"), backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park",
        lease=2, prefetch=2,
    )  # fmt: skip
    queue, other_queue = queue_name(fleet.prefix), queue_name(fleet.prefix, extra=True)
    # Worker "other" consumes another queue (and its wake queue) only; worker "deployed" (one
    # pool process, prefetch 2) consumes the task's queue.
    [other] = fleet.start(1, concurrency=1, queues=[other_queue])
    [deployed] = fleet.start(1, concurrency=1, queues=[queue])
    scope = uuid.uuid4().hex[:16]

    # Given a task holding a slot of limit 1 on "other" for 4 s, a task W parked behind it by
    # "deployed", and then a long task (18 s) on another slot running on "deployed"'s process
    holder = fleet.app.send_task("fleet.hold", args=[scope, 4.0], queue=other_queue).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    waiter = fleet.app.send_task("fleet.hold", args=[scope, 0.3]).id
    wait_parked(fleet, waiter)
    long_task = fleet.app.send_task("fleet.hold", args=[uuid.uuid4().hex[:16], 18.0]).id
    wait_for(lambda: fleet.record().starts[long_task] == 1, 20, "the long task never started")
    assert fleet.record().done[holder] == 0, "the holder ended before the scene was set"

    # When the holder ends and its release wakes W: its copy D1 lands in "deployed"'s prefetch
    # buffer, behind the long task (W's original delivery, then D1)
    wait_for(
        lambda: fleet.record().received[waiter] == 2 and (fleet.last_received(waiter) or ("",))[0] == deployed.name,
        20,
        lambda: f"the woken copy never reached {deployed.name}: {fleet.last_received(waiter)}",
    )
    # ... "other" starts consuming the task's queue (and its wake queue) too; D1's dispatch
    # passes its deadline unclaimed, recovery dispatches W again (D2), and "other" claims and
    # runs it
    assert fleet.app.control.add_consumer(queue, destination=[other.name], reply=True, timeout=5)
    wait_for(lambda: fleet.record().done[waiter] == 1, 30, "W never ran from its second dispatch")
    [run] = fleet.record().runs_of(waiter)
    assert run.hostname == other.name and run.dispatch and not run.redelivered, run
    assert fleet.record().done[long_task] == 0, "the long task ended before the deploy: D1 was not held back"

    # ... then "deployed" is shut down warm (SIGTERM): it finishes the long task, and the broker
    # gives D1, which it never started, back, marked redelivered; "other" receives it
    fleet.stop([deployed])
    assert fleet.record().done[long_task] == 1, "the warm shutdown did not let the long task finish"
    wait_for(lambda: fleet.record().redelivered[waiter] >= 1, 20, "D1 never came back redelivered")
    ended = f"fleet.hold[{waiter}]: the store answers for this task already"
    wait_for(
        lambda: lines_with(fleet, ended) or fleet.record().starts[waiter] > 1,
        20,
        "the redelivered copy was neither ended nor run",
    )
    time.sleep(1.0)  # room for a second, wrong run to show up

    # Then W's body ran once (from D2), and the redelivered D1 ended without running
    record = fleet.record()
    assert record.starts[waiter] == 1, [
        (r.hostname, r.dispatch, r.redelivered, round(r.start - run.start, 3)) for r in record.runs_of(waiter)
    ]
    assert lines_with(fleet, ended), "no worker said the redelivered copy ended"
    # ... W's result is its one run's, and every other task finished once
    assert state_of(fleet, waiter)["status"] == "SUCCESS"
    assert (record.starts[holder], record.done[holder], record.starts[long_task], record.done[long_task]) == (1,) * 4
    assert record.interval_peak(f"one:{scope}") == 1
    nothing_left(fleet)


# -- 2. one bad message fails alone -----------------------------------------------------------


def test_a_waiting_task_whose_copy_cannot_be_published_fails_alone_and_the_others_run(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    redis_url = require_service("redis")
    # Long dispatches (30 s): a waiter behind the bad one runs soon only if the hand-over passes
    # the bad one at once, not when its dispatch expires.
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park", lease=30)
    fleet.start(1, concurrency=2)
    scope = uuid.uuid4().hex[:16]

    # Given a task holding a slot of limit 1 for 2 s
    holder = fleet.app.send_task("fleet.hold", args=[scope, 2.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    # ... a task sent by name with arguments that do not fit its signature (fleet.no_retries
    # takes a scope only), parked first, and three tasks parked behind it
    bad = fleet.app.send_task("fleet.no_retries", args=[scope, "an argument too many"]).id
    wait_parked(fleet, bad)
    others = []
    for _ in range(3):
        others.append(fleet.app.send_task("fleet.hold", args=[scope, 0.2]).id)
        wait_parked(fleet, others[-1])
    assert fleet.record().done[holder] == 0, "the holder ended before every waiter parked"

    # When the holder ends and its release hands the slot to the oldest waiter, the bad one,
    # whose copy cannot be published (Celery's argument check raises TypeError)
    wait_for(
        lambda: state_of(fleet, bad)["status"] not in ("PENDING", "DEFERRED"),
        20,
        lambda: f"the bad task's state stays {state_of(fleet, bad)['status']}",
    )

    # Then it fails, alone and visibly: FAILURE with UnpublishableTask, an ERROR line in the worker log
    meta = state_of(fleet, bad)
    assert meta["status"] == "FAILURE", meta
    result = fleet.app.AsyncResult(bad).result
    assert (type(result).__module__, type(result).__name__) == ("celery_caps.errors", "UnpublishableTask"), result
    assert "TypeError" in str(result), result
    errors = lines_with(fleet, "ERROR", f"fleet.no_retries[{bad}]")
    assert errors and "TypeError" in errors[0], errors
    # ... its body never ran, and every other waiter runs once, at once (none waits for a dispatch)
    fleet.wait_all_done(others, 15)
    record = fleet.record()
    assert record.starts[bad] == 0
    assert [record.starts[task_id] for task_id in others] == [1, 1, 1]
    assert [state_of(fleet, task_id)["status"] for task_id in others] == ["SUCCESS"] * 3
    released = record.runs_of(holder)[0].end or 0
    first_start = min(record.runs_of(task_id)[0].start for task_id in others)
    assert first_start - released < 5, f"the next waiter started {first_start - released:.1f} s after the release"
    assert record.interval_peak(f"one:{scope}") == 1
    nothing_left(fleet)


# -- 6. a switch to backoff leaves no parked task behind -----------------------------------------


def test_tasks_parked_before_a_switch_to_backoff_all_run_once(make_fleet: FleetFactory, tmp_path: Path) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park")
    [parking] = fleet.start(1, concurrency=2)
    scope = uuid.uuid4().hex[:16]

    # Given a park fleet: a task holding a slot of limit 1 for 3 s and four tasks parked behind it
    holder = fleet.app.send_task("fleet.hold", args=[scope, 3.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    waiters = []
    for _ in range(4):
        waiters.append(fleet.app.send_task("fleet.hold", args=[scope, 0.3]).id)
        wait_parked(fleet, waiters[-1])
    assert fleet.record().done[holder] == 0, "the holder ended before every waiter parked"

    # When the fleet is restarted with caps_strategy = "backoff": the park worker is shut down
    # warm (the holder finishes) and a backoff worker starts
    fleet.stop([parking])
    assert fleet.record().done[holder] == 1
    fleet.start(1, concurrency=2, extra_env={"CAPS_FLEET_STRATEGY": "backoff"})

    # Then every parked task runs, exactly once, one at a time
    def progress() -> str:
        record = fleet.record()
        waiting = [(w.task_id[:8], w.dispatched) for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)]
        return (
            f"body starts per parked task, in the order they parked: {[record.starts[t] for t in waiters]}; "
            f"still in the waiting list (task, dispatched): {waiting}"
        )

    wait_for(lambda: all(fleet.record().done[t] for t in waiters), 40, progress, interval=0.25)
    time.sleep(2 * 2.4)  # two recovery intervals: room for a task dispatched again to run again
    record = fleet.record()
    assert {t: record.starts[t] for t in [holder, *waiters] if record.starts[t] != 1} == {}, [
        (r.task_id[:8], r.hostname.split("@")[0], r.dispatch, r.deferrals, round(r.start, 2))
        for r in sorted(record.runs, key=lambda r: r.start)
    ]
    assert [state_of(fleet, task_id)["status"] for task_id in waiters] == ["SUCCESS"] * 4
    assert record.interval_peak(f"one:{scope}") == 1
    nothing_left(fleet)


# -- 7. a body that goes on after asking for a retry keeps its slot --------------------------


@pytest.mark.parametrize("how", ["throw=False", "max-retries-caught"])
def test_a_body_that_goes_on_after_retry_keeps_its_slot_until_it_ends(
    make_fleet: FleetFactory, tmp_path: Path, how: str
) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park")
    fleet.start(1, concurrency=2)
    scope = uuid.uuid4().hex[:16]

    # Given a task of 4 s holding a slot of limit 1 that, 2 s in, asks for a retry and goes on
    # (retry(throw=False) with a countdown of 4 s; or retry() with no retry left, catching
    # MaxRetriesExceededError), and another task parked behind it before then
    task = fleet.app.send_task("fleet.retry_goes_on", args=[scope, how, 4.0, 4.0]).id
    wait_for(lambda: fleet.record().starts[task] == 1, 20, "the task never started")
    waiter = fleet.app.send_task("fleet.hold", args=[scope, 0.5]).id
    wait_parked(fleet, waiter)
    assert not fleet.recorder.client.hget(fleet.recorder.key("retry-asked"), task), "the retry came before the waiter"

    # When the task asks for its retry and goes on: every run finishes
    attempts = 2 if how == "throw=False" else 1
    wait_for(
        lambda: fleet.record().done[task] == attempts and fleet.record().done[waiter] == 1,
        30,
        lambda: f"runs done: task {fleet.record().done[task]} of {attempts}, waiter {fleet.record().done[waiter]}",
    )
    time.sleep(0.5)
    record = fleet.record()
    asked = fleet.recorder.client.hget(fleet.recorder.key("retry-asked"), task)
    assert asked == b"1"
    if how == "max-retries-caught":
        assert fleet.recorder.client.hget(fleet.recorder.key("max-retries-caught"), task) == b"1"

    # Then the bodies, by their own start and end times, never ran two at a time under the cap
    # of 1: the waiter started only once the task's first body ended
    first = record.runs_of(task)[0]
    [waited] = record.runs_of(waiter)
    timeline = [(r.task_id[:8], r.retries, round(r.start - first.start, 3), round((r.end or 0) - first.start, 3))
                for r in sorted(record.runs, key=lambda r: r.start)]  # fmt: skip
    assert record.interval_peak(f"one:{scope}") == 1, timeline
    assert record.peaks[f"one:{scope}"] == 1, timeline
    assert waited.start >= (first.end or 0), timeline
    # ... each attempt ran once, and both tasks succeeded
    assert sorted(r.retries for r in record.runs_of(task)) == list(range(attempts)), timeline
    assert record.starts[waiter] == 1
    assert (state_of(fleet, task)["status"], state_of(fleet, waiter)["status"]) == ("SUCCESS", "SUCCESS")
    nothing_left(fleet)


# -- 8. an exchange-routed task is woken through its wake queue ---------------------------------


@pytest.mark.amqp
def test_a_task_routed_by_exchange_and_routing_key_is_woken_through_its_wake_queue(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    redis_url = require_service("redis")
    prefix_probe = uuid.uuid4().hex[:8]
    exchange, routing_key, queue = f"x-{prefix_probe}", f"rk-{prefix_probe}", f"q-{prefix_probe}-routed"
    # The task's queue is bound to a direct exchange by a routing key of its own; task_routes
    # sends fleet.hold to that exchange with that routing key (no queue named)
    conf = {"task_queues": {queue: {"exchange": exchange, "exchange_type": "direct", "routing_key": routing_key}}}
    fleet = make_fleet(
        broker=require_service("amqp"), backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park",
        routes=json.dumps({"fleet.hold": {"exchange": exchange, "routing_key": routing_key}}), conf=json.dumps(conf),
    )  # fmt: skip
    fleet.extra_exchanges.add(exchange)
    fleet.start(1, concurrency=2, queues=[queue])
    scope = uuid.uuid4().hex[:16]

    # Given a task holding a slot of limit 1 for 1 s, a task parked behind it, and a backlog of
    # twelve tasks of 0.3 s on other slots in the same queue
    holder = fleet.app.send_task("fleet.hold", args=[scope, 1.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    woken = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_parked(fleet, woken)
    backlog = [fleet.app.send_task("fleet.hold", args=[uuid.uuid4().hex[:16], 0.3]).id for _ in range(12)]

    # When the holder ends and its release wakes the parked task
    fleet.wait_all_done([woken, *backlog], 30)

    # Then the tasks came through the exchange, and the woken copy through the wake queue of the
    # task's queue, not behind the backlog in the task's queue (how many of the backlog a worker
    # had prefetched before the copy came is timing, and not asserted)
    holder_delivery = fleet.app.AsyncResult(holder).get(timeout=10)["delivery_info"]
    assert (holder_delivery["exchange"], holder_delivery["routing_key"]) == (exchange, routing_key), holder_delivery
    delivery = fleet.app.AsyncResult(woken).get(timeout=10)["delivery_info"]
    assert delivery["routing_key"] == f"{queue}{WAKE_SUFFIX}", delivery
    record = fleet.record()
    assert record.starts[woken] == 1 and record.runs_of(woken)[0].dispatch
    assert all(record.starts[task_id] == 1 for task_id in backlog)
    nothing_left(fleet)


# -- 3. a fleet restarted on other queues ------------------------------------------------------


def test_a_task_whose_queue_is_no_longer_consumed_stops_holding_its_cap(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    redis_url = require_service("redis")
    # Dispatches last 2 s (caps_lease_seconds).
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park", lease=2)
    queue, other_queue = queue_name(fleet.prefix), queue_name(fleet.prefix, extra=True)
    [old] = fleet.start(1, concurrency=2, queues=[queue])
    scope = uuid.uuid4().hex[:16]

    # Given a fleet on queue "q": a task holding a slot of limit 1 for 3 s and a task X parked
    # behind it
    holder = fleet.app.send_task("fleet.hold", args=[scope, 3.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    stranded = fleet.app.send_task("fleet.hold", args=[scope, 0.3]).id
    wait_parked(fleet, stranded)

    # When the fleet is restarted on another queue: the old worker is shut down warm (the
    # holder finishes, and its release wakes X into q's wake queue, which no worker consumes
    # from now on) and a worker consuming "q-extra" only starts; tasks of the same cap arrive
    # there
    fleet.stop([old])
    assert fleet.record().done[holder] == 1
    [new] = fleet.start(1, concurrency=2, queues=[other_queue])
    wait_for(
        lambda: any(w.task_id == stranded and w.dispatched for w in fleet.store.waiters()),
        20,
        "X was never woken",
    )
    # (each longer than a recovery interval, so that none runs only because it came while X's
    # dispatch had passed its deadline and recovery had not yet dispatched it again)
    others = [fleet.app.send_task("fleet.hold", args=[scope, 2.5], queue=other_queue).id for _ in range(3)]

    # Then X's dispatches pass their deadline unclaimed, X stops holding the slot, and the tasks
    # of the consumed queue all run, one at a time
    def progress() -> str:
        record = fleet.record()
        waiting = [(w.task_id[:8], w.dispatched) for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)]
        return f"runs of the others: {[record.done[t] for t in others]}; waiting (task, dispatched): {waiting}"

    wait_for(lambda: all(fleet.record().done[t] == 1 for t in others), 60, progress, interval=0.25)
    assert fleet.record().starts[stranded] == 0, "X ran on a worker that does not consume its queue"
    # ... X still waits in the store, and runs once when a worker consumes its queue again (the
    # copies of its earlier dispatches there end)
    assert [w.task_id for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == [stranded]
    assert fleet.app.control.add_consumer(queue, destination=[new.name], reply=True, timeout=5)
    wait_for(lambda: fleet.record().done[stranded] == 1, 60, progress, interval=0.25)
    time.sleep(2 * 2.4)  # two recovery intervals: room for a second, wrong run to show up
    record = fleet.record()
    assert {t: record.starts[t] for t in [holder, stranded, *others] if record.starts[t] != 1} == {}
    assert [state_of(fleet, task_id)["status"] for task_id in [stranded, *others]] == ["SUCCESS"] * 4
    assert record.interval_peak(f"one:{scope}") == 1
    nothing_left(fleet)


# -- 9. a message too large for the store ------------------------------------------------------


def test_a_task_too_large_for_the_store_runs_in_its_turn_under_steady_load(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    redis_url = require_service("redis")
    # The store keeps messages of up to 2 kB; dispatches last 3 s (caps_lease_seconds).
    fleet = make_fleet(
        broker=redis_url, backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park", lease=3,
        conf=json.dumps({"caps_park_max_payload_bytes": 2048}),
    )  # fmt: skip
    fleet.start(1, concurrency=3)
    scope = uuid.uuid4().hex[:16]

    # Given a task holding a slot of limit 1 for 2 s, a task B whose message is over the bound
    # arriving behind it, and then a steady load of small tasks of the same cap
    holder = fleet.app.send_task("fleet.hold", args=[scope, 2.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    big = fleet.app.send_task("fleet.hold", args=[scope, 0.2], kwargs={"padding": "x" * 4096}).id
    wait_for(lambda: fleet.record().received[big] >= 1, 20, "B never arrived")
    small = []
    for _ in range(8):
        small.append(fleet.app.send_task("fleet.hold", args=[scope, 0.3]).id)
        time.sleep(0.1)

    # When every task has finished
    fleet.wait_all_done([holder, big, *small], 60)

    # Then B ran in its turn: first after the holder, before every small task sent after it
    record = fleet.record()
    order = [run.task_id for run in sorted(record.runs, key=lambda run: run.start)]
    assert order[:2] == [holder, big], [task_id[:8] for task_id in order]
    assert {t: record.starts[t] for t in [holder, big, *small] if record.starts[t] != 1} == {}
    assert [state_of(fleet, task_id)["status"] for task_id in [big, *small]] == ["SUCCESS"] * 9
    assert record.interval_peak(f"one:{scope}") == 1
    # ... its message waited in the broker (the store kept no payload of it), and a worker said
    # so in one INFO line, once for the wait (later put-backs log at DEBUG)
    said = lines_with(fleet, big, "INFO", " waits for ")
    assert len(said) == 1 and "without its message" in said[0], said
    nothing_left(fleet)
