"""A SQL store keeps no parked message once its entry is done: the tombstone a claim or a forget
leaves (for an hour) holds none of the task's arguments, read from the table itself.

On every SQL store of the table; on PostgreSQL twice: through the store's functions
(``postgresql.sql``: a claim settles in ``concurrency_waiters_settle``) and through the portable
statements (``statements.py``) that a store without its functions runs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_caps.stores.base import ClaimOutcome, ParkOutcome, ParkRequest, Woken
from celery_caps.stores.sql import SQLStore
from celery_caps.stores.sql.postgresql import PostgreSQLStore
from celery_caps.stores.sql.schema import concurrency_waiters
from tests.services import STORE_KINDS, StoreTarget, delete_own_rows, new_prefix, store_url_for

LONG = 120.0
SHORT = 0.3
HOLDER = "w1@host-a/1"

#: The SQL rows of the store table, and PostgreSQL's again through the portable statements.
SQL_ROWS = [
    pytest.param((kind, portable), id=kind.id + ("-portable" if portable else ""), marks=getattr(pytest.mark, kind.id))
    for kind in STORE_KINDS
    if kind.id in ("sqlite", "postgres", "pgbouncer", "mysql")
    for portable in ((False, True) if kind.id == "postgres" else (False,))
]


@pytest.fixture(params=SQL_ROWS)
def sql_store(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Iterator[SQLStore]:
    kind, portable = request.param
    target = StoreTarget(kind, store_url_for(kind, tmp_path), key_prefix=new_prefix())
    store = SQLStore(target.url) if portable else target.open()
    assert isinstance(store, SQLStore)
    try:
        yield store
    finally:
        try:
            delete_own_rows(target, store, prefix)
        finally:
            store.close()


def rows_of(store: SQLStore, task_id: str) -> list[tuple[bytes, float | None]]:
    """Every row of ``task_id`` in the waiting list's table: its payload and ``done_until``."""
    table = concurrency_waiters
    query = sa.select(table.c.payload, table.c.done_until).where(table.c.task_id == store.dialect.exact(task_id))
    with store.engine.connect() as connection:
        return [(bytes(payload), done_until) for payload, done_until in connection.execute(query)]


def park_and_dispatch(store: SQLStore, prefix: str, task_id: str, payload: bytes, dispatch_lease: float) -> Woken:
    """Park ``task_id`` (with ``payload``) behind a holder of its slot, then release the holder:
    the entry is dispatched with leases of ``dispatch_lease`` seconds."""
    slot = f"{prefix}tenant:acme"
    holder_run = uuid.uuid4().hex
    assert store.acquire({slot: 1}, f"{prefix}holder", holder_run, HOLDER, LONG).granted
    request = ParkRequest({slot: 1}, task_id, uuid.uuid4().hex, HOLDER, LONG, 1.0, 10, "job", payload)
    assert store.park(request) == ParkOutcome.PARKED
    assert rows_of(store, task_id) == [(payload, None)]
    _, [woken] = store.release_and_wake(holder_run, dispatch_lease)
    assert (woken.task_id, woken.payload) == (task_id, payload)
    return woken


def wait_dispatch_expired(store: SQLStore, woken: Woken) -> None:
    deadline = time.monotonic() + 10
    while any(lease.expires_in > 0 for lease in store.leases() if lease.run_id == woken.run_id):
        assert time.monotonic() < deadline, "the dispatch lease did not expire"
        time.sleep(0.05)


def assert_tombstone_without_payload(store: SQLStore, task_id: str, payload: bytes) -> None:
    rows = rows_of(store, task_id)
    assert rows and all(done_until is not None for _, done_until in rows), rows  # a tombstone is left
    assert [kept for kept, _ in rows if payload in kept] == []
    if isinstance(store, PostgreSQLStore):
        assert store.functions  # the claim ran in the store's functions
    assert store.waiters(f"{task_id}") == []


def test_a_claim_after_the_dispatch_expired_leaves_a_tombstone_without_the_payload(
    sql_store: SQLStore, prefix: str
) -> None:
    task_id, payload = f"{prefix}task", f"{prefix} arguments: password=hunter2".encode()
    # Given a dispatched entry whose dispatch leases expired before its copy arrived
    woken = park_and_dispatch(sql_store, prefix, task_id, payload, SHORT)
    wait_dispatch_expired(sql_store, woken)

    # When its copy claims: admitted, with a tombstone to turn away a duplicate copy
    assert sql_store.claim(task_id, woken.run_id, HOLDER, LONG) == ClaimOutcome.ADMIT

    # Then the tombstone keeps none of the message
    assert_tombstone_without_payload(sql_store, task_id, payload)


def test_a_claim_of_a_second_dispatch_leaves_a_tombstone_without_the_payload(sql_store: SQLStore, prefix: str) -> None:
    task_id, payload = f"{prefix}task", f"{prefix} arguments: token=abc123".encode()
    # Given an entry dispatched twice: its first dispatch expired, recovery dispatched it again
    first = park_and_dispatch(sql_store, prefix, task_id, payload, SHORT)
    wait_dispatch_expired(sql_store, first)
    [second] = sql_store.recover(LONG, caps=[f"{prefix}tenant"])
    assert second.task_id == task_id and second.run_id != first.run_id

    # When the second dispatch's copy claims and runs (a copy of the first may still come)
    assert sql_store.claim(task_id, second.run_id, HOLDER, LONG) == ClaimOutcome.RUN

    # Then the tombstone keeps none of the message
    assert_tombstone_without_payload(sql_store, task_id, payload)


def test_forgetting_a_dispatched_entry_leaves_a_tombstone_without_the_payload(sql_store: SQLStore, prefix: str) -> None:
    task_id, payload = f"{prefix}task", f"{prefix} arguments: api_key=s3cret".encode()
    # Given a dispatched entry (its copy on the way)
    park_and_dispatch(sql_store, prefix, task_id, payload, LONG)

    # When it is forgotten (revoked)
    assert sql_store.forget(task_id, LONG) == (1, [])

    # Then the tombstone that turns its copy away keeps none of the message
    assert_tombstone_without_payload(sql_store, task_id, payload)
