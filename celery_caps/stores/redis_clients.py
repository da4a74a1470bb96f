"""The redis-py client under the Redis store: built from ``caps_url`` or taken as given.

Three topologies, each from a URL or a ready object:

=====================  ==================================================  ==========================
topology               URL                                                 ready object
=====================  ==================================================  ==========================
one server             ``redis://``, ``rediss://``, ``unix://``,           ``redis.Redis``
                       ``redis+unix://``
Redis Cluster          ``redis+cluster://host:port[,host:port...]``        ``redis.cluster.RedisCluster``
                       (``rediss+cluster://`` with TLS)
Redis Sentinel         ``sentinel://host:port[;sentinel://host:port...]``  ``redis.sentinel.Sentinel``
                       with ``?master_name=...`` (Celery's form)           (with the master name), or
                                                                           its ``master_for(...)`` client
=====================  ==================================================  ==========================

What the store needs from this module is a :class:`RedisTarget`: how to build the client (a
cluster client connects while it is built, so the store builds it on first use, where a
failure is a store error like any other), whether it is a cluster (every key then needs one
hash tag), a description safe to log and the secrets never to show; and what the servers the
store writes to say of their settings (:func:`primary_infos`), and what their eviction policy
means for the store (:func:`eviction_findings`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
import redis.cluster
import redis.sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url as _redis_parse_url

from ..errors import ConfigurationError
from .base import mask_url, secret_parameter

#: Connection settings for clients the store creates, unless the URL sets them.  A store that
#: hangs for long keeps a task from being put back; Redis answers the store's scripts in well
#: under a second.
CLIENT_DEFAULTS: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
#: Retries for clients the store creates: a connection reset or a failover blip is retried a few
#: times within a fraction of a second; a real outage is reported as a StoreError at once, so the
#: task goes back to the broker instead of stalling the worker.  (Replaying a script whose reply
#: was lost is safe: see ``RedisStore.acquire``.)
RETRIES = 3
RETRY_BACKOFF_BASE_SECONDS = 0.01
RETRY_BACKOFF_CAP_SECONDS = 0.1

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("sentinel",)
#: A sentinel's port when the URL names none (Redis Sentinel's own default).
SENTINEL_DEFAULT_PORT = 26379
#: Query parameters of a ``sentinel://`` URL that are not connection settings of the master.
_SENTINEL_PARAMETERS = ("master_name", "sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class RedisTarget:
    """A client to build (or built), and what the store says about it."""

    #: Builds the client; called once, on first use.
    connect: Callable[[], Any]
    #: Where the client goes, for logs and ``celery caps``; never a password.
    description: str
    #: Whether the store created the client (and so closes it).
    owned: bool
    #: Whether it is a Redis Cluster client: every key of the store needs one hash tag.
    cluster: bool
    #: Strings never to show in a message.
    secrets: tuple[str, ...] = ()


def parse_url(url: str) -> dict[str, Any]:
    """redis-py's reading of a URL: host, port, db, credentials and typed query options."""
    return dict(_redis_parse_url(url))  # type: ignore[no-untyped-call]


def _retry() -> redis.retry.Retry:
    backoff = ExponentialWithJitterBackoff(RETRY_BACKOFF_CAP_SECONDS, RETRY_BACKOFF_BASE_SECONDS)
    return redis.retry.Retry(backoff, RETRIES)


def _scrub(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def _bad_url(description: str, reason: str, secrets: Sequence[str] = ()) -> ConfigurationError:
    return ConfigurationError(_scrub(f"caps_url {description!r} is not a valid Redis URL: {reason}", secrets))


def _check_connection_options(description: str, options: dict[str, Any], secrets: Sequence[str]) -> None:
    """Refuse an option no redis-py connection takes (``?cluster=true``) now, naming it, rather
    than as a bare ``TypeError`` at the first command."""
    options = dict(options)
    connection_class = options.pop("connection_class", redis.connection.Connection)
    try:
        connection_class(**options)
    except (TypeError, ValueError) as exc:
        raise _bad_url(description, str(exc), secrets) from exc


def hash_tagged(prefix: str) -> str:
    """``prefix`` with a Redis Cluster hash tag: as it is if it has one (a ``{...}`` with something
    inside, which Cluster hashes instead of the whole key), else wrapped in braces.  Every key of
    the store starts with the prefix, so all of them, and every script's keys, share one hash slot."""
    start = prefix.find("{")
    # Cluster reads the first "}" after the first "{"; an empty tag ("{}") means no tag.
    if start != -1 and prefix.find("}", start + 1) > start + 1:
        return prefix
    return "{" + prefix + "}"


# -- from a URL ----------------------------------------------------------------------------


def target_from_url(url: str, *, master_name: str | None = None) -> RedisTarget:
    """The client of ``caps_url`` (see the module docstring for the forms).

    ``master_name`` is ``caps_redis_master_name``: the Sentinel master's name when the URL has no
    ``master_name`` parameter.

    Raises:
        ConfigurationError: the URL cannot be used (the message shows it masked).
    """
    scheme = url.split("://", 1)[0].lower()
    if scheme in CLUSTER_SCHEMES:
        return _cluster_from_url(url)
    if scheme in SENTINEL_SCHEMES:
        return _sentinel_from_url(url, master_name)
    return _server_from_url(url)


def _password_of(url: str) -> tuple[str, ...]:
    try:
        parts = urlsplit(url)
        secrets = [unquote(parts.password)] if parts.password else []
    except ValueError:
        return ()
    secrets += [value for name, value in parse_qsl(parts.query) if secret_parameter(name) and value]
    return tuple(secrets)


def _server_from_url(url: str) -> RedisTarget:
    description = mask_url(url)
    secrets = _password_of(url)
    # redis-py knows unix://, and ``redis+unix://`` is the same socket URL.
    redis_url = "unix://" + url[len("redis+unix://") :] if url.lower().startswith("redis+unix://") else url
    try:
        options = parse_url(redis_url)
    except (ValueError, TypeError) as exc:
        raise _bad_url(description, str(exc), secrets) from exc
    _check_connection_options(description, options, secrets)

    def connect() -> redis.Redis:
        return redis.Redis.from_url(redis_url, retry=_retry(), **CLIENT_DEFAULTS)

    return RedisTarget(connect, description, owned=True, cluster=False, secrets=secrets)


def _cluster_from_url(url: str) -> RedisTarget:
    """``redis+cluster://[[user]:password@]host:port[,host:port...][/0][?option=value...]``: the
    nodes are where the client starts discovering the cluster (any one of them is enough)."""
    scheme, rest = url.split("://", 1)
    secrets = _password_of(url)
    description = mask_url(url)
    location, _, query = rest.partition("?")
    netloc, _, path = location.partition("/")
    credentials, _, hosts = netloc.rpartition("@")
    nodes = [node for node in hosts.split(",") if node]
    if not nodes:
        raise _bad_url(description, "no cluster node given (redis+cluster://host:port[,host:port...])")
    # Each node as a URL of its own, read by redis-py: host, port, and the shared options.
    base_scheme = "rediss" if scheme.lower().startswith("rediss") else "redis"
    tail = f"/{path}" + (f"?{query}" if query else "")
    node_urls = [f"{base_scheme}://{credentials + '@' if credentials else ''}{node}{tail}" for node in nodes]
    try:
        parsed = [parse_url(node_url) for node_url in node_urls]
    except (ValueError, TypeError) as exc:
        raise _bad_url(description, str(exc), secrets) from exc
    options = {key: value for key, value in parsed[0].items() if key not in ("host", "port")}
    if options.pop("db", 0) != 0:
        raise _bad_url(description, "Redis Cluster has database 0 only: leave the path out, or use /0")
    if "path" in options:
        raise _bad_url(description, "Redis Cluster is reached over TCP, not a unix socket")
    unknown = sorted(set(options) - set(redis.cluster.REDIS_ALLOWED_KEYS))
    if unknown:
        raise _bad_url(description, f"unknown option(s) {', '.join(unknown)} for a Redis Cluster client")
    _check_connection_options(description, options, secrets)
    if any(node.get("port") is None for node in parsed):
        raise _bad_url(description, "every cluster node needs host:port")
    startup = [(str(node["host"]), int(node["port"])) for node in parsed]

    def connect() -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(
            startup_nodes=[
                redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in startup
            ],
            retry=_retry(),
            **{**CLIENT_DEFAULTS, **options},
        )

    return RedisTarget(connect, description, owned=True, cluster=True, secrets=secrets)


def _sentinel_from_url(url: str, master_name: str | None) -> RedisTarget:
    """``sentinel://[[user]:password@]host[:port][/db][;sentinel://host[:port]...][?option=...]``,
    the form Celery's Redis backend and kombu accept: every part names one sentinel; the
    credentials and database (of the master, not of the sentinels) and the options are read from
    whichever part has them.  ``master_name`` (here or ``caps_redis_master_name``) names the
    master; ``sentinel_password`` (and ``sentinel_username``) authenticate to the sentinels."""
    secrets = _password_of(url)
    for part in url.split(";"):
        secrets += _password_of(part)
    parts = [part.strip() for part in url.split(";") if part.strip()]
    hosts: list[tuple[str, int]] = []
    options: dict[str, Any] = {}
    sentinel_options: dict[str, str] = {}
    name_in_url: str | None = None
    for part in parts:
        shown = mask_url(part)
        if not part.lower().startswith("sentinel://"):
            raise _bad_url(_sentinel_display(url), f"{shown!r} is not a sentinel://host:port URL", secrets)
        parsed_part = urlsplit(part)
        query = parse_qsl(parsed_part.query, keep_blank_values=True)
        own = {name: value for name, value in query if name in _SENTINEL_PARAMETERS}
        rest = urlencode([(name, value) for name, value in query if name not in _SENTINEL_PARAMETERS])
        if "master_name" in own:
            name_in_url = own.pop("master_name")
        sentinel_options.update(own)
        redis_url = "redis://" + part.split("://", 1)[1].split("?", 1)[0] + (f"?{rest}" if rest else "")
        try:
            node = parse_url(redis_url)
        except (ValueError, TypeError) as exc:
            raise _bad_url(_sentinel_display(url), str(exc), secrets) from exc
        hosts.append((str(node.pop("host", "localhost")), int(node.pop("port", None) or SENTINEL_DEFAULT_PORT)))
        for key, value in node.items():
            options.setdefault(key, value)
    description = _sentinel_display(url)
    if not hosts:
        raise _bad_url(description, "no sentinel given (sentinel://host:port[;sentinel://host:port...])")
    if name_in_url is not None and master_name is not None and name_in_url != master_name:
        raise ConfigurationError(
            f"caps_url {description!r} names the Sentinel master {name_in_url!r} but caps_redis_master_name "
            f"is {master_name!r}: set one of them"
        )
    name = name_in_url or master_name
    if not name:
        raise ConfigurationError(
            f"caps_url {description!r} names no Sentinel master: add ?master_name=<name> to the URL "
            "or set caps_redis_master_name"
        )
    _check_connection_options(description, options, secrets)
    sentinel_kwargs: dict[str, Any] = {key: value for key, value in options.items() if key.startswith("socket_")}
    sentinel_kwargs.setdefault("socket_timeout", CLIENT_DEFAULTS["socket_timeout"])
    sentinel_kwargs.setdefault("socket_connect_timeout", CLIENT_DEFAULTS["socket_connect_timeout"])
    if "sentinel_password" in sentinel_options:
        sentinel_kwargs["password"] = sentinel_options["sentinel_password"]
    if "sentinel_username" in sentinel_options:
        sentinel_kwargs["username"] = sentinel_options["sentinel_username"]
    description = _describe_sentinels(hosts, name, int(options.get("db", 0) or 0))

    def connect() -> Any:
        sentinel = redis.sentinel.Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **{**CLIENT_DEFAULTS, **options})
        return sentinel.master_for(name, retry=_retry())

    return RedisTarget(connect, description, owned=True, cluster=False, secrets=secrets)


def _sentinel_display(url: str) -> str:
    return ";".join(mask_url(part) for part in url.split(";"))


def _describe_sentinels(hosts: Sequence[tuple[str, int]], master_name: str, db: int) -> str:
    shown = ";".join(f"sentinel://{host}:{port}/{db}" for host, port in hosts)
    return f"{shown}?master_name={master_name}"


# -- from a ready object ---------------------------------------------------------------------


def target_from_client(client: Any, *, master_name: str | None = None) -> RedisTarget:
    """A ready redis-py object as the store's client: a ``Redis`` client (to one server, or a
    Sentinel ``master_for`` client), a ``RedisCluster``, or a ``Sentinel`` with ``master_name``
    (``caps_redis_master_name``), whose ``master_for`` client the store creates and owns.

    Raises:
        ConfigurationError: an asynchronous client, or a ``Sentinel`` without a master name.
    """
    module = type(client).__module__
    type_name = f"{module}.{type(client).__qualname__}"
    if module.startswith("redis.asyncio"):
        raise ConfigurationError(f"the Redis store needs a synchronous redis-py client, got {type_name}")
    if isinstance(client, redis.sentinel.Sentinel):
        if not master_name:
            raise ConfigurationError(
                "caps_url is a redis.sentinel.Sentinel: set caps_redis_master_name to the name of the master "
                "it watches (or pass sentinel.master_for(name))"
            )
        hosts = [_address(sentinel) for sentinel in client.sentinels]
        db = int(client.connection_kwargs.get("db", 0) or 0)
        secrets = _passwords(client.connection_kwargs, *(_kwargs_of(sentinel) for sentinel in client.sentinels))
        name = master_name

        def connect() -> Any:
            return client.master_for(name)

        return RedisTarget(connect, _describe_sentinels(hosts, name, db), owned=True, cluster=False, secrets=secrets)
    if isinstance(client, redis.cluster.RedisCluster):
        nodes = client.nodes_manager.startup_nodes.values()
        description = "redis+cluster://" + ",".join(f"{node.host}:{node.port}" for node in nodes)
        secrets = _passwords(client.nodes_manager.connection_kwargs)
        return RedisTarget(lambda: client, description, owned=False, cluster=True, secrets=secrets)
    if not hasattr(client, "register_script") or not hasattr(client, "execute_command"):
        raise ConfigurationError(
            f"the Redis store needs a redis-py client (redis.Redis, RedisCluster, Sentinel), got {type_name}"
        )
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, redis.sentinel.SentinelConnectionPool):
        manager = pool.sentinel_manager
        hosts = [_address(sentinel) for sentinel in manager.sentinels]
        db = int(pool.connection_kwargs.get("db", 0) or 0)
        secrets = _passwords(pool.connection_kwargs, *(_kwargs_of(sentinel) for sentinel in manager.sentinels))
        description = _describe_sentinels(hosts, str(pool.service_name), db)
        return RedisTarget(lambda: client, description, owned=False, cluster=False, secrets=secrets)
    options = _kwargs_of(client)
    db = options.get("db", 0)
    if options.get("path"):
        description = f"unix://{options['path']}?db={db}"
    elif options:
        description = f"redis://{options.get('host', '?')}:{options.get('port', '?')}/{db}"
    else:
        description = f"<{type(client).__name__}>"
    return RedisTarget(lambda: client, description, owned=False, cluster=False, secrets=_passwords(options))


def _kwargs_of(client: Any) -> dict[str, Any]:
    try:
        return dict(client.connection_pool.connection_kwargs)
    except AttributeError:
        return {}


def _address(client: Any) -> tuple[str, int]:
    options = _kwargs_of(client)
    return str(options.get("host", "?")), int(options.get("port", 0) or 0)


def _passwords(*options: dict[str, Any]) -> tuple[str, ...]:
    return tuple(value for kwargs in options for value in [kwargs.get("password")] if isinstance(value, str) and value)


# -- the servers a client writes to ------------------------------------------------------------


def primary_infos(client: Any, cluster: bool, section: str, description: str) -> list[tuple[str, dict[str, Any]]]:
    """``INFO <section>`` of every server ``client`` writes to, each with where it is: the one
    server of a client to one server (Sentinel's current master for a Sentinel client), every
    primary of a cluster (named by its address).  ``description`` is the target's description."""
    if not cluster:
        return [(description, dict(client.info(section)))]
    return [
        (f"{description} (node {node.name})", dict(client.info(section, target_nodes=node)))
        for node in sorted(client.get_primaries(), key=lambda node: str(node.name))
    ]


#: The ``maxmemory-policy`` under which Redis evicts none of the store's keys, and the prefixes of
#: the policies under which it may evict any key, or any key with a TTL (a tombstone).
SAFE_EVICTION_POLICY = "noeviction"
EVICTS_ANY_KEY = "allkeys-"
EVICTS_KEYS_WITH_TTL = "volatile-"
_EVICTS_ANY_KEY_RISK = (
    "an evicted lease lets a second task take a slot its holder still has (a cap is exceeded), an evicted waiting "
    "list loses its parked tasks"
)
_NO_EVICTION_FIX = (
    f"set maxmemory-policy {SAFE_EVICTION_POLICY} there (CONFIG SET maxmemory-policy {SAFE_EVICTION_POLICY}, "
    "and in its redis.conf), or give the store a Redis of its own that evicts nothing"
)


def eviction_findings(
    servers: Sequence[tuple[str, dict[str, Any]]], allow_eviction: bool, tombstones: str
) -> tuple[str | None, list[str]]:
    """What the ``maxmemory-policy`` of ``servers`` (:func:`primary_infos` of ``memory``) means for
    the store: a refusal (None if none: ``allkeys-*`` without ``allow_eviction``) and warnings
    (``volatile-*``, whose evictions reach the store's ``tombstones``; ``allkeys-*`` allowed; a
    policy unknown or unreadable: an ``unreadable`` entry says why)."""
    by_policy: dict[tuple[str, str], list[str]] = {}
    for where, info in servers:
        key = (str(info.get("maxmemory_policy", "")), str(info.get("unreadable", "")))
        by_policy.setdefault(key, []).append(where)
    refused, warnings = [], []
    for (policy, unreadable), places in sorted(by_policy.items()):
        at = f"the Redis server at {', '.join(places)}"
        if policy == SAFE_EVICTION_POLICY:
            continue
        if not policy:
            warnings.append(_eviction_unknown(at, unreadable or "INFO memory has no maxmemory_policy"))
        elif policy.startswith(EVICTS_ANY_KEY) and allow_eviction:
            warnings.append(
                f"{at} runs with maxmemory-policy {policy} (caps_redis_allow_eviction is True), so Redis may "
                f"evict any of the store's keys when it is short of memory: {_EVICTS_ANY_KEY_RISK}."
            )
        elif policy.startswith(EVICTS_ANY_KEY):
            refused.append(
                f"the slot store refuses {at}: its maxmemory-policy {policy} lets Redis evict any key when it "
                f"is short of memory, the store's included: {_EVICTS_ANY_KEY_RISK}. To fix it, "
                f"{_NO_EVICTION_FIX}; or set caps_redis_allow_eviction = True to run on it anyway, at that risk."
            )
        elif policy.startswith(EVICTS_KEYS_WITH_TTL):
            warnings.append(
                f"{at} runs with maxmemory-policy {policy}: when it is short of memory Redis may evict keys "
                f"that have a TTL, and the store's tombstones ({tombstones}) have one: a tombstone evicted early "
                f"lets a stale copy of a woken task run it again. To fix it, {_NO_EVICTION_FIX}."
            )
        else:
            warnings.append(_eviction_unknown(at, f"maxmemory-policy {policy} is not one the store knows"))
    return (" ".join(refused) or None), warnings


def _eviction_unknown(at: str, reason: str) -> str:
    return (
        f"{at}: {reason}. Unless its maxmemory-policy is {SAFE_EVICTION_POLICY}, Redis may evict the store's "
        f"keys when it is short of memory (allkeys-*: {_EVICTS_ANY_KEY_RISK}; volatile-*: a tombstone, and a "
        "stale copy of a woken task runs it again)."
    )
