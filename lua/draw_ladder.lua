-- One lottery draw with the "ladder" strategy: window check, one chance
-- spent, and the first prize (in the activity's order) with stock left
-- awarded, then the consolation prize when every prize is gone.
-- Prepended by lib/answer.lua.
--
-- KEYS and ARGV as in draw_wheel.lua (ARGV[3], the random values, is unused:
-- the ladder is deterministic).
-- Returns: {"ok", "<prize>|<chances left>", 0}, {"dup", body, 0}, {"reused", "", 0},
--          {"refused", code, 0} for unknown_pool, not_started, ended, no_chances, sold_out

local seen = replay(KEYS[5], ARGV[6])
if seen then return seen end
local m = redis.call('HMGET', KEYS[1], 'kind', 'starts_at', 'ends_at', 'prizes', 'consolation')
if m[1] ~= 'lottery' then return refuse(KEYS[5], ARGV[6], ARGV[4], 'unknown_pool') end

local function count_visit()
  redis.call('INCR', KEYS[6])
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
  redis.call('PFADD', KEYS[7], ARGV[1])
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[5]))
end

local now = tonumber(ARGV[2])
if now < tonumber(m[2]) then count_visit() return refuse(KEYS[5], ARGV[6], ARGV[4], 'not_started') end
if now >= tonumber(m[3]) then count_visit() return refuse(KEYS[5], ARGV[6], ARGV[4], 'ended') end
local chances = tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0
if chances <= 0 then count_visit() return refuse(KEYS[5], ARGV[6], ARGV[4], 'no_chances') end

local prize, finite = nil, false
for id in string.gmatch(m[4], '([^,:]+):%d+') do
  if (tonumber(redis.call('HGET', KEYS[3], id)) or 0) > 0 then prize, finite = id, true break end
end
if prize == nil and m[5] and m[5] ~= '' then prize = string.match(m[5], '^([^:]+):') end
if prize == nil then count_visit() return refuse(KEYS[5], ARGV[6], ARGV[4], 'sold_out') end

count_visit()
if finite then redis.call('HINCRBY', KEYS[3], prize, -1) end
redis.call('HINCRBY', KEYS[4], prize, 1)
local left = redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
local body = prize .. '|' .. int(left)
remember(KEYS[5], ARGV[6], body, ARGV[4])
return {'ok', body, 0}
