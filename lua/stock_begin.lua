-- Claims the right to stock the batch after `trigger`.
--
-- KEYS[1]: pool meta hash (gen, visible, due, stock_token, stock_until)
-- KEYS[2]: prize list `q`
-- ARGV[1]: trigger: the batch whose refill point was reached (0: first batch)
-- ARGV[2]: token naming this stocking attempt
-- ARGV[3]: now, unix milliseconds
-- ARGV[4]: lease, milliseconds
-- Returns: {"done", gen}        batch trigger+1 exists already: nothing to do
--          {"ahead", gen}       trigger is past the last batch: a bogus request
--          {"not_due", gen}     no draw took batch `trigger`'s refill flag or found
--                               the pool short: nobody asked for a batch
--          {"busy", wait_ms}    another live attempt holds the lease
--          {"claimed", stale}   the lease is ours; `stale` elements left behind
--                               the visible ones by a dead attempt must be trimmed
--          {"unknown", 0}       no pool under these keys
--
-- One lease per pool, tied to the trigger through `gen`: however many
-- requests arrive for one trigger, one of them stocks and the others find
-- "busy" and then "done".

if not redis.call('HGET', KEYS[1], 'kind') then return {'unknown', 0} end
local trigger = tonumber(ARGV[1])
local now = tonumber(ARGV[3])
local m = redis.call('HMGET', KEYS[1], 'gen', 'visible', 'stock_token', 'stock_until', 'due', 'max_count')
local gen = tonumber(m[1]) or 0
if gen > trigger then return {'done', gen} end
if gen < trigger then return {'ahead', gen} end
-- A batch after the first is due when a draw took the current batch's
-- refill flag or found the pool short (the draw scripts record it in
-- `due`), or an operator asked. Anything else is a forged or stale request.
if trigger > 0 and (tonumber(m[5]) or -1) < trigger then return {'not_due', gen} end
local until_ms = tonumber(m[4]) or 0
if m[3] and m[3] ~= ARGV[2] and until_ms > now then
  return {'busy', until_ms - now}
end
redis.call('HSET', KEYS[1], 'stock_token', ARGV[2], 'stock_until', now + tonumber(ARGV[4]))
return {'claimed', redis.call('LLEN', KEYS[2]) - (tonumber(m[2]) or 0)}
