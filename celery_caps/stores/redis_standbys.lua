-- celery-caps standbys (for operators and tests): every standby record.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix
-- Returns {task id, holder ('' until its process waits), taken ('1'/'0'), seconds to expiry, ...}.

local now = now_seconds()
local reply = {}
local all = redis.call('HGETALL', standby_key(ARGV[1]))
for i = 1, #all, 2 do
  local standby = cmsgpack.unpack(all[i + 1])
  reply[#reply + 1] = all[i]
  reply[#reply + 1] = standby[4]
  reply[#reply + 1] = standby[3] ~= '' and '1' or '0'
  reply[#reply + 1] = score_text(standby[2] - now)
end
return reply
