"""What a worker says at start about its slot store (a real ``celery worker`` subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

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


def test_a_worker_on_the_memory_store_warns_that_it_caps_nothing_across_processes(tmp_path: Path) -> None:
    # Given an app whose caps_url is memory://
    (tmp_path / "memoryapp.py").write_text(APP)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # When a worker starts on it
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "memoryapp", "worker", "-P", "solo", "-l", "warning"],
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
            if "caps_url is memory://" in line:
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
    # Then it says plainly that such caps hold per process only
    assert "caps_url is memory://, which caps each worker process on its own" in output, output
