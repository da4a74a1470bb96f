-- celery-caps acquire: take one lease per slot for a run, all or none.
--
-- KEYS: limits, runs, expiry, the task's run set, then per slot: its runs, its tasks
-- ARGV: prefix, task id, run id, holder, lease seconds, task name ('' if none), the
--       deployment of the store's handle (whose oldest heavy waiter of a slot holds its room),
--       then per slot: name, limit, weight
-- Returns {1} when granted, or {0, full slot name, ...}.

local limits_key, runs_key, expiry_key, task_runs_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, task_id, run_id, holder = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_seconds = tonumber(ARGV[5])
local task_name, deployment = ARGV[6], ARGV[7]
local FIRST_SLOT = 8
local slot_count = (#ARGV - FIRST_SLOT + 1) / 3
local now = now_seconds()

-- The caller names the keys (a cluster routes on them); derive them here too, so
-- that the Python and Lua spellings of the layout can never drift apart unseen.
if task_key(prefix, task_id) ~= task_runs_key then
  return redis.error_reply('celery-caps: key layout mismatch (task key)')
end
for i = 1, slot_count do
  local slot = ARGV[FIRST_SLOT + 3 * (i - 1)]
  local runs_key, tasks_key = slot_key(prefix, slot, 'runs'), slot_key(prefix, slot, 'tasks')
  if runs_key ~= KEYS[3 + 2 * i] or tasks_key ~= KEYS[4 + 2 * i] then
    return redis.error_reply('celery-caps: key layout mismatch (slot keys)')
  end
end

local full = {}
local names = {}
local weights = nil -- slot -> weight, for the slots where it is above 1
for i = 1, slot_count do
  local at = FIRST_SLOT + 3 * (i - 1)
  local slot, limit_text, weight = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  names[i] = slot
  if weight > 1 then
    weights = weights or {}
    weights[slot] = weight
  end
  remember_limit(prefix, limits_key, slot, limit_text)
  if not slot_has_room(prefix, slot, tonumber(limit_text), task_id, now, nil, weight, deployment) then
    full[#full + 1] = slot
  end
end
if #full > 0 then
  local refused = { 0 }
  for _, slot in ipairs(full) do
    refused[#refused + 1] = slot
  end
  return refused
end

write_run(prefix, runs_key, expiry_key, task_id, run_id, holder, names, lease_seconds, now, task_name, weights)
return { 1 }
