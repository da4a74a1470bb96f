"""The Celery project of the operator-tooling tests: ``celery -A tests.integration.opsapp worker``.

Configured from ``CAPS_OPS_*`` environment variables (see :data:`ENV`) so that each
test has its own broker key prefix, queue, event exchange, caps and store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery

from celery_caps import Cap, CappedTask

ENV: dict[str, str | None] = {
    "CAPS_OPS_PREFIX": "tops-",
    "CAPS_OPS_BROKER": "memory://",
    "CAPS_OPS_BACKEND": None,
    "CAPS_OPS_CAPS_URL": None,
    "CAPS_OPS_METRICS_PORT": None,
    "CAPS_OPS_KEY_WARNING_THRESHOLD": "1000",
    # The operator tests watch put-backs (their events, states and metrics): backoff by default;
    # the tests of what operators see of parked tasks say "park".
    "CAPS_OPS_STRATEGY": "backoff",
}


def setting(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value if value not in (None, "") else ENV[name]


def make_app(env: Mapping[str, str], *, current: bool = True) -> Celery:
    """The app, its settings and its tasks, from ``env``; tests build theirs with ``current=False``."""
    prefix = setting(env, "CAPS_OPS_PREFIX") or "tops-"
    broker = setting(env, "CAPS_OPS_BROKER")
    app = Celery(f"ops-{prefix}", broker=broker, backend=setting(env, "CAPS_OPS_BACKEND"), set_as_current=current)
    metrics_port = setting(env, "CAPS_OPS_METRICS_PORT")
    app.conf.update(
        task_default_queue=f"{prefix}q",
        control_exchange=f"{prefix}celery",
        event_exchange=f"{prefix}celeryev",
        broker_transport_options={"global_keyprefix": f"{prefix}kombu:"},
        result_backend_transport_options={"global_keyprefix": f"{prefix}results:"},
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        result_expires=600,
        caps_url=setting(env, "CAPS_OPS_CAPS_URL"),
        caps_lease_seconds=1.5,  # renewed every 0.5 s: renewals (and history writes) happen in a test's time
        caps_strategy=setting(env, "CAPS_OPS_STRATEGY"),
        caps_backoff_min_seconds=0.2,
        caps_backoff_max_seconds=0.4,
        caps_sweep_interval_seconds=None,
        caps_history_seconds=600,
        caps_metrics_port=int(metrics_port) if metrics_port else None,
        caps_metrics_address="127.0.0.1",
        caps_key_warning_threshold=int(setting(env, "CAPS_OPS_KEY_WARNING_THRESHOLD") or 1000),
    )
    gate = Cap(f"{prefix}gate", 1)
    tenant = Cap(f"{prefix}tenant", 5, key=lambda tenant, seconds: tenant)

    @app.task(name="ops.hold", base=CappedTask, cap=gate, shared=False)
    def hold(seconds: float, label: str) -> str:
        """Holds the gate (limit 1) for ``seconds``."""
        time.sleep(seconds)
        return label

    @app.task(name="ops.hold_until", base=CappedTask, cap=gate, shared=False)
    def hold_until(flag: str, label: str) -> str:
        """Holds the gate until the Redis key ``flag`` exists (the test opens it), at most 120 s."""
        import redis

        client = redis.Redis.from_url(broker or "")
        try:
            deadline = time.monotonic() + 120
            while not client.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            client.close()
        return label

    @app.task(name="ops.hold_quietly", base=CappedTask, cap=gate, shared=False, ignore_result=True)
    def hold_quietly(seconds: float) -> None:
        """Like ``ops.hold``, with results ignored."""
        time.sleep(seconds)

    @app.task(name="ops.tenant", base=CappedTask, cap=tenant, shared=False)
    def per_tenant(tenant: str, seconds: float) -> str:
        """Holds one key of the tenant cap."""
        time.sleep(seconds)
        return tenant

    del hold, hold_until, hold_quietly, per_tenant
    app.ops_prefix = prefix  # type: ignore[attr-defined]
    return app


def _env() -> dict[str, Any]:
    return dict(os.environ)


app = make_app(_env())
