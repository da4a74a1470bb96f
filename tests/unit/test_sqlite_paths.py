"""A relative SQLite path names another database in each working directory: a worker, beat and
``celery caps`` started from different places would each use their own, sharing no caps.  The
store says so, with the absolute path this process uses."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from celery_caps.stores import store_from_url

pytestmark = pytest.mark.sqlite


def test_a_relative_sqlite_path_is_accepted_with_a_warning_naming_the_path_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.WARNING, logger="celery_caps")
    store = store_from_url("sqlite:///caps.db")
    try:
        warnings = [record.getMessage() for record in caplog.records if "relative SQLite path" in record.getMessage()]
        assert len(warnings) == 1, warnings
        assert os.path.join(str(tmp_path), "caps.db") in warnings[0]
        assert "sqlite:////absolute/path/caps.db" in warnings[0]
    finally:
        store.close()


def test_an_absolute_sqlite_path_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="celery_caps")
    store = store_from_url(f"sqlite:///{tmp_path}/caps.db")
    try:
        assert [r for r in caplog.records if "relative SQLite path" in r.getMessage()] == []
    finally:
        store.close()
