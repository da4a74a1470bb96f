"""A real ``celery worker`` of :mod:`tests.integration.opsapp`, for the operator-tooling tests.

The worker runs in its own process group with its log in a file; :meth:`OpsWorker.close`
stops it (TERM, then KILL of the group) and deletes the test's broker, result and slot keys.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery

from tests.integration.fleet import delete_slot_rows
from tests.integration.opsapp import make_app
from tests.services import close_client_app

REPO_ROOT = Path(__file__).resolve().parents[2]
_T = TypeVar("_T")


def wait_for(condition: Callable[[], _T], timeout: float, what: str | Callable[[], str]) -> _T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s: {what() if callable(what) else what}")
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class OpsWorker:
    """One worker subprocess plus a client app with the same configuration."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.prefix = env["CAPS_OPS_PREFIX"]
        self.log_path = log_dir / "worker.log"
        self.app: Celery = make_app(env, current=False)
        self.process: subprocess.Popen[bytes] | None = None
        self.name = f"ops-{self.prefix}@{os.uname().nodename}"

    def start(self, *options: str, pool: str = "prefork", concurrency: int = 2, timeout: float = 60) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        command = [
            sys.executable, "-m", "celery", "-A", "tests.integration.opsapp", "worker", "-P", pool,
            "-c", str(concurrency), "-n", self.name, "-Q", f"{self.prefix}q", "-l", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat", *options,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log()}")
            return bool(self.app.control.ping(destination=[self.name], timeout=0.5))

        wait_for(ready, timeout, lambda: f"worker not ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send(self, name: str, *args: Any, **options: Any) -> Any:
        return self.app.send_task(name, args=list(args), **options)

    def flag(self, name: str) -> str:
        """A Redis key (on the broker) that ``ops.hold_until`` waits for."""
        return f"{self.prefix}results:flag:{name}"

    def open_flag(self, name: str) -> None:
        import redis

        client = redis.Redis.from_url(self.env["CAPS_OPS_BROKER"])
        try:
            client.set(self.flag(name), 1, ex=600)
        finally:
            client.close()

    def stop(self, timeout: float = 20) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def close(self, redis_url: str, store: Any = None) -> None:
        self.stop()
        import redis

        client = redis.Redis.from_url(redis_url)
        try:
            for pattern in (f"{self.prefix}kombu:*", f"{self.prefix}results:*"):
                keys = list(client.scan_iter(match=pattern, count=1000))
                if keys:
                    client.delete(*keys)
        finally:
            client.close()
        if store is not None:
            delete_slot_rows(store, self.prefix)
        close_client_app(self.app)


def ops_env(prefix: str, *, broker: str, caps_url: str, backend: str | None = None, **extra: str) -> dict[str, str]:
    env = {"CAPS_OPS_PREFIX": prefix, "CAPS_OPS_BROKER": broker, "CAPS_OPS_CAPS_URL": caps_url}
    if backend is not None:
        env["CAPS_OPS_BACKEND"] = backend
    env.update({f"CAPS_OPS_{name.upper()}": value for name, value in extra.items()})
    return env


def task_ids(results: Sequence[Any]) -> list[str]:
    return [result.id for result in results]
