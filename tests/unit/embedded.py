"""An app for Celery's embedded worker (``celery.contrib.testing.worker.start_worker``) in a unit
test: kombu's memory broker, a memory store, a queue of the test's own."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from celery_caps.stores.memory import MemoryStore


@contextmanager
def embedded_app(name: str, backend: str | None = None, **settings: Any) -> Iterator[Celery]:
    """An app named ``name`` on ``memory://`` with a fresh ``MemoryStore`` (``caps_url``), no
    beat sweep, ``settings`` added (a ``caps_url`` among them replaces the store); closed afterwards.

    Its default queue is its own: kombu's memory broker is one per process, so a message another
    test left (a woken copy) would reach this test's worker.  The embedded worker leaves the test
    process's logging alone, and the root logger's level is put back (Celery's embedded worker
    sets it to its loglevel: later tests' ``caplog`` must see warnings).
    """
    app = Celery(name, broker="memory://", backend=backend, set_as_current=False)
    app.conf.update(
        {
            "task_default_queue": f"{name}-{uuid.uuid4().hex[:8]}",
            "caps_url": MemoryStore(),
            "caps_sweep_interval_seconds": None,
            "worker_hijack_root_logger": False,
            "worker_redirect_stdouts": False,
            **settings,
        }
    )
    root_level = logging.getLogger().level
    try:
        yield app
    finally:
        app.close()
        logging.getLogger().setLevel(root_level)
