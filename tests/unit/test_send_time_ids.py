"""Sending with ``caps_park_on_publish``: what the sender logs names the task id it sent, and an id
celery-caps makes for a task is in Celery's own form.

The tasks go to Celery's in-memory broker and are read back from it; the stores are real (a
SQLite file; a PostgreSQL URL on a port where nothing listens, so that checking fails).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_caps import Cap, CappedTask

pytestmark = [pytest.mark.sqlite]

#: Celery's task ids: ``str(uuid4())``.
CELERY_TASK_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}")


class Opaque:
    """An argument JSON cannot carry (pickle can)."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (Opaque, ())


@pytest.fixture
def make_app(tmp_path: Path) -> Iterator[Any]:
    apps: list[Celery] = []

    def make(caps_url: str) -> Celery:
        app = Celery(f"sendapp{len(apps)}", broker="memory://", set_as_current=False)
        app.conf.caps_url = caps_url
        app.conf.caps_park_on_publish = True
        # The in-memory broker is one per process: a queue of this test's own.
        app.conf.task_default_queue = f"send-ids-{uuid.uuid4().hex}"
        app.conf.accept_content = ["json", "pickle"]

        @app.task(base=CappedTask, cap=Cap("send-ids", 1), name="sendapp.capped", shared=False)
        def capped(*args: Any) -> None: ...

        app.finalize()
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.close()


def sent_ids(app: Celery) -> list[str]:
    """The ids of the messages in the app's queue (consumed)."""
    ids = []
    with app.connection_for_read() as connection:
        queue = connection.SimpleQueue(app.conf.task_default_queue, accept=["json", "pickle"])
        try:
            while True:
                try:
                    message = queue.get(block=True, timeout=0.2)
                except queue.Empty:
                    break
                ids.append(message.headers["id"])
                message.ack()
        finally:
            queue.close()
    return ids


def logged_ids(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        match.group(1)
        for record in caplog.records
        if text in record.getMessage() and (match := re.search(r"sendapp\.capped\[([^]]+)\]", record.getMessage()))
    ]


def test_a_task_whose_slots_cannot_be_checked_is_sent_under_the_id_the_warning_names(
    make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a sender whose store cannot be reached (nothing listens on the port)
    app = make_app("postgresql+psycopg://postgres@127.0.0.1:9/caps")
    # When it sends a capped task without an id
    with caplog.at_level(logging.WARNING, logger="celery_caps.park"):
        result = app.tasks["sendapp.capped"].apply_async()
    # Then the warning names the id the task was sent under, and says the store cannot be reached
    assert logged_ids(caplog, "sent to the broker: could not check its slots") == [result.id]
    assert "cannot connect to the slot store postgresql+psycopg://postgres@127.0.0.1:9/caps" in caplog.text
    assert sent_ids(app) == [result.id]
    assert CELERY_TASK_ID.fullmatch(result.id)


def test_a_task_that_cannot_be_parked_is_sent_under_the_id_the_log_names(
    make_app: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a sender whose store works, and a message its task serializer (JSON) cannot carry,
    # sent with pickle
    app = make_app(f"sqlite:///{tmp_path}/caps.db")
    # When it is sent without an id
    with caplog.at_level(logging.DEBUG, logger="celery_caps.park"):
        result = app.tasks["sendapp.capped"].apply_async((Opaque(),), serializer="pickle")
    # Then it goes to the broker as usual, under the id the log names
    assert logged_ids(caplog, "sent to the broker: cannot park its message") == [result.id]
    assert sent_ids(app) == [result.id]


def test_a_task_parked_when_sent_gets_an_id_in_celerys_form(make_app: Any, tmp_path: Path) -> None:
    # Given a sender whose cap (limit 1) is taken by a first task sent
    app = make_app(f"sqlite:///{tmp_path}/caps.db")
    first = app.tasks["sendapp.capped"].apply_async()
    # When a second is sent without an id: it parks in the store
    parked = app.tasks["sendapp.capped"].apply_async()
    assert sent_ids(app) == [first.id]
    # Then both ids are in Celery's form
    assert CELERY_TASK_ID.fullmatch(first.id) and CELERY_TASK_ID.fullmatch(parked.id)
