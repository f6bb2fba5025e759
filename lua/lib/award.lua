-- A lucky-gift award as its request's answer stores it (after
-- lib/answer.lua): "<serial>|<version>|<trigger, or nothing for none>|<codes>".
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

-- The stored form of an award. The version's price and asset are written
-- by the pool's load (configure_pool.lua, "v<version>").
local function award_stored(serial, version, trigger, codes)
  local t = ''
  if trigger >= 0 then t = int(trigger) end
  return int(serial) .. '|' .. version .. '|' .. t .. '|' .. codes
end

-- The full body of a stored answer (a refusal, or a full body stored before
-- answers were compacted, is returned as it is). A version loaded before
-- its load wrote "v<version>" takes the pool's price and asset when it is
-- still the pool's version.
local function award_body(meta, stored)
  local serial, version, trigger, codes = string.match(stored, '^(%d+)|([^|]*)|(%-?%d*)|([^|]*)$')
  if not serial then return stored end
  local m = redis.call('HMGET', meta, 'v' .. version, 'version', 'unit_price', 'asset')
  local v = m[1]
  if not v and m[2] == version and m[3] then v = m[3] .. '|' .. (m[4] or 'coin') end
  if not v then return stored end
  local unit_price, asset = string.match(v, '^(%d+)|(.*)$')
  if trigger == '' then trigger = '-1' end
  return serial .. '|' .. version .. '|' .. unit_price .. '|' .. trigger .. '|' .. codes .. '|' .. asset
end

-- replay() for a lucky-gift pool: a replayed award comes back in full.
-- `pre` and `at` as for store_open (the draw's HMGET of meta).
local function replay_award(meta, key, token, pre, at)
  local seen = replay(key, token, pre, at)
  if seen and seen[1] == 'dup' then seen[2] = award_body(meta, seen[2]) end
  return seen
end
