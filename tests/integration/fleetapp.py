"""The Celery project that integration-test workers run: ``celery -A tests.integration.fleetapp worker``.

Everything comes from ``CAPS_FLEET_*`` environment variables (see :data:`ENV`),
so each test starts workers with its own broker, store, queue names and cap
names, and never shares them with another test run on the same servers.

Task bodies record what ran and when in Redis, *independently of celery-caps*
(:class:`Recorder`): a Lua script adds the run to a "live" hash per counter
(``provider``, ``tenant:<t>``, ``one:<scope>``), and raises the counter's
recorded peak in the same atomic step; on exit it removes the run and counts
the task id's completion.  Start and end times come from Redis ``TIME`` (one
clock for every worker), so tests can also rebuild concurrency from intervals.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
from celery import Celery, signals

from celery_caps import Cap, CappedTask

#: Environment variables the app reads, with their defaults (None: unset).
ENV: dict[str, str | None] = {
    "CAPS_FLEET_BROKER": "memory://",
    "CAPS_FLEET_BACKEND": None,
    "CAPS_FLEET_CAPS_URL": None,  # unset: the app has no caps_url
    "CAPS_FLEET_COUNTER_URL": "redis://127.0.0.1:6379/13",
    "CAPS_FLEET_PREFIX": "tfleet-",
    # The prefix of the caps' names (so of their slots); unset: CAPS_FLEET_PREFIX.  Two fleets
    # given the same one share their caps in a shared store, as two deployments of one project do.
    "CAPS_FLEET_CAP_PREFIX": None,
    "CAPS_FLEET_LEASE": "5",
    "CAPS_FLEET_BACKOFF_MIN": "0.05",
    "CAPS_FLEET_BACKOFF_MAX": "1.0",
    "CAPS_FLEET_MAX_WAIT": None,
    "CAPS_FLEET_PREFETCH": "1",  # worker_prefetch_multiplier (Celery's default is 4)
    "CAPS_FLEET_ROUTES": None,  # task_routes, as JSON ({"fleet.hold": "<queue>"})
    "CAPS_FLEET_CONF": None,  # more Celery settings, as JSON ({"task_acks_late": false}), applied last
    "CAPS_FLEET_ON_STORE_ERROR": None,
    "CAPS_FLEET_ON_LEASE_LOST": None,
    "CAPS_FLEET_VISIBILITY_TIMEOUT": None,  # Redis broker only
    "CAPS_FLEET_PROVIDER_LIMIT": "4",
    "CAPS_FLEET_TENANT_LIMIT": "2",
    # caps_strategy: the fleet tests of put-backs are written for "backoff" (the tests of park
    # say "park"); workers count their publishes (put-backs and wakes).
    "CAPS_FLEET_STRATEGY": "backoff",
}


def setting(env: Mapping[str, str], name: str) -> str | None:
    """``env[name]``, or its default from :data:`ENV`."""
    value = env.get(name)
    return value if value not in (None, "") else ENV[name]


#: The name (after the fleet's prefix) of ``fleet.odd``'s cap: quotes, ``%``, ``_``, braces, a
#: backslash, a space and non-ASCII, all allowed in a cap name.
ODD_CAP_NAME = "odd 'q\"%_{}\\ü🚀"


def odd_key(kind: str, value: Any = None, *_: Any, **__: Any) -> Any:
    """The key function of ``fleet.odd``, told by the task's arguments what to do.

    ``("key", v)`` returns ``v`` as sent (a string, None, an int...); ``("chars", [code
    points])`` returns the string they spell (NUL, a lone surrogate: what a message
    serializer would not carry); ``("repeat", [text, n])`` returns ``text * n`` (a 10 MB
    key without a 10 MB message); ``("raise", [text, n])`` raises ``ValueError(text * n)``.
    """
    if kind == "chars":
        return "".join(chr(code) for code in value)
    if kind == "repeat":
        text, times = value
        return text * times
    if kind == "raise":
        text, times = value
        raise ValueError(text * times)
    return value


def queue_name(prefix: str, extra: bool = False) -> str:
    """The default queue (or the second, "extra" one) of the fleet with ``prefix``."""
    return f"{prefix}q-extra" if extra else f"{prefix}q"


# -- the recorder ------------------------------------------------------------------

# KEYS: runs, peaks, starts, live:<counter>...; ARGV: token, meta (JSON), task id, counters...
_ENTER = """
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
local sizes = {}
for i = 4, #KEYS do
  redis.call('HSET', KEYS[i], ARGV[1], ARGV[2])
  local n = redis.call('HLEN', KEYS[i])
  local counter = ARGV[i]
  local peak = tonumber(redis.call('HGET', KEYS[2], counter) or '0')
  if n > peak then redis.call('HSET', KEYS[2], counter, n) end
  sizes[#sizes + 1] = n
end
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return sizes
"""

# KEYS: ends, done, completed, live:<counter>...; ARGV: token, task id, completed (0/1)
_EXIT = """
local t = redis.call('TIME')
for i = 4, #KEYS do redis.call('HDEL', KEYS[i], ARGV[1]) end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d.%06d', t[1], t[2]))
if ARGV[3] == '1' then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  redis.call('HSET', KEYS[3], ARGV[1], '1')
end
return 1
"""


class Recorder:
    """Records runs of task bodies in Redis under ``<prefix>rec:``; see the module docstring."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = f"{prefix}rec:"
        self._pid = -1
        self._clients: dict[bool, redis.Redis] = {}

    @property
    def client(self) -> redis.Redis:
        """This process's client: one for its main thread, one for its other threads.

        A prefork child must not share its parent's socket.  And a threads-pool worker's task
        threads must not share the main thread's connections.  Celery's cold-shutdown handler
        raises in the main thread wherever it is; in one CI run it raised inside this
        recorder's Redis call, and a task thread's end-of-run record was then lost (our
        reading: the connection left half set up went back to the shared pool).
        """
        if self._pid != os.getpid():
            self._clients = {}
            self._pid = os.getpid()
        main = threading.current_thread() is threading.main_thread()
        client = self._clients.get(main)
        if client is None:
            client = self._clients[main] = redis.Redis.from_url(self.url)
        return client

    def close(self) -> None:
        """Close this process's clients (they would otherwise be closed by the garbage
        collector, whose ``ResourceWarning`` fails whichever test is running then)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def key(self, name: str) -> str:
        return self.prefix + name

    def enter(self, task_id: str, counters: Sequence[str], meta: Mapping[str, Any]) -> str:
        """Record a run starting; returns its token (for :meth:`exit`)."""
        token = uuid.uuid4().hex
        document = json.dumps({**meta, "task_id": task_id, "counters": list(counters), "pid": os.getpid()})
        keys = [self.key("runs"), self.key("peaks"), self.key("starts")]
        keys += [self.key(f"live:{counter}") for counter in counters]
        self.client.eval(_ENTER, len(keys), *keys, token, document, task_id, *counters)
        return token

    def exit(self, token: str, task_id: str, counters: Sequence[str], completed: bool) -> None:
        """Record a run ending (``completed``: its body returned; counted per task id and marked per run)."""
        keys = [self.key("ends"), self.key("done"), self.key("completed")]
        keys += [self.key(f"live:{counter}") for counter in counters]
        self.client.eval(_EXIT, len(keys), *keys, token, task_id, "1" if completed else "0")

    def received(self, task_id: str, hostname: str, redelivered: bool = False) -> None:
        """Count a delivery of ``task_id`` (and, apart, one the broker marked redelivered) and
        remember which worker received it."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hincrby(self.key("received"), task_id, 1)
        if redelivered:
            pipe.hincrby(self.key("redelivered"), task_id, 1)
        pipe.sadd(self.key(f"received-on:{hostname}"), task_id)
        pipe.hset(self.key("last-received"), task_id, f"{hostname} {time.time():.3f}")
        pipe.execute()

    def count(self, name: str, field: str, amount: int = 1) -> None:
        self.client.hincrby(self.key(name), field, amount)


# -- the app -----------------------------------------------------------------------


def request_header(request: Any, name: str) -> Any:
    """A custom message header as the task sees it (Celery merges them into the request)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name)
    return value if value is not None else getattr(request, name, None)


def make_app(env: Mapping[str, str], *, current: bool = True) -> Celery:
    """A Celery app with the fleet's configuration and tasks, built from ``env``.

    Tests build their own client app with ``current=False``; a worker's app is current
    (celery-caps releases leases at process shutdown through ``current_app``).
    """
    prefix = setting(env, "CAPS_FLEET_PREFIX") or "tfleet-"
    broker = setting(env, "CAPS_FLEET_BROKER")
    app = Celery(f"fleet-{prefix}", broker=broker, backend=setting(env, "CAPS_FLEET_BACKEND"), set_as_current=current)
    transport_options: dict[str, Any] = {}
    if broker and broker.startswith("redis"):
        # Keep this fleet's broker keys (queues, unacked messages, bindings) apart from
        # every other test run's; restore unacknowledged messages every second.  A worker holds
        # kombu's restore mutex for the few milliseconds of each restore; a Redis server killed
        # meanwhile keeps it from its journal for the mutex's expiry (kombu's default: 300 s),
        # and nothing is restored until then: 10 s here, within the tests' waits.
        transport_options = {
            "global_keyprefix": f"{prefix}kombu:",
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 10,
        }
        visibility = setting(env, "CAPS_FLEET_VISIBILITY_TIMEOUT")
        if visibility:
            transport_options["visibility_timeout"] = float(visibility)
    conf: dict[str, Any] = {
        "task_default_queue": queue_name(prefix),
        "control_exchange": f"{prefix}celery",
        "event_exchange": f"{prefix}celeryev",
        "broker_transport_options": transport_options,
        "result_backend_transport_options": {"global_keyprefix": f"{prefix}results:"},
        "broker_connection_retry_on_startup": True,
        "worker_prefetch_multiplier": int(setting(env, "CAPS_FLEET_PREFETCH") or 1),
        "task_acks_late": True,
        # A pool child killed mid-task (kill -9) gives its message back to the broker.
        "task_reject_on_worker_lost": True,
        "result_expires": 600,
        "caps_lease_seconds": float(setting(env, "CAPS_FLEET_LEASE") or 5),
        "caps_backoff_min_seconds": float(setting(env, "CAPS_FLEET_BACKOFF_MIN") or 0.05),
        "caps_backoff_max_seconds": float(setting(env, "CAPS_FLEET_BACKOFF_MAX") or 1),
        # The tests call the sweep themselves, at the moment they want to check it.
        "caps_sweep_interval_seconds": None,
    }
    optional = {
        "caps_url": "CAPS_FLEET_CAPS_URL",
        "caps_max_wait_seconds": "CAPS_FLEET_MAX_WAIT",
        "caps_on_store_error": "CAPS_FLEET_ON_STORE_ERROR",
        "caps_on_lease_lost": "CAPS_FLEET_ON_LEASE_LOST",
    }
    for name, variable in optional.items():
        value = setting(env, variable)
        if value is not None:
            conf[name] = value if name in ("caps_url", "caps_on_store_error", "caps_on_lease_lost") else float(value)
    strategy = setting(env, "CAPS_FLEET_STRATEGY")
    if strategy is not None:
        conf["caps_strategy"] = strategy
    routes = setting(env, "CAPS_FLEET_ROUTES")
    if routes is not None:
        conf["task_routes"] = json.loads(routes)
    more = setting(env, "CAPS_FLEET_CONF")
    if more is not None:
        conf.update(json.loads(more))
    app.conf.update(conf)
    recorder = Recorder(setting(env, "CAPS_FLEET_COUNTER_URL") or "", prefix)
    app.recorder = recorder  # type: ignore[attr-defined]
    app.fleet_prefix = prefix  # type: ignore[attr-defined]
    _define_tasks(app, prefix, recorder, env)
    return app


def tier_limit(tenant: str, *args: Any, **kwargs: Any) -> int:
    """The tier cap's limit of ``tenant``: 3 for a premium tenant, 1 for others; a tenant named
    ``broken-...`` gets 0 and one named ``raising-...`` an exception (both fail the task)."""
    if tenant.startswith("raising-"):
        raise LookupError(f"no plan for tenant {tenant}")
    if tenant.startswith("broken-"):
        return 0
    return 3 if tenant.startswith("premium-") else 1


#: The weighted cap's limit (test_weights_fleet): units of 5.
GPU_LIMIT = 5


#: The fair cap's limit, and its first-come twin's (test_fair_fleet).
FAIR_LIMIT = 2


def gpu_units(units: Any, *args: Any, **kwargs: Any) -> Any:
    """The weighted cap's weight of a call: its first argument, as given (0 fails the task)."""
    return units


def _define_tasks(app: Celery, prefix: str, recorder: Recorder, env: Mapping[str, str]) -> None:
    provider_limit = int(setting(env, "CAPS_FLEET_PROVIDER_LIMIT") or 4)
    tenant_limit = int(setting(env, "CAPS_FLEET_TENANT_LIMIT") or 2)
    # Slot names (the caps') start with the cap prefix; everything else is named after ``prefix``.
    caps = setting(env, "CAPS_FLEET_CAP_PREFIX") or prefix
    provider = Cap(f"{caps}provider", provider_limit)
    tenant = Cap(f"{caps}tenant", tenant_limit, key=lambda tenant, *_, **__: tenant)
    # Lifecycle tests: a cap of 1 per scope (each test passes its own scope first).
    one = Cap(f"{caps}one", 1, key=lambda scope, *_, **__: scope)
    two = Cap(f"{caps}two", 1, key=lambda scope, *_, **__: scope)
    # Retry tests: a cap of 2 per scope.
    duo = Cap(f"{caps}duo", 2, key=lambda scope, *_, **__: scope)
    # Hostile-input tests: a cap of 1 per key, with an odd name and whatever key odd_key makes.
    odd = Cap(f"{caps}{ODD_CAP_NAME}", 1, key=odd_key)
    # Limits per key (test_per_key_limits): the limit a function of the arguments gives the key.
    tier = Cap(f"{caps}tier", tier_limit, key=lambda tenant, *_, **__: tenant)
    # Weights (test_weights_fleet): a call takes as many units of GPU_LIMIT as its first argument.
    gpu = Cap(f"{caps}gpu", GPU_LIMIT, weight=gpu_units)
    # Fair shares (test_fair_fleet): a cap served in turn across tenants, and its first-come twin.
    fair = Cap(f"{caps}fair", FAIR_LIMIT, fair_by=lambda tenant, *_, **__: tenant)
    fifo = Cap(f"{caps}fifo", FAIR_LIMIT)

    def run_body(
        task: Any, counters: Sequence[str], seconds: float, midway: Callable[[], None] | None = None, **extra: Any
    ) -> dict[str, Any]:
        """Record a run of ``seconds``; ``midway`` is called in the body once half of them passed."""
        request = task.request
        meta = {
            "hostname": request.hostname,
            "deferrals": int(request_header(request, "caps_deferrals") or 0),
            # The dispatch this copy claimed, if it was woken (celery_caps.park).
            "dispatch": request_header(request, "caps_dispatch_run_id"),
            "redelivered": bool((request.delivery_info or {}).get("redelivered")),
            "retries": request.retries,
            "run_id": getattr(request, "caps_run_id", None),
        }
        token = recorder.enter(request.id, counters, meta)
        completed = False
        try:
            deadline = time.monotonic() + seconds
            halfway = deadline - seconds / 2
            while time.monotonic() < deadline:  # short steps: a soft time limit interrupts a sleep
                if midway is not None and time.monotonic() >= halfway:
                    midway, call = None, midway
                    call()
                time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
            completed = True
        finally:
            recorder.exit(token, request.id, counters, completed)
        return {
            **meta,
            **extra,
            "task_id": request.id,
            "pid": os.getpid(),
            "delivery_info": dict(request.delivery_info or {}),
            "x_trace": request_header(request, "x-trace"),
        }

    task_options: dict[str, Any] = {"base": CappedTask, "bind": True, "shared": False}

    @app.task(name="fleet.both", cap=[provider, tenant], **task_options)
    def both(self: Any, tenant: str, ms: int) -> dict[str, Any]:
        """Holds the global provider cap and the tenant's cap."""
        return run_body(self, ["provider", f"tenant:{tenant}"], ms / 1000)

    @app.task(name="fleet.tenant_only", cap=tenant, **task_options)
    def tenant_only(self: Any, tenant: str, ms: int) -> dict[str, Any]:
        """Holds only the tenant's cap."""
        return run_body(self, [f"tenant:{tenant}"], ms / 1000)

    @app.task(name="fleet.tiered", cap=[provider, tier], **task_options)
    def tiered(self: Any, tenant: str, ms: int) -> dict[str, Any]:
        """Holds the provider cap and its tenant's tier cap (tier_limit gives the tenant's limit)."""
        return run_body(self, ["provider", f"tier:{tenant}"], ms / 1000)

    @app.task(name="fleet.weighed", cap=gpu, **task_options)
    def weighed(self: Any, units: int, ms: int) -> dict[str, Any]:
        """Holds ``units`` units of the gpu cap for ``ms`` milliseconds."""
        return run_body(self, ["gpu"], ms / 1000)

    @app.task(name="fleet.fair_call", cap=fair, **task_options)
    def fair_call(self: Any, tenant: str, ms: int) -> dict[str, Any]:
        """Holds the fair cap for ``ms`` milliseconds, for ``tenant``."""
        return run_body(self, ["fair"], ms / 1000)

    @app.task(name="fleet.fifo_call", cap=fifo, **task_options)
    def fifo_call(self: Any, tenant: str, ms: int) -> dict[str, Any]:
        """Holds the first-come twin of the fair cap for ``ms`` milliseconds, for ``tenant``."""
        return run_body(self, ["fifo"], ms / 1000)

    @app.task(name="fleet.hold", cap=one, **task_options)
    def hold(self: Any, scope: str, *seconds_by_run: float, **kwargs: Any) -> dict[str, Any]:
        """Runs for ``seconds_by_run[n]`` seconds on the n-th run of its task id."""
        runs = recorder.client.hincrby(recorder.key("runs-per-id"), self.request.id, 1)
        seconds = seconds_by_run[min(runs, len(seconds_by_run)) - 1] if seconds_by_run else 0.0
        return run_body(self, [f"one:{scope}"], seconds, args=[scope, *seconds_by_run], kwargs=kwargs)

    @app.task(name="fleet.hold_two", cap=[one, two], **task_options)
    def hold_two(self: Any, scope: str, seconds: float) -> dict[str, Any]:
        """Holds two caps (two lease rows) for ``seconds``."""
        return run_body(self, [f"one:{scope}"], seconds)

    @app.task(name="fleet.no_retries", cap=one, max_retries=0, **task_options)
    def no_retries(self: Any, scope: str) -> dict[str, Any]:
        """A task that may not be retried at all."""
        return run_body(self, [f"one:{scope}"], 0.05)

    @app.task(name="fleet.fail", cap=one, **task_options)
    def fail(self: Any, scope: str) -> None:
        run_body(self, [f"one:{scope}"], 0.2)
        raise ValueError(f"fleet.fail[{scope}] fails on purpose")

    @app.task(name="fleet.retry_once", cap=one, max_retries=3, **task_options)
    def retry_once(self: Any, scope: str) -> dict[str, Any]:
        """Retries itself on its first run; the second run reports what the store shows."""
        from celery_caps.runtime import runtime_for

        result = run_body(self, [f"one:{scope}"], 0.1)
        if self.request.retries == 0:
            recorder.client.hset(recorder.key("retry-first-run"), self.request.id, result["run_id"] or "")
            raise self.retry(countdown=0.3)
        leases = runtime_for(self.app).store.leases(f"{caps}one:{scope}")
        result["leases_seen"] = [(lease.task_id, lease.run_id) for lease in leases]
        return result

    def leases_when_retry_is_sent(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
        # In the process sending a retry of fleet.retry_once: what does its slot hold right now?
        if sender != "fleet.retry_once" or not headers or not headers.get("retries"):
            return
        from celery_caps.runtime import runtime_for

        scope = body[0][0]
        leases = runtime_for(app).store.leases(f"{caps}one:{scope}")
        document = json.dumps([[lease.task_id, lease.run_id] for lease in leases])
        recorder.client.hset(recorder.key("leases-at-retry"), headers["id"], document)

    signals.before_task_publish.connect(leases_when_retry_is_sent, weak=False)

    if setting(env, "CAPS_FLEET_STRATEGY") is not None:

        def count_publish(sender: Any = None, **_: Any) -> None:
            # Tests publish from their own client app; a worker's publishes are put-backs and wakes.
            if os.environ.get("CAPS_FLEET_PREFIX") == prefix:
                recorder.count("publishes", str(sender))

        signals.before_task_publish.connect(count_publish, weak=False)

    @app.task(name="fleet.retrying", cap=duo, max_retries=5, **task_options)
    def retrying(self: Any, scope: str, retries: int, ms: int) -> dict[str, Any]:
        """Runs ``ms`` milliseconds, then retries itself (``self.retry``) until it has retried ``retries`` times."""
        result = run_body(self, [f"duo:{scope}"], ms / 1000)
        if self.request.retries < retries:
            raise self.retry(countdown=0.1)
        return result

    @app.task(name="fleet.retry_goes_on", cap=one, max_retries=3, **task_options)
    def retry_goes_on(self: Any, scope: str, how: str, seconds: float, countdown: float = 3.0) -> dict[str, Any]:
        """Runs ``seconds``; halfway through, its first attempt asks for a retry and goes on with
        its body: ``how="throw=False"`` sends the retry (``self.retry(countdown=..., throw=False)``)
        and carries on; ``how="max-retries-caught"`` has no retry left (``self.retry(max_retries=0)``)
        and catches ``MaxRetriesExceededError``.  Counted in Redis ``retry-asked``."""

        def ask_for_retry() -> None:
            if self.request.retries:
                return
            recorder.count("retry-asked", self.request.id)
            if how == "throw=False":
                self.retry(countdown=countdown, throw=False)
                return
            try:
                self.retry(max_retries=0)
            except self.MaxRetriesExceededError:
                recorder.count("max-retries-caught", self.request.id)

        return run_body(self, [f"one:{scope}"], seconds, midway=ask_for_retry)

    @app.task(
        name="fleet.autoretrying", cap=duo, autoretry_for=(RuntimeError,), retry_backoff=0.1, retry_backoff_max=1,
        retry_jitter=False, max_retries=5, **task_options,
    )  # fmt: skip
    def autoretrying(self: Any, scope: str, failures: int, ms: int) -> dict[str, Any]:
        """Raises ``RuntimeError`` (retried by ``autoretry_for`` with ``retry_backoff``) on its
        first ``failures`` runs."""
        result = run_body(self, [f"duo:{scope}"], ms / 1000)
        if self.request.retries < failures:
            raise RuntimeError(f"run {self.request.retries} fails on purpose")
        return result

    @app.task(name="fleet.soft_limited", cap=one, soft_time_limit=1, **task_options)
    def soft_limited(self: Any, scope: str) -> None:
        run_body(self, [f"one:{scope}"], 30)

    @app.task(name="fleet.hard_limited", cap=one, time_limit=1.5, **task_options)
    def hard_limited(self: Any, scope: str) -> None:
        # Like a child stuck in C code, ignore the pool's TERM: only its SIGKILL (0.1 s
        # later) ends this run, so no `finally` in the child can release the slot.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run_body(self, [f"one:{scope}"], 30)

    @app.task(name="fleet.inspect", cap=one, **task_options)
    def inspect(self: Any, scope: str) -> dict[str, Any]:
        """Reports the leases of its own slot, as the store shows them while the body runs."""
        from celery_caps.runtime import runtime_for

        leases = runtime_for(self.app).store.leases(f"{caps}one:{scope}")
        return {
            "task_id": self.request.id,
            "run_id": getattr(self.request, "caps_run_id", None),
            "leases": [[lease.task_id, lease.run_id] for lease in leases],
        }

    @app.task(name="fleet.fenced", cap=one, **task_options)
    def fenced(self: Any, scope: str, seconds: float, check: bool = True) -> dict[str, Any]:
        """Runs ``seconds`` in 0.1 s steps; with ``check``, asks ``caps_still_held()`` at each
        step and records (Redis ``fence-lost``) when it first says no."""
        request = self.request
        counters = [f"one:{scope}"]
        meta = {"hostname": request.hostname, "deferrals": 0, "run_id": getattr(request, "caps_run_id", None)}
        token = recorder.enter(request.id, counters, meta)
        completed = False
        checks = 0
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if check:
                    checks += 1
                    if not self.caps_still_held():
                        recorder.client.hsetnx(recorder.key("fence-lost"), request.id, f"{time.time():.3f}")
                time.sleep(0.1)
            completed = True
        finally:
            recorder.exit(token, request.id, counters, completed)
        return {**meta, "checks": checks, "held_at_end": self.caps_still_held() if check else None}

    @app.task(name="fleet.odd", cap=odd, **task_options)
    def odd_task(self: Any, kind: str, value: Any, seconds: float = 0.0) -> dict[str, Any]:
        """Holds ``odd``'s slot of the key ``odd_key(kind, value)`` for ``seconds``."""
        return run_body(self, [f"odd:{odd_key(kind, value)}"], seconds)

    @app.task(name="fleet.callback", bind=True, shared=False)
    def callback(self: Any, parent_result: Any, marker: str) -> None:
        """A link callback: counts how often it fired for ``marker``."""
        recorder.count("callbacks", marker)


@signals.task_received.connect
def _count_delivery(request: Any = None, **_: Any) -> None:
    # Main process: every delivery of a task id (the first and each put-back copy).
    recorder = getattr(getattr(getattr(request, "task", None), "app", None), "recorder", None)
    if recorder is not None:
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        recorder.received(request.id, request.hostname, redelivered)


def _die_before_publishing_wakes(app: Celery, budget: int) -> None:
    """Fault injection (``CAPS_FLEET_DIE_BEFORE_WAKE=N``, given to workers only): the first
    ``N`` pool processes of the fleet that release a slot and dispatch waiters die right
    after the store committed the dispatch and before its messages are published."""
    from billiard.process import current_process

    from celery_caps import handover

    publish_woken = handover.publish_woken
    recorder: Recorder = app.recorder  # type: ignore[attr-defined]

    def publish_or_die(runtime: Any, woken: Any) -> Any:
        in_pool = current_process().name.startswith("ForkPoolWorker")
        if woken and in_pool and recorder.client.incr(recorder.key("wake-deaths")) <= budget:
            current = runtime.app.current_worker_task
            recorder.client.rpush(recorder.key("died-before-wake"), *[waiter.task_id for waiter in woken])
            if current is not None:
                recorder.client.rpush(recorder.key("died-releasing"), current.request.id)
            os._exit(137)
        return publish_woken(runtime, woken)

    handover.publish_woken = publish_or_die


app = make_app(os.environ)
if os.environ.get("CAPS_FLEET_DIE_BEFORE_WAKE"):
    _die_before_publishing_wakes(app, int(os.environ["CAPS_FLEET_DIE_BEFORE_WAKE"]))
