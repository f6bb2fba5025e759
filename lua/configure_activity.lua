-- Creates or updates a lottery activity's settings in Redis.
-- Prepended by lib/answer.lua and lib/lottery.lua (lottery_fold).
--
-- KEYS[1]: activity meta hash
-- KEYS[2]: stock hash of an activity loaded before its counters moved into
--          meta (lib/lottery.lua: each prize's counts are meta's `c`)
-- KEYS[3]: awarded hash of such an activity
-- ARGV[1]: config version
-- ARGV[2]: strategy label
-- ARGV[3]: starts_at, unix ms
-- ARGV[4]: ends_at, unix ms
-- ARGV[5]: prizes, "id:weight,id:weight"
-- ARGV[6]: consolation, "id:weight" or ""
-- ARGV[7]: seed period, seconds (docs/fairness.md, Lotteries)
-- ARGV[8..]: prize id, initial stock pairs
-- Returns: {"ok", ""}, {"kind", other kind} or {"stale", stored version}
--
-- A prize's stock is set when it first appears; a reload never refills or
-- shrinks what is left (that would break "never beyond stock").

local kind = redis.call('HGET', KEYS[1], 'kind')
if kind and kind ~= 'lottery' then return {'kind', kind} end
local version = tonumber(redis.call('HGET', KEYS[1], 'version')) or 0
if version > tonumber(ARGV[1]) then return {'stale', tostring(version)} end
-- A meta hash made by a remembered refusal (lib/answer.lua) is the activity's now.
redis.call('PERSIST', KEYS[1])
redis.call('HSET', KEYS[1], 'kind', 'lottery', 'version', ARGV[1], 'strategy', ARGV[2],
  'starts_at', ARGV[3], 'ends_at', ARGV[4], 'prizes', ARGV[5], 'consolation', ARGV[6],
  'seed_period_s', ARGV[7])
local c
if redis.call('HGET', KEYS[1], 'counters') == 'meta' then
  c = counts_parse(redis.call('HGET', KEYS[1], 'c'))
else
  c = lottery_fold(KEYS[1], KEYS[2], KEYS[3])
end
for i = 8, #ARGV, 2 do counts_add(c, ARGV[i], tonumber(ARGV[i + 1])) end
redis.call('HSET', KEYS[1], 'c', counts_text(c))
return {'ok', ''}
