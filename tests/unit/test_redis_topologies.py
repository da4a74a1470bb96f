"""The Redis store on the topologies production runs: Redis Cluster and Redis Sentinel.

From plain settings (``redis+cluster://``, ``sentinel://``, ``caps_redis_key_prefix``,
``caps_redis_master_name``) and from ready redis-py objects; every bad value a
:class:`ConfigurationError` naming it, every driver error a :class:`StoreError`, no password
ever shown.  The store contract itself runs on both topologies in ``test_stores.py`` (the store
table); the tests here that need a topology use ``CAPS_TEST_REDIS_CLUSTER_URL`` or
``CAPS_TEST_REDIS_SENTINEL_URL`` (``.ci/redis-topologies.sh start``) and skip without them.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.cluster
import redis.sentinel
from redis.crc import key_slot

from celery_caps.errors import ConfigurationError, StoreError
from celery_caps.settings import CapsSettings
from celery_caps.stores import StoreOptions, store_from_url
from celery_caps.stores.base import ParkRequest
from celery_caps.stores.redis import RedisStore
from celery_caps.stores.redis_clients import hash_tagged
from tests.services import require_service

HOLDER = "worker1@host-a/101"


def new_key_prefix() -> str:
    return f"caps-test-{uuid.uuid4().hex[:12]}"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def drop_keys(store: RedisStore) -> None:
    client = store.client
    for key in list(client.scan_iter(match=f"{store.key_prefix}*", count=1000)):
        client.delete(key)


@pytest.fixture
def cluster_url() -> str:
    return require_service("redis_cluster")


@pytest.fixture
def sentinel_url() -> str:
    return require_service("redis_sentinel")


@pytest.fixture
def stores() -> Iterator[list[RedisStore]]:
    """Stores a test builds: their keys deleted and their clients closed afterwards."""
    built: list[RedisStore] = []
    yield built
    for store in built:
        try:
            drop_keys(store)
        finally:
            store.close()


# -- plain settings: URL forms and their errors (no server needed) ---------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis+cluster://127.0.0.1:7000/3", "database 0 only"),
        ("redis+cluster://127.0.0.1:7000?cluster=true", "unknown option(s) cluster"),
        ("redis+cluster://", "no cluster node"),
        ("redis+cluster://127.0.0.1:7000?socket_timeout=soon", "socket_timeout"),
        ("redis://127.0.0.1:6379/0?cluster=true", "cluster"),
        ("sentinel://127.0.0.1:26379", "names no Sentinel master"),
        ("sentinel://127.0.0.1:26379;redis://127.0.0.1:6379?master_name=m", "is not a sentinel://host:port URL"),
        ("sentinel://127.0.0.1:26379?master_name=m&bogus=1", "bogus"),
    ],
)
def test_a_redis_url_that_cannot_work_is_a_configuration_error_naming_it(url: str, expected: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        store_from_url(url)
    assert expected in str(raised.value)
    assert url.split("?", 1)[0].split(";", 1)[0].split("/", 3)[2].split(",")[0] in str(raised.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://:s3cret-pw@127.0.0.1:7000,127.0.0.1:7001/3",
        "redis+cluster://user:s3cret-pw@127.0.0.1:7000?bogus=1",
        "sentinel://:s3cret-pw@127.0.0.1:26379;sentinel://:s3cret-pw@127.0.0.1:26380",
        "sentinel://127.0.0.1:26379?master_name=m&sentinel_password=s3cret-pw&bogus=1",
        "redis://:s3cret-pw@127.0.0.1:6379/0?cluster=true",
    ],
)
def test_a_bad_redis_url_never_shows_its_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        store_from_url(url)
    assert "s3cret-pw" not in str(raised.value)
    assert "***" in str(raised.value)


def test_the_sentinel_master_name_comes_from_the_url_or_the_setting_but_not_two_different_ones() -> None:
    url = "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380"
    from_setting = store_from_url(url, StoreOptions(redis_master_name="mymaster"))
    from_url = store_from_url(f"{url}?master_name=mymaster")
    assert isinstance(from_setting, RedisStore) and isinstance(from_url, RedisStore)
    expected = "sentinel://127.0.0.1:26379/0;sentinel://127.0.0.1:26380/0?master_name=mymaster"
    assert from_setting.display_url == from_url.display_url == expected
    assert repr(from_url) == f"<RedisStore {expected} key_prefix='caps'>"
    with pytest.raises(ConfigurationError, match=r"'other'.*'mymaster'"):
        store_from_url(f"{url}?master_name=other", StoreOptions(redis_master_name="mymaster"))


def test_a_cluster_store_names_its_nodes_and_puts_a_hash_tag_on_its_prefix() -> None:
    # Built without a connection: the cluster client is created on first use.
    store = store_from_url(
        f"redis+cluster://:pw@127.0.0.1:{closed_port()},127.0.0.1:{closed_port()}", StoreOptions(redis_key_prefix="app")
    )
    assert isinstance(store, RedisStore)
    assert store.is_cluster
    assert store.key_prefix == "{app}"
    assert store.display_url.startswith("redis+cluster://:***@127.0.0.1:")
    assert store.display_url.count(",") == 1
    assert "pw" not in repr(store) and "{app}" in repr(store)


@pytest.mark.parametrize(
    ("prefix", "tagged"),
    [
        ("caps", "{caps}"),
        ("{caps}", "{caps}"),
        ("app:{caps}", "app:{caps}"),
        ("a{}b", "{a{}b}"),
        ("a{}b}", "{a{}b}}"),
        ("{", "{{}"),
    ],
)
def test_hash_tagged_keeps_a_usable_tag_and_adds_one_otherwise(prefix: str, tagged: str) -> None:
    assert hash_tagged(prefix) == tagged
    # whatever follows the prefix, Cluster hashes the same tag
    assert len({key_slot((tagged + suffix).encode()) for suffix in (":limits", ":slot:{x}:runs", ":task:1")}) == 1


def test_an_unreachable_cluster_is_a_store_error_of_the_operation_without_the_password() -> None:
    store = store_from_url(f"redis+cluster://:s3cret-pw@127.0.0.1:{closed_port()}")
    with pytest.raises(StoreError) as raised:
        store.acquire({"slot": 1}, "task", "run", HOLDER, 10.0)
    assert "acquire failed on redis+cluster://:***@127.0.0.1:" in str(raised.value)
    assert "s3cret-pw" not in str(raised.value)
    assert raised.value.__cause__ is not None


def test_an_unreachable_sentinel_set_is_a_store_error_naming_the_sentinels_and_master() -> None:
    port = closed_port()
    store = store_from_url(f"sentinel://127.0.0.1:{port}?master_name=mymaster")
    with pytest.raises(StoreError) as raised:
        store.acquire({"slot": 1}, "task", "run", HOLDER, 10.0)
    assert f"sentinel://127.0.0.1:{port}/0?master_name=mymaster" in str(raised.value)


def test_the_redis_settings_are_checked_and_reach_the_store() -> None:
    settings = CapsSettings.from_conf({"caps_redis_key_prefix": "app", "caps_redis_master_name": "mymaster"})
    assert settings.store_options == StoreOptions(True, "app", "mymaster", deployment=settings.deployment)
    store = store_from_url("sentinel://127.0.0.1:26379", settings.store_options)
    assert isinstance(store, RedisStore)
    assert store.key_prefix == "app"
    assert store.display_url.endswith("?master_name=mymaster")
    for name, value in [("caps_redis_key_prefix", ""), ("caps_redis_key_prefix", 3), ("caps_redis_master_name", "")]:
        with pytest.raises(ConfigurationError, match=name):
            CapsSettings.from_conf({name: value})


def test_a_sentinel_object_needs_the_master_name() -> None:
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", 26379)])
    with pytest.raises(ConfigurationError, match="caps_redis_master_name"):
        store_from_url(sentinel)
    store = store_from_url(sentinel, StoreOptions(redis_master_name="mymaster"))
    assert store.display_url == "sentinel://127.0.0.1:26379/0?master_name=mymaster"
    client_store = store_from_url(sentinel.master_for("mymaster"))
    assert client_store.display_url == "sentinel://127.0.0.1:26379/0?master_name=mymaster"


# -- on a Redis Cluster ------------------------------------------------------------------------


def park_request(slots: dict[str, int], task_id: str) -> ParkRequest:
    return ParkRequest(
        slots, task_id, uuid.uuid4().hex, HOLDER, 60.0, payload=b"message", first_deferred_at=time.time(),
        max_waiters=100,
    )  # fmt: skip


@pytest.mark.redis_cluster
@pytest.mark.parametrize("ready_client", [False, True], ids=["url", "RedisCluster"])
def test_every_key_of_a_cluster_store_lands_in_one_hash_slot(
    cluster_url: str, stores: list[RedisStore], ready_client: bool
) -> None:
    prefix = new_key_prefix()
    if ready_client:
        client = redis.cluster.RedisCluster.from_url("redis://" + cluster_url.split("://", 1)[1].split(",", 1)[0])
        store = RedisStore(client, key_prefix=prefix)
    else:
        store = RedisStore(cluster_url, key_prefix=prefix)
    stores.append(store)
    assert store.key_prefix == "{" + prefix + "}"

    # Given a store used the way admission and park use it: several caps at once, a waiter
    slots = {"provider": 1, "tenant:a": 2, "odd {name}%": 1}
    assert store.acquire(slots, "task-1", "run-1", HOLDER, 60.0).granted
    assert store.park(park_request(slots, "task-2")).value == "parked"
    assert store.status() != []

    # Then every key it wrote is in the one hash slot of its prefix's tag
    keys = list(store.client.scan_iter(match=f"{store.key_prefix}*", count=1000))
    assert len(keys) > 5
    assert {key_slot(key) for key in keys} == {key_slot(prefix.encode())}
    released, woken = store.release_and_wake("run-1", 30.0)
    assert released == len(slots) and [w.task_id for w in woken] == ["task-2"]
    if ready_client:
        store.close()
        assert store.client.ping()  # a client handed over stays open


# -- behind Redis Sentinel ------------------------------------------------------------------


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str]:
    hosts = []
    for part in url.split("?", 1)[0].split(";"):
        host, port = part.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
        hosts.append((host, int(port)))
    master_name = url.split("master_name=", 1)[1].split("&", 1)[0]
    return hosts, master_name


@pytest.mark.redis_sentinel
def test_a_sentinel_object_and_a_master_for_client_reach_the_master(
    sentinel_url: str, stores: list[RedisStore]
) -> None:
    hosts, master_name = sentinel_parts(sentinel_url)
    sentinel = redis.sentinel.Sentinel(hosts, socket_timeout=5)
    for target, options in [
        (sentinel, StoreOptions(redis_key_prefix=new_key_prefix(), redis_master_name=master_name)),
        (sentinel.master_for(master_name), StoreOptions(redis_key_prefix=new_key_prefix())),
    ]:
        store = store_from_url(target, options)
        assert isinstance(store, RedisStore)
        stores.append(store)
        assert store.display_url.endswith(f"?master_name={master_name}")
        assert store.display_url.startswith(f"sentinel://{hosts[0][0]}:{hosts[0][1]}/0")
        assert store.acquire({"slot": 1}, "task", "run", HOLDER, 60.0).granted
        assert store.client.info("replication")["role"] == "master"


def _wait(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {seconds} s")
        time.sleep(0.1)


@pytest.mark.redis_sentinel
def test_calls_during_a_sentinel_failover_succeed_or_raise_the_store_error_and_later_calls_reach_the_new_master(
    sentinel_url: str, stores: list[RedisStore]
) -> None:
    hosts, master_name = sentinel_parts(sentinel_url)
    sentinel = redis.sentinel.Sentinel(hosts, socket_timeout=5)
    store = RedisStore(sentinel_url, key_prefix=new_key_prefix())
    stores.append(store)
    old_master = sentinel.discover_master(master_name)

    # Given a thread admitting and releasing one-at-a-time runs without pause
    outcomes: list[tuple[str, Any]] = []
    attempted: list[str] = []
    stop = threading.Event()

    def admit_and_release() -> None:
        while not stop.is_set():
            run_id = uuid.uuid4().hex
            attempted.append(run_id)
            try:
                granted = store.acquire({"slot": 1}, run_id, run_id, HOLDER, 30.0).granted
                store.release(run_id)
            except StoreError as exc:
                outcomes.append(("error", exc))
                time.sleep(0.05)
            except Exception as exc:  # anything else is the bug this test is for
                outcomes.append(("raw", exc))
            else:
                outcomes.append(("ok", (granted, sentinel.discover_master(master_name))))

    worker = threading.Thread(target=admit_and_release, daemon=True)
    worker.start()
    try:
        _wait(lambda: len(outcomes) >= 20, 10, "20 calls before the failover")

        # When the sentinels fail the master over to its replica
        sentinel.sentinels[0].execute_command("SENTINEL FAILOVER", master_name)
        _wait(lambda: sentinel.discover_master(master_name) != old_master, 30, "a new master")
        new_master = sentinel.discover_master(master_name)

        # Then later calls succeed on the new master
        _wait(
            lambda: sum(1 for kind, value in outcomes if kind == "ok" and value[1] == new_master) >= 20,
            30,
            "20 calls on the new master",
        )
    finally:
        stop.set()
        worker.join(10)
    kinds = [kind for kind, _ in outcomes]
    print(
        f"\n[sentinel failover] {old_master} -> {new_master}: {kinds.count('ok')} calls succeeded, "
        f"{kinds.count('error')} raised StoreError"
    )
    assert [value for kind, value in outcomes if kind == "raw"] == []
    assert store.client.info("replication")["role"] == "master"
    assert store.client.connection_pool.connection_kwargs.get("port") in (None, new_master[1])

    # ... and no slot is left held: a run whose reply was lost is released by its run id
    for run_id in attempted:
        store.release(run_id)
    assert store.leases() == []
    assert [status.holders for status in store.status()] == [0]


@pytest.mark.redis_cluster
def test_a_plain_redis_url_to_a_cluster_node_says_to_use_redis_cluster(cluster_url: str) -> None:
    # Given caps_url = "redis://<a cluster node>/0", the mistake the store cannot work with
    node = cluster_url.split("://", 1)[1].split(",", 1)[0]
    store = store_from_url(f"redis://{node}/0", StoreOptions(redis_key_prefix=new_key_prefix()))
    try:
        # Then the start-up check and every failing call say what to write instead
        with pytest.raises(StoreError, match=r"is a Redis Cluster node: set caps_url to redis\+cluster://"):
            store.warm_up()
        with pytest.raises(StoreError, match=r"redis\+cluster://") as raised:
            for index in range(20):  # some pair of slot names hashes to two slots
                store.acquire({f"a{index}": 1, f"b{index}": 1}, "task", f"run{index}", HOLDER, 5.0)
        assert isinstance(raised.value.__cause__, redis.exceptions.ResponseError)
    finally:
        store.close()


def test_a_worker_builds_its_store_from_the_redis_settings() -> None:
    from celery import Celery

    from celery_caps.runtime import runtime_for

    # Given plain settings, as a Django settings module would give them
    app = Celery("topologies", set_as_current=False)
    app.conf.caps_url = f"redis+cluster://127.0.0.1:{closed_port()}"
    app.conf.caps_redis_key_prefix = "billing-caps"
    try:
        # Then the worker's store is the cluster store with the tagged prefix (built without a connection)
        store = runtime_for(app).store
        assert isinstance(store, RedisStore)
        assert store.is_cluster
        assert store.key_prefix == "{billing-caps}"
    finally:
        app.close()
