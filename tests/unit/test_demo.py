"""The demo's own figures (``examples/demo/demo.py``), from a side channel written by hand: what
it counts as waiting for a free slot, how it words its report, and its task ids."""

from __future__ import annotations

import importlib.util
import re
import sqlite3
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("caps_demo", REPO_ROOT / "examples" / "demo" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def side_channel(path: Path, rows: list[tuple[str, str, float]]) -> None:
    """``(kind, task id, at)`` rows in the demo's side channel (tenant "acme")."""
    connection = sqlite3.connect(path)
    connection.execute(
        "CREATE TABLE events (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, task_id TEXT, tenant TEXT, worker TEXT, "
        "pid INTEGER NOT NULL, at REAL NOT NULL, deferrals INTEGER)"
    )
    connection.executemany(
        "INSERT INTO events (kind, task_id, tenant, worker, pid, at) VALUES (?, ?, 'acme', 'w1', 1, ?)", rows
    )
    connection.commit()
    connection.close()


def test_the_demo_counts_the_tasks_that_had_to_wait_and_says_so_in_plain_words(
    demo: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "observations.db"
    side_channel(
        path,
        [
            ("attempt", "a", 1.0), ("start", "a", 1.1), ("end", "a", 1.5),  # ran at once
            ("attempt", "b", 1.2),  # its cap was full: it waited ...
            ("attempt", "c", 1.3),  # ... and so did this one, which waits still
            ("attempt", "b", 1.6), ("waited", "b", 1.6), ("start", "b", 1.6), ("end", "b", 2.0),
        ],
    )  # fmt: skip
    observed = demo.observe(path, "demo-provider", "demo-tenant")

    assert observed.tasks_that_waited() == {"b", "c"}
    assert observed.tasks_waiting() == {"c"}

    plan = demo.Plan([("a", "acme", 0.1), ("b", "acme", 0.1), ("c", "acme", 0.1)], "demo-provider", "demo-tenant", 4, 2)
    demo.report(plan, observed, 0, [], 1.0, 2.0, 4, "park")
    output = capsys.readouterr().out
    assert "tasks that had to wait for a free slot before they ran: 2 of 3 (the others found room at once)" in output
    assert (
        "deliveries of a task to a worker: 4 for 3 tasks (a task that found its cap full waited in the slot store"
        in (output)
    )
    assert "caps_deferrals" not in output and "put back" not in output


def test_the_demo_sends_its_tasks_under_ids_in_celerys_form(demo: ModuleType) -> None:
    plan = demo.make_plan(5, 1, 4, 2, SimpleNamespace(PROVIDER_CAP="demo-provider", TENANT_CAP="demo-tenant"))
    for task_id, _tenant, _seconds in plan.tasks:
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", task_id), task_id
