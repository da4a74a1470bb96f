"""What a worker says at start about its slot store (a real ``celery worker`` subprocess)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.services import require_service

pytestmark = [pytest.mark.memory]

#: The root of this tree: its celery_caps is the one a worker started here imports.
REPO_ROOT = Path(__file__).resolve().parents[2]

APP = textwrap.dedent(
    """
    from celery import Celery
    from celery_caps import Cap, CappedTask

    app = Celery("memoryapp", broker="memory://")
    app.conf.caps_url = "memory://"

    @app.task(base=CappedTask, cap=Cap("start-check", 1))
    def capped():
        return 1
    """
)


def worker_start_output(tmp_path: Path, app_source: str, until: str, *, loglevel: str = "warning") -> str:
    """Start ``celery -A startapp worker`` (solo pool) on ``app_source``, with this tree's
    celery_caps; its output up to the first line containing ``until`` (or a minute, even if the
    worker goes quiet), then stop it."""
    (tmp_path / "startapp.py").write_text(app_source)
    path = [str(tmp_path), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "startapp", "worker", "-P", "solo", "-l", loglevel],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert worker.stdout is not None
        for line in worker.stdout:
            lines.put(line)
        lines.put("")  # the end of its output

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    output = ""
    try:
        deadline = time.monotonic() + 60
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if not line:
                break
            output += line
            if until in line:
                break
    finally:
        stop(worker)
        reader.join(timeout=5)
        if worker.stdout is not None:
            worker.stdout.close()
    return output


def stop(process: subprocess.Popen[Any], timeout: float = 20) -> None:
    """Stop ``process`` (SIGTERM, then SIGKILL after ``timeout`` seconds) and reap it."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_a_worker_on_the_memory_store_warns_that_it_caps_nothing_across_processes(tmp_path: Path) -> None:
    # Given an app whose caps_url is memory://
    # When a worker starts on it
    output = worker_start_output(tmp_path, APP, until="caps_url is memory://")
    # Then it says plainly that such caps hold per process only
    assert "caps_url is memory://, which caps each worker process on its own" in output, output


@pytest.mark.redis
def test_a_worker_parking_on_a_redis_server_without_an_append_only_file_warns_that_a_restart_loses_waiters(
    tmp_path: Path,
) -> None:
    # Given an app that parks (the default) on a Redis store whose server keeps no append-only
    # file (the test server runs with appendonly no)
    app = APP.replace('app.conf.caps_url = "memory://"', f"app.conf.caps_url = {require_service('redis')!r}")
    # When a worker starts on it
    output = worker_start_output(tmp_path, app, until="parked tasks can be lost")
    # Then it warns, naming the setting to change and the strategy that avoids the loss
    assert "parked tasks can be lost: the Redis server at redis://" in output, output
    assert "appendonly no" in output and "caps_strategy='backoff'" in output, output


# -- a worker refuses to start on a mistake it would otherwise keep quiet about ---------------------


def worker_exit(tmp_path: Path, app_source: str, timeout: float = 60) -> tuple[int | None, str]:
    """Start ``celery -A startapp worker`` (solo pool) on ``app_source``; its exit status and output
    once it exits, or (None, output so far) if it is still running after ``timeout`` seconds
    (then it is stopped)."""
    (tmp_path / "startapp.py").write_text(app_source)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "startapp", "worker", "-P", "solo", "-l", "warning"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code: int | None = worker.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return code, log_path.read_text(errors="replace")


UNCAPPED_APP = textwrap.dedent(
    """
    from celery import Celery
    from celery_caps import Cap

    app = Celery("startapp", broker="memory://")
    {settings}

    @app.task(cap=Cap("forgot-the-base", 1))
    def forgot_the_base():
        return 1

    @app.task
    def plain():
        return 2
    """
)


@pytest.mark.parametrize(
    "settings",
    ["app.conf.caps_url = 'memory://'", "pass  # caps not configured at all"],
    ids=["caps-configured", "caps-not-configured"],
)
def test_a_worker_refuses_to_start_with_a_task_given_a_cap_without_the_capped_base(
    tmp_path: Path, settings: str
) -> None:
    # Given an app whose task says cap=... but not base=CappedTask (Celery keeps the unknown
    # option as a class attribute, and would run the task uncapped)
    # When a worker starts on it
    code, output = worker_exit(tmp_path, UNCAPPED_APP.format(settings=settings))
    # Then it refuses to start, in one line naming the task and the fix (no traceback)
    assert code not in (None, 0), output
    assert "Traceback" not in output, output
    assert "task(s) startapp.forgot_the_base declare cap= without base=CappedTask" in output, output
    assert "@app.task(base=CappedTask, cap=...)" in output, output
    [message] = {line for line in output.splitlines() if "declare cap=" in line}
    assert "startapp.plain" not in message, output


def test_a_worker_without_caps_url_shows_an_absolute_sqlite_path_as_an_example(tmp_path: Path) -> None:
    # Given an app with a capped task and no caps_url
    app = APP.replace('app.conf.caps_url = "memory://"', "")
    # When a worker starts on it
    code, output = worker_exit(tmp_path, app)
    # Then it refuses, and its example of a SQLite URL is an absolute path (four slashes)
    assert code not in (None, 0), output
    assert "caps_url is not set" in output, output
    assert "'sqlite:////absolute/path/caps.db'" in output, output


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("postgresql+pyscopg://user@127.0.0.1/db", "postgresql+pyscopg"),
        ("mysql+pymsql://root@127.0.0.1/db", "mysql+pymsql"),
    ],
    ids=["postgresql+pyscopg", "mysql+pymsql"],
)
def test_a_worker_with_a_mistyped_database_driver_gets_a_hint(tmp_path: Path, url: str, driver: str) -> None:
    # Given an app whose caps_url misspells its driver
    app = APP.replace('app.conf.caps_url = "memory://"', f"app.conf.caps_url = {url!r}")
    # When a worker starts on it
    code, output = worker_exit(tmp_path, app)
    # Then it refuses, saying the driver is unknown (a typo?) and which drivers are tested
    assert code not in (None, 0), output
    assert f"unknown database driver {driver!r} (a typo?)" in output, output
    assert "postgresql+psycopg, mysql+pymysql, sqlite+pysqlite" in output, output
