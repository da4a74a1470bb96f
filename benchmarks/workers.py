"""Real ``celery worker`` subprocesses of :mod:`benchmarks.benchapp`, and the broker-side counting.

A :class:`BenchFleet` starts workers (each in its own process group, logs in
files), fills a fresh queue with a backlog while nobody consumes it, then tells
the workers to consume it and watches the broker (Redis) until every message is
acknowledged.  Nothing runs in the task bodies for this: the overhead benchmark's
tasks are bare.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery.signals import before_task_publish

import celery_caps

from .benchapp import ENV, PUBLISHED_HEADER, make_app, side_keys
from .common import REPO_ROOT


@dataclass
class WorkerProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def pool_pids(self) -> list[int]:
        """The worker's child processes now (its pool processes, for prefork)."""
        return child_pids(self.process.pid)

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:] if self.log_path.exists() else []
        return f"----- {self.name} (exit {self.process.poll()}) -----\n" + "\n".join(text)


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid``, from ``/proc`` (any thread's children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.extend(int(child) for child in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass
class Drain:
    """How one backlog was consumed, as the broker saw it."""

    messages: int
    #: Seconds from the first message taken off the queue to the last one acknowledged.
    seconds: float
    completed: bool

    @property
    def throughput(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else float("nan")


def fleet_env(broker: str, caps_url: str, prefix: str, **settings: object) -> dict[str, str]:
    """The environment of a benchmark fleet: the app's defaults (:data:`benchapp.ENV`), one Redis
    as broker and side channel, the store, the key prefix, and ``settings`` by their names
    without ``CAPS_BENCH_`` (``GLOBAL_LIMIT=4`` sets ``CAPS_BENCH_GLOBAL_LIMIT``)."""
    env = dict(ENV)
    env.update(
        {
            "CAPS_BENCH_BROKER": broker,
            "CAPS_BENCH_SIDE_URL": broker,
            "CAPS_BENCH_CAPS_URL": caps_url,
            "CAPS_BENCH_PREFIX": prefix,
        }
    )
    env.update({f"CAPS_BENCH_{name}": str(value) for name, value in settings.items()})
    return env


@dataclass
class BenchFleet:
    """Workers of one configuration (``env``), a client app, and the Redis they share."""

    env: dict[str, str]
    log_dir: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = self.env["CAPS_BENCH_PREFIX"]
        self.app = make_app(self.env)
        self.redis = redis.Redis.from_url(self.env["CAPS_BENCH_SIDE_URL"])
        self.broker_redis = redis.Redis.from_url(self.env["CAPS_BENCH_BROKER"])
        self.keys = side_keys(self.prefix)
        self._queue_number = 0
        self.last_fill_published = 0

    # -- workers ------------------------------------------------------------------

    def start(self, count: int, concurrency: int, pool: str = "prefork", timeout: float = 90) -> None:
        env = {**os.environ, **self.env, "CAPS_BENCH_WORKER": "1", "PYTHONUNBUFFERED": "1"}
        # The repository last: a PYTHONPATH given to run.py (say, a snapshot of celery_caps) wins.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        started = []
        for _ in range(count):
            index = len(self.workers)
            name = f"w{index}-{self.prefix}@{os.uname().nodename}"
            command = [
                sys.executable, "-m", "celery", "-A", "benchmarks.benchapp", "worker",
                "-P", pool, "-c", str(concurrency), "-n", name, "-Q", f"{self.prefix}idle", "-l", "WARNING",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ]  # fmt: skip
            log_path = self.log_dir / f"{self.prefix}w{index}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    command,
                    # Not the repository: ``python -m`` puts the working directory first on
                    # sys.path, which would shadow a celery_caps snapshot on PYTHONPATH.
                    cwd=self.log_dir,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            worker = WorkerProcess(name, process, log_path)
            self.workers.append(worker)
            started.append(worker)

        def ready() -> bool:
            for worker in started:
                if not worker.alive():
                    raise RuntimeError(f"worker exited before it was ready\n{worker.tail()}")
            replies = self.app.control.ping(destination=[worker.name for worker in started], timeout=0.5)
            return {name for reply in replies for name in reply} >= {worker.name for worker in started}

        wait_for(ready, timeout, "workers to answer ping", interval=0.2)
        # The workers must measure the same celery_caps as this process.
        import celery_caps

        theirs = self.redis.get(self.keys["library"])
        ours = str(Path(celery_caps.__file__).resolve())
        if theirs is None or theirs.decode() != ours:
            raise RuntimeError(f"the workers import celery_caps from {theirs!r}, the benchmark from {ours!r}")

    def stop(self, timeout: float = 20) -> None:
        for worker in self.workers:
            if worker.alive():
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=10)
        self.workers = []

    def close(self) -> None:
        self.stop()
        for key in self.broker_redis.scan_iter(match=f"{self.prefix}*", count=1000):
            self.broker_redis.delete(key)
        for key in self.redis.scan_iter(match=f"{self.prefix}*", count=1000):
            self.redis.delete(key)
        self.redis.close()
        self.broker_redis.close()

    # -- queues -------------------------------------------------------------------

    def new_queue(self) -> str:
        self._queue_number += 1
        return f"{self.prefix}q{self._queue_number}"

    def fill(self, queue: str, task_name: str, calls: Sequence[tuple[Any, ...]]) -> float:
        """Send one task per ``calls`` entry to ``queue`` with ``apply_async``; returns seconds.

        :attr:`last_fill_published` is how many of them reached the broker (with the park
        strategy, a task sent while its cap is full waits in the store instead).
        """
        task = self.app.tasks[task_name]
        published = 0

        def count(sender: Any = None, **_: Any) -> None:
            nonlocal published
            if sender == task_name:
                published += 1

        # The sending process connects to the store before the burst, as a long-running one
        # (a web process warmed up after it forks) has: a first send's connection and schema
        # check (tens of milliseconds) would otherwise start one trial's burst late.
        celery_caps.warm_up(self.app)
        before_task_publish.connect(count, weak=False)
        started = time.perf_counter()
        try:
            with self.app.producer_or_acquire() as producer:
                for args in calls:
                    task.apply_async(args, queue=queue, headers={PUBLISHED_HEADER: time.time()}, producer=producer)
        finally:
            before_task_publish.disconnect(count)
        self.last_fill_published = published
        return time.perf_counter() - started

    def _control(self, command: str, queue: str) -> None:
        destination = [worker.name for worker in self.workers]
        method = getattr(self.app.control, command)
        replies = method(queue, destination=destination, reply=True, timeout=5)
        if len(replies) < len(destination):
            raise RuntimeError(f"{command}({queue}): only {len(replies)} of {len(destination)} workers answered")

    def consume(self, queue: str) -> None:
        self._control("add_consumer", queue)

    def stop_consuming(self, queue: str) -> None:
        self._control("cancel_consumer", queue)

    def _queue_keys(self, queue: str) -> list[str]:
        base = f"{self.prefix}kombu:{queue}"
        # kombu's Redis transport keeps one list per priority step next to the plain one.
        return [base] + [f"{base}\x06\x16{priority}" for priority in range(1, 10)]

    def waiting(self, queue: str) -> tuple[int, int]:
        """Messages in ``queue`` and messages delivered but not acknowledged (all queues)."""
        pipe = self.broker_redis.pipeline(transaction=False)
        for key in self._queue_keys(queue):
            pipe.llen(key)
        pipe.hlen(f"{self.prefix}kombu:unacked")
        *lengths, unacked = pipe.execute()
        return sum(lengths), unacked

    def drain(self, queue: str, messages: int, timeout: float) -> Drain:
        """Let the workers consume ``queue``; time it from the first take to the last acknowledgement."""
        self.consume(queue)
        deadline = time.monotonic() + timeout
        first_take: float | None = None
        while True:
            queued, unacked = self.waiting(queue)
            now = time.monotonic()
            if first_take is None and queued < messages:
                first_take = now
            if queued == 0 and unacked == 0:
                completed = True
                break
            if now >= deadline:
                completed = False
                break
            time.sleep(0.002)
        end = time.monotonic()
        self.stop_consuming(queue)
        return Drain(messages, end - (first_take or end), completed)

    # -- what the workers recorded ----------------------------------------------------

    def worker_publishes(self) -> int:
        return sum(int(value) for value in self.redis.hvals(self.keys["publishes"]))

    def runs(self) -> list[dict[str, Any]]:
        runs = []
        for raw in self.redis.lrange(self.keys["runs"], 0, -1):
            task_id, tenant, published, start, end, deferrals, pid, via = raw.decode().split(" ")
            runs.append(
                {
                    "task_id": task_id,
                    "tenant": tenant,
                    "published": float(published),
                    "start": float(start),
                    "end": float(end),
                    "deferrals": int(deferrals),
                    "pid": int(pid),
                    "via": via,
                }
            )
        return runs

    def reset_records(self) -> None:
        self.redis.delete(*self.keys.values())

    def tails(self, workers: Iterable[WorkerProcess] | None = None) -> str:
        return "\n".join(worker.tail() for worker in (workers or self.workers))
