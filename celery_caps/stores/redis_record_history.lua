-- celery-caps record history: append events, then trim by age and by count.
--
-- KEYS: history
-- ARGV: keep seconds, max events, then per event: its time (score) and its
--       document (unique: it carries a random nonce)
-- Returns how many events the history holds.

local history_key = KEYS[1]
local keep_seconds, max_events = tonumber(ARGV[1]), tonumber(ARGV[2])
local newest = nil
for i = 3, #ARGV, 2 do
  local at = tonumber(ARGV[i])
  redis.call('ZADD', history_key, score_text(at), ARGV[i + 1])
  if newest == nil or at > newest then
    newest = at
  end
end
if newest ~= nil then
  redis.call('ZREMRANGEBYSCORE', history_key, '-inf', '(' .. score_text(newest - keep_seconds))
end
local size = redis.call('ZCARD', history_key)
if size > max_events then
  redis.call('ZREMRANGEBYRANK', history_key, 0, size - max_events - 1)
  size = max_events
end
return size
