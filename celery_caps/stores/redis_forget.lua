-- celery-caps forget: a task is not to run (revoked, expired, dropped by an operator).  It
-- leaves the waiting list, its standby ends, its dispatch leases go (never a run's lease), and the slots
-- they held are dispatched to the oldest waiters with room, in one atomic step.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, task id, dispatch lease seconds, run id nonce
-- Returns {waiting entries removed, task id, run id, task name, payload, ...} (the woken,
-- oldest first).

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, task_id, lease_seconds, nonce = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]

-- Its standby that no dispatch took ends (first: remove_waiter deletes the record), and its
-- waiting process is told at once (the mark alone, no run id) rather than waiting on until its
-- wait is over.
local standby = read_standby(prefix, task_id)
if standby ~= nil and standby[3] == '' then
  redis.call('HDEL', standby_key(prefix), task_id)
  redis.call('DEL', signal_key(prefix, task_id))
  redis.call('RPUSH', signal_key(prefix, task_id), standby[1])
  redis.call('EXPIRE', signal_key(prefix, task_id), SIGNAL_SECONDS)
end

local removed = 0
local record = read_waiter(keys.waiting, task_id)
if record ~= nil then
  remove_waiter(prefix, keys, task_id, record)
  removed = (#record - RECORD_SLOTS + 1) / 2
end

local deleted, freed = 0, {}
for _, run_id in ipairs(redis.call('SMEMBERS', task_key(prefix, task_id))) do
  local run = read_run(runs_key, run_id)
  if run ~= nil and run[2] == DISPATCH_HOLDER then
    deleted = deleted + delete_run(prefix, runs_key, expiry_key, run_id)
    for i = 3, #run do
      freed[#freed + 1] = run[i]
    end
  end
end

local reply = { removed }
if deleted > 0 then
  for _, value in ipairs(dispatch_waiters(prefix, runs_key, expiry_key, keys, freed, now_seconds(), lease_seconds,
      nonce)) do
    reply[#reply + 1] = value
  end
end
return reply
