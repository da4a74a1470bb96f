"""Deployments sharing one Redis store: every path of a hand-over, the keys, and what a walk reads.

``tests/unit/test_store_deployments.py`` holds the contract's cases.  These cover the other
paths a hand-over takes in the Redis scripts (each kind of release, ``forget``'s wake, waiters
of several slots, recovery's walk, its expired dispatches, its readmits and its task names),
with the memory store as the reference; a handle without a deployment beside one with a
deployment (entries parked before deployments existed have none); the keys a deployment's
entries use, gone with them; and, on a Redis of the test's own, that a hand-over sends Redis
the same commands whether or not another deployment has a long list in the same slot: it never
reads the other deployment's waiters.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from celery_caps.stores.base import ClaimOutcome, ParkOutcome, SlotStore, Woken
from celery_caps.stores.redis import RedisStore
from tests.services import REDIS_KINDS, StoreTarget, new_prefix
from tests.unit.test_redis_eviction import redis_server
from tests.unit.test_stores import (
    DISPATCH_LEASE,
    HOLDER,
    LONG_LEASE,
    SHORT_LEASE,
    admit,
    lapse,
    listed,
    park,
    parking_store,
    wait_until_expired,
)

#: Waiters another deployment keeps ahead in a slot, for the cost test (more than one chunk of
#: the walk's reads).
CROWD = 300


def open_like(store: SlotStore, store_target: StoreTarget, deployment: str) -> SlotStore:
    """Another handle on the same store, of ``deployment``; the caller closes it."""
    # (memory: a copy has the same entries, one process's memory)
    other = copy.copy(store) if store_target.kind.id == "memory" else store_target.open()
    other.deployment = deployment
    return other


@pytest.fixture
def production(store_target: StoreTarget, request: pytest.FixtureRequest) -> SlotStore:
    if store_target.kind.id not in ("memory", *REDIS_KINDS):
        pytest.skip("the Redis store's paths (the memory store as the reference)")
    store = parking_store(request.getfixturevalue("store"))  # (only now: no SQL store is opened)
    store.deployment = "production"
    return store


@pytest.fixture
def staging(production: SlotStore, store_target: StoreTarget) -> Iterator[SlotStore]:
    """Another handle on the same store, of the staging deployment."""
    other = open_like(production, store_target, "staging")
    try:
        yield other
    finally:
        other.close()


@pytest.fixture
def unnamed(production: SlotStore, store_target: StoreTarget) -> Iterator[SlotStore]:
    """Another handle on the same store, without a deployment (``""``)."""
    other = open_like(production, store_target, "")
    try:
        yield other
    finally:
        other.close()


RELEASES: dict[str, Callable[[SlotStore, str, str], tuple[int, list[Woken]]]] = {
    "run": lambda store, task_id, run_id: store.release_and_wake(run_id, DISPATCH_LEASE),
    "holder": lambda store, task_id, run_id: store.release_holder_and_wake(task_id, HOLDER, DISPATCH_LEASE),
    "task": lambda store, task_id, run_id: store.release_task_and_wake(task_id, DISPATCH_LEASE),
}


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_kind_of_release_hands_over_only_within_its_deployment(
    production: SlotStore, staging: SlotStore, prefix: str, release: str
) -> None:
    slot = f"{prefix}quota"
    running = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    deleted, woken = RELEASES[release](staging, f"{prefix}staging-run", running)
    assert deleted == 1
    assert [w.task_id for w in woken] == [f"{prefix}staging-task"]
    assert listed(production, slot) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]


def test_a_release_passes_over_another_deployments_waiter_of_several_slots(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    # Given: a production task waits for two slots, the first of them held by staging; a
    # staging task waits for that slot alone, after it
    first, second = f"{prefix}a", f"{prefix}b"
    running = admit(staging, {first: 1}, f"{prefix}staging-run")
    assert park(production, {first: 1, second: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {first: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    # When: staging's run ends
    _, woken = staging.release_and_wake(running, DISPATCH_LEASE)
    # Then: the slot goes to staging's waiter; production's keeps its place in both lists
    assert [w.task_id for w in woken] == [f"{prefix}staging-task"]
    assert listed(production, first) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]
    assert listed(production, second) == [(f"{prefix}production-task", False)]


def test_forget_hands_the_slots_it_frees_only_within_its_deployment_but_drops_any_entry(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    # Given: staging's waiter was dispatched (its dispatch leases hold the slot); a production
    # task and a staging task wait behind it
    slot = f"{prefix}quota"
    running = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(staging, {slot: 1}, f"{prefix}revoked", 1.0) == ParkOutcome.PARKED
    assert park(production, {slot: 1}, f"{prefix}production-task", 2.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 3.0) == ParkOutcome.PARKED
    _, [dispatched] = staging.release_and_wake(running, DISPATCH_LEASE)
    assert dispatched.task_id == f"{prefix}revoked"
    # When: staging forgets it (revoked): the slot its dispatch held goes to staging's waiter
    removed, woken = staging.forget(f"{prefix}revoked", DISPATCH_LEASE)
    assert removed == 1
    assert [w.task_id for w in woken] == [f"{prefix}staging-task"]
    # And: a handle forgets a task of another deployment too (an operator's revoke)
    removed, woken = staging.forget(f"{prefix}production-task", DISPATCH_LEASE)
    assert (removed, woken) == (1, [])
    assert listed(production, slot) == [(f"{prefix}staging-task", True)]


@pytest.mark.parametrize("scoped", [False, True], ids=["every-cap", "its-caps"])
def test_a_recovery_walk_passes_over_an_older_waiter_of_another_deployment(
    production: SlotStore, staging: SlotStore, prefix: str, scoped: bool
) -> None:
    slot = f"{prefix}quota"
    holder = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    lapse(staging, [holder])
    woken = staging.recover(DISPATCH_LEASE, caps=[slot] if scoped else None)
    assert [w.task_id for w in woken] == [f"{prefix}staging-task"]
    assert listed(production, slot) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]


@pytest.mark.parametrize("readmit", [False, True], ids=["walk", "readmit"])
def test_a_recovery_by_task_name_serves_only_its_own_deployments_entries(
    production: SlotStore, staging: SlotStore, prefix: str, readmit: bool
) -> None:
    # Given: tasks of one name, production's and staging's, wait in a slot whose holder is gone
    # (for the walk) or holds it (the readmits)
    slot = f"{prefix}quota"
    holder = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    if not readmit:
        lapse(staging, [holder])
    # When: staging's workers recover the tasks they know by name (no cap of theirs has waiters)
    overdue = time.time() if readmit else None
    woken = staging.recover(DISPATCH_LEASE, caps=[f"{prefix}other"], task_names=["t.parked"], readmit_before=overdue)
    # Then: they serve staging's task alone; production's keeps its place
    assert [(w.task_id, w.readmit) for w in woken] == [(f"{prefix}staging-task", readmit)]
    assert listed(production, slot) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]


def test_a_recovery_returns_only_its_own_deployments_expired_dispatches(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    slot = f"{prefix}quota"
    running = admit(production, {slot: 1}, f"{prefix}production-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    _, [dispatch] = production.release_and_wake(running, SHORT_LEASE)
    wait_until_expired(production, [dispatch.run_id])
    assert staging.recover(DISPATCH_LEASE) == []
    assert staging.recover(DISPATCH_LEASE, caps=[slot]) == []
    assert listed(production, slot) == [(f"{prefix}production-task", True)]
    [again] = production.recover(DISPATCH_LEASE, caps=[slot])
    assert again.task_id == f"{prefix}production-task" and again.run_id != dispatch.run_id


@pytest.mark.parametrize("scoped", [False, True], ids=["every-cap", "its-caps"])
def test_overdue_waiters_are_readmitted_only_by_their_own_deployment(
    production: SlotStore, staging: SlotStore, prefix: str, scoped: bool
) -> None:
    slot = f"{prefix}quota"
    admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    woken = staging.recover(DISPATCH_LEASE, caps=[slot] if scoped else None, readmit_before=time.time())
    assert [(w.task_id, w.readmit) for w in woken] == [(f"{prefix}staging-task", True)]
    assert listed(production, slot) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]


@pytest.mark.parametrize("hand_over", ["release", "recovery", "drain"])
def test_a_handle_without_a_deployment_and_one_with_pass_over_each_others_entries(
    production: SlotStore, unnamed: SlotStore, prefix: str, hand_over: str
) -> None:
    # Given: an entry without a deployment (parked by a handle that has none, as before
    # deployments existed), then one of production, then another without, in one slot
    slot = f"{prefix}quota"
    running = admit(production, {slot: 2}, f"{prefix}production-run")
    admit(unnamed, {slot: 2}, f"{prefix}unnamed-run")
    order = [f"{prefix}unnamed-old", f"{prefix}production-task", f"{prefix}unnamed-new"]
    for first, (store, task_id) in enumerate(zip([unnamed, production, unnamed], order, strict=True)):
        assert park(store, {slot: 2}, task_id, 1.0 + first) == ParkOutcome.PARKED

    def hand_over_by(store: SlotStore) -> list[str]:
        if hand_over == "release":
            return [w.task_id for w in store.release_and_wake(running, DISPATCH_LEASE)[1]]
        if hand_over == "recovery":
            production.release(running)
            return [w.task_id for w in store.recover(DISPATCH_LEASE, caps=[slot])]
        return [w.task_id for w in store.readmit(slot, DISPATCH_LEASE)]

    # When: the handle without a deployment hands over, it serves only the entries without one
    # (a drain takes both, a release or recovery's room only the oldest)
    expected = order[::2] if hand_over == "drain" else order[:1]
    assert hand_over_by(unnamed) == expected
    # Then: production's handle serves its own entry, and none without a deployment
    assert [task_id for task_id, dispatched in listed(production, slot) if not dispatched] == [
        task_id for task_id in order if task_id not in expected
    ]
    woken = production.readmit(slot, DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}production-task"]


# -- the keys ------------------------------------------------------------------------------


def redis_handles(production: SlotStore, staging: SlotStore) -> tuple[RedisStore, RedisStore]:
    if not isinstance(production, RedisStore) or not isinstance(staging, RedisStore):
        pytest.skip("the Redis store's keys")
    return production, staging


def test_a_deployments_entries_keep_their_deployment_and_their_own_lists_until_they_leave(
    production: SlotStore, staging: SlotStore, unnamed: SlotStore, prefix: str
) -> None:
    production, staging = redis_handles(production, staging)
    client = production.client
    slot, other = f"{prefix}a", f"{prefix}b"
    deployments = f"{production.key_prefix}:deployments".encode()

    def deployment_lists(deployment: str) -> list[int]:
        return [client.zcard(production.waiters_key(name) + b":" + deployment.encode()) for name in (slot, other)]

    # Given: a slot held by staging; a production task waits for it and another slot, a
    # staging task and a task without a deployment for it alone
    running = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1, other: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    assert park(unnamed, {slot: 1}, f"{prefix}unnamed-task", 3.0) == ParkOutcome.PARKED
    # Then: each named deployment's entry records its deployment and is in its own lists too;
    # every entry is in each slot's list of every deployment
    assert client.hgetall(deployments) == {
        f"{prefix}production-task".encode(): b"production",
        f"{prefix}staging-task".encode(): b"staging",
    }
    assert deployment_lists("production") == [1, 1]
    assert deployment_lists("staging") == [1, 0]
    assert client.zcard(production.waiters_key(slot)) == 3
    # When: staging's waiter is dispatched and claims its slot, and production's is forgotten
    _, [woken] = staging.release_and_wake(running, DISPATCH_LEASE)
    assert staging.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) == ClaimOutcome.RUN
    assert staging.forget(f"{prefix}production-task", DISPATCH_LEASE)[0] == 1
    # Then: nothing of their deployments is left
    assert client.exists(deployments) == 0
    assert deployment_lists("production") == deployment_lists("staging") == [0, 0]
    assert listed(production, slot) == [(f"{prefix}unnamed-task", False)]


# -- what a hand-over reads ---------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize("step", ["release", "recovery", "forget"])
def test_a_hand_over_reads_nothing_of_another_deployments_list_in_the_same_slot(tmp_path: Path, step: str) -> None:
    # On a Redis of this test's own, whose command counts (INFO commandstats, the scripts'
    # own commands included) no other client adds to.
    with redis_server(tmp_path / "redis") as port:
        url, key_prefix = f"redis://127.0.0.1:{port}/0", new_prefix()
        production, staging = RedisStore(url, key_prefix=key_prefix), RedisStore(url, key_prefix=key_prefix)
        production.deployment, staging.deployment = "production", "staging"
        client = redis.Redis(port=port)
        try:
            production.warm_up()
            # Given: two slots, each held by a production run (or a dispatch, for forget) and
            # awaited by one production task; in the crowded one, staging's tasks wait ahead of it
            crowded, quiet = "crowded", "quiet"
            runs = {slot: admit(production, {slot: 1}, f"{slot}-run") for slot in (crowded, quiet)}
            for number in range(CROWD):
                outcome = park(staging, {crowded: 1}, f"staging-{number}", 1.0 + number, max_waiters=2 * CROWD)
                assert outcome == ParkOutcome.PARKED
            for slot in (crowded, quiet):
                if step == "forget":
                    outcome = park(production, {slot: 1}, f"{slot}-dispatched", 0.5, max_waiters=2 * CROWD)
                    assert outcome == ParkOutcome.PARKED
                    _, [dispatched] = production.release_and_wake(runs[slot], DISPATCH_LEASE)
                    assert dispatched.task_id == f"{slot}-dispatched"
                outcome = park(production, {slot: 1}, f"{slot}-waiter", 1000.0, max_waiters=2 * CROWD)
                assert outcome == ParkOutcome.PARKED
                if step == "recovery":
                    assert production.release(runs[slot]) == 1

            def hand_over(slot: str) -> dict[str, int]:
                client.config_resetstat()
                if step == "release":
                    _, woken = production.release_and_wake(runs[slot], DISPATCH_LEASE)
                elif step == "forget":
                    _, woken = production.forget(f"{slot}-dispatched", DISPATCH_LEASE)
                else:
                    woken = production.recover(DISPATCH_LEASE, caps=[slot])
                assert [w.task_id for w in woken] == [f"{slot}-waiter"]
                stats = client.info("commandstats")
                return {name: stat["calls"] for name, stat in stats.items() if "config" not in name}

            # When: each slot is handed over to production's waiter
            # Then: the crowded slot's hand-over sends the very commands the quiet one's does
            assert hand_over(crowded) == hand_over(quiet)
        finally:
            production.close()
            staging.close()
            client.close()
