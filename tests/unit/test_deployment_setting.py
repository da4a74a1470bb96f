"""``caps_deployment``: which deployment an app's store handles serve when several share a store."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_caps.errors import ConfigurationError
from celery_caps.settings import CapsSettings
from celery_caps.stores import store_from_url
from celery_caps.stores.memory import MemoryStore


def deployment_of(**conf: object) -> str:
    app = Celery("deployment", set_as_current=False)
    app.conf.update(caps_url="memory://", **conf)
    try:
        return CapsSettings.from_conf(app.conf).deployment
    finally:
        app.close()


def test_by_default_each_broker_is_a_deployment_of_its_own_whatever_its_credentials() -> None:
    staging = deployment_of(broker_url="redis://staging-redis:6379/0")
    production = deployment_of(broker_url="amqp://app:secret@rabbit.prod:5672/app")
    assert staging != production
    assert staging == deployment_of(broker_url="redis://staging-redis:6379/0")
    # The password is not part of it (a rotated password is the same deployment)
    assert production == deployment_of(broker_url="amqp://app:rotated@rabbit.prod:5672/app")
    assert "secret" not in production


def test_a_named_deployment_is_used_as_it_is_and_a_bad_one_is_refused_naming_it() -> None:
    assert deployment_of(broker_url="redis://x/0", caps_deployment="production") == "production"
    for bad in ("", "x" * 65, "line\nbreak", 7):
        with pytest.raises(ConfigurationError, match="caps_deployment must be") as caught:
            deployment_of(caps_deployment=bad)
        assert repr(bad)[:20] in str(caught.value)


def test_a_store_built_from_the_settings_serves_the_deployment_a_ready_one_keeps_its_own() -> None:
    app = Celery("deployment", set_as_current=False)
    app.conf.update(caps_url="memory://", caps_deployment="staging")
    try:
        options = CapsSettings.from_conf(app.conf).store_options
        assert store_from_url("memory://", options).deployment == "staging"
        ready = MemoryStore()
        ready.deployment = "mine"
        assert store_from_url(ready, options).deployment == "mine"
    finally:
        app.close()
