"""Run Celery's own integration suite with every task of its test app capped.

Takes ``t/integration`` from the sdist of the Celery version installed, and runs it with the
plugin beside this file (``caps_suite_plugin.py``) in one or more modes:

``uncapped``
    no caps: Celery's suite as Celery runs it (the reference)
``loose``
    every task under one cap of 100000, which never binds: must behave as ``uncapped``
``binding``
    every task under one cap of 2, with a pool of 4: must neither stall nor deadlock

Redis is the broker, the result backend and the Redis of Celery's test helpers, in a database of
its own (``CAPS_SUITE_REDIS_URL``, default ``redis://127.0.0.1:6379/11``) that must be empty
before a run and is flushed after it.  The slot store is a SQLite file per run: the embedded
worker's pool is prefork, so its processes must share a store (``memory://`` would cap each
process on its own).

Usage (from the repository's root)::

    python tests/celery_suite/run.py                      # the CI subset, in every mode
    python tests/celery_suite/run.py --all --mode binding # the whole suite (about 20 minutes a mode)
    python tests/celery_suite/run.py -- -x -k retry       # arguments after -- go to pytest

Exits 0 when every run passed (skips aside) and each capped run's report is sound: tasks took
leases, the peak never passed the limit, no lease or waiting entry was left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
MODES = {"uncapped": None, "loose": 100_000, "binding": 2}
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/11"
#: Seconds one test may take before pytest-timeout fails it (a stall shows up as a failure).
TEST_TIMEOUT_SECONDS = 120


def say(message: str) -> None:
    print(f"[celery-suite {time.strftime('%H:%M:%S')}] {message}", flush=True)


def celery_tests(cache_dir: Path) -> Path:
    """A directory holding ``t/`` and ``pyproject.toml`` of the installed Celery's sdist (only those:
    the installed ``celery`` package is the one under test, not the sdist's copy)."""
    celery_version = version("celery")
    target = cache_dir / f"celery-{celery_version}"
    if (target / "t" / "integration" / "conftest.py").exists():
        return target
    with tempfile.TemporaryDirectory() as download_dir:
        say(f"downloading the sdist of celery {celery_version}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"celery=={celery_version}", "-d", download_dir],
            check=True,
        )  # fmt: skip
        (archive,) = Path(download_dir).glob("celery-*.tar.gz")
        unpacked = Path(download_dir) / "unpacked"
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        (root,) = unpacked.iterdir()
        staging = cache_dir / f".celery-{celery_version}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copytree(root / "t", staging / "t")
        shutil.copy2(root / "pyproject.toml", staging / "pyproject.toml")
        staging.rename(target)
    return target


def redis_client(url: str):  # type: ignore[no-untyped-def]
    import redis

    return redis.Redis.from_url(url)


@dataclass
class Run:
    mode: str
    attempt: int
    seconds: float = 0.0
    exit_code: int = 0
    outcomes: dict[str, str] = field(default_factory=dict)
    caps: dict[str, object] | None = None

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)

    def summary(self) -> str:
        counts = ", ".join(f"{self.count(outcome)} {outcome}" for outcome in ("passed", "failed", "error", "skipped"))
        return f"{self.mode} #{self.attempt}: {counts} in {self.seconds:.0f} s (pytest exit {self.exit_code})"

    def caps_problems(self) -> list[str]:
        if self.caps is None:
            return [] if MODES[self.mode] is None else ["no caps report"]
        problems = []
        limit = MODES[self.mode]
        if not self.caps.get("capped_runs"):
            problems.append("no task took a lease")
        if limit is not None and int(self.caps.get("peak_overlap", 0)) > limit:  # type: ignore[call-overload]
            problems.append(f"peak {self.caps['peak_overlap']} > limit {limit}")
        for key in ("leases_left", "waiting_left"):
            if self.caps.get(key):
                problems.append(f"{key}: {self.caps[key]}")
        return problems


def outcomes_from_junit(path: Path) -> dict[str, str]:
    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                # A failure in teardown comes as an error after a pass: keep the worst.
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                if outcome != "skipped":
                    break
        outcomes[name] = outcome
    return outcomes


def run_mode(tests_dir: Path, mode: str, attempt: int, args: argparse.Namespace, pytest_args: list[str]) -> Run:
    client = redis_client(args.redis_url)
    if client.dbsize():
        raise SystemExit(f"{args.redis_url} is not empty: use an unused database (CAPS_SUITE_REDIS_URL)")
    limit = MODES[mode]
    run = Run(mode, attempt)
    with tempfile.TemporaryDirectory(prefix="celery-suite-") as work:
        junit = Path(work) / "junit.xml"
        report = Path(work) / "caps.json"
        env = {
            **os.environ,
            "TEST_BROKER": args.redis_url,
            "TEST_BACKEND": args.redis_url,
            "REDIS_HOST": urlsplit(args.redis_url).hostname or "localhost",
            "REDIS_PORT": str(urlsplit(args.redis_url).port or 6379),
            "CAPS_SUITE_REDIS_DB": (urlsplit(args.redis_url).path.strip("/") or "0"),
            "CAPS_SUITE_LIMIT": "" if limit is None else str(limit),
            "CAPS_SUITE_CAPS_URL": f"sqlite:///{work}/caps.db",
            "CAPS_SUITE_CONCURRENCY": str(args.concurrency),
            "CAPS_SUITE_SUBSET": "all" if args.all else "ci",
            "CAPS_SUITE_REPORT": str(report),
            "PYTHONPATH": os.pathsep.join([str(tests_dir), str(HERE)]),
        }
        selection = ["t/integration"] if args.all else ["t/integration/test_tasks.py", "t/integration/test_canvas.py"]
        command = [
            sys.executable, "-m", "pytest", "-p", "caps_suite_plugin", "-p", "no:cacheprovider",
            f"--timeout={TEST_TIMEOUT_SECONDS}", f"--junitxml={junit}", "-q", "-rfE", *selection, *pytest_args,
        ]  # fmt: skip
        say(f"{mode} #{attempt}: {' '.join(command[1:])}")
        started = time.monotonic()
        try:
            run.exit_code = subprocess.run(command, cwd=tests_dir, env=env, check=False).returncode
        finally:
            run.seconds = time.monotonic() - started
            client.flushdb()
        if junit.exists():
            run.outcomes = outcomes_from_junit(junit)
        if report.exists():
            run.caps = json.loads(report.read_text(encoding="utf-8"))
    say(run.summary())
    return run


def differences(runs: list[Run]) -> list[str]:
    """Tests whose outcome is not the same in every run, with the outcomes per run."""
    names = sorted({name for run in runs for name in run.outcomes})
    lines = []
    for name in names:
        seen = [run.outcomes.get(name, "-") for run in runs]
        if len(set(seen)) > 1:
            per_run = (f"{run.mode}#{run.attempt}={outcome}" for run, outcome in zip(runs, seen, strict=True))
            lines.append(f"{name}: " + ", ".join(per_run))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", action="append", choices=list(MODES), help="a mode to run (repeatable); default: all")
    parser.add_argument("--all", action="store_true", help="the whole of t/integration, not the CI subset")
    parser.add_argument("--repeat", type=int, default=1, help="run each mode this many times")
    parser.add_argument("--concurrency", type=int, default=4, help="the embedded worker's pool size (default 4)")
    parser.add_argument("--redis-url", default=os.environ.get("CAPS_SUITE_REDIS_URL", DEFAULT_REDIS_URL))
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("CAPS_SUITE_CACHE", Path.home() / ".cache" / "celery-caps-suite")),
        help="where Celery's tests are unpacked (kept between runs)",
    )
    parser.add_argument("--json", type=Path, help="write every run's outcomes and caps report here")
    args, pytest_args = parser.parse_known_args()
    pytest_args = [arg for arg in pytest_args if arg != "--"]
    tests_dir = celery_tests(args.cache_dir)
    runs = [
        run_mode(tests_dir, mode, attempt, args, pytest_args)
        for attempt in range(1, args.repeat + 1)
        for mode in (args.mode or list(MODES))
    ]
    say("summary")
    failed = False
    for run in runs:
        problems = run.caps_problems()
        print(f"  {run.summary()}" + (f"; caps: {', '.join(problems)}" if problems else ""))
        if run.caps is not None:
            shown = {k: v for k, v in run.caps.items() if k != "runs_by_task"}
            print(f"    caps report: {shown}")
        failed = failed or run.exit_code != 0 or bool(problems)
    diff = differences(runs)
    print("  tests whose outcome differs between runs:" + ("" if diff else " none"))
    for line in diff:
        print(f"    {line}")
    if args.json:
        args.json.write_text(json.dumps([run.__dict__ for run in runs], indent=2), encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
