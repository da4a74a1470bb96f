"""Hostile input through a real worker: bad and strange cap keys, on each shared store.

The unit tests (``tests/unit/test_caps.py``, ``test_stores.py``) show that a bad key
is refused with a named error and that strange slot names never collide in a store.
This is the proof end to end, with prefork workers, a result backend and the slot
store of a fleet: ``fleet.odd`` holds a cap of 1 per key, under a cap name full of
quotes, ``%``, ``_``, braces, a backslash and non-ASCII, keyed by whatever its key
function is told to return (:func:`~tests.integration.fleetapp.odd_key`).

What a user checks: a key function that raises, or returns None, an int, an empty,
10 kB or 10 MB string, a NUL or a lone surrogate, fails its task with
``CapKeyError`` naming the value (a 10 MB one cut short), recorded as FAILURE in
the result backend; the body never runs, no slot is taken, no row is created, no
other task's lease or sentinel changes, and the same worker processes go on
serving.  Valid but strange keys each get their own slot, returned unchanged:
distinct keys with a cap of 1 run at the same time, and one key serialises.  A cap
*name* with ``:``, a NUL or 10 kB stops the worker at start with a ConfigurationError
naming it (cut short), before it takes any task.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_caps.caps import MAX_KEY_LENGTH
from celery_caps.errors import CapKeyError
from tests.integration.conftest import FleetFactory
from tests.integration.fleet import Fleet, wait_for
from tests.integration.fleetapp import ODD_CAP_NAME
from tests.services import require_service

#: Valid keys that a careless store would merge, mangle or interpret: LIKE wildcards,
#: case, trailing space, composed and decomposed é, Redis's own escape, SQL.
STRANGE_KEYS = [
    "%",
    "_",
    "a",
    "A",
    "tenant",
    "tenant ",
    "\u00e9",
    "e\u0301",
    "{",
    "%7B",
    "x:y",
    'it\'s "quoted" \\ back',
    "'; DELETE FROM concurrency_slots; --",
    "ünïcödé 🚀",
    "k" * MAX_KEY_LENGTH,
]
#: Keys that get a second task while the first holds the slot: it must wait.
SERIALISED_KEYS = ["%", "'; DELETE FROM concurrency_slots; --"]
HOLD_SECONDS = 4.0
#: Long enough to still hold their slots when every bad task has failed.
BYSTANDER_SECONDS = 10.0
TEN_MB = 10_000_000
#: No error message the library writes should be longer than this, whatever the value.
MESSAGE_LIMIT = 500

#: (arguments of fleet.odd, a fragment the error message must contain)
BAD_KEYS: list[tuple[list[Any], str]] = [
    (["raise", ["no tenant in the arguments", 1]], "raised ValueError: no tenant in the arguments"),
    (["raise", ["x", TEN_MB]], "raised ValueError: xxxxxxxx"),
    (["key", None], "got NoneType None"),
    (["key", 42], "got int 42"),
    (["key", ""], "returned an empty string"),
    (["repeat", ["k", 10_000]], "'kkkkkkkk"),
    (["repeat", ["y", TEN_MB]], "'yyyyyyyy"),
    (["chars", [ord("a"), 0, ord("b")]], "'a\\x00b'"),
    (["chars", [ord("s"), 0xD800]], "'s\\ud800'"),
]


def odd_slot(fleet: Fleet, key: str) -> str:
    return fleet.slot(f"{ODD_CAP_NAME}:{key}")


def rows(fleet: Fleet) -> tuple[set[tuple[str, str, str, str]], set[tuple[str, int | None]]]:
    """The fleet's lease rows (without their expiry, which renewal moves) and its sentinels."""
    leases = {(lease.slot, lease.task_id, lease.run_id, lease.holder) for lease in fleet.leases()}
    sentinels = {(status.slot, status.limit) for status in fleet.store.status() if status.slot.startswith(fleet.prefix)}
    return leases, sentinels


def result_of(fleet: Fleet, task_id: str, timeout: float = 30) -> AsyncResult:
    result = fleet.app.AsyncResult(task_id)
    result.get(timeout=timeout, propagate=False)
    return result


@pytest.mark.fleet
@pytest.mark.redis
@pytest.mark.parametrize(
    "store",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
def test_hostile_keys_through_a_worker(make_fleet: FleetFactory, store: str) -> None:
    redis_url = require_service("redis")
    fleet = make_fleet(broker=redis_url, backend=redis_url, caps_url=require_service(store), lease=30)
    workers = fleet.start(2, concurrency=9)
    pids = {worker.name: (worker.pid, tuple(sorted(worker.children()))) for worker in workers}

    # Given other tasks holding their slots: one of the odd cap's own keys, one of another cap
    scope = uuid.uuid4().hex[:16]
    bystanders = [
        fleet.app.send_task("fleet.odd", args=["key", "bystander", BYSTANDER_SECONDS]).id,
        fleet.app.send_task("fleet.hold", args=[scope, BYSTANDER_SECONDS]).id,
    ]
    wait_for(lambda: len(fleet.leases()) == 2, 20, lambda: f"bystanders not running: {fleet.leases()}")
    before = rows(fleet)

    # When tasks arrive whose key function raises or returns an unusable key, and a task with
    # two caps whose second key is unusable (the first must not be taken either)
    bad = [fleet.app.send_task("fleet.odd", args=args).id for args, _ in BAD_KEYS]
    half_bad = fleet.app.send_task("fleet.both", args=[None, 50]).id

    # Then each fails with CapKeyError naming its value, recorded in the result backend
    for task_id, (args, fragment) in zip(bad, BAD_KEYS, strict=True):
        result = result_of(fleet, task_id)
        assert result.state == "FAILURE", (args[:1], result.state)
        assert isinstance(result.result, CapKeyError), (args[:1], type(result.result))
        message = str(result.result)
        assert repr(fleet.slot(ODD_CAP_NAME)) in message and fragment in message, (args[:1], message[:300])
        assert len(message) <= MESSAGE_LIMIT, f"{args[:1]}: a message of {len(message)} characters"
    result = result_of(fleet, half_bad)
    assert result.state == "FAILURE" and isinstance(result.result, CapKeyError), result.result
    assert "got NoneType None" in str(result.result) and "tenant" in str(result.result)

    # ... no body ran, no slot was taken, no row was created, no other row changed (admission
    # creates a slot's sentinel even when it refuses, so an unchanged set of sentinels also
    # shows that no bad key reached the store)
    after = rows(fleet)
    record = fleet.record()
    assert all(record.starts[task_id] == 0 for task_id in [*bad, half_bad])
    assert not any(record.done[task_id] for task_id in bystanders), "the bystanders ended too early to compare"
    assert after == before
    bystander_leases, _ = before
    assert {lease[1] for lease in bystander_leases} == set(bystanders)

    # ... and the same worker processes go on: the bystanders finish, and release
    wait_for(lambda: all(fleet.record().done[t] for t in bystanders), 30, "the bystanders did not finish")
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")

    # When valid but strange keys arrive, a cap of 1 each, and a second task for some of them
    first = {key: fleet.app.send_task("fleet.odd", args=["key", key, HOLD_SECONDS]).id for key in STRANGE_KEYS}
    second = {key: fleet.app.send_task("fleet.odd", args=["key", key, 0.2]).id for key in SERIALISED_KEYS}

    # Then every key's first task runs at the same time as all the others: no two share a slot
    def all_running() -> list[Any] | None:
        leases = fleet.leases()
        return leases if {lease.task_id for lease in leases} >= set(first.values()) else None

    running = wait_for(all_running, 30, lambda: f"not all keys admitted at once: {fleet.leases()}")
    # ... each slot named exactly after its key, as the store gives it back
    assert sorted(lease.slot for lease in running if lease.task_id in first.values()) == sorted(
        odd_slot(fleet, key) for key in STRANGE_KEYS
    )
    every_id = [*first.values(), *second.values()]
    wait_for(lambda: all(fleet.record().done[t] for t in every_id), 60, "the strange keys' tasks did not finish")
    record = fleet.record()
    runs = {key: record.runs_of(task_id)[0] for key, task_id in first.items()}
    latest_start = max(run.start for run in runs.values())
    earliest_end = min(run.end or float("inf") for run in runs.values())
    assert latest_start < earliest_end, "two keys' first tasks never ran together"

    # ... and one key serialises: its two tasks never ran together, one of them waited
    for key in SERIALISED_KEYS:
        earlier, later = sorted([*record.runs_of(first[key]), *record.runs_of(second[key])], key=lambda run: run.start)
        assert earlier.end is not None and later.start >= earlier.end, (key, earlier, later)
        assert record.interval_peak(f"odd:{key}") == 1
        assert record.received[first[key]] + record.received[second[key]] > 2, f"{key!r}: neither task was put back"

    # ... the workers never restarted, nor lost a pool process, and the library wrote no long
    # line: the only one is the key function's own 10 MB ValueError, chained under CapKeyError
    assert {worker.name: (worker.pid, tuple(sorted(worker.children()))) for worker in workers} == pids
    long_lines = [
        line[:80] for worker in workers for line in worker.log().splitlines() if len(line) > MESSAGE_LIMIT * 2
    ]
    assert long_lines == ["ValueError: " + "x" * 68], long_lines

    # ... and afterwards only sentinels are left: the bystanders' and the valid keys', none for a bad key
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
    fleet.store.sweep()
    _, sentinels = rows(fleet)
    expected = {odd_slot(fleet, key) for key in [*STRANGE_KEYS, "bystander"]} | {fleet.slot(f"one:{scope}")}
    assert {slot for slot, _ in sentinels} == expected
    print(
        f"\n[hostile {store}] {len(BAD_KEYS) + 1} bad keys failed with CapKeyError (longest message "
        f"{max(len(str(result_of(fleet, t).result)) for t in bad)} chars), no row touched; "
        f"{len(STRANGE_KEYS)} strange keys ran together on cap 1 each (overlap {earliest_end - latest_start:.2f} s), "
        f"{len(SERIALISED_KEYS)} serialised"
    )


BAD_NAME_APP = textwrap.dedent(
    """
    from celery import Celery
    from celery_caps import Cap, CappedTask

    app = Celery("badname", broker="memory://")
    app.conf.caps_url = "memory://"
    NAME = {expression}

    @app.task(base=CappedTask, cap=Cap(NAME, 1))
    def capped():
        return 1
    """
)


@pytest.mark.memory
@pytest.mark.parametrize(
    ("expression", "named_as"),
    [
        ('"tenant:acme"', "'tenant:acme' must not contain ':'"),
        ('"nul" + chr(0) + "name"', "'nul\\x00name' must not contain ':' or control characters"),
        ('"n" * 10_000', "'nnnnnnnn"),
    ],
    ids=["colon", "NUL", "10kB"],
)
def test_a_worker_refuses_to_start_with_a_bad_cap_name(tmp_path: Path, expression: str, named_as: str) -> None:
    # Given an app whose capped task has a cap name that cannot be a slot name
    (tmp_path / "badname.py").write_text(BAD_NAME_APP.format(expression=expression))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}

    # When a worker starts on it
    worker = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "badname", "worker", "-P", "solo", "-l", "warning"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )

    # Then it exits at once with the named error, the name cut short
    output = worker.stdout + worker.stderr
    assert worker.returncode != 0, output
    assert f"celery_caps.errors.ConfigurationError: Cap name {named_as}" in output, output[-2000:]
    assert len(output) < 10_000, f"{len(output)} characters of output"
