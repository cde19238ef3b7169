-- needs: _blocks.lua
-- KEYS: the events key of each write; ARGV[1]: cutoff µs (events before it are trimmed, and a
-- write before it only records its time); ARGV[2]: horizon ms (keys expire that long after their
-- newest event); ARGV[3]: slack ms; ARGV[4]: tile µs; ARGV[5]: dedup µs; ARGV[6]: '1' when the
-- writes carry the history's verdicts (a whole-history resend); ARGV[7]: the longest a ledger
-- may grow (Redis's compact sorted-set member: past it, the writes go into the ids hash); then the
-- n writes' µs as decimal text, the n events (8-byte id, then the value), and with verdicts n of
-- '1' (kept) or '0'.
--
-- The duplicate rule (``featurestore.aggregation``): a write of an id is a duplicate when an earlier
-- write of the id lies less than the dedup window away in event time. The ids hash maps each id to
-- the times of its writes (8 bytes each, sign-flipped big-endian: bytes 9-16 of the event), kept a
-- dedup window beyond the events, so the rule is decided here as writes arrive (retries and
-- replays never count twice; an id reused further apart is a new event). Once an event is
-- packed into a block, the block's directory records its write (_blocks.lua) and the hash drops
-- the id unless it has other writes: an id's writes are those in the hash and in the directories
-- of the blocks less than a dedup window away. A light entity (_blocks.lua) records an id's one
-- write by its event alone, or once the event is gone by its ledger: an id the hash lacks is
-- looked up among its few events and its ledger's writes. Events live
-- as long as the ids would: they record them. A kept event goes into
-- the events sorted set (score: its µs; members of one µs sort by id, so a range comes in (time,
-- id) order); one in an ended tile drops that tile's sealed summary. With verdicts, the history
-- decides instead: a kept write replaces any other event of its id less than the dedup window
-- away, a duplicate is removed. Expiry is pushed out to newest + horizon (+ the dedup window for
-- the ids) + slack whenever newest + horizon passes it, so a stream of events refreshes it (and
-- trims old events, blocks, write times and summaries) once per slack, not per event. A block
-- goes once its last tile ends a dedup window before the cutoff (its directory records writes).
-- With verdicts, no write may concern a packed event: the writer unpacks first
-- (``unpack_block.lua``); one that does fails the call before it changes anything.
--
-- An entity's ledger (_blocks.lua) holds the newest µs of an event it lacks: a write before the
-- cutoff (not kept) or an event trimmed. A lookup at a past time (a replay) refuses a window
-- reaching back to it. Once now is past that µs + horizon + dedup window (+ slack), the view's
-- horizons (``keep_horizon.lua``) bound it for every entity, so it is not written then, and the
-- next trim drops it (``OnlineQuery.require_retained``).
local cutoff = tonumber(ARGV[1])
local horizon_ms, slack_ms, tile, within = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local verdicts = ARGV[6] == '1'
local ledger_most = tonumber(ARGV[7])
local n = #KEYS
local added = 0
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local span = BLOCK_TILES * tile
-- events key -> its ledger (_blocks.lua) and the ledger's directory, read once a call; -> writes
-- this call adds to it
local ledgers, ledger_adds = {}, {}
local function remember_ledger(events, member) ledgers[events] = {member, ledger_directory(member)} end
local function ledger(events)  -- its member (or nil), its directory (or nil)
  if ledgers[events] == nil then remember_ledger(events, ledger_of(events)) end
  return ledgers[events][1], ledgers[events][2]
end
-- events key -> its events where it may be light (few_events: its ledger comes with them), else
-- false: read once a call; -> its plain events as this call's write made it heavy (for ``heavier``)
local few_of, grown = {}, {}
local function few(events)
  if few_of[events] == nil then
    local held, with = few_events(events)
    few_of[events] = held
    if held and ledgers[events] == nil then remember_ledger(events, with) end
  end
  return few_of[events]
end
-- events key -> its ids hash's field '' (_blocks.lua: its block list, where it is heavy), false
-- where the hash lacks it; events key -> block number -> its directory: read once a call
local blocks_of, directories = {}, {}
local trims_of = {}  -- events key -> its ids hash's TRIMMED_AT (false: none), where read this call
local function directory_of(events, number)
  local of = directories[events] or {}
  directories[events] = of
  if of[number] == nil then
    local score = fmt(number * span)
    of[number] = false
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', events, score, score)) do
      if is_block(m) then of[number] = directory(m) end
    end
  end
  return of[number]
end
local function listing(events)
  if blocks_of[events] == nil then blocks_of[events] = redis.call('HGET', events .. '|ids', '') or false end
  return blocks_of[events]
end
local function block_list(events) return listing(events) or '' end
local function packed_writes(events, id, us)  -- µs (8 bytes each) of id's packed events near us
  local list, found, at, hashes = block_list(events), '', 1, nil
  while at <= #list do
    local number, length = struct.unpack('>i8I4', list, at)
    if (number + 1) * span >= us - within and number * span <= us + within then
      hashes = hashes or {id_hashes(id)}
      local listed = may_hold(list, at + 12, length, hashes) and directory_of(events, number)
      if listed then found = found .. id_writes(listed, id) end
    end
    at = at + 12 + length
  end
  return found
end
local function is_light(events) return is_light_entity(listing(events), events, few) end
local function to_ledger(events, write)
  ledger_adds[events] = ledger_adds[events] or {}
  table.insert(ledger_adds[events], write)
end
local function plain_writes(events, id)  -- µs of id's writes in a light entity: its plain events' and its ledger's
  local found, held = '', few(events)
  if string.find(table.concat(held), id, 1, true) then  -- (most ids are new: one search of all the members' bytes)
    for _, m in ipairs(held) do
      if string.sub(m, 1, 8) == id then found = found .. string.sub(m, 9, 16) end
    end
  end
  local _, l = ledger(events)
  if l then found = found .. id_writes(l, id) end
  for _, write in ipairs(ledger_adds[events] or {}) do
    if string.sub(write, 1, 8) == id then found = found .. string.sub(write, 9, 16) end
  end
  return found
end
local lacked = {}  -- events key -> the newest µs of an event this call did not keep or trimmed
local trimmed = {}  -- events keys this call trimmed
local function lacks(events, us)
  if lacked[events] == nil or us > lacked[events] then lacked[events] = us end
end
local function changed(events)  -- events were removed: what was read of them is stale
  few_of[events], grown[events], blocks_of[events], directories[events] = nil, nil, nil, nil
end
if verdicts then
  for k = 1, n do
    if packed_writes(KEYS[k], string.sub(ARGV[7 + n + k], 1, 8), tonumber(ARGV[7 + k])) ~= '' then
      return redis.error_reply('PACKED a whole-history write concerns packed events of ' .. KEYS[k] .. ': unpack them first')
    end
  end
end
local summarized = {}  -- events key -> whether it has summaries (read once: this script stores none)
local function touched(events, us)  -- an event changed in an ended tile: its summary is stale
  local tile_no = math.floor(us / tile)
  if (tile_no + 1) * tile > now_ms * 1000 then return end
  if summarized[events] == nil then summarized[events] = redis.call('EXISTS', events .. '|tiles') == 1 end
  if summarized[events] then redis.call('HDEL', events .. '|tiles', tile_no) end
end
-- until when a write at us is needed: its ids (the duplicate rule), a lookup's record of lacking it
local function needed_until_ms(us)
  return math.floor(us / 1000) + horizon_ms + math.floor(within / 1000)
end
local function needed(writes)  -- those the duplicate rule still needs (a dedup window from the cutoff)
  local out = {}
  for _, write in ipairs(writes) do
    if micros(write, 9) > cutoff - within then out[#out + 1] = write end
  end
  return out
end
local function newest(writes, from)  -- the latest µs of writes (16 bytes each) and from (if any)
  for _, write in ipairs(writes) do from = math.max(from or -math.huge, micros(write, 9)) end
  return from
end
-- keys live until expire_at (ms) at least; true if moved, and whether the key had an expiry (one
-- that has none is new: nothing in it to trim)
local function extend(key, expire_at)
  local pttl = redis.call('PTTL', key)
  if pttl >= 0 and now_ms + pttl >= expire_at then return false, true end
  redis.call('PEXPIREAT', key, string.format('%.0f', expire_at + slack_ms))
  return true, pttl >= 0
end
for k = 1, n do
  local events, us, event = KEYS[k], tonumber(ARGV[7 + k]), ARGV[7 + n + k]
  local ids, id, stamp = events .. '|ids', string.sub(event, 1, 8), string.sub(event, 9, 16)
  local expire_ms, ids_expire_ms = math.floor(us / 1000) + horizon_ms, needed_until_ms(us)
  local kept, times, hashed, fetched  -- (fetched: the id's writes in the ids hash, false for none; nil: unread)
  if blocks_of[events] == nil then  -- (a key's first write in a call reads its id's writes with the block list)
    local got = redis.call('HMGET', ids, '', id, TRIMMED_AT)
    blocks_of[events], fetched, trims_of[events] = got[1] or false, got[2], got[3]
  end
  local light, unrecorded, wrote_ids = is_light(events), false, false
  local packed = light and '' or packed_writes(events, id, us)
  if (packed ~= '' or light) and fetched == nil then fetched = redis.call('HGET', ids, id) end
  if packed ~= '' then  -- written before: its writes are those packed and those in the hash
    kept, hashed = false, fetched or ''
    times = hashed .. packed
  elseif light then  -- the hash has every write of the id if it has it, else its plain events do
    times = fetched or plain_writes(events, id)
    kept = times == ''
    if kept then times, unrecorded = stamp, true end
  else
    kept = redis.call('HSETNX', ids, id, stamp) == 1
    times = not kept and redis.call('HGET', ids, id) or stamp
  end
  if not kept then
    local seen = false
    kept = true
    for at = 1, #times, 8 do
      local other = micros(times, at)
      if math.abs(other - us) < within then kept = false end
      if other == us then seen = true end
    end
    if not seen or (light and verdicts) then  -- (a light entity's: a resend may remove the events recording them)
      if not seen then times = (hashed or times) .. stamp end  -- (packed writes stay recorded by their blocks)
      redis.call('HSET', ids, id, times)
      wrote_ids = light
    end
  end
  if verdicts then kept = ARGV[7 + 2 * n + k] == '1' end
  local placed = false
  if us < cutoff then lacks(events, us) end
  if us >= cutoff then
    if kept and redis.call('ZADD', events, us, event) == 1 then
      added, placed = added + 1, true
      local held = few_of[events]
      if held then
        held[#held + 1] = event
        if #held > LIGHT_MOST then few_of[events], grown[events] = false, held end
      end
      touched(events, us)
    elseif verdicts and not kept and redis.call('ZREM', events, event) == 1 then
      changed(events)
      touched(events, us)
    end
    if verdicts and kept then  -- the history's write is the id's event: drop others near it
      for at = 1, #times, 8 do
        local other = micros(times, at)
        if math.abs(other - us) < within then
          local at_us = string.format('%.0f', other)
          for _, member in ipairs(redis.call('ZRANGEBYSCORE', events, at_us, at_us)) do
            if member ~= event and string.sub(member, 1, 8) == id then
              redis.call('ZREM', events, member)
              changed(events)
              touched(events, other)
            end
          end
        end
      end
    end
  end
  if unrecorded and not placed then  -- a light entity's write that is no event: its ledger records it
    to_ledger(events, id .. stamp)
  end
  local light_now = is_light(events)
  local grew = light and not light_now
  if grew then  -- (the writes this call would add to its ledger go to the ids hash too)
    local read = ledgers[events]
    heavier(events, grown[events], read and (read[1] or false))
    grown[events] = nil
    record_writes(ids, ledger_adds[events] or {})
    ledgers[events], ledger_adds[events] = nil, nil
  end
  if us < cutoff or wrote_ids or grew then extend(ids, ids_expire_ms) end
  local moved, held = false, false
  if us >= cutoff then moved, held = extend(events, ids_expire_ms) end
  if moved then
    -- (events live as long as the ids: a light entity's and the blocks record them; the
    -- summaries' and the ids' expiry move with the events')
    if held then trimmed[events] = true end
    redis.call('PEXPIREAT', events .. '|tiles', string.format('%.0f', expire_ms + slack_ms))
    local kept_from = cutoff - within - span
    if light_now then  -- (its plain events, read this call, are all it holds: no block)
      local gone = false
      for _, m in ipairs(few_of[events]) do
        local at_us = micros(m, 9)
        if at_us < cutoff then
          gone = true
          lacks(events, at_us)
          -- (the writes of the events trimmed stay recorded a dedup window, in its ledger)
          if at_us > cutoff - within then to_ledger(events, string.sub(m, 1, 16)) end
        end
      end
      if gone then redis.call('ZREMRANGEBYSCORE', events, '-inf', '(' .. ARGV[1]) end
    else  -- (events and blocks ended a dedup window before the cutoff; then the events before it)
      local newest_gone = redis.call('ZREVRANGEBYSCORE', events, fmt(kept_from), '-inf', 'LIMIT', 0, 1)
      if newest_gone[1] and not is_block(newest_gone[1]) then lacks(events, micros(newest_gone[1], 9)) end
      redis.call('ZREMRANGEBYSCORE', events, '-inf', fmt(kept_from))
      for _, member in ipairs(redis.call('ZRANGEBYSCORE', events, '(' .. fmt(kept_from), '(' .. ARGV[1])) do
        if not is_block(member) then
          redis.call('ZREM', events, member)
          lacks(events, micros(member, 9))
        end
      end
    end
    local listed = listing(events)
    local kept_blocks = listed and unlisted(listed, function(number)
      local first = struct.unpack('>i8', number) * span
      if first <= kept_from then lacks(events, first + span - 1) end  -- (a block gone: its tiles' events)
      return first > kept_from
    end) or ''
    -- (the mark follows what is left: an entity of few events and no block is light again; what
    -- its ids hash recorded stays there, as a light entity's duplicate writes do)
    if kept_blocks == '' and (light_now or few_events(events)) then  -- (light_now: unmarked)
      if listed then redis.call('HDEL', ids, '') end
    elseif kept_blocks ~= listed then
      redis.call('HSET', ids, '', kept_blocks)
    end
    changed(events)
    local first_tile = math.floor(cutoff / tile)
    for _, name in ipairs(redis.call('HKEYS', events .. '|tiles')) do
      if tonumber(name) < first_tile then redis.call('HDEL', events .. '|tiles', name) end
    end
    -- write times a dedup window before the cutoff are no longer needed: dropped once the cutoff
    -- has moved a quarter of the dedup window since they last were (TRIMMED_AT, _blocks.lua)
    local last = trims_of[events]
    if last == nil then last = redis.call('HGET', ids, TRIMMED_AT) end
    if not last or cutoff - micros(last, 1) >= within / 4 then
      local stored, left = redis.call('HGETALL', ids), 0  -- (left: ids and '' the hash keeps)
      for i = 1, #stored, 2 do
        if #stored[i] == 8 then  -- (an id: '' and TRIMMED_AT are not)
          local kept_times = ''
          for at = 1, #stored[i + 1], 8 do
            if micros(stored[i + 1], at) > cutoff - within then kept_times = kept_times .. string.sub(stored[i + 1], at, at + 7) end
          end
          if kept_times == '' then redis.call('HDEL', ids, stored[i])
          else
            left = left + 1
            if kept_times ~= stored[i + 1] then redis.call('HSET', ids, stored[i], kept_times) end
          end
        elseif stored[i] == '' then left = left + 1 end
      end
      if left > 0 then
        trims_of[events] = stamp_of(cutoff)
        redis.call('HSET', ids, TRIMMED_AT, trims_of[events])
      elseif last then  -- (its last field: the hash goes)
        redis.call('HDEL', ids, TRIMMED_AT)
      end
    end
    redis.call('PEXPIREAT', ids, string.format('%.0f', ids_expire_ms + slack_ms))
  end
end
-- each ledger changed: the newest event lacked, while a lookup's bound does not cover it yet, and
-- a light entity's writes the duplicate rule needs (a dedup window from the cutoff)
local function rewrite_ledger(events)
  local old, l = ledger(events)
  local lack, us = old and string.sub(old, 1, 8) or NO_LACK, lacked[events]
  if lack ~= NO_LACK and needed_until_ms(micros(lack, 1)) + slack_ms <= now_ms then lack = NO_LACK end
  if us and needed_until_ms(us) + slack_ms > now_ms and (lack == NO_LACK or micros(lack, 1) < us) then
    lack = stamp_of(us)  -- (the slack: clocks apart)
  end
  local adds, body, spilled = ledger_adds[events] or {}, old and string.sub(old, 9) or '', nil
  local heavy = (body ~= '' or #adds > 0) and not is_light(events)
  -- (most often the writes fit the directory, added in place; a trim drops those no longer needed)
  local whole = heavy or trimmed[events]
  if not whole and l and #adds > 0 then
    local ledger, at = old, l
    for _, write in ipairs(adds) do
      if micros(write, 9) > cutoff - within then
        local grown = inserted(at, write)
        if not grown then whole = true break end
        if grown ~= ledger then ledger, at = grown, directory_at(grown, 13) end
      end
    end
    whole = whole or #lack + #ledger - 8 > ledger_most  -- (past the bound: into the ids hash)
    if not whole then body, adds = string.sub(ledger, 9), {} end
  end
  if #adds > 0 or whole then
    adds = needed(adds)
    table.sort(adds, before)
    local writes = merged(needed(ledger_writes(l)), adds)
    body = ''
    if #writes > 0 then  -- (times counted from near the earliest a needed write may have, in whole
      -- seconds from the earliest write, with room for a horizon on: later writes fit in place)
      local first = micros(writes[1], 9)
      for _, write in ipairs(writes) do first = math.min(first, micros(write, 9)) end
      local low = first - math.floor((first - (cutoff - within)) / 1e6) * 1e6
      body = directory_of_writes(writes, low, cutoff + horizon_ms * 1000)
    end
    if heavy or #lack + #body > ledger_most then  -- (a heavy entity's are in its ids hash)
      spilled, body = writes, ''
    end
  end
  set_ledger(events, old, lack .. body)
  -- the keys live as long as what they now record is needed (a key the ledger made has no expiry yet)
  local recorded = newest(ledger_adds[events] or {}, lack ~= NO_LACK and micros(lack, 1) or nil)
  if recorded and lack .. body ~= NO_LACK then extend(events, needed_until_ms(recorded)) end
  if spilled and #spilled > 0 then
    local ids = events .. '|ids'
    record_writes(ids, spilled)
    extend(ids, needed_until_ms(newest(spilled)))
  end
end
local rewritten = {}
for _, changes in ipairs({lacked, ledger_adds, trimmed}) do
  for events in pairs(changes) do
    if not rewritten[events] then
      rewritten[events] = true
      rewrite_ledger(events)
    end
  end
end
return garbage_taken_out(added)
