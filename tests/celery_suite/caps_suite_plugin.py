"""A pytest plugin that runs Celery's own integration suite (``t/integration`` of Celery's sdist)
with every task of its test app capped.  ``run.py`` loads it (``-p caps_suite_plugin``); it is
not part of celery-caps' own test run.

Celery's ``t/integration/conftest.py`` imports three fixtures of ``celery.contrib.pytest`` and
relies on a plugin for the rest; this module provides them, so that only the test app's
parameters and configuration differ between the modes:

- the test apps' default task class (``Celery(task_cls=...)``) is a ``CappedTask`` subclass with
  one cap for all, so every task defined with ``@shared_task`` (and Celery's built-in tasks) is
  capped; tasks given another ``base=`` are not, and the report names them;
- ``celery_config`` (the conftest's) gets the ``caps_*`` settings added, with history on, so that
  the report at the end counts the capped runs and their peak from the store itself.

Set by ``run.py`` in the environment:

``CAPS_SUITE_LIMIT``
    the cap's limit; empty: no caps (the same suite, uncapped, for comparison)
``CAPS_SUITE_CAPS_URL``
    the slot store (a SQLite file: the embedded worker's prefork children must share it)
``CAPS_SUITE_REDIS_DB``
    the Redis database of Celery's own Redis helper (``get_redis_connection``, db 0 otherwise)
``CAPS_SUITE_CONCURRENCY``
    the embedded worker's pool size
``CAPS_SUITE_SUBSET``
    ``ci``: only ``test_tasks.py`` and ``test_chord``'s errback/link_error tests; else all
``CAPS_SUITE_REPORT``
    where to write the caps report (JSON)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from celery.contrib.pytest import use_celery_app_trap  # noqa: F401

#: The one cap every task of the test app takes.
CAP_NAME = "celery-suite"

#: Tests of the CI subset: all of ``test_tasks.py``, and the chord tests whose name mentions an
#: errback or ``link_error``.
CI_MODULE = "test_tasks.py"
CI_CANVAS_CLASS = "test_chord"
CI_CANVAS_WORDS = ("errback", "link_error")

#: Tests left out of every run, with the reason (node id suffix -> reason): each failed uncapped too.
DESELECTED: dict[str, str] = {
    "test_tasks.py::test_trace_log_arguments::test_task_success": (
        "waits 10 ms for the pool process's log records to reach the test's log capture: fails uncapped "
        "(Celery marks it flaky)"
    ),
    "test_tasks.py::test_trace_log_arguments::test_task_failed": "the same as test_task_success",
    "test_tasks.py::test_tasks::test_revoked_by_headers_complex_canvas": (
        "22 canvases of 2-4 s sleeps within its own 20 s timeout: times out uncapped now and then "
        "(Celery marks it flaky), and always under a binding cap of 2 (the sleeps run two at a time)"
    ),
    "test_tasks.py::test_tasks::test_retry": (
        "the task counts its attempts in an attribute of the task object, i.e. per pool process: "
        "it needs a pool of one (Celery's suite runs -c 1).  With -c 4 an attempt that lands on "
        "another process counts afresh and max_retries ends it with ExpectedException: in runs of "
        "`-k retry`, 2 of 4 failed uncapped and 5 of 8 under the binding cap"
    ),
}

#: Tests rerun (up to twice) when they fail, with the race in Celery that fails them now and then
#: (node id suffix -> reason).  Celery's own ``@flaky`` marks are removed: no other test is rerun.
RERUN: dict[str, str] = {
    "test_tasks.py::test_task_replacement::test_replaced_task_nesting_level_0": (
        "the test resets its flag (assertion_result = False) after delay() returns, while its "
        "task_received handler sets it in the embedded worker's consumer thread: a worker that "
        "receives the task before the test thread's next statement has its True overwritten.  In "
        "runs of `-k test_replaced_task_nesting` with Celery 5.7.0 it failed in 2 of 10 uncapped "
        "and 1 of 10 under the binding cap (and failed a CI run)"
    ),
    "test_tasks.py::test_task_redis_result_backend::test_retry_preserves_ignore_result_false": (
        "Celery sends the retry's message before the first attempt stores RETRY, and "
        "_store_result's guard against overwriting SUCCESS reads, then writes: a retried attempt "
        "that stores SUCCESS between the two leaves RETRY as the final state.  Traced in this "
        "harness (runs of `-k retry`), the retried attempt's SUCCESS landed before the first "
        "attempt's RETRY write for 3 of 14 retried tasks uncapped and 6 of 10 under the binding cap "
        "(history on); the guard nearly always keeps SUCCESS"
    ),
}
#: Seconds a test's teardown waits for the waiting list to empty, so that no task of one test is
#: woken during the next (whose signal handlers would see it); then the run goes on regardless.
QUIET_SECONDS = 20.0


def _limit() -> int | None:
    value = os.environ.get("CAPS_SUITE_LIMIT", "")
    return int(value) if value else None


def _capped_task_class(limit: int) -> type:
    from celery_caps import Cap, CappedTask

    class SuiteTask(CappedTask):  # type: ignore[misc]
        cap = Cap(CAP_NAME, limit)

    SuiteTask.__module__ = __name__
    return SuiteTask


@pytest.fixture(scope="session")
def celery_parameters() -> dict[str, Any]:
    """The test apps' parameters: their default task class is capped (none in uncapped mode)."""
    limit = _limit()
    return {} if limit is None else {"task_cls": _capped_task_class(limit)}


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    """The embedded worker's pool size (Celery's suite uses 1; a cap of 2 needs more to bind)."""
    return {"concurrency": int(os.environ.get("CAPS_SUITE_CONCURRENCY", "1"))}


def _caps_config() -> dict[str, Any]:
    return {
        "caps_url": os.environ["CAPS_SUITE_CAPS_URL"],
        "caps_history_seconds": 24 * 3600,
        "caps_history_max_events": 1_000_000,
        # As the README recommends for capped tasks.
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
    }


_session: dict[str, Any] = {}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Any:
    result = yield
    if fixturedef.argname == "celery_config" and _limit() is not None and isinstance(result, dict):
        # Celery's conftest builds the configuration; the caps settings join it in place.
        result.update(_caps_config())
    elif fixturedef.argname == "celery_session_worker" and result is not None:
        _session["app"] = result.app
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Hide the wake queues from the conftest's check that the session app knows no queue but
    ``celery``: with park, a worker also consumes ``celery.caps-wake`` (a documented difference).
    Wake messages are published to a ``Queue`` object, never looked up in ``app.amqp.queues``."""
    from celery_caps.messages import is_wake_queue

    _wait_for_quiet()
    app = _session.get("app")
    hidden = {}
    if app is not None:
        queues = app.amqp.queues
        hidden = {name: queues.pop(name) for name in list(queues) if is_wake_queue(name)}
    try:
        return (yield)
    finally:
        if app is not None:
            for name, queue in hidden.items():
                app.amqp.queues.setdefault(name, queue)


def _wait_for_quiet() -> None:
    """Wait (at most ``QUIET_SECONDS``) until no task waits for the cap: a task of this test woken
    during the next one would meet that test's ``task_received`` handlers and counters (as
    ``test_replaced_task_nesting_level_0``'s did).  Uncapped, nothing waits."""
    if _limit() is None:
        return
    store = _session.get("store")
    if store is None:
        from celery_caps.stores import store_from_url

        store = _session["store"] = store_from_url(os.environ["CAPS_SUITE_CAPS_URL"])
    deadline = time.monotonic() + QUIET_SECONDS
    while store.waiters() and time.monotonic() < deadline:
        time.sleep(0.1)


def _use_redis_db(function: Any, db: int) -> None:
    """Point Celery's ``get_redis_connection()`` (Redis on localhost, db 0) at database ``db``,
    for every module that imported it: its code object is replaced in place."""

    def get_redis_connection() -> Any:
        from redis import StrictRedis

        host = os.environ.get("REDIS_HOST", "localhost")
        port = os.environ.get("REDIS_PORT", 6379)
        return StrictRedis(host=host, port=port, db=int(os.environ["CAPS_SUITE_REDIS_DB"]), socket_timeout=None)

    function.__code__ = get_redis_connection.__code__


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "celery_suite_ci: the CI subset of Celery's integration suite")
    _session["started"] = time.time()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from t.integration import tasks

    _use_redis_db(tasks.get_redis_connection, int(os.environ.get("CAPS_SUITE_REDIS_DB", "0")))
    subset = os.environ.get("CAPS_SUITE_SUBSET", "")
    kept, dropped = [], []
    _check_names_match(config, items)
    for item in items:
        in_ci = _in_ci_subset(item)
        if in_ci:
            item.add_marker(pytest.mark.celery_suite_ci)
        item.own_markers[:] = [mark for mark in item.own_markers if mark.name != "flaky"]
        if any(item.nodeid.endswith(suffix) for suffix in RERUN):
            item.add_marker(pytest.mark.flaky(reruns=2, reruns_delay=1))
        reason = next((why for suffix, why in DESELECTED.items() if item.nodeid.endswith(suffix)), None)
        if reason is not None or (subset == "ci" and not in_ci):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _check_names_match(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Stop the run if a name in DESELECTED or RERUN matches no test of a module that was collected
    (a renamed test, or a wrong class in the name, would otherwise leave it silently unhandled)."""
    if config.option.keyword or config.option.markexpr:
        return
    modules = {item.nodeid.split("::")[0].rsplit("/", 1)[-1] for item in items}
    unmatched = [
        suffix
        for suffix in (*DESELECTED, *RERUN)
        if suffix.split("::")[0] in modules and not any(item.nodeid.endswith(suffix) for item in items)
    ]
    if unmatched:
        raise pytest.UsageError(f"caps_suite_plugin: no test collected is named {', '.join(unmatched)}")


def _in_ci_subset(item: pytest.Item) -> bool:
    path = item.nodeid.split("::")
    if path[0].endswith(CI_MODULE):
        return True
    return (
        path[0].endswith("test_canvas.py")
        and len(path) > 2
        and path[1] == CI_CANVAS_CLASS
        and any(word in path[2] for word in CI_CANVAS_WORDS)
    )


def _peak_of_distinct_tasks(ran: list[Any]) -> tuple[int, list[dict[str, Any]]]:
    """The most distinct task ids whose runs overlapped in time (a cap counts task ids), and
    those runs.  A run spans admission to release, both taken by the clock of the process
    that held it (one machine here); a run ending at the instant another starts does not
    overlap it."""
    edges = sorted(
        [(event.started_at or event.at, 1, index) for index, event in enumerate(ran)]
        + [(event.at, -1, index) for index, event in enumerate(ran)],
        key=lambda edge: (edge[0], edge[1]),
    )
    running: dict[int, Any] = {}
    peak, at_peak = 0, []
    for _, step, index in edges:
        if step < 0:
            running.pop(index, None)
            continue
        running[index] = ran[index]
        _session["peak_runs"] = max(_session.get("peak_runs", 0), len(running))
        distinct = {event.task_id for event in running.values()}
        if len(distinct) > peak:
            peak = len(distinct)
            at_peak = [
                {"task_id": e.task_id, "task": e.task_name, "started": e.started_at, "ended": e.at, "holder": e.holder}
                for e in running.values()
            ]
    return peak, at_peak


def _caps_report() -> dict[str, Any]:
    """What the store saw: capped runs per task, their peak overlap, put-backs, what is left."""
    from celery_caps.stores import store_from_url

    report: dict[str, Any] = {"limit": _limit()}
    app = _session.get("app")
    if app is not None:
        from celery_caps import CappedTask

        tasks = app.tasks.items()
        report["tasks_not_capped"] = sorted(name for name, task in tasks if not isinstance(task, CappedTask))
    store = store_from_url(os.environ["CAPS_SUITE_CAPS_URL"])
    try:
        events = store.history(since=_session["started"] - 60)
        ran = [event for event in events if event.kind == "ran"]
        runs_by_task: dict[str, int] = {}
        for event in ran:
            runs_by_task[event.task_name or "?"] = runs_by_task.get(event.task_name or "?", 0) + 1
        peak, at_peak = _peak_of_distinct_tasks(ran)
        report.update(
            capped_runs=len(ran),
            distinct_tasks=len({event.task_id for event in ran}),
            runs_by_task=dict(sorted(runs_by_task.items())),
            peak_overlap=peak,
            # Runs at once, a task id counted once per run (a cap counts task ids: see peak_overlap).
            peak_runs=_session.get("peak_runs", 0),
            runs_at_peak=at_peak,
            put_backs=sum(1 for event in events if event.kind == "deferred"),
            leases_left=len(store.leases()),
            waiting_left=len(store.waiters()) if hasattr(store, "waiters") else None,
        )
    finally:
        store.close()
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    store = _session.pop("store", None)
    if store is not None:
        store.close()
    if _limit() is None or "CAPS_SUITE_REPORT" not in os.environ:
        return
    report = _caps_report()
    with open(os.environ["CAPS_SUITE_REPORT"], "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    path = os.environ.get("CAPS_SUITE_REPORT")
    if _limit() is None or not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as file:
        report = json.load(file)
    terminalreporter.section("celery-caps")
    for key, value in report.items():
        terminalreporter.write_line(f"{key}: {value}")
