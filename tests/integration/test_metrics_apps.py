"""Two apps share one store: each worker's ``/metrics`` shows its own app's caps only.

Two real workers (solo pool), each of its own app with its own caps, serve metrics from one
SQLite store that holds leases and waiting tasks of both.  The cap names are chosen so that one
app's cap is a prefix of the other's (``report`` and ``reporting``): a slot belongs to a cap when
its name is the cap's or starts with the cap's and ``:``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_caps.stores import store_from_url
from celery_caps.stores.base import ParkingStore, ParkOutcome, ParkRequest
from tests.integration.ops import free_port, wait_for
from tests.integration.test_worker_start import stop

pytestmark = [pytest.mark.fleet, pytest.mark.sqlite]

pytest.importorskip("prometheus_client")

APP = textwrap.dedent(
    """
    from celery import Celery
    from celery_caps import Cap, CappedTask

    app = Celery({name!r}, broker="memory://")
    app.conf.caps_url = {caps_url!r}
    app.conf.caps_metrics_port = {port}
    app.conf.caps_metrics_address = "127.0.0.1"

    @app.task(base=CappedTask, cap=Cap({plain!r}, 2))
    def plain():
        return 1

    @app.task(base=CappedTask, cap=Cap({keyed!r}, 1, key=lambda tenant: tenant))
    def keyed(tenant):
        return 2
    """
)

#: Each app's caps: a plain one and a keyed one; the second app's names extend the first's.
CAPS = {"first": ("report", "tenant"), "second": ("reporting", "tenant_eu")}
LEASE = 300.0


def cap_labels(port: int) -> dict[str, set[str]]:
    """The ``cap`` labels of every fleet gauge of ``/metrics``, by gauge."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("celery_caps_") and "cap" in sample.labels and "reason" not in sample.labels:
                labels.setdefault(sample.name, set()).add(sample.labels["cap"])
    return labels


def answers(port: int) -> bool:
    try:
        return bool(cap_labels(port).get("celery_caps_slot_limit"))
    except (urllib.error.URLError, ConnectionError):
        return False


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[dict[str, int]]:
    """A worker of each app, serving metrics; yields app name -> metrics port."""
    caps_url = f"sqlite:///{tmp_path}/caps.db"
    ports: dict[str, int] = {}
    with contextlib.ExitStack() as logs:
        for name, (plain, keyed) in CAPS.items():
            directory = tmp_path / name
            directory.mkdir()
            port = free_port()
            source = APP.format(name=name, caps_url=caps_url, port=port, plain=plain, keyed=keyed)
            (directory / f"{name}app.py").write_text(source)
            env = {**os.environ, "PYTHONPATH": f"{directory}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            log = logs.enter_context(open(directory / "worker.log", "wb"))
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", f"{name}app", "worker", "-P", "solo", "-l", "warning",
                 "-n", f"{name}@%h"],
                cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            logs.callback(stop, worker)
            ports[name] = port
        yield ports


def test_each_apps_metrics_endpoint_shows_only_its_own_caps(tmp_path: Path, workers: dict[str, int]) -> None:
    # Given one store holding leases of both apps' caps (plain and keyed) and a task of each
    # app waiting
    store = store_from_url(f"sqlite:///{tmp_path}/caps.db")
    assert isinstance(store, ParkingStore)
    try:
        for plain, keyed in CAPS.values():
            for slot, limit in ((plain, 2), (f"{keyed}:acme", 1), (f"{keyed}:globex", 1)):
                task_id = uuid.uuid4().hex
                assert store.acquire({slot: limit}, task_id, task_id, "test-holder", LEASE).granted
            waiter = uuid.uuid4().hex
            request = ParkRequest({f"{keyed}:acme": 1}, waiter, waiter, "test-holder", LEASE, time.time(),
                                  max_waiters=10, payload=b"{}")  # fmt: skip
            assert store.park(request) is ParkOutcome.PARKED
    finally:
        store.close()

    # When each app's worker is scraped
    for name, port in workers.items():
        wait_for(lambda port=port: answers(port), 60, f"the {name} worker's metrics endpoint never answered")
        labels = cap_labels(port)
        # Then every fleet gauge names this app's caps, and none of the other app's
        own = set(CAPS[name])
        for gauge in ("celery_caps_slots_held", "celery_caps_slot_limit", "celery_caps_keys"):
            assert labels.get(gauge) == own, (name, gauge, labels)
        assert labels.get("celery_caps_waiting_tasks") == own, (name, labels)
