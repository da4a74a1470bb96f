-- celery-caps status: every slot name ever admitted into, from one snapshot.
--
-- KEYS: limits
-- ARGV: prefix
-- Returns {slot, limit, live distinct task ids, expired unswept leases, ...}.

local prefix = ARGV[1]
local now = now_seconds()
local now_text = score_text(now)
local live_from = '(' .. now_text

local limits = redis.call('HGETALL', KEYS[1])
local status = {}
for i = 1, #limits, 2 do
  local slot = limits[i]
  status[#status + 1] = slot
  status[#status + 1] = limits[i + 1]
  status[#status + 1] = redis.call('ZCOUNT', slot_key(prefix, slot, 'tasks'), live_from, '+inf')
  status[#status + 1] = redis.call('ZCOUNT', slot_key(prefix, slot, 'runs'), '-inf', now_text)
end
return status
