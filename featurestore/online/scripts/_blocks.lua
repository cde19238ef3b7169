-- Shared by the scripts that say they need it: packed blocks (featurestore/online/packed.py) and
-- the id index of their events. A block is one sorted-set member holding the events of the
-- ended tiles among the BLOCK_TILES tiles it covers, scored at its first tile's start; bytes 9-16
-- of an event are its µs, of a block all ones. The index (key events|seen) lists each packed event as 16 bytes, its id
-- then its µs (an event's bytes 1-16), sorted bytewise: the duplicate rule finds an id's writes
-- there by binary search once its event is packed (the ids hash then no longer holds it, unless
-- the id has other writes).
local BLOCK_TILES = 32
local ONES = string.rep('\255', 8)
local function is_block(member) return string.sub(member, 9, 16) == ONES end
local function micros(stamp, at)
  local hi, lo = struct.unpack('>I4I4', stamp, at)
  return (hi - 2147483648) * 4294967296 + lo
end
local function fmt(us) return string.format('%.0f', us) end
local function block_events(member, tile_in_block)  -- a block's events in its tile 0..BLOCK_TILES-1
  return (struct.unpack('>I2', member, 26 + 2 * tile_in_block))
end
local function before(a, at, b, bt)  -- the 16 bytes of a at `at` sort before those of b at `bt`
  local a1, a2, a3, a4 = struct.unpack('>I4I4I4I4', a, at)
  local b1, b2, b3, b4 = struct.unpack('>I4I4I4I4', b, bt)
  if a1 ~= b1 then return a1 < b1 end
  if a2 ~= b2 then return a2 < b2 end
  if a3 ~= b3 then return a3 < b3 end
  return a4 < b4
end
local function id_writes(index, id)  -- the µs (8 bytes each) of id's packed events
  local i1, i2 = struct.unpack('>I4I4', id)
  local lo, hi = 0, #index / 16
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local a1, a2 = struct.unpack('>I4I4', index, mid * 16 + 1)
    if a1 < i1 or (a1 == i1 and a2 < i2) then lo = mid + 1 else hi = mid end
  end
  local out = ''
  while lo * 16 < #index and string.sub(index, lo * 16 + 1, lo * 16 + 8) == id do
    out = out .. string.sub(index, lo * 16 + 9, lo * 16 + 16)
    lo = lo + 1
  end
  return out
end
local function with_entries(index, entries)  -- the index with entries (16 bytes each) added
  table.sort(entries, function(a, b) return before(a, 1, b, 1) end)
  local parts, from, n = {}, 0, #index / 16
  for _, e in ipairs(entries) do
    local lo, hi = from, n
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if before(index, mid * 16 + 1, e, 1) then lo = mid + 1 else hi = mid end
    end
    parts[#parts + 1] = string.sub(index, from * 16 + 1, lo * 16)
    if string.sub(index, lo * 16 + 1, lo * 16 + 16) ~= e then parts[#parts + 1] = e end
    from = lo
  end
  parts[#parts + 1] = string.sub(index, from * 16 + 1)
  return table.concat(parts)
end
local function each_chunk(list, size, f)  -- f(i, j) over list[i..j], at most `size` at a time (unpack's stack limit)
  for i = 1, #list, size do f(i, math.min(i + size - 1, #list)) end
end
