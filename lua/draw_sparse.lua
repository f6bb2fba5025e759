-- Draws `count` prizes from a lucky-gift pool in sparse storage, all or nothing.
-- Prepended by lib/answer.lua.
--
-- Prizes occupy consecutive indices. Only non-zero prizes are stored, in
-- buckets of ARGV[4] indices: `sp` field <bucket> = "<offset>.<code>;...".
-- An index with no stored prize holds the zero prize of its combo, found in
-- `seg` (score = first index of a combo run, member = "<start>:<zero code>").
-- Draws may only read indices below `max_index`: running past the stocked
-- range is a short pool, never a silent string of zeros.
--
-- KEYS[1]: pool meta hash (kind, storage, max_index, cur, unit_price, jackpot_*, max_count, gen, drawn)
-- KEYS[2]: `sp` hash of stored prizes
-- KEYS[3]: `seg` sorted set of combo runs
-- KEYS[4]: `flags` sorted set (score = flagged index, member = batch number)
-- KEYS[5]: `held` list of gated jackpots
-- KEYS[6]: today's consumption counter
-- KEYS[7]: result key of this request
-- ARGV[1]: count
-- ARGV[2]: result TTL, seconds
-- ARGV[3]: consumption counter TTL, seconds
-- ARGV[4]: bucket size
-- ARGV[5]: fingerprint of the request
-- Returns: the same three-element replies as draw_lucky_gift.lua (positions
--          in the fairness record count indices)
--
-- Everything is read and checked before the first write, so a step either
-- completes or changes nothing.

local seen = replay_award(KEYS[1], KEYS[7], ARGV[5])
if seen then return seen end
local m = redis.call('HMGET', KEYS[1], 'kind', 'storage', 'max_index', 'cur', 'unit_price',
  'jackpot_threshold', 'jackpot_codes', 'max_count', 'gen', 'version', 'asset', 'due', 'hgen')
if m[1] ~= 'lucky_gift' or m[2] ~= 'sparse' then return refuse(KEYS[7], ARGV[5], ARGV[2], 'unknown_pool') end
local count = tonumber(ARGV[1])
local max_count = tonumber(m[8])
if max_count and count > max_count then return {'too_many', int(max_count), 0} end
local B = tonumber(ARGV[4])
local max_index = tonumber(m[3]) or 0
local cur = tonumber(m[4]) or 0
local visible = max_index - cur
local unit_price = tonumber(m[5])
local gen = tonumber(m[9]) or 0
-- A short answer changes no prize. It makes the current batch due for its
-- successor, like a taken refill flag: the draw's urgent refill request
-- will be honoured, a forged one (no short draw, no flag) will not.
local function short(in_pool)
  if gen > (tonumber(m[12]) or -1) then redis.call('HSET', KEYS[1], 'due', int(gen)) end
  return {'short', int(in_pool), gen}
end
local held_len = redis.call('LLEN', KEYS[5])
local spent, open = gate(KEYS[6], count, unit_price, m[6])
local jackpot = jackpot_set(m[7])

-- Reading prizes by index, one bucket and one combo run at a time.
local buckets = {}
local seg_start, seg_zero, next_start = -1, -1, -1
local function seg_for(i)
  if seg_start < 0 or (next_start >= 0 and i >= next_start) then
    local s = redis.call('ZREVRANGEBYSCORE', KEYS[3], int(i), '-inf', 'LIMIT', 0, 1)
    if s[1] then
      local a, z = string.match(s[1], '^(%d+):(-?%d+)$')
      seg_start, seg_zero = tonumber(a), tonumber(z)
    end
    local n = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. int(i), '+inf', 'LIMIT', 0, 1)
    next_start = n[1] and tonumber(string.match(n[1], '^(%d+):')) or -1
  end
  return seg_zero
end
local function prize_at(i)
  local b = math.floor(i / B)
  local t = buckets[b]
  if t == nil then
    t = {}
    local v = redis.call('HGET', KEYS[2], int(b))
    if v then
      for off, code in string.gmatch(v, '(%d+)%.(%d+);') do t[tonumber(off)] = tonumber(code) end
    end
    buckets[b] = t
  end
  local c = t[i % B]
  if c then return c end
  return seg_for(i)
end

local codes = {}
local from_held = 0
local held_now = {}
local new_cur = cur
-- Where each prize came from (positions count indices).
local hgen0 = tonumber(m[13]) or 0
local track = positions(KEYS[1], hgen0)
local at_index = {}
local parked = {}
if open then
  if held_len + visible < count then return short(held_len + visible) end
  -- Waiting jackpots are first in line.
  from_held = math.min(count, held_len)
  for i = cur, cur + count - from_held - 1 do
    codes[#codes + 1] = prize_at(i)
    at_index[#at_index + 1] = track.at(i)
  end
  new_cur = cur + count - from_held
else
  -- Parked prizes a reload freed from the rule come first.
  from_held = freed_at_head(KEYS[5], count, jackpot)
  if visible + from_held < count then return short(held_len + visible) end
  -- Jackpots met on the way wait in `held`; the next prize takes their place.
  local i = cur
  while #codes < count - from_held and i < max_index do
    local c = prize_at(i)
    local at = track.at(i)
    if jackpot[c] then
      held_now[#held_now + 1] = held_element(c, at)
      parked[#parked + 1] = at
    else
      codes[#codes + 1] = c
      at_index[#at_index + 1] = at
    end
    i = i + 1
  end
  -- Nothing was written yet, so a short answer needs no undo.
  if #codes < count - from_held then return short(held_len + visible - #held_now) end
  new_cur = i
end
for _, c in ipairs(codes) do
  if c < 0 then return redis.error_reply('sparse pool has an index with no prize and no zero prize') end
end

-- Writes start here.
local origins = {}
if from_held > 0 then
  local first = {}
  take_held(KEYS[5], from_held, first, origins)
  for _, c in ipairs(codes) do first[#first + 1] = c end
  codes = first
end
for _, o in ipairs(at_index) do origins[#origins + 1] = o end
push_all('RPUSH', KEYS[5], held_now)
local trigger = -1
if new_cur > cur then
  for _, g in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], int(cur), int(new_cur - 1))) do
    if tonumber(g) > trigger then trigger = tonumber(g) end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', int(new_cur - 1))
  -- Forget buckets and combo runs that are wholly behind us.
  for b = math.floor(cur / B), math.floor(new_cur / B) - 1 do redis.call('HDEL', KEYS[2], int(b)) end
  local s = redis.call('ZREVRANGEBYSCORE', KEYS[3], int(new_cur), '-inf', 'LIMIT', 0, 1)
  if s[1] then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. string.match(s[1], '^(%d+):')) end
  redis.call('HSET', KEYS[1], 'cur', int(new_cur))
end
local record = fair_record(KEYS[1], track, hgen0, origins, parked, new_cur)
local serial = redis.call('HINCRBY', KEYS[1], 'drawn', count)
if trigger > (tonumber(m[12]) or -1) then redis.call('HSET', KEYS[1], 'due', int(trigger)) end
redis.call('SET', KEYS[6], int(spent), 'EX', tonumber(ARGV[3]))
local body = int(serial) .. '|' .. (m[10] or '0') .. '|' .. int(unit_price) .. '|' .. int(trigger) .. '|'
  .. table.concat(codes, ',') .. record .. '|' .. (m[11] or 'coin')
-- The fairness record travels inside the codes field of the stored form.
remember(KEYS[7], ARGV[5], award_stored(KEYS[1], serial, m[10] or '0', unit_price, trigger,
  table.concat(codes, ',') .. record, m[11] or 'coin'), ARGV[2])
return {'ok', body, 0}
