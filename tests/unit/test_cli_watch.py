"""``celery caps watch`` whose output is not a terminal (a log, a pipe, CI): it prints each
refresh as it happens, through the real ``celery`` executable with its output in a pipe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sqlite]

APP = textwrap.dedent(
    """
    from celery import Celery
    from celery_caps import Cap, CappedTask

    app = Celery("watchapp", broker="memory://")
    app.conf.caps_url = {caps_url!r}

    @app.task(base=CappedTask, cap=Cap("watched-cap", 3))
    def capped():
        return 1
    """
)


def test_watch_into_a_pipe_prints_every_refresh_while_it_runs(tmp_path: Path) -> None:
    # Given an app with a cap, and `celery caps watch` whose output goes to a pipe
    (tmp_path / "watchapp.py").write_text(APP.format(caps_url=f"sqlite:///{tmp_path}/caps.db"))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    watch = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "watchapp", "caps", "watch", "--interval", "0.2"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(watch.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        # When it has run for a while (it never ends by itself)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum("watched-cap" in line for line in list(lines)) < 3:
            assert watch.poll() is None, "".join(lines)
            time.sleep(0.1)
        # Then every refresh so far was printed: the cap's line, once per refresh, with its stamp
        output = "".join(lines)
        assert sum("watched-cap" in line for line in lines) >= 3, output
        assert output.count("Ctrl-C to quit") >= 3, output
        assert "\x1b[" not in output, output  # plain text: no cursor movement, no colours
    finally:
        watch.terminate()
        watch.wait(timeout=20)
        reader.join(10)
        assert watch.stdout is not None
        watch.stdout.close()
