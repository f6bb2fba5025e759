-- After a reload, puts the parked prizes that are no jackpot under the
-- pool's current rule at the head of `held`, ahead of the jackpots still
-- gated, each group in its order. Prepended by lib/answer.lua and
-- lib/jackpot.lua.
--
-- KEYS[1]: pool meta hash (jackpot_codes)
-- KEYS[2]: `held` list
-- Returns: the number of freed prizes now at the head of `held`.
--
-- The list is rewritten in one step, so a draw sees it before or after,
-- never half done; prizes only change places in `held`, so conservation
-- (stocked = drawn + in pool) holds throughout. The step costs the length
-- of `held`, once per reload; the draws stay O(count).

local jackpot = jackpot_set(redis.call('HGET', KEYS[1], 'jackpot_codes'))
local n = redis.call('LLEN', KEYS[2])
local freed, gated = {}, {}
-- Whether a freed prize sits behind a gated one (else nothing moves).
local behind = false
for i = 0, n - 1, 1000 do
  for _, v in ipairs(redis.call('LRANGE', KEYS[2], i, i + 999)) do
    if jackpot[held_code(v)] then
      gated[#gated + 1] = v
    else
      freed[#freed + 1] = v
      if #gated > 0 then behind = true end
    end
  end
end
if not behind then return #freed end
redis.call('DEL', KEYS[2])
push_all('RPUSH', KEYS[2], freed)
push_all('RPUSH', KEYS[2], gated)
return #freed
