-- needs: _blocks.lua
-- KEYS[1]: an events key. Returns its blocks.
local out = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if is_block(m) then out[#out + 1] = m end
end
return out
