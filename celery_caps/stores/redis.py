"""The Redis slot store: slot leases in Redis, every operation one Lua script.

Each store operation (acquire, a batch of renewals, each kind of release, the
sweep, the reports, and each step of the waiting list: park, each kind of release
and wake, claim, forget, recover, readmit) is a single script run with ``EVALSHA``
(loaded again automatically after a Redis restart), so Redis executes it
atomically: two admissions competing for the last place of a slot are serialised
by Redis itself, and a park sees every release before it while every release after
it sees the waiter.  Lease expiry, dispatch deadlines, tombstone expiry and park
times are computed inside the scripts from Redis ``TIME``, never from a worker's
clock.  Expiry times are seconds since the epoch, as sorted-set scores.

Key layout
----------
``P`` is the key prefix (``key_prefix``, default ``caps``), so that several apps
can share one Redis database.  ``E`` is the slot name with ``%``, ``{`` and ``}``
percent-encoded (``%25``, ``%7B``, ``%7D``): the mapping is injective and leaves no
brace in a slot's hash tag, so a hostile slot name can neither merge with another
slot's keys nor change which Redis Cluster hash slot its keys land in.

=============================  ======  =============================================
key                            type    content
=============================  ======  =============================================
``P:slot:{E}:runs``            ZSET    run id -> lease expiry, one per lease in the slot
``P:slot:{E}:tasks``           ZSET    task id -> latest expiry of its leases in the
                                       slot; admission counts distinct live task ids
                                       here with one ``ZCOUNT``
``P:limits``                   HASH    slot name -> last limit: the sentinels, which the
                                       sweep never deletes, so ``status`` lists every
                                       slot name ever used; every hand-over to a waiter
                                       counts room by these
``P:operator_limits``          HASH    cap or slot name -> the limit an operator set
                                       (``celery caps limit``): every room count uses
                                       the slot's, else its cap's, else ``P:limits``
``P:keyed``                    ZSET    every keyed slot name (``cap:key``) of ``P:limits``,
                                       score 0, so that a cap's keys are a range by name
                                       (the sweep counts them with ``ZLEXCOUNT``); the
                                       member ``""`` marks it complete
``P:slot:{E}:weights``         HASH    task id -> its weight in the slot (the largest of
                                       its runs there), for the task ids of weight above 1
                                       alone: absent while every holder takes one unit
``P:runs``                     HASH    run id -> MessagePack ``[task id, holder, slot...]``;
                                       run id + NUL + ``meta`` -> ``[task name, taken at]``;
                                       run id + NUL + ``weights`` -> MessagePack
                                       ``{slot: weight}`` of the slots where it is above 1
                                       (no field for a run of weight 1 everywhere)
``P:expiry``                   ZSET    run id -> expiry (every lease of a run shares
                                       one); the sweep's index
``P:task:<task id>``           SET     run ids of a task id; releasing a task or a
                                       holder reads it instead of scanning
``P:history``                  ZSET    optional history: JSON event -> its time, trimmed
                                       by age and count on every write
``P:slot:{E}:waiters``         ZSET    the slot's waiting list (park strategy), one
                                       member per entry, waiting or dispatched: score
                                       = first-deferral time, or for an entry with a
                                       fair key in the slot its round there less 2^40
                                       (negative: below every time), member = park time
                                       (Redis ``TIME`` as fixed-width text) + a signature
                                       of the task's slot names and deployment + task
                                       id, so the set's own order is the waiting order
                                       (round, first deferral, then park time)
``P:waiting``                  HASH    task id -> MessagePack record of an entry: first
                                       deferral, park time, task name, dispatch run id
                                       and deadline (empty while waiting), how many
                                       times it was dispatched, the signature, the slot
                                       names it waits for (no limits: a waiter is
                                       dispatched against the limits in ``P:limits``);
                                       task id + NUL + ``weights`` -> its weights, as a
                                       run's (no field for weight 1 everywhere);
                                       task id + NUL + ``fair`` -> MessagePack ``{slot:
                                       [fair key, round]}`` of the slots where it has a
                                       fair key (no field for none)
``P:payloads``                 HASH    task id -> its message, opaque bytes (kept apart
                                       so that walking a list never reads payloads)
``P:waitlists``                SET     slot names whose waiting list is not empty
                                       (what ``recover`` walks)
``P:dispatches``               ZSET    dispatched task id -> dispatch deadline;
                                       ``recover`` finds unclaimed dispatches here
``P:deployments``              HASH    task id -> the deployment of the handle that
                                       parked the entry, for entries of a deployment
                                       other than ``""`` (an entry without one is of
                                       ``""``); deleted with the entry
``P:slot:{E}:waiters:D``       ZSET    the members of ``P:slot:{E}:waiters`` whose
                                       entries are of deployment ``D`` (not ``""``),
                                       as there: the list a handle of ``D`` walks
``P:slot:{E}:heavy``           ZSET    the waiting (not dispatched) entries of deployment
``P:slot:{E}:heavy:D``                 ``""`` (``D``) whose weight in the slot is above 1,
                                       in waiting order (the waiters member, NUL, the
                                       weight): the oldest holds the room it needs
``P:slot:{E}:fair``            HASH    fair key -> ``"<count> <max round>"`` of the
``P:slot:{E}:fair:D``                  slot's listed entries (waiting or dispatched) of
                                       deployment ``""`` (``D``) with that fair key; a
                                       field goes at count 0
``P:done:<task id>``           STRING  a tombstone: MessagePack (the claimed dispatch's
                                       run id, the holder that claimed it, the count
                                       of dispatches), with a TTL of ``done_seconds``
                                       (Redis deletes it; no script walks tombstones)
=============================  ======  =============================================

A dispatch with leases holds its waiter's room with an ordinary run (holder
``caps-dispatch``, expiry the dispatch deadline by Redis ``TIME``) under the
waiter's own task id; ``claim`` gives that run its holder and a full lease.  A
dispatch without leases (a readmit) only marks the record.  Room is counted
against each slot's limit in ``P:limits`` (its last admission's), never a limit the
waiter parked with, so every waiter of a slot shares one limit: ``release_and_wake``
walks the waiting lists of the released slots together, oldest first, and stops
walking a list once its slot is full.  A waiter passed over because another of its
slots is full marks its signature, so the waiters behind it that need the same
slots are passed over without reading their records (one ``ZSCORE`` each, for the
case where a task id already holds that slot).

Weights (a task taking ``w`` units of a slot's limit): a slot's units are its live task ids
(one ``ZCOUNT``) plus, for each live task id of ``P:slot:{E}:weights``, its weight (at most the
limit in force) less 1.  An admission (``acquire``, ``park``) of a slot whose live task ids
leave room first asks whether the slot has weighted holders or heavy entries (one ``EXISTS`` of
its two keys): without, room is counted as without weights; with, it reads the weighted holders
(``HGETALL``, a ``ZSCORE`` each) and the oldest heavy entry of the handle's deployment
(``ZRANGE 0 1``), which holds the room it needs against newcomers.  A hand-over reads each walked
slot's weighted holders once; an entry that does not fit a slot closes that slot for the
entries after it in the walk (a task id holding the slot already still passes: it counts once).
A weighted run's leaving recomputes its task's weight in each of its slots from the task's
runs that remain.

Fair shares (:class:`~celery_caps.stores.base.ParkingStore`, "Fair shares"): ``park`` of an
entry with a fair key ``k`` in slot ``E`` (``PARKED`` only) reads the handle's list of ``E`` at
both ends (whether an entry without a fair key is listed: a time score, the list's last; then
the entry parks without a round, first come, so that the entries parked before a deploy added
``fair_by`` are not passed by the rounds; else the lowest fair score, the head) and ``k``'s
field of ``P:slot:{E}:fair[:D]``, then scores the member
``round - 2^40`` in ``E``'s lists, counts it in that field and keeps ``[k, round]`` beside the
record; an entry leaving the lists (claimed, forgotten) takes its count off.  A request without
fair keys costs nothing more.  Every walk goes by (score, member) as before, so within a round
Redis orders by park time, not first deferral (they differ only for a task parked again), and a
walk merging lists meets fair entries before entries without a fair key.  Whatever reads a score
as a first deferral (``readmit``, ``recover``'s ``readmit_before``) reads a fair entry's from its
record.  A handle without a deployment, on a store whose entries have some, passes over the other
deployments' entries at the ends of the list to find the head.  Entries parked before fair shares
existed have no fair key.  Entries without a fair key in a slot whose list has rounds (after a
deploy removed ``fair_by``) keep their time score: after every round, first come.  ``park`` of a task id listed
already changes nothing: the entry answers for it if it has the same task name
(whatever slots the copy asks for now), else the id is in use by another task.

Deployments sharing the store (:attr:`~celery_caps.stores.base.SlotStore.deployment`):
``park`` records the handle's deployment ``D`` in ``P:deployments`` and puts the entry's
member in ``P:slot:{E}:waiters:D`` too, and every script that dispatches (each release
and wake, ``forget``, ``recover``, ``readmit``) takes the handle's deployment and
dispatches only entries of it: a handle of deployment ``D`` walks those lists of its own,
so a hand-over never reads another deployment's waiters, however many wait ahead of its
own (``recover`` looks up each expired dispatch's deployment, and leaves another's as it
is).  The others keep their place; the slots, their limits and leases, and the lists of
every deployment (``waiters``, a list's length for ``max_waiters``, ``prune``) are
shared.  A handle without a deployment (``""``) walks the lists of every deployment and
passes over the entries that have one: as the signature in a waiters member covers the
deployment, it reads ``P:deployments`` once per signature it meets, and nothing more
when no entry has a deployment (``P:deployments`` does not exist).  An entry without a
deployment (parked by such a handle, or before deployments existed) is only ever
dispatched by such a handle.

An entry leaves the list when a copy claims it (or ``forget`` drops it).  If it
was dispatched more than once (or is forgotten while dispatched), copies of an
earlier dispatch may still be on their way, so a tombstone key stays behind for
``done_seconds``; ``claim`` reads it (only a copy of the dispatch it records may go
on), ``park`` replaces it by an entry that keeps its count of dispatches.

No operation uses ``KEYS`` or ``SCAN``: renewing or releasing a run costs its own
leases, releasing a task costs its own runs, the sweep costs the expired leases
(plus ``log n``), admission costs ``O(log n)`` per slot (and the slot's weighted holders,
where it has some); parking costs ``O(log n)`` per slot, a release with waiters the waiters it passes over (about
2 µs of Redis time each; a handle without a deployment also passes over every entry
of another deployment, about 2 µs each), ``recover`` the unclaimed dispatches, the
waiters of the caps it serves, with task names the waiters of every other list
(their records tell their task names), and the waiters it passes over.  Empty sets
disappear by themselves; after every lease is released and every waiter has run,
only ``P:limits`` (and tombstones, until they expire) remains.

Redis Cluster
-------------
The per-slot keys of one slot share the hash tag ``{E}``, so the counting, the
lease rows and the waiting list of a slot always live together: a waiter of one
slot name sits in that slot name's hash slot.  But every admission also writes the
run and task indexes (``P:runs``, ``P:expiry``, ``P:task:...``), which releasing by
run id, task id or holder needs, and which no hash tag can put next to every slot
at once; a multi-slot admission touches several slots' tags as well.  Parking is
the same: a park writes the store-wide waiting-list keys (``P:waiting``,
``P:payloads``, ``P:waitlists``, ``P:deployments``, ``P:done:...``), a multi-slot
park (a task with several caps) writes the waiting lists of several slots, and a
release dispatches waiters whose other slots, and their lists, live under other
tags.  A script may only touch keys of one hash slot on a cluster, so on Redis
Cluster every key of the store is
co-located: the store gives its prefix a hash tag of its own (``caps`` becomes
``{caps}``, see :func:`~celery_caps.stores.redis_clients.hash_tagged`; Cluster
hashes only the first ``{...}`` of a key), which puts the whole store on one shard.
How the client is built (one server, ``redis+cluster://``, ``sentinel://``, ready
objects) is :mod:`celery_caps.stores.redis_clients`.

Redis keeps what it has in memory: a Redis restart without persistence loses every
lease and every sentinel, and every parked task's message with the waiting list.
Runs then find their leases gone at the next renewal (reported lost), and
admission starts afresh; parked tasks are lost (their original messages were
acknowledged when they parked), so run Redis with persistence (AOF) when you park
on it.

Nor may Redis evict the store's keys.  Under ``maxmemory-policy allkeys-*`` a Redis short of
memory evicts any key: a lease's (a second task then takes a slot its holder still has) or a
waiting list's (its parked tasks are lost).  The store refuses such a server when it is first
used (:meth:`RedisStore.check_eviction`), on every primary it writes to, unless it is built with
``allow_eviction`` (``caps_redis_allow_eviction``).  Under ``volatile-*`` only keys with a TTL
go, and of the store's keys only tombstones have one: a tombstone evicted early lets a stale
copy of a woken task run it again, which the store warns about
(:meth:`RedisStore.connection_warnings`).  ``noeviction`` is safe: a full Redis refuses writes,
and the store's calls fail with :class:`~celery_caps.errors.StoreError` until it has room.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import asdict
from importlib import resources
from typing import Any

import redis
import redis.cluster
from redis.client import NEVER_DECODE

from ..errors import ConfigurationError, StoreError
from .base import (
    Admission,
    ClaimOutcome,
    Entry,
    HistoryEvent,
    Lease,
    ParkingStore,
    ParkOutcome,
    ParkRequest,
    SlotStatus,
    Waiter,
    Woken,
)
from .redis_clients import (
    RedisTarget,
    eviction_findings,
    hash_tagged,
    primary_infos,
    target_from_client,
    target_from_url,
)

#: Slot names read per HSCAN call, and per status script, by the reads of every slot name.
SCAN_BATCH = 500

#: Helpers of the parking scripts, loaded after redis_common.lua.
_WAITLIST_LIBRARY = "redis_waitlist.lua"
_PARK_OUTCOMES = {outcome.value.encode(): outcome for outcome in ParkOutcome}
_CLAIM_OUTCOMES = {outcome.value.encode(): outcome for outcome in ClaimOutcome}
#: What to do when a client to one server meets a cluster.
_USE_CLUSTER_URL = (
    "set caps_url to redis+cluster://host:port[,host:port...] (or pass a redis.cluster.RedisCluster), "
    "which puts every key of the store under one hash tag"
)


class Script:
    """One Lua script: its text and SHA1 (computed here: a cluster client needs no connection
    for it, and the store builds its client on first use)."""

    def __init__(self, source: str) -> None:
        self.script = source.encode("utf-8")
        self.sha = hashlib.sha1(self.script).hexdigest()


def _encode(text: str) -> bytes:
    # surrogatepass keeps even a lone surrogate round-trippable (and distinct); the
    # layers above reject those, but the store should not be the one to corrupt them.
    return text.encode("utf-8", "surrogatepass")


def _text(value: bytes | str) -> str:
    """A reply string, whether or not the client decodes responses itself."""
    return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else value


def _run_id_nonce() -> str:
    """The first 24 hex digits of the run ids one dispatching script creates (it adds 8 of its own)."""
    return uuid.uuid4().hex[:24]


def _escape_tag(raw: bytes) -> bytes:
    """Percent-encode ``%``, ``{`` and ``}`` (see the module docstring); ``%`` first."""
    return raw.replace(b"%", b"%25").replace(b"{", b"%7B").replace(b"}", b"%7D")


def _load_script_source(name: str, *libraries: str) -> str:
    """A script's text: ``redis_common.lua``, then ``libraries``, then the script itself."""
    package = resources.files(__package__ or "celery_caps.stores")
    parts = ("redis_common.lua", *libraries, name)
    return "\n".join(package.joinpath(part).read_text("utf-8") for part in parts)


class RedisStore(ParkingStore):
    """Slots in Redis, each operation one atomic Lua script (see the module docstring); the
    reads of every slot name (``status``) walk them with ``HSCAN``, a batch at a time, so that
    none holds the server for all of them; ``keys_per_cap`` counts each cap's keys as a range of
    ``P:keyed``.

    Args:
        target: A URL (``redis://[:password@]host:port/db``, ``rediss://...``,
            ``unix:///path/to/redis.sock?db=0``, ``redis+unix://...``;
            ``redis+cluster://host:port[,host:port...]`` for Redis Cluster;
            ``sentinel://host:port[;sentinel://host:port...]?master_name=name`` for
            Redis Sentinel) or a ready client: a ``redis.Redis`` (also a Sentinel
            ``master_for`` client), a ``redis.cluster.RedisCluster``, or a
            ``redis.sentinel.Sentinel`` with ``master_name``.  A client passed in is
            never closed by :meth:`close`, and may decode responses or not.
        key_prefix: Prefix of every key this store uses; stores with different
            prefixes share a Redis database without seeing each other's slots.  On
            Redis Cluster the prefix gets a hash tag unless it has one (``caps``
            becomes ``{caps}``), so that every key of the store, and so every
            script's keys, lands in one hash slot.
        master_name: The Sentinel master's name, for a ``sentinel://`` URL without a
            ``master_name`` parameter, or a ``Sentinel`` object.
        allow_eviction: Run on a Redis whose ``maxmemory-policy`` may evict any key
            (``allkeys-*``), with a warning, rather than refuse it
            (``caps_redis_allow_eviction``; see the module docstring).

    The client is created on first use: a cluster client contacts the cluster as it
    is created, and a failure there is a :class:`~celery_caps.errors.StoreError` of
    the operation like any other (the task is put back), not an error of building
    the store.  The first use also reads the eviction policy of every primary: one
    that may evict any key is refused (:meth:`check_eviction`), with a
    :class:`~celery_caps.errors.StoreError` naming the setting, on every call until
    the policy is changed.
    """

    # OSError: redis-py wraps socket errors as a rule, but not on every path.
    # RedisClusterException: redis-py's cluster errors that are not RedisErrors (no
    # node reachable, a slot not covered, cross-slot keys found client-side).
    driver_errors = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)

    def __init__(
        self,
        target: str | redis.Redis | Any,
        *,
        key_prefix: str = "caps",
        master_name: str | None = None,
        allow_eviction: bool = False,
    ) -> None:
        if not isinstance(allow_eviction, bool):
            raise ConfigurationError(f"caps_redis_allow_eviction must be True or False, got {allow_eviction!r}")
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ConfigurationError(f"the Redis key prefix must be a non-empty string, got {key_prefix!r}")
        if master_name is not None and (not isinstance(master_name, str) or not master_name):
            raise ConfigurationError(f"the Sentinel master name must be a non-empty string, got {master_name!r}")
        self._target: RedisTarget = (
            target_from_url(target, master_name=master_name)
            if isinstance(target, str)
            else target_from_client(target, master_name=master_name)
        )
        self._display_url = self._target.description
        self._owns_client = self._target.owned
        self._client_instance: Any = None
        self._client_lock = threading.Lock()
        #: Run on a server that may evict any key (with a warning) rather than refuse it.
        self.allow_eviction = allow_eviction
        #: Whether the server's eviction policy was read and accepted (on first use).
        self._server_accepted = False
        if self._target.cluster:
            key_prefix = hash_tagged(key_prefix)
        #: The prefix of every key, with the hash tag added on Redis Cluster.
        self.key_prefix = key_prefix
        prefix = _encode(key_prefix)
        self._prefix = prefix
        self._limits_key = prefix + b":limits"
        self._runs_key = prefix + b":runs"
        self._expiry_key = prefix + b":expiry"
        self._history_key = prefix + b":history"
        self._operator_limits_key = prefix + b":operator_limits"
        self._index_keys = [self._limits_key, self._runs_key, self._expiry_key]
        # The waiting list (park strategy): every parking script takes these first.
        self._waitlist_keys = [
            *self._index_keys,
            prefix + b":waiting",
            prefix + b":payloads",
            prefix + b":waitlists",
            prefix + b":dispatches",
        ]
        self._scripts: list[Script] = []
        self._acquire = self._script("redis_acquire.lua")
        self._renew = self._script("redis_renew.lua")
        self._release = self._script("redis_release.lua")
        self._sweep = self._script("redis_sweep.lua")
        self._status = self._script("redis_status.lua")
        self._leases = self._script("redis_leases.lua")
        self._prune = self._script("redis_prune.lua")
        self._keys = self._script("redis_keys.lua")
        self._keyed = self._script("redis_keyed.lua")
        self._record_history = self._script("redis_record_history.lua")
        self._history = self._script("redis_history.lua")
        self._set_limit = self._script("redis_set_limit.lua")
        self._park = self._script("redis_park.lua", _WAITLIST_LIBRARY)
        self._release_and_wake_script = self._script("redis_release_and_wake.lua", _WAITLIST_LIBRARY)
        self._claim = self._script("redis_claim.lua", _WAITLIST_LIBRARY)
        self._forget = self._script("redis_forget.lua", _WAITLIST_LIBRARY)
        self._recover = self._script("redis_recover.lua", _WAITLIST_LIBRARY)
        self._readmit = self._script("redis_readmit.lua", _WAITLIST_LIBRARY)
        self._waiters = self._script("redis_waiters.lua", _WAITLIST_LIBRARY)
        self._entry = self._script("redis_entry.lua", _WAITLIST_LIBRARY)

    @property
    def client(self) -> Any:
        """The redis-py client the store runs on (a ``redis.Redis`` or a ``RedisCluster``),
        created on first use (without the check of :meth:`check_eviction`)."""
        return self._connect()

    def _connect(self) -> Any:
        if self._client_instance is None:
            with self._client_lock:  # the task thread and the lease keeper may both be first
                if self._client_instance is None:
                    self._client_instance = self._target.connect()
        return self._client_instance

    @property
    def _client(self) -> Any:
        """The client, for the store's own calls: the first one checks the server's eviction policy."""
        client = self._connect()
        if not self._server_accepted:
            refusal, _warnings = self._eviction_findings(client)
            if refusal is not None:
                # A StoreError: the task waits (caps_on_store_error) until the policy is fixed.
                raise StoreError(refusal)
            self._server_accepted = True
        return client

    def __repr__(self) -> str:
        return f"<RedisStore {self._display_url} key_prefix={self.key_prefix!r}>"

    @property
    def is_cluster(self) -> bool:
        """Whether the store runs on Redis Cluster (its key prefix then carries a hash tag)."""
        return self._target.cluster

    @property
    def display_url(self) -> str:
        """Where the store lives, with any password masked."""
        return self._display_url

    # -- keys ---------------------------------------------------------------------

    def _slot_key_base(self, slot: str) -> bytes:
        return self._prefix + b":slot:{" + _escape_tag(_encode(slot)) + b"}:"

    def slot_keys(self, slot: str) -> tuple[bytes, bytes]:
        """The keys of one slot: its lease set and its task set (one hash tag)."""
        base = self._slot_key_base(slot)
        return base + b"runs", base + b"tasks"

    def waiters_key(self, slot: str) -> bytes:
        """The key of one slot's waiting list (the same hash tag as its lease keys)."""
        return self._slot_key_base(slot) + b"waiters"

    def fair_hash_key(self, slot: str, deployment: str = "") -> bytes:
        """The key of one slot's fair keys of a deployment's entries (``P:slot:{E}:fair[:D]``)."""
        return self._slot_key_base(slot) + (b"fair:" + _encode(deployment) if deployment else b"fair")

    @property
    def waitlist_index_keys(self) -> tuple[bytes, ...]:
        """The store-wide keys of the waiting list: records, payloads, waiting slot names, dispatches."""
        return tuple(self._waitlist_keys[len(self._index_keys) :])

    def task_key(self, task_id: str) -> bytes:
        """The key of a task id's run set."""
        return self._prefix + b":task:" + _encode(task_id)

    def done_key(self, task_id: str) -> bytes:
        """The key of a task id's tombstone (present only while it lasts)."""
        return self._prefix + b":done:" + _encode(task_id)

    # -- plumbing -----------------------------------------------------------------

    def _script(self, name: str, *libraries: str) -> Script:
        script = Script(_load_script_source(name, *libraries))
        self._scripts.append(script)
        return script

    def warm_up(self, threads: int = 1, renewals: bool = False) -> None:
        """Connect (the pool keeps the connection for the first call; it opens one for each
        further thread on demand, in a fraction of a millisecond) and load every script the
        server does not have yet, so that no first call pays a ``NOSCRIPT`` round trip.

        A ``redis://`` URL that leads to a Redis Cluster node is a :class:`StoreError` saying
        to use ``redis+cluster://`` (its scripts would fail on every call with ``CROSSSLOT``).
        """
        if not self._target.cluster and str(self._client.info("cluster").get("cluster_enabled", "0")) == "1":
            raise StoreError(f"the Redis server at {self._display_url} is a Redis Cluster node: {_USE_CLUSTER_URL}")
        loaded = self._client.script_exists(*(script.sha for script in self._scripts))
        for script, present in zip(self._scripts, loaded, strict=True):
            if not present:
                script.sha = self._client.script_load(script.script)

    def durability_warning(self) -> str | None:
        """A warning when the server keeps no append-only file: its waiting lists live in
        memory, and a restart (or a failover to a replica behind it) loses every parked task."""
        # On a cluster, every primary must keep one.
        servers = primary_infos(self._client, self._target.cluster, "persistence", self._display_url)
        if all(str(info.get("aof_enabled", "0")) == "1" for _where, info in servers):
            return None
        return (
            f"the Redis server at {self._display_url} keeps no append-only file (appendonly no): a restart "
            "loses every task waiting in its lists, which no broker holds. Turn appendonly on (appendfsync "
            "everysec loses at most a second), or choose caps_strategy='backoff', whose waiting tasks stay in "
            "the broker."
        )

    def check_eviction(self) -> list[str]:
        """Read ``maxmemory-policy`` on every primary the store writes to (the server, Sentinel's
        current master, each primary of a cluster), as the store's first use does, for the
        worker's start-up step to refuse what it must.

        Returns:
            Warnings: a ``volatile-*`` policy (a tombstone evicted early lets a stale copy of a
            woken task run it again), an ``allkeys-*`` policy the store runs on by
            ``allow_eviction``, a policy that cannot be read or is unknown.

        Raises:
            ConfigurationError: a primary may evict any key (``allkeys-*``) and
                ``allow_eviction`` is off; the message names the setting and the fix.
            StoreError: the server cannot be reached.
        """
        try:
            refusal, warnings = self._eviction_findings(self._connect())
        except self.driver_errors as exc:
            raise self.store_error("reading maxmemory-policy", exc) from exc
        if refusal is not None:
            raise ConfigurationError(refusal)
        return warnings

    def connection_warnings(self) -> list[str]:
        """What the eviction policy of the servers risks (see :meth:`check_eviction`); a policy
        that would be refused now (changed since the first use) is reported here too."""
        refusal, warnings = self._eviction_findings(self._client)
        return [refusal] if refusal is not None else warnings

    def _eviction_findings(self, client: Any) -> tuple[str | None, list[str]]:
        """The refusal (None if none) and the warnings of the servers' ``maxmemory-policy``."""
        try:
            servers = primary_infos(client, self._target.cluster, "memory", self._display_url)
        except redis.exceptions.ResponseError as exc:  # INFO not allowed to this user, or renamed away
            servers = [(self._display_url, {"maxmemory_policy": "", "unreadable": f"INFO memory failed: {exc}"})]
        return eviction_findings(servers, self.allow_eviction, tombstones=f"{self.key_prefix}:done:<task id>")

    def secrets(self) -> Sequence[str]:
        return self._target.secrets

    def store_error(self, operation: str, exc: BaseException) -> StoreError:
        error = super().store_error(operation, exc)
        # redis-py 5 reports CROSSSLOT from a client to one server as a bare ResponseError.
        cluster_reply = isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith(
            ("CROSSSLOT", "Keys in request don't hash", "MOVED")
        )
        if not self._target.cluster and (cluster_reply or isinstance(exc, redis.exceptions.MovedError)):
            return StoreError(f"{error} ({_USE_CLUSTER_URL})")
        return error

    def _run(self, operation: str, script: Script, keys: Sequence[bytes], args: Sequence[bytes | str]) -> Any:
        """Run ``script`` (one ``EVALSHA``); its reply is never decoded: names and payloads
        come back as the bytes stored, whether or not the client decodes responses."""
        try:
            return self._evalsha(script, keys, args)
        except redis.exceptions.NoScriptError:
            # After a Redis restart or SCRIPT FLUSH: load the script, run it again.
            script.sha = self._client.script_load(script.script)
            return self._evalsha(script, keys, args)

    def _evalsha(self, script: Script, keys: Sequence[bytes], args: Sequence[bytes | str]) -> Any:
        # NEVER_DECODE: the reply as stored, even from a client that decodes responses.
        options: dict[str, Any] = {NEVER_DECODE: []}
        return self._client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **options)

    @staticmethod
    def _seconds(value: float, name: str = "lease_seconds") -> str:
        """A number of seconds as an argument (finite: the store's checks saw to it)."""
        return repr(float(value))

    # -- the contract ---------------------------------------------------------------

    def acquire(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        task_name: str | None = None,
        weights: Mapping[str, int] | None = None,
    ) -> Admission:
        seconds = self._seconds(lease_seconds)
        # A run id that already holds leases has them replaced when admitted: the
        # same run asking again after its leases expired, or redis-py replaying the
        # script after a lost reply (the run's own task id then passes every slot
        # it already holds, so the replay is granted, not refused by itself).
        if not slots:
            return Admission(True)
        keys = [*self._index_keys, self.task_key(task_id)]
        # The handle's deployment: its oldest heavy waiter of a slot holds the room it needs.
        args = [*self._run_args(task_id, run_id, holder, seconds, task_name), _encode(self.deployment)]
        for slot in sorted(slots):
            keys.extend(self.slot_keys(slot))
            args.extend(self._slot_args(slot, slots, weights))
        reply = self._run("acquire", self._acquire, keys, args)
        if int(reply[0]) == 1:
            return Admission(True)
        return Admission(False, tuple(sorted(_text(slot) for slot in reply[1:])))

    def _run_args(
        self, task_id: str, run_id: str, holder: str, seconds: str, task_name: str | None
    ) -> list[bytes | str]:
        """The arguments the admission and park scripts start with: who wants the slots, for how long."""
        return [self._prefix, _encode(task_id), _encode(run_id), _encode(holder), seconds, _encode(task_name or "")]

    @staticmethod
    def _slot_args(slot: str, slots: Mapping[str, int], weights: Mapping[str, int] | None) -> tuple[bytes, str, str]:
        """A slot's arguments to the admission and park scripts: its name, limit and the task's weight there."""
        return _encode(slot), str(int(slots[slot])), str(int((weights or {}).get(slot, 1)))

    def renew(self, run_ids: Collection[str], lease_seconds: float) -> dict[str, int]:
        seconds = self._seconds(lease_seconds)
        # A run named twice is still renewed (and counted) once.
        unique = list(dict.fromkeys(run_ids))
        if not unique:
            return {}
        args: list[bytes | str] = [self._prefix, seconds, *map(_encode, unique)]
        reply = self._run("renew", self._renew, self._index_keys, args)
        return {_text(reply[i]): int(reply[i + 1]) for i in range(0, len(reply), 2)}

    def _delete(self, args: Sequence[bytes]) -> int:
        script_args: list[bytes | str] = [self._prefix, *args]
        return int(self._run("release", self._release, self._index_keys, script_args))

    def release(self, run_id: str) -> int:
        return self._delete([b"run", _encode(run_id)])

    def release_holder(self, task_id: str, holder: str) -> int:
        return self._delete([b"holder", _encode(task_id), _encode(holder)])

    def release_task(self, task_id: str) -> int:
        return self._delete([b"task", _encode(task_id)])

    def sweep(self) -> int:
        return int(self._run("sweep", self._sweep, self._index_keys, [self._prefix]))

    def _slot_names(self) -> Iterator[list[bytes]]:
        """The known slot names (the fields of ``P:limits``), :data:`SCAN_BATCH` at a time, with
        ``HSCAN``: each call a short one, never the whole hash at once."""
        batch: list[bytes] = []
        for field, _limit in self._client.hscan_iter(self._limits_key, count=SCAN_BATCH):
            batch.append(field)
            if len(batch) >= SCAN_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def status(self) -> list[SlotStatus]:
        # A batch of names per script, so that no call holds the server for every slot name (each
        # batch is read from its own snapshot; a slot pruned meanwhile is left out).
        statuses: dict[str, SlotStatus] = {}
        for names in self._slot_names():
            reply = self._run("status", self._status, [self._limits_key], [self._prefix, *names])
            for i in range(0, len(reply), 5):
                slot, units = _text(reply[i]), reply[i + 4]
                statuses[slot] = SlotStatus(
                    slot, int(reply[i + 1]), int(reply[i + 2]), int(reply[i + 3]), int(units) if units else None
                )
        return [statuses[slot] for slot in sorted(statuses)]

    def keys_per_cap(self, at_most: int | None = None) -> dict[str, int]:
        # From the keyed names (``P:keyed``): a range by name per cap, never every slot name
        # (each ZLEXCOUNT is logarithmic: at_most has nothing to save).
        reply = self._run("keys_per_cap", self._keys, [self._limits_key], [self._prefix])
        if reply[0] in (b"0", "0"):
            # Slots named before the keyed names existed: they join once, a batch at a time.
            batches = list(self._slot_names()) or [[]]
            for i, names in enumerate(batches):
                last = "1" if i == len(batches) - 1 else "0"
                self._run("keys_per_cap", self._keyed, [self._limits_key], [self._prefix, last, *names])
            reply = self._run("keys_per_cap", self._keys, [self._limits_key], [self._prefix])
        counts = {_text(reply[i]): int(reply[i + 1]) for i in range(1, len(reply), 2)}
        return counts if at_most is None else {cap: min(keys, at_most) for cap, keys in counts.items()}

    def leases(self, slot: str | None = None) -> list[Lease]:
        args: list[bytes | str] = [self._prefix] if slot is None else [self._prefix, _encode(slot)]
        reply = self._run("leases", self._leases, self._index_keys, args)
        leases = []
        for i in range(0, len(reply), 8):
            slot_name, task_id, run_id, holder, task_name, age = (
                _text(value) for value in (*reply[i : i + 4], *reply[i + 5 : i + 7])
            )
            leases.append(
                Lease(
                    slot_name,
                    task_id,
                    run_id,
                    holder,
                    float(reply[i + 4]),
                    task_name or None,
                    float(age) if age else None,
                    int(reply[i + 7]),
                )
            )
        return sorted(leases, key=lambda lease: (lease.slot, lease.expires_in))

    def prune(self, prefix: str, *, dry_run: bool = False) -> list[str]:
        # Finding candidates scans the sentinels (HSCAN, off any hot path); the
        # script then checks and deletes each one atomically.
        candidates = [
            name
            for name in (_text(field) for field, _ in self._client.hscan_iter(self._limits_key, count=1000))
            if name.startswith(prefix)
        ]
        pruned: list[str] = []
        for start in range(0, len(candidates), 500):
            batch = candidates[start : start + 500]
            args: list[bytes | str] = [self._prefix, "1" if dry_run else "0", *map(_encode, batch)]
            pruned.extend(_text(slot) for slot in self._run("prune", self._prune, self._index_keys, args))
        return sorted(pruned)

    def set_limit(self, name: str, limit: int | None) -> int | None:
        args: list[bytes | str] = [_encode(name)] + ([] if limit is None else [str(limit)])
        previous = self._run("setting a limit", self._set_limit, [self._operator_limits_key], args)
        return None if previous is None else int(previous)

    def limits(self) -> dict[str, int]:
        return {_text(name): int(limit) for name, limit in self._client.hgetall(self._operator_limits_key).items()}

    def record_history(self, events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
        if not events:
            return
        args: list[bytes | str] = [self._seconds(keep_seconds), str(int(max_events))]
        for event in events:
            document = {**asdict(event), "nonce": uuid.uuid4().hex}
            args.extend((repr(float(event.at)), json.dumps(document)))
        self._run("recording history", self._record_history, [self._history_key], args)

    def history(self, since: float, task_id: str | None = None) -> list[HistoryEvent]:
        reply = self._run("reading history", self._history, [self._history_key], [repr(float(since))])
        events = []
        for raw in reply:
            document = json.loads(_text(raw))
            document.pop("nonce", None)
            document["slots"] = tuple(document["slots"])
            document["full_slots"] = tuple(document["full_slots"])
            event = HistoryEvent(**document)
            if task_id is None or event.task_id == task_id:
                events.append(event)
        return events

    # -- the waiting list (park strategy; see the module docstring) ----------------

    def park(self, request: ParkRequest) -> ParkOutcome:
        task_id, payload = request.task_id, request.payload
        keys = [*self._waitlist_keys, self.task_key(task_id), self.done_key(task_id)]
        args = [
            *self._run_args(
                task_id, request.run_id, request.holder, self._seconds(request.lease_seconds), request.task_name
            ),
            b"" if payload is None else bytes(payload),
            "0" if payload is None else "1",
            self._seconds(request.first_deferred_at, "first_deferred_at"),
            str(int(request.max_waiters)),
            _encode(self.deployment),
        ]
        fair_keys = request.fair_keys
        for slot in sorted(request.slots):
            keys.extend((*self.slot_keys(slot), self.waiters_key(slot)))
            # The slot's fair key ('' for none: a fair key is never empty).
            args.extend((*self._slot_args(slot, request.slots, request.weights), _encode(fair_keys.get(slot, ""))))
        return _PARK_OUTCOMES[bytes(self._run("park", self._park, keys, args))]

    @staticmethod
    def _woken(reply: Sequence[Any]) -> list[Woken]:
        """``{task id, run id, task name, payload, readmit ('1'/'0'), ...}`` as :class:`Woken`."""
        return [
            Woken(
                _text(reply[i]), _text(reply[i + 1]), bytes(reply[i + 3]), _text(reply[i + 2]) or None,
                readmit=reply[i + 4] == b"1",
            )
            for i in range(0, len(reply), 5)
        ]  # fmt: skip

    def _hand_over_args(self) -> list[bytes | str]:
        """The arguments every script that dispatches entries starts with: the prefix, and the
        deployment of this handle (:attr:`deployment`, read at each call: the library sets it after
        building the store), whose entries alone it dispatches."""
        return [self._prefix, _encode(self.deployment)]

    def _done_milliseconds(self) -> str:
        """How long a tombstone lasts (``done_seconds``, read at each call: tests shorten it)."""
        return str(math.ceil(float(self._seconds(self.done_seconds, "done_seconds")) * 1000))

    def _release_and_wake(self, dispatch_lease_seconds: float, what: Sequence[bytes]) -> tuple[int, list[Woken]]:
        args: list[bytes | str] = [
            *self._hand_over_args(),
            self._seconds(dispatch_lease_seconds),
            _run_id_nonce(),
            *what,
        ]
        # A replay after a lost reply finds the leases gone and wakes nothing: the waiters the
        # lost reply named stay dispatched until their deadline, then ``recover`` dispatches them
        # again (as after a releaser that died before publishing).
        reply = self._run("release", self._release_and_wake_script, self._waitlist_keys, args)
        return int(reply[0]), self._woken(reply[1:])

    def release_and_wake(self, run_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        return self._release_and_wake(dispatch_lease_seconds, [b"run", _encode(run_id)])

    def release_holder_and_wake(
        self, task_id: str, holder: str, dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        return self._release_and_wake(dispatch_lease_seconds, [b"holder", _encode(task_id), _encode(holder)])

    def release_task_and_wake(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        return self._release_and_wake(dispatch_lease_seconds, [b"task", _encode(task_id)])

    def claim(
        self, task_id: str, run_id: str, holder: str, lease_seconds: float, *, redelivered: bool = False
    ) -> ClaimOutcome:
        args: list[bytes | str] = [
            self._prefix,
            _encode(task_id),
            _encode(run_id),
            _encode(holder),
            self._seconds(lease_seconds),
            "1" if redelivered else "0",
            self._done_milliseconds(),
        ]
        keys = [*self._waitlist_keys, self.done_key(task_id)]
        return _CLAIM_OUTCOMES[bytes(self._run("claim", self._claim, keys, args))]

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        args: list[bytes | str] = [
            *self._hand_over_args(),
            _encode(task_id),
            self._seconds(dispatch_lease_seconds),
            _run_id_nonce(),
            self._done_milliseconds(),
        ]
        keys = [*self._waitlist_keys, self.done_key(task_id), self.task_key(task_id)]
        reply = self._run("forget", self._forget, keys, args)
        return int(reply[0]), self._woken(reply[1:])

    def recover(
        self,
        dispatch_lease_seconds: float,
        *,
        caps: Collection[str] | None = None,
        task_names: Collection[str] | None = None,
        readmit_before: float | None = None,
    ) -> list[Woken]:
        args: list[bytes | str] = [
            *self._hand_over_args(),
            self._seconds(dispatch_lease_seconds),
            _run_id_nonce(),
            "" if readmit_before is None else self._seconds(readmit_before, "readmit_before"),
        ]
        if caps is not None or task_names is not None:
            cap_names, named_tasks = sorted(set(caps or ())), sorted(set(task_names or ()))
            if not cap_names and not named_tasks:
                return []
            args.append(str(len(cap_names)))
            args.extend(map(_encode, [*cap_names, *named_tasks]))
        return self._woken(self._run("recover", self._recover, self._waitlist_keys, args))

    def readmit(self, slot: str, dispatch_lease_seconds: float) -> list[Woken]:
        args: list[bytes | str] = [
            *self._hand_over_args(),
            self._seconds(dispatch_lease_seconds),
            _run_id_nonce(),
            _encode(slot),
        ]
        return self._woken(self._run("readmit", self._readmit, self._waitlist_keys, args))

    def entry(self, task_id: str) -> Entry | None:
        keys = [*self._waitlist_keys, self.done_key(task_id)]
        reply = self._run("entry", self._entry, keys, [self._prefix, _encode(task_id)])
        if not reply:
            return None
        if reply[0] == b"done":
            return Entry(listed=False, dispatch_run_id=None, outside=False)
        return Entry(listed=True, dispatch_run_id=_text(reply[1]) or None, outside=reply[2] == b"1")

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        args: list[bytes | str] = [self._prefix] if slot is None else [self._prefix, _encode(slot)]
        reply = self._run("waiters", self._waiters, self._waitlist_keys, args)
        by_slot: dict[str, list[Waiter]] = {}
        for i in range(0, len(reply), 9):
            name = _text(reply[i])
            of_slot = by_slot.setdefault(name, [])
            of_slot.append(
                Waiter(
                    name,
                    _text(reply[i + 1]),
                    _text(reply[i + 2]) or None,
                    float(reply[i + 3]),
                    float(reply[i + 4]),
                    len(of_slot) + 1,
                    reply[i + 5] == b"1",
                    int(reply[i + 6]),
                    _text(reply[i + 7]) or None,
                    int(reply[i + 8]),
                )
            )
        return [waiter for name in sorted(by_slot) for waiter in by_slot[name]]

    def after_fork(self) -> None:
        # A child must not talk over its parent's sockets.  redis-py's pool notices
        # the new pid by itself; resetting it here makes that explicit for a client
        # we own (one handed to us is its owner's business).
        # A cluster client keeps one pool per node, each of which resets itself on the new pid.
        # A lock some thread of the parent held when it forked stays held in the child.
        self._client_lock = threading.Lock()
        if self._owns_client and self._client_instance is not None and not self._target.cluster:
            self._client_instance.connection_pool.reset()

    def close(self) -> None:
        if self._owns_client and self._client_instance is not None:
            self._client_instance.close()
            self._client_instance = None
            self._server_accepted = False
