-- Creates or updates a pool's settings in Redis, keeping its counters.
--
-- KEYS[1]: pool meta hash
-- ARGV[1]: kind
-- ARGV[2]: config version
-- ARGV[3..]: field, value pairs to set
-- Returns: {"ok", ""}, {"kind", existing_kind} when the id belongs to another
--          kind, or {"stale", version} when a newer version is stored already

local kind = redis.call('HGET', KEYS[1], 'kind')
if kind and kind ~= ARGV[1] then return {'kind', kind} end
local version = tonumber(redis.call('HGET', KEYS[1], 'version')) or 0
if version > tonumber(ARGV[2]) then return {'stale', tostring(version)} end
redis.call('HSET', KEYS[1], 'kind', ARGV[1], 'version', ARGV[2], unpack(ARGV, 3))
-- A meta hash made by a remembered refusal (lib/answer.lua) is the pool's now.
redis.call('PERSIST', KEYS[1])
-- The version's price and asset, for replayed awards (lib/award.lua).
local set = {}
for i = 3, #ARGV - 1, 2 do set[ARGV[i]] = ARGV[i + 1] end
if set.unit_price and set.asset then
  redis.call('HSET', KEYS[1], 'v' .. ARGV[2], set.unit_price .. '|' .. set.asset)
end
for _, f in ipairs({'gen', 'visible', 'stocked', 'drawn', 'max_index', 'cur'}) do
  redis.call('HSETNX', KEYS[1], f, 0)
end
return {'ok', ''}
