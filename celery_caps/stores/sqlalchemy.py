"""The SQL slot store: the ``concurrency_slots`` table and every SQL statement.

One table holds two kinds of rows:

* a **sentinel** per slot name (``run_id = ''``, ``expires_at`` NULL, the last
  limit seen in ``slot_limit``), never deleted by the sweep; admission locks it
  before it counts, so two contenders for the last slot always serialise on it;
* a **lease** per held slot and run (``run_id``, ``task_id``, ``holder``,
  ``expires_at`` in seconds since the epoch by the **database's clock**, and for
  operators ``task_name`` and ``acquired_at``).

A second, optional table, ``concurrency_slots_history``, keeps a bounded record
of put-backs and finished runs for ``celery caps explain`` and ``timeline``; it is
written in batches off the admission path, only when history is enabled.

A third table, ``concurrency_waiters``, is the waiting list of the *park*
strategy: one row per parked task and slot it needs (its payload, first-deferral
time, and once dispatched the run id and expiry of its dispatch leases).  Parking
and waking lock the same sentinels as admission, so each is atomic with it.

Schema upgrades: ``task_name`` and ``acquired_at`` came after the first release.
With ``create_schema`` the store adds them to an existing table (``ALTER TABLE ...
ADD COLUMN``, nullable, so no row is rewritten); without it, a table lacking them
still works, and leases simply show no task name or age.

Admission is one transaction: upsert-and-lock the sentinels of every slot the
task needs (sorted, so tasks with several caps cannot deadlock), *then* count
live leases in a second statement (its snapshot is taken after the locks are
granted, so it sees every committed competitor), then insert the leases.

Dialect notes: PostgreSQL runs at READ COMMITTED; MySQL/MariaDB connections we
create run at READ COMMITTED too, and name columns are ``VARBINARY`` so that
MySQL's case- and pad-insensitive collations cannot merge two slot names;
SQLite uses WAL, a busy timeout and ``BEGIN IMMEDIATE`` so that concurrent
worker processes on one machine serialise their writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Engine

from ..caps import MAX_SLOT_LENGTH
from ..errors import ConfigurationError, StoreError
from .base import (
    DISPATCH_HOLDER,
    PARK_ADMITTED,
    PARK_LIST_FULL,
    PARK_PARKED,
    PARK_PARKED_FIRST,
    PARK_ROOM,
    Admission,
    Claimed,
    HistoryEvent,
    Lease,
    SlotStatus,
    SlotStore,
    Standby,
    StandbyDispatch,
    Waiter,
    Woken,
    green_threads,
    mask_url,
)

logger = logging.getLogger(__name__)

#: Longest task id the table stores, in characters.
MAX_TASK_ID_LENGTH = 255
#: Longest task name kept with a lease (longer ones are cut), in characters.
MAX_TASK_NAME_LENGTH = 255

TABLE_NAME = "concurrency_slots"


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
    # Admission counts live leases of a few slot names: this index makes that cost
    # independent of how many slot names exist.
    sa.Index("ix_concurrency_slots_slot_expiry", "slot", "expires_at", "task_id"),
    sa.Index("ix_concurrency_slots_task_id", "task_id"),
)

#: Lease columns added after the first release; an older table may lack them.
LEASE_DETAIL_COLUMNS = ("task_name", "acquired_at")

HISTORY_TABLE_NAME = "concurrency_slots_history"

concurrency_slots_history = sa.Table(
    HISTORY_TABLE_NAME,
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("recorded_at", sa.Double(), nullable=False, comment="epoch seconds, recording worker's clock"),
    sa.Column("kind", sa.String(16), nullable=False, comment="'deferred' or 'ran'"),
    sa.Column("task_id", _exact_text(MAX_TASK_ID_LENGTH), nullable=False),
    sa.Column("task_name", sa.String(MAX_TASK_NAME_LENGTH), nullable=True),
    sa.Column("holder", sa.String(255), nullable=False, server_default=""),
    sa.Column("slots", sa.Text(), nullable=False, comment="JSON list of slot names"),
    sa.Column("full_slots", sa.Text(), nullable=False, comment="JSON list of slot names"),
    sa.Column("started_at", sa.Double(), nullable=True),
    sa.Column("deferrals", sa.Integer(), nullable=False, server_default="0"),
    sa.Index("ix_concurrency_slots_history_recorded_at", "recorded_at"),
    sa.Index("ix_concurrency_slots_history_task_id", "task_id"),
)

WAITERS_TABLE_NAME = "concurrency_waiters"

concurrency_waiters = sa.Table(
    WAITERS_TABLE_NAME,
    metadata,
    sa.Column("slot", _exact_text(MAX_SLOT_LENGTH), primary_key=True),
    sa.Column("task_id", _exact_text(MAX_TASK_ID_LENGTH), primary_key=True),
    sa.Column("slot_limit", sa.Integer(), nullable=False),
    sa.Column("slot_count", sa.Integer(), nullable=False, comment="how many slots the task needs"),
    sa.Column("first_deferred_at", sa.Double(), nullable=False, comment="epoch seconds, deferring worker's clock"),
    sa.Column("parked_at", sa.Double(), nullable=False, comment="store-clock epoch seconds"),
    sa.Column("task_name", sa.String(MAX_TASK_NAME_LENGTH), nullable=True),
    sa.Column(
        "payload",
        sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb"),
        nullable=False,
        comment="the message to publish again, in the app's serializer",
    ),
    sa.Column("dispatch_run_id", sa.String(64), nullable=True, comment="set once dispatched"),
    sa.Column("dispatch_expires_at", sa.Double(), nullable=True, comment="store-clock epoch seconds"),
    sa.Index("ix_concurrency_waiters_task_id", "task_id"),
    sa.Index("ix_concurrency_waiters_order", "slot", "first_deferred_at", "parked_at"),
)

STANDBY_TABLE_NAME = "concurrency_standby"

concurrency_standby = sa.Table(
    STANDBY_TABLE_NAME,
    metadata,
    sa.Column("task_id", _exact_text(MAX_TASK_ID_LENGTH), primary_key=True),
    sa.Column("mark", sa.String(64), nullable=False, comment="the standby copy's mark"),
    sa.Column("expires_at", sa.Double(), nullable=False, comment="store-clock epoch seconds"),
    sa.Column("dispatch_run_id", sa.String(64), nullable=True, comment="set by the release that took it"),
    sa.Column("holder", sa.String(255), nullable=True, comment="the waiting process, once it waits"),
    sa.Column("lease_seconds", sa.Double(), nullable=True, comment="the waiting process's lease length"),
)

# The store's clock, in seconds since the epoch, per dialect.  Never the worker's.
_NOW = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) / 1000000.0)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}

# Upsert the sentinel rows and leave them locked by this transaction.
_LOCK_SENTINELS = {
    # ON CONFLICT DO UPDATE locks the existing row even when its WHERE is false,
    # so an unchanged limit costs a lock, not a new row version.
    "postgresql": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit) VALUES {values} "
        "ON CONFLICT (run_id, slot) DO UPDATE SET slot_limit = EXCLUDED.slot_limit "
        "WHERE concurrency_slots.slot_limit IS DISTINCT FROM EXCLUDED.slot_limit"
    ),
    # Unlike INSERT IGNORE (a shared lock that can deadlock when upgraded), this
    # takes the row's exclusive lock at once.
    "mysql": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit) VALUES {values} "
        "ON DUPLICATE KEY UPDATE slot_limit = VALUES(slot_limit)"
    ),
    # BEGIN IMMEDIATE already holds the database's write lock.
    "sqlite": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit) VALUES {values} "
        "ON CONFLICT (run_id, slot) DO UPDATE SET slot_limit = excluded.slot_limit "
        "WHERE slot_limit IS NOT excluded.slot_limit"
    ),
}

# A second statement, so that its snapshot postdates the sentinel locks.
_COUNT_LIVE = (
    "SELECT slot, COUNT(DISTINCT task_id), MAX(CASE WHEN task_id = :task_id THEN 1 ELSE 0 END) "
    "FROM concurrency_slots WHERE slot IN ({slots}) AND expires_at > {now} GROUP BY slot"
)
# An upsert: a run admitted again to a slot whose lease it let expire (not swept
# yet) replaces that row rather than colliding with its primary key.
# ``{details}`` is empty for a table without the lease detail columns, else
# ``task_name``/``acquired_at`` (see _lease_details).
_INSERT_LEASES = {
    "postgresql": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at{columns}) VALUES {values} "
        "ON CONFLICT (run_id, slot) DO UPDATE SET task_id = EXCLUDED.task_id, holder = EXCLUDED.holder, "
        "expires_at = EXCLUDED.expires_at{updates}"
    ),
    "mysql": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at{columns}) VALUES {values} "
        "ON DUPLICATE KEY UPDATE task_id = VALUES(task_id), holder = VALUES(holder), expires_at = VALUES(expires_at)"
        "{updates}"
    ),
    "sqlite": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at{columns}) VALUES {values} "
        "ON CONFLICT (run_id, slot) DO UPDATE SET task_id = excluded.task_id, holder = excluded.holder, "
        "expires_at = excluded.expires_at{updates}"
    ),
}
_DETAIL_UPDATES = {
    "postgresql": ", task_name = EXCLUDED.task_name, acquired_at = EXCLUDED.acquired_at",
    "mysql": ", task_name = VALUES(task_name), acquired_at = VALUES(acquired_at)",
    "sqlite": ", task_name = excluded.task_name, acquired_at = excluded.acquired_at",
}
_RENEW = (
    "UPDATE concurrency_slots SET expires_at = {now} + :lease_seconds WHERE run_id IN :run_ids AND expires_at > {now}"
)
_RENEWED = (
    "SELECT run_id, COUNT(*) FROM concurrency_slots WHERE run_id IN :run_ids AND expires_at > {now} GROUP BY run_id"
)
_RELEASE_RUN = "DELETE FROM concurrency_slots WHERE run_id = :run_id"
_RELEASE_HOLDER = "DELETE FROM concurrency_slots WHERE task_id = :task_id AND holder = :holder AND run_id <> ''"
_RELEASE_TASK = "DELETE FROM concurrency_slots WHERE task_id = :task_id AND run_id <> ''"
# Sentinels have a NULL expiry, which no comparison matches: the sweep keeps them.
_SWEEP = "DELETE FROM concurrency_slots WHERE expires_at <= {now}"
_STATUS = (
    "SELECT s.slot, s.slot_limit, "
    "(SELECT COUNT(DISTINCT l.task_id) FROM concurrency_slots l WHERE l.slot = s.slot AND l.expires_at > {now}), "
    "(SELECT COUNT(*) FROM concurrency_slots l WHERE l.slot = s.slot AND l.expires_at <= {now}) "
    "FROM concurrency_slots s WHERE s.run_id = '' ORDER BY s.slot"
)
_LEASES = (
    "SELECT slot, task_id, run_id, holder, expires_at - {now}, {details} FROM concurrency_slots "
    "WHERE run_id <> '' {slot_filter} ORDER BY slot, expires_at"
)
_LEASE_DETAILS = "task_name, {now} - acquired_at"
_NO_LEASE_DETAILS = "NULL, NULL"
# Prune: lock the candidate sentinels first (admission locks them too, so after
# this no lease can be added to them), count live leases in a later statement,
# then delete sentinels and expired leases of the slots nobody holds.
_PRUNE_CANDIDATES = (
    "SELECT slot FROM concurrency_slots WHERE run_id = '' AND slot LIKE :pattern ESCAPE '/' ORDER BY slot"
)
_PRUNE_LIVE = "SELECT DISTINCT slot FROM concurrency_slots WHERE slot IN :slots AND run_id <> '' AND expires_at > {now}"
_PRUNE_DELETE = "DELETE FROM concurrency_slots WHERE slot IN :slots"
_PRUNE_BATCH = 500

# PostgreSQL admission in one round trip: the same three steps as the generic
# transaction (lock sentinels in slot order, count, insert), in a VOLATILE
# function whose every statement takes a fresh READ COMMITTED snapshot, so the
# count runs after the locks are granted.  Versioned by name: a changed body
# gets a new name instead of replacing one that running workers call.
# v1 (no task name) stays for workers of older versions; this version creates
# and calls v2.
POSTGRESQL_ACQUIRE_FUNCTION = "concurrency_slots_acquire_v2"
# The admission steps the functions that admit share (acquire, park), over their parameters
# p_slots/p_limits (sorted slot names and their limits), p_task_id, p_run_id, p_holder,
# p_lease_seconds, p_task_name, and v_now/v_full: lock the sentinels in slot order (creating
# missing ones), then the full slots (a slot this task holds already is not full for it), then
# (if none is full) the leases.
_PG_LOCK_SENTINELS = """
    INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit)
    SELECT '', u.slot, '', '', u.slot_limit
    FROM unnest(p_slots, p_limits) AS u(slot, slot_limit) ORDER BY u.slot
    ON CONFLICT (run_id, slot) DO UPDATE SET slot_limit = EXCLUDED.slot_limit
    WHERE concurrency_slots.slot_limit IS DISTINCT FROM EXCLUDED.slot_limit;
"""
_PG_FULL_SLOTS = f"""
    v_now := {_NOW["postgresql"]};
    SELECT coalesce(array_agg(u.slot ORDER BY u.slot), '{{}}') INTO v_full
    FROM unnest(p_slots, p_limits) AS u(slot, slot_limit)
    WHERE NOT EXISTS (
            SELECT 1 FROM concurrency_slots c
            WHERE c.slot = u.slot AND c.task_id = p_task_id AND c.expires_at > v_now)
      AND (SELECT count(DISTINCT c.task_id) FROM concurrency_slots c
           WHERE c.slot = u.slot AND c.expires_at > v_now) >= u.slot_limit;
"""
_PG_INSERT_LEASES = """
        INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at)
        SELECT p_run_id, u.slot, p_task_id, p_holder, v_now + p_lease_seconds, p_task_name, v_now
        FROM unnest(p_slots) AS u(slot)
        ON CONFLICT (run_id, slot) DO UPDATE SET task_id = EXCLUDED.task_id, holder = EXCLUDED.holder,
            expires_at = EXCLUDED.expires_at, task_name = EXCLUDED.task_name, acquired_at = EXCLUDED.acquired_at;
"""
POSTGRESQL_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_ACQUIRE_FUNCTION}(
    p_slots text[], p_limits integer[], p_task_id text, p_run_id text, p_holder text,
    p_lease_seconds double precision, p_task_name text
) RETURNS text[] LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_full text[];
    v_now double precision;
BEGIN
{_PG_LOCK_SENTINELS}{_PG_FULL_SLOTS}
    IF cardinality(v_full) = 0 THEN
{_PG_INSERT_LEASES}    END IF;
    RETURN v_full;
END $$
"""
# A run's release with the park strategy in one round trip, when nobody waits (the common
# case): delete the run's leases, then lock the freed slots' sentinels (so that a park which
# counted this run's leases, and holds those locks, has committed: its waiter is seen) and
# return the freed slots that have waiters; the caller wakes those in a second transaction.
POSTGRESQL_RELEASE_FUNCTION = "concurrency_slots_release_v1"
POSTGRESQL_RELEASE_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_RELEASE_FUNCTION}(p_run_id text)
RETURNS TABLE (deleted integer, waited text[]) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_slots text[];
BEGIN
    WITH gone AS (DELETE FROM concurrency_slots WHERE run_id = p_run_id RETURNING slot)
    SELECT count(*), coalesce(array_agg(DISTINCT gone.slot), '{{}}') INTO deleted, v_slots FROM gone;
    waited := '{{}}';
    IF deleted > 0 THEN
        PERFORM 1 FROM concurrency_slots WHERE run_id = '' AND slot = ANY(v_slots) ORDER BY slot FOR UPDATE;
        SELECT coalesce(array_agg(DISTINCT w.slot), '{{}}') INTO waited FROM concurrency_waiters w
        WHERE w.slot = ANY(v_slots) AND w.dispatch_run_id IS NULL;
    END IF;
    RETURN NEXT;
END $$
"""
_CALL_RELEASE_FUNCTION_DRIVER = f"SELECT deleted, waited FROM {POSTGRESQL_RELEASE_FUNCTION}(%(run_id)s)"
#: Waiter rows read per batch when a release looks for waiters to dispatch.
_WAITING_BATCH = 64
# A run's release with the park strategy and the wake of the waiters its slots can now
# admit, in one round trip: the steps of the generic release-and-wake transaction
# (``_release_and_wake`` with ``_wake_after_release`` and ``_dispatch``) in a function.
# Delete the run's leases; lock the freed slots' sentinels, then (SKIP LOCKED: no lock-order
# deadlock) those of the other slots their waiters need; walk the waiters of the locked slots
# in their order (first deferral, park time, task id), streaming, and dispatch each whose
# every slot is locked and has room; stop once every slot seen is full.  Every statement
# takes a fresh READ COMMITTED snapshot, so counts run after the locks are granted.  A woken
# waiter on standby is taken (its standby record gets the dispatch run id) and signalled with
# NOTIFY, delivered when the transaction commits.  One row per woken waiter (o_task_id NULL
# when none), each with the number of leases deleted.  v1 (no standby) stays for workers of
# older versions; this version creates and calls v2.
#: The NOTIFY channel of a task's standby: a fixed-length name from its task id (PostgreSQL
#: identifiers are at most 63 bytes).  :func:`standby_channel` is the same in Python.
STANDBY_CHANNEL_SQL = "'caps_standby_' || md5(v_task)"
# The settings of the hot-path functions.  PL/pgSQL plans each statement for the values of its
# first calls, then keeps re-planning ("custom plans") while a generic plan is not estimated
# cheaper; these statements are key lookups whose best plan never depends on the values, and
# re-planning a dozen of them cost more than running them.  A generic plan is made once per
# session, though, from the statistics of that moment: a waiting list analysed while empty would
# be scanned whole, and sorted, for ever after.  So no sequential or bitmap scan and no full sort
# where an index gives the rows in order: every statement here is an index lookup (only the small
# concurrency_standby table is scanned).  And no JIT: those disabled plans look expensive enough
# to be compiled, which cost 70 ms a call here.  (A release-and-wake with 300 waiters here: 2.0 ms
# with custom plans, 0.7 ms with these.)
_GENERIC_PLANS = (
    "SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off "
    "SET enable_sort = off SET jit = off"
)
# A waiter of several slots makes a release look for its other slots: this partial index finds
# the (rare) waiters of several slots of a slot at once, where the list's own index would walk
# every waiter of the slot.
WAITERS_OF_SEVERAL_INDEX = "ix_concurrency_waiters_several"
WAITERS_OF_SEVERAL_INDEX_DDL = (
    f"CREATE INDEX IF NOT EXISTS {WAITERS_OF_SEVERAL_INDEX} ON concurrency_waiters (slot) WHERE slot_count > 1"
)
# A release, and the hand-over it makes, commits without waiting for its WAL record to reach the
# disk (synchronous_commit off for its transaction only; admission, park and renew stay durable).
# The flush is most of a commit's wait (0.5 of 1 ms after the connection sat idle through a
# task), and the waiter on standby is signalled only after it.  A database crash can lose the
# last fraction of a second of such commits, never a parked task: a lost release leaves its
# lease to expire (fewer admissions, never more), a lost hand-over leaves its waiter in the list
# to be handed over again (its task may then run twice, as one task id: at-least-once).
_RELEASE_COMMITS_ASYNCHRONOUSLY = "    PERFORM set_config('synchronous_commit', 'off', true);"
POSTGRESQL_RELEASE_AND_WAKE_FUNCTION = "concurrency_slots_release_and_wake_v4"
# (v3: generic plans, see _GENERIC_PLANS; the other slots are looked for only when a waiter of
# several slots waits, through a partial index; a dispatch's count is not taken again after it;
# a waiter handed to its standby has no payload read.  v4: its transaction commits without
# waiting for the WAL flush, see _RELEASE_COMMITS_ASYNCHRONOUSLY.  Workers of older versions
# call the versions they created.)
POSTGRESQL_RELEASE_AND_WAKE_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_RELEASE_AND_WAKE_FUNCTION}(p_run_id text, p_dispatch_lease_seconds double precision)
RETURNS TABLE (
    o_deleted integer, o_task_id text, o_run_id text, o_payload bytea, o_task_name text, o_standby boolean
) LANGUAGE plpgsql VOLATILE {_GENERIC_PLANS} AS $$
DECLARE
    v_mark text;
    v_holder text;
    v_lease double precision;
    v_full text[] := '{{}}';
    v_found_full text[];
    v_full_after text[];
    v_released text[];
    v_waited text[];
    v_locked text[];
    v_now double precision;
    v_seen_slots text[] := '{{}}';
    v_seen_limits integer[] := '{{}}';
    v_any boolean := false;
    v_task text := NULL;
    v_slots text[];
    v_limits integer[];
    v_count integer;
    v_name text;
    v_waiters refcursor;
    v_read integer := 0;
    v_check_at integer := {_WAITING_BATCH};
    f_task text;
    f_slot text;
    f_limit integer;
    f_count integer;
    f_name text;
BEGIN
{_RELEASE_COMMITS_ASYNCHRONOUSLY}
    WITH gone AS (DELETE FROM concurrency_slots c WHERE c.run_id = p_run_id RETURNING c.slot)
    SELECT count(*), coalesce(array_agg(DISTINCT gone.slot), '{{}}') INTO o_deleted, v_released FROM gone;
    IF o_deleted = 0 THEN
        RETURN NEXT;
        RETURN;
    END IF;
    PERFORM 1 FROM concurrency_slots c WHERE c.run_id = '' AND c.slot = ANY(v_released) ORDER BY c.slot FOR UPDATE;
    IF NOT EXISTS (
        SELECT 1 FROM concurrency_waiters x WHERE x.slot = ANY(v_released) AND x.dispatch_run_id IS NULL)
    THEN
        RETURN NEXT;
        RETURN;
    END IF;
    -- The other slots that waiters of several slots need (none for single-slot waiters, the
    -- common case, which the partial index {WAITERS_OF_SEVERAL_INDEX} tells at once).
    v_locked := v_released;
    IF EXISTS (
        SELECT 1 FROM concurrency_waiters x
        WHERE x.slot = ANY(v_released) AND x.dispatch_run_id IS NULL AND x.slot_count > 1)
    THEN
        SELECT coalesce(array_agg(DISTINCT w.slot), '{{}}') INTO v_waited FROM concurrency_waiters w
        WHERE w.task_id IN (
            SELECT x.task_id FROM concurrency_waiters x
            WHERE x.slot = ANY(v_released) AND x.dispatch_run_id IS NULL AND x.slot_count > 1);
        SELECT v_released || coalesce(array_agg(m.slot), '{{}}') INTO v_locked FROM (
            SELECT c.slot FROM concurrency_slots c
            WHERE c.run_id = '' AND c.slot = ANY(v_waited) AND NOT (c.slot = ANY(v_released))
            ORDER BY c.slot FOR UPDATE SKIP LOCKED) m;
    END IF;
    v_now := {_NOW["postgresql"]};
    -- One waiter's rows are adjacent in this order, read as they come (a long list is not
    -- read to its end); after the last row FETCH sets the f_ variables to NULL, which
    -- closes the last waiter.
    -- (One slot: an equality, so the list's index streams it in order, unsorted.)
    IF cardinality(v_locked) = 1 THEN
        OPEN v_waiters FOR
            SELECT w.task_id, w.slot, w.slot_limit, w.slot_count, w.task_name FROM concurrency_waiters w
            WHERE w.slot = v_locked[1] AND w.dispatch_run_id IS NULL
            ORDER BY w.first_deferred_at, w.parked_at, w.task_id;
    ELSE
        OPEN v_waiters FOR
            SELECT w.task_id, w.slot, w.slot_limit, w.slot_count, w.task_name FROM concurrency_waiters w
            WHERE w.slot = ANY(v_locked) AND w.dispatch_run_id IS NULL
            ORDER BY w.first_deferred_at, w.parked_at, w.task_id;
    END IF;
    LOOP
        FETCH v_waiters INTO f_task, f_slot, f_limit, f_count, f_name;
        IF v_task IS NOT NULL AND f_task IS DISTINCT FROM v_task THEN
            -- Waiter v_task is complete: dispatch it if all its slots are locked here and
            -- each has room (or is held by it already); a waiter passed over keeps its place.
            -- v_full: slots found full in this walk (only dispatches add leases while their
            -- sentinels are locked), so a waiter needing one is passed over without a count.
            IF cardinality(v_slots) = v_count AND NOT (v_slots && v_full) THEN
                -- Full now (for this waiter: a slot it holds already has room for it), and full
                -- once it takes a place (so that no count is needed after the dispatch).
                SELECT coalesce(array_agg(u.slot) FILTER (WHERE NOT u.held AND u.holders >= u.slot_limit), '{{}}'),
                       coalesce(array_agg(u.slot) FILTER (
                           WHERE u.holders + (CASE WHEN u.held THEN 0 ELSE 1 END) >= u.slot_limit), '{{}}')
                INTO v_found_full, v_full_after
                FROM (
                    SELECT s.slot, s.slot_limit,
                        EXISTS (SELECT 1 FROM concurrency_slots c
                                WHERE c.slot = s.slot AND c.task_id = v_task AND c.expires_at > v_now) AS held,
                        (SELECT count(DISTINCT c.task_id) FROM concurrency_slots c
                         WHERE c.slot = s.slot AND c.expires_at > v_now) AS holders
                    FROM unnest(v_slots, v_limits) AS s(slot, slot_limit)) u;
                v_full := v_full || v_found_full;
            END IF;
            IF cardinality(v_slots) = v_count AND NOT (v_slots && v_full) THEN
                o_task_id := v_task;
                o_run_id := md5(random()::text || clock_timestamp()::text || v_task);
                o_task_name := v_name;
                -- (Claimed or not, the waiter leaves the list only when its process claims:
                -- until then the sweep can dispatch it again if that process dies.)  Its rows
                -- first: a stand_by that holds them has committed its standby by then.
                UPDATE concurrency_waiters w SET dispatch_run_id = o_run_id,
                    dispatch_expires_at = v_now + p_dispatch_lease_seconds
                WHERE w.task_id = v_task;
                -- A waiter on standby is taken for this dispatch; if its process waits already
                -- (its holder is in the record), the leases are its own at once, claimed.
                UPDATE concurrency_standby s SET dispatch_run_id = o_run_id
                WHERE s.task_id = v_task AND s.dispatch_run_id IS NULL AND s.expires_at > v_now
                RETURNING s.mark, s.holder, s.lease_seconds INTO v_mark, v_holder, v_lease;
                o_standby := FOUND;
                IF NOT o_standby THEN
                    v_holder := NULL;
                    v_lease := NULL;
                END IF;
                INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at)
                SELECT o_run_id, u.slot, v_task, coalesce(v_holder, '{DISPATCH_HOLDER}'),
                    v_now + coalesce(v_lease, p_dispatch_lease_seconds), v_name, v_now
                FROM unnest(v_slots) AS u(slot);
                IF o_standby THEN
                    -- Its standby process runs it: nothing to publish, no payload to read.
                    o_payload := NULL;
                    PERFORM pg_notify(
                        {STANDBY_CHANNEL_SQL},
                        v_mark || ' ' || o_run_id || CASE WHEN v_holder IS NULL THEN ' dispatched' ELSE ' claimed' END);
                ELSE
                    SELECT w.payload INTO o_payload FROM concurrency_waiters w WHERE w.task_id = v_task LIMIT 1;
                END IF;
                v_any := true;
                RETURN NEXT;
                -- The slots this dispatch filled.
                v_full := v_full || v_full_after;
            END IF;
            -- Stop once every released slot is known full: the room this release freed is
            -- handed out (other slots gain room only by their own releases, or by expiry,
            -- which the sweep's wake serves).
            EXIT WHEN v_released <@ v_full;
            -- Every waiter_batch rows (as the generic path reads them), stop once every slot
            -- seen so far is full.
            IF v_read >= v_check_at THEN
                EXIT WHEN NOT EXISTS (
                    SELECT 1 FROM unnest(v_seen_slots, v_seen_limits) AS u(slot, slot_limit)
                    WHERE (SELECT count(DISTINCT c.task_id) FROM concurrency_slots c
                           WHERE c.slot = u.slot AND c.expires_at > v_now) < u.slot_limit);
                v_check_at := v_read + {_WAITING_BATCH};
            END IF;
        END IF;
        EXIT WHEN f_task IS NULL;
        v_read := v_read + 1;
        IF f_task IS DISTINCT FROM v_task THEN
            v_task := f_task;
            v_slots := '{{}}';
            v_limits := '{{}}';
            v_count := f_count;
            v_name := f_name;
        END IF;
        v_slots := v_slots || f_slot;
        v_limits := v_limits || f_limit;
        IF NOT (f_slot = ANY(v_seen_slots)) THEN
            v_seen_slots := v_seen_slots || f_slot;
            v_seen_limits := v_seen_limits || f_limit;
        END IF;
    END LOOP;
    CLOSE v_waiters;
    IF NOT v_any THEN
        o_task_id := NULL;
        o_run_id := NULL;
        o_payload := NULL;
        o_task_name := NULL;
        o_standby := NULL;
        RETURN NEXT;
    END IF;
END $$
"""
# Park (the park strategy's admission) in one round trip: admission's steps, then, with a slot
# full, the task's waiting entries (one per slot, at the store's clock), unless it waits already
# (a duplicate waits once) or a slot's list holds p_max_waiters.  Returns the outcome (the
# PARK_* names; 'parked_first' when a slot's list held no other task, which the caller reports
# only if asked); with p_admit false a task with room takes nothing ('room').  v1 (no
# 'parked_first') stays for workers of older versions; this version creates and calls v2.
POSTGRESQL_PARK_FUNCTION = "concurrency_slots_park_v2"
POSTGRESQL_PARK_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_PARK_FUNCTION}(
    p_slots text[], p_limits integer[], p_task_id text, p_run_id text, p_holder text,
    p_lease_seconds double precision, p_task_name text, p_payload bytea,
    p_first_deferred_at double precision, p_max_waiters integer, p_admit boolean
) RETURNS text LANGUAGE plpgsql VOLATILE {_GENERIC_PLANS} AS $$
DECLARE
    v_full text[];
    v_now double precision;
    v_first boolean;
BEGIN
{_PG_LOCK_SENTINELS}{_PG_FULL_SLOTS}
    IF cardinality(v_full) = 0 THEN
        IF NOT p_admit THEN
            RETURN '{PARK_ROOM}';
        END IF;
{_PG_INSERT_LEASES}        RETURN '{PARK_ADMITTED}';
    END IF;
    IF EXISTS (SELECT 1 FROM concurrency_waiters w WHERE w.task_id = p_task_id) THEN
        RETURN '{PARK_PARKED}';
    END IF;
    IF EXISTS (
        SELECT 1 FROM unnest(p_slots) AS u(slot)
        WHERE (SELECT count(*) FROM (
                  SELECT 1 FROM concurrency_waiters w WHERE w.slot = u.slot LIMIT p_max_waiters) n
              ) >= p_max_waiters)
    THEN
        RETURN '{PARK_LIST_FULL}';
    END IF;
    v_first := EXISTS (
        SELECT 1 FROM unnest(p_slots) AS u(slot)
        WHERE NOT EXISTS (SELECT 1 FROM concurrency_waiters w WHERE w.slot = u.slot));
    INSERT INTO concurrency_waiters
        (slot, task_id, slot_limit, slot_count, first_deferred_at, parked_at, task_name, payload)
    SELECT u.slot, p_task_id, u.slot_limit, cardinality(p_slots), p_first_deferred_at, v_now, p_task_name, p_payload
    FROM unnest(p_slots, p_limits) AS u(slot, slot_limit);
    RETURN CASE WHEN v_first THEN '{PARK_PARKED_FIRST}' ELSE '{PARK_PARKED}' END;
END $$
"""
_CALL_PARK_FUNCTION_DRIVER = (
    f"SELECT {POSTGRESQL_PARK_FUNCTION}(%(slots)s, %(limits)s, %(task_id)s, %(run_id)s, %(holder)s, "
    "%(lease_seconds)s, %(task_name)s, %(payload)s, %(first_deferred_at)s, %(max_waiters)s, %(admit)s)"
)
_CALL_RELEASE_AND_WAKE_FUNCTION_DRIVER = (
    "SELECT o_deleted, o_task_id, o_run_id, o_payload, o_task_name, o_standby "
    f"FROM {POSTGRESQL_RELEASE_AND_WAKE_FUNCTION}(%(run_id)s, %(dispatch_lease_seconds)s)"
)
_CALL_ACQUIRE_FUNCTION = (
    f"SELECT {POSTGRESQL_ACQUIRE_FUNCTION}(:slots, :limits, :task_id, :run_id, :holder, :lease_seconds, :task_name)"
)
# On the connection's search path: a function of another schema would not be found by its calls.
_FUNCTION_EXISTS = "SELECT count(*) FROM pg_proc WHERE proname = :name AND pg_function_is_visible(oid)"
_FUNCTIONS_PRESENT = "SELECT proname FROM pg_proc WHERE proname IN :names AND pg_function_is_visible(oid)"
# The same two statements for the driver (psycopg's parameter style): the hot path.
_CALL_ACQUIRE_FUNCTION_DRIVER = (
    f"SELECT {POSTGRESQL_ACQUIRE_FUNCTION}(%(slots)s, %(limits)s, %(task_id)s, %(run_id)s, %(holder)s, "
    "%(lease_seconds)s, %(task_name)s)"
)
_RELEASE_RUN_DRIVER = "DELETE FROM concurrency_slots WHERE run_id = %(run_id)s"
# Serialises concurrent first uses that would otherwise race to create the function.
_FUNCTION_CREATION_LOCK = "SELECT pg_advisory_xact_lock(hashtext(:name))"
_RENEW_RETURNING = (
    "UPDATE concurrency_slots SET expires_at = {now} + :lease_seconds "
    "WHERE run_id IN :run_ids AND expires_at > {now} RETURNING run_id"
)

# -- the waiting list (park strategy) ---------------------------------------------
# Sentinels of slots that already have one: lock them in slot order (SQLite: BEGIN
# IMMEDIATE holds the write lock already).
_LOCK_EXISTING_SENTINELS = "SELECT slot FROM concurrency_slots WHERE run_id = '' AND slot IN :slots ORDER BY slot"
# Per slot of :slots: its waiters, and whether :task_id is one of them; plus a row for every
# other slot :task_id waits for (a duplicate of a parked task, whatever slots it parked for).
_WAITERS_PER_SLOT = (
    "SELECT slot, COUNT(*), SUM(CASE WHEN task_id = :task_id THEN 1 ELSE 0 END) "
    "FROM concurrency_waiters WHERE slot IN :slots OR task_id = :task_id GROUP BY slot"
)
_TASK_WAITING_SLOTS = "SELECT slot FROM concurrency_waiters WHERE task_id = :task_id"
_RUN_SLOTS = "SELECT slot FROM concurrency_slots WHERE run_id = :run_id"
_HOLDER_SLOTS = "SELECT slot FROM concurrency_slots WHERE task_id = :task_id AND holder = :holder AND run_id <> ''"
_TASK_SLOTS = "SELECT slot FROM concurrency_slots WHERE task_id = :task_id AND run_id <> ''"
# Every slot of every waiting task that waits for one of :slots (to lock them all, in order).
_WAITING_SLOTS = (
    "SELECT DISTINCT slot FROM concurrency_waiters WHERE task_id IN "
    "(SELECT task_id FROM concurrency_waiters WHERE slot IN :slots AND dispatch_run_id IS NULL)"
)
_ALL_WAITING_SLOTS = "SELECT DISTINCT slot FROM concurrency_waiters WHERE dispatch_run_id IS NULL"
# The waiters of :slots in their order, a batch at a time (keyset: from the row ordered at
# :first/:parked/:task_id on).  Every row of one waiter has the same order key, so a waiter's
# rows are adjacent.
_WAITING_ROWS = (
    "SELECT task_id, slot, slot_limit, slot_count, first_deferred_at, parked_at, task_name "
    "FROM concurrency_waiters WHERE slot IN :slots AND dispatch_run_id IS NULL AND ("
    "first_deferred_at > :first OR (first_deferred_at = :first AND "
    "(parked_at > :parked OR (parked_at = :parked AND task_id >= :task_id)))) "
    "ORDER BY first_deferred_at, parked_at, task_id LIMIT :batch"
)
#: Earlier than any first-deferral or park time (a finite number: MySQL has no infinity).
_BEFORE_ANY_TIME = -1e300
_LIVE_HOLDERS = "SELECT DISTINCT slot, task_id FROM concurrency_slots WHERE slot IN :slots AND expires_at > {now}"
_MARK_DISPATCHED = (
    "UPDATE concurrency_waiters SET dispatch_run_id = :run_id, dispatch_expires_at = {now} + :lease_seconds "
    "WHERE task_id = :task_id"
)
_WAITER_PAYLOADS = "SELECT task_id, payload FROM concurrency_waiters WHERE task_id IN :task_ids"
_CLAIM = (
    "UPDATE concurrency_slots SET holder = :holder, expires_at = {now} + :lease_seconds "
    "WHERE run_id = :run_id AND task_id = :task_id AND expires_at > {now}"
)
_DELETE_WAITER = "DELETE FROM concurrency_waiters WHERE task_id = :task_id"
# A task's waiting entry dispatched to another run than the one claimed, with a live dispatch.
_DISPATCHED_ELSEWHERE = (
    "SELECT count(*) FROM concurrency_waiters WHERE task_id = :task_id AND dispatch_run_id <> :run_id "
    "AND dispatch_expires_at > {now}"
)
# The claim in one statement, for the PostgreSQL hot path (psycopg's parameter style), also
# telling whether other tasks wait (not dispatched) for one of the claimed slots, and whether,
# nothing claimed, the entry is dispatched to another live run (then it stays).  (The sub-
# statements share one snapshot: it still has this task's waiting rows; they are left out.)
_CLAIM_DISPATCH_TEMPLATE = (
    "WITH {standby}claimed AS (UPDATE concurrency_slots SET holder = %(holder)s, "
    f"expires_at = {_NOW['postgresql']} + %(lease_seconds)s "
    f"WHERE run_id = %(run_id)s AND task_id = %(task_id)s AND expires_at > {_NOW['postgresql']} RETURNING slot), "
    "elsewhere AS (SELECT 1 FROM concurrency_waiters w WHERE w.task_id = %(task_id)s "
    f"AND w.dispatch_run_id <> %(run_id)s AND w.dispatch_expires_at > {_NOW['postgresql']} LIMIT 1), "
    "unlisted AS (DELETE FROM concurrency_waiters WHERE task_id = %(task_id)s "
    "AND (EXISTS (SELECT 1 FROM claimed) OR NOT EXISTS (SELECT 1 FROM elsewhere))) "
    "SELECT (SELECT count(*) FROM claimed), EXISTS (SELECT 1 FROM concurrency_waiters w "
    "WHERE w.slot IN (SELECT slot FROM claimed) AND w.dispatch_run_id IS NULL AND w.task_id <> %(task_id)s), "
    "NOT EXISTS (SELECT 1 FROM claimed) AND EXISTS (SELECT 1 FROM elsewhere)"
)
_CLAIM_DISPATCH_DRIVER = _CLAIM_DISPATCH_TEMPLATE.replace("{standby}", "")
# The claim, also deleting the standby record of the claimed dispatch (see
# _SETTLE_ONE_WITH_STANDBY_DRIVER): a copy that came after its standby was taken claims here.
_CLAIM_DISPATCH_WITH_STANDBY_DRIVER = _CLAIM_DISPATCH_TEMPLATE.replace(
    "{standby}",
    "standby AS (DELETE FROM concurrency_standby WHERE task_id = %(task_id)s AND dispatch_run_id = %(run_id)s), ",
)
_EXPIRED_DISPATCHES = (
    "SELECT DISTINCT task_id, dispatch_run_id FROM concurrency_waiters WHERE dispatch_expires_at <= {now}"
)
_EXPIRED_DISPATCHES_OF = (
    _EXPIRED_DISPATCHES + " AND task_id IN (SELECT task_id FROM concurrency_waiters WHERE slot IN :slots)"
)
# Taking waiters off the list (expired, drained) at least once: mark them (a dispatch without
# leases), publish, then delete the published ones; a mark that is never settled expires and the
# waiter waits again.
_EXPIRING_TASKS = (
    "SELECT DISTINCT task_id FROM concurrency_waiters WHERE first_deferred_at < :before AND dispatch_run_id IS NULL"
)
_WAITING_TASKS_OF_SLOT = (
    "SELECT DISTINCT task_id FROM concurrency_waiters WHERE slot = :slot AND dispatch_run_id IS NULL"
)
_SLOTS_OF_TASKS = "SELECT DISTINCT slot FROM concurrency_waiters WHERE task_id IN :task_ids"
_MARK_WAITING = (
    "UPDATE concurrency_waiters SET dispatch_run_id = :mark, dispatch_expires_at = {now} + :hold_seconds "
    "WHERE task_id IN :task_ids AND dispatch_run_id IS NULL"
)
_MARKED = (
    "SELECT task_id, payload, task_name FROM concurrency_waiters WHERE dispatch_run_id = :mark "
    "ORDER BY first_deferred_at, parked_at, task_id"
)
_SETTLE_PUBLISHED = "DELETE FROM concurrency_waiters WHERE dispatch_run_id = :mark AND task_id IN :task_ids"
# One task settled (a task handed over on standby leaving the list), on the hot path's connection.
_SETTLE_ONE_DRIVER = "DELETE FROM concurrency_waiters WHERE dispatch_run_id = %(mark)s AND task_id = %(task_id)s"
# The same, also deleting the standby record the dispatch took (as the Redis store does when a
# task leaves the list): a taken record has no use once its task left the list, and left to
# expire (2 x caps_standby_seconds + 5 s), taken records piled up by the hundred in a busy
# fleet, which every stand_by call scanned twice.
_SETTLE_ONE_WITH_STANDBY_DRIVER = (
    "WITH standby AS (DELETE FROM concurrency_standby WHERE task_id = %(task_id)s AND dispatch_run_id = %(mark)s) "
    + _SETTLE_ONE_DRIVER
)
_SETTLE_FAILED = (
    "UPDATE concurrency_waiters SET dispatch_run_id = NULL, dispatch_expires_at = NULL "
    "WHERE dispatch_run_id = :mark AND task_id IN :task_ids"
)
# Prune keeps the slots parked tasks wait for (waiting or dispatched).
_PRUNE_WAITED = "SELECT DISTINCT slot FROM concurrency_waiters WHERE slot IN :slots"
_UNDISPATCH = (
    "UPDATE concurrency_waiters SET dispatch_run_id = NULL, dispatch_expires_at = NULL "
    "WHERE task_id = :task_id AND dispatch_run_id = :run_id"
)
_DELETE_DISPATCH_LEASES = "DELETE FROM concurrency_slots WHERE run_id = :run_id AND holder = :holder"
_WAITERS_LIST = (
    "SELECT slot, task_id, task_name, first_deferred_at, {now} - parked_at, dispatch_run_id "
    "FROM concurrency_waiters {slot_filter} ORDER BY slot, first_deferred_at, parked_at, task_id"
)

# -- standby (PostgreSQL): waiters whose copy a pool process holds, signalled by NOTIFY ----
# Take a dispatched waiter's live standby and signal it (delivered when the transaction commits).
# (This path keeps the dispatch lease, which the standby process claims: no holder in the record.)
_TAKE_STANDBY = (
    "WITH taken AS (UPDATE concurrency_standby SET dispatch_run_id = :run_id, holder = NULL "
    "WHERE task_id = :task_id AND dispatch_run_id IS NULL AND expires_at > {now} RETURNING mark) "
    "SELECT pg_notify(:channel, taken.mark || ' ' || :run_id || ' dispatched') FROM taken"
)
# End a task's standby that no dispatch took (the task left the waiting list: a revoke) and
# signal its waiting process (the mark alone, no run id), delivered when the transaction commits.
_END_TASK_STANDBY = (
    "WITH ended AS (DELETE FROM concurrency_standby WHERE task_id = :task_id AND dispatch_run_id IS NULL "
    "RETURNING mark) SELECT pg_notify(:channel, ended.mark) FROM ended"
)
# Putting waiters on standby, in one round trip (``SQLAlchemyStore.stand_by``): drop expired
# records; for each slot of p_slots (sorted), read the head of its waiting list (p_per_slot + 16
# rows), each waiter with its live standby's mark, and choose its oldest waiters without one
# until min(p_per_slot, the slot's limit) of them are on standby, never more than p_max_total
# live standbys in all; lock the chosen waiters still waiting (SKIP LOCKED: one a release is
# dispatching, or another stand_by choosing, is left out; locked here, a waiter's dispatch waits
# for this to commit and then sees its standby); replace their taken or expired records and
# insert new ones (ON CONFLICT: skip a waiter another release just put on standby).  One row per
# new standby, in the order chosen: its task id, mark, payload and task name.
POSTGRESQL_STAND_BY_FUNCTION = "concurrency_slots_stand_by_v1"
POSTGRESQL_STAND_BY_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_STAND_BY_FUNCTION}(
    p_slots text[], p_per_slot integer, p_max_total integer, p_hold_seconds double precision
) RETURNS TABLE (o_task_id text, o_mark text, o_payload bytea, o_task_name text)
LANGUAGE plpgsql VOLATILE {_GENERIC_PLANS} AS $$
DECLARE
    v_now double precision := {_NOW["postgresql"]};
    v_room integer;
    v_slot text;
    v_wanted integer;
    v_ids text[];
    v_head_names text[];
    v_marked boolean[];
    v_limit integer;
    v_chosen text[] := '{{}}';
    v_names text[] := '{{}}';
    v_locked text[];
BEGIN
    DELETE FROM concurrency_standby s WHERE s.expires_at <= v_now;
    v_room := p_max_total - (SELECT count(*) FROM concurrency_standby s WHERE s.dispatch_run_id IS NULL);
    FOREACH v_slot IN ARRAY p_slots LOOP
        EXIT WHEN v_room <= cardinality(v_chosen);
        SELECT coalesce(array_agg(h.task_id ORDER BY h.n), '{{}}'),
               coalesce(array_agg(h.task_name ORDER BY h.n), '{{}}'),
               coalesce(array_agg(h.mark IS NOT NULL ORDER BY h.n), '{{}}'),
               (array_agg(h.slot_limit ORDER BY h.n))[1]
        INTO v_ids, v_head_names, v_marked, v_limit
        FROM (
            SELECT w.task_id, w.slot_limit, w.task_name, s.mark,
                row_number() OVER (ORDER BY w.first_deferred_at, w.parked_at, w.task_id) AS n
            FROM concurrency_waiters w
            LEFT JOIN concurrency_standby s ON s.task_id = w.task_id AND s.dispatch_run_id IS NULL
            WHERE w.slot = v_slot AND w.dispatch_run_id IS NULL
            ORDER BY w.first_deferred_at, w.parked_at, w.task_id LIMIT p_per_slot + 16) h;
        CONTINUE WHEN cardinality(v_ids) = 0;
        v_wanted := least(p_per_slot, v_limit) - cardinality(array_positions(v_marked, true));
        FOR i IN 1 .. cardinality(v_ids) LOOP
            EXIT WHEN v_wanted <= 0 OR v_room <= cardinality(v_chosen);
            IF NOT v_marked[i] AND NOT (v_ids[i] = ANY(v_chosen)) THEN
                v_chosen := v_chosen || v_ids[i];
                v_names := v_names || v_head_names[i];
                v_wanted := v_wanted - 1;
            END IF;
        END LOOP;
    END LOOP;
    IF cardinality(v_chosen) = 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(array_agg(l.task_id), '{{}}') INTO v_locked FROM (
        SELECT w.task_id FROM concurrency_waiters w
        WHERE w.task_id = ANY(v_chosen) AND w.dispatch_run_id IS NULL
        FOR UPDATE SKIP LOCKED) l;
    DELETE FROM concurrency_standby s
    WHERE s.task_id = ANY(v_locked) AND (s.dispatch_run_id IS NOT NULL OR s.expires_at <= v_now);
    FOR i IN 1 .. cardinality(v_chosen) LOOP
        CONTINUE WHEN NOT (v_chosen[i] = ANY(v_locked));
        o_mark := md5(random()::text || clock_timestamp()::text || v_chosen[i]);
        INSERT INTO concurrency_standby (task_id, mark, expires_at)
        VALUES (v_chosen[i], o_mark, v_now + p_hold_seconds)
        ON CONFLICT (task_id) DO NOTHING;
        IF FOUND THEN
            o_task_id := v_chosen[i];
            o_task_name := v_names[i];
            SELECT w.payload INTO o_payload FROM concurrency_waiters w WHERE w.task_id = o_task_id LIMIT 1;
            RETURN NEXT;
        END IF;
    END LOOP;
END $$
"""
_CALL_STAND_BY_FUNCTION_DRIVER = (
    "SELECT o_task_id, o_mark, o_payload, o_task_name "
    f"FROM {POSTGRESQL_STAND_BY_FUNCTION}(%(slots)s, %(per_slot)s, %(max_total)s, %(hold_seconds)s)"
)
# The waiting process's side, on its own thread's driver connection (psycopg's style).
_STANDBY_RECORD_DRIVER = "SELECT mark, dispatch_run_id, holder FROM concurrency_standby WHERE task_id = %(task_id)s"
# The process waits (given a holder): a release that takes the standby from now on hands it its
# leases claimed.  One statement: how many records it registered in (1: waiting; never in an
# expired record, which no release takes), the seconds the record has left (the wait ends by
# then), then the record as the statement found it (to tell a copy that came late what the
# release took it for).
_REGISTER_STANDBY_DRIVER = (
    "WITH registered AS ("
    " UPDATE concurrency_standby SET holder = %(holder)s, lease_seconds = %(lease_seconds)s"
    " WHERE task_id = %(task_id)s AND mark = %(mark)s AND dispatch_run_id IS NULL"
    f" AND expires_at > {_NOW['postgresql']} AND %(holder)s::text IS NOT NULL RETURNING expires_at)"
    " SELECT (SELECT count(*) FROM registered),"
    f" (SELECT max(expires_at) FROM registered) - {_NOW['postgresql']}, s.mark, s.dispatch_run_id, s.holder"
    " FROM (SELECT 1) AS one LEFT JOIN concurrency_standby s ON s.task_id = %(task_id)s"
)
_END_STANDBY_DRIVER = (
    "DELETE FROM concurrency_standby WHERE task_id = %(task_id)s AND mark = %(mark)s AND dispatch_run_id IS NULL"
)
_STANDBYS = "SELECT task_id, holder, dispatch_run_id, expires_at - {now} FROM concurrency_standby ORDER BY task_id"


#: The slot names a warm-up rehearses the hot path on (in a transaction rolled back: never seen).
WARM_UP_SLOT_PREFIX = "celery-caps-warm-up:"


def standby_channel(task_id: str) -> str:
    """The NOTIFY channel of ``task_id``'s standby (as ``STANDBY_CHANNEL_SQL`` computes it)."""
    return "caps_standby_" + hashlib.md5(task_id.encode("utf-8", "surrogatepass")).hexdigest()


# A store that vanishes without closing its connections (a partition, a dead host)
# must turn into a StoreError, not a pool process blocked for ever: bounded connects,
# TCP keepalives and, on PostgreSQL, a bound on unacknowledged sends (milliseconds).
_POSTGRESQL_TIMEOUTS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30000,
}
# PyMySQL: seconds; a read that long is no admission any more.
_MYSQL_TIMEOUTS = {"connect_timeout": 10, "read_timeout": 60, "write_timeout": 60}

# Driver error codes worth one more try: MySQL deadlock / lock wait timeout.
_RETRYABLE_MYSQL_CODES = {1213, 1205}
_ACQUIRE_ATTEMPTS = 3
_SCHEMA_ATTEMPTS = 5

_T = TypeVar("_T")


def _as_text(value: Any) -> str:
    """Name columns come back as bytes from MySQL's VARBINARY."""
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else value


def _install_sqlite_transactions(engine: Engine) -> None:
    """WAL, a busy timeout and BEGIN IMMEDIATE, so that worker processes serialise."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")  # first: the WAL switch below may have to wait
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


class _DriverConnections:
    """PostgreSQL's hot path: the statements every task sends — the admission function, a
    run's release (with park in use, the release-and-wake function) and a woken task's claim —
    run on a psycopg connection that each thread keeps checked out in autocommit.  No pool
    checkout and no SQL compilation per call: about a third of the cost of an acquire and
    release through SQLAlchemy Core (``benchmarks/profile_store.py``).

    A connection that fails is invalidated (closed, never returned to the pool, which
    expects transactions); after a fork the parent's connections are left alone.
    Not used under gevent/eventlet, where every green thread would hold a connection.

    :meth:`rehearse` connects ahead of use (from a warm-up thread) and runs the hot path once on
    each new connection: the first threads that need a connection (a pool process's task
    thread, then its background thread) take those instead of connecting.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[Any] = []
        #: Connections opened ahead of use, for the next threads that need one.
        self._spares: list[Any] = []
        #: The thread that ends a standby's LISTEN once the standby is over (off the task's path).
        self._unlistener: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._error: type[Exception] = engine.dialect.loaded_dbapi.Error

    def execute(self, sql: str, params: Mapping[str, Any]) -> Any:
        """Run ``sql`` (psycopg's ``%(name)s`` style) and return the cursor.

        Raises the driver's error after invalidating the connection.
        """
        fairy = self._connection()
        try:
            cursor = fairy.driver_connection.cursor()
            cursor.execute(sql, params)
            return cursor
        except self._error:
            self._drop(fairy)
            raise

    def _connection(self) -> Any:
        """This thread's connection (SQLAlchemy's pool fairy), checked out in autocommit on first
        use (a spare, if one is open)."""
        if os.getpid() != self._pid:
            self._forget_inherited()
        fairy: Any = getattr(self._local, "connection", None)
        if fairy is None:
            with self._lock:
                fairy = self._spares.pop(0) if self._spares else None
            if fairy is None:
                fairy = self._checkout()
            self._local.connection = fairy
        return fairy

    def _checkout(self) -> Any:
        """A new connection in autocommit, kept checked out (and listed, to close it)."""
        fairy: Any = self._engine.raw_connection()
        fairy.driver_connection.autocommit = True
        with self._lock:
            self._open.append(fairy)
        return fairy

    def rehearse(self, work: Callable[[], object], spares: int = 1) -> None:
        """Open connections until ``spares`` are spare, running ``work`` (calls of the store
        from this thread) on each new one in a transaction that is rolled back.

        A new connection costs the server a process, and a new session compiles each function
        and plans its statements on its first calls (about 6 ms for the release-and-wake
        function alone, here) and loads the caches of the tables they read: the first
        hand-overs of a freshly started worker would pay all that, on a machine busy with
        other hand-overs.  The compiled functions and plans outlive the rollback; what
        ``work`` wrote does not, and nobody else saw it.

        Raises the driver's error (that connection is then closed, not kept).
        """
        if os.getpid() != self._pid:
            self._forget_inherited()
        earlier = getattr(self._local, "connection", None)
        try:
            while True:
                with self._lock:
                    if len(self._spares) >= spares:
                        return
                fairy = self._checkout()
                self._local.connection = fairy
                try:
                    fairy.driver_connection.execute("BEGIN")
                    work()
                    fairy.driver_connection.execute("ROLLBACK")
                except BaseException:
                    # Closed, the connection's transaction goes with it (a failed call closed it already).
                    if fairy in self._open:
                        self._drop(fairy)
                    raise
                with self._lock:
                    self._spares.append(fairy)
        finally:
            self._local.connection = earlier

    def listening(self, channel: str, statement: str, params: Mapping[str, Any], work: Callable[[Any, Any], _T]) -> _T:
        """``work(psycopg connection, row)`` while this thread's connection listens to ``channel``;
        ``row`` is the first row of ``statement``, run in the same round trip and transaction
        as the ``LISTEN`` (a psycopg pipeline; two round trips where libpq has none).

        Once ``work`` is done, the connection stops listening, from another thread: PostgreSQL
        wakes every listening session of the database on each ``NOTIFY`` (measured here, 16
        idle listeners made a notification's delivery about 0.5 ms slower), and a pool process
        runs its task on this connection after its standby.  An ``UNLISTEN`` in this thread
        would cost the task a round trip before it starts.

        Raises the driver's error after invalidating the connection.
        """
        from psycopg import Pipeline, sql

        fairy = self._connection()
        connection = fairy.driver_connection
        lock = fairy.info.setdefault(_LISTEN_LOCK, threading.Lock())
        with lock:
            # A pending UNLISTEN of an earlier standby now finds a newer listen, and skips it.
            generation = fairy.info[_LISTEN_GENERATION] = fairy.info.get(_LISTEN_GENERATION, 0) + 1
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
        try:
            if Pipeline.is_supported():
                with connection.pipeline():
                    connection.execute("UNLISTEN *")
                    connection.execute(listen)
                    cursor = connection.execute(statement, params)
            else:
                connection.execute(sql.SQL("UNLISTEN *; {}").format(listen))
                cursor = connection.execute(statement, params)
            return work(connection, cursor.fetchone())
        except self._error:
            self._drop(fairy)
            raise
        finally:
            if fairy in self._open:
                self._unlisten_soon(fairy, generation)

    def _unlisten_soon(self, fairy: Any, generation: int) -> None:
        with self._lock:
            if self._unlistener is None:
                self._unlistener = ThreadPoolExecutor(max_workers=1, thread_name_prefix="celery-caps-unlisten")
            unlistener = self._unlistener

        def unlisten() -> None:
            with fairy.info[_LISTEN_LOCK]:
                if fairy.info.get(_LISTEN_GENERATION) != generation or fairy not in self._open:
                    return  # listening for a newer standby, or closed
                try:
                    fairy.driver_connection.execute("UNLISTEN *")
                except self._error as exc:  # its thread's next call finds the connection broken
                    logger.debug("UNLISTEN failed (%s)", exc)

        with contextlib.suppress(RuntimeError):  # shut down (closing): the connection goes too
            unlistener.submit(unlisten)

    def _drop(self, fairy: Any) -> None:
        self._local.connection = None
        with self._lock:
            if fairy in self._open:
                self._open.remove(fairy)
        try:
            fairy.invalidate()
        except Exception:  # already broken: nothing more to close
            logger.debug("closing a failed store connection failed", exc_info=True)

    def _forget_inherited(self) -> None:
        # The parent's sockets: never closed here (that would end the parent's sessions),
        # and kept referenced so that no finaliser closes them either.
        _INHERITED_CONNECTIONS.extend(self._open)
        self._open = []
        self._spares = []
        self._unlistener = None  # its thread is the parent's
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def close(self) -> None:
        if os.getpid() != self._pid:
            self._forget_inherited()
            return
        with self._lock:
            open_connections, self._open = self._open, []
            self._spares = []
            unlistener, self._unlistener = self._unlistener, None
        if unlistener is not None:
            unlistener.shutdown(wait=False, cancel_futures=True)
        for fairy in open_connections:
            try:
                fairy.invalidate()
            except Exception:
                logger.debug("closing a store connection failed", exc_info=True)
        self._local = threading.local()


#: Driver connections a forked process inherited: kept, never used or closed.
_INHERITED_CONNECTIONS: list[Any] = []
#: Keys of a driver connection's ``info``: the lock and count of its standby listens (a pending
#: UNLISTEN must not end a newer standby's LISTEN).
_LISTEN_LOCK = "celery_caps_listen_lock"
_LISTEN_GENERATION = "celery_caps_listen_generation"


class SQLAlchemyStore(SlotStore):
    """Slots in ``concurrency_slots`` on PostgreSQL, MySQL/MariaDB or SQLite.

    Args:
        target: A SQLAlchemy URL (``postgresql+psycopg://``, ``mysql+pymysql://``,
            ``sqlite:///path``) or a ready ``Engine``.  An engine passed in is
            never disposed by :meth:`close`.
        create_schema: Create the table on first use if it is missing.
    """

    def __init__(self, target: str | Engine, *, create_schema: bool = True) -> None:
        if isinstance(target, Engine):
            self._engine = target
            self._owns_engine = False
        else:
            self._engine = self._create_engine(target)
            self._owns_engine = True
        dialect = self._engine.dialect.name
        self.dialect = "mysql" if dialect == "mariadb" else dialect
        if self.dialect not in _NOW:
            raise ConfigurationError(
                f"caps_url {self.display_url!r}: the SQL store supports PostgreSQL, MySQL/MariaDB "
                f"and SQLite, not {dialect!r}"
            )
        self._create_schema = create_schema
        self._schema_ready = False
        # A pool process's warm-up thread and its first task may prepare at once: once is enough.
        self._prepare_lock = threading.Lock()
        # PostgreSQL runs single statements (and the admission function) in
        # autocommit: no BEGIN and COMMIT round trips around them.
        self._autocommit_engine = (
            self._engine.execution_options(isolation_level="AUTOCOMMIT")
            if self.dialect == "postgresql"
            else self._engine
        )
        self._use_acquire_function = False
        self._use_release_function = False
        self._use_release_and_wake_function = False
        self._use_park_function = False
        self._use_stand_by_function = False
        # Whether concurrency_standby is there (PostgreSQL only); known after _prepare.
        self._standby_table = False
        self._driver: _DriverConnections | None = None
        # Whether the table has the lease detail columns; known after _prepare.
        self._lease_details = True
        now = _NOW[self.dialect]
        self._now = now
        self._lock_statements: dict[int, sa.TextClause] = {}
        self._count_statements: dict[int, sa.TextClause] = {}
        self._insert_statements: dict[int, sa.TextClause] = {}
        run_ids: sa.BindParameter[list[str]] = sa.bindparam("run_ids", expanding=True)
        self._renew = sa.text(_RENEW.format(now=now)).bindparams(run_ids)
        self._renewed = sa.text(_RENEWED.format(now=now)).bindparams(run_ids)
        self._renew_returning = sa.text(_RENEW_RETURNING.format(now=now)).bindparams(run_ids)
        self._call_acquire_function = sa.text(_CALL_ACQUIRE_FUNCTION)
        self._release_run = sa.text(_RELEASE_RUN)
        self._release_holder = sa.text(_RELEASE_HOLDER)
        self._release_task = sa.text(_RELEASE_TASK)
        self._sweep = sa.text(_SWEEP.format(now=now))
        self._status = sa.text(_STATUS.format(now=now))
        self._use_lease_details(True)
        self._prune_candidates = sa.text(_PRUNE_CANDIDATES)
        # SQLite has no FOR UPDATE: BEGIN IMMEDIATE already holds the write lock.
        self._prune_locked_candidates = sa.text(_PRUNE_CANDIDATES + ("" if self.dialect == "sqlite" else " FOR UPDATE"))
        self._prune_live = sa.text(_PRUNE_LIVE.format(now=now)).bindparams(sa.bindparam("slots", expanding=True))
        self._prune_delete = sa.text(_PRUNE_DELETE).bindparams(sa.bindparam("slots", expanding=True))
        self._parking = self._parking_statements()

    def _parking_statements(self) -> dict[str, sa.TextClause]:
        """The waiting-list statements, with expanding lists bound."""
        lock_suffix = "" if self.dialect == "sqlite" else " FOR UPDATE"
        templates = {
            "lock": _LOCK_EXISTING_SENTINELS + lock_suffix,
            # Slots beyond those a release already locked: take what is free, never wait
            # (waiting out of slot order could deadlock); a waiter needing a skipped slot
            # is passed over this time and dispatched by a later release or the sweep.
            "lock_more": _LOCK_EXISTING_SENTINELS + ("" if self.dialect == "sqlite" else " FOR UPDATE SKIP LOCKED"),
            "task_waiting_slots": _TASK_WAITING_SLOTS,
            "waiters_per_slot": _WAITERS_PER_SLOT,
            "run_slots": _RUN_SLOTS,
            "holder_slots": _HOLDER_SLOTS,
            "task_slots": _TASK_SLOTS,
            "waiting_slots": _WAITING_SLOTS,
            "all_waiting_slots": _ALL_WAITING_SLOTS,
            "waiting_rows": _WAITING_ROWS,
            "live": _LIVE_HOLDERS,
            "mark_dispatched": _MARK_DISPATCHED,
            "payloads": _WAITER_PAYLOADS,
            "claim": _CLAIM,
            "delete_waiter": _DELETE_WAITER,
            "dispatched_elsewhere": _DISPATCHED_ELSEWHERE,
            "expired_dispatches": _EXPIRED_DISPATCHES,
            "expired_dispatches_of": _EXPIRED_DISPATCHES_OF,
            "prune_waited": _PRUNE_WAITED,
            "expiring_tasks": _EXPIRING_TASKS,
            "waiting_tasks_of_slot": _WAITING_TASKS_OF_SLOT,
            "slots_of_tasks": _SLOTS_OF_TASKS,
            "mark_waiting": _MARK_WAITING,
            "marked": _MARKED,
            "settle_published": _SETTLE_PUBLISHED,
            "settle_failed": _SETTLE_FAILED,
            "undispatch": _UNDISPATCH,
            "delete_dispatch_leases": _DELETE_DISPATCH_LEASES,
            "waiters_all": _WAITERS_LIST.replace("{slot_filter}", ""),
            "waiters_slot": _WAITERS_LIST.replace("{slot_filter}", "WHERE slot = :slot"),
            "take_standby": _TAKE_STANDBY,
            "end_task_standby": _END_TASK_STANDBY,
            "standbys": _STANDBYS,
        }
        statements = {}
        for name, template in templates.items():
            statement = sa.text(template.format(now=self._now))
            for expanding in ("slots", "task_ids"):
                if f":{expanding}" in template:
                    statement = statement.bindparams(sa.bindparam(expanding, expanding=True))
            statements[name] = statement
        return statements

    def _use_lease_details(self, present: bool) -> None:
        """Pick the statements for a table with (or without) ``task_name``/``acquired_at``."""
        self._lease_details = present
        details = _LEASE_DETAILS.format(now=self._now) if present else _NO_LEASE_DETAILS
        self._all_leases = sa.text(_LEASES.format(now=self._now, slot_filter="", details=details))
        self._slot_leases = sa.text(_LEASES.format(now=self._now, slot_filter="AND slot = :slot", details=details))
        template = _INSERT_LEASES[self.dialect]
        self._insert_template = template.replace("{columns}", ", task_name, acquired_at" if present else "").replace(
            "{updates}", _DETAIL_UPDATES[self.dialect] if present else ""
        )
        self._insert_row = "(:run_id, :s{i}, :task_id, :holder, " + self._now + " + :lease_seconds"
        self._insert_row += ", :task_name, " + self._now + ")" if present else ")"
        self._insert_statements.clear()

    @staticmethod
    def _create_engine(url: str) -> Engine:
        try:
            parsed = sa.engine.make_url(url)
        except sa.exc.ArgumentError as exc:
            raise ConfigurationError(f"caps_url {mask_url(url)!r} is not a valid SQLAlchemy URL") from exc
        backend = parsed.get_backend_name()
        options: dict[str, Any] = {
            # Every transaction here ends in COMMIT or ROLLBACK; a reset on
            # return would only add a round trip.
            "pool_reset_on_return": None,
        }
        connect_args: dict[str, Any] = {}
        if backend in ("mysql", "mariadb"):
            options["isolation_level"] = "READ COMMITTED"
            options["pool_recycle"] = 3600
            if parsed.get_driver_name() == "pymysql":
                connect_args = dict(_MYSQL_TIMEOUTS)
        if backend == "postgresql" and parsed.get_driver_name() in ("psycopg", "psycopg2"):
            connect_args = dict(_POSTGRESQL_TIMEOUTS)
        if backend == "sqlite":
            connect_args = {"check_same_thread": False, "timeout": 30}
        # What the URL sets itself wins.
        connect_args = {key: value for key, value in connect_args.items() if key not in parsed.query}
        if connect_args:
            options["connect_args"] = connect_args
        try:
            engine = sa.create_engine(parsed, **options)
        except ImportError as exc:
            extra = {"postgresql": "postgres", "mysql": "mysql", "mariadb": "mysql"}.get(backend, backend)
            from ..errors import MissingDependencyError

            raise MissingDependencyError(
                f'caps_url {mask_url(url)!r} needs a database driver: pip install "celery-caps[{extra}]" ({exc})'
            ) from exc
        except sa.exc.ArgumentError as exc:
            raise ConfigurationError(f"caps_url {mask_url(url)!r}: {exc}") from exc
        if backend == "sqlite":
            _install_sqlite_transactions(engine)
        return engine

    @property
    def engine(self) -> Engine:
        """The engine the store runs on."""
        return self._engine

    @property
    def display_url(self) -> str:
        """The store URL with the password masked."""
        return self._engine.url.render_as_string(hide_password=True)

    # -- plumbing ---------------------------------------------------------------

    def create_schema(self) -> None:
        """Create ``concurrency_slots``, its indexes and (PostgreSQL) the admission function if missing."""
        for attempt in range(1, _SCHEMA_ATTEMPTS + 1):
            try:
                metadata.create_all(self._engine, checkfirst=True)
                break
            except sa.exc.SQLAlchemyError as exc:
                # Several workers may race to create it (SQLite may even answer
                # "database is locked" at once); only a missing table is an error.
                # The check connects again, so an unreachable store must fail it too.
                try:
                    exists = sa.inspect(self._engine).has_table(TABLE_NAME)
                except sa.exc.SQLAlchemyError:
                    exists = False
                if exists:
                    break
                if attempt == _SCHEMA_ATTEMPTS or not isinstance(exc, sa.exc.OperationalError):
                    raise self._wrap("creating the schema", exc) from exc
                time.sleep(0.05 * attempt)
        self._add_missing_lease_columns()
        if self.dialect == "postgresql":
            try:
                for function, ddl in (
                    (POSTGRESQL_ACQUIRE_FUNCTION, POSTGRESQL_FUNCTION_DDL),
                    (POSTGRESQL_RELEASE_FUNCTION, POSTGRESQL_RELEASE_FUNCTION_DDL),
                    (POSTGRESQL_RELEASE_AND_WAKE_FUNCTION, POSTGRESQL_RELEASE_AND_WAKE_FUNCTION_DDL),
                    (POSTGRESQL_PARK_FUNCTION, POSTGRESQL_PARK_FUNCTION_DDL),
                    (POSTGRESQL_STAND_BY_FUNCTION, POSTGRESQL_STAND_BY_FUNCTION_DDL),
                ):
                    with self._engine.begin() as connection:
                        name = {"name": function}
                        connection.execute(sa.text(_FUNCTION_CREATION_LOCK), name)
                        if not connection.execute(sa.text(_FUNCTION_EXISTS), name).scalar():
                            connection.exec_driver_sql(ddl)
                with self._engine.begin() as connection:
                    # (IF NOT EXISTS; the lock keeps two workers from racing to create it.)
                    connection.execute(sa.text(_FUNCTION_CREATION_LOCK), {"name": WAITERS_OF_SEVERAL_INDEX})
                    connection.exec_driver_sql(WAITERS_OF_SEVERAL_INDEX_DDL)
            except sa.exc.SQLAlchemyError as exc:
                raise self._wrap("creating the admission function", exc) from exc

    def _has_table(self, name: str) -> bool:
        try:
            return sa.inspect(self._engine).has_table(name)
        except sa.exc.SQLAlchemyError as exc:
            raise self._wrap("checking the schema", exc) from exc

    def _missing_lease_columns(self) -> list[str]:
        try:
            present = {column["name"] for column in sa.inspect(self._engine).get_columns(TABLE_NAME)}
        except sa.exc.SQLAlchemyError as exc:
            raise self._wrap("checking the schema", exc) from exc
        return [name for name in LEASE_DETAIL_COLUMNS if name not in present]

    def _add_missing_lease_columns(self) -> None:
        """Upgrade a table created by an older version: add the nullable detail columns.

        Nullable columns without a default change no row, so this is quick on
        every dialect.  Workers racing to add a column: the losers find it there.
        """
        for name in self._missing_lease_columns():
            column_type = concurrency_slots.c[name].type.compile(dialect=self._engine.dialect)
            try:
                with self._engine.begin() as connection:
                    connection.exec_driver_sql(f"ALTER TABLE {TABLE_NAME} ADD COLUMN {name} {column_type}")
                logger.info("added column %s to %s", name, TABLE_NAME)
            except sa.exc.SQLAlchemyError as exc:
                if name in self._missing_lease_columns():
                    raise self._wrap(f"adding column {name}", exc) from exc

    def _prepare(self) -> None:
        """First use in this process: create the schema if asked, pick the admission path."""
        with self._prepare_lock:
            if not self._schema_ready:
                self._prepare_once()

    def _prepare_once(self) -> None:
        if self._create_schema:
            self.create_schema()
        missing = self._missing_lease_columns()
        self._use_lease_details(not missing)
        if missing:
            logger.info(
                "%s lacks column(s) %s (caps_create_schema is off): leases are listed without task name or age",
                TABLE_NAME,
                ", ".join(missing),
            )
        if self.dialect == "postgresql":
            try:
                names = [
                    POSTGRESQL_ACQUIRE_FUNCTION,
                    POSTGRESQL_RELEASE_FUNCTION,
                    POSTGRESQL_RELEASE_AND_WAKE_FUNCTION,
                    POSTGRESQL_PARK_FUNCTION,
                    POSTGRESQL_STAND_BY_FUNCTION,
                ]
                present_query = sa.text(_FUNCTIONS_PRESENT).bindparams(sa.bindparam("names", expanding=True))
                with self._engine.connect() as connection:
                    present = {row[0] for row in connection.execute(present_query, {"names": names})}
            except sa.exc.SQLAlchemyError as exc:
                raise self._wrap("checking the schema", exc) from exc
            found = POSTGRESQL_ACQUIRE_FUNCTION in present
            self._use_acquire_function = found and not missing
            self._use_release_function = POSTGRESQL_RELEASE_FUNCTION in present
            self._use_release_and_wake_function = POSTGRESQL_RELEASE_AND_WAKE_FUNCTION in present
            self._use_park_function = POSTGRESQL_PARK_FUNCTION in present and not missing
            self._use_stand_by_function = POSTGRESQL_STAND_BY_FUNCTION in present
            self._standby_table = self._has_table(STANDBY_TABLE_NAME)
            if not found:
                logger.info(
                    "%s() is missing (caps_create_schema is off): admitting with a three-statement "
                    "transaction instead; create it from POSTGRESQL_FUNCTION_DDL for one round trip",
                    POSTGRESQL_ACQUIRE_FUNCTION,
                )
        self._schema_ready = True

    def _exact(self, value: str) -> str | bytes:
        """A value for a name column through SQLAlchemy Core: bytes for MySQL's VARBINARY."""
        return value.encode("utf-8", "surrogatepass") if self.dialect == "mysql" else value

    def _wrap(self, operation: str, exc: BaseException) -> StoreError:
        reason = getattr(exc, "orig", None) or exc
        return StoreError(f"{operation} failed on {self.display_url}: {type(reason).__name__}: {reason}")

    def _transaction(
        self,
        operation: str,
        work: Callable[[Connection], _T],
        attempts: int = 1,
        single_statement: bool = False,
    ) -> _T:
        """Run ``work`` in one transaction (or, for a single statement on PostgreSQL,
        in autocommit), wrapping driver errors; MySQL deadlocks are tried again."""
        if not self._schema_ready:
            self._prepare()
        for attempt in range(1, attempts + 1):
            try:
                if single_statement:
                    with self._autocommit_engine.connect() as connection:
                        result = work(connection)
                        connection.commit()  # a no-op in autocommit; ends SQLite/MySQL transactions
                        return result
                with self._engine.begin() as connection:
                    return work(connection)
            except sa.exc.DBAPIError as exc:
                code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
                if attempt < attempts and self.dialect == "mysql" and code in _RETRYABLE_MYSQL_CODES:
                    logger.debug("%s: retrying after %s", operation, exc.orig)
                    time.sleep(0.005 * attempt)
                    continue
                raise self._wrap(operation, exc) from exc
            except sa.exc.SQLAlchemyError as exc:
                raise self._wrap(operation, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _statement(self, cache: dict[int, sa.TextClause], template: str, count: int, row: str) -> sa.TextClause:
        statement = cache.get(count)
        if statement is None:
            values = ", ".join(row.format(i=i) for i in range(count))
            slots = ", ".join(f":s{i}" for i in range(count))
            statement = sa.text(template.format(values=values, slots=slots, now=self._now))
            cache[count] = statement
        return statement

    # -- the contract -----------------------------------------------------------

    def _admission_params(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        task_name: str | None,
    ) -> dict[str, Any]:
        """Bind parameters of the admission statements; slot ``i`` in sorted order is ``:s{i}``/``:l{i}``."""
        params: dict[str, Any] = {
            "task_id": task_id,
            "run_id": run_id,
            "holder": holder,
            "lease_seconds": lease_seconds,
            "task_name": task_name,
        }
        for i, slot in enumerate(sorted(slots)):
            params[f"s{i}"] = slot
            params[f"l{i}"] = slots[slot]
        return params

    def _lock_and_count(self, connection: Connection, slots: Mapping[str, int], params: dict[str, Any]) -> list[str]:
        """Lock the slots' sentinels (sorted), then count live holders: the full slots, sorted."""
        count = len(slots)
        lock = self._statement(
            self._lock_statements, _LOCK_SENTINELS[self.dialect], count, "('', :s{i}, '', '', :l{i})"
        )
        connection.execute(lock, params)
        count_live = self._statement(self._count_statements, _COUNT_LIVE, count, "")
        return sorted(
            _as_text(slot)
            for slot, holders, holds_already in connection.execute(count_live, params)
            if not holds_already and holders >= slots[_as_text(slot)]
        )

    def _insert_leases(self, connection: Connection, count: int, params: dict[str, Any]) -> None:
        insert = self._statement(self._insert_statements, self._insert_template, count, self._insert_row)
        connection.execute(insert, params)

    def acquire(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        task_name: str | None = None,
    ) -> Admission:
        if not run_id:
            raise ValueError("run_id must be non-empty")
        if not self._schema_ready:
            self._prepare()
        if task_name is not None:
            task_name = task_name[:MAX_TASK_NAME_LENGTH]
        if self._use_acquire_function:
            return self._acquire_with_function(slots, task_id, run_id, holder, lease_seconds, task_name)
        params = self._admission_params(slots, task_id, run_id, holder, lease_seconds, task_name)

        def admit(connection: Connection) -> Admission:
            full = self._lock_and_count(connection, slots, params)
            if full:
                return Admission(False, tuple(full))
            self._insert_leases(connection, len(slots), params)
            return Admission(True)

        return self._transaction("acquire", admit, attempts=_ACQUIRE_ATTEMPTS)

    def _acquire_with_function(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        task_name: str | None,
    ) -> Admission:
        ordered = sorted(slots)
        params = {
            "slots": ordered,
            "limits": [slots[slot] for slot in ordered],
            "task_id": task_id,
            "run_id": run_id,
            "holder": holder,
            "lease_seconds": lease_seconds,
            "task_name": task_name,
        }
        driver = self._driver_connections()
        if driver is not None:
            full = self._driver_call("acquire", driver, _CALL_ACQUIRE_FUNCTION_DRIVER, params).fetchone()[0]
        else:
            full = self._transaction(
                "acquire",
                lambda connection: connection.execute(self._call_acquire_function, params).scalar(),
                single_statement=True,
            )
        return Admission(False, tuple(full)) if full else Admission(True)

    def _driver_connections(self) -> _DriverConnections | None:
        """The hot path's connections (PostgreSQL with psycopg, not under green threads), or None."""
        if self._driver is None:
            if self.dialect != "postgresql" or self._engine.dialect.driver != "psycopg" or green_threads():
                return None
            with self._prepare_lock:
                if self._driver is None:
                    self._driver = _DriverConnections(self._autocommit_engine)
        return self._driver

    def warm_up(self, threads: int = 1, renewals: bool = False) -> None:
        """Check the schema and connect ahead of the first task: on PostgreSQL with psycopg, a
        spare hot-path connection for each of ``threads`` threads, each rehearsed (plus a
        pooled one for the renewals, with ``renewals``); else a pooled one."""
        if not self._schema_ready:
            self._prepare()
        driver = self._driver_connections()
        if driver is not None:
            try:
                driver.rehearse(lambda: self._rehearse_hot_path(driver), spares=threads)
            except StoreError:
                raise
            except Exception as exc:
                raise StoreError(f"warming up failed on {self.display_url}: {type(exc).__name__}: {exc}") from exc
        if driver is None or renewals:
            # (After the rehearsal, which would otherwise have taken this one from the pool.)
            self._transaction("warming up", lambda connection: connection.exec_driver_sql("SELECT 1"))

    def _rehearse_hot_path(self, driver: _DriverConnections) -> None:
        """A task's store calls, each path of them once, on a slot of its own (the caller
        rolls it all back): admission; with parking, a park, a standby and the release that
        hands it over, its claim, and a dispatch through the broker and its claim."""
        if not self._use_acquire_function:
            return  # admission runs in pooled transactions of its own, which would commit
        slot = f"{WARM_UP_SLOT_PREFIX}{uuid.uuid4().hex}"
        slots = {slot: 1}
        holder, lease = "celery-caps-warm-up", 60.0
        first_task, first_run, standby_task, standby_run, woken_task, woken_run = (uuid.uuid4().hex for _ in range(6))
        if not self.acquire(slots, first_task, first_run, holder, lease).granted:
            return  # (cannot happen: nobody else sees this slot)
        if not (self.supports_parking and self._use_park_function and self._use_release_and_wake_function):
            self.release(first_run)
            return

        def park(task_id: str, run_id: str) -> None:
            self.park(
                slots, task_id, run_id, holder, lease, payload=b"", first_deferred_at=time.time(), max_waiters=10,
                report_first=True,
            )  # fmt: skip

        park(standby_task, standby_run)
        if self.supports_standby:
            for standby in self.stand_by([slot], 1, 2**31 - 1, lease):
                params = {"task_id": standby.task_id, "mark": standby.run_id, "holder": holder, "lease_seconds": lease}
                self._driver_call("warming up", driver, _REGISTER_STANDBY_DRIVER, params)
        _deleted, woken = self.release_and_wake(first_run, lease)
        for waiter in woken:
            self.claim(waiter.task_id, waiter.run_id, holder, lease)
            park(woken_task, woken_run)
            _deleted, dispatched = self.release_and_wake(waiter.run_id, lease)
            for task in dispatched:
                self.claim_dispatch(task.task_id, task.run_id, holder, lease)
                self.release_and_wake(task.run_id, lease)

    def _driver_call(self, operation: str, driver: _DriverConnections, sql: str, params: Mapping[str, Any]) -> Any:
        try:
            return driver.execute(sql, params)
        except Exception as exc:
            raise StoreError(f"{operation} failed on {self.display_url}: {type(exc).__name__}: {exc}") from exc

    def renew(self, run_ids: Collection[str], lease_seconds: float) -> dict[str, int]:
        if not run_ids:
            return {}
        params = {"run_ids": list(run_ids), "lease_seconds": lease_seconds}

        if self.dialect == "postgresql":

            def renew_returning(connection: Connection) -> dict[str, int]:
                renewed: dict[str, int] = {}
                for (run_id,) in connection.execute(self._renew_returning, params):
                    renewed[run_id] = renewed.get(run_id, 0) + 1
                return renewed

            return self._transaction("renew", renew_returning, single_statement=True)

        def renew(connection: Connection) -> dict[str, int]:
            connection.execute(self._renew, params)
            return {run_id: count for run_id, count in connection.execute(self._renewed, params)}

        return self._transaction("renew", renew)

    def _delete(self, operation: str, statement: sa.TextClause, params: dict[str, Any]) -> int:
        return self._transaction(
            operation, lambda connection: connection.execute(statement, params).rowcount, single_statement=True
        )

    def release(self, run_id: str) -> int:
        if not run_id:
            raise ValueError("run_id must be non-empty")
        driver = self._driver_connections() if self._schema_ready else None
        if driver is not None:
            return int(self._driver_call("release", driver, _RELEASE_RUN_DRIVER, {"run_id": run_id}).rowcount)
        return self._delete("release", self._release_run, {"run_id": run_id})

    def release_holder(self, task_id: str, holder: str) -> int:
        return self._delete("release", self._release_holder, {"task_id": task_id, "holder": holder})

    def release_task(self, task_id: str) -> int:
        return self._delete("release", self._release_task, {"task_id": task_id})

    def sweep(self) -> int:
        return self._delete("sweep", self._sweep, {})

    def status(self) -> list[SlotStatus]:
        def read(connection: Connection) -> list[SlotStatus]:
            return [
                SlotStatus(_as_text(slot), limit, int(holders), int(expired))
                for slot, limit, holders, expired in connection.execute(self._status)
            ]

        return self._transaction("status", read, single_statement=True)

    def leases(self, slot: str | None = None) -> list[Lease]:
        if not self._schema_ready:
            self._prepare()
        statement, params = (self._all_leases, {}) if slot is None else (self._slot_leases, {"slot": slot})

        def read(connection: Connection) -> list[Lease]:
            return [
                Lease(
                    _as_text(name),
                    _as_text(task_id),
                    run_id,
                    holder,
                    float(expires_in),
                    task_name,
                    None if age is None else float(age),
                )
                for name, task_id, run_id, holder, expires_in, task_name, age in connection.execute(statement, params)
            ]

        return self._transaction("leases", read, single_statement=True)

    def prune(self, prefix: str, *, dry_run: bool = False) -> list[str]:
        escaped = prefix.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"
        # MySQL's name columns are VARBINARY: match bytes.
        pattern = self._exact(escaped)
        candidates = self._prune_candidates if dry_run else self._prune_locked_candidates

        if not self._schema_ready:
            self._prepare()
        # A table from before the waiting list (caps_create_schema off) has no waiters to keep.
        waiters_table = self._has_table(WAITERS_TABLE_NAME)

        def prune(connection: Connection) -> list[str]:
            slots = [row[0] for row in connection.execute(candidates, {"pattern": pattern})]
            held: set[Any] = set()
            for start in range(0, len(slots), _PRUNE_BATCH):
                batch = slots[start : start + _PRUNE_BATCH]
                held.update(row[0] for row in connection.execute(self._prune_live, {"slots": batch}))
                if waiters_table:
                    held.update(row[0] for row in connection.execute(self._parking["prune_waited"], {"slots": batch}))
            doomed = [slot for slot in slots if slot not in held]
            if not dry_run:
                for start in range(0, len(doomed), _PRUNE_BATCH):
                    connection.execute(self._prune_delete, {"slots": doomed[start : start + _PRUNE_BATCH]})
            return sorted(_as_text(slot) for slot in doomed)

        return self._transaction("prune", prune, attempts=_ACQUIRE_ATTEMPTS)

    def record_history(self, events: Sequence[HistoryEvent], keep_seconds: float, max_events: int) -> None:
        if not events:
            return
        table = concurrency_slots_history
        rows = [
            {
                "recorded_at": event.at,
                "kind": event.kind,
                "task_id": self._exact(event.task_id),
                "task_name": None if event.task_name is None else event.task_name[:MAX_TASK_NAME_LENGTH],
                "holder": event.holder[:255],
                "slots": json.dumps(list(event.slots)),
                "full_slots": json.dumps(list(event.full_slots)),
                "started_at": event.started_at,
                "deferrals": event.deferrals,
            }
            for event in events
        ]
        oldest = max(event.at for event in events) - keep_seconds

        def record(connection: Connection) -> None:
            connection.execute(table.insert(), rows)
            connection.execute(table.delete().where(table.c.recorded_at < oldest))
            # The newest max_events rows stay (ids grow with insertion).
            boundary = connection.execute(
                sa.select(table.c.id).order_by(table.c.id.desc()).limit(1).offset(max_events)
            ).scalar()
            if boundary is not None:
                connection.execute(table.delete().where(table.c.id <= boundary))

        self._transaction("recording history", record)

    def history(self, since: float, task_id: str | None = None) -> list[HistoryEvent]:
        table = concurrency_slots_history
        query = sa.select(
            table.c.kind,
            table.c.recorded_at,
            table.c.task_id,
            table.c.task_name,
            table.c.slots,
            table.c.full_slots,
            table.c.holder,
            table.c.started_at,
            table.c.deferrals,
        ).where(table.c.recorded_at >= since)
        if task_id is not None:
            query = query.where(table.c.task_id == self._exact(task_id))
        query = query.order_by(table.c.recorded_at, table.c.id)

        def read(connection: Connection) -> list[HistoryEvent]:
            return [
                HistoryEvent(
                    kind=kind,
                    at=float(at),
                    task_id=_as_text(event_task_id),
                    task_name=task_name,
                    slots=tuple(json.loads(slots)),
                    full_slots=tuple(json.loads(full_slots)),
                    holder=holder,
                    started_at=None if started_at is None else float(started_at),
                    deferrals=int(deferrals),
                )
                for kind, at, event_task_id, task_name, slots, full_slots, holder, started_at, deferrals in (
                    connection.execute(query)
                )
            ]

        return self._transaction("reading history", read, single_statement=True)

    # -- the waiting list (park strategy) ---------------------------------------

    supports_parking = True

    def park(
        self,
        slots: Mapping[str, int],
        task_id: str,
        run_id: str,
        holder: str,
        lease_seconds: float,
        *,
        payload: bytes,
        first_deferred_at: float,
        max_waiters: int,
        task_name: str | None = None,
        admit: bool = True,
        report_first: bool = False,
    ) -> str:
        if not run_id:
            raise ValueError("run_id must be non-empty")
        if not self._schema_ready:
            self._prepare()
        if task_name is not None:
            task_name = task_name[:MAX_TASK_NAME_LENGTH]
        ordered = sorted(slots)
        count = len(ordered)
        params = self._admission_params(slots, task_id, run_id, holder, lease_seconds, task_name)
        statements = self._parking
        if not admit and not self._full_now(slots, params):
            # A task being sent to a cap with room (the common case) costs one read, no lock.
            return PARK_ROOM
        driver = self._driver_connections() if self._use_park_function else None
        if driver is not None:
            call = {
                "slots": ordered, "limits": [slots[slot] for slot in ordered], "task_id": task_id,
                "run_id": run_id, "holder": holder, "lease_seconds": lease_seconds, "task_name": task_name,
                "payload": payload, "first_deferred_at": first_deferred_at, "max_waiters": max_waiters,
                "admit": admit,
            }  # fmt: skip
            outcome = str(self._driver_call("park", driver, _CALL_PARK_FUNCTION_DRIVER, call).fetchone()[0])
            return PARK_PARKED if outcome == PARK_PARKED_FIRST and not report_first else outcome

        def park(connection: Connection) -> str:
            # The same locks and count as acquire: parking is atomic with admission.
            if not self._lock_and_count(connection, slots, params):
                if not admit:
                    return PARK_ROOM
                self._insert_leases(connection, count, params)
                return PARK_ADMITTED
            per_slot = connection.execute(statements["waiters_per_slot"], {"slots": ordered, "task_id": task_id}).all()
            if any(mine for _slot, _waiting, mine in per_slot):
                return PARK_PARKED  # a duplicate of a parked task: it waits once
            if any(waiting >= max_waiters for _slot, waiting, _mine in per_slot):
                return PARK_LIST_FULL
            # (Rows come only for slots with waiters, none of them this task's.)
            first = report_first and len(per_slot) < count
            parked_at: sa.ColumnElement[Any] = sa.literal_column(self._now)  # the store's clock, in the insert
            connection.execute(
                concurrency_waiters.insert().values(
                    [
                        {
                            "slot": self._exact(slot),
                            "task_id": self._exact(task_id),
                            "slot_limit": slots[slot],
                            "slot_count": count,
                            "first_deferred_at": first_deferred_at,
                            "parked_at": parked_at,
                            "task_name": task_name,
                            "payload": payload,
                        }
                        for slot in ordered
                    ]
                )
            )
            return PARK_PARKED_FIRST if first else PARK_PARKED

        return self._transaction("park", park, attempts=_ACQUIRE_ATTEMPTS)

    def _full_now(self, slots: Mapping[str, int], params: dict[str, Any]) -> bool:
        """Whether a slot looks full now: the admission count, without its locks."""
        count_live = self._statement(self._count_statements, _COUNT_LIVE, len(slots), "")
        rows = self._transaction(
            "park", lambda connection: connection.execute(count_live, params).all(), single_statement=True
        )
        return any(not holds and holders >= slots[_as_text(slot)] for slot, holders, holds in rows)

    def _dispatch(self, connection: Connection, locked: list[str], dispatch_lease_seconds: float) -> list[Woken]:
        """Dispatch the oldest waiters of the ``locked`` slots (sentinels locked) that have room.

        Waiters are read in their order a batch at a time, and reading stops once every
        slot seen is full: a release with a long waiting list reads a few rows, not all.
        """
        statements = self._parking
        live: dict[str, set[str]] = defaultdict(set)
        for slot, task_id in connection.execute(statements["live"], {"slots": locked}):
            live[_as_text(slot)].add(_as_text(task_id))
        limits: dict[str, int] = {}
        chosen: list[tuple[str, str, str | None]] = []
        after: dict[str, Any] = {"first": _BEFORE_ANY_TIME, "parked": _BEFORE_ANY_TIME, "task_id": ""}
        while True:
            rows = connection.execute(
                statements["waiting_rows"], {"slots": locked, "batch": _WAITING_BATCH, **after}
            ).all()
            waiting: dict[str, dict[str, Any]] = {}
            for task_id, slot, limit, count, first, parked, task_name in rows:
                waiter = waiting.setdefault(
                    _as_text(task_id), {"slots": {}, "count": count, "order": (first, parked), "task_name": task_name}
                )
                waiter["slots"][_as_text(slot)] = limit
                limits[_as_text(slot)] = limit
            complete = list(waiting.items())
            more = len(rows) == _WAITING_BATCH and len(complete) > 1
            if more:
                # The last waiter's rows may go on in the next batch: read it again there.
                next_id, next_waiter = complete.pop()
                after = {"first": next_waiter["order"][0], "parked": next_waiter["order"][1], "task_id": next_id}
            for task_id, waiter in complete:
                needed: dict[str, int] = waiter["slots"]
                if len(needed) < waiter["count"]:
                    continue  # one of its slots is not locked here: a later release or the sweep
                if any(task_id not in live[slot] and len(live[slot]) >= limit for slot, limit in needed.items()):
                    continue  # passed over while one of its own slots is full; never blocks the rest
                run_id = uuid.uuid4().hex
                ordered = sorted(needed)
                params: dict[str, Any] = {
                    "task_id": task_id,
                    "run_id": run_id,
                    "holder": DISPATCH_HOLDER,
                    "lease_seconds": dispatch_lease_seconds,
                    "task_name": waiter["task_name"],
                }
                params.update({f"s{i}": slot for i, slot in enumerate(ordered)})
                insert = self._statement(self._insert_statements, self._insert_template, len(ordered), self._insert_row)
                connection.execute(insert, params)
                connection.execute(statements["mark_dispatched"], params)
                for slot in needed:
                    live[slot].add(task_id)
                chosen.append((task_id, run_id, waiter["task_name"]))
            if not more or all(len(live[slot]) >= limit for slot, limit in limits.items()):
                break
        if not chosen:
            return []
        payloads: dict[str, bytes] = {}
        for task_id, payload in connection.execute(
            statements["payloads"], {"task_ids": [task_id for task_id, _, _ in chosen]}
        ):
            payloads.setdefault(_as_text(task_id), bytes(payload))
        standby = {task_id for task_id, run_id, _ in chosen if self._take_standby(connection, task_id, run_id)}
        return [
            Woken(task_id, run_id, payloads[task_id], task_name, task_id in standby)
            for task_id, run_id, task_name in chosen
        ]

    def _take_standby(self, connection: Connection, task_id: str, run_id: str) -> bool:
        """Take ``task_id``'s live standby for the dispatch ``run_id`` and signal it (on commit)."""
        if not self._standby_table:
            return False
        params = {"task_id": task_id, "run_id": run_id, "channel": standby_channel(task_id)}
        return connection.execute(self._parking["take_standby"], params).first() is not None

    def _end_task_standby(self, connection: Connection, task_id: str) -> None:
        """End ``task_id``'s standby that no dispatch took, and signal its waiting copy to stop
        waiting now (on commit) rather than when its wait is over."""
        if self._standby_table:
            params = {"task_id": task_id, "channel": standby_channel(task_id)}
            connection.execute(self._parking["end_task_standby"], params).all()

    def _wake_after_release(
        self, connection: Connection, released: list[str], dispatch_lease_seconds: float
    ) -> list[Woken]:
        statements = self._parking
        if not released:
            return []
        # Lock the released slots first: a park that counted them full has committed
        # by then, so its waiter is seen here.
        locked = sorted(set(released))
        connection.execute(statements["lock"], {"slots": locked}).all()
        waiting = {_as_text(row[0]) for row in connection.execute(statements["waiting_slots"], {"slots": locked})}
        more = sorted(waiting - set(locked))
        if more:
            locked += [_as_text(row[0]) for row in connection.execute(statements["lock_more"], {"slots": more})]
        if not waiting:
            return []
        return self._dispatch(connection, sorted(locked), dispatch_lease_seconds)

    def _release_and_wake(
        self,
        operation: str,
        slots_of: sa.TextClause,
        delete: sa.TextClause,
        params: dict[str, Any],
        dispatch_lease_seconds: float,
    ) -> tuple[int, list[Woken]]:
        """Delete the leases ``delete`` selects (``slots_of`` lists their slots), then wake
        the waiters of those slots, in one transaction."""

        def release(connection: Connection) -> tuple[int, list[Woken]]:
            slots = [_as_text(row[0]) for row in connection.execute(slots_of, params)]
            deleted = connection.execute(delete, params).rowcount
            if not deleted:
                return 0, []
            return deleted, self._wake_after_release(connection, slots, dispatch_lease_seconds)

        return self._transaction(operation, release, attempts=_ACQUIRE_ATTEMPTS)

    def release_and_wake(self, run_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        if not run_id:
            raise ValueError("run_id must be non-empty")
        if not self._schema_ready:
            self._prepare()
        driver = self._driver_connections() if self._use_release_and_wake_function else None
        if driver is not None:
            # One round trip, whether or not anybody waits for the freed slots.
            rows = self._driver_call(
                "release",
                driver,
                _CALL_RELEASE_AND_WAKE_FUNCTION_DRIVER,
                {"run_id": run_id, "dispatch_lease_seconds": dispatch_lease_seconds},
            ).fetchall()
            woken = [
                Woken(str(task_id), str(woken_run_id), bytes(payload or b""), task_name, bool(standby))
                for _, task_id, woken_run_id, payload, task_name, standby in rows
                if task_id is not None
            ]
            return int(rows[0][0]), woken
        driver = self._driver_connections() if self._use_release_function else None
        if driver is not None:
            # One round trip when nobody waits for the freed slots; else wake them now.
            deleted, waited = self._driver_call(
                "release", driver, _CALL_RELEASE_FUNCTION_DRIVER, {"run_id": run_id}
            ).fetchone()
            if not waited:
                return int(deleted), []
            woken = self._transaction(
                "release",
                lambda connection: self._wake_after_release(connection, list(waited), dispatch_lease_seconds),
                attempts=_ACQUIRE_ATTEMPTS,
            )
            return int(deleted), woken
        return self._release_and_wake(
            "release", self._parking["run_slots"], self._release_run, {"run_id": run_id}, dispatch_lease_seconds
        )

    def release_holder_and_wake(
        self, task_id: str, holder: str, dispatch_lease_seconds: float
    ) -> tuple[int, list[Woken]]:
        params = {"task_id": task_id, "holder": holder}
        return self._release_and_wake(
            "release", self._parking["holder_slots"], self._release_holder, params, dispatch_lease_seconds
        )

    def release_task_and_wake(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        return self._release_and_wake(
            "release", self._parking["task_slots"], self._release_task, {"task_id": task_id}, dispatch_lease_seconds
        )

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        statements = self._parking
        params = {"task_id": task_id, "holder": DISPATCH_HOLDER}

        def forget(connection: Connection) -> tuple[int, list[Woken]]:
            slots = sorted(
                {_as_text(row[0]) for row in connection.execute(statements["task_waiting_slots"], params)}
                | {_as_text(row[0]) for row in connection.execute(statements["holder_slots"], params)}
            )
            if not slots:
                self._end_task_standby(connection, task_id)
                return 0, []
            # The sentinels first, as admission and dispatch lock them: no deadlock with a
            # dispatch marking this very waiter.
            connection.execute(statements["lock"], {"slots": slots}).all()
            removed = connection.execute(statements["delete_waiter"], params).rowcount
            self._end_task_standby(connection, task_id)
            deleted = connection.execute(self._release_holder, params).rowcount
            return removed, (self._wake_after_release(connection, slots, dispatch_lease_seconds) if deleted else [])

        return self._transaction("forget", forget, attempts=_ACQUIRE_ATTEMPTS)

    def claim_dispatch(self, task_id: str, run_id: str, holder: str, lease_seconds: float) -> Claimed:
        params = {"task_id": task_id, "run_id": run_id, "holder": holder, "lease_seconds": lease_seconds}
        driver = self._driver_connections() if self._schema_ready else None
        if driver is not None:
            statement = _CLAIM_DISPATCH_WITH_STANDBY_DRIVER if self._standby_table else _CLAIM_DISPATCH_DRIVER
            leases, behind, elsewhere = self._driver_call("claim", driver, statement, params).fetchone()
            return Claimed(int(leases), bool(behind), bool(elsewhere))
        statements = self._parking

        def claim(connection: Connection) -> Claimed:
            claimed = int(connection.execute(statements["claim"], params).rowcount)
            if not claimed and connection.execute(statements["dispatched_elsewhere"], params).scalar():
                return Claimed(0, dispatched_elsewhere=True)
            connection.execute(statements["delete_waiter"], params)
            return Claimed(claimed)

        return self._transaction("claim", claim, attempts=_ACQUIRE_ATTEMPTS)

    def wake(self, dispatch_lease_seconds: float, slots: Collection[str] | None = None) -> list[Woken]:
        statements = self._parking
        only = None if slots is None else sorted(slots)

        def wake(connection: Connection) -> list[Woken]:
            expired = (
                connection.execute(statements["expired_dispatches"])
                if only is None
                else connection.execute(statements["expired_dispatches_of"], {"slots": only})
            )
            for task_id, dispatch_run_id in expired.all():
                # Unclaimed: the releaser died before publishing or the message was lost.
                connection.execute(statements["undispatch"], {"task_id": task_id, "run_id": dispatch_run_id})
                connection.execute(
                    statements["delete_dispatch_leases"], {"run_id": dispatch_run_id, "holder": DISPATCH_HOLDER}
                )
            waiting = (
                connection.execute(statements["all_waiting_slots"])
                if only is None
                else connection.execute(statements["waiting_slots"], {"slots": only})
            )
            waited = sorted({_as_text(row[0]) for row in waiting})
            if not waited:
                return []
            locked = [_as_text(row[0]) for row in connection.execute(statements["lock"], {"slots": waited})]
            return self._dispatch(connection, sorted(locked), dispatch_lease_seconds)

        return self._transaction("wake", wake, attempts=_ACQUIRE_ATTEMPTS)

    def _mark_waiting(
        self, operation: str, select_ids: sa.TextClause, params: dict[str, Any], hold_seconds: float
    ) -> list[Woken]:
        """Mark the waiting tasks ``select_ids`` lists as being published (one mark for the batch,
        held ``hold_seconds``) and return them, oldest first; ``settle_published`` ends the mark."""
        statements = self._parking
        mark = uuid.uuid4().hex

        def mark_waiting(connection: Connection) -> list[Woken]:
            task_ids = [row[0] for row in connection.execute(select_ids, params)]
            if not task_ids:
                return []
            slots: set[str] = set()
            for start in range(0, len(task_ids), _PRUNE_BATCH):
                batch = task_ids[start : start + _PRUNE_BATCH]
                slots.update(
                    _as_text(row[0]) for row in connection.execute(statements["slots_of_tasks"], {"task_ids": batch})
                )
            # The sentinels first, as a dispatch locks them before it marks its waiters: no deadlock.
            connection.execute(statements["lock"], {"slots": sorted(slots)}).all()
            for start in range(0, len(task_ids), _PRUNE_BATCH):
                batch = task_ids[start : start + _PRUNE_BATCH]
                connection.execute(
                    statements["mark_waiting"], {"mark": mark, "hold_seconds": hold_seconds, "task_ids": batch}
                )
            marked: dict[str, Woken] = {}
            for task_id, payload, task_name in connection.execute(statements["marked"], {"mark": mark}):
                task_id = _as_text(task_id)
                marked.setdefault(task_id, Woken(task_id, mark, bytes(payload), task_name))
            return list(marked.values())

        return self._transaction(operation, mark_waiting, attempts=_ACQUIRE_ATTEMPTS)

    def expire_waiters(self, first_deferred_before: float, hold_seconds: float) -> list[Woken]:
        return self._mark_waiting(
            "expiring waiters", self._parking["expiring_tasks"], {"before": first_deferred_before}, hold_seconds
        )

    def drain(self, slot: str, hold_seconds: float) -> list[Woken]:
        return self._mark_waiting(
            "draining waiters", self._parking["waiting_tasks_of_slot"], {"slot": slot}, hold_seconds
        )

    def settle_published(self, published: Sequence[Woken], failed: Sequence[Woken] = ()) -> int:
        driver = self._driver_connections() if self._schema_ready and len(published) == 1 and not failed else None
        if driver is not None:
            params = {"mark": published[0].run_id, "task_id": published[0].task_id}
            settle_one = _SETTLE_ONE_WITH_STANDBY_DRIVER if self._standby_table else _SETTLE_ONE_DRIVER
            return int(self._driver_call("settling published waiters", driver, settle_one, params).rowcount)
        statements = self._parking
        batches: list[tuple[sa.TextClause, str, list[str]]] = []
        for statement, woken in ((statements["settle_published"], published), (statements["settle_failed"], failed)):
            by_mark: dict[str, list[str]] = defaultdict(list)
            for waiter in woken:
                by_mark[waiter.run_id].append(waiter.task_id)
            for mark, task_ids in by_mark.items():
                for start in range(0, len(task_ids), _PRUNE_BATCH):
                    batches.append((statement, mark, task_ids[start : start + _PRUNE_BATCH]))
        if not batches:
            return 0

        def settle(connection: Connection) -> int:
            deleted = 0
            for statement, mark, task_ids in batches:
                count = connection.execute(statement, {"mark": mark, "task_ids": task_ids}).rowcount
                deleted += count if statement is statements["settle_published"] else 0
            return deleted

        return self._transaction("settling published waiters", settle, attempts=_ACQUIRE_ATTEMPTS)

    def waiters(self, slot: str | None = None) -> list[Waiter]:
        statements = self._parking
        statement, params = (
            (statements["waiters_all"], {}) if slot is None else (statements["waiters_slot"], {"slot": slot})
        )

        def read(connection: Connection) -> list[Waiter]:
            result = []
            positions: dict[str, int] = defaultdict(int)
            for name, task_id, task_name, first, age, dispatch_run_id in connection.execute(statement, params):
                name = _as_text(name)
                positions[name] += 1
                result.append(
                    Waiter(name, _as_text(task_id), task_name, float(first), float(age), positions[name],
                           dispatch_run_id is not None)
                )  # fmt: skip
            return result

        return self._transaction("waiters", read, single_statement=True)

    @property
    def supports_standby(self) -> bool:  # type: ignore[override]
        """PostgreSQL through psycopg (LISTEN/NOTIFY on the hot path's connections), not under
        green threads, with ``concurrency_standby`` and the stand-by function in the schema."""
        if self.dialect != "postgresql":
            return False
        if not self._schema_ready:
            self._prepare()
        return self._standby_table and self._use_stand_by_function and self._driver_connections() is not None

    def stand_by(self, slots: Collection[str], per_slot: int, max_total: int, hold_seconds: float) -> list[Woken]:
        driver = self._driver_connections() if self.supports_standby else None
        if driver is None or per_slot <= 0 or max_total <= 0:
            return []
        params = {
            "slots": sorted(set(slots)),
            "per_slot": per_slot,
            "max_total": max_total,
            "hold_seconds": hold_seconds,
        }
        rows = self._driver_call("stand_by", driver, _CALL_STAND_BY_FUNCTION_DRIVER, params).fetchall()
        return [Woken(str(task_id), str(mark), bytes(payload), task_name) for task_id, mark, payload, task_name in rows]

    def standbys(self) -> list[Standby]:
        if not self.supports_standby:
            return []

        def read(connection: Connection) -> list[Standby]:
            return [
                Standby(_as_text(task_id), holder, run_id is not None, float(expires_in))
                for task_id, holder, run_id, expires_in in connection.execute(self._parking["standbys"])
            ]

        return self._transaction("standbys", read, single_statement=True)

    def await_standby(
        self, task_id: str, mark: str, timeout: float, holder: str | None = None, lease_seconds: float | None = None
    ) -> StandbyDispatch | None:
        driver = self._driver_connections() if self.supports_standby else None
        if driver is None:
            return None
        channel = standby_channel(task_id)
        params = {"task_id": task_id, "mark": mark, "holder": holder, "lease_seconds": lease_seconds}

        def read(row: Any) -> tuple[bool, StandbyDispatch | None]:
            """Whether a standby record (mark, dispatch run id, holder) is this mark's, and the
            dispatch a release took it for."""
            if row is None or row[0] != mark:
                return False, None
            # Claimed for this process only if the release used its own name (another copy's,
            # say of a process that died, is to be claimed like a dispatch: claim checks it).
            claimed = holder is not None and row[2] == holder
            return True, (StandbyDispatch(str(row[1]), claimed=claimed) if row[1] else None)

        def record(connection: Any) -> tuple[bool, StandbyDispatch | None]:
            return read(connection.execute(_STANDBY_RECORD_DRIVER, params).fetchone())

        def wait(connection: Any, registered: Any) -> StandbyDispatch | None:
            waiting = registered[0] == 1
            if not waiting:
                mine, dispatch = read(registered[2:])
                if not mine or dispatch is not None:
                    return dispatch
            # Not past the record's expiry: a release would no longer take it.
            deadline = time.monotonic() + (min(timeout, float(registered[1])) if waiting else 0.0)
            while waiting and (remaining := deadline - time.monotonic()) > 0:
                ended = False
                for note in connection.notifies(timeout=remaining, stop_after=1):
                    note_mark, _, taken = str(note.payload).partition(" ")
                    if note.channel != channel or note_mark != mark:
                        continue
                    run_id, _, how = taken.partition(" ")
                    if run_id:
                        return StandbyDispatch(run_id, claimed=how == "claimed")
                    ended = True  # the mark alone: the task left the waiting list (a revoke)
                if ended:
                    # (Asked once the generator is done: it holds the connection meanwhile.)
                    mine, dispatch = record(connection)
                    if not mine or dispatch is not None:
                        return dispatch
            if connection.execute(_END_STANDBY_DRIVER, params).rowcount == 1:
                return None
            # A release took it just before the end: the record says how.
            return record(connection)[1]

        try:
            return driver.listening(channel, _REGISTER_STANDBY_DRIVER, params, wait)
        except Exception as exc:
            raise StoreError(f"await_standby failed on {self.display_url}: {type(exc).__name__}: {exc}") from exc

    def after_fork(self) -> None:
        # Connections inherited from the parent must not be used (nor closed) here.
        if self._driver is not None:
            self._driver._forget_inherited()
        self._prepare_lock = threading.Lock()  # a thread of the parent may have held it
        self._engine.dispose(close=False)

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()
        if self._owns_engine:
            self._engine.dispose()
