"""Limits set by an operator (``celery caps limit``), on every store of the table.

An operator's limit for a cap (all its keys) or one slot overrides the limit in code for every
admission and hand-over from the moment it is set, whatever limit the admitting task carries
or a waiter parked with; a slot's own limit beats its cap's; removing it returns the code's.
"""

from __future__ import annotations

import importlib
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from celery_caps.errors import ConfigurationError, StoreError, StoreInputError
from celery_caps.limits import change_limit, set_limit
from celery_caps.runtime import runtime_for
from celery_caps.settings import CapsSettings
from celery_caps.stores.base import ClaimOutcome, HistoryEvent, ParkOutcome, SlotStore
from celery_caps.stores.memory import MemoryStore
from tests.services import StoreKind, StoreTarget, close_client_app
from tests.unit.test_store_changes import claim_all, live_holders
from tests.unit.test_stores import DISPATCH_LEASE, HOLDER, LONG_LEASE, admit, new_run_id, park, parking_store


def test_an_operator_limit_overrides_the_code_until_it_is_removed(store: SlotStore, prefix: str) -> None:
    cap = f"{prefix}provider"
    code = {cap: 4}
    runs = [admit(store, code, f"{prefix}run{i}") for i in range(3)]
    # When: an operator lowers the cap to 1 while three run under the code's 4
    assert store.set_limit(cap, 1) is None
    assert store.limits()[cap] == 1
    # Then: no task is admitted, whatever limit it carries, until the three have ended
    assert store.acquire(code, f"{prefix}late", new_run_id(), HOLDER, LONG_LEASE).granted is False
    for run_id in runs[:2]:
        store.release(run_id)
        assert store.acquire(code, f"{prefix}late", new_run_id(), HOLDER, LONG_LEASE).granted is False
    store.release(runs[2])
    admit(store, code, f"{prefix}first")
    assert store.acquire(code, f"{prefix}second", new_run_id(), HOLDER, LONG_LEASE).granted is False
    # When: it is raised to 2, and then removed
    assert store.set_limit(cap, 2) == 1
    admit(store, code, f"{prefix}second")
    assert store.acquire(code, f"{prefix}third", new_run_id(), HOLDER, LONG_LEASE).granted is False
    assert store.set_limit(cap, None) == 2
    assert cap not in store.limits()
    # Then: the code's limit holds again
    admit(store, code, f"{prefix}third")
    admit(store, code, f"{prefix}fourth")
    assert store.acquire(code, f"{prefix}fifth", new_run_id(), HOLDER, LONG_LEASE).granted is False
    assert len(live_holders(store, cap)) == 4


def test_a_keys_own_limit_beats_its_caps_and_other_caps_are_untouched(store: SlotStore, prefix: str) -> None:
    cap, other = f"{prefix}tenant", f"{prefix}tenantx"
    store.set_limit(cap, 2)
    store.set_limit(f"{cap}:acme", 3)
    for key, room in (("acme", 3), ("globex", 2)):
        slot = f"{cap}:{key}"
        for number in range(room):
            admit(store, {slot: 1}, f"{prefix}{key}{number}")
        assert store.acquire({slot: 10}, f"{prefix}{key}-over", new_run_id(), HOLDER, LONG_LEASE).granted is False
    # A cap whose name merely starts with the other's keeps its code's limit
    admit(store, {other: 1}, f"{prefix}x0")
    assert store.acquire({other: 1}, f"{prefix}x1", new_run_id(), HOLDER, LONG_LEASE).granted is False
    own = {name: limit for name, limit in store.limits().items() if name.startswith(prefix)}
    assert own == {cap: 2, f"{cap}:acme": 3}


def test_hand_overs_count_against_the_operators_limit(store: SlotStore, prefix: str) -> None:
    # Given: a cap of 3 in code, full, two tasks waiting (parked under the code's 3)
    store = parking_store(store)
    cap = f"{prefix}provider"
    code = {cap: 3}
    runs = [admit(store, code, f"{prefix}run{i}") for i in range(3)]
    for i in range(3):
        assert park(store, code, f"{prefix}w{i}", float(i)) == ParkOutcome.PARKED
    # When: an operator lowers it to 1, and the runs end one by one
    store.set_limit(cap, 1)
    woken = []
    for run_id in runs:
        _, more = store.release_and_wake(run_id, DISPATCH_LEASE)
        woken += more
    # Then: only the last release hands over, and to one waiter
    assert [waiter.task_id for waiter in woken] == [f"{prefix}w0"]
    claim_all(store, woken)
    assert store.recover(DISPATCH_LEASE, caps=[cap]) == []
    # When: the operator raises it to 3: recovery (what `caps limit` calls) hands the room over
    store.set_limit(cap, 3)
    woken = store.recover(DISPATCH_LEASE, caps=[cap])
    assert sorted(waiter.task_id for waiter in woken) == [f"{prefix}w1", f"{prefix}w2"]
    assert len(live_holders(store, cap)) == 3


def test_copies_dispatched_before_a_cut_go_through_admission_and_wait_again_at_their_places(
    store: SlotStore, prefix: str
) -> None:
    store = parking_store(store)
    cap = f"{prefix}provider"
    waiters = [f"{prefix}w{number}" for number in range(3)]
    # Given: a cap of 3 held by three runs, three tasks waiting, and two runs ending: their
    # waiters w0 and w1 are dispatched, their copies on the way (a prefetch buffer, the broker)
    running = [admit(store, {cap: 3}, f"{prefix}run-{number}") for number in range(3)]
    for number, task_id in enumerate(waiters):
        assert park(store, {cap: 3}, task_id, 1.0 + number) == ParkOutcome.PARKED
    _, [first] = store.release_and_wake(running[0], DISPATCH_LEASE)
    _, [second] = store.release_and_wake(running[1], DISPATCH_LEASE)
    assert live_holders(store, cap) == {f"{prefix}run-2", waiters[0], waiters[1]}
    # When: an operator cuts the cap to 1 before the copies arrive
    store.set_limit(cap, 1)
    # Then: neither copy runs: each claim gives its slot up and sends it through admission (it
    # would have been a second and a third run under a limit of 1)
    for woken in (first, second):
        assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert live_holders(store, cap) == {f"{prefix}run-2"}
    # ... the same claim retried (its reply lost) does not run either, nor does another copy
    assert store.claim(first.task_id, first.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.ADMIT
    assert store.claim(first.task_id, first.run_id, "w2@host-b/7", LONG_LEASE) is ClaimOutcome.END
    # ... and their copies, refused by admission, wait again at their places, ahead of w2
    for number, woken in enumerate((first, second)):
        assert park(store, {cap: 3}, woken.task_id, 1.0 + number) == ParkOutcome.PARKED
    assert [waiter.task_id for waiter in store.waiters(cap)] == waiters
    # When the last run ends, w0 is handed the slot and runs: one at a time, as the limit says
    _, [again] = store.release_and_wake(running[2], DISPATCH_LEASE)
    assert again.task_id == waiters[0]
    assert store.claim(again.task_id, again.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert live_holders(store, cap) == {waiters[0]}


def test_a_copy_dispatched_before_a_cut_that_leaves_it_room_runs(store: SlotStore, prefix: str) -> None:
    # Given: a cap of 3, full; a waiter dispatched as one run ends, then another run ends
    store = parking_store(store)
    cap = f"{prefix}provider"
    running = [admit(store, {cap: 3}, f"{prefix}run-{number}") for number in range(3)]
    assert park(store, {cap: 3}, f"{prefix}waiter", 1.0) == ParkOutcome.PARKED
    _, [woken] = store.release_and_wake(running[0], DISPATCH_LEASE)
    store.release(running[1])
    # When: the cap is cut to 2, which the last run and the dispatch fill exactly
    store.set_limit(cap, 2)
    # Then: the copy runs
    assert store.claim(woken.task_id, woken.run_id, HOLDER, LONG_LEASE) is ClaimOutcome.RUN
    assert live_holders(store, cap) == {f"{prefix}run-2", f"{prefix}waiter"}


def test_a_limit_lowered_while_admissions_race_holds_from_the_moment_it_is_set(
    store: SlotStore, store_target: StoreTarget, store_kind: StoreKind, prefix: str
) -> None:
    # Given: four threads (each with its own store) admitting into a cap of 4 and releasing,
    # over and over; each counts the runs it holds in a shared counter (up after the grant,
    # down before the release)
    cap = f"{prefix}provider"
    lock = threading.Lock()
    holding = [0]
    set_at: list[float] = []
    over: list[str] = []
    errors: list[str] = []
    stop = threading.Event()

    def own_store() -> SlotStore:
        return store if store_kind.id == "memory" else store_target.open()

    def admit_and_release(index: int) -> None:
        mine = own_store()
        try:
            number = 0
            while not stop.is_set():
                number += 1
                asked_at = time.monotonic()
                run_id = new_run_id()
                if not mine.acquire({cap: 4}, f"{prefix}t{index}-{number}", run_id, HOLDER, LONG_LEASE).granted:
                    continue
                with lock:
                    holding[0] += 1
                    # Then: a run that asked after the limit was set to 1 is the only one running
                    if set_at and asked_at > set_at[0] and holding[0] > 1:
                        over.append(f"{holding[0]} running after the limit was set to 1")
                time.sleep(0.002)
                with lock:
                    holding[0] -= 1
                mine.release(run_id)
        except Exception:
            errors.append(traceback.format_exc())
        finally:
            if mine is not store:
                mine.close()

    threads = [threading.Thread(target=admit_and_release, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        # When: an operator lowers the cap to 1 while they race
        store.set_limit(cap, 1)
        set_at.append(time.monotonic())
        time.sleep(1.5)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors, errors[0]
    assert not over, over[:3]
    assert live_holders(store, cap) == set()


def test_operators_setting_one_new_name_at_once_all_succeed_and_one_of_their_limits_holds(
    store: SlotStore, store_target: StoreTarget, store_kind: StoreKind, prefix: str
) -> None:
    # Given: a name no task was admitted to yet (no sentinel to lock), and four operators (or
    # provisioning scripts), each with its own connection, setting its limit at the same moment
    names = [f"{prefix}new-{round_}" for round_ in range(5)]
    handles = [store if store_kind.id == "memory" else store_target.open() for _ in range(4)]
    errors: list[str] = []
    try:
        for name in names:
            start = threading.Barrier(len(handles))

            def put(handle: SlotStore, limit: int, name: str = name, start: threading.Barrier = start) -> None:
                try:
                    start.wait(10)
                    handle.set_limit(name, limit)
                except Exception:
                    errors.append(traceback.format_exc())

            threads = [threading.Thread(target=put, args=(handle, 10 + i)) for i, handle in enumerate(handles)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        # Then: none failed (an insert racing another's on PostgreSQL and MariaDB failed on the
        # taken name), and each name has one of the limits they set
        assert not errors, errors[0]
        limits = store.limits()
        assert all(limits[name] in (10, 11, 12, 13) for name in names), limits
    finally:
        for handle in handles:
            if handle is not store:
                handle.close()


def test_an_operator_limit_is_kept_by_the_store_for_every_handle(
    store: SlotStore, store_target: StoreTarget, store_kind: StoreKind, prefix: str
) -> None:
    # A worker started after the change (a new handle on the same store) counts against it
    cap = f"{prefix}provider"
    store.set_limit(cap, 1)
    later = store if store_kind.id == "memory" else store_target.open()
    try:
        assert later.limits()[cap] == 1
        admit(later, {cap: 5}, f"{prefix}first")
        assert later.acquire({cap: 5}, f"{prefix}second", new_run_id(), HOLDER, LONG_LEASE).granted is False
    finally:
        if later is not store:
            later.close()


def test_a_bad_limit_or_name_is_refused_naming_it(store: SlotStore, prefix: str) -> None:
    for name, limit, fragment in (
        (f"{prefix}p", 0, "limit"),
        (f"{prefix}p", -2, "limit"),
        (f"{prefix}p", 2**31, "limit must be at most 2147483647 .*, got 2147483648"),
        ("", 1, "name"),
    ):
        with pytest.raises(StoreInputError, match=fragment):
            store.set_limit(name, limit)
    assert not [name for name in store.limits() if name.startswith(prefix)]


def test_a_limit_set_holds_when_its_history_cannot_be_written() -> None:
    # The limit is set; the store then fails to record the change: the change is reported as set,
    # with the problem, and still holds
    class HistoryDown(MemoryStore):
        def record_history(self, events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
            raise StoreError("recording history failed (simulated)")

    store = HistoryDown()
    context = SimpleNamespace(app=None, settings=CapsSettings.from_conf({"caps_url": store}), store=store)
    change = change_limit(context, "provider", 2, {"provider"}, by="ops@host")  # type: ignore[arg-type]
    assert (change.previous, change.limit) == (None, 2)
    assert change.problems == ("the change is not in the history: recording history failed (simulated)",)
    assert store.limits() == {"provider": 2}


def test_set_limit_knows_the_caps_of_the_modules_the_app_includes(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a project laid out as Celery's docs show: the app in one module, its tasks in a
    # module the app includes (imported by a worker, not yet by a client process)
    project = f"limits_project_{uuid.uuid4().hex[:8]}"
    root = Path(str(tmp_path))
    (root / f"{project}_app.py").write_text(
        "from celery import Celery\n"
        f"app = Celery('{project}', broker='memory://', include=['{project}_tasks'])\n"
        f"app.conf.caps_url = 'sqlite:///{root}/caps.db'\n"
    )
    (root / f"{project}_tasks.py").write_text(
        "from celery_caps import Cap, CappedTask\n"
        f"from {project}_app import app\n"
        "@app.task(base=CappedTask, cap=[Cap('provider', 3), Cap('tenant', 1, key=lambda tenant: tenant)])\n"
        "def work(tenant):\n"
        "    return tenant\n"
    )
    monkeypatch.syspath_prepend(str(root))
    app = importlib.import_module(f"{project}_app").app
    try:
        # When: the client process sets limits with the Python call
        # Then: the included module's caps are known, and a key of a cap without one is refused
        assert set_limit(app, "provider", 2).limit == 2
        assert set_limit(app, "tenant:acme", 5).limit == 5
        with pytest.raises(
            ConfigurationError, match="cap 'provider' has no key function, so 'provider:x' names no slot"
        ):
            set_limit(app, "provider:x", 2)
        with pytest.raises(ConfigurationError, match="at most 2147483647"):
            set_limit(app, "provider", 2**31)
        with pytest.raises(ConfigurationError, match="a cap's name is a string"):
            set_limit(app, 7, 2)  # type: ignore[arg-type]
        assert runtime_for(app).store.limits() == {"provider": 2, "tenant:acme": 5}
    finally:
        close_client_app(app)
