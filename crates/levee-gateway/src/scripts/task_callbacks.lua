-- levee async task: leases on callback deliveries, task script version 1.
-- KEYS[1]: sorted set of the callbacks still to deliver, task id → lease expiry (server ms).
-- ARGV[1]: lease length (ms; 0 hands the leases back: due at once); ARGV[2]: how many due
-- deliveries to take (0: none); ARGV[3..n]: ids whose leases this replica holds, to renew.
-- Returns the ids taken (their leases now this replica's).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i])
end
local due = {}
if tonumber(ARGV[2]) > 0 then
  due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
  for _, id in ipairs(due) do
    redis.call('ZADD', KEYS[1], now + lease, id)
  end
end
return due
