-- celery-caps: the waiting list of the park strategy, helpers shared by the parking
-- scripts.  redis.py prepends redis_common.lua and then this file to each of them.
--
-- Keys (the layout is described in redis.py's module docstring):
--   P:slot:{E}:waiters  ZSET  one entry per task waiting for the slot (dispatched or
--                             not): score = first-deferral time, member = park time
--                             (fixed-width text of Redis TIME), the signature of the
--                             task's slots (below), then the task id; so the set's own
--                             order (score, then member bytes) is the waiting order:
--                             first deferral, then park time (unique per park)
--   P:waiting           HASH  task id -> MessagePack record (below)
--   P:payloads          HASH  task id -> its message (opaque bytes)
--   P:waitlists         SET   the slot names whose waiters set is not empty
--   P:dispatches        ZSET  dispatched task id -> dispatch expiry
--
-- A record: { first deferral (text), park time (text), task name ('' if none),
-- dispatch run id ('' while waiting), dispatch expiry (text, '' while waiting),
-- signature, slot name, limit, slot name, limit, ... } (slots sorted, limits as
-- parked).  The signature (16 hex digits of the SHA-1 of the slots and limits) lets a
-- release pass over waiters needing a slot it found full without reading their records.
--
-- Parking scripts take the same first KEYS: limits, runs, expiry, waiting, payloads,
-- waitlists, dispatches.

-- The holder of a dispatch lease until its task claims it.
local DISPATCH_HOLDER = 'caps-dispatch'

-- Length of the park-time text that starts a waiters member (see now_with_text), and
-- of the slot signature after it.
local PARKED_WIDTH = 18
local SIGNATURE_WIDTH = 16

-- Where a record's slot names and limits begin.
local RECORD_SLOTS = 7

-- Waiters fetched at a time while walking a slot's waiting list.
local WALK_CHUNK = 128

-- Standby (see redis.py): P:standby HASH task id -> MessagePack { mark, expiry (number),
-- dispatch run id ('' until a dispatch takes it), holder ('' until its process waits),
-- lease seconds (number, 0 until then) }; P:standby:signal:<task id> LIST, the signals
-- ("<mark> <run id> claimed|dispatched") a dispatch pushes for the waiting process.
local SIGNAL_SECONDS = 60

local function standby_key(prefix)
  return prefix .. ':standby'
end

local function signal_key(prefix, task_id)
  return prefix .. ':standby:signal:' .. task_id
end

local function read_standby(prefix, task_id)
  local packed = redis.call('HGET', standby_key(prefix), task_id)
  if not packed then
    return nil
  end
  return cmsgpack.unpack(packed)
end

local function write_standby(prefix, task_id, standby)
  redis.call('HSET', standby_key(prefix), task_id, cmsgpack.pack(standby))
end

-- A standby a dispatch can take: live and not taken yet.
local function standby_open(standby, now)
  return standby ~= nil and standby[3] == '' and standby[2] > now
end

local function waitlist_keys()
  return { waiting = KEYS[4], payloads = KEYS[5], waitlists = KEYS[6], dispatches = KEYS[7] }
end

local function read_waiter(waiting_key, task_id)
  local packed = redis.call('HGET', waiting_key, task_id)
  if not packed then
    return nil
  end
  return cmsgpack.unpack(packed)
end

local function waiter_task_id(member)
  return string.sub(member, PARKED_WIDTH + SIGNATURE_WIDTH + 1)
end

local function waiter_signature(member)
  return string.sub(member, PARKED_WIDTH + 1, PARKED_WIDTH + SIGNATURE_WIDTH)
end

local function waiter_member(record, task_id)
  return record[2] .. record[6] .. task_id
end

-- The signature of a slot set: `names` and `limits` (texts) in slot order.
local function slots_signature(names, limits)
  local parts = {}
  for i = 1, #names do
    parts[#parts + 1] = names[i]
    parts[#parts + 1] = limits[i]
  end
  return string.sub(redis.sha1hex(table.concat(parts, '\0')), 1, SIGNATURE_WIDTH)
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

-- Take a parked task off the waiting list: its entry in each slot's list, its
-- record, its payload, its dispatch.
local function remove_waiter(prefix, keys, task_id, record)
  local member = waiter_member(record, task_id)
  for i = RECORD_SLOTS, #record, 2 do
    local waiters_key = slot_key(prefix, record[i], 'waiters')
    redis.call('ZREM', waiters_key, member)
    if redis.call('EXISTS', waiters_key) == 0 then
      redis.call('SREM', keys.waitlists, record[i])
    end
  end
  redis.call('HDEL', keys.waiting, task_id)
  redis.call('HDEL', keys.payloads, task_id)
  redis.call('ZREM', keys.dispatches, task_id)
  redis.call('HDEL', standby_key(prefix), task_id)
end

-- Dispatch, oldest first, every waiter in the waiting lists of `slots` whose every
-- slot has room now: a run under its own task id holding all its slots for
-- `lease_seconds` (holder DISPATCH_HOLDER).  A waiter that does not fit is passed
-- over and keeps its place.  Run ids are `nonce` (unique per call, from the caller:
-- a script's own random numbers repeat) followed by a counter.  Returns the woken
-- as a flat list: task id, run id, task name, payload, standby ('1': a standby process
-- was signalled instead, '0'), ...  A waiter on standby is taken for its dispatch; if its
-- process waits already, the run is created in that process's name with its lease length.
local function dispatch_waiters(prefix, runs_key, expiry_key, keys, slots, now, lease_seconds, nonce)
  local woken = {}
  local room = {} -- slot_has_room's cache
  -- Slot signature -> the task-set key of the slot that refused a waiter with it:
  -- full for newcomers for the rest of the call, so later waiters with that
  -- signature are passed over without reading their records, unless their task id
  -- holds that slot already.
  local blocked_by = {}
  local seen = {} -- task ids considered in this call (a waiter is in several lists)
  local cursors, cursor_of = {}, {}
  for _, slot in ipairs(slots) do
    if cursor_of[slot] == nil then
      local cursor = { key = slot_key(prefix, slot, 'waiters'), rank = 0, entries = {}, at = 1 }
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

  local sequence = 0
  local function new_run_id()
    while true do
      sequence = sequence + 1
      local run_id = nonce .. string.format('%08x', sequence)
      if redis.call('HEXISTS', runs_key, run_id) == 0 then
        return run_id
      end
    end
  end

  while true do
    -- Merge the lists: the oldest entry at the head of any open cursor.
    local best, best_member, best_score = nil, nil, nil
    for _, cursor in ipairs(cursors) do
      if not cursor.closed then
        local member, score = head(cursor)
        if member == nil then
          cursor.closed = true
        elseif best == nil or score < best_score or (score == best_score and bytes_less(member, best_member)) then
          best, best_member, best_score = cursor, member, score
        end
      end
    end
    if best == nil then
      break
    end
    best.at = best.at + 2
    local task_id = waiter_task_id(best_member)
    seen[task_id] = true
    local blocking = blocked_by[waiter_signature(best_member)]
    local record = nil
    if blocking == nil or holds_live_lease(blocking, task_id, now) then
      record = read_waiter(keys.waiting, task_id)
    end
    if record ~= nil and record[4] == '' then
      local names = {}
      local fits = true
      for i = RECORD_SLOTS, #record, 2 do
        local slot = record[i]
        names[#names + 1] = slot
        if not slot_has_room(prefix, slot, record[i + 1], task_id, now, room) then
          fits = false
          blocked_by[record[6]] = slot_key(prefix, slot, 'tasks')
          -- The slot is full for newcomers, so (its waiters sharing its limit) nobody
          -- further down its own list fits either: stop walking it, which keeps a
          -- release's cost to the waiters it passes over while its slots have room.
          -- (A waiter further down whose task id already runs there, and so would
          -- count once, waits for its turn.)
          if cursor_of[slot] ~= nil then
            cursor_of[slot].closed = true
          end
          break
        end
      end
      if fits then
        local run_id = new_run_id()
        local holder, run_seconds = DISPATCH_HOLDER, lease_seconds
        local standby = read_standby(prefix, task_id)
        local signalled = standby_open(standby, now)
        if signalled then
          standby[3] = run_id
          if standby[4] ~= '' then
            holder, run_seconds = standby[4], standby[5]
          end
          write_standby(prefix, task_id, standby)
          local how = holder == DISPATCH_HOLDER and 'dispatched' or 'claimed'
          redis.call('RPUSH', signal_key(prefix, task_id), standby[1] .. ' ' .. run_id .. ' ' .. how)
          redis.call('EXPIRE', signal_key(prefix, task_id), SIGNAL_SECONDS)
        end
        write_run(prefix, runs_key, expiry_key, task_id, run_id, holder, names, run_seconds, now, record[3])
        for _, slot in ipairs(names) do
          room[slot] = nil
        end
        record[4] = run_id
        record[5] = score_text(now + lease_seconds)
        redis.call('HSET', keys.waiting, task_id, cmsgpack.pack(record))
        redis.call('ZADD', keys.dispatches, record[5], task_id)
        woken[#woken + 1] = task_id
        woken[#woken + 1] = run_id
        woken[#woken + 1] = record[3]
        woken[#woken + 1] = redis.call('HGET', keys.payloads, task_id) or ''
        woken[#woken + 1] = signalled and '1' or '0'
      end
    end
  end
  return woken
end
