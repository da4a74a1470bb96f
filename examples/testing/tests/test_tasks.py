"""What a project's own tests of capped tasks look like (see README.md beside this)."""

from __future__ import annotations

import time
from typing import Any

from proj.tasks import import_file

from celery_caps import Cap, CappedTask


def test_a_direct_call_is_a_plain_function_call() -> None:
    # No broker, no worker, no store: calling the task runs its body, as for any Celery task.
    assert import_file("acme", "a.csv") == "acme: imported a.csv"


def test_an_eager_run_needs_no_store(celery_app: Any) -> None:
    # apply() (and task_always_eager) runs without caps unless caps_enforce_eager is set.
    assert import_file.apply(("acme", "a.csv")).get() == "acme: imported a.csv"


def test_imports_of_one_tenant_run_one_at_a_time(celery_app: Any, celery_worker: Any, caps: Any) -> None:
    # Given a worker with four threads, three imports for each of two tenants (a cap of 1 per tenant)
    sent = [import_file.delay(tenant, f"{n}.csv", 0.2) for n in range(3) for tenant in ("acme", "globex")]

    # Then every import runs, never two of one tenant at once, and the tenants' imports overlap
    assert sorted(result.get(timeout=30) for result in sent) == sorted(
        f"{tenant}: imported {n}.csv" for n in range(3) for tenant in ("acme", "globex")
    )
    assert caps.peak("tenant-imports", key="acme") == 1
    assert caps.peak("tenant-imports", key="globex") == 1
    # ... the ones that found their tenant's slot taken waited in the store, then got it
    assert sum(1 for result in sent if caps.waited(result.id)) >= 2
    assert caps.waiting() == [] and caps.held() == []


def test_a_task_defined_in_a_test_and_sent_to_a_named_queue_waits_and_runs(
    celery_app: Any, celery_worker: Any, caps: Any
) -> None:
    # Celery's documented pattern: a task defined inside the test, then the worker reloaded.
    # (The worker consumes the wake queue of every queue it consumes, whatever tasks it knew
    # when it started: the woken task reaches it.)
    @celery_app.task(base=CappedTask, cap=Cap("ledger", 1), shared=False)
    def post(entry: int) -> int:
        time.sleep(0.1)
        return entry

    celery_worker.reload()
    results = [post.apply_async((n,), queue="celery") for n in range(3)]
    assert [result.get(timeout=30) for result in results] == [0, 1, 2]
    assert caps.peak("ledger") == 1
