"""Chaos: the slot store's PostgreSQL server crashes in the middle of a park fleet run.

The store is a PostgreSQL cluster of the test's own (the machine's binaries, a free
port, a temporary directory; the shared server is never touched), stopped with
``pg_ctl stop -m immediate``: SIGQUIT to the postmaster, no checkpoint, the WAL not yet
written is lost (a release and its hand-over commit without waiting for the flush), and
the next start runs crash recovery.  It starts again a few seconds later on the same
port and data directory.  A sweep runs every second meanwhile, as beat would run it.

What a user checks, measured by the task bodies in Redis: nothing starts while the server
is down; every task completes, at least once (a task in the waiting list or being handed
over at the crash may run twice: its hand-over lost in the crash, or its claim failed on
it, the task is handed over again), and only such a task; the workers stay up; the caps
hold throughout, counted in distinct task ids; and once the leases the crash restored or
orphaned have expired, the sweep leaves only sentinels.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from celery_caps.stores.sql import SQLStore
from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, mixed_workload, over_cap, send_workload, wait_for
from tests.services import require_service, unavailable

pytestmark = [pytest.mark.chaos, pytest.mark.fleet, pytest.mark.postgres, pytest.mark.redis]

PROVIDER_LIMIT = 4
TENANT_LIMIT = 2
TASKS = 300
WORKERS = 3
CONCURRENCY = 4
#: Short, so that what the crash restored (a lost release) or orphaned (an admission whose
#: commit was not acknowledged) expires soon; renewed every 2 s.
#: (Renewed every third of it: 2 s.)
LEASE_SECONDS = 6.0
DOWN_SECONDS = 3.0
SWEEP_EVERY_SECONDS = 1.0
#: A run admitted just before the crash may record its start a moment later.
START_GRACE_SECONDS = 1.0
#: A task run twice must have been in flight at the crash: in the waiting list (seen just before
#: the crash or just after the restart), or handed over at most this long before the crash (a
#: hand-over whose commit the crash lost is at most 3 x wal_writer_delay old, 0.6 s by default).
IN_FLIGHT_SECONDS = 2.0


# -- a PostgreSQL server of the test's own, to crash ---------------------------------------


def _as_server_user(*command: str, check: bool = True) -> int:
    """Run ``command`` as the ``postgres`` user when we are root (initdb refuses root); returns
    its exit status, and with ``check`` fails with its output unless it is 0."""
    if os.geteuid() == 0:
        command = ("runuser", "-u", "postgres", "--", *command)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}\n{done.stdout}{done.stderr}")
    return done.returncode


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class PrivatePostgres:
    """A PostgreSQL cluster in ``directory`` (data in ``data/``, its socket in ``directory``)."""

    bin_dir: Path
    directory: Path
    port: int

    @property
    def data(self) -> Path:
        return self.directory / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def pg_ctl(self, *args: str, check: bool = True) -> int:
        return _as_server_user(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), *args, check=check)

    def start(self) -> None:
        """Start the server (crash recovery first, after a crash) and wait until it accepts connections."""
        self.pg_ctl("start", "-w", "-t", "60", "-l", str(self.directory / "server.log"))

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: the postmaster and its backends quit at once, as in a crash."""
        self.pg_ctl("stop", "-m", "immediate", "-w", "-t", "30")

    def log(self) -> str:
        path = self.directory / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _server_binaries() -> Path:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with ``initdb`` and ``pg_ctl``."""

    def version(path: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", Path(path).parent.parent.name))

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    found = [path for path in found if (Path(path).parent / "pg_ctl").exists()]
    if not found:
        unavailable("private PostgreSQL: no server binaries at /usr/lib/postgresql/*/bin/{initdb,pg_ctl}")
    return Path(found[-1]).parent


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this test's own, running, that the test may crash; stopped and
    deleted afterwards.  Request it *before* ``make_fleet``: the fleets are torn down first.

    Skips (fails with ``CAPS_REQUIRE_SERVICES=1``) without the server binaries, or, as root,
    without ``runuser`` or a ``postgres`` user to run them as.
    """
    bin_dir = _server_binaries()
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            unavailable("private PostgreSQL: running as root, and no runuser to start the server as postgres")
        try:
            server_user = pwd.getpwnam("postgres")
        except KeyError:
            unavailable("private PostgreSQL: running as root, and no postgres user to start the server as")
    directory = Path(tempfile.mkdtemp(prefix="caps-crash-pg-"))
    server = PrivatePostgres(bin_dir, directory, _free_port())
    try:
        if os.geteuid() == 0:
            os.chown(directory, server_user.pw_uid, server_user.pw_gid)
        _as_server_user(
            str(bin_dir / "initdb"), "-D", str(server.data), "-A", "trust", "-U", "postgres",
            "--no-sync", "-E", "UTF8", "--locale=C",
        )  # fmt: skip
        with open(server.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {server.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{directory}'\nfsync = on\n"
            )
        server.start()
        yield server
    finally:
        running = server.data.exists() and server.pg_ctl("status", check=False) == 0  # 3: not running
        if running and server.pg_ctl("stop", "-m", "fast", "-w", "-t", "30", check=False) != 0:
            server.crash()
        shutil.rmtree(directory, ignore_errors=True)


# -- the test --------------------------------------------------------------------------------


def _sweep_every(fleet: Fleet, seconds: float, stop: threading.Event, deleted: list[int]) -> threading.Thread:
    """A thread that runs the ``celery_caps.sweep`` task every ``seconds``, as beat would, and
    adds up the expired leases it deleted; a sweep that fails on the crashed store is counted
    as 0 (the next one runs a second later)."""
    sweep = fleet.app.tasks["celery_caps.sweep"]

    def beat() -> None:
        while not stop.wait(seconds):
            result = sweep.apply()
            if result.successful():
                deleted.append(int(result.result))

    thread = threading.Thread(target=beat, name="test-beat", daemon=True)
    thread.start()
    return thread


def test_database_crash_loses_no_task_keeps_the_caps_and_leaves_nothing_behind(
    private_postgres: PrivatePostgres, make_fleet: FleetFactory
) -> None:
    server = private_postgres
    fleet = make_fleet(
        broker=require_service("redis"),
        caps_url=server.url,
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        strategy="park",
        lease=LEASE_SECONDS,
        backoff_min=0.05,
        backoff_max=1.0,
    )
    store = fleet.store
    assert isinstance(store, SQLStore)

    # Given three prefork workers parking on the private PostgreSQL, a sweep every second, and a
    # mixed workload of short tasks sent at once: the caps bind and most tasks wait in the
    # store, to be handed over as the slots free up
    workers = fleet.start(WORKERS, concurrency=CONCURRENCY)
    stop_sweeping, swept = threading.Event(), []
    beat = _sweep_every(fleet, SWEEP_EVERY_SECONDS, stop_sweeping, swept)
    try:
        sent = send_workload(fleet, mixed_workload(TASKS, seed=3103, ms_range=(50, 150)))

        def done() -> int:
            record = fleet.record()
            return sum(1 for task_id in sent if record.done[task_id])

        def waiting() -> set[str]:
            return {w.task_id for w in store.waiters() if w.slot.startswith(fleet.prefix)}

        wait_for(lambda: done() >= TASKS // 4, 60, lambda: f"only {done()} tasks done before the crash")
        handed_over_before = sum(1 for run in fleet.record().runs if run.dispatch)

        # When the database server crashes mid-run, and starts again DOWN_SECONDS later
        done_at_crash, live_at_crash = done(), len(fleet.live_runs())
        waiting_before = waiting()
        crash_at = fleet.redis_time()
        server.crash()
        time.sleep(DOWN_SECONDS)
        alive_while_down = all(worker.alive() for worker in workers)
        done_at_return, restart_at = done(), fleet.redis_time()
        server.start()
        returned_at = fleet.redis_time()
        assert alive_while_down, fleet.tails()
        assert "automatic recovery in progress" in server.log(), f"no crash recovery ran:\n{server.log()[-3000:]}"
        store.engine.dispose()  # the test's own connections died with the server
        waiting_after = waiting()  # as crash recovery left the list, give or take a few milliseconds

        # Then the workers resume by themselves ...
        def first_start_after_return() -> float | None:
            starts = [run.start for run in fleet.record().runs if run.start >= returned_at]
            return min(starts) if starts else None

        first = wait_for(first_start_after_return, 30, "no task started after the server came back")
        recovery = first - returned_at

        # ... every task completes, at least once, and no worker died
        fleet.wait_all_done(sent, 120)
        # ... and the waiting list empties: what the crash left listed is handed over again
        wait_for(lambda: not waiting(), LEASE_SECONDS * 3, lambda: f"waiters left: {waiting()}", interval=0.25)
    finally:
        stop_sweeping.set()
        beat.join(timeout=30)
    assert all(worker.alive() for worker in workers), fleet.tails()
    record = fleet.record()
    assert [run for run in record.runs if not run.completed] == [], "a run was cut short"
    assert waiting_before, "no task waited in the store at the crash: the test would prove nothing"
    assert handed_over_before, "no task was handed over before the crash"

    # ... nothing started while the database was down
    started_while_down = [run for run in record.runs if crash_at + START_GRACE_SECONDS < run.start < restart_at]
    assert started_while_down == [], f"runs started while the database was down: {started_while_down}"

    # ... the caps held throughout: atomic peaks (runs) and intervals rebuilt per task id
    counters = sorted(record.counters())
    limits = {counter: PROVIDER_LIMIT if counter == "provider" else TENANT_LIMIT for counter in counters}
    peaks = {counter: record.peaks[counter] for counter in counters}
    distinct_peaks = {counter: record.interval_peak(counter, distinct=True) for counter in counters}

    def over(counter: str) -> str:
        """Where ``counter`` went over its cap: the runs live then, by task id, relative to the crash."""
        moments = over_cap(record, counter, limits[counter])
        if not moments:
            return ""
        live = record.live_at(counter, moments[0][0])
        return f"{counter} at {moments[0][0] - crash_at:+.3f}s: " + ", ".join(
            f"{run.task_id[:8]} {run.start - crash_at:+.3f}..{(run.end or 0) - crash_at:+.3f}s "
            f"pid {run.pid}{' woken' if run.dispatch else ''} deferrals {run.deferrals}"
            for run in live
        )

    # (What a cap counts is task ids: a task run twice at once, at-least-once after the crash,
    # holds one slot.  Runs above a cap are shown, and allowed only as such duplicates.)
    over_in_runs = [over(c) for c in counters if peaks[c] > limits[c]]
    over_in_task_ids = [c for c in counters if distinct_peaks[c] > limits[c]]
    assert over_in_task_ids == [], f"a cap was exceeded: task ids {distinct_peaks}, runs {peaks}: {over_in_runs}"
    assert peaks["provider"] == PROVIDER_LIMIT, "the provider cap never bound: the test would prove nothing"

    # ... and a task ran more than once (at-least-once) only if it was in flight at the crash
    twice = {task_id: record.runs_of(task_id) for task_id in sent if record.starts[task_id] > 1}

    def describe(task_id: str) -> str:
        where = "listed before" if task_id in waiting_before else "listed after" if task_id in waiting_after else ""
        starts = " ".join(f"{r.start - crash_at:+.2f}s{'/woken' if r.dispatch else ''}" for r in twice[task_id])
        return f"{task_id[:8]}: {where} runs {starts}"

    handed_over_late = {t for t, runs in twice.items() if crash_at - IN_FLIGHT_SECONDS <= runs[0].start <= crash_at}
    not_in_flight = set(twice) - waiting_before - waiting_after - handed_over_late
    assert not_in_flight == set(), f"run twice, not in flight at the crash: {[describe(t) for t in not_in_flight]}"

    # ... no traceback in the workers' logs
    logs = "\n".join(worker.log() for worker in workers)
    traceback_at = logs.find("Traceback")
    assert traceback_at < 0, logs[max(traceback_at - 2000, 0) : traceback_at + 4000]

    # ... and once the leases the crash restored or orphaned have expired, the sweep leaves
    # only sentinels
    fleet.wait_for_expiry(LEASE_SECONDS + 5)
    swept_at_end = fleet.sweep_to_sentinels()
    counts = {
        "store outages reported": logs.count("the slot store cannot be used"),
        "renewals failed": logs.count("lease renewal failed"),
        "releases failed": logs.count("could not release run"),
        "releases retried": len(re.findall(r"released run \S+ after an earlier failure", logs)),
        "claims retried": logs.count("claiming its dispatch failed"),
        "leases lost": logs.count("lost its slot lease"),
    }
    print(
        f"\n[chaos db crash] {TASKS} tasks on {WORKERS}x-c{CONCURRENCY} prefork, park; PostgreSQL "
        f"crashed (immediate stop) after {done_at_crash} done with {live_at_crash} running, "
        f"{len(waiting_before)} waiting and {handed_over_before} handed over so far; down "
        f"{DOWN_SECONDS:.0f} s ({done_at_return - done_at_crash} finished meanwhile); first start "
        f"{recovery:.2f} s after its return; lost 0, run twice {len(twice)} {[describe(t) for t in twice]}; "
        f"peaks vs caps "
        f"{', '.join(f'{c}={peaks[c]}/{distinct_peaks[c]}/{limits[c]}' for c in counters)} (runs/task ids/cap); "
        f"expired leases swept {sum(swept)} during the run, {swept_at_end} at the end; "
        f"runs above a cap (duplicates at once) {over_in_runs or 'none'}; "
        f"{', '.join(f'{name} {count}' for name, count in counts.items())}"
    )
