-- celery-caps park: admission for the park strategy in one atomic step (so a release that
-- ran before it is seen as room, and one that runs after it sees the waiter).  In this
-- order: the task id waits (or is dispatched) already, for this task or another (a reused
-- id); every slot has room; no payload; a slot's list is full; else the task waits in the
-- list of every slot it needs.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches, the task's run
--       set, the task's tombstone, then per slot: its runs, its tasks, its waiters
-- ARGV: prefix, task id, run id, holder, lease seconds, task name ('' if none), payload,
--       '1' if a payload is given else '0', first-deferral time, max waiters, the deployment
--       of the store's handle ('' for none: recorded with the entry), then per slot (sorted):
--       name, limit, weight, fair key ('' for none: see FAIR_OFFSET in redis_waitlist.lua)
-- Returns 'waiting' (the entry is of the same task name: nothing changed),
-- 'id_in_use' (it is another task's: nothing changed), 'admitted', 'full' (no payload: nothing
-- stored), 'waitlist_full' (a slot has max waiters already: nothing stored) or 'parked'.  Only
-- the sentinels are written in every case.

local limits_key, runs_key, expiry_key = KEYS[1], KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, task_id, run_id, holder = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_seconds, task_name, payload, has_payload = tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8] == '1'
local first_deferred_at, max_waiters, deployment = ARGV[9], tonumber(ARGV[10]), ARGV[11]
local FIRST_SLOT = 12
local FIRST_SLOT_KEY = 10
local SLOT_ARGS = 4
local slot_count = (#ARGV - FIRST_SLOT + 1) / SLOT_ARGS
local now, now_text = now_with_text()

-- Derive the keys the caller named, as acquire does: the two spellings must agree.
if task_key(prefix, task_id) ~= KEYS[8] or done_key(prefix, task_id) ~= KEYS[9] then
  return redis.error_reply('celery-caps: key layout mismatch (task keys)')
end
local names, limits, slot_weights, waiters_keys = {}, {}, {}, {}
local weights = nil -- slot -> weight, for the slots where it is above 1
local fair_keys = nil -- slot -> fair key, for the slots where it has one
for i = 1, slot_count do
  local at = FIRST_SLOT + SLOT_ARGS * (i - 1)
  local slot = ARGV[at]
  names[i], limits[i], slot_weights[i] = slot, ARGV[at + 1], tonumber(ARGV[at + 2])
  if slot_weights[i] > 1 then
    weights = weights or {}
    weights[slot] = slot_weights[i]
  end
  if ARGV[at + 3] ~= '' then
    fair_keys = fair_keys or {}
    fair_keys[slot] = ARGV[at + 3]
  end
  local base = FIRST_SLOT_KEY + 3 * (i - 1)
  waiters_keys[i] = KEYS[base + 2]
  if slot_key(prefix, slot, 'runs') ~= KEYS[base] or slot_key(prefix, slot, 'tasks') ~= KEYS[base + 1]
      or slot_key(prefix, slot, 'waiters') ~= waiters_keys[i] then
    return redis.error_reply('celery-caps: key layout mismatch (slot keys)')
  end
end

for i = 1, slot_count do
  remember_limit(prefix, limits_key, names[i], limits[i])
end

-- Its entry answers for the task (a duplicate, or a copy that arrived again) if it is this
-- task's, whatever slots the copy asks for now (a deploy may have renamed its cap or changed
-- its key); an entry of another task name means the id was reused.
local listed = read_waiter(keys.waiting, task_id)
if listed ~= nil then
  if listed[RECORD_TASK_NAME] ~= task_name then
    return 'id_in_use'
  end
  return 'waiting'
end

-- Admission, exactly as acquire.
local full = false
for i = 1, slot_count do
  if not slot_has_room(prefix, names[i], tonumber(limits[i]), task_id, now, nil, slot_weights[i], deployment) then
    full = true
  end
end
if not full then
  if slot_count > 0 then
    write_run(prefix, runs_key, expiry_key, task_id, run_id, holder, names, lease_seconds, now, task_name, weights)
  end
  return 'admitted'
end

if not has_payload then
  return 'full'
end
for i = 1, slot_count do
  if redis.call('ZCARD', waiters_keys[i]) >= max_waiters then
    return 'waitlist_full'
  end
end

-- A new entry replaces a tombstone of the task id (this copy is the task's from now on), and
-- keeps its count of dispatches: copies of the earlier dispatches may still be on their way.
local done = read_done(KEYS[9])
redis.call('DEL', KEYS[9])
local dispatches = done ~= nil and done[3] or 0
local record = { first_deferred_at, now_text, task_name, '', '', dispatches, slots_signature(names, deployment) }
for i = 1, slot_count do
  record[#record + 1] = names[i]
end
write_waiter(keys.waiting, task_id, record)
if weights ~= nil then
  redis.call('HSET', keys.waiting, weights_field(task_id), cmsgpack.pack(weights))
  mark_heavy(prefix, task_id, record, weights, deployment, true)
end
redis.call('HSET', keys.payloads, task_id, payload)
-- Its score in each slot's lists: the first-deferral time, or where it has a fair key, its round
-- there (see FAIR_OFFSET), from the handle's list before it joins (the entries of its deployment)
-- and the slot's fair hash; kept with the entry for its leaving.  Nothing of it without fair keys.
-- While the list holds an entry without a fair key (parked before a deploy added fair_by: a time
-- score, after every round), it parks without a round too: first come, so that those entries
-- are not passed by the rounds (the other stores keep them in round 0).
local scores = {}
if fair_keys ~= nil then
  local lists = handle_lists(prefix, deployment)
  local fair = {}
  for i = 1, slot_count do
    local fair_key = fair_keys[names[i]]
    local last = fair_key and first_listed_score(lists.key(names[i]), lists.test, true)
    if fair_key and (last == nil or last < 0) then
      local round = take_fair_round(prefix, names[i], deployment, lists.key(names[i]), lists.test, fair_key)
      fair[names[i]] = { fair_key, round }
      scores[i] = fair_score(round)
    end
  end
  redis.call('HSET', keys.waiting, fair_field(task_id), cmsgpack.pack(fair))
end
local member = waiter_member(record, task_id)
for i = 1, slot_count do
  redis.call('ZADD', waiters_keys[i], scores[i] or first_deferred_at, member)
  redis.call('SADD', keys.waitlists, names[i])
end
-- An entry of a named deployment is also in that deployment's own list of each slot, which its
-- hand-overs walk.
if deployment ~= '' then
  redis.call('HSET', deployments_key(prefix), task_id, deployment)
  for i = 1, slot_count do
    redis.call('ZADD', deployment_waiters_key(prefix, names[i], deployment), scores[i] or first_deferred_at, member)
  end
end
return 'parked'
