"""The Celery project the benchmark workers run: ``celery -A benchmarks.benchapp worker``.

Configured by ``CAPS_BENCH_*`` environment variables (see :data:`ENV`), so each
benchmark starts workers with its own broker key prefix, store, caps settings and
cap names.  Workers consume no queue at start: the benchmark fills a fresh queue
first and then tells the workers to consume it (``add_consumer``), so every
trial starts from a full backlog.

Tasks come in pairs that differ only in the cap (``noop`` / ``noop_capped``,
``sleep`` / ``sleep_capped``, and ``load`` / ``load_capped``, whose cap binds and whose body
counts its runs in the side channel): same app, same worker, same settings.  The
utilisation tasks write one record per completed run to Redis (the side
channel): publish time (a message header that put-back copies keep), start and
end (``time.time()``, one machine), deferrals.  The record is pushed once the run has
ended (``task_postrun``, after ``CappedTask`` released the slot), so that the benchmark's
own bookkeeping does not lengthen the slot's occupancy or the hand-over it measures.
The utilisation part's baselines record their runs the same way: ``global_uncapped``
(``bench.global`` without its cap, for a dedicated queue whose worker's processes are the
cap) and the ``semaphore_*`` tasks, which take a slot of a hand-rolled Redis semaphore
(:data:`SEMAPHORE_TAKE`) and retry after :data:`SEMAPHORE_RETRY_SECONDS` while it is full.
Workers count every message they publish (the put-back and woken copies) with
``before_task_publish``, pushed after the run that published them, as its record.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
from celery import Celery, Task, signals
from redis.commands.core import Script

from celery_caps import Cap, CappedTask

#: Environment variables the app reads, with their defaults.
ENV: dict[str, str] = {
    "CAPS_BENCH_BROKER": "redis://127.0.0.1:6379/11",
    "CAPS_BENCH_CAPS_URL": "",
    "CAPS_BENCH_SIDE_URL": "redis://127.0.0.1:6379/11",
    "CAPS_BENCH_PREFIX": "benchx-",
    "CAPS_BENCH_LEASE": "30",
    "CAPS_BENCH_BACKOFF_MIN": "0.5",
    "CAPS_BENCH_BACKOFF_MAX": "20",
    "CAPS_BENCH_GLOBAL_LIMIT": "4",
    "CAPS_BENCH_TENANT_LIMIT": "1",
    "CAPS_BENCH_PREFETCH": "4",
    "CAPS_BENCH_EXTRA_CONF": "",  # "name=value;name=value" (numbers or strings), e.g. a strategy's settings
    "CAPS_BENCH_MEMORY_PROBE": "",  # a directory: pool processes report their memory there on SIGUSR2
    "CAPS_BENCH_STEPS": "",  # "1": time each step of every hand-over (benchmarks/handover.py)
}

#: The message header that carries the publish time (seconds since the epoch).
PUBLISHED_HEADER = "bench_published_at"
#: Caps that never bind in the overhead benchmark.
WIDE_LIMIT = 1_000_000
#: The countdown of a ``semaphore_*`` task's retry while its semaphore is full, seconds.
SEMAPHORE_RETRY_SECONDS = 0.2
#: Takes a slot of a hand-rolled semaphore, as users write one: ``KEYS[1]`` is the semaphore, a
#: sorted set of its holders (member: a task id, score: when its hold expires); ``ARGV``: now,
#: the new hold's expiry, the limit, the task id.  Drops the expired holders and adds the task
#: if fewer than the limit remain; returns 1 if it did, 0 if the semaphore is full.
SEMAPHORE_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
    redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
    return 1
end
return 0
"""


def setting(env: Mapping[str, str], name: str) -> str:
    return env.get(name) or ENV[name]


def side_keys(prefix: str) -> dict[str, str]:
    """Redis keys of the side channel."""
    return {
        "runs": f"{prefix}side:runs",
        "publishes": f"{prefix}side:publishes",
        "library": f"{prefix}side:library",
        "done": f"{prefix}side:done",
        "steps": f"{prefix}side:steps",
    }


def semaphore_key(prefix: str, name: str) -> str:
    """The side channel's key of the hand-rolled semaphore ``name`` (``*``: a pattern of them all)."""
    return f"{prefix}side:semaphore:{name}"


def _parse_extra(text: str) -> dict[str, Any]:
    conf: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, value = item.partition("=")
        if value.strip() in ("True", "False"):
            conf[name.strip()] = value.strip() == "True"
            continue
        try:
            conf[name.strip()] = float(value) if "." in value or "e" in value else int(value)
        except ValueError:
            conf[name.strip()] = value
    return conf


def make_app(env: Mapping[str, str]) -> Celery:
    prefix = setting(env, "CAPS_BENCH_PREFIX")
    broker = setting(env, "CAPS_BENCH_BROKER")
    app = Celery(f"bench-{prefix}", broker=broker, set_as_current=True)
    transport_options: dict[str, Any] = {}
    if broker.startswith("redis"):
        transport_options = {"global_keyprefix": f"{prefix}kombu:"}
    conf: dict[str, Any] = {
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "control_exchange": f"{prefix}celery",
        "event_exchange": f"{prefix}celeryev",
        "task_default_queue": f"{prefix}idle",
        "task_ignore_result": True,
        # Capped tasks acknowledge late; the uncapped twins must too, for a fair comparison.
        "task_acks_late": True,
        "worker_prefetch_multiplier": int(setting(env, "CAPS_BENCH_PREFETCH")),
        "worker_hijack_root_logger": False,
        "caps_lease_seconds": float(setting(env, "CAPS_BENCH_LEASE")),
        "caps_backoff_min_seconds": float(setting(env, "CAPS_BENCH_BACKOFF_MIN")),
        "caps_backoff_max_seconds": float(setting(env, "CAPS_BENCH_BACKOFF_MAX")),
        "caps_sweep_interval_seconds": None,
    }
    caps_url = setting(env, "CAPS_BENCH_CAPS_URL")
    if caps_url:
        conf["caps_url"] = caps_url
    conf.update(_parse_extra(setting(env, "CAPS_BENCH_EXTRA_CONF")))
    app.conf.update(conf)
    _define_tasks(app, prefix, env)
    return app


class _SideChannel:
    """One Redis connection per process (a prefork child must not share its parent's), and the
    hand-rolled semaphores on it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pid = -1
        self._client: redis.Redis | None = None
        self._take: Script | None = None

    @property
    def client(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(self.url)
            self._take = self._client.register_script(SEMAPHORE_TAKE)
            self._pid = os.getpid()
        return self._client

    def take_slot(self, key: str, limit: int, holder: str, hold_seconds: float) -> bool:
        """Whether ``holder`` took a slot of the semaphore ``key`` (one ``EVALSHA``); False if
        ``limit`` unexpired holders hold them all."""
        client = self.client
        assert self._take is not None
        now = time.time()
        return bool(self._take(keys=[key], args=[now, now + hold_seconds, limit, holder], client=client))


def _header(request: Any, name: str) -> Any:
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name)
    return value if value is not None else getattr(request, name, None)


def _define_tasks(app: Celery, prefix: str, env: Mapping[str, str]) -> None:
    side = _SideChannel(setting(env, "CAPS_BENCH_SIDE_URL"))
    keys = side_keys(prefix)
    wide = Cap(f"{prefix}wide", WIDE_LIMIT)
    global_limit = int(setting(env, "CAPS_BENCH_GLOBAL_LIMIT"))
    tenant_limit = int(setting(env, "CAPS_BENCH_TENANT_LIMIT"))
    global_cap = Cap(f"{prefix}global", global_limit)
    tenant_cap = Cap(f"{prefix}tenant", tenant_limit, key=lambda tenant, ms: tenant)
    # The global cap's twin served in turn across tenants (the fairness part).
    fair_cap = Cap(f"{prefix}fair", global_limit, fair_by=lambda tenant, ms: tenant)

    @app.task(name="bench.noop", base=Task, shared=False)
    def noop() -> None:
        return None

    @app.task(name="bench.noop_capped", base=CappedTask, cap=wide, shared=False)
    def noop_capped() -> None:
        return None

    @app.task(name="bench.sleep", base=Task, shared=False)
    def sleep(ms: float) -> None:
        time.sleep(ms / 1000)

    @app.task(name="bench.sleep_capped", base=CappedTask, cap=wide, shared=False)
    def sleep_capped(ms: float) -> None:
        time.sleep(ms / 1000)

    def load_body(ms: float, data: str) -> None:
        time.sleep(ms / 1000)
        side.client.incr(keys["done"])

    # The memory part's pair: one body, with and without a binding cap (``data``: the payload).
    @app.task(name="bench.load", base=Task, shared=False)
    def load(ms: float, data: str) -> None:
        load_body(ms, data)

    @app.task(name="bench.load_capped", base=CappedTask, cap=global_cap, shared=False)
    def load_capped(ms: float, data: str) -> None:
        load_body(ms, data)

    # Records of runs whose body ended, pushed by task_postrun (after the slot's release).
    pending: dict[str, str] = {}

    def record(task: Any, tenant: str, ms: float, deferrals: int | None = None) -> None:
        """Sleep ``ms`` and keep the run's record for task_postrun; ``deferrals``: how often the
        task was put back (default: its ``caps_deferrals`` header)."""
        start = time.time()
        time.sleep(ms / 1000)
        end = time.time()
        request = task.request
        published = float(_header(request, PUBLISHED_HEADER) or 0.0)
        if deferrals is None:
            deferrals = int(_header(request, "caps_deferrals") or 0)
        # How the run got its slots: a dispatched message (woken, or admitted when sent), or
        # admission on arrival.
        via = "dispatch" if _header(request, "caps_dispatch_run_id") else "admission"
        times = f"{published:.6f} {start:.6f} {end:.6f}"
        pending[request.id] = f"{request.id} {tenant} {times} {deferrals} {os.getpid()} {via}"

    @app.task(name="bench.global", base=CappedTask, cap=global_cap, bind=True, shared=False)
    def global_task(self: Any, tenant: str, ms: float) -> None:
        record(self, tenant, ms)

    @app.task(name="bench.global_fair", base=CappedTask, cap=fair_cap, bind=True, shared=False)
    def global_fair_task(self: Any, tenant: str, ms: float) -> None:
        record(self, tenant, ms)

    @app.task(name="bench.tenant", base=CappedTask, cap=tenant_cap, bind=True, shared=False)
    def tenant_task(self: Any, tenant: str, ms: float) -> None:
        record(self, tenant, ms)

    # The soak part's task: under the global cap and its tenant's at once.
    @app.task(name="bench.soak", base=CappedTask, cap=[global_cap, tenant_cap], bind=True, shared=False)
    def soak_task(self: Any, tenant: str, ms: float) -> None:
        record(self, tenant, ms)

    # bench.global without its cap: the dedicated queue's baseline (a worker's -c is the cap).
    @app.task(name="bench.global_uncapped", base=Task, bind=True, shared=False)
    def global_uncapped_task(self: Any, tenant: str, ms: float) -> None:
        record(self, tenant, ms)

    hold_seconds = float(setting(env, "CAPS_BENCH_LEASE"))

    def with_semaphore(task: Any, name: str, limit: int, tenant: str, ms: float) -> None:
        """Run ``record`` holding a slot of the semaphore ``name``; retry the task if it is full."""
        key = semaphore_key(prefix, name)
        holder = task.request.id
        if not side.take_slot(key, limit, holder, hold_seconds):
            raise task.retry(countdown=SEMAPHORE_RETRY_SECONDS)
        try:
            record(task, tenant, ms, deferrals=task.request.retries)
        finally:
            side.client.zrem(key, holder)

    # A hand-rolled Redis semaphore: the global cap's and the per-tenant cap's.
    @app.task(name="bench.semaphore_global", base=Task, bind=True, max_retries=None, shared=False)
    def semaphore_global_task(self: Any, tenant: str, ms: float) -> None:
        with_semaphore(self, "global", global_limit, tenant, ms)

    @app.task(name="bench.semaphore_tenant", base=Task, bind=True, max_retries=None, shared=False)
    def semaphore_tenant_task(self: Any, tenant: str, ms: float) -> None:
        with_semaphore(self, f"tenant:{tenant}", tenant_limit, tenant, ms)

    if os.environ.get("CAPS_BENCH_WORKER") == "1":
        import celery_caps

        # Which celery_caps the workers run (the benchmark checks it is the one it measures).
        side.client.set(keys["library"], str(Path(celery_caps.__file__).resolve()))

        # Publishes counted, per routing key, not yet pushed (see count_publish).
        published: dict[str, int] = {}

        def push_publishes() -> None:
            counts = dict(published)
            published.clear()
            if counts:
                pipe = side.client.pipeline(transaction=False)
                for routing_key, count in counts.items():
                    pipe.hincrby(keys["publishes"], routing_key, count)
                pipe.execute()

        @signals.task_postrun.connect(weak=False)
        def push_record(task_id: str | None = None, **_: Any) -> None:
            line = pending.pop(task_id or "", None)
            if line is not None:
                side.client.rpush(keys["runs"], line)
            push_publishes()

        probe_directory = setting(env, "CAPS_BENCH_MEMORY_PROBE")
        if probe_directory:

            @signals.worker_process_init.connect(weak=False)
            def install_probe(**_: Any) -> None:
                from .memory_probe import install

                install(probe_directory)

        if setting(env, "CAPS_BENCH_STEPS") == "1":
            from .steps import install_step_probe

            install_step_probe(lambda: side.client, keys["steps"])

        @signals.before_task_publish.connect(weak=False)
        def count_publish(sender: Any = None, routing_key: Any = None, **_: Any) -> None:
            # In a worker, every publish is a put-back or a woken copy.  One published by a run
            # (its put-back, or the wake of its release) is pushed after the run, as its record:
            # a round trip to the side channel here would lengthen the hand-over measured.
            published[str(routing_key)] = published.get(str(routing_key), 0) + 1
            if app.current_worker_task is None:  # the main process's (recovery's)
                push_publishes()


app = make_app(os.environ)
