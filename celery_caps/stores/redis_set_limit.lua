-- celery-caps set limit: set (ARGV[2]) or remove (no ARGV[2]) the limit an operator set for a
-- cap or slot name (ARGV[1]), which slot_has_room counts against in every admission and hand-over.
--
-- KEYS: the operators' limits
-- Returns the limit it replaces, or false.

local previous = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return previous
