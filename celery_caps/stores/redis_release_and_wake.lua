-- celery-caps release and wake: delete the leases of one run, of one holder's runs of a
-- task (its process died) or of every run of a task (revoke), then dispatch the oldest
-- waiters of the released slots (of the handle's deployment) whose every slot now has room,
-- in one atomic step.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, deployment, dispatch lease seconds, run id nonce, then
--       'run' and a run id | 'holder', a task id and a holder | 'task' and a task id
-- Returns {leases deleted, task id, run id, task name, payload, readmit ('0'), ...} (the
-- woken, oldest first; none when nothing was deleted).

local runs_key, expiry_key = KEYS[2], KEYS[3]
local prefix, deployment, lease_seconds, nonce, mode = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]

local doomed = {}
if mode == 'run' then
  doomed[1] = ARGV[6]
else
  local task_id, holder = ARGV[6], ARGV[7]
  -- The task's run set makes this cost the task's own runs, never a scan.
  for _, run_id in ipairs(redis.call('SMEMBERS', task_key(prefix, task_id))) do
    local take = mode == 'task'
    if not take then
      local run = read_run(runs_key, run_id)
      take = run ~= nil and run[2] == holder
    end
    if take then
      doomed[#doomed + 1] = run_id
    end
  end
end

local deleted, released = 0, {}
for _, run_id in ipairs(doomed) do
  local run = read_run(runs_key, run_id)
  deleted = deleted + delete_run(prefix, runs_key, expiry_key, run_id)
  if run ~= nil then
    for i = 3, #run do
      released[#released + 1] = run[i]
    end
  end
end
if deleted == 0 then
  return { 0 }
end
return dispatch_waiters(prefix, runs_key, expiry_key, waitlist_keys(), released, now_seconds(), lease_seconds,
  run_id_source(runs_key, nonce), handle_lists(prefix, deployment), { deleted })
