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
--   fields                      the storage's meta writes (name, value, ...)
local function draw_award(d)
  local fields = d.fields
  local record, g, p = fair_record(d.meta, d.track, d.hgen0, d.origins, d.from_held, d.parked_at,
    d.next_pos, fields, d.read_at, d.jackpot_min)
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
