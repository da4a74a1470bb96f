"""The metrics endpoint of a real worker: scraped over HTTP while capped tasks run.

A worker (prefork with two children, or two threads) of :mod:`tests.integration.opsapp` serves
``/metrics``; tasks contend for a cap of 1, keys pile up past the warning threshold,
and an operator releases a running task's lease.  The counters, the wait histogram and
the fleet gauges must move accordingly, summed over every pool process.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_caps.errors import MissingDependencyError
from celery_caps.stores import store_from_url
from celery_caps.stores.base import SlotStore
from tests.integration.ops import OpsWorker, free_port, ops_env, wait_for
from tests.services import new_prefix, require_service

pytestmark = [pytest.mark.fleet, pytest.mark.redis]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator[list[tuple[OpsWorker, SlotStore]]]:
    made: list[tuple[OpsWorker, SlotStore]] = []
    yield made
    redis_url = require_service("redis")
    for worker, store in made:
        worker.close(redis_url, store)
        store.close()


@pytest.mark.parametrize(
    ("how", "pool"), [("option", "prefork"), ("setting", "threads")], ids=["worker-option-prefork", "setting-threads"]
)
def test_metrics_endpoint_counts_what_the_pool_did(
    how: str, pool: str, tmp_path: Path, worker_factory: list[tuple[OpsWorker, SlotStore]]
) -> None:
    redis_url = require_service("redis")
    prefix = new_prefix()
    port = free_port()
    caps_url = f"sqlite:///{tmp_path}/caps.db"
    settings = {"metrics_port": str(port)} if how == "setting" else {}
    env = ops_env(prefix, broker=redis_url, backend=redis_url, caps_url=caps_url, key_warning_threshold="2", **settings)
    worker = OpsWorker(env, tmp_path)
    store = store_from_url(caps_url)
    worker_factory.append((worker, store))
    gate, tenant = f"{prefix}gate", f"{prefix}tenant"

    # Given a worker serving metrics
    worker.start(*(["--caps-metrics-port", str(port)] if how == "option" else []), pool=pool)
    assert value(scrape(port), "celery_caps_store_up") == 1

    # When three tasks contend for a cap of 1 (two are put back) and three keys are used
    first = worker.send("ops.hold_until", worker.flag("first"), "a")
    wait_for(lambda: store.leases(gate), 60, "the first task never took the gate")
    others = [worker.send("ops.hold", 0.1, label) for label in ("b", "c")]
    keyed = [worker.send("ops.tenant", name, 0.05) for name in ("x", "y", "z")]

    def contended() -> bool:  # both put back at least once, and the first task's lease renewed
        samples = scrape(port)
        return (
            value(samples, "celery_caps_deferrals_total", cap=gate, reason="full") >= 2
            and value(samples, "celery_caps_lease_renewals_total", cap=gate) >= 1
        )

    wait_for(contended, 60, lambda: f"no contention seen:\n{scrape(port)}")
    worker.open_flag("first")
    assert sorted(result.get(timeout=60) for result in [first, *others]) == ["a", "b", "c"]
    assert sorted(result.get(timeout=60) for result in keyed) == ["x", "y", "z"]

    # Then the counters (summed over every pool process) and the gauges say so
    def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = scrape(port)
        return samples if value(samples, "celery_caps_releases_total", cap=gate) == 3 else None

    samples = wait_for(settled, 60, lambda: f"releases not counted:\n{scrape(port)}")
    assert value(samples, "celery_caps_admissions_total", cap=gate) == 3
    assert value(samples, "celery_caps_admissions_total", cap=tenant) == 3
    assert value(samples, "celery_caps_deferrals_total", cap=gate, reason="full") >= 2
    assert value(samples, "celery_caps_wait_seconds_count", cap=gate) == 3
    assert value(samples, "celery_caps_wait_seconds_sum", cap=gate) > 0.1  # b and c waited for a
    assert value(samples, "celery_caps_wait_seconds_bucket", cap=gate, le="0.0") == 1  # a, at once
    assert value(samples, "celery_caps_lease_renewals_total", cap=gate) >= 1

    # The fleet gauges come from the store, read at most every few seconds
    def gauges_read() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        samples = scrape(port)
        return samples if value(samples, "celery_caps_keys", cap=tenant) else None

    samples = wait_for(gauges_read, 60, "the fleet gauges never showed the keys")
    assert value(samples, "celery_caps_slot_limit", cap=gate) == 1
    assert value(samples, "celery_caps_slot_limit", cap=tenant) == 5
    assert value(samples, "celery_caps_keys", cap=tenant) == 3
    assert value(samples, "celery_caps_slots_held", cap=gate) == 0
    # ... and a limit an operator sets (celery caps limit) as soon as the gauges are read again
    assert store.set_limit(tenant, 2) is None
    wait_for(
        lambda: value(scrape(port), "celery_caps_slot_limit", cap=tenant) == 2, 60, "the operator's limit not shown"
    )
    store.set_limit(tenant, None)
    # and a cap past caps_key_warning_threshold is logged
    wait_for(lambda: f"cap '{tenant}' has 3 distinct keys" in worker.log(), 30, "no key warning in the log")

    # When an operator releases a running task's lease
    long = worker.send("ops.hold_until", worker.flag("long"), "long")
    [lease] = wait_for(lambda: store.leases(gate), 60, "the long task never took the gate")
    assert lease.task_id == long.id and lease.task_name == "ops.hold_until"
    assert store.release_task(long.id) == 1

    # Then its worker counts a lost lease at its next renewal, once, and the task still completes
    wait_for(
        lambda: value(scrape(port), "celery_caps_lease_losses_total", cap=gate) == 1, 60, "the loss was not counted"
    )
    wait_for(lambda: "lost its slot lease" in worker.log(), 30, "the loss was not logged")
    time.sleep(1.0)  # two more renewal ticks: the loss must not be counted again
    worker.open_flag("long")
    assert long.get(timeout=60) == "long"
    assert value(scrape(port), "celery_caps_lease_losses_total", cap=gate) == 1


def test_metrics_without_prometheus_client_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_caps import metrics

    monkeypatch.setattr(metrics.PrometheusMetrics, "_instance", None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r'pip install "celery-caps\[prometheus\]"'):
        metrics.metrics_for(9808)
    assert metrics.metrics_for(None).enabled is False
