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
-- a redelivery, a retry) is marked shared: a record under the id's digest
-- with its last byte flipped, in the same bucket (a record's bucket follows
-- bytes 4-6 of its digest). A shared claim is never released: the copy
-- refused as invalid cannot know whether another copy, claimed under the
-- same binding, has drawn since (its pool may have changed meanwhile), and
-- freeing the id would let other content take it and draw too. No id's
-- digest is the flipped one short of breaking SHA-256.

local s = store_open(KEYS[1], ARGV[1])
local prev = store_find(s)

-- The store opened for the shared mark of the same id.
local function shared_mark()
  local m = {}
  for k, v in pairs(s) do m[k] = v end
  m.epochs = {}
  for i, e in ipairs(s.epochs) do m.epochs[i] = {e[1], e[2], e[3], e[4], e[5]} end
  local last = string.byte(s.d, 16)
  m.d = string.sub(s.d, 1, 15) .. string.char(255 - last)
  m.cur = nil
  return m
end

if ARGV[2] == 'release' then
  if prev == s.fp and not store_find(shared_mark()) then
    store_drop(s)
    return {1, s.now}
  end
  return {0, s.now}
end
if prev then
  if prev == s.fp then
    local m = shared_mark()
    if not store_find(m) then store_put(m, s.fp) end
    return {1, s.now}
  end
  return {0, s.now}
end
store_put(s, s.fp)
return {1, s.now}
