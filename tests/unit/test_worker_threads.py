"""The threads celery-caps starts end with what started them, for embedded workers too.

Celery's embedded worker (``start_worker``, and the ``celery_worker`` fixture built on it) ends
with a cold shutdown: the worker's steps are terminated, not stopped.  The worker's own
threads (recovery, the store check) end when the worker returns; the app's runtime (its lease
keeper, its background releases) ends with the app.  A thread left behind keeps calling the
store of a closed app, under the tests that follow.
"""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
from celery.contrib.testing.worker import start_worker

from celery_caps import Cap, CappedTask
from tests.unit.embedded import embedded_app

pytest_plugins = ["pytester"]

#: Seconds a stopped thread may take to end (one store call of the memory store, at most).
ENDING_SECONDS = 5.0
#: The worker's own threads (CapsWorkerStep's), joined when the worker stops.
WORKER_THREADS = ("celery-caps-recovery", "celery-caps-store-check")


def _caps_threads(ignore: frozenset[threading.Thread] = frozenset()) -> list[str]:
    return sorted(
        thread.name
        for thread in threading.enumerate()
        if thread.name.startswith("celery-caps") and thread not in ignore and thread.is_alive()
    )


def _gone_shortly(ignore: frozenset[threading.Thread]) -> list[str]:
    """The celery-caps threads still alive after :data:`ENDING_SECONDS` (none, if they end)."""
    deadline = time.monotonic() + ENDING_SECONDS
    while _caps_threads(ignore) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _caps_threads(ignore)


@pytest.mark.memory
def test_an_embedded_worker_leaves_no_thread_of_its_own_behind() -> None:
    before = frozenset(threading.enumerate())
    with embedded_app("threads", backend="cache+memory://") as app:

        @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
        def double(value: int) -> int:
            return value * 2

        # Given an embedded worker that runs a capped task
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            assert "celery-caps-recovery" in _caps_threads(before)  # the memory store keeps a waiting list
            assert double.delay(21).get(timeout=10) == 42
        # Then the worker's own threads have ended when it returns
        assert not [name for name in _caps_threads(before) if name in WORKER_THREADS]
    # ... and the app's runtime threads (the lease keeper) end with the app
    assert _gone_shortly(before) == []


def test_the_pytest_fixtures_leave_no_thread_behind(pytester: pytest.Pytester) -> None:
    # Given a project's tests on Celery's fixtures and the caps fixture (as examples/testing)
    pytester.makeconftest(
        """
        import pytest

        pytest_plugins = ["celery.contrib.pytest", "celery_caps.testing"]

        @pytest.fixture(scope="session")
        def celery_config():
            return {"broker_url": "memory://", "result_backend": "cache+memory://", "caps_url": "memory://"}

        @pytest.fixture(scope="session")
        def celery_worker_parameters():
            return {"perform_ping_check": False}
        """
    )
    pytester.makepyfile(
        test_capped=textwrap.dedent(
            f"""
            import threading
            import time

            import pytest

            from celery import shared_task

            from celery_caps import Cap, CappedTask

            # Known when the worker starts (as a project's tasks are): the worker runs recovery.
            @shared_task(base=CappedTask, cap=Cap("provider", 1))
            def double(value):
                return value * 2

            @pytest.mark.parametrize("value", [1, 2])
            def test_a_capped_task_runs(celery_app, celery_worker, caps, value):
                assert any(t.name == "celery-caps-recovery" for t in threading.enumerate())
                assert double.delay(value).get(timeout=10) == value * 2
                assert caps.peak("provider") == 1

            def test_then_no_celery_caps_thread_is_left():
                deadline = time.monotonic() + {ENDING_SECONDS}
                def left():
                    return sorted(t.name for t in threading.enumerate() if t.name.startswith("celery-caps"))
                while left() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert left() == []
            """
        )
    )
    # When they run (in a process of their own: nothing else leaves threads there)
    result = pytester.runpytest_subprocess("-p", "no:celery", "-p", "no:cacheprovider", "-W", "error", timeout=120)
    # Then the two tests' workers and apps have taken their threads with them
    result.assert_outcomes(passed=3)
