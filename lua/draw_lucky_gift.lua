-- Draws `count` prizes from a lucky-gift pool in list storage, all or nothing.
-- Prepended by lib/answer.lua, lib/award.lua, lib/jackpot.lua and lib/draw.lua.
--
-- KEYS[1]: pool meta hash (kind, visible, unit_price, jackpot_*, max_count, drawn, version, asset)
-- KEYS[2]: prize list `q`; the first `visible` elements are drawable, the tail
--          behind them is a batch being stocked and must not be touched
-- KEYS[3]: `held` list: gated jackpots waiting, first in line
-- KEYS[4]: today's consumption counter of an earlier version (its name ends
--          in the day; read on a day's first draw only)
-- KEYS[5]: result key of this request (idempotency)
-- ARGV[1]: count
-- ARGV[2]: result TTL in seconds
-- ARGV[3]: unused (the day's consumption lives in meta's `spent`)
-- ARGV[4]: the request's answer token (lib/answer.lua)
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
-- point is stored as "<code>f<batch>". The jackpot rule (lib/jackpot.lua)
-- pops the prizes it reads and, for a short answer, pushes them back before
-- anything else is written, so a step either completes or changes nothing.

-- One read of meta: the pool, the positions and the answer store's epochs.
local m = redis.call('HMGET', KEYS[1], 'kind', 'visible', 'unit_price',
  'jackpot_threshold', 'jackpot_codes', 'max_count', 'gen', 'version', 'asset', 'storage', 'due',
  'qhead', 'hgen', 'drawn', 'spent', 'held_n', 'hs', 'ns', 'jackpot_min', 'mults', 'tally', unpack(STORE_FIELDS))
local seen = replay_award(KEYS[1], KEYS[5], ARGV[4], m, 22)
if seen then return seen end
if m[1] ~= 'lucky_gift' or m[10] == 'sparse' then return refuse_unknown(KEYS[5], ARGV[4], ARGV[2], m[1]) end
local count = tonumber(ARGV[1])
local max_count = tonumber(m[6])
if max_count and count > max_count then return {'too_many', int(max_count), 0} end

local unit_price = tonumber(m[3])
local held_len = held_count(KEYS[3], m[16])
-- No jackpot rule, or today's consumption (this draw included) reached it.
local _, open, spent = gate(m[15], KEYS[4], count, unit_price, m[4])
local gen = tonumber(m[7]) or 0
-- Positions count the pops of `q`.
local qhead = tonumber(m[12]) or 0
local hgen0 = tonumber(m[13]) or 0
local track = positions(KEYS[1], hgen0, gen, m[17], m[18])

-- The list's reader for the jackpot rule: pops from the head of `q`,
-- keeping the elements popped for the undo and the refill flag.
local popped = {}
local src = {visible = tonumber(m[2]) or 0, base = qhead}
function src.read(n)
  local codes = {}
  for _, v in ipairs(redis.call('LPOP', KEYS[2], n)) do
    popped[#popped + 1] = v
    codes[#codes + 1] = num(v) or tonumber(string.match(v, '^(%d+)f'))
  end
  return codes
end
function src.undo()
  local back = {}
  for i = #popped, 1, -1 do back[#back + 1] = popped[i] end
  push_all('LPUSH', KEYS[2], back)
end

local plan, in_pool = jackpot_pick(KEYS[3], held_len, count, open, jackpot_set(m[5]), src, track)
if not plan then return draw_short(KEYS[1], gen, m[11], in_pool) end

local codes, origins = jackpot_take(KEYS[3], plan)
-- The refill flag of any prize popped, parked jackpots included.
local trigger = -1
for _, v in ipairs(popped) do
  -- A plain find first: one prize in a batch carries a flag.
  if string.find(v, 'f', 1, true) then
    local flagged = tonumber(string.match(v, '^%d+f(%d+)$'))
    if flagged and flagged > trigger then trigger = flagged end
  end
end
local fields = {}
if plan.used > 0 then
  fields = {'visible', int((tonumber(m[2]) or 0) - plan.used), 'qhead', int(qhead + plan.used)}
end
return draw_award({meta = KEYS[1], result = KEYS[5], spent_key = KEYS[4], token = ARGV[4],
  result_ttl = ARGV[2], version = m[8], asset = m[9], due = m[11], drawn = m[14],
  unit_price = unit_price, count = count, spent = spent, trigger = trigger,
  held_n = held_len - plan.from_held + #plan.parked, held_was = m[16],
  codes = codes, origins = origins, from_held = plan.from_held, parked_at = plan.parked_at,
  read_at = plan.read_at, jackpot_min = m[19], mults = m[20], tally = m[21],
  track = track, hgen0 = hgen0, next_pos = qhead + plan.used, fields = fields})
