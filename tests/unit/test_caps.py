"""Cap specifications, key functions and store URLs: bad input gets an error naming it."""

from __future__ import annotations

from typing import Any

import pytest

from celery_caps.caps import MAX_KEY_LENGTH, MAX_NAME_LENGTH, Cap, needs_for, normalize_caps, slots_for
from celery_caps.errors import CapKeyError, CapsError, ConfigurationError, StoreError
from celery_caps.stores import store_from_url
from celery_caps.stores.base import SlotStore, mask_url
from celery_caps.stores.memory import MemoryStore
from celery_caps.stores.sql import SQLStore

# -- Cap validation -------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, 2.5, 3.0, "3", None, True, False, [2]], ids=repr)
def test_a_limit_that_is_not_a_positive_int_is_refused_by_name(limit: object) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Cap("email-provider", limit)  # type: ignore[arg-type]

    message = str(raised.value)
    assert "'email-provider'" in message
    assert f"got {limit!r}" in message
    assert "positive integer" in message


@pytest.mark.parametrize(
    "name",
    ["", 42, None, b"provider", ["provider"], "a:b", "tab\there", "nul\x00", "newline\n", "del\x7f", "lone\ud800"],
    ids=repr,
)
def test_a_bad_cap_name_is_refused_and_named(name: object) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Cap(name, 5)  # type: ignore[arg-type]

    assert repr(name) in str(raised.value)


def test_an_overlong_cap_name_is_refused_with_a_short_message() -> None:
    name = "overlong-" + "x" * (MAX_NAME_LENGTH - len("overlong-") + 1)

    with pytest.raises(ConfigurationError) as raised:
        Cap(name, 5)

    message = str(raised.value)
    assert "'overlong-xxx" in message
    assert f"longer than {MAX_NAME_LENGTH} characters" in message
    assert len(message) < 200


@pytest.mark.parametrize("key", ["tenant", 5, object()], ids=["str", "int", "object"])
def test_a_key_that_is_not_callable_is_refused_and_named(key: object) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Cap("imports", 2, key=key)  # type: ignore[arg-type]

    assert repr(key) in str(raised.value)
    assert "callable" in str(raised.value)


def test_valid_caps_at_the_edges_are_accepted() -> None:
    assert Cap("x" * MAX_NAME_LENGTH, 1).limit == 1
    assert Cap("émail-prövider 🚀", 10_000).name == "émail-prövider 🚀"
    assert Cap("imports", 2, key=lambda tenant: tenant).key is not None


def test_configuration_and_key_errors_share_the_one_root() -> None:
    assert issubclass(ConfigurationError, CapsError)
    assert issubclass(CapKeyError, CapsError)
    assert issubclass(StoreError, CapsError)
    # Both are bad values, as a caller catching ValueError expects.
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(CapKeyError, ValueError)


# -- key functions ---------------------------------------------------------------------


def tenant_key(tenant_id: Any, path: str = "") -> Any:
    return tenant_id


def failing_key(*args: Any, **kwargs: Any) -> str:
    raise LookupError("no tenant in the arguments")


def test_a_key_function_that_raises_becomes_a_cap_key_error() -> None:
    cap = Cap("imports", 2, key=failing_key)

    with pytest.raises(CapKeyError) as raised:
        cap.slot_name(("acme",), {})

    message = str(raised.value)
    assert "'imports'" in message
    assert "failing_key" in message
    assert "LookupError: no tenant in the arguments" in message
    assert isinstance(raised.value.__cause__, LookupError)


def test_a_key_function_raising_a_10_mb_message_gets_a_short_cap_key_error() -> None:
    def huge_failure(*args: Any, **kwargs: Any) -> str:
        raise ValueError("x" * 10_000_000)

    cap = Cap("imports", 2, key=huge_failure)

    with pytest.raises(CapKeyError) as raised:
        cap.slot_name(("acme",), {})

    message = str(raised.value)
    assert "'imports'" in message and "huge_failure" in message
    assert "raised ValueError: xxxxx" in message
    assert "(10000000 chars)" in message
    assert len(message) < 400
    assert len(str(raised.value.__cause__)) == 10_000_000  # the original error stays whole, chained


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (None, "NoneType None"),
        (42, "int 42"),
        (b"acme", "bytes b'acme'"),
        ("", "empty string"),
        ("a\x00b", "'a\\x00b'"),
        ("line\nbreak", "'line\\nbreak'"),
        ("lone\udc80", "'lone\\udc80'"),
    ],
    ids=["None", "int", "bytes", "empty", "NUL", "newline", "surrogate"],
)
def test_an_unusable_key_is_refused_and_named(key: object, expected: str) -> None:
    cap = Cap("imports", 2, key=tenant_key)

    with pytest.raises(CapKeyError) as raised:
        cap.slot_name((key,), {})

    assert "'imports'" in str(raised.value)
    assert expected in str(raised.value)


def test_a_10_kb_key_is_refused_without_a_10_kb_message() -> None:
    cap = Cap("imports", 2, key=tenant_key)
    key = "k" * 10_000

    with pytest.raises(CapKeyError) as raised:
        cap.slot_name((key,), {})

    message = str(raised.value)
    assert f"longer than {MAX_KEY_LENGTH} characters" in message
    assert "'kkkkk" in message
    assert "10002 chars" in message  # the length of the key's repr
    assert len(message) < 300


def test_keys_up_to_the_longest_allowed_are_accepted() -> None:
    cap = Cap("imports", 2, key=tenant_key)

    assert cap.slot_name(("k" * MAX_KEY_LENGTH,), {}) == "imports:" + "k" * MAX_KEY_LENGTH
    with pytest.raises(CapKeyError):
        cap.slot_name(("k" * (MAX_KEY_LENGTH + 1),), {})


# -- slot names -----------------------------------------------------------------------


def test_slots_for_maps_each_slot_name_to_its_limit() -> None:
    caps = [Cap("provider", 25), Cap("tenant", 2, key=lambda t, **_: t)]

    assert slots_for(caps, ("acme",), {"since": 3}) == {"provider": 25, "tenant:acme": 2}
    assert slots_for(caps, (), {"t": "globex"}) == {"provider": 25, "tenant:globex": 2}
    assert slots_for([], ("acme",), {}) == {}


def test_the_key_function_gets_the_tasks_own_arguments() -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def key(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "acme"

    assert Cap("imports", 2, key=key).slot_name(("acme", "/data/file.csv"), {"force": True}) == "imports:acme"
    assert calls == [(("acme", "/data/file.csv"), {"force": True})]


def test_hostile_keys_are_kept_verbatim_in_the_slot_name() -> None:
    cap = Cap("tenant", 2, key=tenant_key)

    for key in ["O'Brien; DROP TABLE x", "a:b", "{tag}", "100%_", "🚀 שלום", "Tenant ", "back\\slash"]:
        assert cap.slot_name((key,), {}) == f"tenant:{key}"


# -- normalize_caps ---------------------------------------------------------------------

PROVIDER = Cap("provider", 25)
TENANT = Cap("tenant", 2, key=tenant_key)


def test_normalize_caps_accepts_none_one_cap_or_a_collection() -> None:
    assert normalize_caps(None, "proj.sync") == ()
    assert normalize_caps(PROVIDER, "proj.sync") == (PROVIDER,)
    assert normalize_caps([PROVIDER, TENANT], "proj.sync") == (PROVIDER, TENANT)
    assert normalize_caps((TENANT, PROVIDER), "proj.sync") == (TENANT, PROVIDER)
    assert normalize_caps([], "proj.sync") == ()


def test_normalize_caps_refuses_a_cap_name_given_twice() -> None:
    with pytest.raises(ConfigurationError) as raised:
        normalize_caps([PROVIDER, TENANT, Cap("provider", 10)], "proj.sync")

    assert "proj.sync" in str(raised.value)
    assert "'provider'" in str(raised.value)
    assert "twice" in str(raised.value)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("provider", "'provider'"),
        (b"provider", "b'provider'"),
        (25, "25"),
        ([PROVIDER, "tenant"], "'tenant'"),
        ([PROVIDER, None], "None"),
        ({"provider": 25}, "'provider'"),
    ],
    ids=["str", "bytes", "int", "list-with-str", "list-with-None", "dict"],
)
def test_normalize_caps_refuses_junk_and_names_it(value: object, named: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        normalize_caps(value, "proj.sync")

    assert "proj.sync" in str(raised.value)
    assert named in str(raised.value)


# -- store URLs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("foo://user:s3cret@host/db", "'foo'"),
        ("mongodb://admin:s3cret@db.example:27017/caps", "'mongodb'"),
        ("s3cret-but-no-scheme", "'(none)'"),
    ],
    ids=["foo", "mongodb", "no-scheme"],
)
def test_an_unknown_store_scheme_is_named_without_the_password(url: str, scheme: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        store_from_url(url)

    message = str(raised.value)
    assert f"unknown store scheme {scheme}" in message
    if "@" in url:
        assert "s3cret" not in message
        assert ":***@" in message


def test_an_unsupported_object_is_named() -> None:
    with pytest.raises(ConfigurationError) as raised:
        store_from_url(42)

    assert "builtins.int" in str(raised.value)


def test_store_from_url_builds_stores_and_passes_ready_ones_through(tmp_path: Any) -> None:
    memory = store_from_url("memory://")
    assert isinstance(memory, MemoryStore)
    assert store_from_url(memory) is memory
    sqlite = store_from_url(f"sqlite:///{tmp_path}/caps.db")
    try:
        assert isinstance(sqlite, SQLStore)
        assert isinstance(sqlite, SlotStore)
    finally:
        sqlite.close()


def test_a_ready_engine_is_used_and_never_disposed(tmp_path: Any) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{tmp_path}/caps.db")
    try:
        store = store_from_url(engine)
        assert isinstance(store, SQLStore)
        assert store.acquire({"provider": 1}, "task-1", "run-1", "w1/1", 30.0).granted
        store.close()

        # The engine still works after the store is closed: it belongs to the caller.
        with engine.connect() as connection:
            count = connection.execute(sa.text("SELECT COUNT(*) FROM concurrency_slots WHERE run_id = 'run-1'"))
            assert count.scalar_one() == 1
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("url", "where"),
    [
        ("postgresql+psycopg://caps:s3cret@127.0.0.1:1/caps", "127.0.0.1:1"),
        ("mysql+pymysql://caps:s3cret@127.0.0.1:1/caps", "127.0.0.1:1"),
        ("sqlite:////nonexistent-caps-dir/caps.db", "/nonexistent-caps-dir/caps.db"),
    ],
    ids=["postgres", "mysql", "sqlite"],
)
def test_an_unreachable_store_raises_a_store_error_without_the_password(url: str, where: str) -> None:
    store = store_from_url(url)
    try:
        with pytest.raises(StoreError) as raised:
            store.acquire({"provider": 1}, "task-1", "run-1", "w1/1", 30.0)
    finally:
        store.close()

    message = str(raised.value)
    assert "s3cret" not in message
    assert where in message
    assert raised.value.__cause__ is not None  # the driver's error, for the traceback


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg://app:s3cret@db:5432/app", "postgresql+psycopg://app:***@db:5432/app"),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("redis://:p@ss@word@cache/0", "redis://:***@cache/0"),
        ("mysql+pymysql://root@127.0.0.1/test", "mysql+pymysql://root@127.0.0.1/test"),
        ("sqlite:////var/lib/caps.db", "sqlite:////var/lib/caps.db"),
        ("memory://", "memory://"),
        ("http://[::1", "<unparsable URL>"),
        ("unix:///run/redis.sock?db=2&password=s3cret", "unix:///run/redis.sock?db=2&password=***"),
        ("rediss://:s3cret@cache/0?pwd=s3cret", "rediss://:***@cache/0?pwd=***"),
    ],
    ids=[
        "password",
        "password-only",
        "at-in-password",
        "no-password",
        "sqlite",
        "memory",
        "unparsable",
        "query-password",
        "both",
    ],
)
def test_mask_url_hides_only_the_password(url: str, masked: str) -> None:
    assert mask_url(url) == masked


# =====================================================================================
# Operator settings: history, metrics endpoint, DEFERRED state.
# =====================================================================================


def test_operator_settings_default_to_off_and_read_from_conf() -> None:
    from celery_caps.settings import CapsSettings

    defaults = CapsSettings.from_conf({})
    assert (defaults.history_seconds, defaults.history_max_events) == (None, 10000)
    assert (defaults.metrics_port, defaults.metrics_address, defaults.deferred_state) == (None, "0.0.0.0", True)
    chosen = CapsSettings.from_conf(
        {
            "caps_history_seconds": 900,
            "caps_history_max_events": 500,
            "caps_metrics_port": 9808,
            "caps_metrics_address": "127.0.0.1",
            "caps_deferred_state": False,
        }
    )
    assert (chosen.history_seconds, chosen.history_max_events) == (900.0, 500)
    assert (chosen.metrics_port, chosen.metrics_address, chosen.deferred_state) == (9808, "127.0.0.1", False)
    assert CapsSettings.from_conf({"caps_history_seconds": 0}).history_seconds is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("caps_history_seconds", -5),
        ("caps_history_seconds", "10m"),
        ("caps_history_max_events", 0),
        ("caps_history_max_events", 2.5),
        ("caps_metrics_port", 0),
        ("caps_metrics_port", 70000),
        ("caps_metrics_port", "9808"),
        ("caps_metrics_port", True),
        ("caps_metrics_address", ""),
        ("caps_deferred_state", "yes"),
    ],
    ids=repr,
)
def test_a_bad_operator_setting_is_named(name: str, value: object) -> None:
    from celery_caps.settings import CapsSettings

    with pytest.raises(ConfigurationError, match=name):
        CapsSettings.from_conf({name: value})


# -- limits per key ---------------------------------------------------------------------


def plan_limit(tenant: str, *args: Any, **kwargs: Any) -> int:
    return 10 if tenant.startswith("premium-") else 1


def test_a_limit_function_gives_each_key_its_own_limit() -> None:
    caps = [Cap("provider", 25), Cap("tenant", plan_limit, key=tenant_key)]

    assert slots_for(caps, ("premium-acme",), {}) == {"provider": 25, "tenant:premium-acme": 10}
    assert slots_for(caps, ("globex",), {"path": "/data"}) == {"provider": 25, "tenant:globex": 1}


def test_the_limit_function_gets_the_tasks_own_arguments() -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def limit(*args: Any, **kwargs: Any) -> int:
        calls.append((args, kwargs))
        return 4

    assert Cap("imports", limit, key=tenant_key).limit_for(("acme", "/data/file.csv"), {"force": True}) == 4
    assert calls == [(("acme", "/data/file.csv"), {"force": True})]


def test_a_limit_function_without_a_key_is_refused_and_named() -> None:
    with pytest.raises(ConfigurationError) as raised:
        Cap("imports", plan_limit)

    assert "'imports'" in str(raised.value) and "plan_limit" in str(raised.value) and "key" in str(raised.value)


def test_a_limit_function_that_raises_becomes_a_cap_key_error() -> None:
    def unknown_plan(tenant: str) -> int:
        raise LookupError("x" * 10_000)

    with pytest.raises(CapKeyError) as raised:
        slots_for([Cap("imports", unknown_plan, key=tenant_key)], ("acme",), {})

    message = str(raised.value)
    assert "'imports'" in message and "unknown_plan" in message and "raised LookupError: xxx" in message
    assert len(message) < 400
    assert isinstance(raised.value.__cause__, LookupError)


def test_a_limit_above_what_every_store_keeps_is_refused_in_code_and_from_a_limit_function() -> None:
    # A SQL INTEGER keeps up to 2**31 - 1: a larger limit would fail at the store (or be clamped)
    assert Cap("wide", 2**31 - 1).limit == 2**31 - 1
    with pytest.raises(ConfigurationError, match=r"Cap 'wide': limit 2147483648 is above 2147483647"):
        Cap("wide", 2**31)
    cap = Cap("imports", lambda tenant: 2**40, key=tenant_key)
    with pytest.raises(CapKeyError, match=r"'imports': limit function .* returned 1099511627776, above 2147483647"):
        cap.limit_for(("acme",), {})


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(0, "int 0"), (-2, "int -2"), (2.5, "float 2.5"), ("3", "str '3'"), (True, "bool True"), (None, "NoneType None")],
    ids=repr,
)
def test_a_limit_function_returning_no_positive_int_is_refused_and_named(limit: object, expected: str) -> None:
    cap = Cap("imports", lambda tenant: limit, key=tenant_key)

    with pytest.raises(CapKeyError) as raised:
        cap.limit_for(("acme",), {})

    message = str(raised.value)
    assert "'imports'" in message and "must return a positive integer" in message and f"got {expected}" in message


# -- weights -------------------------------------------------------------------------------


def gpus_needed(model: str, **kwargs: Any) -> int:
    return 3 if model.startswith("large-") else 1


def test_a_weight_says_how_many_units_of_its_slot_a_call_takes() -> None:
    caps = [Cap("gpu", 10, weight=gpus_needed), Cap("tenant", 2, key=tenant_key), Cap("disk", 4, weight=2)]

    assert needs_for(caps, ("large-7b",), {}).weights == {"gpu": 3, "disk": 2}
    # Weights of 1 are left out: an unweighted call passes nothing more to the store
    assert needs_for(caps[:2], ("small",), {}).weights == {}


@pytest.mark.parametrize(
    ("weight", "expected"),
    [
        (0, "got 0"),
        (-1, "got -1"),
        (1.5, "got 1.5"),
        ("2", "got '2'"),
        (True, "got True"),
        (11, "weight 11 is above its limit 10"),
    ],
    ids=repr,
)
def test_a_bad_weight_in_code_is_refused_when_the_cap_is_declared(weight: object, expected: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        Cap("gpu", 10, weight=weight)  # type: ignore[arg-type]

    assert "'gpu'" in str(raised.value) and expected in str(raised.value)


@pytest.mark.parametrize(
    ("weight", "expected"),
    [
        (0, "must return a positive integer, got int 0"),
        (2.0, "must return a positive integer, got float 2.0"),
        (None, "must return a positive integer, got NoneType None"),
        (11, "returned 11, above the call's limit 10"),
    ],
    ids=repr,
)
def test_a_weight_function_returning_a_bad_weight_fails_the_call_naming_it(weight: object, expected: str) -> None:
    def weight_of(model: str) -> object:
        return weight

    cap = Cap("gpu", 10, weight=weight_of)
    with pytest.raises(CapKeyError) as raised:
        needs_for([cap], ("large",), {})

    message = str(raised.value)
    assert "'gpu'" in message and "weight_of" in message and expected in message


def test_a_weight_function_that_raises_becomes_a_cap_key_error() -> None:
    def weight_of(model: str) -> int:
        raise KeyError(model)

    with pytest.raises(CapKeyError, match=r"'gpu': weight function .*weight_of raised KeyError: 'large'") as raised:
        needs_for([Cap("gpu", 10, weight=weight_of)], ("large",), {})
    assert isinstance(raised.value.__cause__, KeyError)


def test_a_weight_above_the_limit_a_limit_function_gives_fails_that_call() -> None:
    cap = Cap("tenant", plan_limit, key=tenant_key, weight=3)
    assert needs_for([cap], ("premium-acme",), {}).weights == {"tenant:premium-acme": 3}
    with pytest.raises(CapKeyError, match=r"'tenant': weight 3 is above the call's limit 1"):
        needs_for([cap], ("globex",), {})


# -- fair shares ---------------------------------------------------------------------------


def tenant_of(tenant_id: str, **kwargs: Any) -> str:
    return tenant_id


def test_a_fair_key_is_what_fair_by_returns_for_the_call() -> None:
    caps = [Cap("provider", 25, fair_by=tenant_of), Cap("tenant", 2, key=tenant_key)]

    needs = needs_for(caps, ("acme",), {})
    assert needs.slots == {"provider": 25, "tenant:acme": 2}
    assert needs.fair_keys == {"provider": "acme"}
    # A cap without fair_by passes none: the store orders its list first come, first served
    assert needs_for(caps[1:], ("acme",), {}).fair_keys == {}
    assert needs.of(["tenant:acme"]).fair_keys == {} and needs.of(["provider"]).fair_keys == {"provider": "acme"}


@pytest.mark.parametrize(
    ("fair_key", "expected"),
    [
        (7, "fair_by function must return a string, got int 7"),
        ("", "fair_by function returned an empty string"),
        ("x" * (MAX_KEY_LENGTH + 1), f"is longer than {MAX_KEY_LENGTH} characters"),
        ("a\x00b", "contains a control character"),
    ],
    ids=repr,
)
def test_a_fair_by_function_returning_a_bad_key_fails_the_call_naming_it(fair_key: object, expected: str) -> None:
    def fair_key_of(tenant_id: str) -> object:
        return fair_key

    with pytest.raises(CapKeyError) as raised:
        needs_for([Cap("provider", 25, fair_by=fair_key_of)], ("acme",), {})  # type: ignore[arg-type]

    assert "'provider'" in str(raised.value) and expected in str(raised.value)


def test_a_fair_by_function_that_raises_becomes_a_cap_key_error_naming_it() -> None:
    def fair_key_of(tenant_id: str) -> str:
        raise LookupError(tenant_id)

    with pytest.raises(CapKeyError, match=r"'provider': fair_by function .*fair_key_of raised LookupError: acme"):
        needs_for([Cap("provider", 25, fair_by=fair_key_of)], ("acme",), {})


def test_fair_by_that_is_not_callable_is_refused_when_the_cap_is_declared() -> None:
    with pytest.raises(ConfigurationError, match=r"'provider': fair_by must be a callable or None, got 'tenant_id'"):
        Cap("provider", 25, fair_by="tenant_id")  # type: ignore[arg-type]
