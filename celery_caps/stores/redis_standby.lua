-- celery-caps standby, the waiting process's side (see redis.py).
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, task id, mark, then
--       'register', holder, lease seconds: the process waits (a dispatch from now on
--                                          creates the run in its name);
--       'end': the process gives up (the standby ends unless a dispatch took it).
-- Returns {'waiting', seconds the standby has left} (registered: the wait ends by then, as no
-- dispatch takes an expired standby), {'ended'}, {'gone'} (not this mark's standby, or
-- expired), or {'taken', run id, 'claimed' | 'dispatched'}.

local prefix, task_id, mark, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now = now_seconds()
local standby = read_standby(prefix, task_id)
if standby == nil or standby[1] ~= mark then
  return { 'gone' }
end
if standby[3] ~= '' then
  -- Claimed for this process only if the dispatch used its own name (another copy's, say
  -- of a process that died, is to be claimed like a dispatch: claim checks it).
  local mine = mode == 'register' and standby[4] ~= '' and standby[4] == ARGV[5]
  return { 'taken', standby[3], mine and 'claimed' or 'dispatched' }
end
if standby[2] <= now then
  redis.call('HDEL', standby_key(prefix), task_id)
  return { 'gone' }
end
if mode == 'register' then
  standby[4], standby[5] = ARGV[5], tonumber(ARGV[6])
  write_standby(prefix, task_id, standby)
  return { 'waiting', string.format('%.6f', standby[2] - now) }
end
redis.call('HDEL', standby_key(prefix), task_id)
redis.call('DEL', signal_key(prefix, task_id))
return { 'ended' }
