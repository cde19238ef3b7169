-- needs: _blocks.lua
-- KEYS[1]: an events key; ARGV[1]: one of its blocks, then the events it holds. If the block is
-- still there it is replaced by its events, whose ids go back from the index to the ids hash
-- (a write that concerns packed events, a whole-history resend, needs them plain).
local events, block = KEYS[1], ARGV[1]
if not redis.call('ZSCORE', events, block) then return 0 end
redis.call('ZREM', events, block)
local ids, seen, gone = events .. '|ids', events .. '|seen', {}
for i = 2, #ARGV do
  local event = ARGV[i]
  redis.call('ZADD', events, fmt(micros(event, 9)), event)
  local id, stamp = string.sub(event, 1, 8), string.sub(event, 9, 16)
  redis.call('HSETNX', ids, id, stamp)  -- (an id the hash has, it has with all its writes)
  gone[id .. stamp] = true
end
local ttl = redis.call('PTTL', seen)
if ttl > 0 and redis.call('PTTL', ids) < 0 then redis.call('PEXPIRE', ids, ttl) end
local index = redis.call('GET', seen)
if index then
  index = index_where(index, function(e) return not gone[e] end)
  if index == '' then redis.call('DEL', seen) else redis.call('SET', seen, index, 'KEEPTTL') end
end
return garbage_taken_out(1)
