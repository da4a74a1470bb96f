"""The store contract, on every store of the table (memory, SQLite, PostgreSQL, MySQL, Redis).

Every test builds its store from its URL (``tests/services.py``) and names its
slots and task ids under its own random prefix, so that test runs sharing a
server never see each other's slots.  Expiry tests use sub-second leases and wait for the
store's clock with a deadline; the race tests start real OS processes that each
build their own store (threads for the in-memory store, which one process owns).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from celery_caps.caps import MAX_SLOT_LENGTH
from celery_caps.errors import StoreError, StoreInputError
from celery_caps.stores.base import (
    DISPATCH_HOLDER,
    Admission,
    ClaimOutcome,
    HistoryEvent,
    Lease,
    ParkingStore,
    ParkOutcome,
    ParkRequest,
    SlotStatus,
    SlotStore,
    Woken,
)
from celery_caps.sweep import sweep_store
from tests.services import StoreKind, StoreTarget, own_status

#: Long enough never to expire during a test, in seconds.
LONG_LEASE = 120.0
#: Short enough to wait for, in seconds.
SHORT_LEASE = 0.4
#: What is left of a lease that ``lapse`` ends, in seconds.
MOMENT = 0.05
HOLDER = "worker1@host-a/101"


def new_run_id() -> str:
    return uuid.uuid4().hex


def admit(
    store: SlotStore,
    slots: Mapping[str, int],
    task_id: str,
    *,
    run_id: str | None = None,
    holder: str = HOLDER,
    lease_seconds: float = LONG_LEASE,
) -> str:
    """Acquire ``slots`` for a new run of ``task_id``, which must be granted; returns the run id."""
    run_id = run_id or new_run_id()
    admission = store.acquire(slots, task_id, run_id, holder, lease_seconds)
    assert admission == Admission(True), f"task {task_id!r} was refused {dict(slots)}: {admission}"
    return run_id


def refused_slots(store: SlotStore, slots: Mapping[str, int], task_id: str) -> set[str]:
    """Acquire ``slots`` for a new run of ``task_id``, which must be refused; returns the full slots."""
    admission = store.acquire(slots, task_id, new_run_id(), HOLDER, LONG_LEASE)
    assert not admission.granted, f"task {task_id!r} was admitted to {dict(slots)} but they are full"
    assert len(set(admission.full_slots)) == len(admission.full_slots)
    return set(admission.full_slots)


def own_leases(store: SlotStore, prefix: str) -> list[Lease]:
    return [lease for lease in store.leases() if lease.slot.startswith(prefix)]


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still not true after {timeout} s: {what}")
        time.sleep(0.02)


def wait_until_expired(store: SlotStore, run_ids: Sequence[str]) -> None:
    """Wait until every lease of ``run_ids`` is past its expiry by the store's clock."""

    def expired() -> bool:
        leases = [lease for lease in store.leases() if lease.run_id in run_ids]
        assert leases, f"runs {run_ids} hold no lease at all"
        return all(lease.expires_in <= 0 for lease in leases)

    wait_until(expired, f"leases of {run_ids} expired")


def lapse(store: SlotStore, run_ids: Sequence[str]) -> None:
    """End the live leases of ``run_ids`` now, as if their holder died, and wait them out.

    Only for runs that took their slots (a dispatch keeps its own deadline on its entry).

    A test that needs a lease to lapse *after* some steps takes it long and lapses it here: a
    lease taken short could lapse before those steps on a slow machine (a short lease that
    lapsed before a park made CI's park admit instead of wait).
    """
    renewed = store.renew(run_ids, MOMENT)
    assert set(renewed) == set(run_ids), f"runs {set(run_ids) - set(renewed)} had no live lease to lapse"
    wait_until_expired(store, run_ids)


# -- one run's lease ----------------------------------------------------------
#
# ``prefix`` is this test's own: it starts every slot name *and* every task id,
# because release_task/release_holder reach every lease of a task id, and test
# runs sharing a server must never release each other's.


def test_a_lease_is_acquired_listed_renewed_and_released(store: SlotStore, prefix: str) -> None:
    slot, task = f"{prefix}email-provider", f"{prefix}task-1"

    run_id = admit(store, {slot: 2}, task, holder="w1@host/7", lease_seconds=20.0)

    [lease] = store.leases(slot)
    assert (lease.slot, lease.task_id, lease.run_id, lease.holder) == (slot, task, run_id, "w1@host/7")
    assert 10.0 < lease.expires_in <= 20.0
    assert own_status(store, prefix) == {slot: SlotStatus(slot, limit=2, holders=1, expired=0)}

    assert store.renew([run_id], 50.0) == {run_id: 1}
    [lease] = store.leases(slot)
    assert 40.0 < lease.expires_in <= 50.0

    assert store.release(run_id) == 1
    assert store.leases(slot) == []
    assert own_status(store, prefix) == {slot: SlotStatus(slot, limit=2, holders=0, expired=0)}
    # A released run has nothing left to release or renew.
    assert store.release(run_id) == 0
    assert store.renew([run_id], 50.0) == {}
    assert store.renew([], 50.0) == {}


def test_a_slot_admits_exactly_limit_distinct_tasks(store: SlotStore, prefix: str) -> None:
    slot = f"{prefix}licence-server"
    runs = [admit(store, {slot: 3}, f"{prefix}task-{number}") for number in range(3)]

    assert refused_slots(store, {slot: 3}, f"{prefix}task-3") == {slot}
    assert own_status(store, prefix)[slot].holders == 3

    assert store.release(runs[1]) == 1
    admit(store, {slot: 3}, f"{prefix}task-3")
    assert refused_slots(store, {slot: 3}, f"{prefix}task-4") == {slot}
    assert own_status(store, prefix)[slot] == SlotStatus(slot, limit=3, holders=3, expired=0)


def test_several_caps_are_taken_all_or_nothing(store: SlotStore, prefix: str) -> None:
    provider, tenant = f"{prefix}provider", f"{prefix}tenant:acme"
    tenant_run = admit(store, {tenant: 1}, f"{prefix}tenant-task")

    # When a task needs the free provider slot and the full tenant slot
    assert refused_slots(store, {provider: 5, tenant: 1}, f"{prefix}sync") == {tenant}

    # Then it took neither
    assert store.leases(provider) == []
    assert [lease.task_id for lease in store.leases(tenant)] == [f"{prefix}tenant-task"]
    provider_status = own_status(store, prefix).get(provider)
    assert provider_status is None or provider_status.holders == 0

    # When the tenant slot frees, one run takes both slots
    assert store.release(tenant_run) == 1
    sync_run = admit(store, {provider: 5, tenant: 1}, f"{prefix}sync")
    assert sorted(lease.slot for lease in own_leases(store, prefix) if lease.run_id == sync_run) == sorted(
        [provider, tenant]
    )

    # And a task needing two full slots is told about both
    assert refused_slots(store, {provider: 1, tenant: 1}, f"{prefix}blocked") == {provider, tenant}
    assert [lease.run_id for lease in own_leases(store, prefix)] == [sync_run, sync_run]


def test_each_key_has_its_own_slot(store: SlotStore, prefix: str) -> None:
    tenant_a, tenant_b, bare = f"{prefix}tenant:a", f"{prefix}tenant:b", f"{prefix}tenant"
    admit(store, {tenant_a: 1}, f"{prefix}import-a")
    admit(store, {tenant_b: 1}, f"{prefix}import-b")
    admit(store, {bare: 1}, f"{prefix}import-bare")

    assert refused_slots(store, {tenant_a: 1}, f"{prefix}import-a2") == {tenant_a}
    assert {slot: status.holders for slot, status in own_status(store, prefix).items()} == {
        tenant_a: 1,
        tenant_b: 1,
        bare: 1,
    }

    # Freeing tenant a frees tenant a only.
    assert store.release_task(f"{prefix}import-a") == 1
    admit(store, {tenant_a: 1}, f"{prefix}import-a2")
    assert refused_slots(store, {tenant_b: 1}, f"{prefix}import-b2") == {tenant_b}


def test_a_store_warmed_up_in_one_thread_serves_the_first_call_of_another(store: SlotStore, prefix: str) -> None:
    # Given a store warmed up from a thread of its own, as a pool process does when it starts
    warming = threading.Thread(target=store.warm_up)
    warming.start()
    warming.join(30)
    assert not warming.is_alive()

    # Then the process's first task (another thread) admits and releases as usual
    run_id = admit(store, {f"{prefix}a": 1}, f"{prefix}t1")
    assert refused_slots(store, {f"{prefix}a": 1}, f"{prefix}t2") == {f"{prefix}a"}
    assert store.release(run_id) == 1
    admit(store, {f"{prefix}a": 1}, f"{prefix}t2")


def test_warming_up_an_unreachable_store_raises_a_store_error_naming_no_password() -> None:
    from celery_caps.stores import store_from_url

    # Nothing listens on port 1 of this machine
    store = store_from_url("postgresql+psycopg://caps:secret-pw@127.0.0.1:1/test")
    try:
        with pytest.raises(StoreError) as raised:
            store.warm_up()
        assert "secret-pw" not in str(raised.value)
        assert "127.0.0.1:1" in str(raised.value)
    finally:
        store.close()


# -- the same task id twice -----------------------------------------------------


def test_two_runs_of_one_task_id_count_once_and_release_separately(store: SlotStore, prefix: str) -> None:
    slot, dup, other, third = f"{prefix}imports:acme", f"{prefix}dup", f"{prefix}other", f"{prefix}third"
    # Given task "dup" running twice (a broker redelivery) and one other task
    first = admit(store, {slot: 2}, dup, holder="w1@a/1")
    second = admit(store, {slot: 2}, dup, holder="w2@b/2")
    admit(store, {slot: 2}, other)

    # Then "dup" counts once: the slot holds two task ids and a third is refused
    assert own_status(store, prefix)[slot] == SlotStatus(slot, limit=2, holders=2, expired=0)
    assert refused_slots(store, {slot: 2}, third) == {slot}
    assert sorted(lease.run_id for lease in store.leases(slot) if lease.task_id == dup) == sorted([first, second])
    # and a third run of "dup" gets in although the slot is full: that task id already holds it
    third_run = admit(store, {slot: 2}, dup)
    assert store.release(third_run) == 1

    # When the first run ends, the second still holds the slot
    assert store.release(first) == 1
    assert refused_slots(store, {slot: 2}, third) == {slot}
    assert [lease.run_id for lease in store.leases(slot) if lease.task_id == dup] == [second]

    # When the last run ends, the slot frees
    assert store.release(second) == 1
    admit(store, {slot: 2}, third)
    assert own_status(store, prefix)[slot].holders == 2


# -- expiry ----------------------------------------------------------------------


def test_renew_does_not_revive_an_expired_lease(store: SlotStore, prefix: str) -> None:
    slot, provider, tenant = f"{prefix}slow", f"{prefix}provider", f"{prefix}tenant:a"
    # Given a run whose lease expired, and a live run holding two slots
    lost = admit(store, {slot: 1}, f"{prefix}stalled", lease_seconds=SHORT_LEASE)
    alive = admit(store, {provider: 3, tenant: 3}, f"{prefix}healthy")
    wait_until_expired(store, [lost])

    # When the lease keeper renews both (and a run that never held anything)
    renewed = store.renew([lost, alive, new_run_id()], LONG_LEASE)

    # Then only the live run is renewed, once per slot, and the lost run is reported lost
    assert renewed == {alive: 2}
    [lease] = store.leases(slot)
    assert lease.run_id == lost
    assert lease.expires_in <= 0
    assert all(lease.expires_in > LONG_LEASE - 30 for lease in store.leases(provider) + store.leases(tenant))
    # and its room belongs to whoever comes next
    admit(store, {slot: 1}, f"{prefix}next")


def test_an_expired_lease_does_not_count_even_for_its_own_task(store: SlotStore, prefix: str) -> None:
    slot, crashed = f"{prefix}imports:acme", f"{prefix}crashed"
    # Given task "crashed" whose lease expired without being swept
    crashed_run = admit(store, {slot: 1}, crashed, lease_seconds=SHORT_LEASE)
    wait_until_expired(store, [crashed_run])
    assert own_status(store, prefix)[slot] == SlotStatus(slot, limit=1, holders=0, expired=1)

    # When another task asks, the expired lease does not hold it back
    admit(store, {slot: 1}, f"{prefix}next")

    # Then a new run of "crashed" is refused: its expired lease must not pass for "already holds it"
    assert refused_slots(store, {slot: 1}, crashed) == {slot}
    assert own_status(store, prefix)[slot] == SlotStatus(slot, limit=1, holders=1, expired=1)


def test_a_run_whose_lease_expired_can_be_admitted_again(store: SlotStore, prefix: str) -> None:
    slot, other, task = f"{prefix}licence", f"{prefix}provider", f"{prefix}slow-task"
    # Given a run whose leases expired without being swept
    run_id = admit(store, {slot: 1, other: 2}, task, lease_seconds=SHORT_LEASE)
    wait_until_expired(store, [run_id])

    # When the same run asks for its slots again, it is admitted
    admit(store, {slot: 1, other: 2}, task, run_id=run_id)

    # Then it holds one live lease per slot, counted once
    leases = own_leases(store, prefix)
    assert sorted((lease.slot, lease.run_id) for lease in leases) == sorted([(slot, run_id), (other, run_id)])
    assert all(lease.expires_in > LONG_LEASE - 30 for lease in leases)
    assert own_status(store, prefix)[slot] == SlotStatus(slot, limit=1, holders=1, expired=0)
    assert refused_slots(store, {slot: 1}, f"{prefix}another") == {slot}
    assert store.release(run_id) == 2


def test_sweep_deletes_only_expired_leases_and_keeps_every_slot(
    store: SlotStore, store_kind: StoreKind, prefix: str
) -> None:
    busy, idle = f"{prefix}busy", f"{prefix}idle"
    # Given a slot with an expired and a live lease, and a slot whose only lease expired
    expired_busy = admit(store, {busy: 5}, f"{prefix}gone-1", lease_seconds=SHORT_LEASE)
    live = admit(store, {busy: 5}, f"{prefix}alive")
    expired_idle = admit(store, {idle: 2}, f"{prefix}gone-2", lease_seconds=SHORT_LEASE)
    wait_until_expired(store, [expired_busy, expired_idle])

    # When the sweep runs
    deleted = store.sweep()

    # Then exactly the expired leases are gone (a shared server may hold other runs' expired leases)
    if store_kind.shared:
        assert deleted >= 2
    else:
        assert deleted == 2
    assert [lease.run_id for lease in store.leases(busy)] == [live]
    assert store.leases(idle) == []
    # and both slots are still listed with their limits
    assert own_status(store, prefix) == {
        busy: SlotStatus(busy, limit=5, holders=1, expired=0),
        idle: SlotStatus(idle, limit=2, holders=0, expired=0),
    }
    if not store_kind.shared:
        assert store.sweep() == 0
    admit(store, {idle: 2}, f"{prefix}after-sweep")


def test_the_sweep_deletes_every_expired_lease_a_batch_at_a_time_and_no_live_one(
    store: SlotStore, store_kind: StoreKind, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given batches of 3 (SQL stores delete a batch per transaction) and more expired leases
    # than three batches hold, some of runs of two slots, next to live leases of the same slots
    monkeypatch.setattr("celery_caps.stores.sql.leases.SWEEP_BATCH", 3)
    wide, narrow = f"{prefix}wide", f"{prefix}narrow"
    expired = [
        admit(store, {wide: 50, **({narrow: 50} if i % 3 == 0 else {})}, f"{prefix}gone-{i}", lease_seconds=SHORT_LEASE)
        for i in range(11)
    ]
    live = [admit(store, {wide: 50, narrow: 50}, f"{prefix}alive-{i}") for i in range(2)]
    wait_until_expired(store, expired)

    # When the sweep runs once
    deleted = store.sweep()

    # Then every expired lease is gone, and every live one is there
    leases = 11 + 4  # a lease per slot of each expired run
    assert deleted >= leases if store_kind.shared else deleted == leases
    assert sorted({lease.run_id for lease in own_leases(store, prefix)}) == sorted(live)
    assert own_status(store, prefix) == {
        wide: SlotStatus(wide, limit=50, holders=2, expired=0),
        narrow: SlotStatus(narrow, limit=50, holders=2, expired=0),
    }


def test_keys_per_cap_counts_the_slot_names_of_each_keyed_cap(store: SlotStore, prefix: str) -> None:
    # Given a keyed cap with three keys (one of them idle now), another with one, and a plain cap
    keyed, other, plain = f"{prefix}keyed", f"{prefix}other", f"{prefix}plain"
    for key in ("a", "b", "c"):
        store.release(admit(store, {f"{keyed}:{key}": 2, plain: 5}, f"{prefix}t-{key}"))
    admit(store, {f"{other}:x:y": 1}, f"{prefix}t-other")

    # Then each keyed cap's distinct keys are counted, the plain cap is not a keyed one
    counts = {cap: keys for cap, keys in store.keys_per_cap().items() if cap.startswith(prefix)}
    assert counts == {keyed: 3, other: 1}

    # and keys pruned are no longer counted
    assert store.prune(f"{keyed}:") == [f"{keyed}:a", f"{keyed}:b", f"{keyed}:c"]
    counts = {cap: keys for cap, keys in store.keys_per_cap().items() if cap.startswith(prefix)}
    assert counts == {other: 1}


def test_keys_per_cap_stops_counting_at_at_most(store: SlotStore, prefix: str) -> None:
    # Given a keyed cap with five keys, one with two, a cap whose name starts like the first's
    # (its keys are not the first's), and a plain cap named between them
    busy, small, longer = f"{prefix}busy", f"{prefix}small", f"{prefix}busy2"
    slots = [f"{busy}:{key}" for key in "abcde"] + [f"{small}:a", f"{small}:b", f"{longer}:a", f"{prefix}busy1"]
    for slot in slots:
        store.release(admit(store, {slot: 1}, f"{prefix}t-{slot}"))

    def own(at_most: int | None) -> dict[str, int]:
        return {cap: keys for cap, keys in store.keys_per_cap(at_most).items() if cap.startswith(prefix)}

    # Then a count stops at at_most (the cap has at least that many keys), and only there
    assert own(3) == {busy: 3, small: 2, longer: 1}
    assert own(5) == own(None) == {busy: 5, small: 2, longer: 1}
    # and at_most must be a positive int
    with pytest.raises(StoreInputError, match="at_most"):
        store.keys_per_cap(0)


def test_the_sweep_warns_about_a_cap_past_the_threshold_without_counting_every_key(
    store: SlotStore, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a keyed cap with four keys and a threshold of two
    tenant = f"{prefix}tenant"
    for key in "abcd":
        store.release(admit(store, {f"{tenant}:{key}": 1}, f"{prefix}t-{key}"))
    counted: list[int | None] = []
    count = store.keys_per_cap

    def keys_per_cap(at_most: int | None = None) -> dict[str, int]:
        counted.append(at_most)
        return count(at_most)

    store.keys_per_cap = keys_per_cap  # type: ignore[method-assign]

    # When the beat's sweep runs
    with caplog.at_level(logging.WARNING, logger="celery_caps.sweep"):
        sweep_store(store, 2)

    # Then it counted up to the threshold + 1 only, and says the cap has more than the threshold
    assert counted == [3]
    warnings = [record.getMessage() for record in caplog.records if tenant in record.getMessage()]
    assert warnings == [
        f"cap '{tenant}' has more than 2 distinct keys (caps_key_warning_threshold): keys must come from a "
        "bounded set; each key keeps a row. Prune retired keys with `celery caps prune-keys`."
    ]


# -- releasing for someone else ----------------------------------------------------


def test_release_holder_deletes_only_that_holders_leases_of_that_task(store: SlotStore, prefix: str) -> None:
    provider, tenant, task = f"{prefix}provider", f"{prefix}tenant:a", f"{prefix}t"
    # Given task "t" run by worker w1 (two slots) and redelivered to w2, and task "u" on w1
    admit(store, {provider: 5, tenant: 5}, task, holder="w1@a/1")
    redelivered = admit(store, {provider: 5}, task, holder="w2@b/2")
    neighbour = admit(store, {provider: 5}, f"{prefix}u", holder="w1@a/1")

    # When w1's process is found dead while running "t"
    assert store.release_holder(task, "w1@a/1") == 2

    # Then only that run's leases are gone
    assert sorted((lease.slot, lease.run_id) for lease in own_leases(store, prefix)) == sorted(
        [(provider, redelivered), (provider, neighbour)]
    )
    assert store.release_holder(task, "w1@a/1") == 0
    assert store.release_holder(task, "w1@a") == 0


def test_release_task_deletes_every_lease_of_that_task_id_and_nothing_else(store: SlotStore, prefix: str) -> None:
    tenant_a, tenant_b, provider = f"{prefix}tenant:a", f"{prefix}tenant:b", f"{prefix}provider"
    revoked, other = f"{prefix}revoked", f"{prefix}other"
    # Given task "revoked" with runs on several slots, keys and holders
    admit(store, {tenant_a: 10, provider: 10}, revoked, holder="w1@a/1")
    admit(store, {tenant_a: 10}, revoked, holder="w2@b/2")
    admit(store, {tenant_b: 10}, revoked, holder="w3@c/3")
    # and tasks whose ids look alike, on the same and on other keys
    lookalikes = [f"{prefix}{task_id}" for task_id in ["revoked-2", "Revoked", "revoked ", "revoke_", "revoke%"]]
    kept = [(tenant_a, task_id) for task_id in lookalikes]
    for _, task_id in kept:
        admit(store, {tenant_a: 10}, task_id)
    admit(store, {tenant_b: 10, provider: 10}, other)

    # When "revoked" is revoked
    assert store.release_task(revoked) == 4

    # Then every lease of "revoked" is gone and every other lease is untouched
    remaining = sorted((lease.slot, lease.task_id) for lease in own_leases(store, prefix))
    assert remaining == sorted([*kept, (tenant_b, other), (provider, other)])
    assert {slot: (status.limit, status.holders) for slot, status in own_status(store, prefix).items()} == {
        tenant_a: (10, len(lookalikes)),
        tenant_b: (10, 1),
        provider: (10, 1),
    }
    # and the next run of "revoked" starts clean
    fresh = admit(store, {tenant_a: 10}, revoked)
    assert [lease.run_id for lease in own_leases(store, prefix) if lease.task_id == revoked] == [fresh]


# -- reporting -------------------------------------------------------------------


def test_status_counts_distinct_live_holders_and_unswept_leases(store: SlotStore, prefix: str) -> None:
    slot = f"{prefix}provider"
    admit(store, {slot: 4}, f"{prefix}a")
    admit(store, {slot: 4}, f"{prefix}a")
    admit(store, {slot: 4}, f"{prefix}b")
    expiring = admit(store, {slot: 4}, f"{prefix}c")
    assert own_status(store, prefix) == {slot: SlotStatus(slot, limit=4, holders=3, expired=0)}

    lapse(store, [expiring])
    assert own_status(store, prefix) == {slot: SlotStatus(slot, limit=4, holders=2, expired=1)}

    # A task admitted under a new limit records it.
    admit(store, {slot: 6}, f"{prefix}d")
    assert own_status(store, prefix) == {slot: SlotStatus(slot, limit=6, holders=3, expired=1)}


def test_leases_lists_one_slot_or_all(store: SlotStore, prefix: str) -> None:
    tenant, provider = f"{prefix}tenant:a", f"{prefix}provider"
    task_a, task_b = f"{prefix}ta", f"{prefix}tb"
    first = admit(store, {tenant: 3}, task_a, holder="w1@a/1")
    second = admit(store, {tenant: 3, provider: 3}, task_b, holder="w2@b/2")

    def described(leases: list[Lease]) -> list[tuple[str, str, str, str]]:
        return sorted((lease.slot, lease.task_id, lease.run_id, lease.holder) for lease in leases)

    tenant_leases = [(tenant, task_a, first, "w1@a/1"), (tenant, task_b, second, "w2@b/2")]
    provider_leases = [(provider, task_b, second, "w2@b/2")]
    assert described(store.leases(tenant)) == sorted(tenant_leases)
    assert described(store.leases(provider)) == provider_leases
    assert described(own_leases(store, prefix)) == sorted(tenant_leases + provider_leases)
    # A slot name is matched exactly, never as a prefix or a pattern.
    assert store.leases(f"{prefix}tenant") == []
    assert store.leases(f"{prefix}tenant:_") == []
    assert store.leases(f"{prefix}tenant:%") == []
    assert store.leases(f"{prefix}tenant:*") == []
    assert store.leases(f"{prefix}nothing") == []


# -- hostile names -------------------------------------------------------------------

#: Slot-name tails that a careless store would merge, mangle or interpret.  They all
#: differ as Python strings; MySQL's default collations would merge the case,
#: trailing-space, accent and ß/ss variants, LIKE would merge ``_``/``%`` ones,
#: Redis hash tags and glob patterns would misread the braces, ``*``, ``?``, ``[]``.
HOSTILE_NAMES = [
    "quote'",
    "''",
    'double"quote',
    "semi;colon",
    "x'; DELETE FROM concurrency_slots; --",
    "100%",
    "%",
    "_",
    "a_c",
    "abc",
    "tenant:a:b",
    ":",
    "{braces}",
    "{tenant}:x",
    "}{",
    "back\\slash",
    "back\\\\slash",
    "\\",
    "*",
    "?",
    "[ab]",
    "a",
    "A",
    "\uff21",  # fullwidth A
    "ünïcödé",
    "emoji 🚀🔥",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467",  # family: a ZWJ sequence
    "\u202ertl-override",
    "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",  # Hebrew and Arabic
    "Tenant",
    "tenant",
    "tenant ",
    "tenant  ",
    "TENANT",
    "tenánt",
    "tenant\u00a0",  # no-break space
    "straße",
    "strasse",
    "\u00e9",  # é, composed
    "e\u0301",  # é, decomposed
    "$1",
    "%s",
    "{0}",
]


def long_names(prefix: str) -> list[str]:
    """Slot names of exactly ``MAX_SLOT_LENGTH`` characters that differ only at the end."""
    room = MAX_SLOT_LENGTH - len(prefix)
    return [
        prefix + "x" * room,
        prefix + "x" * (room - 1) + "y",
        prefix + "🚀" * room,
        prefix + "🚀" * (room - 1) + "🔥",
    ]


def test_hostile_slot_names_never_collide_and_come_back_unchanged(store: SlotStore, prefix: str) -> None:
    slots = [prefix + name for name in HOSTILE_NAMES] + long_names(prefix)
    assert len(set(slots)) == len(slots)
    assert all(len(slot) <= MAX_SLOT_LENGTH for slot in slots)

    # Given one limit-1 slot per name, each taken by its own task (two names sharing a
    # slot would refuse the second task)
    runs = {slot: admit(store, {slot: 1}, f"{prefix}task-{number}") for number, slot in enumerate(slots)}

    # Then each slot holds exactly its own lease, its name returned unchanged
    for number, slot in enumerate(slots):
        assert [(lease.slot, lease.task_id, lease.run_id) for lease in store.leases(slot)] == [
            (slot, f"{prefix}task-{number}", runs[slot])
        ]
    assert own_status(store, prefix) == {slot: SlotStatus(slot, limit=1, holders=1, expired=0) for slot in slots}
    assert sorted(lease.slot for lease in own_leases(store, prefix)) == sorted(slots)

    # and each is full for anyone else
    for slot in slots:
        assert refused_slots(store, {slot: 1}, f"{prefix}intruder") == {slot}

    # When one task takes all of them at once, under another prefix, in one admission
    batch = {f"{prefix}batch:{name}": 2 for name in HOSTILE_NAMES}
    batch_run = admit(store, batch, f"{prefix}task-batch")
    assert sorted(lease.slot for lease in own_leases(store, prefix) if lease.run_id == batch_run) == sorted(batch)
    assert store.release(batch_run) == len(batch)

    # Releasing one slot's task frees that slot only.
    assert store.release(runs[prefix + "tenant"]) == 1
    admit(store, {prefix + "tenant": 1}, f"{prefix}newcomer")
    for lookalike in ["Tenant", "tenant ", "TENANT", "tenánt", "tenant\u00a0"]:
        assert refused_slots(store, {prefix + lookalike: 1}, f"{prefix}newcomer-2") == {prefix + lookalike}


def test_task_ids_that_differ_only_in_case_spaces_or_accents_are_different_tasks(store: SlotStore, prefix: str) -> None:
    slot, single = f"{prefix}provider", f"{prefix}licence"
    names = ["tenant", "Tenant", "tenant ", "TENANT", "tenánt", "ten'ant", "tenant%", "tenan_", "tenant🚀"]
    task_ids = [prefix + name for name in names] + [prefix + "t" * 200, prefix + "t" * 199 + "T"]
    # Given each of them holding a slot whose limit is exactly their number
    for task_id in task_ids:
        admit(store, {slot: len(task_ids)}, task_id)

    # Then they count as that many tasks and the slot is full
    assert own_status(store, prefix)[slot].holders == len(task_ids)
    assert refused_slots(store, {slot: len(task_ids)}, f"{prefix}one-more") == {slot}
    assert sorted(lease.task_id for lease in store.leases(slot)) == sorted(task_ids)

    # and on a limit-1 slot held by "tenant", its look-alikes are other tasks
    admit(store, {single: 1}, task_ids[0])
    for lookalike in task_ids[1:]:
        assert refused_slots(store, {single: 1}, lookalike) == {single}

    # When "tenant" is revoked, its look-alikes keep their leases
    assert store.release_task(task_ids[0]) == 2
    assert sorted(lease.task_id for lease in store.leases(slot)) == sorted(task_ids[1:])
    assert store.leases(single) == []


# -- input at the edges: every store alike -------------------------------------------
#
# The checks run once, above the stores (``celery_caps.stores.checks``): a value no store
# can keep faithfully is refused with StoreInputError naming it, before any store is
# touched, and an unreachable store is a StoreError, never a StoreInputError.

LONE_SURROGATE = "\ud800"


def bad_calls(store: SlotStore, prefix: str) -> dict[str, tuple[Callable[[], Any], str]]:
    """Calls every store must refuse: name -> (the call, a fragment of the message naming the value)."""
    slot = f"{prefix}s"
    calls: dict[str, tuple[Callable[[], Any], str]] = {
        "limit 0": (lambda: store.acquire({slot: 0}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE), "got 0"),
        "limit -1": (lambda: store.acquire({slot: -1}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE), "got -1"),
        "limit True": (lambda: store.acquire({slot: True}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE), "True"),
        "nan lease": (lambda: store.acquire({slot: 1}, f"{prefix}t", new_run_id(), HOLDER, float("nan")), "nan"),
        "infinite lease": (lambda: store.acquire({slot: 1}, f"{prefix}t", new_run_id(), HOLDER, float("inf")), "inf"),
        "negative lease": (lambda: store.acquire({slot: 1}, f"{prefix}t", new_run_id(), HOLDER, -1.0), "-1.0"),
        "empty slot name": (lambda: store.acquire({"": 1}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE), "''"),
        "NUL in a slot name": (
            lambda: store.acquire({slot + "\x00": 1}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE),
            "\\x00",
        ),
        "surrogate task id": (
            lambda: store.acquire({slot: 1}, prefix + LONE_SURROGATE, new_run_id(), HOLDER, LONG_LEASE),
            "\\ud800",
        ),
        "task id over 255": (
            lambda: store.acquire({slot: 1}, prefix + "t" * 256, new_run_id(), HOLDER, LONG_LEASE),
            "255",
        ),
        "renew a string": (lambda: store.renew("run-1", 30.0), "'run-1'"),
        "renew a nan lease": (lambda: store.renew([new_run_id()], float("nan")), "nan"),
        "release_task surrogate": (lambda: store.release_task(prefix + LONE_SURROGATE), "\\ud800"),
        "release_holder surrogate": (lambda: store.release_holder(f"{prefix}t", LONE_SURROGATE), "\\ud800"),
        "leases surrogate": (lambda: store.leases(prefix + LONE_SURROGATE), "\\ud800"),
        "prune surrogate": (lambda: store.prune(prefix + LONE_SURROGATE), "\\ud800"),
        "history surrogate": (lambda: store.history(0.0, task_id=prefix + LONE_SURROGATE), "\\ud800"),
        "history nan": (lambda: store.history(float("nan")), "nan"),
    }
    if isinstance(store, ParkingStore):
        calls |= {
            "waiters surrogate": (lambda: store.waiters(prefix + LONE_SURROGATE), "\\ud800"),
            "forget surrogate": (lambda: store.forget(prefix + LONE_SURROGATE, LONG_LEASE), "\\ud800"),
            "readmit surrogate": (lambda: store.readmit(prefix + LONE_SURROGATE, LONG_LEASE), "\\ud800"),
            "park limit 0": (
                lambda: store.park(ParkRequest({slot: 0}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE, 1.0, 10)),
                "got 0",
            ),
            "park nan first deferral": (
                lambda: store.park(
                    ParkRequest({slot: 1}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE, float("nan"), 10)
                ),
                "nan",
            ),
            "claim surrogate": (
                lambda: store.claim(prefix + LONE_SURROGATE, new_run_id(), HOLDER, LONG_LEASE),
                "\\ud800",
            ),
        }
    return calls


def test_bad_input_is_refused_naming_the_value_and_touches_nothing(store: SlotStore, prefix: str) -> None:
    # Given a slot held by a task, and a waiter where the store has a waiting list
    slot = f"{prefix}s"
    held = admit(store, {slot: 1}, f"{prefix}holder")
    if isinstance(store, ParkingStore):
        assert park(store, {slot: 1}, f"{prefix}waiter", 1.0) == ParkOutcome.PARKED

    def state() -> tuple[Any, ...]:
        leases = [(lease.slot, lease.task_id, lease.run_id, lease.holder) for lease in own_leases(store, prefix)]
        return leases, own_status(store, prefix)

    before = state()

    # When each bad call is made
    for name, (call, fragment) in bad_calls(store, prefix).items():
        with pytest.raises(StoreInputError) as raised:
            call()
        # Then it is refused as bad input (a ValueError, never "the store is away"), naming the value
        assert isinstance(raised.value, ValueError) and not isinstance(raised.value, StoreError), name
        assert fragment in str(raised.value), (name, str(raised.value))

    # ... and nothing of the store changed: the lease, the slot and the waiter are as they were
    assert state() == before
    assert [lease.run_id for lease in own_leases(store, prefix)] == [held]
    if isinstance(store, ParkingStore):
        assert listed(store, slot) == [(f"{prefix}waiter", False)]


def test_no_slots_at_all_are_granted_at_once_and_take_nothing(store: SlotStore, prefix: str) -> None:
    run_id = new_run_id()
    assert store.acquire({}, f"{prefix}t", run_id, HOLDER, LONG_LEASE) == Admission(True)
    assert store.renew([run_id], LONG_LEASE) == {}
    assert store.release(run_id) == 0
    if isinstance(store, ParkingStore):
        assert park(store, {}, f"{prefix}t", 1.0) == ParkOutcome.ADMITTED
        assert store.waiters() == [] or all(not w.task_id.startswith(prefix) for w in store.waiters())
    assert own_leases(store, prefix) == []


# -- many contenders at once ---------------------------------------------------------
#
# The stores that several processes share are raced by real OS processes, each
# with its own store built from the URL.  Starting a Python process costs about
# a second of CPU, so one set of spawned processes serves every race of this
# module; the in-memory store, which lives in one process, is raced by threads.

CONTENDERS = 16
_SPAWN = multiprocessing.get_context("spawn")
_SHARED_INTS = 1024
_BARRIER_TIMEOUT = 60.0
_JOB_TIMEOUT = 120.0


def _serve_contender(index: int, barrier: Any, shared: Any, inbox: Any, outbox: Any) -> None:
    """A contender process: run each job it is sent on a store of its own; report its traceback or None."""
    while (job := inbox.get()) is not None:
        target, work, args = job
        try:
            store = target.open()
            try:
                work(store, barrier, shared, index, *args)
            finally:
                store.close()
        except BaseException:
            barrier.abort()  # the others stop waiting for this one
            outbox.put((index, traceback.format_exc()))
        else:
            outbox.put((index, None))


class ContenderProcesses:
    """``CONTENDERS`` spawned processes sharing one barrier and one array of ints."""

    def __init__(self) -> None:
        self.barrier = _SPAWN.Barrier(CONTENDERS)
        self.shared = _SPAWN.Array("q", _SHARED_INTS)
        self._outbox = _SPAWN.Queue()
        self._inboxes = [_SPAWN.Queue() for _ in range(CONTENDERS)]
        self._processes = [
            _SPAWN.Process(
                target=_serve_contender,
                args=(index, self.barrier, self.shared, inbox, self._outbox),
                name=f"contender-{index}",
                daemon=True,
            )
            for index, inbox in enumerate(self._inboxes)
        ]
        for process in self._processes:
            process.start()
        self.broken = False

    def run(self, target: StoreTarget, work: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Run ``work(store, barrier, shared, index, *args)`` in every process; fail if one fails."""
        self.barrier.reset()
        self.shared[:] = [0] * _SHARED_INTS
        for inbox in self._inboxes:
            inbox.put((target, work, args))
        failures, deadline = [], time.monotonic() + _JOB_TIMEOUT
        try:
            for _ in range(CONTENDERS):
                index, failure = self._outbox.get(timeout=max(0.0, deadline - time.monotonic()))
                if failure is not None:
                    failures.append(f"contender {index}:\n{failure}")
        except queue.Empty:
            self.broken = True
            pytest.fail(f"contender processes did not finish within {_JOB_TIMEOUT} s")
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for process in self._processes:
            process.join(10.0 if not self.broken else 0.0)
            if process.is_alive():
                process.kill()
                process.join()


@pytest.fixture(scope="module")
def contender_processes() -> Iterator[Callable[[], ContenderProcesses]]:
    """Starts the contender processes on first use, and again if a job broke them."""
    started: list[ContenderProcesses] = []

    def get() -> ContenderProcesses:
        if started and started[-1].broken:
            started.pop().close()
        if not started:
            started.append(ContenderProcesses())
        return started[-1]

    yield get
    for processes in started:
        processes.close()


class Contenders:
    """Runs one function in ``CONTENDERS`` contenders at once, all sharing ``shared``."""

    def __init__(
        self,
        store_kind: StoreKind,
        target: StoreTarget,
        store: SlotStore,
        processes: Callable[[], ContenderProcesses],
    ) -> None:
        self._target, self._store = target, store
        if store_kind.id == "memory":
            self._processes: ContenderProcesses | None = None
            self._barrier: Any = threading.Barrier(CONTENDERS)
            self.shared: Any = _SPAWN.Array("q", _SHARED_INTS)
        else:
            self._processes = processes()
            self.shared = self._processes.shared

    def run(self, work: Callable[..., None], *args: Any) -> None:
        """Run ``work(store, barrier, shared, index, *args)`` in each contender."""
        if self._processes is not None:
            self._processes.run(self._target, work, args)
            return
        failures: list[str] = []

        def contend(index: int) -> None:
            try:
                work(self._store, self._barrier, self.shared, index, *args)
            except BaseException:
                self._barrier.abort()
                failures.append(f"contender {index}:\n{traceback.format_exc()}")

        threads = [threading.Thread(target=contend, args=(index,)) for index in range(CONTENDERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(_JOB_TIMEOUT)
        assert not any(thread.is_alive() for thread in threads), "a contender thread hangs"
        assert not failures, "\n".join(failures)


@pytest.fixture
def contenders(
    store_kind: StoreKind,
    store_target: StoreTarget,
    store: SlotStore,
    contender_processes: Callable[[], ContenderProcesses],
) -> Contenders:
    return Contenders(store_kind, store_target, store, contender_processes)


#: Each race round: (limit, leases already held).  Rounds with ``held == limit - 1``
#: are races for the last slot.
RACE_ROUNDS = [(1, 0), (3, 0), (5, 0), (2, 1), (4, 3), (8, 7), (1, 0), (6, 5)] * 3
_WON, _LOST = 1, 2


def _race_slot(prefix: str, round_number: int) -> str:
    return f"{prefix}race:{round_number}"


def _race(store: SlotStore, barrier: Any, outcomes: Any, index: int, prefix: str) -> None:
    for round_number, (limit, _held) in enumerate(RACE_ROUNDS):
        barrier.wait(_BARRIER_TIMEOUT)
        admission = store.acquire(
            {_race_slot(prefix, round_number): limit},
            f"{prefix}racer-{index}-round-{round_number}",
            new_run_id(),
            f"racer-{index}/{os.getpid()}",
            LONG_LEASE,
        )
        outcomes[round_number * CONTENDERS + index] = _WON if admission.granted else _LOST


def test_racers_for_a_slot_win_exactly_its_limit(store: SlotStore, contenders: Contenders, prefix: str) -> None:
    # Given one slot per round, some with all but their last place already taken
    for round_number, (limit, held) in enumerate(RACE_ROUNDS):
        for number in range(held):
            admit(store, {_race_slot(prefix, round_number): limit}, f"{prefix}early-{round_number}-{number}")

    # When 16 contenders (each its own process and store) ask for each slot at the same moment
    contenders.run(_race, prefix)

    # Then each round has exactly as many winners as free places, and the store agrees
    statuses = own_status(store, prefix)
    for round_number, (limit, held) in enumerate(RACE_ROUNDS):
        slot = _race_slot(prefix, round_number)
        outcomes = contenders.shared[round_number * CONTENDERS : (round_number + 1) * CONTENDERS]
        assert set(outcomes) <= {_WON, _LOST}, f"round {round_number}: a contender never asked"
        assert outcomes.count(_WON) == limit - held, f"round {round_number} (limit {limit}, {held} held): {outcomes}"
        assert statuses[slot] == SlotStatus(slot, limit=limit, holders=limit, expired=0)
        assert len(store.leases(slot)) == limit


#: Acquire/release attempts per contender; SQLite serialises every write through one file lock.
CONTENTION_ATTEMPTS = {
    "memory": 300,
    "sqlite": 300,
    "postgres": 300,
    "pgbouncer": 300,
    "mysql": 300,
    "redis": 300,
    "redis_cluster": 300,
    "redis_sentinel": 300,
}
TENANT_LIMIT = 4
GLOBAL_LIMIT = 3
# The gauge: holders now and at peak per slot, then admissions and refusals.
_TENANT_NOW, _TENANT_PEAK, _GLOBAL_NOW, _GLOBAL_PEAK, _GRANTED, _REFUSED = range(6)


def _contend(store: SlotStore, barrier: Any, gauge: Any, index: int, prefix: str, attempts: int) -> None:
    tenant, global_slot = f"{prefix}tenant:a", f"{prefix}global"
    # Half the tasks lock "global" first, half "tenant:a" first: no shared first lock
    # serialises them, so a count read before the tenant lock would show.
    with_global = {global_slot: GLOBAL_LIMIT, tenant: TENANT_LIMIT}
    tenant_only = {tenant: TENANT_LIMIT}
    barrier.wait(_BARRIER_TIMEOUT)
    for attempt in range(attempts):
        slots = with_global if (index + attempt) % 2 else tenant_only
        run_id = new_run_id()
        admission = store.acquire(slots, f"{prefix}contender-{index}-{attempt}", run_id, f"c{index}", LONG_LEASE)
        if not admission.granted:
            with gauge.get_lock():
                gauge[_REFUSED] += 1
            continue
        # Counted after admission and uncounted before release, the gauge never exceeds
        # the true number of holders: a peak above the limit is over-admission.
        with gauge.get_lock():
            gauge[_GRANTED] += 1
            gauge[_TENANT_NOW] += 1
            gauge[_TENANT_PEAK] = max(gauge[_TENANT_PEAK], gauge[_TENANT_NOW])
            if global_slot in slots:
                gauge[_GLOBAL_NOW] += 1
                gauge[_GLOBAL_PEAK] = max(gauge[_GLOBAL_PEAK], gauge[_GLOBAL_NOW])
        time.sleep(0.005 + 0.002 * (attempt % 4))  # the task body: long enough to overlap under load
        with gauge.get_lock():
            gauge[_TENANT_NOW] -= 1
            if global_slot in slots:
                gauge[_GLOBAL_NOW] -= 1
        released = store.release(run_id)
        assert released == len(slots), f"run {run_id} released {released} leases, took {len(slots)}"


def test_contenders_looping_never_exceed_the_limit(
    store: SlotStore, store_kind: StoreKind, contenders: Contenders, prefix: str
) -> None:
    attempts = CONTENTION_ATTEMPTS[store_kind.id]

    # When 16 contenders loop acquire/release on a limit-4 tenant slot, half of them
    # also taking a limit-3 global slot
    contenders.run(_contend, prefix, attempts)

    # Then at no moment did more than the limit hold either slot
    gauge = contenders.shared
    assert gauge[_TENANT_PEAK] <= TENANT_LIMIT, f"tenant slot peaked at {gauge[_TENANT_PEAK]}"
    assert gauge[_GLOBAL_PEAK] <= GLOBAL_LIMIT, f"global slot peaked at {gauge[_GLOBAL_PEAK]}"
    # and the slots were really contended: full at times, and filled to their limit
    assert gauge[_GRANTED] + gauge[_REFUSED] == CONTENDERS * attempts
    assert gauge[_REFUSED] > 0
    assert gauge[_TENANT_PEAK] == TENANT_LIMIT
    # and nothing is left behind
    tenant, global_slot = f"{prefix}tenant:a", f"{prefix}global"
    assert own_leases(store, prefix) == []
    assert own_status(store, prefix) == {
        tenant: SlotStatus(tenant, limit=TENANT_LIMIT, holders=0, expired=0),
        global_slot: SlotStatus(global_slot, limit=GLOBAL_LIMIT, holders=0, expired=0),
    }


# =====================================================================================
# Operator tooling: lease details, pruning retired keys, the optional history.
# (Added with `celery caps`; every store of the table implements these.)
# =====================================================================================


def test_leases_carry_the_task_name_and_their_age(store: SlotStore, prefix: str) -> None:
    slot = f"{prefix}provider"
    named = run_id = new_run_id()
    assert store.acquire({slot: 3}, f"{prefix}named", run_id, HOLDER, LONG_LEASE, task_name="proj.send_email")
    unnamed = admit(store, {slot: 3}, f"{prefix}unnamed")

    by_run = {lease.run_id: lease for lease in store.leases(slot)}
    assert by_run[named].task_name == "proj.send_email"
    assert by_run[unnamed].task_name is None
    for lease in by_run.values():
        assert lease.age is not None and -0.5 < lease.age < 10.0
    assert {lease.run_id: lease.task_name for lease in own_leases(store, prefix)} == {
        named: "proj.send_email",
        unnamed: None,
    }
    # Released, the details go with the lease; admitted again, the run has its new name.
    store.release(named)
    assert store.acquire({slot: 3}, f"{prefix}named", named, HOLDER, LONG_LEASE, task_name="proj.other")
    assert {lease.task_name for lease in store.leases(slot) if lease.run_id == named} == {"proj.other"}


def test_prune_deletes_only_idle_slots_under_the_prefix(store: SlotStore, prefix: str) -> None:
    cap = f"{prefix}tenant"
    held, idle, lapsed = f"{cap}:held", f"{cap}:idle", f"{cap}:lapsed"
    unkeyed, lookalike = cap, f"{prefix}tenants:x"
    # Given keys of one cap that are held, idle, or hold only an expired lease, and neighbours
    holder_run = admit(store, {held: 2}, f"{prefix}t1")
    released = admit(store, {idle: 2}, f"{prefix}t2")
    store.release(released)
    expired = admit(store, {lapsed: 2}, f"{prefix}t3", lease_seconds=SHORT_LEASE)
    admit(store, {unkeyed: 2}, f"{prefix}t4")
    store.release(admit(store, {lookalike: 2}, f"{prefix}t5"))
    wait_until_expired(store, [expired])

    # When pruning is tried, then done, for the cap's keys
    assert store.prune(f"{cap}:", dry_run=True) == [idle, lapsed]
    assert set(own_status(store, prefix)) == {held, idle, lapsed, unkeyed, lookalike}
    assert store.prune(f"{cap}:") == [idle, lapsed]

    # Then only idle keys of that cap are gone, with their expired leases
    assert set(own_status(store, prefix)) == {held, unkeyed, lookalike}
    assert [lease.run_id for lease in own_leases(store, prefix) if lease.slot == held] == [holder_run]
    assert store.leases(lapsed) == []
    assert store.prune(f"{cap}:") == []
    # and a pruned key is admitted again as if new, its sentinel back
    admit(store, {idle: 1}, f"{prefix}t6")
    assert own_status(store, prefix)[idle] == SlotStatus(idle, limit=1, holders=1, expired=0)


def test_prune_treats_like_wildcards_in_names_literally(store: SlotStore, prefix: str) -> None:
    literal, wildcard_match, other = f"{prefix}a%_b:k", f"{prefix}aXYb:k", f"{prefix}a%_bc:k"
    for number, slot in enumerate((literal, wildcard_match, other)):
        store.release(admit(store, {slot: 1}, f"{prefix}t{number}"))

    assert store.prune(f"{prefix}a%_b:") == [literal]
    assert set(own_status(store, prefix)) == {wildcard_match, other}


def test_prune_racing_admissions_never_hides_a_held_slot(
    store: SlotStore, store_target: StoreTarget, store_kind: StoreKind, prefix: str
) -> None:
    # Given a thread that admits into and releases keys of a cap, over and over, and a
    # thread that prunes the cap's keys at the same time (each with its own store)
    cap = f"{prefix}race"
    errors: list[str] = []
    stop = threading.Event()

    def own_store() -> SlotStore:
        return store if store_kind.id == "memory" else store_target.open()

    def admit_and_check() -> None:
        mine = own_store()
        try:
            for number in range(40):
                slot = f"{cap}:{number % 3}"
                run_id = admit(mine, {slot: 1}, f"{prefix}admit-{number}")
                # Then a held slot is always listed: pruning never removed its sentinel
                if slot not in own_status(mine, prefix):
                    errors.append(f"{slot} is held but not listed")
                mine.release(run_id)
        except Exception:
            errors.append(traceback.format_exc())
        finally:
            stop.set()
            if mine is not store:
                mine.close()

    def prune_until_stopped() -> None:
        mine = own_store()
        try:
            while not stop.is_set():
                mine.prune(f"{cap}:")
        except Exception:
            errors.append(traceback.format_exc())
        finally:
            if mine is not store:
                mine.close()

    threads = [threading.Thread(target=admit_and_check), threading.Thread(target=prune_until_stopped)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[0]
    assert own_leases(store, prefix) == []


def _event(prefix: str, kind: str, at: float, number: int, **fields: Any) -> HistoryEvent:
    return HistoryEvent(
        kind=kind,
        at=at,
        task_id=f"{prefix}task-{number}",
        task_name="proj.import_file",
        slots=(f"{prefix}provider", f"{prefix}tenant:acme"),
        holder=HOLDER,
        **fields,
    )


def test_history_is_recorded_and_read_back_by_time_and_task(store: SlotStore, prefix: str) -> None:
    start = time.time()
    deferred = _event(prefix, "deferred", start, 1, full_slots=(f"{prefix}tenant:acme",), deferrals=2)
    ran = _event(prefix, "ran", start + 2.5, 1, started_at=start + 1.0, deferrals=3)
    other = _event(prefix, "ran", start + 1.5, 2, started_at=start + 0.5)
    hostile = HistoryEvent("deferred", start + 3, f"{prefix}ü'\"", None, (f"{prefix}k:'; DROP",), ())

    store.record_history([deferred, ran], keep_seconds=3600, max_events=100_000)
    store.record_history([other, hostile], keep_seconds=3600, max_events=100_000)

    mine = [event for event in store.history(start - 1) if event.task_id.startswith(prefix)]
    assert mine == [deferred, other, ran, hostile]
    assert store.history(start - 1, task_id=f"{prefix}task-1") == [deferred, ran]
    assert [event for event in store.history(start + 2) if event.task_id.startswith(prefix)] == [ran, hostile]
    store.record_history([], keep_seconds=3600, max_events=100_000)


def test_history_stays_within_its_age_and_size(store: SlotStore, store_kind: StoreKind, prefix: str) -> None:
    if store_kind.shared:
        pytest.skip("trimming is store-wide: it would trim other test runs' history on a shared server")
    start = time.time()
    old = [_event(prefix, "ran", start - 100 + number, number) for number in range(3)]
    store.record_history(old, keep_seconds=3600, max_events=5)
    assert store.history(0) == old

    # Events older than keep_seconds before the newest go, then the oldest beyond max_events
    recent = [_event(prefix, "deferred", start + number, 10 + number) for number in range(4)]
    store.record_history(recent, keep_seconds=50, max_events=5)
    assert store.history(0) == recent
    newer = [_event(prefix, "ran", start + 10 + number, 20 + number) for number in range(3)]
    store.record_history(newer, keep_seconds=50, max_events=5)
    assert store.history(0) == [*recent[2:], *newer]


# -- park and wake: the waiting list (a ParkingStore) -----------------------------------
#
# The entry states and the claim's decisions are those of SlotStore.claim's docstring and
# docs/park.md; each test below names the row of that table it checks.

DISPATCH_LEASE = 30.0


def parking_store(store: SlotStore) -> SlotStore:
    if not isinstance(store, ParkingStore):
        pytest.skip(f"{type(store).__name__} has no waiting list (park falls back to backoff)")
    return store


def park(
    store: SlotStore,
    slots: Mapping[str, int],
    task_id: str,
    first: float,
    max_waiters: int = 100,
    *,
    with_payload: bool = True,
) -> str:
    """Park ``task_id`` (its payload: ``b"payload of <task id>"``, or none)."""
    payload = f"payload of {task_id}".encode() if with_payload else None
    return store.park(ParkRequest(
        slots, task_id, new_run_id(), HOLDER, LONG_LEASE, payload=payload,
        first_deferred_at=first, max_waiters=max_waiters, task_name="t.parked",
    ))  # fmt: skip


def listed(store: SlotStore, slot: str) -> list[tuple[str, bool]]:
    """``(task id, dispatched)`` of ``slot``'s waiting list, in order."""
    return [(waiter.task_id, waiter.dispatched) for waiter in store.waiters(slot)]


def dispatch_one(store: SlotStore, slot: str, task_id: str, lease: float = DISPATCH_LEASE) -> Woken:
    """Park ``task_id`` behind a running task of ``slot`` (limit 1), release that task: the
    waiter's dispatch, returned."""
    running = admit(store, {slot: 1}, f"{task_id}-before")
    assert park(store, {slot: 1}, task_id, 1.0) == ParkOutcome.PARKED
    _, [woken] = store.release_and_wake(running, lease)
    assert woken.task_id == task_id and not woken.readmit
    return woken


def test_park_admits_when_there_is_room_and_parks_when_full(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}s"
    assert park(store, {slot: 1}, f"{prefix}a", 1.0) == ParkOutcome.ADMITTED
    # Full, without a message to park: nothing is stored (the caller builds one and parks)
    assert park(store, {slot: 1}, f"{prefix}b", 2.0, with_payload=False) == ParkOutcome.FULL
    assert store.waiters(slot) == []
    assert park(store, {slot: 1}, f"{prefix}b", 2.0) == ParkOutcome.PARKED
    # A task that waits already changes nothing: its entry answers for it (room or not)
    assert park(store, {slot: 1}, f"{prefix}b", 2.0) == ParkOutcome.WAITING
    assert park(store, {slot: 1}, f"{prefix}b", 2.0, with_payload=False) == ParkOutcome.WAITING
    assert listed(store, slot) == [(f"{prefix}b", False)]
    assert [lease.task_id for lease in store.leases(slot)] == [f"{prefix}a"]


def test_a_task_parked_for_one_full_slot_waits_on_every_slot_it_needs_and_takes_none(
    store: SlotStore, prefix: str
) -> None:
    store = parking_store(store)
    slot, other = f"{prefix}s", f"{prefix}other"
    admit(store, {slot: 1}, f"{prefix}running")
    assert park(store, {slot: 1, other: 5}, f"{prefix}b", 1.0) == ParkOutcome.PARKED
    assert [(w.slot, w.task_id) for w in store.waiters(slot) + store.waiters(other)] == [
        (slot, f"{prefix}b"),
        (other, f"{prefix}b"),
    ]
    assert store.leases(other) == []


def test_a_release_hands_the_slot_to_the_oldest_waiter_which_claims_it(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}s"
    holder_run = admit(store, {slot: 1}, f"{prefix}running")
    # Given waiters parked out of first-deferral order
    for task, first in (("late", 30.0), ("early", 10.0), ("middle", 20.0)):
        assert park(store, {slot: 1}, f"{prefix}{task}", first) == ParkOutcome.PARKED
    assert [w.task_id for w in store.waiters(slot)] == [f"{prefix}{t}" for t in ("early", "middle", "late")]

    # When the running task releases
    deleted, woken = store.release_and_wake(holder_run, DISPATCH_LEASE)

    # Then the oldest waiter gets the slot, under its own task id, and its payload comes back
    assert deleted == 1
    [dispatched] = woken
    assert (dispatched.task_id, dispatched.payload) == (f"{prefix}early", f"payload of {prefix}early".encode())
    assert not dispatched.readmit
    [lease] = store.leases(slot)
    assert (lease.task_id, lease.run_id, lease.holder) == (f"{prefix}early", dispatched.run_id, DISPATCH_HOLDER)
    assert lease.expires_in <= DISPATCH_LEASE
    # ... no newcomer can take it in between
    assert refused_slots(store, {slot: 1}, f"{prefix}newcomer") == {slot}
    # ... and (claim row 1) the arriving copy claims it: a full lease held by its worker, and the
    # task leaves the list
    claimed = store.claim(f"{prefix}early", dispatched.run_id, "w2@host/9", LONG_LEASE)
    assert claimed is ClaimOutcome.RUN
    [lease] = store.leases(slot)
    assert (lease.holder, lease.run_id) == ("w2@host/9", dispatched.run_id)
    assert lease.expires_in > DISPATCH_LEASE
    assert [w.task_id for w in store.waiters(slot)] == [f"{prefix}middle", f"{prefix}late"]
    assert store.renew([dispatched.run_id], LONG_LEASE) == {dispatched.run_id: 1}


def test_a_waiter_with_a_full_slot_is_passed_over_not_blocking_the_rest(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    provider, tenant = f"{prefix}provider", f"{prefix}tenant:a"
    provider_run = admit(store, {provider: 1}, f"{prefix}p")
    admit(store, {tenant: 1}, f"{prefix}t")
    # The oldest waiter needs the tenant slot too, which stays full
    assert park(store, {provider: 1, tenant: 1}, f"{prefix}both", 1.0) == ParkOutcome.PARKED
    assert park(store, {provider: 1}, f"{prefix}provider-only", 2.0) == ParkOutcome.PARKED

    _, woken = store.release_and_wake(provider_run, DISPATCH_LEASE)

    assert [w.task_id for w in woken] == [f"{prefix}provider-only"]
    assert listed(store, provider) == [(f"{prefix}both", False), (f"{prefix}provider-only", True)]


def test_no_key_starves_under_a_global_cap_with_uneven_load(store: SlotStore, prefix: str) -> None:
    # Rule: waiters are served by first-deferral time among those whose every slot has
    # room; a waiter is passed over only while one of its own slots is full.
    store = parking_store(store)
    provider = f"{prefix}provider"
    load = {"a": 12, "b": 3, "c": 1}  # uneven: key a floods the waiting list first
    tasks = [(key, number) for key in load for number in range(load[key])]
    runs = [
        admit(store, {provider: 2, f"{prefix}tenant:x": 1}, f"{prefix}x0"),
        admit(store, {provider: 2}, f"{prefix}f"),
    ]
    for order, (key, number) in enumerate(tasks):
        slots = {provider: 2, f"{prefix}tenant:{key}": 1}
        assert park(store, slots, f"{prefix}{key}{number}", float(order)) == ParkOutcome.PARKED
    served: list[str] = []
    running = list(runs)
    while running:
        _, woken = store.release_and_wake(running.pop(0), DISPATCH_LEASE)
        for waiter in woken:
            assert store.claim(waiter.task_id, waiter.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
            served.append(waiter.task_id.removeprefix(prefix))
            running.append(waiter.run_id)
    # Every task ran; within a key in FIFO order; the quiet keys were served long before key a ended.
    assert sorted(served) == sorted(f"{key}{number}" for key, number in tasks)
    for key in load:
        assert [s for s in served if s[0] == key] == [f"{key}{n}" for n in range(load[key])]
    # (key a holds one slot of two at a time: the others alternate with it, not wait for it)
    assert max(served.index("c0"), served.index("b2")) < served.index("a5"), served
    assert [w for w in store.waiters() if w.slot.startswith(prefix)] == []


def test_a_second_copy_of_a_claimed_dispatch_ends_unless_the_broker_redelivered_it(
    store: SlotStore, prefix: str
) -> None:
    # Claim row 2: the dispatch's leases are live and held by the run of the copy that claimed first.
    store = parking_store(store)
    slot = f"{prefix}s"
    woken = dispatch_one(store, slot, f"{prefix}t")
    assert store.claim(woken.task_id, woken.run_id, "w1@h/1", LONG_LEASE) is ClaimOutcome.RUN

    # The same claim again (its reply was lost and the client retried it) runs: it is that run
    assert store.claim(woken.task_id, woken.run_id, "w1@h/1", LONG_LEASE) is ClaimOutcome.RUN
    # A duplicate (a copy of the same dispatch in another process) ends: the live run answers for it
    assert store.claim(woken.task_id, woken.run_id, "w2@h/2", LONG_LEASE) is ClaimOutcome.END
    # ... unless the broker redelivered it (its first run may have died): it goes through admission
    claimed = store.claim(woken.task_id, woken.run_id, "w2@h/2", LONG_LEASE, redelivered=True)
    assert claimed is ClaimOutcome.ADMIT
    # Neither decision touched the run's lease
    [lease] = store.leases(slot)
    assert (lease.run_id, lease.holder) == (woken.run_id, "w1@h/1")


def test_a_copy_of_an_unknown_dispatch_goes_through_admission(store: SlotStore, prefix: str) -> None:
    # Claim row 3, no entry: nobody else answers for the task (a copy whose dispatch was taken when
    # sent and expired, a redelivered copy whose run finished): it is admitted as usual.
    store = parking_store(store)
    task = f"{prefix}t"
    assert store.claim(task, new_run_id(), HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert store.claim(task, new_run_id(), HOLDER, LONG_LEASE, redelivered=True) is ClaimOutcome.ADMIT
    assert own_leases(store, prefix) == []


def test_a_copy_whose_task_waits_or_was_dispatched_to_another_run_ends(store: SlotStore, prefix: str) -> None:
    # Claim row 3, an entry waiting or dispatched to another run: the list answers for the task.
    store = parking_store(store)
    slot = f"{prefix}s"
    woken = dispatch_one(store, slot, f"{prefix}t")
    stale = new_run_id()
    # dispatched to another run (live): a copy of a stale dispatch ends, redelivered or not
    for redelivered in (False, True):
        assert store.claim(woken.task_id, stale, HOLDER, LONG_LEASE, redelivered=redelivered) is ClaimOutcome.END
    assert listed(store, slot) == [(woken.task_id, True)]
    # waiting: parked again behind a running task, any dispatch's copy ends
    store.forget(woken.task_id, DISPATCH_LEASE)
    store.sweep()
    other = f"{prefix}u"
    running = admit(store, {slot: 1}, f"{other}-before")
    assert park(store, {slot: 1}, other, 5.0) == ParkOutcome.PARKED
    assert store.claim(other, stale, HOLDER, LONG_LEASE) is ClaimOutcome.END
    assert listed(store, slot) == [(other, False)]
    assert [lease.run_id for lease in store.leases(slot)] == [running]


def test_a_copy_whose_dispatch_expired_takes_the_task_off_the_list_and_goes_through_admission(
    store: SlotStore, prefix: str
) -> None:
    # Claim row 3, the entry dispatched to this copy's run with no live lease left.
    store = parking_store(store)
    slot = f"{prefix}s"
    woken = dispatch_one(store, slot, f"{prefix}t", lease=SHORT_LEASE)
    wait_until_expired(store, [woken.run_id])

    assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT

    # Its entry left the list, and the expired dispatch lease is gone
    assert store.waiters(slot) == []
    assert own_leases(store, prefix) == []
    # ... with no lease left to say the task was taken, a tombstone says it: a duplicate copy of the
    # dispatch in another process ends, unless the broker redelivered it; the same claim retried
    # goes through admission again
    assert store.claim(woken.task_id, woken.run_id, "w2@h/2", LONG_LEASE) is ClaimOutcome.END
    claimed = store.claim(woken.task_id, woken.run_id, "w2@h/2", LONG_LEASE, redelivered=True)
    assert claimed is ClaimOutcome.ADMIT
    assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT


def test_an_unclaimed_dispatch_is_dispatched_again_and_the_late_copy_ends_even_after_the_run(
    store: SlotStore, prefix: str
) -> None:
    # Recovery, then claim rows 1 and 3 with a tombstone: the prefetch duplicate.
    store = parking_store(store)
    slot = f"{prefix}s"
    # Given a dispatch whose copy waits somewhere (a prefetch buffer) past its deadline
    first = dispatch_one(store, slot, f"{prefix}t", lease=SHORT_LEASE)
    assert store.recover(DISPATCH_LEASE, caps=[slot]) == []  # not expired yet: nothing to do
    wait_until_expired(store, [first.run_id])

    # When recovery runs, the task is dispatched again, under a new run
    [again] = store.recover(DISPATCH_LEASE, caps=[slot])
    assert (again.task_id, again.payload) == (first.task_id, first.payload)
    assert again.run_id != first.run_id and not again.readmit
    assert [lease.run_id for lease in store.leases(slot)] == [again.run_id]
    # ... the old copy, arriving now, ends (the entry is dispatched to another run)
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END
    # ... the new copy claims it; the entry, dispatched twice, stays as a tombstone (not listed)
    assert store.claim(again.task_id, again.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert store.waiters(slot) == []
    # ... so once that run is over, the old copy still ends, even redelivered (a warm shutdown
    # returns it so): the tombstone records the dispatch that ran, and it is not this one
    assert store.release(again.run_id) == 1
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END
    claimed = store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE, redelivered=True)
    assert claimed is ClaimOutcome.END
    # A new copy of the task without a dispatch (a retry) parks afresh: the tombstone gives way
    busy = admit(store, {slot: 1}, f"{prefix}busy")
    assert park(store, {slot: 1}, first.task_id, 9.0) == ParkOutcome.PARKED
    assert listed(store, slot) == [(first.task_id, False)]
    # ... the old copy still ends (the list answers), and once this new entry is claimed after a
    # single dispatch, it leaves a tombstone all the same: its count of dispatches carried over
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END
    _, [third] = store.release_and_wake(busy, DISPATCH_LEASE)
    assert store.claim(third.task_id, third.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END


def test_a_claim_retried_after_its_reply_was_lost_runs_even_once_its_leases_expired(
    store: SlotStore, prefix: str
) -> None:
    # Claim rows 1 and 3: a claim is repeatable by the process that made it.
    store = parking_store(store)
    slot = f"{prefix}s"
    first = dispatch_one(store, slot, f"{prefix}t", lease=SHORT_LEASE)
    wait_until_expired(store, [first.run_id])
    [again] = store.recover(DISPATCH_LEASE, caps=[slot])  # dispatched twice: a tombstone follows
    # Given a claim that took the task, whose reply was lost (the store went away)
    assert store.claim(again.task_id, again.run_id, "w1@h/1", LONG_LEASE) is ClaimOutcome.RUN
    # When it is retried by the same process: it runs (its leases are its own)
    assert store.claim(again.task_id, again.run_id, "w1@h/1", LONG_LEASE) is ClaimOutcome.RUN
    # ... and once they expired (the store was away longer than a lease), it goes through
    # admission: the tombstone is its own claim's
    lapse(store, [again.run_id])
    assert store.claim(again.task_id, again.run_id, "w1@h/1", LONG_LEASE) is ClaimOutcome.ADMIT
    # Another process presenting that dispatch, or this one presenting the older dispatch, ends
    assert store.claim(again.task_id, again.run_id, "w2@h/2", LONG_LEASE) is ClaimOutcome.END
    assert store.claim(first.task_id, first.run_id, "w1@h/1", LONG_LEASE) is ClaimOutcome.END


def test_the_sweep_deletes_tombstones_once_they_are_old(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    store.done_seconds = SHORT_LEASE
    slot = f"{prefix}s"
    first = dispatch_one(store, slot, f"{prefix}t", lease=SHORT_LEASE)
    wait_until_expired(store, [first.run_id])
    [again] = store.recover(DISPATCH_LEASE, caps=[slot])
    assert store.claim(again.task_id, again.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert store.release(again.run_id) == 1
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END

    def tombstone_gone() -> bool:
        store.sweep()
        return store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT

    wait_until(tombstone_gone, "the sweep deleted the tombstone")


def test_waiting_lists_are_bounded(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}s"
    admit(store, {slot: 1}, f"{prefix}running")
    assert park(store, {slot: 1}, f"{prefix}w1", 1.0, max_waiters=2) == ParkOutcome.PARKED
    assert park(store, {slot: 1}, f"{prefix}w2", 5.0, max_waiters=2) == ParkOutcome.PARKED
    assert park(store, {slot: 1}, f"{prefix}w3", 6.0, max_waiters=2) == ParkOutcome.LIST_FULL
    assert [w.task_id for w in store.waiters(slot)] == [f"{prefix}w1", f"{prefix}w2"]


def test_a_waiting_list_bound_counts_waiting_and_dispatched_entries_until_claimed_or_forgotten(
    store: SlotStore, prefix: str
) -> None:
    store = parking_store(store)
    slot, other = f"{prefix}s", f"{prefix}o"
    running = admit(store, {slot: 1}, f"{prefix}running")
    admit(store, {other: 1}, f"{prefix}running-other")
    # Given a list bound of 2, full (one of its waiters waits for another slot too)
    assert park(store, {slot: 1}, f"{prefix}w1", 1.0, max_waiters=2) == ParkOutcome.PARKED
    assert park(store, {slot: 1, other: 1}, f"{prefix}w2", 2.0, max_waiters=2) == ParkOutcome.PARKED
    assert park(store, {slot: 1}, f"{prefix}w3", 3.0, max_waiters=2) == ParkOutcome.LIST_FULL
    # When a waiter is forgotten, one more fits
    assert store.forget(f"{prefix}w1", DISPATCH_LEASE)[0] == 1
    assert park(store, {slot: 1}, f"{prefix}w3", 3.0, max_waiters=2) == ParkOutcome.PARKED
    assert park(store, {slot: 1}, f"{prefix}w4", 4.0, max_waiters=2) == ParkOutcome.LIST_FULL
    # A dispatched entry still counts until its copy claims it
    _, [woken] = store.release_and_wake(running, DISPATCH_LEASE)
    assert woken.task_id == f"{prefix}w3"
    assert park(store, {slot: 1}, f"{prefix}w4", 4.0, max_waiters=2) == ParkOutcome.LIST_FULL
    assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert park(store, {slot: 1}, f"{prefix}w4", 4.0, max_waiters=2) == ParkOutcome.PARKED
    # and the other slot's list counts only its own waiter
    assert park(store, {other: 1}, f"{prefix}w5", 5.0, max_waiters=2) == ParkOutcome.PARKED
    assert park(store, {other: 1}, f"{prefix}w6", 6.0, max_waiters=2) == ParkOutcome.LIST_FULL
    assert [w.task_id for w in store.waiters(slot)] == [f"{prefix}w2", f"{prefix}w4"]


def test_waiters_past_the_maximum_wait_are_readmitted_and_leave_the_list_when_their_copy_claims(
    store: SlotStore, prefix: str
) -> None:
    store = parking_store(store)
    slot = f"{prefix}s"
    admit(store, {slot: 1}, f"{prefix}running")
    park(store, {slot: 1}, f"{prefix}old", 1.0)
    park(store, {slot: 1}, f"{prefix}young", 5.0)

    # When recovery readmits the waiters first deferred before 2.0 (the slot stays full)
    [readmitted] = store.recover(DISPATCH_LEASE, caps=[slot], readmit_before=2.0)

    # Then the old one is dispatched without leases, and stays listed until its copy claims
    assert (readmitted.task_id, readmitted.readmit) == (f"{prefix}old", True)
    assert readmitted.payload == f"payload of {prefix}old".encode()
    assert [lease.task_id for lease in own_leases(store, prefix)] == [f"{prefix}running"]
    assert listed(store, slot) == [(f"{prefix}old", True), (f"{prefix}young", False)]
    assert store.recover(DISPATCH_LEASE, caps=[slot], readmit_before=2.0) == []  # not twice
    # ... and its copy, claiming, takes it off the list and goes through admission
    assert store.claim(readmitted.task_id, readmitted.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert listed(store, slot) == [(f"{prefix}young", False)]


def test_a_readmit_whose_copy_is_lost_is_readmitted_again(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}s"
    admit(store, {slot: 1}, f"{prefix}running")
    park(store, {slot: 1}, f"{prefix}old", 1.0)
    [lost] = store.recover(SHORT_LEASE, caps=[slot], readmit_before=2.0)

    def readmitted_again() -> list[Woken]:
        return store.recover(DISPATCH_LEASE, caps=[slot], readmit_before=2.0)

    deadline = time.monotonic() + 10
    again: list[Woken] = []
    while not again and time.monotonic() < deadline:
        time.sleep(0.05)
        again = readmitted_again()
    assert [(w.task_id, w.readmit) for w in again] == [(f"{prefix}old", True)]
    assert again[0].run_id != lost.run_id
    assert store.claim(lost.task_id, lost.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END


def test_an_operator_readmits_a_slots_waiters(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot, other = f"{prefix}s", f"{prefix}other"
    admit(store, {slot: 1, other: 1}, f"{prefix}running")
    park(store, {slot: 1}, f"{prefix}b", 2.0)
    park(store, {slot: 1}, f"{prefix}a", 1.0)
    park(store, {other: 1}, f"{prefix}c", 3.0)

    readmitted = store.readmit(slot, DISPATCH_LEASE)

    assert [(w.task_id, w.readmit) for w in readmitted] == [(f"{prefix}a", True), (f"{prefix}b", True)]
    assert listed(store, slot) == [(f"{prefix}a", True), (f"{prefix}b", True)]
    assert listed(store, other) == [(f"{prefix}c", False)]
    assert store.readmit(slot, DISPATCH_LEASE) == []
    for woken in readmitted:
        assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert store.waiters(slot) == []
    # A duplicate copy of a readmit (a publish the broker client retried) ends: the first one's
    # claim left a tombstone
    assert store.claim(readmitted[0].task_id, readmitted[0].run_id, "w2@h/2", LONG_LEASE) is ClaimOutcome.END


def test_a_dead_holders_or_a_revoked_tasks_release_hands_the_slot_to_the_next_waiter(
    store: SlotStore, prefix: str
) -> None:
    store = parking_store(store)
    dead_slot, revoked_slot = f"{prefix}dead", f"{prefix}revoked"
    admit(store, {dead_slot: 1}, f"{prefix}killed", holder="w1@host-a/7")
    admit(store, {revoked_slot: 1}, f"{prefix}revoked")
    park(store, {dead_slot: 1}, f"{prefix}after-killed", 1.0)
    park(store, {revoked_slot: 1}, f"{prefix}after-revoked", 2.0)

    # When the main process releases a dead pool process's leases, and a revoked task's
    deleted, woken = store.release_holder_and_wake(f"{prefix}killed", "w1@host-a/7", DISPATCH_LEASE)

    # Then each freed slot goes to its waiter in the same step, as a dispatch lease
    assert (deleted, [w.task_id for w in woken]) == (1, [f"{prefix}after-killed"])
    deleted, woken = store.release_task_and_wake(f"{prefix}revoked", DISPATCH_LEASE)
    assert (deleted, [w.task_id for w in woken]) == (1, [f"{prefix}after-revoked"])
    assert sorted((lease.slot, lease.task_id, lease.holder) for lease in own_leases(store, prefix)) == [
        (dead_slot, f"{prefix}after-killed", DISPATCH_HOLDER),
        (revoked_slot, f"{prefix}after-revoked", DISPATCH_HOLDER),
    ]
    # ... and nothing to release wakes nobody
    assert store.release_holder_and_wake(f"{prefix}killed", "w1@host-a/7", DISPATCH_LEASE) == (0, [])


def test_forget_takes_a_revoked_task_off_the_waiting_list_and_frees_its_dispatch(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}s"
    running = admit(store, {slot: 1}, f"{prefix}running")
    for order, task in enumerate(("revoked-waiting", "revoked-dispatched", "next")):
        assert park(store, {slot: 1}, f"{prefix}{task}", float(order)) == ParkOutcome.PARKED

    # A task revoked while it waits leaves the list; nothing is freed
    assert store.forget(f"{prefix}revoked-waiting", DISPATCH_LEASE) == (1, [])
    _, [dispatched] = store.release_and_wake(running, DISPATCH_LEASE)
    assert dispatched.task_id == f"{prefix}revoked-dispatched"

    # A task revoked while its dispatch is on the way: its entry and dispatch lease go, and the
    # slot goes to the next waiter in the same step
    removed, woken = store.forget(f"{prefix}revoked-dispatched", DISPATCH_LEASE)
    assert (removed, [w.task_id for w in woken]) == (1, [f"{prefix}next"])
    assert [(lease.task_id, lease.holder) for lease in own_leases(store, prefix)] == [
        (f"{prefix}next", DISPATCH_HOLDER)
    ]
    assert listed(store, slot) == [(f"{prefix}next", True)]
    # ... and the copy of its dispatch, arriving after all, ends (a tombstone answers for it)
    assert store.claim(dispatched.task_id, dispatched.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END

    # It never touches the lease of a run
    assert store.claim(f"{prefix}next", woken[0].run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert store.forget(f"{prefix}next", DISPATCH_LEASE) == (0, [])
    assert [(lease.task_id, lease.holder) for lease in own_leases(store, prefix)] == [(f"{prefix}next", HOLDER)]


def test_recovery_hands_room_freed_by_expired_leases_to_waiters(store: SlotStore, prefix: str) -> None:
    # A crashed worker never releases: its lease expires, and recovery (not a release) wakes.
    store = parking_store(store)
    slot = f"{prefix}s"
    crashed = admit(store, {slot: 1}, f"{prefix}crashed")
    assert park(store, {slot: 1}, f"{prefix}waiter", 1.0) == ParkOutcome.PARKED
    assert store.recover(DISPATCH_LEASE, caps=[slot]) == []
    lapse(store, [crashed])

    [woken] = store.recover(DISPATCH_LEASE, caps=[slot])

    assert woken.task_id == f"{prefix}waiter"
    assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN


def test_recovery_of_a_cap_serves_each_key_with_room_oldest_first_among_many_waiting_keys(
    store: SlotStore, prefix: str
) -> None:
    # Rule: a recovery pass walks the lists of the slots with room, merged by first deferral
    # (the Redis store merges them through a heap: many lists, so that its order is exercised).
    store = parking_store(store)
    cap, keys = f"{prefix}tenant", 48
    slot = [f"{cap}:k{i:02d}" for i in range(keys)]
    # Given keys at limit 1, each held, each with two waiters first deferred in a scrambled order
    holders = [admit(store, {slot[i]: 1}, f"{prefix}holder{i}") for i in range(keys)]
    deferred = {i: float((i * 29) % keys) for i in range(keys)}
    for i in range(keys):
        assert park(store, {slot[i]: 1}, f"{prefix}first{i}", deferred[i]) == ParkOutcome.PARKED
        assert park(store, {slot[i]: 1}, f"{prefix}second{i}", 100.0 + deferred[i]) == ParkOutcome.PARKED
    # ... and, oldest of all, a waiter of an even key and an odd one (the odd key full)
    assert park(store, {slot[0]: 1, slot[1]: 1}, f"{prefix}both", -1.0) == ParkOutcome.PARKED
    # ... and the even keys' holders gone without a hand-over (as leases that expired, swept)
    for i in range(0, keys, 2):
        assert store.release(holders[i]) == 1

    # When a worker's recovery pass runs on the cap
    woken = store.recover(DISPATCH_LEASE, caps=[cap])

    # Then each even key's oldest waiter that fits is dispatched, all of them oldest first; the
    # waiter of a full key stays, and so does every second waiter
    even = sorted(range(0, keys, 2), key=lambda i: deferred[i])
    assert [w.task_id for w in woken] == [f"{prefix}first{i}" for i in even]
    assert all(not w.readmit for w in woken)
    assert store.recover(DISPATCH_LEASE, caps=[cap]) == []


def test_recovery_passes_over_a_key_whose_waiters_all_wait_for_a_full_slot_but_serves_one_holding_it(
    store: SlotStore, prefix: str
) -> None:
    # Rule: recovery dispatches a waiter only where all its slots fit it.  A key with room whose
    # waiters all need the full global slot is left to that slot's release (the stores no longer
    # walk such a list at every pass), but a waiter whose task id holds the full slot already
    # fits it, and is served.
    store = parking_store(store)
    whole, tenant = f"{prefix}global", f"{prefix}tenant"
    quiet, busy = f"{tenant}:quiet", f"{tenant}:busy"
    # Given the global slot full, held by a task that also waits for the busy key
    mine = f"{prefix}mine"
    admit(store, {whole: 1}, mine)
    busy_holder = admit(store, {busy: 1}, f"{prefix}busy-holder")
    assert park(store, {whole: 1, busy: 1}, mine, 1.0) == ParkOutcome.PARKED
    # ... and, older than it, waiters of the quiet key that need the global slot too
    quiet_holders = [admit(store, {quiet: 2}, f"{prefix}quiet-holder{i}") for i in range(2)]
    for i in range(3):
        assert park(store, {whole: 1, quiet: 2}, f"{prefix}quiet{i}", -1.0 + i * 0.1) == ParkOutcome.PARKED
    # ... and both keys given room without a hand-over (as leases that expired, swept)
    for run_id in (busy_holder, *quiet_holders):
        assert store.release(run_id) == 1

    # When a worker's recovery pass runs on both caps
    woken = store.recover(DISPATCH_LEASE, caps=[whole, tenant])

    # Then only the waiter that holds the global slot already is dispatched; the quiet key's
    # waiters stay, in their order, and go once the global slot is released
    assert [w.task_id for w in woken] == [mine]
    assert [task_id for task_id, _ in listed(store, quiet)] == [f"{prefix}quiet{i}" for i in range(3)]
    assert store.recover(DISPATCH_LEASE, caps=[whole, tenant]) == []


def test_prune_keeps_the_slots_that_parked_tasks_wait_for(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    cap = f"{prefix}tenant"
    waited, dispatched, idle = f"{cap}:waited", f"{cap}:dispatched", f"{cap}:idle"
    # Given a slot whose holder's lease expired with a task parked behind it, a slot whose waiter
    # was dispatched and never claimed its (expired) dispatch lease, and an idle slot
    expired = [admit(store, {slot: 1}, f"{prefix}{slot}-holder") for slot in (waited, idle)]
    holder = admit(store, {dispatched: 1}, f"{prefix}dispatched-holder")
    assert park(store, {waited: 1}, f"{prefix}waiter", 1.0) == ParkOutcome.PARKED
    assert park(store, {dispatched: 1}, f"{prefix}dispatched", 2.0) == ParkOutcome.PARKED
    lapse(store, expired)
    _, [lost] = store.release_and_wake(holder, SHORT_LEASE)
    wait_until_expired(store, [lost.run_id])

    # When the operator prunes the cap's keys no live lease holds
    assert store.prune(f"{cap}:", dry_run=True) == [idle]
    assert store.prune(f"{cap}:") == [idle]

    # Then the slots with parked tasks keep their sentinels, and their waiters are still served
    assert set(own_status(store, prefix)) == {waited, dispatched}
    woken = store.recover(DISPATCH_LEASE, caps=[waited, dispatched])
    assert sorted(w.task_id for w in woken) == [f"{prefix}dispatched", f"{prefix}waiter"]


def test_a_release_of_several_slots_serves_the_waiters_of_all_of_them_oldest_first(
    store: SlotStore, prefix: str
) -> None:
    # Rule: the waiting lists of every released slot are served together, by first
    # deferral; each waiter takes all its slots or none.
    store = parking_store(store)
    first_slot, second_slot = f"{prefix}a", f"{prefix}b"
    both = {first_slot: 1, second_slot: 1}
    run = admit(store, both, f"{prefix}running")
    # Given waiters of either slot and of both, parked out of order
    assert park(store, {first_slot: 1}, f"{prefix}a-only", 2.0) == ParkOutcome.PARKED
    assert park(store, both, f"{prefix}both-late", 3.0) == ParkOutcome.PARKED
    assert park(store, {second_slot: 1}, f"{prefix}b-only", 1.0) == ParkOutcome.PARKED

    # When the run holding both slots releases
    deleted, woken = store.release_and_wake(run, DISPATCH_LEASE)

    # Then the oldest waiter of each list gets its slot, and the newer one needing both waits
    assert deleted == 2
    assert [w.task_id for w in woken] == [f"{prefix}b-only", f"{prefix}a-only"]
    assert {(lease.slot, lease.task_id) for lease in own_leases(store, prefix)} == {
        (first_slot, f"{prefix}a-only"),
        (second_slot, f"{prefix}b-only"),
    }
    assert listed(store, first_slot) == [(f"{prefix}a-only", True), (f"{prefix}both-late", False)]

    # When both dispatched tasks claim and finish, the waiter of both slots gets both at once
    for waiter in woken:
        assert store.claim(waiter.task_id, waiter.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    _, first_release = store.release_and_wake(woken[0].run_id, DISPATCH_LEASE)
    assert first_release == []  # its other slot is still held
    _, [last] = store.release_and_wake(woken[1].run_id, DISPATCH_LEASE)
    assert last.task_id == f"{prefix}both-late"
    assert sorted(lease.slot for lease in store.leases() if lease.run_id == last.run_id) == [first_slot, second_slot]
    assert store.claim(last.task_id, last.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert [w for w in store.waiters() if w.slot.startswith(prefix)] == []


def test_forget_frees_the_slots_a_task_took_when_it_was_sent(store: SlotStore, prefix: str) -> None:
    # A task sent while its slot had room took it then, as a dispatch (no entry), and is revoked
    # (or expires) before any worker claims it: its slot goes to the next waiter at once.
    store = parking_store(store)
    slot = f"{prefix}s"
    sent = f"{prefix}sent"
    assert store.park(ParkRequest(
        {slot: 1}, sent, new_run_id(), DISPATCH_HOLDER, DISPATCH_LEASE, payload=b"m", first_deferred_at=1.0,
        max_waiters=100,
    )) == ParkOutcome.ADMITTED  # fmt: skip
    assert park(store, {slot: 1}, f"{prefix}next", 2.0) == ParkOutcome.PARKED

    removed, woken = store.forget(sent, DISPATCH_LEASE)

    assert (removed, [w.task_id for w in woken]) == (0, [f"{prefix}next"])
    assert [(lease.task_id, lease.holder) for lease in own_leases(store, prefix)] == [
        (f"{prefix}next", DISPATCH_HOLDER)
    ]
