"""Part 5: growth curves, per store: what a step costs as the work grows (issue 27).

For each store (SQLite, PostgreSQL, MariaDB, Redis), one client, medians:

* a waiting list of 100, 10,000 and 100,000 waiters on one slot (limit 1): a worker's recovery
  pass with nothing to dispatch (the slot full; :func:`celery_caps.handover.recover` calls
  ``recover`` with the app's caps and task names), the same pass over every cap, and what
  another client waits while the worker's pass runs over and over; the hand-over
  (``release_and_wake`` of the holder: the oldest waiter is dispatched, then claims the slot and
  holds it for the next hand-over) and a park at the end of the list;
* 10, 10,000 and 100,000 keyed slot names, each with a live lease: the sweep with nothing
  expired, the beat's whole work (:func:`celery_caps.sweep.sweep_store`), and what another client
  waits meanwhile: the longest acquire+release of a client on its own slot while the beat's work
  runs over and over, next to the same client's longest with no beat (same duration); at the
  largest, ``status()`` (``celery caps status``) idle and while clients acquire and release on
  keys of their own;
* 1, 2, 4 and 8 clients on distinct keys at 100,000 slot names: acquire+release pairs per second;
* 10 and 10,000 keys of one cap that wait (limit 1, each held, one waiter each): the hand-over
  on one key (release, the key's waiter dispatched, its claim, a new park on that key) and a
  worker's recovery pass with nothing to dispatch.

Ratios are against the smallest size measured in the same run.  The lists and key sets are
filled in bulk with the store's own rows (SQL) or through the store (Redis).  SQL stores get
databases of their own (named after the run), dropped at the end.  PostgreSQL's tables are
vacuumed before each point (autovacuum may be off on the server).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from celery_caps.stores import SlotStore
from celery_caps.stores.base import ParkingStore, ParkOutcome, ParkRequest
from celery_caps.stores.sql import SQLStore
from celery_caps.sweep import sweep_store

from .clients import ClientPool, Job, Outcome, StoreTarget, populate_slot_names, store_targets
from .common import Figure, Options, Report, at_most, median, ms, percentile, ratio

PART = "growth"
WAITLIST_SIZES = (100, 10_000, 100_000)
KEY_SIZES = (10, 10_000, 100_000)
#: Keys of one cap that have a waiter each (issue 35: a hand-over must not cost more when 10,000
#: keys wait than when 10 do).
WAITING_KEY_SIZES = (10, 10_000)
CLIENTS = (1, 2, 4, 8)
#: Hand-over cycles run before each list size's measured ones.
WARM_UP_CYCLES = 5
#: The beat's threshold of keys per cap (the setting's default).
KEY_WARNING_THRESHOLD = 1000
#: Pause between two runs of the beat's work (or of a recovery pass) while another client is
#: watched (a real beat runs it once a minute, a worker's recovery every 2 s; this is many runs
#: under one measurement).
BEAT_PAUSE_SECONDS = 0.05
#: The task names a worker's recovery passes with its caps (the app's tasks: the waiters' among
#: them, as a worker that parked them knows them).
WORKER_TASK_NAMES = ("bench.other", "bench.waiter", "celery_caps.sweep")
#: Clients acquiring and releasing on keys of their own while ``status()`` is timed under load
#: (one: on a 2-core machine more would measure the CPU they take, not the store).
STATUS_LOAD_CLIENTS = 1
#: What the issue measured before (0dbc7ea), milliseconds, for the "versus" column.
BEFORE = {
    "hand-over": {"postgresql": "0.33 → 0.37 → 0.39", "redis": "0.24 flat", "mariadb": "3.0 → 11 → 87",
                  "sqlite": "0.62 → 6.1 → 58"},
    "park": {"postgresql": "0.41 → 1.15 → 7.2", "redis": "0.17 flat", "mariadb": "1.4 → 3.0 → 16",
             "sqlite": "0.42 → 1.3 → 9.2"},
    "sweep": {"postgresql": "0.24 → 46", "redis": "0.04 flat", "mariadb": "0.28 → 67", "sqlite": "0.06 → 7.8"},
    "status": {"postgresql": "629", "redis": "951 (server blocked ~0.46 s)", "mariadb": "451",
               "sqlite": "267 (write lock held 0.33 s)"},
}  # fmt: skip
#: What issue 37 measured before its item 3 (e261afd), milliseconds.
BEFORE_37 = {
    "recovery, every cap": {"postgresql": "0.75 → 14.9", "mariadb": "0.62 → 21.3"},
    "beat": {"postgresql": "28", "mariadb": "97", "sqlite": "43", "redis": "438"},
}


def run(report: Report, options: Options) -> None:
    waitlist_sizes = WAITLIST_SIZES[:2] if options.quick else WAITLIST_SIZES
    key_sizes = KEY_SIZES[:2] if options.quick else KEY_SIZES
    targets, skipped = store_targets(options.stores, options.run_prefix + "g", options.tmp_dir, growth=True)
    for note in skipped:
        report.note(f"growth benchmarks skip {note}")
    # The beat warns about the benchmark's 100,000 keys at each run: not worth a line each.
    logging.getLogger("celery_caps.sweep").setLevel(logging.ERROR)
    for target in targets:
        try:
            target.prepare()
            measure_waitlist(report, options, target, waitlist_sizes)
            measure_keys(report, options, target, key_sizes)
            measure_waiting_keys(report, options, target, WAITING_KEY_SIZES)
            measure_waiting_fair_keys(report, options, target, WAITING_KEY_SIZES)
        except Exception as exc:  # the next store still runs
            report.note(f"growth benchmarks on {target.name} failed: {type(exc).__name__}: {str(exc)[:300]}")
            options.log(f"[growth] {target.name}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            target.cleanup()
            target.drop_databases()


# -- the waiting list -----------------------------------------------------------------------------


def _timed(call: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = call(*args)
    return time.perf_counter() - start, result


def fill_waitlist(store: SlotStore, slots: Sequence[str], per_slot: int, first_from: float) -> None:
    """``per_slot`` waiters of each of ``slots`` (limit 1), first deferred at ``first_from``, +1,
    ...: the SQL store's own rows in bulk (and its list counts where the schema keeps them), parks
    on Redis."""
    waiters = [(slot, f"{slot}-w{i:07d}") for slot in slots for i in range(per_slot)]
    if isinstance(store, SQLStore):
        from celery_caps.stores.sql import schema

        exact = store.dialect.exact
        with store.engine.begin() as connection:
            now = connection.execute(sa.text(f"SELECT {store.dialect.now}")).scalar_one()
            rows = [
                {
                    "slot": exact(slot),
                    "task_id": exact(task_id),
                    "slot_count": 1,
                    "first_deferred_at": first_from + i,
                    "parked_at": now,
                    "task_name": "bench.waiter",
                    "payload": b"payload",
                    "dispatches": 0,
                }
                for i, (slot, task_id) in enumerate(waiters)
            ]
            for start in range(0, len(rows), 5000):
                connection.execute(schema.concurrency_waiters.insert(), rows[start : start + 5000])
            counts = schema.metadata.tables.get("concurrency_waitlists")
            if counts is not None:
                count_rows = [{"slot": exact(slot), "entries": per_slot} for slot in slots]
                for start in range(0, len(count_rows), 5000):
                    connection.execute(counts.insert(), count_rows[start : start + 5000])
        return
    assert isinstance(store, ParkingStore)
    for i, (slot, task_id) in enumerate(waiters):
        request = ParkRequest(
            {slot: 1}, task_id, uuid.uuid4().hex, "bench", 60.0, first_from + i, 10**9, "bench.waiter", b"payload"
        )
        store.park(request)


def measure_waitlist(report: Report, options: Options, target: StoreTarget, sizes: tuple[int, ...]) -> None:
    samples = 40 if options.quick else 150
    passes = 15 if options.quick else 40
    watch_seconds = 1.5 if options.quick else 4.0
    hand_over: dict[int, list[float]] = {}
    parks: dict[int, list[float]] = {}
    claims: dict[int, list[float]] = {}
    recovery: dict[int, list[float]] = {}
    recovery_all: dict[int, list[float]] = {}
    waits: dict[int, tuple[list[float], list[float], int]] = {}
    store = target.open("waiters")
    assert isinstance(store, ParkingStore)
    try:
        for size in sizes:
            slot = f"{target.run_prefix}-wl{size}"
            holder = uuid.uuid4().hex
            store.acquire({slot: 1}, f"{slot}-holder", holder, "bench", 600.0)
            options.log(f"[growth] {target.name}: filling a list of {size:,}")
            fill_waitlist(store, [slot], size, 1000.0)
            target.vacuum_store("waiters")

            # A worker's recovery pass with nothing to do (the slot is full), as handover.recover
            # makes it: the app's caps and task names, no maximum wait (the default).
            def worker_pass(store: ParkingStore = store, slot: str = slot) -> None:
                if store.recover(60.0, caps=[slot], task_names=WORKER_TASK_NAMES, readmit_before=None):
                    raise RuntimeError("a recovery pass with nothing to do dispatched a waiter")

            def every_cap(store: ParkingStore = store) -> None:
                if store.recover(60.0, readmit_before=None):
                    raise RuntimeError("a recovery pass with nothing to do dispatched a waiter")

            worker_pass()  # (a new session's first statements are not counted)
            recovery[size] = [ms(_timed(worker_pass)[0]) for _ in range(passes)]
            recovery_all[size] = [ms(_timed(every_cap)[0]) for _ in range(passes)]
            other = f"{target.run_prefix}-other-wl{size}"
            quiet, _ = _another_client(target, "waiters", other, watch_seconds, None)
            busy, runs = _another_client(target, "waiters", other, watch_seconds, worker_pass)
            waits[size] = (busy, quiet, runs)
            options.log(
                f"[growth] {target.name}: {size:,} waiters: recovery pass {median(recovery[size]):.3f} ms "
                f"(every cap {median(recovery_all[size]):.3f} ms), another client's longest pair {max(busy):.1f} ms "
                f"with it ({runs} passes), {max(quiet):.1f} ms without"
            )
            hand_over[size], parks[size], claims[size] = [], [], []
            for i in range(-WARM_UP_CYCLES, samples):
                # (The first cycles are not counted: a new session compiles PostgreSQL's functions.)
                seconds, (_deleted, woken) = _timed(store.release_and_wake, holder, 600.0)
                hand_over[size].append(ms(seconds))
                [dispatched] = woken
                seconds, _outcome = _timed(store.claim, dispatched.task_id, dispatched.run_id, "bench", 600.0)
                claims[size].append(ms(seconds))
                holder = dispatched.run_id
                request = ParkRequest(
                    {slot: 1}, f"{slot}-late{i:05d}", uuid.uuid4().hex, "bench", 60.0, 1e9 + i, 10**9,
                    "bench.waiter", b"payload",
                )  # fmt: skip
                seconds, _outcome = _timed(store.park, request)
                parks[size].append(ms(seconds))
                if i < 0:
                    for values in (hand_over[size], claims[size], parks[size]):
                        values.pop()
            options.log(
                f"[growth] {target.name}: {size:,} waiters: hand-over {median(hand_over[size]):.3f} ms, "
                f"park {median(parks[size]):.3f} ms, claim {median(claims[size]):.3f} ms"
            )
    finally:
        store.close()
    smallest, largest = sizes[0], sizes[-1]
    for what, values in (("recovery pass, a worker's", recovery), ("recovery pass, every cap", recovery_all)):
        for size in sizes:
            growth = ratio(median(values[size]), median(values[smallest]))
            last = size == largest and size != smallest
            before = BEFORE_37.get(what.replace("recovery pass, ", "recovery, "), {}).get(target.name)
            report.add(
                Figure(
                    PART,
                    f"{target.name}: {what} with nothing to dispatch p50, {size:,} waiters on a full slot",
                    median(values[size]),
                    "ms",
                    versus=f"{smallest:,} waiters {median(values[smallest]):.3f} ms"
                    + (f"; before: {before} ms" if before and last else ""),
                    ratio=growth,
                    target="ratio <= 1.3" if last else "",
                    met=at_most(growth, 1.3) if last else None,
                    repeats=values[size],
                )
            )
    for size in sizes:
        busy, quiet, runs = waits[size]
        report.add(_wait_figure(target, f"a worker's recovery passes run, {size:,} waiters", busy, quiet, runs,
                                "recovery passes", size == largest))  # fmt: skip
    for what, values in (("hand-over", hand_over), ("park", parks), ("claim", claims)):
        for size in sizes:
            growth = ratio(median(values[size]), median(values[smallest]))
            last = size == sizes[-1] and size != smallest
            report.add(
                Figure(
                    PART,
                    f"{target.name}: {what} p50, {size:,} waiters",
                    median(values[size]),
                    "ms",
                    versus=f"{smallest:,} waiters {median(values[smallest]):.3f} ms"
                    + (f"; before: {BEFORE[what][target.name]} ms" if what in BEFORE and last else ""),
                    ratio=growth,
                    target="ratio <= 2" if last and what != "claim" else "",
                    met=at_most(growth, 2.0) if last and what != "claim" else None,
                    repeats=values[size],
                )
            )


# -- the key set ----------------------------------------------------------------------------------


def _other_client(target: StoreTarget, variant: str, slot: str, seconds: float, results: Any) -> None:
    """Acquire and release one slot over and over for ``seconds``: each pair's milliseconds."""
    store = target.open(variant)
    try:
        pairs: list[float] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            run_id = uuid.uuid4().hex
            start = time.perf_counter()
            store.acquire({slot: 4}, run_id, run_id, "bench", 60.0)
            store.release(run_id)
            pairs.append(ms(time.perf_counter() - start))
        results.put(pairs)
    finally:
        store.close()


def _another_client(
    target: StoreTarget, variant: str, slot: str, seconds: float, work: Callable[[], Any] | None
) -> tuple[list[float], int]:
    """The other client's acquire+release pairs (ms) while ``work`` (the beat's, a recovery pass)
    runs every :data:`BEAT_PAUSE_SECONDS` (or nothing does), and the runs of ``work``."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    process = context.Process(target=_other_client, args=(target, variant, slot, seconds, results))
    process.start()
    runs = 0
    deadline = time.monotonic() + seconds
    time.sleep(0.2)  # the client connected and warm
    while time.monotonic() < deadline - 0.1:
        if work is not None:
            work()
            runs += 1
        time.sleep(BEAT_PAUSE_SECONDS)
    pairs: list[float] = results.get(timeout=120)
    process.join(timeout=10)
    return pairs, runs


def _churn(target: StoreTarget, slot: str, stop: Any) -> None:
    """Acquire and release keys of ``slot`` (a cap name) over and over until ``stop`` is set."""
    store = target.open("keys")
    try:
        i = 0
        while not stop.is_set():
            run_id = uuid.uuid4().hex
            store.acquire({f"{slot}:k{i % 100}": 4}, run_id, run_id, "bench", 60.0)
            store.release(run_id)
            i += 1
    finally:
        store.close()


def _status_under_load(target: StoreTarget, store: SlotStore, rounds: int) -> list[float]:
    """``status()`` (ms) while :data:`STATUS_LOAD_CLIENTS` clients acquire and release."""
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    clients = [
        context.Process(target=_churn, args=(target, f"{target.run_prefix}-load{i}", stop))
        for i in range(STATUS_LOAD_CLIENTS)
    ]
    for client in clients:
        client.start()
    try:
        time.sleep(0.5)  # the clients connected and churning
        return [ms(_timed(store.status)[0]) for _ in range(rounds)]
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=30)


def _wait_figure(
    target: StoreTarget, what: str, busy: list[float], quiet: list[float], runs: int, runs_name: str, last: bool
) -> Figure:
    return Figure(
        PART,
        f"{target.name}: another client's longest acquire+release while {what}",
        max(busy),
        "ms",
        versus=f"without it {max(quiet):.1f} ms; p99 {percentile(busy, 0.99):.2f} ms with, "
        f"{percentile(quiet, 0.99):.2f} ms without ({runs} {runs_name} meanwhile)",
        ratio=ratio(max(busy), max(quiet)),
        target="<= 10 ms" if last else "",
        met=at_most(max(busy), 10.0) if last else None,
        detail={
            "p99_ms": percentile(busy, 0.99),
            "quiet_p99_ms": percentile(quiet, 0.99),
            "pairs": len(busy),
            "quiet_pairs": len(quiet),
            "runs": runs,
        },
    )


def measure_keys(report: Report, options: Options, target: StoreTarget, sizes: tuple[int, ...]) -> None:
    sweeps = 15 if options.quick else 40
    beats = 3 if options.quick else 7
    watch_seconds = 1.5 if options.quick else 4.0
    sweep: dict[int, list[float]] = {}
    beat: dict[int, list[float]] = {}
    waits: dict[int, tuple[list[float], list[float], int]] = {}
    rates: dict[int, float] = {}
    status_idle: list[float] = []
    status_busy: list[float] = []
    store = target.open("keys")
    present = 0
    other = f"{target.run_prefix}-other"
    try:
        for size in sizes:
            options.log(f"[growth] {target.name}: {size:,} keys")
            names = [f"{target.run_prefix}-cap:k{i:07d}" for i in range(present, size)]
            populate_slot_names(target, "keys", names, 4)
            present = size
            target.vacuum_store("keys")
            store.sweep()  # (a new session's first statements are not counted)
            sweep[size] = [ms(_timed(store.sweep)[0]) for _ in range(sweeps)]
            beat[size] = [ms(_timed(sweep_store, store, KEY_WARNING_THRESHOLD)[0]) for _ in range(beats)]
            quiet, _ = _another_client(target, "keys", other, watch_seconds, None)
            busy, runs = _another_client(
                target, "keys", other, watch_seconds, lambda: sweep_store(store, KEY_WARNING_THRESHOLD)
            )
            waits[size] = (busy, quiet, runs)
            if size == sizes[-1]:
                # celery caps status, idle and while other clients work, interleaved.
                store.status()
                for _ in range(2 if options.quick else 3):
                    status_idle.append(ms(_timed(store.status)[0]))
                    status_busy.extend(_status_under_load(target, store, 1))
            options.log(
                f"[growth] {target.name}: {size:,} keys: sweep {median(sweep[size]):.3f} ms, beat's work "
                f"{median(beat[size]):.1f} ms, another client's longest pair {max(busy):.1f} ms "
                f"(p99 {percentile(busy, 0.99):.1f}) with the beat ({runs} runs), {max(quiet):.1f} ms "
                f"(p99 {percentile(quiet, 0.99):.1f}) without"
            )
        # Clients on distinct keys, at the largest key set.
        pool = ClientPool(target, max(CLIENTS))
        try:
            for clients in CLIENTS:
                outcome: Outcome = pool.run(
                    clients,
                    Job("caps", variant="keys", slot=f"{target.run_prefix}-cap:c", limit=4, distinct=True),
                    0.6 if options.quick else 1.5,
                )
                rates[clients] = outcome.rate()
        finally:
            pool.close()
    finally:
        store.close()
    smallest, largest = sizes[0], sizes[-1]
    for size in sizes:
        growth = ratio(median(sweep[size]), median(sweep[smallest]))
        last = size == largest and size != smallest
        report.add(
            Figure(
                PART,
                f"{target.name}: sweep, nothing expired, {size:,} keys",
                median(sweep[size]),
                "ms",
                versus=f"{smallest:,} keys {median(sweep[smallest]):.3f} ms"
                + (f"; before: {BEFORE['sweep'][target.name]} ms" if last else ""),
                ratio=growth,
                target="ratio <= 2" if last else "",
                met=at_most(growth, 2.0) if last else None,
                repeats=sweep[size],
            )
        )
        beat_growth = ratio(median(beat[size]), median(beat[smallest]))
        report.add(
            Figure(
                PART,
                f"{target.name}: the beat's work (sweep + keys per cap), {size:,} keys",
                median(beat[size]),
                "ms",
                versus=f"{smallest:,} keys {median(beat[smallest]):.3f} ms"
                + (f"; before: {BEFORE_37['beat'][target.name]} ms" if last else ""),
                ratio=beat_growth,
                target="ratio <= 1.3" if last else "",
                met=at_most(beat_growth, 1.3) if last else None,
                repeats=beat[size],
            )
        )
        busy, quiet, runs = waits[size]
        report.add(_wait_figure(target, f"the beat works, {size:,} keys", busy, quiet, runs, "beat runs",
                                size == largest))  # fmt: skip
    status_growth = ratio(median(status_busy), median(status_idle))
    report.add(
        Figure(
            PART,
            f"{target.name}: status() under load ({STATUS_LOAD_CLIENTS} client(s) acquiring and releasing), "
            f"{largest:,} keys",
            median(status_busy),
            "ms",
            versus=f"idle {median(status_idle):.1f} ms",
            ratio=status_growth,
            target="ratio <= 2",
            met=at_most(status_growth, 2.0),
            repeats=status_busy,
            detail={"idle_ms": status_idle},
        )
    )
    for clients in CLIENTS:
        report.add(
            Figure(
                PART,
                f"{target.name}: pairs/s, {clients} client(s) on distinct keys, {largest:,} keys",
                rates[clients],
                "/s",
                versus=f"1 client {rates[1]:,.0f}/s",
                ratio=ratio(rates[clients], rates[1]),
            )
        )


# -- keys that wait ---------------------------------------------------------------------------------


def measure_waiting_keys(report: Report, options: Options, target: StoreTarget, sizes: tuple[int, ...]) -> None:
    """A hand-over on one key of a cap while ``size`` of its keys wait (each held, limit 1, one
    waiter each), in a store of its own: the other parts' rows would blur the figure."""
    samples = 40 if options.quick else 150
    passes = 15 if options.quick else 40
    hand_over: dict[int, list[float]] = {}
    recovery: dict[int, list[float]] = {}
    store = target.open("waiting_keys")
    assert isinstance(store, ParkingStore)
    present = 0
    cap = f"{target.run_prefix}-wk"
    try:
        for size in sizes:
            options.log(f"[growth] {target.name}: {size:,} keys waiting")
            names = [f"{cap}:k{i:07d}" for i in range(present, size)]
            populate_slot_names(target, "waiting_keys", names, 1)
            fill_waitlist(store, names, 1, 1000.0 + present)
            present = size
            target.vacuum_store("waiting_keys")
            # The key handed over: one in the middle of the set (its holder is populate_slot_names').
            slot = f"{cap}:k{size // 2:07d}"
            holder = f"r-{slot}"

            def worker_pass(store: ParkingStore = store) -> None:
                if store.recover(60.0, caps=[cap], task_names=WORKER_TASK_NAMES, readmit_before=None):
                    raise RuntimeError("a recovery pass with nothing to do dispatched a waiter")

            worker_pass()  # (a new session's first statements are not counted)
            recovery[size] = [ms(_timed(worker_pass)[0]) for _ in range(passes)]
            hand_over[size] = _hand_over_cycles(store, slot, holder, samples, lambda i: {}, check=True)
            options.log(
                f"[growth] {target.name}: {size:,} keys waiting: hand-over cycle {median(hand_over[size]):.3f} ms, "
                f"a worker's recovery pass {median(recovery[size]):.3f} ms"
            )
    finally:
        store.close()
    _report_hand_over(
        report, f"{target.name}: hand-over on one key (release, dispatch, claim, park) p50", "keys", hand_over
    )
    smallest = sizes[0]
    for size in sizes:
        report.add(
            Figure(
                PART,
                f"{target.name}: a worker's recovery pass with nothing to dispatch p50, {size:,} keys waiting",
                median(recovery[size]),
                "ms",
                versus=f"{smallest:,} keys waiting {median(recovery[smallest]):.3f} ms",
                ratio=ratio(median(recovery[size]), median(recovery[smallest])),
                repeats=recovery[size],
            )
        )


def measure_waiting_fair_keys(report: Report, options: Options, target: StoreTarget, sizes: tuple[int, ...]) -> None:
    """A hand-over on a fair cap (``Cap(fair_by=...)``, limit 1) while ``size`` fair keys wait in
    its one list (a waiter each), in a store of its own: the release dispatches the head of the
    list, its claim, and the park of a new waiter under one of the waiting keys (its round read
    from the list's head and the key's last entry)."""
    samples = 40 if options.quick else 150
    hand_over: dict[int, list[float]] = {}
    store = target.open("waiting_keys")
    assert isinstance(store, ParkingStore)
    try:
        for size in sizes:
            slot = f"{target.run_prefix}-fair{size}"
            options.log(f"[growth] {target.name}: {size:,} fair keys waiting")
            holder = uuid.uuid4().hex
            if not store.acquire({slot: 1}, f"{slot}-holder", holder, "bench", 3600.0).granted:
                raise RuntimeError(f"{slot} was not free")
            for i in range(size):
                request = ParkRequest(
                    {slot: 1}, f"{slot}-w{i:07d}", uuid.uuid4().hex, "bench", 60.0, 1000.0 + i, 10**9,
                    "bench.waiter", b"payload", fair_keys={slot: f"tenant{i:07d}"},
                )  # fmt: skip
                if store.park(request) is not ParkOutcome.PARKED:
                    raise RuntimeError(f"{request.task_id} did not park")
            target.vacuum_store("waiting_keys")
            # The new waiter's key: one of those waiting, spread over them.
            keys = [f"tenant{(i * 7919) % size:07d}" for i in range(-WARM_UP_CYCLES, samples)]

            def fair_keys_of(cycle: int, slot: str = slot, keys: list[str] = keys) -> dict[str, str]:
                return {slot: keys[cycle + WARM_UP_CYCLES]}

            hand_over[size] = _hand_over_cycles(store, slot, holder, samples, fair_keys_of)
            options.log(
                f"[growth] {target.name}: {size:,} fair keys waiting: hand-over cycle {median(hand_over[size]):.3f} ms"
            )
    finally:
        store.close()
    _report_hand_over(
        report, f"{target.name}: hand-over on a fair cap (release, dispatch, claim, park) p50", "fair keys", hand_over
    )


def _hand_over_cycles(
    store: ParkingStore,
    slot: str,
    holder: str,
    samples: int,
    fair_keys: Callable[[int], dict[str, str]],
    check: bool = False,
) -> list[float]:
    """Time ``samples`` hand-overs of ``slot`` (limit 1) from run ``holder``, in ms: the release
    dispatches the list's first waiter, which claims, and a new waiter (of ``fair_keys(i)``)
    parks; ``check``: the waiter dispatched must be one of the slot's own (named after it)."""
    timings = []
    for i in range(-WARM_UP_CYCLES, samples):
        start = time.perf_counter()
        _deleted, woken = store.release_and_wake(holder, 3600.0)
        [dispatched] = woken
        if check and dispatched.task_id.rpartition("-")[0] != slot:
            raise RuntimeError(f"the release of {slot} dispatched {dispatched.task_id}")
        store.claim(dispatched.task_id, dispatched.run_id, "bench", 3600.0)
        request = ParkRequest(
            {slot: 1}, f"{slot}-late{i + WARM_UP_CYCLES:05d}", uuid.uuid4().hex, "bench", 60.0, 1e9 + i, 10**9,
            "bench.waiter", b"payload", fair_keys=fair_keys(i),
        )  # fmt: skip
        store.park(request)
        if i >= 0:
            timings.append(ms(time.perf_counter() - start))
        holder = dispatched.run_id
    return timings


def _report_hand_over(report: Report, what: str, keys: str, hand_over: dict[int, list[float]]) -> None:
    """The hand-over figures, each size against the smallest; the largest's target: flat."""
    sizes = sorted(hand_over)
    smallest, largest = sizes[0], sizes[-1]
    for size in sizes:
        last = size == largest and size != smallest
        growth = ratio(median(hand_over[size]), median(hand_over[smallest]))
        report.add(
            Figure(
                PART,
                f"{what}, {size:,} {keys} waiting",
                median(hand_over[size]),
                "ms",
                versus=f"{smallest:,} {keys} waiting {median(hand_over[smallest]):.3f} ms",
                ratio=growth,
                target="ratio <= 1.3" if last else "",
                met=at_most(growth, 1.3) if last else None,
                repeats=hand_over[size],
            )
        )
