-- Grabs one share of a red packet for a user, at most one per user.
--
-- KEYS[1]: packet meta hash
-- KEYS[2]: shares list
-- KEYS[3]: grabbed hash (user id -> "<share>:<amount>")
-- KEYS[4]: result key of this request (idempotency)
-- ARGV[1]: user id
-- ARGV[2]: now, unix milliseconds
-- ARGV[3]: result TTL in seconds
-- Returns: {status, "<share>:<amount>" or "", asset}, status one of
--          ok, dup (the request's first result), already (the user's share),
--          closed (expired or closed), sold_out, unknown (no such packet)

local prev = redis.call('GET', KEYS[4])
local m = redis.call('HMGET', KEYS[1], 'kind', 'closed', 'expires_at', 'asset')
local asset = m[4] or 'coin'
if prev then return {'dup', prev, asset} end
if m[1] ~= 'red_packet' then return {'unknown', '', asset} end
-- The deadline is checked here, not only by the expiry job, so nobody grabs
-- after expires_at even if the job runs late.
if m[2] == '1' or tonumber(ARGV[2]) >= tonumber(m[3]) then return {'closed', '', asset} end
local mine = redis.call('HGET', KEYS[3], ARGV[1])
if mine then return {'already', mine, asset} end
local share = redis.call('LPOP', KEYS[2])
if not share then return {'sold_out', '', asset} end
local amount = tonumber(string.match(share, ':(%d+)$'))
redis.call('HSET', KEYS[3], ARGV[1], share)
redis.call('HINCRBY', KEYS[1], 'grabbed', amount)
redis.call('HINCRBY', KEYS[1], 'grabbed_count', 1)
redis.call('SET', KEYS[4], share, 'EX', tonumber(ARGV[3]))
return {'ok', share, asset}
