-- celery-caps: helpers shared by every Redis script.  redis.py prepends this file
-- to each script, so each script is still one self-contained EVAL.  The key
-- layout is described in redis.py's module docstring.
--
-- Index keys a script needs are passed in KEYS by the caller; per-slot and
-- per-task keys named by what is stored (a run's slot names) can only be
-- derived here, from the key prefix in ARGV, exactly as redis.py derives them.

-- Redis < 5 replicates a script by re-running it, which forbids writes after the
-- non-deterministic TIME; replicating the effects instead makes them legal.  Since
-- Redis 5 that is the default and this call does nothing.
if redis.replicate_commands then
  redis.replicate_commands()
end

-- The store's clock, in seconds since the epoch: lease expiry never depends on a
-- worker's clock.
local function now_seconds()
  local time = redis.call('TIME')
  return tonumber(time[1]) + tonumber(time[2]) / 1000000
end

-- The store's clock as a number and as fixed-width text, 'sssssssssss.uuuuuu', from one
-- TIME: texts of different moments sort (byte by byte) as the moments do.
local function now_with_text()
  local time = redis.call('TIME')
  local text = string.rep('0', 11 - #time[1]) .. time[1] .. '.' .. string.rep('0', 6 - #time[2]) .. time[2]
  return tonumber(time[1]) + tonumber(time[2]) / 1000000, text
end

-- A score as text.  Lua would print 14 significant digits and lose the
-- sub-millisecond part of an epoch timestamp; 17 round-trip a double exactly.
local function score_text(seconds)
  return string.format('%.17g', seconds)
end

-- Redis Cluster hashes the text between the first '{' and the next '}'.  Escaping
-- both (and '%', the escape itself, so that the mapping stays injective) keeps a
-- slot name from closing its hash tag early or smuggling in another one.
local TAG_ESCAPES = { ['%'] = '%25', ['{'] = '%7B', ['}'] = '%7D' }

local function slot_key(prefix, slot, kind)
  local tag = string.gsub(slot, '[%%{}]', TAG_ESCAPES)
  return prefix .. ':slot:{' .. tag .. '}:' .. kind
end

local function task_key(prefix, task_id)
  return prefix .. ':task:' .. task_id
end

-- A run's details for operators, { task name or '', acquired at }, live in the
-- runs hash too, under the run id followed by NUL and 'meta' (scripts of older
-- versions read only the run id's own field, and a run id never ends that way).
local function meta_field(run_id)
  return run_id .. '\0meta'
end

-- A run's record: { task id, holder, slot name, ... } in MessagePack, which is
-- binary-safe whatever bytes the names contain.
local function read_run(runs_key, run_id)
  local packed = redis.call('HGET', runs_key, run_id)
  if not packed then
    return nil
  end
  return cmsgpack.unpack(packed)
end

-- Recompute a task's score in a slot's task set: the latest expiry among the
-- task's runs that hold that slot, or no entry when none does.  Admission counts
-- distinct live task ids from this set in O(log n), however many runs they have.
local function refresh_task(prefix, slot, task_id)
  local runs_key = slot_key(prefix, slot, 'runs')
  local latest = nil
  for _, run_id in ipairs(redis.call('SMEMBERS', task_key(prefix, task_id))) do
    local expiry = redis.call('ZSCORE', runs_key, run_id)
    if expiry then
      expiry = tonumber(expiry)
      if latest == nil or expiry > latest then
        latest = expiry
      end
    end
  end
  local tasks_key = slot_key(prefix, slot, 'tasks')
  if latest == nil then
    redis.call('ZREM', tasks_key, task_id)
  else
    redis.call('ZADD', tasks_key, score_text(latest), task_id)
  end
end

-- Give a task's score in a slot a new expiry from one of its runs.  Only when the
-- new expiry is earlier than the recorded one (a renewal with a shorter lease)
-- can another run be the latest, and only then is the set recomputed.
local function raise_task(prefix, slot, task_id, expiry)
  local tasks_key = slot_key(prefix, slot, 'tasks')
  local recorded = redis.call('ZSCORE', tasks_key, task_id)
  if recorded and expiry < tonumber(recorded) then
    refresh_task(prefix, slot, task_id)
  else
    redis.call('ZADD', tasks_key, score_text(expiry), task_id)
  end
end

-- Delete every lease of one run (all of a run's leases share one expiry, and are
-- taken and dropped together); returns how many leases that was.
local function delete_run(prefix, runs_key, expiry_key, run_id)
  local run = read_run(runs_key, run_id)
  redis.call('HDEL', runs_key, run_id, meta_field(run_id))
  redis.call('ZREM', expiry_key, run_id)
  if run == nil then
    return 0
  end
  local task_id = run[1]
  redis.call('SREM', task_key(prefix, task_id), run_id)
  for i = 3, #run do
    redis.call('ZREM', slot_key(prefix, run[i], 'runs'), run_id)
    refresh_task(prefix, run[i], task_id)
  end
  return #run - 2
end

-- The names of keyed slots ('cap:key'), all at score 0, so that a cap's keys are a range
-- by name (ZLEXCOUNT): the sweep's count of keys reads no list of every slot name.
local function keyed_names_key(prefix)
  return prefix .. ':keyed'
end

-- The sentinel: a slot's last limit.  Written only when it changes, so that a busy
-- slot does not replicate the same value on every admission; a new keyed slot's name
-- joins the keyed names.
local function remember_limit(prefix, limits_key, slot, limit_text)
  if redis.call('HGET', limits_key, slot) ~= limit_text then
    if redis.call('HSET', limits_key, slot, limit_text) == 1 and string.find(slot, ':', 1, true) then
      redis.call('ZADD', keyed_names_key(prefix), 0, slot)
    end
  end
end

-- Whether `task_id` holds a live lease in the slot whose task set is `tasks_key`.
local function holds_live_lease(tasks_key, task_id, now)
  local held_until = redis.call('ZSCORE', tasks_key, task_id)
  return held_until ~= false and tonumber(held_until) > now
end

-- The limit an operator set for `slot` (celery caps limit): the slot's own, else its
-- cap's; nil if neither.
local function operator_limit(prefix, slot)
  local limits_key = prefix .. ':operator_limits'
  local limit = redis.call('HGET', limits_key, slot)
  if not limit then
    local colon = string.find(slot, ':', 1, true)
    if colon then
      limit = redis.call('HGET', limits_key, string.sub(slot, 1, colon - 1))
    end
  end
  return limit and tonumber(limit) or nil
end

-- Whether `slot` admits `task_id` now: fewer than its limit (the operator's, else
-- `limit`) distinct task ids hold a live lease there, or the task id is one of them (a
-- task id counts once).  `cache`, if given, keeps each slot's key, live count and
-- operator's limit between calls (room only shrinks within a script); forget a slot's
-- entry after adding a lease to it.
local function slot_has_room(prefix, slot, limit, task_id, now, cache)
  local entry = cache and cache[slot]
  if entry == nil then
    local tasks_key = slot_key(prefix, slot, 'tasks')
    entry = {
      key = tasks_key,
      live = redis.call('ZCOUNT', tasks_key, '(' .. score_text(now), '+inf'),
      limit = operator_limit(prefix, slot),
    }
    if cache then
      cache[slot] = entry
    end
  end
  if entry.live < (entry.limit or limit) then
    return true
  end
  return holds_live_lease(entry.key, task_id, now)
end

-- Record a run holding one lease in each of `slots` (a list of names), expiring
-- `lease_seconds` after `now`.  A run id names one admission: asking again with it
-- (a client retrying after a lost reply, or a run whose leases expired) replaces
-- what it held.
local function write_run(prefix, runs_key, expiry_key, task_id, run_id, holder, slots, lease_seconds, now, task_name)
  delete_run(prefix, runs_key, expiry_key, run_id)
  local expiry = now + lease_seconds
  local expiry_text = score_text(expiry)
  local run = { task_id, holder }
  for _, slot in ipairs(slots) do
    run[#run + 1] = slot
  end
  redis.call('HSET', runs_key, run_id, cmsgpack.pack(run))
  -- What operators see besides: the task's name and when the lease was taken.
  redis.call('HSET', runs_key, meta_field(run_id), cmsgpack.pack({ task_name, now }))
  redis.call('ZADD', expiry_key, expiry_text, run_id)
  redis.call('SADD', task_key(prefix, task_id), run_id)
  for _, slot in ipairs(slots) do
    redis.call('ZADD', slot_key(prefix, slot, 'runs'), expiry_text, run_id)
    raise_task(prefix, slot, task_id, expiry)
  end
end

-- Move every lease of a run (`run` as read_run returns it) to `expiry`.
local function extend_run(prefix, expiry_key, run_id, run, expiry)
  local expiry_text = score_text(expiry)
  redis.call('ZADD', expiry_key, expiry_text, run_id)
  for j = 3, #run do
    redis.call('ZADD', slot_key(prefix, run[j], 'runs'), expiry_text, run_id)
    raise_task(prefix, run[j], run[1], expiry)
  end
end
