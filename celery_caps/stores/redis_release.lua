-- celery-caps release: delete the leases of one run, of one holder's runs of a
-- task, or of every run of a task (revoke).
--
-- KEYS: limits, runs, expiry
-- ARGV: prefix, 'run' and a run id | 'holder', a task id and a holder | 'task' and a task id
-- Returns how many leases were deleted.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local prefix, mode = ARGV[1], ARGV[2]

if mode == 'run' then
  return delete_run(prefix, runs_key, expiry_key, ARGV[3])
end

local task_id, holder = ARGV[3], ARGV[4]
local deleted = 0
-- The task's run set makes this cost the task's own runs, never a scan.
for _, run_id in ipairs(redis.call('SMEMBERS', task_key(prefix, task_id))) do
  local doomed = mode == 'task'
  if not doomed then
    local run = read_run(runs_key, run_id)
    doomed = run ~= nil and run[2] == holder
  end
  if doomed then
    deleted = deleted + delete_run(prefix, runs_key, expiry_key, run_id)
  end
end
return deleted
