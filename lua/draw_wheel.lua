-- One lottery draw with the "wheel" strategy: window check, one chance
-- spent, a weighted pick among prizes with stock left plus the unlimited
-- consolation prize, and the stock taken, all in one step.
--
-- KEYS[1]: activity meta hash
-- KEYS[2]: chances hash
-- KEYS[3]: stock hash
-- KEYS[4]: awarded hash
-- KEYS[5]: result key of this request (idempotency)
-- KEYS[6]: today's PV counter
-- KEYS[7]: today's UV HyperLogLog
-- ARGV[1]: user id
-- ARGV[2]: now, unix ms
-- ARGV[3]: a random integer in [0, 2^31) from the caller
-- ARGV[4]: result TTL, seconds
-- ARGV[5]: PV/UV TTL, seconds
-- Returns: {status, "<prize>|<chances left>" or ""}, status one of
--          ok, dup, not_started, ended, no_chances, unknown

local prev = redis.call('GET', KEYS[5])
if prev then return {'dup', prev} end
local m = redis.call('HMGET', KEYS[1], 'kind', 'starts_at', 'ends_at', 'prizes', 'consolation')
if m[1] ~= 'lottery' then return {'unknown', ''} end

redis.call('INCR', KEYS[6])
redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
redis.call('PFADD', KEYS[7], ARGV[1])
redis.call('EXPIRE', KEYS[7], tonumber(ARGV[5]))

local now = tonumber(ARGV[2])
if now < tonumber(m[2]) then return {'not_started', ''} end
if now >= tonumber(m[3]) then return {'ended', ''} end
local chances = tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0
if chances <= 0 then return {'no_chances', ''} end

-- Candidates: prizes with stock left (a sold-out prize's weight drops out),
-- then the consolation prize. One pass, no retries.
local ids, weights, total = {}, {}, 0
for id, w in string.gmatch(m[4], '([^,:]+):(%d+)') do
  local left = tonumber(redis.call('HGET', KEYS[3], id)) or 0
  if left > 0 then
    ids[#ids + 1] = id
    weights[#weights + 1] = tonumber(w)
    total = total + tonumber(w)
  end
end
local finite = #ids
if m[5] and m[5] ~= '' then
  local id, w = string.match(m[5], '^([^:]+):(%d+)$')
  ids[#ids + 1] = id
  weights[#weights + 1] = tonumber(w)
  total = total + tonumber(w)
end
if total == 0 then return {'sold_out', ''} end
local r = tonumber(ARGV[3]) % total
local pick = #ids
for i = 1, #ids do
  if r < weights[i] then pick = i break end
  r = r - weights[i]
end
local prize = ids[pick]
if pick <= finite then redis.call('HINCRBY', KEYS[3], prize, -1) end
redis.call('HINCRBY', KEYS[4], prize, 1)
local left = redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
local payload = prize .. '|' .. left
redis.call('SET', KEYS[5], payload, 'EX', tonumber(ARGV[4]))
return {'ok', payload}
