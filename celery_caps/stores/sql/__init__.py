"""The SQL slot store: PostgreSQL, MySQL/MariaDB and SQLite through SQLAlchemy.

Where to look:

* :mod:`.schema`: the four tables (``metadata`` for your own migrations);
* :mod:`.statements`: every SQL statement, by name, and how it runs (``Statements.execute``);
* :mod:`.dialects`: what differs between the databases, and their engines' options;
* :mod:`.leases`: admission, renewal, release and the operators' reads, in portable SQL;
* :mod:`.waitlist`: the waiting list of the park strategy, in portable SQL;
* :mod:`.postgresql` and ``postgresql.sql``: PostgreSQL's admission, park, release and claim,
  one round trip each.
"""

from __future__ import annotations

from typing import Any

from .schema import (
    MAX_TASK_ID_LENGTH,
    MAX_TASK_NAME_LENGTH,
    SCHEMA_VERSION,
    concurrency_slots,
    concurrency_slots_history,
    concurrency_waiters,
    concurrency_waitlists,
    metadata,
)
from .waitlist import SQLStore

__all__ = [
    "MAX_TASK_ID_LENGTH",
    "MAX_TASK_NAME_LENGTH",
    "SCHEMA_VERSION",
    "SQLStore",
    "concurrency_slots",
    "concurrency_slots_history",
    "concurrency_waiters",
    "concurrency_waitlists",
    "metadata",
    "sql_store",
]


def sql_store(target: Any, *, create_schema: bool = True) -> SQLStore:
    """The SQL store for ``target`` (a URL or an ``Engine``): :class:`~.postgresql.PostgreSQLStore`
    on PostgreSQL with psycopg, else the portable :class:`SQLStore`."""
    from .dialects import parse_url

    # A URL goes to the store itself, which builds its engine and so owns it (disposes of it, and
    # closes what its pool keeps once idle); an engine handed in stays its owner's.
    if isinstance(target, str):
        parsed = parse_url(target)
        dialect, driver = parsed.get_backend_name(), parsed.get_driver_name()
    else:
        dialect, driver = target.dialect.name, target.dialect.driver
    if dialect == "postgresql" and driver == "psycopg":
        from .postgresql import PostgreSQLStore

        store_class: type[SQLStore] = PostgreSQLStore
    else:
        store_class = SQLStore
    return store_class(target, create_schema=create_schema)
