"""A worker whose slot store cannot be used says so, at WARNING, and keeps saying it.

Real ``celery worker`` subprocesses of :mod:`tests.integration.opsapp` on stores that are
wrong (a database that does not exist, a wrong password) or away (a SQLite file in a folder
not created yet): the worker still starts, and its log names the store, password masked, and
the cause, in words that say it could not connect.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.integration.ops import OpsWorker, ops_env, wait_for
from tests.services import new_prefix, require_service

SECRET = "not-the-password-4c1d"


@pytest.fixture
def workers() -> Iterator[list[OpsWorker]]:
    made: list[OpsWorker] = []
    yield made
    redis_url = require_service("redis")
    for worker in made:
        worker.close(redis_url)


def start_worker(workers: list[OpsWorker], tmp_path: Path, caps_url: str) -> OpsWorker:
    redis_url = require_service("redis")
    worker = OpsWorker(ops_env(new_prefix(), broker=redis_url, backend=redis_url, caps_url=caps_url), tmp_path)
    workers.append(worker)
    worker.start()
    return worker


def wrong_url(service: str) -> tuple[str, str, str]:
    """A URL of the ``service`` test server that cannot be used, what it looks like masked,
    and the cause the server gives."""
    server = sa.engine.make_url(require_service(service))
    if service == "postgres":
        # A database that does not exist (the test server trusts local users: a wrong password would pass).
        url = server.set(database=f"caps_missing_{uuid.uuid4().hex[:8]}", password=SECRET)
        cause = f'database "{url.database}" does not exist'
    else:
        url = server.set(password=SECRET)
        cause = "Access denied for user"
    return url.render_as_string(hide_password=False), url.render_as_string(hide_password=True), cause


@pytest.mark.fleet
@pytest.mark.redis
@pytest.mark.parametrize(
    "service",
    [pytest.param("postgres", marks=pytest.mark.postgres), pytest.param("mysql", marks=pytest.mark.mysql)],
)
def test_a_worker_on_a_wrong_store_warns_naming_the_store_and_the_cause(
    service: str, tmp_path: Path, workers: list[OpsWorker]
) -> None:
    url, masked, cause = wrong_url(service)
    # Given a worker whose caps_url names a database it cannot use
    # When it starts
    worker = start_worker(workers, tmp_path, url)

    # Then it warns that it cannot connect, naming the store with its password masked, and the cause
    def warning() -> str | None:
        lines = [line for line in worker.log().splitlines() if "the slot store cannot be used" in line]
        return lines[0] if lines else None

    line = wait_for(warning, 60, lambda: f"no warning about the store:\n{worker.log()}")
    assert "WARNING/MainProcess" in line, line
    assert f"cannot connect to the slot store {masked}: OperationalError" in line, line
    assert cause in line, line
    assert "capped tasks wait (put back, caps_on_store_error='defer') until it answers" in line, line
    # and never calls a failed connection a failed schema, nor shows the password
    log = worker.log()
    assert "creating the schema failed" not in log, log
    assert SECRET not in log, log


@pytest.mark.fleet
@pytest.mark.redis
@pytest.mark.sqlite
def test_a_worker_whose_store_comes_later_says_so_and_its_tasks_run(tmp_path: Path, workers: list[OpsWorker]) -> None:
    folder = tmp_path / "not-yet"
    caps_url = f"sqlite:///{folder}/caps.db"
    # Given a worker started while its SQLite store cannot be opened (its folder is missing)
    worker = start_worker(workers, tmp_path, caps_url)
    wait_for(
        lambda: (
            f"cannot connect to the slot store {caps_url}: OperationalError: unable to open database file"
            in worker.log()
        ),
        60,
        lambda: f"no warning about the store:\n{worker.log()}",
    )
    # and a capped task sent meanwhile, which waits
    result = worker.send("ops.hold", 0.01, "done")
    wait_for(lambda: f"ops.hold[{result.id}] waits for the slot store to answer" in worker.log(), 60, worker.log)

    # When the store can be opened
    folder.mkdir()

    # Then the worker says it answers again, and the task runs
    wait_for(lambda: "the slot store answers again" in worker.log(), 60, worker.log)
    assert result.get(timeout=60) == "done"
