-- KEYS[1]: an events key; ARGV[1]: tile µs; then per tile: its number, its event count when
-- summarized, the summary. A summary is kept only for a tile that has ended (by Redis's clock)
-- and still holds that many events: an event added since (which drops the tile's summary) makes
-- the count differ, so a summary never misses an event.
local events, tile = KEYS[1], tonumber(ARGV[1])
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local sealed = 0
for i = 2, #ARGV, 3 do
  local no = tonumber(ARGV[i])
  if (no + 1) * tile <= now_us and redis.call('EXISTS', events) == 1 then
    local from, to = string.format('%.0f', no * tile), string.format('%.0f', (no + 1) * tile - 1)
    if redis.call('ZCOUNT', events, from, to) == tonumber(ARGV[i + 1]) then
      redis.call('HSET', events .. '|tiles', ARGV[i], ARGV[i + 2])
      local ttl = redis.call('PTTL', events)
      if ttl > 0 then redis.call('PEXPIRE', events .. '|tiles', ttl) end
      sealed = sealed + 1
    end
  end
end
return sealed
