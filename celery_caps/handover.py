"""Hand-overs: a release hands the room it frees to waiters, and their copies are published.

Below both strategies (:mod:`celery_caps.park`, :mod:`celery_caps.backoff`) and used by the
runtime, the worker and the CLI: every release of a store with a waiting list goes through
here, whichever strategy the app chooses now, so that tasks parked before a change of
strategy (or of a cap's name) are still handed their slots.  A dispatched waiter's copy is
published to the wake queue of its queue; a copy that cannot be published because of what it
is (its arguments no longer fit, its serializer is missing) fails alone and visibly (a
``FAILURE`` result, a ``task-failed`` event, an ERROR line) and gives back what it held, while
one that cannot be published because the broker is away is dispatched again by recovery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kombu.exceptions import OperationalError

from .errors import UnpublishableTask
from .messages import (
    DISPATCH_HEADER,
    REPUBLISHING,
    decode_payload,
    destination_queue,
    wake_route,
)
from .settings import CapsSettings
from .stores.base import OUTSIDE_PAYLOAD, ParkingStore, SlotStore, Woken

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

#: Errors of a publish that say the broker is away, not that the message is bad: the entry
#: keeps answering for the task and is dispatched again.
_BROKER_ERRORS: tuple[type[BaseException], ...] = (OperationalError, ConnectionError, TimeoutError, OSError)


class CapsContext(Protocol):
    """What the functions below work with: a worker process's ``CapsRuntime``, or the CLI's operator."""

    @property
    def app(self) -> Celery: ...

    @property
    def settings(self) -> CapsSettings: ...

    @property
    def store(self) -> SlotStore: ...


def dispatch_lease_seconds(runtime: CapsContext) -> float:
    """How long a dispatch lasts unclaimed before recovery dispatches the task again, in seconds."""
    return runtime.settings.dispatch_lease_seconds


def parking_store(runtime: CapsContext) -> ParkingStore | None:
    """The runtime's store if it keeps a waiting list (then every release hands freed room to
    waiters, whatever strategy the app chooses now), else None."""
    store = runtime.store
    return store if isinstance(store, ParkingStore) else None


def parks(runtime: CapsContext) -> bool:
    """Whether releases in this runtime hand freed room to waiters (a store with a waiting list)."""
    return parking_store(runtime) is not None


def publish_woken(runtime: CapsContext, woken: Sequence[Woken], *, stop_at_broker_error: bool = False) -> list[Woken]:
    """Publish a copy of each dispatched waiter, carrying its dispatch run id, to the wake queue
    of its queue; returns those published (with ``stop_at_broker_error``, those published before
    the broker first failed: the rest are not tried).  A waiter parked outside (its message in
    the broker already) counts as published: there is nothing to publish.

    A broker that cannot be reached is logged (task id only, never the payload): the entry keeps
    answering for the task, and recovery dispatches it again once the dispatch's deadline
    passes.  A message that cannot be published for what it is fails its task
    (:func:`fail_unpublishable`): one bad message never holds a slot, nor the waiters behind it.
    """
    if not woken:
        return []
    app = runtime.app
    published = []
    unpublishable: list[tuple[Woken, Any, BaseException]] = []
    # Not a child of whatever task runs in this process (Celery would set parent_id).
    current = app.current_worker_task
    if current is not None:
        current.push_request(called_directly=True)
    republishing = REPUBLISHING.set(True)
    try:
        for waiter in woken:
            if waiter.payload == OUTSIDE_PAYLOAD:
                # Its message is in the broker already, and claims the dispatch when it comes back.
                published.append(waiter)
                continue
            signature = None
            try:
                signature = app.signature(decode_payload(app, waiter.payload))
                headers = {**(signature.options.get("headers") or {}), DISPATCH_HEADER: waiter.run_id}
                queue = destination_queue(app, signature)
                if queue is not None:
                    signature.options.update(wake_route(queue))
                signature.apply_async(headers=headers, add_to_parent=False)
                published.append(waiter)
            except _BROKER_ERRORS as broker_error:
                logger.error(
                    "could not publish waiting task %s[%s] (%s: %s); it is dispatched again once its dispatch expires",
                    waiter.task_name, waiter.task_id, type(broker_error).__name__, broker_error,
                )  # fmt: skip
                if stop_at_broker_error:
                    break
            except Exception as bad_message:
                unpublishable.append((waiter, signature, bad_message))
    finally:
        REPUBLISHING.reset(republishing)
        if current is not None:
            current.pop_request()
    for waiter, signature, exc in unpublishable:
        fail_unpublishable(runtime, waiter, signature, exc)
    return published


def fail_unpublishable(runtime: CapsContext, waiter: Woken, signature: Any, exc: BaseException) -> None:
    """``waiter``'s message cannot be published (``exc``): fail its task visibly and give back
    what it held.

    Its result becomes ``FAILURE`` (:class:`UnpublishableTask`, with the reason; the task's
    errbacks are called when its message could be read), a ``task-failed`` event is sent when
    this worker sends events, an ERROR line is logged, and the entry leaves the waiting list
    (``forget``), which hands its slots to the next waiters.  The failure is stored first: a
    ``forget`` whose reply is lost may have taken the entry off the list, and the task must not
    vanish without a result.  If the store cannot be reached, the entry may stay dispatched: its
    dispatch expires, and the next hand-over fails it again (the same result, and its errbacks
    called again: the store's fault).
    """
    app = runtime.app
    task_name = waiter.task_name or (signature.task if signature is not None else None) or "?"
    reason = f"{type(exc).__name__}: {exc}"
    failure = UnpublishableTask(task_name, waiter.task_id, reason)
    logger.error("%s", failure)
    _store_failure(app, waiter.task_id, task_name, signature, failure)
    try:
        forget(runtime, waiter.task_id)
    except Exception as forget_exc:  # a StoreError: the dispatch expires and it is tried again
        logger.warning("%s[%s]: not taken off the waiting list (%s)", task_name, waiter.task_id, forget_exc)
        return
    if getattr(runtime, "send_events", False):
        try:
            with app.events.default_dispatcher() as dispatcher:
                dispatcher.send("task-failed", uuid=waiter.task_id, exception=repr(failure), traceback="")
        except Exception as event_exc:  # an event is worth less than the slot it frees
            logger.warning("%s[%s]: task-failed event not sent (%s)", task_name, waiter.task_id, event_exc)


def _store_failure(app: Celery, task_id: str, task_name: str, signature: Any, failure: BaseException) -> None:
    """Store ``failure`` as the task's result (and call its errbacks), if it keeps results."""
    from celery.app.task import Context
    from celery.backends.base import DisabledBackend

    if signature is None:  # its message could not be read: no errbacks, no canvas
        options: dict[str, Any] = {}
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
    else:
        options, args, kwargs = dict(signature.options), list(signature.args or ()), dict(signature.kwargs or {})
    if options.get("ignore_result") or isinstance(app.backend, DisabledBackend):
        return
    request = Context(
        id=task_id, task=task_name, args=args, kwargs=kwargs, errbacks=options.get("link_error"),
        chord=options.get("chord"), group=options.get("group_id"), root_id=options.get("root_id"),
        parent_id=options.get("parent_id"), delivery_info={},
    )  # fmt: skip
    try:
        app.backend.mark_as_failure(task_id, failure, request=request)
    except Exception as exc:
        logger.warning("%s[%s]: its FAILURE result was not stored (%s)", task_name, task_id, exc)


def release(runtime: CapsContext, run_id: str) -> int:
    """Release ``run_id``; with a waiting list, hand its room to waiters and publish them.

    Returns the leases deleted.  Raises :class:`StoreError` like ``SlotStore.release``.
    """
    store = parking_store(runtime)
    if store is None:
        return runtime.store.release(run_id)
    deleted, woken = store.release_and_wake(run_id, dispatch_lease_seconds(runtime))
    publish_woken(runtime, woken)
    return deleted


def release_holder(runtime: CapsContext, task_id: str, holder: str) -> int:
    """Release what ``holder`` (a dead pool process) held for ``task_id``; with a waiting list,
    hand the room to waiters and publish them.  Returns the leases deleted."""
    store = parking_store(runtime)
    if store is None:
        return runtime.store.release_holder(task_id, holder)
    deleted, woken = store.release_holder_and_wake(task_id, holder, dispatch_lease_seconds(runtime))
    publish_woken(runtime, woken)
    return deleted


def release_task(runtime: CapsContext, task_id: str) -> int:
    """Release every lease of ``task_id`` (revoke); with a waiting list, hand the room to waiters
    and publish them.  Returns the leases deleted."""
    store = parking_store(runtime)
    if store is None:
        return runtime.store.release_task(task_id)
    deleted, woken = store.release_task_and_wake(task_id, dispatch_lease_seconds(runtime))
    publish_woken(runtime, woken)
    return deleted


def forget(runtime: CapsContext, task_id: str) -> int:
    """``task_id`` is not to run (revoked, expired): take it off the waiting list, free its
    dispatch leases for the next waiters and publish them.  Returns the entries removed."""
    store = parking_store(runtime)
    if store is None:
        return 0
    removed, woken = store.forget(task_id, dispatch_lease_seconds(runtime))
    publish_woken(runtime, woken)
    return removed


# -- recovery ------------------------------------------------------------------------------


def caps_of(app: Celery) -> set[str]:
    """The names of the caps ``app``'s tasks declare (those registered now)."""
    return {cap.name for task in list(app.tasks.values()) for cap in getattr(task, "_caps", ())}


def recover(runtime: CapsContext, caps: Collection[str] | None = None) -> list[Woken]:
    """Dispatch again what was never claimed, hand room freed by expiry to waiters, readmit
    waiters past ``caps_max_wait_seconds``; publish them.  Returns those published.

    Only the waiters of ``caps`` (cap names, or slot names) if given; by default those of the
    app's own caps and of every task the app knows by name (a task whose cap its code renamed or
    removed since it parked is still served): a worker publishes the tasks it knows, never
    another app's that shares the store.

    Raises:
        StoreError: the store failed (the next call tries again).
    """
    store = parking_store(runtime)
    if store is None:
        return []
    task_names: list[str] | None = None
    if caps is None:
        caps = caps_of(runtime.app)
        task_names = sorted(name for name in list(runtime.app.tasks) if not name.startswith("celery."))
    if not caps and not task_names:
        return []
    max_wait = runtime.settings.max_wait_seconds
    woken = store.recover(
        dispatch_lease_seconds(runtime),
        caps=sorted(caps),
        task_names=task_names,
        readmit_before=None if max_wait is None else time.time() - max_wait,
    )
    return publish_woken(runtime, woken)


def readmit(runtime: CapsContext, slot: str) -> tuple[int, list[Woken]]:
    """An operator empties ``slot``'s waiting list: its waiters are published to go through
    admission again.  Returns how many were taken off and those published: publishing stops at
    the broker's first failure (each try takes Celery's publish retries); those not published
    stay dispatched, and recovery publishes them once their dispatch expires."""
    store = parking_store(runtime)
    if store is None:
        return 0, []
    woken = store.readmit(slot, dispatch_lease_seconds(runtime))
    return len(woken), publish_woken(runtime, woken, stop_at_broker_error=True)


def check_store(app: Celery, store: SlotStore) -> None:
    """At worker start: warn when park is chosen but the store cannot park (backoff is used)."""
    settings = CapsSettings.from_conf(app.conf).parking
    if settings.uses_park and not isinstance(store, ParkingStore):
        logger.warning(
            "caps_strategy chooses park, but the slot store %s has no waiting list: capped tasks "
            "are put back with backoff instead",
            type(store).__name__,
        )
