"""A store URL's credentials are never shown: its password, and a password passed in its query
string (``?password=``, ``?passwd=``, ...), which the SQL drivers take as well.  Checked where a
store is named: its ``display_url``, every ``StoreError`` of a real store that cannot be reached or
refuses the connection, and ``celery caps check``."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_caps.errors import StoreError
from celery_caps.stores import store_from_url
from celery_caps.stores.base import mask_url
from tests.services import require_service
from tests.unit.test_cli import run

SECRET = "s3cret-pw"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql+psycopg://app@db/app?password=s3cret", "postgresql+psycopg://app@db/app?password=***"),
        (
            "mysql+pymysql://root@db/app?passwd=s3cret&charset=utf8mb4",
            "mysql+pymysql://root@db/app?passwd=***&charset=utf8mb4",
        ),
        ("mssql://u@db/app?PWD=s3cret", "mssql://u@db/app?PWD=***"),
        (
            "postgresql://u@db/app?sslpassword=s3cret&sslmode=require",
            "postgresql://u@db/app?sslpassword=***&sslmode=require",
        ),
        ("redis://db/0?sentinel_password=s3cret", "redis://db/0?sentinel_password=***"),
        ("postgresql://u@db/app?pass%77ord=s3cret", "postgresql://u@db/app?pass%77ord=***"),
        ("postgresql://u:s3cret@db/app?password=s3cret", "postgresql://u:***@db/app?password=***"),
        ("postgresql://u@db/app?auth_token=s3cret", "postgresql://u@db/app?auth_token=***"),
        # What is not a credential stays as written, encoding included.
        (
            "postgresql://u@db/app?options=-csearch_path%3Dx&passfile=/etc/pgpass",
            "postgresql://u@db/app?options=-csearch_path%3Dx&passfile=/etc/pgpass",
        ),
    ],
    ids=["password", "passwd", "pwd", "sslpassword", "sentinel", "encoded-name", "both", "token", "no-secret"],
)
def test_mask_url_hides_a_credential_wherever_it_sits(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def with_query(url: str, **query: str) -> str:
    return sa.engine.make_url(url).update_query_dict(query).render_as_string(hide_password=False)


def unreachable(scheme: str, **query: str) -> str:
    return with_query(f"{scheme}://caps:p%40ss-{SECRET}@127.0.0.1:1/caps", connect_timeout="2", **query)


def missing_database(service: str, **query: str) -> str:
    """A URL of the ``service`` server for a database that does not exist."""
    url = sa.engine.make_url(require_service(service)).set(database=f"caps_missing_{uuid.uuid4().hex[:8]}")
    return with_query(url.render_as_string(hide_password=False), **query)


# Each: a store URL with a credential in its query string, which the store cannot use.
FAILING = {
    "postgres-unreachable": lambda: unreachable("postgresql+psycopg", password=SECRET),
    "postgres-no-database": lambda: missing_database("postgres", password=SECRET),
    "mysql-unreachable": lambda: unreachable("mysql+pymysql", passwd=SECRET),
    "mysql-refused-password": lambda: with_query(require_service("mysql"), password=SECRET),
    "mysql-refused-passwd": lambda: missing_database("mysql", passwd=SECRET),
}


# pymysql takes ``passwd`` and warns that it is deprecated.
@pytest.mark.filterwarnings("ignore:'passwd' is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=getattr(pytest.mark, name.split("-")[0])) for name in FAILING],
)
def test_a_store_error_never_holds_a_password_of_the_query_string(case: str) -> None:
    url = FAILING[case]()
    store = store_from_url(url)
    try:
        assert SECRET not in store.display_url and "=***" in store.display_url
        # When the store is used
        with pytest.raises(StoreError) as raised:
            store.status()
    finally:
        store.close()
    # Then its error names the store, masked, and the driver's cause, but no secret
    message = str(raised.value)
    assert f"failed on {store.display_url}: " in message, message
    assert SECRET not in message, message


@pytest.mark.postgres
def test_check_of_a_working_store_shows_no_password_of_the_query_string() -> None:
    # Given a store reached with a password in its query string (the test server trusts its
    # clients, so the password is taken and not needed)
    app = Celery("creds", broker="memory://", set_as_current=False)
    app.conf.caps_url = with_query(require_service("postgres"), password=SECRET)

    result = run(app, "check")

    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: postgresql+psycopg://"), result.output
    assert "password=***" in result.output and SECRET not in result.output


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("postgres-unreachable", marks=pytest.mark.postgres),
        pytest.param("mysql-refused-password", marks=pytest.mark.mysql),
    ],
)
def test_check_of_a_failing_store_shows_no_password_of_the_query_string(case: str) -> None:
    app = Celery("creds", broker="memory://", set_as_current=False)
    app.conf.caps_url = FAILING[case]()

    result = run(app, "check")

    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: ") and "=***" in line, line
    assert SECRET not in result.output


def test_a_bad_prepare_threshold_is_refused_without_the_password_of_the_query_string() -> None:
    from celery_caps.errors import ConfigurationError
    from celery_caps.stores import store_from_url

    with pytest.raises(ConfigurationError, match="prepare_threshold") as caught:
        store_from_url("postgresql+psycopg://app@127.0.0.1:1/app?password=s3cret-pw&prepare_threshold=often")
    assert "s3cret-pw" not in str(caught.value), caught.value
