-- Binds a request id to what its request asked, before anything moves
-- (after lua/lib/answer.lua, whose store it uses for claims: a claim is a
-- record of the id's digest holding the content fingerprint).
--
-- KEYS[1]: the claim store of the id's group, `<prefix>:<space>:{<group>}`
-- ARGV[1]: the claim token: "<ttl s>::" .. digest (16 bytes of SHA-256 of
--          the id) .. fingerprint (8 bytes of SHA-256 of the content)
-- ARGV[2]: "claim", or "release" to free a claim that still binds this content
-- Returns: {verdict, now}: now is the Redis time (unix seconds) the step
--          read, for the request's answer token; verdict, for claim: 1 when
--          the id may go on (new, or claimed before for the same content),
--          0 when it was first used for other content; for release: 1 when
--          the claim was freed, 0 when it binds nothing of ours or was
--          claimed by more than one copy
--
-- A claim found again for the same content (a second copy of the request:
-- a redelivery, a retry) is marked shared (claim_mark in lib/answer.lua,
-- holding the same fingerprint). A shared claim is never released: the
-- copy refused as invalid cannot know whether another copy, claimed under
-- the same binding, has drawn since (its pool may have changed meanwhile),
-- and freeing the id would let other content take it and draw too. When it
-- is marked, the claim moves to the newest epoch with its mark, so the two
-- expire together (whatever TTL each copy had) and a mark never outlives
-- its claim to hold a later binding of the id.

local s = store_open(KEYS[1], ARGV[1])
local prev = store_find(s)

if ARGV[2] == 'release' then
  -- A mark of another binding (other content) is no mark of this one.
  if prev == s.fp and store_find(claim_mark(s)) ~= s.fp then
    store_drop(s)
    return {1, s.now}
  end
  return {0, s.now}
end
if prev then
  if prev ~= s.fp then return {0, s.now} end
  local m = claim_mark(s)
  local mark = store_find(m)
  if mark ~= s.fp then
    if mark then store_drop(m) end
    store_drop(s)
    -- One store opened for both: one `now` and the epochs the first put
    -- left, so the claim and its mark land in the same epoch even when the
    -- clock ticks past an epoch's end between them.
    local c = store_open(KEYS[1], ARGV[1])
    store_put(c, s.fp)
    store_put(claim_mark(c), s.fp)
  end
  return {1, s.now}
end
store_put(s, s.fp)
return {1, s.now}
