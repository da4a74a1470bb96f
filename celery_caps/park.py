"""Park and wake: the default strategy for a task whose caps are full (``caps_strategy = "park"``).

A task that finds its slots full waits in the store's *waiting list* instead of
going back to the broker, and a release hands the room it frees straight to the
oldest waiter.  This module is the whole protocol, in the order a task lives it;
``docs/park.md`` has its state table (who answers for a task at each step).

1. **Arrival.**  A copy of a task reaches a worker process (:func:`decide`).  A copy
   that carries a dispatch header first *claims* its dispatch (``SlotStore.claim``);
   the store answers RUN, END (someone else answers for the task) or ADMIT.  Then
   admission parks or admits in one atomic step (``SlotStore.park``): the task runs,
   or waits in the list, or ends because it waits there already.
2. **Parked.**  The entry was written before the copy ends (``Ignore``, after which
   Celery acknowledges it): a crash in between leaves both, and the copy that comes
   back finds its entry and ends.
3. **Release and wake.**  A run's release deletes its leases and, in the same store
   transaction, *dispatches* the oldest waiters that fit: their slots are taken
   under a fresh run id (dispatch leases) and their entries marked dispatched with
   a deadline.  Then the releasing process publishes a copy of each, with the run id
   as a header, to the *wake queue* of the queue Celery's router chooses for it
   (``<queue>.caps-wake``, consumed by every worker of that queue), so that it does
   not wait behind its queue's backlog while its slot is reserved.
4. **Claim.**  The copy arrives and claims: its dispatch leases become its run's.
5. **Recovery.**  Every worker's main process calls :func:`recover` every few
   seconds: dispatches whose deadline passed unclaimed (the releaser died, the
   message was lost) go back to waiting and are dispatched again, room freed by
   expired leases (a crashed worker) goes to waiters, and waiters past
   ``caps_max_wait_seconds`` are readmitted (their copies give up in admission).
   Nothing here needs beat.

A copy ends without running only when the store confirms, in the same step, that
someone else answers for its task; headers only say which dispatch a copy claims.
A task dispatched more than once leaves a tombstone when claimed, so that a copy of
an earlier dispatch still on its way (in a prefetch buffer, say) ends rather than
runs it again, unless the broker redelivered it (its run may have died).

Bounds: ``caps_park_max_waiters`` per slot name (a task over it is put back with backoff
instead) and ``caps_park_max_payload_bytes`` per message: a task over it waits in the list
*outside*, its entry without a message, and its message goes back to the broker with a short
countdown until its turn, when it claims its entry's dispatch.  Waiters are
ordered by first-deferral time (then park time); a waiter one of whose slots is
full is passed over, never blocking the ones behind it, so no key starves.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore
from celery.utils import uuid as new_task_id
from celery.utils.time import maybe_make_aware

from . import messages
from .caps import Needs, needs_for
from .errors import CapWaitExceeded, StoreError, StoreInputError, TaskIdInUse
from .handover import dispatch_lease_seconds
from .health import describe
from .messages import DISPATCH_HEADER, encode_payload
from .settings import PARK
from .stores.base import DISPATCH_HOLDER, OUTSIDE_PAYLOAD, ClaimOutcome, ParkingStore, ParkOutcome, ParkRequest

if TYPE_CHECKING:
    from celery import Celery

    from .runtime import CapsRuntime
    from .task import CappedTask

logger = logging.getLogger(__name__)


# -- 1. arrival ---------------------------------------------------------------------


class Verdict(enum.Enum):
    """What :func:`decide` found for an arriving copy."""

    #: Admitted (or its dispatch claimed): run the body under :attr:`Decision.run_id`.
    RUN = "run"
    #: Parked now: the store answers for the task; end this copy.
    PARKED = "parked"
    #: Someone else answers for the task (its entry, a live run, a tombstone); end this copy.
    ANSWERED = "answered"
    #: A slot's waiting list is full: put the copy back with backoff instead.
    LIST_FULL = "waitlist_full"
    #: Its message is over ``caps_park_max_payload_bytes``: it waits in the list without it (an
    #: entry *outside*), and this copy goes back to the broker with a short countdown, to claim
    #: the entry's dispatch when its turn has come.
    OUTSIDE = messages.PAYLOAD_TOO_LARGE
    #: Its slots are full and it has waited ``caps_max_wait_seconds``: it gives up.
    GAVE_UP = "gave_up"
    #: Its task id waits in the list as another task (a reused id): it fails, visibly.
    ID_IN_USE = "id_in_use"


@dataclass(frozen=True)
class Arrival:
    """A copy of a task arriving in the process that would run it."""

    task_id: str
    task_name: str | None
    #: Slot name -> limit.
    slots: Mapping[str, int]
    #: The process that would run it (``"<node>/<pid>"``).
    holder: str
    #: The dispatch this copy carries (its header), if any.
    dispatch_run_id: str | None
    #: The broker delivered this copy before (``delivery_info["redelivered"]``).
    redelivered: bool
    #: When the task was first deferred (epoch seconds): its place in the waiting list.
    first_deferred_at: float
    #: Slot name -> units of its limit the task takes, where more than 1.
    weights: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Slot name -> the task's fair key there (``Cap(fair_by=...)``).
    fair_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    #: The run id holding the slots (RUN only).
    run_id: str | None = None
    #: Whether the run is a claimed dispatch (RUN only).
    claimed: bool = False


def _claim(store: ParkingStore, arrival: Arrival, dispatch_run_id: str, lease_seconds: float) -> Decision | None:
    """Claim ``dispatch_run_id`` for ``arrival``: RUN or ANSWERED; None: go through admission."""
    claimed = store.claim(
        arrival.task_id, dispatch_run_id, arrival.holder, lease_seconds, redelivered=arrival.redelivered
    )
    if claimed is ClaimOutcome.RUN:
        return Decision(Verdict.RUN, dispatch_run_id, claimed=True)
    if claimed is ClaimOutcome.END:
        return Decision(Verdict.ANSWERED)
    return None


def decide(
    store: ParkingStore,
    arrival: Arrival,
    new_run_id: str,
    payload: Callable[[], bytes],
    *,
    lease_seconds: float,
    max_waiters: int,
    max_payload_bytes: int,
    max_wait_seconds: float | None = None,
    now: float | None = None,
    payload_first: bool = False,
) -> Decision:
    """Claim the copy's dispatch, then admit or park it: at most three store calls, one when
    nothing waits.  ``payload`` builds the message to park: called only when the slots are full,
    or, with ``payload_first``, before the first park call, which then parks the task in the same
    call when its slots are full (one call fewer for a task that waits, the message built for one
    that runs).  A task whose slots are full and that was first deferred ``max_wait_seconds`` or
    more before ``now`` (epoch seconds, default the present) gives up instead of parking; it and a
    message over ``max_payload_bytes`` are never parked by the first call.

    Raises:
        StoreError: the store failed; nothing is known of the outcome of the failing call.
    """
    if arrival.dispatch_run_id:
        decision = _claim(store, arrival, arrival.dispatch_run_id, lease_seconds)
        if decision is not None:
            return decision

    waited = (time.time() if now is None else now) - arrival.first_deferred_at
    waited_too_long = max_wait_seconds is not None and waited >= max_wait_seconds
    built: list[bytes] = []

    def message() -> bytes:
        if not built:
            built.append(payload())
        return built[0]

    first_payload = None
    if payload_first and not waited_too_long and len(message()) <= max_payload_bytes:
        first_payload = message()
    request = ParkRequest(
        arrival.slots, arrival.task_id, new_run_id, arrival.holder, lease_seconds, arrival.first_deferred_at,
        max_waiters, arrival.task_name, first_payload, weights=arrival.weights, fair_keys=arrival.fair_keys,
    )  # fmt: skip
    outcome = store.park(request)
    if outcome is ParkOutcome.WAITING:
        # An entry parked outside answers for nothing: it waits for its message, which this is
        # (or a copy of it).  It claims the entry's dispatch, or goes back until its turn.
        entry = store.entry(arrival.task_id)
        if entry is None or not entry.listed or not entry.outside:
            return Decision(Verdict.ANSWERED)
        if entry.dispatch_run_id is None:
            return Decision(Verdict.OUTSIDE)
        decision = _claim(store, dataclasses.replace(arrival, redelivered=False), entry.dispatch_run_id, lease_seconds)
        if decision is not None:
            return decision
        outcome = store.park(request)  # the dispatch had no live leases: its entry left the list
    if outcome is ParkOutcome.FULL:
        if waited_too_long:
            return Decision(Verdict.GAVE_UP)
        if len(message()) > max_payload_bytes:
            # Too large for the store: the task waits in the list all the same, in its place,
            # and this copy is its message, in the broker.
            outcome = store.park(dataclasses.replace(request, payload=OUTSIDE_PAYLOAD))
            if outcome is ParkOutcome.PARKED:
                return Decision(Verdict.OUTSIDE)
        else:
            outcome = store.park(dataclasses.replace(request, payload=message()))
    if outcome is ParkOutcome.ADMITTED:
        return Decision(Verdict.RUN, new_run_id)
    if outcome is ParkOutcome.PARKED:
        return Decision(Verdict.PARKED)
    if outcome is ParkOutcome.WAITING:
        return Decision(Verdict.ANSWERED)
    if outcome is ParkOutcome.LIST_FULL:
        return Decision(Verdict.LIST_FULL)
    if outcome is ParkOutcome.ID_IN_USE:
        return Decision(Verdict.ID_IN_USE)
    raise AssertionError(f"unexpected park outcome {outcome!r}")  # pragma: no cover - the contract's outcomes


# -- 1-2. arrival in a Celery worker: the copy runs, or ends once the store answers for it -----


def admit(
    task: CappedTask,
    runtime: CapsRuntime,
    request: Any,
    needs: Needs,
    holder: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str | None:
    """Park's admission in the process that would run the task: the run id holding the slots it ``needs``;
    or end this copy with ``Ignore`` (parked, or someone else answers for the task), or put it
    back with backoff (it cannot park).  None: it runs uncapped (``caps_on_store_error = "run"``).
    """
    settings = runtime.settings
    parking = settings.parking
    store = runtime.store
    assert isinstance(store, ParkingStore)  # the caller chose park: its store has a waiting list
    deferrals = messages.deferrals_of(request)
    first_deferred_at = messages.first_deferred_at(request) or time.time()
    dispatch = messages.header(request, DISPATCH_HEADER)
    slots = needs.slots
    arrival = Arrival(
        task_id=request.id,
        task_name=task.name,
        slots=needs.slots,
        weights=needs.weights,
        fair_keys=needs.fair_keys,
        holder=holder,
        dispatch_run_id=str(dispatch) if dispatch else None,
        redelivered=bool((getattr(request, "delivery_info", None) or {}).get("redelivered")),
        first_deferred_at=first_deferred_at,
    )
    waiting = {
        "task_name": task.name,
        "slots": list(slots),
        "full_slots": list(slots),
        "reason": "parked",
        "deferrals": deferrals + 1,
        "first_deferred_at": first_deferred_at,
        "next_attempt_at": None,
    }

    def payload() -> bytes:
        headers = messages.republish_headers(request, deferrals, first_deferred_at)
        message = encode_payload(task._get_app(), task.signature_from_request(request, args, kwargs, headers=headers))
        # Before parking: a release may wake it, and it may finish, at once.
        task.store_deferred_state(runtime, request, waiting)
        return message

    # The message goes with the first park call, so that a task that waits parks in one call,
    # unless its wait is stored as DEFERRED first (before its entry: a release may wake it, and it
    # may finish, at once), which only a full slot decides.
    payload_first = not task.keeps_deferred_state(runtime, request)
    run_id = uuid.uuid4().hex
    failures = 0
    while True:
        try:
            decision = decide(
                store, arrival, run_id, payload, lease_seconds=settings.lease_seconds,
                max_waiters=parking.max_waiters, max_payload_bytes=parking.max_payload_bytes,
                max_wait_seconds=settings.max_wait_seconds, payload_first=payload_first,
            )  # fmt: skip
            runtime.health.answered()
            break
        except StoreError as exc:
            if arrival.dispatch_run_id is None:
                # The failing call may have admitted before its reply was lost: that run is
                # released once the store answers again, not a lease later.  A copy put back makes
                # the same decision on its return (none depends on this delivery).
                runtime.retry_release(run_id)
                messages.on_store_error(task, runtime, request, slots, args, kwargs, exc)
                return None
            # A copy carrying a dispatch is decided by its claim, which only this delivery can
            # present (its dispatch, whether the broker redelivered it): a copy put back without
            # them could run a task someone else answers for, and one put back with them could
            # find its own earlier claim and end.  Every step is repeatable by the same process
            # with the same run id, so it waits here and tries again.
            failures += 1
            wait = messages.backoff_seconds(failures, settings.backoff_min_seconds, settings.backoff_max_seconds)
            log = logger.warning if failures == 1 else logger.debug
            log(
                "%s[%s]: claiming its dispatch failed (%s); trying again in %.1f s",
                task.name, request.id, describe(exc), wait,
            )  # fmt: skip
            time.sleep(wait)
    if deferrals == 0 and messages.first_deferred_at(request) is not None and decision.verdict in (
        Verdict.RUN, Verdict.PARKED,
    ):  # fmt: skip
        # Parked when sent: its wait is recorded here, where history is kept (a copy that ends
        # because another answers for the task records nothing).
        runtime.parked_when_sent(request.id, task.name, list(slots), holder, first_deferred_at)
    if decision.verdict is Verdict.RUN:
        assert decision.run_id is not None
        runtime.hold(decision.run_id, request.id, slots, holder, task.name, deferrals)
        runtime.metrics.admitted(slots, messages.seconds_waited(request))
        return decision.run_id
    if decision.verdict is Verdict.PARKED:
        # Once per wait (Celery's own line for this copy says only "ignored").
        logger.info(
            "%s[%s] waits for a free slot of %s, in the waiting list (its place: celery caps explain %s)",
            task.name, request.id, ", ".join(slots), request.id,
        )  # fmt: skip
        task.end_deferred_copy(runtime, request, waiting)
    if decision.verdict is Verdict.ANSWERED:
        if arrival.dispatch_run_id or arrival.redelivered:
            # A copy of an earlier dispatch, or one the broker delivered again: expected after
            # a slow hand-over or a warm shutdown.
            logger.info(
                "%s[%s]: the store answers for this task already (it waits, or another copy claimed it); "
                "this copy ends", task.name, request.id,
            )  # fmt: skip
        else:
            logger.warning(
                "%s[%s]: this task id waits for its caps already, so this copy ends; if it was sent again "
                "with the same task id on purpose, send it with an id of its own", task.name, request.id,
            )  # fmt: skip
        raise Ignore()
    if decision.verdict is Verdict.ID_IN_USE:
        raise TaskIdInUse(task.name, request.id, list(slots))
    if decision.verdict is Verdict.GAVE_UP:
        raise CapWaitExceeded(task.name, request.id, time.time() - first_deferred_at, list(slots))
    if decision.verdict is Verdict.OUTSIDE:
        # Back before its entry's dispatch would pass its deadline.
        countdown = dispatch_lease_seconds(runtime) / 3
        messages.put_back(
            task, runtime, request, slots, list(slots), args, kwargs, reason=decision.verdict.value,
            max_countdown=countdown,
        )  # fmt: skip
    logger.warning(
        "%s[%s] put back with backoff: the waiting list of %s holds caps_park_max_waiters (%d)",
        task.name, request.id, ", ".join(slots), parking.max_waiters,
    )  # fmt: skip
    messages.put_back(task, runtime, request, slots, list(slots), args, kwargs, reason=decision.verdict.value)


@dataclass(frozen=True)
class Sent:
    """What admission when sent decided for a task being sent (both None: send it as usual)."""

    task_id: str | None
    #: The task waits in the store: the result to return instead of sending it.
    parked: Any = None
    #: The task took its slots: the run id of its dispatch leases, for its message's header.
    dispatch_run_id: str | None = None


#: ``apply_async`` options about how to send, not part of the message: never parked.
_SEND_ONLY_OPTIONS = ("producer", "connection", "router", "publisher", "result_cls", "add_to_parent", "retry_policy")


def _absolute_expiry(app: Celery, expires: Any) -> Any:
    """``expires`` as the absolute ISO time Celery would put in the message when sent now: a
    parked message must not restart a relative expiry's clock when it is published later."""
    if isinstance(expires, bool) or not isinstance(expires, (int, float, datetime)):
        return expires
    if isinstance(expires, datetime):
        return maybe_make_aware(expires).isoformat()
    return maybe_make_aware(app.now() + timedelta(seconds=float(expires))).isoformat()


def admit_when_sent(
    task: CappedTask,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str | None,
    link: Any,
    link_error: Any,
    shadow: str | None,
    options: dict[str, Any],
) -> Sent:
    """``caps_park_on_publish``: park the task being sent if its slots are full, or take them if
    they have room; the outcome, or an empty one to send it as usual.

    The trade-off: a store call on the sender's path (its latency, its connection, its outage:
    the task is then sent as usual) against one broker message less for a task that waits, and
    a burst whose first tasks take their slots as they are sent (the next ones see them taken)."""
    from .runtime import runtime_for

    send_as_usual = Sent(task_id)
    app = task._get_app()
    if app.conf.task_always_eager or options.get("countdown") is not None or options.get("eta") is not None:
        return send_as_usual
    headers = options.get("headers") or {}
    if DISPATCH_HEADER in headers or messages.DEFERRALS_HEADER in headers:
        return send_as_usual  # the library's own copies
    try:
        runtime = runtime_for(app)
        parking = runtime.settings.parking
        if not (parking.on_publish and parking.strategy_for(task._caps) == PARK):
            return send_as_usual
        store = runtime.store
        if not isinstance(store, ParkingStore):
            return send_as_usual
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        needs = needs_for(task._caps, args, kwargs)
        slots = needs.slots
    except Exception:
        return send_as_usual  # no usable caps settings, or a bad key: the worker reports it
    # From here on the task is sent under this id whatever happens, as the logs below name it.
    task_id = task_id or new_task_id()
    send_as_usual = Sent(task_id)
    first_deferred_at = time.time()
    # The message as it would have been sent: Celery's routing and execution options,
    # and the parent of the task sending it (a republish has no such context).
    sent_options = {**task._get_exec_options(), **options, "task_id": task_id}
    sent_options.setdefault("ignore_result", task.ignore_result)
    if sent_options.get("expires") is not None:
        sent_options["expires"] = _absolute_expiry(app, sent_options["expires"])
    sent_options["headers"] = {
        **headers, messages.DEFERRALS_HEADER: 0, messages.FIRST_DEFERRED_HEADER: first_deferred_at
    }  # fmt: skip
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
        payload = encode_payload(app, task.signature(args, kwargs, sent_options))
    except Exception as exc:  # an option the serializer cannot carry: send it as usual
        logger.debug("%s[%s] sent to the broker: cannot park its message (%s)", task.name, task_id, exc)
        return send_as_usual
    if len(payload) > parking.max_payload_bytes:
        return send_as_usual
    # Taken when sent, the slots are held like a release's dispatch:
    # by the dispatch holder, for the dispatch lease, until the receiving worker claims them.
    run_id = uuid.uuid4().hex
    try:
        outcome = store.park(
            ParkRequest(
                slots, task_id, run_id, DISPATCH_HOLDER, dispatch_lease_seconds(runtime), first_deferred_at,
                parking.max_waiters, task.name, payload, needs.weights, needs.fair_keys,
            )
        )  # fmt: skip
    except StoreInputError:
        return send_as_usual  # a bad key or id: the worker reports it, failing the task
    except StoreError as exc:
        logger.warning("%s[%s] sent to the broker: could not check its slots (%s)", task.name, task_id, describe(exc))
        return send_as_usual
    if outcome is ParkOutcome.ADMITTED:
        logger.debug("%s[%s] took %s when sent", task.name, task_id, ", ".join(slots))
        return Sent(task_id, dispatch_run_id=run_id)
    if outcome is not ParkOutcome.PARKED:
        return send_as_usual  # room, not taken (or the waiting list is full): the broker it is
    logger.debug("%s[%s] parked when sent: %s full", task.name, task_id, ", ".join(slots))
    runtime.metrics.deferred(list(slots), "parked")
    return Sent(task_id, parked=task.AsyncResult(task_id))
