-- levee backend budget lease, fleet script version 1: one replica leases (or renews, or
-- returns) its slice of one backend's sequence slots and KV tokens.
-- KEYS[1]: hash of the backend's slices, one field per replica: "held_slots held_kv
--   want_slots want_kv expiry_ms" (server ms).
-- ARGV: replica id, lease ms, budget slots, budget kv, want slots, want kv, in-flight slots,
--   in-flight kv. Wants and in-flight all zero: the replica returns its slice.
-- A grant is min(max-min fair share of the budget over the live replicas' wants, budget −
-- what the others hold); the holding recorded is max(grant, in flight), so what a replica
-- still runs keeps counting after its slice shrank. Slices not renewed within the lease
-- are dropped here, by whichever replica comes next.
-- Returns {allowed slots, allowed kv, others' slots, others' kv, live replicas}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local ttl = tonumber(ARGV[2])
local budget = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local want = {tonumber(ARGV[5]), tonumber(ARGV[6])}
local use = {tonumber(ARGV[7]), tonumber(ARGV[8])}
local others = {}
local held = {0, 0}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local r = all[i]
  if r ~= me then
    local v = {}
    for n in string.gmatch(all[i + 1], '%S+') do
      v[#v + 1] = tonumber(n)
    end
    if v[5] == nil or v[5] <= now then
      redis.call('HDEL', KEYS[1], r)
    else
      others[#others + 1] = {r, v}
      held[1] = held[1] + v[1]
      held[2] = held[2] + v[2]
    end
  end
end
-- This replica's max-min fair share of budget[k]: in ascending order of want (ties by
-- replica id), each takes the smaller of its want and an equal part of what is left.
local function fair(k)
  local list = {{me, want[k]}}
  for _, o in ipairs(others) do
    list[#list + 1] = {o[1], o[2][k + 2]}
  end
  table.sort(list, function(a, b)
    if a[2] ~= b[2] then
      return a[2] < b[2]
    end
    return a[1] < b[1]
  end)
  local left = budget[k]
  local n = #list
  for i, e in ipairs(list) do
    local part = math.min(e[2], math.floor(left / (n - i + 1)))
    if e[1] == me then
      return part
    end
    left = left - part
  end
  return 0
end
local allowed = {0, 0}
local hold = {0, 0}
for k = 1, 2 do
  allowed[k] = math.min(fair(k), math.max(0, budget[k] - held[k]))
  hold[k] = math.max(allowed[k], use[k])
end
if want[1] == 0 and want[2] == 0 and use[1] == 0 and use[2] == 0 then
  redis.call('HDEL', KEYS[1], me)
else
  redis.call('HSET', KEYS[1], me,
    string.format('%d %d %d %d %d', hold[1], hold[2], want[1], want[2], now + ttl))
end
redis.call('PEXPIRE', KEYS[1], 3 * ttl)
return {allowed[1], allowed[2], held[1], held[2], #others + 1}
