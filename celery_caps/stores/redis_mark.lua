-- celery-caps mark: take waiting (not dispatched, not marked) tasks off the waiting list
-- at least once: those first deferred before a time (they waited too long), or every one
-- waiting for a slot (an operator drains it).  Each is marked as being published (a
-- dispatch without leases: the mark in the record's dispatch run id, its expiry in
-- P:dispatches), so it is neither dispatched nor taken again; settle_published deletes
-- it once its message is on the broker, and wake puts it back when the mark expires.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, mark, hold seconds, 'before' and a time (epoch seconds) | 'slot' and a slot name
-- Returns {task id, task name, first deferral, park time, payload, ...}.

local keys = waitlist_keys()
local prefix, mark, hold_seconds, mode = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local expiry = score_text(now_seconds() + hold_seconds)

local slots, upper
if mode == 'before' then
  slots, upper = redis.call('SMEMBERS', keys.waitlists), '(' .. score_text(tonumber(ARGV[5]))
else
  slots, upper = { ARGV[5] }, '+inf'
end

local marked = {}
for _, slot in ipairs(slots) do
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', slot_key(prefix, slot, 'waiters'), '-inf', upper)) do
    local task_id = waiter_task_id(member)
    -- Read again for every entry: a task waiting in several lists is marked once.
    local record = read_waiter(keys.waiting, task_id)
    if record ~= nil and record[4] == '' then
      record[4], record[5] = mark, expiry
      redis.call('HSET', keys.waiting, task_id, cmsgpack.pack(record))
      redis.call('ZADD', keys.dispatches, expiry, task_id)
      marked[#marked + 1] = task_id
      marked[#marked + 1] = record[3]
      marked[#marked + 1] = record[1]
      marked[#marked + 1] = record[2]
      marked[#marked + 1] = redis.call('HGET', keys.payloads, task_id) or ''
    end
  end
end
return marked
