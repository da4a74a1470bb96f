"""The slot stores, and choosing one from ``caps_url``.

A store is picked by the URL's scheme from a registry (:func:`register_store`), so that
``base.py`` knows no store and a custom store can take a scheme of its own; a ready
SQLAlchemy ``Engine``, redis-py client or :class:`~celery_caps.stores.base.SlotStore`
is accepted too.  Stores are imported when first chosen: a missing driver is a
:class:`~celery_caps.errors.MissingDependencyError` naming the extra to install.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError, MissingDependencyError
from .base import SlotStore, mask_url


@dataclass(frozen=True)
class StoreOptions:
    """The settings a store is built with besides ``caps_url`` (each store reads its own)."""

    #: ``caps_create_schema``: whether the SQL store creates its tables on first use.
    create_schema: bool = True
    #: ``caps_redis_key_prefix``: the prefix of the Redis store's keys (with a hash tag on Redis Cluster).
    redis_key_prefix: str = "caps"
    #: ``caps_redis_master_name``: the Sentinel master of a ``sentinel://`` URL without
    #: ``?master_name=``, or of a ``redis.sentinel.Sentinel`` object.
    redis_master_name: str | None = None
    #: ``caps_redis_allow_eviction``: run the Redis store on a server whose ``maxmemory-policy`` may
    #: evict any key (``allkeys-*``), with a warning, rather than refuse it.
    redis_allow_eviction: bool = False
    #: ``caps_deployment``: the deployment the store's handle serves (see ``SlotStore.deployment``).
    deployment: str = ""


#: Builds a store from ``caps_url`` (a URL or a ready object) and the store settings.
StoreFactory = Callable[[Any, StoreOptions], SlotStore]

#: URL scheme (before any ``+driver``) -> the factory of its store.
_SCHEMES: dict[str, StoreFactory] = {}


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Make ``caps_url = "<scheme>://..."`` build its store with ``factory(url, options)``
    (:class:`StoreOptions`)."""
    _SCHEMES[scheme.lower()] = factory


def store_from_url(target: Any, options: StoreOptions | None = None, *, create_schema: bool = True) -> SlotStore:
    """Build a store from ``caps_url``: a URL, a ready SQLAlchemy ``Engine``, a redis-py
    client (``Redis``, ``RedisCluster``, ``Sentinel``), or a :class:`SlotStore` instance
    (returned as is, with the deployment it was given).  A store built here serves the
    deployment of ``options`` (``caps_deployment``).

    ``options`` are the store settings (``CapsSettings.store_options``); without them,
    the defaults with ``create_schema`` (whether the SQL store creates its tables on
    first use).

    Raises:
        ConfigurationError: an unknown scheme or driver, or an unsupported object (the
            message names it, never the credentials).
        MissingDependencyError: the store needs an extra that is not installed.
    """
    if isinstance(target, SlotStore):
        return target  # with the deployment its maker gave it
    options = options if options is not None else StoreOptions(create_schema=create_schema)
    store = _build(target, options)
    store.deployment = options.deployment
    return store


def _build(target: Any, options: StoreOptions) -> SlotStore:
    if isinstance(target, str):
        scheme = target.split("://", 1)[0].lower() if "://" in target else ""
        factory = _SCHEMES.get(scheme.split("+", 1)[0]) or _SCHEMES.get(scheme)
        if factory is None:
            raise ConfigurationError(
                f"caps_url {mask_url(target)!r}: unknown store scheme {scheme or '(none)'!r}; use "
                f"{', '.join(f'{name}://' for name in sorted(_SCHEMES))} (for example sqlite:////abs/path/caps.db, "
                "postgresql+psycopg://..., mysql+pymysql://..., redis://..., redis+cluster://..., sentinel://...)"
            )
        return factory(target, options)
    type_name = f"{type(target).__module__}.{type(target).__qualname__}"
    if type_name.startswith("sqlalchemy.") and hasattr(target, "dialect"):
        return _sql_store(target, options)
    if type_name.startswith("redis."):
        return _redis_store(target, options)
    raise ConfigurationError(
        f"caps_url must be a store URL, a SQLAlchemy Engine, a redis-py client (Redis, RedisCluster, Sentinel) "
        f"or a SlotStore, got {type_name}"
    )


def _memory_store(target: Any, options: StoreOptions) -> SlotStore:
    from .memory import MemoryStore

    return MemoryStore()


def _sql_store(target: Any, options: StoreOptions) -> SlotStore:
    from .sql import sql_store

    return sql_store(target, create_schema=options.create_schema)


def _redis_store(target: Any, options: StoreOptions) -> SlotStore:
    try:
        from .redis import RedisStore
    except ImportError as exc:
        raise MissingDependencyError(
            f'the Redis store needs redis-py: pip install "celery-caps[redis]" ({exc})'
        ) from exc
    return RedisStore(
        target,
        key_prefix=options.redis_key_prefix,
        master_name=options.redis_master_name,
        allow_eviction=options.redis_allow_eviction,
    )


register_store("memory", _memory_store)
for _scheme in ("sqlite", "postgresql", "postgres", "mysql", "mariadb"):
    register_store(_scheme, _sql_store)
for _scheme in ("redis", "rediss", "redis+unix", "unix", "redis+cluster", "rediss+cluster", "sentinel"):
    register_store(_scheme, _redis_store)
