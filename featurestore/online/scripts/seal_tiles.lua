-- KEYS[1]: an events key; ARGV[1]: tile µs; then per tile: its number, its event count when
-- summarized, the SHA-1 of its members when summarized ('' for none), the summary. A summary is
-- kept only for a tile that has ended (by Redis's clock) and still holds what was summarized.
-- A lookup's summary (no digest) checks the count: between its read and this call events can
-- only be added (which drops the tile's summary and changes the count). A writer's summary is
-- of the events it sent, some of which Redis may have refused as duplicates while holding
-- others: it checks the members themselves, concatenated in (time, id) order.
local events, tile = KEYS[1], tonumber(ARGV[1])
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local sealed = 0
for i = 2, #ARGV, 4 do
  local no = tonumber(ARGV[i])
  if (no + 1) * tile <= now_us and redis.call('EXISTS', events) == 1 then
    local from, to = string.format('%.0f', no * tile), string.format('%.0f', (no + 1) * tile - 1)
    local same = redis.call('ZCOUNT', events, from, to) == tonumber(ARGV[i + 1])
    if same and ARGV[i + 2] ~= '' then
      same = redis.sha1hex(table.concat(redis.call('ZRANGEBYSCORE', events, from, to))) == ARGV[i + 2]
    end
    if same then
      redis.call('HSET', events .. '|tiles', ARGV[i], ARGV[i + 3])
      local ttl = redis.call('PTTL', events)
      if ttl > 0 then redis.call('PEXPIRE', events .. '|tiles', ttl) end
      sealed = sealed + 1
    end
  end
end
return sealed
