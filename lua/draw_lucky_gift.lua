-- Draws `count` prizes from a lucky-gift pool in list storage, all or nothing.
-- Prepended by lib/answer.lua.
--
-- KEYS[1]: pool meta hash (kind, visible, unit_price, jackpot_*, max_count, drawn, version, asset)
-- KEYS[2]: prize list `q`; the first `visible` elements are drawable, the tail
--          behind them is a batch being stocked and must not be touched
-- KEYS[3]: `held` list: gated jackpots waiting, first in line
-- KEYS[4]: today's consumption counter (sum of count * unit_price, saturating)
-- KEYS[5]: result key of this request (idempotency)
-- ARGV[1]: count
-- ARGV[2]: result TTL in seconds
-- ARGV[3]: consumption counter TTL in seconds
-- ARGV[4]: fingerprint of the request
-- Returns: always three elements {status, text, number}:
--          {"dup", body, 0}           the request was answered before; its first answer
--          {"reused", "", 0}          the request id was first used for another request
--          {"ok", body, 0}            body = "<serial>|<version>|<unit_price>|<trigger>|<code>,<code>,.../<runs>/<parked>/<reveals>|<asset>"
--                                     runs, parked, reveals: the fairness record (lib/jackpot.lua, fair_record)
--                                     serial = the pool's `drawn` counter after this draw:
--                                     it names this draw for ever (the ledger entry id)
--                                     trigger = -1, or the batch whose refill flag was taken
--          {"refused", code, 0}       a remembered refusal (unknown_pool)
--          {"short", in_pool, gen}    fewer than `count` drawable prizes; no prize moved
--                                     (batch `gen` is now due for a refill)
--          {"too_many", max_count, 0} count above the pool's max_count; nothing changed
--
-- Prizes are small-integer codes. The one prize flagged as a batch's refill
-- point is stored as "<code>f<batch>". Everything is checked before the
-- first write, so a step either completes or changes nothing.

local seen = replay_award(KEYS[1], KEYS[5], ARGV[4])
if seen then return seen end

local m = redis.call('HMGET', KEYS[1], 'kind', 'visible', 'unit_price',
  'jackpot_threshold', 'jackpot_codes', 'max_count', 'gen', 'version', 'asset', 'storage', 'due',
  'qhead', 'hgen')
if m[1] ~= 'lucky_gift' or m[10] == 'sparse' then return refuse(KEYS[5], ARGV[4], ARGV[2], 'unknown_pool') end
local count = tonumber(ARGV[1])
local max_count = tonumber(m[6])
if max_count and count > max_count then return {'too_many', int(max_count), 0} end

local visible = tonumber(m[2]) or 0
local unit_price = tonumber(m[3])
local held_len = redis.call('LLEN', KEYS[3])
-- No jackpot rule, or today's consumption (this draw included) reached it.
local spent, open = gate(KEYS[4], count, unit_price, m[4])
local gen = tonumber(m[7]) or 0
-- A short answer changes no prize. It makes the current batch due for its
-- successor, like a taken refill flag: the draw's urgent refill request
-- will be honoured, a forged one (no short draw, no flag) will not.
local function short(in_pool)
  if gen > (tonumber(m[11]) or -1) then redis.call('HSET', KEYS[1], 'due', int(gen)) end
  return {'short', int(in_pool), gen}
end

local jackpot = jackpot_set(m[5])

local codes = {}
local trigger = -1
-- Where each prize came from (positions count the pops of `q`).
local qhead = tonumber(m[12]) or 0
local hgen0 = tonumber(m[13]) or 0
local track = positions(KEYS[1], hgen0)
local origins = {}
local parked = {}

-- Decodes one element; remembers the refill flag it may carry.
local function take(v)
  local code = tonumber(v)
  if code == nil then
    local c, g = string.match(v, '^(%d+)f(%d+)$')
    code = tonumber(c)
    local flagged = tonumber(g)
    if flagged > trigger then trigger = flagged end
  end
  return code
end

local from_q = 0
if open then
  if held_len + visible < count then return short(held_len + visible) end
  -- Waiting jackpots are first in line.
  local from_held = math.min(count, held_len)
  take_held(KEYS[3], from_held, codes, origins)
  local rest = count - from_held
  if rest > 0 then
    for k, v in ipairs(redis.call('LPOP', KEYS[2], rest)) do
      codes[#codes + 1] = take(v)
      origins[#origins + 1] = track.at(qhead + k - 1)
    end
    from_q = rest
  end
else
  -- Gated: jackpots met on the way move to `held` (they stay first in line)
  -- and the next prize takes their place. Only the prizes popped here are
  -- touched, so a draw costs O(count) however many jackpots wait; a long
  -- run of jackpots costs its length, in chunks.
  -- Parked prizes a reload freed from the rule come first.
  local freed = freed_at_head(KEYS[3], count, jackpot)
  if visible + freed < count then return short(held_len + visible) end
  local popped = {}
  local popped_at = {}
  local held_now = {}
  local need = count - freed
  while need > 0 and from_q < visible do
    local n = math.min(need, visible - from_q)
    local batch = redis.call('LPOP', KEYS[2], n)
    from_q = from_q + n
    for _, v in ipairs(batch) do
      popped[#popped + 1] = v
      local at = track.at(qhead + #popped - 1)
      popped_at[#popped] = at
      local code = tonumber(v) or tonumber(string.match(v, '^(%d+)f'))
      if jackpot[code] then
        held_now[#held_now + 1] = held_element(code, at)
        parked[#parked + 1] = at
      else
        need = need - 1
      end
    end
  end
  if need > 0 then
    -- Not enough winnable prizes: put everything back where it was.
    local back = {}
    for i = #popped, 1, -1 do back[#back + 1] = popped[i] end
    push_all('LPUSH', KEYS[2], back)
    return short(held_len + visible - #held_now)
  end
  take_held(KEYS[3], freed, codes, origins)
  for k, v in ipairs(popped) do
    local code = take(v)
    if not jackpot[code] then
      codes[#codes + 1] = code
      origins[#origins + 1] = popped_at[k]
    end
  end
  push_all('RPUSH', KEYS[3], held_now)
end

-- (Lua 5.1 prints -0 as "-0", which Redis refuses: skip a zero move.)
if from_q > 0 then
  redis.call('HINCRBY', KEYS[1], 'visible', -from_q)
  redis.call('HSET', KEYS[1], 'qhead', int(qhead + from_q))
end
local record = fair_record(KEYS[1], track, hgen0, origins, parked, qhead + from_q)
local serial = redis.call('HINCRBY', KEYS[1], 'drawn', count)
-- The batch whose refill point this draw took is due for its successor:
-- a refill request for any later batch is refused.
if trigger > (tonumber(m[11]) or -1) then redis.call('HSET', KEYS[1], 'due', int(trigger)) end
redis.call('SET', KEYS[4], int(spent), 'EX', tonumber(ARGV[3]))
local body = int(serial) .. '|' .. (m[8] or '0') .. '|' .. int(unit_price) .. '|' .. int(trigger) .. '|'
  .. table.concat(codes, ',') .. record .. '|' .. (m[9] or 'coin')
-- The fairness record travels inside the codes field of the stored form.
remember(KEYS[5], ARGV[4], award_stored(KEYS[1], serial, m[8] or '0', unit_price, trigger,
  table.concat(codes, ',') .. record, m[9] or 'coin'), ARGV[2])
return {'ok', body, 0}
