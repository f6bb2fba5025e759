-- Draws `count` prizes from a lucky-gift pool in list storage, all or nothing.
--
-- KEYS[1]: pool meta hash (kind, visible, unit_price, jackpot_*, max_count, drawn)
-- KEYS[2]: prize list `q`; the first `visible` elements are drawable, the tail
--          behind them is a batch being stocked and must not be touched
-- KEYS[3]: `held` list: gated jackpots waiting, first in line
-- KEYS[4]: today's consumption counter (sum of count * unit_price)
-- KEYS[5]: result key of this request (idempotency)
-- ARGV[1]: count
-- ARGV[2]: result TTL in seconds
-- ARGV[3]: consumption counter TTL in seconds
-- Returns: always three elements {status, text, number}:
--          {"dup", payload, 0}        the request was drawn before; its first result
--          {"ok", payload, 0}         payload = "<trigger>|<unit_price>|<spent>|<code>,<code>,..."
--                                     trigger = -1, or the batch whose refill flag was taken
--          {"short", in_pool, gen}    fewer than `count` drawable prizes; nothing changed
--          {"too_many", max_count, 0} count above the pool's max_count
--          {"unknown", "", 0}         no lucky-gift pool under these keys
--
-- Prizes are small-integer codes. The one prize flagged as a batch's refill
-- point is stored as "<code>f<batch>".

local prev = redis.call('GET', KEYS[5])
if prev then return {'dup', prev, 0} end

local m = redis.call('HMGET', KEYS[1], 'kind', 'visible', 'unit_price',
  'jackpot_threshold', 'jackpot_codes', 'max_count', 'gen')
if m[1] ~= 'lucky_gift' then return {'unknown', '', 0} end
local count = tonumber(ARGV[1])
local max_count = tonumber(m[6])
if max_count and count > max_count then return {'too_many', tostring(max_count), 0} end

local visible = tonumber(m[2]) or 0
local unit_price = tonumber(m[3])
local held_len = redis.call('LLEN', KEYS[3])
local spent = (tonumber(redis.call('GET', KEYS[4])) or 0) + count * unit_price
local threshold = tonumber(m[4])
-- No jackpot rule, or today's consumption (this draw included) reached it.
local open = (threshold == nil) or (spent >= threshold)

local jackpot = {}
if m[5] and m[5] ~= '' then
  for c in string.gmatch(m[5], '%d+') do jackpot[tonumber(c)] = true end
end

local codes = {}
local trigger = -1

-- Decodes one element; remembers the refill flag it may carry.
local function take(v)
  local code = tonumber(v)
  if code == nil then
    local c, g = string.match(v, '^(%d+)f(%d+)$')
    code = tonumber(c)
    local gen = tonumber(g)
    if gen > trigger then trigger = gen end
  end
  return code
end

local from_q = 0
if open then
  if held_len + visible < count then return {'short', tostring(held_len + visible), tonumber(m[7]) or 0} end
  -- Waiting jackpots are first in line.
  local from_held = math.min(count, held_len)
  if from_held > 0 then
    for _, v in ipairs(redis.call('LPOP', KEYS[3], from_held)) do codes[#codes + 1] = tonumber(v) end
  end
  local rest = count - from_held
  if rest > 0 then
    for _, v in ipairs(redis.call('LPOP', KEYS[2], rest)) do codes[#codes + 1] = take(v) end
    from_q = rest
  end
else
  -- Gated: jackpots met on the way move to `held` (they stay first in line)
  -- and the next prize takes their place. Only the prizes popped here are
  -- touched, so a draw costs O(count) however many jackpots wait.
  if visible < count then return {'short', tostring(held_len + visible), tonumber(m[7]) or 0} end
  local popped = {}
  local held_now = {}
  local need = count
  while need > 0 and from_q < visible do
    local n = math.min(need, visible - from_q)
    local batch = redis.call('LPOP', KEYS[2], n)
    from_q = from_q + n
    for _, v in ipairs(batch) do
      popped[#popped + 1] = v
      local code = tonumber(v) or tonumber(string.match(v, '^(%d+)f'))
      if jackpot[code] then
        held_now[#held_now + 1] = code
      else
        need = need - 1
      end
    end
  end
  if need > 0 then
    -- Not enough winnable prizes: put everything back where it was.
    for i = #popped, 1, -1 do redis.call('LPUSH', KEYS[2], popped[i]) end
    return {'short', tostring(held_len + visible - #held_now), tonumber(m[7]) or 0}
  end
  for _, v in ipairs(popped) do
    local code = take(v)
    if not jackpot[code] then codes[#codes + 1] = code end
  end
  if #held_now > 0 then redis.call('RPUSH', KEYS[3], unpack(held_now)) end
end

-- (Lua 5.1 prints -0 as "-0", which Redis refuses: skip a zero move.)
if from_q > 0 then redis.call('HINCRBY', KEYS[1], 'visible', -from_q) end
redis.call('HINCRBY', KEYS[1], 'drawn', count)
redis.call('INCRBY', KEYS[4], count * unit_price)
redis.call('EXPIRE', KEYS[4], tonumber(ARGV[3]))
local payload = trigger .. '|' .. unit_price .. '|' .. spent .. '|' .. table.concat(codes, ',')
redis.call('SET', KEYS[5], payload, 'EX', tonumber(ARGV[2]))
return {'ok', payload, 0}
