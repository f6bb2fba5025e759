-- Looks up, or forgets now, what a store holds for a token, as the store's
-- expiry would a day later (after lua/lib/answer.lua). For operators and
-- tests; the fleet never calls it.
--
-- KEYS[1]: an answer store (a pool's) or a claim store (an id group's)
-- ARGV[1]: the token
-- ARGV[2]: "answer" or "claim": which kind of store and token
-- ARGV[3]: "peek" or "forget"
-- Returns: the stored value (fingerprint bytes, then the body for an
--          answer), or false when there is none

local s
if ARGV[2] == 'claim' then s = store_of(KEYS[1], ARGV[1], 8, 8) else s = store_of(KEYS[1], ARGV[1], ANSWER_FIELD, ANSWER_PRINT) end
local value, bucket = lookup(s)
if value and ARGV[3] == 'forget' then redis.call('HDEL', bucket, s.field) end
return value
