-- levee slice of a budget for local batching, script version 2 (see take.lua for the keys
-- and the six numbers per scope; slices are never taken in scopes with a concurrency
-- limit, whose lease set is ignored here).
-- ARGV[1]: most requests wanted (≥ 1); ARGV[2]: most tokens wanted; ARGV[3]: fewest tokens
-- that make the slice useful (the estimate of the request asking for it).
-- Grants as many requests (1..ARGV[1]) and tokens (ARGV[3]..ARGV[2]) as every scope has
-- now, charged at once, or nothing. An optional last ARGV after the scopes: the time to
-- decide at (µs), as in take.lua.
-- Returns {1, requests, tokens, r_remaining, r_reset_us, t_remaining, t_reset_us} (figures
-- of the last scope after the charge, -1 where it has no such limit) or {0, scope, kind,
-- retry_us} with kinds as in take.lua.
local n = #KEYS / 2
local now = tonumber(ARGV[3 + 6 * n + 1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local eps = 0.5
local want_r, want_t, min_t = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local g_r, g_t = want_r, want_t
local st = {}
for i = 1, n do
  local b = 3 + (i - 1) * 6
  local ri, rtol = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local tu, ttol, cap = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  st[i] = redis.call('HMGET', KEYS[2 * i - 1], 'r', 't')
  if ri > 0 then
    local tat = math.max(tonumber(st[i][1]) or 0, now)
    local avail = math.floor((now + eps + rtol - tat) / ri)
    if avail < 1 then
      return {0, i, 1, math.ceil(tat + ri - rtol - now)}
    end
    g_r = math.min(g_r, avail)
  end
  if tu > 0 then
    if min_t > cap then
      return {0, i, 3, 0}
    end
    local tat = math.max(tonumber(st[i][2]) or 0, now)
    local avail = math.floor((now + eps + ttol - tat) / tu)
    if avail < min_t then
      return {0, i, 2, math.ceil(tat + tu * min_t - ttol - now)}
    end
    g_t = math.min(g_t, avail)
  end
end
local fig = {1, g_r, g_t, -1, -1, -1, -1}
for i = 1, n do
  local b = 3 + (i - 1) * 6
  local ri, rtol = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local tu, ttol = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4])
  local h = KEYS[2 * i - 1]
  local last = now
  if ri > 0 then
    local nt = math.max(tonumber(st[i][1]) or 0, now) + g_r * ri
    redis.call('HSET', h, 'r', nt)
    last = math.max(last, nt)
    if i == n then
      fig[4] = math.max(0, math.floor((now + eps + rtol - nt) / ri))
      fig[5] = math.ceil(nt - now)
    end
  end
  if tu > 0 then
    local nt = math.max(tonumber(st[i][2]) or 0, now) + g_t * tu
    redis.call('HSET', h, 't', nt)
    last = math.max(last, nt)
    if i == n then
      fig[6] = math.max(0, math.floor((now + eps + ttol - nt) / tu))
      fig[7] = math.ceil(nt - now)
    end
  end
  if ri > 0 or tu > 0 then
    redis.call('PEXPIRE', h, math.ceil((last - now) / 1000) + 1000)
  end
end
return fig
