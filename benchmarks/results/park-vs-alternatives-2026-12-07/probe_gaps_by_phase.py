"""Where park's per-key hand-over gaps go: by time since the burst was sent, and by how a run got
its slot (a woken copy's claim, or admission on arrival).

Runs the utilisation part's per-key trial (8 tenants, a cap of 1 each, 240 tasks of 50 ms sent at
once, two workers x ``-c 8``, prefetch 1, park) twice, and prints each tenant's gaps between one
run's end and its next run's start, grouped by half-second since the first send.

    python benchmarks/results/park-vs-alternatives-2026-12-07/probe_gaps_by_phase.py redis://127.0.0.1:6379/12

Everything it creates is under a random prefix and deleted at the end.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from benchmarks import utilisation
from benchmarks.clients import drop_slots
from benchmarks.workers import BenchFleet, fleet_env

BROKER = "redis://127.0.0.1:6379/11"
PHASE_SECONDS = 0.5
LONG_GAP_SECONDS = 0.03


def report(runs: list[dict[str, Any]], utilisation_figure: float) -> None:
    sent = min(run["published"] for run in runs)
    by_tenant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        by_tenant[run["tenant"]].append(run)
    # (gap seconds, seconds since the burst, how the next run got its slot)
    gaps: list[tuple[float, float, str]] = []
    for tenant_runs in by_tenant.values():
        tenant_runs.sort(key=lambda run: run["start"])
        for previous, following in itertools.pairwise(tenant_runs):
            gaps.append((following["start"] - previous["end"], previous["end"] - sent, following["via"]))
    long = [gap for gap, _, _ in gaps if gap > LONG_GAP_SECONDS]
    print(
        f"utilisation {utilisation_figure:.3f}; {len(gaps)} gaps, {len(long)} over {LONG_GAP_SECONDS * 1000:.0f} ms "
        f"holding {sum(long):.2f} s of the {sum(gap for gap, _, _ in gaps):.2f} s idle"
    )
    phases: dict[int, list[float]] = defaultdict(list)
    for gap, since, _ in gaps:
        phases[min(int(since / PHASE_SECONDS), 9)].append(gap * 1000)
    for phase in sorted(phases):
        values = sorted(phases[phase])
        print(
            f"  from {phase * PHASE_SECONDS:.1f} s: {len(values)} gaps, p50 {statistics.median(values):.1f} ms, "
            f"max {values[-1]:.1f} ms, {sum(values) / 1000:.2f} s idle"
        )
    by_way: dict[str, list[float]] = defaultdict(list)
    for gap, _, via in gaps:
        by_way[via].append(gap * 1000)
    for via, values in sorted(by_way.items()):
        values.sort()
        print(f"  next run by {via}: {len(values)}, p50 {statistics.median(values):.1f} ms, max {values[-1]:.1f} ms")
    firsts = {tenant: round(min(run["start"] for run in rs) - sent, 2) for tenant, rs in sorted(by_tenant.items())}
    print(f"  each tenant's first start after the send, s: {firsts}")


def main(store_url: str) -> None:
    prefix = f"gp{uuid.uuid4().hex[:6]}-"
    env = fleet_env(BROKER, store_url, prefix, PREFETCH=1, GLOBAL_LIMIT=4, TENANT_LIMIT=1)
    env["CAPS_BENCH_EXTRA_CONF"] = "caps_strategy=park"
    fleet = BenchFleet(env, Path("/tmp/caps-probe-logs"))
    try:
        fleet.start(2, 8)
        for _ in range(2):
            trial = utilisation.run_trial(fleet, "per-key", "bench.tenant", 240, 50, None)
            report(fleet.runs(), trial["utilisation"])
    finally:
        fleet.close()
        drop_slots(store_url, prefix)


if __name__ == "__main__":
    main(sys.argv[1])
