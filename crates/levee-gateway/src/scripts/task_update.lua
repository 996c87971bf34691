-- levee async task: compare-and-set of a task's record, task script version 1.
-- KEYS[1]: the task's hash; KEYS[2]: the queue stream; KEYS[3]: the tenant's count of
-- unfinished tasks; KEYS[4]: the tenant's index; KEYS[5]: the callbacks still to deliver
-- (task id → lease expiry, server ms).
-- ARGV[1]: the record version the new record was computed from; ARGV[2]: the new record
-- (JSON); ARGV[3]: its status; ARGV[4]: the consumer group; ARGV[5]: how long a final
-- record is kept (ms); ARGV[6]: the task's id; ARGV[7]: for a task with a callback, the
-- lease its writer takes on the delivery (ms; 0: no callback).
-- Returns 1 (written), 0 (the record changed since it was read: read it again), -1 (no
-- such task), -2 (refused: a final state is never replaced by another state).
-- The move from an unfinished to a final state happens once per task: it counts itself in
-- the field `finals`, frees the tenant's place, acknowledges and deletes the task's stream
-- entry (no replica will claim it again) and starts the record's retention (the tenant's
-- index lives at least as long, so the record stays listed).
local cur = redis.call('HMGET', KEYS[1], 'v', 'status', 'entry')
if not cur[1] then
  return -1
end
if cur[1] ~= ARGV[1] then
  return 0
end
local function final(s)
  return s ~= 'queued' and s ~= 'running'
end
local was_final = final(cur[2])
if was_final and cur[2] ~= ARGV[3] then
  return -2
end
redis.call('HSET', KEYS[1], 'json', ARGV[2], 'status', ARGV[3], 'v', tonumber(cur[1]) + 1)
if final(ARGV[3]) and not was_final then
  redis.call('HINCRBY', KEYS[1], 'finals', 1)
  if tonumber(redis.call('GET', KEYS[3]) or '0') > 0 then
    redis.call('DECR', KEYS[3])
  end
  if cur[3] then
    redis.call('XACK', KEYS[2], ARGV[4], cur[3])
    redis.call('XDEL', KEYS[2], cur[3])
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  if redis.call('PTTL', KEYS[4]) < tonumber(ARGV[5]) then
    redis.call('PEXPIRE', KEYS[4], ARGV[5])
  end
  if tonumber(ARGV[7]) > 0 then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('ZADD', KEYS[5], now + tonumber(ARGV[7]), ARGV[6])
  end
end
return 1
