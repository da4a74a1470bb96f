-- celery-caps waiters: the waiting list (of one slot, if a name is given), as
-- operators see it.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix [, slot name]
-- Returns {slot, task id, task name, first deferral, seconds since parked,
-- '1' if dispatched else '0', ...}, each slot's waiters in waiting order.

local keys = waitlist_keys()
local prefix = ARGV[1]
local now = now_seconds()

local slots = ARGV[2] and { ARGV[2] } or redis.call('SMEMBERS', keys.waitlists)
local listed = {}
for _, slot in ipairs(slots) do
  for _, member in ipairs(redis.call('ZRANGE', slot_key(prefix, slot, 'waiters'), 0, -1)) do
    local task_id = waiter_task_id(member)
    local record = read_waiter(keys.waiting, task_id)
    if record ~= nil then
      listed[#listed + 1] = slot
      listed[#listed + 1] = task_id
      listed[#listed + 1] = record[3]
      listed[#listed + 1] = record[1]
      listed[#listed + 1] = string.format('%.6f', now - tonumber(record[2]))
      listed[#listed + 1] = record[4] ~= '' and '1' or '0'
    end
  end
end
return listed
