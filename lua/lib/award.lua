-- A lucky-gift award as its request's answer stores it (after
-- lib/answer.lua): "<serial>|<version>|<trigger, or nothing for none>|<codes>".
-- The unit price and asset are those of the config version, kept once per
-- version in the pool's meta hash ("v<version>" = "<unit_price>|<asset>"),
-- not in every one of a day's millions of answers. The scripts reply with
-- the full body, "<serial>|<version>|<unit_price>|<trigger>|<codes>|<asset>".

-- The stored form of an award; records its version's price and asset.
local function award_stored(meta, serial, version, unit_price, trigger, codes, asset)
  redis.call('HSETNX', meta, 'v' .. version, int(unit_price) .. '|' .. asset)
  local t = ''
  if trigger >= 0 then t = int(trigger) end
  return int(serial) .. '|' .. version .. '|' .. t .. '|' .. codes
end

-- The full body of a stored answer (a refusal, or a full body stored before
-- answers were compacted, is returned as it is).
local function award_body(meta, stored)
  local serial, version, trigger, codes = string.match(stored, '^(%d+)|([^|]*)|(%-?%d*)|([^|]*)$')
  if not serial then return stored end
  local v = redis.call('HGET', meta, 'v' .. version)
  if not v then return stored end
  local unit_price, asset = string.match(v, '^(%d+)|(.*)$')
  if trigger == '' then trigger = '-1' end
  return serial .. '|' .. version .. '|' .. unit_price .. '|' .. trigger .. '|' .. codes .. '|' .. asset
end

-- replay() for a lucky-gift pool: a replayed award comes back in full.
local function replay_award(meta, key, token)
  local seen = replay(key, token)
  if seen and seen[1] == 'dup' then seen[2] = award_body(meta, seen[2]) end
  return seen
end
