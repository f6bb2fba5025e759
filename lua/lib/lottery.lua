-- Prelude of every lottery strategy's draw script, after lib/answer.lua
-- (the prelude of its scripts' function libraries, src/scripts/). KEYS and ARGV as draw_wheel.lua lists them.
--
-- An activity's counters live in its meta hash, so a draw reads them with
-- the activity in one HMGET and writes them in one HSET:
--   awards       awards so far: the serial of the last award
--   c            "<prize>:<stock left>:<awards>,...": each prize's counts
--                (the consolation prize's stock is unused)
--   u:<user>     chances a user has left
--   pv           "<day>:<visits>": today's visits (a day's count moves to
--                its own key, `pv:<day>`, on the next day's first visit)
--   counters     "meta" once the activity keeps its counters there
-- Today's visitors are a HyperLogLog of their own (`uv:<day>`). An activity
-- loaded before kept stock and awards in hashes of their own (KEYS[3],
-- KEYS[4]) and chances in KEYS[2]: lottery_fold moves the first two into
-- meta at once (a handful of fields); a user's chances move on the user's
-- next draw or grant.

-- The meta fields every strategy reads, in order; the answer store's
-- epochs follow (index LOTTERY_STORE_AT).
local LOTTERY_FIELDS = {'kind', 'starts_at', 'ends_at', 'prizes', 'consolation', 'counters', 'awards',
  'pv', 'c'}
local LOTTERY_STORE_AT = 10
-- Then the user's `u:<user>`.
local LOTTERY_USER_AT = LOTTERY_STORE_AT + #STORE_FIELDS
-- Then the activity's seed period length and the committed seed of period
-- ARGV[7] (`seed:<period>`, a copy lottery_seed_commit.lua keeps in meta so
-- a draw reads it with the rest): a seeded strategy's.
local LOTTERY_PERIOD_AT = LOTTERY_USER_AT + 1
local LOTTERY_SEED_AT = LOTTERY_USER_AT + 2

-- Meta's `c` as a table: `left` and `awarded` by prize id, `order` the ids
-- in the field's order.
local function counts_parse(field)
  local c = {left = {}, awarded = {}, order = {}}
  for id, l, a in string.gmatch(field or '', '([^,:]+):(%d+):(%d+)') do
    c.order[#c.order + 1] = id
    c.left[id] = tonumber(l)
    c.awarded[id] = tonumber(a)
  end
  return c
end

-- Adds prize `id` with `stock` left and no award, unless `c` counts it:
-- a reload never refills nor shrinks what is left.
local function counts_add(c, id, stock)
  if c.left[id] == nil then
    c.order[#c.order + 1] = id
    c.left[id] = stock
    c.awarded[id] = 0
  end
end

-- Meta's `c` of `c`.
local function counts_text(c)
  local out = {}
  for _, id in ipairs(c.order) do
    out[#out + 1] = id .. ':' .. int(c.left[id]) .. ':' .. int(c.awarded[id])
  end
  return table.concat(out, ',')
end

-- Moves the stock and awards hashes of an activity loaded before into its
-- meta hash's `c` (`meta`, `stock`, `awarded` are their keys) and returns
-- the counts; a no-op once done.
local function lottery_fold(meta, stock, awarded)
  local c = counts_parse(redis.call('HGET', meta, 'c'))
  local all = redis.call('HGETALL', stock)
  for i = 1, #all, 2 do counts_add(c, all[i], tonumber(all[i + 1])) end
  all = redis.call('HGETALL', awarded)
  for i = 1, #all, 2 do
    counts_add(c, all[i], 0)
    c.awarded[all[i]] = tonumber(all[i + 1])
  end
  redis.call('DEL', stock, awarded)
  redis.call('HSET', meta, 'counters', 'meta', 'c', counts_text(c))
  return c
end

-- The chances user ARGV[1] has left: meta's `u:<user>` (`field`, read
-- with the activity), or the chances hash of an activity loaded before.
local function chances_of(field)
  if field then return tonumber(field) or 0 end
  return tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0
end

-- Counts today's visit (PV in meta's `pv`, UV in the day's HyperLogLog)
-- and appends meta's new `pv` to `fields`. `pv` is meta's field as read.
-- A day's first visit moves the day before's count to its own key and
-- sets the expiry of the day's visitors.
local function count_visit(pv, fields)
  local day = string.match(KEYS[6], ':([^:]*)$')
  local pday, n = string.match(pv or '', '^([^:]*):(%d+)$')
  redis.call('PFADD', KEYS[7], ARGV[1])
  if pday ~= day then
    if pday then
      redis.call('SET', string.sub(KEYS[6], 1, -#day - 1) .. pday, n, 'EX', tonumber(ARGV[5]))
      n = 0
    else
      -- The first visit since the counters moved into meta: today's visits
      -- so far were counted in the day's key.
      n = tonumber(redis.call('GET', KEYS[6])) or 0
    end
    redis.call('EXPIRE', KEYS[7], tonumber(ARGV[5]))
  end
  fields[#fields + 1] = 'pv'
  fields[#fields + 1] = day .. ':' .. int(tonumber(n) + 1)
end

-- Writes `fields` to meta (one HSET) after adding the chance spent, when
-- `chances` (before this draw) is given: meta's `u:<user>`, and a user
-- whose chances were kept in the chances hash leaves it.
local function lottery_write(m, fields, chances)
  if chances then
    fields[#fields + 1] = 'u:' .. ARGV[1]
    fields[#fields + 1] = int(chances - 1)
    if not m[LOTTERY_USER_AT] then redis.call('HDEL', KEYS[2], ARGV[1]) end
  end
  redis.call('HSET', KEYS[1], unpack(fields))
end

-- A refusal that counts the visit; `m` as lottery_gate returns it.
local function lottery_refuse(m, code)
  local fields = {}
  count_visit(m[8], fields)
  lottery_write(m, fields)
  return refuse(KEYS[5], ARGV[6], ARGV[4], code)
end

-- The checks every strategy shares, before its pick: the request's stored
-- answer, the activity, its window and the user's chances. Returns the
-- activity's meta (LOTTERY_FIELDS, then the store's, then `u:<user>`) and
-- the user's chances (then the period length and the committed seed of
-- period ARGV[7]), or nil and the reply to give (a replay, or a
-- remembered refusal).
local function lottery_gate()
  local fields = {unpack(LOTTERY_FIELDS)}
  for _, f in ipairs(STORE_FIELDS) do fields[#fields + 1] = f end
  fields[#fields + 1] = 'u:' .. ARGV[1]
  fields[#fields + 1] = 'seed_period_s'
  fields[#fields + 1] = 'seed:' .. (ARGV[7] or '')
  local m = redis.call('HMGET', KEYS[1], unpack(fields))
  local seen = replay(KEYS[5], ARGV[6], m, LOTTERY_STORE_AT)
  if seen then return nil, seen end
  if m[1] ~= 'lottery' then return nil, refuse_unknown(KEYS[5], ARGV[6], ARGV[4], m[1]) end
  if m[6] ~= 'meta' then m[9] = counts_text(lottery_fold(KEYS[1], KEYS[3], KEYS[4])) end
  local now = tonumber(ARGV[2])
  local refusal = nil
  local chances = 0
  if now < tonumber(m[2]) then
    refusal = 'not_started'
  elseif now >= tonumber(m[3]) then
    refusal = 'ended'
  else
    chances = chances_of(m[LOTTERY_USER_AT])
    if chances <= 0 then refusal = 'no_chances' end
  end
  if refusal then return nil, lottery_refuse(m, refusal) end
  return m, chances
end

-- Awards `prize` (its stock taken when `finite`): spends the chance,
-- remembers the answer "<serial>[~<record>]|<prize>|<chances left>" and
-- returns it. The serial counts the activity's awards: it names this draw
-- for ever (the ledger entry id), even once the request id's answer has
-- expired. `record`, when the pick was random, is
-- "<random value>;<prize>:<weight>,...": the value it used and the
-- candidates in the order it walked them, so the award can be recomputed.
-- `m` and `chances` as lottery_gate returns them, `c` counts_parse's
-- table of meta's `c`.
local function lottery_award(m, chances, c, prize, finite, record)
  local fields = {}
  count_visit(m[8], fields)
  local serial = (tonumber(m[7]) or 0) + 1
  counts_add(c, prize, 0)
  if finite then c.left[prize] = c.left[prize] - 1 end
  c.awarded[prize] = c.awarded[prize] + 1
  fields[#fields + 1] = 'awards'
  fields[#fields + 1] = int(serial)
  fields[#fields + 1] = 'c'
  fields[#fields + 1] = counts_text(c)
  lottery_write(m, fields, chances)
  local body = int(serial) .. (record and ('~' .. record) or '') .. '|' .. prize .. '|' .. int(chances - 1)
  remember(KEYS[5], ARGV[6], body, ARGV[4])
  return {'ok', body, 0}
end
