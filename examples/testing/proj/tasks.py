"""The project's tasks: shared tasks (``@shared_task``), so that every app, the tests' too, has them."""

from __future__ import annotations

import time

from celery import shared_task

from celery_caps import Cap, CappedTask

#: At most one import per tenant at a time, fleet-wide.
TENANT_IMPORTS = Cap("tenant-imports", 1, key=lambda tenant, path, seconds=0.0: tenant)


@shared_task(base=CappedTask, cap=TENANT_IMPORTS)
def import_file(tenant: str, path: str, seconds: float = 0.0) -> str:
    """Import ``path`` for ``tenant`` (here: take ``seconds``)."""
    time.sleep(seconds)
    return f"{tenant}: imported {path}"
