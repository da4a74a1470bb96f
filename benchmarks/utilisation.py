"""Part 3: how well a binding cap's slots are used, for every waiting strategy the library has,
next to what a user would do without it.

Global: a cap of 4, tasks sleeping 100 ms (by default: ``run.py --task-ms``), a backlog of 400 sent
at once (with ``apply_async``) to two running workers with ``-c 8`` and a prefetch multiplier of 1 (as the
README recommends for capped tasks; one strategy entry measures park with 4).  The ideal is the cap kept
full: ``limit / duration`` = 40 tasks/s, the backlog done in 10 s, task *i* (in publish order) starting ``floor(i / 4) x
100 ms`` after the first (figures for 100 ms tasks).  Reported: achieved throughput / ideal, deferrals
(put-backs) per completed task, broker messages per completed task (the tasks
that reached the broker when sent, plus every put-back or wake copy: 1.0 is the floor), and the wait from publish to
start (p50/p99) next to the ideal schedule's waits.

Per key: 8 tenants with a cap of 1 each and uneven load (a backlog of 240: 75
tasks for the busiest, 9 for the quietest).  Ideal: each tenant runs back to back from the
first start, so tenant *t* is done after ``count_t x 100 ms``.  Reported: slot
utilisation (ideal busy time / achieved time, summed over tenants), the makespan
against the ideal, and fairness: the spread of per-tenant utilisation (min,
max, Jain's index) and of per-tenant median waits against their ideal.

Every waiting strategy the library has is an entry of :data:`STRATEGIES` (backoff
with its default bounds and with tight ones, and park and wake), with the settings
that select it.  Two entries run the global variant on a fleet with no process to spare
(:data:`SMALL_FLEETS`: one worker with ``-c 4`` under the cap of 4), where the cap hardly
binds and every hand-over goes through the freed process itself.  Two more are the
alternatives, measured in the same run (issue 34), with tasks of their own (:data:`TASKS`):
:data:`BASELINE`, what Celery's documentation suggests for a global cap (a queue of its own
consumed by one worker with ``-c 4``, the task uncapped), whose global utilisation every other
strategy's is also divided by; and :data:`SEMAPHORE`, a hand-rolled Redis semaphore whose
task retries after 0.2 s while it is full.  Each trial also counts, from outside, the
transactions the caps store's server ran per completed task (:func:`transaction_counter`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from .benchapp import semaphore_key
from .clients import caps_url_for, drop_slots, vacuum_database
from .common import (
    CpuSteal,
    Figure,
    Options,
    Report,
    at_least,
    at_most,
    median,
    percentile,
    ratio,
    reachable,
    service_url,
)
from .workers import BenchFleet, fleet_env, wait_for

PART = "utilisation"
GLOBAL_LIMIT = 4
#: How long a task sleeps by default, ms (``run.py --task-ms`` sets another).
TASK_MS = 100
WORKERS = 2
CONCURRENCY = 8
#: ``worker_prefetch_multiplier`` of the workers: 1, as the README recommends for capped tasks
#: (a worker whose processes are all busy takes no woken task it cannot start).
PREFETCH = 1
#: Tenant -> share of the per-key backlog (uneven on purpose).
TENANT_WEIGHTS = {"t1": 8, "t2": 6, "t3": 4, "t4": 3, "t5": 2, "t6": 1, "t7": 1, "t8": 1}
UTILISATION_TARGET = 0.97
#: Broker messages per completed task the park strategy should stay under.
MESSAGES_TARGET = 1.1

#: The baseline: a queue of its own, consumed by one worker with as many processes as the global
#: cap has slots, the task uncapped (Celery's documentation's answer to a global cap).
BASELINE = "dedicated queue, 1 worker x -c 4"
#: A hand-rolled Redis semaphore (benchapp.SEMAPHORE_TAKE), the task retried after 0.2 s while it is full.
SEMAPHORE = "redis semaphore + retry 0.2s"

#: Waiting strategies: label -> the worker environment that selects it.
#: (Put back with backoff; the bounds are caps_backoff_min/max_seconds, the first pair the defaults.)
#: The baseline first: the others' utilisation is divided by its own, measured earlier in the run.
STRATEGIES: dict[str, dict[str, str]] = {
    # Uncapped tasks (see TASKS): nothing to select.
    BASELINE: {},
    "backoff 0.5-20s": {
        "CAPS_BENCH_BACKOFF_MIN": "0.5",
        "CAPS_BENCH_BACKOFF_MAX": "20",
        "CAPS_BENCH_EXTRA_CONF": "caps_strategy=backoff",
    },
    "backoff 0.05-1s": {
        "CAPS_BENCH_BACKOFF_MIN": "0.05",
        "CAPS_BENCH_BACKOFF_MAX": "1",
        "CAPS_BENCH_EXTRA_CONF": "caps_strategy=backoff",
    },
    # Park and wake (celery_caps.park): a full cap parks the task in the store's waiting list.
    "park": {"CAPS_BENCH_EXTRA_CONF": "caps_strategy=park"},
    # Park on workers that prefetch 4 messages per process (Celery's default multiplier).
    "park, prefetch 4": {"CAPS_BENCH_EXTRA_CONF": "caps_strategy=park", "CAPS_BENCH_PREFETCH": "4"},
    # Park, with the sender taking its slots, or parking it, as a task is sent.
    "park on publish": {"CAPS_BENCH_EXTRA_CONF": "caps_strategy=park;caps_park_on_publish=True"},
    # Tasks of their own that hold a Redis semaphore (see TASKS): nothing to select.
    SEMAPHORE: {},
    # A fleet with no process to spare: one worker with as many processes as the cap has slots.
    "park, 1 worker x -c 4": {"CAPS_BENCH_EXTRA_CONF": "caps_strategy=park"},
    "backoff 0.05-1s, 1 worker x -c 4": {
        "CAPS_BENCH_BACKOFF_MIN": "0.05",
        "CAPS_BENCH_BACKOFF_MAX": "1",
        "CAPS_BENCH_EXTRA_CONF": "caps_strategy=backoff",
    },
}
#: Strategies measured on another fleet than WORKERS x CONCURRENCY: (workers, processes each).
#: The global variant only (8 tenants of a cap of 1 cannot all run on 4 processes).
SMALL_FLEETS: dict[str, tuple[int, int]] = {
    BASELINE: (1, GLOBAL_LIMIT),
    "park, 1 worker x -c 4": (1, GLOBAL_LIMIT),
    "backoff 0.05-1s, 1 worker x -c 4": (1, GLOBAL_LIMIT),
}
#: The tasks a trial sends, by variant: the capped ones, or those of a strategy named in :data:`TASKS`.
CAPPED_TASKS = {"global": "bench.global", "per-key": "bench.tenant"}
#: Strategies that send other tasks than :data:`CAPPED_TASKS` (they record their runs the same way).
TASKS: dict[str, dict[str, str]] = {
    BASELINE: {"global": "bench.global_uncapped"},
    SEMAPHORE: {"global": "bench.semaphore_global", "per-key": "bench.semaphore_tenant"},
}


def tenant_counts(total: int) -> dict[str, int]:
    weight_sum = sum(TENANT_WEIGHTS.values())
    counts = {tenant: max(1, round(total * weight / weight_sum)) for tenant, weight in TENANT_WEIGHTS.items()}
    counts["t1"] += total - sum(counts.values())
    return counts


class PostgresTransactions:
    """The transactions of the caps database, ``xact_commit + xact_rollback`` in
    ``pg_stat_database``, read from the server's configured database (the reads are not counted).

    A backend reports its counts as it goes idle, but at most once a second: what it ran less
    than a second after its last report it reports once it has been idle for 10 s
    (PostgreSQL's ``PGSTAT_IDLE_INTERVAL``).  A trial's count is read that long after its end.
    """

    settle_seconds = 11.0
    description = (
        "xact_commit + xact_rollback of the caps database (pg_stat_database) from the burst until every "
        "backend reported (11 s after the last run); includes the benchmark's own few statements (the sender's "
        "warm-up) and the workers' recovery calls meanwhile (one every 2 s per worker)"
    )

    def __init__(self, caps_url: str) -> None:
        self.database = sa.engine.make_url(caps_url).database
        self.engine = sa.create_engine(service_url("postgres"), isolation_level="AUTOCOMMIT")

    def count(self) -> int:
        # Autocommit: every read is a transaction of its own, so it sees fresh statistics.
        with self.engine.connect() as connection:
            query = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = :name"
            return int(connection.execute(sa.text(query), {"name": self.database}).scalar_one())

    def close(self) -> None:
        self.engine.dispose()


class RedisScriptCalls:
    """The calls of ``EVAL``, ``EVALSHA`` and ``FCALL`` in the Redis server's ``INFO
    commandstats``: the Redis store's calls are Lua scripts, kombu's broker traffic is not."""

    settle_seconds = 0.0
    description = (
        "EVAL + EVALSHA + FCALL calls (INFO commandstats) over the trial: the store's calls are Lua scripts, "
        "kombu's are not; server-wide, so anyone else's scripts on this Redis count too "
        "(the hand-rolled semaphore's among them)"
    )
    COMMANDS = ("eval", "evalsha", "fcall")

    def __init__(self, caps_url: str) -> None:
        self.client = redis.Redis.from_url(caps_url)

    def count(self) -> int:
        stats = self.client.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{command}", {}).get("calls", 0)) for command in self.COMMANDS)

    def close(self) -> None:
        self.client.close()


def transaction_counter(store: str, caps_url: str) -> PostgresTransactions | RedisScriptCalls | None:
    """What counts ``store``'s transactions from outside, or None for a store without one here."""
    if store == "postgresql":
        return PostgresTransactions(caps_url)
    if store == "redis":
        return RedisScriptCalls(caps_url)
    return None


def run(report: Report, options: Options) -> None:
    broker = service_url("redis")
    if reachable(broker):
        report.note(f"utilisation benchmarks skipped: {reachable(broker)}")
        return
    backlog = 60 if options.quick else 400
    # The per-key backlog is smaller: at the utilisation backoff reaches it is the slow one.
    tenant_backlog = 48 if options.quick else 240
    backlogs = {"global": backlog, "per-key": tenant_backlog}
    repeats = 1 if options.quick else 2
    task_ms = options.utilisation_task_ms or TASK_MS
    for store in [name for name in options.stores if name in options.utilisation_stores]:
        caps_url, why = caps_url_for(store, options)
        if caps_url is None:
            report.note(f"utilisation benchmarks skip {store}: {why}")
            continue
        # The baseline's global trials, once it ran: the other strategies' utilisation is divided by its.
        baseline: list[dict[str, Any]] | None = None
        for number, (strategy, strategy_env) in enumerate(STRATEGIES.items()):
            if options.utilisation_strategies is not None and strategy not in options.utilisation_strategies:
                continue
            prefix = f"{options.run_prefix}u{store[:2]}{number}-"
            # The strategy's settings last: one of them sets its own prefetch.
            env = fleet_env(broker, caps_url, prefix, PREFETCH=PREFETCH, GLOBAL_LIMIT=GLOBAL_LIMIT, TENANT_LIMIT=1)
            env.update(strategy_env)
            vacuum_database(caps_url)
            fleet = BenchFleet(env, Path(options.tmp_dir) / "logs")
            transactions = transaction_counter(store, caps_url)
            workers, concurrency = SMALL_FLEETS.get(strategy, (WORKERS, CONCURRENCY))
            variants = ("global",) if strategy in SMALL_FLEETS else ("global", "per-key")
            tasks = TASKS.get(strategy, CAPPED_TASKS)
            try:
                options.log(f"[utilisation] {store}, {strategy}: starting {workers} workers x -c {concurrency}")
                start_fleet(fleet, workers, concurrency, transactions)
                trials: dict[str, list[dict[str, Any]]] = defaultdict(list)
                for repeat in range(repeats):
                    for variant in variants:
                        trial = run_trial(fleet, variant, tasks[variant], backlogs[variant], task_ms, transactions)
                        trials[variant].append(trial)
                        options.log(
                            f"[utilisation] {store}, {strategy}: {variant} repeat {repeat + 1}/{repeats}: "
                            f"utilisation {trial['utilisation']:.3f}, {trial['deferrals_per_task']:.1f} "
                            f"deferrals/task, CPU steal {trial['cpu_steal']:.1%}"
                        )
                        if not trial["completed"]:
                            # Put-back copies still held by the workers would run in the next trial.
                            fleet.stop()
                            start_fleet(fleet, workers, concurrency, transactions)
                report_strategy(
                    report,
                    store,
                    strategy,
                    trials,
                    backlogs,
                    task_ms=task_ms,
                    baseline=baseline,
                    transactions=transactions.description if transactions is not None else None,
                )
                if strategy == BASELINE:
                    baseline = trials["global"]
            except Exception as exc:  # the next strategy still runs
                report.note(f"utilisation on {store}, {strategy} failed: {type(exc).__name__}: {str(exc)[:300]}")
                options.log(f"[utilisation] {store}, {strategy}: FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                fleet.close()
                drop_slots(caps_url, prefix)
                if transactions is not None:
                    transactions.close()


def start_fleet(
    fleet: BenchFleet, workers: int, concurrency: int, transactions: PostgresTransactions | RedisScriptCalls | None
) -> None:
    """Start ``fleet``'s workers; with ``transactions``, wait until what they ran as they started
    (their pool processes' warm-up) is counted, so that no trial counts it."""
    fleet.start(workers, concurrency)
    if transactions is not None:
        time.sleep(transactions.settle_seconds)


def run_trial(
    fleet: BenchFleet,
    variant: str,
    task: str,
    backlog: int,
    task_ms: int,
    transactions: PostgresTransactions | RedisScriptCalls | None,
) -> dict[str, Any]:
    """Send ``backlog`` tasks ``task`` of ``task_ms`` at once to the consuming fleet, wait until
    they ran, and analyse the runs; ``transactions`` counts the store's over the trial."""
    fleet.reset_records()
    # A semaphore's holders left by a trial that timed out (fleet.close deletes the rest).
    stale = list(fleet.redis.scan_iter(match=semaphore_key(fleet.prefix, "*")))
    if stale:
        fleet.redis.delete(*stale)
    queue = fleet.new_queue()
    if variant == "global":
        calls = [("g", task_ms)] * backlog
        ideal_seconds = math.ceil(backlog / GLOBAL_LIMIT) * task_ms / 1000
    else:
        counts = tenant_counts(backlog)
        calls = [(tenant, task_ms) for tenant, count in counts.items() for _ in range(count)]
        random.Random(7).shuffle(calls)
        ideal_seconds = max(counts.values()) * task_ms / 1000
    # The fleet is running and consuming when the whole backlog is sent at once (with
    # apply_async): what a burst of work does to a fleet.
    publishes_before = fleet.worker_publishes()
    fleet.consume(queue)
    # kombu's Redis transport listens to a queue added by add_consumer from its next BRPOP,
    # up to its 1 s timeout later: let every worker be listening when the burst comes.
    time.sleep(1.2)
    steal = CpuSteal()
    transactions_before = transactions.count() if transactions is not None else 0
    fleet.fill(queue, task, calls)
    published = fleet.last_fill_published
    deadline = ideal_seconds * 10 + 30
    completed = True
    try:
        wait_for(lambda: fleet.redis.llen(fleet.keys["runs"]) >= len(calls), deadline, f"{variant} backlog", 0.05)
    except TimeoutError:
        completed = False
    ended = time.monotonic()
    fleet.stop_consuming(queue)
    time.sleep(0.2)  # a put-back published just now is still counted
    runs = fleet.runs()
    put_backs = fleet.worker_publishes() - publishes_before
    result = analyse(variant, runs, published, put_backs, task_ms)
    result["completed"] = completed
    result["ideal_seconds"] = ideal_seconds
    result["cpu_steal"] = steal.fraction()
    if transactions is not None:
        time.sleep(max(0.0, ended + transactions.settle_seconds - time.monotonic()))
        result["store_transactions"] = transactions.count() - transactions_before
        result["store_transactions_per_task"] = ratio(result["store_transactions"], len(runs))
    return result


def _linear_fit(positions: list[float], waits: list[float]) -> tuple[float, float]:
    """Least-squares slope of ``waits`` against ``positions``, and the fit's R^2 (1.0: a line)."""
    if len(positions) < 3 or len(set(positions)) < 2:
        return math.nan, math.nan
    slope, _intercept = statistics.linear_regression(positions, waits)
    r = statistics.correlation(positions, waits)
    return slope, r * r


def _peak(runs: list[dict[str, Any]]) -> int:
    events = []
    for run in runs:
        events.append((run["start"], 1))
        events.append((run["end"], -1))
    events.sort(key=lambda event: (event[0], event[1]))
    level = peak = 0
    for _, change in events:
        level += change
        peak = max(peak, level)
    return peak


def analyse(variant: str, runs: list[dict[str, Any]], published: int, put_backs: int, task_ms: int) -> dict[str, Any]:
    done = len(runs)
    duration = task_ms / 1000
    if not runs:
        return {"utilisation": math.nan, "deferrals_per_task": math.nan, "completed_tasks": 0}
    first_start = min(run["start"] for run in runs)
    last_end = max(run["end"] for run in runs)
    makespan = last_end - first_start
    waits = [run["start"] - run["published"] for run in runs]
    result: dict[str, Any] = {
        "completed_tasks": done,
        "published": published,
        "put_backs": put_backs,
        "deferrals_per_task": put_backs / done,
        "deferrals_from_headers": sum(run["deferrals"] for run in runs) / done,
        "broker_messages_per_task": (published + put_backs) / done,
        "makespan_seconds": makespan,
        "wait_p50": percentile(waits, 0.5),
        "wait_p99": percentile(waits, 0.99),
    }
    by_publish = sorted(runs, key=lambda run: run["published"])
    if variant == "global":
        result["throughput"] = done / makespan
        result["utilisation"] = result["throughput"] / (GLOBAL_LIMIT / duration)
        ideal_waits = [
            first_start + (index // GLOBAL_LIMIT) * duration - run["published"] for index, run in enumerate(by_publish)
        ]
        result["peak"] = _peak(runs)
        positions = [float(index) for index in range(len(by_publish))]
        waits_by_position = [run["start"] - run["published"] for run in by_publish]
    else:
        per_tenant: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for run in by_publish:
            per_tenant[run["tenant"]].append(run)
        ideal_waits, shares, tenant_waits = [], {}, {}
        positions, waits_by_position = [], []
        busy = elapsed = elapsed_since_sent = 0.0
        for tenant, tenant_runs in per_tenant.items():
            tenant_busy = len(tenant_runs) * duration
            tenant_end = max(run["end"] for run in tenant_runs)
            tenant_elapsed = tenant_end - first_start
            busy += tenant_busy
            elapsed += tenant_elapsed
            # Not before the tenant's first task was sent: no strategy could start it earlier.
            elapsed_since_sent += tenant_end - max(first_start, tenant_runs[0]["published"])
            shares[tenant] = tenant_busy / tenant_elapsed
            waits_here = [run["start"] - run["published"] for run in tenant_runs]
            ideal_here = [first_start + index * duration - run["published"] for index, run in enumerate(tenant_runs)]
            ideal_waits.extend(ideal_here)
            positions.extend(float(index) for index in range(len(tenant_runs)))
            waits_by_position.extend(waits_here)
            tenant_waits[tenant] = {
                "tasks": len(tenant_runs),
                "utilisation": shares[tenant],
                "wait_p50": percentile(waits_here, 0.5),
                "ideal_wait_p50": percentile(ideal_here, 0.5),
                "peak": _peak(tenant_runs),
            }
        values = list(shares.values())
        result["utilisation"] = busy / elapsed
        result["utilisation_since_sent"] = busy / elapsed_since_sent
        result["makespan_ratio"] = max(len(r) for r in per_tenant.values()) * duration / makespan
        result["tenant_utilisation_min"] = min(values)
        result["tenant_utilisation_max"] = max(values)
        result["jain_index"] = sum(values) ** 2 / (len(values) * sum(value**2 for value in values))
        # How much longer than in the ideal schedule each tenant's median task waited, in
        # seconds (a ratio would explode for a quiet tenant whose ideal wait is ~0).
        extra = [t["wait_p50"] - t["ideal_wait_p50"] for t in tenant_waits.values()]
        result["wait_extra_min"] = min(extra) if extra else math.nan
        result["wait_extra_max"] = max(extra) if extra else math.nan
        result["tenants"] = tenant_waits
        result["peak"] = max(t["peak"] for t in tenant_waits.values())
    # Hand-overs: how long a slot stayed empty before each run took it (global: since the
    # latest end before its start, past the first `limit` runs; per key: since its tenant's
    # previous run ended).
    if variant == "global":
        ends = sorted(run["end"] for run in runs)
        by_start = sorted(runs, key=lambda run: run["start"])[GLOBAL_LIMIT:]
        gaps = [run["start"] - ends[bisect.bisect_right(ends, run["start"]) - 1] for run in by_start]
    else:
        gaps = []
        for tenant_runs in per_tenant.values():
            ordered = sorted(tenant_runs, key=lambda run: run["start"])
            gaps.extend(later["start"] - earlier["end"] for earlier, later in itertools.pairwise(ordered))
    gaps = [gap for gap in gaps if gap >= 0]
    result["handover_ms_p50"] = percentile(gaps, 0.5) * 1000 if gaps else math.nan
    result["handover_ms_p99"] = percentile(gaps, 0.99) * 1000 if gaps else math.nan
    result["handover_ms_max"] = max(gaps) * 1000 if gaps else math.nan
    # Wait against backlog position (publish order; per key: within the tenant's backlog):
    # the slope against the ideal schedule's, and how close to a line the waits lie.
    slope, r_squared = _linear_fit(positions, waits_by_position)
    ideal_slope, _ = _linear_fit(positions, ideal_waits)
    result["wait_slope_ratio"] = slope / ideal_slope if ideal_slope else math.nan
    result["wait_r_squared"] = r_squared
    result["ideal_wait_p50"] = percentile(ideal_waits, 0.5)
    result["ideal_wait_p99"] = percentile(ideal_waits, 0.99)
    return result


def report_strategy(
    report: Report,
    store: str,
    strategy: str,
    trials: dict[str, list[dict[str, Any]]],
    backlogs: dict[str, int],
    *,
    task_ms: int,
    baseline: list[dict[str, Any]] | None,
    transactions: str | None,
) -> None:
    """Add ``strategy``'s figures on ``store``: medians over its ``trials``, per-repeat values in
    each figure.  ``baseline``: the dedicated queue's global trials of this run, if it ran before;
    ``transactions``: what the store's transactions per task count, if counted."""

    def values(variant: str, name: str) -> list[float]:
        return [trial.get(name, math.nan) for trial in trials[variant]]

    def add(variant: str, label: str, name: str, unit: str, **kwargs: Any) -> None:
        series = values(variant, name)
        report.add(
            Figure(PART, f"{store}, {strategy}, {variant}: {label}", median(series), unit, repeats=series, **kwargs)
        )

    for variant in list(trials):
        trial_list = trials[variant]
        incomplete = sum(not trial["completed"] for trial in trial_list)
        detail = {"trials": trial_list, "incomplete_trials": incomplete, "backlog": backlogs[variant]}
        utilisation = median(values(variant, "utilisation"))
        if variant == "global":
            throughput = median(values(variant, "throughput"))
            ideal = GLOBAL_LIMIT / (task_ms / 1000)
            versus = f"{throughput:.1f}/s vs ideal {ideal:.0f}/s (limit {GLOBAL_LIMIT} / {task_ms} ms)"
        else:
            versus = "ideal: each tenant's slot busy until its backlog is done"
        if incomplete:
            versus += f"; {incomplete} trial(s) timed out"
        # How noisy the host was: CPU time the hypervisor gave to others during the trials.
        versus += f"; CPU steal {median(values(variant, 'cpu_steal')):.1%}"
        add(
            variant,
            "slot utilisation",
            "utilisation",
            "ratio",
            versus=versus,
            ratio=utilisation,
            target=f">= {UTILISATION_TARGET}",
            met=at_least(utilisation, UTILISATION_TARGET),
            detail=detail,
        )
        if baseline is not None:
            # Repeat i against the baseline's repeat i (both ran `repeats` trials of this variant).
            baseline_utilisation = [trial["utilisation"] for trial in baseline]
            series = [
                ratio(ours, theirs)
                for ours, theirs in zip(values(variant, "utilisation"), baseline_utilisation, strict=True)
            ]
            label = "slot utilisation / dedicated queue's"
            against = f"{BASELINE} (uncapped), same run: global utilisation {median(baseline_utilisation):.3f}"
            if variant != "global":
                label += " global"
                against += "; per key against its global figure: the only baseline there is (it cannot cap per key)"
            report.add(
                Figure(
                    PART,
                    f"{store}, {strategy}, {variant}: {label}",
                    median(series),
                    "ratio",
                    versus=against,
                    ratio=median(series),
                    repeats=series,
                    detail={"baseline_utilisation": baseline_utilisation},
                )
            )
        from_headers = median(values(variant, "deferrals_from_headers"))
        recorded_by = "the runs' request.retries" if strategy == SEMAPHORE else "caps_deferrals headers"
        add(
            variant,
            "re-publishes/completed task",
            "deferrals_per_task",
            "x",
            versus=f"put-back or wake-up copies, ideal 0; {recorded_by} say {from_headers:.2f}",
        )
        messages = median(values(variant, "broker_messages_per_task"))
        sent = median(values(variant, "published"))
        add(
            variant,
            "broker msgs/completed task",
            "broker_messages_per_task",
            "x",
            versus=f"ideal 1.0; {sent:.0f} of {backlogs[variant]} sent to the broker, the rest parked when sent",
            target=f"<= {MESSAGES_TARGET}" if strategy == "park" else "",
            met=at_most(messages, MESSAGES_TARGET) if strategy == "park" else None,
        )
        if transactions is not None:
            add(variant, "store transactions/completed task", "store_transactions_per_task", "x", versus=transactions)
        add(
            variant,
            "wait p50",
            "wait_p50",
            "s",
            versus=f"publish to start; ideal schedule {median(values(variant, 'ideal_wait_p50')):.2f} s",
            ratio=median(
                [a / b for a, b in zip(values(variant, "wait_p50"), values(variant, "ideal_wait_p50"), strict=True)]
            ),
        )
        add(
            variant,
            "wait p99",
            "wait_p99",
            "s",
            versus=f"publish to start; ideal schedule {median(values(variant, 'ideal_wait_p99')):.2f} s",
            ratio=median(
                [a / b for a, b in zip(values(variant, "wait_p99"), values(variant, "ideal_wait_p99"), strict=True)]
            ),
        )
        add(
            variant,
            "hand-over gap p50",
            "handover_ms_p50",
            "ms",
            versus=(
                f"a slot empty between two runs; p99 {median(values(variant, 'handover_ms_p99')):.1f} ms, "
                f"max {median(values(variant, 'handover_ms_max')):.0f} ms"
            ),
        )
        add(
            variant,
            "wait vs backlog position: R^2",
            "wait_r_squared",
            "ratio",
            versus="least-squares line of each task's wait against its backlog position; 1.0 = a straight line",
            ratio=median(values(variant, "wait_r_squared")),
        )
        add(
            variant,
            "wait vs backlog position: slope / ideal",
            "wait_slope_ratio",
            "ratio",
            versus="the line's slope over the ideal schedule's (1.0 = as ideal; above it: extra wait per position)",
            ratio=median(values(variant, "wait_slope_ratio")),
        )
        peaks = values(variant, "peak")
        limit = GLOBAL_LIMIT if variant == "global" else 1
        add(
            variant,
            "peak runs per slot",
            "peak",
            "count",
            versus=f"limit {limit}",
            target=f"<= {limit}",
            met=max(peaks) <= limit if peaks else None,
        )
        if variant == "per-key":
            add(variant, "slot utilisation from each tenant's first send", "utilisation_since_sent", "ratio",
                versus="the same, each tenant's ideal counted from its first task's send, if later than the first "
                "start: the difference is the sender's burst, not the hand-overs")  # fmt: skip
            add(variant, "makespan vs ideal", "makespan_ratio", "ratio",
                versus="ideal makespan / achieved (busiest tenant back to back)")  # fmt: skip
            add(
                variant,
                "fairness (Jain index)",
                "jain_index",
                "ratio",
                versus=f"1.0 = even; tenant utilisation min {median(values(variant, 'tenant_utilisation_min')):.2f}"
                f" / max {median(values(variant, 'tenant_utilisation_max')):.2f}",
            )
            add(
                variant,
                "tenant p50 wait over ideal, max",
                "wait_extra_max",
                "s",
                versus=f"min {median(values(variant, 'wait_extra_min')):.2f} s (0 = as ideal; the spread: unfairness)",
            )
