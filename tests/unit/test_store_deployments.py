"""Two deployments sharing one store, on every store of the table.

Staging and production (or two services sharing a quota) use one caps store and one cap name,
each with its own broker.  The cap counts both deployments' tasks (the quota is shared), but a
waiting task is only ever handed its slot by its own deployment, whose broker its copy is
published to: a release or a recovery of the other deployment passes it over.  Each store
handle is its deployment's (``SlotStore.deployment``, set from ``caps_deployment``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest

from celery_caps.stores.base import ParkOutcome, SlotStore
from tests.services import StoreTarget
from tests.unit.test_stores import (
    DISPATCH_LEASE,
    admit,
    lapse,
    listed,
    park,
    parking_store,
)


@pytest.fixture
def production(store: SlotStore) -> SlotStore:
    store = parking_store(store)
    store.deployment = "production"
    return store


@pytest.fixture
def staging(production: SlotStore, store_target: StoreTarget) -> Iterator[SlotStore]:
    """Another handle on the same store, of the staging deployment."""
    if store_target.kind.id == "memory":
        other = copy.copy(production)  # the same rows (one process's memory), another deployment
        other.deployment = "staging"
        yield other
        return
    other = store_target.open()
    other.deployment = "staging"
    try:
        yield other
    finally:
        other.close()


def test_a_release_hands_a_slot_only_to_a_waiter_of_its_own_deployment(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    # Given: staging holds the shared cap (limit 1); a production task waits first, a staging
    # task after it
    slot = f"{prefix}quota"
    running = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    # When: staging's run ends
    _, woken = staging.release_and_wake(running, DISPATCH_LEASE)
    # Then: its release hands the slot to staging's own waiter (whose copy goes to staging's
    # broker); production's waiter keeps its place, passed over, not dispatched
    assert [w.task_id for w in woken] == [f"{prefix}staging-task"]
    assert listed(production, slot) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]


def test_recovery_serves_only_its_own_deployments_waiters(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    # Given: a production task waits for a slot whose holder's lease expired
    slot = f"{prefix}quota"
    holder = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    lapse(staging, [holder])
    # When: staging's workers recover, scoped to the cap both deployments declare
    # Then: they leave production's waiter alone; production's recovery hands it the slot
    assert staging.recover(DISPATCH_LEASE, caps=[slot]) == []
    assert staging.recover(DISPATCH_LEASE) == []
    [woken] = production.recover(DISPATCH_LEASE, caps=[slot])
    assert woken.task_id == f"{prefix}production-task"


def test_an_operators_drain_takes_only_its_own_deployments_waiters(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    slot = f"{prefix}quota"
    admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    assert [w.task_id for w in staging.readmit(slot, DISPATCH_LEASE)] == [f"{prefix}staging-task"]
    assert listed(production, slot) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]


def test_the_shared_cap_counts_both_deployments(production: SlotStore, staging: SlotStore, prefix: str) -> None:
    slot = f"{prefix}quota"
    admit(production, {slot: 2}, f"{prefix}production-run")
    admit(staging, {slot: 2}, f"{prefix}staging-run")
    assert park(production, {slot: 2}, f"{prefix}third", 1.0) == ParkOutcome.PARKED


@pytest.mark.parametrize(
    "service", [pytest.param("postgres", marks=pytest.mark.postgres), pytest.param("mysql", marks=pytest.mark.mysql)]
)
def test_deployments_that_keep_apart_use_a_schema_or_a_database_of_their_own(service: str) -> None:
    # Staging and production with their own PostgreSQL schema (search_path in caps_url) or MySQL
    # database, on one server: nothing of one is seen by the other, the PostgreSQL functions
    # included (created in each schema).
    from celery_caps.stores import store_from_url
    from tests.services import private_sql_url

    with private_sql_url(service) as staging_url, private_sql_url(service) as production_url:
        staging, production = store_from_url(staging_url), store_from_url(production_url)
        try:
            admit(staging, {"quota": 1}, "staging-task")
            admit(production, {"quota": 1}, "production-task")  # the same cap name, full in staging
            assert [lease.task_id for lease in staging.leases()] == ["staging-task"]
            assert [lease.task_id for lease in production.leases()] == ["production-task"]
            assert park(production, {"quota": 1}, "production-waiter", 1.0) == ParkOutcome.PARKED
            assert staging.waiters() == []
        finally:
            staging.close()
            production.close()
