"""Every SQL statement of the portable SQL store, by name, and their compiled forms.

``{now}`` in a template is the dialect's clock (:attr:`Dialect.now`), ``{for_update}`` and
``{skip_locked}`` its row locks, ``{slot_starts_with}`` the condition that ``slot`` starts with a
prefix, exactly and case included (its ``:pattern`` is :meth:`Statements.prefix_pattern`),
``{limit_s}`` the limit of the sentinel ``s``: the operator's (:func:`operator_limit`), else its own,
``{limit_of_t}`` and ``{limit_of_c}`` the same of the slot ``t.slot``, ``c.slot`` (its sentinel read in a subquery),
``{several_index}`` the hint that names ix_concurrency_waiters_several where a planner needs it,
``{on_name_taken}`` an INSERT's clause that updates the row whose ``name`` is taken;
``:slots``, ``:task_ids``, ``:run_ids`` and ``:task_names`` are lists (expanding binds).
``:deployment`` is the handle's deployment (:attr:`.SlotStore.deployment`): every statement of a
walk, a recovery or a readmit reads only the waiting entries of that deployment, which alone
dispatches them; admission, the lists' counts, prune, the sweep and the operators' reads see
every deployment's.
The admission statements over several slots (``{values}``/``{slots}``) are built per number
of slots by :meth:`Statements.execute_for_slots`.

The waiting list's states, by column: waiting (``dispatch_run_id`` NULL), dispatched
(``dispatch_run_id`` set, ``done_until`` NULL), tombstone (``done_until`` set; it keeps its
dispatch's run id, so "``dispatch_run_id IS NULL``" alone selects the waiting, and an empty
payload: the task's arguments do not outlive its entry).  Every
change of an entry's state is conditional on the state it was read in, so that a step that
lost a race to another changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult

from ..base import DISPATCH_HOLDER
from .dialects import Dialect

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

# -- admission (one statement per number of slots) -------------------------------------------

#: The oldest heavy waiting entry of :deployment of the slot ``{slot}`` other than :task_id: its
#: weight there (NULL: none).  One probe of ix_concurrency_waiters_heavy (its conditions as
#: written in the index, :data:`.HEAVY_WAITING`), which holds only heavy waiting entries; on MySQL,
#: a range of ix_concurrency_waiters_weight (``weight > 1``), empty while nobody is heavy.
HEAVY_WAITER = (
    "(SELECT h.weight FROM concurrency_waiters h WHERE h.slot = {slot} AND h.deployment = :deployment "
    "AND h.weight > 1 AND h.dispatch_run_id IS NULL AND h.task_id <> :task_id "
    "ORDER BY h.first_deferred_at, h.parked_at, h.task_id LIMIT 1)"
)
#: Of slot ``c.slot``, one of :s0.. (``{slot_cases}``: a ``WHEN :s{i} THEN`` each), its oldest heavy
#: waiter's weight, by :data:`HEAVY_WAITER` of the bound slot.  Not correlated with ``c.slot``:
#: MariaDB runs a correlated one by the slot alone (``ref``, never the range ``weight > 1``), which
#: reads the slot's whole list (7 ms at 10,000 entries, against 0.7 at 10).
HEAVY_WAITER_OF_C = "CASE c.slot {slot_cases} END"
#: Count live holders, in a statement after the sentinel locks (its snapshot postdates them): per
#: slot of :s0.. with live leases, its live holders, the units they take, whether :task_id is one,
#: the limit in force (the operator's, else the sentinel's, which the locks just set to the
#: task's), and the weight of the slot's oldest heavy waiter.  The units are the holders while
#: every live lease weighs 1; else the sum of the live leases' weights, which counts a task id
#: holding the slot twice twice (rare, and on the safe side: it admits less, never more).  (Not
#: capped at the limit: "units + need > limit" and "units >= limit" come out the same capped or
#: not.  No derived table: MariaDB materialises one per admission.)
# (The sentinel in a scalar subquery, not a join: SQLite would read every sentinel to join them.)
COUNT_LIVE = (
    "SELECT c.slot, COUNT(DISTINCT c.task_id), "
    "CASE WHEN MAX(c.weight) = 1 THEN COUNT(DISTINCT c.task_id) ELSE SUM(c.weight) END, "
    "MAX(CASE WHEN c.task_id = :task_id THEN 1 ELSE 0 END), {limit_of_c}, " + HEAVY_WAITER_OF_C + " "
    "FROM concurrency_slots c WHERE c.slot IN ({slots}) AND c.expires_at > {now} GROUP BY c.slot"
)
SENTINEL_ROW = "('', :s{i}, '', '', :l{i})"
LEASE_ROW = "(:run_id, :s{i}, :task_id, :holder, {now} + :lease_seconds, :task_name, {now}, :w{i})"
#: A column added to a table created before it (see :data:`.leases.ADDED_COLUMNS`).
ADD_COLUMN = "ALTER TABLE {table} ADD COLUMN {column} {definition}"
#: An index of an earlier schema dropped (see :data:`.schema.OLD_INDEXES`), by dialect ("": the
#: others').
DROP_INDEX = {"": "DROP INDEX {index}", "mysql": "DROP INDEX {index} ON {table}"}

#: Room for a waiter in the slot of a waiting list ``n``, its sentinel ``s`` joined: fewer live
#: holders than the slot's limit, and a waiting entry of :deployment (a look at the first rows of
#: its list's part of :deployment).  The recovery reads of slots with room share it.
_ROOM_FOR_A_WAITER = (
    "{limit_s} > (SELECT COUNT(DISTINCT c.task_id) "
    "FROM concurrency_slots c WHERE c.slot = n.slot AND c.expires_at > {now}) AND ("
    "SELECT 1 FROM concurrency_waiters w WHERE w.slot = n.slot AND w.deployment = :deployment "
    "AND w.dispatch_run_id IS NULL "
    "ORDER BY w.fair_round, w.first_deferred_at LIMIT 1) IS NOT NULL"
)
_LISTS_AND_SENTINELS = (
    "SELECT n.slot FROM concurrency_waitlists n JOIN concurrency_slots s ON s.run_id = '' AND s.slot = n.slot "
)

# -- leases -------------------------------------------------------------------------------------

TEMPLATES: dict[str, str] = {
    "renew": (
        "UPDATE concurrency_slots SET expires_at = {now} + :lease_seconds "
        "WHERE run_id IN :run_ids AND expires_at > {now}"
    ),
    "renewed": (
        "SELECT run_id, COUNT(*) FROM concurrency_slots WHERE run_id IN :run_ids AND expires_at > {now} GROUP BY run_id"
    ),
    "release_run": "DELETE FROM concurrency_slots WHERE run_id = :run_id",
    "release_holder": "DELETE FROM concurrency_slots WHERE task_id = :task_id AND holder = :holder AND run_id <> ''",
    "release_task": "DELETE FROM concurrency_slots WHERE task_id = :task_id AND run_id <> ''",
    # The sweep, a batch at a time, each in its own transaction: the store's clock read once
    # (a volatile clock compared per row could use no index), the expired rows found through the
    # expiry's index, then deleted if still expired (a run admitted again replaces its row).
    # Sentinels have a NULL expiry, which no comparison matches: the sweep keeps them.
    "now": "SELECT {now}",
    "expired_runs": ("SELECT run_id FROM concurrency_slots WHERE expires_at <= :now ORDER BY expires_at LIMIT :batch"),
    "sweep": "DELETE FROM concurrency_slots WHERE run_id IN :run_ids AND expires_at <= :now",
    # Whether the sweep has anything to do, read first (so that a sweep with nothing to do takes
    # no write lock: on SQLite, the whole database's): the clock, the earliest lease expiry and
    # the earliest end of a tombstone, each the first entry of its index (no parameter: a plan
    # cached for a parameter could scan instead).
    "next_expiries": (
        "SELECT {now}, "
        "(SELECT expires_at FROM concurrency_slots WHERE expires_at IS NOT NULL ORDER BY expires_at LIMIT 1), "
        "(SELECT done_until FROM concurrency_waiters WHERE done_until IS NOT NULL ORDER BY done_until LIMIT 1)"
    ),
    # The clock and the earliest deadline of a dispatch of :deployment (recovery returns the
    # expired ones).
    "next_dispatch_deadline": (
        "SELECT {now}, (SELECT dispatch_expires_at FROM concurrency_waiters WHERE deployment = :deployment "
        "AND dispatch_expires_at IS NOT NULL AND done_until IS NULL ORDER BY dispatch_expires_at LIMIT 1)"
    ),
    "old_tombstones": (
        "SELECT task_id FROM concurrency_waiters WHERE done_until <= :now ORDER BY done_until LIMIT :batch"
    ),
    "sweep_tombstones": "DELETE FROM concurrency_waiters WHERE task_id IN :task_ids AND done_until <= :now",
    # Keys per keyed cap (slot names ``cap:key``), from the sentinels in the primary key's order
    # (plain reads: they lock nothing), each read a short range of it: the first sentinel at or
    # after :start and after :after; a cap's keys, the names from :low ('cap:') to :high
    # ('cap;', the next character), counted up to :most.  (The range is the index's; the prefix
    # test keeps the count exact where a collation orders names otherwise.)
    "next_sentinel": (
        "SELECT slot FROM concurrency_slots WHERE run_id = '' AND slot >= :start AND slot > :after "
        "ORDER BY slot LIMIT 1"
    ),
    "keys_of_cap": (
        "SELECT COUNT(*) FROM (SELECT slot FROM concurrency_slots WHERE run_id = '' AND slot >= :low "
        "AND slot < :high AND {slot_starts_with} ORDER BY slot LIMIT :most) AS k"
    ),
    # Every slot with its live holders and expired leases: the table read once, grouped by slot
    # (by the store's clock read once, :now), the sentinel giving the limit (NULL on leases).
    # Never a count per slot, which a planner may make from the expiry's index, walking every
    # expired (or, on MariaDB, released and not yet purged) lease once per slot; nor a join of
    # two reads, which MariaDB may make a nested loop over both.
    # (And the largest weight of a live lease: the units are read apart, for the slots where it
    # is above 1.)
    "status": (
        "SELECT slot, MAX(slot_limit), COUNT(DISTINCT CASE WHEN expires_at > :now THEN task_id END), "
        "SUM(CASE WHEN expires_at <= :now THEN 1 ELSE 0 END), MAX(CASE WHEN expires_at > :now THEN weight ELSE 0 END) "
        "FROM concurrency_slots GROUP BY slot "
        "HAVING MAX(CASE WHEN run_id = '' THEN 1 ELSE 0 END) = 1 ORDER BY slot"
    ),
    "leases_all": (
        "SELECT slot, task_id, run_id, holder, expires_at - {now}, task_name, {now} - acquired_at, weight "
        "FROM concurrency_slots WHERE run_id <> '' ORDER BY slot, expires_at"
    ),
    "leases_of_slot": (
        "SELECT slot, task_id, run_id, holder, expires_at - {now}, task_name, {now} - acquired_at, weight "
        "FROM concurrency_slots WHERE run_id <> '' AND slot = :slot ORDER BY slot, expires_at"
    ),
    # Prune: lock the candidate sentinels first (admission locks them too, so after this no
    # lease can be added to them), find the held and waited-for ones in later statements, then
    # delete sentinels and expired leases of the others, and the tombstones of their tasks.
    "prune_candidates": "SELECT slot FROM concurrency_slots WHERE run_id = '' AND {slot_starts_with} ORDER BY slot",
    "prune_locked_candidates": (
        "SELECT slot FROM concurrency_slots WHERE run_id = '' AND {slot_starts_with} ORDER BY slot{for_update}"
    ),
    "prune_live": (
        "SELECT DISTINCT slot FROM concurrency_slots WHERE slot IN :slots AND run_id <> '' AND expires_at > {now}"
    ),
    "prune_waited": "SELECT DISTINCT slot FROM concurrency_waiters WHERE slot IN :slots AND done_until IS NULL",
    "prune_delete": "DELETE FROM concurrency_slots WHERE slot IN :slots",
    "prune_waitlists": "DELETE FROM concurrency_waitlists WHERE slot IN :slots",
    "prune_tombstones": (
        "SELECT DISTINCT task_id FROM concurrency_waiters WHERE slot IN :slots AND done_until IS NOT NULL"
    ),
    "delete_tombstones": "DELETE FROM concurrency_waiters WHERE task_id IN :task_ids AND done_until IS NOT NULL",
    # -- the waiting list ----------------------------------------------------------------------
    # Sentinels of slots that already have one: lock them in slot order (SQLite: BEGIN IMMEDIATE
    # holds the write lock already).
    "lock": "SELECT slot FROM concurrency_slots WHERE run_id = '' AND slot IN :slots ORDER BY slot{for_update}",
    # Slots beyond those a release already locked: take what is free, never wait (waiting out of
    # slot order could deadlock); a waiter needing a skipped slot is passed over this time and
    # dispatched by a later release or by recovery.
    "lock_more": "SELECT slot FROM concurrency_slots WHERE run_id = '' AND slot IN :slots ORDER BY slot{skip_locked}",
    # The task name of the task's entry, waiting or dispatched (every row of it has the same).
    "task_listed": (
        "SELECT task_name FROM concurrency_waiters WHERE task_id = :task_id AND done_until IS NULL LIMIT 1"
    ),
    # Entries (waiting or dispatched, not tombstones) per slot of :slots, as counted in
    # concurrency_waitlists: a park adds its entry under the slots' sentinel locks (parks are the
    # only steps that add, so "update, then insert the missing counts" races with none); a step
    # that takes an entry off the list subtracts it as its last statement.  And the last round of
    # each slot's list (of :deployment; NULL: none), the round of a new entry without a fair key
    # there (see ParkingStore, "Fair shares"): the last row of the list's part of
    # ix_concurrency_waiters_place, read from the index alone (a tombstone's round counts too:
    # it only places the entry later than the listed ones' last round, never before one).
    "listed_per_slot": (
        "SELECT n.slot, n.entries, (SELECT w.fair_round FROM concurrency_waiters w WHERE w.slot = n.slot "
        "AND w.deployment = :deployment ORDER BY w.fair_round DESC LIMIT 1) "
        "FROM concurrency_waitlists n WHERE n.slot IN :slots"
    ),
    "list_entry": "UPDATE concurrency_waitlists SET entries = entries + 1 WHERE slot IN :slots",
    "unlist_entry": "UPDATE concurrency_waitlists SET entries = entries - 1 WHERE slot IN :slots",
    # The slots of the entry a claim settles (locked: the rows it changes).
    "settling_slots": (
        "SELECT slot FROM concurrency_waiters WHERE task_id = :task_id AND dispatch_run_id = :run_id "
        "AND done_until IS NULL{for_update}"
    ),
    # A task parking again: its tombstone gives way, and its count of dispatches lives on.
    "tombstone_dispatches": (
        "SELECT dispatches FROM concurrency_waiters WHERE task_id = :task_id AND done_until IS NOT NULL"
    ),
    "delete_tombstone": "DELETE FROM concurrency_waiters WHERE task_id = :task_id AND done_until IS NOT NULL",
    # A task's entry: every row has the same state.
    "entry": (
        "SELECT dispatch_run_id, done_until, claimed_by, slot FROM concurrency_waiters WHERE task_id = :task_id "
        "ORDER BY slot"
    ),
    "lock_entry": (
        "SELECT dispatch_run_id, done_until, claimed_by, slot FROM concurrency_waiters WHERE task_id = :task_id "
        "ORDER BY slot{for_update}"
    ),
    "run_slots": "SELECT slot FROM concurrency_slots WHERE run_id = :run_id",
    "holder_slots": (
        "SELECT slot FROM concurrency_slots WHERE task_id = :task_id AND holder = :holder AND run_id <> ''"
    ),
    "task_slots": "SELECT slot FROM concurrency_slots WHERE task_id = :task_id AND run_id <> ''",
    # Whether a slot's list has an entry, below, is "(SELECT 1 ... ORDER BY w.fair_round,
    # w.first_deferred_at LIMIT 1) IS NOT NULL": a look at the first rows of that one list's part
    # of :deployment, per slot, in the order of ix_concurrency_waiters_place (so that the planner
    # reads that index, not the table, to find them).  An EXISTS there, LIMIT or not, PostgreSQL
    # and MariaDB may turn into a semi-join that reads every entry of every list (all of a full
    # slot's waiters, on every recovery pass); a scalar subquery they keep as it is written.
    # The slots with listed entries of :deployment of one cap (recovery of some caps): the slot
    # named like it, and its keys'; of a slot name (it has a ':'), that slot alone (listed_slot).
    # (Every slot with a list has a row in concurrency_waitlists: one row per slot of the cap.)
    "cap_slots": (
        "SELECT n.slot FROM concurrency_waitlists n WHERE (n.slot = :cap OR {slot_starts_with}) AND ("
        "SELECT 1 FROM concurrency_waiters w WHERE w.slot = n.slot AND w.deployment = :deployment "
        "AND w.done_until IS NULL "
        "ORDER BY w.fair_round, w.first_deferred_at LIMIT 1) IS NOT NULL"
    ),
    "listed_slot": (
        "SELECT n.slot FROM concurrency_waitlists n WHERE n.slot = :cap AND ("
        "SELECT 1 FROM concurrency_waiters w WHERE w.slot = n.slot AND w.deployment = :deployment "
        "AND w.done_until IS NULL "
        "ORDER BY w.fair_round, w.first_deferred_at LIMIT 1) IS NOT NULL"
    ),
    # The slots with listed entries of :deployment of the tasks named :task_names (recovery of the
    # tasks a worker knows, whatever their slots are called): per slot with a list, a look at its
    # list's part of :deployment up to the first such entry (the first row, in a list of the
    # worker's own tasks).  Every row of an entry has its task name: each of its slots is found.
    "named_slots": (
        "SELECT n.slot FROM concurrency_waitlists n WHERE ("
        "SELECT 1 FROM concurrency_waiters w WHERE w.slot = n.slot AND w.deployment = :deployment "
        "AND w.task_name IN :task_names AND w.done_until IS NULL "
        "ORDER BY w.fair_round, w.first_deferred_at LIMIT 1) IS NOT NULL"
    ),
    # The other slots of the (rare) listed entries of :deployment of several slots that wait for
    # one of :slots (ix_concurrency_waiters_several: never a walk of the lists).
    "several_listed_slots": (
        "SELECT DISTINCT slot FROM concurrency_waiters WHERE done_until IS NULL AND task_id IN "
        "(SELECT task_id FROM concurrency_waiters WHERE slot IN :slots AND deployment = :deployment "
        "AND slot_count > 1 AND done_until IS NULL)"
    ),
    # The slots of :slots with a waiting entry of :deployment: a look at the first rows of each
    # list's part of :deployment, however long the lists (their own deployment's or another's).
    "slots_waited_for": (
        "SELECT s.slot FROM concurrency_slots s WHERE s.run_id = '' AND s.slot IN :slots AND "
        "(SELECT 1 FROM concurrency_waiters w WHERE w.slot = s.slot AND w.deployment = :deployment "
        "AND w.dispatch_run_id IS NULL "
        "ORDER BY w.fair_round, w.first_deferred_at LIMIT 1) IS NOT NULL"
    ),
    # The slots (of :slots, or any) with waiting entries of :deployment where a waiter may fit:
    # fewer live holders than the slot's limit, its sentinel's (read without locks: recovery
    # locks these).  (One row per slot with a list, its sentinel by the primary key, its live
    # holders through ix_concurrency_slots_slot_expiry, and a look at the first rows of its list's
    # part of :deployment for a waiting entry.)
    "slots_with_room": (_LISTS_AND_SENTINELS + "WHERE n.slot IN :slots AND n.entries > 0 AND " + _ROOM_FOR_A_WAITER),
    # The slots with room, as above, of one cap (the slot named like it and its keys'): one
    # read, however many of its keys wait (recovery of some caps, when nothing is due).
    "cap_slots_with_room": (
        "SELECT n.slot FROM (SELECT slot FROM concurrency_waitlists WHERE (slot = :cap OR {slot_starts_with}) "
        "AND entries > 0) n JOIN concurrency_slots s ON s.run_id = '' AND s.slot = n.slot WHERE " + _ROOM_FOR_A_WAITER
    ),
    # The slots with room, as above, with a listed entry of :deployment of the tasks named.
    "named_slots_with_room": (
        _LISTS_AND_SENTINELS + "WHERE n.entries > 0 AND " + _ROOM_FOR_A_WAITER + " AND ("
        "SELECT 1 FROM concurrency_waiters w WHERE w.slot = n.slot AND w.deployment = :deployment "
        "AND w.task_name IN :task_names AND w.done_until IS NULL "
        "ORDER BY w.fair_round, w.first_deferred_at LIMIT 1) IS NOT NULL"
    ),
    # The other slots of the (rare) listed entries of :deployment of several slots that wait for a
    # slot of one cap (ix_concurrency_waiters_several; SQLite is told so: with a prefix to match,
    # it chose ix_concurrency_waiters_first_deferred, every entry of the deployment).
    "several_listed_slots_of_cap": (
        "SELECT DISTINCT slot FROM concurrency_waiters WHERE done_until IS NULL AND task_id IN "
        "(SELECT task_id FROM concurrency_waiters{several_index} WHERE (slot = :cap OR {slot_starts_with}) "
        "AND deployment = :deployment AND slot_count > 1 AND done_until IS NULL)"
    ),
    # Those of :slots (the slots with room, as above) where a waiting entry of :deployment may
    # fit: one whose every other slot is among :slots too, or held by its task id already (a
    # list whose waiters all wait for a full slot is left to that slot's release).  Per slot, its
    # list read up to the first such entry; each row, its entry's other rows by
    # ix_concurrency_waiters_task_id.  No locks: recovery locks the slots it keeps.
    "slots_with_a_fitting_waiter": (
        "SELECT n.slot FROM concurrency_waitlists n WHERE n.slot IN :slots AND EXISTS ("
        "SELECT 1 FROM concurrency_waiters w WHERE w.slot = n.slot AND w.deployment = :deployment "
        "AND w.dispatch_run_id IS NULL AND (w.slot_count = 1 OR NOT EXISTS ("
        "SELECT 1 FROM concurrency_waiters o WHERE o.task_id = w.task_id AND o.done_until IS NULL "
        "AND o.slot NOT IN :slots AND NOT EXISTS ("
        "SELECT 1 FROM concurrency_slots c WHERE c.task_id = o.task_id AND c.slot = o.slot "
        "AND c.expires_at > {now}))))"
    ),
    "all_slots_with_room": (_LISTS_AND_SENTINELS + "WHERE n.entries > 0 AND " + _ROOM_FOR_A_WAITER),
    # The limits of :slots: the operators', else their sentinels' (a dispatch counts against
    # these, never against the limits its waiters were parked under).
    "slot_limits": "SELECT s.slot, {limit_s} FROM concurrency_slots s WHERE s.run_id = '' AND s.slot IN :slots",
    # The limits operators set (celery caps limit), by cap or slot name.
    "operator_limits": "SELECT name, slot_limit FROM concurrency_limits ORDER BY name",
    "operator_limit_of": "SELECT slot_limit FROM concurrency_limits WHERE name = :name",
    # Before a limit is set: the sentinels it applies to (the slot :name, or the cap :name's),
    # locked in slot order as admission locks them, so that every admission counting under the
    # old limit has committed first and every later one reads the new limit after its lock.
    "lock_limited_sentinels": (
        "SELECT slot FROM concurrency_slots WHERE run_id = '' AND (slot = :name OR {slot_starts_with}) "
        "ORDER BY slot{for_update}"
    ),
    "delete_operator_limit": "DELETE FROM concurrency_limits WHERE name = :name",
    # Insert or replace (two operators setting one name at once: the later commit's holds, and
    # neither fails on the other's row).
    "put_operator_limit": (
        "INSERT INTO concurrency_limits (name, slot_limit, set_at) VALUES (:name, :limit, {now}) {on_name_taken}"
    ),
    # The waiters of :deployment of :slots in the lists' order, merged, a batch at a time (keyset:
    # from the row ordered at :round/:first/:parked/:task_id on).  Each list's own order is kept
    # (it is this order, of its rows).  A waiter's rows with the same round are adjacent; without
    # fair keys every round is 0, so all of them are.
    "waiting_rows": (
        "SELECT task_id, slot, slot_count, fair_round, first_deferred_at, parked_at, task_name, weight "
        "FROM concurrency_waiters WHERE slot IN :slots AND deployment = :deployment AND dispatch_run_id IS NULL AND ("
        "fair_round > :round OR (fair_round = :round AND (first_deferred_at > :first OR (first_deferred_at = :first "
        "AND (parked_at > :parked OR (parked_at = :parked AND task_id >= :task_id)))))) "
        "ORDER BY fair_round, first_deferred_at, parked_at, task_id LIMIT :batch"
    ),
    # The rows of the waiters :task_ids of several slots that a walk met (their rows of slots it
    # does not walk, and of other rounds: elsewhere in its order, or beyond what it read).  By
    # their task ids alone: their rows are all of the deployment the walk read them for (one park
    # made each entry), and a condition on the deployment could lead a planner to an index of the
    # deployment, all of its waiters.
    "waiting_rows_of_tasks": (
        "SELECT task_id, slot, weight FROM concurrency_waiters WHERE task_id IN :task_ids AND dispatch_run_id IS NULL"
    ),
    # The round of a new entry of fair key :fair_key in the slot :slot (see ParkingStore, "Fair
    # shares"): the list's first round (of its listed entries of :deployment) and the key's last
    # (NULL: none), each the first row of an index in order (ix_concurrency_waiters_place, and
    # ix_concurrency_waiters_fair_key with its condition, schema.FAIR_KEYED, as written there).
    # Read after the slot's sentinel lock, as every park.
    "fair_rounds": (
        "SELECT (SELECT h.fair_round FROM concurrency_waiters h WHERE h.slot = :slot AND h.deployment = :deployment "
        "AND h.done_until IS NULL ORDER BY h.fair_round LIMIT 1), "
        "(SELECT k.fair_round FROM concurrency_waiters k WHERE k.slot = :slot AND k.deployment = :deployment "
        "AND k.fair_key = :fair_key AND k.fair_key IS NOT NULL AND k.done_until IS NULL "
        "ORDER BY k.fair_round DESC LIMIT 1)"
    ),
    # The live holders of :slots, each with its largest weight there.
    "live": (
        "SELECT slot, task_id, MAX(weight) FROM concurrency_slots WHERE slot IN :slots AND expires_at > {now} "
        "GROUP BY slot, task_id"
    ),
    # A dispatch (with or without leases), only of an entry that still waits.
    "mark_dispatched": (
        "UPDATE concurrency_waiters SET dispatch_run_id = :run_id, dispatch_expires_at = {now} + :lease_seconds, "
        "dispatches = dispatches + 1 WHERE task_id = :task_id AND dispatch_run_id IS NULL"
    ),
    "payloads": "SELECT task_id, payload, task_name FROM concurrency_waiters WHERE task_id IN :task_ids",
    # A task's entry (one row of it): a tombstone's done_until, its dispatch, its payload's length.
    "entry_state": (
        "SELECT done_until, dispatch_run_id, length(payload) FROM concurrency_waiters WHERE task_id = :task_id LIMIT 1"
    ),
    # A claim: the task's leases of the dispatch run (locked), and whether each is live.
    "claim_leases": (
        "SELECT holder, CASE WHEN expires_at > {now} THEN 1 ELSE 0 END FROM concurrency_slots "
        "WHERE run_id = :run_id AND task_id = :task_id{for_update}"
    ),
    # A slot of the dispatch :run_id whose live holders take more units than its limit now (a cut
    # since the dispatch, which is one of them): per live task id t of a slot of the dispatch, its
    # largest weight there, each counted as at most the limit in force.  Such a capped sum is above
    # the limit iff there are two holders or more and one of them alone takes the limit, or the
    # weights add up above it: so the limit is read once per slot, never per holder.  (No subquery
    # of a derived table names an outer table: MariaDB allows none.)
    "dispatch_over_limit": (
        "SELECT t.slot FROM (SELECT c.slot, MAX(c.weight) AS w FROM concurrency_slots l "
        "JOIN concurrency_slots c ON c.slot = l.slot AND c.expires_at > {now} "
        "WHERE l.run_id = :run_id AND l.task_id = :task_id GROUP BY c.slot, c.task_id) t "
        "GROUP BY t.slot HAVING COUNT(*) > 1 AND (MAX(t.w) >= {limit_of_t} OR SUM(t.w) > {limit_of_t})"
    ),
    "claim": (
        "UPDATE concurrency_slots SET holder = :holder, expires_at = {now} + :lease_seconds "
        "WHERE run_id = :run_id AND task_id = :task_id"
    ),
    # (:minimum: the dispatches from which a claimed entry leaves a tombstone; 0: always.)  A
    # tombstone keeps no payload (the task's arguments): an empty one, the column being NOT NULL.
    "settle_tombstone": (
        "UPDATE concurrency_waiters SET done_until = {now} + :done_seconds, claimed_by = :holder, "
        "payload = :no_payload "
        "WHERE task_id = :task_id AND dispatch_run_id = :run_id AND done_until IS NULL AND dispatches >= :minimum"
    ),
    "settle_delete": (
        "DELETE FROM concurrency_waiters WHERE task_id = :task_id AND dispatch_run_id = :run_id "
        "AND done_until IS NULL AND dispatches < :minimum"
    ),
    "delete_waiting": "DELETE FROM concurrency_waiters WHERE task_id = :task_id AND dispatch_run_id IS NULL",
    "tombstone": (
        "UPDATE concurrency_waiters SET done_until = {now} + :done_seconds, payload = :no_payload "
        "WHERE task_id = :task_id AND dispatch_run_id = :run_id AND done_until IS NULL"
    ),
    # The dispatches of :deployment past their deadline.  (:now: the store's clock read once, so
    # that the deadline's index is used.)
    "expired_dispatches": (
        "SELECT DISTINCT task_id, dispatch_run_id, dispatches FROM concurrency_waiters "
        "WHERE dispatch_expires_at <= :now AND done_until IS NULL AND deployment = :deployment ORDER BY task_id"
    ),
    # (Of the entries of a recovery's scope: waiting for one of :slots, or of a task named in
    # :task_names; per expired dispatch, a look at its task's rows, never at the lists of :slots.)
    "expired_dispatches_of": (
        "SELECT DISTINCT task_id, dispatch_run_id, dispatches FROM concurrency_waiters "
        "WHERE dispatch_expires_at <= :now AND done_until IS NULL AND deployment = :deployment "
        "AND (task_name IN :task_names OR EXISTS (SELECT 1 FROM concurrency_waiters o "
        "WHERE o.task_id = concurrency_waiters.task_id AND o.slot IN :slots LIMIT 1)) ORDER BY task_id"
    ),
    "undispatch": (
        "UPDATE concurrency_waiters SET dispatch_run_id = NULL, dispatch_expires_at = NULL "
        "WHERE task_id = :task_id AND dispatch_run_id = :run_id AND done_until IS NULL"
    ),
    # A dispatch's leases, never a run's (a claimed lease's holder is its run's).
    "delete_dispatch_leases": (
        f"DELETE FROM concurrency_slots WHERE run_id = :run_id AND task_id = :task_id AND holder = '{DISPATCH_HOLDER}'"
    ),
    # The earliest first deferral of a waiting entry of :deployment (recovery reads the overdue
    # ones only if it is before :before).
    "first_waiting_since": (
        "SELECT first_deferred_at FROM concurrency_waiters WHERE deployment = :deployment AND dispatch_run_id IS NULL "
        "ORDER BY first_deferred_at LIMIT 1"
    ),
    # Waiting entries of :deployment to dispatch without leases, oldest first: first deferred
    # before :before.
    "overdue": (
        "SELECT DISTINCT task_id, first_deferred_at, parked_at FROM concurrency_waiters "
        "WHERE deployment = :deployment AND dispatch_run_id IS NULL AND first_deferred_at < :before "
        "ORDER BY first_deferred_at, parked_at, task_id"
    ),
    "overdue_of": (
        "SELECT DISTINCT task_id, first_deferred_at, parked_at FROM concurrency_waiters "
        "WHERE deployment = :deployment AND dispatch_run_id IS NULL AND first_deferred_at < :before "
        "AND (task_name IN :task_names OR EXISTS (SELECT 1 FROM concurrency_waiters o "
        "WHERE o.task_id = concurrency_waiters.task_id AND o.slot IN :slots LIMIT 1)) "
        "ORDER BY first_deferred_at, parked_at, task_id"
    ),
    # A slot's waiting entries of :deployment, by first deferral (an operator's drain readmits
    # them in that order, whatever their rounds).
    "waiting_of_slot": (
        "SELECT DISTINCT task_id, first_deferred_at, parked_at FROM concurrency_waiters "
        "WHERE slot = :slot AND deployment = :deployment AND dispatch_run_id IS NULL "
        "ORDER BY first_deferred_at, parked_at, task_id"
    ),
    "slots_of_tasks": "SELECT DISTINCT slot FROM concurrency_waiters WHERE task_id IN :task_ids",
    "waiters_all": (
        "SELECT slot, task_id, task_name, first_deferred_at, {now} - parked_at, dispatch_run_id, weight, fair_key, "
        "fair_round FROM concurrency_waiters WHERE done_until IS NULL "
        "ORDER BY slot, fair_round, first_deferred_at, parked_at, task_id"
    ),
    "waiters_of_slot": (
        "SELECT slot, task_id, task_name, first_deferred_at, {now} - parked_at, dispatch_run_id, weight, fair_key, "
        "fair_round FROM concurrency_waiters WHERE done_until IS NULL AND slot = :slot "
        "ORDER BY slot, fair_round, first_deferred_at, parked_at, task_id"
    ),
}

_LISTS = ("slots", "task_ids", "run_ids", "task_names")


class _Prepared(NamedTuple):
    statement: sa.TextClause
    #: The text for the driver as it is (see :attr:`Dialect.binds_as_written`), or None.
    as_written: str | None


class Statements:
    """The statements of :data:`TEMPLATES` compiled for one dialect, and the admission statements
    per number of slots; :meth:`execute` runs one by name."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._limit_s = f"COALESCE({operator_limit(dialect, 's.slot')}, s.slot_limit)"
        # The limit in force of the slot ``t.slot``, its sentinel read by its key.
        self._limit_of_t = f"(SELECT {self._limit_s} FROM concurrency_slots s WHERE s.run_id = '' AND s.slot = t.slot)"
        self._limit_of_c = self._limit_of_t.replace("s.slot = t.slot", "s.slot = c.slot")  # of ``c.slot``
        self._compiled = {name: self._compile(template) for name, template in TEMPLATES.items()}
        self._by_count: dict[tuple[str, int], _Prepared] = {}

    def _compile(self, template: str) -> _Prepared:
        dialect = self.dialect
        return self._prepare(
            template.format(
                now=dialect.now,
                for_update=dialect.for_update,
                skip_locked=dialect.for_update_skip_locked,
                limit_s=self._limit_s,
                limit_of_t=self._limit_of_t,
                limit_of_c=self._limit_of_c,
                slot_starts_with=_SLOT_STARTS_WITH.get(dialect.name, _SLOT_LIKE),
                several_index=_SEVERAL_INDEX.get(dialect.name, ""),
                on_name_taken=_ON_NAME_TAKEN.get(dialect.name, _ON_CONFLICT_NAME),
            )
        )

    def prefix_pattern(self, prefix: str) -> str | bytes:
        """The ``:pattern`` of ``{slot_starts_with}`` for the names that start with ``prefix``."""
        if self.dialect.name == "sqlite":
            return _glob_prefix(prefix)
        # MySQL's name columns are VARBINARY: it matches bytes.
        return self.dialect.exact(_like_prefix(prefix))

    def _prepare(self, text: str) -> _Prepared:
        statement = sa.text(text)
        lists = [name for name in _LISTS if f":{name}" in text]
        for name in lists:
            # (Typed: an empty list is compiled to an empty set of names, which PostgreSQL compares
            # with a name column only as text.)
            statement = statement.bindparams(sa.bindparam(name, expanding=True, type_=sa.String()))
        # A list bind needs SQLAlchemy to expand it; without one, a driver that reads ``:name``
        # binds takes the text as written.
        return _Prepared(statement, text if self.dialect.binds_as_written and not lists else None)

    def execute(
        self, connection: Connection, name: str, params: Mapping[str, Any] | None = None
    ) -> CursorResult[Unpack[tuple[Any, ...]]]:
        """Run the statement ``name`` of :data:`TEMPLATES` with ``params`` on ``connection``."""
        return _run(connection, self._compiled[name], params)

    def execute_for_slots(
        self, connection: Connection, kind: str, count: int, params: Mapping[str, Any]
    ) -> CursorResult[Unpack[tuple[Any, ...]]]:
        """Run ``kind`` (``"lock_sentinels"``, ``"count_live"`` or ``"insert_leases"``) over
        ``count`` slots, bound as ``:s0``.. in slot order (see :func:`admission_params`)."""
        prepared = self._by_count.get((kind, count))
        if prepared is None:
            dialect = self.dialect
            template, row = {
                "lock_sentinels": (dialect.lock_sentinels, SENTINEL_ROW),
                "count_live": (COUNT_LIVE, ""),
                "insert_leases": (dialect.insert_leases, LEASE_ROW),
            }[kind]
            values = ", ".join(row.format(i=i, now=dialect.now) for i in range(count))
            slots = ", ".join(f":s{i}" for i in range(count))
            slot_cases = " ".join(f"WHEN :s{i} THEN {HEAVY_WAITER.format(slot=f':s{i}')}" for i in range(count))
            prepared = self._prepare(
                template.format(
                    values=values,
                    slots=slots,
                    now=dialect.now,
                    limit_of_t=self._limit_of_t,
                    limit_of_c=self._limit_of_c,
                    slot_cases=slot_cases,
                )
            )
            self._by_count[(kind, count)] = prepared
        return _run(connection, prepared, params)


def operator_limit(dialect: Dialect, slot: str) -> str:
    """SQL for the limit an operator set for the slot named by the column ``slot``: the slot's
    own row of ``concurrency_limits``, else its cap's; NULL if neither."""
    cap = dialect.cap_of_slot.format(slot=slot)
    return (
        f"COALESCE((SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = {slot}), "
        f"(SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = {cap}))"
    )


def _run(
    connection: Connection, prepared: _Prepared, params: Mapping[str, Any] | None
) -> CursorResult[Unpack[tuple[Any, ...]]]:
    if prepared.as_written is not None:
        return connection.exec_driver_sql(prepared.as_written, params if params is not None else {})
    return connection.execute(prepared.statement, params)


def admission_params(
    slots: Mapping[str, int],
    task_id: str,
    run_id: str,
    holder: str,
    lease_seconds: float,
    task_name: str | None,
    weights: Mapping[str, int] | None = None,
    deployment: str = "",
) -> dict[str, Any]:
    """Bind parameters of the admission statements: slot ``i`` in sorted order is ``:s{i}``, its
    limit ``:l{i}``, the task's weight there ``:w{i}`` (1 unless ``weights`` names it);
    ``:deployment`` the one whose waiters may hold a slot (see :data:`COUNT_LIVE`)."""
    params: dict[str, Any] = {
        "task_id": task_id,
        "run_id": run_id,
        "holder": holder,
        "lease_seconds": lease_seconds,
        "task_name": task_name,
        "deployment": deployment,
    }
    for i, slot in enumerate(sorted(slots)):
        params[f"s{i}"] = slot
        params[f"l{i}"] = slots[slot]
        params[f"w{i}"] = weights.get(slot, 1) if weights else 1
    return params


# Whether ``slot`` starts with a prefix, exactly.  LIKE compares case-sensitively on PostgreSQL
# and on MySQL's VARBINARY names; SQLite's LIKE folds ASCII case ("tenant:%" matches "Tenant:x"),
# its GLOB does not (and, on the primary key's BINARY collation, can use its index).
_SLOT_LIKE = "slot LIKE :pattern ESCAPE '/'"
_SLOT_STARTS_WITH = {"sqlite": "slot GLOB :pattern"}
_SEVERAL_INDEX = {"sqlite": " INDEXED BY ix_concurrency_waiters_several"}
_ON_CONFLICT_NAME = "ON CONFLICT (name) DO UPDATE SET slot_limit = excluded.slot_limit, set_at = excluded.set_at"
_ON_NAME_TAKEN = {"mysql": "ON DUPLICATE KEY UPDATE slot_limit = VALUES(slot_limit), set_at = VALUES(set_at)"}


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``/``) matching the names that start with ``prefix``."""
    return prefix.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"


def _glob_prefix(prefix: str) -> str:
    """A GLOB pattern matching the names that start with ``prefix``: each wildcard character of
    it (``*``, ``?``, ``[``) inside brackets, where it stands for itself."""
    return "".join(f"[{character}]" if character in "*?[" else character for character in prefix) + "*"


# -- PostgreSQL: calls of its functions (postgresql.sql), in psycopg's parameter style ----------

POSTGRESQL_CALLS = {
    "acquire": (
        "SELECT concurrency_slots_acquire(%(slots)s, %(limits)s, %(task_id)s, %(run_id)s, %(holder)s, "
        "%(lease_seconds)s, %(task_name)s, %(weights)s, %(deployment)s)"
    ),
    "park": (
        "SELECT concurrency_slots_park(%(slots)s, %(limits)s, %(task_id)s, %(run_id)s, %(holder)s, "
        "%(lease_seconds)s, %(task_name)s, %(payload)s, %(first_deferred_at)s, %(max_waiters)s, %(deployment)s, "
        "%(weights)s, %(fair_keys)s::text[])"
    ),
    "release": "DELETE FROM concurrency_slots WHERE run_id = %(run_id)s",
    "release_and_wake": (
        "SELECT o_deleted, o_task_id, o_run_id, o_payload, o_task_name "
        "FROM concurrency_slots_release_and_wake(%(run_id)s, %(dispatch_lease_seconds)s, %(deployment)s)"
    ),
    # Through the store's SQLAlchemy connection, inside its transaction (a release of a holder's
    # or a task's leases, a forget, a recovery).
    "wake": (
        "SELECT o_task_id, o_run_id, o_payload, o_task_name "
        "FROM concurrency_slots_wake(%(slots)s, %(dispatch_lease_seconds)s, %(deployment)s)"
    ),
    "claim": (
        "SELECT concurrency_slots_claim(%(task_id)s, %(run_id)s, %(holder)s, %(lease_seconds)s, "
        "%(redelivered)s, %(done_seconds)s)"
    ),
    "renew": (
        "UPDATE concurrency_slots SET expires_at = concurrency_slots_now() + %(lease_seconds)s "
        "WHERE run_id = ANY(%(run_ids)s) AND expires_at > concurrency_slots_now() RETURNING run_id"
    ),
    "has_schema_version": "SELECT to_regproc('concurrency_slots_schema_version') IS NOT NULL",
    "schema_version": "SELECT concurrency_slots_schema_version()",
    "has_functions_digest": "SELECT to_regproc('concurrency_slots_functions_digest') IS NOT NULL",
    "functions_digest": "SELECT concurrency_slots_functions_digest()",
    # The statements that drop the store's functions in the schema they are created in.
    "drop_functions": (
        "SELECT 'DROP FUNCTION ' || p.oid::regproc || '(' || pg_get_function_identity_arguments(p.oid) || ')' "
        "FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace "
        "AND (starts_with(p.proname, 'concurrency_slots_') OR starts_with(p.proname, 'concurrency_waiters_'))"
    ),
    # Serialises workers that start at once and would race to create the functions.
    "schema_lock": "SELECT pg_advisory_xact_lock(hashtext('celery-caps-schema'))",
}
