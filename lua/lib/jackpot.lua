-- Prelude of the lucky-gift draw scripts, after lib/answer.lua: the jackpot
-- rule, written once for both storages (the prelude of its scripts' function libraries, src/scripts/).
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

-- A `held` element: "<code>" or "<code>:<generation>:<position>" (where the
-- parked prize came from). Returns code, generation, position (0, 0 when
-- unknown).
local function held_parse(v)
  local code, g, p = string.match(v, '^(%d+):(%d+):(%d+)$')
  if code then return tonumber(code), tonumber(g), tonumber(p) end
  return tonumber(v), 0, 0
end

-- The prize code of a `held` element.
local function held_code(v)
  return tonumber(string.match(v, '^(%d+)'))
end

-- The set of jackpot codes from meta's `jackpot_codes` ("3,17,...").
local function jackpot_set(field)
  local set = {}
  if field and field ~= '' then
    for c in string.gmatch(field, '%d+') do set[tonumber(c)] = true end
  end
  return set
end

-- Today's consumption with this draw's (capped, so it stays exact) and
-- whether it opens the gate; an empty threshold means no rule. The day's
-- consumption lives in meta's `spent` as "<day>:<amount>"; `spent_key` (the
-- day's key, whose name ends in the day) is read only on a day's first draw,
-- for a total kept there by an earlier version. Returns the total, the
-- verdict and the field's new value.
local function gate(field, spent_key, count, unit_price, threshold_field)
  local day = string.match(spent_key, ':(%d+)$') or ''
  local fday, amount = string.match(field or '', '^(%d+):(%d+)$')
  local before
  if fday == day then before = tonumber(amount) else before = tonumber(redis.call('GET', spent_key)) or 0 end
  local spent = math.min(before + count * unit_price, SPENT_CAP)
  local threshold = tonumber(threshold_field)
  return spent, (threshold == nil) or (spent >= threshold), day .. ':' .. int(spent)
end

-- How many prizes wait in `held`: meta's `held_n` (kept by the draws), or
-- the list's length for a pool whose draws have not kept it yet.
local function held_count(held_key, field)
  return tonumber(field) or redis.call('LLEN', held_key)
end

-- How many of the first `count` prizes in `held` are freed (no jackpot
-- under the current rule). Read only; O(1) when the head is a jackpot,
-- O(count) at most.
local function freed_at_head(held_key, count, jackpot)
  if count <= 0 then return 0 end
  local first = redis.call('LINDEX', held_key, 0)
  if not first or jackpot[held_code(first)] then return 0 end
  local n = 0
  for _, v in ipairs(redis.call('LRANGE', held_key, 0, count - 1)) do
    if jackpot[held_code(v)] then break end
    n = n + 1
  end
  return n
end

-- Pops `n` prizes from the head of `held`, appending their codes to `codes`
-- and, when `origins` is given, where each came from ({generation,
-- position, true}; generation 0 when unknown) to `origins`.
local function take_held(held_key, n, codes, origins)
  if n > 0 then
    for _, v in ipairs(redis.call('LPOP', held_key, n)) do
      local code, g, p = held_parse(v)
      codes[#codes + 1] = code
      if origins then origins[#origins + 1] = {g, p, true} end
    end
  end
end

-- Provable fairness (docs/fairness.md): every prize is named by its batch
-- (generation) and its position in the batch order, so a draw can be
-- checked against the order the batch's revealed seed derives.
--
-- Positions are counted by one running counter per pool: the list's pop
-- counter `qhead` (list storage) or the index `cur` (sparse storage). In
-- meta:
--   `bstart:<g>`  the counter value at the first prize of batch g (written
--                 by the commit that made g visible; dropped once g is past)
--   `hgen`        the batch the next position belongs to (or an earlier one)
--   `c:<g>`       "<version>|<seed hex>" of batch g until its reveal
--   `hh:<g>`      prizes of batch g parked in `held` (absent when none)
--   `revealed`    "<g>|<version>|<seed hex>" of the last batch revealed
-- A batch's seed is revealed by the draw that leaves none of its prizes in
-- the pool: its last position has been drawn (or parked) and none of its
-- jackpots waits in `held`. The reveal travels in that draw's answer.

-- A tracker of positions for one draw: reads only, so a step that ends
-- `short` after using it has written nothing. `gen` is meta's `gen` (the
-- last batch committed: a later batch has no start yet); `hs` and `ns` are
-- meta's cached starts of batches hgen and hgen + 1 ("<g>:<start>", kept by
-- the draws, trusted only for the batch they name), so a draw within one
-- batch reads no start of its own.
local function positions(meta_key, hgen, gen, hs, ns)
  local t = {hgen = hgen, done = {}, cached = {}}
  local starts = {}
  for _, f in ipairs({hs or '', ns or ''}) do
    local g, v = string.match(f, '^(%d+):(%d+)$')
    if g then t.cached[tonumber(g)] = tonumber(v) end
  end
  local function start(g)
    local s = starts[g]
    if s == nil then
      if g > gen then
        s = false
      elseif t.cached[g] then
        s = t.cached[g]
      else
        s = tonumber(redis.call('HGET', meta_key, 'bstart:' .. int(g))) or false
      end
      starts[g] = s
    end
    return s
  end
  t.start = start
  -- Moves past every batch that starts at or before position `i`.
  function t.advance(i)
    while true do
      local s = start(t.hgen + 1)
      if s and i >= s then
        t.done[#t.done + 1] = t.hgen
        t.hgen = t.hgen + 1
      else
        return
      end
    end
  end
  -- The origin {generation, position} of running position `i` (0, 0 when
  -- its batch was stocked before batches were committed).
  function t.at(i)
    t.advance(i)
    local s = start(t.hgen)
    if s then return {t.hgen, i - s} end
    return {0, 0}
  end
  -- Meta fields to write after the draw: the batch pointer and the cached
  -- starts, where they changed.
  function t.fields(out, hgen0)
    if t.hgen ~= hgen0 then out[#out + 1] = 'hgen'; out[#out + 1] = int(t.hgen) end
    for k, f in ipairs({'hs', 'ns'}) do
      local g = t.hgen + k - 1
      local s = start(g)
      if s and t.cached[g] ~= s then out[#out + 1] = f; out[#out + 1] = int(g) .. ':' .. int(s) end
    end
  end
  return t
end

-- The held element of a parked jackpot: "<code>:<generation>:<position>".
local function held_element(code, origin)
  if origin[1] > 0 then return int(code) .. ':' .. int(origin[1]) .. ':' .. int(origin[2]) end
  return int(code)
end

-- The writes of a draw's fairness record, after every check: held counts,
-- reveals (the batch pointer goes to `fields`, the draw's one meta write). `origins` lists the origins of the answer's
-- prizes in answer order (a third element `true` when taken from `held`),
-- `parked` the origins of the jackpots this draw parked, `next_pos` the
-- running position after the draw. Returns the answer's suffix
-- "/<runs>/<parked>/<reveals>" (empty trailing fields left out): runs
-- "g.p.n" (n prizes at positions
-- p..p+n-1 of batch g, in answer order), parked "g.p", reveals
-- "g.<version>.<seed hex>".
local function fair_record(meta_key, t, hgen0, origins, parked, next_pos, fields)
  t.advance(next_pos)
  local delta, order = {}, {}
  local function add(g, d)
    if g > 0 then
      if delta[g] == nil then delta[g] = 0; order[#order + 1] = g end
      delta[g] = delta[g] + d
    end
  end
  for _, o in ipairs(origins) do if o[3] then add(o[1], -1) end end
  for _, o in ipairs(parked) do add(o[1], 1) end
  local candidates, seen = {}, {}
  local function candidate(g)
    if g > 0 and not seen[g] then seen[g] = true; candidates[#candidates + 1] = g end
  end
  for _, g in ipairs(order) do
    if delta[g] ~= 0 then
      local n = redis.call('HINCRBY', meta_key, 'hh:' .. int(g), delta[g])
      if n <= 0 then redis.call('HDEL', meta_key, 'hh:' .. int(g)) end
    end
    candidate(g)
  end
  for _, g in ipairs(t.done) do
    if g > 0 then redis.call('HDEL', meta_key, 'bstart:' .. int(g)) end
    candidate(g)
  end
  t.fields(fields, hgen0)
  table.sort(candidates)
  local reveals = {}
  for _, g in ipairs(candidates) do
    if g < t.hgen and not redis.call('HGET', meta_key, 'hh:' .. int(g)) then
      local c = redis.call('HGET', meta_key, 'c:' .. int(g))
      if c then
        local v, seed = string.match(c, '^(%d+)|(%x+)$')
        if v then
          reveals[#reveals + 1] = int(g) .. '.' .. v .. '.' .. seed
          redis.call('HSET', meta_key, 'revealed', int(g) .. '|' .. c)
        end
        redis.call('HDEL', meta_key, 'c:' .. int(g))
      end
    end
  end
  local runs = {}
  local lg, lp, ln = -1, 0, 0
  for _, o in ipairs(origins) do
    if o[1] == lg and (lg == 0 or lp + ln == o[2]) then
      ln = ln + 1
    else
      if lg >= 0 then runs[#runs + 1] = int(lg) .. '.' .. int(lp) .. '.' .. int(ln) end
      lg, lp, ln = o[1], o[2], 1
    end
  end
  if lg >= 0 then runs[#runs + 1] = int(lg) .. '.' .. int(lp) .. '.' .. int(ln) end
  local parked_text = {}
  for _, o in ipairs(parked) do parked_text[#parked_text + 1] = int(o[1]) .. '.' .. int(o[2]) end
  -- Empty trailing fields are left out ("/<runs>" for most draws).
  local out = '/' .. table.concat(runs, ',')
  if #parked_text > 0 or #reveals > 0 then out = out .. '/' .. table.concat(parked_text, ',') end
  if #reveals > 0 then out = out .. '/' .. table.concat(reveals, ',') end
  return out
end

-- The jackpot gate applied to one draw of `count` prizes: which prizes the
-- draw wins and which jackpots it parks. Written once for every storage;
-- each storage hands it a reader of its drawable prizes, in draw order:
--   src.visible   how many prizes are drawable
--   src.base      the running position (lib/jackpot.lua's counter: `qhead`
--                 or `cur`) of the first of them
--   src.read(n)   the codes of the next n of them (1 <= n, never past
--                 `visible`); it may take them out of the pool (the list
--                 pops them) as long as
--   src.undo()    puts every prize read back where it was.
-- Besides the reader's own moves it only reads (`held`, the fairness
-- record), so after src.undo() a short draw has changed nothing.
--
-- `open` is gate()'s verdict; `jackpot` is jackpot_set()'s; `track` is the
-- draw's positions() tracker. Returns nil and the count to answer `short`
-- with, or the plan:
--   from_held  prizes to take from the head of `held` (first in the answer)
--   won        codes won from the pool, in draw order; `won_at` their origins
--   parked     `held` elements of the jackpots met and held back;
--              `parked_at` their origins
--   used       drawable prizes the draw used up (won and parked)
local function jackpot_pick(held_key, held_len, count, open, jackpot, src, track)
  local plan = {from_held = 0, won = {}, won_at = {}, parked = {}, parked_at = {}, used = 0}
  -- Reads the next n drawable prizes; while gated, jackpots are parked.
  local function read(n, gated)
    for _, code in ipairs(src.read(n)) do
      local at = track.at(src.base + plan.used)
      plan.used = plan.used + 1
      if gated and jackpot[code] then
        plan.parked[#plan.parked + 1] = held_element(code, at)
        plan.parked_at[#plan.parked_at + 1] = at
      else
        plan.won[#plan.won + 1] = code
        plan.won_at[#plan.won_at + 1] = at
      end
    end
  end
  if open then
    if held_len + src.visible < count then return nil, held_len + src.visible end
    -- Waiting jackpots are first in line, then the pool in order.
    plan.from_held = math.min(count, held_len)
    if count > plan.from_held then read(count - plan.from_held, false) end
    return plan
  end
  -- Gated: parked prizes a reload freed from the rule come first. Jackpots
  -- met on the way move to `held` (they stay first in line) and the next
  -- prize takes their place. Only the prizes read here are touched, so a
  -- draw costs O(count) however many jackpots wait; a long run of jackpots
  -- costs its length, in chunks. A chunk never reads past the prize that
  -- completes the draw: it is no longer than the prizes still missing.
  plan.from_held = freed_at_head(held_key, count, jackpot)
  if src.visible + plan.from_held < count then return nil, held_len + src.visible end
  local need = count - plan.from_held
  while #plan.won < need and plan.used < src.visible do
    read(math.min(need - #plan.won, src.visible - plan.used), true)
  end
  if #plan.won < need then
    -- Not enough winnable prizes: everything goes back where it was.
    src.undo()
    return nil, held_len + src.visible - #plan.parked
  end
  return plan
end

-- The `held` writes of a planned draw: takes `plan.from_held` prizes from
-- the head of `held` and parks the jackpots met at its tail. Returns the
-- answer's codes and their origins (a third element `true` for a prize from
-- `held`), in answer order: prizes from `held` first, then those won.
local function jackpot_take(held_key, plan)
  local codes, origins = {}, {}
  take_held(held_key, plan.from_held, codes, origins)
  for k, code in ipairs(plan.won) do
    codes[#codes + 1] = code
    origins[#origins + 1] = plan.won_at[k]
  end
  push_all('RPUSH', held_key, plan.parked)
  return codes, origins
end
