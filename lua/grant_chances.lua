-- Adds lottery chances for a user, once per grant id.
--
-- KEYS[1]: activity meta hash
-- KEYS[2]: chances hash (user id -> chances left)
-- KEYS[3]: grant key (idempotency): the fingerprint of what the grant asked
-- ARGV[1]: user id
-- ARGV[2]: chances to add
-- ARGV[3]: grant key TTL, seconds
-- ARGV[4]: fingerprint of the grant (activity, user, chances)
-- Returns: {"ok", chances left} or {"dup", chances left}; {"unknown", 0};
--          {"reused", 0} when the grant id was first used for another grant

if redis.call('HGET', KEYS[1], 'kind') ~= 'lottery' then return {'unknown', 0} end
local prev = redis.call('GET', KEYS[3])
if prev then
  if prev ~= ARGV[4] then return {'reused', 0} end
  return {'dup', tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0}
end
local left = redis.call('HINCRBY', KEYS[2], ARGV[1], tonumber(ARGV[2]))
redis.call('SET', KEYS[3], ARGV[4], 'EX', tonumber(ARGV[3]))
return {'ok', left}
