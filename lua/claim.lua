-- Binds a request id to what its request asked, before anything moves
-- (after lua/lib/answer.lua, whose answer store it uses for claims).
--
-- KEYS[1]: the claim store of the id's group, `<prefix>:<space>:{<group>}`
-- ARGV[1]: the claim token: "<ttl s>:<selector>:" .. field (8 bytes of a hash
--          of the id) .. fingerprint (8 bytes of a hash of the content)
-- ARGV[2]: "claim", or "release" to free a claim that still binds this content
-- Returns: claim: 1 when the id may go on (new, or claimed before for the
--          same content), 0 when it was first used for other content;
--          release: 1 when the claim was freed, 0 when it binds nothing of ours

local s = store_of(KEYS[1], ARGV[1], 8, 8)
local prev, bucket = lookup(s)
if ARGV[2] == 'release' then
  if prev == s.fp then
    redis.call('HDEL', bucket, s.field)
    return 1
  end
  return 0
end
if prev then
  if prev == s.fp then return 1 end
  return 0
end
store(s, s.fp)
return 1
