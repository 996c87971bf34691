-- levee limit decision, script version 2 (the version is part of every key name: a changed
-- script gets new keys, so replicas running different versions never share state).
--
-- Two keys per scope: KEYS[2i-1], a hash with fields `r` (request GCRA) and `t` (token
-- bucket), each a theoretical arrival time in microseconds of the server's clock;
-- KEYS[2i], a sorted set of concurrency leases scored by their expiry (server ms).
-- ARGV[1]: tokens to reserve; ARGV[2]: the lease id; ARGV[3]: lease lifetime (ms); then
-- six numbers per scope: request interval µs (0: no request limit), request tolerance µs
-- (interval × burst), token interval µs (0: no token limit), token tolerance µs
-- (interval × capacity), token capacity, leases allowed at once (0: no limit).
-- After the scopes, an optional last ARGV: the time to decide at (µs); without it, the
-- server's TIME (as in production: every replica shares the server's clock).
-- Every scope is checked before anything is written: a refusal charges nothing.
-- Returns {1, r_remaining, r_reset_us, t_remaining, t_reset_us} (figures of the last scope,
-- -1 where it has no such limit) or {0, scope, kind, retry_us} with kind 1 = requests,
-- 2 = tokens, 3 = larger than the bucket's capacity, 4 = concurrency.
local n = #KEYS / 2
local now = tonumber(ARGV[3 + 6 * n + 1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local now_ms = math.floor(now / 1000)
-- Half a microsecond of slack absorbs floating-point error in favour of the client.
local eps = 0.5
local tokens = tonumber(ARGV[1])
local lease, ttl = ARGV[2], tonumber(ARGV[3])
local new_r, new_t, leased = {}, {}, {}
local fig = {1, -1, -1, -1, -1}
for i = 1, n do
  local b = 3 + (i - 1) * 6
  local ri, rtol = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local tu, ttol, cap = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  local conc = tonumber(ARGV[b + 6])
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  if conc > 0 then
    -- Leases of replicas that stopped renewing them (dead ones) are gone.
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now_ms)
    if redis.call('ZCARD', z) >= conc then
      return {0, i, 4, 0}
    end
    leased[i] = true
  end
  local st = redis.call('HMGET', h, 'r', 't')
  if ri > 0 then
    local tat = math.max(tonumber(st[1]) or 0, now)
    local nt = tat + ri
    local allow = nt - rtol
    if allow > now + eps then
      return {0, i, 1, math.ceil(allow - now)}
    end
    new_r[i] = nt
    if i == n then
      fig[2] = math.max(0, math.floor((now + eps + rtol - nt) / ri))
      fig[3] = math.ceil(nt - now)
    end
  end
  if tu > 0 then
    if tokens > cap then
      return {0, i, 3, 0}
    end
    local tat = math.max(tonumber(st[2]) or 0, now)
    local nt = tat + tu * tokens
    if nt > now + ttol + eps then
      return {0, i, 2, math.ceil(nt - now - ttol)}
    end
    new_t[i] = nt
    if i == n then
      fig[4] = math.max(0, math.floor((now + eps + ttol - nt) / tu))
      fig[5] = math.ceil(nt - now)
    end
  end
end
for i = 1, n do
  local h, z = KEYS[2 * i - 1], KEYS[2 * i]
  local last = now
  if new_r[i] then
    redis.call('HSET', h, 'r', new_r[i])
    last = math.max(last, new_r[i])
  end
  if new_t[i] then
    redis.call('HSET', h, 't', new_t[i])
    last = math.max(last, new_t[i])
  end
  if new_r[i] or new_t[i] then
    -- A key lives while it holds debt, plus a second; a full bucket is the same as no key.
    redis.call('PEXPIRE', h, math.ceil((last - now) / 1000) + 1000)
  end
  if leased[i] then
    redis.call('ZADD', z, now_ms + ttl, lease)
    redis.call('PEXPIRE', z, 2 * ttl)
  end
end
return fig
