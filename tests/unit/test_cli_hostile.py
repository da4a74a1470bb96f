"""``celery caps ...`` on names that look like markup, and on names that only start alike.

Slot names come from task arguments (a key function's result), task ids from callers, holders
from hosts: each command prints them as they are, never as rich markup (``[/]`` crashed the
tables, ``[bold]`` and ``[link=...]`` hid text) or emoji codes (``:smile:``).  And a name is
matched exactly: a slot name never reaches longer keys (``tenant:acme`` is not
``tenant:acme:eu``), a cap name never the keys of a cap named in another case.

On every store of the table, with the harness of ``test_cli.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_caps.stores.base import HistoryEvent, ParkingStore, SlotStore
from tests.services import own_status
from tests.unit.test_cli import (
    LONG,
    SHORT,
    app,
    park_task,
    parking_store,
    published,
    run,
    take,
    wait_expired,
)

__all__ = ["app"]  # the fixture, imported for the tests below

#: Keys of cap ``tenant`` that rich would read as markup or an emoji code.
HOSTILE_KEYS = ("[/]", "[bold]b", "[link=x]l", "e :smile:")


@pytest.fixture
def hostile(app: Celery, store: SlotStore, prefix: str) -> dict[str, Any]:
    """Given: two runs holding two hostile keys each, under hostile task ids, task names and
    holders; a task parked for all four keys (where the store parks); an expired lease of a
    fifth hostile key; history of them all."""
    p = prefix
    app.conf.caps_strategy = "park"
    keys = [f"{p}tenant:{key}" for key in HOSTILE_KEYS]
    old_key = f"{p}tenant:[/]old"
    running = [f"{p}run[/]a", f"{p}run[bold]b"]
    name, holders = f"{p}[red]job :smile:", ["w[/]@h/11", "w[link=x]@h/12"]
    runs = [
        take(store, {keys[0]: 1, keys[1]: 1}, running[0], name=name, holder=holders[0]),
        take(store, {keys[2]: 1, keys[3]: 1}, running[1], name=name, holder=holders[1]),
    ]
    expired = take(store, {old_key: 1}, f"{p}old[/]", name=name, holder=holders[0], lease=SHORT)
    parked = f"{p}parked[/]"
    if isinstance(store, ParkingStore):
        park_task(app, store, dict.fromkeys(keys, 1), parked, first=time.time() - 5, tenant="[/]")
    now = time.time()
    store.record_history(
        [
            HistoryEvent("deferred", now - 3, parked, name, tuple(keys), tuple(keys), holders[0], None, 0),
            HistoryEvent("ran", now - 2, running[0], name, tuple(keys[:2]), (), holders[0], now - 20, 0),
        ],
        keep_seconds=600,
        max_events=100_000,
    )
    wait_expired(store, expired)
    return {
        "keys": keys,
        "old_key": old_key,
        "running": running,
        "runs": runs,
        "name": name,
        "holders": holders,
        "parked": parked,
    }


def assert_printed_as_is(output: str, *texts: str) -> None:
    for text in texts:
        assert text in output, f"{text!r} is not printed as it is:\n{output}"
    assert "😄" not in output, output


def test_status_prints_hostile_keys_as_they_are(app: Celery, hostile: dict[str, Any], prefix: str) -> None:
    result = run(app, "status")
    assert result.exit_code == 0, result.output
    assert_printed_as_is(result.output, *hostile["keys"], hostile["old_key"])
    assert run(app, "status", "--cap", f"{prefix}tenant").exit_code == 0


def test_holders_prints_hostile_keys_ids_names_and_holders_as_they_are(
    app: Celery, hostile: dict[str, Any], prefix: str
) -> None:
    result = run(app, "holders", f"{prefix}tenant")
    assert result.exit_code == 0, result.output
    worker_names = [holder.rpartition("/")[0] for holder in hostile["holders"]]
    assert_printed_as_is(result.output, *hostile["keys"], *hostile["running"], hostile["name"], *worker_names)
    one = run(app, "holders", hostile["keys"][0])
    assert one.exit_code == 0, one.output
    assert_printed_as_is(one.output, hostile["keys"][0], hostile["running"][0])


def test_waiters_and_drain_print_hostile_keys_and_ids_as_they_are(
    app: Celery, hostile: dict[str, Any], store: SlotStore, prefix: str
) -> None:
    parking_store(store)
    listed = run(app, "waiters", f"{prefix}tenant")
    assert listed.exit_code == 0, listed.output
    assert_printed_as_is(listed.output, *hostile["keys"], hostile["parked"])

    drained = run(app, "drain", hostile["keys"][1], "--yes")
    assert drained.exit_code == 0, drained.output
    assert_printed_as_is(drained.output, hostile["keys"][1], hostile["parked"])
    assert [message["id"] for message in published(app)] == [hostile["parked"]]


def test_redispatch_prints_hostile_ids_as_they_are(
    app: Celery, hostile: dict[str, Any], store: SlotStore, prefix: str
) -> None:
    parking_store(store)
    for task_id in hostile["running"]:
        store.release_task(task_id)  # room, without waking anyone
    result = run(app, "redispatch", f"{prefix}tenant")
    assert result.exit_code == 0, result.output
    assert_printed_as_is(result.output, hostile["parked"])


def test_explain_prints_hostile_keys_ids_names_and_holders_as_they_are(
    app: Celery, hostile: dict[str, Any], store: SlotStore
) -> None:
    result = run(app, "explain", hostile["running"][0])
    assert result.exit_code == 0, result.output
    assert_printed_as_is(result.output, hostile["running"][0], hostile["name"], *hostile["keys"][:2])
    assert hostile["holders"][0].rpartition("/")[0] in result.output

    parking_store(store)
    waiting = run(app, "explain", hostile["parked"])
    assert waiting.exit_code == 0, waiting.output
    # Each key it needs, who holds it and that it is full
    assert_printed_as_is(waiting.output, hostile["parked"], *hostile["keys"], *hostile["running"], "FULL")


def test_watch_prints_hostile_keys_as_they_are(app: Celery, hostile: dict[str, Any], prefix: str) -> None:
    result = run(app, "watch", "--iterations", "1", "--cap", f"{prefix}tenant")
    assert result.exit_code == 0, result.output
    assert_printed_as_is(result.output, *hostile["keys"])


def test_sweep_prints_a_hostile_expired_lease_as_it_is(app: Celery, hostile: dict[str, Any], prefix: str) -> None:
    result = run(app, "sweep")
    assert result.exit_code == 0, result.output
    assert_printed_as_is(result.output, hostile["old_key"], f"{prefix}old[/]")


def test_release_of_a_task_with_hostile_names_asks_then_releases(
    app: Celery, hostile: dict[str, Any], store: SlotStore, prefix: str
) -> None:
    task_id = hostile["running"][0]
    declined = run(app, "release", task_id, input="n\n")
    assert declined.exit_code == 1 and "Aborted" in declined.output, declined.output
    assert_printed_as_is(declined.output, task_id, *hostile["keys"][:2], hostile["name"])
    assert own_status(store, prefix)[hostile["keys"][0]].holders == 1

    accepted = run(app, "release", task_id, input="y\n")

    assert accepted.exit_code == 0, accepted.output
    assert f"released 2 lease(s) of task {task_id}" in accepted.output
    assert not [lease for lease in store.leases() if lease.task_id == task_id]


def test_prune_keys_prints_hostile_keys_as_they_are(
    app: Celery, hostile: dict[str, Any], store: SlotStore, prefix: str
) -> None:
    result = run(app, "prune-keys", f"{prefix}tenant", "--yes")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-2:] == [f"deleted 1 key(s) of cap {prefix}tenant", f"  {hostile['old_key']}"]


def test_timeline_of_hostile_keys_draws_them(app: Celery, hostile: dict[str, Any], prefix: str, tmp_path: Path) -> None:
    out = tmp_path / "caps.png"
    result = run(app, "timeline", "--since", "5m", "--out", str(out), "--cap", f"{prefix}tenant")
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_timeline_draws_a_key_that_matplotlib_would_read_as_math(
    app: Celery, store: SlotStore, prefix: str, tmp_path: Path
) -> None:
    # A "$" in a label is math text to matplotlib: "$\\frac{$x" failed to draw (ValueError).
    key = f"{prefix}tenant:$\\frac{{$x"
    take(store, {key: 1}, f"{prefix}math-run", name="job", holder="w/1")
    now = time.time()
    store.record_history(
        [HistoryEvent("ran", now - 2, f"{prefix}math-run", "job", (key,), (), "w/1", now - 9, 0)],
        keep_seconds=600,
        max_events=100_000,
    )
    out = tmp_path / "caps.png"
    result = run(app, "timeline", "--since", "5m", "--out", str(out), "--cap", f"{prefix}tenant")
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_json_keeps_hostile_names_as_they_are(app: Celery, hostile: dict[str, Any], prefix: str) -> None:
    report = json.loads(run(app, "status", "--json").output)
    assert set(hostile["keys"]) <= {line["slot"] for line in report["slots"]}


# -- names match exactly ----------------------------------------------------------------------


@pytest.fixture
def nested(app: Celery, store: SlotStore, prefix: str) -> dict[str, str]:
    """Given: a key ``acme`` and two longer keys that start with it, ``acme:eu`` and ``acme:us``,
    each held and with a task parked behind its holder (where the store parks)."""
    app.conf.caps_strategy = "park"
    slots = {key: f"{prefix}tenant:{key}" for key in ("acme", "acme:eu", "acme:us")}
    for key, slot in slots.items():
        take(store, {slot: 1}, f"{prefix}holder-{key}", name="job", holder="w1@host-a/1")
        if isinstance(store, ParkingStore):
            park_task(app, store, {slot: 1}, f"{prefix}waiter-{key}", first=time.time(), tenant=key)
    return slots


def test_drain_of_a_slot_leaves_the_longer_keys_that_start_with_its_name(
    app: Celery, nested: dict[str, str], store: SlotStore, prefix: str
) -> None:
    parking_store(store)
    # When tenant:acme is drained
    result = run(app, "drain", nested["acme"], "--yes")

    # Then its task alone is published, and tenant:acme:eu and tenant:acme:us still wait
    assert result.exit_code == 0, result.output
    assert f"published 1 waiting task(s) of {nested['acme']}" in result.output
    assert [message["id"] for message in published(app)] == [f"{prefix}waiter-acme"]
    for key in ("acme:eu", "acme:us"):
        assert [(w.task_id, w.dispatched) for w in store.waiters(nested[key])] == [(f"{prefix}waiter-{key}", False)]
        assert f"{prefix}waiter-{key}" not in result.output


def test_holders_waiters_and_redispatch_of_a_slot_leave_the_longer_keys(
    app: Celery, nested: dict[str, str], store: SlotStore, prefix: str
) -> None:
    listed = json.loads(run(app, "holders", nested["acme"], "--json").output)
    assert [lease["slot"] for lease in listed] == [nested["acme"]]
    cap = json.loads(run(app, "holders", f"{prefix}tenant", "--json").output)
    assert sorted(lease["slot"] for lease in cap) == sorted(nested.values())

    parking_store(store)
    waiting = json.loads(run(app, "waiters", nested["acme"], "--json").output)
    assert [waiter["task_id"] for waiter in waiting] == [f"{prefix}waiter-acme"]
    for key in nested:
        store.release_task(f"{prefix}holder-{key}")  # room everywhere, without waking anyone
    result = run(app, "redispatch", nested["acme"])
    assert result.output.splitlines() == [
        f"dispatched 1 waiting task(s) of {nested['acme']}",
        f"  {prefix}waiter-acme {prefix}import_file",
    ]


def test_timeline_of_a_slot_leaves_the_longer_keys(
    app: Celery, nested: dict[str, str], store: SlotStore, prefix: str, tmp_path: Path
) -> None:
    now = time.time()
    store.record_history(
        [
            HistoryEvent("ran", now - 2, f"{prefix}r-{key}", "job", (slot,), (), "w/1", now - 9, 0)
            for key, slot in nested.items()
        ],
        keep_seconds=600,
        max_events=100_000,
    )
    result = run(app, "timeline", "--since", "5m", "--out", str(tmp_path / "t.png"), "--cap", nested["acme"])
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 't.png'}: 1 slot(s)" in result.output


def test_prune_keys_lists_then_asks_before_deleting(app: Celery, store: SlotStore, prefix: str) -> None:
    # Given idle keys of cap "tenant", and of a cap "Tenant" that differs only in case
    cap = f"{prefix}tenant"
    for slot in (f"{cap}:old", f"{prefix}Tenant:old", f"{prefix}Tenant:other"):
        run_id = take(store, {slot: 1}, f"{prefix}t", name="job", holder="w1@host-a/1", lease=LONG)
        assert store.release(run_id) == 1

    # When the operator declines
    declined = run(app, "prune-keys", cap, input="n\n")

    # Then the keys were listed, and nothing is deleted
    assert declined.exit_code == 1, declined.output
    assert declined.output.splitlines()[:3] == [
        f"would delete 1 key(s) of cap {cap}",
        f"  {cap}:old",
        f"Delete 1 key(s) of cap {cap}? [y/N]: n",
    ]
    assert "Aborted" in declined.output
    assert set(own_status(store, prefix)) == {f"{cap}:old", f"{prefix}Tenant:old", f"{prefix}Tenant:other"}

    # When the operator accepts, the key of "tenant" alone goes
    accepted = run(app, "prune-keys", cap, input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert accepted.output.splitlines()[-2:] == [f"deleted 1 key(s) of cap {cap}", f"  {cap}:old"]
    assert set(own_status(store, prefix)) == {f"{prefix}Tenant:old", f"{prefix}Tenant:other"}
    # ... and with nothing to delete there is nothing to ask
    assert run(app, "prune-keys", cap).output.splitlines() == [f"would delete 0 key(s) of cap {cap}"]
