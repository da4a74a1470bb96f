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
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from rich.console import RenderableType

    from ..stores.base import HistoryEvent, SlotStatus, Waiter

from ..caps import MAX_LIMIT
from ..stores.base import ParkingStore
from .common import (
    Operator,
    clock,
    duration,
    echo_json,
    guard,
    lease_json,
    lease_table,
    names_slot,
    new_console,
    one_line,
    operator_for,
    parse_duration,
    waiter_json,
    waiter_table,
)
from .explain import explain_task, print_explanation

__all__ = ["caps", "duration", "explain_task", "parse_duration"]


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
    #: Distinct fair keys among them (``Cap(fair_by=...)``; 0 for a cap without).
    fair_keys: int = 0

    def __str__(self) -> str:
        return f"{self.waiters} ({self.fair_keys} keys)" if self.fair_keys else str(self.waiters)


def waiting_per_slot(waiters: Iterable[Waiter]) -> dict[str, SlotWaiting]:
    now = time.time()
    found: dict[str, list[float]] = {}
    fair_keys: dict[str, set[str]] = {}
    for waiter in waiters:
        found.setdefault(waiter.slot, []).append(max(now - waiter.first_deferred_at, 0.0))
        if waiter.fair_key is not None:
            fair_keys.setdefault(waiter.slot, set()).add(waiter.fair_key)
    return {slot: SlotWaiting(len(waits), max(waits), len(fair_keys.get(slot, ()))) for slot, waits in found.items()}


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
    #: Units of the limits in use over the cap's slots (``holders`` unless some weigh more than 1).
    units: int = 0
    #: Parked tasks over the cap's slots (a task waiting for two keys counts twice).
    waiters: int = 0
    #: The function(s) that give each key its limit (then ``limit`` is None), comma-separated.
    limit_function: str | None = None
    #: Where ``limit`` comes from: ``"operator"`` (``celery caps limit``), ``"code"`` or ``"store"``.
    limit_source: str = "code"
    #: The limit in code (the least the tasks declare); None for a limit function or an unknown cap.
    code_limit: int | None = None
    #: The keys given a limit of their own by an operator.
    keys_set: int = 0


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
        code_limit = info.limit if info is not None else None
        set_by_operator = operator.operator_limits().get(cap)
        limit: int | None
        if set_by_operator is not None:
            limit, source = set_by_operator, "operator"
        elif info is not None:
            limit, source = code_limit, "code"
        else:
            limit, source = (max(stored_limits) if stored_limits else None), "store"
        summaries.append(
            CapSummary(
                cap=cap,
                limit=limit,
                limit_source=source,
                code_limit=code_limit,
                keys_set=sum(1 for name in operator.operator_limits() if name.startswith(cap + ":")),
                registered=info is not None,
                keyed=info.keyed if info is not None else any(":" in status.slot for status in slots),
                keys=sum(1 for status in slots if ":" in status.slot),
                holders=sum(status.holders for status in slots),
                units=sum(status.used for status in slots),
                expired=sum(status.expired for status in slots),
                tasks=info.tasks if info is not None else (),
                waiters=sum(waiting[status.slot].waiters for status in slots if status.slot in waiting),
                limit_function=", ".join(info.limit_functions) if info is not None and info.limit_functions else None,
            )
        )
    return summaries


def _shows_waiting(operator: Operator, waiting: Mapping[str, SlotWaiting]) -> bool:
    """Whether the tables show the waiting list: a store that parks, and park in use or waiters."""
    return isinstance(operator.store, ParkingStore) and (operator.settings.parking.uses_park or bool(waiting))


def _limit_cell(line: CapSummary) -> str | Any:
    """A cap's limit as the status table shows it: where an operator set it, marked so, with the
    code's beside it."""
    from rich.text import Text

    code = str(line.code_limit) if line.code_limit is not None else "per key" if line.limit_function else "?"
    if line.limit_source == "operator":
        return Text.assemble((str(line.limit), "bold yellow"), f" (set; code {code})")
    cell = code if line.limit_source == "code" else str(line.limit) if line.limit is not None else "?"
    return cell + (f" ({line.keys_set} key(s) set)" if line.keys_set else "")


def _held_text(holders: int, units: int) -> str:
    """A holders cell: ``3``, or ``2 (5 units)`` where some holders weigh more than 1."""
    return str(holders) if units == holders else f"{holders} ({units} units)"


def _status_tables(
    operator: Operator, statuses: Sequence[SlotStatus], cap: str | None, waiting: Mapping[str, SlotWaiting]
) -> list[Any]:
    from rich.table import Table
    from rich.text import Text

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
        keys: str | Text = str(line.keys) if line.keyed else "-"
        if line.keys > threshold:
            keys = Text.assemble((str(line.keys), "bold red"), f" (> {threshold})")
        name = line.cap if line.registered else Text.assemble(line.cap, (" (not registered)", "dim"))
        limit_cell = _limit_cell(line)
        cells = [name, limit_cell, keys, _held_text(line.holders, line.units), str(line.expired)]
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
        holders: str | Text = _held_text(status.holders, status.used)
        if limit is not None and status.used >= limit:
            holders = Text.assemble((_held_text(status.holders, status.used), "bold"), " (full)")
        limit_text = str(limit) if limit is not None else "?"
        set_for = operator.limit_set_for(status.slot)
        if set_for is not None:
            limit_text += " (set)" if set_for == status.slot else f" (set for {set_for})"
        cells = [status.slot, limit_text, holders, str(status.expired)]
        if show_waiting:
            slot_waiting = waiting.get(status.slot)
            cells += [str(slot_waiting), duration(slot_waiting.oldest_seconds)] if slot_waiting else ["0", "-"]
        slots.add_row(*cells)
    return [summary, slots]


@caps.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--cap", "cap", metavar="NAME", default=None, help="Only this cap and its keys.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, cap: str | None) -> None:
    """Every cap and slot: limit, live holders, expired leases not swept yet, keys per cap,
    and (park strategy) tasks waiting and how long the oldest has waited."""
    operator = operator_for(ctx)
    statuses = operator.statuses()
    waiting = waiting_per_slot(operator.waiters())
    if as_json:
        echo_json(
            {
                "caps": [
                    {
                        "cap": line.cap,
                        "limit": line.limit,
                        "limit_function": line.limit_function,
                        "limit_source": line.limit_source,
                        "code_limit": line.code_limit,
                        "keys_with_limits_set": line.keys_set,
                        "registered": line.registered,
                        "keyed": line.keyed,
                        "keys": line.keys,
                        "holders": line.holders,
                        "units": line.units,
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
                        "limit_source": operator.limit_source(status.slot),
                        "limit_set_for": operator.limit_set_for(status.slot),
                        "holders": status.holders,
                        "units": status.used,
                        "expired": status.expired,
                        "waiters": waiting[status.slot].waiters if status.slot in waiting else 0,
                        "oldest_waiter_seconds": waiting[status.slot].oldest_seconds
                        if status.slot in waiting
                        else None,
                        "fair_keys_waiting": waiting[status.slot].fair_keys if status.slot in waiting else 0,
                    }
                    for status in statuses
                    if cap is None or status.slot.partition(":")[0] == cap
                ],
            }
        )
        return
    console = new_console()
    for table in _status_tables(operator, statuses, cap, waiting):
        console.print(table)


# -- holders ----------------------------------------------------------------------


def _slots_of(name: str, statuses: Iterable[SlotStatus]) -> list[str]:
    """The slot ``name``, or (a cap) the cap's slot and every key of it: see :func:`names_slot`."""
    return [status.slot for status in statuses if names_slot(name, status.slot)]


@caps.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def holders(ctx: click.Context, name: str, as_json: bool) -> None:
    """Live leases of NAME: a slot (tenant:acme) or a cap with all its keys (tenant)."""
    operator = operator_for(ctx)
    slots = set(_slots_of(name, operator.statuses()))
    if not slots and name.partition(":")[0] not in operator.caps:
        raise click.ClickException(f"no slot or cap named {name!r} (see `celery caps status`)")
    leases = [lease for lease in guard(operator.store.leases) if lease.slot in slots and lease.expires_in > 0]
    if as_json:
        echo_json([lease_json(lease) for lease in leases])
        return
    if not leases:
        click.echo(f"{name}: no live lease")
        return
    new_console().print(lease_table(leases, title=f"{len(leases)} live lease(s) of {name}"))


# -- explain ----------------------------------------------------------------------


@caps.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def explain(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Why TASK_ID waits (or waited): the caps it needs, which are full, who holds them."""
    operator = operator_for(ctx)
    report = guard(lambda: explain_task(operator, task_id))
    if as_json:
        echo_json(report)
    else:
        print_explanation(report)
    if report["state"] == "unknown":
        ctx.exit(1)


# -- check ---------------------------------------------------------------------------


@caps.command()
@click.pass_context
def check(ctx: click.Context) -> None:
    """Check that the store works as a worker needs it, as every worker does when it starts:
    create what is missing of its schema, take a scratch slot of limit 1, be refused a second
    run of it, give it back and remove it (it never counts against a cap); then report what in
    the way the store is reached would break it (a PostgreSQL pooler with prepared statements
    on).  Exit status 1 with the store's masked URL and the cause if anything is wrong."""
    from ..errors import StoreError
    from ..health import check_store, describe
    from ..runtime import holder_name

    operator = operator_for(ctx)
    try:
        result = check_store(operator.store, f"celery-caps-check/{holder_name(None, None)}")
    except StoreError as exc:
        raise click.ClickException(one_line(describe(exc))) from exc
    isolation = f"; transactions at {result.isolation}" if result.isolation else ""
    click.echo(
        f"{click.style('ok', fg='green')}: {result.store}: a scratch slot taken, refused to a second run and "
        f"given back in {result.seconds * 1000:.0f} ms{isolation}"
    )
    if result.warnings:
        for warning in result.warnings:
            click.echo(f"{click.style('problem', fg='red')}: {warning}")
        raise click.ClickException(f"{len(result.warnings)} problem(s) with the slot store")


# -- sweep, release, prune-keys -----------------------------------------------------


@caps.command()
@click.pass_context
def sweep(ctx: click.Context) -> None:
    """Delete expired leases now (sentinels are kept); print what was removed.  With park in
    use, then do what every worker's recovery does: dispatch again what was never claimed,
    wake what fits, readmit those past caps_max_wait_seconds."""
    from .. import handover

    operator = operator_for(ctx)
    expired = [lease for lease in guard(operator.store.leases) if lease.expires_in <= 0]
    deleted = guard(operator.store.sweep)
    if expired:
        new_console().print(lease_table(expired, title="expired leases found"))
    click.echo(f"deleted {deleted} expired lease(s)")
    if handover.parks(operator):
        published = guard(lambda: handover.recover(operator))
        click.echo(f"published {len(published)} waiting task(s)")


@caps.command()
@click.option("--sql", "print_sql", is_flag=True, help="Print the DDL instead of running it.")
@click.pass_context
def schema(ctx: click.Context, print_sql: bool) -> None:
    """Create what is missing of the store's schema now (tables; on PostgreSQL, its functions),
    or print the DDL of this schema version for the configured database (--sql), to run by hand
    or in your own migrations with caps_create_schema = False."""
    from ..stores.sql import SCHEMA_VERSION, SQLStore

    operator = operator_for(ctx)
    store = operator.store
    if not isinstance(store, SQLStore):
        click.echo(f"the {type(store).__name__} keeps no schema: there is nothing to create")
        return
    if print_sql:
        click.echo(f"-- celery-caps schema version {SCHEMA_VERSION}")
        for statement in store.schema_statements():
            click.echo(f"{statement}\n;")
        return
    guard(store.create_schema)
    click.echo(f"schema version {SCHEMA_VERSION} is in place on {store.display_url}")


@caps.command()
@click.argument("task_id")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def release(ctx: click.Context, task_id: str, yes: bool) -> None:
    """Force-release every lease of TASK_ID (its slots free at once; a running task runs on);
    a parked TASK_ID leaves the waiting list (it will not run: its result becomes REVOKED)."""
    from .. import handover
    from ..stores import checks

    operator = operator_for(ctx)
    guard(lambda: checks.text("task_id", task_id))
    leases = [lease for lease in guard(operator.store.leases) if lease.task_id == task_id]
    waiting = [waiter for waiter in operator.waiters() if waiter.task_id == task_id]
    if not leases and not waiting:
        click.echo(f"task {task_id} holds no lease")
        return
    console = new_console()
    if leases:
        console.print(lease_table(leases, title=f"leases of task {task_id}"))
    if waiting:
        console.print(waiter_table(waiting, title=f"task {task_id} in the waiting list"))
    if not yes:
        drop = "drop it from the waiting list (it will not run)"
        if leases and waiting:
            question = f"Release the {len(leases)} lease(s) of task {task_id} and {drop}?"
        elif leases:
            question = f"Release the {len(leases)} lease(s) of task {task_id}?"
        else:
            question = f"Drop task {task_id} from the waiting list (it will not run)?"
        click.confirm(question, abort=True)
    released = guard(lambda: handover.release_task(operator, task_id))
    removed = guard(lambda: handover.forget(operator, task_id))
    if leases or released:
        click.echo(f"released {released} lease(s) of task {task_id}")
    if removed:
        click.echo(f"removed task {task_id} from the waiting list; it will not run")
        _mark_dropped(operator.app, task_id)


def _mark_dropped(app: Any, task_id: str) -> None:
    """A task dropped from the waiting list ends as a revoke ends it: ``REVOKED``, with the reason,
    so that a caller waiting on its result returns (a no-op without a result backend)."""
    try:
        app.backend.mark_as_revoked(task_id, "dropped from the waiting list by 'celery caps release'")
    except Exception as exc:  # the store's change is made: say what is left undone
        click.echo(f"warning: could not store REVOKED as the result of task {task_id}: {one_line(str(exc))}", err=True)
        return
    click.echo("its result is REVOKED")


@caps.command(name="prune-keys")
@click.argument("cap")
@click.option("--dry-run", is_flag=True, help="List the keys that would go; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def prune_keys(ctx: click.Context, cap: str, dry_run: bool, yes: bool) -> None:
    """Delete the rows of CAP's keys that no live lease holds and no parked task waits for
    (retired tenants, regions); the keys are listed first, and deleted once confirmed.

    CAP is matched exactly, case included: ``tenant`` never reaches the keys of ``Tenant``.
    Safe while workers run: a key being admitted into is kept, or admitted again afresh.
    """
    if not cap or ":" in cap:
        raise click.BadParameter(f"{cap!r} is not a cap name (a cap name has no ':')", param_hint="CAP")
    operator = operator_for(ctx)
    prefix = f"{cap}:"
    if dry_run or not yes:
        candidates = guard(lambda: operator.store.prune(prefix, dry_run=True))
        _echo_keys(f"would delete {len(candidates)} key(s) of cap {cap}", candidates)
        if dry_run or not candidates:
            return
        click.confirm(f"Delete {len(candidates)} key(s) of cap {cap}?", abort=True)
    # (What is idle now: a key listed above that a task took since is kept.)
    pruned = guard(lambda: operator.store.prune(prefix))
    _echo_keys(f"deleted {len(pruned)} key(s) of cap {cap}", pruned)


def _echo_keys(heading: str, slots: Sequence[str], shown: int = 50) -> None:
    click.echo(heading)
    for slot in slots[:shown]:
        click.echo(f"  {slot}")
    if len(slots) > shown:
        click.echo(f"  ... and {len(slots) - shown} more")


# -- the waiting list (park strategy) ------------------------------------------------


def _parking_operator(ctx: click.Context) -> Operator:
    operator = operator_for(ctx)
    operator.statuses()  # an unreachable store says so first
    if not isinstance(operator.store, ParkingStore):
        raise click.ClickException(f"the slot store {type(operator.store).__name__} has no waiting list")
    return operator


def _waiters_of(operator: Operator, name: str) -> list[Waiter]:
    """The waiters of NAME (a slot, or a cap with all its keys); an unknown name is an error."""
    waiters = [waiter for waiter in operator.waiters() if names_slot(name, waiter.slot)]
    if not waiters and not _slots_of(name, operator.statuses()) and name.partition(":")[0] not in operator.caps:
        raise click.ClickException(f"no slot or cap named {name!r} (see `celery caps status`)")
    return waiters


@caps.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def waiters(ctx: click.Context, name: str, as_json: bool) -> None:
    """Tasks parked for NAME (a slot, or a cap with all its keys), in the order they are served."""
    operator = operator_for(ctx)
    found = _waiters_of(operator, name)
    if as_json:
        now = time.time()
        echo_json([waiter_json(waiter, now) for waiter in found])
        return
    if not found:
        click.echo(f"{name}: no waiting task")
        return
    new_console().print(waiter_table(found, title=f"{len(found)} waiting task(s) of {name}"))


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
    from .. import handover

    operator = _parking_operator(ctx)
    waiting = [waiter for waiter in _waiters_of(operator, name) if not waiter.dispatched]
    if not waiting:
        click.echo(f"{name}: no waiting task")
        return
    tasks = {waiter.task_id for waiter in waiting}
    new_console().print(waiter_table(waiting, title=f"waiting for {name}"))
    if dry_run:
        click.echo(f"would publish {len(tasks)} waiting task(s) of {name}")
        return
    if not yes:
        click.confirm(f"Publish {len(tasks)} waiting task(s) of {name} back to the broker?", abort=True)
    taken = published = 0
    for slot in sorted({waiter.slot for waiter in waiting}):
        dispatched, sent = guard(functools.partial(handover.readmit, operator, slot))
        taken += dispatched
        published += len(sent)
        if len(sent) < dispatched:
            break  # the broker failed: the other slots' waiters stay as they are
    click.echo(f"published {published} waiting task(s) of {name}; each leaves the waiting list when its copy arrives")
    if published < taken:
        raise click.ClickException(
            f"publishing stopped at the broker's first failure (is it reachable?): {taken - published} task(s) "
            "were not published; they stay in the waiting list, dispatched, and the workers publish them once "
            "their dispatch expires. Run drain again for the rest of the list once the broker is back"
        )


@caps.command()
@click.argument("name")
@click.pass_context
def redispatch(ctx: click.Context, name: str) -> None:
    """Dispatch now the tasks waiting for NAME (a cap with all its keys, or one slot) whose slots
    have room, and those whose dispatch expired unclaimed: the workers' recovery, at once."""
    from .. import handover

    operator = _parking_operator(ctx)
    slots = sorted({waiter.slot for waiter in _waiters_of(operator, name)})
    if not slots:
        click.echo(f"{name}: no waiting task")
        return
    sent = guard(lambda: handover.recover(operator, slots))
    click.echo(f"dispatched {len(sent)} waiting task(s) of {name}")
    for waiter in sent:
        click.echo(f"  {waiter.task_id} {waiter.task_name or '?'}")


# -- limit -------------------------------------------------------------------------


@caps.command()
@click.argument("name")
@click.argument("new_limit", metavar="[N]", required=False, type=click.IntRange(min=1, max=MAX_LIMIT))
@click.option("--reset", is_flag=True, help="Return NAME to the limit in code.")
@click.pass_context
def limit(ctx: click.Context, name: str, new_limit: int | None, reset: bool) -> None:
    """Set the limit of NAME (a cap, for all its keys, or one key: cap:key) to N on every worker at
    once, kept in the store until changed again; --reset returns it to the code's.  A raise
    dispatches the waiters it has room for at once; after a cut no one is admitted above N
    while running tasks finish.  Without N: the limit now, where it comes from, and its changes."""
    from ..limits import change_limit, check_name

    if reset and new_limit is not None:
        raise click.UsageError("give N or --reset, not both")
    operator = operator_for(ctx)
    # A limit left on a cap the code no longer declares can still be shown and reset.
    if new_limit is not None or name not in operator.operator_limits():
        guard(lambda: check_name(name, _keyed_caps(operator)))
    if new_limit is None and not reset:
        _show_limit(operator, name)
        return
    user = _operator_name()
    before = _limit_in_force(operator, name)
    change = guard(lambda: change_limit(operator, name, new_limit, _keyed_caps(operator), by=user))
    operator.forget_operator_limits()
    now = _limit_in_force(operator, name)
    click.echo(
        f"{name}: limit {_said(name, now)}, was {_said(name, before)}; every worker counts against it from now on"
    )
    if change.woken:
        click.echo(f"dispatched {len(change.woken)} waiting task(s) into the room it leaves")
    for problem in change.problems:
        click.echo(f"warning: {one_line(problem)}", err=True)


def _keyed_caps(operator: Operator) -> dict[str, bool]:
    """The app's caps, each with whether it has a key (see :func:`check_name`)."""
    return {cap: info.keyed for cap, info in operator.caps.items()}


def _operator_name() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without one)
        user = "?"
    return f"caps limit by {user}@{socket.gethostname()}"


def _limit_in_force(operator: Operator, name: str) -> tuple[str, str, str | None]:
    """The limit admission counts ``name`` (a cap or one key of one) against, the code's limit of
    its cap, and the name an operator set the limit for (``name`` itself or its cap; None: the
    code's holds)."""
    cap = name.partition(":")[0]
    info = operator.caps.get(cap)
    if info is None:  # a limit left on a cap the code no longer declares
        code = "none (no task of this app declares it)"
    elif info.limit is not None:
        code = str(info.limit)
    else:
        code = f"per key ({', '.join(info.limit_functions)})"
    set_for = operator.limit_set_for(name)
    return (code, code, None) if set_for is None else (str(operator.operator_limits()[set_for]), code, set_for)


def _said(name: str, in_force: tuple[str, str, str | None]) -> str:
    """A limit in force (:func:`_limit_in_force`) in a few words: ``1 (set)``, ``2 (set for
    tenant)``, ``3 (the code's)``."""
    value, _code, set_for = in_force
    if set_for == name:
        return f"{value} (set)"
    return f"{value} (set for {set_for})" if set_for is not None else f"{value} (the code's)"


def _show_limit(operator: Operator, name: str) -> None:
    cap = name.partition(":")[0]
    value, code, set_for = _limit_in_force(operator, name)
    if set_for == name:
        click.echo(f"{name}: limit {value}, set by an operator (code: {code})")
    elif set_for is not None:
        click.echo(f"{name}: limit {value}, set by an operator for {set_for} (code: {code})")
    else:
        click.echo(f"{name}: limit {code}, from code")
    limits = operator.operator_limits()
    for key in sorted(key for key in limits if name == cap and key.startswith(cap + ":")):
        click.echo(f"  {key}: {limits[key]}, set by an operator")
    events = [
        event
        for event in guard(lambda: operator.store.history(0.0))
        if event.kind == "limit" and any(slot == name or slot.startswith(name + ":") for slot in event.slots)
    ]
    if events:
        click.echo("changes:")
    for event in events[-20:]:
        value = str(event.limit) if event.limit is not None else "reset to the code's"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.at))
        click.echo(f"  {when}  {', '.join(event.slots)} -> {value}  ({event.holder})")


# -- watch -------------------------------------------------------------------------


@caps.command()
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds.")
@click.option("--cap", "cap", metavar="NAME", default=None, help="Only this cap and its keys.")
@click.option("--iterations", default=0, type=click.IntRange(min=0), help="Stop after this many refreshes (0: never).")
@click.pass_context
def watch(ctx: click.Context, interval: float, cap: str | None, iterations: int) -> None:
    """A live view of the caps and their slots, refreshed every INTERVAL seconds (Ctrl-C quits).

    Not on a terminal (a log, a pipe, CI), each refresh is printed in full, one after another."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    operator = operator_for(ctx)

    def view() -> RenderableType:
        operator.forget_operator_limits()  # a limit set while it watches shows at the next refresh
        statuses = operator.statuses()
        waiting = waiting_per_slot(operator.waiters())
        stamp = Text(f"{clock(time.time())}, every {interval:g}s, Ctrl-C to quit", style="dim")
        return Group(stamp, *_status_tables(operator, statuses, cap, waiting))

    console = new_console()
    refreshes = 0
    if not console.is_terminal:
        # A live display draws only on a terminal: elsewhere nothing would show before it ends.
        try:
            while True:
                refreshes += 1
                console.print(view())
                sys.stdout.flush()
                if iterations and refreshes >= iterations:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
        return
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
    """Draw slot occupancy over time against each limit, and the tasks waiting for each slot,
    from the recorded history and the waiting list (PNG, SVG or PDF)."""
    from ..history import Occupancy, occupancy, waiting

    since_seconds = parse_duration(since_text)
    operator = operator_for(ctx)
    now = time.time()
    since = now - since_seconds
    statuses = {status.slot: status for status in operator.statuses()}
    events = guard(lambda: operator.store.history(since))
    leases = guard(operator.store.leases)
    series = occupancy(events, leases, since, now)

    def wanted(slot: str) -> bool:
        return cap is None or names_slot(cap, slot)

    series = {slot: value for slot, value in series.items() if wanted(slot)}
    waiters = [waiter for waiter in operator.waiters() if wanted(waiter.slot)]
    waits = {slot: value for slot, value in waiting(events, waiters, since, now).items() if wanted(slot)}
    for slot in waits:  # a slot whose tasks only waited is drawn too
        series.setdefault(slot, Occupancy(slot, [(since, 0), (now, 0)]))
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
    from ..plot import draw_timeline

    chosen = sorted(series.values(), key=lambda value: (-value.peak, value.slot))[:max_slots]
    limits = {
        value.slot: operator.limit_of(value.slot, statuses[value.slot].limit if value.slot in statuses else None)
        for value in chosen
    }
    guard(lambda: draw_timeline(chosen, limits, _deferral_times(deferrals, limits), since, now, out, waits))
    waited = {task_id for value in waits.values() for task_id in value.tasks}
    waiting_now = {waiter.task_id for waiter in waiters}
    click.echo(
        f"wrote {out}: {len(chosen)} slot(s), {len(events)} event(s) since {clock(since)}; "
        f"{len(waited)} task(s) waited for a slot, {len(waiting_now)} waiting now"
    )


def _deferral_times(events: Iterable[HistoryEvent], limits: Mapping[str, int | None]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for event in events:
        for slot in event.full_slots:
            if slot in limits:
                times.setdefault(slot, []).append(event.at)
    return times
