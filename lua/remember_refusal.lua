-- Stores a refusal decided outside a pool step (pool_exhausted after the
-- short-pool wait, unknown_pool) as a request's answer, unless the request
-- was answered meanwhile (a concurrent copy): then that answer stands.
--
-- KEYS[1]: the pool's answer store
-- ARGV[1]: the request's answer token
-- ARGV[2]: the refusal, "<code>[:<detail>]"
-- ARGV[3]: "absent" to store it only while the pool is not there (an
--          unknown_pool decided before the pool's load finished); optional
-- Returns: {"refused", code, 0} when stored now, the stored answer as
--          replay gives it ({"dup", body, 0}), or {"retry", "", 0} when the
--          pool is there now ("absent" only): nothing stored, route again

local seen = replay(KEYS[1], ARGV[1])
if seen then return seen end
local kind = redis.call('HGET', meta_of(KEYS[1]), 'kind')
if kind and ARGV[3] == 'absent' then return {'retry', '', 0} end
-- For a pool that is not there, the store's meta hash expires with it.
if not kind then OPEN[KEYS[1] .. ARGV[1]].ephemeral = true end
return refuse(KEYS[1], ARGV[1], 0, ARGV[2])
