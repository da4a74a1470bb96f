-- celery-caps keyed names, filled once: the keyed slot names given (a batch of those the
-- caller read from the limits hash with HSCAN) that are still known join the keyed names; the
-- last batch marks them complete (member '').  Slots named meanwhile join by themselves
-- (remember_limit), and prune takes its names out.
--
-- KEYS: limits
-- ARGV: prefix, '1' for the last batch else '0', slot name, ...

local key = keyed_names_key(ARGV[1])
for i = 3, #ARGV do
  local slot = ARGV[i]
  if string.find(slot, ':', 1, true) and redis.call('HEXISTS', KEYS[1], slot) == 1 then
    redis.call('ZADD', key, 0, slot)
  end
end
if ARGV[2] == '1' then
  redis.call('ZADD', key, 0, '')
end
return 0
