-- KEYS[1]: the hash of the horizons aggregated views' writes use; ARGV[1]: a view's events field;
-- ARGV[2]: the horizon (ms) a write keeps its events for; ARGV[3]: until when (ms) a key it wrote may
-- live; ARGV[4]: '1' for a whole-history resend, after which no event is held under another horizon.
-- The field lists each horizon writes have used, as "horizon:until" pairs (the latest until of
-- each; a few, one per retention ever configured): a replay reckons with every one
-- (``OnlineQuery.require_retained``). A write records its horizon ahead of its events.
local kept, found = {}, false
local listed = ARGV[4] ~= '1' and redis.call('HGET', KEYS[1], ARGV[1]) or ''
for horizon, held_until in string.gmatch(listed, '(%d+):(%d+)') do
  local last = tonumber(held_until)
  if horizon == ARGV[2] then last, found = math.max(last, tonumber(ARGV[3])), true end
  kept[#kept + 1] = horizon .. ':' .. string.format('%.0f', last)
end
if not found then kept[#kept + 1] = ARGV[2] .. ':' .. ARGV[3] end
redis.call('HSET', KEYS[1], ARGV[1], table.concat(kept, ' '))
return garbage_taken_out(0)
