-- celery-caps: the waiting list of the park strategy, helpers shared by the parking
-- scripts.  redis.py prepends redis_common.lua and then this file to each of them.
--
-- Keys (the layout is described in redis.py's module docstring):
--   P:slot:{E}:waiters  ZSET  one member per task waiting for the slot (dispatched or
--                             not): score = first-deferral time, or for an entry with a fair
--                             key in the slot its round there less FAIR_OFFSET (negative,
--                             below every time); member = park time (fixed-width text of
--                             Redis TIME), the signature of the task's slot names and
--                             deployment (below), then the task id; so the set's own order
--                             (score, then member bytes) is the waiting order: round (fair
--                             entries first), first deferral, then park time (unique per park)
--   P:waiting           HASH  task id -> MessagePack record (below), waiting or dispatched;
--                             task id NUL 'weights' -> its weights (see weights_field);
--                             task id NUL 'fair' -> its fair keys and rounds (see fair_field)
--   P:payloads          HASH  task id -> its message (opaque bytes)
--   P:waitlists         SET   the slot names whose waiters set is not empty
--   P:dispatches        ZSET  dispatched task id -> dispatch deadline
--   P:deployments       HASH  task id -> the deployment of the handle that parked the entry, for
--                             entries of a deployment other than '' (an entry without one is of
--                             deployment '')
--   P:slot:{E}:waiters:<deployment>  ZSET  the members of the slot's waiting list that are of
--                             that (non-empty) deployment, as they are in P:slot:{E}:waiters
--                             (which holds every deployment's)
--   P:slot:{E}:heavy[:<deployment>]  ZSET  the waiting entries of weight above 1 in the slot (see
--                             heavy_key in redis_common.lua)
--   P:slot:{E}:fair[:<deployment>]  HASH  fair key -> '<count> <max round>' of the listed entries
--                             (waiting or dispatched) of that deployment ('' without the suffix)
--                             with that fair key in the slot (see fair_hash_key)
--   P:done:<task id>    STRING  a tombstone: MessagePack { the claimed (or last) dispatch's run id,
--                             the holder that claimed it ('' if forgotten), the entry's count of
--                             dispatches }, expiring (PEXPIRE) after the store's done_seconds
-- (P:deployments and the deployments' lists are derived from the prefix here, as the slots'
-- keys are.)
--
-- Parking scripts take the same first KEYS: limits, runs, expiry, waiting, payloads,
-- waitlists, dispatches.  Every script that hands entries over (dispatches them) takes the
-- deployment of the store's handle in ARGV, and dispatches only entries of that deployment
-- (see handle_lists): the others are passed over and keep their place.

-- The holder of a dispatch lease until its task claims it.
local DISPATCH_HOLDER = 'caps-dispatch'

-- A record: { first deferral (text), park time (text), task name ('' if none), dispatch
-- run id ('' while waiting), dispatch deadline (text, '' while waiting), dispatches so far
-- (with leases or without), signature, slot name, slot name, ... } (names sorted).  It holds
-- no limit: a waiter is dispatched against its slots' limits as the limits hash holds them
-- then (the sentinels, written by every admission), never the limits it parked with.  The
-- signature (16 hex digits of the SHA-1 of the slot names and the entry's deployment, see
-- slots_signature) lets a release pass over waiters needing a slot it found full without
-- reading their records, every waiter of a slot sharing its limit; and waiters that share a
-- signature share their deployment (see without_deployment_test).
local RECORD_FIRST_DEFERRAL = 1
local RECORD_PARKED = 2
local RECORD_TASK_NAME = 3
local RECORD_RUN_ID = 4
local RECORD_DEADLINE = 5
local RECORD_DISPATCHES = 6
local RECORD_SIGNATURE = 7
local RECORD_SLOTS = 8

-- Dispatches of a task with leases before recovery gives up holding its slots for it, and the
-- deadline of its dispatches without leases after that: twice as long at each miss, up to 64
-- dispatch leases (celery_caps.stores.base's LEASED_DISPATCHES and unleased_dispatch_seconds).
local LEASED_DISPATCHES = 2
local function unleased_dispatch_seconds(dispatches, lease_seconds)
  return lease_seconds * 2 ^ math.min(math.max(dispatches - 1, 0), 6)
end

-- Waiters fetched at a time while walking a slot's waiting list.
local WALK_CHUNK = 128

local function waitlist_keys()
  return { limits = KEYS[1], waiting = KEYS[4], payloads = KEYS[5], waitlists = KEYS[6], dispatches = KEYS[7] }
end

local function done_key(prefix, task_id)
  return prefix .. ':done:' .. task_id
end

local function deployments_key(prefix)
  return prefix .. ':deployments'
end

-- The waiting list of `slot` that holds the entries of (non-empty) `deployment` alone.
local function deployment_waiters_key(prefix, slot, deployment)
  return slot_key(prefix, slot, 'waiters:' .. deployment)
end

-- Fair shares (ParkingStore's "Fair shares"): an entry parked with a fair key k in slot E has a
-- round there, max(head, last + 1) (head: the smallest round of E's listed entries of the
-- handle's deployment, 0 if none; last: the largest round of those with key k, none: head), and
-- its member's score in E's lists is round - FAIR_OFFSET: negative, so below every first-deferral
-- time (>= 0), and a list's fair entries come first, by round (then by member: park time).  An
-- entry without a fair key in E has round 0 there and its first-deferral time as score, as
-- before; so a score below 0 is a round, never a time: whatever reads a score as a first deferral
-- reads a fair entry's from its record instead.  (Rounds stay far below 2^40: one per park.)
local FAIR_OFFSET = 2 ^ 40

-- An entry's fair keys live beside its record, as its weights do: task id NUL 'fair' ->
-- MessagePack { slot name = { fair key, round } } of the slots where it has one; absent for an
-- entry without any (and for entries parked before fair shares existed).
local function fair_field(task_id)
  return task_id .. '\0fair'
end

-- P:slot:{E}:fair (deployment ''), P:slot:{E}:fair:<deployment>: fair key -> '<count> <max
-- round>' of the slot's listed entries of that deployment with that key (waiting or dispatched):
-- a park reads a key's last round here in O(1).  +1 (and the max) at park, -1 where the entry
-- leaves the slot's list (remove_waiter), the field deleted at 0.  The max is not lowered when
-- the entry that had it leaves first: a stale max only places the key's next entry later.
local function fair_hash_key(prefix, slot, deployment)
  return slot_key(prefix, slot, deployment == '' and 'fair' or 'fair:' .. deployment)
end

local function fair_score(round)
  return score_text(round - FAIR_OFFSET)
end

-- The count and max round of a fair hash value.
local function fair_counts(value)
  local count, top = string.match(value, '^(%d+) (%d+)$')
  return tonumber(count), tonumber(top)
end

-- A record as written by park, with its slot names from RECORD_SLOTS on, the entry's weights
-- (nil: 1 in every slot), kept beside it under weights_field(task id), and its fair keys (nil:
-- none), kept under fair_field(task id), all three read in one command.  A record may also
-- hold a number after each name (the limit it parked with, as records parked by releases of
-- the store that kept limits do): those are dropped here, so every reader sees names only,
-- and the record is written back without them at its next dispatch.
local function read_waiter(waiting_key, task_id)
  local found = redis.call('HMGET', waiting_key, task_id, weights_field(task_id), fair_field(task_id))
  local packed, weights = found[1], unpack_weights(found[2])
  if not packed then
    return nil
  end
  local fair = found[3] and cmsgpack.unpack(found[3]) or nil
  local record = cmsgpack.unpack(packed)
  if type(record[RECORD_SLOTS + 1]) == 'number' then
    local names = {}
    for i = RECORD_SLOTS, #record, 2 do
      names[#names + 1] = record[i]
    end
    for i = #record, RECORD_SLOTS, -1 do
      record[i] = nil
    end
    for _, name in ipairs(names) do
      record[#record + 1] = name
    end
  end
  return record, weights, fair
end

local function write_waiter(waiting_key, task_id, record)
  redis.call('HSET', waiting_key, task_id, cmsgpack.pack(record))
end

local function is_waiting(record)
  return record[RECORD_RUN_ID] == ''
end

local function record_slot_names(record)
  local names = {}
  for i = RECORD_SLOTS, #record do
    names[#names + 1] = record[i]
  end
  return names
end

local function waiter_task_id(member)
  return string.sub(member, PARKED_WIDTH + SIGNATURE_WIDTH + 1)
end

local function waiter_signature(member)
  return string.sub(member, PARKED_WIDTH + 1, PARKED_WIDTH + SIGNATURE_WIDTH)
end

local function waiter_member(record, task_id)
  return record[RECORD_PARKED] .. record[RECORD_SIGNATURE] .. task_id
end

-- The signature of an entry: its slot `names` (sorted) and its `deployment`.  Names hold no
-- NUL and are never empty, so the two NULs before a deployment mark where it starts; an entry
-- of deployment '' has the signature of its names alone, as entries parked before deployments
-- existed have.
local function slots_signature(names, deployment)
  local text = table.concat(names, '\0')
  if deployment ~= '' then
    text = text .. '\0\0' .. deployment
  end
  return string.sub(redis.sha1hex(text), 1, SIGNATURE_WIDTH)
end

-- Whether an entry has no deployment (is of deployment ''): a test taking the entry's task id
-- and, if known, its waiters member; or nil when no entry has one (every entry passes).  Given
-- a member, the test reads the deployments hash once per signature, since the entries that
-- share one share their deployment.
local function without_deployment_test(prefix)
  local key = deployments_key(prefix)
  if redis.call('EXISTS', key) == 0 then
    return nil
  end
  local by_signature = {}
  return function(task_id, member)
    local signature = member and waiter_signature(member)
    local passes = signature and by_signature[signature]
    if passes == nil then
      passes = redis.call('HEXISTS', key, task_id) == 0
      if signature then
        by_signature[signature] = passes
      end
    end
    return passes
  end
end

-- The waiting lists a handle of deployment `own` hands entries over from, as { key = a
-- function of a slot name giving its list's key, test = nil or a test that each entry read
-- from them must pass, owns = a function of a task id: whether its entry is of `own` }.  A
-- named deployment walks its own lists, which hold its entries alone: it never reads another
-- deployment's waiters.  Deployment '' walks the lists of every entry, testing each unless no
-- entry has a deployment (then it pays nothing more per waiter than a store without
-- deployments).
local function handle_lists(prefix, own)
  if own ~= '' then
    return {
      key = function(slot) return deployment_waiters_key(prefix, slot, own) end,
      owns = function(task_id) return redis.call('HGET', deployments_key(prefix), task_id) == own end,
    }
  end
  local test = without_deployment_test(prefix)
  return {
    key = function(slot) return slot_key(prefix, slot, 'waiters') end,
    test = test,
    owns = function(task_id) return test == nil or test(task_id) end,
  }
end

-- Whether byte string a sorts before b (Lua's own '<' follows the server's locale).
local function bytes_less(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return #a < #b
end

-- Whether waiting-list entry a ({member, score}) comes before b: the older first, then by the
-- member's bytes (the order of a sorted set's members of one score).
local function entry_before(a, b)
  if a.score ~= b.score then
    return a.score < b.score
  end
  return bytes_less(a.member, b.member)
end

-- The deployment of an entry ('' for none).
local function entry_deployment(prefix, task_id)
  return redis.call('HGET', deployments_key(prefix), task_id) or ''
end

-- The score of the first entry (the last one, with `reverse`) of the list at `key` that `test`
-- passes (nil: every entry; see handle_lists), or nil if none does.  Without a test it reads one
-- member; with one, it passes over the entries of other deployments.
local function first_listed_score(key, test, reverse)
  local chunk = test and WALK_CHUNK or 1
  local rank = 0
  while true do
    local found = redis.call(reverse and 'ZREVRANGE' or 'ZRANGE', key, rank, rank + chunk - 1, 'WITHSCORES')
    for i = 1, #found, 2 do
      if test == nil or test(waiter_task_id(found[i]), found[i]) then
        return tonumber(found[i + 1])
      end
    end
    if #found < 2 * chunk then
      return nil
    end
    rank = rank + chunk
  end
end

-- The head of the list at `key` (the handle's list of a slot, entries of other deployments
-- failing `test`; the caller found no entry without a fair key in it): the smallest round of its
-- entries, 0 if it has none.  One read of O(log n) (with a test: plus the other deployments'
-- entries at the head).
local function fair_head(key, test)
  local lowest = first_listed_score(key, test, false)
  if lowest == nil or lowest >= 0 then
    return 0
  end
  return lowest + FAIR_OFFSET
end

-- The round in `slot` of a new entry of `deployment` with fair key `fair_key` (`list`: the
-- handle's list of the slot, `test` its test, as handle_lists gives them), counted in the slot's
-- fair hash at once (the caller lists the entry with it).
local function take_fair_round(prefix, slot, deployment, list, test, fair_key)
  local key = fair_hash_key(prefix, slot, deployment)
  local round = fair_head(list, test)
  local count = 0
  local kept = redis.call('HGET', key, fair_key)
  if kept then
    local top
    count, top = fair_counts(kept)
    round = math.max(round, top + 1)
  end
  redis.call('HSET', key, fair_key, string.format('%d %d', count + 1, round))
  return round
end

-- An entry of `deployment` with fair keys `fair` (nil: none; see fair_field) leaves the lists of
-- its slots (`record`'s): each key's count goes down, its field deleted at 0.
local function leave_fair(prefix, record, fair, deployment)
  if fair == nil then
    return
  end
  for i = RECORD_SLOTS, #record do
    local kept = fair[record[i]]
    if kept then
      local key = fair_hash_key(prefix, record[i], deployment)
      local value = redis.call('HGET', key, kept[1])
      if value then
        local count, top = fair_counts(value)
        if count <= 1 then
          redis.call('HDEL', key, kept[1])
        else
          redis.call('HSET', key, kept[1], string.format('%d %d', count - 1, top))
        end
      end
    end
  end
end

-- Put a waiting entry of `deployment` in (`add`), or take it out of, the heavy entries of each
-- slot where its weight is above 1 (see heavy_key): an entry is there while it waits, neither
-- dispatched nor settled.  Nothing to do for an entry of weight 1 everywhere (`weights` nil).
local function mark_heavy(prefix, task_id, record, weights, deployment, add)
  if weights == nil then
    return
  end
  local member = waiter_member(record, task_id)
  for i = RECORD_SLOTS, #record do
    local weight = weights[record[i]]
    if weight then
      local key = heavy_key(prefix, record[i], deployment)
      if add then
        redis.call('ZADD', key, record[RECORD_FIRST_DEFERRAL], heavy_member(member, weight))
      else
        redis.call('ZREM', key, heavy_member(member, weight))
      end
    end
  end
end

-- Take an entry off the waiting list: its member in each slot's list (and its deployment's),
-- its record, weights and fair keys (and its place among the heavy entries, its counts in the
-- fair hashes), its payload, its dispatch, its deployment.  The one place where an entry leaves
-- the slots' lists.
local function remove_waiter(prefix, keys, task_id, record, weights, fair)
  local member = waiter_member(record, task_id)
  local deployment = redis.call('HGET', deployments_key(prefix), task_id)
  if is_waiting(record) then
    mark_heavy(prefix, task_id, record, weights, deployment or '', false)
  end
  leave_fair(prefix, record, fair, deployment or '')
  for i = RECORD_SLOTS, #record do
    local waiters_key = slot_key(prefix, record[i], 'waiters')
    redis.call('ZREM', waiters_key, member)
    if deployment then
      redis.call('ZREM', deployment_waiters_key(prefix, record[i], deployment), member)
    end
    if redis.call('EXISTS', waiters_key) == 0 then
      redis.call('SREM', keys.waitlists, record[i])
    end
  end
  redis.call('HDEL', keys.waiting, task_id, weights_field(task_id), fair_field(task_id))
  redis.call('HDEL', keys.payloads, task_id)
  redis.call('ZREM', keys.dispatches, task_id)
  if deployment then
    redis.call('HDEL', deployments_key(prefix), task_id)
  end
end

-- A dispatched entry leaves the list (claimed by `claimer`, or forgotten: claimer '').  With
-- `tombstone`, a record of it stays for `done_milliseconds`, so that copies of its dispatches
-- still on their way end rather than run the task again; it expires by itself, and nothing
-- ever walks it.
local function settle_waiter(prefix, keys, task_id, record, weights, fair, tombstone, done_milliseconds, claimer)
  remove_waiter(prefix, keys, task_id, record, weights, fair)
  if tombstone and done_milliseconds > 0 then
    local done = cmsgpack.pack({ record[RECORD_RUN_ID], claimer, record[RECORD_DISPATCHES] })
    redis.call('SET', done_key(prefix, task_id), done, 'PX', done_milliseconds)
  end
end

-- The tombstone at `key` as { run id, claimer, dispatches }, or nil.
local function read_done(key)
  local packed = redis.call('GET', key)
  if not packed then
    return nil
  end
  return cmsgpack.unpack(packed)
end

-- Delete what is left of dispatch `run_id` of `task_id`: its dispatch leases, never a run's
-- (once claimed, the holder is the claiming worker).  Returns the slot names freed (empty if
-- none: a readmit has no leases).
local function delete_dispatch(prefix, runs_key, expiry_key, task_id, run_id)
  local run = read_run(runs_key, run_id)
  if run == nil or run[1] ~= task_id or run[2] ~= DISPATCH_HOLDER then
    return {}
  end
  delete_run(prefix, runs_key, expiry_key, run_id)
  local freed = {}
  for i = 3, #run do
    freed[#freed + 1] = run[i]
  end
  return freed
end

-- Fresh run ids for the dispatches of one script: `nonce` (unique per call, from the caller:
-- a script's own random numbers repeat) followed by a counter, skipping any in use.
local function run_id_source(runs_key, nonce)
  local sequence = 0
  return function()
    while true do
      sequence = sequence + 1
      local run_id = nonce .. string.format('%08x', sequence)
      if redis.call('HEXISTS', runs_key, run_id) == 0 then
        return run_id
      end
    end
  end
end

-- Dispatch a waiting entry (of `weights`) until now + `lease_seconds`: with leases (a run under
-- its own task id holding all its slots at its weights, holder DISPATCH_HOLDER, so no newer task
-- takes the room) or without (a readmit: its copy goes through admission again).  Appends it to
-- `woken` as task id, run id, task name, payload, '1' for a readmit else '0'.
local function dispatch_entry(prefix, runs_key, expiry_key, keys, task_id, record, weights, run_id, now,
    lease_seconds, with_leases, woken)
  if with_leases then
    write_run(prefix, runs_key, expiry_key, task_id, run_id, DISPATCH_HOLDER, record_slot_names(record), lease_seconds,
      now, record[RECORD_TASK_NAME], weights)
  end
  if weights ~= nil and is_waiting(record) then
    mark_heavy(prefix, task_id, record, weights, entry_deployment(prefix, task_id), false)
  end
  record[RECORD_RUN_ID] = run_id
  record[RECORD_DEADLINE] = score_text(now + lease_seconds)
  record[RECORD_DISPATCHES] = record[RECORD_DISPATCHES] + 1
  write_waiter(keys.waiting, task_id, record)
  redis.call('ZADD', keys.dispatches, record[RECORD_DEADLINE], task_id)
  woken[#woken + 1] = task_id
  woken[#woken + 1] = run_id
  woken[#woken + 1] = record[RECORD_TASK_NAME]
  woken[#woken + 1] = redis.call('HGET', keys.payloads, task_id) or ''
  woken[#woken + 1] = with_leases and '0' or '1'
end

-- Dispatch without leases every waiting entry among `members` (waiters members of the
-- handle's `lists` (see handle_lists), any slots', a task's member the same in each of its
-- lists) that their test passes, oldest first (by first deferral, then park time), and first
-- deferred before `before` if given (a number: the members of a fair entry were collected
-- whatever their time, see collect_members).
local function readmit_members(prefix, runs_key, expiry_key, keys, members, now, lease_seconds, next_run_id, lists,
    woken, before)
  local entries, seen = {}, {}
  for _, entry in ipairs(members) do
    local task_id = waiter_task_id(entry.member)
    if not seen[task_id] then
      seen[task_id] = true
      if lists.test == nil or lists.test(task_id, entry.member) then
        if entry.score < 0 then
          -- A round, not a time: the first deferral is the record's.
          local record = read_waiter(keys.waiting, task_id)
          entry.score = record and tonumber(record[RECORD_FIRST_DEFERRAL])
        end
        if entry.score ~= nil and (before == nil or entry.score < before) then
          entries[#entries + 1] = entry
        end
      end
    end
  end
  table.sort(entries, entry_before)
  for _, entry in ipairs(entries) do
    local task_id = waiter_task_id(entry.member)
    local record, weights = read_waiter(keys.waiting, task_id)
    if record ~= nil and is_waiting(record) then
      dispatch_entry(prefix, runs_key, expiry_key, keys, task_id, record, weights, next_run_id(), now, lease_seconds,
        false, woken)
    end
  end
end

-- The members (with their scores) of the waiting list at `key` whose score is below `upper`
-- (a ZRANGEBYSCORE bound), appended to `members`: every fair entry's among them (a negative
-- score, a round: see FAIR_OFFSET), whose time readmit_members reads from its record.
local function collect_members(key, upper, members)
  local found = redis.call('ZRANGEBYSCORE', key, '-inf', upper, 'WITHSCORES')
  for i = 1, #found, 2 do
    members[#members + 1] = { member = found[i], score = tonumber(found[i + 1]) }
  end
end

-- Dispatch with leases, in the lists' order (each list's own: round, then first deferral, then
-- park time; the lists merged by score then member, an entry met at its first place among them),
-- every waiting entry in the handle's waiting `lists` of
-- `slots` (see handle_lists) that their test passes and whose every slot has room now, by the
-- slot's limit in the limits hash (a slot without one there counts as full), each at its weight
-- there.  A waiter that does not fit is passed over and keeps its place, and the slots it does
-- not fit are given to no waiter after it in this walk (a heavy waiter keeps the room it needs
-- from the light ones behind it); a waiter of another deployment neither takes room nor stops
-- the walk.  The woken are appended to `woken` (see dispatch_entry).
local function dispatch_waiters(prefix, runs_key, expiry_key, keys, slots, now, lease_seconds, next_run_id, lists,
    woken)
  local is_own = lists.test
  local room = {} -- slot_has_room's cache
  local refused = {} -- slot -> true once a waiter did not fit it: no later waiter takes it
  local limits = {} -- slot -> its limit (false if it has none), read once per call

  local function limit_of(slot)
    if limits[slot] == nil then
      local limit = redis.call('HGET', keys.limits, slot)
      limits[slot] = limit and tonumber(limit) or false
    end
    return limits[slot]
  end
  -- Slot signature -> the task-set key of the slot that refused a waiter with it:
  -- full for newcomers for the rest of the call, so later waiters with that
  -- signature are passed over without reading their records, unless their task id
  -- holds that slot already.
  local blocked_by = {}
  local seen = {} -- task ids considered in this call (a waiter is in several lists)
  local cursors, cursor_of = {}, {}
  for _, slot in ipairs(slots) do
    if cursor_of[slot] == nil then
      local cursor = { key = lists.key(slot), rank = 0, entries = {}, at = 1 }
      cursors[#cursors + 1] = cursor
      cursor_of[slot] = cursor
    end
  end

  -- The next entry of a cursor's list not considered yet: member, score; nil at the end.
  local function head(cursor)
    while true do
      if cursor.at > #cursor.entries then
        if cursor.exhausted then
          return nil
        end
        cursor.entries = redis.call('ZRANGE', cursor.key, cursor.rank, cursor.rank + WALK_CHUNK - 1, 'WITHSCORES')
        cursor.rank = cursor.rank + WALK_CHUNK
        cursor.at = 1
        cursor.exhausted = #cursor.entries < 2 * WALK_CHUNK
        if #cursor.entries == 0 then
          return nil
        end
      end
      local member = cursor.entries[cursor.at]
      if not seen[waiter_task_id(member)] then
        return member, tonumber(cursor.entries[cursor.at + 1])
      end
      cursor.at = cursor.at + 2
    end
  end

  -- Merge the lists: the open cursors in a binary min-heap by their heads (score, then member
  -- bytes), so that the oldest entry at the head of any of them is found in log(cursors) steps.
  -- (A look at every cursor for each entry made a recovery pass over 10,000 lists that wait
  -- 10,000 x 10,000 steps: 38 s inside one script.)  A cursor whose head moved on since it was
  -- pushed (that entry was seen through another list) is pushed again by its new head; a closed
  -- one is dropped when it comes up.
  local heap = {}
  local function push_head(cursor)
    local member, score = head(cursor)
    if member == nil then
      cursor.closed = true
      return
    end
    local item = { cursor = cursor, member = member, score = score }
    local i = #heap + 1
    heap[i] = item
    while i > 1 do
      local parent = math.floor(i / 2)
      if not entry_before(heap[i], heap[parent]) then
        break
      end
      heap[i], heap[parent] = heap[parent], heap[i]
      i = parent
    end
  end
  local function pop_oldest()
    local top, last = heap[1], heap[#heap]
    heap[#heap] = nil
    if #heap > 0 then
      heap[1] = last
      local i = 1
      while true do
        local left, right, first = 2 * i, 2 * i + 1, i
        if left <= #heap and entry_before(heap[left], heap[first]) then
          first = left
        end
        if right <= #heap and entry_before(heap[right], heap[first]) then
          first = right
        end
        if first == i then
          break
        end
        heap[i], heap[first] = heap[first], heap[i]
        i = first
      end
    end
    return top
  end
  -- Dispatch the entry `member` of the merged lists if it is a waiting entry of the handle's
  -- that fits now; if a slot of it is full, close that slot's list (see below).
  local function consider(member)
    local task_id = waiter_task_id(member)
    seen[task_id] = true
    local blocking = blocked_by[waiter_signature(member)]
    local record, weights = nil, nil
    if (is_own == nil or is_own(task_id, member))
        and (blocking == nil or holds_live_lease(blocking, task_id, now)) then
      record, weights = read_waiter(keys.waiting, task_id)
    end
    if record ~= nil and is_waiting(record) then
      local fits = true
      for i = RECORD_SLOTS, #record do
        local slot = record[i]
        local limit = limit_of(slot)
        local has_room
        if not limit then
          has_room = false
        elseif refused[slot] then
          -- Given to no one after the waiter it refused, but a task id that holds it already
          -- counts once and takes nothing.
          has_room = holds_live_lease(slot_key(prefix, slot, 'tasks'), task_id, now)
        else
          has_room = slot_has_room(prefix, slot, limit, task_id, now, room, weights and weights[slot])
        end
        if not has_room then
          if fits then
            blocked_by[record[RECORD_SIGNATURE]] = slot_key(prefix, slot, 'tasks')
          end
          fits = false
          refused[slot] = true
          -- Nobody further down the slot's own list takes it now: stop walking it, which
          -- keeps a release's cost to the waiters it passes over while its slots have room.
          -- (A waiter further down whose task id already runs there, and so would count
          -- once, waits for its turn.)
          if cursor_of[slot] ~= nil then
            cursor_of[slot].closed = true
          end
          -- A waiter of weight 1 everywhere refuses only full slots, which refuse every later
          -- waiter anyway; a weighted one refuses each slot it does not fit.
          if weights == nil then
            break
          end
        end
      end
      if fits then
        dispatch_entry(prefix, runs_key, expiry_key, keys, task_id, record, weights, next_run_id(), now,
          lease_seconds, true, woken)
        for i = RECORD_SLOTS, #record do
          took_room(room, record[i], task_id, weights and weights[record[i]] or 1)
        end
      end
    end
  end

  for _, cursor in ipairs(cursors) do
    push_head(cursor)
  end
  while #heap > 0 do
    local top = pop_oldest()
    local cursor = top.cursor
    if not cursor.closed then
      if head(cursor) == top.member then
        cursor.at = cursor.at + 2
        consider(top.member)
      end
      if not cursor.closed then
        push_head(cursor)
      end
    end
  end
  return woken
end
