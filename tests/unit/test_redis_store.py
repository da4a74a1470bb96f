"""What only the Redis store has: key prefixes, hash tags, ready clients, losing Redis.

The store contract itself is tested on every store in ``test_stores.py``.  These
tests run on the server of ``CAPS_TEST_REDIS_URL`` (default
``redis://127.0.0.1:6379/15``) but always on database 15, whatever the URL says:
the restart test wipes that database with ``FLUSHDB``, so it is reserved for this
module.  Every other test uses its own key prefix and deletes its keys afterwards.
Without a reachable Redis the module is skipped, or fails with
``CAPS_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
import redis
from redis.crc import key_slot

from celery_caps.errors import ConfigurationError, StoreError
from celery_caps.stores import store_from_url
from celery_caps.stores.base import Admission, ClaimOutcome, ParkOutcome, ParkRequest, SlotStatus, Woken
from celery_caps.stores.checks import MAX_ID_LENGTH
from celery_caps.stores.redis import RedisStore

pytestmark = pytest.mark.redis

_T = TypeVar("_T")

#: The database this module owns (and flushes).
DEDICATED_DB = 15
LONG_LEASE = 120.0
DISPATCH_LEASE = 30.0
HOLDER = "worker1@host-a/101"


def _dedicated_db_url(url: str) -> str:
    """``url`` pointed at database ``DEDICATED_DB`` (a ``db`` query option wins over the path)."""
    parts = urlsplit(url)
    query = [(name, value) for name, value in parse_qsl(parts.query) if name != "db"]
    if parts.scheme in ("unix", "redis+unix"):
        return urlunsplit(parts._replace(query=urlencode([*query, ("db", str(DEDICATED_DB))])))
    return urlunsplit(parts._replace(path=f"/{DEDICATED_DB}", query=urlencode(query)))


def _reachable_url() -> str:
    url = _dedicated_db_url(os.environ.get("CAPS_TEST_REDIS_URL", "").strip() or "redis://127.0.0.1:6379/15")
    probe = RedisStore(url)
    try:
        probe.client.ping()
    except (redis.RedisError, OSError) as exc:
        reason = f"Redis at {probe.display_url} is unreachable: {type(exc).__name__}"
        if os.environ.get("CAPS_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{reason} (CAPS_REQUIRE_SERVICES=1)", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    finally:
        probe.close()
    return url


REDIS_URL = _reachable_url()


def new_run_id() -> str:
    return uuid.uuid4().hex


def new_key_prefix() -> str:
    return f"caps-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    """A plain client on the dedicated database, to look at the keys the store wrote."""
    plain = redis.Redis.from_url(REDIS_URL)
    try:
        yield plain
    finally:
        plain.close()


@pytest.fixture
def new_store(client: redis.Redis) -> Iterator[Callable[..., RedisStore]]:
    """Builds stores on their own key prefixes; closes them and deletes their keys afterwards."""
    stores: list[RedisStore] = []

    def build(key_prefix: str | None = None) -> RedisStore:
        store = RedisStore(REDIS_URL, key_prefix=key_prefix or new_key_prefix())
        stores.append(store)
        return store

    yield build
    for store in stores:
        store.close()
        keys = list(client.scan_iter(match=f"{store.key_prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def park(store: RedisStore, slots: dict[str, int], task_id: str, first: float) -> str:
    """Park (or admit) a new run of ``task_id``; its payload names it."""
    return store.park(ParkRequest(
        slots, task_id, new_run_id(), HOLDER, LONG_LEASE, payload=f"payload of {task_id}".encode(),
        first_deferred_at=first, max_waiters=100,
    ))  # fmt: skip


def redis_time(client: redis.Redis) -> float:
    seconds, microseconds = client.time()
    return seconds + microseconds / 1_000_000


def written_keys(client: redis.Redis, store: RedisStore) -> set[bytes]:
    return set(client.scan_iter(match=f"{store.key_prefix}*", count=1000))


def index_keys(store: RedisStore, *task_ids: str, keyed: bool = True) -> set[bytes]:
    """The keys every admission writes besides its slots' own keys (``keyed``: and the keyed
    names, once a keyed slot is named)."""
    return (
        sentinel_keys(store, keyed=keyed)
        | {store.key_prefix.encode() + name for name in (b":runs", b":expiry")}
        | {store.task_key(task_id) for task_id in task_ids}
    )


def sentinel_keys(store: RedisStore, *, keyed: bool = True) -> set[bytes]:
    """The keys that stay when every lease and waiter is gone: the limits (the sentinels) and,
    once a keyed slot is named, the keyed names."""
    prefix = store.key_prefix.encode()
    return {prefix + b":limits", prefix + b":keyed"} if keyed else {prefix + b":limits"}


# -- key prefixes ----------------------------------------------------------------------


def test_stores_with_different_key_prefixes_share_a_database_without_seeing_each_other(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    first, second = new_store(), new_store()
    # Given the same slot name, limit 1, taken in both stores by different tasks
    assert first.acquire({"licence": 1}, "task-a", new_run_id(), HOLDER, LONG_LEASE) == Admission(True)
    assert second.acquire({"licence": 1}, "task-b", new_run_id(), HOLDER, LONG_LEASE) == Admission(True)
    # and an expired lease in the first store only
    first.acquire({"expired": 1}, "task-x", new_run_id(), HOLDER, 0.05)
    time.sleep(0.1)

    # Then each store sees only its own slots and leases
    assert first.status() == [
        SlotStatus("expired", 1, holders=0, expired=1),
        SlotStatus("licence", 1, holders=1, expired=0),
    ]
    assert second.status() == [SlotStatus("licence", 1, holders=1, expired=0)]
    assert [lease.task_id for lease in second.leases()] == ["task-b"]

    # and what one store releases or sweeps, the other keeps
    assert second.release_task("task-a") == 0
    assert second.release_holder("task-a", HOLDER) == 0
    assert second.sweep() == 0
    assert first.sweep() == 1
    assert [lease.task_id for lease in first.leases()] == ["task-a"]

    # and every key lives under its own store's prefix
    first_keys, second_keys = written_keys(client, first), written_keys(client, second)
    assert first_keys and second_keys
    assert first_keys.isdisjoint(second_keys)


def test_keys_per_cap_counts_keys_named_before_the_keyed_names_existed_and_after_a_prune(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    store = new_store()
    # Given keyed slots named by a store that kept no keyed names (their set deleted)
    for key in ("a", "b", "c"):
        store.acquire({f"tenant:{key}": 1, "plain": 1}, f"t-{key}", f"r-{key}", HOLDER, LONG_LEASE)
        store.release(f"r-{key}")
    keyed = store.key_prefix.encode() + b":keyed"
    client.delete(keyed)

    # Then the count fills the keyed names once from the sentinels, and counts them
    assert store.keys_per_cap() == {"tenant": 3}
    assert client.zrangebylex(keyed, "-", "+") == [b"", b"tenant:a", b"tenant:b", b"tenant:c"]
    # and a key named later is counted, a key pruned is not
    store.acquire({"tenant:d": 1}, "t-d", "r-d", HOLDER, LONG_LEASE)
    store.release("r-d")
    assert store.prune("tenant:a") == ["tenant:a"]
    assert store.keys_per_cap() == {"tenant": 3}
    assert store.keys_per_cap(2) == {"tenant": 2}
    assert client.zrangebylex(keyed, "-", "+") == [b"", b"tenant:b", b"tenant:c", b"tenant:d"]


def test_an_empty_key_prefix_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="key prefix"):
        RedisStore(REDIS_URL, key_prefix="")


# -- hash tags ---------------------------------------------------------------------------


def test_a_slot_keeps_its_keys_in_one_cluster_hash_slot_tagged_by_its_name(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    store = new_store()
    slot = "tenant-imports:{acme}"  # braces of its own, which must not become the hash tag

    # When a single-slot admission runs
    store.acquire({slot: 2}, "task-1", new_run_id(), HOLDER, LONG_LEASE)

    # Then it wrote the slot's two keys, both hashed by the whole (escaped) slot name
    keys = written_keys(client, store)
    slot_keys = set(store.slot_keys(slot))
    assert {key_slot(key) for key in slot_keys} == {key_slot(b"tenant-imports:%7Bacme%7D")}
    assert key_slot(b"tenant-imports:%7Bacme%7D") != key_slot(b"acme")
    # and otherwise only the run and task indexes (documented: on a cluster these
    # need a prefix with a hash tag of its own, see the next test)
    assert keys == slot_keys | index_keys(store, "task-1")

    # When a multi-slot admission runs, its slots' keys sit in their own hash slots
    # (a cluster could only serve it if they were co-located)
    other = "provider"
    store.acquire({slot: 2, other: 5}, "task-2", new_run_id(), HOLDER, LONG_LEASE)
    assert {key_slot(key) for key in store.slot_keys(other)} == {key_slot(b"provider")}
    assert key_slot(b"provider") != key_slot(b"tenant-imports:%7Bacme%7D")


def test_a_key_prefix_with_a_hash_tag_puts_every_key_in_one_hash_slot(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    # The documented Redis Cluster set-up: the prefix's tag wins over the slots' tags.
    store = new_store("{" + new_key_prefix() + "}")

    first_run = new_run_id()
    store.acquire({"provider": 5, "tenant:{acme}": 1}, "task-1", first_run, HOLDER, LONG_LEASE)
    run_id = new_run_id()
    store.acquire({"provider": 5}, "task-2", run_id, HOLDER, LONG_LEASE)
    store.renew([run_id], LONG_LEASE)
    # and waiters, one of two slots, which a release dispatches
    park(store, {"provider": 5, "tenant:{acme}": 1}, "task-3", 1.0)
    park(store, {"tenant:{acme}": 1}, "task-4", 2.0)
    _, [woken] = store.release_and_wake(first_run, DISPATCH_LEASE)
    assert woken.task_id == "task-3"

    keys = written_keys(client, store)
    waitlist_keys = {store.waiters_key("provider"), store.waiters_key("tenant:{acme}"), *store.waitlist_index_keys}
    assert waitlist_keys <= keys
    assert len(keys) == 2 + 2 + len(index_keys(store, "task-2", "task-3")) + len(waitlist_keys)
    assert {key_slot(key) for key in keys} == {key_slot(store.key_prefix[1:-1].encode())}


def test_a_waiter_lives_in_the_hash_slot_of_the_slot_it_waits_for(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    store = new_store()
    slot, other = "tenant-imports:{acme}", "provider"
    held = new_run_id()
    store.acquire({slot: 1, other: 1}, "task-1", held, HOLDER, LONG_LEASE)

    # When a task waits for one slot
    assert park(store, {slot: 1}, "task-2", 1.0) == ParkOutcome.PARKED

    # Then its entry is in that slot's waiting list, hashed like the slot's lease keys
    # (by the whole escaped name), and the rest are the store-wide waiting-list keys
    keys = written_keys(client, store)
    assert store.waiters_key(slot) in keys
    assert {key_slot(key) for key in (*store.slot_keys(slot), store.waiters_key(slot))} == {
        key_slot(b"tenant-imports:%7Bacme%7D")
    }
    # (P:dispatches comes with the first dispatch)
    assert keys == set(store.slot_keys(slot)) | set(store.slot_keys(other)) | index_keys(store, "task-1") | {
        store.waiters_key(slot),
        *store.waitlist_index_keys[:3],
    }
    assert b":".join([store.key_prefix.encode(), b"waiting"]) in store.waitlist_index_keys

    # When a task waits for two slots, it has one entry in each slot's list, each in
    # that slot's own hash slot (a cluster could only serve it if they were co-located)
    assert park(store, {slot: 1, other: 1}, "task-3", 2.0) == ParkOutcome.PARKED
    assert client.zcard(store.waiters_key(slot)) == 2
    assert client.zcard(store.waiters_key(other)) == 1
    assert key_slot(store.waiters_key(other)) == key_slot(b"provider") != key_slot(store.waiters_key(slot))

    # When the holder releases, the waiters run in turn, and nothing is left but the sentinels
    _, [first] = store.release_and_wake(held, DISPATCH_LEASE)
    assert first.task_id == "task-2"
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    _, [second] = store.release_and_wake(first.run_id, DISPATCH_LEASE)
    assert second.task_id == "task-3"
    assert store.claim(second.task_id, second.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert store.release(second.run_id) == 2
    assert written_keys(client, store) == sentinel_keys(store)


def test_stores_with_different_key_prefixes_never_see_each_others_waiters(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    first, second = new_store(), new_store()
    # Given the same slot name, full in both stores, and a waiter in the first only
    first_run = new_run_id()
    first.acquire({"licence": 1}, "task-a", first_run, HOLDER, LONG_LEASE)
    second_run = new_run_id()
    second.acquire({"licence": 1}, "task-b", second_run, HOLDER, LONG_LEASE)
    assert park(first, {"licence": 1}, "waiter", 1.0) == ParkOutcome.PARKED

    # Then the second store neither lists, recovers, readmits nor forgets it
    assert second.waiters() == []
    assert second.recover(DISPATCH_LEASE) == []
    assert second.recover(DISPATCH_LEASE, readmit_before=10.0) == []
    assert second.readmit("licence", DISPATCH_LEASE) == []
    assert second.forget("waiter", DISPATCH_LEASE) == (0, [])
    # ... its own release hands nothing to the first store's waiter
    assert second.release_and_wake(second_run, DISPATCH_LEASE) == (1, [])
    # ... nor does a claim there see it (nobody answers for the task in the second store)
    assert second.claim("waiter", first_run, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert [(w.slot, w.task_id, w.dispatched) for w in first.waiters()] == [("licence", "waiter", False)]
    # ... and the same task id parks in the second store on its own
    second.acquire({"licence": 1}, "task-c", new_run_id(), HOLDER, LONG_LEASE)
    assert park(second, {"licence": 1}, "waiter", 5.0) == ParkOutcome.PARKED
    assert [w.first_deferred_at for w in second.waiters()] == [5.0]
    assert [w.first_deferred_at for w in first.waiters()] == [1.0]
    assert written_keys(client, first).isdisjoint(written_keys(client, second))

    # When the first store's holder releases, its own waiter is woken, the other's stays
    _, [woken] = first.release_and_wake(first_run, DISPATCH_LEASE)
    assert (woken.task_id, woken.payload) == ("waiter", b"payload of waiter")
    assert [w.dispatched for w in second.waiters()] == [False]


def test_equal_first_deferrals_are_served_in_park_order_by_redis_time(new_store: Callable[..., RedisStore]) -> None:
    store = new_store()
    held = new_run_id()
    store.acquire({"licence": 1}, "holder", held, HOLDER, LONG_LEASE)
    # Given waiters deferred at the same moment, parked in the reverse of their task ids' order
    for task_id in ("task-z", "task-m", "task-a"):
        assert park(store, {"licence": 1}, task_id, 100.0) == ParkOutcome.PARKED

    # Then they wait, and are served, in park order
    assert [w.task_id for w in store.waiters("licence")] == ["task-z", "task-m", "task-a"]
    served = []
    run = held
    for _ in range(3):
        _, [woken] = store.release_and_wake(run, DISPATCH_LEASE)
        assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
        served.append(woken.task_id)
        run = woken.run_id
    assert served == ["task-z", "task-m", "task-a"]


def test_park_times_and_dispatch_expiry_follow_redis_time_not_the_worker_clock(
    new_store: Callable[..., RedisStore], client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker whose clock is a day ahead of the Redis server's
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86_400.0)
    store = new_store()
    held = new_run_id()
    store.acquire({"licence": 1}, "holder", held, HOLDER, LONG_LEASE)

    # When a task parks, and a release dispatches it with a 30 s dispatch lease
    assert park(store, {"licence": 1}, "waiter", 1.0) == ParkOutcome.PARKED
    parked_by_redis = redis_time(client)
    [member] = client.zrange(store.waiters_key("licence"), 0, -1)
    assert isinstance(member, bytes)
    _, [woken] = store.release_and_wake(held, DISPATCH_LEASE)
    dispatched_by_redis = redis_time(client)

    # Then its park time is Redis TIME (the member starts with it), and so its age
    assert abs(float(member[:18]) - parked_by_redis) < 5.0
    [waiter] = store.waiters("licence")
    assert 0.0 <= waiter.age < 5.0
    # ... and its dispatch expires DISPATCH_LEASE after Redis TIME, as does its lease
    dispatch_expiry = client.zscore(store.waitlist_index_keys[3], "waiter")
    assert dispatch_expiry is not None
    assert abs(dispatch_expiry - (dispatched_by_redis + DISPATCH_LEASE)) < 5.0
    [lease] = store.leases("licence")
    assert (lease.task_id, lease.run_id, lease.holder) == ("waiter", woken.run_id, "caps-dispatch")
    assert DISPATCH_LEASE - 5.0 < lease.expires_in <= DISPATCH_LEASE

    # When a short dispatch goes unclaimed, it expires by Redis TIME, not by the worker clock
    assert store.release(woken.run_id) == 1
    # (released: no lease left to claim; the copy takes the entry off the list)
    assert store.claim("waiter", woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    blocker = new_run_id()
    store.acquire({"licence": 1}, "blocker", blocker, HOLDER, LONG_LEASE)
    assert park(store, {"licence": 1}, "waiter", 1.0) == ParkOutcome.PARKED
    _, [short] = store.release_and_wake(blocker, 0.5)
    assert store.recover(DISPATCH_LEASE) == []  # a day passed for the worker, not for Redis
    deadline = real_time() + 10.0
    again: list[Woken] = []
    while not again and real_time() < deadline:
        time.sleep(0.05)
        again = store.recover(DISPATCH_LEASE)
    assert [(w.task_id, w.run_id != short.run_id) for w in again] == [("waiter", True)]


#: Payload bytes no text decoding survives: NUL, invalid UTF-8, every byte value.
BINARY_PAYLOAD = bytes(range(256)) + b"\xff\xfe\x00\xc3(" + "€".encode()


@pytest.mark.parametrize("decode_responses", [False, True], ids=["bytes", "decoded"])
def test_payloads_and_names_come_back_byte_for_byte_even_through_a_decoding_client(
    decode_responses: bool, client: redis.Redis
) -> None:
    own_client = redis.Redis.from_url(REDIS_URL, decode_responses=decode_responses)
    store = RedisStore(own_client, key_prefix=new_key_prefix())
    try:
        held = new_run_id()
        store.acquire({"ünï{cödé}": 1}, "holder", held, HOLDER, LONG_LEASE)
        for task_id in ("tâsk-1", "tâsk-2"):
            outcome = store.park(ParkRequest(
                {"ünï{cödé}": 1}, task_id, new_run_id(), HOLDER, LONG_LEASE, payload=BINARY_PAYLOAD + task_id.encode(),
                first_deferred_at=1.0, max_waiters=10, task_name="pröj.task",
            ))  # fmt: skip
            assert outcome == ParkOutcome.PARKED
        _, [woken] = store.release_and_wake(held, DISPATCH_LEASE)
        assert (woken.task_id, woken.payload, woken.task_name) == (
            "tâsk-1",
            BINARY_PAYLOAD + "tâsk-1".encode(),
            "pröj.task",
        )
        [readmitted] = store.readmit("ünï{cödé}", LONG_LEASE)
        assert (readmitted.task_id, readmitted.payload) == ("tâsk-2", BINARY_PAYLOAD + "tâsk-2".encode())
        assert store.claim("tâsk-2", readmitted.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
        assert [w.task_id for w in store.waiters()] == ["tâsk-1"]  # (still dispatched)
    finally:
        own_client.close()
        keys = list(client.scan_iter(match=f"{store.key_prefix}*"))
        if keys:
            client.delete(*keys)


class _CountingConnection(redis.Connection):
    """A connection that notes the name of every command it sends (the round trips)."""

    sent: list[str] = []

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        _CountingConnection.sent.append(str(args[0]))
        super().send_command(*args, **kwargs)  # type: ignore[no-untyped-call]


@pytest.fixture
def counting_store(client: redis.Redis) -> Iterator[RedisStore]:
    """A store whose connections note every command they send (``_CountingConnection.sent``);
    closed, its pool disconnected (a client handed a pool leaves it open) and its keys deleted
    afterwards."""
    parts = urlsplit(REDIS_URL)
    pool = redis.ConnectionPool(
        connection_class=_CountingConnection, host=parts.hostname or "127.0.0.1", port=parts.port or 6379,
        db=DEDICATED_DB, password=parts.password,
    )  # fmt: skip
    store = RedisStore(redis.Redis(connection_pool=pool), key_prefix=new_key_prefix())
    try:
        yield store
    finally:
        store.close()
        pool.disconnect()
        keys = list(client.scan_iter(match=f"{store.key_prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def test_warm_up_loads_the_scripts_so_that_a_first_call_after_a_restart_is_one_round_trip(
    client: redis.Redis, counting_store: RedisStore
) -> None:
    store = counting_store
    # Given a server that lost its script cache (a restart without persistence)
    client.script_flush()

    # When the store warms up (a pool process starting)
    store.warm_up()

    # Then the first admission and release are one EVALSHA each: no NOSCRIPT, no load
    _CountingConnection.sent.clear()
    run_id = new_run_id()
    assert store.acquire({"licence": 1}, "task-1", run_id, HOLDER, LONG_LEASE) == Admission(True)
    assert store.release(run_id) == 1
    assert _CountingConnection.sent == ["EVALSHA", "EVALSHA"]


def test_each_parking_step_is_one_round_trip(counting_store: RedisStore) -> None:
    store = counting_store
    # Given every script loaded once (a first use after a restart loads it: one more trip)
    held = new_run_id()
    store.acquire({"licence": 1}, "holder", held, HOLDER, LONG_LEASE)
    park(store, {"licence": 1}, "warm-up", 1.0)
    _, [warm] = store.release_and_wake(held, DISPATCH_LEASE)
    store.claim(warm.task_id, warm.run_id, HOLDER, LONG_LEASE)
    store.recover(DISPATCH_LEASE)
    store.readmit("nobody", DISPATCH_LEASE)
    store.forget("nobody", DISPATCH_LEASE)
    store.release_holder_and_wake("nobody", HOLDER, DISPATCH_LEASE)
    store.waiters()

    def in_one_trip(step: str, operation: Callable[[], _T]) -> _T:
        _CountingConnection.sent.clear()
        result = operation()
        assert _CountingConnection.sent == ["EVALSHA"], f"{step}: {_CountingConnection.sent}"
        return result

    def park_once(task_id: str, slots: dict[str, int], *, payload: bytes | None = b"message", **options: Any) -> str:
        return in_one_trip(
            f"park {task_id}",
            lambda: store.park(ParkRequest(
                slots, task_id, new_run_id(), HOLDER, LONG_LEASE, payload=payload, first_deferred_at=2.0,
                **{"max_waiters": 10, **options},
            )),
        )  # fmt: skip

    # Then each step is one EVALSHA, whatever it decides
    assert park_once("task-2", {"licence": 1}) == ParkOutcome.PARKED
    assert park_once("task-2", {"licence": 1}) == ParkOutcome.WAITING
    assert park_once("task-x", {"licence": 1}, payload=None) == ParkOutcome.FULL
    assert park_once("task-x", {"licence": 1}, max_waiters=1) == ParkOutcome.LIST_FULL
    assert park_once("task-3", {"other": 1}) == ParkOutcome.ADMITTED
    _, [woken] = in_one_trip("release_and_wake", lambda: store.release_and_wake(warm.run_id, DISPATCH_LEASE))
    claimed = in_one_trip("claim", lambda: store.claim("task-2", woken.run_id, HOLDER, LONG_LEASE))
    assert claimed is ClaimOutcome.RUN
    again = in_one_trip("claim (a duplicate)", lambda: store.claim("task-2", woken.run_id, "w9@h/9", LONG_LEASE))
    assert again is ClaimOutcome.END
    assert in_one_trip("recover", lambda: store.recover(DISPATCH_LEASE)) == []
    assert in_one_trip("recover (of some slots)", lambda: store.recover(DISPATCH_LEASE, caps=["licence"])) == []
    # ... readmits: past the maximum wait, then by an operator
    for task_id, first in (("task-4", 4.0), ("task-5", 5.0)):
        assert park(store, {"licence": 1}, task_id, first) == ParkOutcome.PARKED
    overdue = in_one_trip("recover (readmit)", lambda: store.recover(DISPATCH_LEASE, readmit_before=4.5))
    assert [(w.task_id, w.readmit) for w in overdue] == [("task-4", True)]
    drained = in_one_trip("readmit", lambda: store.readmit("licence", DISPATCH_LEASE))
    assert [(w.task_id, w.readmit) for w in drained] == [("task-5", True)]
    for readmitted in (*overdue, *drained):
        assert store.claim(readmitted.task_id, readmitted.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    # ... a dead holder's release, a forgotten dispatch and a revoked task's release, each with its wake
    assert park(store, {"licence": 1}, "task-6", 6.0) == ParkOutcome.PARKED
    deleted, [dispatched] = in_one_trip(
        "release_holder_and_wake", lambda: store.release_holder_and_wake("task-2", HOLDER, DISPATCH_LEASE)
    )
    assert (deleted, dispatched.task_id) == (1, "task-6")
    assert in_one_trip("forget", lambda: store.forget("task-6", DISPATCH_LEASE)) == (1, [])
    assert in_one_trip("release_task_and_wake", lambda: store.release_task_and_wake("task-3", DISPATCH_LEASE)) == (
        1,
        [],
    )
    assert in_one_trip("waiters", store.waiters) == []
    assert store.leases() == []


def test_a_tombstone_is_one_key_that_expires_by_itself_and_gives_way_to_a_new_park(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    store = new_store()
    store.done_seconds = 60.0
    held = new_run_id()
    store.acquire({"licence": 1}, "holder", held, HOLDER, LONG_LEASE)
    assert park(store, {"licence": 1}, "waiter", 1.0) == ParkOutcome.PARKED
    _, [woken] = store.release_and_wake(held, DISPATCH_LEASE)

    # When the task is revoked while its dispatch is on the way
    assert store.forget("waiter", DISPATCH_LEASE) == (1, [])

    # Then it left every list and index, its payload with it: only its tombstone is left, a
    # key that Redis deletes after done_seconds (by Redis TIME), which nothing ever walks
    done = store.done_key("waiter")
    assert written_keys(client, store) == {store.key_prefix.encode() + b":limits", done}
    assert 55_000 < client.pttl(done) <= 60_000
    assert store.waiters() == []
    # ... and it answers for the task: the late copy ends
    assert store.claim("waiter", woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END

    # When a new copy of the task parks, the tombstone gives way to its entry
    store.acquire({"licence": 1}, "blocker", new_run_id(), HOLDER, LONG_LEASE)
    assert park(store, {"licence": 1}, "waiter", 2.0) == ParkOutcome.PARKED
    assert client.exists(done) == 0
    assert store.claim("waiter", woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END  # (it waits)


def test_a_claimed_entry_dispatched_once_leaves_nothing_and_one_dispatched_twice_a_tombstone(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    store = new_store()
    limits = store.key_prefix.encode() + b":limits"
    held = new_run_id()
    store.acquire({"licence": 1}, "holder", held, HOLDER, LONG_LEASE)
    for task_id, first in (("once", 1.0), ("twice", 2.0)):
        assert park(store, {"licence": 1}, task_id, first) == ParkOutcome.PARKED

    # Given one waiter dispatched and claimed at the first try
    _, [once] = store.release_and_wake(held, DISPATCH_LEASE)
    assert store.claim("once", once.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert client.exists(store.done_key("once")) == 0

    # and one whose first dispatch went unclaimed past its deadline, then a readmit, before a claim
    _, [lost] = store.release_and_wake(once.run_id, 0.2)
    assert lost.task_id == "twice"
    deadline = time.monotonic() + 10.0
    readmits: list[Woken] = []
    while not readmits and time.monotonic() < deadline:
        time.sleep(0.05)
        readmits = store.recover(DISPATCH_LEASE, readmit_before=10.0)
    [readmitted] = readmits
    assert (readmitted.task_id, readmitted.readmit) == ("twice", True)
    assert store.claim("twice", readmitted.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT

    # Then each dispatch counted: the one dispatched twice leaves a tombstone, the other nothing
    assert written_keys(client, store) == {limits, store.done_key("twice")}
    assert store.claim("twice", lost.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END


#: Rewrites a waiting record with a limit after each slot name (KEYS: the waiting hash; ARGV:
#: task id, limit): a record as a store that kept the parked limits wrote it.
_WITH_PARKED_LIMITS = """
local record = cmsgpack.unpack(redis.call('HGET', KEYS[1], ARGV[1]))
local rewritten = {}
for i = 1, 7 do
  rewritten[i] = record[i]
end
for i = 8, #record do
  rewritten[#rewritten + 1] = record[i]
  rewritten[#rewritten + 1] = tonumber(ARGV[2])
end
redis.call('HSET', KEYS[1], ARGV[1], cmsgpack.pack(rewritten))
"""


def test_records_holding_the_limits_they_parked_with_are_served_by_the_slots_limits(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    # Given waiters of a limit-1 slot whose records hold a limit of 5 after each slot name
    store = new_store()
    held = new_run_id()
    store.acquire({"licence": 1}, "holder", held, HOLDER, LONG_LEASE)
    assert park(store, {"licence": 1, "region": 1}, "both", 1.0) == ParkOutcome.PARKED
    assert park(store, {"licence": 1}, "licence-only", 2.0) == ParkOutcome.PARKED
    waiting = store.key_prefix.encode() + b":waiting"
    for task_id in ("both", "licence-only"):
        client.eval(_WITH_PARKED_LIMITS, 1, waiting, task_id, 5)
    # Then they read as the same tasks, waiting for their slots
    assert park(store, {"region": 1, "licence": 1}, "both", 1.0) == ParkOutcome.WAITING
    assert [(w.slot, w.task_id) for w in store.waiters()] == [
        ("licence", "both"), ("licence", "licence-only"), ("region", "both"),
    ]  # fmt: skip

    # When the holder releases, one waiter takes the slot: its limit is 1, not 5
    _, [first] = store.release_and_wake(held, DISPATCH_LEASE)
    assert first.task_id == "both"
    assert store.claim("both", first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert {lease.slot for lease in store.leases()} == {"licence", "region"}
    _, [second] = store.release_and_wake(first.run_id, DISPATCH_LEASE)
    assert second.task_id == "licence-only"
    assert store.claim("licence-only", second.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert store.release(second.run_id) == 1
    # ... and each left every list
    assert written_keys(client, store) == {store.key_prefix.encode() + b":limits"}


# -- hostile names -----------------------------------------------------------------------

#: Slot names that a careless layout would let into another slot's keys or hash tag:
#: braces, their escaped spellings, the escape character, key-suffix look-alikes.
BRACE_NAMES = [
    "a",
    "{a}",
    "%7Ba%7D",
    "%257Ba%257D",
    "%",
    "%25",
    "{",
    "}",
    "}{",
    "{}",
    "a}:tasks",
    "a}:runs",
    "{a}:slot:{b}",
    "x:slot:{a}:runs",
    "quote'\"{brace}",
    "ünï{cödé}🚀",
    "{" * 120 + "}" * 120,
    "}" * 120 + "{" * 120,
]


def hostile_task_id(number: int) -> str:
    """A task id made of a hostile name, cut to the longest task id a store keeps."""
    suffix = f"#{number}"
    return BRACE_NAMES[-number - 1][: MAX_ID_LENGTH - len(suffix)] + suffix


def test_slot_names_and_task_ids_with_braces_never_collide(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    store = new_store()
    assert len(set(BRACE_NAMES)) == len(BRACE_NAMES)
    # Given every name as a limit-1 slot, each taken by a task id that is a hostile name too
    runs = {}
    for number, slot in enumerate(BRACE_NAMES):
        task_id = hostile_task_id(number)
        runs[slot] = (task_id, new_run_id())
        assert store.acquire({slot: 1}, task_id, runs[slot][1], HOLDER, LONG_LEASE) == Admission(True), slot

    # Then every slot has keys of its own, and each holds exactly its own lease
    all_slot_keys = [key for slot in BRACE_NAMES for key in store.slot_keys(slot)]
    assert len(set(all_slot_keys)) == len(all_slot_keys)
    for slot, (task_id, run_id) in runs.items():
        assert [(lease.slot, lease.task_id, lease.run_id) for lease in store.leases(slot)] == [(slot, task_id, run_id)]
    assert store.status() == sorted(
        (SlotStatus(slot, 1, holders=1, expired=0) for slot in BRACE_NAMES), key=lambda status: status.slot
    )

    # When each task id is revoked (the scripts find the keys from the stored names)
    for task_id, _run_id in runs.values():
        assert store.release_task(task_id) == 1

    # Then nothing but the sentinels is left: the Python and Lua spellings of the keys agree
    assert store.leases() == []
    assert written_keys(client, store) == sentinel_keys(store)
    assert [status.holders for status in store.status()] == [0] * len(BRACE_NAMES)


def test_waiters_of_slots_with_braces_never_collide(new_store: Callable[..., RedisStore], client: redis.Redis) -> None:
    store = new_store()
    # Given every hostile name as a full limit-1 slot, each with one waiter whose task id is hostile too
    held = {}
    for number, slot in enumerate(BRACE_NAMES):
        held[slot] = new_run_id()
        assert store.acquire({slot: 1}, f"holder#{number}", held[slot], HOLDER, LONG_LEASE) == Admission(True)
        assert park(store, {slot: 1}, hostile_task_id(number), float(number)) == ParkOutcome.PARKED

    # Then each slot's waiting list has a key of its own and holds exactly its own waiter
    waiter_keys = [store.waiters_key(slot) for slot in BRACE_NAMES]
    assert len(set(waiter_keys)) == len(waiter_keys)
    for number, slot in enumerate(BRACE_NAMES):
        assert [(w.slot, w.task_id, w.position) for w in store.waiters(slot)] == [(slot, hostile_task_id(number), 1)]
    assert len(store.waiters()) == len(BRACE_NAMES)

    # When each holder releases, exactly its own slot's waiter is dispatched, and claims
    for number, slot in enumerate(BRACE_NAMES):
        task_id = hostile_task_id(number)
        deleted, woken = store.release_and_wake(held[slot], DISPATCH_LEASE)
        assert (deleted, [(w.task_id, w.payload) for w in woken]) == (1, [(task_id, f"payload of {task_id}".encode())])
        assert store.claim(task_id, woken[0].run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
        assert store.release(woken[0].run_id) == 1

    # Then nothing but the sentinels is left: the Python and Lua spellings of the keys agree
    assert store.waiters() == []
    assert store.leases() == []
    assert written_keys(client, store) == sentinel_keys(store)


# -- a client of the application's own ---------------------------------------------------


@pytest.mark.parametrize("decode_responses", [False, True], ids=["bytes", "decoded"])
def test_a_ready_client_is_used_and_never_closed(decode_responses: bool, client: redis.Redis) -> None:
    own_client = redis.Redis.from_url(REDIS_URL, decode_responses=decode_responses)
    key_prefix = new_key_prefix()
    try:
        store = store_from_url(own_client)
        assert isinstance(store, RedisStore)
        store = RedisStore(own_client, key_prefix=key_prefix)
        assert store.client is own_client
        connection_id = own_client.client_id()

        run_id = new_run_id()
        assert store.acquire({"provider": 1}, "task-ü", run_id, HOLDER, LONG_LEASE) == Admission(True)
        assert store.acquire({"provider": 1}, "task-2", new_run_id(), HOLDER, LONG_LEASE) == Admission(
            False, ("provider",)
        )
        assert [(lease.slot, lease.task_id) for lease in store.leases()] == [("provider", "task-ü")]
        assert store.renew([run_id], LONG_LEASE) == {run_id: 1}
        assert store.status() == [SlotStatus("provider", 1, holders=1, expired=0)]

        # When the store is closed, the application's client keeps its connection
        store.close()
        assert own_client.client_id() == connection_id
        assert store.release(run_id) == 1
    finally:
        own_client.close()
        keys = list(client.scan_iter(match=f"{key_prefix}*"))
        if keys:
            client.delete(*keys)


def test_close_closes_a_client_the_store_created(new_store: Callable[..., RedisStore]) -> None:
    store = new_store()
    connection_id = store.client.client_id()
    store.close()
    # The pool was disconnected: the next command needs a new connection.
    assert store.client.client_id() != connection_id


# -- losing Redis --------------------------------------------------------------------------


def test_a_redis_restart_loses_every_lease_and_admission_starts_afresh(
    new_store: Callable[..., RedisStore], client: redis.Redis
) -> None:
    store = new_store()
    # Given a run holding the only place of a slot, which refuses a second task
    held = new_run_id()
    assert store.acquire({"licence": 1}, "task-a", held, HOLDER, LONG_LEASE) == Admission(True)
    assert not store.acquire({"licence": 1}, "task-b", new_run_id(), HOLDER, LONG_LEASE).granted

    # When Redis restarts without persistence: its data and its script cache are gone
    client.flushdb()
    client.script_flush()

    # Then the lease keeper's next renewal reports the run lost
    assert store.renew([held], LONG_LEASE) == {}
    # and the store is empty, sentinels included (status forgets the slot until it is used)
    assert store.leases() == []
    assert store.status() == []
    assert store.release(held) == 0
    # and admission works again at once (the scripts are loaded again by themselves)
    assert store.acquire({"licence": 1}, "task-b", new_run_id(), HOLDER, LONG_LEASE) == Admission(True)
    assert store.status() == [SlotStatus("licence", 1, holders=1, expired=0)]


def test_an_unreachable_redis_raises_store_error_without_the_password() -> None:
    store = RedisStore("redis://:s3cret-pw@127.0.0.1:1/15")
    try:
        assert "s3cret-pw" not in store.display_url
        operations: list[Callable[[], object]] = [
            lambda: store.acquire({"provider": 1}, "task-1", new_run_id(), HOLDER, LONG_LEASE),
            lambda: store.renew([new_run_id()], LONG_LEASE),
            lambda: store.release(new_run_id()),
            store.sweep,
            store.status,
        ]
        for operation in operations:
            with pytest.raises(StoreError) as raised:
                operation()
            assert "s3cret-pw" not in str(raised.value)
            assert "127.0.0.1:1" in str(raised.value)
            assert isinstance(raised.value.__cause__, redis.RedisError)
    finally:
        store.close()


def test_a_unix_socket_url_masks_its_query_password() -> None:
    store = RedisStore("redis+unix:///nonexistent/caps-test.sock?db=15&password=s3cret-pw")
    try:
        assert store.client.connection_pool.connection_kwargs["path"] == "/nonexistent/caps-test.sock"
        assert "s3cret-pw" not in store.display_url
        with pytest.raises(StoreError) as raised:
            store.status()
        assert "s3cret-pw" not in str(raised.value)
    finally:
        store.close()


def test_a_malformed_url_is_a_configuration_error_without_the_password() -> None:
    with pytest.raises(ConfigurationError) as raised:
        RedisStore("redis://:s3cret-pw@127.0.0.1:notaport/15")
    assert "s3cret-pw" not in str(raised.value)


def test_a_server_without_an_append_only_file_is_reported_as_losing_parked_tasks_on_restart(
    tmp_path: Any, client: redis.Redis
) -> None:
    # The shared test server runs with appendonly no (as CI starts it): its waiting lists die with it.
    store = RedisStore(client, key_prefix=new_key_prefix())
    warning = store.durability_warning()
    assert warning is not None and "appendonly no" in warning and "caps_strategy='backoff'" in warning
    # A private server with an append-only file keeps them: nothing to warn about.
    with private_redis_server(tmp_path, "--appendonly", "yes") as url:
        durable = RedisStore(url, key_prefix=new_key_prefix())
        try:
            assert durable.durability_warning() is None
        finally:
            durable.close()


@contextlib.contextmanager
def private_redis_server(directory: Any, *options: str) -> Iterator[str]:
    """A ``redis-server`` of this test's own on a free loopback port, stopped afterwards."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(directory), *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis.from_url(url) as probe_client:
                    probe_client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)
