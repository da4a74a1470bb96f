"""The metrics endpoint of a real worker with Flower installed, and what it says of parked tasks.

Flower's ``celery`` sub-command imports prometheus_client before any worker starts (Celery
loads every sub-command): a worker started with ``--caps-metrics-port`` must still collect
what its pool processes count.  Under park, the endpoint shows the tasks waiting per cap, and
the deferrals counter's help text says what each ``reason`` means.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_caps.metrics import DEFERRAL_REASONS
from celery_caps.stores import store_from_url
from celery_caps.stores.base import SlotStore
from tests.integration.ops import OpsWorker, free_port, ops_env, wait_for
from tests.integration.test_metrics import scrape, value
from tests.services import new_prefix, require_service

pytestmark = [pytest.mark.fleet, pytest.mark.redis, pytest.mark.sqlite]


@pytest.fixture
def metrics_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[OpsWorker, SlotStore, int]]:
    # Flower is in the test extra: its `celery flower` sub-command is what imports prometheus_client early.
    assert "flower" in {point.name for point in entry_points(group="celery.commands")}, "install celery-caps[test]"
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # the worker makes its own
    redis_url = require_service("redis")
    caps_url = f"sqlite:///{tmp_path}/caps.db"
    env = ops_env(new_prefix(), broker=redis_url, backend=redis_url, caps_url=caps_url, strategy="park")
    worker = OpsWorker(env, tmp_path)
    store = store_from_url(caps_url)
    yield worker, store, free_port()
    worker.close(redis_url, store)
    store.close()


def help_text(port: int, name: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return next(family.documentation for family in text_string_to_metric_families(text) if family.name == name)


def test_a_worker_with_flower_installed_serves_what_its_pool_processes_count_and_the_tasks_waiting(
    metrics_worker: tuple[OpsWorker, SlotStore, int],
) -> None:
    worker, store, port = metrics_worker
    gate = f"{worker.prefix}gate"
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ

    # Given a prefork worker started with --caps-metrics-port while Flower is installed
    worker.start("--caps-metrics-port", str(port))
    assert value(scrape(port), "celery_caps_store_up") == 1

    # When a task holds the gate (limit 1) and two more arrive: they park
    first = worker.send("ops.hold_until", worker.flag("first"), "a")
    wait_for(lambda: store.leases(gate), 60, lambda: f"the first task never took the gate:\n{worker.log()}")
    others = [worker.send("ops.hold", 0.05, label) for label in ("b", "c")]
    wait_for(lambda: len(store.waiters(gate)) == 2, 60, lambda: f"the tasks never parked:\n{worker.log()}")

    # Then the endpoint shows two tasks waiting for the cap, and two parks counted in the pool processes
    def parked_seen() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = scrape(port)
        return samples if value(samples, "celery_caps_waiting_tasks", cap=gate) == 2 else None

    samples = wait_for(parked_seen, 60, lambda: f"no waiting tasks shown:\n{scrape(port)}")
    assert value(samples, "celery_caps_deferrals_total", cap=gate, reason="parked") == 2
    # and the counter's help says what each reason means
    documentation = help_text(port, "celery_caps_deferrals")
    for reason in DEFERRAL_REASONS:
        assert f"{reason}: " in documentation, documentation
    assert "caps_park_max_waiters" in documentation and "caps_park_max_payload_bytes" in documentation

    # When the gate opens and every task runs
    worker.open_flag("first")
    assert sorted(result.get(timeout=60) for result in [first, *others]) == ["a", "b", "c"]

    # Then nothing waits, and the pool processes' admissions are all counted
    def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = scrape(port)
        waiting = value(samples, "celery_caps_waiting_tasks", cap=gate)
        released = value(samples, "celery_caps_releases_total", cap=gate)
        return samples if (waiting, released) == (0, 3) else None

    samples = wait_for(settled, 60, lambda: f"the runs were not counted:\n{scrape(port)}")
    assert ("celery_caps_waiting_tasks", (("cap", gate),)) in samples  # shown as 0, not dropped
    assert value(samples, "celery_caps_admissions_total", cap=gate) == 3
    assert value(samples, "celery_caps_wait_seconds_count", cap=gate) == 3
