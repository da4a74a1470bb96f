-- celery-caps: the PostgreSQL store's functions, schema version 1.
--
-- Each of a task's store steps in one round trip: admission (concurrency_slots_acquire), park
-- (concurrency_slots_park), a run's release and the hand-over it makes
-- (concurrency_slots_release_and_wake) and a woken copy's claim (concurrency_slots_claim).  They
-- take the steps, locks and lock order of the portable store (celery_caps/stores/sql/leases.py and
-- waitlist.py).  Every statement in a VOLATILE function takes a fresh READ COMMITTED snapshot, so
-- a count after a lock sees every competitor committed before it was granted.
--
-- The store creates them with its tables (caps_create_schema), or `celery caps schema --sql`
-- prints them with the tables' DDL for your own migrations.  Statements are separated by lines
-- holding only ';' after a body ($$ ... $$).

-- The store's clock, in seconds since the epoch (never a worker's).
CREATE OR REPLACE FUNCTION concurrency_slots_now() RETURNS double precision
LANGUAGE sql VOLATILE AS $$
    SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)
$$
;

-- The limit a slot's room is counted against: the operator's for the slot (celery caps limit),
-- else for its cap, else p_limit (its sentinel's, or the admitting task's).  Called in a statement
-- after the slot's lock, so that it reads every limit set before the lock was granted.  (A SQL
-- function with sub-selects is never inlined: admission, every capped run's first call, writes
-- the same two look-ups out instead of calling it.)
CREATE OR REPLACE FUNCTION concurrency_slots_limit(p_slot text, p_limit integer) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = p_slot),
        (SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = split_part(p_slot, ':', 1)),
        p_limit)
$$
;

-- Admission, first step: lock the sentinels of p_slots (sorted) in slot order, creating missing
-- ones with their limits.  ON CONFLICT DO UPDATE locks the existing row even when its WHERE is
-- false, so an unchanged limit costs a lock, not a new row version.
CREATE OR REPLACE FUNCTION concurrency_slots_lock_sentinels(p_slots text[], p_limits integer[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit)
    SELECT '', u.slot, '', '', u.slot_limit
    FROM unnest(p_slots, p_limits) AS u(slot, slot_limit) ORDER BY u.slot
    ON CONFLICT (run_id, slot) DO UPDATE SET slot_limit = EXCLUDED.slot_limit
    WHERE concurrency_slots.slot_limit IS DISTINCT FROM EXCLUDED.slot_limit;
END $$
;

-- Admission, second step (after the locks): the slots of p_slots without room for the task at
-- p_weights (its weight in each), sorted.  A slot the task holds already has room for it; else a
-- slot has room when the task's weight (at most the limit in force) fits the units its live
-- holders leave free (each task id once, at its largest weight), and the slot's oldest heavy
-- waiter of p_deployment (weight above 1 there, another task: one probe of the partial index
-- ix_concurrency_waiters_heavy, empty while nobody is heavy) does not need more than that: it
-- holds them.  The limit is read once (OFFSET 0 keeps the planner from copying its lookups into
-- every use), and the units are the live task ids' count unless one of them weighs more than 1.
CREATE OR REPLACE FUNCTION concurrency_slots_full(
    p_slots text[], p_limits integer[], p_weights integer[], p_task_id text, p_now double precision,
    p_deployment text
) RETURNS text[] LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (
        SELECT coalesce(array_agg(u.slot ORDER BY u.slot), '{}')
        FROM unnest(p_slots, p_limits, p_weights) AS u(slot, slot_limit, weight)
        CROSS JOIN LATERAL (SELECT coalesce(
            (SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = u.slot),
            (SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = split_part(u.slot, ':', 1)),
            u.slot_limit) AS lim OFFSET 0) m
        CROSS JOIN LATERAL (
            SELECT count(DISTINCT c.task_id) AS holders, coalesce(max(c.weight), 1) AS heaviest,
                coalesce(bool_or(c.task_id = p_task_id), false) AS mine
            FROM concurrency_slots c WHERE c.slot = u.slot AND c.expires_at > p_now OFFSET 0) h
        CROSS JOIN LATERAL (SELECT CASE WHEN h.heaviest = 1 THEN h.holders ELSE (
            SELECT sum(least(t.w, m.lim)) FROM (SELECT max(c.weight) AS w FROM concurrency_slots c
                WHERE c.slot = u.slot AND c.expires_at > p_now GROUP BY c.task_id) t) END AS units OFFSET 0) n
        WHERE NOT h.mine AND (least(u.weight, m.lim) > m.lim - n.units
            OR (SELECT least(x.weight, m.lim) FROM concurrency_waiters x
                WHERE x.slot = u.slot AND x.deployment = p_deployment AND x.weight > 1
                    AND x.dispatch_run_id IS NULL AND x.task_id <> p_task_id
                ORDER BY x.first_deferred_at, x.parked_at, x.task_id LIMIT 1) > m.lim - n.units));
END $$
;

-- Admission, last step: the run's leases (a run admitted again to a slot whose lease it let
-- expire, not swept yet, replaces that row).
CREATE OR REPLACE FUNCTION concurrency_slots_insert_leases(
    p_slots text[], p_weights integer[], p_task_id text, p_run_id text, p_holder text,
    p_lease_seconds double precision, p_task_name text, p_now double precision
) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at, weight)
    SELECT p_run_id, u.slot, p_task_id, p_holder, p_now + p_lease_seconds, p_task_name, p_now, u.weight
    FROM unnest(p_slots, p_weights) AS u(slot, weight)
    ON CONFLICT (run_id, slot) DO UPDATE SET task_id = EXCLUDED.task_id, holder = EXCLUDED.holder,
        expires_at = EXCLUDED.expires_at, task_name = EXCLUDED.task_name, acquired_at = EXCLUDED.acquired_at,
        weight = EXCLUDED.weight;
END $$
;

-- Admission: the full slots (none: the leases are taken).  p_weights: the task's weight in each
-- slot (NULL: 1 in every slot); p_deployment: the deployment whose heavy waiters may hold a slot.  The three steps above, written out
-- in one body: this is every capped run's first call, and a PL/pgSQL call within a call costs
-- about a fifth of an acquire on the server (park, which runs once per wait, calls them).
CREATE OR REPLACE FUNCTION concurrency_slots_acquire(
    p_slots text[], p_limits integer[], p_task_id text, p_run_id text, p_holder text,
    p_lease_seconds double precision, p_task_name text, p_weights integer[] DEFAULT NULL, p_deployment text DEFAULT ''
) RETURNS text[] LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_full text[];
    v_now double precision;
BEGIN
    p_weights := coalesce(p_weights, array_fill(1, ARRAY[cardinality(p_slots)]));
    INSERT INTO concurrency_slots (run_id, slot, task_id, holder, slot_limit)
    SELECT '', u.slot, '', '', u.slot_limit
    FROM unnest(p_slots, p_limits) AS u(slot, slot_limit) ORDER BY u.slot
    ON CONFLICT (run_id, slot) DO UPDATE SET slot_limit = EXCLUDED.slot_limit
    WHERE concurrency_slots.slot_limit IS DISTINCT FROM EXCLUDED.slot_limit;
    v_now := CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION);
    SELECT coalesce(array_agg(u.slot ORDER BY u.slot), '{}') INTO v_full
        FROM unnest(p_slots, p_limits, p_weights) AS u(slot, slot_limit, weight)
        CROSS JOIN LATERAL (SELECT coalesce(
            (SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = u.slot),
            (SELECT o.slot_limit FROM concurrency_limits o WHERE o.name = split_part(u.slot, ':', 1)),
            u.slot_limit) AS lim OFFSET 0) m
        CROSS JOIN LATERAL (
            SELECT count(DISTINCT c.task_id) AS holders, coalesce(max(c.weight), 1) AS heaviest,
                coalesce(bool_or(c.task_id = p_task_id), false) AS mine
            FROM concurrency_slots c WHERE c.slot = u.slot AND c.expires_at > v_now OFFSET 0) h
        CROSS JOIN LATERAL (SELECT CASE WHEN h.heaviest = 1 THEN h.holders ELSE (
            SELECT sum(least(t.w, m.lim)) FROM (SELECT max(c.weight) AS w FROM concurrency_slots c
                WHERE c.slot = u.slot AND c.expires_at > v_now GROUP BY c.task_id) t) END AS units OFFSET 0) n
        WHERE NOT h.mine AND (least(u.weight, m.lim) > m.lim - n.units
            OR (SELECT least(x.weight, m.lim) FROM concurrency_waiters x
                WHERE x.slot = u.slot AND x.deployment = p_deployment AND x.weight > 1
                    AND x.dispatch_run_id IS NULL AND x.task_id <> p_task_id
                ORDER BY x.first_deferred_at, x.parked_at, x.task_id LIMIT 1) > m.lim - n.units);
    IF cardinality(v_full) = 0 THEN
        INSERT INTO concurrency_slots (run_id, slot, task_id, holder, expires_at, task_name, acquired_at, weight)
        SELECT p_run_id, u.slot, p_task_id, p_holder, v_now + p_lease_seconds, p_task_name, v_now, u.weight
        FROM unnest(p_slots, p_weights) AS u(slot, weight)
        ON CONFLICT (run_id, slot) DO UPDATE SET task_id = EXCLUDED.task_id, holder = EXCLUDED.holder,
            expires_at = EXCLUDED.expires_at, task_name = EXCLUDED.task_name, acquired_at = EXCLUDED.acquired_at,
            weight = EXCLUDED.weight;
    END IF;
    RETURN v_full;
END $$
;

-- Park (the park strategy's admission), in ParkingStore.park's order: lock the sentinels; the
-- task's entry, waiting or dispatched, answers for it: 'waiting' if it is of the same task name
-- (a copy of the task, whatever slots it asks for now: a deploy may have renamed its cap or
-- changed its key), else 'id_in_use' (the id reused by another task), changing nothing;
-- admission's count and leases ('admitted'); without a payload, 'full'; a slot whose list holds
-- p_max_waiters entries, 'waitlist_full'; else the task's tombstone (if any) gives way to its
-- waiting entry, which keeps its count of dispatches, one row per slot at the store's clock,
-- without a limit (its slots' limits are their sentinels'), of deployment p_deployment, which
-- alone dispatches it ('parked').  p_fair_keys: its fair key in each slot of p_slots (NULL: none
-- there; the array NULL: none anywhere); in a slot where it has one, its round is the list's first
-- (of its listed entries of p_deployment) or, if later, the one after the key's last there (see
-- ParkingStore, "Fair shares"): two probes, each the first row of an index in order.  Elsewhere
-- its round is the list's last (0 in a list without fair keys), so that after a deploy that
-- removed fair_by new entries queue behind the rounds left: the last row of the list's part of
-- ix_concurrency_waiters_place, from the index alone (a tombstone's round counts too: it only
-- places the entry later than the listed ones' last round, never before one).
--
-- The hot-path functions below plan each statement once per session: these are key lookups whose
-- best plan never depends on the values, and re-planning a dozen of them costs more than running
-- them.  A generic plan is made from the statistics of its moment, though: a waiting list
-- analysed while empty would be scanned whole, and sorted, for ever after.  So no sequential or
-- bitmap scan and no full sort where an index gives the rows in order, and no JIT (those
-- disabled plans look expensive enough to be compiled, which costs far more than the call).
CREATE OR REPLACE FUNCTION concurrency_slots_park(
    p_slots text[], p_limits integer[], p_task_id text, p_run_id text, p_holder text,
    p_lease_seconds double precision, p_task_name text, p_payload bytea,
    p_first_deferred_at double precision, p_max_waiters integer, p_deployment text, p_weights integer[] DEFAULT NULL,
    p_fair_keys text[] DEFAULT NULL
) RETURNS text LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off
SET enable_sort = off SET jit = off AS $$
DECLARE
    v_full text[];
    v_now double precision;
    v_dispatches integer;
    v_same_name boolean;
BEGIN
    p_weights := coalesce(p_weights, array_fill(1, ARRAY[cardinality(p_slots)]));
    PERFORM concurrency_slots_lock_sentinels(p_slots, p_limits);
    -- (Every row of an entry has the same task name.)
    SELECT w.task_name IS NOT DISTINCT FROM p_task_name INTO v_same_name
    FROM concurrency_waiters w WHERE w.task_id = p_task_id AND w.done_until IS NULL LIMIT 1;
    IF FOUND THEN
        RETURN CASE WHEN v_same_name THEN 'waiting' ELSE 'id_in_use' END;
    END IF;
    v_now := concurrency_slots_now();
    v_full := concurrency_slots_full(p_slots, p_limits, p_weights, p_task_id, v_now, p_deployment);
    IF cardinality(v_full) = 0 THEN
        PERFORM concurrency_slots_insert_leases(p_slots, p_weights, p_task_id, p_run_id, p_holder, p_lease_seconds,
            p_task_name, v_now);
        RETURN 'admitted';
    END IF;
    IF p_payload IS NULL THEN
        RETURN 'full';
    END IF;
    -- The lists' lengths, as counted in concurrency_waitlists (never the lists themselves).
    IF EXISTS (
        SELECT 1 FROM concurrency_waitlists n WHERE n.slot = ANY(p_slots) AND n.entries >= p_max_waiters)
    THEN
        RETURN 'waitlist_full';
    END IF;
    WITH gone AS (
        DELETE FROM concurrency_waiters w WHERE w.task_id = p_task_id AND w.done_until IS NOT NULL
        RETURNING w.dispatches)
    SELECT coalesce(max(gone.dispatches), 0) INTO v_dispatches FROM gone;
    -- (The rounds read the snapshot of before this statement: never the rows it inserts.
    -- greatest() ignores a NULL: a key without an entry there takes the first round.)
    INSERT INTO concurrency_waiters
        (slot, task_id, slot_count, first_deferred_at, parked_at, task_name, deployment, payload, dispatches, weight,
         fair_key, fair_round)
    SELECT u.slot, p_task_id, cardinality(p_slots), p_first_deferred_at, v_now, p_task_name, p_deployment, p_payload,
        v_dispatches, u.weight, u.fair_key,
        CASE WHEN u.fair_key IS NULL THEN coalesce((SELECT l.fair_round FROM concurrency_waiters l
            WHERE l.slot = u.slot AND l.deployment = p_deployment ORDER BY l.fair_round DESC LIMIT 1), 0)
        ELSE greatest(
            coalesce((SELECT h.fair_round FROM concurrency_waiters h
                WHERE h.slot = u.slot AND h.deployment = p_deployment AND h.done_until IS NULL
                ORDER BY h.fair_round LIMIT 1), 0),
            (SELECT k.fair_round + 1 FROM concurrency_waiters k
                WHERE k.slot = u.slot AND k.deployment = p_deployment AND k.fair_key = u.fair_key
                    AND k.fair_key IS NOT NULL AND k.done_until IS NULL
                ORDER BY k.fair_round DESC LIMIT 1)) END
    FROM unnest(p_slots, p_weights, p_fair_keys) AS u(slot, weight, fair_key);
    -- The lists' counts last: only parks add to them, under the sentinels' locks.
    INSERT INTO concurrency_waitlists (slot, entries) SELECT u.slot, 1 FROM unnest(p_slots) AS u(slot)
    ON CONFLICT (slot) DO UPDATE SET entries = concurrency_waitlists.entries + 1;
    RETURN 'parked';
END $$
;

-- The wake of the waiters of deployment p_deployment that slots p_released (their leases just
-- deleted, or expired) can now admit, in the caller's transaction: the one waiting-list walk of
-- this store (the portable store's _wake_after_release and _dispatch, which PostgreSQL never
-- runs).  Lock the slots' sentinels; walk the waiters of p_deployment of the released slots in
-- their lists' order (round, first deferral, park time, task id: the lists merged, each one's own
-- order kept), streaming; consider each waiter once, at its first place, with all its rows (a
-- waiter of several slots: its other slots' sentinels locked then, SKIP LOCKED: no lock-order
-- deadlock, and one locked elsewhere passes it over); dispatch each whose every slot has room
-- (and still waits: a readmit or a forget may have taken it since the walk began); stop once
-- every released slot is full.  (Only the released slots' lists: a list of another slot, full,
-- could hold any number of rows of earlier rounds.)  Room is counted against each slot's limit
-- as its sentinel holds it now (read as the sentinels are locked), never a limit a waiter was
-- parked under; a slot without a limit counts as full.  A waiter has room in a slot when the
-- units its live holders take (each task id once, at its largest weight) leave its weight there
-- (at most the limit) free; the first waiter that does not fit a slot closes it for the rest of
-- the walk (v_full), so that a heavy waiter's room goes to nobody behind it (with every weight 1
-- a slot a waiter does not fit is full: nothing changes).
--
-- A release costs the waiters it passes over, never the length of the lists: up to c_merged
-- released lists are each read by a cursor of its own (an equality on the slot: its index
-- streams the list in order, unsorted), merged here by their heads.  A closed slot's list is read
-- no further, and once a slot closes the other lists are read on without the waiters of weight 1
-- it holds back (a global cap's release, the global slot full again, reads on through its
-- tenant's list for a waiter that needs the tenant alone, not through every tenant's waiters
-- behind the global slot).  More released lists (a recovery pass) are read by one cursor, sorted.
-- Other deployments' waiters are never read (every index with the deployment has it first or
-- right after the slot): they keep their place, for their own deployment's releases and
-- recoveries.  One row per woken waiter.
CREATE OR REPLACE FUNCTION concurrency_slots_wake(
    p_released text[], p_dispatch_lease_seconds double precision, p_deployment text
) RETURNS TABLE (
    o_task_id text, o_run_id text, o_payload bytea, o_task_name text
) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off
SET enable_sort = off SET jit = off AS $$
DECLARE
    -- Waiter rows read between checks that some released slot still has room.
    c_batch constant integer := 64;
    -- Released lists up to this many are read by a cursor each (see above).
    c_merged constant integer := 4;
    v_merged boolean := cardinality(p_released) <= c_merged;
    v_released text[] := p_released;
    v_released_slot text;
    v_waiting boolean := false;
    -- Slots found full, or closed, in this walk (only dispatches add leases while their sentinels
    -- are locked).
    v_full text[] := '{}';
    v_found_full text[];
    v_full_after text[];
    -- The locked slots and their limits, v_limit_values[i] of v_limit_slots[i]; slots whose
    -- sentinel was locked by another transaction (or is missing).
    v_limit_slots text[];
    v_limit_values integer[];
    v_unlockable text[] := '{}';
    -- The slots whose waiters (of weight 1) the cursors pass over, as last opened, and how many
    -- slots were full or unlockable then.
    v_held_back text[] := '{}';
    v_skips_when_opened integer := 0;
    l_slot text;
    l_limit integer;
    l_weight integer;
    v_now double precision;
    -- The waiter considered: its slots, their limits, its weights there.
    v_slots text[];
    v_limits integer[];
    v_weights integer[];
    -- Waiters of several slots considered without all their rows at that place: passed by at
    -- their other places.
    v_met text[] := '{}';
    v_read integer := 0;
    v_check_at integer := c_batch;
    -- The cursors: cursor i reads the list of c_slot[i] (NULL: of every released slot, sorted)
    -- from its head row h_*[i] on (h_done[i]: read to its end, or its slot closed).
    v_reopen boolean := true;
    v_cursor refcursor;
    c_cursors refcursor[] := '{}';
    c_slot text[] := '{}';
    h_done boolean[] := '{}';
    h_task text[] := '{}';
    h_slot text[] := '{}';
    h_count integer[] := '{}';
    h_name text[] := '{}';
    h_weight integer[] := '{}';
    h_round integer[] := '{}';
    h_first double precision[] := '{}';
    h_parked double precision[] := '{}';
    v_oldest integer;
    f_task text;
    f_count integer;
    f_name text;
    f_round integer;
    f_first double precision;
    f_parked double precision;
    -- A cursor's next row.
    n_task text;
    n_slot text;
    n_count integer;
    n_name text;
    n_weight integer;
    n_round integer;
    n_first double precision;
    n_parked double precision;
BEGIN
    SELECT coalesce(array_agg(l.slot), '{}'), coalesce(array_agg(l.slot_limit), '{}')
    INTO v_limit_slots, v_limit_values FROM (
        SELECT c.slot, c.slot_limit FROM concurrency_slots c
        WHERE c.run_id = '' AND c.slot = ANY(v_released) ORDER BY c.slot FOR UPDATE) l;
    -- Whether p_deployment has a waiter in a released slot: the first of each slot's list, in the
    -- walk's order.  (Each look below is of one slot, in the order of the one index that gives it
    -- without a sort: planned generically, a look at several slots at once, or in no order, may
    -- take an index of the deployment alone and read every waiter of the deployment.)
    FOREACH v_released_slot IN ARRAY v_released LOOP
        PERFORM 1 FROM concurrency_waiters x
        WHERE x.slot = v_released_slot AND x.deployment = p_deployment AND x.dispatch_run_id IS NULL
        ORDER BY x.fair_round, x.first_deferred_at, x.parked_at, x.task_id LIMIT 1;
        v_waiting := FOUND;
        EXIT WHEN v_waiting;
    END LOOP;
    IF NOT v_waiting THEN
        RETURN;
    END IF;
    -- The limits to count against, the operators' where set: read after the locks, in a statement
    -- of its own (a fresh snapshot), so that a limit set before they were granted is seen.
    v_limit_values := ARRAY(
        SELECT concurrency_slots_limit(u.slot, u.slot_limit)
        FROM unnest(v_limit_slots, v_limit_values) WITH ORDINALITY AS u(slot, slot_limit, n) ORDER BY u.n);
    v_now := concurrency_slots_now();
    IF v_merged THEN
        c_slot := v_released;
    ELSE
        c_slot := ARRAY[NULL::text];
    END IF;
    FOR i IN 1 .. cardinality(c_slot) LOOP
        c_cursors := c_cursors || NULL::refcursor;
        h_done := h_done || false;
        -- Before every row.
        h_round := h_round || -1;
        h_first := h_first || '-infinity'::double precision;
        h_parked := h_parked || '-infinity'::double precision;
        h_task := h_task || ''::text;
        h_slot := h_slot || NULL::text;
        h_count := h_count || 0;
        h_name := h_name || NULL::text;
        h_weight := h_weight || 0;
    END LOOP;
    LOOP
        IF v_reopen THEN
            -- (Re)open each cursor still reading at its head row, passing over the waiters of
            -- weight 1 that a closed slot holds back (a heavy one is considered: the other slots
            -- it does not fit close too).  A tombstone keeps its dispatch's run id: never read.
            v_reopen := false;
            v_held_back := v_full || v_unlockable;
            v_skips_when_opened := cardinality(v_held_back);
            FOR i IN 1 .. cardinality(c_slot) LOOP
                CONTINUE WHEN h_done[i];
                IF c_cursors[i] IS NOT NULL THEN
                    v_cursor := c_cursors[i];
                    CLOSE v_cursor;
                END IF;
                v_cursor := NULL;
                -- (The same query twice: an equality on the slot is what makes a generic plan
                -- stream one list in its index's order, unsorted.)
                IF c_slot[i] IS NOT NULL THEN
                    OPEN v_cursor FOR
                        SELECT w.task_id, w.slot, w.slot_count, w.task_name, w.weight, w.fair_round,
                            w.first_deferred_at, w.parked_at
                        FROM concurrency_waiters w
                        WHERE w.slot = c_slot[i] AND w.deployment = p_deployment AND w.dispatch_run_id IS NULL
                            AND (w.fair_round, w.first_deferred_at, w.parked_at, w.task_id)
                                >= (h_round[i], h_first[i], h_parked[i], h_task[i])
                            AND (cardinality(v_held_back) = 0 OR w.slot_count = 1 OR NOT EXISTS (
                                SELECT 1 FROM concurrency_waiters o
                                WHERE o.task_id = w.task_id AND o.slot = ANY(v_held_back) AND o.dispatch_run_id IS NULL)
                            OR EXISTS (
                                SELECT 1 FROM concurrency_waiters o
                                WHERE o.task_id = w.task_id AND o.weight > 1 AND o.dispatch_run_id IS NULL))
                        ORDER BY w.fair_round, w.first_deferred_at, w.parked_at, w.task_id;
                ELSE
                    OPEN v_cursor FOR
                        SELECT w.task_id, w.slot, w.slot_count, w.task_name, w.weight, w.fair_round,
                            w.first_deferred_at, w.parked_at
                        FROM concurrency_waiters w
                        WHERE w.slot = ANY(v_released) AND w.deployment = p_deployment AND w.dispatch_run_id IS NULL
                            AND (w.fair_round, w.first_deferred_at, w.parked_at, w.task_id)
                                >= (h_round[i], h_first[i], h_parked[i], h_task[i])
                            AND (cardinality(v_held_back) = 0 OR w.slot_count = 1 OR NOT EXISTS (
                                SELECT 1 FROM concurrency_waiters o
                                WHERE o.task_id = w.task_id AND o.slot = ANY(v_held_back) AND o.dispatch_run_id IS NULL)
                            OR EXISTS (
                                SELECT 1 FROM concurrency_waiters o
                                WHERE o.task_id = w.task_id AND o.weight > 1 AND o.dispatch_run_id IS NULL))
                        ORDER BY w.fair_round, w.first_deferred_at, w.parked_at, w.task_id;
                END IF;
                c_cursors[i] := v_cursor;
                FETCH v_cursor INTO n_task, n_slot, n_count, n_name, n_weight, n_round, n_first, n_parked;
                IF FOUND THEN
                    h_task[i] := n_task;
                    h_slot[i] := n_slot;
                    h_count[i] := n_count;
                    h_name[i] := n_name;
                    h_weight[i] := n_weight;
                    h_round[i] := n_round;
                    h_first[i] := n_first;
                    h_parked[i] := n_parked;
                ELSE
                    h_done[i] := true;
                    CLOSE v_cursor;
                END IF;
            END LOOP;
        END IF;
        -- The oldest head row, and the rows of the same waiter at the same place in the other
        -- lists (the oldest heads after it), each cursor moved on.
        v_oldest := NULL;
        FOR i IN 1 .. cardinality(c_slot) LOOP
            IF NOT h_done[i] AND (v_oldest IS NULL
                OR (h_round[i], h_first[i], h_parked[i], h_task[i])
                    < (h_round[v_oldest], h_first[v_oldest], h_parked[v_oldest], h_task[v_oldest])) THEN
                v_oldest := i;
            END IF;
        END LOOP;
        EXIT WHEN v_oldest IS NULL;
        f_task := h_task[v_oldest];
        f_count := h_count[v_oldest];
        f_name := h_name[v_oldest];
        f_round := h_round[v_oldest];
        f_first := h_first[v_oldest];
        f_parked := h_parked[v_oldest];
        v_slots := '{}';
        v_limits := '{}';
        v_weights := '{}';
        LOOP
            v_slots := v_slots || h_slot[v_oldest];
            v_limits := v_limits || coalesce(v_limit_values[array_position(v_limit_slots, h_slot[v_oldest])], 0);
            v_weights := v_weights || h_weight[v_oldest];
            v_cursor := c_cursors[v_oldest];
            FETCH v_cursor INTO n_task, n_slot, n_count, n_name, n_weight, n_round, n_first, n_parked;
            IF FOUND THEN
                h_task[v_oldest] := n_task;
                h_slot[v_oldest] := n_slot;
                h_count[v_oldest] := n_count;
                h_name[v_oldest] := n_name;
                h_weight[v_oldest] := n_weight;
                h_round[v_oldest] := n_round;
                h_first[v_oldest] := n_first;
                h_parked[v_oldest] := n_parked;
            ELSE
                h_done[v_oldest] := true;
                CLOSE v_cursor;
            END IF;
            v_read := v_read + 1;
            EXIT WHEN f_count = 1;
            v_oldest := NULL;
            FOR i IN 1 .. cardinality(c_slot) LOOP
                IF NOT h_done[i] AND h_task[i] = f_task AND (h_round[i], h_first[i], h_parked[i])
                        = (f_round, f_first, f_parked) THEN
                    v_oldest := i;
                END IF;
            END LOOP;
            EXIT WHEN v_oldest IS NULL;
        END LOOP;
        -- A waiter of several slots: considered once, at its first place in these lists; if not all
        -- its rows are there, it is passed by at its other places (v_met), and its rows of other
        -- slots (and of other rounds) are read now, their sentinels, if not locked yet, locked
        -- unless another transaction holds one (then it is passed over: that slot's release, or
        -- recovery, serves it).  (By its task id alone: its rows are all of p_deployment, one
        -- park made them; a deployment's index here would read all of the deployment's waiters.)
        IF f_count > 1 AND cardinality(v_met) > 0 AND f_task = ANY(v_met) THEN
            v_slots := NULL;
        ELSIF f_count > 1 THEN
            IF cardinality(v_slots) < f_count THEN
                v_met := v_met || f_task;
                FOR l_slot, l_weight IN
                    SELECT w.slot, w.weight FROM concurrency_waiters w
                    WHERE w.task_id = f_task AND w.dispatch_run_id IS NULL AND NOT (w.slot = ANY(v_slots))
                LOOP
                    IF NOT (l_slot = ANY(v_limit_slots)) AND NOT (l_slot = ANY(v_unlockable)) THEN
                        SELECT c.slot_limit INTO l_limit FROM concurrency_slots c
                        WHERE c.run_id = '' AND c.slot = l_slot FOR UPDATE SKIP LOCKED;
                        IF FOUND THEN
                            -- (Read after the lock, in a statement of its own, as above.)
                            l_limit := concurrency_slots_limit(l_slot, l_limit);
                            v_limit_slots := v_limit_slots || l_slot;
                            v_limit_values := v_limit_values || l_limit;
                        ELSE
                            v_unlockable := v_unlockable || l_slot;
                        END IF;
                    END IF;
                    v_slots := v_slots || l_slot;
                    v_limits := v_limits || coalesce(v_limit_values[array_position(v_limit_slots, l_slot)], 0);
                    v_weights := v_weights || l_weight;
                END LOOP;
            END IF;
        END IF;
        -- Dispatch it if all its slots are locked here and each has room (or is held by it
        -- already); a waiter passed over keeps its place.  A waiter needing a slot found full or
        -- closed is passed over without a count; unless it is heavy: the other slots it does not
        -- fit close too.
        IF v_slots IS NOT NULL AND cardinality(v_slots) = f_count AND NOT (v_slots && v_unlockable) THEN
            IF NOT (v_slots && v_full) OR 1 < ANY(v_weights) THEN
                -- Without room now (for this waiter: a slot it holds already has room for it), and
                -- full once it takes its place (so that no count is needed after the dispatch).
                SELECT coalesce(array_agg(u.slot) FILTER (
                           WHERE NOT u.held AND least(u.weight, u.slot_limit) > u.slot_limit - u.units), '{}'),
                       coalesce(array_agg(u.slot) FILTER (
                           WHERE u.units + (CASE WHEN u.held THEN 0 ELSE least(u.weight, u.slot_limit) END)
                               >= u.slot_limit), '{}')
                INTO v_found_full, v_full_after
                FROM (
                    SELECT s.slot, s.slot_limit, s.weight, coalesce(h.held, false) AS held,
                        coalesce(h.units, 0) AS units
                    FROM unnest(v_slots, v_limits, v_weights) AS s(slot, slot_limit, weight)
                    CROSS JOIN LATERAL (
                        SELECT bool_or(t.mine) AS held, sum(least(t.w, s.slot_limit)) AS units
                        FROM (SELECT max(c.weight) AS w, bool_or(c.task_id = f_task) AS mine FROM concurrency_slots c
                              WHERE c.slot = s.slot AND c.expires_at > v_now GROUP BY c.task_id) t) h) u;
                v_full := v_full || v_found_full;
            END IF;
            IF NOT (v_slots && v_full) THEN
                o_run_id := md5(random()::text || clock_timestamp()::text || f_task);
                -- The entry answers for the task until a copy claims it (or the deadline passes).
                UPDATE concurrency_waiters w SET dispatch_run_id = o_run_id,
                    dispatch_expires_at = v_now + p_dispatch_lease_seconds, dispatches = w.dispatches + 1
                WHERE w.task_id = f_task AND w.dispatch_run_id IS NULL;
                IF FOUND THEN
                    o_task_id := f_task;
                    o_task_name := f_name;
                    PERFORM concurrency_slots_insert_leases(v_slots, v_weights, f_task, o_run_id, 'caps-dispatch',
                        p_dispatch_lease_seconds, f_name, v_now);
                    SELECT w.payload INTO o_payload FROM concurrency_waiters w WHERE w.task_id = f_task LIMIT 1;
                    RETURN NEXT;
                    -- The slots this dispatch filled.
                    v_full := v_full || v_full_after;
                END IF;
            END IF;
        END IF;
        -- Stop once every released slot is known full: the room this release freed is handed out
        -- (other slots gain room only by their own releases, or by expiry, which recovery serves).
        EXIT WHEN v_released <@ v_full;
        -- Every c_batch rows, stop once every released slot is full or closed.  (Units not capped
        -- at the limit: "units >= limit" comes out the same either way.)
        IF v_read >= v_check_at THEN
            EXIT WHEN NOT EXISTS (
                SELECT 1 FROM unnest(v_limit_slots, v_limit_values) AS u(slot, slot_limit)
                WHERE u.slot = ANY(v_released) AND NOT (u.slot = ANY(v_full)) AND (
                    SELECT coalesce(sum(t.w), 0) FROM (
                        SELECT max(c.weight) AS w FROM concurrency_slots c
                        WHERE c.slot = u.slot AND c.expires_at > v_now GROUP BY c.task_id) t) < u.slot_limit);
            v_check_at := v_read + c_batch;
        END IF;
        -- A slot closed (or found locked elsewhere) since the cursors were opened: its own list is
        -- read no further, and the others are read again from their heads without the waiters it
        -- holds back.  (One cursor of many lists, sorted, is opened again only for a slot outside
        -- them, as a tenant's waiters' global slot in a recovery pass over the tenants' lists.)
        IF cardinality(v_full) + cardinality(v_unlockable) > v_skips_when_opened THEN
            IF v_merged THEN
                FOR i IN 1 .. cardinality(c_slot) LOOP
                    IF NOT h_done[i] AND c_slot[i] = ANY(v_full) THEN
                        h_done[i] := true;
                        v_cursor := c_cursors[i];
                        CLOSE v_cursor;
                    END IF;
                END LOOP;
                v_reopen := true;
            ELSIF EXISTS (
                SELECT 1 FROM unnest(v_full || v_unlockable) AS s(slot)
                WHERE NOT (s.slot = ANY(v_released)) AND NOT (s.slot = ANY(v_held_back))) THEN
                v_reopen := true;
            ELSE
                v_skips_when_opened := cardinality(v_full) + cardinality(v_unlockable);
            END IF;
        END IF;
    END LOOP;
    FOR i IN 1 .. cardinality(c_slot) LOOP
        IF NOT h_done[i] THEN
            v_cursor := c_cursors[i];
            CLOSE v_cursor;
        END IF;
    END LOOP;
END $$
;

-- A run's release and the wake of the waiters of deployment p_deployment its slots can now admit,
-- in one round trip.  One row per woken waiter (o_task_id NULL when none), each with the number
-- of leases deleted.
--
-- It commits without waiting for its WAL record to reach the disk (synchronous_commit off for
-- its transaction only; admission, park, claim and renew stay durable): the flush is most of a
-- commit's wait after the connection sat idle through a task.  A database crash can lose the last
-- fraction of a second of such commits, never a parked task: a lost release leaves its lease to
-- expire (fewer admissions, never more), a lost hand-over leaves its waiter in the list to be
-- handed over again (its task may then run twice, as one task id: at-least-once).
CREATE OR REPLACE FUNCTION concurrency_slots_release_and_wake(
    p_run_id text, p_dispatch_lease_seconds double precision, p_deployment text
) RETURNS TABLE (
    o_deleted integer, o_task_id text, o_run_id text, o_payload bytea, o_task_name text
) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off
SET enable_sort = off SET jit = off AS $$
DECLARE
    v_released text[];
    v_any boolean := false;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH gone AS (DELETE FROM concurrency_slots c WHERE c.run_id = p_run_id RETURNING c.slot)
    SELECT count(*), coalesce(array_agg(DISTINCT gone.slot), '{}') INTO o_deleted, v_released FROM gone;
    IF o_deleted > 0 THEN
        FOR o_task_id, o_run_id, o_payload, o_task_name IN
            SELECT w.o_task_id, w.o_run_id, w.o_payload, w.o_task_name
            FROM concurrency_slots_wake(v_released, p_dispatch_lease_seconds, p_deployment) w
        LOOP
            v_any := true;
            RETURN NEXT;
        END LOOP;
    END IF;
    IF NOT v_any THEN
        o_task_id := NULL;
        o_run_id := NULL;
        o_payload := NULL;
        o_task_name := NULL;
        RETURN NEXT;
    END IF;
END $$
;

-- A claimed entry leaves the list: a tombstone of p_holder's claim until p_done_until if it was
-- dispatched p_minimum times or more (copies of its other dispatches may be on their way; 0:
-- always), else deleted; a tombstone keeps no payload (the task's arguments).  Its slots' list
-- counts go down by one, last (see concurrency_waitlists).
CREATE OR REPLACE FUNCTION concurrency_waiters_settle(
    p_task_id text, p_run_id text, p_holder text, p_done_until double precision, p_minimum integer
) RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_slots text[];
BEGIN
    WITH kept AS (
        UPDATE concurrency_waiters w SET done_until = p_done_until, claimed_by = p_holder, payload = ''::bytea
        WHERE w.task_id = p_task_id AND w.dispatch_run_id = p_run_id AND w.done_until IS NULL
            AND w.dispatches >= p_minimum
        RETURNING w.slot),
    gone AS (
        DELETE FROM concurrency_waiters w
        WHERE w.task_id = p_task_id AND w.dispatch_run_id = p_run_id AND w.done_until IS NULL
            AND w.dispatches < p_minimum
        RETURNING w.slot)
    SELECT array_agg(settled.slot) INTO v_slots
    FROM (SELECT kept.slot FROM kept UNION ALL SELECT gone.slot FROM gone) AS settled;
    IF v_slots IS NULL THEN
        RETURN;
    END IF;
    -- The count rows in slot order, the order a park adds to them in: a claim holding one of two
    -- slots' rows while a park of the same two slots holds the other would wait for each other.
    PERFORM 1 FROM concurrency_waitlists n WHERE n.slot = ANY(v_slots) ORDER BY n.slot FOR UPDATE;
    UPDATE concurrency_waitlists n SET entries = n.entries - 1 WHERE n.slot = ANY(v_slots);
END $$
;

-- A copy's claim in one round trip, ParkingStore.claim's decision: lock the task's leases of the
-- dispatch run, then read them by the store's clock.  All live, and each a dispatch lease or
-- p_holder's (the same claim again, after its reply was lost): they become (stay) the run's, the
-- entry settles ('run'), unless a limit was cut since the dispatch (see below).  A live lease
-- held by another run: another copy claimed first ('admit' if redelivered, else 'end').
-- Otherwise what is left of the dispatch's leases goes, and the task's entry (locked) decides.
CREATE OR REPLACE FUNCTION concurrency_slots_claim(
    p_task_id text, p_run_id text, p_holder text, p_lease_seconds double precision, p_redelivered boolean,
    p_done_seconds double precision
) RETURNS text LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET enable_bitmapscan = off
SET enable_sort = off SET jit = off AS $$
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
    v_now := concurrency_slots_now();
    SELECT count(*), count(*) FILTER (WHERE c.expires_at > v_now),
        count(*) FILTER (WHERE c.expires_at > v_now AND c.holder = 'caps-dispatch'),
        count(*) FILTER (WHERE c.expires_at > v_now AND c.holder IN ('caps-dispatch', p_holder))
    INTO v_leases, v_live, v_live_dispatch, v_live_claimable
    FROM concurrency_slots c WHERE c.run_id = p_run_id AND c.task_id = p_task_id;
    -- (Not a dispatch in a slot whose live holders take more units than its limit now, itself one
    -- of them: a limit cut since the dispatch.  Each task id counts once, at its largest weight,
    -- at most the limit.  Its leases go as below, and its copy goes through admission.)
    IF v_live > 0 AND v_live = v_leases AND v_live_claimable = v_live AND NOT (
        v_live_dispatch = v_live AND EXISTS (
            SELECT 1 FROM concurrency_slots l JOIN concurrency_slots s ON s.run_id = '' AND s.slot = l.slot
            CROSS JOIN LATERAL (SELECT concurrency_slots_limit(l.slot, s.slot_limit) AS lim) m
            WHERE l.run_id = p_run_id AND l.task_id = p_task_id
              AND m.lim < (
                  SELECT sum(least(t.w, m.lim)) FROM (
                      SELECT max(c.weight) AS w FROM concurrency_slots c
                      WHERE c.slot = l.slot AND c.expires_at > v_now GROUP BY c.task_id) t))) THEN
        UPDATE concurrency_slots c SET holder = p_holder, expires_at = v_now + p_lease_seconds
        WHERE c.run_id = p_run_id AND c.task_id = p_task_id;
        PERFORM concurrency_waiters_settle(p_task_id, p_run_id, p_holder, v_now + p_done_seconds, 2);
        RETURN 'run';
    END IF;
    IF v_live > v_live_dispatch THEN
        RETURN CASE WHEN p_redelivered THEN 'admit' ELSE 'end' END;
    END IF;
    DELETE FROM concurrency_slots c
    WHERE c.run_id = p_run_id AND c.task_id = p_task_id AND c.holder = 'caps-dispatch';
    PERFORM 1 FROM concurrency_waiters w WHERE w.task_id = p_task_id FOR UPDATE;
    SELECT w.dispatch_run_id, w.done_until IS NOT NULL, w.claimed_by INTO v_dispatch, v_done, v_claimed_by
    FROM concurrency_waiters w WHERE w.task_id = p_task_id LIMIT 1;
    IF NOT FOUND THEN
        RETURN 'admit';
    END IF;
    IF v_done THEN
        -- Only a copy of the dispatch the tombstone records goes on: redelivered (its run may
        -- have died), or this very claim retried (its leases expired meanwhile).  A copy of any
        -- other dispatch ends, redelivered or not.
        RETURN CASE WHEN v_dispatch = p_run_id AND (p_redelivered OR v_claimed_by IS NOT DISTINCT FROM p_holder)
            THEN 'admit' ELSE 'end' END;
    END IF;
    IF v_dispatch IS DISTINCT FROM p_run_id THEN
        RETURN 'end';
    END IF;
    -- No lease is left to tell a duplicate copy of this dispatch that the task was taken: the
    -- tombstone does.
    PERFORM concurrency_waiters_settle(p_task_id, p_run_id, p_holder, v_now + p_done_seconds, 0);
    RETURN 'admit';
END $$
;

-- Last, so that its presence says every function above is there: the schema version these
-- functions belong to.  A store finding an older one creates them again; see docs/stores.md.
CREATE OR REPLACE FUNCTION concurrency_slots_schema_version() RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT 1
$$
;
