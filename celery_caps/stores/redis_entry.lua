-- celery-caps entry: a task's entry, read without changing anything (ParkingStore.entry).
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches, the task's tombstone
-- ARGV: prefix, task id
-- Returns {} (no entry), {'done'} (a tombstone), or {'listed', dispatch run id ('' while it
-- waits), '1' if it was parked without its message (an empty payload) else '0'}.

local keys = waitlist_keys()
local prefix, task_id = ARGV[1], ARGV[2]

if done_key(prefix, task_id) ~= KEYS[8] then
  return redis.error_reply('celery-caps: key layout mismatch (tombstone key)')
end

local record = read_waiter(keys.waiting, task_id)
if record ~= nil then
  local outside = redis.call('HSTRLEN', keys.payloads, task_id) == 0
  return { 'listed', record[RECORD_RUN_ID], outside and '1' or '0' }
end
if redis.call('EXISTS', KEYS[8]) == 1 then
  return { 'done' }
end
return {}
