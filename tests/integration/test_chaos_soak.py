"""Chaos soak: thousands of capped tasks over four prefork workers while workers and pool
children are killed at random (``kill -9``) and replaced.

Bounded for CI: ``CAPS_CHAOS_SOAK_TASKS`` tasks (default 10,000) and at most
``CAPS_CHAOS_SOAK_SECONDS`` seconds of feeding (default 240; raise both locally
for a longer soak).  The broker is RabbitMQ, which requeues a dead consumer's
unacknowledged messages at once: nothing may be lost.  Final invariants: every
task sent completed, a task completed twice only if a killed process had it in
hand, measured concurrency exceeded a cap only within a kill's lease window and by
at most the runs it cut short (the rule of ``test_crash``), and after a sweep
only sentinels are left.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Kill, Worker, mixed_workload, pid_alive, wait_for
from tests.integration.test_crash import LEASE_SECONDS, PROVIDER_LIMIT, TENANT_LIMIT, _check_caps
from tests.services import require_service

pytestmark = [pytest.mark.chaos, pytest.mark.fleet, pytest.mark.postgres, pytest.mark.amqp, pytest.mark.redis]

TASKS = int(os.environ.get("CAPS_CHAOS_SOAK_TASKS", "10000"))
FEED_SECONDS = float(os.environ.get("CAPS_CHAOS_SOAK_SECONDS", "240"))
WORKERS = 4
IN_FLIGHT = 120
KILL_EVERY_SECONDS = (8.0, 16.0)


def test_soak_with_random_kills(make_fleet: FleetFactory) -> None:
    began = time.monotonic()
    fleet = make_fleet(
        broker=require_service("amqp"),
        caps_url=require_service("postgres"),
        provider_limit=PROVIDER_LIMIT,
        tenant_limit=TENANT_LIMIT,
        lease=LEASE_SECONDS,
        backoff_min=0.02,
        backoff_max=0.5,
    )
    rng = random.Random(99)

    # Given four prefork workers and a stream of short capped tasks, fed so that about
    # IN_FLIGHT wait at any time (a flood of put-backs would measure the broker, not us)
    fleet.start(WORKERS, concurrency=4)
    jobs = mixed_workload(TASKS, seed=31337, ms_range=(1, 20))
    sent: dict[str, object] = {}
    kills: list[Kill] = []
    # Workers that lost a pool child: a child killed after publishing a put-back copy but before
    # its message was acknowledged has the original requeued (reject_on_worker_lost) beside the
    # copy: a duplicate the design allows, of a task whose body never started in the dead child.
    child_kill_victims: list[Worker] = []
    next_kill = time.monotonic() + rng.uniform(*KILL_EVERY_SECONDS)
    feed_deadline = time.monotonic() + FEED_SECONDS

    def done_count() -> int:
        done = fleet.recorder.client.hgetall(fleet.recorder.key("done"))
        return len(done)

    # When workers and pool children are killed at random while it runs (a killed worker is
    # replaced at once)
    while len(sent) < len(jobs) and time.monotonic() < feed_deadline:
        backlog = len(sent) - done_count()
        for job in jobs[len(sent) : len(sent) + max(IN_FLIGHT - backlog, 0)]:
            sent[fleet.app.send_task(job.task, args=[job.tenant, job.ms]).id] = job
        if time.monotonic() >= next_kill:
            alive = [worker for worker in fleet.workers if worker.alive()]
            victim = rng.choice(alive)
            if rng.random() < 0.5 and victim.children():
                kills.append(fleet.kill_child(rng.choice(victim.children())))
                child_kill_victims.append(victim)
            else:
                kills.append(fleet.kill_main(victim))
                fleet.start(1, concurrency=4)
            next_kill = time.monotonic() + rng.uniform(*KILL_EVERY_SECONDS)
        time.sleep(0.05)
    fed_seconds = time.monotonic() - began

    # Then every task sent completes
    def all_done() -> bool:  # reads only the completion hash: record() decodes every run
        done = {key.decode() for key in fleet.recorder.client.hkeys(fleet.recorder.key("done"))}
        return done >= set(sent)

    wait_for(all_done, 180, lambda: f"{done_count()} of {len(sent)} done", interval=1.0)
    record = fleet.record()
    assert all(record.done[task_id] >= 1 for task_id in sent)

    # ... twice only where a killed process had the task in hand
    dead_pids = {pid for kill in kills for pid in kill.pids}
    killed_workers = [worker for worker in fleet.workers if not worker.alive()]
    in_dead_hands = {run.task_id for run in record.runs if run.pid in dead_pids}
    for worker in [*killed_workers, *child_kill_victims]:
        in_dead_hands |= fleet.received_on(worker)
    duplicated = {task_id for task_id in sent if record.done[task_id] > 1}
    assert duplicated <= in_dead_hands, sorted(duplicated - in_dead_hands)[:5]

    # ... the caps held, except within a kill's lease window by at most the runs it cut short
    counters = sorted(record.counters())
    excess = {counter: _check_caps(record, kills, counter, in_dead_hands) for counter in counters}

    # ... and once the dead runs' leases expire and are swept, only sentinels are left
    fleet.wait_for_expiry(LEASE_SECONDS + 10)
    fleet.sweep_to_sentinels()
    assert all(not pid_alive(pid) for kill in kills for pid in kill.pids)
    print(
        f"\n[chaos soak] {len(sent)} of {TASKS} tasks sent in {fed_seconds:.0f} s on {WORKERS}x-c4 prefork "
        f"(RabbitMQ, PostgreSQL, lease {LEASE_SECONDS:.0f} s); kills {len(kills)} "
        f"({sum(len(kill.pids) == 1 for kill in kills)} pool children, {sum(len(kill.pids) > 1 for kill in kills)} "
        f"main processes), runs cut {sum(kill.runs_cut for kill in kills)}; lost 0, completed twice "
        f"{len(duplicated)}; Lua peaks {dict(sorted(record.peaks.items()))} (caps provider {PROVIDER_LIMIT}, "
        f"tenant {TENANT_LIMIT}); largest excess (task ids, bodies) {excess}; wall {time.monotonic() - began:.0f} s"
    )
    assert len(sent) >= min(TASKS, 1000), "the soak fed too few tasks to mean anything"
