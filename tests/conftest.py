"""Fixtures shared by every test layer: the store table (see ``tests/services.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_caps.stores.base import SlotStore
from tests.services import StoreKind, StoreTarget, delete_own_rows, new_prefix, store_params, store_url_for


@pytest.fixture(params=store_params())
def store_kind(request: pytest.FixtureRequest) -> StoreKind:
    """One row of the store table; every test using a store fixture runs once per row."""
    kind: StoreKind = request.param
    return kind


@pytest.fixture
def prefix() -> str:
    """This test's prefix for its slot names and task ids: test runs sharing a server never
    see, count or release each other's slots (release_task reaches every lease of a task id)."""
    return new_prefix()


@pytest.fixture
def store_target(store_kind: StoreKind, tmp_path: Path) -> StoreTarget:
    """How to build this test's store, for tests that start several processes."""
    return StoreTarget(store_kind, store_url_for(store_kind, tmp_path), key_prefix=new_prefix())


@pytest.fixture(name="store_url")
def store_url_fixture(store_target: StoreTarget) -> str:
    """The URL this test's store is built from."""
    return store_target.url


@pytest.fixture
def store(store_target: StoreTarget, prefix: str) -> Iterator[SlotStore]:
    """This test's store; its rows are deleted and its connections closed afterwards."""
    opened = store_target.open()
    try:
        yield opened
    finally:
        try:
            delete_own_rows(store_target, opened, prefix)
        finally:
            opened.close()
