"""Part 1: store operations, per store, against the floor and the peers, in the same run.

For each store (SQLite, PostgreSQL, MariaDB, Redis):

* one client: acquire and release latency (p50/p99) and pairs per second, next
  to the bare round trip (``SELECT 1`` / ``PING``), a naive ``FOR UPDATE``
  transaction (SQLAlchemy and bare driver) or dramatiq's ``ConcurrentRateLimiter``;
* 16 and 64 contenders on one slot name with limit 4 (holders keep the slot
  1 ms, refused clients try again after 1 ms), the cap checked while measuring,
  next to the peer under the same load;
* 64 clients on 64 distinct slot names;
* one client and 64 distinct clients again with 10,000 other slot names (each
  with a live lease) in the store, side by side with the nearly empty store.

Every round runs all measurements in a rotated order (reversed every other
round); figures are medians over rounds, ratios are medians of per-round ratios.
PostgreSQL tables are vacuumed before every round (see ``clients.vacuum_database``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .clients import ClientPool, Job, Outcome, StoreTarget, populate_slot_names, store_targets
from .common import Figure, Options, Report, at_least, at_most, median, ms, ratio

PART = "store"
CAP_LIMIT = 4
HOLD_SECONDS = 0.001
RETRY_PAUSE_SECONDS = 0.001
EXISTING_SLOT_NAMES = 10_000

#: The issue's targets for one client, milliseconds (p50).
ACQUIRE_TARGETS_MS = {"postgresql": 0.5, "redis": 0.15}
RELEASE_TARGETS_MS = {"postgresql": 0.3}


def run(report: Report, options: Options) -> None:
    targets, skipped = store_targets(options.stores, options.run_prefix + "s", options.tmp_dir)
    for note in skipped:
        report.note(f"store benchmarks skip {note}")
    for target in targets:
        options.log(f"[store] {target.name}: preparing")
        target.prepare()
        target.vacuum(full=True)
        names = [f"{target.run_prefix}-k{i:05d}" for i in range(EXISTING_SLOT_NAMES)]
        populate_slot_names(target, "keys", names, CAP_LIMIT)
        pool = ClientPool(target, 64)
        try:
            measure_store(report, options, target, pool)
        except Exception as exc:  # the next store still runs
            report.note(f"store benchmarks on {target.name} failed: {type(exc).__name__}: {str(exc)[:300]}")
            options.log(f"[store] {target.name}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            pool.close()
            target.cleanup()


def single_jobs(target: StoreTarget) -> dict[str, Job]:
    """The one-client measurements of ``target``: name -> job."""
    slot = f"{target.run_prefix}-one"
    jobs = {
        "roundtrip": Job("roundtrip", slot=slot),
        "caps": Job("caps", slot=slot, limit=CAP_LIMIT),
        "caps@10k": Job("caps", variant="keys", slot=slot, limit=CAP_LIMIT),
    }
    if target.kind == "sql":
        jobs["roundtrip-sa"] = Job("roundtrip-sa", slot=slot)
        jobs["naive"] = Job("naive", slot=slot, limit=CAP_LIMIT)
        jobs["naive-raw"] = Job("naive-raw", slot=slot, limit=CAP_LIMIT)
    else:
        jobs["dramatiq"] = Job("dramatiq", slot=slot, limit=CAP_LIMIT)
    return jobs


def crowd_jobs(target: StoreTarget) -> dict[str, tuple[int, Job]]:
    """The many-client measurements: name -> (clients, job)."""
    peer = "naive" if target.kind == "sql" else "dramatiq"
    jobs: dict[str, tuple[int, Job]] = {}
    for clients in (16, 64):
        for adapter in ("caps", peer):
            jobs[f"{adapter} x{clients}"] = (
                clients,
                Job(
                    adapter,
                    slot=f"{target.run_prefix}-hot{clients}",
                    limit=CAP_LIMIT,
                    hold=HOLD_SECONDS,
                    retry_pause=RETRY_PAUSE_SECONDS,
                    check=True,
                ),
            )
    for variant, label in (("main", "distinct x64"), ("keys", "distinct x64@10k")):
        jobs[label] = (64, Job("caps", variant=variant, slot=f"{target.run_prefix}-d", limit=CAP_LIMIT, distinct=True))
    return jobs


def measure_store(report: Report, options: Options, target: StoreTarget, pool: ClientPool) -> None:
    singles = single_jobs(target)
    crowds = crowd_jobs(target)
    single_seconds = 0.3 if options.quick else 0.8
    crowd_seconds = 0.4 if options.quick else 1.0
    results: dict[str, list[Outcome]] = defaultdict(list)
    # One-client figures first, then the crowds: a crowd leaves the server busy
    # (dead rows, autovacuum) for a few seconds, which must not land on one side
    # of a one-client comparison only.
    for round_index in range(options.rounds):
        target.vacuum()
        for name in _order(list(singles), round_index):
            results[name].append(pool.run(1, singles[name], single_seconds))
    options.log(f"[store] {target.name}: one-client rounds done")
    for round_index in range(options.rounds):
        target.vacuum()
        for name in _order(list(crowds), round_index):
            clients, job = crowds[name]
            time.sleep(0.3)  # let the previous crowd's connections and processes settle
            results[name].append(pool.run(clients, job, crowd_seconds))
        options.log(f"[store] {target.name}: crowd round {round_index + 1}/{options.rounds} done")
    report_store(report, target, results)


def _order(names: list[str], round_index: int) -> list[str]:
    """Rotated each round and reversed every other one, so no measurement always follows the same one."""
    shift = round_index % len(names)
    rotated = names[shift:] + names[:shift]
    return rotated if round_index % 2 == 0 else rotated[::-1]


def _per_round(outcomes: list[Outcome], value: Callable[[Outcome], float]) -> list[float]:
    return [value(outcome) for outcome in outcomes]


def _paired(a: list[Outcome], b: list[Outcome], value: Callable[[Outcome], float]) -> list[float]:
    return [ratio(value(x), value(y)) for x, y in zip(a, b, strict=True)]


def report_store(report: Report, target: StoreTarget, results: dict[str, list[Outcome]]) -> None:
    name = target.name
    peer = "naive" if target.kind == "sql" else "dramatiq"
    peer_label = {"sql": "naive FOR UPDATE (SQLAlchemy)", "redis": "dramatiq ConcurrentRateLimiter"}[target.kind]
    if target.name == "sqlite":
        peer_label = "naive BEGIN IMMEDIATE (SQLAlchemy)"
    floor_label = "PING" if target.kind == "redis" else "SELECT 1 (driver)"

    def p50(which: str) -> Callable[[Outcome], float]:
        return lambda outcome: ms(outcome.p(which, 0.5))

    def p99(which: str) -> Callable[[Outcome], float]:
        return lambda outcome: ms(outcome.p(which, 0.99))

    def add(figure_name: str, values: list[float], unit: str, **kwargs: Any) -> Figure:
        return report.add(Figure(PART, f"{name}: {figure_name}", median(values), unit, repeats=values, **kwargs))

    floor = _per_round(results["roundtrip"], p50("granted"))
    add("round trip p50", floor, "ms", versus=f"the floor: {floor_label}")
    if target.kind == "sql":
        sa_floor = _per_round(results["roundtrip-sa"], p50("granted"))
        add(
            "SELECT 1 in a SQLAlchemy transaction p50",
            sa_floor,
            "ms",
            versus=f"{floor_label} {median(floor):.3f} ms",
            ratio=median(_paired(results["roundtrip-sa"], results["roundtrip"], p50("granted"))),
        )

    peer_acquire = median(_per_round(results[peer], p50("granted")))
    peer_release = median(_per_round(results[peer], p50("released")))
    acquire = _per_round(results["caps"], p50("granted"))
    target_ms = ACQUIRE_TARGETS_MS.get(name)
    add(
        "acquire p50, 1 client",
        acquire,
        "ms",
        versus=f"{peer_label} {peer_acquire:.3f} ms",
        ratio=median(_paired(results["caps"], results[peer], p50("granted"))),
        target=f"<= {target_ms} ms" if target_ms else "",
        met=at_most(median(acquire), target_ms) if target_ms else None,
        detail={"in_round_trips": median(_paired(results["caps"], results["roundtrip"], p50("granted")))},
    )
    if target.name != "sqlite":  # SQLite's "round trip" is a function call
        add(
            "acquire p50 in round trips",
            _paired(results["caps"], results["roundtrip"], p50("granted")),
            "x",
            versus=f"{floor_label} {median(floor):.3f} ms",
        )
    add("acquire p99, 1 client", _per_round(results["caps"], p99("granted")), "ms",
        versus=f"{peer_label} p99 {median(_per_round(results[peer], p99('granted'))):.3f} ms",
        ratio=median(_paired(results["caps"], results[peer], p99("granted"))))  # fmt: skip
    release = _per_round(results["caps"], p50("released"))
    release_target = RELEASE_TARGETS_MS.get(name)
    add(
        "release p50, 1 client",
        release,
        "ms",
        versus=f"{peer_label} {peer_release:.3f} ms",
        ratio=median(_paired(results["caps"], results[peer], p50("released"))),
        target=f"<= {release_target} ms" if release_target else "",
        met=at_most(median(release), release_target) if release_target else None,
    )
    add("release p99, 1 client", _per_round(results["caps"], p99("released")), "ms",
        versus=f"{peer_label} p99 {median(_per_round(results[peer], p99('released'))):.3f} ms",
        ratio=median(_paired(results["caps"], results[peer], p99("released"))))  # fmt: skip
    add(
        "pairs/s, 1 client",
        _per_round(results["caps"], Outcome.rate),
        "/s",
        versus=f"{peer_label} {median(_per_round(results[peer], Outcome.rate)):,.0f}/s",
        ratio=median(_paired(results["caps"], results[peer], Outcome.rate)),
    )
    if target.kind == "sql":
        raw_acquire = median(_per_round(results["naive-raw"], p50("granted")))
        raw_release = median(_per_round(results["naive-raw"], p50("released")))
        add(
            "naive FOR UPDATE acquire p50 (SQLAlchemy)",
            _per_round(results["naive"], p50("granted")),
            "ms",
            versus=f"same statements, bare driver {raw_acquire:.3f} ms",
            ratio=median(_paired(results["naive"], results["naive-raw"], p50("granted"))),
            detail={"release_p50_ms": peer_release, "raw_release_p50_ms": raw_release},
        )
        add(
            "naive FOR UPDATE release p50 (SQLAlchemy)",
            _per_round(results["naive"], p50("released")),
            "ms",
            versus=f"bare driver {raw_release:.3f} ms",
            ratio=median(_paired(results["naive"], results["naive-raw"], p50("released"))),
        )
        add(
            "acquire p50 vs bare-driver naive",
            _paired(results["caps"], results["naive-raw"], p50("granted")),
            "x",
            versus=f"naive FOR UPDATE, bare driver {raw_acquire:.3f} ms",
        )
    else:
        add(
            "dramatiq acquire p50 (1 client)",
            _per_round(results["dramatiq"], p50("granted")),
            "ms",
            versus=f"PING {median(floor):.3f} ms",
            ratio=median(_paired(results["dramatiq"], results["roundtrip"], p50("granted"))),
            detail={"release_p50_ms": peer_release},
        )

    # Contention on one slot name, limit 4.
    for clients in (16, 64):
        ours, theirs = results[f"caps x{clients}"], results[f"{peer} x{clients}"]
        peaks = [outcome.peak for outcome in ours]
        errors = sum(outcome.errors for outcome in ours)
        add(
            f"{clients} contenders, limit {CAP_LIMIT}: granted/s",
            _per_round(ours, Outcome.rate),
            "/s",
            versus=f"{peer_label} {median(_per_round(theirs, Outcome.rate)):,.0f}/s",
            ratio=median(_paired(ours, theirs, Outcome.rate)),
            detail={"errors": errors, "peer_peaks": [outcome.peak for outcome in theirs]},
        )
        add(
            f"{clients} contenders: attempt p50 / p99",
            _per_round(ours, p50("attempts")),
            "ms",
            versus=f"p99 {median(_per_round(ours, p99('attempts'))):.2f} ms; "
            f"peer p50 {median(_per_round(theirs, p50('attempts'))):.2f} ms",
            ratio=median(_paired(ours, theirs, p50("attempts"))),
            detail={"p99_ms": _per_round(ours, p99("attempts"))},
        )
        add(
            f"{clients} contenders: peak holders seen",
            [float(peak) for peak in peaks],
            "count",
            versus=f"limit {CAP_LIMIT} (errors: {errors})",
            target=f"<= {CAP_LIMIT}",
            met=max(peaks) <= CAP_LIMIT and errors == 0,
        )

    # 64 clients on 64 slot names; and with 10,000 other names in the store.
    main, keys = results["distinct x64"], results["distinct x64@10k"]
    add(
        "64 clients, 64 keys: pairs/s",
        _per_round(main, Outcome.rate),
        "/s",
        versus=f"1 client {median(_per_round(results['caps'], Outcome.rate)):,.0f}/s",
        ratio=median(_paired(main, results["caps"], Outcome.rate)),
        detail={"acquire_p50_ms": _per_round(main, p50("granted")), "acquire_p99_ms": _per_round(main, p99("granted"))},
    )
    growth = median(_paired(results["caps@10k"], results["caps"], p50("granted")))
    add(
        "acquire p50, 1 client, 10k slot names",
        _per_round(results["caps@10k"], p50("granted")),
        "ms",
        versus=f"nearly empty store {median(acquire):.3f} ms",
        ratio=growth,
        target="ratio <= 1.2 (no growth)",
        met=at_most(growth, 1.2),
    )
    throughput = median(_paired(keys, main, Outcome.rate))
    add(
        "64 clients, 64 keys, 10k slot names: pairs/s",
        _per_round(keys, Outcome.rate),
        "/s",
        versus=f"nearly empty store {median(_per_round(main, Outcome.rate)):,.0f}/s",
        ratio=throughput,
        target="ratio >= 0.83 (no growth)",
        met=at_least(throughput, 1 / 1.2),
    )
