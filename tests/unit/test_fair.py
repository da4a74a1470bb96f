"""Fair shares between keys (``Cap(name, limit, fair_by=...)``), on every store of the table.

Each entry of a slot's waiting list has a round there: a new entry of fair key ``k`` gets the
list's first round, or the round after ``k``'s last entry in the list if that is later.  The
list is served by round, then first come: keys waiting together take turns, one place a round
each, however many entries each has queued.  A slot without fair keys keeps every entry in
round 0: first come, first served, as before.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import pytest

from celery_caps.errors import StoreInputError
from celery_caps.metrics import FleetCollector
from celery_caps.stores.base import ParkOutcome, ParkRequest, SlotStore
from tests.unit.test_store_changes import claim_all
from tests.unit.test_stores import DISPATCH_LEASE, HOLDER, LONG_LEASE, admit, parking_store


def park_fair(
    store: SlotStore, slots: Mapping[str, int], task_id: str, first: float, fair_keys: Mapping[str, str]
) -> ParkOutcome:
    return store.park(ParkRequest(
        slots, task_id, uuid.uuid4().hex, HOLDER, LONG_LEASE, first_deferred_at=first, max_waiters=100,
        task_name="t.fair", payload=f"payload of {task_id}".encode(), fair_keys=fair_keys,
    ))  # fmt: skip


def queue(store: SlotStore, slot: str, prefix: str, arrivals: list[str], first: float = 1.0) -> None:
    """Park one task per arrival (its fair key), first deferred in that order."""
    for number, key in enumerate(arrivals):
        task_id = f"{prefix}{key}{number}"
        assert park_fair(store, {slot: 1}, task_id, first + number, {slot: key}) == ParkOutcome.PARKED


def served(store: SlotStore, slot: str, run_id: str, prefix: str, count: int) -> list[str]:
    """Hand the slot over ``count`` times from run ``run_id``: the fair keys served, in order."""
    keys = []
    for _ in range(count):
        _, woken = store.release_and_wake(run_id, DISPATCH_LEASE)
        assert len(woken) == 1, f"one release of a slot of limit 1 dispatched {[w.task_id for w in woken]}"
        [run_id] = claim_all(store, woken)
        keys.append(woken[0].task_id.removeprefix(prefix).rstrip("0123456789"))
    return keys


def test_keys_waiting_together_are_served_in_turn(store: SlotStore, prefix: str) -> None:
    # Given: a slot of limit 1 runs; tenant a queues five tasks, then b two and c one
    store = parking_store(store)
    slot = f"{prefix}provider"
    running = admit(store, {slot: 1}, f"{prefix}running")
    queue(store, slot, prefix, ["a"] * 5 + ["b"] * 2 + ["c"])
    # Then: the list shows each entry's key and round, in the order they will be served
    listed = [(w.fair_key, w.fair_round, w.position) for w in store.waiters(slot)]
    assert [(key, position) for key, _, position in listed] == [
        ("a", 1), ("b", 2), ("c", 3), ("a", 4), ("b", 5), ("a", 6), ("a", 7), ("a", 8)
    ]  # fmt: skip
    rounds = [fair_round for _, fair_round, _ in listed]
    assert rounds == sorted(rounds) and rounds[0] == rounds[2] and rounds[3] == rounds[4] == rounds[0] + 1
    # And the hand-overs go round-robin across the keys that wait: a, b, c, a, b, a, a, a
    assert served(store, slot, running, prefix, 8) == ["a", "b", "c", "a", "b", "a", "a", "a"]


def test_a_key_that_arrives_later_joins_the_round_being_served(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}provider"
    running = admit(store, {slot: 1}, f"{prefix}running")
    queue(store, slot, prefix, ["a"] * 4 + ["b"] * 2)
    # When: a, b are served (the first round is over), then d arrives
    _, woken = store.release_and_wake(running, DISPATCH_LEASE)
    [run_id] = claim_all(store, woken)
    _, woken = store.release_and_wake(run_id, DISPATCH_LEASE)
    [run_id] = claim_all(store, woken)
    assert park_fair(store, {slot: 1}, f"{prefix}d0", 100.0, {slot: "d"}) == ParkOutcome.PARKED
    # Then: d takes its turn in the round now served, after those who came before it in that
    # round, and before a's later entries: it does not wait behind a's backlog
    assert [w.fair_key for w in store.waiters(slot)] == ["a", "b", "d", "a", "a"]
    assert served(store, slot, run_id, prefix, 5) == ["a", "b", "d", "a", "a"]


def test_a_slot_without_fair_keys_is_first_come_first_served(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}provider"
    running = admit(store, {slot: 1}, f"{prefix}running")
    for number, first in enumerate([3.0, 1.0, 2.0]):
        assert park_fair(store, {slot: 1}, f"{prefix}t{number}", first, {}) == ParkOutcome.PARKED
    waiters = store.waiters(slot)
    assert [(w.task_id, w.fair_key, w.fair_round) for w in waiters] == [
        (f"{prefix}t1", None, 0), (f"{prefix}t2", None, 0), (f"{prefix}t0", None, 0)
    ]  # fmt: skip
    _, woken = store.release_and_wake(running, DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}t1"]


def test_rounds_are_per_slot(store: SlotStore, prefix: str) -> None:
    # A task waiting for two fair caps has a round in each, counted in each list alone
    store = parking_store(store)
    provider, region = f"{prefix}provider", f"{prefix}region"
    limits = {provider: 1, region: 1}
    admit(store, {provider: 1}, f"{prefix}running-p")
    admit(store, {region: 1}, f"{prefix}running-r")
    for number in range(3):
        assert park_fair(store, {provider: 1}, f"{prefix}a{number}", 1.0 + number, {provider: "a"}) == (
            ParkOutcome.PARKED
        )
    assert park_fair(store, limits, f"{prefix}both", 10.0, {provider: "b", region: "b"}) == ParkOutcome.PARKED
    assert [(w.task_id, w.fair_round) for w in store.waiters(region)] == [(f"{prefix}both", 0)]
    assert [w.task_id for w in store.waiters(provider)] == [
        f"{prefix}a0",
        f"{prefix}both",
        f"{prefix}a1",
        f"{prefix}a2",
    ]


def test_a_deploy_that_removes_fair_by_puts_the_new_tasks_after_those_waiting(store: SlotStore, prefix: str) -> None:
    # Given: a fair cap's list: a's backlog in rounds 0-3, b in round 0
    store = parking_store(store)
    slot = f"{prefix}provider"
    running = admit(store, {slot: 1}, f"{prefix}running")
    queue(store, slot, prefix, ["a"] * 4 + ["b"])
    # When: a deploy removes fair_by and new tasks park without a fair key
    for number in range(2):
        assert park_fair(store, {slot: 1}, f"{prefix}x{number}", 100.0 + number, {}) == ParkOutcome.PARKED
    # Then: they wait after the tasks parked before (a task arriving without a key never goes ahead
    # of a backlog's later rounds, which would wait for as long as new tasks kept coming)
    assert served(store, slot, running, prefix, 7) == ["a", "b", "a", "a", "a", "x", "x"]


def test_a_deploy_that_adds_fair_by_serves_the_tasks_parked_before_first(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}provider"
    running = admit(store, {slot: 1}, f"{prefix}running")
    for number in range(2):
        assert park_fair(store, {slot: 1}, f"{prefix}old{number}", 1.0 + number, {}) == ParkOutcome.PARKED
    # When: a deploy adds fair_by and a flood of one key arrives
    queue(store, slot, prefix, ["a"] * 4 + ["b"], first=100.0)
    # Then: the tasks parked before it start first: the flood's rounds do not pass them
    assert served(store, slot, running, prefix, 2) == ["old", "old"]


@pytest.mark.parametrize(
    ("fair_keys", "expected"),
    [
        ({"elsewhere": "a"}, "fair_keys name slot 'elsewhere', which is not among the slots asked for"),
        ({"{slot}": ""}, "its fair key must be a non-empty string, got ''"),
        ({"{slot}": 7}, "its fair key must be a non-empty string, got 7"),
        ({"{slot}": "x" * 151}, "is longer than 150 characters"),
        ({"{slot}": "a\nb"}, "'a\\nb'"),
        (["a"], "fair_keys must map slot names to fair keys, got ['a']"),
    ],
    ids=["other slot", "empty", "not text", "too long", "control character", "not a map"],
)
def test_bad_fair_keys_are_refused_naming_the_value_and_nothing_is_stored(
    store: SlotStore, prefix: str, fair_keys: object, expected: str
) -> None:
    store = parking_store(store)
    slot = f"{prefix}provider"
    admit(store, {slot: 1}, f"{prefix}running")
    if isinstance(fair_keys, dict):
        fair_keys = {name.format(slot=slot): key for name, key in fair_keys.items()}
    with pytest.raises(StoreInputError) as raised:
        park_fair(store, {slot: 1}, f"{prefix}bad", 1.0, fair_keys)  # type: ignore[arg-type]
    assert expected in str(raised.value)
    assert store.waiters(slot) == [] and store.entry(f"{prefix}bad") is None


def test_the_metrics_count_the_fair_keys_waiting_per_cap(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}provider"
    admit(store, {slot: 1}, f"{prefix}running")
    queue(store, slot, prefix, ["a", "a", "b", "c"])
    collector = FleetCollector(lambda: store, key_warning_threshold=1000, caps=lambda: [slot])
    samples = {
        (sample.name, sample.labels.get("cap")): sample.value
        for family in collector.collect()
        for sample in family.samples
    }
    assert samples[("celery_caps_waiting_tasks", slot)] == 4
    assert samples[("celery_caps_fair_keys_waiting", slot)] == 3
