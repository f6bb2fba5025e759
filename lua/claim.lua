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
-- a redelivery, a retry) is marked shared: its record gets an `s` after the
-- fingerprint, in place. A shared claim is never released: the copy refused
-- as invalid cannot know whether another copy, claimed under the same
-- binding, has drawn since (its pool may have changed meanwhile), and
-- freeing the id would let other content take it and draw too. (A claim of
-- the earlier layout is never released either: it is only read.)

local s = store_open(KEYS[1], ARGV[1])
local held, bucket = store_find(s)

if ARGV[2] == 'release' then
  if held == s.fp and bucket then
    store_drop(s, bucket, held)
    return {1, s.now}
  end
  return {0, s.now}
end
if not held then
  store_put(s, s.fp)
elseif string.sub(held, 1, 8) ~= s.fp then
  return {0, s.now}
elseif held == s.fp then
  if bucket then
    redis.call('HSET', bucket, s.d, s.fp .. 's')
  else
    store_put(s, s.fp .. 's')
  end
end
return {1, s.now}
