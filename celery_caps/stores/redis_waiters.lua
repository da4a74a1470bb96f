-- celery-caps waiters: the waiting list (of one slot, if a name is given), as
-- operators see it (tombstones are not listed).
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix [, slot name]
-- Returns {slot, task id, task name, first deferral, seconds since parked,
-- '1' if dispatched else '0', weight in the slot, fair key there ('' for none), round there,
-- ...}, each slot's waiters in its list's order.  (The first deferral is the record's: a fair
-- entry's score is its round.)

local keys = waitlist_keys()
local prefix = ARGV[1]
local now = now_seconds()

local slots = ARGV[2] and { ARGV[2] } or redis.call('SMEMBERS', keys.waitlists)
local listed = {}
for _, slot in ipairs(slots) do
  for _, member in ipairs(redis.call('ZRANGE', slot_key(prefix, slot, 'waiters'), 0, -1)) do
    local task_id = waiter_task_id(member)
    local record, weights, fair = read_waiter(keys.waiting, task_id)
    if record ~= nil then
      listed[#listed + 1] = slot
      listed[#listed + 1] = task_id
      listed[#listed + 1] = record[RECORD_TASK_NAME]
      listed[#listed + 1] = record[RECORD_FIRST_DEFERRAL]
      listed[#listed + 1] = string.format('%.6f', now - tonumber(record[RECORD_PARKED]))
      listed[#listed + 1] = is_waiting(record) and '0' or '1'
      listed[#listed + 1] = tostring(weights and weights[slot] or 1)
      local kept = fair and fair[slot]
      listed[#listed + 1] = kept and kept[1] or ''
      listed[#listed + 1] = kept and string.format('%d', kept[2]) or '0'
    end
  end
end
return listed
