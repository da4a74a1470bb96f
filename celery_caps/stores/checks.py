"""The checks of what callers pass to a store, made once above every store.

:class:`~celery_caps.stores.base.SlotStore` runs the check of a contract method before
the store's own code (see its ``__init_subclass__``), so that every store refuses the
same inputs the same way: with :class:`~celery_caps.errors.StoreInputError` naming the
value, before anything reaches a driver, and never as a :class:`StoreError` (which
means the store could not answer, and makes admission wait and try again).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from ..caps import MAX_KEY_LENGTH, MAX_LIMIT, MAX_SLOT_LENGTH
from ..errors import StoreInputError

#: Longest task id, run id or holder a store keeps, in characters.
MAX_ID_LENGTH = 255

# NUL and the other control characters, and lone surrogates: no store keeps them faithfully
# (a lone surrogate cannot even be encoded), and none belongs in a name.
_UNSTORABLE = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} chars)"


def text(name: str, value: object, *, longest: int = MAX_ID_LENGTH) -> None:
    """A task id, run id, holder or slot name: a non-empty string a store can keep."""
    if type(value) is str and value and len(value) <= longest and value.isprintable():
        return  # the common case, on every store call: printable excludes what _UNSTORABLE finds
    if not isinstance(value, str) or not value:
        raise StoreInputError(f"{name} must be a non-empty string, got {_describe(value)}")
    if len(value) > longest:
        raise StoreInputError(f"{name} {_describe(value)} is longer than {longest} characters")
    if _UNSTORABLE.search(value):
        raise StoreInputError(f"{name} {_describe(value)} contains a control character or a lone surrogate")


def optional_text(name: str, value: object) -> None:
    if value is not None:
        text(name, value, longest=MAX_SLOT_LENGTH)


def slot(name: str, value: object) -> None:
    text(name, value, longest=MAX_SLOT_LENGTH)


def seconds(name: str, value: object, *, positive: bool = True) -> None:
    """A duration or a time: a finite number (positive for a duration)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise StoreInputError(f"{name} must be a finite number of seconds, got {_describe(value)}")
    if positive and value <= 0:
        raise StoreInputError(f"{name} must be positive, got {_describe(value)}")


def count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StoreInputError(f"{name} must be a positive integer, got {_describe(value)}")


def limit(name: str, value: object) -> None:
    """A slot's limit: a positive integer no larger than every store keeps (MAX_LIMIT)."""
    count(name, value)
    if value > MAX_LIMIT:  # type: ignore[operator]
        raise StoreInputError(f"{name} must be at most {MAX_LIMIT} (the largest every store keeps), got {value}")


def names(name: str, values: object, check: Callable[[str, object], None] = text) -> None:
    """A collection of strings (a string itself is not one: ``renew("run-1", ...)``)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Collection):
        raise StoreInputError(f"{name} must be a collection of strings, got {_describe(values)}")
    for value in values:
        check(f"an element of {name}", value)


def slots(value: object) -> None:
    """Slot name -> limit (a positive integer)."""
    if not isinstance(value, (dict, Mapping)):  # (dict first: the ABC check costs a call)
        raise StoreInputError(f"slots must map slot names to limits, got {_describe(value)}")
    for name, slot_limit in value.items():
        slot("a slot name", name)
        limit(f"slot {name!r}: its limit", slot_limit)


def weight_map(value: object, slots_: Mapping[str, int]) -> None:
    """Slot name -> weight: slots of ``slots_`` only, each weight a positive integer no larger
    than the slot's limit."""
    if not isinstance(value, (dict, Mapping)):
        raise StoreInputError(f"weights must map slot names to weights, got {_describe(value)}")
    for name, weight in value.items():
        if name not in slots_:
            raise StoreInputError(f"weights name slot {_describe(name)}, which is not among the slots asked for")
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise StoreInputError(f"slot {name!r}: its weight must be a positive integer, got {_describe(weight)}")
        if weight > slots_[name]:
            raise StoreInputError(f"slot {name!r}: its weight {weight} is above its limit {slots_[name]}")


def fair_key_map(value: object, slots_: Mapping[str, int]) -> None:
    """Slot name -> fair key: slots of ``slots_`` only, each key a text a cap's key could be."""
    if not isinstance(value, Mapping):
        raise StoreInputError(f"fair_keys must map slot names to fair keys, got {_describe(value)}")
    for name, key in value.items():
        if name not in slots_:
            raise StoreInputError(f"fair_keys name slot {_describe(name)}, which is not among the slots asked for")
        text(f"slot {name!r}: its fair key", key, longest=MAX_KEY_LENGTH)


def admission(
    slots_: Mapping[str, int],
    task_id: str,
    run_id: str,
    holder: str,
    lease_seconds: float,
    task_name: Any = None,
    weights: Any = None,
) -> None:
    slots(slots_)
    if weights:
        weight_map(weights, slots_)
    text("task_id", task_id)
    text("run_id", run_id)
    text("holder", holder)
    seconds("lease_seconds", lease_seconds)


def history_events(events: Sequence[Any]) -> None:
    for event in events:
        if event.kind == "limit":  # an operator's change of a limit: of no task
            if event.task_id != "":
                raise StoreInputError(f"a limit event's task_id must be empty, got {_describe(event.task_id)}")
            if event.limit is not None:
                limit("a limit event's limit", event.limit)
        else:
            text("an event's task_id", event.task_id)
        names("an event's slots", event.slots, slot)
        seconds("an event's time", event.at, positive=False)
