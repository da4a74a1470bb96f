"""Part 4: how admission cost grows with contenders, slot names and held leases; renewal cost.

Per store:

* contenders 1 -> 64 on one slot name with limit 4 (holders keep it 1 ms,
  refused clients retry after 1 ms): attempt latency p50/p99 and grants/s;
* slot names 10 -> 10,000 (each with a live lease), one client admitting into
  them in turn: acquire p50/p99 against 10 names;
* held leases 0 -> 10,000 on the slot being admitted into (its limit above
  them): acquire p50/p99 against none held;
* renewal of 100 running tasks' leases, as one worker's lease keeper does it
  (one ``renew`` call), against renewing them one call per task.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from .clients import (
    LEASE_SECONDS,
    ClientPool,
    Job,
    Outcome,
    StoreTarget,
    populate_leases,
    populate_slot_names,
    store_targets,
)
from .common import Figure, Options, Report, median, ms, percentile, ratio
from .store_ops import CAP_LIMIT, HOLD_SECONDS, RETRY_PAUSE_SECONDS

PART = "scaling"


def run(report: Report, options: Options) -> None:
    targets, skipped = store_targets(options.stores, options.run_prefix + "c", options.tmp_dir)
    for note in skipped:
        report.note(f"scaling benchmarks skip {note}")
    for target in targets:
        options.log(f"[scaling] {target.name}: preparing")
        target.prepare()
        target.vacuum(full=True)
        pool = ClientPool(target, 64)
        try:
            for measure in (contenders, slot_names, held_leases):
                target.vacuum()
                measure(report, options, target, pool)
            target.vacuum()
            renewal(report, options, target)
        except Exception as exc:  # the next store still runs
            report.note(f"scaling benchmarks on {target.name} failed: {type(exc).__name__}: {str(exc)[:300]}")
            options.log(f"[scaling] {target.name}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            pool.close()
            target.cleanup()


def _seconds(options: Options) -> float:
    return 0.25 if options.quick else 0.6


def _series(
    report: Report,
    target: StoreTarget,
    label: str,
    steps: list[int],
    outcomes: dict[int, list[Outcome]],
    value: Callable[[Outcome], float],
    unit: str,
    versus_step: int,
    what: str,
) -> None:
    base = median(value(outcome) for outcome in outcomes[versus_step])
    for step in steps:
        values = [value(outcome) for outcome in outcomes[step]]
        p99 = median(ms(outcome.p(what, 0.99)) for outcome in outcomes[step])
        report.add(
            Figure(
                PART,
                f"{target.name}: {label} = {step:,}",
                median(values),
                unit,
                versus=f"at {versus_step:,}: {base:.3f} {unit}; p99 here {p99:.2f} ms",
                ratio=ratio(median(values), base),
                repeats=values,
                detail={"p99_ms": [ms(outcome.p(what, 0.99)) for outcome in outcomes[step]]},
            )
        )


def contenders(report: Report, options: Options, target: StoreTarget, pool: ClientPool) -> None:
    steps = [1, 4, 16, 64] if options.quick else [1, 2, 4, 8, 16, 32, 64]
    outcomes: dict[int, list[Outcome]] = {step: [] for step in steps}
    job = Job(
        "caps",
        slot=f"{target.run_prefix}-ladder",
        limit=CAP_LIMIT,
        hold=HOLD_SECONDS,
        retry_pause=RETRY_PAUSE_SECONDS,
        check=True,
    )
    for round_index in range(options.rounds):
        order = steps if round_index % 2 == 0 else list(reversed(steps))
        for step in order:
            outcomes[step].append(pool.run(step, job, _seconds(options)))
    _series(report, target, "attempt p50, contenders", steps, outcomes,
            lambda outcome: ms(outcome.p("attempts", 0.5)), "ms", 1, "attempts")  # fmt: skip
    peaks = [outcome.peak for values in outcomes.values() for outcome in values]
    rates = {step: median(outcome.rate() for outcome in outcomes[step]) for step in steps}
    report.add(
        Figure(
            PART,
            f"{target.name}: grants/s by contenders (limit {CAP_LIMIT}, hold 1 ms)",
            rates[steps[-1]],
            "/s",
            versus=", ".join(f"{step}: {rate:,.0f}" for step, rate in rates.items()),
            ratio=ratio(rates[steps[-1]], rates[steps[0]]),
            target=f"peak holders <= {CAP_LIMIT}",
            met=max(peaks) <= CAP_LIMIT,
            detail={"peaks": peaks},
        )
    )
    options.log(f"[scaling] {target.name}: contenders done")


def slot_names(report: Report, options: Options, target: StoreTarget, pool: ClientPool) -> None:
    steps = [10, 1000] if options.quick else [10, 100, 1000, 10_000]
    names = [f"{target.run_prefix}-n{i:05d}" for i in range(steps[-1])]
    outcomes: dict[int, list[Outcome]] = {step: [] for step in steps}
    populated = 0
    for step in steps:
        populate_slot_names(target, "main", names[populated:step], CAP_LIMIT)
        populated = step
        job = Job("caps", limit=CAP_LIMIT, keys=names[:step])
        for _ in range(options.rounds):
            outcomes[step].append(pool.run(1, job, _seconds(options)))
    _series(report, target, "acquire p50, slot names", steps, outcomes,
            lambda outcome: ms(outcome.p("granted", 0.5)), "ms", steps[0], "granted")  # fmt: skip
    options.log(f"[scaling] {target.name}: slot names done")


def held_leases(report: Report, options: Options, target: StoreTarget, pool: ClientPool) -> None:
    steps = [0, 1000] if options.quick else [0, 100, 1000, 10_000]
    slot = f"{target.run_prefix}-held"
    outcomes: dict[int, list[Outcome]] = {step: [] for step in steps}
    held = 0
    limit = steps[-1] + 1000
    for step in steps:
        hold_leases(target, slot, held, step, limit)
        held = step
        job = Job("caps", slot=slot, limit=limit)
        for _ in range(options.rounds):
            outcomes[step].append(pool.run(1, job, _seconds(options)))
    _series(report, target, "acquire p50, leases held on the slot", steps, outcomes,
            lambda outcome: ms(outcome.p("granted", 0.5)), "ms", 0, "granted")  # fmt: skip
    options.log(f"[scaling] {target.name}: held leases done")


def hold_leases(target: StoreTarget, slot: str, start: int, stop: int, limit: int) -> None:
    """Live leases ``start..stop`` on ``slot``, each of its own task id."""
    if stop > start:
        populate_leases(target, "main", slot, [f"held-{index}" for index in range(start, stop)], limit)


def renewal(report: Report, options: Options, target: StoreTarget) -> None:
    """One worker's lease keeper renewing 100 running tasks: one call, against one call per task."""
    store = target.open("main")
    tasks = 100
    repeats = 30 if options.quick else 100
    slot = f"{target.run_prefix}-renew"
    try:
        run_ids = [f"renew-{uuid.uuid4().hex}" for _ in range(tasks)]
        for run_id in run_ids:
            store.acquire({slot: tasks * 2}, run_id, run_id, "bench", LEASE_SECONDS)
        batched: list[list[float]] = []
        single: list[list[float]] = []
        for _ in range(options.rounds):
            batch_times, single_times = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                renewed = store.renew(run_ids, LEASE_SECONDS)
                batch_times.append(time.perf_counter() - started)
                if sum(renewed.values()) != tasks:
                    raise RuntimeError(f"{target.name}: renewed {sum(renewed.values())} of {tasks} leases")
            for _ in range(max(repeats // 10, 3)):
                started = time.perf_counter()
                for run_id in run_ids:
                    store.renew([run_id], LEASE_SECONDS)
                single_times.append(time.perf_counter() - started)
            batched.append(batch_times)
            single.append(single_times)
        batch_p50 = [ms(percentile(values, 0.5)) for values in batched]
        batch_p99 = [ms(percentile(values, 0.99)) for values in batched]
        single_p50 = [ms(percentile(values, 0.5)) for values in single]
        report.add(
            Figure(
                PART,
                f"{target.name}: renew {tasks} running tasks' leases, one call (p50)",
                median(batch_p50),
                "ms",
                versus=f"one call per task {median(single_p50):.2f} ms; p99 {median(batch_p99):.2f} ms",
                ratio=median([ratio(a, b) for a, b in zip(batch_p50, single_p50, strict=True)]),
                repeats=batch_p50,
                detail={
                    "p99_ms": batch_p99,
                    "one_call_per_task_ms": single_p50,
                    "per_lease_ms": median(batch_p50) / tasks,
                },
            )
        )
        for run_id in run_ids:
            store.release(run_id)
    finally:
        store.close()
    options.log(f"[scaling] {target.name}: renewal done")
