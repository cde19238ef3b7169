-- KEYS[1]: an idempotency key; ARGV: the value to record unless one is, its expiry in s. Returns the recorded one.
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
return redis.call('GET', KEYS[1])
