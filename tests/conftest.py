"""Fixtures shared by every test layer: the store table (see ``tests/services.py``), and a
watchdog that ends a test run stuck where pytest-timeout's signal cannot reach."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest

from celery_caps.stores.base import SlotStore
from tests.services import (
    StoreKind,
    StoreTarget,
    delete_own_rows,
    new_prefix,
    private_databases,
    store_params,
    store_url_for,
)


def _reentrant_pubsub_lock() -> None:
    """Give redis-py's PubSub the reentrant lock later redis-py versions have, in the test process.

    redis-py 5.3 (celery54's) guards a PubSub connection with a plain ``Lock``.  Celery's
    ``AsyncResult.__del__`` unsubscribes through the result consumer's PubSub.  When the garbage
    collector runs that ``__del__`` in the middle of a PubSub command of the same consumer (a
    ``send_task`` subscribing to its result), the test process waits on itself for ever.  Seen
    once, in CI's celery54 run (test_lifecycle's hard time limit test, stuck in ``subscribe`` ->
    ``__del__`` -> ``unsubscribe``).  redis-py 8 uses an ``RLock`` there; this does the same for the
    older one.  It is not celery-caps code: the package creates no AsyncResult.
    """
    import redis.client

    plain_lock = type(threading.Lock())
    original_init = redis.client.PubSub.__init__

    def init(self: redis.client.PubSub, *args: object, **kwargs: object) -> None:
        original_init(self, *args, **kwargs)  # type: ignore[arg-type]
        if type(self._lock) is plain_lock:
            self._lock = threading.RLock()  # type: ignore[assignment]

    if not getattr(original_init, "_caps_reentrant", False):
        init._caps_reentrant = True  # type: ignore[attr-defined]
        redis.client.PubSub.__init__ = init  # type: ignore[method-assign]


_reentrant_pubsub_lock()

#: Seconds a test phase may outlive its pytest-timeout limit before the watchdog ends the run.
WATCHDOG_GRACE_SECONDS = 120.0
#: Seconds after that before faulthandler's own thread ends it, if the watchdog thread never got the GIL.
WATCHDOG_BACKSTOP_SECONDS = 30.0

_terminal: TextIO | None = None  # the real stderr, opened before output capture starts


def pytest_configure(config: pytest.Config) -> None:
    global _terminal
    _terminal = open(os.dup(2), "w", encoding="utf-8", errors="replace")  # noqa: SIM115 - lives as long as the run


#: The line :func:`pytest_terminal_summary` makes, printed last of all by :func:`pytest_unconfigure`.
_SKIPPED_FOR_SERVICES = pytest.StashKey[str]()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _terminal
    line = config.stash.get(_SKIPPED_FOR_SERVICES, None)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)
    if _terminal is not None:
        _terminal.close()
        _terminal = None


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line at the end: how many tests skipped for want of each service (``CAPS_TEST_*`` unset
    or unreachable), so that a run without servers says what it did not prove."""
    missing: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")
        found = re.search(r"\b(CAPS_TEST_[A-Z_]+)\b", reason)
        if found:
            missing[found.group(1)] += 1
    if missing:
        counts = ", ".join(f"{variable} {count}" for variable, count in sorted(missing.items()))
        config.stash[_SKIPPED_FOR_SERVICES] = (
            f"celery-caps: {sum(missing.values())} test(s) skipped for want of a service: {counts} "
            "(README, Development: the CAPS_TEST_* variables)"
        )


def _phase_limit(item: pytest.Item) -> float | None:
    """The pytest-timeout limit of ``item``'s phases (its ``timeout`` mark, else the ini value)."""
    mark = item.get_closest_marker("timeout")
    seconds = float(mark.args[0]) if mark is not None and mark.args else float(item.config.getini("timeout") or 0)
    return seconds if seconds > 0 else None


def _kill_child_groups() -> list[int]:
    """SIGKILL the process group of every child of this process (the fleet's workers each lead one);
    returns their pids."""
    killed = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            pid = int(stat.parent.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def _end_stuck_run(item: pytest.Item, phase: str, seconds: float, terminal: TextIO) -> None:
    """Print every thread's stack to the real terminal, kill the workers this run started and end
    the process: a phase that pytest-timeout's SIGALRM could not end (a C call that retries on
    EINTR, a handler caught and ignored) would otherwise hold the whole run until CI's own
    deadline, with nothing printed."""
    terminal.write(
        f"\n===== watchdog: {item.nodeid} still in {phase} {seconds:.0f} s after it began;"
        " pytest-timeout did not end it: stacks of every thread, then exit =====\n"
    )
    terminal.flush()
    faulthandler.dump_traceback(file=terminal, all_threads=True)
    terminal.write(f"===== watchdog: killed the process groups of children {_kill_child_groups()} =====\n")
    terminal.flush()
    os._exit(3)


def _watch_phase(item: pytest.Item, phase: str) -> Iterator[None]:
    limit = _phase_limit(item)
    if limit is None or _terminal is None:
        yield
        return
    seconds = limit + WATCHDOG_GRACE_SECONDS
    timer = threading.Timer(seconds, _end_stuck_run, args=(item, phase, seconds, _terminal))
    timer.daemon = True
    timer.start()
    # faulthandler's thread needs no GIL: it ends the run even if the main thread never lets go of it
    faulthandler.dump_traceback_later(seconds + WATCHDOG_BACKSTOP_SECONDS, exit=True, file=_terminal)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _watch_phase(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _watch_phase(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield from _watch_phase(item, "teardown")


@pytest.fixture(scope="session", autouse=True)
def session_databases() -> Iterator[None]:
    """This session's own PostgreSQL schema and MySQL database (dropped at its end): tests and
    the workers they start never meet tables of another run, or of another version."""
    with private_databases():
        yield


@pytest.fixture(params=store_params())
def store_kind(request: pytest.FixtureRequest) -> StoreKind:
    """One row of the store table; every test using a store fixture runs once per row."""
    kind: StoreKind = request.param
    return kind


@pytest.fixture
def prefix() -> str:
    """This test's prefix for its slot names and task ids: test runs sharing a server never
    see, count or release each other's slots (release_task reaches every lease of a task id)."""
    return new_prefix()


@pytest.fixture
def store_target(store_kind: StoreKind, tmp_path: Path) -> StoreTarget:
    """How to build this test's store, for tests that start several processes."""
    return StoreTarget(store_kind, store_url_for(store_kind, tmp_path), key_prefix=new_prefix())


@pytest.fixture(name="store_url")
def store_url_fixture(store_target: StoreTarget) -> str:
    """The URL this test's store is built from."""
    return store_target.url


@pytest.fixture
def store(store_target: StoreTarget, prefix: str) -> Iterator[SlotStore]:
    """This test's store; its rows are deleted and its connections closed afterwards."""
    opened = store_target.open()
    try:
        yield opened
    finally:
        try:
            delete_own_rows(store_target, opened, prefix)
        finally:
            opened.close()
