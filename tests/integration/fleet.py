"""Harness for integration tests: real ``celery worker`` subprocesses and what their tasks recorded.

A :class:`Fleet` is one test's set of workers of ``tests.integration.fleetapp``,
configured through environment variables (:func:`fleet_env`), each worker in its
own process group with its log in a file under the test's ``tmp_path``.  The
fleet also holds a client app (to send tasks and ping workers) and reads the
:class:`~tests.integration.fleetapp.Recorder` data back (:meth:`Fleet.record`).

Everything a fleet creates is named after its unique prefix (cap names, queues,
Redis keys, the control exchange), so several test runs can share the servers.
Two fleets of one test may share their caps (``cap_prefix``): two deployments of one
project sharing a store.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery

from celery_caps.messages import wake_queue_name
from celery_caps.settings import CapsSettings
from celery_caps.stores import store_from_url
from celery_caps.stores.base import Lease, ParkingStore, SlotStore
from tests.integration.fleetapp import Recorder, make_app, queue_name
from tests.services import close_client_app

REPO_ROOT = Path(__file__).resolve().parents[2]

_T = TypeVar("_T")

# After a kill: mark the runs of the killed processes as ended now (Redis TIME)
# and take them out of the live counters, in one atomic step.
# KEYS: runs, ends; ARGV: live-key prefix, pids...
_MARK_KILLED = """
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
local killed = {}
for i = 2, #ARGV do killed[ARGV[i]] = true end
local runs = redis.call('HGETALL', KEYS[1])
local marked = 0
for i = 1, #runs, 2 do
  local token = runs[i]
  local document = cjson.decode(string.sub(runs[i + 1], string.find(runs[i + 1], ' ') + 1))
  if killed[tostring(document['pid'])] and redis.call('HEXISTS', KEYS[2], token) == 0 then
    redis.call('HSET', KEYS[2], token, now)
    for _, counter in ipairs(document['counters']) do
      redis.call('HDEL', ARGV[1] .. counter, token)
    end
    marked = marked + 1
  end
end
return {now, marked}
"""


def wait_for(
    condition: Callable[[], _T], timeout: float, message: str | Callable[[], str], interval: float = 0.05
) -> _T:
    """Poll ``condition`` until it returns something truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:.1f} s: {text}")
        time.sleep(interval)


def fleet_env(
    prefix: str,
    *,
    broker: str,
    counter_url: str,
    caps_url: str | None = None,
    backend: str | None = None,
    **settings: Any,
) -> dict[str, str]:
    """The ``CAPS_FLEET_*`` environment of a fleet; ``settings`` are ``lease=3`` -> ``CAPS_FLEET_LEASE``."""
    env = {"CAPS_FLEET_PREFIX": prefix, "CAPS_FLEET_BROKER": broker, "CAPS_FLEET_COUNTER_URL": counter_url}
    if caps_url is not None:
        env["CAPS_FLEET_CAPS_URL"] = caps_url
    if backend is not None:
        env["CAPS_FLEET_BACKEND"] = backend
    for name, value in settings.items():
        if value is not None:
            env[f"CAPS_FLEET_{name.upper()}"] = str(value)
    return env


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@dataclass
class Worker:
    """One ``celery worker`` subprocess (its own process group) and its log files."""

    name: str
    process: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def children(self) -> list[int]:
        """The main process's child pids (the prefork pool)."""
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except FileNotFoundError:
            return []
        return [int(pid) for pid in text.split()]

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        parts = []
        for path in (self.stdout_path, self.stderr_path):
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "".join(parts)

    def tail(self, lines: int = 60) -> str:
        text = self.log().splitlines()[-lines:]
        return f"----- {self.name} (pid {self.pid}, exit {self.process.poll()}) -----\n" + "\n".join(text)


@dataclass(frozen=True)
class Kill:
    """A ``kill -9``: when (Redis clock), which pids, how many runs it cut short."""

    moment: float
    pids: tuple[int, ...]
    runs_cut: int

    def holders(self, record: Record, counter: str) -> int:
        """Runs of ``counter`` this kill cut short (they held its slot when they died)."""
        return sum(
            1 for run in record.runs if run.pid in self.pids and run.end == self.moment and counter in run.counters
        )


@dataclass(frozen=True)
class Run:
    """One execution of a task body, as the recorder saw it (times by Redis ``TIME``)."""

    token: str
    task_id: str
    counters: tuple[str, ...]
    pid: int
    start: float
    end: float | None
    deferrals: int
    hostname: str
    #: The body returned (False: it raised, was cut short, or still runs).
    completed: bool = False
    #: The dispatch its copy claimed (a woken task), if any.
    dispatch: str | None = None
    #: Its copy was delivered again by the broker.
    redelivered: bool = False
    #: ``request.retries``: which attempt of the task this run was.
    retries: int = 0


@dataclass
class Record:
    """Everything the task bodies of one fleet recorded."""

    peaks: dict[str, int]
    starts: Counter[str]
    done: Counter[str]
    received: Counter[str]
    callbacks: Counter[str]
    runs: list[Run]
    #: Deliveries the broker marked redelivered, per task id: a copy that parked or ended
    #: counts too, though no run of it shows the mark (a parked copy runs as a woken one).
    redelivered: Counter[str] = field(default_factory=Counter)

    def runs_of(self, task_id: str) -> list[Run]:
        return sorted((run for run in self.runs if run.task_id == task_id), key=lambda run: run.start)

    def concurrency(self, counter: str, *, distinct: bool = False) -> list[tuple[float, int]]:
        """``(time, level from then on)`` for ``counter``, rebuilt from the run intervals.

        The level counts live runs, or with ``distinct`` live *task ids*: what a cap
        counts (two runs of one task id, a duplicate delivery, hold one slot).
        """
        events: list[tuple[float, int, str]] = []
        for run in self.runs:
            if counter in run.counters:
                events.append((run.start, 1, run.task_id))
                events.append((run.end if run.end is not None else float("inf"), -1, run.task_id))
        events.sort(key=lambda event: (event[0], event[1]))  # an end before a start at the same time
        per_task: Counter[str] = Counter()
        level, series = 0, []
        for moment, change, task_id in events:
            per_task[task_id] += change
            if distinct:
                level = sum(1 for runs in per_task.values() if runs > 0)
            else:
                level += change
            series.append((moment, level))
        return series

    def interval_peak(self, counter: str, *, distinct: bool = False) -> int:
        return max((level for _, level in self.concurrency(counter, distinct=distinct)), default=0)

    def live_at(self, counter: str, moment: float) -> list[Run]:
        """Runs of ``counter`` live at ``moment`` (Redis clock)."""
        return [
            run
            for run in self.runs
            if counter in run.counters and run.start <= moment and (run.end is None or moment < run.end)
        ]

    def counters(self) -> set[str]:
        return {counter for run in self.runs for counter in run.counters}


@dataclass
class Fleet:
    """One test's workers, client app and recorded data; see the module docstring."""

    prefix: str
    env: dict[str, str]
    log_dir: Path
    workers: list[Worker] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.app: Celery = make_app(self.env, current=False)
        self.recorder: Recorder = self.app.recorder  # type: ignore[attr-defined]
        self._store: SlotStore | None = None
        self._closed = False
        self.extra_queues: set[str] = set()
        #: Exchanges of this fleet's own (declared through ``task_queues``), deleted on an AMQP broker.
        self.extra_exchanges: set[str] = set()

    @property
    def cap_prefix(self) -> str:
        """The prefix of this fleet's slot names (its caps'): the fleet's own prefix, unless it
        shares its caps with another fleet (``CAPS_FLEET_CAP_PREFIX``)."""
        return self.env.get("CAPS_FLEET_CAP_PREFIX") or self.prefix

    # -- workers ------------------------------------------------------------------

    def start(
        self,
        count: int = 1,
        *,
        concurrency: int = 4,
        pool: str = "prefork",
        queues: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        wait: bool = True,
        timeout: float = 60,
    ) -> list[Worker]:
        """Start ``count`` workers (each its own process group); wait until they answer ping.
        ``extra_args`` go to ``celery worker`` (``--max-tasks-per-child=1``, say)."""
        queues = list(queues) or [queue_name(self.prefix)]
        self.extra_queues.update(queues)
        env = {**os.environ, **self.env, **(extra_env or {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        started = []
        for _ in range(count):
            index = len(self.workers)
            name = f"w{index}-{self.prefix}@%h"
            command = [
                sys.executable, "-m", "celery", "-A", "tests.integration.fleetapp", "worker",
                "-P", pool, "-c", str(concurrency), "-n", name, "-Q", ",".join(queues), "-l", "INFO",
                "--without-gossip", "--without-mingle", "--without-heartbeat", *extra_args,
            ]  # fmt: skip
            stdout_path = self.log_dir / f"w{index}.out.log"
            stderr_path = self.log_dir / f"w{index}.err.log"
            with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
                process = subprocess.Popen(
                    command,
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=stdout,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            worker = Worker(name.replace("%h", os.uname().nodename), process, stdout_path, stderr_path)
            self.workers.append(worker)
            started.append(worker)
        if wait:
            self.wait_ready(started, timeout=timeout)
        return started

    def ping(self, workers: Iterable[Worker]) -> set[str]:
        """Names of ``workers`` that answer ``app.control.ping``."""
        names = [worker.name for worker in workers]
        replies = self.app.control.ping(destination=names, timeout=0.5)
        return {name for reply in replies for name in reply}

    def wait_ready(self, workers: Sequence[Worker], timeout: float = 60) -> None:
        """Wait until every worker answers ping; fail early if one exits."""

        def ready() -> bool:
            for worker in workers:
                if not worker.alive():
                    raise AssertionError(f"worker {worker.name} exited before it was ready\n{worker.tail()}")
            return self.ping(workers) >= {worker.name for worker in workers}

        wait_for(ready, timeout, lambda: "workers not ready\n" + self.tails(workers), interval=0.2)

    def stop(self, workers: Sequence[Worker] | None = None, timeout: float = 30) -> None:
        """Warm shutdown (TERM to the main process); KILL the whole group after ``timeout`` seconds."""
        workers = list(self.workers if workers is None else workers)
        for worker in workers:
            if worker.alive():
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            self._kill_group(worker)

    def _kill_group(self, worker: Worker) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.process.wait(timeout=10)

    def kill_main(self, worker: Worker, children: Sequence[int] | None = None) -> Kill:
        """``kill -9`` the worker's main process only; its pool children (``children``, looked
        up when not given) die with it (Celery sets their parent-death signal to SIGKILL):
        checked here."""
        children = list(worker.children() if children is None else children)
        os.kill(worker.pid, signal.SIGKILL)
        worker.process.wait(timeout=10)
        kill = self.mark_killed([worker.pid, *children])
        wait_for(lambda: not any(pid_alive(pid) for pid in children), 10, f"children {children} outlived the kill")
        return kill

    def kill_child(self, pid: int) -> Kill:
        """``kill -9`` one pool child (its worker's main process lives on)."""
        os.kill(pid, signal.SIGKILL)
        kill = self.mark_killed([pid])
        wait_for(lambda: not pid_alive(pid), 10, f"child {pid} survived SIGKILL")
        return kill

    def mark_killed(self, pids: Sequence[int]) -> Kill:
        """End the recorded runs of killed ``pids`` now (Redis clock), atomically."""
        moment, marked = self.recorder.client.eval(
            _MARK_KILLED,
            2,
            self.recorder.key("runs"),
            self.recorder.key("ends"),
            self.recorder.key("live:"),
            *[str(pid) for pid in pids],
        )
        return Kill(float(moment), tuple(pids), int(marked))

    def live_runs(self) -> list[dict[str, Any]]:
        """Runs in progress now: ``{"token", "pid", "task_id", "counters", "start", ...}``."""
        client = self.recorder.client
        tokens: set[bytes] = set()
        for key in client.scan_iter(match=self.recorder.key("live:*")):
            tokens.update(client.hkeys(key))
        live = []
        for token in tokens:
            raw = client.hget(self.recorder.key("runs"), token)
            if raw is not None:
                start, document = raw.decode().split(" ", 1)
                live.append({**json.loads(document), "token": token.decode(), "start": float(start)})
        return live

    def redis_broker_queued(self) -> int:
        """Redis broker only: the messages that wait in this fleet's queues (not taken by a worker)."""
        client = self.recorder.client
        queued = 0
        for queue in self.extra_queues:
            for key in client.scan_iter(match=f"{self.prefix}kombu:{queue}*"):
                if client.type(key) == b"list":
                    queued += client.llen(key)
        return queued

    def redis_broker_idle(self) -> bool:
        """Redis broker only: no message waits in this fleet's queues and none is unacknowledged
        (ETA/countdown messages held by a worker are unacknowledged too)."""
        return not self.redis_broker_queued() and not self.recorder.client.hlen(f"{self.prefix}kombu:unacked")

    def tails(self, workers: Iterable[Worker] | None = None, lines: int = 60) -> str:
        return "\n".join(worker.tail(lines) for worker in (self.workers if workers is None else workers))

    # -- what the tasks recorded -------------------------------------------------

    def received_on(self, worker: Worker) -> set[str]:
        """Task ids ``worker`` received (first deliveries, put-back copies and redeliveries)."""
        members = self.recorder.client.smembers(self.recorder.key(f"received-on:{worker.name}"))
        return {member.decode() for member in members}

    def last_received(self, task_id: str) -> tuple[str, float] | None:
        """Which worker received ``task_id`` last, and when (epoch seconds, this machine's clock)."""
        raw = self.recorder.client.hget(self.recorder.key("last-received"), task_id)
        if raw is None:
            return None
        hostname, moment = raw.decode().rsplit(" ", 1)
        return hostname, float(moment)

    def redis_time(self) -> float:
        seconds, microseconds = self.recorder.client.time()
        return seconds + microseconds / 1e6

    def record(self) -> Record:
        client = self.recorder.client

        def counts(name: str) -> Counter[str]:
            return Counter({key.decode(): int(value) for key, value in client.hgetall(self.recorder.key(name)).items()})

        ends = {key.decode(): float(value) for key, value in client.hgetall(self.recorder.key("ends")).items()}
        completed = {key.decode() for key in client.hkeys(self.recorder.key("completed"))}
        runs = []
        for token, raw in client.hgetall(self.recorder.key("runs")).items():
            start, document = raw.decode().split(" ", 1)
            meta = json.loads(document)
            runs.append(
                Run(
                    token=token.decode(),
                    task_id=meta["task_id"],
                    counters=tuple(meta["counters"]),
                    pid=meta["pid"],
                    start=float(start),
                    end=ends.get(token.decode()),
                    deferrals=meta["deferrals"],
                    hostname=meta["hostname"],
                    completed=token.decode() in completed,
                    dispatch=meta.get("dispatch"),
                    redelivered=bool(meta.get("redelivered")),
                    retries=int(meta.get("retries") or 0),
                )
            )
        peaks = {key: int(value) for key, value in counts("peaks").items()}
        return Record(
            peaks,
            counts("starts"),
            counts("done"),
            counts("received"),
            counts("callbacks"),
            runs,
            counts("redelivered"),
        )

    # -- the slot store -----------------------------------------------------------

    @property
    def store(self) -> SlotStore:
        """A store on the fleet's ``caps_url``, for inspecting ``concurrency_slots``; a handle of
        the fleet's own deployment (its app's settings), as its workers' are."""
        if self._store is None:
            options = CapsSettings.from_conf(self.app.conf).store_options
            self._store = store_from_url(self.env["CAPS_FLEET_CAPS_URL"], options)
        return self._store

    def leases(self, slot: str | None = None) -> list[Lease]:
        """This fleet's leases (live or expired), of one slot name if given (those of every fleet
        sharing its caps)."""
        leases = self.store.leases(slot)
        return [lease for lease in leases if lease.slot.startswith(self.cap_prefix)]

    def wait_all_done(self, task_ids: Collection[str], timeout: float, interval: float = 0.25) -> None:
        """Wait until every task of ``task_ids`` completed at least once; the failure says how many did."""
        wait_for(
            lambda: all(self.record().done[task_id] for task_id in task_ids),
            timeout,
            lambda: self._missing(task_ids),
            interval=interval,
        )

    def _missing(self, task_ids: Collection[str]) -> str:
        """How many of ``task_ids`` completed, and where the store has the others (for a failure)."""
        record = self.record()
        missing = {t for t in task_ids if not record.done[t]}
        text = f"{len(task_ids) - len(missing)} of {len(task_ids)} tasks completed"
        try:
            waiting = [w for w in getattr(self.store, "waiters", list)() if w.task_id in missing]
            leases = [lease for lease in self.leases() if lease.task_id in missing]
        except Exception as exc:  # a diagnostic only: the store may be what failed
            return f"{text} (the store could not be read: {exc})"
        parked = {w.task_id for w in waiting if not w.dispatched}
        dispatched = {w.task_id for w in waiting if w.dispatched}
        held = {lease.task_id for lease in leases}
        return (
            f"{text}; of the rest, in the store: {len(parked)} parked, {len(dispatched)} dispatched, "
            f"{len(held)} holding leases, {len(missing - parked - dispatched - held)} nowhere; "
            f"live leases of the fleet: {self.leases()[:10]}; waiters: {waiting[:10]}"
        )

    def wait_for_expiry(self, timeout: float) -> None:
        """Wait until no lease of this fleet is live (each expired or released)."""
        wait_for(
            lambda: all(lease.expires_in < 0 for lease in self.leases()),
            timeout,
            lambda: f"live leases left: {self.leases()}",
        )

    def sweep_to_sentinels(self) -> int:
        """Sweep, then check that only sentinels are left of this fleet: no lease row, and every
        slot it used has no holder and no expired lease.  Returns the rows the sweep deleted."""
        swept = self.store.sweep()
        assert self.leases() == [], self.leases()
        own = [status for status in self.store.status() if status.slot.startswith(self.cap_prefix)]
        assert own and all(status.holders == 0 and status.expired == 0 for status in own), own
        return swept

    def slot(self, name: str) -> str:
        """The full slot name of ``name`` (``"provider"``, ``"tenant:a"``, ``"one:<scope>"``)."""
        return f"{self.cap_prefix}{name}"

    # -- clean-up -----------------------------------------------------------------

    def close(self) -> None:
        """Kill every worker; delete this fleet's Redis keys, broker queues and slot rows.  Idempotent.

        The test is over, so its workers are killed (SIGKILL to each process group), not shut
        down: Celery's warm shutdown of an idle worker takes about 2.5 s, over the suite's
        fleets several minutes of CI.  The tests of shutdowns stop their workers themselves
        (:meth:`stop`), and what a killed worker leaves is deleted here.
        """
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            self._kill_group(worker)
        client = self.recorder.client
        for pattern in (f"{self.prefix}rec:*", f"{self.prefix}kombu:*", f"{self.prefix}results:*"):
            keys = list(client.scan_iter(match=pattern, count=1000))
            if keys:
                client.delete(*keys)
        self.recorder.close()
        broker = self.env["CAPS_FLEET_BROKER"]
        if broker.startswith("amqp"):
            with self.app.connection_for_write() as connection:
                channel = connection.default_channel
                # Each queue, and the wake queue a worker declares for it (named after it).
                for queue in sorted({*self.extra_queues, *map(wake_queue_name, self.extra_queues)}):
                    channel.queue_delete(queue)
                    channel.exchange_delete(queue)
                own = (f"{self.prefix}celery.pidbox", f"{self.prefix}celeryev", f"{self.prefix}celery")
                for exchange in (*own, *sorted(self.extra_exchanges)):
                    channel.exchange_delete(exchange)
        if self._store is not None:
            delete_slot_rows(self._store, self.cap_prefix)
            self._store.close()
        elif self.env.get("CAPS_FLEET_CAPS_URL"):
            # A test that never read its store leaves its slots' rows all the same (sentinels; on
            # Redis, fields of the shared limits hash): deleted too, if the store answers now (a
            # chaos test may have left it down: its rows are then its own database's, or expire).
            with contextlib.suppress(Exception):
                store = self.store  # one attempt to reach it, not one per step
                try:
                    delete_slot_rows(store, self.cap_prefix)
                finally:
                    store.close()
        close_client_app(self.app)


def delete_slot_rows(store: SlotStore, prefix: str) -> None:
    """Delete every lease and sentinel whose slot name starts with ``prefix`` (SQL or Redis store),
    and the limits operators set for them (and, on Redis, the history's events of those slots
    alone), and take the tasks still waiting for those slots off the waiting list."""
    from celery_caps.stores.redis import RedisStore
    from celery_caps.stores.sql import SQLStore, concurrency_slots, concurrency_waiters

    if isinstance(store, ParkingStore):
        for task_id in sorted({waiter.task_id for waiter in store.waiters() if waiter.slot.startswith(prefix)}):
            store.forget(task_id, 30.0)
    for name in store.limits():  # set by an operator (celery caps limit)
        if name.startswith(prefix):
            store.set_limit(name, None)
    if isinstance(store, RedisStore):
        # Lease keys vanish once empty; the sentinels are fields of the "<key prefix>:limits" hash.
        client, limits = store.client, f"{store.key_prefix}:limits"
        fields = [name for name, _ in client.hscan_iter(limits, match=f"{prefix}*")]
        if fields:
            client.hdel(limits, *fields)
        # ... and the keyed ones are members of the "<key prefix>:keyed" sorted set, with its
        # marker '' (complete), which goes with the last name.
        keyed = f"{store.key_prefix}:keyed"
        names = [name for name, _ in client.zscan_iter(keyed, match=f"{prefix}*")]
        if names:
            client.zrem(keyed, *names)
        if client.zrange(keyed, 0, 1) in ([], [b""]):
            client.delete(keyed)
        # ... and the history's events of those slots alone (a limit set by a test is recorded
        # there), members of the "<key prefix>:history" sorted set.
        history = f"{store.key_prefix}:history"
        events = [
            event
            for event, _ in client.zscan_iter(history)
            if (slots := json.loads(event).get("slots")) and all(slot.startswith(prefix) for slot in slots)
        ]
        if events:
            client.zrem(history, *events)
    if isinstance(store, SQLStore):
        # On MySQL/MariaDB the name columns are VARBINARY: compare bytes.
        pattern = store.dialect.exact(prefix)
        with store.engine.begin() as connection:
            connection.execute(concurrency_slots.delete().where(concurrency_slots.c.slot.startswith(pattern)))
            connection.execute(concurrency_waiters.delete().where(concurrency_waiters.c.slot.startswith(pattern)))


def over_cap(record: Record, counter: str, limit: int, *, distinct: bool = False) -> list[tuple[float, int]]:
    """The moments (Redis clock) when more than ``limit`` runs (or task ids) of ``counter`` were live."""
    return [(moment, level) for moment, level in record.concurrency(counter, distinct=distinct) if level > limit]


# -- the mixed workload of the fleet and crash tests ---------------------------------

#: Tenants and their share of the tasks: deliberately uneven.
TENANT_WEIGHTS = {"a": 0.4, "b": 0.3, "c": 0.2, "d": 0.1}


@dataclass(frozen=True)
class Job:
    """One task of a workload: which task, for which tenant, how long its body sleeps."""

    task: str  # "fleet.both" (provider + tenant caps) or "fleet.tenant_only"
    tenant: str
    ms: int

    @property
    def counters(self) -> tuple[str, ...]:
        tenant = f"tenant:{self.tenant}"
        return ("provider", tenant) if self.task == "fleet.both" else (tenant,)


def mixed_workload(count: int, seed: int, both_share: float = 0.6, ms_range: tuple[int, int] = (50, 150)) -> list[Job]:
    """``count`` jobs over the tenants of :data:`TENANT_WEIGHTS`, ``both_share`` of them also
    holding the provider cap; bodies sleep ``ms_range`` milliseconds (uniform)."""
    import random

    rng = random.Random(seed)
    tenants = list(TENANT_WEIGHTS)
    weights = list(TENANT_WEIGHTS.values())
    return [
        Job(
            "fleet.both" if rng.random() < both_share else "fleet.tenant_only",
            rng.choices(tenants, weights)[0],
            rng.randint(*ms_range),
        )
        for _ in range(count)
    ]


def send_workload(fleet: Fleet, jobs: Sequence[Job]) -> dict[str, Job]:
    """Publish every job; returns them by task id."""
    sent = {}
    for job in jobs:
        result = fleet.app.send_task(job.task, args=[job.tenant, job.ms])
        sent[result.id] = job
    return sent


# -- a store that goes away and comes back -------------------------------------------------


class TcpProxy:
    """A TCP forwarder to ``target`` on a local port that can be closed and reopened.

    Closed, the port refuses connections (and existing ones are cut), as a database
    server that is down; open, it forwards byte for byte; paused, it holds every byte
    (connections stay up, nothing is answered), as a server that hangs.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port: int = probe.getsockname()[1]
        probe.close()
        self._listener: Any = None
        self._connections: list[Any] = []
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            # shutdown() first: close() alone neither wakes a pump blocked in recv() on the
            # socket nor sends the peer a FIN, which would leave the client waiting for ever.
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                connection.close()
        self._flowing.set()  # pumps held by a pause end on the closed sockets

    def pause(self) -> None:
        """Hold the bytes of every connection until :meth:`resume`."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def _accept(self, listener: Any) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # closed while this one was connecting
                    client.close()
                    upstream.close()
                    continue
                self._connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: Any, sink: Any) -> None:
        try:
            while data := source.recv(65536):
                self._flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()
