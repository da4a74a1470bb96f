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

-- Weights (a task taking w units of a slot's limit): a run's, or a waiting entry's, live beside
-- its record in the same hash, under its id followed by NUL and 'weights', as MessagePack
-- { slot name = weight } of the slots where it is above 1; absent for a task of weight 1
-- everywhere, so that the unweighted path reads and writes nothing more.  (Ids hold no NUL.)
local function weights_field(id)
  return id .. '\0weights'
end

local function unpack_weights(packed)
  return packed and cmsgpack.unpack(packed) or nil
end

-- A run's record: { task id, holder, slot name, ... } in MessagePack, which is
-- binary-safe whatever bytes the names contain; and its weights (nil: 1 in every slot),
-- read with it in one command.
local function read_run(runs_key, run_id)
  local found = redis.call('HMGET', runs_key, run_id, weights_field(run_id))
  if not found[1] then
    return nil
  end
  return cmsgpack.unpack(found[1]), unpack_weights(found[2])
end

-- A slot's weighted holders: P:slot:{E}:weights, task id -> its weight in the slot (the largest
-- of its runs there, live or not yet swept), for the task ids of weight above 1 alone.  The
-- units a slot's live holders take are its live task ids plus, for each live weighted one,
-- its weight (at most the limit) less 1.
local function weights_key(prefix, slot)
  return slot_key(prefix, slot, 'weights')
end

-- Recompute a task's score in a slot's task set: the latest expiry among the
-- task's runs that hold that slot, or no entry when none does.  Admission counts
-- distinct live task ids from this set in O(log n), however many runs they have.
-- With `runs_key` (the runs hash: a weighted run of the task left the slot), its weight
-- in the slot's weighted holders is recomputed too, from the runs that remain.
local function refresh_task(prefix, slot, task_id, runs_key)
  local slot_runs_key = slot_key(prefix, slot, 'runs')
  local latest = nil
  local weight = 1
  for _, run_id in ipairs(redis.call('SMEMBERS', task_key(prefix, task_id))) do
    local expiry = redis.call('ZSCORE', slot_runs_key, run_id)
    if expiry then
      expiry = tonumber(expiry)
      if latest == nil or expiry > latest then
        latest = expiry
      end
      if runs_key then
        local weights = unpack_weights(redis.call('HGET', runs_key, weights_field(run_id)))
        weight = math.max(weight, weights and weights[slot] or 1)
      end
    end
  end
  local tasks_key = slot_key(prefix, slot, 'tasks')
  if latest == nil then
    redis.call('ZREM', tasks_key, task_id)
  else
    redis.call('ZADD', tasks_key, score_text(latest), task_id)
  end
  if runs_key then
    if weight > 1 then
      redis.call('HSET', weights_key(prefix, slot), task_id, weight)
    else
      redis.call('HDEL', weights_key(prefix, slot), task_id)
    end
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
  local run, weights = read_run(runs_key, run_id)
  redis.call('HDEL', runs_key, run_id, meta_field(run_id), weights_field(run_id))
  redis.call('ZREM', expiry_key, run_id)
  if run == nil then
    return 0
  end
  local task_id = run[1]
  redis.call('SREM', task_key(prefix, task_id), run_id)
  for i = 3, #run do
    redis.call('ZREM', slot_key(prefix, run[i], 'runs'), run_id)
    -- Only a weighted run's leaving can change the task's weight in the slot.
    refresh_task(prefix, run[i], task_id, weights and weights[run[i]] and runs_key)
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

-- Length of the park-time text that starts a waiters member (see now_with_text), and of the
-- slot signature after it (see redis_waitlist.lua); the task id follows.
local PARKED_WIDTH = 18
local SIGNATURE_WIDTH = 16

-- The heavy entries of a slot: P:slot:{E}:heavy (deployment ''), P:slot:{E}:heavy:<deployment>,
-- the waiting (not dispatched) entries of that deployment whose weight in the slot is above 1,
-- in waiting order: score = first-deferral time, member = the entry's waiters member, NUL, its
-- weight in the slot.  The oldest holds the room it needs (see heavy_holds).
local function heavy_key(prefix, slot, deployment)
  return slot_key(prefix, slot, deployment == '' and 'heavy' or 'heavy:' .. deployment)
end

local function heavy_member(waiters_member, weight)
  return waiters_member .. '\0' .. weight
end

-- A slot's counts for room, as { key = its task set, limit = the operator's or nil, live =
-- distinct live task ids, weights = its live weighted holders (task id -> weight), read when
-- first needed }.  `cache`, if given, keeps them between calls (see slot_has_room).
local function slot_state(prefix, slot, now, cache)
  local state = cache and cache[slot]
  if state == nil then
    state = { key = slot_key(prefix, slot, 'tasks'), limit = operator_limit(prefix, slot) }
    if cache then
      cache[slot] = state
    end
  end
  if state.live == nil then
    state.live = redis.call('ZCOUNT', state.key, '(' .. score_text(now), '+inf')
  end
  return state
end

-- The units of `limit` a slot's live holders take: each live task id one, a weighted one its
-- weight (at most `limit`).  Reads the weighted holders once per state (one HGETALL, of
-- nothing when no holder is weighted, and a ZSCORE per weighted holder).
local function slot_units(prefix, slot, state, limit, now)
  if state.weights == nil then
    state.weights = {}
    local found = redis.call('HGETALL', weights_key(prefix, slot))
    for i = 1, #found, 2 do
      if holds_live_lease(state.key, found[i], now) then
        state.weights[found[i]] = tonumber(found[i + 1])
      end
    end
  end
  local units = state.live
  for _, weight in pairs(state.weights) do
    units = units + math.min(weight, limit) - 1
  end
  return units
end

-- Whether the oldest heavy entry at `key` (of another task id than `task_id`) needs more than
-- `free` units of the slot (each weight at most `limit`): it holds them against newcomers.
local function heavy_holds(key, task_id, free, limit)
  for _, member in ipairs(redis.call('ZRANGE', key, 0, 1)) do
    local cut = string.find(member, '%z[0-9]+$')
    if string.sub(member, PARKED_WIDTH + SIGNATURE_WIDTH + 1, cut - 1) ~= task_id then
      return math.min(tonumber(string.sub(member, cut + 1)), limit) > free
    end
  end
  return false
end

-- Whether `slot` admits `task_id` at `weight` now: the task id holds a live lease there
-- already (a task id counts once), or `weight` (at most the limit: the operator's, else
-- `limit`) fits the units its live holders leave free.  A newcomer (an admission: `deployment`
-- given, the handle's) also finds no room where the slot's oldest heavy entry of that
-- deployment needs more than is free (see ParkingStore's weights); a hand-over (`deployment`
-- nil) walks the entries in order itself.  `cache`, if given, keeps each slot's counts between
-- calls (room only shrinks within a script); after adding a lease to a slot, forget its `live`
-- and add the task's weight to its `weights` (see took_room).
local function slot_has_room(prefix, slot, limit, task_id, now, cache, weight, deployment)
  local state = slot_state(prefix, slot, now, cache)
  limit = state.limit or limit
  -- Every live task id takes a unit at least: a slot whose live task ids fill it is full.
  if state.live < limit then
    local need = math.min(weight or 1, limit)
    if deployment == nil then
      if need <= limit - slot_units(prefix, slot, state, limit, now) then
        return true
      end
    else
      local heavy = heavy_key(prefix, slot, deployment)
      if state.plain == nil then
        -- No weighted holder and no heavy entry: room is counted as without weights.
        state.plain = redis.call('EXISTS', weights_key(prefix, slot), heavy) == 0
      end
      if state.plain then
        if need <= limit - state.live then
          return true
        end
      else
        local free = limit - slot_units(prefix, slot, state, limit, now)
        if need <= free and not heavy_holds(heavy, task_id, free, limit) then
          return true
        end
      end
    end
  end
  return holds_live_lease(state.key, task_id, now)
end

-- A cached slot state after `task_id` took a lease of it at `weight`: its live count is read
-- again, and its weighted holders know the task's weight.
local function took_room(cache, slot, task_id, weight)
  local state = cache[slot]
  if state ~= nil then
    state.live = nil
    if weight > 1 and state.weights ~= nil then
      state.weights[task_id] = math.max(state.weights[task_id] or 1, weight)
    end
    state.plain = nil
  end
end

-- Record a run holding one lease in each of `slots` (a list of names), expiring
-- `lease_seconds` after `now`.  A run id names one admission: asking again with it
-- (a client retrying after a lost reply, or a run whose leases expired) replaces
-- what it held.  `weights` (nil: 1 everywhere) maps slots of `slots` to the run's weight
-- there, for those above 1.
local function write_run(prefix, runs_key, expiry_key, task_id, run_id, holder, slots, lease_seconds, now, task_name,
    weights)
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
  if weights then
    redis.call('HSET', runs_key, weights_field(run_id), cmsgpack.pack(weights))
  end
  redis.call('ZADD', expiry_key, expiry_text, run_id)
  redis.call('SADD', task_key(prefix, task_id), run_id)
  for _, slot in ipairs(slots) do
    redis.call('ZADD', slot_key(prefix, slot, 'runs'), expiry_text, run_id)
    raise_task(prefix, slot, task_id, expiry)
    local weight = weights and weights[slot]
    if weight then
      local key = weights_key(prefix, slot)
      if weight > tonumber(redis.call('HGET', key, task_id) or 1) then
        redis.call('HSET', key, task_id, weight)
      end
    end
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
