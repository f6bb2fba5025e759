-- The seed of a lottery activity's period: the one committed or chosen
-- already, or the candidate, kept as chosen (not committed) until its
-- commitment is on record (lottery_seed_commit.lua).
--
-- KEYS[1]: activity meta hash (its `kind`)
-- KEYS[2]: activity seeds hash: field <period> the committed
--          "<commitment>|<seed hex>", `n:<period>` one chosen and not
--          committed yet, `r:<period>` one retired (its period over) and not
--          yet revealed in Postgres, `retired` the last period retired
-- ARGV[1]: period start, unix seconds
-- ARGV[2]: candidate "<commitment>|<seed hex>" (fresh from the OS CSPRNG)
-- Returns: {"committed", value}  the period's seed is committed already
--          {"chosen", value}     the seed to record and then commit: an
--                                earlier attempt's, or the candidate
--          {"retired", ""}       the period is over: no seed is chosen for it
--          {"unknown", ""}       no lottery activity has this id
--
-- A commitment may be recorded (Postgres, the outbox) and the attempt die
-- before it commits; the attempt that takes over must commit the same seed,
-- or the record would name a seed no draw used. So the seed is chosen once
-- per period, here, next to the activity.

if redis.call('HGET', KEYS[1], 'kind') ~= 'lottery' then return {'unknown', ''} end
local period = tonumber(ARGV[1])
local m = redis.call('HMGET', KEYS[2], ARGV[1], 'n:' .. ARGV[1], 'open')
if m[1] then return {'committed', m[1]} end
if period < (tonumber(m[3]) or -1) then return {'retired', ''} end
if m[2] then return {'chosen', m[2]} end
redis.call('HSET', KEYS[2], 'n:' .. ARGV[1], ARGV[2])
return {'chosen', ARGV[2]}
