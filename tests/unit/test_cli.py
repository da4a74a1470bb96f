"""``celery caps ...`` on every store of the table, through click's runner with a real Celery app.

Each test builds a Celery app whose ``caps_url`` is this test's store (the store
object itself, so a Redis store keeps its private key prefix), declares caps
under the test's own prefix, puts real leases and history into the store, and
runs the commands.  One test runs the real ``celery`` executable to check the
entry point is wired; others point the app at stores that cannot be reached.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from click.testing import CliRunner, Result

from celery_caps import Cap, CappedTask
from celery_caps.cli import caps, duration, parse_duration
from celery_caps.messages import encode_payload, wake_queue_name
from celery_caps.stores import store_from_url
from celery_caps.stores.base import (
    DISPATCH_HOLDER,
    OUTSIDE_PAYLOAD,
    HistoryEvent,
    ParkingStore,
    ParkOutcome,
    ParkRequest,
    SlotStore,
)
from celery_caps.stores.sql import SCHEMA_VERSION, SQLStore
from celery_caps.stores.sql.postgresql import PostgreSQLStore
from tests.services import own_status, private_sql_url

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG = 120.0
SHORT = 0.3


class Obj:
    """What ``celery`` hands its sub-commands as ``ctx.obj`` (a ``CLIContext``): the app."""

    def __init__(self, app: Celery) -> None:
        self.app = app


@pytest.fixture
def app(store: SlotStore, prefix: str) -> Iterator[Celery]:
    """An app with three capped tasks whose caps live under this test's prefix."""
    app = Celery(f"{prefix}proj", broker="memory://", set_as_current=False)
    app.conf.caps_url = store
    app.conf.caps_history_seconds = 600
    app.conf.task_default_queue = f"{prefix}q"

    @app.task(base=CappedTask, cap=Cap(f"{prefix}email", 3), name=f"{prefix}send_email", shared=False)
    def send_email(to: str) -> None: ...

    @app.task(
        base=CappedTask,
        cap=[Cap(f"{prefix}provider", 2), Cap(f"{prefix}tenant", 1, key=lambda tenant, path: tenant)],
        name=f"{prefix}import_file",
        shared=False,
    )
    def import_file(tenant: str, path: str) -> None: ...

    app.finalize()
    yield app
    app.close()


def run(app: Celery, *args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(caps, list(args), obj=Obj(app), input=input, catch_exceptions=False)


def take(store: SlotStore, slots: dict[str, int], task_id: str, *, name: str, holder: str, lease: float = LONG) -> str:
    run_id = uuid.uuid4().hex
    assert store.acquire(slots, task_id, run_id, holder, lease, task_name=name).granted
    return run_id


def parking_store(store: SlotStore) -> SlotStore:
    if not isinstance(store, ParkingStore):
        pytest.skip(f"{type(store).__name__} has no waiting list")
    return store


def park_task(
    app: Celery, store: SlotStore, slots: dict[str, int], task_id: str, *, first: float, tenant: str = "acme"
) -> None:
    """Park a real ``import_file`` message for ``task_id`` (first deferred at ``first``, epoch seconds)."""
    name = next(name for name in app.tasks if name.endswith("import_file"))
    payload = encode_payload(app, app.signature(name, args=[tenant, "path"], options={"task_id": task_id}))
    outcome = store.park(ParkRequest(
        slots, task_id, uuid.uuid4().hex, "w2@host-b/2", LONG, payload=payload, first_deferred_at=first,
        max_waiters=100, task_name=name,
    ))  # fmt: skip
    assert outcome == ParkOutcome.PARKED, outcome


def published(app: Celery) -> list[dict[str, Any]]:
    """The headers of every message published to the app's default queue and to its wake queue
    (where woken tasks go), consumed."""
    headers = []
    with app.connection_for_read() as connection:
        for name in (app.conf.task_default_queue, wake_queue_name(app.conf.task_default_queue)):
            queue = connection.SimpleQueue(name)
            try:
                while True:
                    try:
                        message = queue.get(block=True, timeout=0.2)
                    except queue.Empty:
                        break
                    headers.append(dict(message.headers))
                    message.ack()
            finally:
                queue.close()
    return headers


def wait_expired(store: SlotStore, run_id: str) -> None:
    deadline = time.monotonic() + 10
    while any(lease.expires_in > 0 for lease in store.leases() if lease.run_id == run_id):
        assert time.monotonic() < deadline, "lease did not expire"
        time.sleep(0.05)


@pytest.fixture
def busy(store: SlotStore, prefix: str) -> dict[str, Any]:
    """Given: two imports for tenant acme's single slot, one running, one put back twice;
    an e-mail running; an expired lease of tenant old."""
    p = prefix
    running = f"{p}task-running"
    waiting = f"{p}task-waiting"
    take(store, {f"{p}provider": 2, f"{p}tenant:acme": 1}, running, name=f"{p}import_file", holder="w1@host-a/4242")
    take(store, {f"{p}email": 3}, f"{p}task-email", name=f"{p}send_email", holder="w2@host-b/77")
    expired = take(
        store, {f"{p}tenant:old": 1}, f"{p}task-old", name=f"{p}import_file", holder="w1@host-a/9", lease=SHORT
    )
    now = time.time()
    slots = (f"{p}provider", f"{p}tenant:acme")
    store.record_history(
        [
            HistoryEvent(
                "deferred", now - 5, waiting, f"{p}import_file", slots, (f"{p}tenant:acme",), "w2@b/1", None, 0
            ),
            HistoryEvent(
                "deferred", now - 2, waiting, f"{p}import_file", slots, (f"{p}tenant:acme",), "w2@b/1", None, 1
            ),
            HistoryEvent("ran", now - 30, f"{p}task-done", f"{p}import_file", slots, (), "w1@host-a/4242", now - 40, 0),
        ],
        keep_seconds=600,
        max_events=100_000,
    )
    wait_expired(store, expired)
    return {"running": running, "waiting": waiting}


# -- status ----------------------------------------------------------------------------


def test_status_lists_every_cap_and_slot_with_limits_holders_expired_and_keys(
    app: Celery, busy: dict[str, Any], prefix: str
) -> None:
    result = run(app, "status", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    caps_seen = {line["cap"]: line for line in report["caps"] if line["cap"].startswith(prefix)}
    assert caps_seen[f"{prefix}tenant"] == {
        "cap": f"{prefix}tenant",
        "limit": 1,
        "limit_function": None,
        "limit_source": "code",
        "code_limit": 1,
        "keys_with_limits_set": 0,
        "registered": True,
        "keyed": True,
        "keys": 2,
        "holders": 1,
        "units": 1,
        "expired": 1,
        "waiters": 0,
        "tasks": [f"{prefix}import_file"],
    }
    assert (caps_seen[f"{prefix}email"]["holders"], caps_seen[f"{prefix}email"]["keys"]) == (1, 0)
    slots = {line["slot"]: line for line in report["slots"] if line["slot"].startswith(prefix)}
    assert slots[f"{prefix}tenant:acme"] == {
        "slot": f"{prefix}tenant:acme",
        "cap": f"{prefix}tenant",
        "limit": 1,
        "limit_source": "code",
        "limit_set_for": None,
        "holders": 1,
        "units": 1,
        "expired": 0,
        "waiters": 0,
        "oldest_waiter_seconds": None,
        "fair_keys_waiting": 0,
    }
    assert (slots[f"{prefix}tenant:old"]["holders"], slots[f"{prefix}tenant:old"]["expired"]) == (0, 1)

    table = run(app, "status", "--cap", f"{prefix}tenant")
    assert table.exit_code == 0
    assert f"{prefix}tenant:acme" in table.output and "(full)" in table.output
    assert f"{prefix}email" not in table.output


def test_status_of_an_app_whose_caps_were_never_used(app: Celery, prefix: str) -> None:
    report = json.loads(run(app, "status", "--json").output)
    mine = [line for line in report["caps"] if line["cap"].startswith(prefix)]
    assert [(line["cap"], line["limit"], line["holders"]) for line in mine] == [
        (f"{prefix}email", 3, 0),
        (f"{prefix}provider", 2, 0),
        (f"{prefix}tenant", 1, 0),
    ]


def plan_limit(tenant: str, *args: Any) -> int:
    return 3 if tenant.startswith("premium-") else 1


def test_status_of_a_cap_whose_limit_is_a_function_of_the_key(store: SlotStore, prefix: str) -> None:
    app = Celery(f"{prefix}proj", broker="memory://", set_as_current=False)
    app.conf.caps_url = store

    @app.task(base=CappedTask, cap=Cap(f"{prefix}plan", plan_limit, key=lambda tenant: tenant), shared=False)
    def sync(tenant: str) -> None: ...

    app.finalize()
    # Given two keys admitted under the limits the function gave them
    take(store, {f"{prefix}plan:premium-a": 3}, "t1", name="sync", holder="w1@host-a/1")
    take(store, {f"{prefix}plan:b": 1}, "t2", name="sync", holder="w1@host-a/2")

    # Then status names the function for the cap and shows each slot's own limit, from the store
    report = json.loads(run(app, "status", "--json").output)
    [line] = [line for line in report["caps"] if line["cap"] == f"{prefix}plan"]
    assert (line["limit"], line["limit_function"], line["keys"], line["holders"]) == (None, "plan_limit", 2, 2)
    limits = {line["slot"]: line["limit"] for line in report["slots"] if line["cap"] == f"{prefix}plan"}
    assert limits == {f"{prefix}plan:premium-a": 3, f"{prefix}plan:b": 1}
    table = run(app, "status", "--cap", f"{prefix}plan").output
    assert "per key" in table and "(full)" in table  # b holds 1 of 1; premium-a 1 of 3 is not full
    assert table.count("(full)") == 1
    app.close()


# -- holders ---------------------------------------------------------------------------


def test_holders_of_a_cap_or_a_slot(app: Celery, busy: dict[str, Any], prefix: str) -> None:
    result = run(app, "holders", f"{prefix}tenant", "--json")
    assert result.exit_code == 0, result.output
    [lease] = json.loads(result.output)  # the expired lease of tenant:old is not live
    assert {key: lease[key] for key in ("slot", "task_id", "task_name", "worker", "pid")} == {
        "slot": f"{prefix}tenant:acme",
        "task_id": busy["running"],
        "task_name": f"{prefix}import_file",
        "worker": "w1@host-a",
        "pid": 4242,
    }
    assert 0 <= lease["age_seconds"] < 30 and 60 < lease["expires_in_seconds"] <= LONG

    table = run(app, "holders", f"{prefix}tenant:acme")
    assert table.exit_code == 0
    for text in (busy["running"], f"{prefix}import_file", "w1@host-a", "4242"):
        assert text in table.output
    assert run(app, "holders", f"{prefix}email").output.count(f"{prefix}task-email") == 1
    assert run(app, "holders", f"{prefix}tenant:nobody").exit_code == 0  # a key of a registered cap


def test_holders_of_an_unknown_name_fails_in_one_line(app: Celery, prefix: str) -> None:
    result = run(app, "holders", f"{prefix}no-such-cap")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: no slot or cap named '{prefix}no-such-cap' (see `celery caps status`)"
    ]


# -- explain ---------------------------------------------------------------------------


def test_explain_a_waiting_task_names_the_full_cap_and_its_holder(
    app: Celery, busy: dict[str, Any], prefix: str
) -> None:
    result = run(app, "explain", busy["waiting"], "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    # (known from the history alone, which workers write in batches: what is known is said)
    assert (report["state"], report["task_name"], report["deferrals"]) == (
        "last seen waiting", f"{prefix}import_file", 2,
    )  # fmt: skip
    assert report["last_full_slots"] == [f"{prefix}tenant:acme"]
    by_slot = {slot["slot"]: slot for slot in report["slots"]}
    assert by_slot[f"{prefix}tenant:acme"]["full"] is True
    assert [lease["task_id"] for lease in by_slot[f"{prefix}tenant:acme"]["held_by"]] == [busy["running"]]
    assert by_slot[f"{prefix}provider"]["full"] is False

    text = run(app, "explain", busy["waiting"]).output
    assert "put back 2 time(s)" in text and "FULL" in text and busy["running"] in text
    assert "last seen waiting at " in text and "a run since then may not show yet" in text, text


def test_explain_a_running_and_a_finished_task(app: Celery, busy: dict[str, Any], prefix: str) -> None:
    report = json.loads(run(app, "explain", busy["running"], "--json").output)
    assert report["state"] == "running"
    assert sorted(lease["slot"] for lease in report["holds"]) == [f"{prefix}provider", f"{prefix}tenant:acme"]
    report = json.loads(run(app, "explain", f"{prefix}task-done", "--json").output)
    assert report["state"] == "ran" and report["runs"][0]["holder"] == "w1@host-a/4242"


def test_explain_a_task_sent_with_room_says_its_slots_are_reserved_for_it(
    app: Celery, store: SlotStore, prefix: str
) -> None:
    parking_store(store)
    app.conf.caps_park_on_publish = True
    # Given a task sent (to the in-memory broker) while its caps have room, with admission when
    # sent: it takes its slots as it is sent, held by the dispatch holder until a worker claims them
    sent = app.tasks[f"{prefix}import_file"].apply_async(("acme", "a.csv"))
    reserved = [lease for lease in store.leases() if lease.task_id == sent.id]
    assert sorted((lease.slot, lease.holder) for lease in reserved) == [
        (f"{prefix}provider", DISPATCH_HOLDER),
        (f"{prefix}tenant:acme", DISPATCH_HOLDER),
    ]

    # Then explain says it is dispatched, on which slots, and that it runs nowhere yet
    report = json.loads(run(app, "explain", sent.id, "--json").output)
    assert (report["state"], report["task_name"], report["holds"]) == ("dispatched", f"{prefix}import_file", [])
    assert sorted(slot["slot"] for slot in report["slots"]) == [f"{prefix}provider", f"{prefix}tenant:acme"]
    text = run(app, "explain", sent.id).output
    assert f"task {sent.id} ({prefix}import_file): dispatched" in text
    assert "its slots are reserved for it and its message is on the way" in text


def test_explain_an_unknown_task_says_so_and_fails(app: Celery, prefix: str) -> None:
    result = run(app, "explain", f"{prefix}never-seen")
    assert result.exit_code == 1
    assert "unknown" in result.output


# -- sweep, release, prune-keys --------------------------------------------------------


def test_sweep_removes_expired_leases_and_says_which(
    app: Celery, busy: dict[str, Any], store: SlotStore, prefix: str
) -> None:
    result = run(app, "sweep")
    assert result.exit_code == 0, result.output
    assert f"{prefix}task-old" in result.output
    assert "deleted" in result.output and "expired lease(s)" in result.output
    assert own_status(store, prefix)[f"{prefix}tenant:old"].expired == 0


def test_release_asks_first_then_frees_every_lease_of_the_task(
    app: Celery, busy: dict[str, Any], store: SlotStore, prefix: str
) -> None:
    running = busy["running"]
    declined = run(app, "release", running, input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert own_status(store, prefix)[f"{prefix}tenant:acme"].holders == 1

    accepted = run(app, "release", running, input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert f"released 2 lease(s) of task {running}" in accepted.output
    assert own_status(store, prefix)[f"{prefix}tenant:acme"].holders == 0

    assert (
        run(app, "release", f"{prefix}task-email", "--yes")
        .output.strip()
        .endswith(f"released 1 lease(s) of task {prefix}task-email")
    )
    assert run(app, "release", running, "--yes").output.strip() == f"task {running} holds no lease"


def test_prune_keys_dry_run_then_for_real(app: Celery, busy: dict[str, Any], store: SlotStore, prefix: str) -> None:
    cap = f"{prefix}tenant"
    dry = run(app, "prune-keys", cap, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.output.splitlines() == [f"would delete 1 key(s) of cap {cap}", f"  {cap}:old"]
    assert f"{cap}:old" in own_status(store, prefix)

    done = run(app, "prune-keys", cap, "--yes")
    assert done.output.splitlines() == [f"deleted 1 key(s) of cap {cap}", f"  {cap}:old"]
    assert set(own_status(store, prefix)) == {f"{prefix}email", f"{prefix}provider", f"{cap}:acme"}


def test_release_of_a_parked_task_drops_it_and_hands_its_dispatch_to_the_next_waiter(
    app: Celery, store: SlotStore, prefix: str
) -> None:
    parking_store(store)
    app.conf.caps_strategy = "park"
    slot = f"{prefix}tenant:acme"
    running = take(store, {slot: 1}, f"{prefix}running", name=f"{prefix}import_file", holder="w1@host-a/1")
    dropped, following = f"{prefix}dropped", f"{prefix}following"
    park_task(app, store, {slot: 1}, dropped, first=1.0)
    park_task(app, store, {slot: 1}, following, first=2.0)
    # Given the dropped task dispatched (its message on the way) when the operator releases it
    _, [dispatched] = store.release_and_wake(running, LONG)
    assert dispatched.task_id == dropped

    app.conf.result_backend = "cache+memory://"
    result = run(app, "release", dropped, input="y\n")

    assert result.exit_code == 0, result.output
    # (its dispatch leases, reserving its slot, are its leases)
    question = f"Release the 1 lease(s) of task {dropped} and drop it from the waiting list (it will not run)?"
    assert question in result.output, result.output
    assert f"removed task {dropped} from the waiting list; it will not run" in result.output
    # ... its caller's result.get() returns: the task ended REVOKED, as a revoke ends it
    assert app.AsyncResult(dropped).state == "REVOKED"
    assert "celery caps release" in str(app.AsyncResult(dropped).result)
    # ... its slot went on to the next waiter, whose message was published
    assert [(w.task_id, w.dispatched) for w in store.waiters(slot)] == [(following, True)]
    assert [lease.task_id for lease in store.leases(slot)] == [following]
    assert [message["id"] for message in published(app)] == [following]
    assert run(app, "release", dropped, "--yes").output.strip() == f"task {dropped} holds no lease"


def test_prune_keys_keeps_a_key_that_a_parked_task_waits_for(
    app: Celery, busy: dict[str, Any], store: SlotStore, prefix: str
) -> None:
    parking_store(store)
    cap = f"{prefix}tenant"
    # Given a task parked for key "gone", whose holder's lease then expired (nobody woke it yet)
    holder = take(store, {f"{cap}:gone": 1}, f"{prefix}gone", name="t", holder="w1@host-a/3", lease=SHORT)
    park_task(app, store, {f"{cap}:gone": 1}, f"{prefix}parked", first=1.0, tenant="gone")
    wait_expired(store, holder)

    result = run(app, "prune-keys", cap, "--yes")

    # Then only the idle key "old" goes
    assert result.output.splitlines() == [f"deleted 1 key(s) of cap {cap}", f"  {cap}:old"]
    assert f"{cap}:gone" in own_status(store, prefix)


def test_sweep_with_park_wakes_the_waiter_of_an_expired_lease(app: Celery, store: SlotStore, prefix: str) -> None:
    parking_store(store)
    app.conf.caps_strategy = "park"
    slot = f"{prefix}tenant:gone"
    # Given a task parked behind a holder whose lease expired (its worker died: nobody released)
    holder = take(store, {slot: 1}, f"{prefix}dead", name="t", holder="w1@host-a/3", lease=SHORT)
    park_task(app, store, {slot: 1}, f"{prefix}parked", first=1.0, tenant="gone")
    wait_expired(store, holder)

    result = run(app, "sweep")

    # Then the expired lease is deleted and the waiter is dispatched and published
    assert result.exit_code == 0, result.output
    assert "deleted" in result.output and "published" in result.output, result.output
    assert f"{prefix}parked" in [message["id"] for message in published(app)]
    assert [(w.task_id, w.dispatched) for w in store.waiters(slot)] == [(f"{prefix}parked", True)]


@pytest.mark.parametrize("argument", ["tenant:acme", ""])
def test_prune_keys_refuses_a_slot_name(app: Celery, argument: str) -> None:
    result = run(app, "prune-keys", argument)
    assert result.exit_code == 2
    assert "is not a cap name" in result.output


# -- the waiting list (park strategy) ----------------------------------------------------------


@pytest.fixture
def parked(app: Celery, busy: dict[str, Any], store: SlotStore, prefix: str) -> list[str]:
    """Given (on top of ``busy``) two imports for tenant acme parked behind the running one,
    first deferred 20 s and 10 s ago; returns their task ids, oldest first."""
    parking_store(store)
    app.conf.caps_strategy = "park"
    slots = {f"{prefix}provider": 2, f"{prefix}tenant:acme": 1}
    task_ids = [f"{prefix}parked-older", f"{prefix}parked-younger"]
    for task_id, ago in zip(task_ids, (20, 10), strict=True):
        park_task(app, store, slots, task_id, first=time.time() - ago)
    return task_ids


def test_status_shows_how_many_tasks_wait_and_the_oldest_wait(app: Celery, parked: list[str], prefix: str) -> None:
    report = json.loads(run(app, "status", "--json").output)
    slots = {line["slot"]: line for line in report["slots"] if line["slot"].startswith(prefix)}
    for slot in (f"{prefix}tenant:acme", f"{prefix}provider"):
        assert slots[slot]["waiters"] == 2
        assert 0 <= slots[slot]["oldest_waiter_seconds"] < 60
    assert (slots[f"{prefix}email"]["waiters"], slots[f"{prefix}email"]["oldest_waiter_seconds"]) == (0, None)
    caps_seen = {line["cap"]: line for line in report["caps"]}
    assert (caps_seen[f"{prefix}tenant"]["waiters"], caps_seen[f"{prefix}email"]["waiters"]) == (2, 0)

    table = run(app, "status", "--cap", f"{prefix}tenant").output
    assert "waiting" in table and "oldest wait" in table
    [acme] = [line for line in table.splitlines() if f"{prefix}tenant:acme" in line]
    assert acme.split("│")[5].strip() == "2", acme


def test_explain_a_parked_task_gives_its_place_in_line_and_its_wait(
    app: Celery, parked: list[str], prefix: str
) -> None:
    report = json.loads(run(app, "explain", parked[1], "--json").output)
    assert report["state"] == "parked"
    assert {(e["slot"], e["position"], e["waiters"], e["dispatched"]) for e in report["parked"]} == {
        (f"{prefix}provider", 2, 2, False),
        (f"{prefix}tenant:acme", 2, 2, False),
    }
    assert 9 < report["waited_seconds"] < 60
    assert {slot["slot"]: slot["full"] for slot in report["slots"]}[f"{prefix}tenant:acme"] is True

    text = run(app, "explain", parked[1]).output
    assert f"task {parked[1]} ({prefix}import_file): parked" in text
    assert f"{prefix}tenant:acme: position 2 of 2" in text


def test_waiters_lists_a_caps_waiting_tasks_in_order(app: Celery, parked: list[str], prefix: str) -> None:
    result = run(app, "waiters", f"{prefix}tenant", "--json")
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)
    assert [(w["slot"], w["position"], w["task_id"], w["state"]) for w in listed] == [
        (f"{prefix}tenant:acme", 1, parked[0], "waiting"),
        (f"{prefix}tenant:acme", 2, parked[1], "waiting"),
    ]
    assert [round(w["waited_seconds"]) // 10 for w in listed] == [2, 1]
    assert listed[0]["task_name"] == f"{prefix}import_file"

    table = run(app, "waiters", f"{prefix}provider").output
    assert table.index(parked[0]) < table.index(parked[1]) and "waiting" in table
    assert run(app, "waiters", f"{prefix}email").output.strip() == f"{prefix}email: no waiting task"
    unknown = run(app, "waiters", f"{prefix}nothing")
    assert unknown.exit_code == 1
    assert unknown.output.strip() == f"Error: no slot or cap named '{prefix}nothing' (see `celery caps status`)"


def test_drain_publishes_the_waiting_tasks_then_empties_the_list(
    app: Celery, parked: list[str], store: SlotStore, prefix: str
) -> None:
    cap = f"{prefix}tenant"
    dry = run(app, "drain", cap, "--dry-run")
    assert dry.exit_code == 0 and f"would publish 2 waiting task(s) of {cap}" in dry.output
    declined = run(app, "drain", cap, input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert len(store.waiters(f"{cap}:acme")) == 2 and published(app) == []

    result = run(app, "drain", cap, "--yes")

    assert result.exit_code == 0, result.output
    assert f"published 2 waiting task(s) of {cap}; each leaves the waiting list when its copy arrives" in (
        result.output
    )
    # Oldest first, each copy carrying its dispatch (without leases: it goes through admission
    # again); the list keeps them, dispatched, until their copies claim
    messages = published(app)
    assert [message["id"] for message in messages] == parked
    assert all(message["caps_dispatch_run_id"] for message in messages)
    assert [(w.task_id, w.dispatched) for w in store.waiters(f"{cap}:acme")] == [(t, True) for t in parked]
    assert run(app, "drain", cap, "--yes").output.strip() == f"{cap}: no waiting task"


def test_drain_counts_a_task_parked_without_its_message_as_published(
    app: Celery, parked: list[str], store: SlotStore, prefix: str
) -> None:
    # Given, behind the two parked tasks, one parked outside (its message, too large for the store,
    # waits in the broker)
    cap = f"{prefix}tenant"
    name = next(name for name in app.tasks if name.endswith("import_file"))
    outside = f"{prefix}outside"
    request = ParkRequest(
        {f"{cap}:acme": 1}, outside, uuid.uuid4().hex, "w2@host-b/2", LONG, 3.0, 100, name, OUTSIDE_PAYLOAD
    )
    assert store.park(request) == ParkOutcome.PARKED

    result = run(app, "drain", cap, "--yes")

    # Then all three are drained: two copies published, and the third's own message claims its
    # dispatch when it comes back (nothing to publish, and no error for it)
    assert result.exit_code == 0, result.output
    assert f"published 3 waiting task(s) of {cap}" in result.output
    assert [message["id"] for message in published(app)] == parked
    listed = sorted((w.task_id, w.dispatched) for w in store.waiters(f"{cap}:acme"))
    assert listed == sorted((t, True) for t in [*parked, outside])


def test_drain_stops_at_the_brokers_first_failure_and_leaves_the_rest_in_the_list(
    app: Celery, parked: list[str], store: SlotStore, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a broker that refuses connections (kombu tries once: its default retries to connect
    # take 6 s a task)
    app.conf.broker_url = "redis://127.0.0.1:1/0"
    app.conf.broker_transport_options = {"max_retries": 1}

    result = run(app, "drain", f"{prefix}tenant", "--yes")

    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: publishing stopped at the broker's first failure (is it reachable?): 2 task(s) were not "
        "published; they stay in the waiting list, dispatched, and the workers publish them once their "
        "dispatch expires. Run drain again for the rest of the list once the broker is back"
    )
    # ... after one try: the second task was not tried (a drain of 1,000 tasks takes one try, not 1,000)
    failures = [r for r in caplog.records if r.getMessage().startswith("could not publish waiting task")]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert [(w.task_id, w.dispatched) for w in store.waiters(f"{prefix}tenant:acme")] == [
        (parked[0], True),
        (parked[1], True),
    ]


def test_redispatch_hands_free_slots_to_waiting_tasks_now(
    app: Celery, busy: dict[str, Any], parked: list[str], store: SlotStore, prefix: str
) -> None:
    # Given the running import's slots freed without waking anyone (as by a plain release)
    assert store.release_task(busy["running"]) == 2
    assert run(app, "redispatch", f"{prefix}email").output.strip() == f"{prefix}email: no waiting task"

    result = run(app, "redispatch", f"{prefix}tenant")

    # Then the oldest waiter gets tenant acme's single slot, and its message carries its dispatch
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"dispatched 1 waiting task(s) of {prefix}tenant",
        f"  {parked[0]} {prefix}import_file",
    ]
    assert [(w.task_id, w.dispatched) for w in store.waiters(f"{prefix}tenant:acme")] == [
        (parked[0], True),
        (parked[1], False),
    ]
    [message] = published(app)
    assert message["id"] == parked[0] and message["caps_dispatch_run_id"]
    assert {lease.run_id for lease in store.leases(f"{prefix}tenant:acme")} == {message["caps_dispatch_run_id"]}


def test_waiting_list_commands_on_a_store_without_one(app: Celery, store: SlotStore, prefix: str) -> None:
    if isinstance(store, ParkingStore):
        pytest.skip("this store has a waiting list")
    assert run(app, "waiters", f"{prefix}tenant").output.strip() == f"{prefix}tenant: no waiting task"
    for command in ("drain", "redispatch"):
        result = run(app, command, f"{prefix}tenant")
        assert result.exit_code == 1
        assert result.output.strip() == f"Error: the slot store {type(store).__name__} has no waiting list"


# -- limit -----------------------------------------------------------------------------


def test_limit_overrides_the_code_shows_where_it_comes_from_and_resets(
    app: Celery, store: SlotStore, prefix: str
) -> None:
    email = f"{prefix}email"
    # Given: the code's limit of 3, two held
    for number in range(2):
        take(store, {email: 3}, f"{prefix}e{number}", name="send_email", holder="w1@host-a/1")
    assert run(app, "limit", email).output.strip() == f"{email}: limit 3, from code"

    # When: an operator cuts it to 1
    result = run(app, "limit", email, "1")
    assert result.exit_code == 0, result.output
    assert (
        result.output.splitlines()[0]
        == f"{email}: limit 1 (set), was 3 (the code's); every worker counts against it from now on"
    )

    # Then: the store refuses a task that carries the code's 3, and status says where the limit comes from
    assert store.acquire({email: 3}, f"{prefix}e9", uuid.uuid4().hex, "w1@host-a/1", LONG).granted is False
    report = json.loads(run(app, "status", "--json").output)
    [line] = [line for line in report["caps"] if line["cap"] == email]
    assert (line["limit"], line["limit_source"], line["code_limit"]) == (1, "operator", 3)
    [slot] = [slot for slot in report["slots"] if slot["slot"] == email]
    assert (slot["limit"], slot["limit_source"], slot["holders"]) == (1, "operator", 2)
    table = run(app, "status", "--cap", email).output
    assert "1 (set; code 3)" in table and "(full)" in table
    shown = run(app, "limit", email).output.splitlines()
    assert shown[0] == f"{email}: limit 1, set by an operator (code: 3)"
    assert shown[1] == "changes:" and shown[2].endswith(f"{email} -> 1  (caps limit by {shown[2].split('by ')[-1]}")

    # When: it is reset
    result = run(app, "limit", email, "--reset")
    assert (
        result.output.splitlines()[0]
        == f"{email}: limit 3 (the code's), was 1 (set); every worker counts against it from now on"
    )
    assert email not in store.limits()
    assert run(app, "limit", email).output.splitlines()[0] == f"{email}: limit 3, from code"
    take(store, {email: 3}, f"{prefix}e9", name="send_email", holder="w1@host-a/1")


def test_limit_of_one_key_beats_its_caps_and_a_raise_wakes_the_waiters(
    app: Celery, store: SlotStore, prefix: str
) -> None:
    store = parking_store(store)
    tenant = f"{prefix}tenant"
    acme = f"{tenant}:acme"
    # Given: tenant acme full at the code's 1, two imports waiting for it
    take(store, {acme: 1}, f"{prefix}running", name="import_file", holder="w1@host-a/1")
    park_task(app, store, {acme: 1}, f"{prefix}w0", first=time.time() - 5)
    park_task(app, store, {acme: 1}, f"{prefix}w1", first=time.time() - 4)
    # When: an operator raises acme to 3
    result = run(app, "limit", acme, "3")
    # Then: both waiters are dispatched at once, their copies published
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1] == "dispatched 2 waiting task(s) into the room it leaves"
    assert sorted(message["id"] for message in published(app)) == [f"{prefix}w0", f"{prefix}w1"]
    assert [waiter.dispatched for waiter in store.waiters(acme)] == [True, True]
    report = json.loads(run(app, "explain", f"{prefix}w0", "--json").output)
    [needed] = [slot for slot in report["slots"] if slot["slot"] == acme]
    assert (needed["limit"], needed["limit_source"]) == (3, "operator")
    assert "tenant:acme: 3/3 held (limit set by an operator)" in run(app, "explain", f"{prefix}w0").output
    # ... and the cap's limit for all keys does not undo the key's own
    run(app, "limit", tenant, "2")
    report = json.loads(run(app, "status", "--json").output)
    limits = {slot["slot"]: (slot["limit"], slot["limit_source"]) for slot in report["slots"] if slot["cap"] == tenant}
    assert limits[acme] == (3, "operator")
    [line] = [line for line in report["caps"] if line["cap"] == tenant]
    assert (line["limit"], line["keys_with_limits_set"]) == (2, 1)
    # ... and once the key's is reset, the cap's holds for it (not the code's), and both say so
    result = run(app, "limit", acme, "--reset")
    assert result.output.splitlines()[0] == (
        f"{acme}: limit 2 (set for {tenant}), was 3 (set); every worker counts against it from now on"
    )
    assert (
        run(app, "limit", acme).output.splitlines()[0] == f"{acme}: limit 2, set by an operator for {tenant} (code: 1)"
    )
    report = json.loads(run(app, "status", "--json").output)
    [slot] = [slot for slot in report["slots"] if slot["slot"] == acme]
    assert (slot["limit"], slot["limit_source"], slot["limit_set_for"]) == (2, "operator", tenant)
    assert f"2 (set for {tenant})" in run(app, "status", "--cap", tenant).output


def test_a_limit_left_on_a_cap_no_task_declares_any_more_is_shown_and_reset(
    app: Celery, store: SlotStore, prefix: str
) -> None:
    # Given: an operator's limit on a cap the code has since renamed (it would hold again if the
    # name came back)
    gone = f"{prefix}renamed-away"
    store.set_limit(gone, 2)
    # Then: it is shown and can be reset; setting it again is refused, naming the caps the app has
    shown = run(app, "limit", gone)
    assert shown.exit_code == 0, shown.output
    assert (
        shown.output.splitlines()[0]
        == f"{gone}: limit 2, set by an operator (code: none (no task of this app declares it))"
    )
    assert run(app, "limit", gone, "3").exit_code != 0
    reset = run(app, "limit", gone, "--reset")
    assert reset.exit_code == 0, reset.output
    assert gone not in store.limits()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["nosuchcap", "2"], "Error: no task of this app declares a cap named 'nosuchcap' (its caps: {caps})"),
        (["{prefix}email", "0"], "0 is not in the range 1<=x<=2147483647"),
        (["{prefix}email", "many"], "'many' is not a valid integer"),
        (["{prefix}email", "2", "--reset"], "give N or --reset, not both"),
        (["{prefix}tenant:", "2"], "'{prefix}tenant:' gives no key after '{prefix}tenant:'"),
        (["{prefix}email:acme", "2"], "cap '{prefix}email' has no key function, so '{prefix}email:acme' names no slot"),
        (["{prefix}email", "2147483648"], "2147483648 is not in the range 1<=x<=2147483647"),
    ],
)
def test_limit_refuses_unknown_caps_and_bad_values_and_changes_nothing(
    app: Celery, store: SlotStore, prefix: str, arguments: list[str], message: str
) -> None:
    result = run(app, "limit", *(argument.format(prefix=prefix) for argument in arguments))
    assert result.exit_code != 0
    caps = ", ".join(sorted(f"{prefix}{name}" for name in ("email", "provider", "tenant")))
    assert message.format(caps=caps, prefix=prefix) in result.output
    assert not [name for name in store.limits() if name.startswith(prefix)]


# -- watch, timeline -------------------------------------------------------------------


def test_watch_refreshes_the_tables(app: Celery, busy: dict[str, Any], prefix: str) -> None:
    result = run(app, "watch", "--interval", "0.1", "--iterations", "2", "--cap", f"{prefix}tenant")
    assert result.exit_code == 0, result.output
    assert f"{prefix}tenant:acme" in result.output and "Ctrl-C" in result.output


def test_timeline_draws_a_picture_of_the_history(
    app: Celery, busy: dict[str, Any], prefix: str, tmp_path: Path
) -> None:
    out = tmp_path / "caps.png"
    result = run(app, "timeline", "--since", "5m", "--out", str(out), "--cap", f"{prefix}tenant")
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}: 1 slot(s)" in result.output


def test_timeline_without_history_says_how_to_get_one(app: Celery, prefix: str, tmp_path: Path) -> None:
    app.conf.caps_history_seconds = None
    result = run(app, "timeline", "--since", "1m", "--out", str(tmp_path / "x.png"), "--cap", f"{prefix}tenant")
    assert result.exit_code == 1
    assert (
        result.output.strip()
        == "Error: nothing to draw: no run or put-back recorded in the last 1m (caps_history_seconds is not set)"
    )


@pytest.mark.parametrize("since", ["ten minutes", "-5m", "5x"])
def test_timeline_refuses_a_bad_duration(app: Celery, since: str, tmp_path: Path) -> None:
    result = run(app, "timeline", "--since", since, "--out", str(tmp_path / "x.png"))
    assert result.exit_code == 2 and "is not a duration" in result.output


def test_durations_read_and_print() -> None:
    assert [parse_duration(text) for text in ("90", "90s", "10m", "1.5h", "1d")] == [90, 90, 600, 5400, 86400]
    assert [duration(s) for s in (None, 0.25, 42, 185, 7800, -3)] == ["-", "0.2s", "42s", "3m05s", "2h10m", "-3.0s"]


# -- failures: no caps_url, unreachable stores ------------------------------------------------

COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["holders", "tenant"],
    ["explain", "some-task"],
    ["sweep"],
    ["release", "some-task", "--yes"],
    ["prune-keys", "tenant"],
    ["waiters", "tenant"],
    ["drain", "tenant", "--yes"],
    ["redispatch", "tenant"],
    ["limit", "tenant", "2"],
    ["watch", "--iterations", "1"],
    ["timeline", "--out", "/dev/null"],
]


def bare_app(caps_url: Any) -> Celery:
    app = Celery("bare", broker="memory://", set_as_current=False)
    app.conf.caps_url = caps_url
    return app


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(command[:2]) for command in COMMANDS])
def test_every_command_needs_caps_url(command: list[str]) -> None:
    result = run(bare_app(None), *command)
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: caps_url is not set")


UNREACHABLE = {
    "sqlite": "sqlite:////nonexistent-dir/caps.db",
    "postgres": "postgresql+psycopg://caps:s3cret-pw@127.0.0.1:1/caps?connect_timeout=2",
    "redis": "redis://:s3cret-pw@127.0.0.1:1/0",
}


# Every command on one unreachable store; a few on the others (a refused SQL connection is
# tried again for half a second while the schema is being created).
DOWN_CASES = [
    pytest.param(UNREACHABLE[name], command, id=f"{name}-{' '.join(command[:2])}", marks=getattr(pytest.mark, name))
    for name in UNREACHABLE
    for command in (
        # (limit refuses a cap the bare app does not declare before it reads the store.)
        [command for command in COMMANDS if command[0] != "limit"]
        if name == "redis"
        else [["status"], ["explain", "some-task"], ["timeline", "--out", "/dev/null"]]
    )
]


@pytest.mark.parametrize(("url", "command"), DOWN_CASES)
def test_every_command_fails_in_one_line_without_credentials_when_the_store_is_down(
    url: str, command: list[str]
) -> None:
    result = run(bare_app(url), *command)
    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: ") and "failed on" in line
    assert "s3cret" not in result.output


def test_an_unknown_store_scheme_is_a_one_line_error() -> None:
    result = run(bare_app("mongodb://u:s3cret@db/x"), "status")
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: caps_url 'mongodb://u:***@db/x': unknown store scheme 'mongodb'; use "), line
    assert all(scheme in line for scheme in ("sqlite://", "postgresql://", "mysql://", "redis://", "memory://")), line
    assert "s3cret" not in result.output


# -- the real `celery` executable ----------------------------------------------------------------


@pytest.mark.sqlite
def test_the_celery_command_has_caps_and_the_worker_option(tmp_path: Path) -> None:
    env = {**os.environ, "CAPS_CLI_TEST_URL": f"sqlite:///{tmp_path}/caps.db"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "celery", "-A", "tests.unit.cliapp", *args]
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    status = celery("caps", "status", "--json")
    assert status.returncode == 0, status.stderr
    assert {line["cap"]: line["limit"] for line in json.loads(status.stdout)["caps"]} == {"cli-provider": 5}
    env["CAPS_CLI_TEST_URL"] = "redis://:s3cret@127.0.0.1:1/0"
    down = celery("caps", "status")
    assert down.returncode == 1 and down.stdout == ""
    assert down.stderr.startswith("Error: status failed on redis://:***@127.0.0.1:1/0") and "s3cret" not in down.stderr
    assert "--caps-metrics-port" in celery("worker", "--help").stdout


# -- the schema: created now, or printed for your own migrations --------------------------


@contextlib.contextmanager
def fresh_sql_url(service: str, tmp_path: Path) -> Iterator[str]:
    """An empty database of ``service`` (a SQLite file, a PostgreSQL schema, a MySQL database)."""
    if service == "sqlite":
        yield f"sqlite:///{tmp_path / 'caps.db'}"
        return
    with private_sql_url(service) as url:
        yield url


@pytest.mark.parametrize(
    "service",
    ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres), pytest.param("mysql", marks=pytest.mark.mysql)],
)
def test_the_printed_schema_run_by_hand_is_all_the_store_needs(service: str, tmp_path: Path) -> None:
    with fresh_sql_url(service, tmp_path) as url:
        # Given an app that must never run DDL itself, on an empty database
        app = bare_app(url)
        app.conf.caps_create_schema = False
        # When its DDL is printed and run by hand, one statement at a time
        result = run(app, "schema", "--sql")
        assert result.exit_code == 0, result.output
        assert result.output.startswith(f"-- celery-caps schema version {SCHEMA_VERSION}\n")
        heading, _, ddl = result.output.partition("\n")
        statements = [part.strip() for part in ddl.split("\n;\n") if part.strip()]
        assert heading == f"-- celery-caps schema version {SCHEMA_VERSION}"
        assert statements and all("CREATE " in statement.upper() for statement in statements)
        engine = sa.create_engine(url)
        try:
            with engine.begin() as connection:
                for statement in statements:
                    connection.exec_driver_sql(statement)
        finally:
            engine.dispose()
        # Then the store works on it without creating anything, parking included, and on
        # PostgreSQL it finds the functions of this schema version
        store = store_from_url(url, create_schema=False)
        try:
            run_id = take(store, {"tenant:a": 1}, "t1", name="job", holder="w/1")
            assert isinstance(store, ParkingStore)
            request = ParkRequest({"tenant:a": 1}, "t2", "r2", "w/1", LONG, 1.0, 10, "job", b"payload")
            assert store.park(request) == ParkOutcome.PARKED
            released, woken = store.release_and_wake(run_id, 30.0)
            assert released == 1 and [w.task_id for w in woken] == ["t2"]
            if service == "postgres":
                assert isinstance(store, PostgreSQLStore) and store.functions
        finally:
            store.close()


def test_schema_creates_what_is_missing_and_says_which_version(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'caps.db'}"
    app = bare_app(url)
    app.conf.caps_create_schema = False
    result = run(app, "schema")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"schema version {SCHEMA_VERSION} is in place on {url}"
    engine = sa.create_engine(url)
    try:
        assert sa.inspect(engine).has_table("concurrency_slots")
    finally:
        engine.dispose()


def test_schema_of_a_store_without_one_says_there_is_nothing_to_create() -> None:
    result = run(bare_app("memory://"), "schema")
    assert result.exit_code == 0
    assert result.output.strip() == "the MemoryStore keeps no schema: there is nothing to create"


@pytest.mark.parametrize("command", [["explain"], ["release", "--yes"]], ids=["explain", "release"])
def test_a_task_id_no_store_can_keep_gets_a_one_line_answer(command: list[str], tmp_path: Path) -> None:
    # A byte that is not UTF-8 on the command line reaches Python as a lone surrogate.
    bad_id = "bad\udcff"
    result = run(bare_app(f"sqlite:///{tmp_path / 'caps.db'}"), command[0], bad_id, *command[1:])
    assert result.exit_code == 1
    assert result.output.strip() == "Error: task_id 'bad\\udcff' contains a control character or a lone surrogate"


def test_check_takes_a_scratch_slot_and_says_the_store_works(app: Celery, store: SlotStore) -> None:
    result = run(app, "check")
    assert result.exit_code == 0, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"ok: {store.display_url}: a scratch slot taken, refused to a second run and given back")
    # ... and, on a store with transactions, the isolation they run at (admission needs READ COMMITTED)
    if isinstance(store, SQLStore):
        expected = "SERIALIZABLE" if store.engine.dialect.name == "sqlite" else "READ COMMITTED"
        assert line.endswith(f"; transactions at {expected}"), line


@pytest.mark.postgres
def test_check_of_a_store_that_cannot_be_reached_says_why_in_one_line_without_credentials() -> None:
    result = run(bare_app(UNREACHABLE["postgres"]), "check")
    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: cannot connect to the slot store postgresql+psycopg://caps:***@127.0.0.1:1/caps")
    assert "Connection refused" in line
    assert "s3cret" not in result.output


@pytest.mark.pgbouncer
def test_check_through_pgbouncer_with_prepared_statements_on_names_the_problem() -> None:
    from tests.services import require_service

    pooled = sa.engine.make_url(require_service("pgbouncer-tx"))
    # Given caps_url through a transaction pooler, with prepared statements asked for
    result = run(bare_app(pooled.update_query_dict({"prepare_threshold": "5"}).render_as_string(False)), "check")
    # Then the round trip works, but the check fails and says what to change
    assert result.exit_code == 1, result.output
    assert "ok: " in result.output
    assert "prepared statements on (prepare_threshold=5)" in result.output
    assert "set prepare_threshold=none" in " ".join(result.output.split())
    # And without it (the default through a pooler: off) the check passes
    assert run(bare_app(pooled.render_as_string(False)), "check").exit_code == 0


def test_status_holders_and_explain_count_the_units_of_weighted_tasks(
    app: Celery, store: SlotStore, prefix: str
) -> None:
    # Given: the e-mail cap (limit 3) held by a task of weight 2 and one of weight 1
    email = f"{prefix}email"
    for task_id, weight in ((f"{prefix}bulk", 2), (f"{prefix}single", 1)):
        admission = store.acquire(
            {email: 3}, task_id, uuid.uuid4().hex, "w1@host-a/1", LONG, task_name=f"{prefix}send_email",
            weights={email: weight} if weight > 1 else None,
        )  # fmt: skip
        assert admission.granted
    # Then: status counts 3 units of 3 (full) held by 2 tasks, in the table and in JSON
    report = json.loads(run(app, "status", "--json").output)
    slot = next(line for line in report["slots"] if line["slot"] == email)
    assert (slot["holders"], slot["units"]) == (2, 3)
    cap = next(line for line in report["caps"] if line["cap"] == email)
    assert (cap["holders"], cap["units"]) == (2, 3)
    table = run(app, "status", "--cap", email).output
    assert "2 (3 units)" in table and "(full)" in table
    # ... holders gives each lease's weight
    leases = json.loads(run(app, "holders", email, "--json").output)
    assert sorted((lease["task_id"], lease["weight"]) for lease in leases) == [
        (f"{prefix}bulk", 2),
        (f"{prefix}single", 1),
    ]
    assert "weight" in run(app, "holders", email).output
    # ... and explain says a task put back for the cap finds it full, by units
    late = f"{prefix}late"
    event = HistoryEvent("deferred", time.time(), late, f"{prefix}send_email", (email,), (email,), "w2@b/1", None, 0)
    store.record_history([event], keep_seconds=600, max_events=100_000)
    explained = json.loads(run(app, "explain", late, "--json").output)
    assert [(s["slot"], s["holders"], s["units"], s["full"]) for s in explained["slots"]] == [(email, 2, 3, True)]
    assert f"{email}: 3/3 units held by 2 task(s)" in run(app, "explain", late).output
    # ... and waiters gives a waiting task's weight (stores with a waiting list)
    if isinstance(store, ParkingStore):
        request = ParkRequest(
            {email: 3}, f"{prefix}heavy", uuid.uuid4().hex, "w1@host-a/1", LONG, first_deferred_at=time.time(),
            max_waiters=100, task_name=f"{prefix}send_email", payload=b"message", weights={email: 2},
        )  # fmt: skip
        assert store.park(request) is ParkOutcome.PARKED
        waiting = json.loads(run(app, "waiters", email, "--json").output)
        assert [(line["task_id"], line["weight"]) for line in waiting] == [(f"{prefix}heavy", 2)]
        assert "weight" in run(app, "waiters", email).output


def test_status_waiters_and_explain_show_the_fair_keys_that_take_turns(
    app: Celery, store: SlotStore, prefix: str
) -> None:
    if not isinstance(store, ParkingStore):
        pytest.skip(f"{type(store).__name__} has no waiting list")
    # Given: the e-mail cap (limit 1) is full; tenant acme parks two tasks, then globex one
    email = f"{prefix}email"
    assert store.acquire({email: 1}, f"{prefix}running", uuid.uuid4().hex, "w1@host-a/1", LONG).granted
    for number, tenant in enumerate(["acme", "acme", "globex"]):
        request = ParkRequest(
            {email: 1}, f"{prefix}{tenant}-{number}", uuid.uuid4().hex, "w1@host-a/1", LONG,
            first_deferred_at=time.time() + number, max_waiters=100, task_name=f"{prefix}send_email",
            payload=b"message", fair_keys={email: tenant},
        )  # fmt: skip
        assert store.park(request) is ParkOutcome.PARKED
    # Then: waiters lists them in the order they will start, with their keys and rounds
    waiting = json.loads(run(app, "waiters", email, "--json").output)
    assert [(line["task_id"], line["fair_key"], line["position"]) for line in waiting] == [
        (f"{prefix}acme-0", "acme", 1), (f"{prefix}globex-2", "globex", 2), (f"{prefix}acme-1", "acme", 3)
    ]  # fmt: skip
    table = run(app, "waiters", email).output
    assert "fair key" in table and "globex" in table
    # ... status counts the keys taking turns
    report = json.loads(run(app, "status", "--json").output)
    slot = next(line for line in report["slots"] if line["slot"] == email)
    assert (slot["waiters"], slot["fair_keys_waiting"]) == (3, 2)
    assert "3 (2 keys)" in run(app, "status", "--cap", email).output
    # ... and explain says where acme's second task stands
    explained = json.loads(run(app, "explain", f"{prefix}acme-1", "--json").output)
    [entry] = explained["parked"]
    assert (entry["fair_key"], entry["ahead_of_same_key"], entry["fair_keys_waiting"]) == ("acme", 1, 2)
    assert "fair key 'acme', round 1: 1 of its key ahead of it, 2 key(s) taking turns" in (
        run(app, "explain", f"{prefix}acme-1").output
    )
