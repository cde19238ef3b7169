-- needs: _blocks.lua
-- KEYS[1]: an events key; ARGV[1]: one of its blocks, then the events it holds. If the block is
-- still there it is replaced by its events, whose writes go from its directory to the ids hash
-- (a write that concerns packed events, a whole-history resend, needs them plain).
local events, block = KEYS[1], ARGV[1]
if not redis.call('ZSCORE', events, block) then return 0 end
redis.call('ZREM', events, block)
local ids, number = events .. '|ids', block_number(block)
redis.call('HSET', ids, '', unlisted(redis.call('HGET', ids, '') or '', function(other) return other ~= number end))
for i = 2, #ARGV do
  local event = ARGV[i]
  redis.call('ZADD', events, fmt(micros(event, 9)), event)
  local id, stamp = string.sub(event, 1, 8), string.sub(event, 9, 16)
  local times = redis.call('HGET', ids, id) or ''
  if not holds(times, stamp) then redis.call('HSET', ids, id, times .. stamp) end
end
local ttl = redis.call('PTTL', events)
if ttl > 0 and redis.call('PTTL', ids) < ttl then redis.call('PEXPIRE', ids, ttl) end
return garbage_taken_out(1)
