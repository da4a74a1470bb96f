"""Backoff: put a task back to the broker with a countdown (``caps_strategy = "backoff"``).

A task whose caps are full is *put back*: the same message (id, arguments, headers,
routing, priority, links, chord membership) is published again with a countdown
(exponential backoff with jitter), then the running copy ends with ``Ignore`` so that
nothing is stored and no retry is used up.  The copy is published before the
original is acknowledged: a worker dying in between causes a duplicate, never a loss.

Park falls back to a put-back when it cannot park (a full waiting list, a message
over ``caps_park_max_payload_bytes``, a store error under ``caps_on_store_error =
"defer"``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Reject

from .errors import CapWaitExceeded, StoreError
from .health import describe
from .park import DISPATCH_HEADER, REPUBLISHING

if TYPE_CHECKING:
    from .runtime import CapsRuntime
    from .task import CappedTask

logger = logging.getLogger(__name__)

#: Message headers that carry a deferred task's waiting history.
DEFERRALS_HEADER = "caps_deferrals"
FIRST_DEFERRED_HEADER = "caps_first_deferred_at"
#: The put-back's countdown in seconds: a receiving worker never waits longer than this
#: after receipt, whatever the ETA (computed by the publisher's clock) says.
COUNTDOWN_HEADER = "caps_countdown"
#: Headers of this library that describe one delivery: never carried to another copy.
DELIVERY_HEADERS = (DISPATCH_HEADER, COUNTDOWN_HEADER)

# Celery's own request fields that may show up among a request's headers; the
# rest are the caller's custom headers, which a put-back message must keep.
_CELERY_HEADER_FIELDS = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
        "replaced_task_nesting", "stamped_headers", "stamps", "caps_run_id", "redelivered",
    }
)  # fmt: skip


def backoff_seconds(deferrals: int, minimum: float, maximum: float) -> float:
    """How long the ``deferrals``-th put-back waits: exponential, capped, with jitter.

    The delay doubles from ``minimum`` up to ``maximum`` (seconds); a random
    factor in [0.5, 1) spreads tasks that were put back together.
    """
    ceiling = min(maximum, minimum * (2.0 ** min(deferrals, 32)))
    return max(minimum / 2, ceiling * random.uniform(0.5, 1.0))


def header(request: Any, name: str) -> Any:
    """A header of ``request``'s message (or the request field of that name)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name)
    return value if value is not None else getattr(request, name, None)


def deferrals_of(request: Any) -> int:
    """How many times the task of ``request`` was put back or parked before."""
    return int(header(request, DEFERRALS_HEADER) or 0)


def first_deferred_at(request: Any) -> float | None:
    """When the task of ``request`` was first put back or parked (epoch seconds), if ever."""
    value = header(request, FIRST_DEFERRED_HEADER)
    return float(value) if value else None


def seconds_waited(request: Any) -> float:
    """How long a task admitted now has waited for its caps (0 if it never waited)."""
    first = first_deferred_at(request)
    return time.time() - first if first else 0.0


def copied_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """``headers`` as a copy of the task made from this delivery carries them (a retry, a
    put-back, a parked message): without this delivery's own headers (its dispatch)."""
    return {key: value for key, value in (headers or {}).items() if key not in DELIVERY_HEADERS}


def republish_headers(request: Any, deferrals: int, first_deferred: float) -> dict[str, Any]:
    """The caller's custom headers of ``request`` plus the waiting history of one more deferral."""
    headers = {
        key: value
        for key, value in copied_headers(getattr(request, "headers", None)).items()
        if key not in _CELERY_HEADER_FIELDS
    }
    headers[DEFERRALS_HEADER] = deferrals + 1
    headers[FIRST_DEFERRED_HEADER] = first_deferred
    return headers


def waiting_so_far(task: CappedTask, runtime: CapsRuntime, request: Any, full_slots: list[str]) -> tuple[int, float]:
    """``(deferrals, first deferral time)`` of ``request``.

    Raises:
        CapWaitExceeded: it has waited ``caps_max_wait_seconds`` already.
    """
    deferrals = deferrals_of(request)
    first = first_deferred_at(request) or time.time()
    waited = time.time() - first
    max_wait = runtime.settings.max_wait_seconds
    if max_wait is not None and waited >= max_wait:
        raise CapWaitExceeded(task.name, request.id, waited, full_slots)
    return deferrals, first


def put_back(
    task: CappedTask,
    runtime: CapsRuntime,
    request: Any,
    slots: Mapping[str, int],
    full_slots: list[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    reason: str = "full",
) -> NoReturn:
    """Publish the task again with a countdown, then end this copy with ``Ignore``."""
    settings = runtime.settings
    deferrals, first = waiting_so_far(task, runtime, request, full_slots)
    countdown = backoff_seconds(deferrals, settings.backoff_min_seconds, settings.backoff_max_seconds)
    if settings.max_wait_seconds is not None:
        # Come back in time to give up at the deadline rather than long after it.
        countdown = min(countdown, max(settings.max_wait_seconds - (time.time() - first), 0.0) + 0.01)
    signature = task.signature_from_request(
        request, args, kwargs, countdown=countdown, headers=republish_headers(request, deferrals, first)
    )
    # Added after the copy is made (which drops this delivery's own headers, this one among
    # them): the receiving worker bounds its wait by it, whatever the ETA says.
    signature.options["headers"][COUNTDOWN_HEADER] = countdown
    waiting = {
        "task_name": task.name,
        "slots": list(slots),
        "full_slots": full_slots,
        "reason": reason,
        "deferrals": deferrals + 1,
        "first_deferred_at": first,
        "next_attempt_at": time.time() + countdown,
    }
    # Before publishing: the copy may run and store its final state at once.
    task.store_deferred_state(runtime, request, waiting)
    logger.debug(
        "%s[%s] put back for %.2f s (deferral %d): %s full",
        task.name, request.id, countdown, deferrals + 1, ", ".join(full_slots),
    )  # fmt: skip
    # While the published copy is built, this task must not count as its own
    # parent (Celery would set parent_id to its own id).
    task.push_request(called_directly=True)
    republishing = REPUBLISHING.set(True)
    try:
        signature.apply_async(add_to_parent=False)
    except Exception as exc:
        # Not published: the original must go back to the queue, not be acked.
        raise Reject(exc, requeue=True) from exc
    finally:
        REPUBLISHING.reset(republishing)
        task.pop_request()
    task.end_deferred_copy(runtime, request, waiting)


def on_store_error(
    task: CappedTask,
    runtime: CapsRuntime,
    request: Any,
    slots: Mapping[str, int],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    exc: StoreError,
) -> None:
    """Admission met a store error: ``caps_on_store_error`` says whether the task runs uncapped
    (returns), fails (raises ``exc``) or is put back (raises ``Ignore``)."""
    policy = runtime.settings.on_store_error
    if policy == "run":
        logger.warning("%s[%s] runs uncapped: slot store error (%s)", task.name, request.id, describe(exc))
        return
    if policy == "fail":
        raise exc
    logger.warning("%s[%s] put back: slot store error (%s)", task.name, request.id, describe(exc))
    put_back(task, runtime, request, slots, list(slots), args, kwargs, reason="store_error")


def admit(
    task: CappedTask,
    runtime: CapsRuntime,
    request: Any,
    slots: Mapping[str, int],
    holder: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str | None:
    """Backoff's admission: the run id holding ``slots``; or put the task back (``Ignore``).
    None: the task runs uncapped (``caps_on_store_error = "run"``)."""
    try:
        admission, run_id = runtime.acquire(
            slots, request.id, holder, task_name=task.name, deferrals=deferrals_of(request)
        )
    except StoreError as exc:
        on_store_error(task, runtime, request, slots, args, kwargs, exc)
        return None
    if not admission.granted:
        put_back(task, runtime, request, slots, list(admission.full_slots), args, kwargs)
    runtime.metrics.admitted(slots, seconds_waited(request))
    return run_id
