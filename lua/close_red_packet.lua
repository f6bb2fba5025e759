-- Closes a red packet at or after its own stored expiry: removes the
-- remaining shares and records their sum as refunded, in one step, then lets
-- the packet's keys expire after the retention period. Closing twice changes
-- nothing. The caller's idea of the expiry plays no part: only `expires_at`
-- in the meta hash decides.
-- Prepended by lib/answer.lua (for the expiry of the answer store's buckets).
--
-- KEYS[1]: packet meta hash
-- KEYS[2]: shares list
-- KEYS[3]: grabbed hash
-- ARGV[1]: now, unix milliseconds
-- ARGV[2]: retention of a closed packet's keys, seconds
-- Returns: {"closed", refunded, shares removed}
--          {"already", refunded, 0}  closed before (refund figure of that close)
--          {"early", expires_at, 0}  not due yet (unix milliseconds)
--          {"unknown", 0, 0}

local m = redis.call('HMGET', KEYS[1], 'kind', 'closed', 'refunded', 'expires_at')
if m[1] ~= 'red_packet' then return {'unknown', 0, 0} end
if m[2] == '1' then return {'already', tonumber(m[3]) or 0, 0} end
local expires_at = tonumber(m[4])
if not expires_at or tonumber(ARGV[1]) < expires_at then return {'early', expires_at or 0, 0} end
local left = redis.call('LRANGE', KEYS[2], 0, -1)
-- Shares are at most 10^12 in total, so this float sum is exact.
local sum = 0
for _, share in ipairs(left) do sum = sum + tonumber(string.match(share, ':(%d+)$')) end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[1], 'closed', 1, 'refunded', sum)
local retention = tonumber(ARGV[2])
-- The meta hash also keeps the epochs of the packet's answer store
-- (`ep`, lib/answer.lua, and the earlier layout's `r.e`): it stays until
-- their buckets are gone.
local until_s = math.floor(tonumber(ARGV[1]) / 1000) + retention
local ep, old = unpack(redis.call('HMGET', KEYS[1], 'ep', 'r.e'))
if ep then
  local v = {struct.unpack(ep_format(#ep), ep)}
  for i = 1, math.floor(#ep / 16) do
    until_s = math.max(until_s, expiry_of(v[4 * i - 3], v[4 * i - 2]))
  end
end
for t, l in string.gmatch(old or '', '(%d+):(%d+):%d+') do
  until_s = math.max(until_s, tonumber(t) + 5 * tonumber(l) + SKEW)
end
redis.call('EXPIREAT', KEYS[1], until_s)
redis.call('EXPIRE', KEYS[3], retention)
return {'closed', sum, #left}
