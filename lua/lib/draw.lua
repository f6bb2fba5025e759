-- The frame every lucky-gift draw script shares, whatever its storage
-- (a prelude of the draw scripts' libraries, src/scripts/, after lib/answer.lua, lib/award.lua and
-- lib/jackpot.lua): the short answer and the writes that end an award.
--
-- A storage's draw script reads its meta fields, checks the request, asks
-- gate() whether jackpots are open, hands jackpot_pick() a reader of its
-- prizes and, for a plan, makes its own writes (what marks its prizes as
-- drawn, the refill flag taken) between jackpot_take() and draw_award().

-- A short answer: fewer than the asked prizes are drawable and no prize
-- moved. It makes the current batch `gen` due for its successor, like a
-- taken refill flag: the draw's urgent refill request will be honoured, a
-- forged one (no short draw, no flag) will not. `due` is meta's `due`.
local function draw_short(meta_key, gen, due, in_pool)
  if gen > (tonumber(due) or -1) then redis.call('HSET', meta_key, 'due', int(gen)) end
  return {'short', int(in_pool), gen}
end

-- The realised return to player (docs/operations.md, "Realised against
-- configured"): every prize paid is tallied against the batch it came
-- from, in the pool's meta, and a batch's tally joins its config version's
-- totals when its seed is revealed (the draw that leaves none of its
-- prizes in the pool, lib/jackpot.lua), so completed batches are counted
-- whole, exactly, once. Only first answers reach draw_award, so a replay
-- tallies nothing. Meta fields:
--   `mults`          "<m0>,<m1>,...": the multiplier of each code, by code
--                    (written by every `pool load`; absent: no tally)
--   `tally`          "<from>|<g>|<prizes>|<paid>": batches from `from` on
--                    are tallied; batch g is the running one (read and
--                    written with the draw's own HMGET and HSET, so a draw
--                    within one batch costs no command more)
--   `tp:<g>` `tm:<g>` prizes and multipliers paid of another batch still
--                    open (the batch a draw moved on from, or one whose
--                    parked jackpots are paid from `held`)
--   `rtp:<v>`        "<batches>|<prizes>|<paid>" over the completed
--                    batches of config version v
-- A pool that had drawn before its first tally starts with its next batch
-- (the running one is part drawn); batch 0 (stocked before batches were
-- committed) is never tallied.

-- Each code's multiplier (`mults` read as a table, code 0 first). A
-- pool's `mults` changes only with a load: its table is kept between calls
-- (parsing it on every draw cost more than the tally itself).
local MULTS, mults_kept = {}, 0
local function multipliers(mults)
  local mult = MULTS[mults]
  if mult then return mult end
  mult = {}
  local k = 0
  for x in string.gmatch(mults, '[^,]+') do
    mult[k] = tonumber(x) or 0
    k = k + 1
  end
  if mults_kept >= 256 then MULTS, mults_kept = {}, 0 end
  MULTS[mults], mults_kept = mult, mults_kept + 1
  return mult
end

-- Tallies the prizes of an award (`codes` with their flat `origins`).
-- Returns the running tally {from, g, prizes, paid} to write, or nil for a
-- pool without `mults`.
local function tally_draw(mults, tally, drawn, hgen0, meta_key, codes, origins)
  if not mults then return nil end
  local from, tg, tp, tm = string.match(tally or '', '^(%d+)|(%d+)|(%d+)|(%d+)$')
  if from then
    from, tg, tp, tm = tonumber(from), tonumber(tg), tonumber(tp), tonumber(tm)
  else
    from = ((tonumber(drawn) or 0) == 0) and 1 or hgen0 + 1
    tg, tp, tm = 0, 0, 0
  end
  local mult = multipliers(mults)
  -- Prizes of batches other than the running one, by batch.
  local others, order, top = {}, {}, tg
  for i = 1, #codes do
    local g = origins[2 * i - 1]
    if g >= from and g > 0 then
      -- A code past `mults` pays what its decoder says; tallied as 0 it
      -- shows as a departure, which it is.
      local m = mult[codes[i]] or 0
      if g == tg then
        tp, tm = tp + 1, tm + m
      else
        local o = others[g]
        if not o then
          o = {0, 0}
          others[g] = o
          order[#order + 1] = g
        end
        o[1], o[2] = o[1] + 1, o[2] + m
        if g > top then top = g end
      end
    end
  end
  if top ~= tg then
    -- The draw moved on to a newer batch: it runs now, the old one waits
    -- in `tp:`/`tm:` for its reveal.
    others[tg] = {tp, tm}
    order[#order + 1] = tg
    tg, tp, tm = top, others[top][1], others[top][2]
    others[top] = nil
  end
  for _, g in ipairs(order) do
    local o = others[g]
    if o and g > 0 and o[1] > 0 then
      redis.call('HINCRBY', meta_key, 'tp:' .. int(g), o[1])
      redis.call('HINCRBY', meta_key, 'tm:' .. int(g), o[2])
    end
  end
  return {from = from, g = tg, prizes = tp, paid = tm}
end

-- Adds each batch the draw completed (`revealed`: g1, v1, g2, v2, ...) to
-- its version's totals `rtp:<v>`, taking its tally out of the running one
-- or `tp:`/`tm:`. Rare: once per batch.
local function tally_reveals(meta_key, tally, revealed)
  for k = 1, #revealed, 2 do
    local g, v = revealed[k], revealed[k + 1]
    if g >= tally.from then
      local p, m = 0, 0
      if g == tally.g then
        p, m = tally.prizes, tally.paid
        tally.prizes, tally.paid = 0, 0
      end
      local spilt = redis.call('HMGET', meta_key, 'tp:' .. int(g), 'tm:' .. int(g))
      if spilt[1] then
        p, m = p + (tonumber(spilt[1]) or 0), m + (tonumber(spilt[2]) or 0)
        redis.call('HDEL', meta_key, 'tp:' .. int(g), 'tm:' .. int(g))
      end
      local b0, p0, m0 = string.match(redis.call('HGET', meta_key, 'rtp:' .. int(v)) or '',
        '^(%d+)|(%d+)|(%d+)$')
      redis.call('HSET', meta_key, 'rtp:' .. int(v), int((tonumber(b0) or 0) + 1) .. '|'
        .. int((tonumber(p0) or 0) + p) .. '|' .. int((tonumber(m0) or 0) + m))
    end
  end
end

-- The last writes of an awarded draw, after the storage's own: the
-- fairness record, then one HSET of the pool's meta (the serial, the refill
-- point taken, the day's consumption, the `held` count, the batch pointer
-- and the storage's own fields); then the answer is stored and returned.
-- `d` holds:
--   meta, result, spent_key     KEYS: meta hash, answer store, day counter
--   token, result_ttl           the request's token and answer TTL
--   version, asset, due         meta's `version`, `asset`, `due` (raw)
--   drawn                       meta's `drawn` before this draw
--   unit_price, count, spent    the price, the prizes drawn, gate()'s field
--   held_n, held_was            `held` after the draw; meta's `held_n` (raw)
--   trigger                     the batch whose refill flag was taken, or -1
--   codes, origins, from_held   jackpot_take()'s answer (origins flat), and
--                               how many of its prizes came from `held`
--   parked_at, read_at          the plan's parks (flat origins) and reads
--   jackpot_min                 meta's `jackpot_min` (raw)
--   track, hgen0, next_pos      the positions() tracker, meta's `hgen`, and
--                               the running position after the draw
--   mults, tally                meta's `mults` and `tally` (raw), for
--                               tally_draw
--   fields                      the storage's meta writes (name, value, ...)
local function draw_award(d)
  local fields = d.fields
  local tally = tally_draw(d.mults, d.tally, d.drawn, d.hgen0, d.meta, d.codes, d.origins)
  local record, g, p = fair_record(d.meta, d.track, d.hgen0, d.origins, d.from_held, d.parked_at,
    d.next_pos, fields, d.read_at, d.jackpot_min)
  if tally then
    if d.track.revealed then tally_reveals(d.meta, tally, d.track.revealed) end
    fields[#fields + 1] = 'tally'
    fields[#fields + 1] = int(tally.from) .. '|' .. int(tally.g) .. '|' .. int(tally.prizes) .. '|'
      .. int(tally.paid)
  end
  local serial = (tonumber(d.drawn) or 0) + d.count
  fields[#fields + 1] = 'drawn'
  fields[#fields + 1] = int(serial)
  fields[#fields + 1] = 'spent'
  fields[#fields + 1] = d.spent
  -- The batch whose refill point this draw took is due for its successor:
  -- a refill request for any later batch is refused.
  if d.trigger > (tonumber(d.due) or -1) then
    fields[#fields + 1] = 'due'
    fields[#fields + 1] = int(d.trigger)
  end
  if tonumber(d.held_was) ~= d.held_n then
    fields[#fields + 1] = 'held_n'
    fields[#fields + 1] = int(d.held_n)
  end
  redis.call('HSET', d.meta, unpack(fields))
  local version, asset = d.version or '0', d.asset or 'coin'
  local runs = codes_text(d.codes)
  local codes = runs .. record
  local body = int(serial) .. '|' .. version .. '|' .. int(d.unit_price) .. '|' .. int(d.trigger) .. '|'
    .. codes .. '|' .. asset
  -- The fairness record travels inside the codes field of the stored form.
  remember(d.result, d.token, award_stored(serial, version, d.trigger, runs, record, g, p), d.result_ttl)
  return {'ok', body, 0}
end
