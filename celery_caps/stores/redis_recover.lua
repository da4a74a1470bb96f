-- celery-caps recover: keep waiters moving when no release does.  Dispatches whose deadline
-- passed go back to waiting at their old place (their dispatch leases deleted); with a
-- readmit time, waiting entries first deferred before it are dispatched without leases,
-- oldest first; then every waiting entry that has room now is dispatched with leases,
-- oldest first.  With cap names, only the entries waiting for a slot of one of them (named
-- like the cap, or "<cap>:<key>") are considered, with (to keep the order fair) the other
-- waiters of the slots those need.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, dispatch lease seconds, run id nonce, readmit time (epoch seconds, '' for
--       none) [, cap name, ...]
-- Returns {task id, run id, task name, payload, readmit, ...}: the readmits, then the
-- dispatches, each oldest first.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, lease_seconds, nonce, readmit_before = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local FIRST_SLOT = 5
local now = now_seconds()
local next_run_id = run_id_source(runs_key, nonce)

local caps = nil
if #ARGV >= FIRST_SLOT then
  caps = {}
  for i = FIRST_SLOT, #ARGV do
    caps[#caps + 1] = ARGV[i]
  end
end

-- Whether `slot` belongs to one of the caps (all do without caps).
local function of_caps(slot)
  if caps == nil then
    return true
  end
  for _, cap in ipairs(caps) do
    if slot == cap or string.sub(slot, 1, #cap + 1) == cap .. ':' then
      return true
    end
  end
  return false
end

local function waits_for_caps(record)
  for j = RECORD_SLOTS, #record, 2 do
    if of_caps(record[j]) then
      return true
    end
  end
  return false
end

-- Unclaimed: the dispatcher died before publishing, the message was lost or is late.  The
-- entry never left the slots' lists, so it keeps its place.
for _, task_id in ipairs(redis.call('ZRANGEBYSCORE', keys.dispatches, '-inf', score_text(now))) do
  local record = read_waiter(keys.waiting, task_id)
  if record == nil then
    redis.call('ZREM', keys.dispatches, task_id)
  elseif waits_for_caps(record) then
    if not is_waiting(record) then
      delete_dispatch(prefix, runs_key, expiry_key, task_id, record[RECORD_RUN_ID])
      record[RECORD_RUN_ID], record[RECORD_DEADLINE] = '', ''
      write_waiter(keys.waiting, task_id, record)
    end
    redis.call('ZREM', keys.dispatches, task_id)
  end
end

local named = {}
for _, slot in ipairs(redis.call('SMEMBERS', keys.waitlists)) do
  if of_caps(slot) then
    named[#named + 1] = slot
  end
end

local woken = {}
if readmit_before ~= '' then
  local overdue = {}
  for _, slot in ipairs(named) do
    collect_members(prefix, slot, '(' .. score_text(tonumber(readmit_before)), overdue)
  end
  readmit_members(prefix, runs_key, expiry_key, keys, overdue, now, lease_seconds, next_run_id, woken)
end

local slots
if caps == nil then
  slots = named
else
  -- The named slots, and every slot their waiting (not dispatched) entries need.
  slots = {}
  local listed = {}
  local function add(slot)
    if not listed[slot] then
      listed[slot] = true
      slots[#slots + 1] = slot
    end
  end
  for _, slot in ipairs(named) do
    local waiters_key = slot_key(prefix, slot, 'waiters')
    if redis.call('EXISTS', waiters_key) == 1 then
      add(slot)
      for _, member in ipairs(redis.call('ZRANGE', waiters_key, 0, -1)) do
        local record = read_waiter(keys.waiting, waiter_task_id(member))
        if record ~= nil and is_waiting(record) then
          for j = RECORD_SLOTS, #record, 2 do
            add(record[j])
          end
        end
      end
    end
  end
end

return dispatch_waiters(prefix, runs_key, expiry_key, keys, slots, now, lease_seconds, next_run_id, woken)
