-- celery-caps keys per cap: how many keys each keyed cap has, from the keyed names (every
-- 'cap:key' slot name, at score 0), one cap after the other: each cap's first name, then its
-- keys counted as a range by name (ZLEXCOUNT, logarithmic).  It never reads every slot name.
-- The names are complete once the member '' marks them so (a store whose slots were named
-- before the keyed names existed fills them once, with redis_keyed.lua).
--
-- KEYS: limits
-- ARGV: prefix
-- Returns {'1' if the names are complete else '0', cap, keys, cap, keys, ...}.

local key = keyed_names_key(ARGV[1])
if redis.call('ZSCORE', key, '') == false then
  return { '0' }
end
local counts = { '1' }
local from = '('
while true do
  local first = redis.call('ZRANGEBYLEX', key, from, '+', 'LIMIT', 0, 1)[1]
  if first == nil then
    return counts
  end
  -- Cap names have no ':': a cap's names are those from 'cap:' up to 'cap;' (the next byte).
  local cap = string.sub(first, 1, string.find(first, ':', 1, true) - 1)
  counts[#counts + 1] = cap
  counts[#counts + 1] = redis.call('ZLEXCOUNT', key, '[' .. cap .. ':', '(' .. cap .. ';')
  from = '[' .. cap .. ';'
end
