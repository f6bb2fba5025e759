-- Prelude of every lottery strategy's draw script, after lib/answer.lua
-- (the prelude of its scripts' function libraries, src/scripts/). KEYS and ARGV as draw_wheel.lua lists them.

-- Counts today's visit (PV) and visitor (UV HyperLogLog). The day's first
-- visit creates both keys and sets their expiry.
local function count_visit()
  local first = redis.call('INCR', KEYS[6]) == 1
  redis.call('PFADD', KEYS[7], ARGV[1])
  if first then
    redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
    redis.call('EXPIRE', KEYS[7], tonumber(ARGV[5]))
  end
end

-- The checks every strategy shares, before its pick: the request's stored
-- answer, the activity, its window and the user's chances. Returns the
-- activity's meta {kind, starts_at, ends_at, prizes, consolation}, or nil and
-- the reply to give (a replay, or a remembered refusal).
local function lottery_gate()
  local m = redis.call('HMGET', KEYS[1], 'kind', 'starts_at', 'ends_at', 'prizes', 'consolation',
    unpack(STORE_FIELDS))
  local seen = replay(KEYS[5], ARGV[6], m, 6)
  if seen then return nil, seen end
  if m[1] ~= 'lottery' then return nil, refuse_unknown(KEYS[5], ARGV[6], ARGV[4], m[1]) end
  local now = tonumber(ARGV[2])
  local refusal = nil
  if now < tonumber(m[2]) then
    refusal = 'not_started'
  elseif now >= tonumber(m[3]) then
    refusal = 'ended'
  elseif (tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0) <= 0 then
    refusal = 'no_chances'
  end
  if refusal then
    count_visit()
    return nil, refuse(KEYS[5], ARGV[6], ARGV[4], refusal)
  end
  return m
end

-- Awards `prize` (taking one of its stock when `finite`): spends the chance,
-- remembers the answer "<serial>[~<record>]|<prize>|<chances left>" and
-- returns it. The serial counts the activity's awards: it names this draw
-- for ever (the ledger entry id), even once the request id's answer has
-- expired. `record`, when the pick was random, is
-- "<random value>;<prize>:<weight>,...": the value it used and the
-- candidates in the order it walked them, so the award can be recomputed.
local function lottery_award(prize, finite, record)
  count_visit()
  local serial = redis.call('HINCRBY', KEYS[1], 'awards', 1)
  if finite then redis.call('HINCRBY', KEYS[3], prize, -1) end
  redis.call('HINCRBY', KEYS[4], prize, 1)
  local left = redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
  local body = int(serial) .. (record and ('~' .. record) or '') .. '|' .. prize .. '|' .. int(left)
  remember(KEYS[5], ARGV[6], body, ARGV[4])
  return {'ok', body, 0}
end

