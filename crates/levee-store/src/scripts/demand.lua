-- levee fleet demand, fleet script version 1: one replica publishes a model's demand as it
-- measures it (arrivals per second, requests queued) and reads the other live replicas'.
-- KEYS[1]: hash of the model's demand, one field per replica: "rate queued expiry_ms".
-- ARGV: replica id, lifetime ms, arrivals per second, queued.
-- Returns {others' arrivals per second (a string), others' queued, live replicas}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local ttl = tonumber(ARGV[2])
local rate = 0
local queued = 0
local n = 1
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= me then
    local v = {}
    for x in string.gmatch(all[i + 1], '%S+') do
      v[#v + 1] = tonumber(x)
    end
    if v[3] == nil or v[3] <= now then
      redis.call('HDEL', KEYS[1], all[i])
    else
      rate = rate + v[1]
      queued = queued + v[2]
      n = n + 1
    end
  end
end
redis.call('HSET', KEYS[1], me, ARGV[3] .. ' ' .. ARGV[4] .. ' ' .. (now + ttl))
redis.call('PEXPIRE', KEYS[1], 3 * ttl)
return {tostring(rate), queued, n}
