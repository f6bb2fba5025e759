-- One lottery draw with the "wheel" strategy: window check, one chance
-- spent, a weighted pick among prizes with stock left plus the unlimited
-- consolation prize, and the stock taken, all in one step.
-- Prepended by lib/answer.lua and lib/lottery.lua.
--
-- KEYS[1]: activity meta hash
-- KEYS[2]: chances hash
-- KEYS[3]: stock hash
-- KEYS[4]: awarded hash
-- KEYS[5]: result key of this request (idempotency)
-- KEYS[6]: today's PV counter
-- KEYS[7]: today's UV HyperLogLog
-- KEYS[8]: seeds hash (lottery_seed.lua; the committed seed a draw uses is
--          its copy in meta, `seed:<period>`)
-- ARGV[1]: user id
-- ARGV[2]: now, unix ms
-- ARGV[3]: the draw's values, integers in [0, 2^52), comma-separated: values
--          k .. k+3 derived from the period's seed (docs/fairness.md, Lotteries)
-- ARGV[4]: result TTL, seconds
-- ARGV[5]: PV/UV TTL, seconds
-- ARGV[6]: the request's answer token (lib/answer.lua)
-- ARGV[7]: the start of the seed period of ARGV[2] (unix seconds), whose
--          seed the values came from
-- ARGV[8]: that seed's commitment (64 hex digits)
-- Returns: {status, text, 0}:
--          {"ok", "<serial>~<value>;<prize>:<weight>,...;<period>|<prize>|<chances left>", 0}
--          (the value used, the weights it was read against, the period),
--          {"short", "0", <period>} when the period's seed is not committed
--          (or is another one): nothing changed; commit it and call again,
--          {"dup", body, 0}, {"reused", "", 0},
--          {"refused", code, 0} for unknown_pool, not_started, ended, no_chances, sold_out,
--          {"retry", "", 0} when every random value fell in the rejected tail
--          (nothing changed; call again with fresh values)
--
-- The pick is exactly uniform over the total weight: a value r is used only
-- below the largest multiple of the total that fits in 2^52 (rejection
-- sampling), so `r % total` has no modulo bias. Weights are bounded at load
-- (total below 2^40), so a value is rejected with probability below 2^-12.

local m, chances = lottery_gate()
if not m then return chances end

-- Candidates: prizes with stock left (a sold-out prize's weight drops out),
-- then the consolation prize. One pass, no retries.
local c = counts_parse(m[9])
local ids, weights, total = {}, {}, 0
for id, w in string.gmatch(m[4], '([^,:]+):(%d+)') do
  if (c.left[id] or 0) > 0 then
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
-- Every prize is gone and there is no consolation: no chance is spent.
if total == 0 then return lottery_refuse(m, 'sold_out') end

-- The values must come from the committed seed of the period `now` is in:
-- a seed whose commitment is not on record is never used.
-- Both were read with the activity (lottery_gate): no command of their own.
local len = tonumber(m[LOTTERY_PERIOD_AT]) or 86400
local now_s = math.floor(tonumber(ARGV[2]) / 1000)
local period = now_s - now_s % len
local committed = m[LOTTERY_SEED_AT]
if tonumber(ARGV[7]) ~= period or not committed or string.sub(committed, 1, 64) ~= ARGV[8] then
  return {'short', '0', period}
end

local SPAN = 4503599627370496 -- 2^52
local limit = SPAN - (SPAN % total)
local r, value = nil, nil
for v in string.gmatch(ARGV[3], '%d+') do
  local x = tonumber(v)
  if x < limit then r, value = x % total, x break end
end
if r == nil then return {'retry', '', 0} end
local candidates = {}
for i = 1, #ids do candidates[i] = ids[i] .. ':' .. int(weights[i]) end
local pick = #ids
for i = 1, #ids do
  if r < weights[i] then pick = i break end
  r = r - weights[i]
end
return lottery_award(m, chances, c, ids[pick], pick <= finite,
  int(value) .. ';' .. table.concat(candidates, ',') .. ';' .. int(period))
