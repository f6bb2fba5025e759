-- Appends one chunk of a batch behind the visible prizes, where draws cannot
-- see it until stock_commit.
--
-- KEYS[1]: pool meta hash
-- KEYS[2]: prize list `q`
-- ARGV[1]: token that must hold the lease
-- ARGV[2]: now, unix milliseconds
-- ARGV[3]: lease, milliseconds (renewed by every chunk)
-- ARGV[4..]: prize elements
-- Returns: elements pushed so far for this batch, or -1 if the lease was lost
--          (a slower attempt must never write into another's batch)

if redis.call('HGET', KEYS[1], 'stock_token') ~= ARGV[1] then return -1 end
redis.call('RPUSH', KEYS[2], unpack(ARGV, 4))
redis.call('HSET', KEYS[1], 'stock_until', tonumber(ARGV[2]) + tonumber(ARGV[3]))
local visible = tonumber(redis.call('HGET', KEYS[1], 'visible')) or 0
return redis.call('LLEN', KEYS[2]) - visible
