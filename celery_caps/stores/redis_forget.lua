-- celery-caps forget: a task is not to run (revoked, expired, dropped by an operator).  A
-- waiting entry is deleted; a dispatched one becomes a tombstone (its copy may be on its
-- way); every dispatch lease of the task goes (a release's, or one taken when it was sent;
-- never a run's lease), and the slots they held are dispatched to the oldest waiters (of the
-- handle's deployment) with room, in one atomic step.  The entry goes whatever its deployment.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches, the task's tombstone,
--       the task's run set
-- ARGV: prefix, deployment, task id, dispatch lease seconds, run id nonce, tombstone milliseconds
-- Returns {entries removed (0 or 1), task id, run id, task name, payload, readmit, ...}
-- (the woken, oldest first).

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, deployment, task_id, lease_seconds, nonce = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local done_milliseconds = tonumber(ARGV[6])

if done_key(prefix, task_id) ~= KEYS[8] or task_key(prefix, task_id) ~= KEYS[9] then
  return redis.error_reply('celery-caps: key layout mismatch (tombstone or task key)')
end

local reply = { 0 }
local record, weights, fair = read_waiter(keys.waiting, task_id)
if record ~= nil then
  reply[1] = 1
  if is_waiting(record) then
    remove_waiter(prefix, keys, task_id, record, weights, fair)
  else
    settle_waiter(prefix, keys, task_id, record, weights, fair, true, done_milliseconds, '')
  end
end
-- The task's run set makes this cost its own runs, never a scan.
local freed = {}
for _, run_id in ipairs(redis.call('SMEMBERS', KEYS[9])) do
  for _, slot in ipairs(delete_dispatch(prefix, runs_key, expiry_key, task_id, run_id)) do
    freed[#freed + 1] = slot
  end
end
if #freed > 0 then
  dispatch_waiters(prefix, runs_key, expiry_key, keys, freed, now_seconds(), lease_seconds,
    run_id_source(runs_key, nonce), handle_lists(prefix, deployment), reply)
end
return reply
