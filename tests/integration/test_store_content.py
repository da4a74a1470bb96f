"""The store is not a way in: a parked message is decoded only as the app's ``accept_content``
allows, as Celery decodes what comes from the broker (``docs/production.md``).

A real prefork worker on a fresh SQLite store; the test writes into the waiting list what
someone with write access to the store (and not to the broker) could: a pickled payload whose
unpickling would create a file.  The worker refuses it: the task fails alone and visibly, the
file never appears, and the waiters behind it run.
"""

from __future__ import annotations

import pickle
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import wait_for
from tests.integration.test_fleet_changes import lines_with, nothing_left, sqlite_url, state_of, wait_parked
from tests.services import require_service

pytestmark = [pytest.mark.fleet, pytest.mark.sqlite, pytest.mark.redis]


class _CreatesAFile:
    """Unpickled, it opens (creates) ``path`` for writing."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_a_pickled_payload_written_into_the_store_is_refused_not_unpickled(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    redis_url = require_service("redis")
    # The app accepts JSON only (Celery's default accept_content).
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=sqlite_url(tmp_path), strategy="park", lease=30)
    fleet.start(1, concurrency=2)
    scope = uuid.uuid4().hex[:16]

    # Given a task holding a slot of limit 1 for 2 s, a task W parked behind it, and one more
    holder = fleet.app.send_task("fleet.hold", args=[scope, 2.0]).id
    wait_for(lambda: fleet.record().starts[holder] == 1, 20, "the holder never started")
    planted = fleet.app.send_task("fleet.hold", args=[scope, 0.2]).id
    wait_parked(fleet, planted)
    after = fleet.app.send_task("fleet.hold", args=[scope, 0.2]).id
    wait_parked(fleet, after)
    # ... and W's stored message replaced by a pickle, declared as such, as someone who can
    # write to the store could
    marker = tmp_path / "unpickled"
    payload = b"application/x-python-serialize\nbinary\n" + pickle.dumps(_CreatesAFile(marker))
    with sqlite3.connect(tmp_path / "caps.db") as connection:
        changed = connection.execute(
            "UPDATE concurrency_waiters SET payload = ? WHERE task_id = ?", (payload, planted)
        ).rowcount
    connection.close()
    assert changed >= 1
    assert fleet.record().done[holder] == 0, "the holder ended before the payload was planted"

    # When the holder ends and its release wakes W
    wait_for(
        lambda: state_of(fleet, planted)["status"] not in ("PENDING", "DEFERRED"),
        20,
        lambda: f"W's state stays {state_of(fleet, planted)['status']}",
    )

    # Then the worker never unpickled it: W fails, visibly, saying its content is not accepted
    assert not marker.exists(), "the worker unpickled a payload the app does not accept"
    meta = state_of(fleet, planted)
    assert meta["status"] == "FAILURE", meta
    result = fleet.app.AsyncResult(planted).result
    assert type(result).__name__ == "UnpublishableTask", result
    assert "ContentDisallowed" in str(result), result
    assert lines_with(fleet, "ERROR", planted)
    # ... and the task behind it runs, once
    fleet.wait_all_done([after], 15)
    assert fleet.record().starts[after] == 1
    assert fleet.record().starts[planted] == 0
    nothing_left(fleet)
