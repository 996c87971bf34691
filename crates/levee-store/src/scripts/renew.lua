-- levee lease renewal, script version 2: a live replica extends the leases of its requests
-- still in flight; a dead one stops, and its leases expire.
-- KEYS[i]: a lease set; ARGV[1]: lease lifetime (ms); ARGV[i + 1]: the lease id in KEYS[i].
-- Returns how many leases were still there.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local kept = 0
for i = 1, #KEYS do
  kept = kept + redis.call('ZADD', KEYS[i], 'XX', 'CH', now_ms + ttl, ARGV[i + 1])
  redis.call('PEXPIRE', KEYS[i], 2 * ttl)
end
return kept
