-- Stocking steps for sparse pools; the lease works as in stock_begin.lua.
--
-- KEYS[1]: pool meta hash (gen, max_index, stock_token, stock_until, staged_n, staged_hi)
-- KEYS[2]: `sp` hash of stored prizes
-- KEYS[3]: `seg` sorted set of combo runs
-- KEYS[4]: `flags` sorted set
-- ARGV[1]: step: "begin", "trim", "push" or "commit"
-- ARGV[2]: token
-- begin:  ARGV[3] trigger, ARGV[4] now ms, ARGV[5] lease ms
--         -> {"claimed", first index} | {"done", gen} | {"busy", wait ms} | {"ahead", gen}
--            | {"not_due", gen} (as in stock_begin.lua) | {"unknown", 0}
-- trim:   ARGV[3] most buckets to clean, ARGV[4] bucket size
--         -> {"ok", buckets still to clean} | {"lost", 0}
-- push:   ARGV[3] now ms, ARGV[4] lease ms, then bucket, "<off>.<code>;..." pairs
--         -> {"ok", prizes staged} | {"lost", 0}
-- commit: ARGV[3] trigger, ARGV[4] batch size, ARGV[5] non-zero prizes expected,
--         ARGV[6] flagged index, ARGV[7] seed hex (the one fair_seed.lua chose),
--         ARGV[8] config version, then combo-run members "<start>:<zero code>"
--         -> {"ok", gen} | {"lost", 0} | {"mismatch", staged}
--
-- Staged prizes sit at indices >= max_index, which draws never read, so a
-- batch appears all at once when commit raises max_index.

local step = ARGV[1]
local m = redis.call('HMGET', KEYS[1], 'kind', 'gen', 'max_index', 'stock_token', 'stock_until', 'staged_n', 'staged_hi', 'due', 'fair_next')
if m[1] ~= 'lucky_gift' then return {'unknown', 0} end
local gen = tonumber(m[2]) or 0
local max_index = tonumber(m[3]) or 0

if step == 'begin' then
  local trigger, now = tonumber(ARGV[3]), tonumber(ARGV[4])
  if gen > trigger then return {'done', gen} end
  if gen < trigger then return {'ahead', gen} end
  if trigger > 0 and (tonumber(m[8]) or -1) < trigger then return {'not_due', gen} end
  local until_ms = tonumber(m[5]) or 0
  if m[4] and m[4] ~= ARGV[2] and until_ms > now then return {'busy', until_ms - now} end
  redis.call('HSET', KEYS[1], 'stock_token', ARGV[2], 'stock_until', now + tonumber(ARGV[5]))
  return {'claimed', max_index}
end

if m[4] ~= ARGV[2] then return {'lost', 0} end

if step == 'trim' then
  -- Remove what a dead attempt staged: entries at or above max_index.
  local B = tonumber(ARGV[4])
  local hi = tonumber(m[7]) or -1
  local lo = math.floor(max_index / B)
  local budget = tonumber(ARGV[3])
  while hi >= lo and budget > 0 do
    if hi > lo then
      redis.call('HDEL', KEYS[2], hi)
    else
      local v = redis.call('HGET', KEYS[2], hi)
      if v then
        local keep = {}
        for off, code in string.gmatch(v, '(%d+)%.(%d+);') do
          if hi * B + tonumber(off) < max_index then keep[#keep + 1] = off .. '.' .. code .. ';' end
        end
        if #keep > 0 then redis.call('HSET', KEYS[2], hi, table.concat(keep)) else redis.call('HDEL', KEYS[2], hi) end
      end
    end
    hi = hi - 1
    budget = budget - 1
  end
  if hi < lo then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], max_index, '+inf')
    redis.call('ZREMRANGEBYSCORE', KEYS[4], max_index, '+inf')
    redis.call('HSET', KEYS[1], 'staged_n', 0, 'staged_hi', -1)
    return {'ok', 0}
  end
  redis.call('HSET', KEYS[1], 'staged_hi', hi)
  return {'ok', hi - lo + 1}
end

if step == 'push' then
  local staged = tonumber(m[6]) or 0
  local hi = tonumber(m[7]) or -1
  for i = 5, #ARGV, 2 do
    local b = tonumber(ARGV[i])
    local v = redis.call('HGET', KEYS[2], b) or ''
    redis.call('HSET', KEYS[2], b, v .. ARGV[i + 1])
    local _, n = string.gsub(ARGV[i + 1], ';', '')
    staged = staged + n
    if b > hi then hi = b end
  end
  redis.call('HSET', KEYS[1], 'staged_n', staged, 'staged_hi', hi, 'stock_until', tonumber(ARGV[3]) + tonumber(ARGV[4]))
  return {'ok', staged}
end

if step == 'commit' then
  if gen ~= tonumber(ARGV[3]) then return {'lost', 0} end
  local next_gen = string.format('%d', gen + 1)
  if m[9] ~= next_gen .. '|' .. ARGV[7] then return {'lost', 0} end
  local staged = tonumber(m[6]) or 0
  if staged ~= tonumber(ARGV[5]) then return {'mismatch', staged} end
  -- The fairness record (lib/jackpot.lua): the batch starts at index
  -- max_index; its seed stays until the reveal.
  redis.call('HSET', KEYS[1], 'bstart:' .. next_gen, string.format('%d', max_index),
    'c:' .. next_gen, ARGV[8] .. '|' .. ARGV[7])
  redis.call('HSETNX', KEYS[1], 'hgen', string.format('%d', gen))
  redis.call('HDEL', KEYS[1], 'fair_next')
  for i = 9, #ARGV do
    redis.call('ZADD', KEYS[3], tonumber(string.match(ARGV[i], '^(%d+):')), ARGV[i])
  end
  redis.call('ZADD', KEYS[4], tonumber(ARGV[6]), gen + 1)
  local size = tonumber(ARGV[4])
  redis.call('HINCRBY', KEYS[1], 'max_index', size)
  redis.call('HINCRBY', KEYS[1], 'stocked', size)
  redis.call('HSET', KEYS[1], 'staged_n', 0, 'staged_hi', -1)
  local g = redis.call('HINCRBY', KEYS[1], 'gen', 1)
  redis.call('HDEL', KEYS[1], 'stock_token', 'stock_until')
  return {'ok', g}
end
return redis.error_reply('unknown step ' .. tostring(step))
