"""The waiting list through the changes a fleet lives through, on every store of the table.

A deploy changes a cap's limit while tasks wait for it; a stale copy of a task comes back
redelivered after another dispatch of it ran; a task id is reused by another task; a cap is
renamed in code while its waiters wait; a task's wake queue is no longer consumed; a task's
message is too large for the store.  Each test drives the store contract in the order a
real fleet produces, and checks what the user would see: how many hold a slot, who is
dispatched, which copies end.  ``docs/park.md`` ("Changing a fleet while tasks wait") says
what each change does.
"""

from __future__ import annotations

from collections.abc import Mapping

from celery_caps.stores.base import DISPATCH_HOLDER, OUTSIDE_PAYLOAD, ClaimOutcome, ParkOutcome, ParkRequest, SlotStore
from tests.unit.test_stores import (
    DISPATCH_LEASE,
    HOLDER,
    LONG_LEASE,
    SHORT_LEASE,
    admit,
    lapse,
    listed,
    new_run_id,
    park,
    parking_store,
    wait_until_expired,
)


def live_holders(store: SlotStore, slot: str) -> set[str]:
    """The task ids holding a live lease of ``slot`` (a dispatch's lease included)."""
    return {lease.task_id for lease in store.leases(slot) if lease.expires_in > 0}


def claim_all(store: SlotStore, woken: list, holder: str = HOLDER) -> list[str]:  # type: ignore[type-arg]
    """Claim every woken waiter; returns their run ids."""
    for waiter in woken:
        assert store.claim(waiter.task_id, waiter.run_id, holder, LONG_LEASE) is ClaimOutcome.RUN
    return [waiter.run_id for waiter in woken]


def test_lowering_a_limit_while_tasks_wait_admits_no_one_above_the_new_limit(store: SlotStore, prefix: str) -> None:
    # Given: a rolling deploy lowers a cap from 4 to 1.  Four runs hold it and four tasks wait,
    # all admitted and parked by the old code, at limit 4.
    store = parking_store(store)
    slot = f"{prefix}provider"
    old: Mapping[str, int] = {slot: 4}
    running = [admit(store, old, f"{prefix}run{i}") for i in range(4)]
    for i in range(4):
        assert park(store, old, f"{prefix}old{i}", float(i)) == ParkOutcome.PARKED
    # ... then new code's tasks arrive at limit 1 and wait too
    new: Mapping[str, int] = {slot: 1}
    for i in range(2):
        assert park(store, new, f"{prefix}new{i}", 10.0 + i) == ParkOutcome.PARKED

    # When: the four old runs end, one after the other
    woken = []
    for ended, run_id in enumerate(running, 1):
        _, more = store.release_and_wake(run_id, DISPATCH_LEASE)
        woken += more
        # Then: nobody is handed a place while the old runs still hold one or more: the slot's
        # limit is 1 now, whatever limit the waiters parked with (running tasks finish)
        assert len(live_holders(store, slot)) == (4 - ended) + len(woken)
        if ended < 4:
            assert woken == [], [w.task_id for w in woken]
    assert len(woken) == 1, [w.task_id for w in woken]
    assert woken[0].task_id == f"{prefix}old0"
    assert live_holders(store, slot) == {f"{prefix}old0"}
    # ... recovery does not add any either
    assert store.recover(DISPATCH_LEASE, caps=[slot]) == []
    # ... and the next release hands over one at a time, in order
    [run] = claim_all(store, woken)
    _, [following] = store.release_and_wake(run, DISPATCH_LEASE)
    assert following.task_id == f"{prefix}old1"
    assert live_holders(store, slot) == {f"{prefix}old1"}


def test_raising_a_limit_while_tasks_wait_gives_the_new_room_to_the_waiters(store: SlotStore, prefix: str) -> None:
    # Given: a cap of 1, held, with three tasks waiting (parked by the old code, at limit 1)
    store = parking_store(store)
    slot = f"{prefix}provider"
    admit(store, {slot: 1}, f"{prefix}run")
    for i in range(3):
        assert park(store, {slot: 1}, f"{prefix}old{i}", float(i)) == ParkOutcome.PARKED
    # When: the new code raises the limit to 3 (its first task takes one of the new places)
    admit(store, {slot: 3}, f"{prefix}new")
    # Then: recovery (any worker's, every few seconds) hands the room left to the oldest waiter
    [woken] = store.recover(DISPATCH_LEASE, caps=[slot])
    assert woken.task_id == f"{prefix}old0"
    assert len(live_holders(store, slot)) == 3
    assert listed(store, slot) == [(f"{prefix}old0", True), (f"{prefix}old1", False), (f"{prefix}old2", False)]


def test_after_a_raise_a_release_hands_out_every_place_the_new_limit_has(store: SlotStore, prefix: str) -> None:
    # Given: waiters parked at limit 1, and the new code's limit of 3 (its first task admitted)
    store = parking_store(store)
    slot = f"{prefix}provider"
    running = admit(store, {slot: 1}, f"{prefix}run")
    for i in range(3):
        assert park(store, {slot: 1}, f"{prefix}old{i}", float(i)) == ParkOutcome.PARKED
    admit(store, {slot: 3}, f"{prefix}new")
    # When: the old run ends
    _, woken = store.release_and_wake(running, DISPATCH_LEASE)
    # Then: its release fills the slot up to the new limit, oldest first (no waiter parked
    # with the old limit stops the walk)
    assert [w.task_id for w in woken] == [f"{prefix}old0", f"{prefix}old1"]
    assert len(live_holders(store, slot)) == 3
    assert listed(store, slot)[-1] == (f"{prefix}old2", False)


def test_keys_of_one_cap_keep_the_limits_their_function_gave_them(store: SlotStore, prefix: str) -> None:
    # Given: a cap whose limit is a function of the key (Cap(limit=plan, key=...)): a premium
    # key at 3 and a basic key at 1, each full, and a task waiting for each
    store = parking_store(store)
    premium, basic = f"{prefix}tier:premium", f"{prefix}tier:basic"
    premium_runs = [admit(store, {premium: 3}, f"{prefix}p{i}") for i in range(3)]
    basic_run = admit(store, {basic: 1}, f"{prefix}b0")
    assert store.acquire({basic: 1}, f"{prefix}b1", new_run_id(), HOLDER, LONG_LEASE).granted is False
    assert park(store, {premium: 3}, f"{prefix}p3", 1.0) == ParkOutcome.PARKED
    assert park(store, {basic: 1}, f"{prefix}b1", 2.0) == ParkOutcome.PARKED
    # Then: each key's sentinel keeps its own limit
    limits = {status.slot: status.limit for status in store.status() if status.slot.startswith(f"{prefix}tier:")}
    assert limits == {premium: 3, basic: 1}
    # When: a premium run ends, its place goes to the premium waiter only
    _, woken = store.release_and_wake(premium_runs[0], DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}p3"]
    assert len(live_holders(store, premium)) == 3 and live_holders(store, basic) == {f"{prefix}b0"}
    # ... and the basic key hands over at its own limit of 1
    _, woken = store.release_and_wake(basic_run, DISPATCH_LEASE)
    assert [w.task_id for w in woken] == [f"{prefix}b1"]
    assert live_holders(store, basic) == {f"{prefix}b1"}
    assert store.recover(DISPATCH_LEASE, caps=[f"{prefix}tier"]) == []


def test_a_stale_copy_redelivered_after_another_dispatch_ran_ends(store: SlotStore, prefix: str) -> None:
    # Given: a woken copy D1 sits in a worker's prefetch buffer past its deadline; recovery
    # dispatches D2, which another worker claims and runs
    store = parking_store(store)
    slot = f"{prefix}s"
    running = admit(store, {slot: 1}, f"{prefix}before")
    assert park(store, {slot: 1}, f"{prefix}t", 1.0) == ParkOutcome.PARKED
    _, [first] = store.release_and_wake(running, SHORT_LEASE)
    wait_until_expired(store, [first.run_id])
    [second] = store.recover(DISPATCH_LEASE, caps=[slot])
    assert store.claim(second.task_id, second.run_id, "w2@h/2", LONG_LEASE) is ClaimOutcome.RUN
    # When: the first worker is warm-shut down and the broker returns D1, marked redelivered
    # (while D2's run is on, and after it ended)
    for _ in ("while D2 runs", "after D2 ended"):
        claimed = store.claim(first.task_id, first.run_id, "w3@h/3", LONG_LEASE, redelivered=True)
        # Then: it ends: the tombstone records D2 as the dispatch that ran
        assert claimed is ClaimOutcome.END
        store.release(second.run_id)
    # ... while D2's own copy, redelivered (its run may have died), still goes through admission
    assert store.claim(second.task_id, second.run_id, "w3@h/3", LONG_LEASE, redelivered=True) is ClaimOutcome.ADMIT


def test_a_stale_copy_of_a_forgotten_dispatch_ends_unless_it_is_that_dispatch(store: SlotStore, prefix: str) -> None:
    store = parking_store(store)
    slot = f"{prefix}s"
    running = admit(store, {slot: 1}, f"{prefix}before")
    assert park(store, {slot: 1}, f"{prefix}t", 1.0) == ParkOutcome.PARKED
    _, [first] = store.release_and_wake(running, SHORT_LEASE)
    wait_until_expired(store, [first.run_id])
    [second] = store.recover(DISPATCH_LEASE, caps=[slot])
    # The task is revoked while D2 is on its way: its entry becomes a tombstone of D2
    assert store.forget(second.task_id, DISPATCH_LEASE)[0] == 1
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE, redelivered=True) is ClaimOutcome.END
    assert store.claim(second.task_id, second.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.END


def test_a_reused_task_id_is_reported_not_taken_for_the_waiting_task(store: SlotStore, prefix: str) -> None:
    # Given: task t waits for a full cap
    store = parking_store(store)
    busy, empty = f"{prefix}busy", f"{prefix}empty"
    admit(store, {busy: 1}, f"{prefix}running")
    assert park(store, {busy: 1}, f"{prefix}t", 1.0) == ParkOutcome.PARKED
    # When: the same id is sent again by another task, for another cap (an empty one) or the same
    reused_for_other_cap = store.park(
        _request({empty: 1}, f"{prefix}t", task_name="t.other", payload=b"other")  # type: ignore[arg-type]
    )
    reused_for_same_cap = store.park(
        _request({busy: 1}, f"{prefix}t", task_name="t.other", payload=b"other")  # type: ignore[arg-type]
    )
    # Then: the store says the id is in use by another task, and changes nothing
    assert reused_for_other_cap is ParkOutcome.ID_IN_USE
    assert reused_for_same_cap is ParkOutcome.ID_IN_USE
    assert listed(store, busy) == [(f"{prefix}t", False)]
    assert store.waiters(empty) == []
    assert store.leases(empty) == []
    # ... while a copy of the task itself is answered by its entry, whatever it asks for now (a
    # deploy changed the cap's limit, renamed the cap, or changed its key)
    assert park(store, {busy: 1}, f"{prefix}t", 1.0) == ParkOutcome.WAITING
    assert park(store, {busy: 2}, f"{prefix}t", 1.0) == ParkOutcome.WAITING
    assert park(store, {empty: 1}, f"{prefix}t", 1.0) == ParkOutcome.WAITING
    assert store.leases(empty) == []


def test_recovery_serves_the_waiters_of_a_task_it_knows_whose_cap_was_renamed(store: SlotStore, prefix: str) -> None:
    # Given: tasks of "t.parked" wait for cap <prefix>old, whose holder died (its lease expires)
    store = parking_store(store)
    old = f"{prefix}old"
    holder = admit(store, {old: 1}, f"{prefix}running")
    assert park(store, {old: 1}, f"{prefix}t", 1.0) == ParkOutcome.PARKED
    lapse(store, [holder])
    # When: the fleet's new code calls the cap <prefix>new: its recovery names that cap only ...
    assert store.recover(DISPATCH_LEASE, caps=[f"{prefix}new"]) == []
    # ... and the tasks it knows: the waiter is served
    [woken] = store.recover(DISPATCH_LEASE, caps=[f"{prefix}new"], task_names=["t.parked"])
    assert woken.task_id == f"{prefix}t"
    assert {lease.holder for lease in store.leases(old) if lease.expires_in > 0} == {DISPATCH_HOLDER}
    # Another app's tasks (names it does not know) stay where they are
    other = f"{prefix}other"
    other_holder = admit(store, {other: 1}, f"{prefix}other-running")
    assert park(store, {other: 1}, f"{prefix}u", 1.0) == ParkOutcome.PARKED
    lapse(store, [other_holder])
    assert store.recover(DISPATCH_LEASE, caps=[f"{prefix}new"], task_names=["t.unknown"]) == []
    assert store.recover(DISPATCH_LEASE, caps=[], task_names=[]) == []


def test_a_task_whose_dispatches_are_never_claimed_stops_holding_the_slot(store: SlotStore, prefix: str) -> None:
    # Given: a cap of 1 whose run ends, with t and then u waiting; t's wake queue is no longer
    # consumed (the fleet was restarted on other queues), so none of its copies is ever claimed
    store = parking_store(store)
    slot = f"{prefix}s"
    running = admit(store, {slot: 1}, f"{prefix}before")
    assert park(store, {slot: 1}, f"{prefix}t", 1.0) == ParkOutcome.PARKED
    assert park(store, {slot: 1}, f"{prefix}u", 2.0) == ParkOutcome.PARKED
    _, [first] = store.release_and_wake(running, SHORT_LEASE)
    assert (first.task_id, first.readmit) == (f"{prefix}t", False)
    # When: its first dispatch passes its deadline unclaimed, recovery dispatches it again, with
    # the slot (its copy may only have been late: stuck in a prefetch buffer)
    wait_until_expired(store, [first.run_id])
    [second] = store.recover(SHORT_LEASE, caps=[slot])
    assert (second.task_id, second.readmit) == (f"{prefix}t", False)
    assert live_holders(store, slot) == {f"{prefix}t"}
    # ... and when that one passes its deadline unclaimed too
    wait_until_expired(store, [second.run_id])
    woken = store.recover(SHORT_LEASE, caps=[slot])
    # Then: t is dispatched again without the slot (its copy, when some worker takes it, goes
    # through admission), and the slot goes to u
    assert sorted((w.task_id, w.readmit) for w in woken) == [(f"{prefix}t", True), (f"{prefix}u", False)]
    assert live_holders(store, slot) == {f"{prefix}u"}
    # ... the copies of t's earlier dispatches end; the last one's goes through admission, and
    # parks again, at its old place, first in line
    [third] = [w for w in woken if w.task_id == f"{prefix}t"]
    for stale in (first, second):
        assert store.claim(stale.task_id, stale.run_id, HOLDER, LONG_LEASE, redelivered=True) is ClaimOutcome.END
    assert store.claim(third.task_id, third.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert park(store, {slot: 1}, f"{prefix}t", 1.0) == ParkOutcome.PARKED
    [u] = [w for w in woken if w.task_id == f"{prefix}u"]
    [u_run] = claim_all(store, [u])
    _, [next_one] = store.release_and_wake(u_run, DISPATCH_LEASE)
    assert (next_one.task_id, next_one.readmit) == (f"{prefix}t", False)


def test_a_task_parked_without_its_message_keeps_its_place_and_its_message_claims_it(
    store: SlotStore, prefix: str
) -> None:
    # Given: a cap of 1, held; task big parks without its message (too large for the store: the
    # message waits in the broker), then small parks with its own
    store = parking_store(store)
    slot = f"{prefix}s"
    running = admit(store, {slot: 1}, f"{prefix}before")
    big, small = f"{prefix}big", f"{prefix}small"
    outside = ParkRequest({slot: 1}, big, new_run_id(), HOLDER, LONG_LEASE, 1.0, 100, "t.big", OUTSIDE_PAYLOAD)
    assert store.park(outside) is ParkOutcome.PARKED
    assert park(store, {slot: 1}, small, 2.0) == ParkOutcome.PARKED
    # Then: its entry says it waits outside, undispatched; a copy of its message that comes back
    # now learns it must go back to the broker (and a copy of another task's entry is not outside)
    waiting = store.entry(big)  # type: ignore[attr-defined]
    assert waiting is not None and (waiting.listed, waiting.dispatch_run_id, waiting.outside) == (True, None, True)
    assert store.entry(small).outside is False  # type: ignore[attr-defined]
    assert store.entry(f"{prefix}nobody") is None  # type: ignore[attr-defined]
    # When: the run ends
    _, woken = store.release_and_wake(running, DISPATCH_LEASE)
    # Then: the slot is reserved for big, first in line (nothing to publish: its message is in
    # the broker), and small still waits
    assert [(w.task_id, w.payload, w.readmit) for w in woken] == [(big, OUTSIDE_PAYLOAD, False)]
    assert live_holders(store, slot) == {big}
    dispatched = store.entry(big)  # type: ignore[attr-defined]
    assert dispatched is not None and dispatched.dispatch_run_id == woken[0].run_id and dispatched.outside
    # ... and its message, coming back, claims that dispatch and runs
    assert store.claim(big, dispatched.dispatch_run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert listed(store, slot) == [(small, False)]
    gone = store.entry(big)  # type: ignore[attr-defined]
    assert gone is None or not gone.listed


def _request(slots: Mapping[str, int], task_id: str, *, task_name: str, payload: bytes) -> object:
    return ParkRequest(slots, task_id, new_run_id(), HOLDER, LONG_LEASE, 1.0, 100, task_name, payload)
