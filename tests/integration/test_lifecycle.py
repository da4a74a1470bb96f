"""The life of a capped task, with real workers: admission, put-back, release, renewal, limits.

Most tests share one prefork worker (``-c 3``, lease 30 s, so that a release can
never be mistaken for an expiry) on a Redis broker with a Redis result backend
and the PostgreSQL store.  Each test uses its own *scope*: the key of the
``one`` cap (limit 1), so tests never contend with each other.  Where a test
needs a slot taken by "someone else", it takes it through the store contract,
as another worker would.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery.result import AsyncResult
from sqlalchemy.engine import make_url

from celery_caps.stores.base import SlotStore
from tests.integration.conftest import FleetFactory, Fleets
from tests.integration.fleet import Fleet, TcpProxy, pid_alive, wait_for
from tests.integration.fleetapp import queue_name
from tests.services import require_service

pytestmark = [pytest.mark.fleet, pytest.mark.postgres, pytest.mark.redis]

LEASE_SECONDS = 30.0


@pytest.fixture(scope="module")
def life(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One prefork worker (-c 3) consuming the default and the "extra" queue; lease 30 s."""
    fleets = Fleets(tmp_path_factory.mktemp("life"))
    redis_url = require_service("redis")
    fleet = fleets.build(
        broker=redis_url,
        backend=redis_url,
        caps_url=require_service("postgres"),
        lease=LEASE_SECONDS,
        backoff_min=0.05,
        backoff_max=0.5,
    )
    try:
        fleet.start(1, concurrency=3, queues=[queue_name(fleet.prefix), queue_name(fleet.prefix, extra=True)])
        yield fleet
    finally:
        fleets.close()


@pytest.fixture
def scope() -> str:
    """This test's key of the ``one`` cap."""
    return uuid.uuid4().hex[:16]


def result_of(fleet: Fleet, task_id: str, timeout: float = 20) -> AsyncResult:
    """The task's result once it is ready (fails after ``timeout`` seconds)."""
    result = fleet.app.AsyncResult(task_id)
    result.get(timeout=timeout, propagate=False)
    return result


def take_slot(store: SlotStore, slot: str, seconds: float = 60) -> str:
    """Take ``slot`` (limit 1) for another task id, as a task on another worker would; returns the run id."""
    run_id = uuid.uuid4().hex
    admission = store.acquire({slot: 1}, f"other-{run_id}", run_id, "elsewhere/1", seconds)
    assert admission.granted, admission
    return run_id


def running(fleet: Fleet, task_id: str, runs: int = 1) -> bool:
    return fleet.record().starts[task_id] >= runs


# -- put-back ----------------------------------------------------------------------------


def test_deferrals_do_not_use_up_retries(life: Fleet, scope: str) -> None:
    # Given the task's slot taken elsewhere
    slot = life.slot(f"one:{scope}")
    blocker = take_slot(life.store, slot)

    # When a task that may not be retried at all (max_retries=0) waits behind it
    task_id = life.app.send_task("fleet.no_retries", args=[scope]).id
    wait_for(lambda: life.record().received[task_id] >= 4, 15, "the task was not put back three times")
    assert life.record().starts[task_id] == 0, "the task ran while its cap was full"
    life.store.release(blocker)

    # Then it still completes, as its first try
    result = result_of(life, task_id)
    assert result.state == "SUCCESS", result.result
    assert result.result["retries"] == 0
    assert result.result["deferrals"] >= 3
    assert life.record().starts[task_id] == 1


def test_put_back_keeps_id_arguments_headers_routing_and_links(life: Fleet, scope: str) -> None:
    # Given the task's slot taken elsewhere
    slot = life.slot(f"one:{scope}")
    blocker = take_slot(life.store, slot)
    extra_queue = queue_name(life.prefix, extra=True)
    task_id = f"put-back-{scope}"
    marker = f"link-{scope}"

    # When a task with custom headers, a priority, a non-default queue and a link is put back
    life.app.send_task(
        "fleet.hold",
        args=[scope, 0.05],
        kwargs={"note": "ünïcode ✓"},
        task_id=task_id,
        headers={"x-trace": "trace-42"},
        queue=extra_queue,
        priority=3,
        link=life.app.signature("fleet.callback", args=[marker]),
    )
    wait_for(lambda: life.record().received[task_id] >= 3, 15, "the task was not put back twice")
    life.store.release(blocker)

    # Then the run that gets in sees the original message
    result = result_of(life, task_id)
    assert result.state == "SUCCESS", result.result
    seen = result.result
    assert seen["task_id"] == task_id
    assert seen["args"] == [scope, 0.05]
    assert seen["kwargs"] == {"note": "ünïcode ✓"}
    assert seen["x_trace"] == "trace-42"
    assert seen["delivery_info"]["routing_key"] == extra_queue
    assert seen["delivery_info"]["priority"] == 3
    assert seen["deferrals"] >= 2
    assert seen["retries"] == 0
    # ... and its link fires once, after the success (never for a put-back copy)
    wait_for(lambda: life.record().callbacks[marker] >= 1, 10, "the link callback never fired")
    time.sleep(0.5)  # room for a second, wrong firing to show up
    assert life.record().callbacks[marker] == 1
    assert life.record().starts[task_id] == 1


# -- release -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task", "state", "error"),
    [
        ("fleet.hold", "SUCCESS", None),
        ("fleet.fail", "FAILURE", "ValueError"),
        ("fleet.soft_limited", "FAILURE", "SoftTimeLimitExceeded"),
    ],
    ids=["success", "failure", "soft-time-limit"],
)
def test_slot_released_as_soon_as_the_task_ends(
    life: Fleet, scope: str, task: str, state: str, error: str | None
) -> None:
    slot = life.slot(f"one:{scope}")
    args: list[Any] = [scope, 0.5] if task == "fleet.hold" else [scope]

    # Given a capped task running and holding its slot
    task_id = life.app.send_task(task, args=args).id
    wait_for(lambda: running(life, task_id), 10, "the task never started")
    assert [lease.task_id for lease in life.leases(slot)] == [task_id]

    # When it ends (returns, raises, or hits its soft time limit)
    result = result_of(life, task_id)

    # Then its slot is free by the time its result is stored
    assert result.state == state
    if error is not None:
        assert type(result.result).__name__ == error
    assert life.leases(slot) == []


def test_retry_releases_the_slot_and_the_retried_run_takes_it_again(life: Fleet, scope: str) -> None:
    slot = life.slot(f"one:{scope}")

    # Given a task that calls self.retry() on its first run
    task_id = life.app.send_task("fleet.retry_once", args=[scope]).id

    # When the retried run executes
    result = result_of(life, task_id)

    # Then the first run's lease was gone before the retry was even sent
    assert result.state == "SUCCESS", result.result
    at_retry = life.recorder.client.hget(life.recorder.key("leases-at-retry"), task_id)
    assert at_retry is not None and json.loads(at_retry) == []
    # ... and the retried run holds the slot under a new run of its own
    first_run = life.recorder.client.hget(life.recorder.key("retry-first-run"), task_id).decode()
    second_run = result.result["run_id"]
    assert first_run and second_run and first_run != second_run
    assert result.result["retries"] == 1
    assert result.result["leases_seen"] == [[task_id, second_run]]
    assert life.leases(slot) == []


def test_hard_time_limit_releases_from_the_main_process(life: Fleet, scope: str) -> None:
    slot = life.slot(f"one:{scope}")

    # Given a task that runs past its hard time limit (1.5 s), ignoring SIGTERM
    task_id = life.app.send_task("fleet.hard_limited", args=[scope]).id
    wait_for(lambda: running(life, task_id), 10, "the task never started")
    child = next(run.pid for run in life.record().runs_of(task_id))

    # When the pool child is SIGKILLed for it
    result = result_of(life, task_id)
    failed_at = time.monotonic()
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "TimeLimitExceeded"

    # Then the worker's main process deletes its lease (not left to expire: lease is 30 s)
    wait_for(lambda: life.leases(slot) == [], 5, lambda: f"lease still there: {life.leases(slot)}")
    released_after = time.monotonic() - failed_at
    assert life.record().done[task_id] == 0
    wait_for(lambda: not pid_alive(child), 5, f"the pool child {child} survived its hard time limit")
    print(f"\n[hard time limit] lease deleted {released_after:.2f} s after FAILURE (lease {LEASE_SECONDS:.0f} s)")


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_deletes_every_lease_of_the_task_id(life: Fleet, scope: str, signal_name: str) -> None:
    # Given a run holding two caps (two lease rows), and one more lease of the same task id
    # held by another run elsewhere (a duplicate delivery on another worker)
    task_id = f"revoke-{scope}"
    life.app.send_task("fleet.hold_two", args=[scope, 20], task_id=task_id)
    wait_for(lambda: running(life, task_id), 10, "the task never started")
    elsewhere = uuid.uuid4().hex
    assert life.store.acquire({life.slot(f"one:{scope}"): 1}, task_id, elsewhere, "elsewhere/1", 60).granted
    leases = [lease for lease in life.leases() if lease.task_id == task_id]
    assert len(leases) == 3 and len({lease.run_id for lease in leases}) == 2, leases

    # When the task is revoked with terminate=True (SIGKILL: the child cannot release anything)
    revoked_at = time.monotonic()
    life.app.control.revoke(task_id, terminate=True, signal=signal_name)

    # Then every lease row of that task id goes at once, whatever run or holder took it
    wait_for(
        lambda: not [lease for lease in life.leases() if lease.task_id == task_id],
        3,
        lambda: f"leases left: {life.leases()}",
    )
    print(f"\n[revoke {signal_name}] 3 lease rows deleted within {time.monotonic() - revoked_at:.2f} s")
    assert result_of(life, task_id).state == "REVOKED"
    assert life.record().done[task_id] == 0


# -- the same task id twice --------------------------------------------------------------


def test_the_same_task_id_running_twice_counts_once(life: Fleet, scope: str) -> None:
    slot = life.slot(f"one:{scope}")
    twice = f"twice-{scope}"

    # Given one task id delivered twice (its first run lasts 1.5 s, its second 3 s) on a cap of 1
    for _ in range(2):
        life.app.send_task("fleet.hold", args=[scope, 1.5, 3.0], task_id=twice)
    wait_for(lambda: running(life, twice, runs=2), 10, "the two runs of one task id did not both start")
    leases = life.leases(slot)
    assert {lease.task_id for lease in leases} == {twice} and len({lease.run_id for lease in leases}) == 2

    # When another task id wants the same slot
    other = life.app.send_task("fleet.hold", args=[scope, 0.1]).id

    # Then it waits while either run holds the slot: each run releases only its own lease
    wait_for(lambda: life.record().done[twice] == 1, 10, "the first run did not end")
    # (the body's record is written before its run releases: wait for the release itself)
    wait_for(lambda: len(life.leases(slot)) == 1, 5, "the first run did not release its own lease")
    assert [lease.task_id for lease in life.leases(slot)] == [twice]
    assert life.record().done[twice] == 1, "the second run ended before the first run's release was seen"
    assert life.record().starts[other] == 0
    assert result_of(life, other).state == "SUCCESS"
    record = life.record()
    assert record.done[twice] == 2
    last_end = max(run.end or 0 for run in record.runs_of(twice))
    assert record.runs_of(other)[0].start >= last_end
    assert record.peaks[f"one:{scope}"] == 2  # two bodies, one task id
    assert record.received[other] >= 2, "the other task was never put back"
    assert life.leases(slot) == []


# -- a worker of its own -----------------------------------------------------------------


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_warm_shutdown_lets_the_task_finish_and_releases(make_fleet: FleetFactory, pool: str) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), lease=30)
    scope = uuid.uuid4().hex[:16]
    slot = fleet.slot(f"one:{scope}")
    (worker,) = fleet.start(1, concurrency=2, pool=pool)

    # Given a capped task running
    task_id = fleet.app.send_task("fleet.hold", args=[scope, 2.0]).id
    wait_for(lambda: running(fleet, task_id), 15, "the task never started")
    assert len(fleet.leases(slot)) == 1

    # When the worker gets TERM (warm shutdown)
    worker.process.terminate()

    # Then the task finishes, its slot is released, and the worker exits cleanly
    assert worker.process.wait(timeout=30) == 0
    assert fleet.record().done[task_id] == 1
    assert result_of(fleet, task_id, timeout=5).state == "SUCCESS"
    assert fleet.leases(slot) == []


def test_pool_processes_connect_to_the_store_before_their_first_task(make_fleet: FleetFactory) -> None:
    # Given a store URL that names its connections, and no connection under that name yet
    name = f"caps-warm-{uuid.uuid4().hex[:12]}"
    caps_url = make_url(require_service("postgres")).update_query_dict({"application_name": name})
    engine = sa.create_engine(require_service("postgres"))

    def connections() -> int:
        with engine.connect() as connection:
            query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :name")
            return int(connection.execute(query, {"name": name}).scalar_one())

    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=caps_url.render_as_string(hide_password=False))
    try:
        assert connections() == 0
        # When a prefork worker with two pool processes starts (and no task is sent)
        fleet.start(1, concurrency=2)

        # Then each pool process has connected (schema checked, a connection open for its tasks)
        wait_for(lambda: connections() >= 2, 20, lambda: f"{connections()} connection(s) after start")
        assert fleet.record().starts == {}
        # ... and the first task runs as usual
        scope = uuid.uuid4().hex[:16]
        task_id = fleet.app.send_task("fleet.hold", args=[scope, 0.05]).id
        assert result_of(fleet, task_id).state == "SUCCESS"
        assert fleet.leases(fleet.slot(f"one:{scope}")) == []
    finally:
        engine.dispose()


def test_worker_without_caps_url_refuses_to_start(make_fleet: FleetFactory) -> None:
    # Given an app with capped tasks and no caps_url
    fleet = make_fleet(broker=require_service("redis"), caps_url=None)

    # When its worker starts
    (worker,) = fleet.start(1, concurrency=1, wait=False)

    # Then it exits with an error naming caps_url
    code = worker.process.wait(timeout=30)
    stderr = worker.stderr_path.read_text()
    assert code != 0
    assert "caps_url" in stderr, stderr[-2000:]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_renewal_keeps_a_long_task_lease_alive(make_fleet: FleetFactory, pool: str) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), lease=2)
    scope = uuid.uuid4().hex[:16]
    slot = fleet.slot(f"one:{scope}")
    fleet.start(1, concurrency=2, pool=pool)

    # Given a task running 6 s, three times its 2 s lease, and another task wanting its slot
    long_task = fleet.app.send_task("fleet.hold", args=[scope, 6.0]).id
    wait_for(lambda: running(fleet, long_task), 15, "the long task never started")
    started = time.monotonic()
    other = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id

    # When time passes beyond several lease lengths
    observed = []
    while not fleet.record().done[long_task]:
        leases = fleet.leases(slot)
        record = fleet.record()
        if record.done[long_task]:
            break
        observed.append((time.monotonic() - started, [(lease.task_id, lease.expires_in) for lease in leases]))
        # Then the long task's lease is always there and live, and the other task never got in
        assert [lease.task_id for lease in leases] == [long_task], observed[-1]
        assert leases[0].expires_in > 0, observed[-1]
        assert record.starts[other] == 0, "a second task got in while the first held the slot"
        time.sleep(0.25)
    assert observed[-1][0] > 4.0, "the long task ended too early to show renewal"

    # ... and the other task runs once the slot is released
    assert result_of(fleet, other).state == "SUCCESS"
    assert fleet.record().received[other] >= 2
    print(f"\n[renewal {pool}] lease 2 s held live through {observed[-1][0]:.1f} s of a 6 s run")


def test_max_wait_ends_the_task_with_cap_wait_exceeded(make_fleet: FleetFactory) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), lease=30, max_wait=1.5
    )
    scope = uuid.uuid4().hex[:16]
    fleet.start(1, concurrency=1, pool="solo")

    # Given the slot taken elsewhere for longer than caps_max_wait_seconds (1.5 s)
    take_slot(fleet.store, fleet.slot(f"one:{scope}"))

    # When a task waits for it
    sent_at = time.monotonic()
    task_id = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id

    # Then it gives up with a clear, named error, never having run
    result = result_of(fleet, task_id, timeout=15)
    waited = time.monotonic() - sent_at
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "CapWaitExceeded"
    assert "caps_max_wait_seconds" in str(result.result) and fleet.slot(f"one:{scope}") in str(result.result)
    assert 1.5 <= waited < 6, waited
    assert fleet.record().starts[task_id] == 0
    print(f"\n[max wait] FAILURE CapWaitExceeded after {waited:.1f} s (max wait 1.5 s)")


def test_unreachable_store_puts_tasks_back_or_follows_the_policy(make_fleet: FleetFactory) -> None:
    redis_url = require_service("redis")
    postgres = make_url(require_service("postgres"))
    proxy = TcpProxy((postgres.host or "127.0.0.1", postgres.port or 5432))
    # A password in the URL (PostgreSQL here trusts local connections and ignores it) must
    # never show in an error or a log line.
    password = "s3cret-pw"
    down_url = postgres.set(host="127.0.0.1", port=proxy.port, password=password).render_as_string(hide_password=False)
    scope = uuid.uuid4().hex[:16]

    # Given a slot store that is down (its port refuses connections), and three workers with
    # the three caps_on_store_error policies
    fleets = {
        policy: make_fleet(broker=redis_url, backend=redis_url, caps_url=down_url, on_store_error=policy)
        for policy in ("defer", "run", "fail")
    }
    workers = {policy: fleet.start(1, concurrency=1, wait=False)[0] for policy, fleet in fleets.items()}
    for policy, fleet in fleets.items():
        fleet.wait_ready([workers[policy]])

    # When a capped task arrives at each
    sent = {policy: fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id for policy, fleet in fleets.items()}

    # Then "run" runs it uncapped and "fail" fails it with the store error
    ran = result_of(fleets["run"], sent["run"])
    assert ran.state == "SUCCESS", ran.result
    failed = result_of(fleets["fail"], sent["fail"])
    assert failed.state == "FAILURE" and type(failed.result).__name__ == "StoreError", failed.result
    assert password not in str(failed.result)

    # ... and "defer" (the default) puts it back again and again without running it
    defer = fleets["defer"]
    wait_for(lambda: defer.record().received[sent["defer"]] >= 4, 20, "the task was not put back")
    assert defer.record().starts[sent["defer"]] == 0
    assert workers["defer"].alive()

    # When the store comes back, the waiting task runs, once, and releases its slot
    proxy.open()
    try:
        result = result_of(defer, sent["defer"], timeout=20)
        assert result.state == "SUCCESS", result.result
        assert defer.record().starts[sent["defer"]] == 1
        assert defer.leases(defer.slot(f"one:{scope}")) == []
        for fleet in fleets.values():
            assert password not in fleet.tails(lines=10_000), "a store password leaked into a worker log"
        print(
            f"\n[store down] defer: put back {defer.record().received[sent['defer']] - 1} times, ran once "
            "after the store came back; run: ran uncapped; fail: FAILURE StoreError"
        )
    finally:
        defer.close()  # stop the worker before the store goes away again
        proxy.close()
