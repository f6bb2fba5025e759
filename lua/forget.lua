-- Looks up, or forgets now, what a store holds for a token, as the store's
-- expiry would a day later (after lua/lib/answer.lua). For operators and
-- tests; the fleet never calls it.
--
-- KEYS[1]: an answer store (a pool's) or a claim store (an id group's)
-- ARGV[1]: the token
-- ARGV[2]: "answer" or "claim": which kind of store and token (both are
--          read alike)
-- ARGV[3]: "peek" or "forget"
-- Returns: the stored record (the content fingerprint for a claim, followed
--          by `s` once shared; the body for an answer), or false when there
--          is none. A record of the earlier layout is read, not forgotten.

local s = store_open(KEYS[1], ARGV[1])
local value, bucket = store_find(s)
if value and bucket and ARGV[3] == 'forget' then store_drop(s, bucket, value) end
return value
