"""celery-caps demo: several real workers, a burst of tasks, two caps that hold fleet-wide.

Starts ``--workers`` real ``celery worker`` processes (prefork, ``--concurrency``
each, so up to workers x concurrency tasks could run at once), publishes
``--tasks`` tasks for a few tenants with uneven load, and shows live how many
run per cap against its limit: 4 at once in total (``demo-provider``) and 2 per
tenant (``demo-tenant:<tenant>``).  What runs is measured from the tasks' own
start/end records (see ``demoapp.py``), not from the library.

It exits 0 only if every task completed exactly once, no cap was exceeded and
no lease was left behind; otherwise it says what went wrong and exits 1.

With no options it needs no server: kombu's filesystem transport as the broker
and a SQLite file as the slot store, both in a temporary folder.  Point it at
servers with ``--broker`` and ``--store``, e.g.::

    python examples/demo/demo.py --broker redis://127.0.0.1:6379/0 \\
        --store postgresql+psycopg://postgres@127.0.0.1/test

``--no-workers`` starts no workers: run them yourself (see README.md beside this file).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from celery.utils import uuid as new_task_id

HERE = Path(__file__).resolve().parent

#: Tenants and their share of the burst: one tenant has most of the work.
TENANT_WEIGHTS = {"acme": 6, "globex": 3, "initech": 2, "umbrella": 1}
#: How long one task's body sleeps, in seconds (uniform in this range).
TASK_SECONDS = (0.2, 0.5)
#: Seconds a worker may take to start, and to stop after SIGTERM before it is killed.
START_DEADLINE_SECONDS = 60.0
STOP_DEADLINE_SECONDS = 15.0
#: Seconds between screen refreshes.
REFRESH_SECONDS = 0.25
#: ``--crash``: runs started before one is killed, and kills tried before giving up (a kill finds
#: the process between runs when its task ends in the meantime).
CRASH_AFTER_STARTS = 3
CRASH_TRIES = 5


class DemoFailed(Exception):
    """The demo could not run to the end (a worker died, tasks did not complete in time)."""


# -- the workers --------------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(f"    {line}" for line in text[-lines:])


def start_workers(count: int, concurrency: int, data_dir: Path, env: dict[str, str]) -> list[Worker]:
    """Start ``count`` prefork workers, each in its own process group (Ctrl-C here does not reach them)."""
    workers = []
    for number in range(1, count + 1):
        name = f"demo{number}"
        log_path = data_dir / f"{name}.log"
        options = (
            f"--hostname {name}@%h --pool prefork --concurrency {concurrency} --queues {env['CAPS_DEMO_QUEUE']} "
            "--loglevel INFO --without-mingle --without-gossip --without-heartbeat"
        )
        command = [sys.executable, "-m", "celery", "-A", "demoapp", "worker", *options.split()]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command,
                cwd=HERE,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        workers.append(Worker(name, process, log_path))
    return workers


def stop_workers(workers: Sequence[Worker], deadline_seconds: float = STOP_DEADLINE_SECONDS) -> list[str]:
    """SIGTERM every worker (a warm shutdown), SIGKILL its process group after the deadline.

    Only the worker's main process gets SIGTERM: it lets running tasks finish and
    stops its pool; a SIGTERM to the pool processes would end their tasks at once.
    Returns the names of workers that had to be killed.  A second Ctrl-C kills at once.
    """
    for worker in workers:
        if worker.alive():
            worker.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + deadline_seconds
    try:
        while any(worker.alive() for worker in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    killed = []
    for worker in workers:
        if worker.alive():
            killed.append(worker.name)
        # The whole group: this also ends pool processes a dead worker left behind.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
    return killed


# -- the side channel: what ran, when -------------------------------------------------------


@dataclass
class Observed:
    """Everything the tasks recorded, and what follows from it."""

    #: Per slot label: the running count now.
    running: Counter[str] = field(default_factory=Counter)
    #: Per slot label: the highest number running at once.
    peak: Counter[str] = field(default_factory=Counter)
    #: Per slot label: completed runs.
    completed: Counter[str] = field(default_factory=Counter)
    #: Deliveries of a task to a worker (each one a worker picked up, whether it ran or not).
    attempts: int = 0
    starts: int = 0
    ends: int = 0
    #: task id -> number of deliveries.
    attempts_per_task: Counter[str] = field(default_factory=Counter)
    #: Tasks whose run started after they had waited for a slot (the run says so).
    started_after_waiting: set[str] = field(default_factory=set)
    #: task id -> number of completed body runs.
    runs_per_task: Counter[str] = field(default_factory=Counter)
    #: task id -> number of body starts.
    starts_per_task: Counter[str] = field(default_factory=Counter)
    ready_workers: set[str] = field(default_factory=set)
    #: pool process id -> (task id, tenant) of the run it has started and not ended.
    open_runs: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: (task id, pid) of each run whose pool process was killed mid-run (``--crash``).
    killed_runs: list[tuple[str, int]] = field(default_factory=list)
    #: Kills that found the process between runs (its task had ended just before).
    kills_between_runs: int = 0
    first_start: float | None = None
    last_end: float | None = None

    def tasks_that_waited(self) -> set[str]:
        """Tasks that found a cap full and had to wait for a free slot: delivered more often than
        they started (turned away at least once), or started after waiting."""
        turned_away = {
            task_id for task_id, count in self.attempts_per_task.items() if count > self.starts_per_task[task_id]
        }
        return turned_away | self.started_after_waiting

    def tasks_waiting(self) -> set[str]:
        """Tasks that were turned away and have not started yet: they wait for a free slot now."""
        return {task_id for task_id in self.tasks_that_waited() if not self.starts_per_task[task_id]}


def read_events(path: Path) -> list[tuple[str, str | None, str | None, str | None, float, int | None, int]]:
    """Every event row, oldest first (read-only; the writers are never blocked)."""
    if not path.exists():
        return []
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return connection.execute(
            "SELECT kind, task_id, tenant, worker, at, deferrals, pid FROM events ORDER BY at, id"
        ).fetchall()
    except sqlite3.OperationalError:  # the table is not there yet
        return []
    finally:
        connection.close()


def observe(path: Path, provider_label: str, tenant_label: str) -> Observed:
    """Replay the events: running counts by time, peaks, completions, deliveries and waits.

    A task's body starts after it took its leases and ends before it releases
    them, so if the caps hold, the start..end intervals of one slot never
    overlap more than its limit.  A run whose pool process was killed (``--crash``) ends when
    the kill was sent: its slots are free only later, once its worker has seen the process die.
    At equal timestamps ends count first (a slot is released before the next admission can see
    it free).
    """
    observed = Observed()
    rows = read_events(path)
    order = {"end": 0, "killed": 0, "start": 1}
    timeline = sorted(
        ((at, order[kind], index) for index, (kind, *_rest, at, _d, _pid) in enumerate(rows) if kind in order),
    )
    for kind, task_id, _tenant, worker, _at, _deferrals, _pid in rows:
        if kind == "ready" and worker:
            observed.ready_workers.add(worker)
        elif kind == "attempt":
            observed.attempts += 1
            observed.attempts_per_task[task_id or ""] += 1
        elif kind == "waited":
            observed.started_after_waiting.add(task_id or "")
    for at, _order, index in timeline:
        kind, task_id, tenant, _worker, _at, _deferrals, pid = rows[index]
        if kind == "killed":
            killed_run = observed.open_runs.pop(pid, None)
            if killed_run is None:
                observed.kills_between_runs += 1
                continue
            observed.killed_runs.append((killed_run[0], pid))
            for label in (provider_label, f"{tenant_label}:{killed_run[1]}"):
                observed.running[label] -= 1
            continue
        labels = (provider_label, f"{tenant_label}:{tenant}")
        if kind == "start":
            observed.open_runs[pid] = (task_id or "", tenant or "")
            observed.starts += 1
            observed.starts_per_task[task_id or ""] += 1
            observed.first_start = at if observed.first_start is None else observed.first_start
            for label in labels:
                observed.running[label] += 1
                observed.peak[label] = max(observed.peak[label], observed.running[label])
        else:
            observed.open_runs.pop(pid, None)
            observed.ends += 1
            observed.runs_per_task[task_id or ""] += 1
            observed.last_end = at
            for label in labels:
                observed.running[label] -= 1
                observed.completed[label] += 1
    return observed


# -- display -----------------------------------------------------------------------------


@dataclass
class Plan:
    """What the demo publishes and the limits it expects to hold."""

    tasks: list[tuple[str, str, float]]  # (task id, tenant, seconds)
    provider_label: str
    tenant_label: str
    provider_limit: int
    tenant_limit: int

    def totals(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for _task_id, tenant, _seconds in self.tasks:
            counts[self.provider_label] += 1
            counts[f"{self.tenant_label}:{tenant}"] += 1
        return counts

    def rows(self) -> Iterator[tuple[str, int]]:
        """(slot label, limit), the global cap first, then tenants by load."""
        yield self.provider_label, self.provider_limit
        totals = self.totals()
        tenants = sorted((label for label in totals if label != self.provider_label), key=lambda label: -totals[label])
        for label in tenants:
            yield label, self.tenant_limit


def _bar(running: int, limit: int) -> str:
    return "■" * min(running, limit) + "□" * max(limit - running, 0) + "!" * max(running - limit, 0)


def live_table(plan: Plan, observed: Observed, status: str) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    totals = plan.totals()
    table = Table(title="running now, per slot, against its cap")
    for column in ("slot", "cap", "running", "peak", "done"):
        table.add_column(column, justify="left" if column in ("slot", "running") else "right")
    for label, limit in plan.rows():
        running, peak = observed.running[label], observed.peak[label]
        style = "bold red" if peak > limit else ""
        table.add_row(
            label,
            str(limit),
            f"{_bar(running, limit)} {running}",
            f"[{style}]{peak}[/]" if style else str(peak),
            f"{observed.completed[label]}/{totals[label]}",
        )
    return Group(table, Text(status))


def plain_line(plan: Plan, observed: Observed, status: str) -> str:
    parts = [f"{label.split(':')[-1]} {observed.running[label]}/{limit}" for label, limit in plan.rows()]
    return f"running: {' | '.join(parts)} -- {status}"


# -- the run -------------------------------------------------------------------------------


def make_plan(count: int, seed: int, provider_limit: int, tenant_limit: int, demoapp: ModuleType) -> Plan:
    rng = random.Random(seed)
    tenants = rng.choices(list(TENANT_WEIGHTS), weights=list(TENANT_WEIGHTS.values()), k=count)
    # Task ids in Celery's own form, as apply_async would make them.
    tasks = [(new_task_id(), tenant, round(rng.uniform(*TASK_SECONDS), 3)) for tenant in tenants]
    return Plan(tasks, demoapp.PROVIDER_CAP, demoapp.TENANT_CAP, provider_limit, tenant_limit)


def wait_for_ready(workers: Sequence[Worker], observations: Path) -> None:
    deadline = time.monotonic() + START_DEADLINE_SECONDS
    while True:
        ready = {name.split("@", 1)[0] for name in observe(observations, "", "").ready_workers}
        if all(worker.name in ready for worker in workers):
            return
        check_alive(workers)
        if time.monotonic() > deadline:
            missing = ", ".join(worker.name for worker in workers if worker.name not in ready)
            raise DemoFailed(f"workers not ready after {START_DEADLINE_SECONDS:.0f} s: {missing}")
        time.sleep(0.2)


def check_alive(workers: Iterable[Worker]) -> None:
    for worker in workers:
        if not worker.alive():
            raise DemoFailed(
                f"worker {worker.name} exited with code {worker.process.returncode}; "
                f"the end of its log ({worker.log_path}):\n{worker.log_tail()}"
            )


def crasher(demoapp: ModuleType) -> Callable[[Observed], None]:
    """``--crash``: kill one pool process (SIGKILL, as the OOM killer does) in the middle of a run.

    Its worker sees the process die, releases the run's slots and gives the message back to the
    broker (``task_acks_late``, ``task_reject_on_worker_lost``): the task runs again.  The kill is
    recorded with the time it was sent, which ends the run for the peaks.
    """
    tried: set[int] = set()

    def crash(observed: Observed) -> None:
        if observed.killed_runs or len(tried) >= CRASH_TRIES or observed.starts < CRASH_AFTER_STARTS:
            return
        candidates = [pid for pid in observed.open_runs if pid not in tried]
        if not candidates:
            return
        pid = candidates[-1]  # the run started last: the least likely to end before the kill
        task_id, tenant = observed.open_runs[pid]
        tried.add(pid)
        sent_at = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        demoapp.record("killed", None, task_id, tenant, pid=pid, at=sent_at)
        print(f"--crash: killed pool process {pid} (SIGKILL) while it ran task {task_id}", flush=True)

    return crash


def watch(
    plan: Plan,
    workers: Sequence[Worker],
    observations: Path,
    timeout: float,
    plain: bool,
    crash: Callable[[Observed], None] | None = None,
) -> Observed:
    """Refresh the display until every task has completed; return the last observation.
    ``crash`` is shown each observation (``--crash``)."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    plain = plain or not console.is_terminal
    expected = len(plan.tasks)
    started = time.monotonic()
    last_line = 0.0

    def status(observed: Observed) -> str:
        elapsed = time.monotonic() - started
        alive = sum(worker.alive() for worker in workers)
        worker_text = f", workers alive {alive}/{len(workers)}" if workers else ""
        if not workers and not observed.attempts and elapsed > 10:
            worker_text = " -- no worker has taken a task yet: start them (see README.md)"
        return (
            f"{elapsed:5.1f} s, completed {observed.ends}/{expected}, "
            f"waiting for a free slot {len(observed.tasks_waiting())} "
            f"(had to wait so far {len(observed.tasks_that_waited())}){worker_text}"
        )

    def done(observed: Observed) -> bool:
        return all(observed.runs_per_task[task_id] >= 1 for task_id, _tenant, _seconds in plan.tasks)

    def step() -> Observed:
        check_alive(workers)
        if time.monotonic() - started > timeout:
            observed = observe(observations, plan.provider_label, plan.tenant_label)
            raise DemoFailed(f"only {observed.ends} of {expected} tasks completed within {timeout:.0f} s")
        time.sleep(REFRESH_SECONDS)
        observed = observe(observations, plan.provider_label, plan.tenant_label)
        if crash is not None:
            crash(observed)
        return observed

    observed = observe(observations, plan.provider_label, plan.tenant_label)
    if plain:
        while not done(observed):
            observed = step()
            if time.monotonic() - last_line >= 1.0:
                last_line = time.monotonic()
                print(plain_line(plan, observed, status(observed)), flush=True)
        print(plain_line(plan, observed, status(observed)), flush=True)
        return observed
    with Live(live_table(plan, observed, status(observed)), console=console, auto_refresh=False) as live:
        while not done(observed):
            observed = step()
            live.update(live_table(plan, observed, status(observed)), refresh=True)
    return observed


def leases_left(store_url: str, task_ids: set[str]) -> int:
    """Leases of this run's tasks still in the store (after the workers stopped: should be 0)."""
    from celery_caps.stores import store_from_url

    store = store_from_url(store_url)
    try:
        return sum(1 for lease in store.leases() if lease.task_id in task_ids)
    finally:
        store.close()


def report(
    plan: Plan,
    observed: Observed,
    leftover: int | None,
    killed: list[str],
    wall: float,
    total: float,
    pool_slots: int | None,
    strategy: str,
    crash: bool = False,
) -> list[str]:
    """Print the figures; return the failures (empty: success)."""
    failures = []
    totals = plan.totals()
    print()
    print(f"{'slot':<28} {'cap':>4} {'peak':>5} {'tasks':>6} {'completed':>10}")
    for label, limit in plan.rows():
        peak = observed.peak[label]
        flag = "  <-- EXCEEDED" if peak > limit else ""
        print(f"{label:<28} {limit:>4} {peak:>5} {totals[label]:>6} {observed.completed[label]:>10}{flag}")
        if peak > limit:
            failures.append(f"{label} ran {peak} at once, over its cap of {limit}")
    overall = observed.peak[plan.provider_label]
    pool_text = f" ({pool_slots} pool processes could have run {pool_slots})" if pool_slots else ""
    print(f"\noverall peak running: {overall} (global cap {plan.provider_limit}){pool_text}")
    task_ids = [task_id for task_id, _tenant, _seconds in plan.tasks]
    completed_once = sum(1 for task_id in task_ids if observed.runs_per_task[task_id] == 1)
    never = [task_id for task_id in task_ids if observed.runs_per_task[task_id] == 0]
    # A run whose process was killed is not a second run of its task: its message ran again.
    kills = Counter(task_id for task_id, _pid in observed.killed_runs)
    twice = [task_id for task_id in task_ids if observed.starts_per_task[task_id] - kills[task_id] > 1]
    print(f"tasks completed exactly once: {completed_once}/{len(task_ids)}")
    for task_id, pid in observed.killed_runs:
        print(
            f"pool process {pid} killed mid-run (--crash): its task {task_id} started "
            f"{observed.starts_per_task[task_id]} times and completed {observed.runs_per_task[task_id]}"
        )
    if crash and not observed.killed_runs:
        failures.append(f"--crash: none of {CRASH_TRIES} kills found its process running a task")
    if never:
        failures.append(f"{len(never)} task(s) never completed, e.g. {never[0]}")
    if twice:
        failures.append(f"{len(twice)} task(s) ran more than once, e.g. {twice[0]}")
    print(
        f"tasks that had to wait for a free slot before they ran: {len(observed.tasks_that_waited())} "
        f"of {len(task_ids)} (the others found room at once)"
    )
    again = (
        "a task that found its cap full waited in the slot store and was delivered again when a slot freed up"
        if strategy == "park"
        else "a task that found its cap full went back to the queue and was delivered again after a short delay, "
        "as often as it took"
    )
    print(f"deliveries of a task to a worker: {observed.attempts} for {len(task_ids)} tasks ({again})")
    if leftover is not None:
        print(f"leases of this run left in the store: {leftover}")
        if leftover:
            failures.append(f"{leftover} lease(s) of this run were left in the store")
    if killed:
        print(f"workers killed after not stopping within {STOP_DEADLINE_SECONDS:.0f} s: {', '.join(killed)}")
    print(f"wall time: {wall:.1f} s from the first publish to the last completion ({total:.1f} s in all)")
    return failures


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run real Celery workers against fleet-wide caps and check that the caps hold."
    )
    parser.add_argument(
        "--broker",
        default=os.environ.get("CAPS_DEMO_BROKER") or "filesystem://",
        help="broker URL (default: filesystem://, files in the data folder)",
    )
    parser.add_argument(
        "--store",
        default=os.environ.get("CAPS_DEMO_STORE"),
        help="slot store URL, caps_url (default: sqlite:///<data folder>/caps.db)",
    )
    parser.add_argument("--workers", type=int, default=3, help="celery worker processes to start (default 3)")
    parser.add_argument("--concurrency", type=int, default=3, help="prefork pool size of each worker (default 3)")
    parser.add_argument("--tasks", type=int, default=60, help="tasks to publish in one burst (default 60)")
    parser.add_argument("--provider-limit", type=int, default=4, help="the global cap (default 4)")
    parser.add_argument("--tenant-limit", type=int, default=2, help="the per-tenant cap (default 2)")
    parser.add_argument(
        "--strategy",
        choices=("backoff", "park"),
        default=os.environ.get("CAPS_DEMO_STRATEGY") or "park",
        help="caps_strategy: park in the store until a release wakes it (default) or put back with a countdown",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed for tenants and durations (default 1)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds the tasks may take to complete before the demo fails (default 120)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="folder for the SQLite files, broker files and worker logs "
        "(default: a temporary folder, removed after a successful run)",
    )
    parser.add_argument(
        "--no-workers",
        action="store_true",
        help="start no workers: publish, watch and check while you run them (see README.md)",
    )
    parser.add_argument("--plain", action="store_true", help="print plain lines instead of a live table")
    parser.add_argument(
        "--crash",
        action="store_true",
        help="kill one pool process (SIGKILL) while it runs a task: its slots come back and its task runs again",
    )
    args = parser.parse_args(argv)
    if args.crash and args.no_workers:
        parser.error("--crash kills a pool process of the workers the demo starts: not with --no-workers")
    for name in ("workers", "concurrency", "tasks", "provider_limit", "tenant_limit"):
        if getattr(args, name) < 1 and not (name == "workers" and args.no_workers):
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    temporary = args.data_dir is None and not args.no_workers
    if args.data_dir is not None:
        data_dir = args.data_dir.resolve()
    elif args.no_workers:
        data_dir = Path(os.environ.get("CAPS_DEMO_DIR") or HERE / "data").resolve()
    else:
        data_dir = Path(tempfile.mkdtemp(prefix="celery-caps-demo-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    store_url = args.store or f"sqlite:///{data_dir / 'caps.db'}"

    # demoapp reads its configuration from the environment; the workers inherit it.
    env = dict(os.environ)
    env.update(
        CAPS_DEMO_DIR=str(data_dir),
        CAPS_DEMO_BROKER=args.broker,
        CAPS_DEMO_STORE=store_url,
        CAPS_DEMO_PROVIDER_LIMIT=str(args.provider_limit),
        CAPS_DEMO_TENANT_LIMIT=str(args.tenant_limit),
        CAPS_DEMO_STRATEGY=args.strategy,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    os.environ.update(env)
    sys.path.insert(0, str(HERE))
    import demoapp

    env["CAPS_DEMO_QUEUE"] = demoapp.QUEUE
    plan = make_plan(args.tasks, args.seed, args.provider_limit, args.tenant_limit, demoapp)
    observations = demoapp.OBSERVATIONS_PATH

    # A SIGTERM to the demo stops the workers like Ctrl-C does.
    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)

    from celery_caps.stores.base import mask_url

    mode = (
        "no workers started (run your own)"
        if args.no_workers
        else (f"{args.workers} workers x --concurrency {args.concurrency} (prefork)")
    )
    print(
        f"celery-caps demo: {mode}, {args.tasks} tasks, caps {plan.provider_label}={args.provider_limit} "
        f"and {plan.tenant_label}:<tenant>={args.tenant_limit}"
    )
    print(
        f"broker {mask_url(args.broker)}, store {mask_url(store_url)}, strategy {args.strategy}, data folder {data_dir}"
    )

    workers: list[Worker] = []
    failures: list[str] = []
    killed: list[str] = []
    began = time.monotonic()
    try:
        # A fresh side channel (rows, not the file: hand-started workers may hold it open).
        demoapp.observations().execute("DELETE FROM events")
        # Messages an interrupted earlier run left in the demo's queue would skew the counts.
        demoapp.app.control.purge()
        if not args.no_workers:
            workers = start_workers(args.workers, args.concurrency, data_dir, env)
            print(f"starting workers {', '.join(worker.name for worker in workers)} ...", flush=True)
            wait_for_ready(workers, observations)
        published_at = time.time()
        for task_id, tenant, seconds in plan.tasks:
            demoapp.call_provider.apply_async((tenant, seconds), task_id=task_id)
        print(
            f"published {len(plan.tasks)} tasks: "
            + ", ".join(f"{t} {n}" for t, n in Counter(t for _i, t, _s in plan.tasks).most_common()),
            flush=True,
        )
        crash = crasher(demoapp) if args.crash else None
        observed = watch(plan, workers, observations, args.timeout, args.plain, crash)
        if workers:
            killed = stop_workers(workers)
        # Read again once nothing runs any more: a duplicate run would show now.
        observed = observe(observations, plan.provider_label, plan.tenant_label)
        leftover = leases_left(store_url, {task_id for task_id, _t, _s in plan.tasks})
        wall = (observed.last_end or published_at) - published_at
        pool_slots = args.workers * args.concurrency if workers else None
        failures = report(
            plan, observed, leftover, killed, wall, time.monotonic() - began, pool_slots, args.strategy, args.crash
        )
    except KeyboardInterrupt:
        failures = ["interrupted"]
        print("\ninterrupted: stopping the workers", file=sys.stderr)
    except DemoFailed as exc:
        failures = [str(exc)]
    finally:
        if workers:
            stop_workers(workers)
    if failures:
        print("\nFAILED: " + "\n        ".join(failures), file=sys.stderr)
        print(f"(the data folder with the workers' logs is kept: {data_dir})", file=sys.stderr)
        return 130 if failures == ["interrupted"] else 1
    print("\nOK: every task completed exactly once and no cap was exceeded.")
    if temporary:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
