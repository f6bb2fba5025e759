-- A consistent snapshot of a red packet.
--
-- KEYS[1]: packet meta hash
-- KEYS[2]: shares list
-- Returns: {kind or false, total, grabbed, grabbed_count, refunded, closed, shares...}

local m = redis.call('HMGET', KEYS[1], 'kind', 'total', 'grabbed', 'grabbed_count', 'refunded', 'closed')
local out = {m[1] or false, tonumber(m[2]) or 0, tonumber(m[3]) or 0, tonumber(m[4]) or 0,
  tonumber(m[5]) or 0, m[6] or '0'}
for _, s in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do out[#out + 1] = s end
return out
