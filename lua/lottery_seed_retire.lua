-- Retires the seeds of lottery periods that are over: no draw finds them
-- any more, and each waits as `r:<period>` until its reveal is in Postgres
-- (the caller then deletes the field). A seed chosen and never committed
-- is retired too: its commitment may be on record.
--
-- KEYS[1]: activity seeds hash (lottery_seed.lua)
-- KEYS[2]: activity meta hash (its copy `seed:<period>` of a committed seed)
-- ARGV[1]: the start of the oldest period still open, unix seconds: every
--          period before it is over, and no seed is chosen for it any more
-- Returns: {"ok", number of seeds retired}
--
-- The fields are the periods not retired yet (normally the current one and
-- perhaps the one before), so the walk is short.

local open = tonumber(ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
local moved = 0
for i = 1, #all, 2 do
  local field, value = all[i], all[i + 1]
  -- A period's seed is either chosen (`n:`) or committed, never both.
  local period = string.match(field, '^n:(%d+)$') or string.match(field, '^(%d+)$')
  if period and tonumber(period) < open then
    redis.call('HSET', KEYS[1], 'r:' .. period, value)
    redis.call('HDEL', KEYS[1], field)
    redis.call('HDEL', KEYS[2], 'seed:' .. period)
    moved = moved + 1
  end
end
if open > (tonumber(redis.call('HGET', KEYS[1], 'open')) or -1) then
  redis.call('HSET', KEYS[1], 'open', ARGV[1])
end
return {'ok', moved}
