"""What a worker says at start about its slot store shows no credential of its URL: a password in
the query string (``?password=``) included, whether the store works or cannot be reached (a real
``celery worker`` subprocess, at log level INFO)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.integration.test_worker_start import worker_start_output
from tests.services import require_service

pytestmark = [pytest.mark.postgres]

SECRET = "s3cret-pw"

APP = textwrap.dedent(
    """
    from celery import Celery
    from celery_caps import Cap, CappedTask

    app = Celery("startapp", broker="memory://")
    app.conf.caps_url = {url!r}

    @app.task(base=CappedTask, cap=Cap("start-credentials", 1))
    def capped():
        return 1
    """
)


def worker_output(tmp_path: Path, url: str, until: str) -> str:
    """The output of a worker (solo pool, INFO) on a store at ``url``, up to ``until``."""
    return worker_start_output(tmp_path, APP.format(url=url), until, loglevel="info")


def with_password_in_query(url: str) -> str:
    return sa.engine.make_url(url).update_query_dict({"password": SECRET}).render_as_string(hide_password=False)


def test_the_start_line_of_a_worker_shows_no_password_of_the_query_string(tmp_path: Path) -> None:
    # Given a store URL with a password in its query string (the test server trusts its clients)
    url = with_password_in_query(require_service("postgres"))

    # When a worker starts on it
    output = worker_output(tmp_path, url, until=" ready.")

    # Then it names the store with the password masked, and nowhere shows it
    assert "1 capped task(s) use the slot store postgresql+psycopg://" in output, output
    assert "password=***" in output, output
    assert SECRET not in output, output


def test_a_worker_whose_store_cannot_be_reached_shows_no_password_of_the_query_string(tmp_path: Path) -> None:
    url = with_password_in_query("postgresql+psycopg://caps@127.0.0.1:1/caps?connect_timeout=2")

    output = worker_output(tmp_path, url, until="the slot store cannot be used")

    assert "the slot store cannot be used: cannot connect to the slot store postgresql+psycopg://" in output, output
    assert "password=***" in output, output
    assert SECRET not in output, output
