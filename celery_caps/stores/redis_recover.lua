-- celery-caps recover: keep waiters moving when no release does.  Dispatches whose deadline
-- passed go back to waiting at their old place (their dispatch leases deleted); with a
-- readmit time, waiting entries first deferred before it are dispatched without leases,
-- oldest first; then the lists of the slots that have room now (by their limits in the
-- limits hash) are walked, and every waiting entry whose slots all have room is dispatched
-- with leases, oldest first.  With a scope (cap names, task
-- names, or both), only the entries waiting for a slot of one of the caps (named like the
-- cap, or "<cap>:<key>" for a cap name without ':'; a slot name is that slot alone) or of a
-- task named are considered, with (to keep the order fair)
-- the other waiters of the slots those need.  Finding the lists with entries of the tasks
-- named reads each other slot's list up to its first such entry.  Only entries of the handle's
-- deployment are considered at all: the others (their expired dispatches included) are left
-- as they are, in their place.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, deployment, dispatch lease seconds, run id nonce, readmit time (epoch seconds,
--       '' for none) [, number of cap names, cap name, ..., task name, ...] (no scope: every
--       entry)
-- Returns {task id, run id, task name, payload, readmit, ...}: the readmits, then the
-- dispatches, each oldest first.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, deployment, lease_seconds, nonce = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local readmit_before = ARGV[5]
local SCOPE = 6
local now = now_seconds()
local next_run_id = run_id_source(runs_key, nonce)
-- The lists of the handle's deployment, and a test of the entries read from them.
local lists = handle_lists(prefix, deployment)
local function own(task_id, member)
  return lists.test == nil or lists.test(task_id, member)
end

-- caps: nil without a scope (every entry is considered); task_names: name -> true.
local caps, task_names = nil, {}
if #ARGV >= SCOPE then
  caps = {}
  local first_name = SCOPE + 1 + tonumber(ARGV[SCOPE])
  for i = SCOPE + 1, first_name - 1 do
    caps[#caps + 1] = ARGV[i]
  end
  for i = first_name, #ARGV do
    task_names[ARGV[i]] = true
  end
end
local scoped = caps ~= nil
local by_task_name = next(task_names) ~= nil

-- Whether `slot` belongs to one of the caps (all do without a scope).
local function of_caps(slot)
  if not scoped then
    return true
  end
  for _, cap in ipairs(caps) do
    if slot == cap or (not string.find(cap, ':', 1, true) and string.sub(slot, 1, #cap + 1) == cap .. ':') then
      return true
    end
  end
  return false
end

local function named_task(record)
  return record[RECORD_TASK_NAME] ~= '' and task_names[record[RECORD_TASK_NAME]] == true
end

local function in_scope(record)
  if not scoped or named_task(record) then
    return true
  end
  for j = RECORD_SLOTS, #record do
    if of_caps(record[j]) then
      return true
    end
  end
  return false
end

local woken = {}

-- Unclaimed: the dispatcher died before publishing, the message was lost or is late.  The
-- entry never left the slots' lists, so it keeps its place.  A task dispatched LEASED_DISPATCHES
-- times already, every dispatch unclaimed (its wake queue no longer consumed, say), is
-- dispatched again at once without leases, its copy given the longer the more it missed: it
-- holds no slot while the cap's other waiters are served.
for _, task_id in ipairs(redis.call('ZRANGEBYSCORE', keys.dispatches, '-inf', score_text(now))) do
  local record, weights = read_waiter(keys.waiting, task_id)
  if record == nil then
    redis.call('ZREM', keys.dispatches, task_id)
  elseif in_scope(record) and lists.owns(task_id) then
    redis.call('ZREM', keys.dispatches, task_id)
    if not is_waiting(record) then
      delete_dispatch(prefix, runs_key, expiry_key, task_id, record[RECORD_RUN_ID])
      record[RECORD_RUN_ID], record[RECORD_DEADLINE] = '', ''
      local dispatches = tonumber(record[RECORD_DISPATCHES])
      if dispatches >= LEASED_DISPATCHES then
        dispatch_entry(prefix, runs_key, expiry_key, keys, task_id, record, weights, next_run_id(), now,
          unleased_dispatch_seconds(dispatches, lease_seconds), false, woken)
      else
        write_waiter(keys.waiting, task_id, record)
        -- Waiting again: a heavy entry holds its room again.
        mark_heavy(prefix, task_id, record, weights, deployment, true)
      end
    end
  end
end

-- The lists of the caps' slots (every list without a scope), whose entries (of the handle's
-- deployment) are all considered; and the other lists that hold an entry of a task named (each
-- read up to its first such entry: the first, in a list of the worker's own tasks), whose
-- entries are considered too, as they are walked with it.  (Every slot of an entry has it in
-- its list, so each slot of an entry of a task named is found.)
local function holds_named_entry(key)
  local rank = 0
  while true do
    local members = redis.call('ZRANGE', key, rank, rank + WALK_CHUNK - 1)
    for _, member in ipairs(members) do
      local task_id = waiter_task_id(member)
      local record = own(task_id, member) and read_waiter(keys.waiting, task_id)
      if record and named_task(record) then
        return true
      end
    end
    if #members < WALK_CHUNK then
      return false
    end
    rank = rank + WALK_CHUNK
  end
end

local named, names_slots = {}, {}
for _, slot in ipairs(redis.call('SMEMBERS', keys.waitlists)) do
  if of_caps(slot) then
    named[#named + 1] = slot
  elseif by_task_name and holds_named_entry(lists.key(slot)) then
    names_slots[#names_slots + 1] = slot
  end
end

if readmit_before ~= '' then
  local overdue = {}
  local before = '(' .. score_text(tonumber(readmit_before))
  for _, slot in ipairs(named) do
    collect_members(lists.key(slot), before, overdue)
  end
  -- Of the other lists, the entries of the tasks named alone.
  local others = {}
  for _, slot in ipairs(names_slots) do
    collect_members(lists.key(slot), before, others)
  end
  for _, entry in ipairs(others) do
    local record = read_waiter(keys.waiting, waiter_task_id(entry.member))
    if record and named_task(record) then
      overdue[#overdue + 1] = entry
    end
  end
  readmit_members(prefix, runs_key, expiry_key, keys, overdue, now, lease_seconds, next_run_id, lists, woken,
    tonumber(readmit_before))
end

-- Whether a newcomer fits `slot` now, by its limit in the limits hash (without one: no).  Only
-- slots with room are walked, as the SQL stores' recovery walks them: a full slot's waiters
-- cannot be dispatched by this pass, and looking at each of them made a pass cost every list
-- that waits (10,000 lists of full keys: 10,000 walks for nothing).
local function has_room(slot)
  local limit = redis.call('HGET', keys.limits, slot)
  return limit and slot_has_room(prefix, slot, tonumber(limit), '', now, nil)
end

local slots = {}
if not scoped then
  for _, slot in ipairs(named) do
    if has_room(slot) then
      slots[#slots + 1] = slot
    end
  end
else
  -- The caps' slots with room where a waiting (not dispatched) entry of this deployment may
  -- fit, every slot those entries need, and the slots with room of the entries of the tasks
  -- named.  Entries of one signature need the same slots: one waiting entry's record per
  -- signature is read, not every entry's.  A list whose waiters all wait for a full slot (a
  -- tenant's, behind a global cap), none of them holding it already, is that slot's release's
  -- to serve: it is not walked (its entries' other slots are, as before).
  local listed, room_of, holders, full_of = {}, {}, {}, {}
  local function add(slot)
    if not listed[slot] then
      listed[slot] = true
      slots[#slots + 1] = slot
    end
  end
  local function slot_room(slot)
    if room_of[slot] == nil then
      room_of[slot] = has_room(slot) and true or false
    end
    return room_of[slot]
  end
  -- A full slot's live holders: task id -> true.
  local function holders_of(slot)
    if holders[slot] == nil then
      local held = {}
      local tasks_key = slot_key(prefix, slot, 'tasks')
      for _, task_id in ipairs(redis.call('ZRANGEBYSCORE', tasks_key, '(' .. score_text(now), '+inf')) do
        held[task_id] = true
      end
      holders[slot] = held
    end
    return holders[slot]
  end
  for _, slot in ipairs(named) do
    local waiters_key = lists.key(slot)
    if redis.call('EXISTS', waiters_key) == 1 and slot_room(slot) then
      local rank, done, fits = 0, false, false
      while not done do
        local members = redis.call('ZRANGE', waiters_key, rank, rank + WALK_CHUNK - 1)
        rank = rank + WALK_CHUNK
        done = #members < WALK_CHUNK
        for _, member in ipairs(members) do
          local signature, task_id = waiter_signature(member), waiter_task_id(member)
          local full = full_of[signature]
          if full == nil then
            local record = own(task_id, member) and read_waiter(keys.waiting, task_id)
            if record and is_waiting(record) then
              full = {}
              for j = RECORD_SLOTS, #record do
                if record[j] ~= slot then
                  add(record[j])
                end
                if not slot_room(record[j]) then
                  full[#full + 1] = record[j]
                end
              end
              full_of[signature] = full
            end
          end
          if full ~= nil and not fits then
            fits = true
            for _, full_slot in ipairs(full) do
              if not holders_of(full_slot)[task_id] then
                fits = false
                break
              end
            end
          end
        end
      end
      if fits then
        add(slot)
      end
    end
  end
  for _, slot in ipairs(names_slots) do
    if has_room(slot) then
      add(slot)
    end
  end
end

return dispatch_waiters(prefix, runs_key, expiry_key, keys, slots, now, lease_seconds, next_run_id, lists, woken)
