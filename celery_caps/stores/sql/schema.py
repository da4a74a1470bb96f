"""The SQL store's schema: five tables, one version.

* ``concurrency_slots``: a **sentinel** row per slot name (``run_id = ''``, ``expires_at``
  NULL, the last limit seen in ``slot_limit``: the slot's limit, which admission and every
  hand-over to a waiter count against), never deleted by the sweep, which admission
  locks before it counts, so two contenders for the last slot always serialise on it; and a
  **lease** row per held slot and run (``run_id``, ``task_id``, ``holder``, ``expires_at`` in
  seconds since the epoch by the **database's clock**, ``weight``: the units of the slot's limit
  the run takes, and for operators ``task_name`` and ``acquired_at``).
* ``concurrency_waiters``: the waiting list of the park strategy, one row per parked task and
  slot it needs (its task name, payload, first-deferral time, the deployment that parked it, its
  weight, fair key and round in that slot, how many times it was dispatched, and while
  dispatched the run id and deadline of its dispatch; a
  tombstone has ``done_until`` set, keeps its dispatch's run id and, if a claim made it, the
  claiming holder).  It holds no limit: a waiter is dispatched against its slots' sentinels, as
  they are at that moment.  Only its own deployment dispatches it: every walk, recovery and
  readmit reads the entries of one deployment, through indexes that hold ``deployment`` first or
  right after the slot, so that another deployment's list costs them nothing.
* ``concurrency_waitlists``: how many entries (waiting or dispatched) each slot's list holds, so
  that a park checks ``caps_park_max_waiters`` without counting the list.  Parks add to it under
  the slot's sentinel lock; the steps that take entries off the list (a claim, a forget) take
  from it as their last statement, so that no transaction holding its row waits for another.
* ``concurrency_slots_history``: an optional, bounded record of put-backs and finished runs
  for ``celery caps explain`` and ``timeline``, written in batches off the admission path, and
  of the limits operators set.
* ``concurrency_limits``: the limits operators set (``celery caps limit``), by cap name (all its
  slots) or slot name; a slot's room is counted against its own row, else its cap's, else its
  sentinel's ``slot_limit``, in every admission and hand-over, after the slot's lock.

There is one schema version before the first release: the store creates what is missing
(``caps_create_schema``); for your own migrations, include :data:`metadata` (Alembic).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from ...caps import MAX_KEY_LENGTH, MAX_SLOT_LENGTH

#: The schema's version: of the tables and (PostgreSQL) the functions of ``postgresql.sql``.
SCHEMA_VERSION = 1

#: Longest task id the table stores, in characters.
MAX_TASK_ID_LENGTH = 255
#: Longest task name kept with a lease (longer ones are cut), in characters.
MAX_TASK_NAME_LENGTH = 255
#: Longest deployment name (``caps_deployment``) an entry records, in characters.
MAX_DEPLOYMENT_LENGTH = 64

TABLE_NAME = "concurrency_slots"

#: The databases with partial indexes (MySQL/MariaDB has none: it gets full ones instead).
PARTIAL_INDEX_DIALECTS = ("postgresql", "sqlite")
FULL_INDEX_DIALECTS = ("mysql", "mariadb")
#: The rows of ix_concurrency_waiters_heavy: waiting entries (a tombstone keeps its dispatch's run
#: id) of weight above 1.  A query that probes it states both conditions, as written here.
HEAVY_WAITING = "weight > 1 AND dispatch_run_id IS NULL"
#: The rows of ix_concurrency_waiters_fair_key: entries with a fair key in their slot.  A query
#: that probes it states this condition too, as written here.
FAIR_KEYED = "fair_key IS NOT NULL"
#: Indexes of an earlier schema that the store drops where it finds them, by table (their tables
#: got the columns of :data:`.leases.ADDED_COLUMNS` that replace them; see ``create_schema``).
OLD_INDEXES = {"concurrency_waiters": ("ix_concurrency_waiters_order",)}


def _exact_text(length: int) -> sa.types.TypeEngine[Any]:
    # MySQL's default collations fold case and ignore trailing spaces, which would
    # merge "Tenant" and "tenant "; bytes compare exactly.
    return sa.String(length).with_variant(mysql.VARBINARY(length * 4), "mysql", "mariadb")


#: The schema, for users' own migrations (Alembic: include ``metadata``).
metadata = sa.MetaData()

concurrency_slots = sa.Table(
    TABLE_NAME,
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True, comment="'' for a slot's sentinel row"),
    sa.Column("slot", _exact_text(MAX_SLOT_LENGTH), primary_key=True),
    sa.Column("task_id", _exact_text(MAX_TASK_ID_LENGTH), nullable=False, server_default=""),
    sa.Column("holder", sa.String(255), nullable=False, server_default=""),
    sa.Column("expires_at", sa.Double(), nullable=True, comment="store-clock epoch seconds; NULL on sentinels"),
    sa.Column("slot_limit", sa.Integer(), nullable=True, comment="last limit admitted with; sentinels only"),
    sa.Column("task_name", sa.String(MAX_TASK_NAME_LENGTH), nullable=True, comment="for operators; leases only"),
    sa.Column("acquired_at", sa.Double(), nullable=True, comment="store-clock epoch seconds the lease was taken"),
    sa.Column(
        "weight", sa.Integer(), nullable=False, server_default="1", comment="units of the slot's limit the run takes"
    ),
    # Admission counts live leases (and their weights) of a few slot names: this index makes that
    # cost independent of how many slot names exist, and holds all it reads.
    sa.Index("ix_concurrency_slots_slot_expiry", "slot", "expires_at", "task_id", "weight"),
    sa.Index("ix_concurrency_slots_task_id", "task_id"),
    # The sweep deletes what expired: it reads this index from its start to ``now``, never the
    # live leases nor the sentinels (whose expiry is NULL).
    sa.Index("ix_concurrency_slots_expires_at", "expires_at"),
)

HISTORY_TABLE_NAME = "concurrency_slots_history"

concurrency_slots_history = sa.Table(
    HISTORY_TABLE_NAME,
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("recorded_at", sa.Double(), nullable=False, comment="epoch seconds, recording worker's clock"),
    sa.Column("kind", sa.String(16), nullable=False, comment="'deferred', 'ran' or 'limit'"),
    sa.Column("task_id", _exact_text(MAX_TASK_ID_LENGTH), nullable=False),
    sa.Column("task_name", sa.String(MAX_TASK_NAME_LENGTH), nullable=True),
    sa.Column("holder", sa.String(255), nullable=False, server_default=""),
    sa.Column("slots", sa.Text(), nullable=False, comment="JSON list of slot names"),
    sa.Column("full_slots", sa.Text(), nullable=False, comment="JSON list of slot names"),
    sa.Column("started_at", sa.Double(), nullable=True),
    sa.Column("deferrals", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("slot_limit", sa.Integer(), nullable=True, comment="'limit': the limit set (NULL: reset)"),
    sa.Index("ix_concurrency_slots_history_recorded_at", "recorded_at"),
    sa.Index("ix_concurrency_slots_history_task_id", "task_id"),
)

WAITERS_TABLE_NAME = "concurrency_waiters"

concurrency_waiters = sa.Table(
    WAITERS_TABLE_NAME,
    metadata,
    sa.Column("slot", _exact_text(MAX_SLOT_LENGTH), primary_key=True),
    sa.Column("task_id", _exact_text(MAX_TASK_ID_LENGTH), primary_key=True),
    sa.Column("slot_count", sa.Integer(), nullable=False, comment="how many slots the task needs"),
    sa.Column("first_deferred_at", sa.Double(), nullable=False, comment="epoch seconds, deferring worker's clock"),
    sa.Column("parked_at", sa.Double(), nullable=False, comment="store-clock epoch seconds"),
    sa.Column("task_name", sa.String(MAX_TASK_NAME_LENGTH), nullable=True),
    sa.Column(
        "deployment",
        _exact_text(MAX_DEPLOYMENT_LENGTH),
        nullable=False,
        server_default="",
        comment="caps_deployment of the handle that parked it: only that deployment dispatches it",
    ),
    sa.Column(
        "payload",
        sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb"),
        nullable=False,
        comment="the message to publish again, in the app's serializer",
    ),
    sa.Column("dispatch_run_id", sa.String(64), nullable=True, comment="set while dispatched, and on tombstones"),
    sa.Column("dispatch_expires_at", sa.Double(), nullable=True, comment="store-clock epoch seconds"),
    sa.Column("dispatches", sa.Integer(), nullable=False, server_default="0", comment="dispatches so far"),
    sa.Column("done_until", sa.Double(), nullable=True, comment="a tombstone until then (store-clock epoch seconds)"),
    sa.Column("claimed_by", sa.String(255), nullable=True, comment="a claim's tombstone: the holder that claimed"),
    sa.Column(
        "weight", sa.Integer(), nullable=False, server_default="1", comment="units of this slot's limit the task needs"
    ),
    sa.Column("fair_key", _exact_text(MAX_KEY_LENGTH), nullable=True, comment="its fair key in this slot (fair_by)"),
    sa.Column(
        "fair_round",
        sa.Integer(),
        nullable=False,
        server_default="0",
        comment="its round in this slot's list (0 without a fair key)",
    ),
    sa.Index("ix_concurrency_waiters_task_id", "task_id"),
    # Every index holding ``deployment`` has it first or right after the slot: whichever of them a
    # plan takes (a PL/pgSQL function's generic plan included), a look for one deployment's
    # entries never reads another deployment's.
    # A slot's waiters of one deployment in their order (a release reads the first few, never
    # another deployment's), and the list's first round (a park with a fair key there).  (It
    # replaces ix_concurrency_waiters_order, of the order before rounds: see OLD_INDEXES.)
    sa.Index(
        "ix_concurrency_waiters_place", "slot", "deployment", "fair_round", "first_deferred_at", "parked_at", "task_id"
    ),
    # The last round of a fair key in a slot's list (a park with that key there): one probe into
    # an index of the entries with a fair key only (partial where the database has partial indexes).
    sa.Index(
        "ix_concurrency_waiters_fair_key",
        "slot",
        "deployment",
        "fair_key",
        "fair_round",
        postgresql_where=sa.text(FAIR_KEYED),
        sqlite_where=sa.text(FAIR_KEYED),
    ),
    # The waiters of several slots of a slot, whose other slots a scoped recovery pass considers:
    # found without walking the slot's list (partial where the database has partial indexes).
    sa.Index(
        "ix_concurrency_waiters_several",
        "slot",
        "deployment",
        "slot_count",
        postgresql_where=sa.text("slot_count > 1"),
        sqlite_where=sa.text("slot_count > 1"),
    ),
    # The oldest heavy waiting entry of a slot (weight above 1 there), which may hold the slot's free
    # units against newcomers: one probe per slot an admission counts, into an index that holds
    # only heavy waiting entries (empty while nobody is heavy), in the list's order.  MySQL has
    # no partial index: there, the slot's heavy entries, through ix_concurrency_waiters_weight.
    sa.Index(
        "ix_concurrency_waiters_heavy",
        "slot",
        "deployment",
        "first_deferred_at",
        "parked_at",
        "task_id",
        postgresql_where=sa.text(HEAVY_WAITING),
        sqlite_where=sa.text(HEAVY_WAITING),
        info={"dialects": PARTIAL_INDEX_DIALECTS},
    ).ddl_if(dialect=PARTIAL_INDEX_DIALECTS),  # type: ignore[arg-type]  # (a tuple, as documented)
    sa.Index(
        "ix_concurrency_waiters_weight",
        "slot",
        "deployment",
        "weight",
        info={"dialects": FULL_INDEX_DIALECTS},
    ).ddl_if(dialect=FULL_INDEX_DIALECTS),  # type: ignore[arg-type]
    # Recovery's, of one deployment: the oldest waiter (whether any is past the maximum wait),
    # and the entries of the tasks a worker knows by name (whatever their slots are called).
    sa.Index("ix_concurrency_waiters_first_deferred", "deployment", "first_deferred_at"),
    sa.Index("ix_concurrency_waiters_task_name", "deployment", "task_name"),
    # The sweep's and recovery's passes read only what is due: old tombstones, dispatches (of
    # one deployment) past their deadline (NULL on most rows: partial where possible).
    sa.Index(
        "ix_concurrency_waiters_done_until",
        "done_until",
        postgresql_where=sa.text("done_until IS NOT NULL"),
        sqlite_where=sa.text("done_until IS NOT NULL"),
    ),
    sa.Index(
        "ix_concurrency_waiters_dispatch_expiry",
        "deployment",
        "dispatch_expires_at",
        postgresql_where=sa.text("dispatch_expires_at IS NOT NULL"),
        sqlite_where=sa.text("dispatch_expires_at IS NOT NULL"),
    ),
)

WAITLISTS_TABLE_NAME = "concurrency_waitlists"

concurrency_waitlists = sa.Table(
    WAITLISTS_TABLE_NAME,
    metadata,
    sa.Column("slot", _exact_text(MAX_SLOT_LENGTH), primary_key=True),
    sa.Column("entries", sa.Integer(), nullable=False, comment="entries of the slot's list not yet settled"),
)

LIMITS_TABLE_NAME = "concurrency_limits"

concurrency_limits = sa.Table(
    LIMITS_TABLE_NAME,
    metadata,
    sa.Column("name", _exact_text(MAX_SLOT_LENGTH), primary_key=True, comment="a cap (all its slots) or a slot name"),
    sa.Column("slot_limit", sa.Integer(), nullable=False),
    sa.Column("set_at", sa.Double(), nullable=False, comment="store-clock epoch seconds"),
)
