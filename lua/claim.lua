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
--          the claim was freed, 0 when it binds nothing of ours

local s = store_open(KEYS[1], ARGV[1])
local prev = store_find(s)
if ARGV[2] == 'release' then
  if prev == s.fp then
    store_drop(s)
    return {1, s.now}
  end
  return {0, s.now}
end
if prev then
  if prev == s.fp then return {1, s.now} end
  return {0, s.now}
end
store_put(s, s.fp)
return {1, s.now}
