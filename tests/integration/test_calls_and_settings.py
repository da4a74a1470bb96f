"""Capped tasks called in this process (eager ``apply()``, a direct call) and namespaced settings.

No worker here: these paths run the task in the calling process.  As in Celery, a direct
call is a plain function call and an eager run takes nothing, unless ``caps_enforce_eager``:
then it takes and releases its slots in the real store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_caps import Cap, CappedTask
from celery_caps.runtime import runtime_for
from celery_caps.settings import CapsSettings
from celery_caps.stores import store_from_url
from celery_caps.stores.base import SlotStore
from tests.integration.fleet import delete_slot_rows, fleet_env
from tests.integration.fleetapp import make_app
from tests.services import new_prefix, require_service

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture
def store() -> Iterator[SlotStore]:
    opened = store_from_url(require_service("postgres"))
    yield opened
    opened.close()


@pytest.fixture
def app(store: SlotStore) -> Iterator[Celery]:
    """The fleet app, in this process, on the PostgreSQL store (no broker needed)."""
    prefix = new_prefix()
    built = make_app(
        fleet_env(
            prefix, broker="memory://", counter_url=require_service("redis"), caps_url=require_service("postgres")
        ),
        current=False,
    )
    yield built
    runtime_for(built).close()
    delete_slot_rows(store, prefix)
    client = built.recorder.client  # type: ignore[attr-defined]
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()
    built.close()


@pytest.mark.parametrize("how", ["direct call", "apply", "apply, caps_enforce_eager"])
def test_calls_in_this_process_follow_celerys_conventions(app: Celery, store: SlotStore, how: str) -> None:
    scope = uuid.uuid4().hex[:16]
    slot = f"{app.fleet_prefix}one:{scope}"  # type: ignore[attr-defined]
    task = app.tasks["fleet.inspect"]
    app.conf.caps_enforce_eager = how.endswith("caps_enforce_eager")

    # When the task runs eagerly or is called like a function
    seen: dict[str, Any] = task(scope) if how == "direct call" else task.apply(args=[scope]).get()

    # Then a direct call and an eager run take nothing (as Celery's own per-task options do not
    # apply to them); enforced, an eager run holds exactly one lease of its slot, under its own
    # run and its task id, released as soon as it returned
    if how.endswith("caps_enforce_eager"):
        assert seen["run_id"], seen
        assert seen["leases"] == [[seen["task_id"], seen["run_id"]]]
    else:
        assert (seen["run_id"], seen["leases"]) == (None, []), seen
    assert store.leases(slot) == []


def test_an_enforced_eager_run_waits_for_its_slot(app: Celery, store: SlotStore) -> None:
    scope = uuid.uuid4().hex[:16]
    slot = f"{app.fleet_prefix}one:{scope}"  # type: ignore[attr-defined]
    app.conf.update(caps_max_wait_seconds=0.5, caps_enforce_eager=True)
    runtime_for(app)  # settings are read once per process: after the change above

    # Given the slot taken by another task id
    blocker = uuid.uuid4().hex
    assert store.acquire({slot: 1}, "other", blocker, "elsewhere/1", 60).granted

    # When the task is applied eagerly, it waits, then gives up with the named error
    result = app.tasks["fleet.inspect"].apply(args=[scope])
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "CapWaitExceeded"
    assert [lease.task_id for lease in store.leases(slot)] == ["other"]
    store.release(blocker)


class NamespacedSettings:
    """A Django-style settings object: every Celery setting under the ``CELERY_`` namespace."""

    CELERY_BROKER_URL = "memory://"
    CELERY_CAPS_LEASE_SECONDS = 7
    CELERY_CAPS_BACKOFF_MIN_SECONDS = 0.01
    CELERY_CAPS_BACKOFF_MAX_SECONDS = 0.02
    CELERY_CAPS_ON_STORE_ERROR = "fail"
    CELERY_CAPS_ENFORCE_EAGER = True


def test_namespaced_configuration(store: SlotStore) -> None:
    prefix = new_prefix()
    postgres = require_service("postgres")
    settings = type("Settings", (NamespacedSettings,), {"CELERY_CAPS_URL": postgres})

    # Given an app configured like a Django project: config_from_object(..., namespace="CELERY")
    app = Celery("namespaced", set_as_current=False)
    app.config_from_object(settings, namespace="CELERY")
    slot = f"{prefix}tenant:acme"
    seen: list[list[str]] = []

    @app.task(base=CappedTask, cap=Cap(f"{prefix}tenant", 1, key=lambda tenant: tenant), bind=True, shared=False)
    def capped(self: Any, tenant: str) -> None:
        seen.extend([lease.task_id, lease.holder] for lease in store.leases(slot))

    try:
        # Then the caps settings are read from the namespaced names
        caps = CapsSettings.from_conf(app.conf)
        assert caps.url == postgres
        assert caps.lease_seconds == 7
        assert (caps.backoff_min_seconds, caps.backoff_max_seconds) == (0.01, 0.02)
        assert caps.on_store_error == "fail"

        # ... and a task of that app takes its slot in that store
        result = capped.apply(args=["acme"], task_id="namespaced-1")
        assert result.state == "SUCCESS", result.result
        assert [task_id for task_id, _ in seen] == ["namespaced-1"]
        assert store.leases(slot) == []
    finally:
        runtime_for(app).close()
        delete_slot_rows(store, prefix)
        app.close()
