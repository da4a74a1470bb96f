-- celery-caps readmit: an operator empties a slot's list.  Every waiting (not dispatched)
-- entry of the slot of the handle's deployment (the others keep their place) is dispatched
-- without leases, oldest first: its copy goes through admission again.  Each stays listed,
-- dispatched, until its copy claims it (or recover puts it back when its deadline passes
-- unclaimed).
--
-- KEYS: limits, runs, expiry, waiting, payloads, waitlists, dispatches
-- ARGV: prefix, deployment, dispatch lease seconds, run id nonce, slot name
-- Returns {task id, run id, task name, payload, readmit ('1'), ...}, oldest first.

local runs_key, expiry_key = KEYS[2], KEYS[3]
local keys = waitlist_keys()
local prefix, deployment, lease_seconds, nonce, slot = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]

local members = {}
local lists = handle_lists(prefix, deployment)
collect_members(lists.key(slot), '+inf', members)
local woken = {}
readmit_members(prefix, runs_key, expiry_key, keys, members, now_seconds(), lease_seconds,
  run_id_source(runs_key, nonce), lists, woken)
return woken
