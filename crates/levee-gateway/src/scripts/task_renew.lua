-- levee async task: a replica keeps (or hands back) the tasks it holds, task script
-- version 1.
-- KEYS[1]: the queue stream; KEYS[2..n]: the hashes of the tasks held.
-- ARGV[1]: the consumer group; ARGV[2]: this replica's consumer name; ARGV[3]: the idle
-- time to give each entry (ms): 0 keeps it (no other replica claims it for a visibility
-- timeout), the visibility timeout hands it back (another replica may claim it at once).
-- Returns one code per task: 1 done, 0 lost (another consumer holds the entry now), 2
-- finished (final, or the record is gone).
local out = {}
for i = 2, #KEYS do
  local rec = redis.call('HMGET', KEYS[i], 'status', 'entry')
  local status, entry = rec[1], rec[2]
  if not status or (status ~= 'queued' and status ~= 'running') or not entry then
    out[#out + 1] = 2
  else
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
    if #p == 0 or p[1][2] ~= ARGV[2] then
      out[#out + 1] = 0
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, entry, 'IDLE', ARGV[3], 'JUSTID')
      out[#out + 1] = 1
    end
  end
end
return out
