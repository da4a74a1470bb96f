"""Wake queues: where a woken task is published, and where it goes when it is sent on again."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from kombu.entity import Exchange, Queue

from celery_caps import Cap, CappedTask
from celery_caps.messages import WAKE_QUEUE_SUFFIX, destination_queue, queue_of_wake_queue, wake_queue_name
from celery_caps.messages import _declared_queue as declared_queue


@pytest.fixture
def app() -> Celery:
    app = Celery("wake-queues", broker="memory://", set_as_current=False)
    app.conf.caps_url = "memory://"
    app.conf.task_queues = [Queue("reports", Exchange("jobs", type="topic"), routing_key="jobs.reports")]
    return app


def test_a_wake_queue_is_named_after_its_queue_and_maps_back() -> None:
    assert wake_queue_name("emails") == "emails" + WAKE_QUEUE_SUFFIX
    assert wake_queue_name(wake_queue_name("emails")) == wake_queue_name("emails")
    assert queue_of_wake_queue(wake_queue_name("emails")) == "emails"
    assert queue_of_wake_queue("emails") == "emails"


@pytest.mark.parametrize(
    ("options", "queue"),
    [
        ({"queue": "emails"}, "emails"),
        ({"queue": Queue("emails")}, "emails"),
        ({"exchange": "", "routing_key": "emails"}, "emails"),
        ({"exchange": "jobs", "routing_key": "jobs.reports"}, "reports"),
        ({"exchange": Exchange("jobs"), "routing_key": "jobs.reports"}, "reports"),
        ({"exchange": "jobs", "routing_key": "jobs.unknown"}, None),
        ({}, None),
    ],
    ids=repr,
)
def test_the_queue_a_parked_message_names_is_found_from_its_route(
    app: Celery, options: dict[str, Any], queue: str | None
) -> None:
    assert declared_queue(app, options) == queue


def test_a_woken_task_without_a_queue_of_its_own_goes_where_celerys_router_sends_it(app: Celery) -> None:
    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False, name="jobs.routed")
    def routed() -> None: ...

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False, name="jobs.plain")
    def plain() -> None: ...

    app.conf.task_default_queue = "defaults"
    app.conf.task_routes = {"jobs.routed": {"queue": "routed-here"}}
    # task_routes, then task_default_queue, as Celery sends them; a named queue wins
    assert destination_queue(app, routed.s()) == "routed-here"
    assert destination_queue(app, plain.s()) == "defaults"
    assert destination_queue(app, plain.s().set(queue="named")) == "named"
    # (a route the options carry from the message's delivery, to a queue nobody declared, is asked
    # of the router too)
    assert destination_queue(app, plain.s().set(exchange="nowhere", routing_key="nothing")) == "defaults"


def test_a_task_woken_into_a_wake_queue_is_sent_on_to_its_own_queue(app: Celery) -> None:
    @app.task(base=CappedTask, cap=Cap("provider", 1), bind=True)
    def work(self: Any) -> None: ...

    woken = {"exchange": wake_queue_name("emails"), "routing_key": wake_queue_name("emails"), "priority": 3}
    signature = work.signature_from_request(_request(woken), (), {})
    assert signature.options["queue"] == "emails"
    assert signature.options["priority"] == 3
    assert "routing_key" not in signature.options

    plain = work.signature_from_request(_request({"exchange": "", "routing_key": "emails"}), (), {})
    assert plain.options["queue"] == "emails"

    # A woken copy as the release publishes it: through the default exchange, by the wake queue's name
    by_name = {"exchange": "", "routing_key": wake_queue_name("emails")}
    assert work.signature_from_request(_request(by_name), (), {}).options["queue"] == "emails"


def _request(delivery_info: dict[str, Any]) -> Any:
    from celery.app.task import Context

    return Context(id="t-1", delivery_info=delivery_info, args=(), kwargs={})


def test_tasks_sent_to_a_full_cap_are_parked_with_their_group_and_links(app: Celery) -> None:
    from celery import group

    from celery_caps.messages import decode_payload
    from celery_caps.runtime import runtime_for

    app.conf.caps_strategy = "park"
    app.conf.caps_park_on_publish = True

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False)
    def work(number: int) -> int:
        return number

    @app.task(shared=False)
    def after(result: int) -> None: ...

    store = runtime_for(app).store
    assert store.acquire({"provider": 1}, "running", "run-1", "elsewhere/1", 60).granted

    # When a group of three and a linked task are sent while the cap is full
    grouped = group(work.s(n) for n in range(3)).apply_async()
    linked = work.apply_async((7,), link=after.s(), priority=5, headers={"trace": "t-1"})

    # Then all four wait in the store, with what they need to be sent later, exactly
    waiters = {w.task_id for w in store.waiters("provider")}
    assert waiters == {r.id for r in grouped.results} | {linked.id}
    woken = {w.task_id: decode_payload(app, w.payload) for w in store.readmit("provider", 30)}
    for result in grouped.results:
        options = woken[result.id]["options"]
        assert options["group_id"] == grouped.id and options["task_id"] == result.id
    linked_options = woken[linked.id]["options"]
    assert woken[linked.id]["args"] == [7]
    links = linked_options["link"]
    assert [link["task"] for link in (links if isinstance(links, list) else [links])] == [after.name]
    assert linked_options["priority"] == 5 and linked_options["headers"]["trace"] == "t-1"

    # ... and with room, a task is sent as usual (nothing stored)
    store.release("run-1")
    sent = work.apply_async((8,))
    assert sent.id not in {w.task_id for w in store.waiters("provider")}


@pytest.mark.redis
def test_a_woken_copy_goes_to_its_wake_queue_in_one_broker_command() -> None:
    import redis

    from celery_caps import handover
    from celery_caps.messages import encode_payload
    from celery_caps.runtime import runtime_for
    from celery_caps.stores.base import Woken
    from tests.services import close_client_app, new_prefix, require_service

    # Given an app on a Redis broker whose wake queue is declared (as a worker declares it)
    url = require_service("redis")
    prefix = new_prefix()
    app = Celery("wake-publish", broker=url, set_as_current=False)
    app.conf.caps_url = "memory://"
    app.conf.broker_transport_options = {"global_keyprefix": f"{prefix}kombu:"}
    app.conf.task_default_queue = f"{prefix}emails"

    @app.task(base=CappedTask, cap=Cap("provider", 1), shared=False, name="jobs.send")
    def send(to: str) -> None: ...

    client = redis.Redis.from_url(url)
    try:
        payload = encode_payload(app, dict(send.s("a@example.org")))
        woken = [Woken(f"t-{n}", f"run-{n}", payload, "jobs.send") for n in range(3)]
        handover.publish_woken(runtime_for(app), woken[:1])  # declares the wake queue
        before = _commands(client)

        # When the release publishes two more woken copies
        assert handover.publish_woken(runtime_for(app), woken[1:]) == woken[1:]

        # Then each is one LPUSH on the wake queue, named; no lookup of its exchange's bindings
        spent = {name: count - before.get(name, 0) for name, count in _commands(client).items()}
        assert spent.get("lpush") == 2, spent
        assert not spent.get("smembers"), spent
        wake = f"{prefix}kombu:{wake_queue_name(app.conf.task_default_queue)}"
        assert client.llen(wake) == 3
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
        runtime_for(app).close()
        close_client_app(app)


def _commands(client: Any) -> dict[str, int]:
    """Calls per command on the server so far (``INFO commandstats``)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}
