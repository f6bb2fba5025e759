-- Removes up to ARGV[2] elements of a dead stocking attempt from the tail.
--
-- KEYS[1]: pool meta hash
-- KEYS[2]: prize list `q`
-- ARGV[1]: token that must hold the lease
-- ARGV[2]: most elements to remove in this step (bounds the time Redis is busy)
-- Returns: elements still to trim, or -1 if the lease was lost

if redis.call('HGET', KEYS[1], 'stock_token') ~= ARGV[1] then return -1 end
local visible = tonumber(redis.call('HGET', KEYS[1], 'visible')) or 0
local extra = redis.call('LLEN', KEYS[2]) - visible
local n = math.min(extra, tonumber(ARGV[2]))
if n > 0 then redis.call('RPOP', KEYS[2], n) end
return extra - n
