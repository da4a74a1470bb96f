-- celery-caps settle: end the marks of expire_waiters/drain.  A published task leaves the
-- waiting list; a task whose publish failed waits again at its place.  Matched by task id
-- and mark: a mark that expired (and was put back, or taken again under a new mark) is
-- left alone.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, then per task: 'published' | 'failed', task id, mark
-- Returns how many waiting entries (one per slot of a task) were deleted.

local keys = waitlist_keys()
local prefix = ARGV[1]

local deleted = 0
for i = 2, #ARGV, 3 do
  local outcome, task_id, mark = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local record = read_waiter(keys.waiting, task_id)
  if mark ~= '' and record ~= nil and record[4] == mark then
    if outcome == 'published' then
      remove_waiter(prefix, keys, task_id, record)
      deleted = deleted + (#record - RECORD_SLOTS + 1) / 2
    else
      record[4], record[5] = '', ''
      redis.call('HSET', keys.waiting, task_id, cmsgpack.pack(record))
      redis.call('ZREM', keys.dispatches, task_id)
    end
  end
end
return deleted
