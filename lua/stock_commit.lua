-- Makes a fully pushed batch visible to draws, all at once, in O(1).
--
-- KEYS[1]: pool meta hash
-- KEYS[2]: prize list `q`
-- ARGV[1]: token that must hold the lease
-- ARGV[2]: trigger the batch answers
-- ARGV[3]: batch size
-- Returns: {"ok", gen}            the new batch number
--          {"lost", 0}             the lease was taken over; nothing changed
--          {"mismatch", pushed}   the hidden tail is not exactly one batch

local m = redis.call('HMGET', KEYS[1], 'stock_token', 'gen', 'visible')
if m[1] ~= ARGV[1] or (tonumber(m[2]) or 0) ~= tonumber(ARGV[2]) then return {'lost', 0} end
local size = tonumber(ARGV[3])
local pushed = redis.call('LLEN', KEYS[2]) - (tonumber(m[3]) or 0)
if pushed ~= size then return {'mismatch', pushed} end
redis.call('HINCRBY', KEYS[1], 'visible', size)
redis.call('HINCRBY', KEYS[1], 'stocked', size)
local gen = redis.call('HINCRBY', KEYS[1], 'gen', 1)
redis.call('HDEL', KEYS[1], 'stock_token', 'stock_until')
return {'ok', gen}
