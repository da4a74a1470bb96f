-- celery-caps prune: delete the sentinels of slots no live lease holds and no parked
-- task waits for (waiting or dispatched), with the expired leases of those slots.
-- Tombstones are left to expire by themselves.
-- (A slot with waiters is in use: waking them counts room by its sentinel, and status
-- keeps listing it, as on the other stores.)
--
-- KEYS: limits, runs, expiry
-- ARGV: prefix, '1' for a dry run or '0', candidate slot name, ...
-- Returns the slot names pruned (or that would be).  Atomic: an admission runs
-- wholly before (its lease keeps the slot) or after (it writes the sentinel again).

local limits_key, runs_key, expiry_key = KEYS[1], KEYS[2], KEYS[3]
local prefix, dry_run = ARGV[1], ARGV[2] == '1'
local now = now_seconds()
local live_from = '(' .. score_text(now)

local pruned = {}
for i = 3, #ARGV do
  local slot = ARGV[i]
  if redis.call('HEXISTS', limits_key, slot) == 1
      and redis.call('ZCOUNT', slot_key(prefix, slot, 'tasks'), live_from, '+inf') == 0
      and redis.call('EXISTS', slot_key(prefix, slot, 'waiters')) == 0 then
    pruned[#pruned + 1] = slot
    if not dry_run then
      -- Every run left in the slot has expired (a run's leases share one expiry).
      for _, run_id in ipairs(redis.call('ZRANGE', slot_key(prefix, slot, 'runs'), 0, -1)) do
        delete_run(prefix, runs_key, expiry_key, run_id)
      end
      redis.call('HDEL', limits_key, slot)
      redis.call('ZREM', keyed_names_key(prefix), slot)
    end
  end
end
return pruned
