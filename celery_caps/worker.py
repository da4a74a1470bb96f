"""Worker wiring: the per-process runtime, the lease keeper, and Celery's signals.

Each process that runs capped tasks (a prefork child, a threads/solo worker, a
gevent worker, or a process calling tasks eagerly) has one :class:`CapsRuntime`
per app.  It owns the store connection, remembers which runs this process holds,
and runs a :class:`LeaseKeeper` thread that renews all of them in one store call
per tick, long before they expire.

The worker's main process never blocks its event loop on the store: releases it
must do itself (a child killed by a hard time limit, ``revoke(terminate=True)``,
a lost child, a revoked parked task discarded on arrival) go to a small
background thread.  With the park strategy in use, every release hands the freed
slots to waiting tasks, and the main process runs :class:`Recovery`, which keeps
waiters moving when no release does (see :mod:`celery_caps.park`).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery import bootsteps, signals
from celery.worker.request import Request

from . import park
from .errors import ConfigurationError, LeaseLost, StoreError
from .health import StoreHealth, describe
from .history import HistoryRecorder
from .metrics import metrics_for
from .settings import CapsSettings
from .stores import store_from_url
from .stores.base import Admission, HistoryEvent, ParkingStore, SlotStore
from .stores.base import green_threads as _green_threads

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

_RUNTIME_ATTRIBUTE = "_celery_caps_runtime"
#: Seconds between retries of releases that failed (store unreachable).
UNRELEASED_RETRY_SECONDS = 1.0


def _set_async_exception(thread_id: int, exception: type[BaseException] | None) -> bool:
    """Raise ``exception`` in thread ``thread_id`` at its next Python instruction (None cancels)."""
    import ctypes

    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception is not None else None
    )
    return bool(done == 1)


def holder_name(node_name: str | None, pid: int | None) -> str:
    """``"<node>/<pid>"``: who holds a lease, the same string in a child and its supervisor."""
    return f"{node_name or socket.gethostname()}/{pid if pid is not None else os.getpid()}"


@dataclass
class HeldRun:
    """A run this process holds leases for."""

    task_id: str
    slot_count: int
    slots: tuple[str, ...] = ()
    task_name: str | None = None
    holder: str = ""
    #: When it was admitted (epoch seconds, this process's clock).
    started_at: float = 0.0
    #: How many times the task had been put back before this run.
    deferrals: int = 0
    #: A lease of the run expired or was released under it (reported once).
    lost: bool = False
    #: The thread running the task, where ``caps_on_lease_lost="stop"`` raises :class:`LeaseLost`.
    thread_id: int | None = None
    #: The body has ended: the keeper no longer interrupts the run.
    finishing: bool = False


class CapsRuntime:
    """One app's slot store and held leases, in one process."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.settings = CapsSettings.from_conf(app.conf)
        self._pid = os.getpid()
        self._store: SlotStore | None = None
        self._lock = threading.Lock()
        self._held: dict[str, HeldRun] = {}
        # Releases that failed (store unreachable), retried by the keeper every second until they
        # succeed, so that their slots free soon after the store returns rather than a lease later.
        self._failed_calls: dict[str, Callable[[], object]] = {}
        self._keeper: LeaseKeeper | None = None
        #: Renewal ticks that failed (store unreachable) in this process.
        self.renewal_failures = 0
        self._background: ThreadPoolExecutor | None = None
        self.metrics = metrics_for(self.settings.metrics_port)
        self.history: HistoryRecorder | None = None
        if self.settings.history_seconds is not None:
            self.history = HistoryRecorder(self.settings.history_seconds, self.settings.history_max_events)
        #: Whether this worker sends task events (-E); set by the worker's bootstep.
        self.send_events = False
        #: Warns when the store cannot be used, and when it answers again.
        self.health = StoreHealth(self.settings.on_store_error)

    # -- process life -------------------------------------------------------------

    def _check_fork(self) -> None:
        if self._pid == os.getpid():
            return
        # A forked child: the parent's connections, keeper and held runs are not ours.
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._held = {}
        self._failed_calls = {}  # (the parent's, which it retries itself)
        self._keeper = None
        self._background = None
        if self.history is not None:
            self.history.after_fork()
        if self._store is not None:
            if isinstance(self.settings.url, str):
                # We built this store from caps_url: build a fresh one here.  The parent's may
                # have been in use by another of its threads at the moment of the fork (the
                # main process releases a dead child's leases in a background thread while
                # the pool forks its replacement): a copy taken mid-connect has a half
                # initialised SQLAlchemy dialect that never completes.  Dropped, not closed:
                # its connections belong to the parent.
                self._store = None
            else:
                # A ready engine, client or store the user handed us: reset its connections.
                self._store.after_fork()

    @property
    def store(self) -> SlotStore:
        """The slot store, built from ``caps_url`` on first use in this process."""
        self._check_fork()
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = store_from_url(self.settings.require_url(), create_schema=self.settings.create_schema)
        return self._store

    def warm_up(self) -> None:
        """Build the store and let it prepare (schema, connections) before the first task needs
        it: for the thread that runs the tasks, the background thread and the lease keeper.  A
        failure is logged (the first task tries again)."""
        try:
            self.store.warm_up(threads=2, renewals=True)
        except Exception as exc:  # a StoreError (the worker's main process warns), or a bad setting
            reason = describe(exc) if isinstance(exc, StoreError) else str(exc)
            logger.info("celery-caps: the slot store was not warmed up (%s); the first task connects", reason)
            return
        if not park.parks(self):
            return
        # With park, a pool process publishes woken tasks from its first runs on, while
        # hand-overs wait for those messages: connect its producer to the broker now.
        try:
            with self.app.producer_or_acquire() as producer:
                producer.connection.ensure_connection(max_retries=1)
                _ = producer.channel  # opened on first use otherwise
        except Exception as exc:  # the first publish tries again
            logger.info("celery-caps: no broker connection ahead of the first hand-over (%s)", exc)

    def close(self) -> None:
        """Stop the keeper and close the store (connections it opened)."""
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        if self._background is not None:
            self._background.shutdown(wait=True)
            self._background = None
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- leases of this process ---------------------------------------------------

    def acquire(
        self,
        slots: Mapping[str, int],
        task_id: str,
        holder: str,
        task_name: str | None = None,
        deferrals: int = 0,
    ) -> tuple[Admission, str]:
        """Try to take ``slots`` for a new run of ``task_id``; returns the outcome and the run id."""
        run_id = uuid.uuid4().hex
        try:
            admission = self.store.acquire(
                slots, task_id, run_id, holder, self.settings.lease_seconds, task_name=task_name
            )
        except StoreError:
            # The error may have come after the store committed the leases (the connection
            # died before the reply): release the run once the store answers again, or its
            # leases would count against the caps until they expire.
            self.retry_release(run_id)
            raise
        if admission.granted:
            with self._lock:
                self._held[run_id] = HeldRun(
                    task_id, len(slots), tuple(slots), task_name, holder, time.time(), deferrals,
                    thread_id=threading.get_ident(),
                )  # fmt: skip
            self._ensure_keeper()
        return admission, run_id

    def hold(
        self,
        run_id: str,
        task_id: str,
        slots: Mapping[str, int],
        holder: str,
        task_name: str | None = None,
        deferrals: int = 0,
    ) -> None:
        """Hold ``run_id``, admitted by other means than :meth:`acquire` (parked, or a claimed dispatch)."""
        with self._lock:
            self._held[run_id] = HeldRun(
                task_id, len(slots), tuple(slots), task_name, holder, time.time(), deferrals,
                thread_id=threading.get_ident(),
            )  # fmt: skip
        self._ensure_keeper()

    def deferred(
        self,
        task_id: str,
        task_name: str | None,
        slots: Sequence[str],
        full_slots: Sequence[str],
        holder: str,
        deferrals: int,
        reason: str = "full",
    ) -> None:
        """Count and record a put-back or a park (``reason``: one of
        :data:`~celery_caps.metrics.DEFERRAL_REASONS`)."""
        self.metrics.deferred(full_slots, reason)
        self._record_deferral(task_id, task_name, slots, full_slots, holder, deferrals, time.time())

    def parked_when_sent(
        self, task_id: str, task_name: str | None, slots: Sequence[str], holder: str, parked_at: float
    ) -> None:
        """Record the wait of a task parked as it was sent (``caps_park_on_publish``), on its
        arrival here: its sender keeps no history.  ``parked_at`` is when it parked (epoch
        seconds, the sender's clock).  Not counted again: the sender counted the park."""
        self._record_deferral(task_id, task_name, slots, slots, holder, 0, parked_at)

    def _record_deferral(
        self,
        task_id: str,
        task_name: str | None,
        slots: Sequence[str],
        full_slots: Sequence[str],
        holder: str,
        deferrals: int,
        at: float,
    ) -> None:
        if self.history is not None:
            self.history.add(
                HistoryEvent(
                    "deferred", at, task_id, task_name, tuple(slots), tuple(full_slots), holder, deferrals=deferrals
                )
            )
            self._ensure_keeper()  # it writes the history

    def release(self, run_id: str) -> None:
        """Release one run's leases, once; a failure leaves them to expire (they are no longer renewed)."""
        with self._lock:
            run = self._held.pop(run_id, None)
        if run is None:
            return
        self.metrics.released(run.slots)
        if self.history is not None:
            self.history.add(
                HistoryEvent(
                    "ran", time.time(), run.task_id, run.task_name, run.slots, (), run.holder,
                    started_at=run.started_at, deferrals=run.deferrals,
                )
            )  # fmt: skip
        try:
            park.release(self, run_id)
        except StoreError as exc:
            logger.warning(
                "could not release run %s (%s); retrying in the background (its leases expire within %.0f s)",
                run_id,
                describe(exc),
                self.settings.lease_seconds,
            )
            self.retry_release(run_id)

    def retry_release(self, run_id: str) -> None:
        """Have the keeper release ``run_id`` every second until the store answers: a call that
        failed may have committed its leases before its reply was lost."""

        def release_again() -> None:
            if park.release(self, run_id):
                logger.info("released run %s after an earlier failure", run_id)

        with self._lock:
            self._failed_calls[f"release {run_id}"] = release_again
        self._ensure_keeper()

    def retry_failed_calls(self) -> int:
        """Retry the releases that failed earlier; a StoreError leaves the rest for the keeper's
        next tick.  Returns how many are still pending."""
        with self._lock:
            pending = list(self._failed_calls.items())
        for key, call in pending:
            call()
            with self._lock:
                if self._failed_calls.get(key) is call:
                    del self._failed_calls[key]
        with self._lock:
            return len(self._failed_calls)

    def has_failed_calls(self) -> bool:
        """Whether releases failed and wait for a retry."""
        with self._lock:
            return bool(self._failed_calls)

    # -- lease loss: the fencing check and caps_on_lease_lost -------------------------

    def still_held(self, run_id: str) -> bool:
        """Whether ``run_id`` still holds every lease it took, asked of the store now.

        Renews the run's leases in the same call (by the store's clock): a run that
        gets True keeps its slot for at least ``caps_lease_seconds`` more.  False when
        the run is unknown, was found lost before, lost a lease now, or the store
        cannot be reached (a holder that cannot prove it holds must not act as one).
        """
        with self._lock:
            run = self._held.get(run_id)
        if run is None or run.lost:
            return False
        try:
            renewed = self.store.renew([run_id], self.settings.lease_seconds)
        except StoreError as exc:
            logger.warning("task %s: could not check its slot lease (%s)", run.task_id, describe(exc))
            return False
        if renewed.get(run_id, 0) >= run.slot_count:
            return True
        self._mark_lost(run_id, run)
        return False

    def _mark_lost(self, run_id: str, run: HeldRun) -> bool:
        """Record that ``run`` lost a lease; True the first time (then it is logged and counted)."""
        with self._lock:
            if run.lost or run_id not in self._held:
                return False
            run.lost = True
        logger.warning(
            "task %s lost its slot lease (run %s): it expired or was released by an operator; caps_on_lease_lost=%s",
            run.task_id,
            run_id,
            self.settings.on_lease_lost,
        )
        self.metrics.lost(run.slots)
        return True

    def finish(self, run_id: str) -> None:
        """The run's body has ended: from now on the keeper never interrupts it."""
        with self._lock:
            run = self._held.get(run_id)
            if run is None:
                return
            run.finishing = True
            if run.thread_id is not None and self.settings.on_lease_lost == "stop":
                # Cancel a LeaseLost injected just before (under this lock) and not raised yet.
                _set_async_exception(run.thread_id, None)

    def stop_lost(self, run_id: str) -> bool:
        """``caps_on_lease_lost="stop"``: raise :class:`LeaseLost` in the thread running ``run_id``.

        The exception arrives at that thread's next Python instruction: a call blocked
        in C (a socket read, ``time.sleep``) ends first.  Not possible under gevent or
        eventlet (the task is a greenlet): then only the fencing check tells the task.
        """
        with self._lock:
            run = self._held.get(run_id)
            if run is None or run.finishing or run.thread_id is None:
                return False
            if _green_threads():
                logger.warning(
                    "task %s: caps_on_lease_lost=stop cannot interrupt a green thread; it continues "
                    "(check self.caps_still_held() before side effects)",
                    run.task_id,
                )
                return False
            return _set_async_exception(run.thread_id, LeaseLost)

    def release_all(self) -> None:
        """Release every run this process holds (process shutdown)."""
        with self._lock:
            run_ids = list(self._held)
        for run_id in run_ids:
            self.release(run_id)
        try:
            self.flush_history()
        except StoreError as exc:
            logger.debug("history not written at shutdown (%s)", exc)

    def runs_of(self, task_id: str) -> set[str]:
        """The run ids this process holds for ``task_id``."""
        with self._lock:
            return {run_id for run_id, run in self._held.items() if run.task_id == task_id}

    def held_runs(self) -> dict[str, HeldRun]:
        """A snapshot of the runs this process holds."""
        with self._lock:
            return dict(self._held)

    def renew_held(self) -> list[str]:
        """Renew every held run in one store call; returns the runs that lost a lease since the last call.

        A run that lost a lease is reported once and not renewed again: an expired or
        released lease is never revived, so renewing it could only report it again.
        """
        held = {run_id: run for run_id, run in self.held_runs().items() if not run.lost}
        if not held:
            return []
        renewed = self.store.renew(list(held), self.settings.lease_seconds)
        lost = [run_id for run_id, run in held.items() if renewed.get(run_id, 0) < run.slot_count]
        # A run released while we renewed is not lost; it is simply gone.
        current = self.held_runs()
        lost = [run_id for run_id in lost if run_id in current and self._mark_lost(run_id, current[run_id])]
        if self.metrics.enabled:
            for run_id, run in held.items():
                if run_id not in lost and run_id in renewed:
                    self.metrics.renewed(run.slots)
        return lost

    def flush_history(self) -> None:
        """Write this process's buffered history events (one store call), if history is on."""
        if self.history is not None and self.history.pending():
            self.history.flush(self.store)

    def _ensure_keeper(self) -> None:
        if self._keeper is None or not self._keeper.is_alive():
            with self._lock:
                if self._keeper is None or not self._keeper.is_alive():
                    self._keeper = LeaseKeeper(self)
                    self._keeper.start()

    # -- work for the worker's main process --------------------------------------

    def in_background(
        self, description: str, work: Callable[[], int], after_failure: str = "the leases expire by themselves"
    ) -> None:
        """Run a store call off the event loop (or off a task's thread); errors are logged, never
        raised.  ``work`` returns a count, logged at debug level."""
        self._check_fork()
        if self._background is None:
            with self._lock:
                if self._background is None:
                    self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="celery-caps")

        def run() -> None:
            try:
                done = work()
                logger.debug("%s: done (%d)", description, done)
            except Exception as exc:
                reason = describe(exc) if isinstance(exc, StoreError) else exc
                logger.warning("%s failed (%s); %s", description, reason, after_failure)

        self._background.submit(run)


class LeaseKeeper(threading.Thread):
    """Renews every lease its process holds, every third of ``caps_lease_seconds``, in one call;
    after a failed renewal (the store away), every second until one succeeds."""

    def __init__(self, runtime: CapsRuntime) -> None:
        super().__init__(name="celery-caps-lease-keeper", daemon=True)
        self.runtime = runtime
        self._stopped = threading.Event()
        self._renewal_failed = False

    def stop(self) -> None:
        self._stopped.set()

    def _next_wait(self) -> float:
        # Releases that failed, and a renewal that failed, are retried every second (at most):
        # slots free, and leases are renewed, within a second or so of the store's return.
        interval = self.runtime.settings.renew_seconds
        hurry = self.runtime.has_failed_calls() or self._renewal_failed
        return min(interval, UNRELEASED_RETRY_SECONDS) if hurry else interval

    def run(self) -> None:
        interval = self.runtime.settings.renew_seconds
        last_renewal = time.monotonic()
        while not self._stopped.wait(self._next_wait()):
            if self.runtime.has_failed_calls():
                try:
                    self.runtime.retry_failed_calls()
                except StoreError as exc:
                    logger.debug("retrying failed store calls failed (%s)", exc)
                except Exception:
                    logger.exception("retrying failed store calls crashed")
            if time.monotonic() - last_renewal < interval * 0.9 and not self._renewal_failed:
                continue
            last_renewal = time.monotonic()
            try:
                self.runtime.flush_history()
            except Exception:  # history is best effort; renewal must go on
                logger.exception("writing the caps history failed")
            try:
                lost = self.runtime.renew_held()
                self._renewal_failed = False
            except StoreError as exc:
                self.runtime.renewal_failures += 1
                if not self._renewal_failed:
                    logger.warning(
                        "lease renewal failed (%s); %d running task(s) keep running, retrying every %.0f s",
                        describe(exc), len(self.runtime.held_runs()), UNRELEASED_RETRY_SECONDS,
                    )  # fmt: skip
                self._renewal_failed = True
                continue
            except Exception:  # keep renewing whatever happens
                self.runtime.renewal_failures += 1
                logger.exception("lease renewal crashed; retrying in %.1f s", interval)
                continue
            if self.runtime.settings.on_lease_lost == "stop":
                for run_id in lost:
                    if self.runtime.stop_lost(run_id):
                        logger.warning("run %s stopped with LeaseLost (caps_on_lease_lost=stop)", run_id)


def runtime_for(app: Celery) -> CapsRuntime:
    """The app's runtime in this process, created on first use; ``app.close()`` closes it."""
    runtime: CapsRuntime | None = getattr(app, _RUNTIME_ATTRIBUTE, None)
    if runtime is None:
        runtime = CapsRuntime(app)
        setattr(app, _RUNTIME_ATTRIBUTE, runtime)
        _close_with(app, runtime)
    return runtime


def _close_with(app: Celery, runtime: CapsRuntime) -> None:
    """Make ``app.close()`` close ``runtime`` too: its store connections and its threads go with
    the app (a test suite that builds an app per test would otherwise keep a connection each)."""
    close_app = app.close

    @functools.wraps(close_app)
    def close(*args: Any, **kwargs: Any) -> Any:
        runtime.close()
        return close_app(*args, **kwargs)

    app.close = close


def warm_up(app: Celery) -> None:
    """Connect this process to ``app``'s slot store and check its schema now, not in the first
    capped ``apply_async`` (which would otherwise take tens to hundreds of milliseconds longer).

    For processes that send capped tasks with ``caps_park_on_publish`` (otherwise sending never
    touches the store): call it after they fork (a web server's post-fork hook), never before,
    as connections do not survive a fork.  Worker pool processes warm up by themselves.

    Raises:
        ConfigurationError: a bad ``caps_url``.
        StoreError: the store cannot be reached.
    """
    runtime_for(app).store.warm_up()


def _existing_runtime(app: Celery | None) -> CapsRuntime | None:
    return getattr(app, _RUNTIME_ATTRIBUTE, None) if app is not None else None


def _is_capped(task: Any) -> bool:
    return bool(getattr(task, "_caps", ()))


def tasks_capped_without_base(app: Celery) -> list[str]:
    """The names of ``app``'s tasks declared with ``cap=`` but not ``base=CappedTask``.

    Celery keeps an option it does not know as a class attribute of the task: such a task
    has a ``cap`` holding :class:`~celery_caps.Cap` objects and runs uncapped.
    """
    from .caps import Cap
    from .task import CappedTask

    found = []
    for name, task in sorted(app.tasks.items()):
        if isinstance(task, CappedTask):
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
    runtime.in_background(f"releasing {task_id} after {reason}", lambda: park.release_holder(runtime, task_id, holder))


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
    """With park in use, consume the wake queue of every task queue this worker consumes
    (:data:`~celery_caps.park.WAKE_QUEUE_SUFFIX`), also of queues added later by the
    ``add_consumer`` control command: a woken task, its slot already taken for it,
    overtakes its queue's backlog.  A wake queue is dropped with its queue."""

    label = "celery-caps wake queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)
        # Whatever tasks it knows now: tasks registered later (``reload()``) park too.
        self.enabled = _park_in_use(consumer.app)

    def start(self, consumer: Any) -> None:
        from .park import is_wake_queue, wake_queue, wake_queue_name

        queues = consumer.app.amqp.queues
        for queue in list(consumer.task_consumer.queues):
            if not is_wake_queue(queue.name):
                name = wake_queue_name(queue.name)
                if name not in queues:
                    queues.add(wake_queue(name))
                consumer.add_task_queue(name)
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


def _park_in_use(app: Celery) -> bool:
    try:
        return CapsSettings.from_conf(app.conf).parking.uses_park
    except Exception:  # a bad setting is reported by CapsWorkerStep, which stops the worker
        return False


#: Seconds between two recovery calls of a worker's main process (each call spread by up to
#: a fifth, so that a fleet's workers do not all call at once).
RECOVERY_SECONDS = 2.0


class Recovery(threading.Thread):
    """Main process, with park in use: every :data:`RECOVERY_SECONDS`, one store call that keeps
    waiters moving when no release does (:func:`celery_caps.park.recover`): dispatches never
    claimed are dispatched again, room freed by expired leases goes to waiters, waiters past
    ``caps_max_wait_seconds`` are readmitted.  Every worker runs one; several at once are safe.
    A store outage is reported by the runtime's :class:`~celery_caps.health.StoreHealth`: when
    it starts, at most once a minute while it lasts, and when it ends."""

    def __init__(self, runtime: CapsRuntime) -> None:
        super().__init__(name="celery-caps-recovery", daemon=True)
        self.runtime = runtime
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(RECOVERY_SECONDS * random.uniform(0.8, 1.2)):
            self.tick()

    def tick(self) -> None:
        try:
            published = park.recover(self.runtime)
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
        """One check: from ``caps_url`` as a URL, on a store of its own, closed after (the main
        process keeps no connection for it); from a ready engine, client or store, on the
        runtime's store, which resets the connections a forked pool process inherits."""
        settings = self.runtime.settings
        url = settings.require_url()
        if not isinstance(url, str):
            self.runtime.store.warm_up()
            return
        store = store_from_url(url, create_schema=settings.create_schema)
        try:
            store.warm_up()
        finally:
            store.close()


class CapsWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Refuses to start a worker whose app has capped tasks but no usable caps settings, or
    tasks given ``cap=`` without ``base=CappedTask``; checks the store (:class:`StoreCheck`);
    serves the metrics endpoint (``caps_metrics_port``, ``--caps-metrics-port``); runs
    :class:`Recovery` with park in use."""

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
        store = store_from_url(url, create_schema=settings.create_schema)
        display = getattr(store, "display_url", type(store).__name__)
        park.check_store(app, store)
        from .stores.memory import MemoryStore

        if isinstance(store, MemoryStore):
            logger.warning(
                "celery-caps: caps_url is memory://, which caps each worker process on its own: "
                "prefork children and other workers do not share it. Use a SQL or Redis store for a fleet."
            )
        logger.info("celery-caps: %d capped task(s) use the slot store %s", len(capped), display)
        if settings.parking.uses_park and isinstance(store, ParkingStore):
            try:
                durability = store.durability_warning()
            except StoreError:  # the store check reports it once the worker starts
                durability = None
            if durability:
                logger.warning("celery-caps: parked tasks can be lost: %s", durability)
        store.close()
        if settings.metrics_port is not None:
            from . import metrics

            # Pool processes inherit the directory; it must be set before prometheus_client loads.
            metrics.prepare_multiprocess_dir()
            metrics.metrics_for(settings.metrics_port)  # fails now if prometheus-client is missing
        # Task events (-E) are known here; pool processes inherit the flag.
        runtime_for(app).send_events = bool(getattr(worker, "task_events", False))

    def start(self, worker: Any) -> None:
        runtime = _existing_runtime(worker.app)
        if runtime is None:
            return
        self._store_check = StoreCheck(runtime)
        self._store_check.start()
        if runtime.settings.parking.uses_park:
            self._recovery = Recovery(runtime)
            self._recovery.start()
        if runtime.settings.metrics_port is None:
            return
        from . import metrics

        settings = runtime.settings
        self._metrics_server = metrics.serve(
            settings.metrics_port,  # type: ignore[arg-type]
            settings.metrics_address,
            lambda: runtime.store,
            settings.key_warning_threshold,
        )

    def stop(self, worker: Any) -> None:
        if self._store_check is not None:
            self._store_check.stop()
            self._store_check = None
        if self._recovery is not None:
            self._recovery.stop()
            self._recovery = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None


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
        from .sweep import install

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

    runtime = _existing_runtime(current_app)
    if runtime is not None and (runtime.held_runs() or runtime.history is not None):
        runtime.release_all()  # also writes what is left of the history
    if runtime is not None and runtime.metrics.enabled:
        from .metrics import mark_process_dead

        mark_process_dead(os.getpid())


@signals.task_revoked.connect  # type: ignore[untyped-decorator]
def _release_on_revoke(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    # Main process.  revoke(terminate=True): every lease of the task id goes, whatever run holds
    # it.  Any revoke (or an expired message) discarded here: with park in use, the task also
    # leaves the waiting list and its dispatch leases go to the next waiters, or the sweep would
    # dispatch it again and again, each copy discarded like this one.
    if not _is_capped(sender) or request is None:
        return
    runtime = runtime_for(sender.app)
    if not (terminated or runtime.settings.parking.uses_park):
        return
    task_id = request.id

    def release_revoked() -> int:
        released = park.release_task(runtime, task_id) if terminated else 0
        return released + park.forget(runtime, task_id)

    runtime.in_background(f"releasing revoked task {task_id}", release_revoked)


@signals.worker_shutdown.connect  # type: ignore[untyped-decorator]
def _release_on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    # A cold shutdown leaves running tasks behind (redelivered with acks_late):
    # free their slots now rather than after the lease window.
    from celery.worker import state

    app = getattr(sender, "app", None)
    runtime = _existing_runtime(app)
    requests = [request for request in list(state.active_requests) if _is_capped(request.task)]
    if runtime is None and not requests:
        return
    if requests:
        runtime = runtime or runtime_for(requests[0].task.app)
        for request in requests:
            if request.worker_pid is None:
                continue
            try:
                park.release_holder(runtime, request.id, holder_name(request.hostname, request.worker_pid))
            except StoreError as exc:
                logger.warning("could not release %s at shutdown (%s)", request.id, exc)
    if runtime is not None:
        runtime.release_all()
        runtime.close()
