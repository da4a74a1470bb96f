"""A task's message and its copies: headers, payloads, routing, and putting a copy back.

Both strategies work on copies of the message a worker received (:mod:`celery_caps.park`
keeps one in the store's waiting list, :mod:`celery_caps.backoff` publishes one with a
countdown), and the hand-overs (:mod:`celery_caps.handover`) publish the parked copy again.
This module is what they share: which headers a copy carries (a copy never carries the
headers of one delivery, nor a retry the wait of an earlier attempt), how a parked message is
stored and read back, which queue a woken copy goes to, and the put-back itself (publish a copy
with a countdown, then end the copy that arrived), which park uses when it cannot park.
It imports no strategy and no runtime.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Reject
from kombu.entity import Exchange, Queue
from kombu.serialization import dumps, loads, prepare_accept_content

from .errors import CapWaitExceeded, StoreError
from .health import describe

if TYPE_CHECKING:
    from celery import Celery

    from .runtime import CapsRuntime
    from .task import CappedTask

logger = logging.getLogger(__name__)

#: The header of a dispatched copy: the run id of its dispatch, which it claims on arrival.
DISPATCH_HEADER = "caps_dispatch_run_id"
#: A woken task is published to ``<its queue>`` + this suffix: a queue that every worker
#: consuming ``<its queue>`` consumes too (:class:`~celery_caps.worker.CapsWakeQueues`).
WAKE_QUEUE_SUFFIX = ".caps-wake"

# -- headers ------------------------------------------------------------------------------

#: Message headers that carry a deferred task's waiting history.
DEFERRALS_HEADER = "caps_deferrals"
FIRST_DEFERRED_HEADER = "caps_first_deferred_at"
#: The put-back's countdown in seconds: a receiving worker never waits longer than this
#: after receipt, whatever the ETA (computed by the publisher's clock) says.
COUNTDOWN_HEADER = "caps_countdown"
#: Headers of this library that describe one delivery: never carried to another copy.
DELIVERY_HEADERS = (DISPATCH_HEADER, COUNTDOWN_HEADER)
#: Headers of this library that describe one attempt's wait: a retry is a new attempt and
#: waits afresh (its own place in the waiting list, its own ``caps_max_wait_seconds``).
WAITING_HEADERS = (DEFERRALS_HEADER, FIRST_DEFERRED_HEADER)

# Celery's own request fields that may show up among a request's headers; the
# rest are the caller's custom headers, which a put-back message must keep.
_CELERY_HEADER_FIELDS = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
        "replaced_task_nesting", "stamped_headers", "stamps", "caps_run_id", "redelivered",
    }
)  # fmt: skip


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


def copied_headers(headers: Mapping[str, Any] | None, *, new_attempt: bool = False) -> dict[str, Any]:
    """``headers`` as a copy of the task made from this delivery carries them (a retry, a
    put-back, a parked message): without this delivery's own headers (its dispatch), and for a
    ``new_attempt`` (a retry) without this attempt's wait."""
    dropped = DELIVERY_HEADERS + WAITING_HEADERS if new_attempt else DELIVERY_HEADERS
    return {key: value for key, value in (headers or {}).items() if key not in dropped}


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


# -- payloads and routing ---------------------------------------------------------------


def encode_payload(app: Celery, message: Mapping[str, Any]) -> bytes:
    """``message`` (a signature as a dict) in the app's task serializer, with its content type."""
    content_type, encoding, data = dumps(dict(message), serializer=app.conf.task_serializer)  # type: ignore[no-untyped-call]
    body = data if isinstance(data, bytes) else data.encode(encoding)
    return f"{content_type}\n{encoding}\n".encode() + body


def decode_payload(app: Celery, payload: bytes) -> Any:
    """A parked message, decoded only if its content type is one the app accepts
    (``accept_content``), as Celery decodes a message from the broker: whoever can write to the
    store cannot make a worker unpickle what its broker would refuse.

    Raises:
        kombu.exceptions.ContentDisallowed: the payload's content type is not accepted.
    """
    content_type, encoding, body = payload.split(b"\n", 2)
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    return loads(body, content_type.decode(), encoding.decode(), accept=accept)  # type: ignore[no-untyped-call]


#: True while the library publishes a waiting task again (a wake, a put-back): such a
#: message goes to the broker, never to the waiting list at publish time.
REPUBLISHING: ContextVar[bool] = ContextVar("celery_caps_republishing", default=False)


def is_wake_queue(name: str) -> bool:
    return name.endswith(WAKE_QUEUE_SUFFIX)


def wake_queue_name(queue: str) -> str:
    """The wake queue of ``queue`` (itself for a wake queue)."""
    return queue if is_wake_queue(queue) else queue + WAKE_QUEUE_SUFFIX


def queue_of_wake_queue(name: str) -> str:
    """The queue whose wake queue is ``name``."""
    return name[: -len(WAKE_QUEUE_SUFFIX)] if is_wake_queue(name) else name


def wake_queue(name: str) -> Queue:
    """The wake queue called ``name``, declared like a queue Celery creates when it is missing."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)  # type: ignore[no-untyped-call]


def wake_route(queue: str) -> dict[str, Any]:
    """The options that send a woken copy of a task of ``queue`` to its wake queue.

    Straight to the wake queue by name, through the broker's default exchange (as Celery sends
    to a queue of a direct exchange): one command on Redis, where the wake queue's own exchange
    costs a lookup of its bindings first.  All three named: the delivery's exchange and routing
    key, which a parked signature carries, and a route of task_routes, which Celery's router
    merges in, would send it past its wake queue (Celery drops options given as None; the empty
    name is the default exchange's).  The queue is declared before the publish, as Celery
    declares the queue it sends to.
    """
    wake = wake_queue(wake_queue_name(queue))
    return {"queue": wake, "exchange": "", "routing_key": wake.name}


def _declared_queue(app: Celery, options: Mapping[str, Any]) -> str | None:
    """The queue a message's options name, or reach through a declared binding (None: they do not say)."""
    queue = options.get("queue")
    if isinstance(queue, Queue):
        return str(queue.name)
    if isinstance(queue, str) and queue:
        return queue
    exchange, routing_key = options.get("exchange"), options.get("routing_key")
    if isinstance(exchange, Exchange):
        exchange = exchange.name
    if not routing_key:
        return None
    if not exchange:
        return str(routing_key)  # the default exchange routes by queue name
    for candidate in app.amqp.queues.values():
        bound = candidate.exchange is not None and candidate.exchange.name == exchange
        if bound and candidate.routing_key == routing_key:
            return str(candidate.name)
    return None


def destination_queue(app: Celery, signature: Any) -> str | None:
    """The queue Celery sends ``signature`` to: the one its options name, else the one its router
    chooses (``task_routes``, ``task_default_queue``); None if neither names a queue."""
    options = dict(signature.options)
    named = _declared_queue(app, options)
    if named is not None:
        return named
    for option in ("exchange", "routing_key"):
        options.pop(option, None)
    routed = app.amqp.router.route(options, signature.task, tuple(signature.args or ()), dict(signature.kwargs or {}))
    queue = routed.get("queue")
    return str(queue.name) if isinstance(queue, Queue) else (queue or None)


# -- putting a copy back to the broker -----------------------------------------------------


def backoff_seconds(deferrals: int, minimum: float, maximum: float) -> float:
    """How long the ``deferrals``-th put-back waits: exponential, capped, with jitter.

    The delay doubles from ``minimum`` up to ``maximum`` (seconds); a random
    factor in [0.5, 1) spreads tasks that were put back together.
    """
    ceiling = min(maximum, minimum * (2.0 ** min(deferrals, 32)))
    return max(minimum / 2, ceiling * random.uniform(0.5, 1.0))


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


#: A put-back's reason when the task waits in the list while its message waits in the broker
#: (``park.Verdict.OUTSIDE``).
PAYLOAD_TOO_LARGE = "payload_too_large"


def put_back(
    task: CappedTask,
    runtime: CapsRuntime,
    request: Any,
    slots: Mapping[str, int],
    full_slots: list[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    reason: str = "full",
    max_countdown: float | None = None,
) -> NoReturn:
    """Publish the task again with a countdown (backoff's, at most ``max_countdown`` seconds),
    then end this copy with ``Ignore``."""
    settings = runtime.settings
    deferrals, first = waiting_so_far(task, runtime, request, full_slots)
    maximum = settings.backoff_max_seconds
    if max_countdown is not None:
        maximum = min(maximum, max_countdown)
    countdown = backoff_seconds(deferrals, min(settings.backoff_min_seconds, maximum), maximum)
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
    # Once per wait at INFO (its first put-back; Celery's own line for this copy says only
    # "ignored"), then at DEBUG.
    if reason == "store_error":
        waits_for = "the slot store to answer"
    elif reason == PAYLOAD_TOO_LARGE:
        waits_for = (
            f"its turn in the waiting list of {', '.join(full_slots)} without its message, which is over "
            f"caps_park_max_payload_bytes ({settings.parking.max_payload_bytes}): the message waits in the broker"
        )
    else:
        waits_for = f"a free slot of {', '.join(full_slots)}"
    logger.log(
        logging.INFO if deferrals == 0 else logging.DEBUG,
        "%s[%s] waits for %s: put back for %.2f s (deferral %d)",
        task.name, request.id, waits_for, countdown, deferrals + 1,
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
    (returns), fails (raises ``exc``) or is put back (raises ``Ignore``).

    The store and the cause are reported by the process's :class:`~celery_caps.health.StoreHealth`:
    once when the outage starts, then a reminder a minute, and once when the store answers again;
    each task affected gets one short line (at WARNING if it runs uncapped, else at DEBUG).
    """
    runtime.health.failed(exc)
    policy = runtime.settings.on_store_error
    if policy == "run":
        logger.warning("%s[%s] runs uncapped: the slot store cannot be used", task.name, request.id)
        return
    if policy == "fail":
        raise exc
    logger.debug("%s[%s] put back: the slot store cannot be used (%s)", task.name, request.id, describe(exc))
    put_back(task, runtime, request, slots, list(slots), args, kwargs, reason="store_error")
