"""Weighted slots (``Cap(name, limit, weight=...)``), on every store of the table.

A task of weight ``w`` takes ``w`` units of its slot's limit: a slot admits while the units its
live holders take, plus the newcomer's, stay within the limit in force; each weight counts as at
most that limit (an operator's cut below a heavy task's weight leaves it room to run alone); a
task id counts once.  Against starvation: the oldest waiter of a slot that needs more room than
is free holds that room: no newcomer and no waiter behind it takes it until it has started.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

import pytest

from celery_caps.errors import StoreInputError
from celery_caps.stores.base import Admission, ClaimOutcome, ParkOutcome, ParkRequest, SlotStore
from tests.services import own_status
from tests.unit.test_store_changes import claim_all, live_holders
from tests.unit.test_stores import DISPATCH_LEASE, HOLDER, LONG_LEASE, parking_store


def new_run_id() -> str:
    return uuid.uuid4().hex


def weighed(
    store: SlotStore, slots: Mapping[str, int], weights: Mapping[str, int], task_id: str, run_id: str | None = None
) -> Admission:
    return store.acquire(slots, task_id, run_id or new_run_id(), HOLDER, LONG_LEASE, weights=weights)


def admit_weighed(store: SlotStore, slots: Mapping[str, int], weights: Mapping[str, int], task_id: str) -> str:
    run_id = new_run_id()
    admission = weighed(store, slots, weights, task_id, run_id)
    assert admission == Admission(True), f"{task_id} of weights {dict(weights)} was refused {dict(slots)}"
    return run_id


def park_weighed(
    store: SlotStore, slots: Mapping[str, int], weights: Mapping[str, int], task_id: str, first: float
) -> ParkOutcome:
    return store.park(ParkRequest(
        slots, task_id, new_run_id(), HOLDER, LONG_LEASE, first_deferred_at=first, max_waiters=100,
        task_name="t.weighed", payload=f"payload of {task_id}".encode(), weights=weights,
    ))  # fmt: skip


def test_a_slot_admits_while_the_weights_of_its_holders_fit_its_limit(store: SlotStore, prefix: str) -> None:
    gpu = f"{prefix}gpu"
    limit = {gpu: 5}
    heavy = admit_weighed(store, limit, {gpu: 3}, f"{prefix}heavy")
    # Three of five units taken: another 3 does not fit, a 2 does, and then not even a 1
    assert weighed(store, limit, {gpu: 3}, f"{prefix}second-heavy") == Admission(False, (gpu,))
    admit_weighed(store, limit, {gpu: 2}, f"{prefix}medium")
    assert weighed(store, limit, {}, f"{prefix}light") == Admission(False, (gpu,))
    status = own_status(store, prefix)[gpu]
    assert (status.holders, status.units) == (2, 5)
    assert sorted((lease.task_id, lease.weight) for lease in store.leases(gpu)) == [
        (f"{prefix}heavy", 3),
        (f"{prefix}medium", 2),
    ]
    # A task id counts once: another run of the heavy task id is admitted beside it
    admit_weighed(store, limit, {gpu: 3}, f"{prefix}heavy")
    # When the heavy run ends, its three units are free again
    store.release(heavy)
    store.release_task(f"{prefix}heavy")
    admit_weighed(store, limit, {gpu: 3}, f"{prefix}second-heavy")
    assert live_holders(store, gpu) == {f"{prefix}medium", f"{prefix}second-heavy"}


def test_unweighted_slots_count_tasks_as_before(store: SlotStore, prefix: str) -> None:
    slot = f"{prefix}provider"
    for number in range(3):
        admit_weighed(store, {slot: 3}, {}, f"{prefix}t{number}")
    assert weighed(store, {slot: 3}, {}, f"{prefix}late").granted is False
    status = own_status(store, prefix)[slot]
    assert status.holders == 3 and status.units in (None, 3)


def test_a_task_takes_its_weight_in_every_slot_all_or_nothing(store: SlotStore, prefix: str) -> None:
    gpu, tenant = f"{prefix}gpu", f"{prefix}tenant:acme"
    slots = {gpu: 10, tenant: 2}
    admit_weighed(store, {tenant: 2}, {}, f"{prefix}a")
    admit_weighed(store, {tenant: 2}, {}, f"{prefix}b")
    # The tenant is full: the GPU units are not taken either
    assert weighed(store, slots, {gpu: 4}, f"{prefix}job") == Admission(False, (tenant,))
    assert live_holders(store, gpu) == set()
    store.release_task(f"{prefix}a")
    admit_weighed(store, slots, {gpu: 4}, f"{prefix}job")
    assert {lease.slot: lease.weight for lease in store.leases() if lease.task_id == f"{prefix}job"} == {
        gpu: 4,
        tenant: 1,
    }


def test_an_operators_limit_below_a_weight_lets_that_task_run_alone(store: SlotStore, prefix: str) -> None:
    gpu = f"{prefix}gpu"
    store.set_limit(gpu, 2)
    # A weight of 6 under a limit cut to 2 counts as 2: it runs, alone
    admit_weighed(store, {gpu: 10}, {gpu: 6}, f"{prefix}big")
    assert weighed(store, {gpu: 10}, {}, f"{prefix}light").granted is False
    assert own_status(store, prefix)[gpu].units == 2


def test_the_oldest_waiter_that_needs_more_room_than_is_free_holds_it(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    gpu = f"{prefix}gpu"
    limit = {gpu: 4}
    light = [admit_weighed(store, limit, {}, f"{prefix}run{number}") for number in range(3)]
    # Given: three of four units run, a task of weight 3 waits, and light tasks keep coming
    assert park_weighed(store, limit, {gpu: 3}, f"{prefix}heavy", 1.0) == ParkOutcome.PARKED
    assert [(w.task_id, w.weight) for w in store.waiters(gpu)] == [(f"{prefix}heavy", 3)]
    # Then: the free unit is the heavy task's: a light newcomer neither takes it nor runs
    assert weighed(store, limit, {}, f"{prefix}newcomer") == Admission(False, (gpu,))
    assert park_weighed(store, limit, {}, f"{prefix}newcomer", 2.0) == ParkOutcome.PARKED
    # When: one run ends (two units free): nobody is dispatched, not the light one behind it
    _, woken = store.release_and_wake(light[0], DISPATCH_LEASE)
    assert woken == []
    # When: another ends: the heavy task is dispatched, and the slot is full again
    _, woken = store.release_and_wake(light[1], DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}heavy"]
    assert own_status(store, prefix)[gpu].units == 4
    claim_all(store, woken)
    # When: the last light run ends: the newcomer's turn
    _, woken = store.release_and_wake(light[2], DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}newcomer"]


def test_a_heavy_waiter_holds_its_room_in_each_slot_a_newcomer_asks_for(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    # Slots in order a, b: the heavy waiter waits in b, the second slot the newcomer asks for
    api, gpu = f"{prefix}a-api", f"{prefix}b-gpu"
    limits = {api: 4, gpu: 4}
    admit_weighed(store, {api: 4}, {}, f"{prefix}api-run")
    admit_weighed(store, {gpu: 4}, {gpu: 2}, f"{prefix}gpu-run")
    # Given: a task of weight 3 waits for the GPU (two units free)
    assert park_weighed(store, {gpu: 4}, {gpu: 3}, f"{prefix}heavy", 1.0) == ParkOutcome.PARKED
    # Then: a light newcomer of both slots does not take the GPU's free units (nor the API's)
    assert weighed(store, limits, {}, f"{prefix}newcomer") == Admission(False, (gpu,))
    units = {slot: own_status(store, prefix)[slot].used for slot in limits}
    assert (units[api], units[gpu]) == (1, 2), units


def test_a_waiter_that_fits_is_not_held_back_by_one_that_waits_for_another_slot(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    gpu, tenant = f"{prefix}gpu", f"{prefix}tenant:acme"
    holder = admit_weighed(store, {gpu: 4, tenant: 1}, {}, f"{prefix}holder")
    # Given: the oldest waiter needs the tenant (full) and one GPU unit, which is free
    assert park_weighed(store, {gpu: 4, tenant: 1}, {}, f"{prefix}tenant-waiter", 1.0) == ParkOutcome.PARKED
    # Then: it does not hold the GPU's free units: a newcomer of weight 3 takes them
    admit_weighed(store, {gpu: 4}, {gpu: 3}, f"{prefix}gpu-job")
    store.release_task(f"{prefix}gpu-job")
    _, woken = store.release_and_wake(holder, DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}tenant-waiter"]


def test_a_heavy_copy_dispatched_before_a_cut_waits_again(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    gpu = f"{prefix}gpu"
    limit = {gpu: 4}
    first = admit_weighed(store, limit, {gpu: 2}, f"{prefix}first")
    second = admit_weighed(store, limit, {}, f"{prefix}second")
    assert park_weighed(store, limit, {gpu: 3}, f"{prefix}heavy", 1.0) == ParkOutcome.PARKED
    # Given: the first run ends and the heavy task is dispatched (1 + 3 units of 4)
    _, [woken] = store.release_and_wake(first, DISPATCH_LEASE)
    # When: an operator cuts the GPU to 3 before its copy arrives (1 + 3 > 3)
    store.set_limit(gpu, 3)
    # Then: its claim gives the units up and it goes through admission: it waits again
    assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert live_holders(store, gpu) == {f"{prefix}second"}
    store.release(second)


@pytest.mark.parametrize(
    ("weights", "named"),
    [
        ({"SLOT": 0}, "0"),
        ({"SLOT": -2}, "-2"),
        ({"SLOT": True}, "True"),
        ({"SLOT": 2.5}, "2.5"),
        ({"SLOT": 6}, "6"),
        ({"OTHER": 2}, "OTHER"),
        ([("SLOT", 2)], "[("),
    ],
)
def test_bad_weights_are_refused_naming_the_value_and_nothing_is_taken(
    store: SlotStore, prefix: str, weights: object, named: str
) -> None:
    slot = f"{prefix}gpu"

    def named_for(value: object) -> object:
        if isinstance(value, dict):
            return {key.replace("SLOT", slot).replace("OTHER", f"{prefix}other"): w for key, w in value.items()}
        return [(key.replace("SLOT", slot), w) for key, w in value]  # type: ignore[attr-defined]

    with pytest.raises(StoreInputError, match="weight") as raised:
        store.acquire({slot: 5}, f"{prefix}t", new_run_id(), HOLDER, LONG_LEASE, weights=named_for(weights))  # type: ignore[arg-type]
    assert named.replace("OTHER", f"{prefix}other") in str(raised.value)
    assert store.leases(slot) == []


def test_a_dispatch_heavier_than_the_lease_its_task_holds_counts_the_difference(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    gpu, b, c = f"{prefix}gpu", f"{prefix}b", f"{prefix}c"
    # Given: b and c held by one task; t holds a GPU unit (weight 1) and x another (2 of 4)
    blocker = f"{prefix}blocker"
    admit_weighed(store, {b: 1, c: 1}, {}, blocker)
    admit_weighed(store, {gpu: 4}, {}, f"{prefix}t")
    admit_weighed(store, {gpu: 4}, {}, f"{prefix}x")
    # ... t waits for b at weight 3 on the GPU, and a light task waits for c and a GPU unit
    assert park_weighed(store, {gpu: 4, b: 1}, {gpu: 3}, f"{prefix}t", 1.0) == ParkOutcome.PARKED
    assert park_weighed(store, {gpu: 4, c: 1}, {}, f"{prefix}light", 2.0) == ParkOutcome.PARKED
    # When: b and c free in one release
    _, woken = store.release_task_and_wake(blocker, DISPATCH_LEASE)
    # Then: t's dispatch takes the GPU to 4 units (x 1, t 3: a task id counts once, at its
    # largest weight), and the light task, which would make it 5, is not dispatched
    assert [w.task_id for w in woken] == [f"{prefix}t"]
    assert own_status(store, prefix)[gpu].used == 4
