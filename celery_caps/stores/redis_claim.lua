-- celery-caps claim: a dispatched task arrived.  Its live dispatch leases become a
-- run lease (its holder, a full lease), and it leaves the waiting list.
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, task id, run id (of the dispatch), holder, lease seconds
-- Returns { how many leases were claimed (0: the dispatch expired; admit as usual),
-- 1 if other tasks still wait for one of the claimed slots else 0,
-- 1 if nothing was claimed and the task is dispatched again to another run with a live
-- dispatch (its entry stays, for that run's copy; this copy ends) else 0 }.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, task_id, run_id, holder, lease_seconds = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local now = now_seconds()

local claimed = 0
local run = read_run(runs_key, run_id)
local expiry = redis.call('ZSCORE', expiry_key, run_id)
-- An expired dispatch is never revived: its room may belong to another task now.
if run ~= nil and run[1] == task_id and expiry and tonumber(expiry) > now then
  run[2] = holder
  redis.call('HSET', runs_key, run_id, cmsgpack.pack(run))
  extend_run(prefix, expiry_key, run_id, run, now + lease_seconds)
  claimed = #run - 2
end
local record = read_waiter(keys.waiting, task_id)
local elsewhere = 0
if claimed == 0 and record ~= nil and record[4] ~= '' and record[4] ~= run_id and tonumber(record[5]) > now then
  elsewhere = 1
elseif record ~= nil then
  remove_waiter(prefix, keys, task_id, record)
end
local behind = 0
if claimed > 0 then
  for i = 3, #run do
    if redis.call('EXISTS', slot_key(prefix, run[i], 'waiters')) == 1 then
      behind = 1
      break
    end
  end
end
return { claimed, behind, elsewhere }
