"""``CappedTask``: admission before the body, release after.

Admission happens in ``Task.__call__``, in the process that runs the task (a
prefork child, a pool thread, a greenlet or the solo worker), after the worker
received the message and before the body: all of the task's caps are taken in
one store transaction.  Calls that are not messages follow Celery's conventions:
a direct call (``mytask(...)``) is a plain function call, and an eager run
(``task_always_eager``, ``apply()``) runs without caps unless ``caps_enforce_eager``
says otherwise.  When a cap is full, the strategy decides what becomes of
the copy: *park* (:mod:`celery_caps.park`, the default) keeps the task in the
store's waiting list until a release hands it a slot; *backoff*
(:mod:`celery_caps.backoff`) publishes it again with a countdown.

A task that waits is visible: with a result backend (and results not ignored) its
state becomes ``DEFERRED`` with the full slots in its meta (the final state
overwrites it), and with task events on (``-E``) the worker sends a
``task-deferred`` event, which Flower shows as the task's state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject
from celery.utils import uuid as new_task_id

from . import backoff, handover, messages, park
from .caps import Cap, Needs, needs_for, normalize_caps
from .errors import CapWaitExceeded, LeaseLost, StoreError
from .health import describe
from .runtime import CapsRuntime, holder_name, runtime_for
from .settings import PARK
from .stores.base import ParkingStore

logger = logging.getLogger(__name__)


def _green_kill_exceptions() -> tuple[type[BaseException], ...]:
    """What a green pool raises in a greenlet it kills (gevent, eventlet: ``GreenletExit``)."""
    try:
        from greenlet import GreenletExit
    except ImportError:  # no greenlet installed: no green pool either
        return ()
    return (GreenletExit,)


_GREEN_KILLS = _green_kill_exceptions()
#: What releasing a killed greenlet's run may raise (logged; its leases then expire).
_RELEASE_WHEN_KILLED_ERRORS: tuple[type[BaseException], ...] = (Exception, *_GREEN_KILLS)

#: The result state of a task waiting for its caps, and the event sent when it is put back.
DEFERRED_STATE = "DEFERRED"
DEFERRED_EVENT = "task-deferred"

#: The slots held by the capped runs under way in this thread (or greenlet): an eager call
#: nested in one runs under its admission for those slots, rather than wait for itself.
_HELD_HERE: ContextVar[frozenset[str]] = ContextVar("celery_caps_held_here", default=frozenset())


@contextlib.contextmanager
def _holding(slots: Mapping[str, int]) -> Iterator[None]:
    token = _HELD_HERE.set(_HELD_HERE.get() | frozenset(slots))
    try:
        yield
    finally:
        _HELD_HERE.reset(token)


def _ignores_result(task: Task, request: Any) -> bool:
    """Whether the worker will store no result for this run, by the running Celery's own rule.

    Celery 5.7 lets a request's own ``ignore_result`` (``apply_async(ignore_result=...)``)
    override the task's (``get_actual_ignore_result``); earlier versions store nothing when
    either the task or the request ignores results.
    """
    try:
        from celery.app.task import get_actual_ignore_result
    except ImportError:  # Celery < 5.7
        return bool(task.ignore_result or getattr(request, "ignore_result", False))
    return bool(get_actual_ignore_result(task, request))


class CappedTask(Task):  # type: ignore[misc]
    """A task that runs only while it holds a slot of every cap in ``cap``.

    Use as ``@app.task(base=CappedTask, cap=Cap("provider", 25))``; ``cap`` takes
    one :class:`~celery_caps.Cap` or a list of them (taken all-or-nothing).

    Acknowledgement is the app's and the task's choice, as for any task (``task_acks_late``,
    ``acks_late=``): with late acknowledgement (recommended) a crash redelivers the message;
    with Celery's default, a crash during admission or the run loses it, as it loses any task
    (a task waiting in the store is held there, and a woken copy lost before its claim is
    dispatched again).
    """

    #: The task's caps: one ``Cap``, a list of them, or None (then it runs uncapped).
    cap: Cap | Sequence[Cap] | None = None
    #: Main-process hooks that release the slots of a child killed mid-run.
    Request = "celery_caps.worker:CappedRequest"
    #: The worker's message handler: a woken copy starts before the arrivals that wait for a pool process.
    Strategy = "celery_caps.worker:capped_strategy"

    _caps: ClassVar[tuple[Cap, ...]] = ()

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        cls._caps = normalize_caps(cls.cap, cls.name or cls.__name__)
        if cls._caps:
            from .worker import install

            install(app)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        caps = self._caps
        request = self.request
        if not caps or request.called_directly or getattr(request, "caps_ran", False):
            # A direct call is a plain function call, as in Celery: no store, no lease.  So is
            # a call made under a request whose run is over: Celery calls an errback of the
            # failed task's own type directly, with the failed task's request still current.
            return super().__call__(*args, **kwargs)
        runtime = runtime_for(self._get_app())
        if request.is_eager and not runtime.settings.enforce_eager:
            return super().__call__(*args, **kwargs)
        needs = needs_for(caps, args, kwargs)
        holder = holder_name(request.hostname, None)
        run_id: str | None
        if request.is_eager:
            # Slots this thread holds already (an eager call nested in a capped run) are its caller's.
            needed = needs.of(slot for slot in needs.slots if slot not in _HELD_HERE.get())
            run_id = self._admit_waiting(runtime, request, needed, holder) if needed.slots else None
            runtime.metrics.admitted(needed.slots, 0.0)
        else:
            runs_before = runtime.runs_of(request.id)
            try:
                strategy = park if self._parks(runtime, request) else backoff
                run_id = strategy.admit(self, runtime, request, needs, holder, args, kwargs)
            except _GREEN_KILLS as exc:
                self._give_back_when_killed(runtime, request, runs_before, exc)
        # The body's request is a copy of this one: retry() finds the run there.
        request.caps_run_id = run_id
        try:
            with _holding(needs.slots):
                return super().__call__(*args, **kwargs)
        finally:
            # Set after the body (a request pushed during it copies this one's attributes).
            request.caps_ran = True
            if run_id is not None:
                runtime.finish(run_id)
                runtime.release(run_id)

    def _parks(self, runtime: CapsRuntime, request: Any) -> bool:
        """Whether this copy goes through park's admission: the strategy chooses park, or it is a
        woken copy (it carries a dispatch), which claims its dispatch whatever the strategy now."""
        if not isinstance(runtime.store, ParkingStore):
            return False
        if messages.header(request, messages.DISPATCH_HEADER):
            return True
        return runtime.settings.parking.strategy_for(self._caps) == PARK

    def _give_back_when_killed(
        self, runtime: CapsRuntime, request: Any, runs_before: set[str], exc: BaseException
    ) -> NoReturn:
        """A green pool killed this greenlet before the body ran: give the message back.

        gevent's and eventlet's pools kill their greenlets at a cold shutdown (and on
        ``revoke(terminate=True)``), and Celery then acknowledges the message as if the task
        had succeeded.  Killed during admission or a put-back (store calls and publishes
        switch greenlets), the task would be lost without ever running.  Instead the run
        this attempt may have taken is released, and the message is rejected with requeue;
        if even that cannot be sent (the worker is going down), it stays unacknowledged and
        the broker delivers it again.
        """
        for run_id in runtime.runs_of(request.id) - runs_before:
            try:
                runtime.release(run_id)  # no longer renewed, even if the store call fails
            except _RELEASE_WHEN_KILLED_ERRORS as release_exc:
                logger.warning("%s[%s]: not released when killed (%r)", self.name, request.id, release_exc)
        logger.warning("%s[%s] killed before its body ran: message given back to the broker", self.name, request.id)
        raise Reject(exc, requeue=True) from exc

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Push a request that starts from a copy of the current one, as Celery 5.5+ does.

        ``Task.__call__`` pushes a request of its own when the worker's stack protection is
        not installed (``apply()``, direct calls).  Celery 5.3 and 5.4 pushed an empty one,
        so a task overriding ``__call__`` (as this class must) would lose its id, retries
        and this run's ``caps_run_id`` in the body under ``apply()``.
        """
        self.request_stack.push(Context(*args, **{**self.request.__dict__, **kwargs}))

    def caps_still_held(self) -> bool:
        """The fencing check: whether this run still holds all its slots, asked of the store now.

        Call it right before a side effect that the cap protects.  It renews the run's
        leases in the same store call, so True means the slots are held for at least
        ``caps_lease_seconds`` more (by the store's clock).  False means a lease expired
        (a store outage longer than the lease, a frozen process) or an operator released
        it: another task may hold the room now.  Also False when the store cannot be
        reached (the run cannot prove it holds).  True for a task without caps, or
        running uncapped under ``caps_on_store_error="run"``, since there is nothing to hold.

        Raises:
            LeaseLost: the lease is gone and ``caps_on_lease_lost`` is ``"stop"``.
        """
        if not self._caps:
            return True
        run_id = getattr(self.request, "caps_run_id", None)
        if run_id is None:
            return True
        runtime = runtime_for(self._get_app())
        held = runtime.still_held(run_id)
        if not held and runtime.settings.on_lease_lost == "stop":
            raise LeaseLost(f"task {self.name}[{self.request.id}] lost its slot lease (run {run_id})")
        return held

    def retry(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``retry``; this run's slots are released before the retry is sent when the
        body ends with it (``throw=True``, retries left).  Otherwise the body goes on (``throw=False``,
        or ``MaxRetriesExceededError`` caught) and keeps its slots until it ends."""
        run_id = getattr(self.request, "caps_run_id", None)
        if run_id is not None and throw and self._retry_will_be_sent(max_retries):
            runtime_for(self._get_app()).release(run_id)
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)

    def _retry_will_be_sent(self, max_retries: int | None) -> bool:
        """Whether Celery's ``retry`` sends a retry now rather than raise ``MaxRetriesExceededError``
        (or the given exception), by Celery's own rule."""
        request = self.request
        if request.called_directly:
            return False
        limit = self.max_retries if max_retries is None else max_retries
        return limit is None or (request.retries or 0) < limit

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's; with ``caps_park_on_publish`` (off by default) and the park strategy, a task
        whose slots are full right now goes straight to the waiting list instead of the broker,
        and one whose slots have room takes them now, as a dispatch its worker claims on arrival."""
        if self._caps and not messages.REPUBLISHING.get():
            sent = park.admit_when_sent(self, args, kwargs, task_id, link, link_error, shadow, options)
            if sent.parked is not None:
                return sent.parked
            task_id = sent.task_id
            if sent.dispatch_run_id is not None:
                headers = {**(options.get("headers") or {}), messages.DISPATCH_HEADER: sent.dispatch_run_id}
                options = {**options, "headers": headers}
                try:
                    return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
                except BaseException:
                    self._give_back_sent_slots(sent.task_id, sent.dispatch_run_id)
                    raise
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

    def _give_back_sent_slots(self, task_id: str | None, dispatch_run_id: str) -> None:
        """The task that took its slots when sent was not published: free them for the next waiters."""
        try:
            handover.release(runtime_for(self._get_app()), dispatch_run_id)
        except StoreError as exc:  # its dispatch lease expires
            logger.warning("%s[%s] not sent: its slots were not given back (%s)", self.name, task_id, exc)

    def signature_from_request(
        self,
        request: Any = None,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        queue: Any = None,
        **extra_options: Any,
    ) -> Any:
        """Celery's (used by ``retry``, a put-back and parking), except that the copy it makes
        carries none of this delivery's own headers (its dispatch), a retry (a copy made without
        ``headers=``) none of this attempt's wait either, and a task woken into a wake queue is
        sent on to its own queue, never to the wake queue."""
        request = self.request if request is None else request
        routing_key = (getattr(request, "delivery_info", None) or {}).get("routing_key")
        if queue is None and isinstance(routing_key, str) and messages.is_wake_queue(routing_key):
            queue = messages.queue_of_wake_queue(routing_key)
        new_attempt = "headers" not in extra_options
        signature = super().signature_from_request(request, args, kwargs, queue=queue, **extra_options)
        if signature.options.get("headers"):
            signature.options["headers"] = messages.copied_headers(
                signature.options["headers"], new_attempt=new_attempt
            )
        return signature

    # -- a copy that waits ------------------------------------------------------------

    def end_deferred_copy(self, runtime: CapsRuntime, request: Any, waiting: Mapping[str, Any]) -> NoReturn:
        """Record the deferral, tell event consumers, and end this copy with ``Ignore``."""
        runtime.deferred(
            request.id, self.name, waiting["slots"], waiting["full_slots"], holder_name(request.hostname, None),
            waiting["deferrals"] - 1, waiting["reason"],
        )  # fmt: skip
        if runtime.send_events and self.send_events:
            try:
                self.send_event(DEFERRED_EVENT, **waiting)
            except Exception as exc:  # an event is worth less than the task
                logger.warning("%s[%s]: could not send %s (%s)", self.name, request.id, DEFERRED_EVENT, exc)
        raise Ignore()

    def keeps_deferred_state(self, runtime: CapsRuntime, request: Any) -> bool:
        """Whether a wait of this copy is stored as ``DEFERRED``: ``caps_deferred_state``, a
        result backend, and results kept."""
        if not runtime.settings.deferred_state or _ignores_result(self, request):
            return False
        from celery.backends.base import DisabledBackend

        return not isinstance(self.backend, DisabledBackend)

    def store_deferred_state(self, runtime: CapsRuntime, request: Any, waiting: Mapping[str, Any]) -> None:
        """Store ``DEFERRED`` with ``waiting`` as meta, when there is a backend and results are kept."""
        if not self.keeps_deferred_state(runtime, request):
            return
        try:
            self.update_state(task_id=request.id, state=DEFERRED_STATE, meta=dict(waiting))
        except Exception as exc:  # the state is information; the task must still go back
            logger.warning("%s[%s]: could not store state %s (%s)", self.name, request.id, DEFERRED_STATE, exc)

    def _admit_waiting(self, runtime: CapsRuntime, request: Any, needs: Needs, holder: str) -> str | None:
        """An eager run under ``caps_enforce_eager``: wait in this process until the caps admit.

        There is no broker to put it back to: a full cap, or a store error under
        ``caps_on_store_error = "defer"``, waits (and gives up after ``caps_max_wait_seconds``).
        None: it runs uncapped (``caps_on_store_error = "run"``).
        """
        settings = runtime.settings
        task_id = request.id or new_task_id()
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                admission, run_id = runtime.acquire(
                    needs.slots, task_id, holder, task_name=self.name, deferrals=attempt, weights=needs.weights
                )
                full = list(admission.full_slots)
            except StoreError as exc:
                if settings.on_store_error != "defer":
                    messages.on_store_error(self, runtime, request, needs.slots, (), {}, exc)
                    return None  # "run": uncapped ("fail" raised)
                logger.warning("%s[%s] waits: slot store error (%s)", self.name, task_id, describe(exc))
                admission, run_id, full = None, "", list(needs.slots)
            if admission is not None and admission.granted:
                return run_id
            waited = time.monotonic() - started
            if settings.max_wait_seconds is not None and waited >= settings.max_wait_seconds:
                raise CapWaitExceeded(self.name, task_id, waited, full)
            time.sleep(messages.backoff_seconds(attempt, settings.backoff_min_seconds, settings.backoff_max_seconds))
            attempt += 1
