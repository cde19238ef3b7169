-- needs: _blocks.lua
-- KEYS[1]: an events key; ARGV[1]: tile µs; then entries, each only for what has ended (by
-- Redis's clock) and still holds what was read or written:
--   'S', tile number, its events when summarized, the SHA-1 of its members ('' for none), the
--   summary: stored in events|tiles. A lookup's summary (no digest) checks the count: between
--   its read and this call events can only be added (which drops the tile's summary and changes
--   the count), or packed (which keeps it). A writer's summary is of the events it sent, some of
--   which Redis may have refused as duplicates while holding others: it checks the members
--   themselves, concatenated in (time, id) order, after the block holding some of the tile's
--   events if one does (a writer's digest covers none: a tile partly packed refuses it;
--   ``featurestore compact``'s covers the block).
--   'P', block number, k, the SHA-1 of every member scored in the block's first k tiles (in
--   sorted-set order: a block packed before, events), the block (featurestore/online/packed.py)
--   holding exactly their events, and its id filter (``packed.id_filter``): the block replaces
--   them, the ids hash lists it with its filter, and its directory records their writes: an
--   id whose only write is its event leaves the ids hash. A light entity packed is light no
--   more: the ids hash then records its plain events (``heavier``).
local events, tile = KEYS[1], tonumber(ARGV[1])
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
if redis.call('EXISTS', events) == 0 then return 0 end
local ids = events .. '|ids'
local was_light = is_light_entity(redis.call('HGET', ids, ''), events, few_events)
local done, i, removed, ids_removed, packed_any = 0, 2, 0, 0, false
while i <= #ARGV do
  if ARGV[i] == 'S' then
    local no = tonumber(ARGV[i + 1])
    if (no + 1) * tile <= now_us then
      local plain, packed, block = {}, 0, ''
      for _, m in ipairs(redis.call('ZRANGEBYSCORE', events, fmt(no * tile), fmt((no + 1) * tile - 1))) do
        if not is_block(m) then plain[#plain + 1] = m end
      end
      local first = math.floor(no / BLOCK_TILES) * BLOCK_TILES
      for _, m in ipairs(redis.call('ZRANGEBYSCORE', events, fmt(first * tile), fmt(first * tile))) do
        if is_block(m) and block_events(m, no - first) > 0 then
          packed, block = packed + block_events(m, no - first), m
        end
      end
      local same = #plain + packed == tonumber(ARGV[i + 2])
      if same and ARGV[i + 3] ~= '' then
        same = redis.sha1hex(block .. table.concat(plain)) == ARGV[i + 3]
      end
      if same then
        redis.call('HSET', events .. '|tiles', ARGV[i + 1], ARGV[i + 4])
        local ttl = redis.call('PTTL', events)
        if ttl > 0 then redis.call('PEXPIRE', events .. '|tiles', ttl) end
        done = done + 1
      end
    end
    i = i + 5
  else
    local block, tiles = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local first = block * BLOCK_TILES * tile
    local last = first + math.min(tiles, BLOCK_TILES) * tile - 1
    if last < now_us then
      local members = redis.call('ZRANGEBYSCORE', events, fmt(first), fmt(last))
      if redis.sha1hex(table.concat(members)) == ARGV[i + 3] then
        local stamps, plain_ids = {}, {}
        for _, m in ipairs(members) do
          if not is_block(m) then
            stamps[#stamps + 1] = string.sub(m, 9, 16)
            plain_ids[#plain_ids + 1] = string.sub(m, 1, 8)
          end
        end
        removed = removed + redis.call('ZREMRANGEBYSCORE', events, fmt(first), fmt(last))
        redis.call('ZADD', events, fmt(first), ARGV[i + 4])
        listed_block(events, ARGV[i + 4], ARGV[i + 5])  -- (before its ids leave the hash: it keeps it)
        packed_any = true
        if #plain_ids > 0 then
          local alone = {}  -- ids whose one write is their event: the block's directory holds it now
          each_chunk(plain_ids, 4000, function(a, b)
            local stored = redis.call('HMGET', ids, unpack(plain_ids, a, b))
            for k = a, b do
              if stored[k - a + 1] == stamps[k] then alone[#alone + 1] = plain_ids[k] end
            end
          end)
          if #alone > 0 then
            each_chunk(alone, 4000, function(a, b) redis.call('HDEL', ids, unpack(alone, a, b)) end)
            ids_removed = ids_removed + #alone
          end
        end
        done = done + 1
      end
    end
    i = i + 6
  end
end
if was_light and packed_any then  -- (its ids then live as long as its events, as they did)
  heavier(events)
  local ttl = redis.call('PTTL', events)
  if ttl > 0 and redis.call('PTTL', ids) < ttl then redis.call('PEXPIRE', ids, ttl) end
end
-- Redis keeps a set's or hash's table at its largest size until it shrinks it itself (not while
-- it rewrites its append-only file): a set or hash that packing emptied is rewritten at its size.
local function rewritten(key, emptied, size, copy)
  if emptied >= 256 and emptied > 4 * size then
    local ttl = redis.call('PTTL', key)
    copy()
    if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
  end
end
rewritten(events, removed, redis.call('ZCARD', events), function() redis.call('ZUNIONSTORE', events, 1, events) end)
rewritten(ids, ids_removed, redis.call('HLEN', ids), function()
  local fields = redis.call('HGETALL', ids)
  redis.call('DEL', ids)
  each_chunk(fields, 4000, function(a, b) redis.call('HSET', ids, unpack(fields, a, b)) end)
end)
return garbage_taken_out(done)
