"""Where a PostgreSQL store's time goes under a fleet's load: ``pg_stat_activity`` sampled.

A thread reads, every :data:`SAMPLE_SECONDS`, the backends of the benchmark's database that are
running a statement, and counts each by the statement (the store function it calls, else its
first words) and what it is doing: on the CPU, waiting for the WAL flush of its commit, or
waiting for a lock another transaction holds.  The result is each pair's mean number of busy
backends over the sampling: 0.15 means that statement kept a backend busy that way 15% of the
time.  A sample is one short query every 0.1 s on its own connection: it costs the measured
fleet well under 1% of a core.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from typing import Any

import sqlalchemy as sa

SAMPLE_SECONDS = 0.1
#: What a backend is doing, by ``wait_event_type`` / ``wait_event``.
_WAITS = {("IO", "WALSync"): "WAL flush", ("IO", "WALWrite"): "WAL flush", ("Lock", None): "lock wait"}
_FUNCTION = re.compile(r"\b(concurrency_(?:slots|waiters)_[a-z_]+)\(")
_ACTIVE = (
    "SELECT wait_event_type, wait_event, query FROM pg_stat_activity "
    "WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()"
)


def statement_name(query: str) -> str:
    """The store function ``query`` calls (without its ``concurrency_`` prefix), else its first words."""
    called = _FUNCTION.search(query)
    if called:
        return called.group(1).removeprefix("concurrency_")
    return " ".join(query.split()[:6])[:60]


def doing(wait_type: str | None, wait_event: str | None) -> str:
    """A busy backend's activity: ``cpu``, ``WAL flush``, ``lock wait`` or the wait's own name."""
    if wait_type is None:
        return "cpu"
    return _WAITS.get((wait_type, wait_event)) or _WAITS.get((wait_type, None)) or f"{wait_type}:{wait_event}"


class StoreActivity:
    """Samples a PostgreSQL database's busy backends from :meth:`start` to :meth:`stop`."""

    def __init__(self, url: str) -> None:
        self._engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="store-activity", daemon=True)
        self._counts: Counter[tuple[str, str]] = Counter()
        self._samples = 0

    def start(self) -> StoreActivity:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling: ``{"samples": n, "busy": [[statement, doing, mean busy backends], ...]}``,
        the largest first."""
        self._stopped.set()
        self._thread.join()
        self._engine.dispose()
        samples = max(self._samples, 1)
        busy = [[name, activity, count / samples] for (name, activity), count in self._counts.most_common()]
        return {"samples": self._samples, "busy": busy}

    def _sample(self) -> None:
        with self._engine.connect() as connection:
            while not self._stopped.wait(SAMPLE_SECONDS):
                rows = connection.exec_driver_sql(_ACTIVE).all()
                self._samples += 1
                for wait_type, wait_event, query in rows:
                    self._counts[(statement_name(query or ""), doing(wait_type, wait_event))] += 1


def summary(activity: dict[str, Any], top: int = 6) -> str:
    """The ``top`` largest busy-backend figures of :meth:`StoreActivity.stop`'s result, on one line."""
    parts = [f"{name} {what} {share:.2f}" for name, what, share in activity["busy"][:top]]
    total = sum(share for _, _, share in activity["busy"])
    return f"{total:.2f} busy backends on average: " + ", ".join(parts)
