"""Fixtures for the integration tests: fleets of real workers, cleaned up, logs shown on failure."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.integration.fleet import Fleet, TcpProxy, fleet_env
from tests.services import new_prefix, private_sql_url, require_service


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # Keep each phase's report on the item, so fixtures can tell whether the test failed.
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


def failed_in(request: pytest.FixtureRequest) -> bool:
    """Whether the requesting test failed (in setup or in its body)."""
    return any(getattr(getattr(request.node, f"rep_{phase}", None), "failed", False) for phase in ("setup", "call"))


def print_tails(fleet: Fleet, lines: int = 80) -> None:
    print(f"\n===== worker logs of fleet {fleet.prefix} (last {lines} lines each) =====")
    print(fleet.tails(lines=lines))


FleetFactory = Callable[..., Fleet]

#: Each store a cap's fleet test runs on, with its strategy: park on the stores with a server,
#: backoff on SQLite (whose park fleets run in test_park).
STORES_AND_STRATEGIES = [
    pytest.param("postgres", "park", marks=pytest.mark.postgres),
    pytest.param("mysql", "park", marks=pytest.mark.mysql),
    pytest.param("sqlite", "backoff", marks=pytest.mark.sqlite),
    pytest.param("redis", "park", marks=pytest.mark.redis),
]


def start_fleet_on(make_fleet: FleetFactory, tmp_path: Path, store: str, strategy: str, **settings: Any) -> Fleet:
    """Two workers of four prefork processes on ``store`` (a service name, or ``"sqlite"``: a
    file of this test's), with Redis as broker and result backend."""
    redis_url = require_service("redis")
    caps_url = f"sqlite:///{tmp_path}/caps.db" if store == "sqlite" else require_service(store)
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=caps_url, strategy=strategy, **settings)
    fleet.start(2, concurrency=4)
    return fleet


class Fleets:
    """Builds fleets whose logs live under ``log_root``; :meth:`close` stops and cleans them all."""

    def __init__(self, log_root: Path) -> None:
        self.log_root = log_root
        self.fleets: list[Fleet] = []

    def build(self, *, broker: str, caps_url: str | None, **settings: Any) -> Fleet:
        """A fleet (no worker started yet) with ``settings`` as ``CAPS_FLEET_*`` variables.

        The counter Redis (``CAPS_TEST_REDIS_URL``) is always needed.
        """
        prefix = new_prefix()
        log_dir = self.log_root / prefix.rstrip("-")
        log_dir.mkdir()
        env = fleet_env(prefix, broker=broker, counter_url=require_service("redis"), caps_url=caps_url, **settings)
        fleet = Fleet(prefix, env, log_dir)
        self.fleets.append(fleet)
        return fleet

    def close(self, show_logs: bool = False) -> None:
        for fleet in self.fleets:
            if show_logs:
                print_tails(fleet)
            fleet.close()


@pytest.fixture
def make_fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FleetFactory]:
    """Build fleets for this test: ``make_fleet(broker=..., caps_url=..., lease=3, ...)``.

    Every fleet is stopped and cleaned up afterwards; its worker logs are printed if the test failed.
    """
    fleets = Fleets(tmp_path)
    yield fleets.build
    fleets.close(show_logs=failed_in(request))


@pytest.fixture(autouse=True)
def _show_shared_fleet_logs(request: pytest.FixtureRequest) -> Iterator[None]:
    # Fleets shared by several tests (module fixtures) outlive a failing test: show their logs now.
    yield
    if failed_in(request):
        for value in request.node.funcargs.values():
            if isinstance(value, Fleet):
                print_tails(value)


@pytest.fixture
def postgres_proxy() -> Iterator[tuple[TcpProxy, str]]:
    """An open proxy to the test PostgreSQL and the store URL through it; closed afterwards.

    Request it *before* ``make_fleet``: the fleets are torn down (their rows deleted
    through the proxy) before the proxy closes.
    """
    postgres = make_url(require_service("postgres"))
    proxy = TcpProxy((postgres.host or "127.0.0.1", postgres.port or 5432))
    proxy.open()
    url = postgres.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        yield proxy, url
    finally:
        proxy.close()


@pytest.fixture
def private_postgres_url() -> Iterator[str]:
    """A store URL on the test PostgreSQL whose tables live in a schema of this test's own
    (first on the search path), dropped afterwards.

    For tests that run the sweep: it wakes and publishes every waiter of the store, which
    on the shared server would include other test runs' parked tasks.  Request it *before*
    ``make_fleet``, so that the fleets are torn down before the schema goes.
    """
    with private_sql_url("postgres") as url:
        yield url
