-- levee settlement of one admitted request, script version 2 (see take.lua for the keys
-- and the six numbers per scope).
-- ARGV[1]: tokens reserved; ARGV[2]: tokens used; ARGV[3]: requests to give back (a
-- request never served: 1; the unused rest of a slice: its count); ARGV[4]: the request's lease id (empty: none); then
-- six numbers per scope; then, optionally, the time to settle at (µs), as in take.lua.
-- Tokens: a refund never fills past capacity; a charge past empty is kept as debt of at most
-- one capacity (the level stays within -capacity..capacity), as in the in-memory bucket.
local now = tonumber(ARGV[4 + 6 * (#KEYS / 2) + 1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local reserved, actual = tonumber(ARGV[1]), tonumber(ARGV[2])
local give_back = tonumber(ARGV[3])
local lease = ARGV[4]
for i = 1, #KEYS / 2 do
  local b = 4 + (i - 1) * 6
  local ri = tonumber(ARGV[b + 1])
  local tu, ttol = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local conc = tonumber(ARGV[b + 6])
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  if conc > 0 and lease ~= '' then
    redis.call('ZREM', z, lease)
  end
  local st = redis.call('HMGET', h, 'r', 't')
  local wrote = false
  if ri > 0 and give_back > 0 then
    local tat = tonumber(st[1])
    if tat and tat > now then
      tat = math.max(tat - give_back * ri, now)
      redis.call('HSET', h, 'r', tat)
      wrote = true
    end
  end
  if tu > 0 and reserved ~= actual then
    local tat = math.max(tonumber(st[2]) or 0, now)
    if actual > reserved then
      tat = math.min(tat + tu * (actual - reserved), now + 2 * ttol)
    else
      tat = math.max(tat - tu * (reserved - actual), now)
    end
    redis.call('HSET', h, 't', tat)
    wrote = true
  end
  if wrote then
    local cur = redis.call('HMGET', h, 'r', 't')
    local last = math.max(now, tonumber(cur[1]) or 0, tonumber(cur[2]) or 0)
    redis.call('PEXPIRE', h, math.ceil((last - now) / 1000) + 1000)
  end
end
return 1
