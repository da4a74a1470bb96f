-- celery-caps claim: a copy of a task carrying dispatch run id D arrived; decide whether
-- it runs, ends, or goes through admission (SlotStore.claim's table, row by row).
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches, the task's tombstone
-- ARGV: prefix, task id, run id (D), holder, lease seconds, '1' if the broker redelivered the
--       copy else '0', tombstone milliseconds
-- Returns 'run', 'end' or 'admit'.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, task_id, run_id, holder = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_seconds, redelivered, done_milliseconds = tonumber(ARGV[5]), ARGV[6] == '1', tonumber(ARGV[7])
local now = now_seconds()

if done_key(prefix, task_id) ~= KEYS[8] then
  return redis.error_reply('celery-caps: key layout mismatch (tombstone key)')
end

-- D's leases, if D is a run of this task (a run id of another task is no dispatch of it).
local run = read_run(runs_key, run_id)
if run ~= nil and run[1] ~= task_id then
  run = nil
end
local live = false
if run ~= nil then
  local expiry = redis.call('ZSCORE', expiry_key, run_id)
  live = expiry ~= false and tonumber(expiry) > now
end
local record, record_weights, record_fair = read_waiter(keys.waiting, task_id)

-- The entry leaves the list; a tombstone stays if other copies may be on their way.
-- (`tombstone`: always leave one; else only if the entry was dispatched more than once.)
local function settle(tombstone)
  settle_waiter(prefix, keys, task_id, record, record_weights, record_fair,
    tombstone or record[RECORD_DISPATCHES] > 1, done_milliseconds, holder)
end

-- Whether a slot of the run holds more units than its limit now (the operator's, else its
-- sentinel's), the run's own among them: a limit cut since the dispatch.
local function over_limit()
  for j = 3, #run do
    local slot = run[j]
    local state = slot_state(prefix, slot, now, nil)
    local limit = state.limit or tonumber(redis.call('HGET', KEYS[1], slot))
    if limit ~= nil and (state.live > limit or slot_units(prefix, slot, state, limit, now) > limit) then
      return true
    end
  end
  return false
end

-- 1. Live dispatch leases: they become this copy's run, unless a limit was cut since the
-- dispatch (then they go as in 3, and the copy goes through admission); or they are this
-- holder's run already (the same claim again, retried after its reply was lost).  (A run's
-- leases share one holder and one expiry, so they are all live dispatch leases or none is.)
if live and run[2] == DISPATCH_HOLDER and over_limit() then
  live = false
end
if live and (run[2] == DISPATCH_HOLDER or run[2] == holder) then
  run[2] = holder
  redis.call('HSET', runs_key, run_id, cmsgpack.pack(run))
  extend_run(prefix, expiry_key, run_id, run, now + lease_seconds)
  if record ~= nil and record[RECORD_RUN_ID] == run_id then
    settle(false)
  end
  return 'run'
end

-- 2. Live, and held by the run of a copy that claimed first in another process.
if live then
  return redelivered and 'admit' or 'end'
end

-- 3. No live lease of D: what is left of it goes, and the entry decides.
delete_dispatch(prefix, runs_key, expiry_key, task_id, run_id)
if record == nil then
  local done = read_done(KEYS[8])
  if done == nil then
    return 'admit'
  end
  -- Only a copy of the dispatch the tombstone records goes on: redelivered (its run may have
  -- died), or this very claim retried after its reply was lost (its leases expired meanwhile).
  -- A copy of any other dispatch ends, redelivered or not.
  if done[1] == run_id and (redelivered or done[2] == holder) then
    return 'admit'
  end
  return 'end'
end
if record[RECORD_RUN_ID] ~= run_id then
  return 'end'
end
-- No lease is left to tell a duplicate copy of this dispatch that the task was taken: the
-- tombstone does.
settle(true)
return 'admit'
