-- Prelude of the lucky-gift draw scripts, after lib/answer.lua: the jackpot
-- rule, written once for both storages (prepended by scripts.rs).
--
-- A prize is a jackpot when its code is in the pool's `jackpot_codes` (the
-- codes whose multiplier reaches the rule's minimum). While the day's
-- consumption is below the rule's threshold the gate is closed: a jackpot a
-- draw meets is parked at the tail of `held`, and the next prize takes its
-- place. Once the gate opens, the prizes in `held` are first in line.
--
-- A reload may change which codes are jackpots. `regate_held.lua` then
-- moves the parked prizes that are no jackpot any more to the head of
-- `held` ("freed"), and a gated draw takes freed prizes before any other:
-- the new rule holds for every prize at once, parked ones included.

-- The set of jackpot codes from meta's `jackpot_codes` ("3,17,...").
local function jackpot_set(field)
  local set = {}
  if field and field ~= '' then
    for c in string.gmatch(field, '%d+') do set[tonumber(c)] = true end
  end
  return set
end

-- Today's consumption with this draw's (capped, so it stays exact) and
-- whether it opens the gate; an empty threshold means no rule.
local function gate(spent_key, count, unit_price, threshold_field)
  local spent = math.min((tonumber(redis.call('GET', spent_key)) or 0) + count * unit_price, SPENT_CAP)
  local threshold = tonumber(threshold_field)
  return spent, (threshold == nil) or (spent >= threshold)
end

-- How many of the first `count` prizes in `held` are freed (no jackpot
-- under the current rule). Read only; O(1) when the head is a jackpot,
-- O(count) at most.
local function freed_at_head(held_key, count, jackpot)
  if count <= 0 then return 0 end
  local first = redis.call('LINDEX', held_key, 0)
  if not first or jackpot[tonumber(first)] then return 0 end
  local n = 0
  for _, v in ipairs(redis.call('LRANGE', held_key, 0, count - 1)) do
    if jackpot[tonumber(v)] then break end
    n = n + 1
  end
  return n
end

-- Pops `n` prizes from the head of `held`, appending their codes to `codes`.
local function take_held(held_key, n, codes)
  if n > 0 then
    for _, v in ipairs(redis.call('LPOP', held_key, n)) do codes[#codes + 1] = tonumber(v) end
  end
end
