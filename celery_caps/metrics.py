"""Prometheus metrics, optional (``pip install "celery-caps[prometheus]"``).

Enabled by ``caps_metrics_port`` (or ``celery worker --caps-metrics-port``), a
worker's main process serves ``/metrics`` on that port, the way Celery exporters
usually do, from a thread of its own.  Counters and the wait histogram are
written by the processes that admit and run tasks (prefork children included)
through prometheus_client's multiprocess mode: every process writes its own
files under ``PROMETHEUS_MULTIPROC_DIR`` (set by the worker before any process
imports prometheus_client, to a fresh directory unless you set it), and the main
process adds them up on each scrape.  Gauges of the fleet (slots held, limits,
keys, expired leases, tasks waiting, per cap) are read from the store on each
scrape, cached for a few seconds: they are the same on every worker, so
aggregate them with ``max``.  Labels are cap names, never keys: a keyed cap with
a thousand keys is one time series, not a thousand.

The counters (label ``cap``; deferrals also ``reason``, see :data:`DEFERRAL_REASONS`):

* ``celery_caps_admissions_total``, ``celery_caps_deferrals_total``,
  ``celery_caps_releases_total``, ``celery_caps_lease_renewals_total``,
  ``celery_caps_lease_losses_total``;
* ``celery_caps_wait_seconds``: histogram of the wait from a task's first
  put-back (or park) to its admission (0 for a task admitted at once).

Counters count in the process that did the thing.  A park made as a task is sent
(``caps_park_on_publish``) is counted by the sending process: by a worker when one
of its tasks sends it, not at all by a process that serves no metrics (a web
server).  Counting it again in the worker that later runs the task would count
late, never count a task that does not run, and count twice when the sender is a
worker; instead ``celery_caps_waiting_tasks``, read from the store, shows every
waiting task wherever it parked, and the wait histogram of the worker that runs it
includes its wait.

The fleet gauges: ``celery_caps_store_up``, ``celery_caps_slots_held``,
``celery_caps_slot_limit``, ``celery_caps_keys``, ``celery_caps_expired_leases``,
``celery_caps_waiting_tasks`` (park: tasks in the waiting list, not yet woken), each of
the caps the worker's app declares only: another app sharing the store is not shown.

The endpoint has no authentication, and listens on every interface by default
(``caps_metrics_address`` ``0.0.0.0``): whoever reaches the port reads the app's cap names
and counts.  Bind it to a private address, or keep the port behind a firewall.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import ConfigurationError, MissingDependencyError, StoreError
from .health import describe
from .stores.base import ParkingStore, SlotStatus, SlotStore, with_operator_limits

logger = logging.getLogger(__name__)

MULTIPROC_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds a scrape reuses the store's last answer for the fleet gauges.
STATUS_CACHE_SECONDS = 5.0
#: The ``reason`` label of ``celery_caps_deferrals_total``: why a task did not run on arrival.
DEFERRAL_REASONS = {
    "full": "a cap was full: put back to the broker with backoff (caps_strategy backoff)",
    "parked": "a cap was full: parked in the store's waiting list until a release wakes it (park)",
    "waitlist_full": "a cap was full and its waiting list held caps_park_max_waiters: put back with backoff",
    "payload_too_large": (
        "a cap was full and the message was over caps_park_max_payload_bytes: it waits in the list without it, "
        "its message put back until its turn"
    ),
    "store_error": "the store failed (caps_on_store_error defer): put back with backoff",
}
#: Buckets of the wait histogram, in seconds.
WAIT_BUCKETS = (0.0, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, float("inf"))


def cap_of(slot: str) -> str:
    """The cap name of a slot name (``tenant:acme`` -> ``tenant``)."""
    return slot.partition(":")[0]


def _caps(slots: Iterable[str]) -> set[str]:
    return {cap_of(slot) for slot in slots}


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise MissingDependencyError(
            f'caps_metrics_port needs prometheus-client: pip install "celery-caps[prometheus]" ({exc})'
        ) from exc
    return prometheus_client


class Metrics:
    """What the runtime reports; this base class records nothing (metrics off)."""

    enabled = False

    def admitted(self, slots: Iterable[str], waited_seconds: float) -> None:
        """A task took ``slots`` after waiting ``waited_seconds`` since its first put-back."""

    def deferred(self, slots: Iterable[str], reason: str) -> None:
        """A task was put back or parked because ``slots`` were full (or the store failed);
        ``reason`` is one of :data:`DEFERRAL_REASONS`."""

    def released(self, slots: Iterable[str]) -> None:
        """A run let go of ``slots``."""

    def renewed(self, slots: Iterable[str]) -> None:
        """A run's leases of ``slots`` were renewed."""

    def lost(self, slots: Iterable[str]) -> None:
        """A run's leases of ``slots`` expired or were released under it."""


class PrometheusMetrics(Metrics):
    """Counters and a histogram in prometheus_client's default (multiprocess-aware) value store.

    The instruments are registered nowhere: the serving process collects every
    process's values from the multiprocess directory (or, without one, from
    :func:`registry_for`'s own registry in a single-process worker).
    """

    enabled = True
    _instance: ClassVar[PrometheusMetrics | None] = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        client = _prometheus()
        self.admissions = client.Counter(
            "celery_caps_admissions", "Tasks admitted into a cap's slot", ["cap"], registry=None
        )
        self.deferrals = client.Counter(
            "celery_caps_deferrals",
            "Tasks put back or parked instead of running, by reason: "
            + "; ".join(f"{reason}: {meaning}" for reason, meaning in DEFERRAL_REASONS.items()),
            ["cap", "reason"], registry=None,
        )  # fmt: skip
        self.releases = client.Counter("celery_caps_releases", "Slot leases released", ["cap"], registry=None)
        self.renewals = client.Counter("celery_caps_lease_renewals", "Slot leases renewed", ["cap"], registry=None)
        self.losses = client.Counter(
            "celery_caps_lease_losses", "Running tasks whose slot lease expired or was released", ["cap"],
            registry=None,
        )  # fmt: skip
        self.wait = client.Histogram(
            "celery_caps_wait_seconds", "Seconds from a task's first put-back to its admission", ["cap"],
            buckets=WAIT_BUCKETS, registry=None,
        )  # fmt: skip

    @classmethod
    def shared(cls) -> PrometheusMetrics:
        """The process's one set of instruments: two objects writing one series would clobber it."""
        # Forked children keep their parent's set: its values re-open their files by pid.
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def admitted(self, slots: Iterable[str], waited_seconds: float) -> None:
        for cap in _caps(slots):
            self.admissions.labels(cap).inc()
            self.wait.labels(cap).observe(max(waited_seconds, 0.0))

    def deferred(self, slots: Iterable[str], reason: str) -> None:
        for cap in _caps(slots):
            self.deferrals.labels(cap, reason).inc()

    def released(self, slots: Iterable[str]) -> None:
        for cap in _caps(slots):
            self.releases.labels(cap).inc()

    def renewed(self, slots: Iterable[str]) -> None:
        for cap in _caps(slots):
            self.renewals.labels(cap).inc()

    def lost(self, slots: Iterable[str]) -> None:
        for cap in _caps(slots):
            self.losses.labels(cap).inc()


NO_METRICS = Metrics()


def metrics_for(port: int | None) -> Metrics:
    """The instruments to record into: real ones when a metrics port is configured."""
    return NO_METRICS if port is None else PrometheusMetrics.shared()


# -- the worker's main process: the directory, the endpoint --------------------------


def prepare_multiprocess_dir() -> str | None:
    """Make sure ``PROMETHEUS_MULTIPROC_DIR`` is set, and prometheus_client in multiprocess
    mode, before this library's instruments are created.

    prometheus_client chooses its mode from the variable when it is first imported, and it may
    have been imported already: Celery loads every ``celery`` sub-command before the worker
    starts, and Flower's imports prometheus_client.  Then its choice is made again here, which
    holds for every instrument created from now on (this library's, in the worker and its pool
    processes); instruments created before (Flower's own, say) keep theirs and are not served.

    Returns the directory if this call created it (removed when this process
    exits), None if it was set already (then it is yours to empty between runs).

    Raises:
        ConfigurationError: this library's instruments exist already without the
            variable (they could not be collected from pool processes), or this
            prometheus_client cannot be switched to multiprocess mode.
    """
    if os.environ.get(MULTIPROC_DIR_VARIABLE):
        os.makedirs(os.environ[MULTIPROC_DIR_VARIABLE], exist_ok=True)
        _choose_multiprocess_values()
        return None
    if PrometheusMetrics._instance is not None:
        raise ConfigurationError(
            f"caps_metrics_port: this process recorded metrics before the worker started, without "
            f"{MULTIPROC_DIR_VARIABLE}; set {MULTIPROC_DIR_VARIABLE} to an empty directory in the "
            "worker's environment so that every pool process's metrics are collected"
        )
    created = tempfile.mkdtemp(prefix="celery-caps-metrics-")
    os.environ[MULTIPROC_DIR_VARIABLE] = created
    # Removed when the main process exits, after its pool processes are gone.
    atexit.register(_remove_directory, created, os.getpid())
    _choose_multiprocess_values()
    return created


def _choose_multiprocess_values() -> None:
    """If prometheus_client is imported already, have it choose its value class again now that
    ``PROMETHEUS_MULTIPROC_DIR`` is set (it chose when imported)."""
    if "prometheus_client" not in sys.modules:
        return  # it chooses when imported
    from prometheus_client import values

    if getattr(values.ValueClass, "_multiprocess", False):
        return
    choose = getattr(values, "get_value_class", None)
    chosen = choose() if callable(choose) else None
    if not getattr(chosen, "_multiprocess", False):
        raise ConfigurationError(
            f"caps_metrics_port: prometheus_client was imported before the worker started, without "
            f"{MULTIPROC_DIR_VARIABLE}, and this version of it cannot switch to multiprocess mode; set "
            f"{MULTIPROC_DIR_VARIABLE} to an empty directory in the worker's environment"
        )
    values.ValueClass = chosen


def _remove_directory(path: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def mark_process_dead(pid: int) -> None:
    """Tell prometheus_client that pool process ``pid`` is gone (its live gauges stop counting)."""
    if os.environ.get(MULTIPROC_DIR_VARIABLE) and "prometheus_client" in sys.modules:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


class FleetCollector:
    """Gauges of the whole fleet, read from the store at scrape time (cached briefly), for the
    caps ``caps()`` names (the app's: slot names equal to a cap name or starting with it and
    ``:``); other apps sharing the store stay out of the endpoint.  ``caps`` None: every cap.

    Also logs a warning when a cap's number of keys goes above
    ``key_warning_threshold`` (once per crossing, per process).
    """

    def __init__(
        self,
        store: Callable[[], SlotStore],
        key_warning_threshold: int,
        caps: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self._store = store
        self._caps = caps
        self._threshold = key_warning_threshold
        self._lock = threading.Lock()
        self._cached: tuple[float, list[SlotStatus], _Waiting | None] | None = None
        self._over_threshold: set[str] = set()

    def _statuses(self) -> tuple[list[SlotStatus], _Waiting | None]:
        """The slots' statuses, and the tasks waiting per cap (None for a store that does not park)."""
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] > STATUS_CACHE_SECONDS:
                store = self._store()
                statuses, waiting = with_operator_limits(store.status(), store.limits()), _waiting_per_cap(store)
                if self._caps is not None:
                    own = set(self._caps())
                    statuses = [status for status in statuses if cap_of(status.slot) in own]
                    if waiting is not None:
                        waiting = waiting.of(own)
                self._cached = (now, statuses, waiting)
            return self._cached[1], self._cached[2]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("celery_caps_store_up", "1 if the slot store answered the last status read")
        try:
            statuses, waiting = self._statuses()
        except StoreError as exc:
            logger.warning("metrics: could not read the slot store (%s)", describe(exc))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        held: dict[str, int] = {}
        units: dict[str, int] = {}
        limits: dict[str, int] = {}
        keys: dict[str, int] = {}
        expired: dict[str, int] = {}
        for status in statuses:
            cap, separator, _key = status.slot.partition(":")
            held[cap] = held.get(cap, 0) + status.holders
            units[cap] = units.get(cap, 0) + status.used
            expired[cap] = expired.get(cap, 0) + status.expired
            keys[cap] = keys.get(cap, 0) + (1 if separator else 0)
            if status.limit is not None:
                limits[cap] = max(limits.get(cap, 0), status.limit)
        self._warn_about_keys(keys)
        gauges = [
            ("celery_caps_slots_held", "Distinct tasks holding a live lease, summed over a cap's keys", held),
            (
                "celery_caps_slot_units_held",
                "Units of the limit live leases take (weights), summed over a cap's keys",
                units,
            ),
            ("celery_caps_slot_limit", "A cap's limit (per key, for keyed caps)", limits),
            ("celery_caps_keys", "Distinct keys (slot names) a keyed cap has in the store", keys),
            ("celery_caps_expired_leases", "Expired leases not swept yet", expired),
        ]
        if waiting is not None:  # every cap the store knows, 0 when nothing waits
            documentation = "Tasks in the store's waiting list for a cap's slots, not yet woken (park)"
            gauges.append(("celery_caps_waiting_tasks", documentation, {**dict.fromkeys(held, 0), **waiting.tasks}))
            documentation = "Distinct fair keys (Cap(fair_by=...)) with a task waiting for a cap, not yet woken"
            gauges.append(("celery_caps_fair_keys_waiting", documentation, waiting.fair_keys))
        for name, documentation, values in gauges:
            family = GaugeMetricFamily(name, documentation, labels=["cap"])
            for cap, value in sorted(values.items()):
                family.add_metric([cap], value)
            yield family

    def _warn_about_keys(self, keys: dict[str, int]) -> None:
        for cap, count in keys.items():
            if count > self._threshold and cap not in self._over_threshold:
                self._over_threshold.add(cap)
                logger.warning(
                    "cap %r has %d distinct keys (caps_key_warning_threshold=%d): keys must come from a "
                    "bounded set; each key keeps a row. Prune retired keys with `celery caps prune-keys`.",
                    cap,
                    count,
                    self._threshold,
                )
            elif count <= self._threshold:
                self._over_threshold.discard(cap)


def _waiting_per_cap(store: SlotStore) -> _Waiting | None:
    """Distinct tasks waiting (not dispatched) per cap in ``store``'s waiting list, and distinct
    fair keys they wait under, for caps with ``fair_by`` (None: the store has no waiting list)."""
    if not isinstance(store, ParkingStore):
        return None
    tasks: dict[str, set[str]] = {}
    fair_keys: dict[str, set[str]] = {}
    for waiter in store.waiters():
        if not waiter.dispatched:
            tasks.setdefault(cap_of(waiter.slot), set()).add(waiter.task_id)
            if waiter.fair_key is not None:
                fair_keys.setdefault(cap_of(waiter.slot), set()).add(waiter.fair_key)
    return _Waiting(
        {cap: len(task_ids) for cap, task_ids in tasks.items()}, {cap: len(keys) for cap, keys in fair_keys.items()}
    )


@dataclass(frozen=True)
class _Waiting:
    """The waiting list per cap: distinct tasks waiting, and distinct fair keys among them."""

    tasks: dict[str, int]
    fair_keys: dict[str, int]

    def of(self, caps: Collection[str]) -> _Waiting:
        return _Waiting(
            {cap: count for cap, count in self.tasks.items() if cap in caps},
            {cap: count for cap, count in self.fair_keys.items() if cap in caps},
        )


def registry_for(
    store: Callable[[], SlotStore], key_warning_threshold: int, caps: Callable[[], Collection[str]] | None = None
) -> Any:
    """A registry of every process's counters (multiprocess mode) plus the fleet gauges of
    ``caps`` (see :class:`FleetCollector`)."""
    client = _prometheus()
    from prometheus_client import multiprocess

    registry = client.CollectorRegistry()
    if os.environ.get(MULTIPROC_DIR_VARIABLE):
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:  # a worker that has only its own process: collect its instruments directly
        instruments = PrometheusMetrics.shared()
        for metric in (instruments.admissions, instruments.deferrals, instruments.releases):
            registry.register(metric)
        for metric in (instruments.renewals, instruments.losses, instruments.wait):
            registry.register(metric)
    registry.register(FleetCollector(store, key_warning_threshold, caps))
    return registry


def serve(
    port: int,
    address: str,
    store: Callable[[], SlotStore],
    key_warning_threshold: int,
    caps: Callable[[], Collection[str]] | None = None,
) -> Any:
    """Start the ``/metrics`` endpoint in a daemon thread; returns the server (``shutdown()`` stops it).

    It has no authentication: it answers whoever reaches ``address`` (``0.0.0.0``: every
    interface).  Its fleet gauges name only ``caps`` (the worker passes its app's)."""
    client = _prometheus()
    try:
        server, _thread = client.start_http_server(
            port, addr=address, registry=registry_for(store, key_warning_threshold, caps)
        )
    except OSError as exc:
        raise ConfigurationError(f"caps_metrics_port: cannot listen on {address}:{port} ({exc})") from exc
    logger.info("celery-caps metrics on http://%s:%d/metrics", address, port)
    return server
