-- KEYS: entity keys; ARGV[1]: view field; ARGV[2]: expiry ttl in ms (0: none); ARGV[i+2]: value for KEYS[i].
-- A value replaces the stored one only if its 32-byte order key is larger: compared as
-- eight big-endian uint32s (exact; Lua numbers are doubles and string < depends on locale).
-- With a ttl, the key expires when its newest value would be OUTSIDE_MAX_AGE (never earlier).
local field = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local written = 0
local now_ms = nil
for i, key in ipairs(KEYS) do
  local new = ARGV[i + 2]
  local n = {struct.unpack('>I4I4I4I4I4I4I4I4', new)}
  local old = redis.call('HGET', key, field)
  local newer = true
  if old then
    local o = {struct.unpack('>I4I4I4I4I4I4I4I4', old)}
    newer = false
    for j = 1, 8 do
      if n[j] ~= o[j] then newer = n[j] > o[j]; break end
    end
  end
  if newer then
    redis.call('HSET', key, field, new)
    written = written + 1
    if ttl_ms > 0 then
      if not now_ms then
        local t = redis.call('TIME')
        now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      end
      local event_ms = math.floor(((n[1] - 2147483648) * 4294967296 + n[2]) / 1000)
      local expire_at = event_ms + ttl_ms
      local pttl = redis.call('PTTL', key)
      if pttl == -1 or now_ms + pttl < expire_at then
        redis.call('PEXPIREAT', key, expire_at)
      end
    end
  end
end
return garbage_taken_out(written)
