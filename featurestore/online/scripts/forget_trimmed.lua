-- needs: _blocks.lua
-- KEYS: events keys. Each forgets the newest event it lacked (its member scored +inf,
-- ``add_events.lua``): a whole-history resend is about to send all their events again, and
-- records anew what each still lacks.
for _, events in ipairs(KEYS) do redis.call('ZREMRANGEBYSCORE', events, LACKED_SCORE, LACKED_SCORE) end
return garbage_taken_out(0)
