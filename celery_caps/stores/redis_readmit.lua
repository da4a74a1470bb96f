-- celery-caps readmit: an operator empties a slot's list.  Every waiting (not dispatched)
-- entry of the slot is dispatched without leases, oldest first: its copy goes through
-- admission again.  Each stays listed, dispatched, until its copy claims it (or recover puts
-- it back when its deadline passes unclaimed).
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, dispatch lease seconds, run id nonce, slot name
-- Returns {task id, run id, task name, payload, readmit ('1'), ...}, oldest first.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, lease_seconds, nonce, slot = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

local members = {}
collect_members(prefix, slot, '+inf', members)
local woken = {}
readmit_members(prefix, runs_key, expiry_key, keys, members, now_seconds(), lease_seconds,
  run_id_source(runs_key, nonce), woken)
return woken
