"""What every ``celery caps`` command shares: the app's store and caps as an :class:`Operator`,
errors as one line, durations, clocks and the lease and waiter tables.

Imported by every ``celery`` invocation (through :mod:`celery_caps.cli`), so only click at
the top; rich and the stores are imported where used.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from celery import Celery

    from ..settings import CapsSettings
    from ..stores.base import Lease, SlotStatus, SlotStore, Waiter

from ..caps import function_name, limit_set_for, operator_limit
from ..stores.base import ParkingStore

_T = TypeVar("_T")


# -- plumbing -------------------------------------------------------------------------


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def guard(work: Callable[[], _T]) -> _T:
    """Run ``work``; a celery-caps error becomes a one-line ``Error: ...`` and exit status 1."""
    from ..errors import CapsError

    try:
        return work()
    except CapsError as exc:
        raise click.ClickException(one_line(str(exc))) from exc


@dataclass(frozen=True)
class CapInfo:
    """A cap as the app's registered tasks declare it."""

    name: str
    #: The fixed limits the tasks declare (tasks may differ; the least is shown).
    limits: tuple[int, ...]
    keyed: bool
    tasks: tuple[str, ...]
    #: The names of the functions that give each key its limit, if any task declares one.
    limit_functions: tuple[str, ...] = ()

    @property
    def limit(self) -> int | None:
        """The cap's limit; None when a function gives each key its own (the store knows it)."""
        return min(self.limits) if self.limits and not self.limit_functions else None


@dataclass
class Operator:
    """What a command works with: the app, its settings, its store, its registered caps."""

    app: Celery
    settings: CapsSettings
    store: SlotStore
    caps: dict[str, CapInfo] = field(default_factory=dict)

    #: The limits operators set (``celery caps limit``), by cap or slot name: read once, by
    #: :meth:`operator_limits`.
    _operator_limits: dict[str, int] | None = None

    def operator_limits(self) -> dict[str, int]:
        if self._operator_limits is None:
            store = self.store
            self._operator_limits = guard(store.limits)
        return self._operator_limits

    def forget_operator_limits(self) -> None:
        """Read the operators' limits again at the next :meth:`operator_limits` (one changed, or
        a view refreshes)."""
        self._operator_limits = None

    def limit_of(self, slot: str, stored: int | None) -> int | None:
        """The limit ``slot``'s room is counted against: an operator's (see :meth:`limit_source`),
        else the registered limit of its cap, else the limit the store last saw (for a cap whose
        limit is a function of the key, that key's last admission's)."""
        set_by_operator = operator_limit(slot, self.operator_limits())
        if set_by_operator is not None:
            return set_by_operator
        info = self.caps.get(slot.partition(":")[0])
        return info.limit if info is not None and info.limit is not None else stored

    def limit_set_for(self, slot: str) -> str | None:
        """The name an operator set ``slot``'s limit for (the slot or its cap), or None."""
        return limit_set_for(slot, self.operator_limits())

    def limit_source(self, slot: str) -> str:
        """Where :meth:`limit_of` took ``slot``'s limit from: ``"operator"`` (``celery caps
        limit``), ``"code"`` (a cap of the app's tasks: their limit, or their limit function's for the
        key, as its last admission gave it) or ``"store"`` (a cap the app does not declare: the
        limit its last admission gave)."""
        if operator_limit(slot, self.operator_limits()) is not None:
            return "operator"
        return "code" if slot.partition(":")[0] in self.caps else "store"

    def statuses(self) -> list[SlotStatus]:
        return guard(self.store.status)

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        """The waiting list (of one slot name, if given); empty for a store without one."""
        store = self.store
        if not isinstance(store, ParkingStore):
            return []
        return guard(lambda: store.waiters(slot))


def registered_caps(app: Celery) -> dict[str, CapInfo]:
    """Every cap the app's tasks declare, by name."""
    try:
        app.loader.import_default_modules()  # tasks in `include`d modules register now
    except Exception as exc:  # a broken project module must not hide the store's state
        click.echo(f"warning: could not import the app's task modules: {one_line(str(exc))}", err=True)
    found: dict[str, tuple[set[int], set[str], bool, list[str]]] = {}
    for task_name, task in sorted(app.tasks.items()):
        for cap in getattr(task, "_caps", ()):
            limits, functions, keyed, tasks = found.setdefault(cap.name, (set(), set(), False, []))
            if isinstance(cap.limit, int):
                limits.add(cap.limit)
            else:
                functions.add(function_name(cap.limit))
            tasks.append(task_name)
            found[cap.name] = (limits, functions, keyed or cap.key is not None, tasks)
    return {
        name: CapInfo(name, tuple(sorted(limits)), keyed, tuple(tasks), tuple(sorted(functions)))
        for name, (limits, functions, keyed, tasks) in sorted(found.items())
    }


def operator_for(ctx: click.Context) -> Operator:
    from ..settings import CapsSettings
    from ..stores import store_from_url

    app = getattr(ctx.obj, "app", None)  # celery's CLIContext
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()

    def build() -> Operator:
        settings = CapsSettings.from_conf(app.conf)
        store = store_from_url(settings.require_url(), settings.store_options)
        return Operator(app, settings, store, registered_caps(app))

    operator = guard(build)
    if isinstance(operator.settings.url, str):  # a store we built; never close one the app handed us
        ctx.call_on_close(operator.store.close)
    return operator


def new_console() -> Any:
    """A console that prints strings as they are: slot names, task ids, task names and holders
    come from task arguments and callers, so neither markup (``[/]`` would crash a table,
    ``[link=...]`` or ``[bold]`` fake or hide text) nor emoji codes (``:tenant:``) are read in
    them.  What the commands style themselves they pass as :class:`rich.text.Text`."""
    from rich.console import Console

    # sys.stdout at call time: click's test runner swaps it.
    return Console(file=sys.stdout, markup=False, emoji=False, highlight=False, soft_wrap=False, width=terminal_width())


def terminal_width() -> int | None:
    # A pipe or a test runner has no terminal: wide enough for every column.
    return None if sys.stdout.isatty() else 160


def echo_json(value: Any) -> None:
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


def clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def names_slot(name: str, slot: str) -> bool:
    """Whether ``name`` names ``slot``: a slot name (``tenant:acme``, with a ``:``) names that slot
    alone, never a longer key (``tenant:acme:eu``); a cap name (``tenant``) names the cap's own
    slot and every key of it (``tenant:*``).  Names compare exactly, case included."""
    return slot == name or (":" not in name and slot.startswith(name + ":"))


def split_holder(holder: str) -> tuple[str, str]:
    node, separator, pid = holder.rpartition("/")
    return (node, pid) if separator else (holder, "")


# -- leases and waiters as JSON and tables ---------------------------------------------


def lease_json(lease: Lease) -> dict[str, Any]:
    node, pid = split_holder(lease.holder)
    return {
        "slot": lease.slot,
        "task_id": lease.task_id,
        "task_name": lease.task_name,
        "worker": node,
        "pid": int(pid) if pid.isdigit() else None,
        "age_seconds": lease.age,
        "expires_in_seconds": lease.expires_in,
        "run_id": lease.run_id,
        "weight": lease.weight,
    }


def lease_table(leases: Iterable[Lease], title: str | None = None) -> Any:
    from rich.table import Table

    leases = list(leases)
    weighted = any(lease.weight > 1 for lease in leases)
    table = Table(title=title, title_justify="left")
    for column in ("slot", "task id", "task", "worker", "pid"):
        table.add_column(column)
    if weighted:
        table.add_column("weight", justify="right")
    table.add_column("age", justify="right")
    table.add_column("expires in", justify="right")
    for lease in leases:
        node, pid = split_holder(lease.holder)
        expires = duration(lease.expires_in) if lease.expires_in > 0 else f"expired {duration(-lease.expires_in)} ago"
        weight = [str(lease.weight)] if weighted else []
        table.add_row(
            lease.slot, lease.task_id, lease.task_name or "?", node, pid, *weight, duration(lease.age), expires
        )
    return table


def waiter_json(waiter: Waiter, now: float) -> dict[str, Any]:
    return {
        "slot": waiter.slot,
        "position": waiter.position,
        "task_id": waiter.task_id,
        "task_name": waiter.task_name,
        "first_deferred_at": waiter.first_deferred_at,
        "waited_seconds": max(now - waiter.first_deferred_at, 0.0),
        "parked_seconds": waiter.age,
        "state": "dispatched" if waiter.dispatched else "waiting",
        "weight": waiter.weight,
        "fair_key": waiter.fair_key,
        "fair_round": waiter.fair_round,
    }


def waiter_table(waiters: Iterable[Waiter], title: str | None = None) -> Any:
    from rich.table import Table

    now = time.time()
    waiters = list(waiters)
    weighted = any(waiter.weight > 1 for waiter in waiters)
    fair = any(waiter.fair_key is not None for waiter in waiters)
    table = Table(title=title, title_justify="left")
    table.add_column("slot")
    table.add_column("#", justify="right")
    for column in ("task id", "task"):
        table.add_column(column)
    if weighted:
        table.add_column("weight", justify="right")
    if fair:
        table.add_column("fair key")
        table.add_column("round", justify="right")
    table.add_column("waited", justify="right")
    table.add_column("parked", justify="right")
    table.add_column("state")
    for waiter in waiters:
        table.add_row(
            waiter.slot,
            str(waiter.position),
            waiter.task_id,
            waiter.task_name or "?",
            *([str(waiter.weight)] if weighted else []),
            *([waiter.fair_key or "-", str(waiter.fair_round)] if fair else []),
            duration(max(now - waiter.first_deferred_at, 0.0)),
            duration(waiter.age),
            "dispatched" if waiter.dispatched else "waiting",
        )
    return table
