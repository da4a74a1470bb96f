"""The table of slot stores every store test runs on, and how to reach their services.

Real services come from environment variables set by tox/CI (no defaults):

=========== ========================= ===========================================
store       variable                  example
=========== ========================= ===========================================
postgres    ``CAPS_TEST_POSTGRES_URL`` ``postgresql+psycopg://postgres@127.0.0.1/test``
mysql       ``CAPS_TEST_MYSQL_URL``    ``mysql+pymysql://root@127.0.0.1/test``
redis       ``CAPS_TEST_REDIS_URL``    ``redis://127.0.0.1:6379/14``
(broker)    ``CAPS_TEST_AMQP_URL``     ``amqp://guest:guest@127.0.0.1:5672//``
=========== ========================= ===========================================

and two Redis topologies, which ``.ci/redis-topologies.sh start`` starts and prints:

============== ================================ ====================================
store          variable                         example
============== ================================ ===========================================
redis_cluster  ``CAPS_TEST_REDIS_CLUSTER_URL``  ``redis+cluster://127.0.0.1:7301,127.0.0.1:7302``
redis_sentinel ``CAPS_TEST_REDIS_SENTINEL_URL`` ``sentinel://127.0.0.1:7321;...?master_name=caps-master``
============== ================================ ===========================================
=======
PgBouncer in front of that PostgreSQL server, in transaction and in session pooling
(``.ci/run`` starts both): ``CAPS_TEST_PGBOUNCER_TX_URL`` and ``CAPS_TEST_PGBOUNCER_SESSION_URL``,
e.g. ``postgresql+psycopg://postgres@127.0.0.1:17432/test``.  The ``pgbouncer`` store row runs
the store tests through the transaction pooler.  A pooler forwards no ``options``, so tests
through one get a database of their own (created on the PostgreSQL server directly; the
pooler's ``[databases]`` must forward any name: ``* = host=... port=...``).

A test whose service is unset or unreachable is skipped, unless
``CAPS_REQUIRE_SERVICES=1`` (CI), which turns the skip into a failure.
``memory`` and ``sqlite`` (a fresh file per test) need nothing.

Several test runs may share one server, so a test never wipes shared data: it
names its slots and task ids under its own random prefix (``new_prefix``), uses
its own key prefix on Redis, and deletes only its own rows afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import unquote, urlsplit

import pytest
import sqlalchemy as sa

from celery_caps.stores import store_from_url
from celery_caps.stores.base import SlotStatus, SlotStore, mask_url

if TYPE_CHECKING:
    from celery import Celery

#: Set to ``1`` (CI) to fail, rather than skip, a test whose service is missing.
REQUIRE_SERVICES_VARIABLE = "CAPS_REQUIRE_SERVICES"

#: Service name -> the environment variable holding its URL.
SERVICE_VARIABLES = {
    "postgres": "CAPS_TEST_POSTGRES_URL",
    "mysql": "CAPS_TEST_MYSQL_URL",
    "redis": "CAPS_TEST_REDIS_URL",
    "amqp": "CAPS_TEST_AMQP_URL",
    "redis_cluster": "CAPS_TEST_REDIS_CLUSTER_URL",
    "redis_sentinel": "CAPS_TEST_REDIS_SENTINEL_URL",
    "pgbouncer-tx": "CAPS_TEST_PGBOUNCER_TX_URL",
    "pgbouncer-session": "CAPS_TEST_PGBOUNCER_SESSION_URL",
}
#: The poolers in front of the PostgreSQL server, by service name.
POOLER_SERVICES = ("pgbouncer-tx", "pgbouncer-session")

#: The Redis topologies besides one server (``.ci/redis-topologies.sh``).
REDIS_TOPOLOGY_KINDS = ("redis_cluster", "redis_sentinel")
#: The Redis store kinds (one server, Cluster, Sentinel): a key prefix per test, no shared rows.
REDIS_KINDS = ("redis", *REDIS_TOPOLOGY_KINDS)

_DEFAULT_PORTS = {
    "postgresql": 5432,
    "postgres": 5432,
    "mysql": 3306,
    "mariadb": 3306,
    "redis": 6379,
    "rediss": 6379,
    "sentinel": 26379,
    "amqp": 5672,
    "pyamqp": 5672,
    "amqps": 5671,
}
_UNIX_SOCKET_SCHEMES = ("unix", "redis+unix")
_CONNECT_TIMEOUT_SECONDS = 1.0


@dataclass(frozen=True)
class StoreKind:
    """One row of the store table."""

    #: The pytest param id and marker name.
    id: str
    #: The service whose URL the store needs; None for stores that need nothing.
    service: str | None
    #: Other test runs may use the same store at the same time.
    shared: bool


#: Every store the store tests run on, in the order they run.
STORE_KINDS = (
    StoreKind("memory", None, shared=False),
    StoreKind("sqlite", None, shared=False),
    StoreKind("postgres", "postgres", shared=True),
    StoreKind("pgbouncer", "pgbouncer-tx", shared=True),  # PostgreSQL through PgBouncer, transaction pooling
    StoreKind("mysql", "mysql", shared=True),
    StoreKind("redis", "redis", shared=False),  # private: a key prefix per test
    StoreKind("redis_cluster", "redis_cluster", shared=False),
    StoreKind("redis_sentinel", "redis_sentinel", shared=False),
)


def store_params() -> list[Any]:
    """``STORE_KINDS`` as pytest params, each with its id and its marker."""
    return [pytest.param(kind, id=kind.id, marks=getattr(pytest.mark, kind.id)) for kind in STORE_KINDS]


def unavailable(reason: str) -> NoReturn:
    """A service a test needs is missing: fail under ``CAPS_REQUIRE_SERVICES=1`` (CI), else skip."""
    if os.environ.get(REQUIRE_SERVICES_VARIABLE) == "1":
        pytest.fail(f"{reason} ({REQUIRE_SERVICES_VARIABLE}=1)", pytrace=False)
    pytest.skip(reason)


@functools.cache
def _unreachable_reason(url: str) -> str | None:
    """Why a connection to ``url``'s server (TCP or Unix socket) fails; None if it works."""
    # A cluster or Sentinel URL names several servers: the first one must answer.
    first = url.split(";", 1)[0]
    scheme_part, _, rest = first.partition("://")
    netloc, separator, tail = rest.partition("/")
    first = f"{scheme_part}://{netloc.split(',', 1)[0].split('?', 1)[0]}{separator}{tail}"
    try:
        parts = urlsplit(first)
        scheme = parts.scheme.lower()
        host, port = parts.hostname, parts.port or _DEFAULT_PORTS.get(scheme.split("+", 1)[0])
    except ValueError as exc:
        return f"cannot parse {mask_url(url)!r}: {exc}"
    try:
        if scheme in _UNIX_SOCKET_SCHEMES:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(_CONNECT_TIMEOUT_SECONDS)
                connection.connect(unquote(parts.path))
        elif host and port:
            socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_SECONDS).close()
        else:
            return f"cannot tell host and port from {mask_url(url)!r}"
    except OSError as exc:
        return f"cannot connect: {exc}"
    return None


def require_service(name: str) -> str:
    """The URL of service ``name`` (``postgres``, ``mysql``, ``redis``, ``amqp``,
    ``redis_cluster``, ``redis_sentinel``).

    Skips the calling test when the variable is unset or the server does not
    accept a connection, or fails it when ``CAPS_REQUIRE_SERVICES=1``.
    """
    variable = SERVICE_VARIABLES[name]
    url = os.environ.get(variable, "").strip()
    if not url:
        unavailable(f"{name}: {variable} is not set")
    reason = _unreachable_reason(url)
    if reason is not None:
        unavailable(f"{name} ({variable}={mask_url(url)}): {reason}")
    return url


def store_url_for(kind: StoreKind, tmp_path: Path) -> str:
    """The URL a test builds a ``kind`` store from (skips if its service is missing)."""
    if kind.id == "memory":
        return "memory://"
    if kind.id == "sqlite":
        return f"sqlite:///{tmp_path}/caps.db"
    assert kind.service is not None
    url = require_service(kind.service)
    if kind.id in REDIS_KINDS and importlib.util.find_spec("celery_caps.stores.redis") is None:
        unavailable("redis: the Redis store (celery_caps.stores.redis) is not available")
    return url


@contextlib.contextmanager
def private_sql_url(service: str, server_url: str | None = None) -> Iterator[str]:
    """A store URL on the ``postgres`` or ``mysql`` test server (``server_url``, default the
    service's variable) whose tables are this test's alone, dropped afterwards: a PostgreSQL
    schema of its own (alone on the search path) or a MySQL database of its own.

    For tests of store-wide operations (recovery, say), which on a shared database would
    reach other test runs' rows; and for each test session (``tests/conftest.py``), so that
    no table of another version or another run is ever seen.
    """
    server = sa.engine.make_url(server_url or require_service(service))
    space = f"caps_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(server)
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql(f"CREATE {'SCHEMA' if service == 'postgres' else 'DATABASE'} {space}")
        if service == "postgres":
            # The schema alone on the path: the shared tables (and functions) of public are not
            # seen, so celery-caps creates its own here.
            url = server.update_query_dict({"options": f"-csearch_path={space}"})
        else:
            url = server.set(database=space)
        try:
            yield url.render_as_string(hide_password=False)
        finally:
            with engine.begin() as connection:
                drop = f"DROP SCHEMA {space} CASCADE" if service == "postgres" else f"DROP DATABASE {space}"
                connection.exec_driver_sql(drop)
    finally:
        engine.dispose()


@contextlib.contextmanager
def private_pooled_url(service: str, pooler_url: str | None = None) -> Iterator[str]:
    """A store URL through the pooler ``service`` (``pgbouncer-tx``, ``pgbouncer-session``) to a
    PostgreSQL database of its own, created and dropped on the server directly (a pooler
    forwards no ``options``, so a schema of its own is out of reach)."""
    pooled = sa.engine.make_url(pooler_url or require_service(service))
    server = sa.engine.make_url(require_service("postgres")).set(query={})
    database = f"caps_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(f"CREATE DATABASE {database}")
        try:
            # (The session's search path, on a direct URL, names a schema of another database.)
            own = pooled.set(database=database).difference_update_query(["options"])
            yield own.render_as_string(hide_password=False)
        finally:
            with engine.connect() as connection:
                connection.exec_driver_sql(f"DROP DATABASE {database} WITH (FORCE)")
    finally:
        engine.dispose()


@contextlib.contextmanager
def private_databases() -> Iterator[None]:
    """Point the PostgreSQL and MySQL variables at a schema/database of their own while the
    context lasts (each reachable service; the others are left to skip or fail as usual)."""
    with contextlib.ExitStack() as stack:
        for service in ("postgres", "mysql"):
            variable = SERVICE_VARIABLES[service]
            url = os.environ.get(variable, "").strip()
            if not url or _unreachable_reason(url) is not None:
                continue
            private = stack.enter_context(private_sql_url(service, url))
            os.environ[variable] = private
            stack.callback(os.environ.__setitem__, variable, url)
        for service in POOLER_SERVICES:
            variable = SERVICE_VARIABLES[service]
            url = os.environ.get(variable, "").strip()
            server = os.environ.get(SERVICE_VARIABLES["postgres"], "").strip()
            if not url or not server or _unreachable_reason(url) is not None or _unreachable_reason(server):
                continue
            private = stack.enter_context(private_pooled_url(service, url))
            os.environ[variable] = private
            stack.callback(os.environ.__setitem__, variable, url)
        yield


def new_prefix() -> str:
    """A fresh prefix for one test's slot names (or Redis keys): unique across runs."""
    return f"t{uuid.uuid4().hex[:12]}-"


@dataclass(frozen=True)
class StoreTarget:
    """What a process needs to build its own store: picklable, for spawned processes."""

    kind: StoreKind
    url: str
    #: Redis key prefix that keeps one test's keys apart from every other test's.
    key_prefix: str

    def open(self) -> SlotStore:
        """A new store on ``url``; the caller closes it."""
        if self.kind.id in REDIS_KINDS:
            from celery_caps.stores.redis import RedisStore

            return RedisStore(self.url, key_prefix=self.key_prefix)
        return store_from_url(self.url)


def delete_own_rows(target: StoreTarget, store: SlotStore, prefix: str) -> None:
    """Remove what one test left behind, and nothing that another test run owns."""
    if target.kind.id in REDIS_KINDS:
        from celery_caps.stores.redis import RedisStore

        assert isinstance(store, RedisStore)
        # The store's own client: on a cluster its keys (under the prefix's hash tag) are on
        # one node, and the cluster client scans every node.
        client = store.client
        for key in list(client.scan_iter(match=f"{store.key_prefix}*", count=1000)):
            client.delete(key)
    elif target.kind.shared:
        # Every row of a test (sentinels and leases) carries one of its slot names;
        # the prefix is letters, digits and '-', nothing LIKE would interpret.
        from celery_caps.stores.sql import SQLStore

        assert isinstance(store, SQLStore)
        assert prefix.replace("-", "").isalnum()
        if not sa.inspect(store.engine).has_table("concurrency_slots"):
            return  # a test that never used its store (skipped, say) on a fresh database
        with store.engine.begin() as connection:
            connection.execute(
                sa.text("DELETE FROM concurrency_slots WHERE slot LIKE :pattern"), {"pattern": f"{prefix}%"}
            )
            connection.execute(
                sa.text("DELETE FROM concurrency_waiters WHERE slot LIKE :pattern"), {"pattern": f"{prefix}%"}
            )
            if sa.inspect(connection).has_table("concurrency_waitlists"):
                connection.execute(
                    sa.text("DELETE FROM concurrency_waitlists WHERE slot LIKE :pattern"), {"pattern": f"{prefix}%"}
                )
            if sa.inspect(connection).has_table("concurrency_limits"):
                connection.execute(
                    sa.text("DELETE FROM concurrency_limits WHERE name LIKE :pattern"), {"pattern": f"{prefix}%"}
                )


def own_status(store: SlotStore, prefix: str) -> dict[str, SlotStatus]:
    """``store.status()`` of the slots under ``prefix`` only, by slot name."""
    statuses = [status for status in store.status() if status.slot.startswith(prefix)]
    by_slot = {status.slot: status for status in statuses}
    assert len(by_slot) == len(statuses), f"status lists a slot twice: {statuses}"
    return by_slot


def close_client_app(app: Celery) -> None:
    """Close a test's client app and every socket it holds.

    ``app.close()`` closes nothing (Celery 5.5+ only drops its broker connection pool), and
    the Redis result backend keeps a pool of its own (``backend.client.close()`` leaves the
    pool's connections open) and a pub/sub connection its result consumer opened at the first
    send.  Left to the garbage collector, a connection in a reference cycle may have its
    socket finalised before itself: the socket's ``ResourceWarning`` then fails whichever test
    runs at that moment (a CI run: a fleet test, after test_crash's fleets).
    """
    import kombu.pools

    broker = app.connection_for_write()
    if broker.transport_cls.startswith("redis"):
        # kombu keeps one connection pool per broker URL and transport options for all the
        # apps of a process.  A Redis test app's options name its own key prefix: that pool
        # is this app's alone (the AMQP fleets share theirs, left open).
        app.pool.force_close_all()  # the broker connections, the producers' among them
        del kombu.pools.connections[broker]
    backend = app.backend  # (cheap if the app never made it: no backend connects when made)
    # Both are cached properties of Celery's Redis backend: read only if made.
    consumer = backend.__dict__.get("result_consumer")
    pubsub = getattr(consumer, "_pubsub", None)
    if pubsub is not None:
        pubsub.close()
    client = backend.__dict__.get("client")
    if client is not None:
        client.connection_pool.disconnect()
        client.close()
    app.close()
