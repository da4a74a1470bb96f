"""Chaos: every Celery pool — prefork, threads, solo, gevent — under caps, with real fleets.

Three questions per pool, each on real workers (``acks_late``; a Redis broker, but for the
gevent-only fleets, which use RabbitMQ: see their parameters):

1. A fleet of that pool (two or more workers) runs the mixed capped workload: measured
   concurrency never passes a cap, every task runs exactly once, no lease is left.
   One more fleet mixes all four pools on the same caps.
2. A run releases its slot at once however it ends — success, exception, soft and hard
   time limit, ``revoke(terminate=True)`` — where the pool supports the way of ending;
   where it does not (Celery ignores time limits on threads, solo and the soft limit on
   gevent; threads and solo cannot terminate a task), the task runs to completion and
   then releases, and a revoke never takes a slot from a task that is still running.
   Prefork's release paths are in ``test_lifecycle.py``.
3. A warm shutdown (SIGTERM) mid-run lets the running tasks finish and release; a cold
   shutdown (SIGQUIT) mid-run does what Celery does on that pool (below), the slots of
   the runs it ends are released at exit or expire, and the caps hold by the crash rule
   of ``test_crash`` (exceeded, if ever, only within a lease window and by the runs cut).
4. A gevent worker given a cold shutdown while a task is still in its admission (its
   store hangs) gives that task back to the broker: another worker runs it.

What Celery 5.7 does on a cold shutdown, seen here with plain (uncapped) tasks too:
prefork ends the running tasks and their messages are redelivered; threads fails inside
its cold-shutdown handler (the pool cannot terminate a task: ``NotImplementedError``) and
falls back to waiting for them; solo raises that ``NotImplementedError`` inside the
running task, which fails and is acknowledged; gevent kills the greenlets and
acknowledges their messages as if the tasks had succeeded.  So on solo and gevent a cold
shutdown loses the tasks it cuts short in their bodies — Celery's doing, not celery-caps';
this module checks that nothing else is lost and that their slots are free.  A greenlet
killed *before* the body (admission and put-back switch greenlets on their store calls and
publishes) would be acknowledged the same way: there ``CappedTask`` rejects the message with
requeue instead (or, if even that cannot be sent, leaves it unacknowledged for redelivery).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from celery_caps.stores.base import Lease
from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, Kill, Run, TcpProxy, Worker, mixed_workload, send_workload, wait_for
from tests.integration.test_crash import LEASE_SECONDS as CRASH_LEASE_SECONDS
from tests.integration.test_crash import PROVIDER_LIMIT, TENANT_LIMIT, _check_caps
from tests.services import require_service

pytestmark = [pytest.mark.chaos, pytest.mark.fleet, pytest.mark.redis]

POOLS = ("prefork", "threads", "solo", "gevent")


def _pool_param(pool: str, *values: str, marks: Sequence[pytest.MarkDecorator] = (), id: str | None = None) -> Any:
    """A pytest param for ``pool`` (``"mixed"``: every pool), skipped where it needs gevent and
    gevent is not installed (the ``test`` extra installs it)."""
    if pool in ("gevent", "mixed") and importlib.util.find_spec("gevent") is None:
        marks = (*marks, pytest.mark.skip(reason="gevent is not installed (pip install gevent)"))
    return pytest.param(pool, *values, marks=list(marks), id=id or pool)


def _concurrency(pool: str, threads: int) -> int:
    return 1 if pool == "solo" else threads


def _holders_of(fleet: Fleet, worker: Worker) -> list[Lease]:
    """Leases (live or expired) held by ``worker``'s processes: holders are ``<node name>/<pid>``."""
    return [lease for lease in fleet.leases() if lease.holder.startswith(f"{worker.name}/")]


def _runs_in_hand(fleet: Fleet, worker: Worker) -> list[dict[str, Any]]:
    """Runs of ``worker`` in progress now (recorded by the task bodies)."""
    return [run for run in fleet.live_runs() if run["hostname"] == worker.name]


# -- 1. caps hold across a fleet of each pool --------------------------------------------------------

FLEET_TASKS = 120


@pytest.mark.parametrize(
    ("pool", "store", "broker"),
    [
        _pool_param("threads", "postgres", "redis", marks=[pytest.mark.postgres], id="threads-postgres-redis"),
        _pool_param("solo", "postgres", "redis", marks=[pytest.mark.postgres], id="solo-postgres-redis"),
        # gevent workers take messages from a Redis broker slowly, caps or not (60 plain 0.1 s tasks
        # on 2 x -c4: 14 s, against 1 s on RabbitMQ): their fleets use RabbitMQ, to keep this short.
        # gevent on a Redis broker runs in the mixed fleet and the tests below.
        _pool_param(
            "gevent", "postgres", "amqp", marks=[pytest.mark.postgres, pytest.mark.amqp], id="gevent-postgres-amqp"
        ),
        _pool_param("gevent", "redis", "amqp", marks=[pytest.mark.amqp], id="gevent-redis-amqp"),
        _pool_param("mixed", "postgres", "redis", marks=[pytest.mark.postgres], id="mixed-postgres-redis"),
    ],
)
def test_caps_hold_across_a_fleet_of_each_pool(make_fleet: FleetFactory, pool: str, store: str, broker: str) -> None:
    began = time.monotonic()
    fleet = make_fleet(
        broker=require_service(broker),
        caps_url=require_service(store),
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        backoff_min=0.05,
        backoff_max=1.0,
    )

    # Given a fleet of one pool type (threads: 2 workers x -c 4, gevent: x -c 10; solo: 4 workers),
    # or one worker of every pool type side by side
    gevent_workers: list[Worker] = []
    if pool == "mixed":
        workers = [
            *fleet.start(1, concurrency=2, pool="prefork", wait=False),
            *fleet.start(1, concurrency=3, pool="threads", wait=False),
            *fleet.start(2, concurrency=1, pool="solo", wait=False),
        ]
        gevent_workers = fleet.start(1, concurrency=4, pool="gevent", wait=False)
        workers += gevent_workers
        fleet.wait_ready(workers)
        layout = "prefork -c2 + threads -c3 + 2 solo + gevent -c4"
    elif pool == "solo":
        workers = fleet.start(4, pool="solo", concurrency=1)
        layout = "4 solo"
    else:
        # (gevent: more green threads than caps allow, as gevent workers usually run)
        concurrency = 10 if pool == "gevent" else 4
        workers = fleet.start(2, pool=pool, concurrency=concurrency)
        layout = f"2 {pool} -c{concurrency}"

    # When the mixed workload (provider + tenant caps, tenant-only cap) is published at once
    jobs = mixed_workload(FLEET_TASKS, seed=6006)
    started = time.monotonic()
    sent = send_workload(fleet, jobs)

    # Then every task completes, exactly once
    fleet.wait_all_done(sent, 90)
    run_seconds = time.monotonic() - started
    record = fleet.record()
    assert {t: (record.starts[t], record.done[t]) for t in sent if (record.starts[t], record.done[t]) != (1, 1)} == {}

    # ... measured concurrency never passed a cap (atomic Lua peaks and rebuilt intervals)
    counters = sorted(record.counters())
    limits = {counter: PROVIDER_LIMIT if counter == "provider" else TENANT_LIMIT for counter in counters}
    peaks = {counter: record.peaks.get(counter, 0) for counter in counters}
    interval_peaks = {counter: record.interval_peak(counter) for counter in counters}
    put_backs = sum(record.received[task_id] for task_id in sent) - len(sent)
    runs_per_worker = {
        worker.name.split("-")[0]: sum(run.hostname == worker.name for run in record.runs) for worker in workers
    }
    received_per_worker = {worker.name.split("-")[0]: len(fleet.received_on(worker)) for worker in workers}
    print(
        f"\n[pools fleet {pool}, store {store}, broker {broker}] {len(sent)} tasks on {layout}; "
        f"peaks vs caps {', '.join(f'{c}={peaks[c]}/{limits[c]}' for c in counters)}; "
        f"interval peaks {interval_peaks}; put-backs {put_backs}; runs per worker {runs_per_worker}; "
        f"tasks received per worker {received_per_worker}; "
        f"run {run_seconds:.1f} s"
    )
    assert all(peaks[c] <= limits[c] for c in counters), f"a cap was exceeded: {peaks} vs {limits}"
    assert all(interval_peaks[c] <= limits[c] for c in counters), f"a cap was exceeded: {interval_peaks}"

    # ... the caps really bound (peaks reached the limits, tasks were put back), and every
    # worker took part (a pool that ran nothing would prove nothing): each received tasks and
    # decided on them under the caps, and each ran some, except a gevent worker on a Redis broker.
    # That one takes messages slowly, caps or not (see above): in the mixed fleet's 5 s runs it
    # received 4-9 of the 120 tasks and ran 0-8 (measured 2026-12-06; one CI run saw 0). The
    # gevent fleets above show that pool holding slots.
    assert peaks["provider"] == PROVIDER_LIMIT
    assert peaks["tenant:a"] == TENANT_LIMIT
    assert put_backs > 0
    assert all(received_per_worker.values()), received_per_worker
    slow_takers = {worker.name.split("-")[0] for worker in gevent_workers} if broker == "redis" else set()
    assert all(runs for name, runs in runs_per_worker.items() if name not in slow_takers), runs_per_worker

    # ... and every lease was released when its task ended; a sweep leaves only sentinels
    wait_for(lambda: fleet.leases() == [], 3, lambda: f"leases left: {fleet.leases()}")
    fleet.sweep_to_sentinels()
    print(f"[pools fleet {pool}, store {store}, broker {broker}] wall time {time.monotonic() - began:.1f} s")


# -- 2. release however a run ends, as far as the pool supports it -----------------------------------

#: How each pool ends a run that passes its time limits (soft, hard) or is revoked with
#: terminate=True: the final state Celery stores, or "SUCCESS" where the pool ignores it.
ENDINGS: dict[str, dict[str, tuple[str, str | None]]] = {
    "threads": {
        "soft": ("SUCCESS", None),
        "hard": ("SUCCESS", None),
        "revoke": ("SUCCESS", None),
    },
    "solo": {
        "soft": ("SUCCESS", None),
        "hard": ("SUCCESS", None),
        "revoke": ("SUCCESS", None),
    },
    "gevent": {
        "soft": ("SUCCESS", None),  # Celery's gevent pool implements only the hard limit
        "hard": ("FAILURE", "TimeLimitExceeded"),  # a gevent.Timeout raised in the greenlet
        "revoke": ("REVOKED", "TaskRevokedError"),  # the greenlet is killed
    },
}
RELEASE_LEASE_SECONDS = 2.0


def _result(fleet: Fleet, task_id: str, timeout: float = 30) -> Any:
    result = fleet.app.AsyncResult(task_id)
    result.get(timeout=timeout, propagate=False)
    return result


@pytest.mark.postgres
@pytest.mark.parametrize("pool", [_pool_param(pool) for pool in ("threads", "solo", "gevent")])
def test_every_way_a_run_ends_releases_its_slot(make_fleet: FleetFactory, pool: str) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(
        broker=redis_url, backend=redis_url, caps_url=require_service("postgres"), lease=RELEASE_LEASE_SECONDS
    )
    (worker,) = fleet.start(1, pool=pool, concurrency=_concurrency(pool, 6))
    endings = ENDINGS[pool]

    def scope() -> str:
        return uuid.uuid4().hex[:16]

    def started(task_id: str) -> None:
        wait_for(lambda: fleet.record().starts[task_id] >= 1, 30, f"{task_id} never started")

    def check_released(name: str, task_id: str, slot: str, state: str, error: str | None) -> str:
        """Wait for the task's result; check its state, that its body ran to the end (it did
        unless a time limit or a revoke ended it) and that its lease was deleted at once."""
        result = _result(fleet, task_id)
        # Expired leases stay listed until a sweep: an empty list means the run deleted its lease.
        wait_for(lambda: fleet.leases(slot) == [], 1.0, lambda: f"{name}: lease left {fleet.leases(slot)}")
        assert result.state == state, (name, result.state, result.result)
        if error is not None:
            assert type(result.result).__name__ == error, (name, result.result)
        completed = fleet.record().done[task_id]
        assert completed == (1 if error in (None, "ValueError") else 0), (name, completed)
        return f"{name}={result.state}"

    # Given a task that runs 3 lease lengths (lease 2 s), one that raises, and two that pass their
    # soft (0.5 s) or hard (1 s) time limit in a 2.5 s body, sent at once (solo runs them in turn)
    scopes = {name: scope() for name in ("success", "failure", "soft", "hard")}
    sent = {
        "success": fleet.app.send_task("fleet.hold", args=[scopes["success"], 3 * RELEASE_LEASE_SECONDS]).id,
        "failure": fleet.app.send_task("fleet.fail", args=[scopes["failure"]]).id,
        "soft": fleet.app.send_task("fleet.hold", args=[scopes["soft"], 2.5], soft_time_limit=0.5).id,
        "hard": fleet.app.send_task("fleet.hold", args=[scopes["hard"], 2.5], time_limit=1.0).id,
    }
    expected = {"success": ("SUCCESS", None), "failure": ("FAILURE", "ValueError")}
    expected |= {name: endings[name] for name in ("soft", "hard")}

    # When the long task runs, its lease is renewed: always there, never expired
    long_task, long_slot = sent["success"], fleet.slot(f"one:{scopes['success']}")
    started(long_task)
    while not fleet.record().done[long_task]:
        leases = fleet.leases(long_slot)
        if fleet.record().done[long_task]:
            break
        assert [lease.task_id for lease in leases] == [long_task] and leases[0].expires_in > 0, leases
        time.sleep(0.25)

    # Then each run's slot is free as soon as it ends, whichever way it ended
    outcomes = [
        check_released(name, task_id, fleet.slot(f"one:{scopes[name]}"), *expected[name])
        for name, task_id in sent.items()
    ]

    # When a running task is revoked with terminate=True
    revoked_scope = scope()
    revoked_slot = fleet.slot(f"one:{revoked_scope}")
    revoked = fleet.app.send_task("fleet.hold", args=[revoked_scope, 2.0]).id
    started(revoked)
    replies = fleet.app.control.revoke(revoked, terminate=True, reply=True, timeout=1.0)
    state, error = endings["revoke"]
    if state == "SUCCESS":
        # The pool cannot terminate it: it runs on, and it keeps its slot while it runs
        time.sleep(0.3)
        if not fleet.record().done[revoked]:
            assert [lease.task_id for lease in fleet.leases(revoked_slot)] == [revoked], "a revoke freed a busy slot"
    outcomes.append(check_released("revoke", revoked, revoked_slot, state, error))

    # Then the worker still admits, runs and releases capped tasks, and nothing is left behind
    follow_up_scope = scope()
    follow_up = fleet.app.send_task("fleet.hold", args=[follow_up_scope, 0.05]).id
    outcomes.append(check_released("after", follow_up, fleet.slot(f"one:{follow_up_scope}"), "SUCCESS", None))
    assert worker.alive()
    assert "lost its slot lease" not in worker.log()
    assert fleet.leases() == []
    print(f"\n[pools release {pool}] {', '.join(outcomes)}; revoke replies {replies}")


# -- 3. warm and cold shutdown in the middle of a run ------------------------------------------------

SHUTDOWN_TASKS = 48
#: What a cold shutdown does to the runs in progress: "cut" (ended at once) or "finish".
COLD_SHUTDOWN_RUNS = {"prefork": "cut", "threads": "finish", "solo": "cut", "gevent": "cut"}
#: Pools whose cold shutdown acknowledges the runs it cuts short (Celery: they are not redelivered).
COLD_SHUTDOWN_LOSES_CUT_RUNS = {"solo", "gevent"}
#: Seconds before a cold shutdown within which a task received by the worker may be in its hands
#: (admitted, its body starting) when the signal comes: a body lasts 0.3-0.9 s.
IN_HAND_SECONDS = 2.0


#: Seconds a worker may take to exit after a shutdown signal before its stacks are printed.
STALL_SECONDS = 30
#: Seconds more it may take before the test stops waiting (an expected failure: a hang).
HANG_SECONDS = 60


def _signal_mid_run(fleet: Fleet, worker: Worker, signum: signal.Signals, pool: str) -> tuple[float, float]:
    """Send ``worker`` ``signum`` while it runs a task; returns the moment (Redis clock, taken just
    before: a run seen live after it and started before it was live at it) and how long the worker
    took to exit (seconds).

    A worker still there after ``STALL_SECONDS`` has its processes' stacks printed, and gets
    ``HANG_SECONDS`` more; the test goes on if it exits then (the callers check how long it took).
    Seen on prefork twice in CI, never in 9 runs here (once SIGTERM: the main process waited in
    the pool's join for a pool process, about 31 s; once SIGQUIT, not exited within 30 s), and on
    gevent after SIGQUIT in 2 of about 12 runs in one session: Celery 5.7 runs its cold shutdown,
    the pool's join included, inside the signal handler (see docs/worker-options.md). A worker
    that never exits is reported as an expected failure, not hidden as a pass."""

    def moment_mid_run() -> float | None:
        moment = fleet.redis_time()
        return moment if any(run["start"] <= moment for run in _runs_in_hand(fleet, worker)) else None

    moment = wait_for(moment_mid_run, 30, f"{worker.name} never ran a task", interval=0.02)
    worker.process.send_signal(signum)
    sent_at = time.monotonic()
    try:
        worker.process.wait(timeout=STALL_SECONDS)
    except subprocess.TimeoutExpired:
        stacks = _stacks_of(worker)
        print(f"\n===== {worker.name} did not exit within {STALL_SECONDS} s of {signum.name}; stacks =====\n{stacks}")
        try:
            worker.process.wait(timeout=HANG_SECONDS)
        except subprocess.TimeoutExpired:
            pytest.xfail(
                f"{pool} worker {worker.name} did not exit within {STALL_SECONDS + HANG_SECONDS} s of "
                f"{signum.name} (shutdown hang; stacks printed)"
            )
    return moment, time.monotonic() - sent_at


def _stacks_of(worker: Worker) -> str:
    """The stacks of ``worker``'s processes (py-spy, as root); else its main process's
    threads, which Celery logs on SIGUSR1 (pool processes die of SIGUSR1)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if os.geteuid() == 0 and Path(py_spy).exists():
        dumps = []
        for pid in [worker.pid, *worker.children()]:
            done = subprocess.run(
                [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False
            )
            dumps.append(f"--- pid {pid} (py-spy exit {done.returncode}) ---\n{done.stdout}{done.stderr}")
        return "\n".join(dumps)
    size_before = worker.stderr_path.stat().st_size
    worker.process.send_signal(signal.SIGUSR1)
    time.sleep(2.0)
    with open(worker.stderr_path, "rb") as log:
        log.seek(size_before)
        written = log.read().decode(errors="replace")
    return written or "(nothing logged on SIGUSR1: the main thread never got back to Python)"


def _runs_live_at(fleet: Fleet, worker: Worker, moment: float) -> list[Run]:
    """``worker``'s runs live at ``moment`` (Redis clock), as recorded now."""
    return [
        run
        for run in fleet.record().runs
        if run.hostname == worker.name and run.start <= moment and (run.end is None or run.end > moment)
    ]


@pytest.mark.postgres
@pytest.mark.parametrize("pool", [_pool_param(pool) for pool in POOLS])
def test_warm_and_cold_shutdown_mid_run(make_fleet: FleetFactory, pool: str) -> None:
    began = time.monotonic()
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=require_service("postgres"),
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        lease=CRASH_LEASE_SECONDS,
        backoff_min=0.05,
        backoff_max=0.5,
        visibility_timeout=10,
    )

    # Given three workers of the pool running a capped workload with longer bodies
    # (solo: four, so that two single-task workers are left to finish the work)
    warm, cold, *survivors = fleet.start(4 if pool == "solo" else 3, pool=pool, concurrency=_concurrency(pool, 3))
    sent = send_workload(fleet, mixed_workload(SHUTDOWN_TASKS, seed=60606, ms_range=(300, 900)))

    def done() -> int:
        record = fleet.record()
        return sum(1 for task_id in sent if record.done[task_id])

    # When one worker gets SIGTERM while it runs tasks (warm shutdown)
    wait_for(lambda: done() >= SHUTDOWN_TASKS // 6, 60, lambda: f"only {done()} done")
    warm_moment, warm_exit_seconds = _signal_mid_run(fleet, warm, signal.SIGTERM, pool)

    # Then its running tasks finish there, once, and their slots are released (not left to expire)
    assert warm.process.returncode == 0, warm.tail()
    warm_runs = _runs_live_at(fleet, warm, warm_moment)
    assert warm_runs and all(run.completed for run in warm_runs), warm_runs
    record = fleet.record()
    assert all(run.hostname == warm.name for warm_run in warm_runs for run in record.runs_of(warm_run.task_id))
    assert _holders_of(fleet, warm) == []

    # When another worker gets SIGQUIT while it runs tasks (cold shutdown): one of the others seen
    # running a task (which of them gets the rest of the work is the broker's choice: a put-back
    # copy runs on the worker that received it)
    wait_for(lambda: done() >= SHUTDOWN_TASKS // 3, 60, lambda: f"only {done()} done")
    others = [cold, *survivors]
    cold = wait_for(
        lambda: next((worker for worker in others if _runs_in_hand(fleet, worker)), None),
        30,
        lambda: f"none of {[worker.name for worker in others]} ran a task; {done()} done",
        interval=0.02,
    )
    survivors = [worker for worker in others if worker is not cold]
    cold_children = cold.children()
    cold_moment, cold_exit_seconds = _signal_mid_run(fleet, cold, signal.SIGQUIT, pool)
    # (runs a dead pool child could not record as ended end now: the harness's kill bookkeeping)
    cold_kill = fleet.mark_killed([cold.pid, *cold_children])
    cold_kill = Kill(cold_moment, cold_kill.pids, cold_kill.runs_cut)

    # Then it exits at once (threads: once its running tasks finished, as Celery falls back to waiting)
    cold_runs = _runs_live_at(fleet, cold, cold_moment)
    assert cold_runs, "the cold shutdown caught no run"
    cut_on_the_spot = {run.task_id for run in cold_runs if not run.completed}
    if COLD_SHUTDOWN_RUNS[pool] == "cut":
        # (or, after a stall of the kind _signal_mid_run describes, once the stall ended)
        assert cold_exit_seconds < 10 or cold_exit_seconds > STALL_SECONDS, cold_exit_seconds
        # (a run that completed there was ending anyway, as the signal arrived)
        assert cut_on_the_spot, cold_runs
        assert all(run.end - cold_moment < 0.25 for run in cold_runs if run.completed and run.end), cold_runs
    else:
        assert cut_on_the_spot == set(), cold_runs

    # ... and the slots of its runs are free: released at exit, or expired within a lease
    wait_for(
        lambda: all(lease.expires_in < 0 for lease in _holders_of(fleet, cold)),
        CRASH_LEASE_SECONDS + 2,
        lambda: f"live leases of the cold-shut worker: {_holders_of(fleet, cold)}",
    )
    left_by_cold = len(_holders_of(fleet, cold))

    # (every run the cold-shut worker never completed was cut by its shutdown: those live at the
    # moment, and those it started between that moment and acting on the signal)
    cut_by_cold = {run.task_id for run in fleet.record().runs if run.hostname == cold.name and not run.completed}
    assert cut_on_the_spot <= cut_by_cold, (cut_on_the_spot, cut_by_cold)
    # On a pool whose cold shutdown acknowledges what it cut, a run cut while its body recorded its
    # own start (the body's first act, a Redis call, switches greenlets) leaves no run behind: CI
    # saw a gevent worker lose a task it received 5 ms before the signal, past its admission (a
    # task killed in admission says so in the log and is given back: see the test below). So the
    # tasks last received by the cold-shut worker just before the signal count as cut too (a
    # message it only held back unacknowledged comes back and is received again elsewhere).
    if pool in COLD_SHUTDOWN_LOSES_CUT_RUNS:
        received_last_there = {
            task_id
            for task_id in fleet.received_on(cold)
            if (last := fleet.last_received(task_id)) is not None
            and last[0] == cold.name
            and cold_moment - IN_HAND_SECONDS <= last[1]
        }
        lost_with_cold = cut_by_cold | received_last_there
    else:
        lost_with_cold = cut_by_cold

    # Then the survivor completes the rest; the only tasks never completed are runs the cold
    # shutdown cut short on a pool whose cold shutdown acknowledges them (Celery: solo, gevent)
    def settled() -> bool:
        record = fleet.record()
        missing = {task_id for task_id in sent if not record.done[task_id]}
        if not missing:
            return True
        if pool not in COLD_SHUTDOWN_LOSES_CUT_RUNS or not missing <= lost_with_cold:
            return False
        return fleet.redis_broker_idle() and not fleet.live_runs()

    def unsettled() -> str:
        record = fleet.record()
        missing = sorted(task_id for task_id in sent if not record.done[task_id])
        return (
            f"{done()} of {len(sent)} done; missing {missing}, cut short {sorted(cut_by_cold)} "
            f"({sorted(cut_on_the_spot)} at the moment), broker idle {fleet.redis_broker_idle()}, "
            f"live runs {fleet.live_runs()}, last received {[fleet.last_received(task_id) for task_id in missing]}, "
            f"runs of the missing {[run for run in record.runs if run.task_id in missing]}"
        )

    wait_for(settled, 90, unsettled, interval=0.25)
    time.sleep(1.0)  # a lost task coming back late would show now
    record = fleet.record()
    never_done = {task_id for task_id in sent if not record.done[task_id]}
    if pool in COLD_SHUTDOWN_LOSES_CUT_RUNS:
        assert never_done <= lost_with_cold, sorted(never_done - lost_with_cold)
    else:
        assert never_done == set(), sorted(never_done)
    redelivered = {task_id for task_id in cut_by_cold if record.done[task_id]}

    # ... a task completed twice only if the cold-shut worker had it in hand
    in_dead_hands = fleet.received_on(cold) | {run.task_id for run in cold_runs}
    twice = {task_id for task_id in sent if record.done[task_id] > 1}
    assert twice <= in_dead_hands, sorted(twice - in_dead_hands)

    # ... the caps held, except within the cold shutdown's lease window by the runs it cut short
    counters = sorted(record.counters())
    excess = {counter: _check_caps(record, [cold_kill], counter, in_dead_hands) for counter in counters}

    # ... and after the sweep only sentinels are left
    fleet.wait_for_expiry(CRASH_LEASE_SECONDS + 2)
    fleet.sweep_to_sentinels()
    assert all(worker.alive() for worker in survivors)
    print(
        f"\n[pools shutdown {pool}] {len(sent)} tasks on {2 + len(survivors)}x {pool}; warm: exit "
        f"{warm.process.returncode} after {warm_exit_seconds:.1f} s, {len(warm_runs)} running task(s) finished there; "
        f"cold: exit "
        f"{cold.process.returncode} after {cold_exit_seconds:.1f} s, {len(cold_runs)} running, "
        f"{len(cut_by_cold)} cut short ({len(cut_on_the_spot)} at the signal; "
        f"{len(redelivered)} redelivered and completed, {len(never_done)} never completed, "
        f"{len(never_done - cut_by_cold)} of them cut before their run was recorded), "
        f"{left_by_cold} expired lease(s) left for the sweep; "
        f"completed twice {len(twice)}; peaks {dict(sorted(record.peaks.items()))} "
        f"(caps provider {PROVIDER_LIMIT}, tenant {TENANT_LIMIT}); excess (task ids, bodies) {excess}; "
        f"wall {time.monotonic() - began:.1f} s"
    )


# -- 4. a green pool killed during admission gives the task back ---------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("pool", [_pool_param("gevent")])
def test_green_cold_shutdown_during_admission_loses_no_task(
    postgres_proxy: tuple[TcpProxy, str], make_fleet: FleetFactory, pool: str
) -> None:
    proxy, proxied_url = postgres_proxy
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=require_service("postgres"),
        lease=CRASH_LEASE_SECONDS,
        visibility_timeout=5,
    )

    # Given a gevent worker whose store hangs (its bytes held by a proxy) while it admits a capped task
    (cold,) = fleet.start(1, pool=pool, concurrency=2, extra_env={"CAPS_FLEET_CAPS_URL": proxied_url})
    proxy.pause()
    scope = uuid.uuid4().hex[:16]
    task_id = fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id
    wait_for(lambda: task_id in fleet.received_on(cold), 30, f"{cold.name} never received {task_id}")
    time.sleep(0.5)  # in the admission's store call, which cannot return
    assert fleet.record().starts[task_id] == 0

    # When it gets a cold shutdown there (Celery kills its greenlets and acknowledges their
    # messages as if the tasks had succeeded)
    cold.process.send_signal(signal.SIGQUIT)
    try:
        cold.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.xfail(f"gevent worker {cold.name} did not exit within 30 s of SIGQUIT (cold shutdown hang)")
    proxy.resume()

    # Then the task is not lost: its message went back to the broker, and another worker runs it
    (survivor,) = fleet.start(1, pool="prefork", concurrency=1)
    wait_for(lambda: fleet.record().done[task_id] >= 1, 60, f"{task_id} was lost in the cold shutdown")
    record = fleet.record()
    assert (record.starts[task_id], record.done[task_id]) == (1, 1)
    assert [run.hostname for run in record.runs_of(task_id)] == [survivor.name]
    assert "killed before its body ran" in cold.log(), cold.tail()

    # ... and once any lease the killed admission took has expired, a sweep leaves nothing
    fleet.wait_for_expiry(CRASH_LEASE_SECONDS + 2)
    fleet.sweep_to_sentinels()
    print(
        f"\n[pools green admission kill] cold-shut worker exit {cold.process.returncode}; "
        f"{task_id} ran once, on {survivor.name}"
    )
