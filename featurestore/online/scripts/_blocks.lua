-- Shared by the scripts that say they need it: packed blocks (featurestore/online/packed.py). A
-- block is one sorted-set member holding the events of the ended tiles among the BLOCK_TILES
-- tiles it covers, scored at its first tile's start; bytes 9-16 of an event are its µs, of a
-- block all ones.
--
-- A block's directory lists each of its events' id and µs (an event's bytes 1-16), sorted by id
-- then µs: the duplicate rule finds an id's packed writes there by binary search (the ids hash
-- then no longer holds an id whose one write is a packed event), so a block lives as long as its
-- events' writes are needed. The ids hash's field '' lists the entity's blocks, each as its number
-- (int64, as in its header), the length of its id filter (uint32) and the filter
-- (``packed.id_filter``), so a write finds the blocks near its time without reading the sorted
-- set, and reads only those whose filter may hold its id (a new id: about one in thirty). The
-- field is there for every entity that is not light (below), blocks or none: it marks it heavy,
-- and keeps the hash, and its expiry, once its ids are packed. Entries are
-- stored short and fixed in width: the header is the length p of the prefix every id shares,
-- that prefix, the width w of a time, the exponent e of the unit of times (10^e µs) and the 8
-- bytes of the earliest µs; each entry is then the id's last 8 - p bytes and its µs less the
-- earliest in units, in w bytes.
--
-- A light entity's events (no block, at most LIGHT_MOST members) are the record of their ids'
-- writes where an id has just the one: its ids hash holds only the ids with other writes (a key
-- and ~20 bytes an event less). Every other entity's ids hash holds the ids of all its plain
-- events (``heavier`` records them, and sets the field '', as an entity stops being light; a trim
-- that leaves it few events and no block removes the field). A write to a light entity reads all
-- its members to find its id's writes: the bound keeps that read short, where the key a hash
-- costs is most of a small entity's memory (``benchmarks/aggregations.py``); a write to a heavy
-- one reads none (the field says so).
-- The ids hash's field TRIMMED_AT holds the cutoff (8 bytes, as a stamp) at which its write times
-- were last trimmed (``add_events.lua``): reading the whole hash to drop the few times a dedup
-- window past is done once the cutoff has moved a quarter of the dedup window since, not at every
-- move of an entity's expiry (once per slack). Times kept longer only keep more of the rule's
-- record: nothing is judged otherwise than the rule does.
local BLOCK_TILES = 32
local TRIMMED_AT = 't'  -- (no id: ids are 8 bytes)
local LIGHT_MOST = 16
local ONES = string.rep('\255', 8)
-- (an event's byte 9 is its µs's sign-flipped top byte: 255 only past the year 290,000, so the
-- cheap test spares nearly every member a copy of its bytes)
local function is_block(member) return string.byte(member, 9) == 255 and string.sub(member, 9, 16) == ONES end
-- An entity's ledger is one member of its events key scored +inf, outside every window, trim and
-- block (whatever reads or counts all of an entity's events reads them up to it: EVENTS_TO): the
-- newest µs of an event the entity lacks (8 bytes, all zero for none: add_events.lua), then, for
-- a light entity, the directory (as a block's) of the writes the duplicate rule still needs of
-- events it no longer holds: trimmed, or written before the cutoff. A light entity keeps them
-- there, not in an ids hash, whose key would cost more than its ~16 entries of ~5-11 bytes; up
-- to Redis's compact member length (past it they go into the hash, rather than turn the whole
-- set into Redis's large encoding). A write is added in place where the directory's header can
-- hold it; a trim, which drops those no longer needed, writes it anew.
local LEDGER_SCORE, EVENTS_TO, NO_LACK = '+inf', '(inf', string.rep('\0', 8)
local function micros(stamp, at)
  local hi, lo = struct.unpack('>I4I4', stamp, at)
  return (hi - 2147483648) * 4294967296 + lo
end
local function stamp_of(us)  -- micros's inverse
  local hi = math.floor(us / 4294967296)
  return struct.pack('>I4I4', hi + 2147483648, us - hi * 4294967296)
end
local function fmt(us) return string.format('%.0f', us) end
local function block_events(member, tile_in_block)  -- a block's events in its tile 0..BLOCK_TILES-1
  local held, width = struct.unpack('>I4B', member, 26)  -- (bit i: tile i holds events; then their counts)
  if math.floor(held / 2 ^ tile_in_block) % 2 == 0 then return 0 end
  local before = 0  -- tiles holding events before this one
  for i = 0, tile_in_block - 1 do before = before + math.floor(held / 2 ^ i) % 2 end
  return (struct.unpack(width == 1 and '>I1' or '>I2', member, 31 + width * before))
end
local function block_number(member) return string.sub(member, 18, 25) end  -- (int64: its header's)
local FILTER_PRIME = 2147483647
local function id_hashes(id)  -- packed.filter_hashes: (hi * A + lo * B) mod FILTER_PRIME, exact (< 2^53)
  local hi, lo = struct.unpack('>I4I4', id)
  return math.fmod(hi * 648113 + lo * 521387, FILTER_PRIME), math.fmod(hi * 797473 + lo * 938351, FILTER_PRIME),
         math.fmod(hi * 574831 + lo * 1003441, FILTER_PRIME)
end
local function filter_bit(list, at, k)  -- bit k (from 0, least significant first) of the bytes from at
  return math.floor(string.byte(list, at + math.floor(k / 8)) / 2 ^ (k % 8)) % 2 == 1
end
-- whether the filter of `length` bytes at list[at..] may hold an id of these hashes (none: it may)
local function may_hold(list, at, length, hashes)
  if length == 0 then return true end
  for _, h in ipairs(hashes) do
    if not filter_bit(list, at, math.fmod(h, length * 8)) then return false end
  end
  return true
end
local function compare(a, at, b, bt, length)  -- bytes a[at..] against b[bt..]: -1, 0 or 1
  local k = 0  -- (by 8 bytes, then 4, then 1: Lua compares strings by locale)
  while k + 8 <= length do
    local x1, x2 = struct.unpack('>I4I4', a, at + k)
    local y1, y2 = struct.unpack('>I4I4', b, bt + k)
    if x1 ~= y1 then return x1 < y1 and -1 or 1 end
    if x2 ~= y2 then return x2 < y2 and -1 or 1 end
    k = k + 8
  end
  if k + 4 <= length then
    local x, y = struct.unpack('>I4', a, at + k), struct.unpack('>I4', b, bt + k)
    if x ~= y then return x < y and -1 or 1 end
    k = k + 4
  end
  for j = k, length - 1 do
    local x, y = string.byte(a, at + j), string.byte(b, bt + j)
    if x ~= y then return x < y and -1 or 1 end
  end
  return 0
end
-- a directory, read in place from s[from] (past its length): {block (s), p, prefix, w, unit µs,
-- base µs, first entry's offset, entry width, entries}
local function directory_at(block, from)
  local length, p = struct.unpack('>I4', block, from - 4), string.byte(block, from)
  local w, e = string.byte(block, from + p + 1, from + p + 2)
  local at, width = from + p + 11, 8 - p + w
  return {block = block, p = p, prefix = string.sub(block, from + 1, from + p), w = w, unit = 10 ^ e,
          base = micros(block, from + p + 3), at = at, width = width, n = (from + length - at) / width}
end
local function directory(block)  -- a block's
  local held, count_width = struct.unpack('>I4B', block, 26)
  local tiles = 0  -- (tiles holding events: bits set in held)
  while held ~= 0 do held, tiles = bit.band(held, held - 1), tiles + 1 end
  return directory_at(block, 31 + count_width * tiles + 4)
end
local function entry_us(block, l, at)  -- the µs of the entry at offset at
  return l.base + l.unit * struct.unpack('>I' .. l.w, block, at + 8 - l.p)
end
local function entry(block, l, i)  -- entry i (from 0) as 16 bytes: id, then stamp
  local at = l.at + i * l.width
  return l.prefix .. string.sub(block, at, at + 7 - l.p) .. stamp_of(entry_us(block, l, at))
end
-- the first entry (from 0) of directory l not before `bytes` (its first `length` bytes compared):
-- entries sort by id, then µs, bytewise, as they are big-endian
local function first_from(l, bytes, length)
  local lo, hi = 0, l.n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if compare(l.block, l.at + mid * l.width, bytes, 1, length) < 0 then lo = mid + 1 else hi = mid end
  end
  return lo
end
local function id_writes(l, id)  -- the µs (8 bytes each) of id's events in a directory
  local block = l.block
  if string.sub(id, 1, l.p) ~= l.prefix then return '' end
  local tail, length = string.sub(id, l.p + 1), 8 - l.p
  local lo = first_from(l, tail, length)
  local out = ''
  while lo < l.n and compare(block, l.at + lo * l.width, tail, 1, length) == 0 do
    out = out .. string.sub(entry(block, l, lo), 9, 16)
    lo = lo + 1
  end
  return out
end
local function before(x, y) return compare(x, 1, y, 1, 16) < 0 end  -- (writes: by id, then µs)
local function merged(a, b)  -- two sorted lists of writes as one
  local out, i, j = {}, 1, 1
  while i <= #a or j <= #b do
    if j > #b or (i <= #a and before(a[i], b[j])) then out[#out + 1], i = a[i], i + 1
    else out[#out + 1], j = b[j], j + 1 end
  end
  return out
end
-- packed.directory of writes (16 bytes each: id, stamp; sorted), its times counted from low (or
-- the earliest write, if earlier) and wide enough for times up to reach: later writes fit in place
local function directory_of_writes(writes, low, reach)
  local first, last = writes[1], writes[#writes]
  local p = 0
  while p < 8 and string.byte(first, p + 1) == string.byte(last, p + 1) do p = p + 1 end
  local high = reach
  for _, write in ipairs(writes) do
    local us = micros(write, 9)
    if us < low then low = us end
    if us > high then high = us end
  end
  local e = 6
  for _, write in ipairs(writes) do
    while e > 0 and math.fmod(micros(write, 9) - low, 10 ^ e) ~= 0 do e = e - 3 end
  end
  local unit, w = 10 ^ e, 1
  while (high - low) / unit >= 256 ^ w do w = w + 1 end
  local parts = {string.char(p), string.sub(first, 1, p), string.char(w, e), stamp_of(low)}
  for i, write in ipairs(writes) do
    if i == 1 or write ~= writes[i - 1] then
      parts[#parts + 1] = string.sub(write, p + 1, 8) .. struct.pack('>I' .. w, (micros(write, 9) - low) / unit)
    end
  end
  local body = table.concat(parts)
  return struct.pack('>I4', #body) .. body
end
local function ledger_of(events)  -- its ledger member, or nil
  return redis.call('ZRANGEBYSCORE', events, LEDGER_SCORE, LEDGER_SCORE)[1]
end
-- the ledger of directory l with write (16 bytes: id, stamp) added in place, or nil where the
-- directory's header cannot hold it (another prefix, an earlier or longer time, another unit)
local function inserted(l, write)
  local ledger = l.block
  local offset = micros(write, 9) - l.base
  if string.sub(write, 1, l.p) ~= l.prefix or offset < 0 or math.fmod(offset, l.unit) ~= 0
     or offset / l.unit >= 256 ^ l.w then
    return nil
  end
  local entry_bytes = string.sub(write, l.p + 1, 8) .. struct.pack('>I' .. l.w, offset / l.unit)
  local lo = first_from(l, entry_bytes, l.width)
  local at = l.at + lo * l.width
  if lo < l.n and compare(ledger, at, entry_bytes, 1, l.width) == 0 then return ledger end
  local length = struct.unpack('>I4', ledger, 9) + l.width
  return string.sub(ledger, 1, 8) .. struct.pack('>I4', length) .. string.sub(ledger, 13, at - 1) .. entry_bytes
         .. string.sub(ledger, at)
end
local function ledger_directory(ledger)  -- a ledger's directory, read in place, or nil
  if ledger and #ledger > 8 then return directory_at(ledger, 13) end
end
local function ledger_writes(l)  -- the writes of a ledger's directory l (if any), 16 bytes each, sorted
  local out = {}
  if l then
    for i = 0, l.n - 1 do out[#out + 1] = entry(l.block, l, i) end
  end
  return out
end
-- whether a member is a ledger: 8 bytes, or its bytes 9-12 a directory's length (under 2^24: its
-- byte 9 is 0, where an event's is its µs's sign-flipped top byte: 0 only before the year -290,000)
local function is_ledger(member) return #member == 8 or string.byte(member, 9) == 0 end
-- the events of an entity whose ids hash lacks the field '' (so it holds no block: every block is
-- listed there) where they are at most LIGHT_MOST, and its ledger (or nil), read in one command
-- (the ledger, scored +inf, comes last); false where it holds more (no more than LIGHT_MOST + 2
-- members are read)
local function few_events(events)
  local held = redis.call('ZRANGE', events, 0, LIGHT_MOST + 1)
  if #held > LIGHT_MOST + 1 then return false end
  local ledger = held[#held] and is_ledger(held[#held]) and table.remove(held) or nil
  if #held > LIGHT_MOST then return false end
  return held, ledger
end
-- whether an entity is light: its ids hash lacks the field '' (which lists its blocks, and marks
-- an entity heavy: ``heavier`` sets it, a trim that leaves few events and no block removes it),
-- and few(events) (read only where the field is missing: a heavier entity's members are not read)
local function is_light_entity(field, events, few)
  return not field and few(events) ~= false
end
local function each_chunk(list, size, f)  -- f(i, j) over list[i..j], at most `size` at a time (unpack's stack limit)
  for i = 1, #list, size do f(i, math.min(i + size - 1, #list)) end
end
local function holds(list, item)  -- whether item is one of list's (each as long as it)
  for at = 1, #list, #item do
    if string.sub(list, at, at + #item - 1) == item then return true end
  end
  return false
end
local function unlisted(list, keep)  -- the block list with only the blocks keep(number) is true of
  local kept, at = {}, 1
  while at <= #list do
    local next_at = at + 12 + struct.unpack('>I4', list, at + 8)
    if keep(string.sub(list, at, at + 7)) then kept[#kept + 1] = string.sub(list, at, next_at - 1) end
    at = next_at
  end
  return table.concat(kept)
end
-- the ids hash lists the block member of events, with its id filter
local function listed_block(events, member, filter)
  local ids, number = events .. '|ids', block_number(member)
  local listed = unlisted(redis.call('HGET', ids, '') or '', function(other) return other ~= number end)
  redis.call('HSET', ids, '', listed .. number .. struct.pack('>I4', #filter) .. filter)
end
-- the writes of the plain members into the ids hash (fresh: the hash does not exist, nothing to
-- read); how many ids they are of
local function record_writes(ids, members, fresh)
  local writes, order = {}, {}  -- id -> its members' stamps; ids in first-seen order
  for _, m in ipairs(members) do
    if not is_block(m) then
      local id = string.sub(m, 1, 8)
      if writes[id] == nil then writes[id], order[#order + 1] = '', id end
      writes[id] = writes[id] .. string.sub(m, 9, 16)
    end
  end
  each_chunk(order, 1000, function(i, j)  -- (one read and one write of the hash a chunk)
    local held, changes = fresh and {} or redis.call('HMGET', ids, unpack(order, i, j)), {}
    for k = i, j do
      local id = order[k]
      local times = held[k - i + 1] or ''
      local recorded = times
      for at = 1, #writes[id], 8 do
        local stamp = string.sub(writes[id], at, at + 7)
        if not holds(times, stamp) then times = times .. stamp end
      end
      if times ~= recorded then changes[#changes + 1], changes[#changes + 2] = id, times end
    end
    if #changes > 0 then redis.call('HSET', ids, unpack(changes)) end
  end)
  return #order
end
local function set_ledger(events, old, new)  -- old: the ledger member, if any; new: its bytes
  if new == old then return end
  if old then redis.call('ZREM', events, old) end
  if new ~= NO_LACK then redis.call('ZADD', events, LEDGER_SCORE, new) end
end
-- as an entity stops being light: every plain event's write, and its ledger's, into the ids hash
-- (its callers see that the hash lives as long as the events' writes need). Where the caller has
-- read them this call: members, its plain events; ledger, its ledger member (false: none)
local function heavier(events, members, ledger)
  local ids = events .. '|ids'
  if ledger == nil then ledger = ledger_of(events) end
  local fresh = redis.call('EXISTS', ids) == 0
  local recorded = record_writes(ids, members or redis.call('ZRANGEBYSCORE', events, '-inf', EVENTS_TO), fresh)
  if ledger and #ledger > 8 then
    recorded = recorded + record_writes(ids, ledger_writes(ledger_directory(ledger)), fresh and recorded == 0)
    set_ledger(events, ledger, string.sub(ledger, 1, 8))
  end
  redis.call('HSETNX', ids, '', '')  -- (the mark of a heavy entity: is_light_entity)
end
