-- levee backend budget lease, fleet script version 2: one replica leases (or renews, or
-- returns) its slice of one backend's sequence slots and KV tokens.
-- KEYS[1]: hash of the backend's slices, one field per replica: "held_slots held_kv
--   expiry_ms want_slots_0 want_kv_0 want_slots_1 want_kv_1 ..." (server ms; one want pair
--   per priority class, the highest first).
-- ARGV: replica id, lease ms, budget slots, budget kv, in-flight slots, in-flight kv (what
--   the replica may run until this answer reaches it: in flight, or the slice it admits
--   against meanwhile, whichever is larger), then
--   the replica's want per class: slots, kv, slots, kv, ... Wants and in-flight all zero (or
--   no wants): the replica returns its slice.
-- A grant is min(tiered share of the budget over the live replicas' wants, budget − what the
-- others hold): class by class, highest first, each class's wants split max-min fair over
-- what the classes above left; the holding recorded is max(grant, in flight), so what a
-- replica still runs keeps counting after its slice shrank. Slices not renewed within the
-- lease are dropped here, by whichever replica comes next.
-- Returns {allowed slots, allowed kv, others' slots, others' kv, live replicas}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local ttl = tonumber(ARGV[2])
local budget = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local use = {tonumber(ARGV[5]), tonumber(ARGV[6])}
local mine = {}
local active = use[1] > 0 or use[2] > 0
for i = 7, #ARGV do
  local w = tonumber(ARGV[i])
  mine[#mine + 1] = w
  active = active or w > 0
end
local entries = {{me, mine}}
local held = {0, 0}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local r = all[i]
  if r ~= me then
    local v = {}
    for n in string.gmatch(all[i + 1], '%S+') do
      v[#v + 1] = tonumber(n)
    end
    if v[3] == nil or v[3] <= now then
      redis.call('HDEL', KEYS[1], r)
    else
      held[1] = held[1] + v[1]
      held[2] = held[2] + v[2]
      local w = {}
      for j = 4, #v do
        w[#w + 1] = v[j]
      end
      entries[#entries + 1] = {r, w}
    end
  end
end
local classes = 0
for _, e in ipairs(entries) do
  classes = math.max(classes, math.floor(#e[2] / 2))
end
-- This replica's tiered share of budget[k]: class by class, in ascending order of want
-- (ties by replica id), each takes the smaller of its want and an equal part of what is
-- left; the next class splits what this one left.
local function share(k)
  local left = budget[k]
  local got = 0
  for c = 1, classes do
    local list = {}
    for _, e in ipairs(entries) do
      list[#list + 1] = {e[1], e[2][2 * (c - 1) + k] or 0}
    end
    table.sort(list, function(a, b)
      if a[2] ~= b[2] then
        return a[2] < b[2]
      end
      return a[1] < b[1]
    end)
    local n = #list
    for i, e in ipairs(list) do
      local part = math.min(e[2], math.floor(left / (n - i + 1)))
      if e[1] == me then
        got = got + part
      end
      left = left - part
    end
  end
  return got
end
local allowed = {0, 0}
local hold = {0, 0}
for k = 1, 2 do
  allowed[k] = math.min(share(k), math.max(0, budget[k] - held[k]))
  hold[k] = math.max(allowed[k], use[k])
end
if not active then
  redis.call('HDEL', KEYS[1], me)
else
  local rec = {string.format('%d %d %d', hold[1], hold[2], now + ttl)}
  for _, w in ipairs(mine) do
    rec[#rec + 1] = string.format('%d', w)
  end
  redis.call('HSET', KEYS[1], me, table.concat(rec, ' '))
end
redis.call('PEXPIRE', KEYS[1], 3 * ttl)
return {allowed[1], allowed[2], held[1], held[2], #entries}
