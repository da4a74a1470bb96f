"""The demo (``examples/demo/demo.py``) run for real: its own workers, filesystem broker and SQLite
store in a folder of the test's own; what it prints while it runs and at the end, in a newcomer's
words."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fleet, pytest.mark.sqlite]

REPO_ROOT = Path(__file__).resolve().parents[2]
TASKS = 16


def test_the_demo_says_how_many_tasks_had_to_wait_for_a_free_slot(tmp_path: Path) -> None:
    # Given the demo with two workers of three pool processes and a burst of tasks (caps 4 and 2 per
    # tenant). Six processes on a global cap of 4: two of the first six tasks find it full whatever
    # the order of delivery. With four processes only a tenant's cap can turn a task away, and
    # whether one does depends on which process takes which task when (CI saw 0 of 16 once).
    env = {name: value for name, value in os.environ.items() if not name.startswith("CAPS_DEMO_")}
    command = [
        sys.executable, str(REPO_ROOT / "examples" / "demo" / "demo.py"), "--plain", "--tasks", str(TASKS),
        "--workers", "2", "--concurrency", "3", "--data-dir", str(tmp_path / "data"),
    ]  # fmt: skip
    # When it runs to the end
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # Then its live lines count tasks waiting for a free slot, not "put back" deliveries
    live = [line for line in done.stdout.splitlines() if line.startswith("running:")]
    assert live and all("waiting for a free slot" in line and "had to wait so far" in line for line in live), output
    # and its closing lines say how many tasks had to wait, and what the deliveries were
    waited = re.search(rf"tasks that had to wait for a free slot before they ran: (\d+) of {TASKS}", output)
    delivered = re.search(rf"deliveries of a task to a worker: (\d+) for {TASKS} tasks \(a task that found", output)
    assert waited and delivered, output
    # (each task that waited was delivered once more at least: when woken)
    assert 1 <= int(waited.group(1)) <= TASKS and int(delivered.group(1)) >= TASKS + int(waited.group(1)), output
    assert "caps_deferrals" not in output and "put back" not in output, output


def test_the_demo_under_backoff_runs_every_task_once_within_the_caps(tmp_path: Path) -> None:
    # The same real fleet (two workers of three pool processes, SQLite store, broker on files: no
    # server) with caps_strategy "backoff": a task that finds its cap full goes back to the broker.
    env = {name: value for name, value in os.environ.items() if not name.startswith("CAPS_DEMO_")}
    command = [
        sys.executable, str(REPO_ROOT / "examples" / "demo" / "demo.py"), "--plain", "--tasks", str(TASKS),
        "--workers", "2", "--concurrency", "3", "--strategy", "backoff", "--data-dir", str(tmp_path / "data"),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    # Then the demo's own checks hold: each task completed once, the peak within the global cap of
    # 4 (six pool processes could have run six), each tenant within 2, no lease left
    assert done.returncode == 0, output
    assert f"tasks completed exactly once: {TASKS}/{TASKS}" in output, output
    peak = re.search(r"overall peak running: (\d+) \(global cap 4\)", output)
    assert peak and int(peak.group(1)) <= 4, output
    assert "leases of this run left in the store: 0" in output, output
    assert "went back to the queue" in output, output


@pytest.mark.parametrize("strategy", ["park", "backoff"])
def test_the_demo_with_a_pool_process_killed_mid_run_runs_its_task_again_within_the_caps(
    tmp_path: Path, strategy: str
) -> None:
    # The same serverless fleet, and a pool process killed with SIGKILL while it runs a task (as the
    # OOM killer would): its worker releases the run's slots and gives the message back (acks late,
    # reject on worker lost), so the task runs again.  The kill ends that run for the peaks.
    env = {name: value for name, value in os.environ.items() if not name.startswith("CAPS_DEMO_")}
    command = [
        sys.executable, str(REPO_ROOT / "examples" / "demo" / "demo.py"), "--plain", "--tasks", str(TASKS),
        "--workers", "2", "--concurrency", "3", "--strategy", strategy, "--crash", "--data-dir", str(tmp_path / "data"),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    # Then one run was killed mid-run, its task started twice and completed once
    killed = re.findall(
        r"pool process \d+ killed mid-run \(--crash\): its task \S+ started (\d+) times and completed (\d+)", output
    )
    assert killed == [("2", "1")], output
    # and the demo's own checks hold: every task completed once, no other task started twice, the
    # peak within the global cap of 4, no lease left (the killed run's slots were given back)
    assert done.returncode == 0, output
    assert f"tasks completed exactly once: {TASKS}/{TASKS}" in output, output
    peak = re.search(r"overall peak running: (\d+) \(global cap 4\)", output)
    assert peak and int(peak.group(1)) <= 4, output
    assert "leases of this run left in the store: 0" in output, output
