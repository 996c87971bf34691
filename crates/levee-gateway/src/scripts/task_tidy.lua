-- levee async task: removes consumers of the queue's group, task script version 1.
-- KEYS[1]: the queue stream. ARGV[1]: the consumer group; ARGV[2..n]: consumers to remove
-- if they hold no pending entry (checked here, atomically: deleting a consumer drops its
-- pending entries, which no replica could claim any more).
-- Returns the number removed.
local n = 0
for i = 2, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[i])
  if #p == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    n = n + 1
  end
end
return n
