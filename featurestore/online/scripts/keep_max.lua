-- KEYS[1]: a hash; ARGV[1]: a field; ARGV[2]: a number. The field keeps the largest number it was given.
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current or tonumber(current) < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
