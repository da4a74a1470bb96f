"""The Redis store on a Redis that may evict keys (``maxmemory-policy``), on servers of the test's own.

Each test starts its own ``redis-server`` (``--maxmemory 20mb`` and the policy under test) on a
free port of 6390-6399, and stops it after.  A policy that may evict any key (``allkeys-*``) is
refused by the store's first call, by ``celery caps check`` and by a worker at start, unless
``caps_redis_allow_eviction`` is set; ``volatile-*`` (tombstones have a TTL) is warned about;
``noeviction`` is accepted.  The last tests show what the refusal prevents: on ``allkeys-lru``,
other data filling the server evicts the store's keys, a second task is granted a slot of limit
1 that the first still holds, and a parked task is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from click.testing import CliRunner, Result

from celery_caps.cli import caps
from celery_caps.errors import ConfigurationError, StoreError
from celery_caps.settings import CapsSettings
from celery_caps.stores import store_from_url
from celery_caps.stores.base import ParkOutcome, ParkRequest
from celery_caps.stores.redis import RedisStore
from tests.integration.test_worker_start import APP, worker_exit, worker_start_output
from tests.services import unavailable

pytestmark = [pytest.mark.redis]

#: The ports these tests may start servers on.
PORTS = range(6390, 6400)
MAXMEMORY = "20mb"
LEASE = 120.0


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def redis_server(directory: Path, *options: str, configuration: Path | None = None) -> Iterator[int]:
    """A ``redis-server`` of this test's own (no persistence; ``configuration`` is its file, which
    a sentinel needs) on a free port of :data:`PORTS`, stopped afterwards; yields its port.  A
    port another process takes meanwhile is skipped: the server is ours once it answers with our
    process id."""
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    for port in PORTS:
        if _answers(port):
            continue
        server = subprocess.Popen(
            ["redis-server", *([str(configuration)] if configuration else []), "--port", str(port),
             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(directory), *options],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            if _wait_until_ours(server, port):
                yield port
                return
        finally:
            server.terminate()
            server.wait(timeout=10)
    unavailable(f"no free port in {PORTS.start}-{PORTS.stop - 1} for a redis-server")


def _wait_until_ours(server: subprocess.Popen[bytes], port: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False  # the port was taken meanwhile
        try:
            with redis.Redis(port=port, socket_timeout=1) as client:
                return int(client.info("server")["process_id"]) == server.pid
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    raise AssertionError(f"redis-server on port {port} did not start")


def policy_server(directory: Path, policy: str) -> contextlib.AbstractContextManager[int]:
    return redis_server(directory, "--maxmemory", MAXMEMORY, "--maxmemory-policy", policy)


def new_prefix() -> str:
    return f"evict-{uuid.uuid4().hex[:8]}"


def take(store: RedisStore, slot: str, task_id: str) -> bool:
    return store.acquire({slot: 1}, task_id, uuid.uuid4().hex, "test-holder", LEASE).granted


# -- the store --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_the_store_refuses_a_redis_that_may_evict_any_key_naming_the_setting_and_the_fix(
    tmp_path: Path, policy: str
) -> None:
    with policy_server(tmp_path, policy) as port:
        store = RedisStore(f"redis://127.0.0.1:{port}/0", key_prefix=new_prefix())
        try:
            # When the store is first used, the call fails as the store failing would (the task waits)
            with pytest.raises(StoreError) as refused:
                take(store, "evict", "first")
            message = str(refused.value)
            assert f"maxmemory-policy {policy}" in message and f"127.0.0.1:{port}" in message, message
            assert "CONFIG SET maxmemory-policy noeviction" in message, message
            assert "a Redis of its own" in message and "caps_redis_allow_eviction = True" in message, message
            # nothing was written
            assert store.client.dbsize() == 0
            # the worker's start-up step asks the same as a configuration error
            with pytest.raises(ConfigurationError, match=f"maxmemory-policy {policy}"):
                store.check_eviction()
            # Once the server evicts nothing, the same store works: no restart needed
            store.client.config_set("maxmemory-policy", "noeviction")
            assert take(store, "evict", "first")
            assert store.connection_warnings() == []
        finally:
            store.close()


@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-ttl"])
def test_the_store_runs_on_a_redis_that_may_evict_keys_with_a_ttl_and_warns_about_tombstones(
    tmp_path: Path, policy: str
) -> None:
    with policy_server(tmp_path, policy) as port:
        prefix = new_prefix()
        store = RedisStore(f"redis://127.0.0.1:{port}/0", key_prefix=prefix)
        try:
            assert take(store, "evict", "first")
            assert not take(store, "evict", "second")
            [warning] = store.connection_warnings()
            assert f"maxmemory-policy {policy}" in warning and f"{prefix}:done:<task id>" in warning, warning
            assert "a stale copy of a woken task run it again" in warning and "noeviction" in warning, warning
            assert store.check_eviction() == [warning]
        finally:
            store.close()


def test_the_store_runs_on_a_redis_that_evicts_nothing_without_a_warning(tmp_path: Path) -> None:
    with policy_server(tmp_path, "noeviction") as port:
        store = RedisStore(f"redis://127.0.0.1:{port}/0", key_prefix=new_prefix())
        try:
            assert take(store, "evict", "first")
            assert store.connection_warnings() == [] and store.check_eviction() == []
        finally:
            store.close()


def test_a_policy_the_store_may_not_read_is_used_with_a_warning_saying_what_to_check(tmp_path: Path) -> None:
    with policy_server(tmp_path, "allkeys-lru") as port:
        # Given a user whose ACL denies INFO (the policy cannot be read: it is not refused)
        with redis.Redis(port=port) as admin:
            admin.acl_setuser("caps", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                              commands=["+@all", "-info"])  # fmt: skip
        store = RedisStore(f"redis://caps:pw@127.0.0.1:{port}/0", key_prefix=new_prefix())
        try:
            assert take(store, "evict", "first")
            [warning] = store.connection_warnings()
            assert "INFO memory failed" in warning and "Unless its maxmemory-policy is noeviction" in warning
            assert "pw@" not in warning, warning
        finally:
            store.close()


def test_caps_redis_allow_eviction_runs_the_store_on_allkeys_with_a_warning(tmp_path: Path) -> None:
    with policy_server(tmp_path, "allkeys-lru") as port:
        url = f"redis://127.0.0.1:{port}/0"
        settings = CapsSettings.from_conf(
            {"caps_url": url, "caps_redis_key_prefix": new_prefix(), "caps_redis_allow_eviction": True}
        )
        store = store_from_url(url, settings.store_options)
        assert isinstance(store, RedisStore) and store.allow_eviction
        try:
            assert take(store, "evict", "first")
            [warning] = store.check_eviction()
            assert "(caps_redis_allow_eviction is True)" in warning and "maxmemory-policy allkeys-lru" in warning
            assert "a cap is exceeded" in warning and "parked tasks" in warning, warning
            assert store.connection_warnings() == [warning]
        finally:
            store.close()


def test_caps_redis_allow_eviction_is_off_by_default_and_must_be_a_boolean() -> None:
    assert CapsSettings.from_conf({}).store_options.redis_allow_eviction is False
    with pytest.raises(ConfigurationError, match="caps_redis_allow_eviction must be True or False"):
        CapsSettings.from_conf({"caps_redis_allow_eviction": "yes"})


# -- Redis Cluster and Sentinel: the primaries the store writes to ------------------------------


def test_on_redis_cluster_the_store_refuses_a_primary_that_may_evict_any_key(tmp_path: Path) -> None:
    options = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
    with redis_server(tmp_path, "--maxmemory", MAXMEMORY, "--maxmemory-policy", "allkeys-lru", *options) as port:
        # Given a cluster of one primary that serves every hash slot
        with redis.Redis(port=port, decode_responses=True) as node:
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 10
            while node.cluster("info")["cluster_state"] != "ok":
                assert time.monotonic() < deadline, "the one-node cluster never became ok"
                time.sleep(0.05)
        store = RedisStore(f"redis+cluster://127.0.0.1:{port}", key_prefix=new_prefix())
        try:
            with pytest.raises(StoreError) as refused:
                take(store, "evict", "first")
            assert "maxmemory-policy allkeys-lru" in str(refused.value), refused.value
            assert f"(node 127.0.0.1:{port})" in str(refused.value), refused.value
            store.client.config_set("maxmemory-policy", "volatile-lfu")
            assert take(store, "evict", "first")
            [warning] = store.connection_warnings()
            assert "maxmemory-policy volatile-lfu" in warning and f"(node 127.0.0.1:{port})" in warning, warning
        finally:
            store.close()


def test_through_sentinel_the_store_refuses_a_master_that_may_evict_any_key(tmp_path: Path) -> None:
    with policy_server(tmp_path / "master", "allkeys-lru") as master_port:
        sentinel_directory = tmp_path / "sentinel"
        sentinel_directory.mkdir()
        configuration = sentinel_directory / "sentinel.conf"  # a sentinel rewrites its own file
        configuration.write_text(f"sentinel monitor evict-master 127.0.0.1 {master_port} 1\n")
        with redis_server(sentinel_directory, "--sentinel", configuration=configuration) as sentinel_port:
            url = f"sentinel://127.0.0.1:{sentinel_port}?master_name=evict-master"
            store = RedisStore(url, key_prefix=new_prefix())
            try:
                with pytest.raises(StoreError, match="maxmemory-policy allkeys-lru") as refused:
                    take(store, "evict", "first")
                assert "master_name=evict-master" in str(refused.value), refused.value
                store.client.config_set("maxmemory-policy", "noeviction")
                assert take(store, "evict", "first")
            finally:
                store.close()


# -- celery caps check ------------------------------------------------------------------------


def check(url: str, **settings: object) -> Result:
    app = Celery("evictcheck", broker="memory://", set_as_current=False)
    app.conf.caps_url = url
    app.conf.caps_redis_key_prefix = new_prefix()
    app.conf.update(settings)

    class Obj:
        def __init__(self, app: Celery) -> None:
            self.app = app

    try:
        return CliRunner().invoke(caps, ["check"], obj=Obj(app), catch_exceptions=False)
    finally:
        app.close()


def test_caps_check_fails_on_allkeys_and_reports_volatile_and_an_allowed_allkeys_as_problems(tmp_path: Path) -> None:
    with policy_server(tmp_path, "allkeys-lru") as port:
        url = f"redis://127.0.0.1:{port}/0"
        refused = check(url)
        assert refused.exit_code == 1, refused.output
        assert "maxmemory-policy allkeys-lru" in refused.output and "noeviction" in refused.output, refused.output
        allowed = check(url, caps_redis_allow_eviction=True)
        assert allowed.exit_code == 1 and "ok" in allowed.output, allowed.output
        assert "problem: " in allowed.output and "(caps_redis_allow_eviction is True)" in allowed.output
        with redis.Redis(port=port) as client:
            client.config_set("maxmemory-policy", "volatile-lru")
        volatile = check(url)
        assert volatile.exit_code == 1 and "problem: " in volatile.output, volatile.output
        assert "maxmemory-policy volatile-lru" in volatile.output, volatile.output
        with redis.Redis(port=port) as client:
            client.config_set("maxmemory-policy", "noeviction")
        fine = check(url)
        assert fine.exit_code == 0 and "problem" not in fine.output, fine.output


# -- a worker at start ------------------------------------------------------------------------


def redis_app(url: str, *settings: str) -> str:
    configuration = "\n".join((f"app.conf.caps_url = {url!r}", f"app.conf.caps_redis_key_prefix = {new_prefix()!r}"))
    return APP.replace('app.conf.caps_url = "memory://"', "\n".join((configuration, *settings)))


@pytest.mark.fleet
def test_a_worker_refuses_to_start_on_a_redis_that_may_evict_any_key(tmp_path: Path) -> None:
    with policy_server(tmp_path / "redis", "allkeys-lru") as port:
        # When a worker starts on a store whose server runs allkeys-lru
        code, output = worker_exit(tmp_path, redis_app(f"redis://127.0.0.1:{port}/0"))
        # Then it refuses to start, in one line naming the setting and the fix
        assert code not in (None, 0), output
        [refusal] = [line for line in output.splitlines() if "the worker cannot start" in line]
        assert refusal.startswith("celery-caps: the worker cannot start:") and "Traceback" not in output, output
        assert "maxmemory-policy allkeys-lru" in refusal, output
        assert "maxmemory-policy noeviction" in refusal and "caps_redis_allow_eviction = True" in refusal, output


@pytest.mark.fleet
@pytest.mark.parametrize(
    ("policy", "settings", "warning"),
    [
        ("allkeys-lru", ("app.conf.caps_redis_allow_eviction = True",), "(caps_redis_allow_eviction is True)"),
        ("volatile-lru", (), "maxmemory-policy volatile-lru"),
    ],
    ids=["allkeys-allowed", "volatile"],
)
def test_a_worker_starts_on_an_evicting_redis_it_may_use_and_warns(
    tmp_path: Path, policy: str, settings: tuple[str, ...], warning: str
) -> None:
    with policy_server(tmp_path / "redis", policy) as port:
        output = worker_start_output(tmp_path, redis_app(f"redis://127.0.0.1:{port}/0", *settings), until=warning)
        assert warning in output, output
        assert "ConfigurationError" not in output, output


# -- what the refusal prevents ----------------------------------------------------------------


def store_keys(client: redis.Redis, prefix: str) -> list[bytes]:
    """The store's keys, read with SCAN (which leaves their LRU clocks alone)."""
    return list(client.scan_iter(match=f"{prefix}:*", count=1000))


def fill(client: redis.Redis, until_gone: str, most_bytes: int) -> int:
    """Write other data (64 KiB values) until no key of prefix ``until_gone`` is left, the server
    refuses a write (noeviction), or ``most_bytes`` were written; returns the bytes written."""
    value = os.urandom(64 * 1024)
    written = 0
    while written < most_bytes and store_keys(client, until_gone):
        try:
            with client.pipeline(transaction=False) as pipeline:
                for _ in range(16):
                    pipeline.set(f"cache:{uuid.uuid4().hex}", value)
                pipeline.execute()
        except redis.exceptions.OutOfMemoryError:
            break
        written += 16 * len(value)
    return written


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_on_allkeys_lru_other_data_evicts_the_stores_keys_a_cap_is_exceeded_and_a_parked_task_is_lost(
    tmp_path: Path, policy: str
) -> None:
    with policy_server(tmp_path, policy) as port:
        prefix = new_prefix()
        store = RedisStore(f"redis://127.0.0.1:{port}/0", key_prefix=prefix, allow_eviction=True)
        client = redis.Redis(port=port)
        try:
            # Given task A holding the slot of limit 1 and task C parked behind it
            assert take(store, "report", "task-a")
            parked = ParkRequest({"report": 1}, "task-c", uuid.uuid4().hex, "test-holder", LEASE, time.time(),
                                 max_waiters=10, payload=b"task C's message")  # fmt: skip
            assert store.park(parked) is ParkOutcome.PARKED
            # (Redis's LRU clock counts seconds: let the store's keys be a second older than the others)
            slot_runs, _tasks = store.slot_keys("report")
            deadline = time.monotonic() + 5
            while (client.object("idletime", slot_runs) or 0) < 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            # When other data fills the server past its maxmemory
            written = fill(client, prefix, most_bytes=400 * 1024 * 1024)
            if policy == "noeviction":
                # Then (noeviction) the server refuses the other data and keeps every key of the store
                assert written < 40 * 1024 * 1024 and store_keys(client, prefix)
                assert not take(store, "report", "task-b")
                assert [waiter.task_id for waiter in store.waiters("report")] == ["task-c"]
                return
            # Then (allkeys-lru) every key of the store is evicted ...
            assert store_keys(client, prefix) == [], f"store keys left after {written} bytes"
            assert client.info("stats")["evicted_keys"] > 0
            # ... a second task is granted the slot that A, never released, still holds: two at once
            assert take(store, "report", "task-b")
            # ... and the parked task is gone: nothing will ever wake it, no broker holds its message
            assert store.waiters() == []
        finally:
            client.close()
            store.close()
