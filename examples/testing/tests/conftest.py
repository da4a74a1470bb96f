"""Celery's own pytest plugin (an embedded worker per test) and celery-caps' (the ``caps`` fixture)."""

from __future__ import annotations

from typing import Any

import pytest

pytest_plugins = ["celery.contrib.pytest", "celery_caps.testing"]


@pytest.fixture(scope="session")
def celery_config() -> dict[str, Any]:
    # An in-memory broker, results and slot store: nothing to run beside the tests.  Each test's
    # app builds its own store from "memory://", so no test sees another's slots.
    return {"broker_url": "memory://", "result_backend": "cache+memory://", "caps_url": "memory://"}


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    return "threads"  # several tasks at once, so that a cap has something to hold back


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    return {"concurrency": 4, "perform_ping_check": False}
