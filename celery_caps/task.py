"""``CappedTask``: admission before the body, putting back when full, release after.

Admission happens in ``Task.__call__``, in the process that runs the task (a
prefork child, a pool thread, a greenlet or the solo worker), after the worker
received the message and before the body: all of the task's caps are taken in
one store transaction.  When a cap is full the task is *put back*: the same
message (id, arguments, headers, routing, priority, links, chord membership) is
published again with a countdown (exponential backoff with jitter), then the
running copy ends with ``Ignore`` so that nothing is stored and no retry is used
up.  The copy is published before the original is acknowledged: a worker dying
in between causes a duplicate, never a loss.

A put-back is visible: with a result backend (and results not ignored) the task's
state becomes ``DEFERRED`` with the full slots and the next attempt in its meta
(the final state overwrites it), and with task events on (``-E``) the worker
sends a ``task-deferred`` event, which Flower shows as the task's state.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.app.task import Context
from celery.exceptions import Ignore, Reject

from .caps import Cap, normalize_caps, slots_for
from .errors import CapWaitExceeded, LeaseLost, StoreError
from .parking import (
    DISPATCH_HEADER,
    REPUBLISHING,
    STANDBY_HEADER,
    dispatch_lease_seconds,
    encode_payload,
    is_wake_queue,
    parking_for,
    queue_of_wake_queue,
)
from .parking import release as release_and_wake
from .settings import PARK
from .stores.base import DISPATCH_HOLDER, PARK_ADMITTED, PARK_LIST_FULL, PARK_PARKED, PARK_PARKED_FIRST, StandbyDispatch
from .worker import CapsRuntime, holder_name, runtime_for

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

#: Message headers that carry a deferred task's waiting history.
DEFERRALS_HEADER = "caps_deferrals"
FIRST_DEFERRED_HEADER = "caps_first_deferred_at"
#: The put-back's countdown in seconds: a receiving worker never waits longer than this
#: after receipt, whatever the ETA (computed by the publisher's clock) says.
COUNTDOWN_HEADER = "caps_countdown"
#: The result state of a task waiting for its caps, and the event sent when it is put back.
DEFERRED_STATE = "DEFERRED"
DEFERRED_EVENT = "task-deferred"

# Celery's own request fields that may show up among a request's headers; the
# rest are the caller's custom headers, which a put-back message must keep.
_CELERY_HEADER_FIELDS = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
        "replaced_task_nesting", "stamped_headers", "stamps", "caps_run_id",
    }
)  # fmt: skip


def backoff_seconds(deferrals: int, minimum: float, maximum: float) -> float:
    """How long the ``deferrals``-th put-back waits: exponential, capped, with jitter.

    The delay doubles from ``minimum`` up to ``maximum`` (seconds); a random
    factor in [0.5, 1) spreads tasks that were put back together.
    """
    ceiling = min(maximum, minimum * (2.0 ** min(deferrals, 32)))
    return max(minimum / 2, ceiling * random.uniform(0.5, 1.0))


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


#: ``apply_async`` options about how to send, not part of the message: never parked.
_SEND_ONLY_OPTIONS = ("producer", "connection", "router", "publisher", "result_cls", "add_to_parent", "retry_policy")


def _header(request: Any, name: str) -> Any:
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name)
    return value if value is not None else getattr(request, name, None)


#: Seconds between a standby's tries to reach the store again after a store error.
STANDBY_RETRY_SECONDS = 0.5


def _wants_standby(runtime: CapsRuntime) -> bool:
    """Whether a park should report a task parked first in its list: the one who parks it then
    puts the next waiters on standby (in the background), as nobody else would before the first
    hand-over: the claims of the tasks that hold the slots saw no waiter behind them."""
    return parking_for(runtime).uses_standby and runtime.store.supports_standby


def _wake_queue_of(request: Any) -> str | None:
    """The wake queue ``request``'s message came through (a task woken by a release), else None."""
    routing_key = (getattr(request, "delivery_info", None) or {}).get("routing_key")
    return routing_key if isinstance(routing_key, str) and is_wake_queue(routing_key) else None


def _seconds_since_first_deferral(request: Any) -> float:
    """How long a task admitted now has waited for its caps (0 if it was never put back)."""
    first_deferred_at = _header(request, FIRST_DEFERRED_HEADER)
    return time.time() - float(first_deferred_at) if first_deferred_at else 0.0


def _republish_headers(request: Any, deferrals: int, first_deferred_at: float) -> dict[str, Any]:
    """The caller's custom headers of ``request`` plus the waiting history of one more deferral."""
    headers = {
        key: value
        for key, value in (getattr(request, "headers", None) or {}).items()
        if key not in _CELERY_HEADER_FIELDS and key not in (DISPATCH_HEADER, STANDBY_HEADER)
    }
    headers[DEFERRALS_HEADER] = deferrals + 1
    headers[FIRST_DEFERRED_HEADER] = first_deferred_at
    return headers


@dataclass(frozen=True)
class _Sent:
    """What admission when sent decided for a task being sent (both None: send it as usual)."""

    task_id: str | None
    #: The task waits in the store: the result to return instead of sending it.
    parked: Any = None
    #: The task took its slots: the run id of its dispatch leases, for its message's header.
    dispatch_run_id: str | None = None


class CappedTask(Task):  # type: ignore[misc]
    """A task that runs only while it holds a slot of every cap in ``cap``.

    Use as ``@app.task(base=CappedTask, cap=Cap("provider", 25))``; ``cap`` takes
    one :class:`~celery_caps.Cap` or a list of them (taken all-or-nothing).
    Capped tasks acknowledge late by default, so a worker crash redelivers them.
    """

    #: The task's caps: one ``Cap``, a list of them, or None (then it runs uncapped).
    cap: Cap | Sequence[Cap] | None = None
    #: Acknowledge after the run: a put-back or a crash must not lose the message.
    acks_late = True
    #: Main-process hooks that release the slots of a child killed mid-run.
    Request = "celery_caps.worker:CappedRequest"

    _caps: ClassVar[tuple[Cap, ...]] = ()

    @classmethod
    def on_bound(cls, app: Any) -> None:
        super().on_bound(app)
        cls._caps = normalize_caps(cls.cap, cls.name or cls.__name__)
        if cls._caps:
            from .sweep import install

            install(app)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        caps = self._caps
        if not caps:
            return super().__call__(*args, **kwargs)
        runtime = runtime_for(self._get_app())
        request = self.request
        slots = slots_for(caps, args, kwargs)
        holder = holder_name(request.hostname, None)
        run_id: str | None
        if request.called_directly or request.is_eager:
            run_id = self._admit_waiting(runtime, request.id or uuid.uuid4().hex, slots, holder)
            runtime.metrics.admitted(slots, 0.0)
        else:
            runs_before = runtime.runs_of(request.id)
            try:
                run_id = self._admit_or_put_back(runtime, request, slots, holder, args, kwargs)
            except _GREEN_KILLS as exc:
                self._give_back_when_killed(runtime, request, runs_before, exc)
        # The body's request is a copy of this one: retry() finds the run there.
        request.caps_run_id = run_id
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if run_id is not None:
                runtime.finish(run_id)
                runtime.release(run_id)

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
        the broker delivers it again.  A put-back copy already published makes a duplicate,
        which the same-task-id rules handle.
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

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, releasing this run's slots before the retry is sent."""
        run_id = getattr(self.request, "caps_run_id", None)
        if run_id is not None:
            runtime_for(self._get_app()).release(run_id)
        return super().retry(*args, **kwargs)

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
        """Celery's, except for admission when sent, with the park strategy and
        ``caps_park_on_publish``: a task whose slots are full right now goes straight to the
        waiting list instead of the broker (it is published once, when a release wakes it,
        not twice); and, with ``caps_admit_on_publish``, a task whose slots have room takes
        them now, as a dispatch lease its worker claims on arrival (it travels with its slots,
        so that the tasks sent after it see them taken and wait in the store)."""
        if self._caps and not REPUBLISHING.get():
            sent = self._admit_when_sent(args, kwargs, task_id, link, link_error, shadow, options)
            if sent.parked is not None:
                return sent.parked
            if sent.dispatch_run_id is not None:
                headers = {**(options.get("headers") or {}), DISPATCH_HEADER: sent.dispatch_run_id}
                options = {**options, "headers": headers}
                task_id = sent.task_id  # the id the slots were taken for
                try:
                    return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)
                except BaseException:
                    self._give_back_sent_slots(sent)
                    raise
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

    def _give_back_sent_slots(self, sent: _Sent) -> None:
        """The task that took its slots when sent was not published: free them for the next waiters."""
        runtime = runtime_for(self._get_app())
        try:
            release_and_wake(runtime, str(sent.dispatch_run_id))
        except StoreError as exc:  # its dispatch lease expires
            logger.warning("%s[%s] not sent: its slots were not given back (%s)", self.name, sent.task_id, exc)

    def _admit_when_sent(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str | None,
        link: Any,
        link_error: Any,
        shadow: str | None,
        options: dict[str, Any],
    ) -> _Sent:
        """Park the task being sent if its slots are full, or take them if they have room
        (``caps_admit_on_publish``); the outcome, or an empty one to send the task as usual."""
        send_as_usual = _Sent(task_id)
        app = self._get_app()
        if app.conf.task_always_eager or options.get("countdown") is not None or options.get("eta") is not None:
            return send_as_usual
        headers = options.get("headers") or {}
        if DISPATCH_HEADER in headers or DEFERRALS_HEADER in headers or STANDBY_HEADER in headers:
            return send_as_usual  # the library's own copies
        try:
            runtime = runtime_for(app)
            parking = runtime.settings.parking
            if not (parking.on_publish and parking.strategy_for(self._caps) == PARK):
                return send_as_usual
            store = runtime.store
            if not store.supports_parking:
                return send_as_usual
            args, kwargs = tuple(args or ()), dict(kwargs or {})
            slots = slots_for(self._caps, args, kwargs)
        except Exception:
            return send_as_usual  # no usable caps settings, or a bad key: the worker reports it
        task_id = task_id or uuid.uuid4().hex
        first_deferred_at = time.time()
        # The message as it would have been sent: Celery's routing and execution options,
        # and the parent of the task sending it (a republish has no such context).
        sent_options = {**self._get_exec_options(), **options, "task_id": task_id}
        sent_options.setdefault("ignore_result", self.ignore_result)
        sent_options["headers"] = {**headers, DEFERRALS_HEADER: 0, FIRST_DEFERRED_HEADER: first_deferred_at}
        parent = app.current_worker_task
        if parent is not None and options.get("add_to_parent", True):
            sent_options.setdefault("root_id", parent.request.root_id or parent.request.id)
            sent_options.setdefault("parent_id", parent.request.id)
        if shadow:
            sent_options["shadow"] = shadow
        for name, value in (("link", link), ("link_error", link_error)):
            if value:
                sent_options[name] = value
        for name in _SEND_ONLY_OPTIONS:
            sent_options.pop(name, None)
        try:
            payload = encode_payload(app, self.signature(args, kwargs, sent_options))
        except Exception as exc:  # an option the serializer cannot carry: send it as usual
            logger.debug("%s[%s] sent to the broker: cannot park its message (%s)", self.name, task_id, exc)
            return send_as_usual
        if len(payload) > parking.max_payload_bytes:
            return send_as_usual
        # Taken when sent (caps_admit_on_publish), the slots are held like a release's dispatch:
        # by the dispatch holder, for caps_dispatch_lease_seconds, until the receiving worker
        # claims them.  Without admit, park takes nothing and the holder is never written.
        run_id = uuid.uuid4().hex
        try:
            outcome = store.park(
                slots, task_id, run_id, DISPATCH_HOLDER, dispatch_lease_seconds(runtime),
                payload=payload, first_deferred_at=first_deferred_at, max_waiters=parking.max_waiters,
                task_name=self.name, admit=parking.admit_on_publish, report_first=_wants_standby(runtime),
            )  # fmt: skip
        except StoreError as exc:
            logger.warning("%s[%s] sent to the broker: could not check its slots (%s)", self.name, task_id, exc)
            return send_as_usual
        if outcome == PARK_ADMITTED:
            logger.debug("%s[%s] took %s when sent", self.name, task_id, ", ".join(slots))
            return _Sent(task_id, dispatch_run_id=run_id)
        if outcome not in (PARK_PARKED, PARK_PARKED_FIRST):
            return _Sent(task_id)  # room, not taken (or the waiting list is full): the broker it is
        logger.debug("%s[%s] parked when sent: %s full", self.name, task_id, ", ".join(slots))
        runtime.metrics.deferred(list(slots), "parked")
        if outcome == PARK_PARKED_FIRST:
            runtime.stand_by_soon(self.name, list(slots))
        return _Sent(task_id, parked=self.AsyncResult(task_id))

    def signature_from_request(
        self,
        request: Any = None,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        queue: Any = None,
        **extra_options: Any,
    ) -> Any:
        """Celery's, except that a task woken into a wake queue is sent on to its own queue
        (by ``retry``, a put-back or parking again), never to the wake queue."""
        request = self.request if request is None else request
        wake_queue = _wake_queue_of(request)
        if queue is None and wake_queue is not None:
            queue = queue_of_wake_queue(wake_queue)
        return super().signature_from_request(request, args, kwargs, queue=queue, **extra_options)

    # -- admission ------------------------------------------------------------------

    def _admit_or_put_back(
        self,
        runtime: CapsRuntime,
        request: Any,
        slots: Mapping[str, int],
        holder: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> str | None:
        """The run id holding ``slots``; or put the task back and raise ``Ignore``."""
        deferrals = int(_header(request, DEFERRALS_HEADER) or 0)
        standby_mark = _header(request, STANDBY_HEADER)
        dispatch_run_id = _header(request, DISPATCH_HEADER)
        if standby_mark:
            dispatch = self._await_standby(runtime, request, str(standby_mark), holder)
            if dispatch.claimed:
                return self._take_handed_over(runtime, request, dispatch.run_id, slots, holder, deferrals)
            dispatch_run_id = dispatch.run_id
        park = parking_for(runtime).strategy_for(self._caps) == PARK and runtime.store.supports_parking
        if dispatch_run_id and (park or standby_mark):
            try:
                claimed = self._claim_dispatch(runtime, request, str(dispatch_run_id), slots, holder, deferrals)
            except StoreError as exc:
                # Its dispatch may still be live, and its entry is still in the waiting list:
                # admitted afresh, it would run once more when that entry is dispatched again.
                # Its copy keeps the dispatch, to claim it on its return.
                self._on_store_error(runtime, request, slots, args, kwargs, exc, str(dispatch_run_id))
                return None  # caps_on_store_error = "run": uncapped
            if claimed is not None:
                runtime.metrics.admitted(slots, _seconds_since_first_deferral(request))
                return claimed
        try:
            admission, run_id = runtime.acquire(slots, request.id, holder, task_name=self.name, deferrals=deferrals)
        except StoreError as exc:
            self._on_store_error(runtime, request, slots, args, kwargs, exc)
            return None  # caps_on_store_error = "run": uncapped
        if not admission.granted and park:
            run_id = self._park(runtime, request, slots, list(admission.full_slots), holder, args, kwargs)
        elif not admission.granted:
            self._put_back(runtime, request, slots, list(admission.full_slots), args, kwargs)
        runtime.metrics.admitted(slots, _seconds_since_first_deferral(request))
        return run_id

    def _on_store_error(
        self,
        runtime: CapsRuntime,
        request: Any,
        slots: Mapping[str, int],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        exc: StoreError,
        dispatch_run_id: str | None = None,
    ) -> None:
        """Admission met a store error: ``caps_on_store_error`` says whether the task runs
        uncapped (returns), fails (raises ``exc``) or is put back (raises ``Ignore``), its copy
        carrying ``dispatch_run_id`` if given."""
        policy = runtime.settings.on_store_error
        if policy == "run":
            logger.warning("%s[%s] runs uncapped: slot store error (%s)", self.name, request.id, exc)
            return
        if policy == "fail":
            raise exc
        logger.warning("%s[%s] put back: slot store error (%s)", self.name, request.id, exc)
        self._put_back(
            runtime, request, slots, list(slots), args, kwargs, reason="store_error", dispatch_run_id=dispatch_run_id
        )

    # -- park and wake (caps_strategy = "park"; see celery_caps.parking) ------------------

    def _await_standby(self, runtime: CapsRuntime, request: Any, mark: str, holder: str) -> StandbyDispatch:
        """A standby copy: wait for a release to dispatch this waiter; or end this copy with
        ``Ignore`` (the waiter waits on in the store's list).

        The wait is ``caps_standby_seconds``, or half the task's time limit if that is shorter
        (a copy killed by its time limit would leave its dispatch to the sweep).
        """
        wait = parking_for(runtime).standby_seconds
        for limit in getattr(request, "timelimit", None) or ():
            if limit:
                wait = min(wait, float(limit) / 2)
        store = runtime.store
        # A store error (a lost connection, an outage, even before this process first reached
        # the store) does not end the standby: its record still names this process, and a
        # release would hand it the slot in this name, so the process waits on, connecting
        # again, until the wait is over.
        deadline = time.monotonic() + wait
        while True:
            try:
                if not store.supports_standby:
                    raise Ignore()
                dispatch = store.await_standby(
                    request.id, mark, max(deadline - time.monotonic(), 0.0), holder, runtime.settings.lease_seconds
                )
                break
            except StoreError as exc:
                if deadline - time.monotonic() <= STANDBY_RETRY_SECONDS:
                    logger.warning("%s[%s]: standby ended by a store error (%s)", self.name, request.id, exc)
                    dispatch = None
                    break
                logger.info("%s[%s]: standby interrupted (%s); waiting on", self.name, request.id, exc)
                time.sleep(STANDBY_RETRY_SECONDS)
        if dispatch is None:
            logger.debug("%s[%s]: standby ended; the task waits on in the store", self.name, request.id)
            raise Ignore()
        return dispatch

    def _take_handed_over(
        self,
        runtime: CapsRuntime,
        request: Any,
        run_id: str,
        slots: Mapping[str, int],
        holder: str,
        deferrals: int,
    ) -> str:
        """A release handed this standby its leases claimed (in this process's name, for a full
        lease): run now, and take the task off the waiting list meanwhile, in the background
        (retried after a store error; should this process die first, the sweep dispatches
        the task again once its dispatch expires: at least once)."""
        runtime.hold(run_id, request.id, slots, holder, self.name, deferrals)
        runtime.metrics.admitted(slots, _seconds_since_first_deferral(request))
        runtime.unlist_handed_over(str(request.id), run_id, self.name)
        return run_id

    def _claim_dispatch(
        self,
        runtime: CapsRuntime,
        request: Any,
        dispatch_run_id: str,
        slots: Mapping[str, int],
        holder: str,
        deferrals: int,
    ) -> str | None:
        """A woken task, or one that took its slots when sent: claim the dispatch leases taken
        for it; None if they expired.  A store error is raised (the caller puts the task back
        with its dispatch).  A copy whose dispatch expired while the task was dispatched again
        (to another run, still live) ends with ``Ignore``: that run's copy runs the task.

        A task that took its slots when sent, with tasks waiting behind it, puts the next of them
        on standby as it starts (in the background): the first hand-over of a burst then goes
        through a standby too.  (A woken task's releaser did that already.)
        """
        claimed = runtime.store.claim_dispatch(request.id, dispatch_run_id, holder, runtime.settings.lease_seconds)
        if claimed.leases == len(slots):
            runtime.hold(dispatch_run_id, request.id, slots, holder, self.name, deferrals)
            if claimed.waiters_behind and _wake_queue_of(request) is None:
                runtime.stand_by_soon(self.name, list(slots))
            return str(dispatch_run_id)
        if claimed.leases:
            # Part of the dispatch expired: give the rest back and be admitted as usual.
            try:
                release_and_wake(runtime, dispatch_run_id)
            except StoreError as exc:
                logger.warning("%s[%s]: could not release a partial dispatch (%s)", self.name, request.id, exc)
        if claimed.dispatched_elsewhere:
            logger.info(
                "%s[%s]: its dispatch %s is gone and the task was dispatched again; this copy ends",
                self.name, request.id, dispatch_run_id,
            )  # fmt: skip
            raise Ignore()
        # The dispatch expired, and the task is not dispatched again: admitted as usual.
        return None

    def _park(
        self,
        runtime: CapsRuntime,
        request: Any,
        slots: Mapping[str, int],
        full_slots: list[str],
        holder: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> str:
        """Park the task in the store's waiting list and end this copy with ``Ignore``; or,
        if room appeared meanwhile, return the run id it was admitted with."""
        settings = runtime.settings
        parking = parking_for(runtime)
        deferrals, first_deferred_at, _waited = self._waiting_so_far(runtime, request, full_slots)
        headers = _republish_headers(request, deferrals, first_deferred_at)
        signature = self.signature_from_request(request, args, kwargs, headers=headers)
        payload = encode_payload(self._get_app(), signature)
        if len(payload) > parking.max_payload_bytes:
            logger.warning(
                "%s[%s] put back with backoff: its message (%d bytes) is over caps_park_max_payload_bytes (%d)",
                self.name, request.id, len(payload), parking.max_payload_bytes,
            )  # fmt: skip
            self._put_back(runtime, request, slots, full_slots, args, kwargs, reason="payload_too_large")
        waiting = {
            "task_name": self.name,
            "slots": list(slots),
            "full_slots": full_slots,
            "reason": "parked",
            "deferrals": deferrals + 1,
            "first_deferred_at": first_deferred_at,
            "next_attempt_at": None,
        }
        # Before parking: a release may wake it, and it may finish, at once.
        self._store_deferred_state(runtime, request, waiting)
        run_id = uuid.uuid4().hex
        try:
            outcome = runtime.store.park(
                slots, request.id, run_id, holder, settings.lease_seconds, payload=payload,
                first_deferred_at=first_deferred_at, max_waiters=parking.max_waiters, task_name=self.name,
                report_first=_wants_standby(runtime),
            )  # fmt: skip
        except StoreError as exc:
            logger.warning("%s[%s] put back: could not park (%s)", self.name, request.id, exc)
            self._put_back(runtime, request, slots, full_slots, args, kwargs, reason="store_error")
        if outcome == PARK_ADMITTED:
            runtime.hold(run_id, request.id, slots, holder, self.name, deferrals)
            return run_id
        if outcome == PARK_LIST_FULL:
            logger.warning(
                "%s[%s] put back with backoff: the waiting list of %s holds caps_park_max_waiters (%d)",
                self.name, request.id, ", ".join(full_slots), parking.max_waiters,
            )  # fmt: skip
            self._put_back(runtime, request, slots, full_slots, args, kwargs, reason="waitlist_full")
        logger.debug("%s[%s] parked: %s full", self.name, request.id, ", ".join(full_slots))
        if outcome == PARK_PARKED_FIRST:
            runtime.stand_by_soon(self.name, list(slots))
        self._end_deferred_copy(runtime, request, waiting)

    def _put_back(
        self,
        runtime: CapsRuntime,
        request: Any,
        slots: Mapping[str, int],
        full_slots: list[str],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        reason: str = "full",
        dispatch_run_id: str | None = None,
    ) -> None:
        """Publish the task again with a countdown, then end this copy with ``Ignore``; the
        copy claims ``dispatch_run_id`` when it comes back, if given."""
        settings = runtime.settings
        deferrals, first_deferred_at, waited = self._waiting_so_far(runtime, request, full_slots)
        countdown = backoff_seconds(deferrals, settings.backoff_min_seconds, settings.backoff_max_seconds)
        if settings.max_wait_seconds is not None:
            # Come back in time to give up at the deadline rather than long after it.
            countdown = min(countdown, max(settings.max_wait_seconds - waited, 0.0) + 0.01)
        headers = _republish_headers(request, deferrals, first_deferred_at)
        headers[COUNTDOWN_HEADER] = countdown
        if dispatch_run_id is not None:
            headers[DISPATCH_HEADER] = dispatch_run_id
        signature = self.signature_from_request(request, args, kwargs, countdown=countdown, headers=headers)
        waiting = {
            "task_name": self.name,
            "slots": list(slots),
            "full_slots": full_slots,
            "reason": reason,
            "deferrals": deferrals + 1,
            "first_deferred_at": first_deferred_at,
            "next_attempt_at": time.time() + countdown,
        }
        # Before publishing: the copy may run and store its final state at once.
        self._store_deferred_state(runtime, request, waiting)
        logger.debug(
            "%s[%s] put back for %.2f s (deferral %d): %s full",
            self.name,
            request.id,
            countdown,
            deferrals + 1,
            ", ".join(full_slots),
        )
        # While the published copy is built, this task must not count as its own
        # parent (Celery would set parent_id to its own id).
        self.push_request(called_directly=True)
        republishing = REPUBLISHING.set(True)
        try:
            signature.apply_async(add_to_parent=False)
        except Exception as exc:
            # Not published: the original must go back to the queue, not be acked.
            raise Reject(exc, requeue=True) from exc
        finally:
            REPUBLISHING.reset(republishing)
            self.pop_request()
        self._end_deferred_copy(runtime, request, waiting)

    def _waiting_so_far(self, runtime: CapsRuntime, request: Any, full_slots: list[str]) -> tuple[int, float, float]:
        """``(deferrals, first deferral time, seconds waited)`` of ``request``.

        Raises:
            CapWaitExceeded: it has waited ``caps_max_wait_seconds`` already.
        """
        deferrals = int(_header(request, DEFERRALS_HEADER) or 0)
        first_deferred_at = float(_header(request, FIRST_DEFERRED_HEADER) or time.time())
        waited = time.time() - first_deferred_at
        max_wait = runtime.settings.max_wait_seconds
        if max_wait is not None and waited >= max_wait:
            raise CapWaitExceeded(self.name, request.id, waited, full_slots)
        return deferrals, first_deferred_at, waited

    def _end_deferred_copy(self, runtime: CapsRuntime, request: Any, waiting: Mapping[str, Any]) -> NoReturn:
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

    def _store_deferred_state(self, runtime: CapsRuntime, request: Any, waiting: Mapping[str, Any]) -> None:
        """Store ``DEFERRED`` with ``waiting`` as meta, when there is a backend and results are kept."""
        if not runtime.settings.deferred_state or _ignores_result(self, request):
            return
        from celery.backends.base import DisabledBackend

        if isinstance(self.backend, DisabledBackend):
            return
        try:
            self.update_state(task_id=request.id, state=DEFERRED_STATE, meta=dict(waiting))
        except Exception as exc:  # the state is information; the task must still go back
            logger.warning("%s[%s]: could not store state %s (%s)", self.name, request.id, DEFERRED_STATE, exc)

    def _admit_waiting(self, runtime: CapsRuntime, task_id: str, slots: Mapping[str, int], holder: str) -> str:
        """For direct calls and ``apply()``: wait in this process until the caps admit."""
        settings = runtime.settings
        started = time.monotonic()
        attempt = 0
        while True:
            admission, run_id = runtime.acquire(slots, task_id, holder, task_name=self.name, deferrals=attempt)
            if admission.granted:
                return run_id
            waited = time.monotonic() - started
            if settings.max_wait_seconds is not None and waited >= settings.max_wait_seconds:
                raise CapWaitExceeded(self.name, task_id, waited, list(admission.full_slots))
            time.sleep(backoff_seconds(attempt, settings.backoff_min_seconds, settings.backoff_max_seconds))
            attempt += 1
