-- Stocks a red packet's shares once; a repeated call changes nothing.
--
-- KEYS[1]: packet meta hash
-- KEYS[2]: shares list ("<share number>:<amount>" elements)
-- ARGV[1]: sender account
-- ARGV[2]: total (escrowed), at most 10^12
-- ARGV[3]: expires_at, unix milliseconds
-- ARGV[4]: asset
-- ARGV[5..]: share elements, at most 5,000 (inside `unpack`'s limit)
-- Meta's `grabs` = "meta" says the packet keeps each user's share in its
-- meta hash (grab_red_packet.lua).
-- Returns: {"stocked", n} or {"exists", 0}; {"kind", 0} if the id names another kind

local kind = redis.call('HGET', KEYS[1], 'kind')
if kind == 'red_packet' then return {'exists', 0} end
if kind then return {'kind', 0} end
-- A meta hash made by a remembered refusal (lib/answer.lua) is the packet's now.
redis.call('PERSIST', KEYS[1])
redis.call('HSET', KEYS[1], 'kind', 'red_packet', 'sender', ARGV[1], 'total', ARGV[2],
  'expires_at', ARGV[3], 'asset', ARGV[4], 'grabbed', 0, 'grabbed_count', 0,
  'refunded', 0, 'closed', 0, 'grabs', 'meta')
redis.call('RPUSH', KEYS[2], unpack(ARGV, 5))
return {'stocked', #ARGV - 4}
