-- One lottery draw with the "ladder" strategy: window check, one chance
-- spent, and the first prize (in the activity's order) with stock left
-- awarded, then the consolation prize when every prize is gone.
-- Prepended by lib/answer.lua and lib/lottery.lua.
--
-- KEYS and ARGV as in draw_wheel.lua (ARGV[3], the random values, is unused:
-- the ladder is deterministic).
-- Returns: {"ok", "<serial>|<prize>|<chances left>", 0}, {"dup", body, 0}, {"reused", "", 0},
--          {"refused", code, 0} for unknown_pool, not_started, ended, no_chances, sold_out

local m, reply = lottery_gate()
if not m then return reply end

local prize, finite = nil, false
for id in string.gmatch(m[4], '([^,:]+):%d+') do
  if (tonumber(redis.call('HGET', KEYS[3], id)) or 0) > 0 then prize, finite = id, true break end
end
if prize == nil and m[5] and m[5] ~= '' then prize = string.match(m[5], '^([^:]+):') end
if prize == nil then count_visit() return refuse(KEYS[5], ARGV[6], ARGV[4], 'sold_out') end

return lottery_award(prize, finite)
