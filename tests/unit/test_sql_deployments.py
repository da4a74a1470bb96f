"""Deployments sharing one SQL store: every path of a hand-over, and what it reads.

``tests/unit/test_store_deployments.py`` holds the contract's cases.  These cover the other
paths a hand-over takes in the SQL stores (the PostgreSQL functions' walk, the portable walk,
recovery's expired dispatches and readmits, waiters of several slots, each kind of release),
with the memory store as the reference; and, on each SQL database, that a hand-over costs the
same whether or not another deployment has a long list in the same slot: it never reads the
other deployment's waiters.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from celery_caps import settings
from celery_caps.stores.base import ParkOutcome, SlotStore, Woken
from celery_caps.stores.sql import SQLStore
from celery_caps.stores.sql.postgresql import PostgreSQLStore
from celery_caps.stores.sql.schema import MAX_DEPLOYMENT_LENGTH
from tests.services import REDIS_KINDS, StoreTarget
from tests.unit.test_stores import (
    DISPATCH_LEASE,
    HOLDER,
    SHORT_LEASE,
    admit,
    lapse,
    listed,
    park,
    parking_store,
    wait_until_expired,
)

#: Waiters another deployment keeps ahead in a slot, for the cost tests.
CROWD = 150
#: Rows (on SQLite, tens of VM steps) a hand-over may read beyond the same hand-over in a slot
#: without the other deployment's list: a few, where reading the list would cost a few per waiter.
SLACK = 40


@pytest.fixture
def production(store: SlotStore, store_target: StoreTarget) -> SlotStore:
    if store_target.kind.id in REDIS_KINDS:
        pytest.skip("the SQL stores' paths (the memory store as the reference)")
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
    assert listed(production, second) == [(f"{prefix}production-task", False)]


@pytest.mark.parametrize("scoped", [False, True], ids=["every-cap", "its-caps"])
def test_a_recovery_walk_passes_over_an_older_waiter_of_another_deployment(
    production: SlotStore, staging: SlotStore, prefix: str, scoped: bool
) -> None:
    # Given: the holder of a slot died (its lease expired) while a production task and, after
    # it, a staging task wait for the slot
    slot = f"{prefix}quota"
    holder = admit(staging, {slot: 1}, f"{prefix}staging-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 2.0) == ParkOutcome.PARKED
    lapse(staging, [holder])
    # When: staging's workers recover
    woken = staging.recover(DISPATCH_LEASE, caps=[slot] if scoped else None)
    # Then: they hand the slot to staging's waiter, passing production's over
    assert [w.task_id for w in woken] == [f"{prefix}staging-task"]
    assert listed(production, slot) == [(f"{prefix}production-task", False), (f"{prefix}staging-task", True)]


def test_a_recovery_returns_only_its_own_deployments_expired_dispatches(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    # Given: production's release dispatched its waiter, whose copy never claimed the slot
    slot = f"{prefix}quota"
    running = admit(production, {slot: 1}, f"{prefix}production-run")
    assert park(production, {slot: 1}, f"{prefix}production-task", 1.0) == ParkOutcome.PARKED
    _, [dispatch] = production.release_and_wake(running, SHORT_LEASE)
    wait_until_expired(production, [dispatch.run_id])
    # When: staging's workers recover, then production's
    # Then: staging leaves the dispatch as it is; production puts it back and dispatches it again
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


def test_deployment_names_match_exactly_at_their_longest(
    production: SlotStore, staging: SlotStore, prefix: str
) -> None:
    # Given: deployment names that a case-folding, space-padding collation would merge, and one
    # as long as caps_deployment allows, outside ASCII
    assert MAX_DEPLOYMENT_LENGTH >= settings.MAX_DEPLOYMENT_LENGTH
    production.deployment, staging.deployment = "Staging", "staging "
    slot = f"{prefix}quota"
    running = admit(production, {slot: 1}, f"{prefix}production-run")
    assert park(staging, {slot: 1}, f"{prefix}staging-task", 1.0) == ParkOutcome.PARKED
    # When: "Staging" releases; Then: it leaves the waiter of "staging " where it is
    assert production.release_and_wake(running, DISPATCH_LEASE) == (1, [])
    assert production.readmit(slot, DISPATCH_LEASE) == []
    staging.deployment = "é" * settings.MAX_DEPLOYMENT_LENGTH
    running = admit(staging, {f"{slot}-long": 1}, f"{prefix}staging-run")
    assert park(staging, {f"{slot}-long": 1}, f"{prefix}long-task", 1.0) == ParkOutcome.PARKED
    _, woken = staging.release_and_wake(running, DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}long-task"]


# -- what a hand-over reads ---------------------------------------------------------------


@contextlib.contextmanager
def counted_reads(store: SlotStore) -> Iterator[Callable[[], int]]:
    """Within the block, the store's calls on this thread count what they read: rows of
    ``concurrency_waiters`` and its indexes (PostgreSQL: in a transaction rolled back at the
    end, the functions' hot path included), rows read through the handler (MySQL), tens of VM
    steps (SQLite).  Yields a function returning the count so far."""
    assert isinstance(store, SQLStore)
    if isinstance(store, PostgreSQLStore):
        read = (
            "SELECT coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0) "
            "+ pg_stat_get_xact_tuples_returned('concurrency_waiters'::regclass) "
            "FROM pg_index i WHERE i.indrelid = 'concurrency_waiters'::regclass"
        )
        with store.pool.rehearsal():  # one connection for this thread's calls, rolled back
            start = int(store.pool.execute(read, {})[0][0][0])
            yield lambda: int(store.pool.execute(read, {})[0][0][0]) - start
        return
    engine = store.engine
    engine.dispose()  # one connection from here on (one thread), seen by the counter
    if store.dialect.name == "sqlite":
        steps = [0]

        def count(dbapi_connection: object, _record: object) -> None:
            def step() -> int:
                steps[0] += 1
                return 0

            dbapi_connection.set_progress_handler(step, 10)  # type: ignore[attr-defined]

        sa.event.listen(engine, "connect", count)
        try:
            yield lambda: steps[0]
        finally:
            sa.event.remove(engine, "connect", count)
            engine.dispose()
        return

    def handler_reads() -> int:
        with engine.connect() as connection:
            rows = connection.exec_driver_sql("SHOW SESSION STATUS LIKE 'Handler_read%%'").all()
        assert engine.pool.checkedin() == 1  # type: ignore[attr-defined]
        return sum(int(value) for _name, value in rows)

    start = handler_reads()
    yield lambda: handler_reads() - start


@pytest.mark.parametrize("step", ["release", "recovery"])
def test_a_hand_over_reads_nothing_of_another_deployments_list_in_the_same_slot(
    production: SlotStore, staging: SlotStore, store_target: StoreTarget, prefix: str, step: str
) -> None:
    if store_target.kind.id not in ("sqlite", "postgres", "mysql"):
        pytest.skip("a count of what the SQL databases read")
    if step == "recovery" and isinstance(production, PostgreSQLStore):
        pytest.skip("recovery's transactions commit (their counts are not the session's): its walk is the release's")
    # Given: two slots, each held by a production run and awaited by one production task; in
    # the crowded one, staging's tasks wait ahead of it.  (For recovery, the runs are gone
    # without handing over: their slots have room that only a recovery hands over.)
    crowded, quiet = f"{prefix}crowded", f"{prefix}quiet"
    runs = {slot: admit(production, {slot: 1}, f"{slot}-run") for slot in (crowded, quiet)}
    for number in range(CROWD):
        outcome = park(staging, {crowded: 1}, f"{prefix}staging-{number}", 1.0 + number, max_waiters=2 * CROWD)
        assert outcome == ParkOutcome.PARKED
    for slot in (crowded, quiet):
        assert park(production, {slot: 1}, f"{slot}-waiter", 1000.0, max_waiters=2 * CROWD) == ParkOutcome.PARKED
        if step == "recovery":
            assert production.release(runs[slot]) == 1

    def hand_over(slot: str) -> int:
        with counted_reads(production) as reads:
            if step == "release":
                _, woken = production.release_and_wake(runs[slot], DISPATCH_LEASE)
            else:
                woken = production.recover(DISPATCH_LEASE, caps=[slot])
            assert [w.task_id for w in woken] == [f"{slot}-waiter"]
            return reads()

    # When: each slot is handed over to production's waiter
    # Then: the crowded slot's hand-over reads about what the quiet one's does, however long
    # staging's list
    quiet_reads, crowded_reads = hand_over(quiet), hand_over(crowded)
    assert crowded_reads <= quiet_reads + SLACK, (crowded_reads, quiet_reads)
