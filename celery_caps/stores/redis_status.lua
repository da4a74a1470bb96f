-- celery-caps status: the slot names given (a batch of those the caller read from the limits
-- hash with HSCAN), each still known, from one snapshot: a call costs its batch, never every
-- slot name at once.
--
-- KEYS: limits
-- ARGV: prefix, slot names...
-- Returns {slot, limit, live distinct task ids, expired unswept leases, units the live holders
-- take ('' when each takes one), ...}.

local prefix = ARGV[1]
local now = now_seconds()
local now_text = score_text(now)

local status = {}
for i = 2, #ARGV do
  local slot = ARGV[i]
  local limit = redis.call('HGET', KEYS[1], slot)
  if limit then
    status[#status + 1] = slot
    status[#status + 1] = limit
    local state = slot_state(prefix, slot, now, nil)
    status[#status + 1] = state.live
    status[#status + 1] = redis.call('ZCOUNT', slot_key(prefix, slot, 'runs'), '-inf', now_text)
    -- Units against the limit in force (the operator's, else the sentinel's).
    local units = slot_units(prefix, slot, state, state.limit or tonumber(limit), now)
    status[#status + 1] = next(state.weights) and tostring(units) or ''
  end
end
return status
