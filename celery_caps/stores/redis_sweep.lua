-- celery-caps sweep: delete every expired lease; the limits (sentinels) stay.
--
-- KEYS: limits, runs, expiry
-- ARGV: prefix
-- Returns how many leases were deleted.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local prefix = ARGV[1]
local now = now_seconds()

local deleted = 0
-- The global expiry index finds expired runs in O(log n + expired), whatever the
-- number of slot names.
for _, run_id in ipairs(redis.call('ZRANGEBYSCORE', expiry_key, '-inf', score_text(now))) do
  deleted = deleted + delete_run(prefix, runs_key, expiry_key, run_id)
end
return deleted
