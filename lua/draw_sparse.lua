-- Draws `count` prizes from a lucky-gift pool in sparse storage, all or nothing.
-- Prepended by lib/answer.lua, lib/award.lua, lib/jackpot.lua and lib/draw.lua.
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
-- KEYS[6]: today's consumption counter of an earlier version (lib/jackpot.lua, gate)
-- KEYS[7]: result key of this request
-- ARGV[1]: count
-- ARGV[2]: result TTL, seconds
-- ARGV[3]: unused (the day's consumption lives in meta's `spent`)
-- ARGV[4]: bucket size
-- ARGV[5]: fingerprint of the request
-- Returns: the same three-element replies as draw_lucky_gift.lua (positions
--          in the fairness record count indices)
--
-- Reading a prize writes nothing (the index `cur` moves at the end), so
-- everything is read and checked before the first write: a step either
-- completes or changes nothing.

local m = redis.call('HMGET', KEYS[1], 'kind', 'storage', 'max_index', 'cur', 'unit_price',
  'jackpot_threshold', 'jackpot_codes', 'max_count', 'gen', 'version', 'asset', 'due', 'hgen',
  'drawn', 'spent', 'held_n', 'hs', 'ns', 'jackpot_min', 'mults', 'tally', unpack(STORE_FIELDS))
local seen = replay_award(KEYS[1], KEYS[7], ARGV[5], m, 22)
if seen then return seen end
if m[1] ~= 'lucky_gift' or m[2] ~= 'sparse' then return refuse_unknown(KEYS[7], ARGV[5], ARGV[2], m[1]) end
local count = tonumber(ARGV[1])
local max_count = tonumber(m[8])
if max_count and count > max_count then return {'too_many', int(max_count), 0} end
local B = tonumber(ARGV[4])
local max_index = tonumber(m[3]) or 0
local cur = tonumber(m[4]) or 0
local unit_price = tonumber(m[5])
local gen = tonumber(m[9]) or 0
local held_len = held_count(KEYS[5], m[16])
-- No jackpot rule, or today's consumption (this draw included) reached it.
local _, open, spent = gate(m[15], KEYS[6], count, unit_price, m[6])
-- Positions count indices.
local hgen0 = tonumber(m[13]) or 0
local track = positions(KEYS[1], hgen0, gen, m[17], m[18])

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

-- The sparse reader for the jackpot rule: reads indices from `cur` on and
-- moves nothing, so there is nothing to undo.
local next_index = cur
local src = {visible = max_index - cur, base = cur}
function src.read(n)
  local codes = {}
  for i = next_index, next_index + n - 1 do codes[#codes + 1] = prize_at(i) end
  next_index = next_index + n
  return codes
end
function src.undo() end

local plan, in_pool = jackpot_pick(KEYS[5], held_len, count, open, jackpot_set(m[7]), src, track)
if not plan then return draw_short(KEYS[1], gen, m[12], in_pool) end
for _, c in ipairs(plan.won) do
  if c < 0 then return redis.error_reply('sparse pool has an index with no prize and no zero prize') end
end

-- Writes start here.
local codes, origins = jackpot_take(KEYS[5], plan)
local new_cur = cur + plan.used
local trigger = -1
local fields = {}
if new_cur > cur then
  -- The refill flag of any index passed, parked jackpots included.
  for _, g in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], int(cur), int(new_cur - 1))) do
    if tonumber(g) > trigger then trigger = tonumber(g) end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', int(new_cur - 1))
  -- Forget buckets and combo runs that are wholly behind us.
  for b = math.floor(cur / B), math.floor(new_cur / B) - 1 do redis.call('HDEL', KEYS[2], int(b)) end
  local s = redis.call('ZREVRANGEBYSCORE', KEYS[3], int(new_cur), '-inf', 'LIMIT', 0, 1)
  if s[1] then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. string.match(s[1], '^(%d+):')) end
  fields = {'cur', int(new_cur)}
end
return draw_award({meta = KEYS[1], result = KEYS[7], spent_key = KEYS[6], token = ARGV[5],
  result_ttl = ARGV[2], version = m[10], asset = m[11], due = m[12], drawn = m[14],
  unit_price = unit_price, count = count, spent = spent, trigger = trigger,
  held_n = held_len - plan.from_held + #plan.parked, held_was = m[16],
  codes = codes, origins = origins, from_held = plan.from_held, parked_at = plan.parked_at,
  read_at = plan.read_at, jackpot_min = m[19], mults = m[20], tally = m[21],
  track = track, hgen0 = hgen0, next_pos = new_cur, fields = fields})
