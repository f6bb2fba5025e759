-- Grabs one share of a red packet for a user, at most one per user.
-- Prepended by lib/answer.lua.
--
-- KEYS[1]: packet meta hash; `g:<user id>` = "<share>:<amount>", the share
--          each user holds, when its `grabs` is "meta"
-- KEYS[2]: shares list
-- KEYS[3]: grabbed hash (user id -> "<share>:<amount>") of a packet stocked
--          before shares were kept in meta
-- KEYS[4]: result key of this request (idempotency)
-- ARGV[1]: user id
-- ARGV[2]: now, unix milliseconds
-- ARGV[3]: result TTL in seconds
-- ARGV[4]: the request's answer token (lib/answer.lua)
-- Returns: {status, text, 0}:
--          {"ok", "<share>:<amount>:<asset>", 0}  a share, now
--          {"dup", body, 0}                       the request's first answer
--          {"reused", "", 0}                      the id was first used for another request
--          {"refused", code, 0}                   pool_closed (expired or closed), sold_out,
--                                                 unknown_pool, already_grabbed:<share>:<amount>

local m = redis.call('HMGET', KEYS[1], 'kind', 'closed', 'expires_at', 'asset', 'grabbed',
  'grabbed_count', 'grabs', 'g:' .. ARGV[1], unpack(STORE_FIELDS))
local seen = replay(KEYS[4], ARGV[4], m, 9)
if seen then return seen end
if m[1] ~= 'red_packet' then return refuse_unknown(KEYS[4], ARGV[4], ARGV[3], m[1]) end
-- The deadline is checked here, not only by the expiry job, so nobody grabs
-- after expires_at even if the job runs late.
if m[2] == '1' or tonumber(ARGV[2]) >= tonumber(m[3]) then
  return refuse(KEYS[4], ARGV[4], ARGV[3], 'pool_closed')
end
local fields = {'grabbed', '', 'grabbed_count', int((tonumber(m[6]) or 0) + 1)}
local share
if m[7] == 'meta' then
  -- The user's share is meta's `g:<user>`, read with the packet and written
  -- with its totals.
  if m[8] then return refuse(KEYS[4], ARGV[4], ARGV[3], 'already_grabbed:' .. m[8]) end
  share = redis.call('LPOP', KEYS[2])
  if not share then return refuse(KEYS[4], ARGV[4], ARGV[3], 'sold_out') end
  fields[5] = 'g:' .. ARGV[1]
  fields[6] = share
else
  -- A packet stocked before: the user's share is in the grabbed hash. A
  -- share is taken, then bound to the user unless the user holds one (then
  -- it goes back where it was).
  share = redis.call('LPOP', KEYS[2])
  if not share then
    local mine = redis.call('HGET', KEYS[3], ARGV[1])
    if mine then return refuse(KEYS[4], ARGV[4], ARGV[3], 'already_grabbed:' .. mine) end
    return refuse(KEYS[4], ARGV[4], ARGV[3], 'sold_out')
  end
  if redis.call('HSETNX', KEYS[3], ARGV[1], share) == 0 then
    redis.call('LPUSH', KEYS[2], share)
    return refuse(KEYS[4], ARGV[4], ARGV[3], 'already_grabbed:' .. redis.call('HGET', KEYS[3], ARGV[1]))
  end
end
local amount = tonumber(string.match(share, ':(%d+)$'))
fields[2] = int((tonumber(m[5]) or 0) + amount)
redis.call('HSET', KEYS[1], unpack(fields))
local body = share .. ':' .. (m[4] or 'coin')
remember(KEYS[4], ARGV[4], body, ARGV[3])
return {'ok', body, 0}
