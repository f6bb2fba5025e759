-- A consistent snapshot of a lucky-gift pool's counters.
--
-- KEYS[1]: pool meta hash
-- KEYS[2]: `held` list
-- KEYS[3]: today's consumption counter
-- Returns: {kind, version, gen, stocked, drawn, visible, held, spent_today}
--          (kind is false when the pool does not exist)

local m = redis.call('HMGET', KEYS[1], 'kind', 'version', 'gen', 'stocked', 'drawn', 'visible',
  'storage', 'max_index', 'cur')
local visible = tonumber(m[6]) or 0
-- Sparse pools count drawable prizes by index range instead.
if m[7] == 'sparse' then visible = (tonumber(m[8]) or 0) - (tonumber(m[9]) or 0) end
return {m[1], tonumber(m[2]) or 0, tonumber(m[3]) or 0, tonumber(m[4]) or 0,
  tonumber(m[5]) or 0, visible, redis.call('LLEN', KEYS[2]),
  tonumber(redis.call('GET', KEYS[3])) or 0}
