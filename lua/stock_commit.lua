-- Makes a fully pushed batch visible to draws, all at once, in O(1).
--
-- KEYS[1]: pool meta hash
-- KEYS[2]: prize list `q`
-- ARGV[1]: token that must hold the lease
-- ARGV[2]: trigger the batch answers
-- ARGV[3]: batch size
-- ARGV[4]: the batch's seed, 64 hex digits (must be the one `fair_seed` chose)
-- ARGV[5]: the config version the batch was shuffled under
-- Returns: {"ok", gen}            the new batch number
--          {"lost", 0}             the lease was taken over; nothing changed
--          {"mismatch", pushed}   the hidden tail is not exactly one batch

local m = redis.call('HMGET', KEYS[1], 'stock_token', 'gen', 'visible', 'fair_next', 'qhead')
if m[1] ~= ARGV[1] or (tonumber(m[2]) or 0) ~= tonumber(ARGV[2]) then return {'lost', 0} end
local next_gen = string.format('%d', (tonumber(m[2]) or 0) + 1)
if m[4] ~= next_gen .. '|' .. ARGV[4] then return {'lost', 0} end
local size = tonumber(ARGV[3])
local pushed = redis.call('LLEN', KEYS[2]) - (tonumber(m[3]) or 0)
if pushed ~= size then return {'mismatch', pushed} end
-- The fairness record (lib/jackpot.lua): where the batch starts in the
-- running count of pops, and its seed until the reveal. A pool stocked
-- before batches were committed starts counting batches here.
redis.call('HSET', KEYS[1], 'bstart:' .. next_gen,
  string.format('%d', (tonumber(m[5]) or 0) + (tonumber(m[3]) or 0)),
  'c:' .. next_gen, ARGV[5] .. '|' .. ARGV[4])
redis.call('HSETNX', KEYS[1], 'hgen', string.format('%d', tonumber(m[2]) or 0))
redis.call('HDEL', KEYS[1], 'fair_next')
redis.call('HINCRBY', KEYS[1], 'visible', size)
redis.call('HINCRBY', KEYS[1], 'stocked', size)
local gen = redis.call('HINCRBY', KEYS[1], 'gen', 1)
redis.call('HDEL', KEYS[1], 'stock_token', 'stock_until')
return {'ok', gen}
