"""The worker's account of its slot store (:class:`celery_caps.health.StoreHealth`): a warning
when the store fails, a reminder at most once a minute while it keeps failing, one line when it
answers again; and a connection failure called one, whatever operation met it."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from celery_caps.errors import StoreError
from celery_caps.health import CHECK_SLOT_PREFIX, REMINDER_SECONDS, StoreHealth, check_store, describe
from celery_caps.stores import store_from_url
from celery_caps.stores.base import Admission, SlotStore

pytestmark = [pytest.mark.memory]


def test_a_store_that_keeps_failing_is_reported_at_most_once_a_minute_and_its_return_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1000.0]
    health = StoreHealth("defer", clock=lambda: now[0])
    error = StoreError("creating the schema failed on sqlite:////x/caps.db: OperationalError: unable to open")
    error.__cause__ = ConnectionRefusedError("refused")

    def warnings() -> list[str]:
        found = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        caplog.clear()
        return found

    with caplog.at_level(logging.INFO, logger="celery_caps.health"):
        # Given a store that fails: the first failure is reported at once, as a connection failure
        health.failed(error)
        [first] = warnings()
        assert first.startswith("celery-caps: the slot store cannot be used: cannot connect to the slot store ")
        assert "sqlite:////x/caps.db: OperationalError: unable to open" in first
        # When it keeps failing, nothing more within the minute
        for _ in range(5):
            now[0] += REMINDER_SECONDS / 10
            health.failed(error)
        assert warnings() == []
        # Then a reminder once the minute has passed, with how long and how often
        now[0] += REMINDER_SECONDS / 2
        health.failed(error)
        [reminder] = warnings()
        assert re.match(r"celery-caps: the slot store still cannot be used after 60 s \(7 failed attempts\)", reminder)
        # and one line when it answers again (only then)
        now[0] += 5
        health.answered()
        health.answered()
        assert warnings() == ["celery-caps: the slot store answers again (it could not be used for 65 s)"]
        # and a new failure is reported at once again
        health.failed(error)
        assert len(warnings()) == 1


@pytest.mark.sqlite
def test_a_store_that_cannot_be_opened_is_described_as_a_connection_failure(tmp_path: Path) -> None:
    store = store_from_url(f"sqlite:///{tmp_path}/missing/caps.db")
    with pytest.raises(StoreError) as raised:
        store.warm_up()
    assert str(raised.value).startswith("creating the schema failed on ")  # the store's own words
    assert describe(raised.value) == (
        f"cannot connect to the slot store sqlite:///{tmp_path}/missing/caps.db: "
        "OperationalError: unable to open database file"
    )


def test_an_error_of_a_statement_keeps_the_stores_words() -> None:
    error = StoreError("creating the schema failed on sqlite:////x/caps.db: OperationalError: permission denied")
    error.__cause__ = ValueError("not a connection")
    assert describe(error) == str(error)


@pytest.mark.usefixtures("store_kind")
def test_a_store_check_takes_a_scratch_slot_and_leaves_nothing_behind(store: SlotStore) -> None:
    # Given a store of the table, when the start-up check runs on it
    result = check_store(store, "celery-caps-check/test")

    # Then it passes with nothing to warn about, and leaves no row of its scratch slot
    assert result.warnings == []
    assert result.store == store.display_url
    assert [status for status in store.status() if status.slot.startswith(CHECK_SLOT_PREFIX)] == []
    assert [lease for lease in store.leases() if lease.slot.startswith(CHECK_SLOT_PREFIX)] == []


@pytest.mark.sqlite
def test_a_store_check_on_a_store_that_grants_a_full_slot_says_so(tmp_path: Path) -> None:
    # Given a store whose admission grants whatever it is asked (a broken store)
    store = store_from_url(f"sqlite:///{tmp_path}/caps.db")
    granting = store.acquire

    def grant_always(slots: Any, task_id: str, run_id: str, *args: Any, **kwargs: Any) -> Admission:
        granting({f"{slot}:{run_id}": limit for slot, limit in slots.items()}, task_id, run_id, *args, **kwargs)
        return Admission(True)

    store.acquire = grant_always  # type: ignore[method-assign]

    # Then the check fails, naming the store and what it did wrong
    with pytest.raises(StoreError, match="a slot of limit 1 was granted to two runs at once") as raised:
        check_store(store, "celery-caps-check/test")
    assert str(raised.value).startswith(f"sqlite:///{tmp_path}/caps.db: ")
    store.close()
