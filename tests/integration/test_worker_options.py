"""Capped tasks under the worker options production fleets run: one real worker per option.

Each cell starts a worker with one option (a pool, recycled children, autoscaling, time
limits, acknowledgement, prefetch, a shutdown, a lost broker connection) on a binding cap,
with no beat, and checks from outside what a user would (task bodies record their own
starts and ends, ``fleetapp.Recorder``): every task finishes exactly once (at least once
where the option's fault cuts runs short, and only those twice), measured concurrency never
passes a cap, no lease and no waiting entry is left, and no body starts after a warm shutdown
began.  ``docs/worker-options.md`` says what each option means for a cap.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, Record, TcpProxy, Worker, wait_for
from tests.services import require_service

pytestmark = [pytest.mark.fleet, pytest.mark.postgres, pytest.mark.redis]

PROVIDER_LIMIT = 2
TENANT_LIMIT = 1
TENANTS = ("a", "b", "c")
TASKS = 18
TASK_MS = 200
#: A body may start this long after a warm shutdown began: the pool had handed it to a
#: process just before the signal.
SHUTDOWN_GRACE_SECONDS = 0.3
#: ``fleet.hard_limited``'s time limit: its body runs at least this long (then its process is killed).
HARD_LIMIT_SECONDS = 1.5


@dataclass(frozen=True)
class Cell:
    """One worker option to run capped tasks under."""

    id: str
    pool: str = "prefork"
    concurrency: int = 3
    #: More arguments for ``celery worker``.
    args: tuple[str, ...] = ()
    #: Celery settings of the worker's app (the fleet app's own are late acks, prefetch 1).
    conf: dict[str, Any] = field(default_factory=dict)
    #: What happens mid-run: "warm" or "cold" shutdown (then a new worker), "kill-child",
    #: "broker-loss" (the broker connection cut for 3 s), or nothing.
    fault: str | None = None


CELLS = [
    Cell("celery-defaults", conf={"task_acks_late": False, "worker_prefetch_multiplier": 4}),
    Cell("acks-late-prefetch-1"),
    Cell("acks-late-prefetch-4", conf={"worker_prefetch_multiplier": 4}),
    Cell("threads", pool="threads"),
    Cell("solo", pool="solo", concurrency=1),
    Cell("gevent", pool="gevent", concurrency=4),
    Cell("max-tasks-per-child-1", args=("--max-tasks-per-child=1",)),
    Cell("max-memory-per-child", args=("--max-memory-per-child=1",)),  # 1 KiB: every child is recycled
    Cell("autoscale", args=("--autoscale=4,1",)),
    Cell("warm-shutdown", fault="warm"),
    Cell("warm-shutdown-acks-early", fault="warm", conf={"task_acks_late": False}),
    Cell("cold-shutdown", fault="cold"),
    Cell("reject-on-worker-lost", fault="kill-child", conf={"task_reject_on_worker_lost": True}),
    Cell("cancel-long-running-on-connection-loss", fault="broker-loss",
         conf={"worker_cancel_long_running_tasks_on_connection_loss": True}),
]  # fmt: skip


def _param(cell: Cell) -> Any:
    marks = []
    if cell.pool == "gevent" and importlib.util.find_spec("gevent") is None:
        marks.append(pytest.mark.skip(reason="gevent is not installed (pip install gevent)"))
    return pytest.param(cell, id=cell.id, marks=marks)


def _check_caps(record: Record, *, bound: bool) -> None:
    """The caps held (counting task ids: a run cut short and its redelivery hold one slot); with
    ``bound``, the global one was full at times (the worker had the processes to fill it)."""
    limits = {"provider": PROVIDER_LIMIT, **{f"tenant:{tenant}": TENANT_LIMIT for tenant in TENANTS}}
    peaks = {counter: record.interval_peak(counter, distinct=True) for counter in limits}
    assert all(peaks[counter] <= limit for counter, limit in limits.items()), f"a cap was exceeded: {peaks}"
    assert not bound or peaks["provider"] == PROVIDER_LIMIT, f"the cap never bound: {peaks}"


def _nothing_left(fleet: Fleet) -> None:
    wait_for(lambda: fleet.leases() == [], 15, lambda: f"leases left: {fleet.leases()}")
    assert [w for w in fleet.store.waiters() if w.slot.startswith(fleet.prefix)] == []


def _worker(fleet: Fleet, cell: Cell, broker_env: dict[str, str] | None = None) -> Worker:
    [worker] = fleet.start(1, concurrency=cell.concurrency, pool=cell.pool, extra_args=cell.args, extra_env=broker_env)
    return worker


@pytest.mark.parametrize("cell", [_param(cell) for cell in CELLS])
def test_capped_tasks_under_a_worker_option(make_fleet: FleetFactory, cell: Cell) -> None:
    broker = require_service("redis")
    proxy: TcpProxy | None = None
    worker_env: dict[str, str] | None = None
    if cell.fault == "broker-loss":
        # The workers reach the broker through a proxy the test can cut.
        redis_host, redis_port = broker.split("//", 1)[1].split("/", 1)[0].split(":")
        proxy = TcpProxy((redis_host, int(redis_port)))
        proxy.open()
        database = broker.rsplit("/", 1)[1]
        worker_env = {"CAPS_FLEET_BROKER": f"redis://127.0.0.1:{proxy.port}/{database}"}
    try:
        fleet = make_fleet(
            broker=broker, backend=broker, caps_url=require_service("postgres"), strategy="park",
            provider_limit=PROVIDER_LIMIT, tenant_limit=TENANT_LIMIT, lease=5, conf=json.dumps(cell.conf),
            # A message unacknowledged when the connection was cut comes back within seconds.
            visibility_timeout=5 if cell.fault == "broker-loss" else None,
        )  # fmt: skip
        worker = _worker(fleet, cell, worker_env)

        # Given tasks of three tenants under a global cap of 2 and a tenant cap of 1
        sent = [fleet.app.send_task("fleet.both", args=[TENANTS[n % 3], TASK_MS]).id for n in range(TASKS)]

        # When the option's fault happens mid-run (if it has one)
        cut: set[str] = set()
        signalled_at = None
        if cell.fault in ("warm", "cold"):
            wait_for(lambda: len(fleet.live_runs()) >= 2, 60, "no task ran before the shutdown")
            signalled_at = fleet.redis_time()
            running = {run["task_id"] for run in fleet.live_runs()}
            worker.process.send_signal(signal.SIGTERM if cell.fault == "warm" else signal.SIGQUIT)
            worker.process.wait(timeout=60)
            if cell.fault == "cold":
                cut = running
            _worker(fleet, cell)  # a new worker takes over
        elif cell.fault == "kill-child":
            wait_for(lambda: fleet.live_runs(), 60, "no task ran")
            [victim, *_] = fleet.live_runs()
            fleet.kill_child(int(victim["pid"]))
            cut = {victim["task_id"]}
        elif cell.fault == "broker-loss":
            assert proxy is not None
            wait_for(lambda: len(fleet.live_runs()) >= 2, 60, "no task ran before the broker was cut")
            cut = {run["task_id"] for run in fleet.live_runs()}
            proxy.close()
            time.sleep(3)
            proxy.open()

        # Then every task finishes: exactly once, or at least once where the fault cut runs short
        # or the broker delivered a copy again (a lost connection: a message a worker had taken
        # but not acknowledged comes back, as Celery's at-least-once delivery has it).  A copy
        # that parked just before the cut, its acknowledgement lost, comes back marked redelivered
        # after its entry may have run: it parks again and runs as a woken copy, which carries no
        # mark, so the deliveries count as well as the runs.
        fleet.wait_all_done(sent, 120)
        record = fleet.record()
        twice = {task_id for task_id in sent if record.starts[task_id] > 1}
        redelivered = {
            task_id for task_id in twice
            if record.redelivered[task_id] or any(run.redelivered for run in record.runs_of(task_id))
        }  # fmt: skip
        assert twice <= cut | redelivered, (
            f"run twice without being cut short or redelivered: {twice - cut - redelivered}"
        )
        assert all(record.done[task_id] >= 1 for task_id in sent)
        # ... the caps held
        _check_caps(record, bound=cell.concurrency >= PROVIDER_LIMIT)
        # ... no body started on the worker after its warm shutdown began
        if cell.fault == "warm":
            assert signalled_at is not None
            late = [
                run for run in record.runs
                if run.hostname == worker.name and run.start > signalled_at + SHUTDOWN_GRACE_SECONDS
            ]  # fmt: skip
            assert late == [], f"bodies started after the warm shutdown began: {late}"
        # ... and nothing is left behind
        _nothing_left(fleet)
    finally:
        if proxy is not None:
            proxy.close()


@pytest.mark.parametrize("limit", ["soft", "hard"])
def test_a_time_limit_fails_the_task_and_frees_its_slot_at_once(make_fleet: FleetFactory, limit: str) -> None:
    broker = require_service("redis")
    fleet = make_fleet(broker=broker, backend=broker, caps_url=require_service("postgres"), strategy="park", lease=30)
    fleet.start(1, concurrency=3)
    scope = uuid.uuid4().hex[:16]

    # Given tasks over their time limit and ordinary tasks, all for one slot (a cap of 1)
    limited = [fleet.app.send_task(f"fleet.{limit}_limited", args=[scope]).id for _ in range(2)]
    ordinary = [fleet.app.send_task("fleet.hold", args=[scope, 0.1]).id for _ in range(3)]

    # Then the limited ones fail with Celery's time limit error, the others run exactly once,
    # never two at a time, and nothing is left (a slot waits for no lease to expire: 30 s)
    for task_id in limited:
        result = fleet.app.AsyncResult(task_id)
        result.get(timeout=60, propagate=False)
        assert result.state == "FAILURE", (task_id, result.state)
        assert type(result.result).__name__ in ("SoftTimeLimitExceeded", "TimeLimitExceeded"), result.result
    fleet.wait_all_done(ordinary, 30)
    record = fleet.record()
    assert [record.starts[task_id] for task_id in ordinary] == [1, 1, 1]
    # (A run killed by its hard limit records no end: it ran until its limit, 1.5 s, at least.)
    ends = {run.token: run.end if run.end is not None else run.start + HARD_LIMIT_SECONDS for run in record.runs}
    intervals = sorted((run.start, ends[run.token]) for run in record.runs)
    overlapping = [(a, b) for a, b in itertools.pairwise(intervals) if b[0] < a[1]]
    assert overlapping == [], f"two runs of a cap of 1 at once: {overlapping}"
    _nothing_left(fleet)
