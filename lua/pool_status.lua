-- A consistent snapshot of a lucky-gift pool's counters.
--
-- KEYS[1]: pool meta hash
-- KEYS[2]: `held` list
-- KEYS[3]: today's consumption counter
-- ARGV[1..]: meta fields the storages count their drawable prizes from
--            (`visible` for list storage, `max_index` and `cur` for sparse)
-- Returns: {kind, version, gen, stocked, drawn, held, spent_today, storage,
--          {the ARGV fields' values, 0 when absent}}
--          (kind is false when the pool does not exist; storage "" when unset)

local m = redis.call('HMGET', KEYS[1], 'kind', 'version', 'gen', 'stocked', 'drawn', 'storage')
local fields = {}
if #ARGV > 0 then
  for _, v in ipairs(redis.call('HMGET', KEYS[1], unpack(ARGV))) do fields[#fields + 1] = tonumber(v) or 0 end
end
return {m[1], tonumber(m[2]) or 0, tonumber(m[3]) or 0, tonumber(m[4]) or 0,
  tonumber(m[5]) or 0, redis.call('LLEN', KEYS[2]),
  tonumber(redis.call('GET', KEYS[3])) or 0, m[6] or '', fields}
