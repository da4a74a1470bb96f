"""The per-process caps runtime: the store, the runs this process holds, their lease keeper.

Each process that runs capped tasks (a prefork child, a threads/solo worker, a gevent worker,
or a process calling tasks eagerly) has one :class:`CapsRuntime` per app (:func:`runtime_for`).
It owns the store connection, remembers which runs this process holds, and runs a
:class:`LeaseKeeper` thread that renews all of them in one store call per tick, long before
they expire.  Releases the process cannot wait for go to a small background thread.  The
worker's wiring (Celery's signals and bootsteps) is :mod:`celery_caps.worker`.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import handover
from .errors import LeaseLost, StoreError
from .health import StoreHealth, describe
from .history import HistoryRecorder
from .metrics import metrics_for
from .settings import CapsSettings
from .stores import store_from_url
from .stores.base import Admission, HistoryEvent, SlotStore
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
                    self._store = store_from_url(self.settings.require_url(), self.settings.store_options)
        return self._store

    def warm_up(self) -> None:
        """Build the store and let it prepare (schema, a connection) before the first task of
        this pool process needs it.  The process runs one task at a time, so it keeps one store
        connection, which the thread that runs the tasks, the background thread and the lease
        keeper share (each call takes about a millisecond).  A failure is logged (the first task
        tries again)."""
        try:
            store = self.store
            store.limit_connections(1)
            store.warm_up(threads=1)
        except Exception as exc:  # a StoreError (the worker's main process warns), or a bad setting
            reason = describe(exc) if isinstance(exc, StoreError) else str(exc)
            logger.info("celery-caps: the slot store was not warmed up (%s); the first task connects", reason)
            return
        if not (self.settings.parking.uses_park and handover.parks(self)):
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
        weights: Mapping[str, int] | None = None,
    ) -> tuple[Admission, str]:
        """Try to take ``slots`` (at ``weights``, 1 where not given) for a new run of ``task_id``;
        returns the outcome and the run id."""
        run_id = uuid.uuid4().hex
        try:
            admission = self.store.acquire(
                slots, task_id, run_id, holder, self.settings.lease_seconds, task_name=task_name, weights=weights
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
            handover.release(self, run_id)
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
            if handover.release(self, run_id):
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


def existing_runtime(app: Celery | None) -> CapsRuntime | None:
    return getattr(app, _RUNTIME_ATTRIBUTE, None) if app is not None else None
