-- Closes a red packet: removes the remaining shares and records their sum as
-- refunded, in one step. Closing twice changes nothing.
--
-- KEYS[1]: packet meta hash
-- KEYS[2]: shares list
-- Returns: {"closed", refunded, shares removed}
--          {"already", refunded, 0}  closed before (refund figure of that close)
--          {"unknown", 0, 0}

local m = redis.call('HMGET', KEYS[1], 'kind', 'closed', 'refunded')
if m[1] ~= 'red_packet' then return {'unknown', 0, 0} end
if m[2] == '1' then return {'already', tonumber(m[3]) or 0, 0} end
local left = redis.call('LRANGE', KEYS[2], 0, -1)
local sum = 0
for _, share in ipairs(left) do sum = sum + tonumber(string.match(share, ':(%d+)$')) end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'closed', 1, 'refunded', sum)
return {'closed', sum, #left}
