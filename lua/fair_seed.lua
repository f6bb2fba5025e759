-- The seed of the batch being stocked: the one chosen by an earlier attempt
-- at the same batch, or the candidate. Works for both storages.
--
-- KEYS[1]: pool meta hash (stock_token, gen, fair_next)
-- ARGV[1]: token that must hold the stocking lease
-- ARGV[2]: candidate seed, 64 hex digits (fresh from the OS CSPRNG)
-- Returns: {"ok", seed hex}  the seed of batch gen+1, kept in `fair_next` as
--                            "<gen+1>|<seed hex>" until the commit moves it
--          {"lost", ""}      the lease is not ours; nothing changed
--
-- A commitment may be recorded (Postgres, events) before the batch is
-- visible; an attempt that dies after that and the attempt that takes over
-- (or the same attempt retrying after a Redis failure) must shuffle with
-- the same seed, or the recorded commitment would name a batch that never
-- existed. So the seed is chosen once per batch, here, next to the batch.

local m = redis.call('HMGET', KEYS[1], 'stock_token', 'gen', 'fair_next')
if m[1] ~= ARGV[1] then return {'lost', ''} end
local next_gen = (tonumber(m[2]) or 0) + 1
if m[3] then
  local g, seed = string.match(m[3], '^(%d+)|(%x+)$')
  if tonumber(g) == next_gen then return {'ok', seed} end
end
redis.call('HSET', KEYS[1], 'fair_next', string.format('%d', next_gen) .. '|' .. ARGV[2])
return {'ok', ARGV[2]}
