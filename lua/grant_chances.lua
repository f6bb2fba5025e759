-- Adds lottery chances for a user, once per grant id.
--
-- KEYS[1]: activity meta hash
-- KEYS[2]: chances hash (user id -> chances left)
-- KEYS[3]: grant key (idempotency): the fingerprint of what the grant asked,
--          followed by ";=<chances left>" (the answer the grant got) or by
--          ";!unknown_pool" when the answer was that no such activity exists
-- ARGV[1]: user id
-- ARGV[2]: chances to add
-- ARGV[3]: grant key TTL, seconds
-- ARGV[4]: fingerprint of the grant (activity, user, chances)
-- Returns: {"ok", chances left} or {"dup", chances left}; {"unknown", 0};
--          {"reused", 0} when the grant id was first used for another grant
--
-- Every answer is kept under the grant key, the refusal included: a grant
-- once told "no such activity" stays refused when the activity appears
-- later, so an upstream that acted on the "no" never sees chances it did
-- not expect; a grant sent again replays the chances left it first
-- answered, whatever was drawn since. (Keys stored before the answer was
-- kept hold the fingerprint alone: they answer the chances left now.)

local prev = redis.call('GET', KEYS[3])
if prev then
  local fingerprint, rest = string.match(prev, '^([^;]*)(.*)$')
  if fingerprint ~= ARGV[4] then return {'reused', 0} end
  if rest == ';!unknown_pool' then return {'unknown', 0} end
  local first = string.match(rest, '^;=(%d+)$')
  if first then return {'dup', tonumber(first)} end
  local now = redis.call('HGET', KEYS[1], 'u:' .. ARGV[1]) or redis.call('HGET', KEYS[2], ARGV[1])
  return {'dup', tonumber(now) or 0}
end
if redis.call('HGET', KEYS[1], 'kind') ~= 'lottery' then
  redis.call('SET', KEYS[3], ARGV[4] .. ';!unknown_pool', 'EX', tonumber(ARGV[3]))
  return {'unknown', 0}
end
local field = 'u:' .. ARGV[1]
local before = redis.call('HGET', KEYS[2], ARGV[1])
if before then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[1], field, tonumber(before))
end
local left = redis.call('HINCRBY', KEYS[1], field, tonumber(ARGV[2]))
-- `%d`: the count as digits, never in exponent notation.
redis.call('SET', KEYS[3], ARGV[4] .. ';=' .. string.format('%d', left), 'EX', tonumber(ARGV[3]))
return {'ok', left}
