"""``celery_caps.warm_up``: a process that sends capped tasks connects before its first send."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest
from celery import Celery

import celery_caps
from celery_caps import Cap, CappedTask, ConfigurationError, StoreError


def _app(caps_url: str) -> Celery:
    app = Celery("warm-up", broker="memory://", set_as_current=False)
    app.conf.caps_url = caps_url
    return app


def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_warm_up_prepares_the_store_before_the_first_send(tmp_path: Path) -> None:
    # Given an app whose senders check their slots as they send (caps_park_on_publish), and whose
    # store is a database nobody has used yet
    path = tmp_path / "caps.db"
    app = _app(f"sqlite:///{path}")
    app.conf.caps_park_on_publish = True

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def work() -> None: ...

    # When the process warms up, before sending anything
    celery_caps.warm_up(app)

    # Then the store's tables are there already
    assert {"concurrency_slots", "concurrency_waiters"} <= _tables(path)
    # ... and the first send uses that store: it takes the free slot when sent
    try:
        work.apply_async()
        with contextlib.closing(sqlite3.connect(path)) as connection:
            assert connection.execute("SELECT count(*) FROM concurrency_slots WHERE run_id <> ''").fetchone() == (1,)
    finally:
        app.close()  # the app's store and its connections


def test_warm_up_names_a_bad_store_url() -> None:
    with pytest.raises(ConfigurationError, match="nosuch://somewhere"):
        celery_caps.warm_up(_app("nosuch://somewhere"))


def test_warm_up_reports_an_unreachable_store_without_its_password() -> None:
    with pytest.raises(StoreError) as raised:
        celery_caps.warm_up(_app("postgresql+psycopg://caps:s3cret-pw@127.0.0.1:1/caps?connect_timeout=2"))
    assert "s3cret-pw" not in str(raised.value)
    assert "127.0.0.1:1" in str(raised.value)
