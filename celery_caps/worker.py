"""Worker wiring: Celery's signals and bootsteps for capped tasks.

Each pool process gets its :class:`~celery_caps.runtime.CapsRuntime` (warmed up when it
starts, closed when it exits).  The worker's main process never blocks its event loop on the
store: releases it must do itself (a child killed by a hard time limit,
``revoke(terminate=True)``, a lost child, a revoked parked task discarded on arrival) go to the
runtime's background thread.  With the park strategy in use, every worker consumes the wake
queues of its queues (:class:`CapsWakeQueues`) and its main process runs :class:`Recovery`,
which keeps waiters moving when no release does (see :mod:`celery_caps.park`).
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery import bootsteps, signals, states
from celery.worker.request import Request
from celery.worker.strategy import default as default_strategy

from . import handover
from .errors import ConfigurationError, StoreError
from .health import CheckResult, check_store
from .messages import DISPATCH_HEADER
from .settings import CapsSettings
from .stores import store_from_url
from .stores.base import ParkingStore
from .sweep import SWEEP_SCHEDULE_NAME, SWEEP_TASK_NAME, sweep_store

if TYPE_CHECKING:
    from celery import Celery

from .runtime import CapsRuntime, existing_runtime, holder_name, runtime_for

logger = logging.getLogger(__name__)


def _is_capped(task: Any) -> bool:
    return bool(getattr(task, "_caps", ()))


def tasks_capped_without_base(app: Celery) -> list[str]:
    """The names of ``app``'s tasks declared with ``cap=`` but not ``base=CappedTask``.

    Celery keeps an option it does not know as a class attribute of the task: such a task
    has a ``cap`` holding :class:`~celery_caps.Cap` objects and runs uncapped.
    """
    from .caps import Cap

    found = []
    for name, task in sorted(app.tasks.items()):
        if hasattr(task, "_caps"):  # a CappedTask (whose class holds its normalised caps)
            continue
        value = getattr(task, "cap", None)
        values = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
        if any(isinstance(item, Cap) for item in values):
            found.append(name)
    return found


def refuse_tasks_capped_without_base(app: Celery) -> None:
    """Raise :class:`ConfigurationError` naming every task of ``app`` that declares ``cap=``
    without ``base=CappedTask`` (it would run uncapped, silently)."""
    names = tasks_capped_without_base(app)
    if names:
        raise ConfigurationError(
            f"task(s) {', '.join(names)} declare cap= without base=CappedTask, so Celery would run them "
            "uncapped. Declare them as @app.task(base=CappedTask, cap=...) "
            "(from celery_caps import CappedTask), or remove cap="
        )


def _release_dead_run(request: Request, reason: str) -> None:
    """From the main process: release what a child held for ``request`` before it died."""
    task = request.task
    if not _is_capped(task) or request.worker_pid is None:
        return
    holder = holder_name(request.hostname, request.worker_pid)
    task_id = request.id
    runtime = runtime_for(task.app)
    runtime.in_background(
        f"releasing {task_id} after {reason}", lambda: handover.release_holder(runtime, task_id, holder)
    )


def capped_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., None]:
    """The message handler of a capped task in the worker: Celery's default, then a woken copy
    that waits for a free pool process goes ahead of the arrivals waiting there
    (``CappedTask.Strategy``).

    A woken copy's slots are reserved for it from its dispatch on.  Behind a prefetch buffer of
    new arrivals (Celery's default prefetch takes four per pool process), each of which may only
    park, they would stay reserved and unused.
    """
    handle = default_strategy(task, app, consumer, **kwargs)

    def handle_message(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **options: Any) -> None:
        handle(message, body, ack, reject, callbacks, **options)
        headers = getattr(message, "headers", None) or {}
        if headers.get(DISPATCH_HEADER):
            _ahead_of_arrivals(consumer, headers.get("id"))

    return handle_message


def _ahead_of_arrivals(consumer: Any, task_id: str | None) -> None:
    """Move the request of ``task_id``, just handed on, before the requests that wait for a free
    pool process, behind the woken copies that wait there already.

    A request waits in the worker's semaphore (prefork, Celery's default ``pool_putlocks``: its
    waiters are ``(callback, (request,), kwargs)``), or in prefork's own buffer without it (its
    jobs carry the task id as ``correlation_id``); last, as it was just handed on.  Other pools
    take a request when they have room, and a request held for its ETA is not handed on yet:
    either way nothing moves.
    """
    semaphore = getattr(getattr(consumer, "controller", None), "semaphore", None)
    _move_ahead(getattr(semaphore, "_waiting", None), task_id, lambda waiter: (waiter[1] or (None,))[0])
    buffer = getattr(getattr(getattr(consumer, "pool", None), "_pool", None), "outbound_buffer", None)
    _move_ahead(buffer, task_id, lambda job: job)


def _move_ahead(waiting: Any, task_id: str | None, holder_of: Callable[[Any], Any]) -> None:
    """Move the last of ``waiting`` (a deque), if it holds ``task_id``, behind the woken copies
    at its head; ``holder_of`` gives what an item holds: a request (its ``id``) or a job (its
    ``correlation_id``), marked once woken."""
    if not waiting or task_id is None:
        return
    last = holder_of(waiting[-1])
    if task_id not in (getattr(last, "id", None), getattr(last, "correlation_id", None)):
        return
    item = waiting.pop()
    place = 0
    for queued in waiting:
        if not getattr(holder_of(queued), _WOKEN_MARK, False):
            break
        place += 1
    setattr(last, _WOKEN_MARK, True)
    waiting.insert(place, item)


#: The attribute that marks a woken copy's request or job where it waits (see _move_ahead).
_WOKEN_MARK = "caps_woken"


class CappedRequest(Request):  # type: ignore[misc]
    """Main-process request hooks: release the leases of a child that was killed; bound the
    wait of a put-back copy whose ETA was computed by a clock ahead of this worker's."""

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        # Celery turns a countdown into an absolute ETA by the publisher's clock: a copy put
        # back by a worker an hour ahead would wait an hour here.  Wait at most the countdown.
        countdown = self._request_dict.get("caps_countdown")
        eta: datetime | None = self.eta
        if eta is not None and isinstance(countdown, (int, float)):
            latest = datetime.now(timezone.utc) + timedelta(seconds=float(countdown))
            if eta > latest:
                self._eta = latest

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            # The child is SIGKILLed; it cannot release its own leases.
            _release_dead_run(self, "hard time limit")

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        try:
            super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            exc = getattr(exc_info.exception, "exc", exc_info.exception)
            if isinstance(exc, (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit)):
                _release_dead_run(self, type(exc).__name__)


class CapsWakeQueues(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consume the wake queue of every task queue this worker consumes
    (:data:`~celery_caps.messages.WAKE_QUEUE_SUFFIX`), also of queues added later by the
    ``add_consumer`` control command: a woken task, its slot already taken for it,
    overtakes its queue's backlog.  A wake queue is dropped with its queue.  Consumed whatever
    strategy the app chooses now: tasks parked before a switch to backoff are still woken."""

    label = "celery-caps wake queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)
        # Whatever tasks it knows now: tasks registered later (``reload()``) park too.
        self.enabled = _caps_configured(consumer.app)

    def start(self, consumer: Any) -> None:
        from .messages import is_wake_queue, wake_queue, wake_queue_name

        queues = consumer.app.amqp.queues
        task_consumer = consumer.task_consumer
        for queue in list(task_consumer.queues):
            if not is_wake_queue(queue.name):
                name = wake_queue_name(queue.name)
                if name not in queues:
                    queues.add(wake_queue(name))
                # Added to the task consumer, never consumed from here: the worker's event loop
                # consumes every queue of it once its message handler is set.  (Celery's
                # add_task_queue consumes at once: a message delivered while a later declaration
                # waits for its reply, before that handler is set, stops the worker with
                # "Consumer does not have any callbacks", as seen after a broker reconnection.)
                wake = queues.select_add(queues[name])
                if not task_consumer.consuming_from(name):
                    task_consumer.add_queue(wake)
        if getattr(consumer, "_caps_wake_queues", False):
            return
        consumer._caps_wake_queues = True
        add_task_queue, cancel_task_queue = consumer.add_task_queue, consumer.cancel_task_queue

        def add_with_wake_queue(queue: str, *args: Any, **options: Any) -> None:
            add_task_queue(queue, *args, **options)
            if not is_wake_queue(queue):
                name = wake_queue_name(queue)
                if name not in queues:
                    queues.add(wake_queue(name))
                add_task_queue(name)

        def cancel_with_wake_queue(queue: str) -> None:
            cancel_task_queue(queue)
            if not is_wake_queue(queue) and consumer.task_consumer.consuming_from(wake_queue_name(queue)):
                cancel_task_queue(wake_queue_name(queue))

        consumer.add_task_queue = add_with_wake_queue
        consumer.cancel_task_queue = cancel_with_wake_queue


def _caps_configured(app: Celery) -> bool:
    try:
        return CapsSettings.from_conf(app.conf).url not in (None, "")
    except Exception:  # a bad setting is reported by CapsWorkerStep, which stops the worker
        return False


#: Seconds between two recovery calls of a worker's main process (each call spread by up to
#: a fifth, so that a fleet's workers do not all call at once).
RECOVERY_SECONDS = 2.0


class Recovery(threading.Thread):
    """Main process, with a store that keeps a waiting list (whatever the strategy): every
    :data:`RECOVERY_SECONDS`, one store call that keeps waiters moving when no release does
    (:func:`celery_caps.handover.recover`): dispatches never claimed are dispatched again, room
    freed by expired leases (or by a raised limit) goes to waiters, waiters past
    ``caps_max_wait_seconds`` are readmitted.  Every worker runs one; several at once are safe.
    A store outage is reported by the runtime's :class:`~celery_caps.health.StoreHealth`: when
    it starts, at most once a minute while it lasts, and when it ends."""

    def __init__(self, runtime: CapsRuntime) -> None:
        super().__init__(name="celery-caps-recovery", daemon=True)
        self.runtime = runtime
        self._stopped = threading.Event()
        # A generator of its own: a background thread drawing from the global one would change
        # the sequence the process's own code sees (a seeded program, hypothesis's examples).
        self._jitter = random.Random()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(RECOVERY_SECONDS * self._jitter.uniform(0.8, 1.2)):
            self.tick()

    def tick(self) -> None:
        try:
            published = handover.recover(self.runtime)
        except StoreError as exc:
            self.runtime.health.failed(exc)
            return
        except Exception:  # keep recovering whatever happens
            logger.exception("celery-caps recovery crashed; trying again in %.0f s", RECOVERY_SECONDS)
            return
        self.runtime.health.answered()
        if published:
            logger.info("celery-caps recovery: dispatched %d waiting task(s)", len(published))


#: Seconds between two checks of a slot store that could not be used when the worker started.
STORE_CHECK_SECONDS = 5.0


class StoreCheck(threading.Thread):
    """Main process, at start: connect to the slot store (and create its schema, as the first
    task would) until it answers once, every :data:`STORE_CHECK_SECONDS`.  A worker whose store
    is wrong or away still starts; the runtime's :class:`~celery_caps.health.StoreHealth` warns
    (the store, its cause), reminds while it lasts, and says when the store answers."""

    def __init__(self, runtime: CapsRuntime) -> None:
        super().__init__(name="celery-caps-store-check", daemon=True)
        self.runtime = runtime
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while True:
            try:
                self.check()
            except StoreError as exc:
                self.runtime.health.failed(exc)
            except Exception:  # a bug here must not stop the worker
                logger.exception("celery-caps: checking the slot store crashed")
                return
            else:
                self.runtime.health.answered()
                return
            if self._stopped.wait(STORE_CHECK_SECONDS):
                return

    def check(self) -> None:
        """One check (:func:`~celery_caps.health.check_store`: a round trip of admission and
        release on a scratch slot, and what would break the store under load): from
        ``caps_url`` as a URL, on a store of its own, closed after (the main process keeps no
        connection for it); from a ready engine, client or store, on the runtime's store, which
        resets the connections a forked pool process inherits."""
        settings = self.runtime.settings
        url = settings.require_url()
        holder = f"celery-caps-check/{holder_name(None, None)}"
        if not isinstance(url, str):
            self.report(check_store(self.runtime.store, holder, settings.lease_seconds))
            return
        store = store_from_url(url, settings.store_options)
        try:
            self.report(check_store(store, holder, settings.lease_seconds))
        finally:
            store.close()

    @staticmethod
    def report(result: CheckResult) -> None:
        logger.info(
            "celery-caps: the slot store %s works (a scratch slot taken, refused to a second run and given back "
            "in %.0f ms%s)",
            result.store,
            result.seconds * 1000,
            f"; transactions at {result.isolation}" if result.isolation else "",
        )
        for warning in result.warnings:
            logger.error("celery-caps: %s", warning)


#: Seconds a stopping worker waits for its threads to end: long enough for a store call under
#: way (a connection timeout, when the store is away), short enough that a stuck call cannot
#: hold up the shutdown.
THREAD_JOIN_SECONDS = 10.0


class CapsWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Refuses to start a worker whose app has capped tasks but no usable caps settings, or
    tasks given ``cap=`` without ``base=CappedTask``, or a store on a Redis that may evict its
    keys (``maxmemory-policy allkeys-*``); checks the store (:class:`StoreCheck`);
    serves the metrics endpoint (``caps_metrics_port``, ``--caps-metrics-port``); runs
    :class:`Recovery` when the store keeps a waiting list."""

    label = "celery-caps"
    # Started once the pool has forked its processes: a thread of this process that is inside a
    # store call when a process forks leaves it a copy of the call's locks (SQLite keeps the
    # locks of every connection of a process in memory: a child forked mid-transaction waits
    # for a lock nobody will release).
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, caps_metrics_port: int | None = None, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self._metrics_server: Any = None
        self._recovery: Recovery | None = None
        self._store_check: StoreCheck | None = None
        #: The store keeps a waiting list: this worker recovers its waiters, whatever the strategy.
        self._serves_waiters = False
        try:
            self._check_and_prepare(worker, caps_metrics_port)
        except ConfigurationError as refusal:
            # One clear line on stderr (exit status 1), not the last line of a traceback.
            raise SystemExit(f"celery-caps: the worker cannot start: {refusal}") from None

    def _check_and_prepare(self, worker: Any, caps_metrics_port: int | None) -> None:
        """Refuse what must not run (``ConfigurationError``); check the store and set up the rest."""
        app = worker.app
        refuse_tasks_capped_without_base(app)
        capped = sorted(name for name, task in app.tasks.items() if _is_capped(task))
        if not capped:
            return
        if caps_metrics_port is not None:
            # Before any runtime reads the settings, and before the pool forks.
            app.conf.caps_metrics_port = caps_metrics_port
        settings = CapsSettings.from_conf(app.conf)  # raises ConfigurationError on a bad setting
        url = settings.require_url()
        store = store_from_url(url, settings.store_options)
        display = getattr(store, "display_url", type(store).__name__)
        handover.check_store(app, store)
        _refuse_evicting_server(store)
        from .stores.memory import MemoryStore

        if isinstance(store, MemoryStore):
            logger.warning(
                "celery-caps: caps_url is memory://, which caps each worker process on its own: "
                "prefork children and other workers do not share it. Use a SQL or Redis store for a fleet."
            )
        logger.info(
            "celery-caps: %d capped task(s) use the slot store %s, as deployment %s%s",
            len(capped), display, settings.deployment,
            "" if app.conf.get("caps_deployment") else " (from broker_url; set caps_deployment to name it)",
        )  # fmt: skip
        if settings.parking.uses_park and isinstance(store, ParkingStore):
            try:
                durability = store.durability_warning()
            except StoreError:  # the store check reports it once the worker starts
                durability = None
            if durability:
                logger.warning("celery-caps: parked tasks can be lost: %s", durability)
        self._serves_waiters = isinstance(store, ParkingStore)
        store.close()
        if settings.metrics_port is not None:
            from . import metrics

            # Pool processes inherit the directory; it must be set before prometheus_client loads.
            metrics.prepare_multiprocess_dir()
            metrics.metrics_for(settings.metrics_port)  # fails now if prometheus-client is missing
        # Task events (-E) are known here; pool processes inherit the flag.
        runtime_for(app).send_events = bool(getattr(worker, "task_events", False))

    def start(self, worker: Any) -> None:
        runtime = existing_runtime(worker.app)
        if runtime is None:
            return
        self._store_check = StoreCheck(runtime)
        self._store_check.start()
        if self._serves_waiters:
            self._recovery = Recovery(runtime)
            self._recovery.start()
        if runtime.settings.metrics_port is None:
            return
        from . import metrics

        settings = runtime.settings
        app = worker.app
        self._metrics_server = metrics.serve(
            settings.metrics_port,  # type: ignore[arg-type]
            settings.metrics_address,
            lambda: runtime.store,
            settings.key_warning_threshold,
            caps=lambda: caps_of(app),
        )

    def stop(self, worker: Any) -> None:
        """Stop this step's threads and wait for them to end (a store call under way ends first)."""
        threads = [thread for thread in (self._store_check, self._recovery) if thread is not None]
        for thread in threads:
            thread.stop()
        for thread in threads:
            thread.join(THREAD_JOIN_SECONDS)
        self._store_check = self._recovery = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    def terminate(self, worker: Any) -> None:
        # A cold shutdown terminates the steps instead of stopping them, and Celery's embedded
        # worker (start_worker, the celery_worker fixture) always ends with one.
        # StartStopStep.terminate stops only a step's ``obj``, which this step has none of.
        self.stop(worker)


def _refuse_evicting_server(store: Any) -> None:
    """Raise :class:`ConfigurationError` if the store's server may evict its keys (a Redis with
    ``maxmemory-policy allkeys-*``, unless ``caps_redis_allow_eviction``); its warnings are
    reported by the store check (:class:`StoreCheck`), and an unreachable store too."""
    check_eviction = getattr(store, "check_eviction", None)  # the Redis store's
    if check_eviction is None:
        return
    try:
        check_eviction()
    except StoreError:
        return
    except ConfigurationError:
        store.close()
        raise


def caps_of(app: Celery) -> set[str]:
    """The names of the caps ``app``'s registered tasks declare."""
    return {cap.name for task in list(app.tasks.values()) for cap in getattr(task, "_caps", ())}


#: Set on an app once :func:`install` has run.
_INSTALLED_ATTRIBUTE = "_celery_caps_installed"


def install(app: Celery) -> None:
    """Give ``app`` what its capped tasks need: the worker's steps (its checks at start, the
    wake queues, recovery) and the sweep task with, once configured, its beat entry.
    Idempotent; called when a capped task is bound to ``app`` and when a worker of it starts."""
    if getattr(app, _INSTALLED_ATTRIBUTE, False):
        return
    setattr(app, _INSTALLED_ATTRIBUTE, True)
    app.steps["worker"].add(CapsWorkerStep)
    app.steps["consumer"].add(CapsWakeQueues)

    @app.task(name=SWEEP_TASK_NAME, shared=False, ignore_result=True)  # type: ignore[untyped-decorator]
    def sweep() -> int:
        """Delete expired slot leases (keeps sentinels); returns how many were deleted."""
        runtime = runtime_for(app)
        return sweep_store(runtime.store, runtime.settings.key_warning_threshold)

    def add_beat_entry(sender: Any = None, **_: Any) -> None:
        interval = CapsSettings.from_conf(app.conf).sweep_interval_seconds
        if interval is not None and SWEEP_SCHEDULE_NAME not in (app.conf.beat_schedule or {}):
            app.add_periodic_task(interval, sweep.s(), name=SWEEP_SCHEDULE_NAME)

    if app.configured:
        add_beat_entry()
    else:
        app.on_after_configure.connect(add_beat_entry, weak=False)


@signals.worker_init.connect  # type: ignore[untyped-decorator]
def _install_on_worker_init(sender: Any = None, **_: Any) -> None:
    # Before the worker builds its steps: an app with caps configured gets them (the wake queues
    # of every queue it consumes, the checks at start) whatever tasks it has registered yet, so
    # that tasks registered later (Celery's test worker and its reload()) park and wake too.
    # An app with a task given cap= without base=CappedTask gets them too: their check refuses
    # to start the worker (an exception raised here would only be logged).  The worker has
    # imported its task modules and finalized the app by now.
    app = getattr(sender, "app", None)
    if app is not None and (app.conf.get("caps_url") not in (None, "") or tasks_capped_without_base(app)):
        install(app)


@signals.worker_process_init.connect  # type: ignore[untyped-decorator]
def _warm_up_on_process_init(**_: Any) -> None:
    # A pool process (prefork child, or the solo worker) has just started: connect to the store
    # and check its schema now, in a thread (this signal must return within seconds), rather
    # than in the first capped task it runs, which would start tens of milliseconds late.
    from celery import current_app

    app = current_app._get_current_object()
    if not any(_is_capped(task) for task in app.tasks.values()):
        return
    runtime = runtime_for(app)
    threading.Thread(target=runtime.warm_up, name="celery-caps-warm-up", daemon=True).start()


@signals.worker_process_shutdown.connect  # type: ignore[untyped-decorator]
def _release_on_process_shutdown(**_: Any) -> None:
    from celery import current_app

    runtime = existing_runtime(current_app)
    if runtime is not None and (runtime.held_runs() or runtime.history is not None):
        runtime.release_all()  # also writes what is left of the history
    if runtime is not None and runtime.metrics.enabled:
        from .metrics import mark_process_dead

        mark_process_dead(os.getpid())


#: The states of a copy that ended without running its body by raising ``Ignore`` or ``Reject``
#: (a put-back, a park, a copy the store answers for).
_ENDED_UNRUN_STATES = frozenset({states.IGNORED, states.REJECTED})


@signals.task_postrun.connect  # type: ignore[untyped-decorator]
def _free_ended_copy(
    sender: Any = None, state: str | None = None, retval: Any = None, task: Any = None, **_: Any
) -> None:
    # Pool process.  Celery's tracer keeps the exception that ended a copy (its result) in a
    # local of its own frame, and the exception's traceback points back at that frame: a
    # reference cycle holding the picklable copy of the traceback Celery builds for each
    # Ignore (on Python 3.11+ a copy of every instruction position of every frame's code,
    # hundreds of kilobytes per copy ended).  Only the cyclic garbage collector frees it, and
    # under saturation (a copy ended per task) its oldest generation fills with hundreds of
    # megabytes before it runs.  Dropping the traceback once Celery has used it lets the
    # tracer's frame go when it returns.  Eager calls keep theirs: their caller gets the exception.
    task = task or sender
    if state not in _ENDED_UNRUN_STATES or not isinstance(retval, BaseException) or not _is_capped(task):
        return
    if getattr(task.request, "is_eager", False):
        return
    retval.__traceback__ = None


@signals.task_revoked.connect  # type: ignore[untyped-decorator]
def _release_on_revoke(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    # Main process.  revoke(terminate=True): every lease of the task id goes, whatever run holds
    # it.  Any revoke (or an expired message) discarded here: the task also leaves the waiting
    # list and its dispatch leases go to the next waiters, or recovery would dispatch it again
    # and again, each copy discarded like this one.
    if not _is_capped(sender) or request is None:
        return
    runtime = runtime_for(sender.app)
    task_id = request.id

    def release_revoked() -> int:
        released = handover.release_task(runtime, task_id) if terminated else 0
        return released + handover.forget(runtime, task_id)

    runtime.in_background(f"releasing revoked task {task_id}", release_revoked)


@signals.worker_shutdown.connect  # type: ignore[untyped-decorator]
def _release_on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    # A cold shutdown leaves running tasks behind (redelivered with acks_late):
    # free their slots now rather than after the lease window.
    from celery.worker import state

    app = getattr(sender, "app", None)
    runtime = existing_runtime(app)
    requests = [request for request in list(state.active_requests) if _is_capped(request.task)]
    if runtime is None and not requests:
        return
    if requests:
        runtime = runtime or runtime_for(requests[0].task.app)
        for request in requests:
            if request.worker_pid is None:
                continue
            try:
                handover.release_holder(runtime, request.id, holder_name(request.hostname, request.worker_pid))
            except StoreError as exc:
                logger.warning("could not release %s at shutdown (%s)", request.id, exc)
    if runtime is not None:
        runtime.release_all()
        runtime.close()
