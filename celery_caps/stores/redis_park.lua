-- celery-caps park: admit like acquire if every slot has room, else put the task on
-- the waiting list of every slot it needs, in one atomic step (so a release that
-- ran before it is seen as room, and one that runs after it sees the waiter).
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches, the task's run
--       set, then per slot: its runs, its tasks, its waiters
-- ARGV: prefix, task id, run id, holder, lease seconds, task name ('' if none), payload,
--       first-deferral time, max waiters, '1' to admit or '0' (a task being sent, not
--       run), then per slot (sorted): name, limit
-- Returns 'admitted', 'room' (every slot has room but admit was '0': nothing taken,
-- nothing stored but the sentinels), 'parked' (also when the task id was parked already),
-- 'parked_first' (parked, and a slot's list held no other task) or 'waitlist_full' (a slot
-- has max waiters already; nothing stored).

local limits_key, runs_key, expiry_key = KEYS[1], KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, task_id, run_id, holder = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_seconds, task_name, payload = tonumber(ARGV[5]), ARGV[6], ARGV[7]
local first_deferred_at, max_waiters, admit = ARGV[8], tonumber(ARGV[9]), ARGV[10] == '1'
local FIRST_SLOT = 11
local slot_count = (#ARGV - FIRST_SLOT + 1) / 2
local now, now_text = now_with_text()

-- Derive the keys the caller named, as acquire does: the two spellings must agree.
if task_key(prefix, task_id) ~= KEYS[8] then
  return redis.error_reply('celery-caps: key layout mismatch (task key)')
end
local names, limits = {}, {}
for i = 1, slot_count do
  local slot = ARGV[FIRST_SLOT + 2 * (i - 1)]
  names[i], limits[i] = slot, ARGV[FIRST_SLOT + 2 * (i - 1) + 1]
  local base = 8 + 3 * (i - 1)
  if slot_key(prefix, slot, 'runs') ~= KEYS[base + 1] or slot_key(prefix, slot, 'tasks') ~= KEYS[base + 2]
      or slot_key(prefix, slot, 'waiters') ~= KEYS[base + 3] then
    return redis.error_reply('celery-caps: key layout mismatch (slot keys)')
  end
end

-- Admission, exactly as acquire.
local full = false
for i = 1, slot_count do
  remember_limit(limits_key, names[i], limits[i])
  if not slot_has_room(prefix, names[i], tonumber(limits[i]), task_id, now) then
    full = true
  end
end
if not full then
  if not admit then
    return 'room'
  end
  write_run(prefix, runs_key, expiry_key, task_id, run_id, holder, names, lease_seconds, now, task_name)
  return 'admitted'
end

-- A duplicate of a parked task waits once, at the first copy's place.
if redis.call('HEXISTS', keys.waiting, task_id) == 1 then
  return 'parked'
end
local first = false
for i = 1, slot_count do
  local waiting = redis.call('ZCARD', KEYS[8 + 3 * i])
  if waiting >= max_waiters then
    return 'waitlist_full'
  end
  first = first or waiting == 0
end

local record = { first_deferred_at, now_text, task_name, '', '', slots_signature(names, limits) }
for i = 1, slot_count do
  record[#record + 1] = names[i]
  record[#record + 1] = tonumber(limits[i])
end
redis.call('HSET', keys.waiting, task_id, cmsgpack.pack(record))
redis.call('HSET', keys.payloads, task_id, payload)
local member = waiter_member(record, task_id)
for i = 1, slot_count do
  redis.call('ZADD', KEYS[8 + 3 * i], first_deferred_at, member)
  redis.call('SADD', keys.waitlists, names[i])
end
if first then
  return 'parked_first'
end
return 'parked'
