-- Commits the chosen seed of a lottery period once its commitment is on
-- record: draws of the period use it from now on.
--
-- KEYS[1]: activity seeds hash (lottery_seed.lua)
-- KEYS[2]: activity meta hash: gets a copy as `seed:<period>`, which draws
--          read with the activity's other fields
-- ARGV[1]: period start, unix seconds
-- ARGV[2]: the commitment that was recorded (64 hex digits)
-- Returns: {"ok", ""}       committed (now or before)
--          {"missing", ""}  no seed with this commitment is chosen for the
--                           period (retired meanwhile, or another one)

local m = redis.call('HMGET', KEYS[1], ARGV[1], 'n:' .. ARGV[1])
local function matches(v) return v and string.sub(v, 1, 64) == ARGV[2] end
if matches(m[1]) then
  redis.call('HSET', KEYS[2], 'seed:' .. ARGV[1], m[1])
  return {'ok', ''}
end
if not matches(m[2]) then return {'missing', ''} end
redis.call('HSET', KEYS[1], ARGV[1], m[2])
redis.call('HDEL', KEYS[1], 'n:' .. ARGV[1])
redis.call('HSET', KEYS[2], 'seed:' .. ARGV[1], m[2])
return {'ok', ''}
