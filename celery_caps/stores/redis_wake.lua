-- celery-caps wake (for the sweep and operators): waiters whose dispatch (or mark of
-- expire_waiters/drain) expired unclaimed go back to waiting at their old place, then
-- every waiter that has room now is dispatched.  With slot names, only the waiters that
-- wait for one of them are put back and considered, with (to keep the order fair) the
-- other waiters of the slots those need.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, dispatch lease seconds, run id nonce [, slot name, ...]
-- Returns {task id, run id, task name, payload, ...}, oldest first.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, lease_seconds, nonce = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now = now_seconds()

local only = nil
if #ARGV > 3 then
  only = {}
  for i = 4, #ARGV do
    only[ARGV[i]] = true
  end
end

local function waits_for_one_of_only(record)
  for i = RECORD_SLOTS, #record, 2 do
    if only[record[i]] then
      return true
    end
  end
  return false
end

-- Unclaimed: the releaser died before publishing, the message was lost, or the publisher
-- of a mark died before settling.  The waiter's entries never left the slots' lists, so
-- it keeps its place.
for _, task_id in ipairs(redis.call('ZRANGEBYSCORE', keys.dispatches, '-inf', score_text(now))) do
  local record = read_waiter(keys.waiting, task_id)
  if record == nil then
    redis.call('ZREM', keys.dispatches, task_id)
  elseif only == nil or waits_for_one_of_only(record) then
    if record[4] ~= '' then
      -- (a mark has no leases: no run of the task carries it)
      local run = read_run(runs_key, record[4])
      if run ~= nil and run[1] == task_id and run[2] == DISPATCH_HOLDER then
        delete_run(prefix, runs_key, expiry_key, record[4])
      end
      record[4], record[5] = '', ''
      redis.call('HSET', keys.waiting, task_id, cmsgpack.pack(record))
    end
    redis.call('ZREM', keys.dispatches, task_id)
  end
end

local slots
if only == nil then
  slots = redis.call('SMEMBERS', keys.waitlists)
else
  -- The named slots, and every slot their waiting (not dispatched) tasks need.
  slots = {}
  local listed = {}
  local function add(slot)
    if not listed[slot] then
      listed[slot] = true
      slots[#slots + 1] = slot
    end
  end
  for i = 4, #ARGV do
    local waiters_key = slot_key(prefix, ARGV[i], 'waiters')
    if redis.call('EXISTS', waiters_key) == 1 then
      add(ARGV[i])
      for _, member in ipairs(redis.call('ZRANGE', waiters_key, 0, -1)) do
        local record = read_waiter(keys.waiting, waiter_task_id(member))
        if record ~= nil and record[4] == '' then
          for j = RECORD_SLOTS, #record, 2 do
            add(record[j])
          end
        end
      end
    end
  end
end

return dispatch_waiters(prefix, runs_key, expiry_key, keys, slots, now, lease_seconds, nonce)
