"""What a copy of a task carries: a retry waits afresh, a put-back and a parked message keep
the wait, and none carries the delivery's own dispatch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_caps import Cap, CappedTask
from celery_caps.messages import COUNTDOWN_HEADER, DEFERRALS_HEADER, DISPATCH_HEADER, FIRST_DEFERRED_HEADER

#: The headers of a delivery that waited: woken (a dispatch), after three deferrals since 1000.0.
DELIVERED = {
    DISPATCH_HEADER: "dispatch-run",
    COUNTDOWN_HEADER: 0.5,
    DEFERRALS_HEADER: 3,
    FIRST_DEFERRED_HEADER: 1000.0,
    "tenant-trace": "kept",
}


@pytest.fixture
def task() -> Iterator[Any]:
    app = Celery("copies", set_as_current=False)
    app.conf.caps_url = "memory://"

    @app.task(base=CappedTask, cap=Cap("copies", 1), bind=True, shared=False, max_retries=3)
    def waits(self: Any) -> None: ...

    waits.push_request(id="t-1", retries=0, headers=dict(DELIVERED), delivery_info={"routing_key": "celery"})
    try:
        yield waits
    finally:
        waits.pop_request()
        app.close()


def test_a_retry_carries_none_of_the_earlier_attempts_wait_nor_its_dispatch(task: Any) -> None:
    # As Task.retry builds it: no headers= of its own
    retry = task.signature_from_request(task.request, (), {}, countdown=1, retries=1)
    headers = retry.options["headers"]
    assert headers.get("tenant-trace") == "kept"
    for name in (DISPATCH_HEADER, COUNTDOWN_HEADER, DEFERRALS_HEADER, FIRST_DEFERRED_HEADER):
        assert name not in headers, (name, headers)


def test_a_put_back_keeps_the_wait_it_is_given_and_drops_the_dispatch(task: Any) -> None:
    # As a put-back or a park builds it: the waiting history passed as headers=
    given = {**DELIVERED, DEFERRALS_HEADER: 4}
    copy = task.signature_from_request(task.request, (), {}, headers=given)
    headers = copy.options["headers"]
    assert (headers[DEFERRALS_HEADER], headers[FIRST_DEFERRED_HEADER]) == (4, 1000.0)
    assert DISPATCH_HEADER not in headers and COUNTDOWN_HEADER not in headers
