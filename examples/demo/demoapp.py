"""The demo's Celery app: one task under a global cap and a per-tenant cap.

``call_provider(tenant, seconds)`` stands for a call to a fragile downstream: at
most ``CAPS_DEMO_PROVIDER_LIMIT`` (4) run at once across every worker, and at
most ``CAPS_DEMO_TENANT_LIMIT`` (2) per tenant.

So that the demo can check the caps *without trusting the library*, every task
writes what happens to it into a small side channel, ``observations.db`` (a
SQLite file, one ``BEGIN IMMEDIATE`` transaction per event): an ``attempt`` row
each time a worker picks it up (Celery's ``task_prerun``, before admission), a
``start`` row when its body begins and an ``end`` row when the body returns.
``demo.py`` computes running tasks, peaks and put-backs from those rows.

Configuration comes from environment variables, so that ``demo.py`` and workers
started by hand in other terminals agree:

``CAPS_DEMO_DIR``
    Folder for the SQLite files and the filesystem broker (default: ``data/``
    beside this file).
``CAPS_DEMO_BROKER``
    Broker URL (default ``filesystem://``: message files under ``CAPS_DEMO_DIR``).
``CAPS_DEMO_STORE``
    ``caps_url`` (default ``sqlite:///<CAPS_DEMO_DIR>/caps.db``).
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import atomicfs
from celery import Celery, signals

from celery_caps import Cap, CappedTask

DATA_DIR = Path(os.environ.get("CAPS_DEMO_DIR") or Path(__file__).resolve().parent / "data").resolve()
BROKER_URL = os.environ.get("CAPS_DEMO_BROKER") or "filesystem://"
STORE_URL = os.environ.get("CAPS_DEMO_STORE") or f"sqlite:///{DATA_DIR / 'caps.db'}"
STRATEGY = os.environ.get("CAPS_DEMO_STRATEGY") or "park"
PROVIDER_LIMIT = int(os.environ.get("CAPS_DEMO_PROVIDER_LIMIT") or 4)
TENANT_LIMIT = int(os.environ.get("CAPS_DEMO_TENANT_LIMIT") or 2)

#: The demo's own queue, so that it never consumes (or purges) another app's messages.
QUEUE = "celery-caps-demo"
PROVIDER_CAP = "demo-provider"
TENANT_CAP = "demo-tenant"
OBSERVATIONS_PATH = DATA_DIR / "observations.db"

app = Celery("demoapp", broker=BROKER_URL)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    # One message per pool process at a time: the rest stay in the broker for other workers.
    worker_prefetch_multiplier=1,
    # As the README recommends for capped tasks: a message is acknowledged once its task has
    # run, and the message of a pool process killed mid-task (the OOM killer, `demo.py
    # --crash`) goes back to the broker, to run again.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_hijack_root_logger=True,
    broker_connection_retry_on_startup=True,
    caps_url=STORE_URL,
    # Tasks here last a fraction of a second: come back soon when a cap is full.
    caps_backoff_min_seconds=0.1,
    caps_backoff_max_seconds=1.0,
    # Ten minutes of put-backs and runs, for `celery -A demoapp caps explain TASK_ID`.
    caps_history_seconds=600,
    # "backoff" (put back with a countdown) or "park" (wait in the store, woken by a release).
    caps_strategy=STRATEGY,
)

if BROKER_URL.startswith("filesystem:"):
    # kombu's filesystem transport: one file per message.  Producers write into
    # data_folder_out and consumers read from data_folder_in, so both name the
    # same folder.  Processed files are moved (an atomic rename, which is what
    # keeps two workers from taking one message) into a folder on the same disk.
    broker_dir = DATA_DIR / "broker"
    folders = {name: broker_dir / name for name in ("queue", "processed", "control")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    app.conf.broker_transport_options = {
        "data_folder_in": str(folders["queue"]),
        "data_folder_out": str(folders["queue"]),
        "store_processed": True,
        "processed_folder": str(folders["processed"]),
        "control_folder": str(folders["control"]),
        # The transport polls its folder; the default 1 s would dominate 0.3 s tasks.
        "polling_interval": 0.05,
    }
    # kombu's transport with message and binding files that appear whole: several
    # workers share the folder (see atomicfs.py).
    app.conf.broker_transport = atomicfs.Transport


def tenant_of(tenant: str, seconds: float) -> str:
    """The per-tenant cap's key: the task's ``tenant`` argument."""
    return tenant


# -- the side channel -----------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,          -- ready | attempt | waited | start | end | killed
    task_id TEXT,
    tenant TEXT,
    worker TEXT,
    pid INTEGER NOT NULL,        -- killed rows: the process killed (by demo.py --crash)
    at REAL NOT NULL,            -- time.time() of this machine, in seconds
    deferrals INTEGER            -- start rows: the caps_deferrals header the run arrived with
)
"""

_connections: dict[int, sqlite3.Connection] = {}


def observations(path: Path = OBSERVATIONS_PATH) -> sqlite3.Connection:
    """A connection to the side channel, one per process (a forked child opens its own)."""
    connection = _connections.get(os.getpid())
    if connection is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(path, timeout=30, isolation_level=None)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute(_SCHEMA)
        _connections[os.getpid()] = connection
    return connection


def record(
    kind: str,
    worker: str | None,
    task_id: str | None = None,
    tenant: str | None = None,
    deferrals: int | None = None,
    *,
    pid: int | None = None,
    at: float | None = None,
) -> None:
    """Append one event, atomically, with this process's clock reading (or ``at``) and pid (or ``pid``)."""
    connection = observations()
    connection.execute("BEGIN IMMEDIATE")
    try:
        connection.execute(
            "INSERT INTO events (kind, task_id, tenant, worker, pid, at, deferrals) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                kind, task_id, tenant, worker or socket.gethostname(), pid or os.getpid(),
                time.time() if at is None else at, deferrals,
            ),
        )  # fmt: skip
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise


# -- the capped task --------------------------------------------------------------------


@app.task(
    bind=True,
    base=CappedTask,
    cap=[Cap(PROVIDER_CAP, PROVIDER_LIMIT), Cap(TENANT_CAP, TENANT_LIMIT, key=tenant_of)],
    name="demoapp.call_provider",
)
def call_provider(self: Any, tenant: str, seconds: float) -> None:
    """Pretend to call the provider for ``tenant`` for ``seconds``."""
    # Admission has happened by now (CappedTask.__call__), and release happens
    # after the body returns: the start..end interval lies inside the lease.
    deferrals = int(getattr(self.request, "caps_deferrals", None) or 0)
    if getattr(self.request, "caps_first_deferred_at", None) is not None:
        # It waited for a slot: parked in the store (when sent, or on arrival) or put back.
        record("waited", self.request.hostname, self.request.id, tenant)
    record("start", self.request.hostname, self.request.id, tenant, deferrals)
    time.sleep(seconds)
    record("end", self.request.hostname, self.request.id, tenant)


@signals.task_prerun.connect(sender=call_provider)
def _record_attempt(task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    # Every delivery of the message, admitted or put back.
    record("attempt", task.request.hostname if task else None, task_id, args[0] if args else None)


@signals.worker_ready.connect
def _record_ready(sender: Any = None, **_: Any) -> None:
    record("ready", getattr(sender, "hostname", None))
