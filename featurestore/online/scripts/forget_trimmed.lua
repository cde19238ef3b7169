-- KEYS: events keys. Each forgets the newest event it lacked (the ids hash's 'trimmed',
-- ``add_events.lua``): a whole-history resend is about to send all their events again, and
-- records anew what each still lacks.
for _, events in ipairs(KEYS) do redis.call('HDEL', events .. '|ids', 'trimmed') end
return garbage_taken_out(0)
