"""Park and wake: the second strategy for a full cap (``caps_strategy = "park"``).

With *backoff*, a task whose caps are full goes back to the broker with a countdown
and tries again later.  With *park* (the default):

1. **Park.**  Admission fails, so the task's message (everything needed to publish
   it again exactly: name, id, args, kwargs, custom headers, routing, priority,
   links, chord membership, first-deferral time), encoded with the app's
   ``task_serializer``, goes to the store's waiting list for the slots it needs,
   and the original message is acknowledged (``Ignore``).  ``SlotStore.park`` is
   atomic with admission (same sentinel locks, same count): if a release made
   room meanwhile the task is admitted instead, so no waiter is ever parked after
   the last release that could wake it.
2. **Wake.**  ``SlotStore.release_and_wake`` deletes a run's leases and, in the same
   transaction, hands the freed room to the oldest waiters whose every slot has
   room now: it creates their leases under their own task ids as short *dispatch
   leases* (``caps_dispatch_lease_seconds``).  The releasing process then publishes
   their messages with a ``caps_dispatch_run_id`` header, to the *wake queue* of
   their queue (``<queue>.caps-wake``, consumed by every worker of that queue:
   ``worker.CapsWakeQueues``), so that a woken task does not wait behind its
   queue's backlog while its slot stays empty.
3. **Claim.**  The dispatched task arrives and claims its dispatch leases
   (``SlotStore.claim``: same run id, renewed to a full lease, the worker as
   holder): admission succeeds without a second contest, and no newer task could
   take the room in between.
4. **Re-dispatch.**  A dispatch that is never claimed (the releaser died before
   publishing, the message was lost) expires; the sweep (``SlotStore.wake``) puts
   the waiter back at its old place and dispatches again.  At-least-once: a
   dispatched message that arrives after its dispatch expired is admitted like
   any task; two copies of one task id count once against a cap.

Admitted or parked when sent.  With ``caps_park_on_publish`` (the default under
park), ``CappedTask.apply_async`` of a task whose slots are full right now parks it
at once instead of sending it: a waiting task reaches the broker once, when woken.
With ``caps_admit_on_publish`` too (the default), a task whose slots have room takes
them as it is sent (``park`` admits it under :data:`~celery_caps.stores.base.DISPATCH_HOLDER`
for ``caps_dispatch_lease_seconds``) and is sent with the dispatch header, so its
worker claims them like a woken task's: the tasks sent after it see the slots taken
and wait in the store, so that a burst costs one broker message per task.  A publish
that fails gives the slots back; a message that arrives after its dispatch expired is
admitted like any task.  (Without it, ``park(admit=False)`` takes nothing when there
is room, and the first tasks of a burst all reach the broker before any worker takes a
slot, most of them to park on arrival: two messages each.)

Fairness.  Waiters are ordered by first-deferral time (then park time).  A
release dispatches, in that order, every waiter whose slots can *all* be taken
now; a waiter one of whose own slots is full is passed over and keeps its place,
it never blocks the waiters behind it (no idle slot).  So under a global cap
shared by many keys no key starves: a waiter is passed over only while one of
its own slots is full, and among the waiters that fit, the oldest always wins.

Bounds.  ``caps_park_max_waiters`` waiters per slot name and
``caps_park_max_payload_bytes`` per message; a task over either bound is put back
with backoff instead (metrics/history reason ``waitlist_full`` or
``payload_too_large``).  ``caps_max_wait_seconds`` applies too: the sweep
publishes waiters that waited longer once more, and they end in
:class:`~celery_caps.errors.CapWaitExceeded` unless a slot is free at that moment.
Payloads are never logged.

At least once.  A waiter leaves the list only once its message is on the broker:
a dispatch keeps its entry until the task claims it, and a waiter taken off
without slots (past the maximum wait, or drained by an operator) is first
*marked* (``expire_waiters``/``drain``), then published, then deleted
(``settle_published``); a failed publish puts it back at its place, a publisher
that dies leaves a mark that expires like a dispatch.

Standby.  A hand-over through the broker costs a publish, the broker, the worker's main
process and a claim between two tasks (milliseconds each, an idle slot meanwhile).  On a
store that can signal (PostgreSQL's NOTIFY, a Redis list), a release that woke waiters also
puts the next waiters of its slots *on standby* (``SlotStore.stand_by``:
``caps_standby_per_slot`` per slot name, at most the slot's limit, ``caps_standby_max`` in
all) and publishes a copy of each with a ``caps_standby_mark`` header, to the wake queue;
right after the release, from the worker's background thread (the released task's process is
free for its next message meanwhile).  A
pool process that receives one records its holder in the standby and waits there
(``SlotStore.await_standby``, up to ``caps_standby_seconds``).  A release that dispatches a
waiter on standby creates its leases in that process's name, signals it in the dispatch's
own transaction and publishes nothing: the process runs at once, and claims in the
background (which takes the task off the list).  A copy that arrives after its standby was
taken, or runs in another process than the one named, claims like a dispatched task.  The
order is the same (a standby waiter is dispatched when its turn comes, like any other); only
the way its message travels changes.  A standby that times out ends in one step against the
release (either it ends, and its copy is dropped while the waiter waits on in the list, or a
release took it first and it runs).  A standby process that dies is ended by the worker's
main process (:func:`end_standby`; leases created in its name go with its other leases),
and the task, still listed as dispatched, is dispatched again by the sweep.  Standbys are
only taken by a release whose run lasted under half of ``caps_standby_seconds``: for long
tasks the hand-over is no cost worth a blocked pool process.  A burst's first hand-over has no
release before it: a task that took its slots when sent, whose claim sees tasks waiting behind it
(``SlotStore.claim_dispatch``), puts them on standby as it starts, in the background
(``CapsRuntime.stand_by_soon``), unless the last run of its task in that process was long.
A task claimed before anyone waited behind it is covered from the other side: a park that finds
one of its slots' lists empty (``park(report_first=True)`` returns ``PARK_PARKED_FIRST``) has
whoever parked it (the sender's ``apply_async``, or the worker it reached) put the next waiters
on standby the same way.  To Celery a standby copy runs: a ``revoke`` without ``terminate``
would not stop it, so the worker's main process takes revoked standby copies off the list
(``worker.RevokedStandbys``).  A standby whose store connection fails waits on, connecting
again, until its wait is over: its record still names its process.

Choosing.  ``caps_strategy`` is ``"park"`` (default) or ``"backoff"``, or a mapping
``{"default": ..., "<cap name>": ...}`` choosing per cap; a task parks when any of
its caps chooses ``park``.  Every built-in store has a waiting list; a store
without one falls back to backoff, with a warning when the worker starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from kombu.entity import Exchange, Queue
from kombu.serialization import dumps, loads

from .errors import StoreError
from .settings import CapsSettings, ParkingSettings
from .stores.base import DISPATCH_HOLDER, SlotStore, Woken

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

#: The header of a dispatched message: the run id of its dispatch leases.
DISPATCH_HEADER = "caps_dispatch_run_id"
#: The header of a standby copy: the mark of its standby (``SlotStore.stand_by``).
STANDBY_HEADER = "caps_standby_mark"
#: A release publishes the tasks it woke to ``<their queue>`` + this suffix: a queue that
#: every worker consuming ``<their queue>`` consumes too (:class:`~celery_caps.worker.CapsWakeQueues`),
#: so that a woken task does not wait behind the backlog of its own queue.
WAKE_QUEUE_SUFFIX = ".caps-wake"


class CapsContext(Protocol):
    """What the functions below work with: a worker process's ``CapsRuntime``, or the CLI's operator."""

    @property
    def app(self) -> Celery: ...

    @property
    def settings(self) -> CapsSettings: ...

    @property
    def store(self) -> SlotStore: ...


def parking_for(runtime: CapsContext) -> ParkingSettings:
    """The runtime's parking settings (``caps_strategy`` and the ``caps_park_*`` bounds)."""
    return runtime.settings.parking


def dispatch_lease_seconds(runtime: CapsContext) -> float:
    """How long a dispatch lease (or a mark on a waiter being published) lasts, in seconds."""
    return runtime.settings.parking.dispatch_lease_seconds or runtime.settings.lease_seconds


def check_store(app: Celery, store: SlotStore) -> None:
    """At worker start: warn when park is chosen but the store cannot park (backoff is used)."""
    settings = CapsSettings.from_conf(app.conf).parking
    if settings.uses_park and not store.supports_parking:
        logger.warning(
            "caps_strategy chooses park, but the slot store %s has no waiting list: capped tasks "
            "are put back with backoff instead",
            type(store).__name__,
        )


# -- payloads ---------------------------------------------------------------------


def encode_payload(app: Celery, message: Mapping[str, Any]) -> bytes:
    """``message`` (a signature as a dict) in the app's task serializer, with its content type."""
    content_type, encoding, data = dumps(dict(message), serializer=app.conf.task_serializer)  # type: ignore[no-untyped-call]
    body = data if isinstance(data, bytes) else data.encode(encoding)
    return f"{content_type}\n{encoding}\n".encode() + body


def decode_payload(payload: bytes) -> Any:
    content_type, encoding, body = payload.split(b"\n", 2)
    kind = content_type.decode()
    return loads(body, kind, encoding.decode(), accept=[kind])  # type: ignore[no-untyped-call]


#: True while the library publishes a waiting task again (a wake, a drain, a put-back):
#: such a message goes to the broker, never back to the waiting list at publish time.
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


def _queue_of(app: Celery, options: Mapping[str, Any]) -> str | None:
    """The name of the queue a signature's options route to, when they say (None: unknown)."""
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


def publish_woken(
    app: Celery,
    woken: Sequence[Woken],
    *,
    dispatched: bool = True,
    to_wake_queue: bool = True,
    standby: bool = False,
) -> list[Woken]:
    """Publish each woken waiter's message again; returns those published (and, dispatched,
    those signalled to their standby process instead).

    ``dispatched``: the waiters hold dispatch leases, and their messages carry the
    run id to claim them (else ordinary messages, re-entering admission).  A
    dispatched waiter whose standby was signalled (``Woken.standby``) is not published.
    ``standby``: standby copies (``SlotStore.stand_by``), carrying their mark, to the
    wake queue.
    ``to_wake_queue``: a dispatched message goes to the wake queue of its queue, so
    that it overtakes that queue's backlog (its own lease is already taken: the slot
    waits for it).  The sweep passes False: a
    dispatch that was never claimed (a worker that does not consume wake queues
    yet, say) goes the task's own way the second time.  A failure is logged (task id
    only, never the payload): a dispatched waiter is dispatched again by the sweep
    once its dispatch lease expires.
    """
    if not woken:
        return []
    published = []
    # Not a child of whatever task runs in this process (Celery would set parent_id).
    current = app.current_worker_task
    if current is not None:
        current.push_request(called_directly=True)
    republishing = REPUBLISHING.set(True)
    try:
        for waiter in woken:
            if dispatched and waiter.standby:
                published.append(waiter)  # its standby process claims it
                continue
            try:
                signature = app.signature(decode_payload(waiter.payload))
                headers = dict(signature.options.get("headers") or {})
                headers.pop(DISPATCH_HEADER, None)
                headers.pop(STANDBY_HEADER, None)
                route: dict[str, Any] = {}
                if dispatched or standby:
                    headers[STANDBY_HEADER if standby else DISPATCH_HEADER] = waiter.run_id
                    queue = _queue_of(app, signature.options) if to_wake_queue else None
                    if queue is not None:
                        route = {"queue": wake_queue(wake_queue_name(queue)), "exchange": None, "routing_key": None}
                signature.apply_async(headers=headers, add_to_parent=False, **route)
                published.append(waiter)
            except Exception as exc:
                logger.error(
                    "could not publish waiting task %s[%s] (%s: %s); %s",
                    waiter.task_name,
                    waiter.task_id,
                    type(exc).__name__,
                    exc,
                    "the sweep dispatches it again" if dispatched else "it stays in the waiting list",
                )
    finally:
        REPUBLISHING.reset(republishing)
        if current is not None:
            current.pop_request()
    return published


def publish_taken(runtime: CapsContext, taken: Sequence[Woken]) -> list[Woken]:
    """Publish waiters taken off the list (``expire_waiters``, ``drain``) as ordinary messages,
    then delete the published ones from the store and put the others back to waiting (at
    least once: a task is deleted only once its message is on the broker).  Returns those
    published."""
    if not taken:
        return []
    published = publish_woken(runtime.app, taken, dispatched=False)
    done = {(waiter.task_id, waiter.run_id) for waiter in published}
    failed = [waiter for waiter in taken if (waiter.task_id, waiter.run_id) not in done]
    try:
        runtime.store.settle_published(published, failed)
    except StoreError as exc:
        # Their marks expire: the unpublished wait again, the published may be published twice.
        logger.warning("could not settle %d published waiting task(s) (%s)", len(taken), exc)
    return published


# -- the runtime's side -----------------------------------------------------------


def parks(runtime: CapsContext) -> bool:
    """Whether releases in this runtime hand freed room to waiters (park in use, a store that parks)."""
    return parking_for(runtime).uses_park and runtime.store.supports_parking


def release(runtime: CapsContext, run_id: str, after_wake: Callable[[], object] | None = None) -> int:
    """Release ``run_id``; with park in use, hand its room to waiters and publish them, then
    call ``after_wake`` if it woke any (a worker puts the next waiters on standby then, in the
    background: see the module docstring).

    Returns the leases deleted.  Raises :class:`StoreError` like ``SlotStore.release``.
    """
    store = runtime.store
    if not parks(runtime):
        return store.release(run_id)
    deleted, woken = store.release_and_wake(run_id, dispatch_lease_seconds(runtime))
    publish_woken(runtime.app, woken)
    if woken and after_wake is not None:
        after_wake()
    return deleted


def stand_by(runtime: CapsContext, slots: Sequence[str], ran_seconds: float) -> list[Woken]:
    """Put the next waiters of ``slots`` on standby and publish their copies, when the store
    can and a run of ``ran_seconds`` is short enough for it to pay; returns those published.
    A failure is logged: the waiters are dispatched through the broker instead."""
    parking = parking_for(runtime)
    if not parking.uses_standby or ran_seconds >= parking.standby_seconds / 2 or not runtime.store.supports_standby:
        return []
    # The copy waits up to standby_seconds after it arrives; the record outlives it.
    hold_seconds = parking.standby_seconds * 2 + 5
    try:
        standbys = runtime.store.stand_by(slots, parking.standby_per_slot, parking.standby_max, hold_seconds)
    except StoreError as exc:
        logger.warning("could not put waiters on standby (%s); they are published when woken", exc)
        return []
    published = publish_woken(runtime.app, standbys, dispatched=False, standby=True)
    for waiter in standbys:
        if waiter not in published:
            end_standby(runtime, waiter.task_id, waiter.run_id, waiter.payload)
    return published


def end_standby(runtime: CapsContext, task_id: str, mark: str, payload: bytes | None = None) -> None:
    """End a standby whose copy will never wait for it (its publish failed, its process died).

    If a release took it already for a dispatch lease, that dispatch is published with
    ``payload``; without one (the process died), the dispatch lease, if nobody claimed it, is
    released for the next waiters (the task keeps its place, and the sweep dispatches it again
    once its dispatch lease expires).  Leases a release created in a dead process's name are
    released with that process's other leases (``release_holder``).  Logged on failure (the
    sweep dispatches it again then, too).
    """
    try:
        dispatch = runtime.store.await_standby(task_id, mark, 0)
        if dispatch is None:
            return
        if payload is not None:
            publish_woken(runtime.app, [Woken(task_id, dispatch.run_id, payload)])
        else:
            release_holder(runtime, task_id, DISPATCH_HOLDER)
    except StoreError as exc:
        logger.warning("could not end the standby of task %s (%s)", task_id, exc)


def release_holder(runtime: CapsContext, task_id: str, holder: str) -> int:
    """Release what ``holder`` (a dead pool process) held for ``task_id``; with park in use,
    hand the room to waiters and publish them.  Returns the leases deleted."""
    store = runtime.store
    if not parks(runtime):
        return store.release_holder(task_id, holder)
    deleted, woken = store.release_holder_and_wake(task_id, holder, dispatch_lease_seconds(runtime))
    publish_woken(runtime.app, woken)
    return deleted


def release_task(runtime: CapsContext, task_id: str) -> int:
    """Release every lease of ``task_id`` (revoke); with park in use, hand the room to waiters
    and publish them.  Returns the leases deleted."""
    store = runtime.store
    if not parks(runtime):
        return store.release_task(task_id)
    deleted, woken = store.release_task_and_wake(task_id, dispatch_lease_seconds(runtime))
    publish_woken(runtime.app, woken)
    return deleted


def forget(runtime: CapsContext, task_id: str) -> int:
    """``task_id`` is not to run (revoked, expired, dropped by an operator): remove it from the
    waiting list, free its dispatch leases for the next waiters and publish them.  Returns the
    waiting entries removed (0 for a store without a waiting list)."""
    if not runtime.store.supports_parking:
        return 0
    removed, woken = runtime.store.forget(task_id, dispatch_lease_seconds(runtime))
    publish_woken(runtime.app, woken)
    return removed


def sweep_waiters(runtime: CapsContext) -> int:
    """For the sweep: re-dispatch expired dispatches, wake what fits, give up on waiters past
    ``caps_max_wait_seconds``.  Returns how many messages were published."""
    store = runtime.store
    if not parks(runtime):
        return 0
    published = 0
    max_wait = runtime.settings.max_wait_seconds
    if max_wait is not None:
        try:
            expired = store.expire_waiters(time.time() - max_wait, dispatch_lease_seconds(runtime))
            published += len(publish_taken(runtime, expired))
        except StoreError as exc:
            logger.warning("expiring parked tasks failed (%s); the next sweep tries again", exc)
    try:
        woken = store.wake(dispatch_lease_seconds(runtime))
        published += len(publish_woken(runtime.app, woken, to_wake_queue=False))
    except StoreError as exc:
        logger.warning("waking parked tasks failed (%s); the next sweep tries again", exc)
    return published
