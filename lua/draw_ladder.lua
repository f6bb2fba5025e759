-- One lottery draw with the "ladder" strategy: window check, one chance
-- spent, and the first prize (in the activity's order) with stock left
-- awarded, then the consolation prize when every prize is gone.
-- Prepended by lib/answer.lua and lib/lottery.lua.
--
-- KEYS and ARGV as in draw_wheel.lua (ARGV[3], ARGV[7], ARGV[8] and KEYS[8],
-- the values and the seed they came from, are unused: the ladder is
-- deterministic).
-- Returns: {"ok", "<serial>|<prize>|<chances left>", 0}, {"dup", body, 0}, {"reused", "", 0},
--          {"refused", code, 0} for unknown_pool, not_started, ended, no_chances, sold_out

local m, chances = lottery_gate()
if not m then return chances end

local c = counts_parse(m[9])
local prize = nil
for id in string.gmatch(m[4], '([^,:]+):%d+') do
  if (c.left[id] or 0) > 0 then prize = id break end
end
if prize then return lottery_award(m, chances, c, prize, true) end
if m[5] and m[5] ~= '' then return lottery_award(m, chances, c, string.match(m[5], '^([^:]+):'), false) end
return lottery_refuse(m, 'sold_out')
