"""The ``caps_*`` settings: names, defaults and validation.

Settings live on the Celery app's ``conf`` like Celery's own, so they also work
through namespaced configuration (a Django project's ``CELERY_CAPS_URL`` with
``app.config_from_object("django.conf:settings", namespace="CELERY")``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from .errors import ConfigurationError

if TYPE_CHECKING:
    from .caps import Cap
    from .stores import StoreOptions

StoreErrorPolicy = Literal["defer", "run", "fail"]
STORE_ERROR_POLICIES: tuple[StoreErrorPolicy, ...] = ("defer", "run", "fail")
LeaseLostPolicy = Literal["continue", "stop"]
LEASE_LOST_POLICIES: tuple[LeaseLostPolicy, ...] = ("continue", "stop")

#: Every setting with its default; docs/settings.md describes each.
DEFAULTS: dict[str, Any] = {
    "caps_url": None,
    "caps_lease_seconds": 30.0,
    "caps_backoff_min_seconds": 0.5,
    "caps_backoff_max_seconds": 20.0,
    "caps_max_wait_seconds": None,
    "caps_on_store_error": "defer",
    "caps_on_lease_lost": "continue",
    "caps_sweep_interval_seconds": 60.0,
    "caps_key_warning_threshold": 1000,
    "caps_create_schema": True,
    "caps_redis_key_prefix": "caps",  # the Redis store's keys; a hash tag is added on Redis Cluster
    "caps_redis_master_name": None,  # Redis Sentinel: the master of sentinel:// or of a Sentinel object
    # Run on a Redis whose maxmemory-policy may evict any key (allkeys-*), with a warning, rather than refuse it.
    "caps_redis_allow_eviction": False,
    # The deployment this app's workers serve, when several share a store; None: a digest of broker_url.
    "caps_deployment": None,
    "caps_history_seconds": None,  # None: no history (explain and timeline see only the present)
    "caps_history_max_events": 10000,
    "caps_metrics_port": None,  # None: no metrics endpoint (also: celery worker --caps-metrics-port)
    "caps_metrics_address": "0.0.0.0",
    "caps_deferred_state": True,
    # Eager runs (task_always_eager, apply()) take their caps too, waiting in the calling process.
    "caps_enforce_eager": False,
    "caps_strategy": "park",  # or "backoff", or {"default": ..., "<cap name>": ...}
    "caps_park_max_waiters": 10000,
    "caps_park_max_payload_bytes": 65536,
    # With park: sending a capped task checks its slots (a store call in the sender): full, it waits
    # in the store at once (one broker message less); with room, it takes them as it is sent.
    "caps_park_on_publish": False,
}


def _number(conf: Mapping[str, Any], name: str, *, optional: bool = False) -> float | None:
    value = conf.get(name, DEFAULTS[name])
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        allowed = "a positive number of seconds" + (" or None" if optional else "")
        raise ConfigurationError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _positive_int(conf: Mapping[str, Any], name: str) -> int:
    value = conf.get(name, DEFAULTS[name])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    return value


def _flag(conf: Mapping[str, Any], name: str) -> bool:
    value = conf.get(name, DEFAULTS[name])
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


#: Longest ``caps_deployment``, in characters.
MAX_DEPLOYMENT_LENGTH = 64


def _deployment(conf: Mapping[str, Any]) -> str:
    """``caps_deployment``, or by default a digest of the app's broker URL (credentials left out):
    two deployments sharing a store, each with its own broker, are told apart with no setting."""
    value = conf.get("caps_deployment", DEFAULTS["caps_deployment"])
    if value is None:
        import hashlib

        from .stores.base import mask_url

        broker = getattr(conf, "broker_url", None) or conf.get("broker_url") or ""
        if not isinstance(broker, str):  # a list of failover URLs
            broker = ";".join(str(url) for url in broker)
        return "broker-" + hashlib.sha1(mask_url(broker).encode()).hexdigest()[:12]
    if not isinstance(value, str) or not value or len(value) > MAX_DEPLOYMENT_LENGTH or not value.isprintable():
        raise ConfigurationError(
            f"caps_deployment must be a printable string of 1 to {MAX_DEPLOYMENT_LENGTH} characters or None, "
            f"got {value!r}"
        )
    return value


BACKOFF = "backoff"
PARK = "park"
STRATEGIES = (BACKOFF, PARK)


def _strategy(name: str, value: object) -> str:
    if value not in STRATEGIES:
        raise ConfigurationError(f"{name} must be one of {', '.join(STRATEGIES)}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class ParkingSettings:
    """The validated parking settings of one app (durations in seconds)."""

    default: str = PARK
    per_cap: Mapping[str, str] = field(default_factory=dict)
    max_waiters: int = 10000
    max_payload_bytes: int = 65536
    on_publish: bool = False

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> ParkingSettings:
        """Read and check the settings; raise :class:`ConfigurationError` naming a bad one."""
        value = conf.get("caps_strategy", DEFAULTS["caps_strategy"])
        per_cap: dict[str, str] = {}
        if isinstance(value, Mapping):
            default = _strategy("caps_strategy['default']", value.get("default", PARK))
            for cap_name, strategy in value.items():
                if cap_name != "default":
                    per_cap[str(cap_name)] = _strategy(f"caps_strategy[{cap_name!r}]", strategy)
        else:
            default = _strategy("caps_strategy", value)
        return cls(
            default,
            per_cap,
            _positive_int(conf, "caps_park_max_waiters"),
            _positive_int(conf, "caps_park_max_payload_bytes"),
            _flag(conf, "caps_park_on_publish"),
        )

    def strategy_for(self, caps: Sequence[Cap]) -> str:
        """``park`` if any of ``caps`` chooses it, else ``backoff``."""
        return PARK if any(self.per_cap.get(cap.name, self.default) == PARK for cap in caps) else BACKOFF

    @property
    def uses_park(self) -> bool:
        """Whether any cap of the app may park (then releases wake waiters)."""
        return self.default == PARK or PARK in self.per_cap.values()


@dataclass(frozen=True)
class CapsSettings:
    """The validated ``caps_*`` settings of one Celery app (all durations in seconds)."""

    url: Any
    lease_seconds: float
    backoff_min_seconds: float
    backoff_max_seconds: float
    max_wait_seconds: float | None
    on_store_error: StoreErrorPolicy
    sweep_interval_seconds: float | None
    key_warning_threshold: int
    create_schema: bool
    history_seconds: float | None = None
    history_max_events: int = 10000
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    deferred_state: bool = True
    on_lease_lost: LeaseLostPolicy = "continue"
    enforce_eager: bool = False
    parking: ParkingSettings = field(default_factory=ParkingSettings)
    redis_key_prefix: str = "caps"
    redis_master_name: str | None = None
    redis_allow_eviction: bool = False
    #: The deployment this app's store handles serve (``caps_deployment``, or derived from the broker).
    deployment: str = ""

    @property
    def store_options(self) -> StoreOptions:
        """The settings a store is built with besides ``caps_url``."""
        from .stores import StoreOptions

        return StoreOptions(
            self.create_schema,
            self.redis_key_prefix,
            self.redis_master_name,
            redis_allow_eviction=self.redis_allow_eviction,
            deployment=self.deployment,
        )

    @property
    def renew_seconds(self) -> float:
        """How often a process renews its leases: a third of the lease, so that two renewals can
        fail before one expires."""
        return self.lease_seconds / 3

    @property
    def dispatch_lease_seconds(self) -> float:
        """How long a dispatch waits for its copy before recovery dispatches the task again: a
        lease (a copy that sits longer in a prefetch buffer or a broker backlog is dispatched
        again, and the tombstone of its claim ends the late one)."""
        return self.lease_seconds

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> CapsSettings:
        """Read and check the settings; raise :class:`ConfigurationError` naming a bad one."""
        lease = cast(float, _number(conf, "caps_lease_seconds"))
        backoff_min = cast(float, _number(conf, "caps_backoff_min_seconds"))
        backoff_max = cast(float, _number(conf, "caps_backoff_max_seconds"))
        if backoff_max < backoff_min:
            raise ConfigurationError(
                f"caps_backoff_max_seconds ({backoff_max}) is below caps_backoff_min_seconds ({backoff_min})"
            )
        policy = conf.get("caps_on_store_error", DEFAULTS["caps_on_store_error"])
        if policy not in STORE_ERROR_POLICIES:
            raise ConfigurationError(
                f"caps_on_store_error must be one of {', '.join(STORE_ERROR_POLICIES)}, got {policy!r}"
            )
        lease_lost = conf.get("caps_on_lease_lost", DEFAULTS["caps_on_lease_lost"])
        if lease_lost not in LEASE_LOST_POLICIES:
            raise ConfigurationError(
                f"caps_on_lease_lost must be one of {', '.join(LEASE_LOST_POLICIES)}, got {lease_lost!r}"
            )
        sweep_interval = conf.get("caps_sweep_interval_seconds", DEFAULTS["caps_sweep_interval_seconds"])
        sweep_interval = None if sweep_interval in (None, 0) else _number(conf, "caps_sweep_interval_seconds")
        threshold = _positive_int(conf, "caps_key_warning_threshold")
        create_schema = _flag(conf, "caps_create_schema")
        history_seconds = conf.get("caps_history_seconds", DEFAULTS["caps_history_seconds"])
        history_seconds = None if history_seconds in (None, 0) else _number(conf, "caps_history_seconds")
        history_max_events = _positive_int(conf, "caps_history_max_events")
        metrics_port = conf.get("caps_metrics_port", DEFAULTS["caps_metrics_port"])
        if metrics_port is not None and (
            isinstance(metrics_port, bool) or not isinstance(metrics_port, int) or not 0 < metrics_port < 65536
        ):
            raise ConfigurationError(f"caps_metrics_port must be a TCP port (1-65535) or None, got {metrics_port!r}")
        metrics_address = conf.get("caps_metrics_address", DEFAULTS["caps_metrics_address"])
        if not isinstance(metrics_address, str) or not metrics_address:
            raise ConfigurationError(f"caps_metrics_address must be a host name or address, got {metrics_address!r}")
        key_prefix = conf.get("caps_redis_key_prefix", DEFAULTS["caps_redis_key_prefix"])
        if not isinstance(key_prefix, str) or not key_prefix:
            raise ConfigurationError(f"caps_redis_key_prefix must be a non-empty string, got {key_prefix!r}")
        master_name = conf.get("caps_redis_master_name", DEFAULTS["caps_redis_master_name"])
        if master_name is not None and (not isinstance(master_name, str) or not master_name):
            raise ConfigurationError(f"caps_redis_master_name must be a non-empty string or None, got {master_name!r}")
        return cls(
            url=conf.get("caps_url"),
            lease_seconds=lease,
            backoff_min_seconds=backoff_min,
            backoff_max_seconds=backoff_max,
            max_wait_seconds=_number(conf, "caps_max_wait_seconds", optional=True),
            on_store_error=policy,
            sweep_interval_seconds=sweep_interval,
            key_warning_threshold=threshold,
            create_schema=create_schema,
            history_seconds=history_seconds,
            history_max_events=history_max_events,
            metrics_port=metrics_port,
            metrics_address=metrics_address,
            deferred_state=_flag(conf, "caps_deferred_state"),
            on_lease_lost=lease_lost,
            enforce_eager=_flag(conf, "caps_enforce_eager"),
            parking=ParkingSettings.from_conf(conf),
            redis_key_prefix=key_prefix,
            redis_master_name=master_name,
            redis_allow_eviction=_flag(conf, "caps_redis_allow_eviction"),
            deployment=_deployment(conf),
        )

    def require_url(self) -> Any:
        """``caps_url``, or a :class:`ConfigurationError` saying capped tasks cannot run without it."""
        if self.url is None or self.url == "":
            raise ConfigurationError(
                "caps_url is not set: capped tasks cannot run uncapped. Set app.conf.caps_url "
                "(for example 'sqlite:////absolute/path/caps.db' or 'postgresql+psycopg://user@host/db')"
            )
        return self.url
