"""Slot names match exactly, case included, on every store of the table: a prune of a cap's keys
and a recovery scoped to a cap reach that cap's slots and nothing else, whatever other caps are
called (``tenant`` and ``Tenant``) and whatever characters a name holds (a SQL pattern's ``%``,
``_`` or ``/``, a GLOB's ``*``, ``?`` or ``[``)."""

from __future__ import annotations

import uuid

import pytest

from celery_caps.stores.base import ParkingStore, ParkOutcome, ParkRequest, SlotStore
from tests.services import own_status

LONG = 120.0
HOLDER = "w1@host-a/1"


def idle_key(store: SlotStore, slot: str) -> None:
    """Leave ``slot`` with a sentinel and no lease: taken, then given back."""
    run_id = uuid.uuid4().hex
    assert store.acquire({slot: 1}, f"task-of-{slot}", run_id, HOLDER, LONG).granted
    assert store.release(run_id) == 1


def parking(store: SlotStore) -> ParkingStore:
    if not isinstance(store, ParkingStore):
        pytest.skip(f"{type(store).__name__} has no waiting list")
    return store


def test_prune_of_a_cap_never_reaches_the_keys_of_a_cap_named_in_another_case(store: SlotStore, prefix: str) -> None:
    # Given idle keys of two caps whose names differ only in case
    lower, upper = f"{prefix}tenant", f"{prefix}Tenant"
    for slot in (f"{lower}:acme", f"{upper}:acme", f"{upper}:globex", f"{prefix}TENANT:x"):
        idle_key(store, slot)

    # When the keys of "tenant" are pruned, first as a dry run
    assert store.prune(f"{lower}:", dry_run=True) == [f"{lower}:acme"]
    assert store.prune(f"{lower}:") == [f"{lower}:acme"]

    # Then those of "Tenant" and "TENANT" are all still there
    assert set(own_status(store, prefix)) == {f"{upper}:acme", f"{upper}:globex", f"{prefix}TENANT:x"}
    assert store.prune(f"{upper}:") == [f"{upper}:acme", f"{upper}:globex"]


# Cap names holding characters that a LIKE or a GLOB pattern reads as wildcards, or as their
# escape character, each beside a cap those would match if read so.
WILDCARD_CAPS = [
    ("ten_nt", "tenant"),
    ("te%", "tenant"),
    ("te/%", "te/xy"),
    ("ten*", "tenant"),
    ("t?nant", "tenant"),
    ("[t]enant", "tenant"),
    ("[a-z]x", "bx"),
    ("a]b", "a]b]"),
]


@pytest.mark.parametrize(("cap", "other"), WILDCARD_CAPS, ids=[cap for cap, _ in WILDCARD_CAPS])
def test_prune_reads_every_character_of_the_cap_as_itself(store: SlotStore, prefix: str, cap: str, other: str) -> None:
    mine, theirs = f"{prefix}{cap}", f"{prefix}{other}"
    idle_key(store, f"{mine}:k")
    idle_key(store, f"{theirs}:k")

    assert store.prune(f"{mine}:") == [f"{mine}:k"]

    assert set(own_status(store, prefix)) == {f"{theirs}:k"}


def park_behind_a_holder(store: ParkingStore, slot: str, task_id: str) -> None:
    """Park ``task_id`` for ``slot`` (limit 1) behind a holder, then free the slot without waking
    anyone (a plain release): the waiter has room, and only a recovery dispatches it."""
    holder_run = uuid.uuid4().hex
    assert store.acquire({slot: 1}, f"holder-of-{task_id}", holder_run, HOLDER, LONG).granted
    request = ParkRequest({slot: 1}, task_id, uuid.uuid4().hex, HOLDER, LONG, 1.0, 10, "job", b"payload")
    assert store.park(request) == ParkOutcome.PARKED
    assert store.release(holder_run) == 1


def test_recovery_of_a_cap_reaches_only_its_own_waiters_case_included(store: SlotStore, prefix: str) -> None:
    parking_store = parking(store)
    lower, upper = f"{prefix}tenant", f"{prefix}Tenant"
    # Given a waiter with room in each of "tenant:acme", "Tenant:acme" and (unkeyed) "Tenant"
    park_behind_a_holder(parking_store, f"{lower}:acme", f"{prefix}lower")
    park_behind_a_holder(parking_store, f"{upper}:acme", f"{prefix}upper")
    park_behind_a_holder(parking_store, upper, f"{prefix}upper-unkeyed")

    # When a worker that knows cap "tenant" only recovers
    woken = parking_store.recover(LONG, caps=[lower])

    # Then it dispatches the waiter of "tenant:acme" alone
    assert [w.task_id for w in woken] == [f"{prefix}lower"]
    assert [(w.task_id, w.dispatched) for w in parking_store.waiters(f"{upper}:acme")] == [(f"{prefix}upper", False)]
    assert [(w.task_id, w.dispatched) for w in parking_store.waiters(upper)] == [(f"{prefix}upper-unkeyed", False)]
    # ... and the one that knows "Tenant" gets both of its own
    assert sorted(w.task_id for w in parking_store.recover(LONG, caps=[upper])) == [
        f"{prefix}upper",
        f"{prefix}upper-unkeyed",
    ]


def test_recovery_of_a_slot_name_reaches_that_slot_alone(store: SlotStore, prefix: str) -> None:
    parking_store = parking(store)
    acme = f"{prefix}tenant:acme"
    # Given a waiter with room in "tenant:acme" and in the longer keys "tenant:acme:eu", "tenant:acme:us"
    park_behind_a_holder(parking_store, acme, f"{prefix}acme")
    park_behind_a_holder(parking_store, f"{acme}:eu", f"{prefix}acme-eu")
    park_behind_a_holder(parking_store, f"{acme}:us", f"{prefix}acme-us")

    # When an operator recovers the slot "tenant:acme" (celery caps redispatch tenant:acme)
    woken = parking_store.recover(LONG, caps=[acme])

    # Then its waiter alone is dispatched
    assert [w.task_id for w in woken] == [f"{prefix}acme"]
    for key in ("eu", "us"):
        assert [(w.task_id, w.dispatched) for w in parking_store.waiters(f"{acme}:{key}")] == [
            (f"{prefix}acme-{key}", False)
        ]
    # ... and the cap reaches every key of it
    assert sorted(w.task_id for w in parking_store.recover(LONG, caps=[f"{prefix}tenant"])) == [
        f"{prefix}acme-eu",
        f"{prefix}acme-us",
    ]
