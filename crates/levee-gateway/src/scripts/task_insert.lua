-- levee async task: submit, task script version 1.
-- KEYS[1]: the task's hash; KEYS[2]: the queue stream; KEYS[3]: the tenant's index (sorted
-- set of task ids scored by sequence); KEYS[4]: the tenant's count of unfinished tasks.
-- ARGV[1]: the task as JSON; ARGV[2]: its id; ARGV[3]: its sequence number; ARGV[4]: the
-- tenant's limit of unfinished tasks; ARGV[5]: lifetime of the index after its last
-- submission (ms).
-- Returns {1, open} (stored and queued) or {0, open} (the tenant is at its limit: nothing
-- written).
local open = tonumber(redis.call('GET', KEYS[4]) or '0')
if open >= tonumber(ARGV[4]) then
  return {0, open}
end
local entry = redis.call('XADD', KEYS[2], '*', 'id', ARGV[2])
redis.call('HSET', KEYS[1], 'json', ARGV[1], 'status', 'queued', 'v', 1, 'entry', entry,
  'finals', 0)
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('INCR', KEYS[4])
return {1, open + 1}
