-- levee replica heartbeat, script version 2.
-- KEYS[1]: sorted set of replicas scored by their last heartbeat (server ms).
-- ARGV[1]: this replica's id; ARGV[2]: how long a replica counts as live after its last
-- heartbeat (ms). Returns the number of live replicas, this one included.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('PEXPIRE', KEYS[1], window * 2)
return redis.call('ZCARD', KEYS[1])
