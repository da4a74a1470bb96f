-- celery-caps stand_by: put the oldest waiting waiters of some slots on standby (see
-- redis.py), at most `per slot` waiters of each slot (and never more than its limit)
-- and `max total` untaken standbys in all.  Standbys past their expiry are dropped.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, per slot, max total, hold seconds, mark nonce, slot name, ...
-- Returns {task id, mark, task name, payload, '0', ...}, in the order chosen.

local keys = waitlist_keys()
local prefix, per_slot, max_total = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local hold_seconds, nonce = tonumber(ARGV[4]), ARGV[5]
local now = now_seconds()
-- Waiting entries read per slot beyond the bound itself.
local SCAN_EXTRA = 16

local open = 0
local all = redis.call('HGETALL', standby_key(prefix))
for i = 1, #all, 2 do
  local standby = cmsgpack.unpack(all[i + 1])
  if standby[2] <= now then
    redis.call('HDEL', standby_key(prefix), all[i])
  elseif standby[3] == '' then
    open = open + 1
  end
end

local chosen, reply, sequence = {}, {}, 0
for i = 6, #ARGV do
  if open >= max_total then
    break
  end
  local slot = ARGV[i]
  local on_standby, candidates, limit = 0, {}, nil
  for _, member in ipairs(redis.call('ZRANGE', slot_key(prefix, slot, 'waiters'), 0, per_slot + SCAN_EXTRA - 1)) do
    local task_id = waiter_task_id(member)
    local record = read_waiter(keys.waiting, task_id)
    if record ~= nil and record[4] == '' then
      if limit == nil then
        for j = RECORD_SLOTS, #record, 2 do
          if record[j] == slot then
            limit = tonumber(record[j + 1])
          end
        end
      end
      if standby_open(read_standby(prefix, task_id), now) then
        on_standby = on_standby + 1
      elseif not chosen[task_id] then
        candidates[#candidates + 1] = { task_id, record }
      end
    end
  end
  local wanted = math.min(per_slot, limit or per_slot) - on_standby
  for _, candidate in ipairs(candidates) do
    if wanted <= 0 or open >= max_total then
      break
    end
    local task_id, record = candidate[1], candidate[2]
    sequence = sequence + 1
    local mark = nonce .. string.format('%08x', sequence)
    write_standby(prefix, task_id, { mark, now + hold_seconds, '', '', 0 })
    redis.call('DEL', signal_key(prefix, task_id))
    chosen[task_id] = true
    open = open + 1
    wanted = wanted - 1
    reply[#reply + 1] = task_id
    reply[#reply + 1] = mark
    reply[#reply + 1] = record[3]
    reply[#reply + 1] = redis.call('HGET', keys.payloads, task_id) or ''
    reply[#reply + 1] = '0'
  end
end
return reply
