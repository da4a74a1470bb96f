"""A hand-over on a fair cap with 10 and with 10,000 fair keys waiting, the two interleaved.

``growth.py`` times one list size after the other, so that the machine's drift between them
lands in their ratio.  Here two slots of one store, one with ``--small`` fair keys waiting (a
waiter each), one with ``--large``, take turns cycle by cycle: a cycle releases the slot's
holder, which dispatches the list's first waiter; the waiter claims; a new waiter parks under
one of the waiting keys (as ``growth.measure_waiting_fair_keys`` does).  Printed: each size's
p50 of the whole cycle and of its steps (release, claim, park), in ms, and the ratio.

    python benchmarks/results/mariadb-fair-2026-12-07/probe_fair_hand_over.py redis://127.0.0.1:6379/14

It writes under a key prefix (Redis) and slot names of its own, and removes all of it after.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from celery_caps.stores import StoreOptions, store_from_url
from celery_caps.stores.base import ParkingStore, ParkOutcome, ParkRequest
from celery_caps.stores.redis import RedisStore

STEPS = ("release", "claim", "park")


class FairList:
    """One slot (limit 1) held by a run, with ``size`` fair keys waiting in its list."""

    def __init__(self, store: ParkingStore, slot: str, size: int) -> None:
        self.store, self.slot, self.size = store, slot, size
        self.holder = uuid.uuid4().hex
        self.cycles = 0
        if not store.acquire({slot: 1}, f"{slot}-holder", self.holder, "probe", 3600.0).granted:
            raise RuntimeError(f"{slot} was not free")
        for i in range(size):
            if store.park(self.request(f"{slot}-w{i:07d}", 1000.0 + i, f"tenant{i:07d}")) is not ParkOutcome.PARKED:
                raise RuntimeError(f"waiter {i} of {slot} did not park")
        self.timings: dict[str, list[float]] = {step: [] for step in (*STEPS, "cycle")}

    def request(self, task_id: str, first_deferred_at: float, fair_key: str) -> ParkRequest:
        return ParkRequest(
            {self.slot: 1}, task_id, uuid.uuid4().hex, "probe", 60.0, first_deferred_at, 10**9, "probe.waiter",
            b"payload", fair_keys={self.slot: fair_key},
        )  # fmt: skip

    def cycle(self, keep: bool) -> None:
        started = time.perf_counter()
        _deleted, woken = self.store.release_and_wake(self.holder, 3600.0)
        [dispatched] = woken
        released = time.perf_counter()
        self.store.claim(dispatched.task_id, dispatched.run_id, "probe", 3600.0)
        claimed = time.perf_counter()
        key = f"tenant{(self.cycles * 7919) % self.size:07d}"
        self.store.park(self.request(f"{self.slot}-late{self.cycles:06d}", 1e9 + self.cycles, key))
        parked = time.perf_counter()
        self.holder = dispatched.run_id
        self.cycles += 1
        if keep:
            for step, seconds in zip(
                (*STEPS, "cycle"),
                (released - started, claimed - released, parked - claimed, parked - started),
                strict=True,
            ):
                self.timings[step].append(seconds * 1000)

    def p50(self, step: str) -> float:
        return statistics.median(self.timings[step])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the store's URL (redis://..., postgresql+psycopg://..., ...)")
    parser.add_argument("--small", type=int, default=10)
    parser.add_argument("--large", type=int, default=10_000)
    parser.add_argument("--cycles", type=int, default=300, help="cycles timed per size (after 30 of warm-up)")
    arguments = parser.parse_args()
    tag = f"probe{uuid.uuid4().hex[:8]}"
    store = store_from_url(arguments.url, StoreOptions(redis_key_prefix=tag))
    assert isinstance(store, ParkingStore)
    lists: list[FairList] = []
    try:
        for size in (arguments.small, arguments.large):
            lists.append(FairList(store, f"{tag}-{size}", size))
        for cycle in range(-30, arguments.cycles):
            for fair_list in lists if cycle % 2 == 0 else lists[::-1]:
                fair_list.cycle(keep=cycle >= 0)
        small, large = lists
        for step in (*STEPS, "cycle"):
            print(
                f"{step:>7}: {small.size:,} keys {small.p50(step):.3f} ms, {large.size:,} keys "
                f"{large.p50(step):.3f} ms, ratio {large.p50(step) / small.p50(step):.2f}"
            )
    finally:
        # The waiters first (the holders keep the slots: nobody is dispatched), then the holders'
        # runs, then the slots themselves; on Redis, every key of the probe's own prefix.
        for waiter in store.waiters():
            if waiter.slot.startswith(tag):
                store.forget(waiter.task_id, 1.0)
        for run_id in {lease.run_id for lease in store.leases() if lease.slot.startswith(tag)}:
            store.release(run_id)
        store.prune(tag)
        if isinstance(store, RedisStore):
            for key in store.client.scan_iter(match=f"{tag}*", count=1000):
                store.client.delete(key)
        store.close()


if __name__ == "__main__":
    main()
