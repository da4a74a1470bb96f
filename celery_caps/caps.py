"""The cap specification: a name, a limit and an optional key function.

A :class:`Cap` turns a task's arguments into a *slot name*: ``name`` for a global
cap, ``name + ":" + key`` for a keyed one, where each key gets its own ``limit``
(a number, or for a keyed cap a function of the same arguments).  This module
validates caps, keys and limits and knows nothing of stores or Celery.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import CapKeyError, ConfigurationError

#: Longest cap name, in characters.
MAX_NAME_LENGTH = 100
#: Longest key a key function may return, in characters.
MAX_KEY_LENGTH = 150
#: Longest slot name (``name:key``); stores size their columns for it.
MAX_SLOT_LENGTH = MAX_NAME_LENGTH + 1 + MAX_KEY_LENGTH
#: Largest limit, in code or set by an operator: what every store keeps (a SQL INTEGER).
MAX_LIMIT = 2**31 - 1

# Control characters (NUL above all) and lone surrogates cannot be stored
# faithfully by every store and make operator output unreadable.
_FORBIDDEN_CHARACTERS = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")

KeyFunction = Callable[..., str]
LimitFunction = Callable[..., int]
WeightFunction = Callable[..., int]
FairFunction = Callable[..., str]


#: Longest part of a key function's own exception text that a CapKeyError quotes.
_MAX_QUOTED_ERROR_LENGTH = 200


def _shorten(text: str, limit: int) -> str:
    """``text``, cut after ``limit`` characters with its full length said."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _describe(value: object, limit: int = 60) -> str:
    """A short, safe ``repr`` of a user value for error messages."""
    return _shorten(repr(value), limit)


@dataclass(frozen=True)
class Cap:
    """At most ``limit`` tasks at once, fleet-wide, per slot name.

    Args:
        name: The cap's name, shared by every task that uses the same cap.
            Non-empty, at most 100 characters, no ``:`` and no control characters.
        limit: How many distinct task ids may hold the slot at once; a positive int.
            For a keyed cap, also a function called like ``key`` that returns the
            positive int of the call's key (premium tenants 10, others 1).
        key: Optional function called with the task's own positional and keyword
            arguments; it returns a string, and each distinct string gets its own
            ``limit``.  Keys must come from a bounded set (tenants, regions).
        weight: How many units of the limit one task takes (default 1): a positive int no
            larger than the limit, or a function called like ``key`` that returns it.  A
            task of weight 3 under a limit of 10 leaves room for 7 more units.
        fair_by: Optional function called like ``key`` that returns the call's *fair key*
            (a string, as a key): while the cap is full, its waiting tasks start in turn
            across fair keys (round-robin), so a tenant with 1,000 queued does not hold
            back one with 3.  Fair keys may be many; each does not get its own limit.
    """

    name: str
    limit: int | LimitFunction
    key: KeyFunction | None = None
    weight: int | WeightFunction = 1
    fair_by: FairFunction | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigurationError(f"Cap name must be a non-empty string, got {_describe(self.name)}")
        if len(self.name) > MAX_NAME_LENGTH:
            raise ConfigurationError(f"Cap name {_describe(self.name)} is longer than {MAX_NAME_LENGTH} characters")
        if ":" in self.name or _FORBIDDEN_CHARACTERS.search(self.name):
            raise ConfigurationError(
                f"Cap name {_describe(self.name)} must not contain ':' or control characters "
                "(':' separates the name from the key in slot names)"
            )
        if self.key is not None and not callable(self.key):
            raise ConfigurationError(f"Cap {self.name!r}: key must be a callable or None, got {_describe(self.key)}")
        if callable(self.limit):
            if self.key is None:
                raise ConfigurationError(
                    f"Cap {self.name!r}: a limit function ({function_name(self.limit)}) needs a key function: "
                    "every slot has one limit, so a limit that depends on the arguments must come with a key "
                    "that does"
                )
        elif not _positive_int(self.limit):
            raise ConfigurationError(
                f"Cap {self.name!r}: limit must be a positive integer or a function, got {_describe(self.limit)}"
            )
        elif self.limit > MAX_LIMIT:
            raise ConfigurationError(f"Cap {self.name!r}: limit {self.limit} is above {MAX_LIMIT}, {_LARGEST}")
        if self.fair_by is not None and not callable(self.fair_by):
            raise ConfigurationError(
                f"Cap {self.name!r}: fair_by must be a callable or None, got {_describe(self.fair_by)}"
            )
        if callable(self.weight):
            return
        if not _positive_int(self.weight):
            raise ConfigurationError(
                f"Cap {self.name!r}: weight must be a positive integer or a function, got {_describe(self.weight)}"
            )
        if not callable(self.limit) and self.weight > self.limit:
            raise ConfigurationError(
                f"Cap {self.name!r}: weight {self.weight} is above its limit {self.limit}: no task of it could ever run"
            )

    def slot_name(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The slot this cap takes for a task called with ``args`` and ``kwargs``.

        Raises:
            CapKeyError: the key function raised or returned an unusable key.
        """
        if self.key is None:
            return self.name
        key = self._call("key", self.key, args, kwargs)
        return f"{self.name}:{validate_key(self.name, key)}"

    def fair_key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
        """The fair key of a task called with ``args`` and ``kwargs``; None for a cap without ``fair_by``.

        Raises:
            CapKeyError: the ``fair_by`` function raised or returned an unusable key.
        """
        if self.fair_by is None:
            return None
        return validate_key(self.name, self._call("fair_by", self.fair_by, args, kwargs), role="fair_by")

    def limit_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
        """The limit of the slot this cap takes for a task called with ``args`` and ``kwargs``.

        Raises:
            CapKeyError: the limit function raised or returned something that is not a positive int.
        """
        if not callable(self.limit):
            return self.limit
        return self._positive_int_from("limit", self.limit, args, kwargs, MAX_LIMIT, f"{MAX_LIMIT}, {_LARGEST}")

    def weight_for(self, args: Sequence[Any], kwargs: Mapping[str, Any], limit: int) -> int:
        """How many units of its slot's ``limit`` a task called with ``args`` and ``kwargs`` takes.

        Raises:
            CapKeyError: the weight function raised or returned something that is not a
                positive int, or a weight above ``limit``.
        """
        if not callable(self.weight):
            if self.weight > limit:  # a limit function's value below the weight in code
                raise CapKeyError(f"Cap {self.name!r}: weight {self.weight} is above the call's limit {limit}")
            return self.weight
        return self._positive_int_from("weight", self.weight, args, kwargs, limit, f"the call's limit {limit}")

    def _positive_int_from(
        self,
        role: str,
        function: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        highest: int,
        above: str,
    ) -> int:
        """What ``function`` returns for the call, which must be a positive int at most ``highest``
        (``above`` names that bound); else a :class:`CapKeyError` naming the function and the value."""
        value = self._call(role, function, args, kwargs)
        if not _positive_int(value):
            raise CapKeyError(
                f"Cap {self.name!r}: {role} function {function_name(function)} must return a positive integer, "
                f"got {type(value).__name__} {_describe(value)}"
            )
        if value > highest:
            raise CapKeyError(
                f"Cap {self.name!r}: {role} function {function_name(function)} returned {value}, above {above}"
            )
        return value  # type: ignore[no-any-return]

    def _call(self, role: str, function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``function(*args, **kwargs)``; what it raises becomes a :class:`CapKeyError` naming it."""
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            # The function's own message may be anything, 10 MB included: the error is stored
            # in the result backend and logged, so quote only its beginning.
            raise CapKeyError(
                f"Cap {self.name!r}: {role} function {function_name(function)} raised {type(exc).__name__}: "
                f"{_shorten(str(exc), _MAX_QUOTED_ERROR_LENGTH)}"
            ) from exc


_LARGEST = "the largest limit every store keeps"


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def function_name(function: Callable[..., Any]) -> str:
    """How messages name a user's key or limit function."""
    return getattr(function, "__qualname__", None) or repr(function)


def limit_set_for(slot: str, limits: Mapping[str, int]) -> str | None:
    """The name whose operator's limit (``celery caps limit``) holds for ``slot``: the slot
    itself, else its cap, else None (the code's limit holds).  ``limits`` maps cap and slot
    names to limits, as :meth:`SlotStore.limits` returns them."""
    for name in (slot, slot.partition(":")[0]):
        if name in limits:
            return name
    return None


def operator_limit(slot: str, limits: Mapping[str, int]) -> int | None:
    """The limit an operator set for ``slot`` (see :func:`limit_set_for`), or None."""
    name = limit_set_for(slot, limits)
    return None if name is None else limits[name]


def validate_key(cap_name: str, key: object, *, role: str = "key") -> str:
    """Return ``key`` if it is a usable key for cap ``cap_name``; raise :class:`CapKeyError`.
    ``role`` names the function that returned it (``key`` or ``fair_by``)."""
    if not isinstance(key, str):
        raise CapKeyError(
            f"Cap {cap_name!r}: {role} function must return a string, got {type(key).__name__} {_describe(key)}"
        )
    if not key:
        raise CapKeyError(f"Cap {cap_name!r}: {role} function returned an empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise CapKeyError(f"Cap {cap_name!r}: key {_describe(key)} is longer than {MAX_KEY_LENGTH} characters")
    if _FORBIDDEN_CHARACTERS.search(key):
        raise CapKeyError(f"Cap {cap_name!r}: key {_describe(key)} contains a control character or a lone surrogate")
    return key


def normalize_caps(value: object, task_name: str) -> tuple[Cap, ...]:
    """Turn a task's ``cap=`` option (one :class:`Cap`, a list of them, or None) into a tuple.

    Raises:
        ConfigurationError: the option holds something else, or two caps share a name.
    """
    if value is None:
        return ()
    caps: Iterable[object] = (value,) if isinstance(value, Cap) else value  # type: ignore[assignment]
    if isinstance(value, (str, bytes)) or not isinstance(caps, Iterable):
        raise ConfigurationError(f"task {task_name}: cap= must be a Cap or a list of Caps, got {_describe(value)}")
    result: list[Cap] = []
    for cap in caps:
        if not isinstance(cap, Cap):
            raise ConfigurationError(f"task {task_name}: cap= must hold only Cap objects, got {_describe(cap)}")
        if any(existing.name == cap.name for existing in result):
            raise ConfigurationError(f"task {task_name}: cap {cap.name!r} is given twice")
        result.append(cap)
    return tuple(result)


def slots_for(caps: Sequence[Cap], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, int]:
    """Map each slot name a call needs to its limit.

    Raises:
        CapKeyError: a key or limit function raised or returned an unusable value.
    """
    return {cap.slot_name(args, kwargs): cap.limit_for(args, kwargs) for cap in caps}


@dataclass(frozen=True)
class Needs:
    """What one call of a capped task asks of its caps' slots."""

    #: Slot name -> its limit for the call.
    slots: dict[str, int]
    #: Slot name -> the units of its limit the call takes, where more than 1.
    weights: dict[str, int] = field(default_factory=dict)
    #: Slot name -> the call's fair key there, for the slots of caps with ``fair_by``.
    fair_keys: dict[str, str] = field(default_factory=dict)

    def of(self, slots: Iterable[str]) -> Needs:
        """These needs in ``slots`` only."""
        kept = set(slots)
        return Needs(
            {slot: limit for slot, limit in self.slots.items() if slot in kept},
            {slot: weight for slot, weight in self.weights.items() if slot in kept},
            {slot: key for slot, key in self.fair_keys.items() if slot in kept},
        )


def needs_for(caps: Sequence[Cap], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Needs:
    """What a call with ``args`` and ``kwargs`` needs of ``caps``: each cap's slot and limit, and
    where they are not the defaults, its weight and fair key there.

    Raises:
        CapKeyError: a key, limit, weight or ``fair_by`` function raised or returned an unusable value.
    """
    needs = Needs({})
    for cap in caps:
        slot, limit = cap.slot_name(args, kwargs), cap.limit_for(args, kwargs)
        needs.slots[slot] = limit
        if cap.weight != 1:
            weight = cap.weight_for(args, kwargs, limit)
            if weight > 1:
                needs.weights[slot] = weight
        fair_key = cap.fair_key_for(args, kwargs)
        if fair_key is not None:
            needs.fair_keys[slot] = fair_key
    return needs
