"""Limits set while the fleet runs: an operator's limit for a cap (all its keys) or one slot
(``cap:key``), kept in the store, which overrides the limit in code on every worker at once and
survives restarts, until reset.

The store counts every admission and hand-over against it (:meth:`SlotStore.set_limit`); this
module checks the name against the caps the app knows, records the change in the history and,
since a raised limit leaves room, hands that room to the waiters at once.  Used by
``celery caps limit`` and by :func:`celery_caps.set_limit`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import handover
from .caps import MAX_LIMIT, validate_key
from .errors import CapKeyError, ConfigurationError, StoreError
from .stores.base import HistoryEvent, Woken

if TYPE_CHECKING:
    from celery import Celery

    from .handover import CapsContext

#: How long a limit change stays in the history when the app keeps none
#: (``caps_history_seconds`` unset): 30 days.
LIMIT_HISTORY_SECONDS = 30 * 24 * 3600.0


@dataclass(frozen=True)
class LimitChange:
    """What :func:`change_limit` did."""

    name: str
    #: The operator's limit it replaced (None: the code's held).
    previous: int | None
    #: The operator's limit now (None: reset, the code's holds).
    limit: int | None
    #: The waiters dispatched at once into the room a raised (or reset) limit left.
    woken: tuple[Woken, ...] = ()
    #: What failed after the limit was set (the history, the wake), which the change survives.
    problems: tuple[str, ...] = ()


def check_name(name: str, known_caps: Mapping[str, bool]) -> str:
    """``name`` if it names a cap of ``known_caps`` (each with whether it has a key) or one key of
    a cap that has one (``cap:key``).

    Raises:
        ConfigurationError: the cap is not one the app's tasks declare (the message names them),
            or ``name`` gives a key the cap cannot have.
    """
    if not isinstance(name, str):
        raise ConfigurationError(f"a cap's name is a string (a cap, or cap:key), got {type(name).__name__} {name!r}")
    cap, separator, key = name.partition(":")
    if cap not in known_caps:
        known = ", ".join(sorted(known_caps)) or "none"
        raise ConfigurationError(f"no task of this app declares a cap named {cap!r} (its caps: {known})")
    if separator:
        if not known_caps[cap]:
            raise ConfigurationError(
                f"cap {cap!r} has no key function, so {name!r} names no slot: set the limit of {cap!r} itself"
            )
        if not key:
            raise ConfigurationError(f"{name!r} gives no key after {cap + ':'!r}: name a key, as in {cap}:acme")
        try:
            validate_key(cap, key)
        except CapKeyError as exc:
            raise ConfigurationError(str(exc)) from exc
    return name


def change_limit(
    context: CapsContext, name: str, limit: int | None, known_caps: Mapping[str, bool], by: str | None = None
) -> LimitChange:
    """Set the operator's limit of ``name`` (a cap or ``cap:key``) to ``limit``, or with None return
    it to the code's; record the change in the history; dispatch at once the waiters the new
    limit has room for.

    Once the limit is set, the change holds: a store failure in what follows is said in
    :attr:`LimitChange.problems`, not raised (the workers' recovery hands the room over within
    seconds).

    Raises:
        ConfigurationError: ``name`` names no known cap, or ``limit`` is not a positive int.
        StoreError: the store failed before the limit was set (nothing changed).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"a limit must be a positive integer, got {limit!r}")
    if limit is not None and limit > MAX_LIMIT:
        raise ConfigurationError(f"a limit must be at most {MAX_LIMIT} (the largest every store keeps), got {limit}")
    store = context.store
    # A limit left on a cap the code no longer declares can still be reset.
    if limit is not None or name not in store.limits():
        check_name(name, known_caps)
    previous = store.set_limit(name, limit)
    settings = context.settings
    event = HistoryEvent(
        kind="limit",
        at=time.time(),
        task_id="",
        task_name=None,
        slots=(name,),
        holder=by or f"{socket.gethostname()}/{os.getpid()}",
        limit=limit,
    )
    problems: list[str] = []
    try:
        store.record_history([event], settings.history_seconds or LIMIT_HISTORY_SECONDS, settings.history_max_events)
    except StoreError as exc:
        problems.append(f"the change is not in the history: {exc}")
    # Every count from now on uses the new limit; the waiters it has room for (a raise, or a
    # reset above the operator's limit) go now, not at the workers' next recovery.
    woken: list[Woken] = []
    try:
        woken = handover.recover(context, [name.partition(":")[0]])
    except StoreError as exc:
        problems.append(f"waiting tasks are left to the workers' recovery: {exc}")
    return LimitChange(name, previous, limit, tuple(woken), tuple(problems))


def set_limit(app: Celery, name: str, limit: int | None) -> LimitChange:
    """Set the limit of cap ``name`` (all its keys) or of one key (``"cap:key"``) to ``limit``
    on every worker at once, kept in the store until changed again; ``None`` returns it to the
    limit in code.  The Python form of ``celery caps limit``.

    Raises:
        ConfigurationError: ``name`` names no cap of the app's tasks, or ``limit`` is not a
            positive int.
        StoreError: the store failed before the limit was set (nothing changed).
    """
    from .runtime import runtime_for

    app.loader.import_default_modules()  # tasks of `include`d modules declare their caps now
    keyed: dict[str, bool] = {}
    for task in list(app.tasks.values()):
        for cap in getattr(task, "_caps", ()):
            keyed[cap.name] = keyed.get(cap.name, False) or cap.key is not None
    return change_limit(runtime_for(app), name, limit, keyed)
