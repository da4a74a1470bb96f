"""What a worker says at start about its slot store (a real ``celery worker`` subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.services import require_service

pytestmark = [pytest.mark.memory]

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


def worker_start_output(tmp_path: Path, app_source: str, until: str) -> str:
    """Start ``celery -A startapp worker`` (solo pool) on ``app_source``; its output up to the
    first line containing ``until`` (or a minute), then stop it."""
    (tmp_path / "startapp.py").write_text(app_source)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "startapp", "worker", "-P", "solo", "-l", "warning"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = ""
    try:
        deadline = time.monotonic() + 60
        assert worker.stdout is not None
        while time.monotonic() < deadline:
            line = worker.stdout.readline()
            if not line:
                break
            output += line
            if until in line:
                break
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        if worker.stdout is not None:
            worker.stdout.close()
    return output


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
