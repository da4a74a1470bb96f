"""A tiny Celery project for the end-to-end CLI test: ``celery -A tests.unit.cliapp caps status``.

Its ``caps_url`` comes from ``CAPS_CLI_TEST_URL``.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_caps import Cap, CappedTask

app = Celery("cliapp", broker="memory://")
app.conf.caps_url = os.environ.get("CAPS_CLI_TEST_URL")


@app.task(base=CappedTask, cap=Cap("cli-provider", 5))
def call_provider() -> None:
    """Stands for a task that calls a fragile provider."""
