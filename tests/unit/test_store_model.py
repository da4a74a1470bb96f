"""Chaos: a model-based (hypothesis) test of every store against a small reference model.

Random interleavings of acquire / renew / release / release by holder / revoke
(release of a task id) / sweep, across four slot names with different limits,
five task ids and three holders, are applied both to a store and to a plain
Python model of the contract.  After every step the store must agree with the
model: the same admissions and refusals, the same renewal counts, the same
deletions and the same lease rows.  Invariants checked on the store itself:
distinct live holders never exceed a slot's limit, a sentinel is never removed,
a release only ever removes its own run's (or holder's, or task id's) leases.

The in-memory store runs on a clock the test controls, so leases also expire
(to the exact boundary) between steps.  Real stores (SQLite, PostgreSQL,
MySQL/MariaDB, Redis) use leases that never expire during a run; expiry on them
is covered by ``test_stores.py`` with short real leases.

The waiting list (park and wake) is checked against the in-memory store, the
reference implementation of parking, by seeded random walks (long ones: a list
must fill up before a release has waiters to pass over): admissions, parks (new,
duplicate, without a payload), releases that wake, claims (of live, repeated and
unknown dispatches), recoveries, readmits (past a maximum wait, and by an
operator) must give the same outcomes, the same woken tasks in the same order,
and after every step the same waiting lists and leases.  It runs on stores whose
waiting list is this test's alone — SQLite, Redis with its own key prefix, and
PostgreSQL and MySQL/MariaDB in a schema (database) of their own — since
``recover`` is store-wide.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule, run_state_machine_as_test

from celery_caps.stores import store_from_url
from celery_caps.stores.base import ClaimOutcome, ParkOutcome, ParkRequest, SlotStore, Woken
from celery_caps.stores.memory import MemoryStore
from tests.services import StoreKind, private_sql_url

pytestmark = pytest.mark.chaos

#: Slot suffixes and their limits (fixed per slot: a cap's limit does not change mid-run).
LIMITS = {"a": 1, "b": 2, "c:x": 2, "c:y:ü'%{}": 1}
TASKS = [f"t{index}" for index in range(5)]
HOLDERS = ["w1@h/11", "w1@h/12", "w2@h/21"]
#: Real stores: a lease that outlives any example.
REAL_LEASE_SECONDS = 600.0
#: The memory store's model clock: leases of 10 s, time moves in steps of 0-12 s.
MODEL_LEASE_SECONDS = 10.0


@dataclass
class ModelLease:
    slot: str
    task_id: str
    holder: str
    expires_at: float


class StoreModel:
    """The store contract in a few lines: leases keyed by (slot, run id), expiry by ``now``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.leases: dict[tuple[str, str], ModelLease] = {}
        self.sentinels: set[str] = set()

    def live_tasks(self, slot: str) -> set[str]:
        return {lease.task_id for lease in self.leases.values() if lease.slot == slot and lease.expires_at > self.now}

    def acquire(self, slots: dict[str, int], task_id: str, run_id: str, holder: str, lease: float) -> set[str]:
        self.sentinels |= set(slots)
        full = {
            slot
            for slot, limit in slots.items()
            if task_id not in self.live_tasks(slot) and len(self.live_tasks(slot)) >= limit
        }
        if not full:
            for slot in slots:
                self.leases[(slot, run_id)] = ModelLease(slot, task_id, holder, self.now + lease)
        return full

    def renew(self, run_ids: set[str], lease: float) -> dict[str, int]:
        renewed: dict[str, int] = {}
        for (_, run_id), entry in self.leases.items():
            if run_id in run_ids and entry.expires_at > self.now:
                entry.expires_at = self.now + lease
                renewed[run_id] = renewed.get(run_id, 0) + 1
        return renewed

    def delete(self, doomed: Callable[[str, ModelLease], bool]) -> int:
        keys = [key for key, entry in self.leases.items() if doomed(key[1], entry)]
        for key in keys:
            del self.leases[key]
        return len(keys)


def make_machine(shared_store: SlotStore | None, prefix: str) -> type[RuleBasedStateMachine]:
    """A state machine class driving ``shared_store``, or (None) a fresh memory store per
    example on a clock the machine sets."""
    clock = [0.0] if shared_store is None else None
    lease_seconds = MODEL_LEASE_SECONDS if clock is not None else REAL_LEASE_SECONDS
    store: SlotStore = shared_store or MemoryStore()

    class StoreMachine(RuleBasedStateMachine):
        runs = Bundle("runs")

        def __init__(self) -> None:
            super().__init__()
            # A fresh namespace per example: slots and task ids never meet an earlier example's.
            self.space = f"{prefix}{uuid.uuid4().hex[:8]}-"
            self.model = StoreModel()
            if clock is not None:
                nonlocal store
                clock[0] = 1_000_000.0
                self.model.now = clock[0]
                store = MemoryStore(clock=lambda: clock[0])

        def slot(self, suffix: str) -> str:
            return self.space + suffix

        def task(self, name: str) -> str:
            return self.space + name

        @rule(
            target=runs,
            suffixes=st.sets(st.sampled_from(sorted(LIMITS)), min_size=1, max_size=3),
            task=st.sampled_from(TASKS),
            holder=st.sampled_from(HOLDERS),
        )
        def acquire(self, suffixes: set[str], task: str, holder: str) -> str:
            slots = {self.slot(suffix): LIMITS[suffix] for suffix in suffixes}
            run_id = uuid.uuid4().hex
            expected_full = self.model.acquire(slots, self.task(task), run_id, holder, lease_seconds)
            admission = store.acquire(slots, self.task(task), run_id, holder, lease_seconds, task_name="model")
            assert admission.granted == (not expected_full), (slots, task, admission, expected_full)
            assert set(admission.full_slots) == expected_full
            return run_id

        @rule(run_ids=st.lists(runs, max_size=3), unknown=st.booleans())
        def renew(self, run_ids: list[str], unknown: bool) -> None:
            wanted = set(run_ids) | ({uuid.uuid4().hex} if unknown else set())
            expected = self.model.renew(wanted, lease_seconds)
            assert store.renew(sorted(wanted), lease_seconds) == expected

        @rule(run_id=consumes(runs))
        def release(self, run_id: str) -> None:
            expected = self.model.delete(lambda run, _: run == run_id)
            assert store.release(run_id) == expected

        @rule(task=st.sampled_from(TASKS), holder=st.sampled_from(HOLDERS))
        def release_holder(self, task: str, holder: str) -> None:
            task_id = self.task(task)
            expected = self.model.delete(lambda _, lease: lease.task_id == task_id and lease.holder == holder)
            assert store.release_holder(task_id, holder) == expected

        @rule(task=st.sampled_from(TASKS))
        def revoke(self, task: str) -> None:
            task_id = self.task(task)
            expected = self.model.delete(lambda _, lease: lease.task_id == task_id)
            assert store.release_task(task_id) == expected

        @rule()
        def sweep(self) -> None:
            expected = self.model.delete(lambda _, lease: lease.expires_at <= self.model.now)
            swept = store.sweep()
            if clock is not None:  # a shared server's sweep also removes other runs' expired rows
                assert swept == expected

        if clock is not None:

            @rule(seconds=st.sampled_from([0.0, 1.0, 5.0, 10.0, 12.0]))
            def advance_clock(self, seconds: float) -> None:
                clock[0] += seconds
                self.model.now = clock[0]

        @invariant()
        def store_agrees_with_the_model(self) -> None:
            rows = {
                (lease.slot, lease.run_id): (lease.task_id, lease.holder)
                for lease in store.leases()
                if lease.slot.startswith(self.space)
            }
            expected = {key: (lease.task_id, lease.holder) for key, lease in self.model.leases.items()}
            assert rows == expected
            statuses = {status.slot: status for status in store.status() if status.slot.startswith(self.space)}
            # Sentinels are never removed: every slot ever asked for is still there.
            assert set(statuses) == self.model.sentinels
            for slot, status in statuses.items():
                live = self.model.live_tasks(slot)
                assert status.holders == len(live), (slot, status, live)
                assert status.limit is not None and status.holders <= status.limit, status

    return StoreMachine


def test_every_store_behaves_like_the_model(store_kind: StoreKind, store: SlotStore, prefix: str) -> None:
    if store_kind.id == "pgbouncer":
        # PostgreSQL's row runs the same SQL directly; through the pooler, the store table and the
        # fleet tests run (tests/integration/test_poolers.py): a minute of CI saved.
        pytest.skip("the model runs on PostgreSQL directly; through PgBouncer, the store table and fleet tests run")
    machine = make_machine(None if store_kind.id == "memory" else store, prefix)
    examples = 60 if store_kind.id == "memory" else 15
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


# -- the waiting list, against the in-memory store's ------------------------------------

#: Parking walks' leases and dispatch leases: never expire during a run.
PARK_LEASE_SECONDS = 600.0
WAITER_HOLDER = "w9@h/99"
#: Each walk's operations and how often each is picked: lists fill faster than they empty.
PARKING_OPERATIONS = {
    "acquire": 2.0,
    "park": 4.0,
    "park_duplicate": 0.5,
    "park_without_payload": 0.3,
    "release_and_wake": 5.0,
    "claim": 4.0,
    "claim_again": 0.3,
    "claim_unknown": 0.3,
    "recover": 0.5,
    "readmit_overdue": 0.2,
    "readmit": 0.2,
}
PARKING_STEPS = 400


@dataclass(frozen=True)
class RunPair:
    """One run as the reference store and the store under test name it (dispatch run ids differ)."""

    reference: str
    tested: str


class ParkingWalk:
    """A random walk of waiting-list operations on ``tested`` and on a fresh reference
    (in-memory) store, checking after every step that both agree."""

    def __init__(self, tested: SlotStore, space: str, seed: int) -> None:
        self.tested = tested
        self.reference = MemoryStore()
        self.space = space
        self.random = random.Random(seed)
        self.held: list[RunPair] = []  # runs holding leases
        self.dispatched: list[tuple[str, RunPair]] = []  # woken, not claimed yet
        self.claimed: list[tuple[str, RunPair]] = []  # claimed dispatches
        self.waiting: list[str] = []  # parked task ids, not dispatched
        self.parked = 0
        self.woken = 0  # how many dispatches the walk saw (a walk without any proves little)
        self.passed_over = 0  # releases that left a waiter of a released slot waiting

    def slots(self) -> dict[str, int]:
        suffixes = self.random.sample(sorted(LIMITS), self.random.randint(1, 3))
        return {self.space + suffix: LIMITS[suffix] for suffix in suffixes}

    def own(self, woken: list[Woken]) -> list[Woken]:
        return [waiter for waiter in woken if waiter.task_id.startswith(self.space)]

    def agree_on_woken(self, expected: list[Woken], got: list[Woken]) -> None:
        got = self.own(got)
        assert [(w.task_id, w.payload, w.task_name, w.readmit) for w in got] == [
            (w.task_id, w.payload, w.task_name, w.readmit) for w in expected
        ]
        for theirs, mine in zip(expected, got, strict=True):
            self.dispatched.append((mine.task_id, RunPair(theirs.run_id, mine.run_id)))
        self.woken += len(got)

    def step(self) -> str:
        operation = self.random.choices(list(PARKING_OPERATIONS), list(PARKING_OPERATIONS.values()))[0]
        getattr(self, operation)()
        return operation

    def both(self, call: Callable[[SlotStore], Any]) -> tuple[Any, Any]:
        return call(self.reference), call(self.tested)

    def acquire(self) -> None:
        slots, task_id, run_id = self.slots(), f"{self.space}h{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
        expected, got = self.both(lambda store: store.acquire(slots, task_id, run_id, HOLDERS[0], PARK_LEASE_SECONDS))
        assert got == expected
        if expected.granted:
            self.held.append(RunPair(run_id, run_id))

    def park(self) -> None:
        self.parked += 1
        slots, task_id, run_id = self.slots(), f"{self.space}w{self.parked:04d}", uuid.uuid4().hex
        # Unique first-deferral times: ties are broken by park time, which two stores
        # never share (and SQLite's clock counts only milliseconds).
        first = self.random.randint(0, 50) + self.parked / 10_000
        max_waiters = self.random.choice([3, 100, 100, 100])
        expected, got = self.both(
            lambda store: store.park(
                ParkRequest(
                    slots,
                    task_id,
                    run_id,
                    WAITER_HOLDER,
                    PARK_LEASE_SECONDS,
                    payload=f"payload {task_id}".encode(),
                    first_deferred_at=first,
                    max_waiters=max_waiters,
                    task_name="model",
                )
            )
        )
        assert got == expected, (slots, task_id)
        if expected is ParkOutcome.ADMITTED:
            self.held.append(RunPair(run_id, run_id))

    def park_without_payload(self) -> None:
        slots, task_id = self.slots(), f"{self.space}x{uuid.uuid4().hex[:6]}"
        run_id = uuid.uuid4().hex
        expected, got = self.both(
            lambda store: store.park(
                ParkRequest(
                    slots,
                    task_id,
                    run_id,
                    WAITER_HOLDER,
                    PARK_LEASE_SECONDS,
                    payload=None,
                    first_deferred_at=0.0,
                    max_waiters=100,
                )
            )
        )
        assert got == expected, (slots, task_id)
        if expected is ParkOutcome.ADMITTED:
            self.held.append(RunPair(run_id, run_id))

    def park_duplicate(self) -> None:
        if not self.waiting:
            return
        task_id, slots = self.random.choice(self.waiting), {self.space + "a": LIMITS["a"]}
        expected, got = self.both(
            lambda store: store.park(
                ParkRequest(
                    slots,
                    task_id,
                    uuid.uuid4().hex,
                    WAITER_HOLDER,
                    PARK_LEASE_SECONDS,
                    payload=b"duplicate",
                    first_deferred_at=0.0,
                    max_waiters=100,
                )
            )
        )
        assert got == expected

    def release_and_wake(self) -> None:
        if not self.held:
            return
        run = self.held.pop(self.random.randrange(len(self.held)))
        released = {lease.slot for lease in self.reference.leases() if lease.run_id == run.reference}
        (deleted, woken), (tested_deleted, tested_woken) = (
            self.reference.release_and_wake(run.reference, PARK_LEASE_SECONDS),
            self.tested.release_and_wake(run.tested, PARK_LEASE_SECONDS),
        )
        assert tested_deleted == deleted
        self.agree_on_woken(woken, tested_woken)
        if any(w.slot in released and not w.dispatched for w in self.reference.waiters()):
            self.passed_over += 1

    def claim_pair(self, task_id: str, run: RunPair, holder: str = WAITER_HOLDER) -> ClaimOutcome:
        expected = self.reference.claim(task_id, run.reference, holder, PARK_LEASE_SECONDS)
        assert self.tested.claim(task_id, run.tested, holder, PARK_LEASE_SECONDS) is expected, (task_id, expected)
        return expected

    def claim(self) -> None:
        if not self.dispatched:
            return
        task_id, run = self.dispatched.pop(self.random.randrange(len(self.dispatched)))
        if self.claim_pair(task_id, run) is ClaimOutcome.RUN:
            self.held.append(run)
            self.claimed.append((task_id, run))

    def claim_again(self) -> None:
        # A claim repeated by its process (its reply was lost), or presented by another one.
        if not self.claimed:
            return
        task_id, run = self.random.choice(self.claimed)
        self.claim_pair(task_id, run, self.random.choice([WAITER_HOLDER, HOLDERS[1]]))

    def claim_unknown(self) -> None:
        # A stale or foreign run id: the task's entry answers for it (the copy ends).
        if not self.waiting:
            return
        task_id, run_id = self.random.choice(self.waiting), uuid.uuid4().hex
        expected, got = self.both(lambda store: store.claim(task_id, run_id, WAITER_HOLDER, PARK_LEASE_SECONDS))
        assert got is expected

    def recover(self) -> None:
        expected, got = self.both(lambda store: store.recover(PARK_LEASE_SECONDS))
        self.agree_on_woken(self.own(expected), got)

    def readmit_overdue(self) -> None:
        before = float(self.random.randint(0, 50))
        expected, got = self.both(lambda store: store.recover(PARK_LEASE_SECONDS, readmit_before=before))
        self.agree_on_woken(self.own(expected), got)

    def readmit(self) -> None:
        slot = self.space + self.random.choice(sorted(LIMITS))
        expected, got = self.both(lambda store: store.readmit(slot, PARK_LEASE_SECONDS))
        self.agree_on_woken(expected, got)

    def check(self) -> None:
        """Both stores list the same waiting lists (order, positions, dispatched) and leases."""
        listings = [
            [(w.slot, w.task_id, w.position, w.dispatched) for w in store.waiters() if w.slot.startswith(self.space)]
            for store in (self.reference, self.tested)
        ]
        assert listings[1] == listings[0]
        self.waiting = sorted({task_id for _, task_id, _, dispatched in listings[0] if not dispatched})
        leases = [
            sorted(
                (lease.slot, lease.task_id, lease.holder)
                for lease in store.leases()
                if lease.slot.startswith(self.space)
            )
            for store in (self.reference, self.tested)
        ]
        assert leases[1] == leases[0]


def _walk_and_check(store: SlotStore, space: str, seed: int, label: str) -> None:
    """Walk ``store``'s waiting list (slot names under ``space``) beside the reference."""
    walk = ParkingWalk(store, space, seed)
    for number in range(PARKING_STEPS):
        operation = walk.step()
        try:
            walk.check()
        except AssertionError as exc:
            raise AssertionError(f"step {number} ({operation}), seed {seed}: {exc}") from exc
    # A walk that never woke or passed over a waiter would prove little.
    print(f"[parking walk {label} seed {seed}] woken {walk.woken}, releases passing over {walk.passed_over}")
    assert walk.woken >= 10 and walk.passed_over >= 10, (walk.woken, walk.passed_over)


@pytest.mark.parametrize("seed", range(4))
def test_every_waiting_list_behaves_like_the_reference(
    store_kind: StoreKind, store: SlotStore, prefix: str, seed: int
) -> None:
    if store_kind.id == "memory":
        pytest.skip("the in-memory store is the reference")
    if store_kind.shared:
        pytest.skip("recover is store-wide: the private-space test below walks this store")
    _walk_and_check(store, f"{prefix}{seed}-", seed, store_kind.id)


@pytest.mark.parametrize(
    "service", [pytest.param("postgres", marks=pytest.mark.postgres), pytest.param("mysql", marks=pytest.mark.mysql)]
)
@pytest.mark.parametrize("seed", range(4))
def test_a_private_sql_waiting_list_behaves_like_the_reference(service: str, seed: int) -> None:
    # PostgreSQL and MySQL/MariaDB in a schema (database) of this test's own: there the
    # store-wide steps reach no other test run's waiters.
    with private_sql_url(service) as url:
        store = store_from_url(url)
        try:
            _walk_and_check(store, f"w{seed}-", seed, service)
        finally:
            store.close()
