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
time, how many times it was dispatched, and while dispatched the run id and deadline
of its dispatch; a tombstone has ``done_until`` set, keeps its dispatch's run id and, if
a claim made it, the claiming holder).
Parking and waking lock the same sentinels as admission, so each is atomic with it.

Lock order, so that no two steps wait for each other in a circle: lease rows
before the entry they belong to (a claim, a forget and recovery's return of an
expired dispatch take a dispatch's leases, then its entry); a run's lease rows
before sentinels (a release); sentinels in slot order (more of them only with
SKIP LOCKED) before the waiting entries a dispatch or a readmit changes.  Every
change of an entry's state is conditional on the state it was read in (a waiting
entry is dispatched only ``WHERE dispatch_run_id IS NULL``, and so on), so a step
that lost a race to another changes nothing.

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

import json
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
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
    PARK_FULL,
    PARK_LIST_FULL,
    PARK_PARKED,
    PARK_ROOM,
    PARK_WAITING,
    Admission,
    ClaimOutcome,
    HistoryEvent,
    Lease,
    SlotStatus,
    SlotStore,
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
    sa.Column("dispatch_run_id", sa.String(64), nullable=True, comment="set while dispatched, and on tombstones"),
    sa.Column("dispatch_expires_at", sa.Double(), nullable=True, comment="store-clock epoch seconds"),
    sa.Column("dispatches", sa.Integer(), nullable=False, server_default="0", comment="dispatches so far"),
    sa.Column("done_until", sa.Double(), nullable=True, comment="a tombstone until then (store-clock epoch seconds)"),
    sa.Column("claimed_by", sa.String(255), nullable=True, comment="a claim's tombstone: the holder that claimed"),
    sa.Index("ix_concurrency_waiters_task_id", "task_id"),
    sa.Index("ix_concurrency_waiters_order", "slot", "first_deferred_at", "parked_at"),
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
# A task being sent finds room without a lock (the common case) when no slot is full and it has no
# entry in the waiting list: the admission count, and a row (slot NULL) per entry row of the task.
_ROOM_NOW = (
    _COUNT_LIVE
    + " UNION ALL SELECT NULL, 1, 1 FROM concurrency_waiters WHERE task_id = :task_id AND done_until IS NULL"
)
# An upsert: a run admitted again to a slot whose lease it let expire (not swept
# yet) replaces that row rather than colliding with its primary key.
_INSERT_LEASES = {
    "postgresql": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at) "
        "VALUES {values} ON CONFLICT (run_id, slot) DO UPDATE SET task_id = EXCLUDED.task_id, "
        "holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at, task_name = EXCLUDED.task_name, "
        "acquired_at = EXCLUDED.acquired_at"
    ),
    "mysql": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at) "
        "VALUES {values} ON DUPLICATE KEY UPDATE task_id = VALUES(task_id), holder = VALUES(holder), "
        "expires_at = VALUES(expires_at), task_name = VALUES(task_name), acquired_at = VALUES(acquired_at)"
    ),
    "sqlite": (
        "INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at) "
        "VALUES {values} ON CONFLICT (run_id, slot) DO UPDATE SET task_id = excluded.task_id, "
        "holder = excluded.holder, expires_at = excluded.expires_at, task_name = excluded.task_name, "
        "acquired_at = excluded.acquired_at"
    ),
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
_SWEEP_TOMBSTONES = "DELETE FROM concurrency_waiters WHERE done_until <= {now}"
_STATUS = (
    "SELECT s.slot, s.slot_limit, "
    "(SELECT COUNT(DISTINCT l.task_id) FROM concurrency_slots l WHERE l.slot = s.slot AND l.expires_at > {now}), "
    "(SELECT COUNT(*) FROM concurrency_slots l WHERE l.slot = s.slot AND l.expires_at <= {now}) "
    "FROM concurrency_slots s WHERE s.run_id = '' ORDER BY s.slot"
)
_LEASES = (
    "SELECT slot, task_id, run_id, holder, expires_at - {now}, task_name, {now} - acquired_at "
    "FROM concurrency_slots WHERE run_id <> '' {slot_filter} ORDER BY slot, expires_at"
)
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
# count runs after the locks are granted.
POSTGRESQL_ACQUIRE_FUNCTION = "concurrency_slots_acquire"
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
#: Waiter rows read per batch when a release looks for waiters to dispatch.
_WAITING_BATCH = 64
# The settings of the hot-path functions.  PL/pgSQL plans each statement for the values of its
# first calls, then keeps re-planning ("custom plans") while a generic plan is not estimated
# cheaper; these statements are key lookups whose best plan never depends on the values, and
# re-planning a dozen of them costs more than running them.  A generic plan is made once per
# session, though, from the statistics of that moment: a waiting list analysed while empty would
# be scanned whole, and sorted, for ever after.  So no sequential or bitmap scan and no full sort
# where an index gives the rows in order: every statement here is an index lookup.  And no JIT:
# those disabled plans look expensive enough to be compiled, which costs far more than the call.
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
# disk (synchronous_commit off for its transaction only; admission, park, claim and renew stay
# durable).  The flush is most of a commit's wait after the connection sat idle through a task.
# A database crash can lose the last fraction of a second of such commits, never a parked task:
# a lost release leaves its lease to expire (fewer admissions, never more), a lost hand-over
# leaves its waiter in the list to be handed over again (its task may then run twice, as one
# task id: at-least-once).
_RELEASE_COMMITS_ASYNCHRONOUSLY = "    PERFORM set_config('synchronous_commit', 'off', true);"
# A run's release and the wake of the waiters its slots can now admit, in one round trip: the
# steps of the generic release-and-wake transaction (``_release_and_wake`` with
# ``_wake_after_release`` and ``_dispatch``) in a function.  Delete the run's leases; lock the
# freed slots' sentinels, then (SKIP LOCKED: no lock-order deadlock) those of the other slots
# their waiters need; walk the waiters of the locked slots in their order (first deferral, park
# time, task id), streaming, and dispatch each that waits for a freed slot and whose every slot
# is locked and has room (and still waits: a readmit or a forget may have taken it since the walk
# began); stop once every slot seen is full.  Every statement takes a fresh READ COMMITTED
# snapshot, so counts run after the locks are granted.  One row per woken waiter (o_task_id NULL
# when none), each with the number of leases deleted.
POSTGRESQL_RELEASE_AND_WAKE_FUNCTION = "concurrency_slots_release_and_wake"
POSTGRESQL_RELEASE_AND_WAKE_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_RELEASE_AND_WAKE_FUNCTION}(p_run_id text, p_dispatch_lease_seconds double precision)
RETURNS TABLE (
    o_deleted integer, o_task_id text, o_run_id text, o_payload bytea, o_task_name text
) LANGUAGE plpgsql VOLATILE {_GENERIC_PLANS} AS $$
DECLARE
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
    -- closes the last waiter.  (A tombstone keeps its dispatch's run id: never read here.)
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
            -- Waiter v_task is complete: dispatch it if it waits for a released slot, all its
            -- slots are locked here and each has room (or is held by it already); a waiter
            -- passed over keeps its place.
            -- v_full: slots found full in this walk (only dispatches add leases while their
            -- sentinels are locked), so a waiter needing one is passed over without a count.
            IF cardinality(v_slots) = v_count AND v_slots && v_released AND NOT (v_slots && v_full) THEN
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
            IF cardinality(v_slots) = v_count AND v_slots && v_released AND NOT (v_slots && v_full) THEN
                o_run_id := md5(random()::text || clock_timestamp()::text || v_task);
                -- The entry answers for the task until a copy claims it (or the deadline passes).
                UPDATE concurrency_waiters w SET dispatch_run_id = o_run_id,
                    dispatch_expires_at = v_now + p_dispatch_lease_seconds, dispatches = w.dispatches + 1
                WHERE w.task_id = v_task AND w.dispatch_run_id IS NULL;
                IF FOUND THEN
                    o_task_id := v_task;
                    o_task_name := v_name;
                    INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at)
                    SELECT o_run_id, u.slot, v_task, '{DISPATCH_HOLDER}', v_now + p_dispatch_lease_seconds, v_name,
                        v_now
                    FROM unnest(v_slots) AS u(slot);
                    SELECT w.payload INTO o_payload FROM concurrency_waiters w WHERE w.task_id = v_task LIMIT 1;
                    v_any := true;
                    RETURN NEXT;
                    -- The slots this dispatch filled.
                    v_full := v_full || v_full_after;
                END IF;
            END IF;
            -- Stop once every released slot is known full: the room this release freed is
            -- handed out (other slots gain room only by their own releases, or by expiry,
            -- which recovery serves).
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
        RETURN NEXT;
    END IF;
END $$
"""
# Park (the park strategy's admission) in one round trip, in SlotStore.park's order: lock the
# sentinels; the task's entry, waiting or dispatched, answers for it ('waiting'); admission's
# count and leases ('admitted', or 'room' with p_admit false); without a payload, 'full'; a slot
# whose list holds p_max_waiters entries, 'waitlist_full'; else the task's tombstone (if any)
# gives way to its waiting entry, which keeps its count of dispatches, one row per slot at the
# store's clock ('parked').
POSTGRESQL_PARK_FUNCTION = "concurrency_slots_park"
POSTGRESQL_PARK_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_PARK_FUNCTION}(
    p_slots text[], p_limits integer[], p_task_id text, p_run_id text, p_holder text,
    p_lease_seconds double precision, p_task_name text, p_payload bytea,
    p_first_deferred_at double precision, p_max_waiters integer, p_admit boolean
) RETURNS text LANGUAGE plpgsql VOLATILE {_GENERIC_PLANS} AS $$
DECLARE
    v_full text[];
    v_now double precision;
    v_dispatches integer;
BEGIN
{_PG_LOCK_SENTINELS}
    IF EXISTS (SELECT 1 FROM concurrency_waiters w WHERE w.task_id = p_task_id AND w.done_until IS NULL) THEN
        RETURN '{PARK_WAITING}';
    END IF;
{_PG_FULL_SLOTS}
    IF cardinality(v_full) = 0 THEN
        IF NOT p_admit THEN
            RETURN '{PARK_ROOM}';
        END IF;
{_PG_INSERT_LEASES}        RETURN '{PARK_ADMITTED}';
    END IF;
    IF p_payload IS NULL THEN
        RETURN '{PARK_FULL}';
    END IF;
    IF EXISTS (
        SELECT 1 FROM unnest(p_slots) AS u(slot)
        WHERE (SELECT count(*) FROM (
                  SELECT 1 FROM concurrency_waiters w
                  WHERE w.slot = u.slot AND w.done_until IS NULL LIMIT p_max_waiters) n
              ) >= p_max_waiters)
    THEN
        RETURN '{PARK_LIST_FULL}';
    END IF;
    WITH gone AS (
        DELETE FROM concurrency_waiters w WHERE w.task_id = p_task_id AND w.done_until IS NOT NULL
        RETURNING w.dispatches)
    SELECT coalesce(max(gone.dispatches), 0) INTO v_dispatches FROM gone;
    INSERT INTO concurrency_waiters
        (slot, task_id, slot_limit, slot_count, first_deferred_at, parked_at, task_name, payload, dispatches)
    SELECT u.slot, p_task_id, u.slot_limit, cardinality(p_slots), p_first_deferred_at, v_now, p_task_name, p_payload,
        v_dispatches
    FROM unnest(p_slots, p_limits) AS u(slot, slot_limit);
    RETURN '{PARK_PARKED}';
END $$
"""
_CALL_PARK_FUNCTION_DRIVER = (
    f"SELECT {POSTGRESQL_PARK_FUNCTION}(%(slots)s, %(limits)s, %(task_id)s, %(run_id)s, %(holder)s, "
    "%(lease_seconds)s, %(task_name)s, %(payload)s, %(first_deferred_at)s, %(max_waiters)s, %(admit)s)"
)
# An entry dispatched to the claiming run leaves the list: a tombstone of p_holder's claim until
# p_done_seconds from now if it was dispatched {minimum} times or more (copies of its other
# dispatches may be on their way; 0: always), else deleted.  (Over p_task_id, p_run_id, p_holder,
# p_done_seconds and v_now.)
_PG_SETTLE = """
    UPDATE concurrency_waiters w SET done_until = v_now + p_done_seconds, claimed_by = p_holder
    WHERE w.task_id = p_task_id AND w.dispatch_run_id = p_run_id AND w.done_until IS NULL
        AND w.dispatches >= {minimum};
    DELETE FROM concurrency_waiters w
    WHERE w.task_id = p_task_id AND w.dispatch_run_id = p_run_id AND w.done_until IS NULL
        AND w.dispatches < {minimum};
"""
# A copy's claim in one round trip, SlotStore.claim's decision: lock the task's leases of the
# dispatch run, then read them by the store's clock.  All live, and each a dispatch lease or
# p_holder's (the same claim again, after its reply was lost): they become (stay) the run's, the
# entry settles ('run').  A live lease held by another run: another copy claimed first ('admit'
# if redelivered, else 'end').  Otherwise what is left of the dispatch's leases goes, and the
# task's entry (locked) decides.
POSTGRESQL_CLAIM_FUNCTION = "concurrency_slots_claim"
POSTGRESQL_CLAIM_FUNCTION_DDL = f"""
CREATE FUNCTION {POSTGRESQL_CLAIM_FUNCTION}(
    p_task_id text, p_run_id text, p_holder text, p_lease_seconds double precision, p_redelivered boolean,
    p_done_seconds double precision
) RETURNS text LANGUAGE plpgsql VOLATILE {_GENERIC_PLANS} AS $$
DECLARE
    v_now double precision;
    v_leases integer;
    v_live integer;
    v_live_dispatch integer;
    v_live_claimable integer;
    v_dispatch text;
    v_done boolean;
    v_claimed_by text;
BEGIN
    PERFORM 1 FROM concurrency_slots c WHERE c.run_id = p_run_id AND c.task_id = p_task_id FOR UPDATE;
    v_now := {_NOW["postgresql"]};
    SELECT count(*), count(*) FILTER (WHERE c.expires_at > v_now),
        count(*) FILTER (WHERE c.expires_at > v_now AND c.holder = '{DISPATCH_HOLDER}'),
        count(*) FILTER (WHERE c.expires_at > v_now AND c.holder IN ('{DISPATCH_HOLDER}', p_holder))
    INTO v_leases, v_live, v_live_dispatch, v_live_claimable
    FROM concurrency_slots c WHERE c.run_id = p_run_id AND c.task_id = p_task_id;
    IF v_live > 0 AND v_live = v_leases AND v_live_claimable = v_live THEN
        UPDATE concurrency_slots c SET holder = p_holder, expires_at = v_now + p_lease_seconds
        WHERE c.run_id = p_run_id AND c.task_id = p_task_id;
{_PG_SETTLE.format(minimum=2)}
        RETURN '{ClaimOutcome.RUN.value}';
    END IF;
    IF v_live > v_live_dispatch THEN
        RETURN CASE WHEN p_redelivered THEN '{ClaimOutcome.ADMIT.value}' ELSE '{ClaimOutcome.END.value}' END;
    END IF;
    DELETE FROM concurrency_slots c
    WHERE c.run_id = p_run_id AND c.task_id = p_task_id AND c.holder = '{DISPATCH_HOLDER}';
    PERFORM 1 FROM concurrency_waiters w WHERE w.task_id = p_task_id FOR UPDATE;
    SELECT w.dispatch_run_id, w.done_until IS NOT NULL, w.claimed_by INTO v_dispatch, v_done, v_claimed_by
    FROM concurrency_waiters w WHERE w.task_id = p_task_id LIMIT 1;
    IF NOT FOUND THEN
        RETURN '{ClaimOutcome.ADMIT.value}';
    END IF;
    IF v_done THEN
        -- This very claim's tombstone: the claim retried, its leases expired meanwhile.
        RETURN CASE WHEN p_redelivered OR (v_dispatch = p_run_id AND v_claimed_by = p_holder)
            THEN '{ClaimOutcome.ADMIT.value}' ELSE '{ClaimOutcome.END.value}' END;
    END IF;
    IF v_dispatch IS DISTINCT FROM p_run_id THEN
        RETURN '{ClaimOutcome.END.value}';
    END IF;
    -- No lease is left to tell a duplicate copy of this dispatch that the task was taken: the
    -- tombstone does.
{_PG_SETTLE.format(minimum=0)}
    RETURN '{ClaimOutcome.ADMIT.value}';
END $$
"""
_CALL_CLAIM_FUNCTION_DRIVER = (
    f"SELECT {POSTGRESQL_CLAIM_FUNCTION}(%(task_id)s, %(run_id)s, %(holder)s, %(lease_seconds)s, "
    "%(redelivered)s, %(done_seconds)s)"
)
_CALL_RELEASE_AND_WAKE_FUNCTION_DRIVER = (
    "SELECT o_deleted, o_task_id, o_run_id, o_payload, o_task_name "
    f"FROM {POSTGRESQL_RELEASE_AND_WAKE_FUNCTION}(%(run_id)s, %(dispatch_lease_seconds)s)"
)
_CALL_ACQUIRE_FUNCTION = (
    f"SELECT {POSTGRESQL_ACQUIRE_FUNCTION}(:slots, :limits, :task_id, :run_id, :holder, :lease_seconds, :task_name)"
)
#: The functions the store creates, and their definitions.
_POSTGRESQL_FUNCTIONS = {
    POSTGRESQL_ACQUIRE_FUNCTION: POSTGRESQL_FUNCTION_DDL,
    POSTGRESQL_RELEASE_AND_WAKE_FUNCTION: POSTGRESQL_RELEASE_AND_WAKE_FUNCTION_DDL,
    POSTGRESQL_PARK_FUNCTION: POSTGRESQL_PARK_FUNCTION_DDL,
    POSTGRESQL_CLAIM_FUNCTION: POSTGRESQL_CLAIM_FUNCTION_DDL,
}
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
# States, by column: waiting (dispatch_run_id NULL), dispatched (dispatch_run_id set, done_until
# NULL), tombstone (done_until set; it keeps its dispatch's run id, so "dispatch_run_id IS NULL"
# alone selects the waiting).  ``{of_slots}`` narrows a statement to the entries that wait for
# one of :slots (recovery of some slots).
_OF_SLOTS = " AND task_id IN (SELECT task_id FROM concurrency_waiters WHERE slot IN :slots)"
# Sentinels of slots that already have one: lock them in slot order (SQLite: BEGIN
# IMMEDIATE holds the write lock already).
_LOCK_EXISTING_SENTINELS = "SELECT slot FROM concurrency_slots WHERE run_id = '' AND slot IN :slots ORDER BY slot"
_TASK_LISTED = "SELECT 1 FROM concurrency_waiters WHERE task_id = :task_id AND done_until IS NULL"
# Entries (waiting or dispatched, not tombstones) per slot of :slots.
_LISTED_PER_SLOT = (
    "SELECT slot, COUNT(*) FROM concurrency_waiters WHERE slot IN :slots AND done_until IS NULL GROUP BY slot"
)
# A task parking again: its tombstone gives way, and its count of dispatches lives on.
_TOMBSTONE_DISPATCHES = "SELECT dispatches FROM concurrency_waiters WHERE task_id = :task_id AND done_until IS NOT NULL"
_DELETE_TOMBSTONE = "DELETE FROM concurrency_waiters WHERE task_id = :task_id AND done_until IS NOT NULL"
# A task's entry: every row has the same state.
_ENTRY = (
    "SELECT dispatch_run_id, done_until, claimed_by, slot FROM concurrency_waiters WHERE task_id = :task_id "
    "ORDER BY slot"
)
_RUN_SLOTS = "SELECT slot FROM concurrency_slots WHERE run_id = :run_id"
_HOLDER_SLOTS = "SELECT slot FROM concurrency_slots WHERE task_id = :task_id AND holder = :holder AND run_id <> ''"
_TASK_SLOTS = "SELECT slot FROM concurrency_slots WHERE task_id = :task_id AND run_id <> ''"
# The listed slots of one cap (recovery of some caps): the slot named like it, and its keys'.
_CAP_SLOTS = (
    "SELECT DISTINCT slot FROM concurrency_waiters WHERE done_until IS NULL "
    "AND (slot = :cap OR slot LIKE :pattern ESCAPE '/')"
)
# Every slot of every listed entry (waiting or dispatched) that waits for one of :slots.
_LISTED_SLOTS = (
    "SELECT DISTINCT slot FROM concurrency_waiters WHERE done_until IS NULL AND task_id IN "
    "(SELECT task_id FROM concurrency_waiters WHERE slot IN :slots AND done_until IS NULL)"
)
# Every slot of every waiting task that waits for one of :slots (to lock them all, in order).
_WAITING_SLOTS = (
    "SELECT DISTINCT slot FROM concurrency_waiters WHERE task_id IN "
    "(SELECT task_id FROM concurrency_waiters WHERE slot IN :slots AND dispatch_run_id IS NULL)"
)
# The slots (of :slots, or any) with waiting entries where a waiter may fit: fewer live holders
# than the highest limit its waiters were parked with (read without locks: recovery locks these).
_SLOTS_WITH_ROOM = (
    "SELECT w.slot FROM concurrency_waiters w WHERE w.dispatch_run_id IS NULL {slot_filter} GROUP BY w.slot "
    "HAVING (SELECT COUNT(DISTINCT c.task_id) FROM concurrency_slots c "
    "WHERE c.slot = w.slot AND c.expires_at > {now}) < MAX(w.slot_limit)"
)
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
# A dispatch (with or without leases), only of an entry that still waits.
_MARK_DISPATCHED = (
    "UPDATE concurrency_waiters SET dispatch_run_id = :run_id, dispatch_expires_at = {now} + :lease_seconds, "
    "dispatches = dispatches + 1 WHERE task_id = :task_id AND dispatch_run_id IS NULL"
)
_WAITER_PAYLOADS = "SELECT task_id, payload, task_name FROM concurrency_waiters WHERE task_id IN :task_ids"
# The claim (see POSTGRESQL_CLAIM_FUNCTION_DDL for the same steps in one round trip): the task's
# leases of the dispatch run, and whether each is live.
_CLAIM_LEASES = (
    "SELECT holder, CASE WHEN expires_at > {now} THEN 1 ELSE 0 END FROM concurrency_slots "
    "WHERE run_id = :run_id AND task_id = :task_id"
)
_CLAIM = (
    "UPDATE concurrency_slots SET holder = :holder, expires_at = {now} + :lease_seconds "
    "WHERE run_id = :run_id AND task_id = :task_id"
)
# (:minimum: the dispatches from which a claimed entry leaves a tombstone; 0: always.)
_SETTLE_TOMBSTONE = (
    "UPDATE concurrency_waiters SET done_until = {now} + :done_seconds, claimed_by = :holder WHERE task_id = :task_id "
    "AND dispatch_run_id = :run_id AND done_until IS NULL AND dispatches >= :minimum"
)
_SETTLE_DELETE = (
    "DELETE FROM concurrency_waiters WHERE task_id = :task_id AND dispatch_run_id = :run_id "
    "AND done_until IS NULL AND dispatches < :minimum"
)
_DELETE_WAITING = "DELETE FROM concurrency_waiters WHERE task_id = :task_id AND dispatch_run_id IS NULL"
_TOMBSTONE = (
    "UPDATE concurrency_waiters SET done_until = {now} + :done_seconds "
    "WHERE task_id = :task_id AND dispatch_run_id = :run_id AND done_until IS NULL"
)
_EXPIRED_DISPATCHES = (
    "SELECT DISTINCT task_id, dispatch_run_id FROM concurrency_waiters "
    "WHERE dispatch_expires_at <= {now} AND done_until IS NULL {of_slots} ORDER BY task_id"
)
_UNDISPATCH = (
    "UPDATE concurrency_waiters SET dispatch_run_id = NULL, dispatch_expires_at = NULL "
    "WHERE task_id = :task_id AND dispatch_run_id = :run_id AND done_until IS NULL"
)
# A dispatch's leases, never a run's (a claimed lease's holder is its run's).
_DELETE_DISPATCH_LEASES = (
    "DELETE FROM concurrency_slots WHERE run_id = :run_id AND task_id = :task_id AND holder = :holder"
)
# Waiting entries to dispatch without leases, oldest first: first deferred before :before, or of :slot.
_OVERDUE = (
    "SELECT DISTINCT task_id, first_deferred_at, parked_at FROM concurrency_waiters "
    "WHERE dispatch_run_id IS NULL AND first_deferred_at < :before {of_slots} "
    "ORDER BY first_deferred_at, parked_at, task_id"
)
_WAITING_OF_SLOT = (
    "SELECT DISTINCT task_id, first_deferred_at, parked_at FROM concurrency_waiters "
    "WHERE slot = :slot AND dispatch_run_id IS NULL ORDER BY first_deferred_at, parked_at, task_id"
)
_SLOTS_OF_TASKS = "SELECT DISTINCT slot FROM concurrency_waiters WHERE task_id IN :task_ids"
# Prune keeps the slots parked tasks wait for (waiting or dispatched), and takes the tombstones
# of the slots it deletes with them.
_PRUNE_WAITED = "SELECT DISTINCT slot FROM concurrency_waiters WHERE slot IN :slots AND done_until IS NULL"
_PRUNE_TOMBSTONES = "SELECT DISTINCT task_id FROM concurrency_waiters WHERE slot IN :slots AND done_until IS NOT NULL"
_DELETE_TOMBSTONES = "DELETE FROM concurrency_waiters WHERE task_id IN :task_ids AND done_until IS NOT NULL"
_WAITERS_LIST = (
    "SELECT slot, task_id, task_name, first_deferred_at, {now} - parked_at, dispatch_run_id "
    "FROM concurrency_waiters WHERE done_until IS NULL {slot_filter} "
    "ORDER BY slot, first_deferred_at, parked_at, task_id"
)


#: The slot names a warm-up rehearses the hot path on (in a transaction rolled back: never seen).
WARM_UP_SLOT_PREFIX = "celery-caps-warm-up:"


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
#: Reads of a task's entry by ``forget`` while other steps keep changing it.
_FORGET_ATTEMPTS = 5
_SCHEMA_ATTEMPTS = 5

_T = TypeVar("_T")


def _as_text(value: Any) -> str:
    """Name columns come back as bytes from MySQL's VARBINARY."""
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else value


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``/``) matching the names that start with ``prefix``."""
    return prefix.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"


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
        for fairy in open_connections:
            try:
                fairy.invalidate()
            except Exception:
                logger.debug("closing a store connection failed", exc_info=True)
        self._local = threading.local()


#: Driver connections a forked process inherited: kept, never used or closed.
_INHERITED_CONNECTIONS: list[Any] = []


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
        # PostgreSQL: which functions the hot path calls (known after _prepare; without one, its
        # step runs as the generic transaction).
        self._use_acquire_function = False
        self._use_release_and_wake_function = False
        self._use_park_function = False
        self._use_claim_function = False
        self._driver: _DriverConnections | None = None
        now = _NOW[self.dialect]
        self._now = now
        self._lock_statements: dict[int, sa.TextClause] = {}
        self._count_statements: dict[int, sa.TextClause] = {}
        self._room_statements: dict[int, sa.TextClause] = {}
        self._insert_statements: dict[int, sa.TextClause] = {}
        self._insert_template = _INSERT_LEASES[self.dialect]
        self._insert_row = f"(:run_id, :s{{i}}, :task_id, :holder, {now} + :lease_seconds, :task_name, {now})"
        run_ids: sa.BindParameter[list[str]] = sa.bindparam("run_ids", expanding=True)
        self._renew = sa.text(_RENEW.format(now=now)).bindparams(run_ids)
        self._renewed = sa.text(_RENEWED.format(now=now)).bindparams(run_ids)
        self._renew_returning = sa.text(_RENEW_RETURNING.format(now=now)).bindparams(run_ids)
        self._call_acquire_function = sa.text(_CALL_ACQUIRE_FUNCTION)
        self._release_run = sa.text(_RELEASE_RUN)
        self._release_holder = sa.text(_RELEASE_HOLDER)
        self._release_task = sa.text(_RELEASE_TASK)
        self._sweep = sa.text(_SWEEP.format(now=now))
        self._sweep_tombstones = sa.text(_SWEEP_TOMBSTONES.format(now=now))
        self._status = sa.text(_STATUS.format(now=now))
        self._all_leases = sa.text(_LEASES.format(now=now, slot_filter=""))
        self._slot_leases = sa.text(_LEASES.format(now=now, slot_filter="AND slot = :slot"))
        self._prune_candidates = sa.text(_PRUNE_CANDIDATES)
        # SQLite has no FOR UPDATE: BEGIN IMMEDIATE already holds the write lock.
        self._prune_locked_candidates = sa.text(_PRUNE_CANDIDATES + ("" if self.dialect == "sqlite" else " FOR UPDATE"))
        self._prune_live = sa.text(_PRUNE_LIVE.format(now=now)).bindparams(sa.bindparam("slots", expanding=True))
        self._prune_delete = sa.text(_PRUNE_DELETE).bindparams(sa.bindparam("slots", expanding=True))
        self._parking = self._parking_statements()

    def _parking_statements(self) -> dict[str, sa.TextClause]:
        """The waiting-list statements, with expanding lists bound."""
        # SQLite has no FOR UPDATE: BEGIN IMMEDIATE already holds the write lock.
        for_update = "" if self.dialect == "sqlite" else " FOR UPDATE"
        templates = {
            "lock": _LOCK_EXISTING_SENTINELS + for_update,
            # Slots beyond those a release already locked: take what is free, never wait
            # (waiting out of slot order could deadlock); a waiter needing a skipped slot
            # is passed over this time and dispatched by a later release or by recovery.
            "lock_more": _LOCK_EXISTING_SENTINELS + ("" if self.dialect == "sqlite" else " FOR UPDATE SKIP LOCKED"),
            "task_listed": _TASK_LISTED,
            "listed_per_slot": _LISTED_PER_SLOT,
            "tombstone_dispatches": _TOMBSTONE_DISPATCHES,
            "delete_tombstone": _DELETE_TOMBSTONE,
            "entry": _ENTRY,
            "lock_entry": _ENTRY + for_update,
            "run_slots": _RUN_SLOTS,
            "holder_slots": _HOLDER_SLOTS,
            "task_slots": _TASK_SLOTS,
            "waiting_slots": _WAITING_SLOTS,
            "cap_slots": _CAP_SLOTS,
            "listed_slots": _LISTED_SLOTS,
            "slots_with_room": _SLOTS_WITH_ROOM.replace("{slot_filter}", "AND w.slot IN :slots"),
            "all_slots_with_room": _SLOTS_WITH_ROOM.replace("{slot_filter}", ""),
            "waiting_rows": _WAITING_ROWS,
            "live": _LIVE_HOLDERS,
            "mark_dispatched": _MARK_DISPATCHED,
            "payloads": _WAITER_PAYLOADS,
            "claim_leases": _CLAIM_LEASES + for_update,
            "claim": _CLAIM,
            "settle_tombstone": _SETTLE_TOMBSTONE,
            "settle_delete": _SETTLE_DELETE,
            "delete_waiting": _DELETE_WAITING,
            "tombstone": _TOMBSTONE,
            "expired_dispatches": _EXPIRED_DISPATCHES.replace("{of_slots}", ""),
            "expired_dispatches_of": _EXPIRED_DISPATCHES.replace("{of_slots}", _OF_SLOTS),
            "undispatch": _UNDISPATCH,
            "delete_dispatch_leases": _DELETE_DISPATCH_LEASES,
            "overdue": _OVERDUE.replace("{of_slots}", ""),
            "overdue_of": _OVERDUE.replace("{of_slots}", _OF_SLOTS),
            "waiting_of_slot": _WAITING_OF_SLOT,
            "slots_of_tasks": _SLOTS_OF_TASKS,
            "prune_waited": _PRUNE_WAITED,
            "prune_tombstones": _PRUNE_TOMBSTONES,
            "delete_tombstones": _DELETE_TOMBSTONES,
            "waiters_all": _WAITERS_LIST.replace("{slot_filter}", ""),
            "waiters_slot": _WAITERS_LIST.replace("{slot_filter}", "AND slot = :slot"),
        }
        statements = {}
        for name, template in templates.items():
            statement = sa.text(template.format(now=self._now))
            for expanding in ("slots", "task_ids"):
                if f":{expanding}" in template:
                    statement = statement.bindparams(sa.bindparam(expanding, expanding=True))
            statements[name] = statement
        return statements

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
        """Create the tables, their indexes and (PostgreSQL) the functions if missing."""
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
        if self.dialect == "postgresql":
            try:
                for function, ddl in _POSTGRESQL_FUNCTIONS.items():
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
                raise self._wrap("creating the store's functions", exc) from exc

    def _prepare(self) -> None:
        """First use in this process: create the schema if asked, pick the PostgreSQL functions."""
        with self._prepare_lock:
            if not self._schema_ready:
                self._prepare_once()

    def _prepare_once(self) -> None:
        if self._create_schema:
            self.create_schema()
        if self.dialect == "postgresql":
            try:
                present_query = sa.text(_FUNCTIONS_PRESENT).bindparams(sa.bindparam("names", expanding=True))
                with self._engine.connect() as connection:
                    present = {
                        row[0] for row in connection.execute(present_query, {"names": list(_POSTGRESQL_FUNCTIONS)})
                    }
            except sa.exc.SQLAlchemyError as exc:
                raise self._wrap("checking the schema", exc) from exc
            self._use_acquire_function = POSTGRESQL_ACQUIRE_FUNCTION in present
            self._use_release_and_wake_function = POSTGRESQL_RELEASE_AND_WAKE_FUNCTION in present
            self._use_park_function = POSTGRESQL_PARK_FUNCTION in present
            self._use_claim_function = POSTGRESQL_CLAIM_FUNCTION in present
            missing = sorted(set(_POSTGRESQL_FUNCTIONS) - present)
            if missing:
                logger.info(
                    "%s missing (caps_create_schema is off): their steps run as transactions of several "
                    "statements instead; create them from the store's POSTGRESQL_*_DDL for one round trip each",
                    ", ".join(f"{name}()" for name in missing),
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
        self._lock_sentinels(connection, slots, params)
        return self._full_slots(connection, slots, params)

    def _lock_sentinels(self, connection: Connection, slots: Mapping[str, int], params: dict[str, Any]) -> None:
        """Lock the slots' sentinels, in slot order, creating missing ones (recording the limits)."""
        lock = self._statement(
            self._lock_statements, _LOCK_SENTINELS[self.dialect], len(slots), "('', :s{i}, '', '', :l{i})"
        )
        connection.execute(lock, params)

    def _full_slots(self, connection: Connection, slots: Mapping[str, int], params: dict[str, Any]) -> list[str]:
        """Count live holders (in a statement after the locks): the full slots, sorted."""
        count_live = self._statement(self._count_statements, _COUNT_LIVE, len(slots), "")
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
        """A task's store calls, each path of them once, on a slot of its own (the caller rolls
        it all back, on ``driver``'s connection): admission; with parking, a park (new and
        again), the release that hands the slot over, the claims of that dispatch (by its copy,
        by a second copy) and of an unknown one, and a release with nobody waiting."""
        functions = (self._use_park_function, self._use_release_and_wake_function, self._use_claim_function)
        if not self._use_acquire_function:
            return  # admission runs in pooled transactions of its own, which would commit
        slot = f"{WARM_UP_SLOT_PREFIX}{uuid.uuid4().hex}"
        slots = {slot: 1}
        holder, lease = "celery-caps-warm-up", 60.0
        first_task, first_run, waiter_task, waiter_run, other_task, other_run = (uuid.uuid4().hex for _ in range(6))
        if not self.acquire(slots, first_task, first_run, holder, lease).granted:
            return  # (cannot happen: nobody else sees this slot)
        if not all(functions):
            self.release(first_run)
            return
        for _ in range(2):  # parked, then waiting already
            self.park(
                slots, waiter_task, waiter_run, holder, lease, payload=b"", first_deferred_at=time.time(),
                max_waiters=10,
            )  # fmt: skip
        _deleted, woken = self.release_and_wake(first_run, lease)
        for waiter in woken:
            for _ in range(2):  # run, then end (another copy runs it)
                self.claim(waiter.task_id, waiter.run_id, holder, lease)
            self.claim(other_task, other_run, holder, lease)
            self.release_and_wake(waiter.run_id, lease)

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
        def sweep(connection: Connection) -> int:
            deleted = int(connection.execute(self._sweep).rowcount)
            connection.execute(self._sweep_tombstones)
            return deleted

        return self._transaction("sweep", sweep)

    def status(self) -> list[SlotStatus]:
        def read(connection: Connection) -> list[SlotStatus]:
            return [
                SlotStatus(_as_text(slot), limit, int(holders), int(expired))
                for slot, limit, holders, expired in connection.execute(self._status)
            ]

        return self._transaction("status", read, single_statement=True)

    def leases(self, slot: str | None = None) -> list[Lease]:
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
        # MySQL's name columns are VARBINARY: match bytes.
        pattern = self._exact(_like_prefix(prefix))
        candidates = self._prune_candidates if dry_run else self._prune_locked_candidates
        statements = self._parking

        def prune(connection: Connection) -> list[str]:
            slots = [row[0] for row in connection.execute(candidates, {"pattern": pattern})]
            held: set[Any] = set()
            for start in range(0, len(slots), _PRUNE_BATCH):
                batch = slots[start : start + _PRUNE_BATCH]
                held.update(row[0] for row in connection.execute(self._prune_live, {"slots": batch}))
                held.update(row[0] for row in connection.execute(statements["prune_waited"], {"slots": batch}))
            doomed = [slot for slot in slots if slot not in held]
            if not dry_run:
                for start in range(0, len(doomed), _PRUNE_BATCH):
                    batch = doomed[start : start + _PRUNE_BATCH]
                    connection.execute(self._prune_delete, {"slots": batch})
                    # A tombstone of a task that needed a pruned slot goes whole.
                    tombstones = self._names(connection, "prune_tombstones", "slots", batch)
                    if tombstones:
                        connection.execute(statements["delete_tombstones"], {"task_ids": sorted(tombstones)})
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
        payload: bytes | None,
        first_deferred_at: float,
        max_waiters: int,
        task_name: str | None = None,
        admit: bool = True,
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
        if not admit and self._room_now(slots, params):
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
            return str(self._driver_call("park", driver, _CALL_PARK_FUNCTION_DRIVER, call).fetchone()[0])

        def park(connection: Connection) -> str:
            # The same locks as acquire, then (read after them) the task's entry and the room:
            # parking is atomic with admission.
            self._lock_sentinels(connection, slots, params)
            if connection.execute(statements["task_listed"], params).first() is not None:
                return PARK_WAITING
            if not self._full_slots(connection, slots, params):
                if not admit:
                    return PARK_ROOM
                self._insert_leases(connection, count, params)
                return PARK_ADMITTED
            if payload is None:
                return PARK_FULL
            listed = connection.execute(statements["listed_per_slot"], {"slots": ordered}).all()
            if any(entries >= max_waiters for _slot, entries in listed):
                return PARK_LIST_FULL
            dispatches = connection.execute(statements["tombstone_dispatches"], params).scalar() or 0
            connection.execute(statements["delete_tombstone"], params)
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
                            "dispatches": dispatches,
                        }
                        for slot in ordered
                    ]
                )
            )
            return PARK_PARKED

        return self._transaction("park", park, attempts=_ACQUIRE_ATTEMPTS)

    def _room_now(self, slots: Mapping[str, int], params: dict[str, Any]) -> bool:
        """Whether every slot has room for the task and it has no entry, by a read without locks."""
        room_now = self._statement(self._room_statements, _ROOM_NOW, len(slots), "")
        rows = self._transaction(
            "park", lambda connection: connection.execute(room_now, params).all(), single_statement=True
        )
        # (A row without a slot is one of the task's entry rows.)
        return not any(
            slot is None or (not holds and holders >= slots[_as_text(slot)]) for slot, holders, holds in rows
        )

    def _dispatch(
        self, connection: Connection, locked: list[str], dispatch_lease_seconds: float, touching: set[str] | None
    ) -> list[Woken]:
        """Dispatch, with leases, the oldest waiters of the ``locked`` slots (sentinels locked)
        that have room and (if ``touching`` is given) wait for one of the slots ``touching``.

        Waiters are read in their order a batch at a time, and reading stops once every
        slot seen is full: a release with a long waiting list reads a few rows, not all.
        """
        statements = self._parking
        live: dict[str, set[str]] = defaultdict(set)
        for slot, task_id in connection.execute(statements["live"], {"slots": locked}):
            live[_as_text(slot)].add(_as_text(task_id))
        limits: dict[str, int] = {}
        chosen: list[tuple[str, str]] = []
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
                if touching is not None and touching.isdisjoint(needed):
                    continue  # read for a slot it shares with those, which it does not wait for
                if len(needed) < waiter["count"]:
                    continue  # one of its slots is not locked here: a later release or recovery
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
                if not connection.execute(statements["mark_dispatched"], params).rowcount:
                    continue  # no longer waiting: a readmit or a forget took it since it was read
                self._insert_leases(connection, len(ordered), params)
                for slot in needed:
                    live[slot].add(task_id)
                chosen.append((task_id, run_id))
            if not more or all(len(live[slot]) >= limit for slot, limit in limits.items()):
                break
        return self._woken(connection, chosen, readmit=False)

    def _readmit(self, connection: Connection, task_ids: Sequence[str], dispatch_lease_seconds: float) -> list[Woken]:
        """Dispatch, without leases, those of ``task_ids`` that still wait, in that order (their
        sentinels locked)."""
        chosen = []
        for task_id in task_ids:
            run_id = uuid.uuid4().hex
            params = {"task_id": task_id, "run_id": run_id, "lease_seconds": dispatch_lease_seconds}
            if connection.execute(self._parking["mark_dispatched"], params).rowcount:
                chosen.append((task_id, run_id))
        return self._woken(connection, chosen, readmit=True)

    def _woken(self, connection: Connection, chosen: Sequence[tuple[str, str]], readmit: bool) -> list[Woken]:
        """The dispatches ``chosen`` (task id, dispatch run id), with their payloads and names."""
        found: dict[str, tuple[bytes, str | None]] = {}
        task_ids = [task_id for task_id, _run_id in chosen]
        for start in range(0, len(task_ids), _PRUNE_BATCH):
            batch = task_ids[start : start + _PRUNE_BATCH]
            for task_id, payload, task_name in connection.execute(self._parking["payloads"], {"task_ids": batch}):
                found.setdefault(_as_text(task_id), (bytes(payload), task_name))
        return [Woken(task_id, run_id, *found[task_id], readmit=readmit) for task_id, run_id in chosen]

    def _names(self, connection: Connection, statement: str, name: str, values: Collection[Any]) -> set[str]:
        """The first column of the waiting-list statement ``statement``, run on ``values`` bound
        to the list ``name`` a batch at a time."""
        found: set[str] = set()
        listed = list(values)
        for start in range(0, len(listed), _PRUNE_BATCH):
            rows = connection.execute(self._parking[statement], {name: listed[start : start + _PRUNE_BATCH]})
            found.update(_as_text(row[0]) for row in rows)
        return found

    def _lock_existing(self, connection: Connection, slots: Collection[str]) -> list[str]:
        """Lock the sentinels of ``slots`` in slot order, waiting for them; the slots locked."""
        if not slots:
            return []
        rows = connection.execute(self._parking["lock"], {"slots": sorted(slots)})
        return sorted(_as_text(row[0]) for row in rows)

    def _wake_after_release(
        self, connection: Connection, released: list[str], dispatch_lease_seconds: float
    ) -> list[Woken]:
        statements = self._parking
        if not released:
            return []
        # Lock the released slots first: a park that counted them full has committed
        # by then, so its waiter is seen here.
        locked = self._lock_existing(connection, set(released))
        waiting = {_as_text(row[0]) for row in connection.execute(statements["waiting_slots"], {"slots": locked})}
        more = sorted(waiting - set(locked))
        if more:
            locked += [_as_text(row[0]) for row in connection.execute(statements["lock_more"], {"slots": more})]
        if not waiting:
            return []
        return self._dispatch(connection, sorted(locked), dispatch_lease_seconds, touching=set(released))

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
                Woken(str(task_id), str(woken_run_id), bytes(payload), task_name)
                for _, task_id, woken_run_id, payload, task_name in rows
                if task_id is not None
            ]
            return int(rows[0][0]), woken
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

    def claim(
        self, task_id: str, run_id: str, holder: str, lease_seconds: float, *, redelivered: bool = False
    ) -> ClaimOutcome:
        if not run_id:
            raise ValueError("run_id must be non-empty")
        if not self._schema_ready:
            self._prepare()
        params = {
            "task_id": task_id,
            "run_id": run_id,
            "holder": holder,
            "lease_seconds": lease_seconds,
            "redelivered": redelivered,
            "done_seconds": self.done_seconds,
        }
        driver = self._driver_connections() if self._use_claim_function else None
        if driver is not None:
            outcome = self._driver_call("claim", driver, _CALL_CLAIM_FUNCTION_DRIVER, params).fetchone()[0]
            return ClaimOutcome(str(outcome))
        statements = self._parking
        other_copy = ClaimOutcome.ADMIT if redelivered else ClaimOutcome.END

        def settle(connection: Connection, *, tombstone: bool) -> None:
            """The entry dispatched to this run leaves the list: a tombstone if dispatched more than
            once, or ``tombstone``."""
            minimum = {**params, "minimum": 0 if tombstone else 2}
            connection.execute(statements["settle_tombstone"], minimum)
            connection.execute(statements["settle_delete"], minimum)

        def claim(connection: Connection) -> ClaimOutcome:
            # The dispatch's leases (locked), then the entry: the order of every step that changes both.
            leases = connection.execute(statements["claim_leases"], params).all()
            live = [lease_holder for lease_holder, alive in leases if alive]
            # (A lease already the run's: the same claim again, its reply lost.)
            if (
                live
                and len(live) == len(leases)
                and all(lease_holder in (DISPATCH_HOLDER, holder) for lease_holder in live)
            ):
                connection.execute(statements["claim"], params)
                settle(connection, tombstone=False)
                return ClaimOutcome.RUN
            if any(lease_holder != DISPATCH_HOLDER for lease_holder in live):
                return other_copy  # another copy's run holds the dispatch's slots
            connection.execute(statements["delete_dispatch_leases"], {**params, "holder": DISPATCH_HOLDER})
            entry = connection.execute(statements["lock_entry"], params).first()
            if entry is None:
                return ClaimOutcome.ADMIT
            dispatch_run_id, done_until, claimed_by, _slot = entry
            if done_until is not None:
                # This very claim's tombstone: the claim retried, its leases expired meanwhile.
                same_claim = dispatch_run_id == run_id and claimed_by == holder
                return ClaimOutcome.ADMIT if same_claim else other_copy
            if dispatch_run_id != run_id:
                return ClaimOutcome.END  # the list answers for the task
            # No lease is left to tell a duplicate copy of this dispatch that the task was taken.
            settle(connection, tombstone=True)
            return ClaimOutcome.ADMIT

        return self._transaction("claim", claim, attempts=_ACQUIRE_ATTEMPTS)

    def forget(self, task_id: str, dispatch_lease_seconds: float) -> tuple[int, list[Woken]]:
        statements = self._parking
        params = {"task_id": task_id, "holder": DISPATCH_HOLDER, "done_seconds": self.done_seconds}

        def forget(connection: Connection) -> tuple[int, list[Woken]]:
            # Every dispatch lease of the task first (a release's, or one taken when it was sent:
            # that has no entry), as a claim takes them before the entry; never a run's lease,
            # whose holder is the run's.
            freed = [_as_text(row[0]) for row in connection.execute(statements["holder_slots"], params)]
            deleted = connection.execute(self._release_holder, params).rowcount
            woken = self._wake_after_release(connection, freed, dispatch_lease_seconds) if deleted else []
            # Then the entry.  Each change is conditional on the state just read: one that lost a
            # race (a dispatch, a claim, a recovery in between) changes nothing, and it is read again.
            for _ in range(_FORGET_ATTEMPTS):
                rows = connection.execute(statements["entry"], params).all()
                if not rows or rows[0][1] is not None:
                    return 0, woken  # no entry, or a tombstone
                dispatch_run_id = rows[0][0]
                if dispatch_run_id is None:
                    if connection.execute(statements["delete_waiting"], params).rowcount:
                        return 1, woken
                    continue
                if connection.execute(statements["tombstone"], {**params, "run_id": dispatch_run_id}).rowcount:
                    return 1, woken
            raise StoreError(f"forget failed on {self.display_url}: the entry of {task_id!r} kept changing")

        return self._transaction("forget", forget, attempts=_ACQUIRE_ATTEMPTS)

    def recover(
        self,
        dispatch_lease_seconds: float,
        *,
        caps: Collection[str] | None = None,
        readmit_before: float | None = None,
    ) -> list[Woken]:
        statements = self._parking
        if caps is not None and not caps:
            return []

        def recover(connection: Connection) -> list[Woken]:
            # The entries considered: every listed one, or those waiting for a slot of ``caps``.
            of_slots: dict[str, Any] = {}
            considered: set[str] | None = None  # the slots they need (None: every slot)
            if caps is not None:
                cap_slots: set[str] = set()
                for cap in sorted(set(caps)):
                    pattern = {"cap": cap, "pattern": self._exact(_like_prefix(cap + ":"))}
                    cap_slots.update(_as_text(row[0]) for row in connection.execute(statements["cap_slots"], pattern))
                if not cap_slots:
                    return []
                of_slots = {"slots": sorted(cap_slots)}
                considered = self._names(connection, "listed_slots", "slots", cap_slots)
            # Dispatches past their deadline wait again at their place: their leases first, as a
            # claim takes them, one dispatch after the other in task order (so concurrent
            # recoveries never wait for each other in a circle).
            expired = statements["expired_dispatches" if caps is None else "expired_dispatches_of"]
            for task_id, dispatch_run_id in connection.execute(expired, of_slots).all():
                dispatch = {"task_id": task_id, "run_id": dispatch_run_id, "holder": DISPATCH_HOLDER}
                connection.execute(statements["delete_dispatch_leases"], dispatch)
                connection.execute(statements["undispatch"], dispatch)
            overdue: list[str] = []
            if readmit_before is not None:
                statement = statements["overdue" if caps is None else "overdue_of"]
                rows = connection.execute(statement, {"before": readmit_before, **of_slots})
                overdue = [_as_text(row[0]) for row in rows]
            # The slots where a waiter may fit (read without locks: a slot that gains room after
            # this read is served by its release, or by the next recovery), and the other slots
            # their waiters need.
            if considered is None:
                room = {_as_text(row[0]) for row in connection.execute(statements["all_slots_with_room"])}
            else:
                room = self._names(connection, "slots_with_room", "slots", considered)
            walked = room | self._names(connection, "waiting_slots", "slots", room)
            # Every sentinel at once, in slot order: readmits and dispatches change waiting entries
            # only under the locks of their slots, as a release's dispatches do.
            overdue_slots = self._names(connection, "slots_of_tasks", "task_ids", overdue)
            locked = self._lock_existing(connection, walked | overdue_slots)
            woken = self._readmit(connection, overdue, dispatch_lease_seconds)
            if room:
                walk = [slot for slot in locked if slot in walked]
                woken += self._dispatch(connection, walk, dispatch_lease_seconds, touching=considered)
            return woken

        return self._transaction("recover", recover, attempts=_ACQUIRE_ATTEMPTS)

    def readmit(self, slot: str, dispatch_lease_seconds: float) -> list[Woken]:
        statements = self._parking

        def readmit(connection: Connection) -> list[Woken]:
            task_ids = [_as_text(row[0]) for row in connection.execute(statements["waiting_of_slot"], {"slot": slot})]
            if not task_ids:
                return []
            # Under the sentinels of their slots, as every change of a waiting entry.
            self._lock_existing(connection, self._names(connection, "slots_of_tasks", "task_ids", task_ids))
            return self._readmit(connection, task_ids, dispatch_lease_seconds)

        return self._transaction("readmit", readmit, attempts=_ACQUIRE_ATTEMPTS)

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
