-- needs: _blocks.lua
-- KEYS[1]: an events key; ARGV: low µs (exclusive), high µs, tile µs, the summaries' tag, then the
-- window starts and the lookup time (the tiles holding them are read event by event).
-- Returns {summaries, runs}: the sealed summary of each tile inside (low, high] holding no cut
-- (``tile number, summary`` pairs), and the events of the other tiles in (low, high], in order,
-- as one array per run of such tiles (not copied into one: Lua pays per element), each with the
-- blocks holding any of its tiles after its events (a block may come in two runs, and holds the
-- events of all its tiles: the reader keeps those of tiles without a summary).
local events, low, high = KEYS[1], ARGV[1], ARGV[2]
local tile = tonumber(ARGV[3])
local tag = ARGV[4]
local cut = {}
for i = 5, #ARGV do cut[math.floor(tonumber(ARGV[i]) / tile)] = true end
local sealed = {}
local stored = redis.call('HGETALL', events .. '|tiles')
for i = 1, #stored, 2 do
  if string.sub(stored[i + 1], 1, #tag) == tag then sealed[tonumber(stored[i])] = stored[i + 1] end
end
local summaries, read = {}, {}
local first, last = math.floor((tonumber(low) + 1) / tile), math.floor(tonumber(high) / tile)
local run = nil  -- the first tile of a run read event by event
for t = first, last + 1 do
  local summary = t <= last and not cut[t] and sealed[t]
  if summary then
    summaries[#summaries + 1] = t
    summaries[#summaries + 1] = summary
  end
  if (summary or t > last) and run then
    local from = math.max(tonumber(low) + 1, run * tile)
    local to = math.min(tonumber(high), t * tile - 1)
    local kept = redis.call('ZRANGEBYSCORE', events, fmt(from), fmt(to))
    for block = math.floor(run / BLOCK_TILES), math.floor((t - 1) / BLOCK_TILES) do  -- blocks scored outside
      local score = block * BLOCK_TILES * tile
      if score < from or score > to then
        for _, m in ipairs(redis.call('ZRANGEBYSCORE', events, fmt(score), fmt(score))) do
          if is_block(m) then kept[#kept + 1] = m end
        end
      end
    end
    read[#read + 1] = kept
    run = nil
  elseif not summary and not run then
    run = t
  end
end
return {summaries, read}
