-- A lucky-gift award as its request's answer stores it (after
-- lib/answer.lua): byte 1, then serial, version and trigger + 1 (0: none)
-- as base-128 varints (low group first, high bit set on all but the last
-- byte), then the codes and the fairness record as text; or byte 2, the
-- same three varints, the batch and first position of the draw's one run
-- of positions as varints, then the codes (award_stored). Earlier versions
-- stored "<serial>|<version>|<trigger, or nothing for none>|<codes>", which
-- is still read.
-- The unit price and asset are those of the config version, kept once per
-- version in the pool's meta hash ("v<version>" = "<unit_price>|<asset>"),
-- not in every one of a day's millions of answers. The scripts reply with
-- the full body, "<serial>|<version>|<unit_price>|<trigger>|<codes>|<asset>".

-- The codes of an award in draw order, as runs: "<code>" or
-- "<code>*<n>" for n equal codes in a row, comma-separated.
local function codes_text(codes)
  local out = {}
  local i, n = 1, #codes
  while i <= n do
    local j = i
    while j < n and codes[j + 1] == codes[i] do j = j + 1 end
    if j > i then out[#out + 1] = int(codes[i]) .. '*' .. int(j - i + 1) else out[#out + 1] = int(codes[i]) end
    i = j + 1
  end
  return table.concat(out, ',')
end

-- `n` (0 <= n < 2^53) as a base-128 varint, built with one string.char
-- (no table: this runs five times a draw).
local function varint(n)
  if n < 128 then return string.char(n) end
  local b1 = n % 128
  n = (n - b1) / 128
  if n < 128 then return string.char(b1 + 128, n) end
  local b2 = n % 128
  n = (n - b2) / 128
  if n < 128 then return string.char(b1 + 128, b2 + 128, n) end
  local b3 = n % 128
  n = (n - b3) / 128
  if n < 128 then return string.char(b1 + 128, b2 + 128, b3 + 128, n) end
  local bytes = {b1 + 128, b2 + 128, b3 + 128}
  repeat
    local b = n % 128
    n = (n - b) / 128
    if n > 0 then b = b + 128 end
    bytes[#bytes + 1] = b
  until n == 0
  return string.char(unpack(bytes))
end

-- The varint at `pos` of `s`, and the position after it.
local function unvarint(s, pos)
  local n, mul = 0, 1
  while true do
    local b = string.byte(s, pos)
    if not b then return nil, pos end
    pos = pos + 1
    n = n + (b % 128) * mul
    if b < 128 then return n, pos end
    mul = mul * 128
  end
end

-- The stored form of an award: `runs` (codes_text) and the fairness
-- `record` ("/<runs>[/<parked>[/<reveals>]]"). The version's price and
-- asset are written by the pool's load (configure_pool.lua, "v<version>").
-- A draw whose record is one run of positions of one batch (most draws;
-- fair_record then gives its batch `g` and first position `p`) stores byte
-- 2 and that run's batch and first position as varints instead of the
-- record: its length is the number of codes.
local function award_stored(serial, version, trigger, runs, record, g, p)
  local head = varint(serial) .. varint(tonumber(version) or 0) .. varint(trigger + 1)
  if g then return '\2' .. head .. varint(g) .. varint(p) .. runs end
  return '\1' .. head .. runs .. record
end

-- How many codes `runs` (codes_text) stands for.
local function runs_count(runs)
  local n = 0
  for item in string.gmatch(runs, '[^,]+') do n = n + (tonumber(string.match(item, '%*(%d+)$')) or 1) end
  return n
end

-- The full body of a stored answer (a refusal, or a full body stored before
-- answers were compacted, is returned as it is). A version loaded before
-- its load wrote "v<version>" takes the pool's price and asset when it is
-- still the pool's version.
local function award_body(meta, stored)
  local serial, version, trigger, codes
  local form = string.byte(stored, 1)
  if form == 1 or form == 2 then
    local pos, t
    serial, pos = unvarint(stored, 2)
    version, pos = unvarint(stored, pos)
    t, pos = unvarint(stored, pos)
    if not t then return stored end
    serial, version, trigger = int(serial), int(version), int(t - 1)
    if form == 2 then
      local g, p
      g, pos = unvarint(stored, pos)
      p, pos = unvarint(stored, pos)
      if not p then return stored end
      local runs = string.sub(stored, pos)
      codes = runs .. '/' .. int(g) .. '.' .. int(p) .. '.' .. int(runs_count(runs))
    else
      codes = string.sub(stored, pos)
    end
  else
    serial, version, trigger, codes = string.match(stored, '^(%d+)|([^|]*)|(%-?%d*)|([^|]*)$')
    if not serial then return stored end
    if trigger == '' then trigger = '-1' end
  end
  local m = redis.call('HMGET', meta, 'v' .. version, 'version', 'unit_price', 'asset')
  local v = m[1]
  if not v and m[2] == version and m[3] then v = m[3] .. '|' .. (m[4] or 'coin') end
  if not v then return stored end
  local unit_price, asset = string.match(v, '^(%d+)|(.*)$')
  return serial .. '|' .. version .. '|' .. unit_price .. '|' .. trigger .. '|' .. codes .. '|' .. asset
end

-- replay() for a lucky-gift pool: a replayed award comes back in full.
-- `pre` and `at` as for store_open (the draw's HMGET of meta).
local function replay_award(meta, key, token, pre, at)
  local seen = replay(key, token, pre, at)
  if seen and seen[1] == 'dup' then seen[2] = award_body(meta, seen[2]) end
  return seen
end
