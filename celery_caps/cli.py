"""``celery -A proj caps ...``: operator commands, reading through the store contract.

Every ``celery`` invocation imports this module (the ``celery.commands`` entry
point), the worker included, so it imports only click at the top; each command
imports what it needs.  Importing it also adds ``--caps-metrics-port`` to
``celery worker`` (see :func:`_add_worker_option`).

Every command fails with a one-line message and exit status 1 when the app has
no ``caps_url`` or the store cannot be reached; store URLs are shown with their
password masked.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from celery import Celery
    from rich.console import RenderableType

    from .settings import CapsSettings
    from .stores.base import HistoryEvent, Lease, SlotStatus, SlotStore, Waiter

_T = TypeVar("_T")


def _add_worker_option() -> None:
    """``celery worker --caps-metrics-port PORT``: the metrics endpoint, for any app.

    ``app.user_options["worker"]`` would need the app before the worker command
    parses its options, and capped tasks bind to their app later than that; the
    ``celery`` command has imported its ``worker`` command before it loads this
    plugin, so the option goes there directly.  The value reaches
    :class:`~celery_caps.worker.CapsWorkerStep` as a keyword argument.
    """
    worker_module = sys.modules.get("celery.bin.worker")
    if worker_module is None:  # not under the `celery` command: nothing to extend
        return
    worker = worker_module.worker
    if any(param.name == "caps_metrics_port" for param in worker.params):
        return
    from celery.bin.base import CeleryOption

    worker.params.append(
        CeleryOption(
            ["--caps-metrics-port"],
            type=click.IntRange(1, 65535),
            default=None,
            help_group="celery-caps Options",
            help="Serve celery-caps Prometheus metrics on this port (overrides caps_metrics_port).",
        )
    )


_add_worker_option()


# -- plumbing -------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _guard(work: Callable[[], _T]) -> _T:
    """Run ``work``; a celery-caps error becomes a one-line ``Error: ...`` and exit status 1."""
    from .errors import CapsError

    try:
        return work()
    except CapsError as exc:
        raise click.ClickException(_one_line(str(exc))) from exc


@dataclass(frozen=True)
class CapInfo:
    """A cap as the app's registered tasks declare it."""

    name: str
    limits: tuple[int, ...]
    keyed: bool
    tasks: tuple[str, ...]

    @property
    def limit(self) -> int:
        return min(self.limits)


@dataclass
class Operator:
    """What a command works with: the app, its settings, its store, its registered caps."""

    app: Celery
    settings: CapsSettings
    store: SlotStore
    caps: dict[str, CapInfo] = field(default_factory=dict)

    def limit_of(self, slot: str, stored: int | None) -> int | None:
        """The registered limit of ``slot``'s cap, else the limit the store last saw."""
        info = self.caps.get(slot.partition(":")[0])
        return info.limit if info is not None else stored

    def statuses(self) -> list[SlotStatus]:
        return _guard(self.store.status)

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        """The waiting list (of one slot name, if given); empty for a store without one."""
        if not self.store.supports_parking:
            return []
        return _guard(lambda: self.store.waiters(slot))


def registered_caps(app: Celery) -> dict[str, CapInfo]:
    """Every cap the app's tasks declare, by name."""
    try:
        app.loader.import_default_modules()  # tasks in `include`d modules register now
    except Exception as exc:  # a broken project module must not hide the store's state
        click.echo(f"warning: could not import the app's task modules: {_one_line(str(exc))}", err=True)
    found: dict[str, tuple[set[int], bool, list[str]]] = {}
    for task_name, task in sorted(app.tasks.items()):
        for cap in getattr(task, "_caps", ()):
            limits, keyed, tasks = found.setdefault(cap.name, (set(), False, []))
            limits.add(cap.limit)
            tasks.append(task_name)
            found[cap.name] = (limits, keyed or cap.key is not None, tasks)
    return {
        name: CapInfo(name, tuple(sorted(limits)), keyed, tuple(tasks))
        for name, (limits, keyed, tasks) in sorted(found.items())
    }


def _operator(ctx: click.Context) -> Operator:
    from .settings import CapsSettings
    from .stores.base import store_from_url

    app = getattr(ctx.obj, "app", None)  # celery's CLIContext
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()

    def build() -> Operator:
        settings = CapsSettings.from_conf(app.conf)
        store = store_from_url(settings.require_url(), create_schema=settings.create_schema)
        return Operator(app, settings, store, registered_caps(app))

    operator = _guard(build)
    if isinstance(operator.settings.url, str):  # a store we built; never close one the app handed us
        ctx.call_on_close(operator.store.close)
    return operator


def _console() -> Any:
    from rich.console import Console

    # sys.stdout at call time: click's test runner swaps it.
    return Console(file=sys.stdout, highlight=False, soft_wrap=False, width=_width())


def _width() -> int | None:
    # A pipe or a test runner has no terminal: wide enough for every column.
    return None if sys.stdout.isatty() else 160


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False))


def duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h10m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    sign, seconds = ("-" if seconds < 0 else ""), abs(seconds)
    if seconds < 10:
        return f"{sign}{seconds:.1f}s"
    if seconds < 60:
        return f"{sign}{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{sign}{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{sign}{hours}h{minutes:02d}m"
    return f"{sign}{hours // 24}d{hours % 24:02d}h"


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h``, ``1d`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise click.BadParameter(f"{text!r} is not a duration (examples: 90s, 10m, 2h, 1d)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def _split_holder(holder: str) -> tuple[str, str]:
    node, separator, pid = holder.rpartition("/")
    return (node, pid) if separator else (holder, "")


# -- the caps group ---------------------------------------------------------------


@click.group(name="caps")
@click.pass_context
def caps(ctx: click.Context) -> None:
    """Inspect and operate celery-caps: caps, slots, holders, waiting tasks."""


# -- status -----------------------------------------------------------------------


@dataclass(frozen=True)
class SlotWaiting:
    """A slot's waiting list in short (park strategy)."""

    #: Tasks parked for the slot (waiting or dispatched).
    waiters: int
    #: How long the longest-waiting of them has waited since its first deferral (seconds; the
    #: deferring worker's clock against this machine's).
    oldest_seconds: float


def waiting_per_slot(waiters: Iterable[Waiter]) -> dict[str, SlotWaiting]:
    now = time.time()
    found: dict[str, list[float]] = {}
    for waiter in waiters:
        found.setdefault(waiter.slot, []).append(max(now - waiter.first_deferred_at, 0.0))
    return {slot: SlotWaiting(len(waits), max(waits)) for slot, waits in found.items()}


@dataclass(frozen=True)
class CapSummary:
    cap: str
    limit: int | None
    registered: bool
    keyed: bool
    keys: int
    holders: int
    expired: int
    tasks: tuple[str, ...]
    #: Parked tasks over the cap's slots (a task waiting for two keys counts twice).
    waiters: int = 0


def summarize(
    operator: Operator, statuses: Sequence[SlotStatus], waiting: Mapping[str, SlotWaiting] | None = None
) -> list[CapSummary]:
    """One line per cap: registered caps (used or not) and caps found only in the store."""
    waiting = waiting or {}
    by_cap: dict[str, list[SlotStatus]] = {}
    for status in statuses:
        by_cap.setdefault(status.slot.partition(":")[0], []).append(status)
    summaries = []
    for cap in sorted(set(by_cap) | set(operator.caps)):
        slots = by_cap.get(cap, [])
        info = operator.caps.get(cap)
        stored_limits = [status.limit for status in slots if status.limit is not None]
        summaries.append(
            CapSummary(
                cap=cap,
                limit=info.limit if info is not None else (max(stored_limits) if stored_limits else None),
                registered=info is not None,
                keyed=info.keyed if info is not None else any(":" in status.slot for status in slots),
                keys=sum(1 for status in slots if ":" in status.slot),
                holders=sum(status.holders for status in slots),
                expired=sum(status.expired for status in slots),
                tasks=info.tasks if info is not None else (),
                waiters=sum(waiting[status.slot].waiters for status in slots if status.slot in waiting),
            )
        )
    return summaries


def _shows_waiting(operator: Operator, waiting: Mapping[str, SlotWaiting]) -> bool:
    """Whether the tables show the waiting list: a store that parks, and park in use or waiters."""
    return operator.store.supports_parking and (operator.settings.parking.uses_park or bool(waiting))


def _status_tables(
    operator: Operator, statuses: Sequence[SlotStatus], cap: str | None, waiting: Mapping[str, SlotWaiting]
) -> list[Any]:
    from rich.table import Table

    threshold = operator.settings.key_warning_threshold
    show_waiting = _shows_waiting(operator, waiting)
    summary = Table(title="caps", title_justify="left")
    for column, justify in (("cap", "left"), ("limit", "right"), ("keys", "right"), ("holders", "right")):
        summary.add_column(column, justify=justify)  # type: ignore[arg-type]
    summary.add_column("expired", justify="right")
    if show_waiting:
        summary.add_column("waiting", justify="right")
    summary.add_column("tasks")
    for line in summarize(operator, statuses, waiting):
        if cap is not None and line.cap != cap:
            continue
        keys = str(line.keys) if line.keyed else "-"
        if line.keys > threshold:
            keys = f"[bold red]{line.keys}[/] (> {threshold})"
        name = line.cap if line.registered else f"{line.cap} [dim](not registered)[/]"
        cells = [name, str(line.limit) if line.limit is not None else "?", keys, str(line.holders), str(line.expired)]
        if show_waiting:
            cells.append(str(line.waiters))
        summary.add_row(*cells, ", ".join(line.tasks) or "-")
    slots = Table(title="slots", title_justify="left")
    columns = ["slot", "limit", "holders", "expired"] + (["waiting", "oldest wait"] if show_waiting else [])
    for column in columns:
        slots.add_column(column, justify="left" if column == "slot" else "right")
    for status in statuses:
        if cap is not None and status.slot.partition(":")[0] != cap:
            continue
        limit = operator.limit_of(status.slot, status.limit)
        holders = str(status.holders)
        if limit is not None and status.holders >= limit:
            holders = f"[bold]{status.holders}[/] (full)"
        cells = [status.slot, str(limit) if limit is not None else "?", holders, str(status.expired)]
        if show_waiting:
            slot_waiting = waiting.get(status.slot)
            cells += [str(slot_waiting.waiters), duration(slot_waiting.oldest_seconds)] if slot_waiting else ["0", "-"]
        slots.add_row(*cells)
    return [summary, slots]


@caps.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--cap", "cap", metavar="NAME", default=None, help="Only this cap and its keys.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, cap: str | None) -> None:
    """Every cap and slot: limit, live holders, expired leases not swept yet, keys per cap,
    and (park strategy) tasks waiting and how long the oldest has waited."""
    operator = _operator(ctx)
    statuses = operator.statuses()
    waiting = waiting_per_slot(operator.waiters())
    if as_json:
        _echo_json(
            {
                "caps": [
                    {
                        "cap": line.cap,
                        "limit": line.limit,
                        "registered": line.registered,
                        "keyed": line.keyed,
                        "keys": line.keys,
                        "holders": line.holders,
                        "expired": line.expired,
                        "waiters": line.waiters,
                        "tasks": list(line.tasks),
                    }
                    for line in summarize(operator, statuses, waiting)
                    if cap is None or line.cap == cap
                ],
                "slots": [
                    {
                        "slot": status.slot,
                        "cap": status.slot.partition(":")[0],
                        "limit": operator.limit_of(status.slot, status.limit),
                        "holders": status.holders,
                        "expired": status.expired,
                        "waiters": waiting[status.slot].waiters if status.slot in waiting else 0,
                        "oldest_waiter_seconds": waiting[status.slot].oldest_seconds
                        if status.slot in waiting
                        else None,
                    }
                    for status in statuses
                    if cap is None or status.slot.partition(":")[0] == cap
                ],
            }
        )
        return
    console = _console()
    for table in _status_tables(operator, statuses, cap, waiting):
        console.print(table)


# -- holders ----------------------------------------------------------------------


def _lease_json(lease: Lease) -> dict[str, Any]:
    node, pid = _split_holder(lease.holder)
    return {
        "slot": lease.slot,
        "task_id": lease.task_id,
        "task_name": lease.task_name,
        "worker": node,
        "pid": int(pid) if pid.isdigit() else None,
        "age_seconds": lease.age,
        "expires_in_seconds": lease.expires_in,
        "run_id": lease.run_id,
    }


def _lease_table(leases: Iterable[Lease], title: str | None = None) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("slot", "task id", "task", "worker", "pid"):
        table.add_column(column)
    table.add_column("age", justify="right")
    table.add_column("expires in", justify="right")
    for lease in leases:
        node, pid = _split_holder(lease.holder)
        expires = duration(lease.expires_in) if lease.expires_in > 0 else f"expired {duration(-lease.expires_in)} ago"
        table.add_row(lease.slot, lease.task_id, lease.task_name or "?", node, pid, duration(lease.age), expires)
    return table


def _waiter_json(waiter: Waiter, now: float) -> dict[str, Any]:
    return {
        "slot": waiter.slot,
        "position": waiter.position,
        "task_id": waiter.task_id,
        "task_name": waiter.task_name,
        "first_deferred_at": waiter.first_deferred_at,
        "waited_seconds": max(now - waiter.first_deferred_at, 0.0),
        "parked_seconds": waiter.age,
        "state": "dispatched" if waiter.dispatched else "waiting",
    }


def _waiter_table(waiters: Iterable[Waiter], title: str | None = None) -> Any:
    from rich.table import Table

    now = time.time()
    table = Table(title=title, title_justify="left")
    table.add_column("slot")
    table.add_column("#", justify="right")
    for column in ("task id", "task"):
        table.add_column(column)
    table.add_column("waited", justify="right")
    table.add_column("parked", justify="right")
    table.add_column("state")
    for waiter in waiters:
        table.add_row(
            waiter.slot,
            str(waiter.position),
            waiter.task_id,
            waiter.task_name or "?",
            duration(max(now - waiter.first_deferred_at, 0.0)),
            duration(waiter.age),
            "dispatched" if waiter.dispatched else "waiting",
        )
    return table


def _slots_of(name: str, statuses: Iterable[SlotStatus]) -> list[str]:
    """``name`` itself if it is a slot, plus every key of it if it is a cap."""
    return [status.slot for status in statuses if status.slot == name or status.slot.startswith(name + ":")]


@caps.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def holders(ctx: click.Context, name: str, as_json: bool) -> None:
    """Live leases of NAME: a slot (tenant:acme) or a cap with all its keys (tenant)."""
    operator = _operator(ctx)
    slots = set(_slots_of(name, operator.statuses()))
    if not slots and name.partition(":")[0] not in operator.caps:
        raise click.ClickException(f"no slot or cap named {name!r} (see `celery caps status`)")
    leases = [lease for lease in _guard(operator.store.leases) if lease.slot in slots and lease.expires_in > 0]
    if as_json:
        _echo_json([_lease_json(lease) for lease in leases])
        return
    if not leases:
        click.echo(f"{name}: no live lease")
        return
    _console().print(_lease_table(leases, title=f"{len(leases)} live lease(s) of {name}"))


# -- explain ----------------------------------------------------------------------


def _backend_view(app: Celery, task_id: str) -> dict[str, Any] | None:
    """The result backend's state of ``task_id`` (None without a backend or on error)."""
    from celery.backends.base import DisabledBackend

    if isinstance(app.backend, DisabledBackend):
        return None
    try:
        meta = app.backend.get_task_meta(task_id)
    except Exception as exc:
        click.echo(f"warning: result backend not read: {_one_line(str(exc))}", err=True)
        return None
    state = meta.get("status")
    if state in (None, "PENDING"):
        return None
    info = meta.get("result")
    info = info if isinstance(info, dict) else None
    return {"state": state, "name": meta.get("name") or (info or {}).get("task_name"), "meta": info}


def explain_task(operator: Operator, task_id: str) -> dict[str, Any]:
    """Everything known about why ``task_id`` waits or waited: see ``celery caps explain``."""
    from .stores.base import DISPATCH_HOLDER

    statuses = {status.slot: status for status in operator.statuses()}
    all_leases = _guard(operator.store.leases)
    # A dispatch lease reserves a woken waiter's slot until it arrives: it does not run yet.
    live = [lease for lease in all_leases if lease.task_id == task_id and lease.expires_in > 0]
    held = [lease for lease in live if lease.holder != DISPATCH_HOLDER]
    # Dispatch leases without a waiting entry: the task took its slots when it was sent.
    reserved = [lease for lease in live if lease.holder == DISPATCH_HOLDER]
    all_waiters = operator.waiters()
    parked = [waiter for waiter in all_waiters if waiter.task_id == task_id]
    in_line = {waiter.slot: 0 for waiter in parked}
    for waiter in all_waiters:
        if waiter.slot in in_line:
            in_line[waiter.slot] += 1
    from .errors import StoreError

    since = time.time() - (operator.settings.history_seconds or 7 * 86400)
    try:
        events = operator.store.history(since, task_id=task_id)
        history_note = None if operator.settings.history_seconds else "caps_history_seconds is not set in this app"
    except StoreError as exc:
        events, history_note = [], f"history unavailable: {_one_line(str(exc))}"
    backend = _backend_view(operator.app, task_id)
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
    elif (deferred and (not runs or deferred[-1].at > runs[-1].at)) or (backend and backend["state"] == "DEFERRED"):
        state = "waiting"
    elif runs:
        state = "ran"
    else:
        state = "unknown"

    slots = []
    for slot in needed:
        status = statuses.get(slot)
        limit = operator.limit_of(slot, status.limit if status else None)
        holders = status.holders if status else 0
        slot_leases = [lease for lease in all_leases if lease.slot == slot and lease.expires_in > 0]
        slots.append(
            {
                "slot": slot,
                "limit": limit,
                "holders": holders,
                "full": limit is not None
                and holders >= limit
                and not any(lease.task_id == task_id for lease in slot_leases),
                "held_by": [_lease_json(lease) for lease in slot_leases if lease.task_id != task_id],
            }
        )
    last_wait = deferred[-1] if deferred else None
    meta = backend["meta"] if backend and backend["state"] == "DEFERRED" else None
    first_deferred_at = (
        (meta or {}).get("first_deferred_at")
        or (min(waiter.first_deferred_at for waiter in parked) if parked else None)
        or (deferred[0].at if deferred else None)
    )
    return {
        "task_id": task_id,
        "task_name": task_name,
        "state": state,
        "holds": [_lease_json(lease) for lease in held],
        "deferrals": max([last_wait.deferrals + 1 if last_wait else 0, (meta or {}).get("deferrals", 0)]),
        "first_deferred_at": first_deferred_at,
        "waited_seconds": max(time.time() - first_deferred_at, 0.0) if first_deferred_at and not held else None,
        "parked": [
            {
                "slot": waiter.slot,
                "position": waiter.position,
                "waiters": in_line[waiter.slot],
                "parked_seconds": waiter.age,
                "dispatched": waiter.dispatched,
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


def _print_explanation(report: Mapping[str, Any]) -> None:
    console = _console()
    now = time.time()
    name = f" ({report['task_name']})" if report["task_name"] else ""
    console.print(f"[bold]task {report['task_id']}{name}[/]: {report['state']}")
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
    if report["state"] == "dispatched":
        console.print("  dispatched: its slots are reserved for it and its message is on the way")
    if report["deferrals"]:
        first = report["first_deferred_at"]
        waited = f", first at {_clock(first)} ({duration(now - first)} ago)" if first else ""
        console.print(f"  put back {report['deferrals']} time(s){waited}")
        if report["last_full_slots"]:
            last = report["last_deferred_at"]
            when = f" at {_clock(last)}" if last else ""
            console.print(f"  last put back{when}: full {', '.join(report['last_full_slots'])}")
        if report["next_attempt_at"] and report["state"] == "waiting":
            console.print(f"  next attempt around {_clock(report['next_attempt_at'])}")
    for run in report["runs"]:
        console.print(
            f"  ran {_clock(run['started_at'])}-{_clock(run['ended_at'])} "
            f"({duration(run['ended_at'] - run['started_at'])}) on {run['holder']}"
        )
    if report["slots"]:
        console.print("  needs:")
        for slot in report["slots"]:
            limit = slot["limit"] if slot["limit"] is not None else "?"
            flag = " [bold red]FULL[/]" if slot["full"] else ""
            console.print(f"    {slot['slot']}: {slot['holders']}/{limit} held{flag}")
            for lease in slot["held_by"]:
                console.print(
                    f"      {lease['task_id']} {lease['task_name'] or '?'} on {lease['worker']}/{lease['pid']}, "
                    f"age {duration(lease['age_seconds'])}, expires in {duration(lease['expires_in_seconds'])}"
                )
    if report["history_note"] and report["state"] in ("unknown", "waiting"):
        console.print(f"  [dim]{report['history_note']}[/]")


@caps.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def explain(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Why TASK_ID waits (or waited): the caps it needs, which are full, who holds them."""
    operator = _operator(ctx)
    report = explain_task(operator, task_id)
    if as_json:
        _echo_json(report)
    else:
        _print_explanation(report)
    if report["state"] == "unknown":
        ctx.exit(1)


# -- sweep, release, prune-keys -----------------------------------------------------


@caps.command()
@click.pass_context
def sweep(ctx: click.Context) -> None:
    """Delete expired leases now (sentinels are kept); print what was removed.  With park in
    use, then do what every worker's recovery does: dispatch again what was never claimed,
    wake what fits, readmit those past caps_max_wait_seconds."""
    from . import park

    operator = _operator(ctx)
    expired = [lease for lease in _guard(operator.store.leases) if lease.expires_in <= 0]
    deleted = _guard(operator.store.sweep)
    if expired:
        _console().print(_lease_table(expired, title="expired leases found"))
    click.echo(f"deleted {deleted} expired lease(s)")
    if park.parks(operator):
        published = _guard(lambda: park.recover(operator))
        click.echo(f"published {len(published)} waiting task(s)")


@caps.command()
@click.argument("task_id")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release(ctx: click.Context, task_id: str, yes: bool) -> None:
    """Force-release every lease of TASK_ID (its slots free at once; a running task runs on);
    a parked TASK_ID leaves the waiting list (it will not run)."""
    from . import park

    operator = _operator(ctx)
    leases = [lease for lease in _guard(operator.store.leases) if lease.task_id == task_id]
    waiting = [waiter for waiter in operator.waiters() if waiter.task_id == task_id]
    if not leases and not waiting:
        click.echo(f"task {task_id} holds no lease")
        return
    console = _console()
    if leases:
        console.print(_lease_table(leases, title=f"leases of task {task_id}"))
    if waiting:
        console.print(_waiter_table(waiting, title=f"task {task_id} in the waiting list"))
    if not yes:
        what = [f"{len(leases)} lease(s)"] if leases else []
        if waiting:
            what.append("drop it from the waiting list (it will not run)")
        click.confirm(f"Release {' and '.join(what)} of task {task_id}?", abort=True)
    released = _guard(lambda: park.release_task(operator, task_id))
    removed = _guard(lambda: park.forget(operator, task_id))
    if leases or released:
        click.echo(f"released {released} lease(s) of task {task_id}")
    if removed:
        click.echo(f"removed task {task_id} from the waiting list; it will not run")


@caps.command(name="prune-keys")
@click.argument("cap")
@click.option("--dry-run", is_flag=True, help="List the keys that would go; delete nothing.")
@click.pass_context
def prune_keys(ctx: click.Context, cap: str, dry_run: bool) -> None:
    """Delete the rows of CAP's keys that no live lease holds (retired tenants, regions).

    Safe while workers run: a key being admitted into is kept, or admitted again afresh.
    """
    if not cap or ":" in cap:
        raise click.BadParameter(f"{cap!r} is not a cap name (a cap name has no ':')", param_hint="CAP")
    operator = _operator(ctx)
    pruned = _guard(lambda: operator.store.prune(f"{cap}:", dry_run=dry_run))
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {len(pruned)} key(s) of cap {cap}")
    for slot in pruned[:50]:
        click.echo(f"  {slot}")
    if len(pruned) > 50:
        click.echo(f"  ... and {len(pruned) - 50} more")


# -- the waiting list (park strategy) ------------------------------------------------


def _parking_operator(ctx: click.Context) -> Operator:
    operator = _operator(ctx)
    operator.statuses()  # an unreachable store says so first
    if not operator.store.supports_parking:
        raise click.ClickException(f"the slot store {type(operator.store).__name__} has no waiting list")
    return operator


def _waiters_of(operator: Operator, name: str) -> list[Waiter]:
    """The waiters of NAME (a slot, or a cap with all its keys); an unknown name is an error."""
    waiters = [w for w in operator.waiters() if w.slot == name or w.slot.startswith(name + ":")]
    if not waiters and not _slots_of(name, operator.statuses()) and name.partition(":")[0] not in operator.caps:
        raise click.ClickException(f"no slot or cap named {name!r} (see `celery caps status`)")
    return waiters


@caps.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def waiters(ctx: click.Context, name: str, as_json: bool) -> None:
    """Tasks parked for NAME (a slot, or a cap with all its keys), in the order they are served."""
    operator = _operator(ctx)
    found = _waiters_of(operator, name)
    if as_json:
        now = time.time()
        _echo_json([_waiter_json(waiter, now) for waiter in found])
        return
    if not found:
        click.echo(f"{name}: no waiting task")
        return
    _console().print(_waiter_table(found, title=f"{len(found)} waiting task(s) of {name}"))


@caps.command()
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--dry-run", is_flag=True, help="List the tasks that would be published; change nothing.")
@click.pass_context
def drain(ctx: click.Context, name: str, yes: bool, dry_run: bool) -> None:
    """Publish every task waiting for NAME (a cap with all its keys, or one slot) back to the
    broker, to go through admission again, and empty its waiting list.

    Each task stays in the list, dispatched, until its copy arrives and takes it off; a copy
    that is lost is published again by the workers' recovery.  The tasks then go through
    admission again (and park again if their caps still park and are full).
    """
    from . import park

    operator = _parking_operator(ctx)
    waiting = [waiter for waiter in _waiters_of(operator, name) if not waiter.dispatched]
    if not waiting:
        click.echo(f"{name}: no waiting task")
        return
    tasks = {waiter.task_id for waiter in waiting}
    _console().print(_waiter_table(waiting, title=f"waiting for {name}"))
    if dry_run:
        click.echo(f"would publish {len(tasks)} waiting task(s) of {name}")
        return
    if not yes:
        click.confirm(f"Publish {len(tasks)} waiting task(s) of {name} back to the broker?", abort=True)
    taken = published = 0
    for slot in sorted({waiter.slot for waiter in waiting}):
        dispatched, sent = _guard(functools.partial(park.readmit, operator, slot))
        taken += dispatched
        published += len(sent)
    click.echo(f"published {published} waiting task(s) of {name}; each leaves the waiting list when its copy arrives")
    if published < taken:
        raise click.ClickException(
            f"{taken - published} task(s) could not be published (is the broker reachable?); they stay in the "
            "waiting list, and the workers publish them again once their dispatch expires"
        )


@caps.command()
@click.argument("name")
@click.pass_context
def redispatch(ctx: click.Context, name: str) -> None:
    """Dispatch now the tasks waiting for NAME (a cap with all its keys, or one slot) whose slots
    have room, and those whose dispatch expired unclaimed: the workers' recovery, at once."""
    from . import park

    operator = _parking_operator(ctx)
    slots = sorted({waiter.slot for waiter in _waiters_of(operator, name)})
    if not slots:
        click.echo(f"{name}: no waiting task")
        return
    sent = _guard(lambda: park.recover(operator, slots))
    click.echo(f"dispatched {len(sent)} waiting task(s) of {name}")
    for waiter in sent:
        click.echo(f"  {waiter.task_id} {waiter.task_name or '?'}")


# -- watch -------------------------------------------------------------------------


@caps.command()
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds.")
@click.option("--cap", "cap", metavar="NAME", default=None, help="Only this cap and its keys.")
@click.option("--iterations", default=0, type=click.IntRange(min=0), help="Stop after this many refreshes (0: never).")
@click.pass_context
def watch(ctx: click.Context, interval: float, cap: str | None, iterations: int) -> None:
    """A live view of the caps and their slots, refreshed every INTERVAL seconds (Ctrl-C quits)."""
    from rich.console import Group
    from rich.live import Live

    operator = _operator(ctx)

    def view() -> RenderableType:
        statuses = operator.statuses()
        waiting = waiting_per_slot(operator.waiters())
        stamp = f"[dim]{_clock(time.time())}, every {interval:g}s, Ctrl-C to quit[/]"
        return Group(stamp, *_status_tables(operator, statuses, cap, waiting))

    console = _console()
    refreshes = 0
    try:
        with Live(view(), console=console, auto_refresh=False, transient=False) as live:
            while True:
                refreshes += 1
                if iterations and refreshes >= iterations:
                    break
                time.sleep(interval)
                live.update(view(), refresh=True)
    except KeyboardInterrupt:
        pass


# -- timeline ------------------------------------------------------------------------


@caps.command()
@click.option("--since", "since_text", default="10m", show_default=True, help="How far back: 90s, 10m, 2h, 1d.")
@click.option("--out", "out", default="caps-timeline.png", show_default=True, type=click.Path(dir_okay=False))
@click.option("--cap", "cap", metavar="NAME", default=None, help="Only this cap and its keys.")
@click.option("--max-slots", default=12, show_default=True, type=click.IntRange(min=1), help="Busiest slots drawn.")
@click.pass_context
def timeline(ctx: click.Context, since_text: str, out: str, cap: str | None, max_slots: int) -> None:
    """Draw slot occupancy over time against each limit, from the recorded history (PNG, SVG or PDF)."""
    from .history import Occupancy, occupancy

    since_seconds = parse_duration(since_text)
    operator = _operator(ctx)
    now = time.time()
    since = now - since_seconds
    statuses = {status.slot: status for status in operator.statuses()}
    events = _guard(lambda: operator.store.history(since))
    leases = _guard(operator.store.leases)
    series = occupancy(events, leases, since, now)

    def wanted(slot: str) -> bool:
        return cap is None or slot == cap or slot.startswith(cap + ":")

    series = {slot: value for slot, value in series.items() if wanted(slot)}
    deferrals = [
        event for event in events if event.kind == "deferred" and any(wanted(slot) for slot in event.full_slots)
    ]
    for event in deferrals:  # a slot that only turned tasks away is drawn too, flat
        for slot in event.full_slots:
            if wanted(slot) and slot not in series:
                series[slot] = Occupancy(slot, [(since, 0), (now, 0)])
    if not series:
        hint = "" if operator.settings.history_seconds else " (caps_history_seconds is not set)"
        raise click.ClickException(f"nothing to draw: no run or put-back recorded in the last {since_text}{hint}")
    from .plot import draw_timeline

    chosen = sorted(series.values(), key=lambda value: (-value.peak, value.slot))[:max_slots]
    limits = {
        value.slot: operator.limit_of(value.slot, statuses[value.slot].limit if value.slot in statuses else None)
        for value in chosen
    }
    _guard(lambda: draw_timeline(chosen, limits, _deferral_times(deferrals, limits), since, now, out))
    click.echo(f"wrote {out}: {len(chosen)} slot(s), {len(events)} event(s) since {_clock(since)}")


def _deferral_times(events: Iterable[HistoryEvent], limits: Mapping[str, int | None]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for event in events:
        for slot in event.full_slots:
            if slot in limits:
                times.setdefault(slot, []).append(event.at)
    return times
