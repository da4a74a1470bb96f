-- celery-caps renew: push the expiry of live runs to now + lease seconds.
--
-- KEYS: limits, runs, expiry
-- ARGV: prefix, lease seconds, run id, ...
-- Returns {run id, leases renewed, ...} for the runs that were still live.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local prefix = ARGV[1]
local now = now_seconds()
local expiry = now + tonumber(ARGV[2])

local renewed = {}
for i = 3, #ARGV do
  local run_id = ARGV[i]
  local current = redis.call('ZSCORE', expiry_key, run_id)
  -- An expired lease is never revived: its room may belong to another task now.
  if current and tonumber(current) > now then
    local run = read_run(runs_key, run_id)
    if run ~= nil then
      extend_run(prefix, expiry_key, run_id, run, expiry)
      renewed[#renewed + 1] = run_id
      renewed[#renewed + 1] = #run - 2
    end
  end
end
return renewed
