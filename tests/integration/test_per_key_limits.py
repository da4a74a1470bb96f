"""Limits per key from the task's arguments: ``Cap("tier", limit=tier_limit, key=...)``.

Real prefork workers on each store: a premium tenant's key admits 3 at once and a basic
tenant's 1, as measured by the task bodies (not by the library); a limit function that raises
or returns 0 fails its task with ``CapKeyError`` naming the function and the value, takes no
slot (not even the task's other cap) and touches no other key's rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from celery.result import AsyncResult

from celery_caps.errors import CapKeyError
from tests.integration.conftest import STORES_AND_STRATEGIES, FleetFactory, start_fleet_on
from tests.integration.fleet import Fleet, wait_for

pytestmark = [pytest.mark.fleet, pytest.mark.redis]

#: The provider cap the tiered task also takes: high enough never to bind here.
PROVIDER_LIMIT = 8
PREMIUM, BASIC, OTHER_BASIC = "premium-a", "basic-b", "basic-c"
#: tests.integration.fleetapp.tier_limit gives premium tenants 3, the others 1.
TIER_LIMITS = {PREMIUM: 3, BASIC: 1, OTHER_BASIC: 1}
TASKS = {PREMIUM: 12, BASIC: 5, OTHER_BASIC: 5}
TASK_MS = 250


def _result(fleet: Fleet, task_id: str) -> AsyncResult:
    result = fleet.app.AsyncResult(task_id)
    result.get(timeout=30, propagate=False)
    return result


@pytest.mark.parametrize(("store", "strategy"), STORES_AND_STRATEGIES)
def test_each_key_gets_the_limit_its_function_gives(
    make_fleet: FleetFactory, tmp_path: Path, store: str, strategy: str
) -> None:
    fleet = start_fleet_on(make_fleet, tmp_path, store, strategy, provider_limit=PROVIDER_LIMIT)

    # Given a premium tenant (limit 3) and two basic ones (limit 1), all sent at once
    sent = {
        fleet.app.send_task("fleet.tiered", args=[tenant, TASK_MS]).id: tenant
        for tenant, count in TASKS.items()
        for _ in range(count)
    }
    # ... and a tenant whose limit function returns 0, and one whose limit function raises
    broken = fleet.app.send_task("fleet.tiered", args=["broken-x", TASK_MS]).id
    raising = fleet.app.send_task("fleet.tiered", args=["raising-y", TASK_MS]).id

    # Then every good task runs once
    fleet.wait_all_done(sent, 90)
    record = fleet.record()
    assert {t: (record.starts[t], record.done[t]) for t in sent if (record.starts[t], record.done[t]) != (1, 1)} == {}

    # ... and each tenant's measured peak is its own limit: reached, never passed
    peaks = {tenant: record.interval_peak(f"tier:{tenant}", distinct=True) for tenant in TASKS}
    counted = {tenant: record.peaks.get(f"tier:{tenant}", 0) for tenant in TASKS}
    print(f"\n[per-key limits {store}/{strategy}] peaks {peaks} (counted {counted}) against {TIER_LIMITS}")
    assert peaks == TIER_LIMITS, f"peaks {peaks} against limits {TIER_LIMITS}"
    assert all(counted[tenant] <= TIER_LIMITS[tenant] for tenant in TASKS), counted
    assert record.peaks.get("provider", 0) <= PROVIDER_LIMIT

    # ... the store keeps each key's own limit on its sentinel
    limits = {
        status.slot: status.limit for status in fleet.store.status() if status.slot.startswith(fleet.slot("tier:"))
    }
    assert limits == {fleet.slot(f"tier:{tenant}"): limit for tenant, limit in TIER_LIMITS.items()}

    # ... the bad limits failed their tasks with an error naming the function and the value,
    # ran no body, and took no slot of either cap (no sentinel for their keys either)
    for task_id, fragment in ((broken, "must return a positive integer, got int 0"), (raising, "raised LookupError")):
        result = _result(fleet, task_id)
        assert result.state == "FAILURE" and isinstance(result.result, CapKeyError), (result.state, result.result)
        message = str(result.result)
        assert "tier_limit" in message and fragment in message and repr(fleet.slot("tier")) in message, message
        assert record.starts[task_id] == 0
    assert not any("broken-x" in slot or "raising-y" in slot for slot in limits)
    wait_for(lambda: fleet.leases() == [], 10, lambda: f"leases left: {fleet.leases()}")
