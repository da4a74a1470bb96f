-- celery-caps leases: every lease (of one slot, if a name is given), live or expired.
--
-- KEYS: limits, runs, expiry
-- ARGV: prefix [, slot name]
-- Returns {slot, task id, run id, holder, seconds until expiry, task name, age in
-- seconds, weight, ...}; the seconds are text, since a Lua number in a reply would be
-- truncated to an integer; task name and age are '' when unknown.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local prefix, only_slot = ARGV[1], ARGV[2]
local now = now_seconds()

local leases = {}
local function add(slot, run_id, run, weights, expiry)
  leases[#leases + 1] = slot
  leases[#leases + 1] = run[1]
  leases[#leases + 1] = run_id
  leases[#leases + 1] = run[2]
  leases[#leases + 1] = string.format('%.6f', tonumber(expiry) - now)
  local packed = redis.call('HGET', runs_key, meta_field(run_id))
  if packed then
    local meta = cmsgpack.unpack(packed)
    leases[#leases + 1] = meta[1]
    leases[#leases + 1] = string.format('%.6f', now - tonumber(meta[2]))
  else
    leases[#leases + 1] = ''
    leases[#leases + 1] = ''
  end
  leases[#leases + 1] = weights and weights[slot] or 1
end

if only_slot then
  local entries = redis.call('ZRANGE', slot_key(prefix, only_slot, 'runs'), 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    local run, weights = read_run(runs_key, entries[i])
    if run ~= nil then
      add(only_slot, entries[i], run, weights, entries[i + 1])
    end
  end
else
  local entries = redis.call('ZRANGE', expiry_key, 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    local run, weights = read_run(runs_key, entries[i])
    if run ~= nil then
      for j = 3, #run do
        add(run[j], entries[i], run, weights, entries[i + 1])
      end
    end
  end
end
return leases
