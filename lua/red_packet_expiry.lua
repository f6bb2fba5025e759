-- Keeps one pending expiry message per red packet. Each expiry message
-- carries a token; the packet's meta hash names the one that is pending
-- (`expiry`). A create that sends an expiry message makes it the pending
-- one (a create sent again replaces the one before, which is then dropped
-- when it comes); an early expiry message is delayed again only if it is
-- the pending one, so forged or stale messages are answered and dropped
-- instead of multiplying.
--
-- KEYS[1]: packet meta hash
-- ARGV[1]: "arm" (a create is sending a new expiry message) or "check" (an
--          expiry message came before the packet's expiry)
-- ARGV[2]: the token of that message ("" for a message without one)
-- ARGV[3]: check: a fresh token for a message without one that takes over
-- Returns: {"pending", token}  arm: the new message is the pending one;
--                              check: the message is the pending one (a
--                              packet with none pending, from before tokens
--                              or whose token was lost, takes the first
--                              message that comes: its token, or ARGV[3])
--          {"stale", ""}       check: another message is the pending one
--          {"closed", ""}      the packet is closed
--          {"unknown", ""}     Redis holds no such packet

local m = redis.call('HMGET', KEYS[1], 'kind', 'closed', 'expiry')
if m[1] ~= 'red_packet' then return {'unknown', ''} end
if m[2] == '1' then return {'closed', ''} end
if ARGV[1] == 'arm' then
  redis.call('HSET', KEYS[1], 'expiry', ARGV[2])
  return {'pending', ARGV[2]}
end
if m[3] then
  if m[3] == ARGV[2] then return {'pending', ARGV[2]} end
  return {'stale', ''}
end
local token = ARGV[2]
if token == '' then token = ARGV[3] end
redis.call('HSET', KEYS[1], 'expiry', token)
return {'pending', token}
