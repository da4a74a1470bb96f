"""A pytest plugin for testing a project's capped tasks: ``pytest_plugins = ["celery_caps.testing"]``.

With Celery's own plugin (``celery.contrib.pytest``), a project's tests run its tasks in
an embedded worker (``celery_app``, ``celery_worker``); with ``caps_url = "memory://"`` in
``celery_config``, every test's app gets a store of its own, in memory.  This plugin adds
the :func:`caps` fixture: what the caps did during the test, asked of that store.

.. code-block:: python

    # conftest.py
    pytest_plugins = ["celery.contrib.pytest", "celery_caps.testing"]

    @pytest.fixture(scope="session")
    def celery_config():
        return {"broker_url": "memory://", "result_backend": "cache+memory://", "caps_url": "memory://"}

    # test_tasks.py
    def test_imports_of_one_tenant_never_overlap(celery_app, celery_worker, caps):
        results = [import_file.delay("acme", f"{n}.csv") for n in range(4)]
        assert [r.get(timeout=10) for r in results] == ["ok"] * 4
        assert caps.peak("tenant-imports", key="acme") == 1

Direct calls (``mytask(...)``) and eager runs need none of this: they run without caps.
"""

from __future__ import annotations

from typing import Any

import pytest

from .runtime import runtime_for
from .stores.memory import MemoryStore


class CapsProbe:
    """What the caps of ``app`` did, read from its in-memory store."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @property
    def store(self) -> MemoryStore:
        """The app's store: a :class:`~celery_caps.stores.memory.MemoryStore` (``caps_url = "memory://"``)."""
        store = runtime_for(self.app).store
        if not isinstance(store, MemoryStore):
            raise TypeError(
                f"the caps fixture reads a memory store (caps_url = 'memory://'), not {type(store).__name__}"
            )
        return store

    def _slots(self, cap: str, key: str | None) -> list[str]:
        if key is not None:
            return [f"{cap}:{key}"]
        return [slot for slot in self.store.peaks if slot == cap or slot.startswith(cap + ":")]

    def peak(self, cap: str, key: str | None = None) -> int:
        """The most tasks that held cap ``cap`` at once (of one ``key``'s slot, if given; else of
        whichever of its keys' slots saw the most): never more than its limit."""
        return max((self.store.peaks.get(slot, 0) for slot in self._slots(cap, key)), default=0)

    def waited(self, task_id: str) -> float | None:
        """Seconds ``task_id`` waited in the waiting list before its slot was handed to it, or None
        if it never waited there."""
        return self.store.waited.get(task_id)

    def waiting(self, cap: str | None = None) -> list[str]:
        """Task ids waiting now (for a slot of ``cap``, if given), oldest first."""
        names = [
            w.task_id for w in self.store.waiters() if cap is None or w.slot == cap or w.slot.startswith(cap + ":")
        ]
        return list(dict.fromkeys(names))

    def held(self, cap: str | None = None) -> list[str]:
        """Task ids holding a live lease now (of a slot of ``cap``, if given)."""
        leases = self.store.leases()
        return sorted(
            {
                lease.task_id
                for lease in leases
                if lease.expires_in > 0 and (cap is None or lease.slot == cap or lease.slot.startswith(cap + ":"))
            }
        )


@pytest.fixture
def caps(celery_app: Any) -> CapsProbe:
    """What the caps did in this test (see :class:`CapsProbe`); needs ``celery_app`` (Celery's
    pytest plugin) with ``caps_url = "memory://"``."""
    return CapsProbe(celery_app)
