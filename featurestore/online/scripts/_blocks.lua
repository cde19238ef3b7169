-- Shared by the scripts that say they need it: packed blocks (featurestore/online/packed.py) and
-- the id index of their events. A block is one sorted-set member holding the events of the
-- ended tiles among the BLOCK_TILES tiles it covers, scored at its first tile's start; bytes 9-16
-- of an event are its µs, of a block all ones.
--
-- The index (key events|seen) lists each packed event's id and µs (an event's bytes 1-16), sorted
-- by id then µs: the duplicate rule finds an id's writes there by binary search once its event is
-- packed (the ids hash then no longer holds it, unless the id has other writes). Entries are
-- stored short and fixed in width (so the search stays a binary search): the header is the
-- length p of the prefix every id shares, that prefix, the width w of a time, the exponent e of
-- the unit of times (10^e µs: 6 when every time lies whole seconds from the earliest, 3 for whole
-- ms, else 0) and the 8 bytes of the earliest µs; each entry is then the id's last 8 - p bytes and
-- its µs less the earliest in units, in w bytes (12 days of room at least before a new entry makes
-- the index be written anew, as one off the unit does).
--
-- A light entity's events (none packed, at most LIGHT_MOST members) are the record of their ids'
-- writes where an id has just the one: its ids hash holds only the ids with other writes (a key
-- and ~20 bytes an event less). Every other entity's ids hash holds the ids of all its plain
-- events (``heavier`` records them as an entity stops being light). A write to a light entity
-- reads all its members to find its id's writes: the bound keeps that read short, where the key
-- a hash costs is most of a small entity's memory (``benchmarks/aggregations.py``).
local BLOCK_TILES = 32
local LIGHT_MOST = 16
local ONES = string.rep('\255', 8)
local function is_block(member) return string.sub(member, 9, 16) == ONES end
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
local function layout(index)  -- {p, prefix, w, unit µs, base µs, first entry's offset, entry width, entries}
  local p = string.byte(index, 1)
  local w, e = string.byte(index, p + 2, p + 3)
  local at, width = p + 12, 8 - p + w
  return {p = p, prefix = string.sub(index, 2, p + 1), w = w, unit = 10 ^ e, base = micros(index, p + 4),
          at = at, width = width, n = (#index - at + 1) / width}
end
local function entry_us(index, l, at)  -- the µs of the entry at offset at
  return l.base + l.unit * struct.unpack('>I' .. l.w, index, at + 8 - l.p)
end
local function entry(index, l, i)  -- entry i (from 0) as 16 bytes: id, then stamp
  local at = l.at + i * l.width
  return l.prefix .. string.sub(index, at, at + 7 - l.p) .. stamp_of(entry_us(index, l, at))
end
local function entries_of(index)  -- every entry as 16 bytes, in order
  if index == '' then return {} end
  local l, out = layout(index), {}
  for i = 0, l.n - 1 do out[#out + 1] = entry(index, l, i) end
  return out
end
local function short(l, e)  -- a 16-byte entry in layout l, or nil where it does not fit
  if string.sub(e, 1, l.p) ~= l.prefix then return nil end
  local offset = micros(e, 9) - l.base  -- (math.fmod is exact)
  if offset < 0 or offset >= l.unit * 256 ^ l.w or math.fmod(offset, l.unit) ~= 0 then return nil end
  return string.sub(e, l.p + 1, 8) .. string.sub(struct.pack('>I8', offset / l.unit), 9 - l.w)
end
local function index_of_entries(entries)  -- sorted, distinct 16-byte entries as an index
  if #entries == 0 then return '' end
  local first, last = entries[1], entries[#entries]
  local p = 0
  while p < 8 and string.byte(first, p + 1) == string.byte(last, p + 1) do p = p + 1 end
  local low, high = micros(first, 9), micros(first, 9)
  for _, e in ipairs(entries) do
    local us = micros(e, 9)
    if us < low then low = us end
    if us > high then high = us end
  end
  local exponent = 6  -- (the unit: whole seconds, else ms, else µs)
  for _, e in ipairs(entries) do
    while exponent > 0 and math.fmod(micros(e, 9) - low, 10 ^ exponent) ~= 0 do exponent = exponent - 3 end
  end
  local unit, w = 10 ^ exponent, 1
  while w < 8 and (unit * 256 ^ w < 2 ^ 40 or high - low >= unit * 256 ^ w) do w = w + 1 end
  local l = {p = p, prefix = string.sub(first, 1, p), w = w, unit = unit, base = low}
  local parts = {string.char(p) .. l.prefix .. string.char(w, exponent) .. stamp_of(low)}
  for _, e in ipairs(entries) do parts[#parts + 1] = short(l, e) end
  return table.concat(parts)
end
local function id_writes(index, id)  -- the µs (8 bytes each) of id's packed events
  local l = layout(index)
  if string.sub(id, 1, l.p) ~= l.prefix then return '' end
  local tail, length = string.sub(id, l.p + 1), 8 - l.p
  local lo, hi = 0, l.n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if compare(index, l.at + mid * l.width, tail, 1, length) < 0 then lo = mid + 1 else hi = mid end
  end
  local out = ''
  while lo < l.n and compare(index, l.at + lo * l.width, tail, 1, length) == 0 do
    out = out .. string.sub(entry(index, l, lo), 9, 16)
    lo = lo + 1
  end
  return out
end
local function sorted_entries(entries)  -- 16-byte entries sorted (on their numbers: a comparator unpacking them costs 3x)
  local keyed = {}
  for k, e in ipairs(entries) do
    local a1, a2, a3, a4 = struct.unpack('>I4I4I4I4', e)
    keyed[k] = {a1, a2, a3, a4, e}
  end
  table.sort(keyed, function(x, y)
    if x[1] ~= y[1] then return x[1] < y[1] end
    if x[2] ~= y[2] then return x[2] < y[2] end
    if x[3] ~= y[3] then return x[3] < y[3] end
    return x[4] < y[4]
  end)
  local out = {}
  for k, x in ipairs(keyed) do out[k] = x[5] end
  return out
end
local function with_entries(index, entries)  -- the index with entries (16 bytes each) added
  entries = sorted_entries(entries)
  local l = index ~= '' and layout(index)
  local shorts, fit = {}, l and true
  for _, e in ipairs(entries) do
    local e_short = fit and short(l, e)
    if e_short then shorts[#shorts + 1] = e_short else fit = false end
  end
  if not fit then  -- (one does not fit, or the index is new: it is written anew)
    local all, distinct = entries_of(index), {}
    for _, e in ipairs(entries) do all[#all + 1] = e end
    all = sorted_entries(all)
    for _, e in ipairs(all) do
      if e ~= distinct[#distinct] then distinct[#distinct + 1] = e end
    end
    return index_of_entries(distinct)
  end
  local parts, from, last = {string.sub(index, 1, l.at - 1)}, 0, nil
  for _, e in ipairs(shorts) do  -- (sorted as their entries: the same order)
    local lo, hi = from, l.n
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if compare(index, l.at + mid * l.width, e, 1, l.width) < 0 then lo = mid + 1 else hi = mid end
    end
    parts[#parts + 1] = string.sub(index, l.at + from * l.width, l.at + lo * l.width - 1)
    if (lo == l.n or compare(index, l.at + lo * l.width, e, 1, l.width) ~= 0) and e ~= last then
      parts[#parts + 1] = e
    end
    from, last = lo, e
  end
  parts[#parts + 1] = string.sub(index, l.at + from * l.width)
  return table.concat(parts)
end
local function index_after(index, us)  -- the index without the entries at or before us
  local l, parts = layout(index), {}
  for at = l.at, #index, l.width do
    if entry_us(index, l, at) > us then parts[#parts + 1] = string.sub(index, at, at + l.width - 1) end
  end
  if #parts == 0 then return '' end
  return string.sub(index, 1, l.at - 1) .. table.concat(parts)
end
local function index_where(index, keep)  -- the index with only the entries e (16 bytes) where keep(e)
  local kept = {}
  for _, e in ipairs(entries_of(index)) do
    if keep(e) then kept[#kept + 1] = e end
  end
  return index_of_entries(kept)
end
local function each_chunk(list, size, f)  -- f(i, j) over list[i..j], at most `size` at a time (unpack's stack limit)
  for i = 1, #list, size do f(i, math.min(i + size - 1, #list)) end
end
local function has_stamp(times, stamp)  -- whether stamp is one of times' (8 bytes each)
  for at = 1, #times, 8 do
    if string.sub(times, at, at + 7) == stamp then return true end
  end
  return false
end
local function record_writes(ids, members)  -- the writes of the plain members into the ids hash
  local writes, order = {}, {}  -- id -> its members' stamps; ids in first-seen order
  for _, m in ipairs(members) do
    if not is_block(m) then
      local id = string.sub(m, 1, 8)
      if writes[id] == nil then writes[id], order[#order + 1] = '', id end
      writes[id] = writes[id] .. string.sub(m, 9, 16)
    end
  end
  each_chunk(order, 1000, function(i, j)  -- (one read and one write of the hash a chunk)
    local held, changes = redis.call('HMGET', ids, unpack(order, i, j)), {}
    for k = i, j do
      local id = order[k]
      local times = held[k - i + 1] or ''
      local recorded = times
      for at = 1, #writes[id], 8 do
        local stamp = string.sub(writes[id], at, at + 7)
        if not has_stamp(times, stamp) then times = times .. stamp end
      end
      if times ~= recorded then changes[#changes + 1], changes[#changes + 2] = id, times end
    end
    if #changes > 0 then redis.call('HSET', ids, unpack(changes)) end
  end)
end
local function heavier(events)  -- as an entity stops being light: every plain event's write into the ids hash
  local ids = events .. '|ids'       -- (its callers see that it lives as long as the events' writes need)
  record_writes(ids, redis.call('ZRANGE', events, 0, -1))
  if redis.call('EXISTS', ids) == 0 then redis.call('HSET', ids, '', '') end  -- ('': a field that keeps the hash, and its expiry)
end
