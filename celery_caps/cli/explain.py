"""``celery caps explain``: why a task waits or waited, from the store's leases and waiting
list, its recorded history and the result backend."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import click

from .common import Operator, clock, duration, guard, lease_json, new_console, one_line

if TYPE_CHECKING:
    from celery import Celery

    from ..stores.base import HistoryEvent, Lease


def backend_view(app: Celery, task_id: str) -> dict[str, Any] | None:
    """The result backend's state of ``task_id`` (None without a backend or on error)."""
    from celery.backends.base import DisabledBackend

    if isinstance(app.backend, DisabledBackend):
        return None
    try:
        meta = app.backend.get_task_meta(task_id)
    except Exception as exc:
        click.echo(f"warning: result backend not read: {one_line(str(exc))}", err=True)
        return None
    state = meta.get("status")
    if state in (None, "PENDING"):
        return None
    info = meta.get("result")
    info = info if isinstance(info, dict) else None
    return {"state": state, "name": meta.get("name") or (info or {}).get("task_name"), "meta": info}


def explain_task(operator: Operator, task_id: str) -> dict[str, Any]:
    """Everything known about why ``task_id`` waits or waited: see ``celery caps explain``."""
    from ..stores.base import DISPATCH_HOLDER

    statuses = {status.slot: status for status in operator.statuses()}
    all_leases = guard(operator.store.leases)
    # A dispatch lease reserves a woken waiter's slot until it arrives: it does not run yet.
    live = [lease for lease in all_leases if lease.task_id == task_id and lease.expires_in > 0]
    held = [lease for lease in live if lease.holder != DISPATCH_HOLDER]
    # Dispatch leases without a waiting entry: the task took its slots when it was sent.
    reserved = [lease for lease in live if lease.holder == DISPATCH_HOLDER]
    all_waiters = operator.waiters()
    parked = [waiter for waiter in all_waiters if waiter.task_id == task_id]
    in_line = {waiter.slot: 0 for waiter in parked}
    # In a slot with fair keys: the keys waiting there, and the entries of this task's key ahead of it
    keys_in_line: dict[str, set[str]] = {waiter.slot: set() for waiter in parked}
    own_key_ahead = {waiter.slot: 0 for waiter in parked}
    own = {waiter.slot: waiter for waiter in parked}
    for waiter in all_waiters:
        if waiter.slot in in_line:
            in_line[waiter.slot] += 1
            if waiter.fair_key is not None:
                keys_in_line[waiter.slot].add(waiter.fair_key)
                mine = own[waiter.slot]
                if waiter.fair_key == mine.fair_key and waiter.position < mine.position:
                    own_key_ahead[waiter.slot] += 1
    from ..errors import StoreError

    since = time.time() - (operator.settings.history_seconds or 7 * 86400)
    try:
        events = operator.store.history(since, task_id=task_id)
        history_note = None if operator.settings.history_seconds else "caps_history_seconds is not set in this app"
    except StoreError as exc:
        events, history_note = [], f"history unavailable: {one_line(str(exc))}"
    backend = backend_view(operator.app, task_id)
    deferred = [event for event in events if event.kind == "deferred"]
    runs = [event for event in events if event.kind == "ran"]
    names = [
        *(lease.task_name for lease in held),
        *(waiter.task_name for waiter in parked),
        *(lease.task_name for lease in reserved),
        *(event.task_name for event in reversed(events)),
    ]
    task_name = next((name for name in names if name), (backend or {}).get("name"))
    needed: list[str] = []
    if held:
        needed = sorted({lease.slot for lease in held})
    elif parked:
        needed = sorted(in_line)
    elif reserved:
        needed = sorted({lease.slot for lease in reserved})
    elif deferred:
        needed = list(deferred[-1].slots)
    elif backend and backend["meta"] and backend["meta"].get("slots"):
        needed = list(backend["meta"]["slots"])
    elif runs:
        needed = list(runs[-1].slots)
    elif task_name and task_name in operator.app.tasks:
        task_caps = getattr(operator.app.tasks[task_name], "_caps", ())
        needed = [cap.name + (":<key>" if cap.key else "") for cap in task_caps]

    if held:
        state = "running"
    elif parked:
        state = "dispatched" if any(waiter.dispatched for waiter in parked) else "parked"
    elif reserved:
        state = "dispatched"
    elif backend and backend["state"] not in ("DEFERRED", "STARTED", "RECEIVED"):
        state = f"finished ({backend['state']})"
    elif backend and backend["state"] == "DEFERRED":
        state = "waiting"
    elif deferred and (not runs or deferred[-1].at > runs[-1].at):
        # Known from the history alone, which workers write in batches: a run that ended since
        # may not show yet, so say what is known.
        state = LAST_SEEN_WAITING
    elif runs:
        state = "ran"
    else:
        state = "unknown"

    slots = []
    for slot in needed:
        status = statuses.get(slot)
        limit = operator.limit_of(slot, status.limit if status else None)
        holders = status.holders if status else 0
        units = status.used if status else 0
        slot_leases = [lease for lease in all_leases if lease.slot == slot and lease.expires_in > 0]
        slots.append(
            {
                "slot": slot,
                "limit": limit,
                "limit_source": operator.limit_source(slot),
                "holders": holders,
                "units": units,
                "full": limit is not None
                and units >= limit
                and not any(lease.task_id == task_id for lease in slot_leases),
                "held_by": [lease_json(lease) for lease in slot_leases if lease.task_id != task_id],
            }
        )
    last_wait = deferred[-1] if deferred else None
    meta = backend["meta"] if backend and backend["state"] == "DEFERRED" else None
    first_deferred_at = (
        (meta or {}).get("first_deferred_at")
        or (min(waiter.first_deferred_at for waiter in parked) if parked else None)
        or (deferred[0].at if deferred else None)
    )
    waited_seconds = _waited(first_deferred_at, state, runs, held)
    return {
        "task_id": task_id,
        "task_name": task_name,
        "state": state,
        "holds": [lease_json(lease) for lease in held],
        "deferrals": max([last_wait.deferrals + 1 if last_wait else 0, (meta or {}).get("deferrals", 0)]),
        "first_deferred_at": first_deferred_at,
        "waited_seconds": waited_seconds,
        "waiting": state in _WAITING_STATES,
        "parked": [
            {
                "slot": waiter.slot,
                "position": waiter.position,
                "waiters": in_line[waiter.slot],
                "parked_seconds": waiter.age,
                "dispatched": waiter.dispatched,
                "fair_key": waiter.fair_key,
                "fair_round": waiter.fair_round,
                "fair_keys_waiting": len(keys_in_line[waiter.slot]),
                "ahead_of_same_key": own_key_ahead[waiter.slot],
            }
            for waiter in parked
        ],
        "last_deferred_at": last_wait.at if last_wait else None,
        "last_full_slots": list(last_wait.full_slots) if last_wait else list((meta or {}).get("full_slots", [])),
        "next_attempt_at": (meta or {}).get("next_attempt_at"),
        "runs": [
            {"started_at": run.started_at, "ended_at": run.at, "holder": run.holder, "slots": list(run.slots)}
            for run in runs
        ],
        "result_state": backend["state"] if backend else None,
        "slots": slots,
        "history_note": history_note,
    }


#: A task whose last recorded event is a put-back, and that the store and the result backend
#: know nothing more of: it waited then, and may have run since (history is written in batches).
LAST_SEEN_WAITING = "last seen waiting"
#: The states of a task that waits for its caps now (as far as is known).
_WAITING_STATES = ("parked", "dispatched", "waiting", LAST_SEEN_WAITING)


def _waited(
    first_deferred_at: float | None, state: str, runs: Sequence[HistoryEvent], held: Sequence[Lease]
) -> float | None:
    """How long the task waited for its caps, in seconds: from its first deferral to now while
    it waits, or to the start of the run that followed (None: it never waited, or no run after
    its wait is known).  The two times may come from different machines' clocks."""
    if first_deferred_at is None:
        return None
    now = time.time()
    if state in _WAITING_STATES:
        return max(now - first_deferred_at, 0.0)
    starts = [run.started_at for run in runs if run.started_at is not None]
    starts += [now - lease.age for lease in held if lease.age is not None]
    after = [start for start in starts if start >= first_deferred_at]
    return min(after) - first_deferred_at if after else None


def print_explanation(report: Mapping[str, Any]) -> None:
    from rich.text import Text

    console = new_console()
    now = time.time()
    name = f" ({report['task_name']})" if report["task_name"] else ""
    console.print(Text.assemble((f"task {report['task_id']}{name}", "bold"), f": {report['state']}"))
    if report["result_state"]:
        console.print(f"  result backend state: {report['result_state']}")
    if report["holds"]:
        lease = report["holds"][0]
        console.print(
            f"  holds {', '.join(sorted({h['slot'] for h in report['holds']}))} on {lease['worker']} "
            f"(pid {lease['pid']}) for {duration(lease['age_seconds'])}"
        )
    if report["parked"]:
        waited = report["waited_seconds"]
        since = f", waiting for {duration(waited)} since its first deferral" if waited is not None else ""
        console.print(f"  in the waiting list{since}:")
        for entry in report["parked"]:
            console.print(
                f"    {entry['slot']}: position {entry['position']} of {entry['waiters']} "
                f"(in the list for {duration(entry['parked_seconds'])})"
            )
            if entry["fair_key"] is not None:
                console.print(
                    f"      fair key {entry['fair_key']!r}, round {entry['fair_round']}: "
                    f"{entry['ahead_of_same_key']} of its key ahead of it, {entry['fair_keys_waiting']} key(s) "
                    "taking turns"
                )
    if report["state"] == "dispatched":
        console.print("  dispatched: its slots are reserved for it and its message is on the way")
    if report["state"] == LAST_SEEN_WAITING and report["last_deferred_at"]:
        last = report["last_deferred_at"]
        console.print(
            f"  last seen waiting at {clock(last)} ({duration(now - last)} ago): the history is written in "
            "batches, so a run since then may not show yet (a result backend would tell)"
        )
    if report["waited_seconds"] is not None and not report["waiting"]:
        console.print(f"  waited {duration(report['waited_seconds'])} for its caps before it ran")
    if report["deferrals"]:
        first = report["first_deferred_at"]
        waited = f", first at {clock(first)} ({duration(now - first)} ago)" if first else ""
        console.print(f"  put back {report['deferrals']} time(s){waited}")
        if report["last_full_slots"]:
            last = report["last_deferred_at"]
            when = f" at {clock(last)}" if last else ""
            console.print(f"  last put back{when}: full {', '.join(report['last_full_slots'])}")
        if report["next_attempt_at"] and report["state"] == "waiting":
            console.print(f"  next attempt around {clock(report['next_attempt_at'])}")
    for run in report["runs"]:
        console.print(
            f"  ran {clock(run['started_at'])}-{clock(run['ended_at'])} "
            f"({duration(run['ended_at'] - run['started_at'])}) on {run['holder']}"
        )
    if report["slots"]:
        console.print("  needs:")
        for slot in report["slots"]:
            limit = slot["limit"] if slot["limit"] is not None else "?"
            flag = (" FULL", "bold red") if slot["full"] else ""
            source = " (limit set by an operator)" if slot["limit_source"] == "operator" else ""
            held = f"{slot['holders']}/{limit} held"
            if slot["units"] != slot["holders"]:
                held = f"{slot['units']}/{limit} units held by {slot['holders']} task(s)"
            console.print(Text.assemble(f"    {slot['slot']}: {held}{source}", flag))
            for lease in slot["held_by"]:
                console.print(
                    f"      {lease['task_id']} {lease['task_name'] or '?'} on {lease['worker']}/{lease['pid']}, "
                    f"age {duration(lease['age_seconds'])}, expires in {duration(lease['expires_in_seconds'])}"
                )
    if report["history_note"] and report["state"] in ("unknown", "waiting"):
        console.print(Text(f"  {report['history_note']}", style="dim"))
