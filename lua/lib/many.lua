-- The driver of a coalesced draw script (appended by scripts.rs after the
-- script's body, which is wrapped as `local function step(ARGV)`): applies
-- several draws of one pool in one call, in order, each exactly as its own
-- call would (each reads the state the one before left, and each is all or
-- nothing), so Redis pays one call for many draws.
--
-- ARGV[1]: how many arguments each draw takes (n); then n arguments per
--          draw, in the order the draws are applied, each group laid out as
--          the script's header says for ARGV
-- Returns: the three elements of each draw's reply, one draw after another.

local per = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, per do
  local reply = step({unpack(ARGV, i, i + per - 1)})
  out[#out + 1] = reply[1]
  out[#out + 1] = reply[2]
  out[#out + 1] = reply[3]
end
return out
