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

-- Runs of positions (as runs_of counts them) the prizes one draw takes
-- from `held` may form, so that its fairness record stays within its
-- bound (HELD_RUNS in src/kinds/lucky_gift/config/bounds.rs): a draw
-- stops taking parked prizes where one more would start a run past this
-- many, and the rest wait, still first in line, for the next draw.
local HELD_RUNS = 32

-- How many of the first `count` prizes in `held` a draw takes: those that
-- form at most HELD_RUNS runs and, for a gated draw (`jackpot` given),
-- none from the first jackpot under the current rule on (only the freed).
-- Read only; O(1) when `held` is empty or a gated draw finds a jackpot at
-- its head, O(count) at most.
local function held_takes(held_key, count, jackpot)
  if count <= 0 then return 0 end
  if jackpot then
    local first = redis.call('LINDEX', held_key, 0)
    if not first or jackpot[held_code(first)] then return 0 end
  end
  local n, runs = 0, 0
  local lg, lp = -1, 0
  for _, v in ipairs(redis.call('LRANGE', held_key, 0, count - 1)) do
    local code, g, p = held_parse(v)
    if jackpot and jackpot[code] then break end
    if not (g == lg and (g == 0 or p == lp + 1)) then
      if runs == HELD_RUNS then break end
      runs = runs + 1
    end
    lg, lp = g, p
    n = n + 1
  end
  return n
end

-- Pops `n` prizes from the head of `held`, appending their codes to `codes`
-- and where each came from (generation, position; 0, 0 when unknown) to
-- the flat list `origins` (g1, p1, g2, p2, ...).
local function take_held(held_key, n, codes, origins)
  if n > 0 then
    for _, v in ipairs(redis.call('LPOP', held_key, n)) do
      local code, g, p = held_parse(v)
      codes[#codes + 1] = code
      origins[#origins + 1] = g
      origins[#origins + 1] = p
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
-- batch reads no start of its own. The tracker is one table of numbers and
-- the functions below take it as their first argument: a draw builds no
-- closure and no table per prize.
--   hgen       the batch the running position is in (moves forward)
--   s, ns      the starts of batches hgen and hgen + 1 (false: none), nil
--              until the first track_at
--   done       the batches passed, or nil
local function positions(meta_key, hgen, gen, hs, ns)
  local t = {meta = meta_key, gen = gen, hgen = hgen}
  local g, v = string.match(hs or '', '^(%d+):(%d+)$')
  if g then t.c1g, t.c1s = tonumber(g), tonumber(v) end
  g, v = string.match(ns or '', '^(%d+):(%d+)$')
  if g then t.c2g, t.c2s = tonumber(g), tonumber(v) end
  return t
end

-- The start meta's `hs` or `ns` holds for batch g, or nil.
local function track_cached(t, g)
  if g == t.c2g then return t.c2s end
  if g == t.c1g then return t.c1s end
  return nil
end

-- The running position of the first prize of batch g (false: none known).
-- A start that is not cached is read once (`bstart:<g>`).
local function track_start(t, g)
  if g > t.gen then return false end
  local s = track_cached(t, g)
  if s then return s end
  local starts = t.starts
  if not starts then
    starts = {}
    t.starts = starts
  end
  s = starts[g]
  if s == nil then
    s = tonumber(redis.call('HGET', t.meta, 'bstart:' .. int(g))) or false
    starts[g] = s
  end
  return s
end

-- Moves past every batch that starts at or before position `i`.
local function track_advance(t, i)
  while true do
    local s = track_start(t, t.hgen + 1)
    if s and i >= s then
      local done = t.done
      if not done then
        done = {}
        t.done = done
      end
      done[#done + 1] = t.hgen
      t.hgen = t.hgen + 1
    else
      t.ns = s
      t.s = track_start(t, t.hgen)
      return
    end
  end
end

-- The origin (generation, position) of running position `i` (0, 0 when its
-- batch was stocked before batches were committed). Positions only grow
-- within a draw, so a prize that stays in its batch costs a comparison.
local function track_at(t, i)
  local ns = t.ns
  if ns == nil or (ns and i >= ns) then track_advance(t, i) end
  local s = t.s
  if s then return t.hgen, i - s end
  return 0, 0
end

-- Meta fields to write after the draw: the batch pointer and the cached
-- starts, where they changed.
local function track_fields(t, out, hgen0)
  if t.hgen ~= hgen0 then
    out[#out + 1] = 'hgen'
    out[#out + 1] = int(t.hgen)
  end
  local g = t.hgen
  local s = track_start(t, g)
  if s and track_cached(t, g) ~= s then
    out[#out + 1] = 'hs'
    out[#out + 1] = int(g) .. ':' .. int(s)
  end
  g = g + 1
  s = track_start(t, g)
  if s and track_cached(t, g) ~= s then
    out[#out + 1] = 'ns'
    out[#out + 1] = int(g) .. ':' .. int(s)
  end
end

-- The held element of a parked jackpot: "<code>:<generation>:<position>".
local function held_element(code, g, p)
  if g > 0 then return int(code) .. ':' .. int(g) .. ':' .. int(p) end
  return int(code)
end

-- The runs of a flat list of origins (g1, p1, g2, p2, ...), in answer
-- order: "g.p.n" for n prizes at positions p..p+n-1 of batch g (batch 0,
-- unknown, makes one run whatever the positions). Returns the text, and
-- the batch and first position when the origins make a single run.
local function runs_of(origins)
  local runs = {}
  local lg, lp, ln = -1, 0, 0
  for k = 1, #origins, 2 do
    local g, p = origins[k], origins[k + 1]
    if g == lg and (lg == 0 or lp + ln == p) then
      ln = ln + 1
    else
      if lg >= 0 then runs[#runs + 1] = int(lg) .. '.' .. int(lp) .. '.' .. int(ln) end
      lg, lp, ln = g, p, 1
    end
  end
  if lg < 0 then return '' end
  local last = int(lg) .. '.' .. int(lp) .. '.' .. int(ln)
  if #runs == 0 then return last, lg, lp end
  runs[#runs + 1] = last
  return table.concat(runs, ',')
end

-- The runs of a draw that held jackpots back, over every position it took
-- or read: the first `from_held` origins of the flat `origins` (g1, p1,
-- ...: prizes taken from `held`, none of them held back) and then the flat
-- triples of `read_at` (g, p, held). A run "g.p.n" or "g.p.n.h" covers
-- positions p..p+n-1 of batch g, h of them held back (batch 0, unknown,
-- makes one run whatever the positions). The draw names no held-back
-- position itself: they are the positions of these runs whose prize
-- reaches the rule's minimum multiplier (docs/fairness.md), so the record
-- grows with the batches a draw reads, not with the jackpots it meets.
local function scan_runs(origins, from_held, read_at)
  local runs = {}
  local lg, lp, ln, lh = -1, 0, 0, 0
  local function add(g, p, h)
    if g == lg and (lg == 0 or lp + ln == p) then
      ln = ln + 1
      lh = lh + h
    else
      if lg >= 0 then
        local run = int(lg) .. '.' .. int(lp) .. '.' .. int(ln)
        if lh > 0 then run = run .. '.' .. int(lh) end
        runs[#runs + 1] = run
      end
      lg, lp, ln, lh = g, p, 1, h
    end
  end
  for k = 1, from_held do add(origins[2 * k - 1], origins[2 * k], 0) end
  for k = 1, #read_at, 3 do add(read_at[k], read_at[k + 1], read_at[k + 2]) end
  add(-2, 0, 0)
  return table.concat(runs, ',')
end

-- The held counts (`hh:<g>`) a draw changes, and the batches whose seed it
-- may reveal. `origins` as for fair_record, of which the first `from_held`
-- were taken from `held`; `parked` the flat origins of the jackpots parked.
local function held_counts(meta_key, origins, from_held, parked, candidates, seen)
  local delta, order = {}, {}
  local function add(g, d)
    if g > 0 then
      if delta[g] == nil then
        delta[g] = 0
        order[#order + 1] = g
      end
      delta[g] = delta[g] + d
    end
  end
  for k = 1, from_held do add(origins[2 * k - 1], -1) end
  for k = 1, #parked, 2 do add(parked[k], 1) end
  for _, g in ipairs(order) do
    if delta[g] ~= 0 then
      local n = redis.call('HINCRBY', meta_key, 'hh:' .. int(g), delta[g])
      if n <= 0 then redis.call('HDEL', meta_key, 'hh:' .. int(g)) end
    end
    if not seen[g] then
      seen[g] = true
      candidates[#candidates + 1] = g
    end
  end
end

-- The reveals of a draw: each batch among `candidates` that is behind the
-- running position with none of its prizes parked has its seed revealed
-- (and its commitment dropped). Returns "g.<version>.<seed hex>,...".
local function reveals_of(meta_key, t, candidates)
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
          -- The batches this draw completed, for the realised RTP
          -- (lib/draw.lua, tally_reveals): g1, v1, g2, v2, ...
          local done = t.revealed or {}
          done[#done + 1] = g
          done[#done + 1] = tonumber(v)
          t.revealed = done
        end
        redis.call('HDEL', meta_key, 'c:' .. int(g))
      end
    end
  end
  return table.concat(reveals, ',')
end

-- The writes of a draw's fairness record, after every check: held counts,
-- reveals (the batch pointer goes to `fields`, the draw's one meta write).
-- `origins` lists the origins of the answer's prizes in answer order, flat
-- (g1, p1, g2, p2, ...), the first `from_held` taken from `held`; `parked`
-- the flat origins of the jackpots this draw parked; `next_pos` the running
-- position after the draw; `read_at` the plan's (gated draws) and `min`
-- meta's `jackpot_min` (the rule's minimum multiplier; absent for a pool
-- loaded before it was kept). Returns the answer's suffix
-- "/<runs>/<parked>/<reveals>" (empty trailing fields left out): runs
-- "g.p.n" (runs_of), parked "g.p", reveals "g.<version>.<seed hex>"; for a
-- draw that parked jackpots with `min` known, runs over every position
-- read (scan_runs) and parked "m<min>"; and, when the record is one run
-- and nothing else, that run's batch and first position.
local function fair_record(meta_key, t, hgen0, origins, from_held, parked, next_pos, fields, read_at, min)
  track_advance(t, next_pos)
  local candidates, seen = {}, {}
  if from_held > 0 or #parked > 0 then held_counts(meta_key, origins, from_held, parked, candidates, seen) end
  if t.done then
    for _, g in ipairs(t.done) do
      if g > 0 then
        redis.call('HDEL', meta_key, 'bstart:' .. int(g))
        if not seen[g] then
          seen[g] = true
          candidates[#candidates + 1] = g
        end
      end
    end
  end
  track_fields(t, fields, hgen0)
  local reveals = ''
  if #candidates > 0 then reveals = reveals_of(meta_key, t, candidates) end
  local derived = #parked > 0 and read_at ~= nil and tonumber(min) ~= nil
  if derived then
    local out = '/' .. scan_runs(origins, from_held, read_at) .. '/m' .. int(tonumber(min))
    if reveals ~= '' then out = out .. '/' .. reveals end
    return out, nil, nil
  end
  local runs, g, p = runs_of(origins)
  local out = '/' .. runs
  -- Empty trailing fields are left out ("/<runs>" for most draws).
  if #parked > 0 or reveals ~= '' then
    local parked_text = {}
    for k = 1, #parked, 2 do parked_text[#parked_text + 1] = int(parked[k]) .. '.' .. int(parked[k + 1]) end
    out = out .. '/' .. table.concat(parked_text, ',')
    g = nil
  end
  if reveals ~= '' then out = out .. '/' .. reveals end
  return out, g, p
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
--   won        codes won from the pool, in draw order; `won_at` their
--              origins, flat (g1, p1, g2, p2, ...)
--   parked     `held` elements of the jackpots met and held back;
--              `parked_at` their origins, flat
--   read_at    gated only: every prize read, in draw order, flat
--              (g1, p1, held1, g2, ...; held 1 for a jackpot parked, else 0)
--   used       drawable prizes the draw used up (won and parked)

-- Reads the next n drawable prizes into `plan`; while gated, jackpots are
-- parked.
local function pick_read(plan, src, track, jackpot, n, gated)
  local won, won_at = plan.won, plan.won_at
  local used = plan.used
  local base = src.base
  for _, code in ipairs(src.read(n)) do
    local g, p = track_at(track, base + used)
    used = used + 1
    local held = gated and jackpot[code]
    if held then
      local parked, parked_at = plan.parked, plan.parked_at
      parked[#parked + 1] = held_element(code, g, p)
      parked_at[#parked_at + 1] = g
      parked_at[#parked_at + 1] = p
    else
      won[#won + 1] = code
      won_at[#won_at + 1] = g
      won_at[#won_at + 1] = p
    end
    if gated then
      local read_at = plan.read_at
      read_at[#read_at + 1] = g
      read_at[#read_at + 1] = p
      read_at[#read_at + 1] = held and 1 or 0
    end
  end
  plan.used = used
end

local function jackpot_pick(held_key, held_len, count, open, jackpot, src, track)
  local plan = {from_held = 0, won = {}, won_at = {}, parked = {}, parked_at = {}, read_at = {}, used = 0}
  if open then
    if held_len + src.visible < count then return nil, held_len + src.visible end
    -- Waiting jackpots are first in line (as many as the record's bound
    -- lets one draw take), then the pool in order.
    plan.from_held = held_takes(held_key, math.min(count, held_len), nil)
    if src.visible + plan.from_held < count then return nil, plan.from_held + src.visible end
    if count > plan.from_held then pick_read(plan, src, track, jackpot, count - plan.from_held, false) end
    return plan
  end
  -- Gated: parked prizes a reload freed from the rule come first. Jackpots
  -- met on the way move to `held` (they stay first in line) and the next
  -- prize takes their place. Only the prizes read here are touched, so a
  -- draw costs O(count) however many jackpots wait; a long run of jackpots
  -- costs its length, in chunks. A chunk never reads past the prize that
  -- completes the draw: it is no longer than the prizes still missing.
  plan.from_held = held_takes(held_key, math.min(count, held_len), jackpot)
  if src.visible + plan.from_held < count then return nil, held_len + src.visible end
  local need = count - plan.from_held
  while #plan.won < need and plan.used < src.visible do
    pick_read(plan, src, track, jackpot, math.min(need - #plan.won, src.visible - plan.used), true)
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
-- answer's codes and their flat origins, in answer order: prizes from
-- `held` first (plan.from_held of them), then those won.
local function jackpot_take(held_key, plan)
  local codes, origins = plan.won, plan.won_at
  if plan.from_held > 0 then
    codes, origins = {}, {}
    take_held(held_key, plan.from_held, codes, origins)
    for _, code in ipairs(plan.won) do codes[#codes + 1] = code end
    for _, x in ipairs(plan.won_at) do origins[#origins + 1] = x end
  end
  push_all('RPUSH', held_key, plan.parked)
  return codes, origins
end
