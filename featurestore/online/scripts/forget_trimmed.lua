-- needs: _blocks.lua
-- KEYS: events keys. Each forgets the newest event it lacked (its ledger's, ``add_events.lua``),
-- keeping the writes it records: a whole-history resend is about to send all their events again,
-- and records anew what each still lacks.
for _, events in ipairs(KEYS) do
  local ledger = ledger_of(events)
  if ledger then set_ledger(events, ledger, NO_LACK .. string.sub(ledger, 9)) end
end
return garbage_taken_out(0)
