-- Prelude of every script that answers a request (prepended by scripts.rs).
--
-- A request's result key holds "<fingerprint>;<body>": the fingerprint of
-- what the request asked (kind, pool, user, count), so an id reused with
-- other content is refused instead of replaying or drawing, and the body of
-- its first answer: a kind's award, or "!<code>[:<detail>]" for a refusal.
-- Every final answer is remembered, refusals included, so a request once
-- told "no" never draws later.

-- The first answer of a request, if it has one: {"dup", body, 0}, or
-- {"reused", "", 0} when the id was first used for other content.
local function replay(key, fp)
  local prev = redis.call('GET', key)
  if not prev then return nil end
  local at = string.find(prev, ';', 1, true)
  if not at or string.sub(prev, 1, at - 1) ~= fp then return {'reused', '', 0} end
  return {'dup', string.sub(prev, at + 1), 0}
end

-- Records the answer `body` of a request.
local function remember(key, fp, body, ttl)
  redis.call('SET', key, fp .. ';' .. body, 'EX', tonumber(ttl))
end

-- Records and returns a refusal; `code` is an error code of the wire
-- contract, optionally followed by ":<detail>".
local function refuse(key, fp, ttl, code)
  remember(key, fp, '!' .. code, ttl)
  return {'refused', code, 0}
end

-- An integer as decimal digits. Lua's tostring writes 1e+14 and above in
-- exponent notation, which neither Redis nor the Rust side read as an integer.
local function int(n)
  return string.format('%d', n)
end

-- Pushes `items` onto `key` with `cmd` (RPUSH or LPUSH) in chunks, in order:
-- `unpack` fails past a few thousand values.
local function push_all(cmd, key, items)
  local n = #items
  local i = 1
  while i <= n do
    local j = math.min(i + 999, n)
    redis.call(cmd, key, unpack(items, i, j))
    i = j + 1
  end
end

-- Consumption counters saturate here, far above any jackpot threshold, so
-- they never overflow nor lose exactness (2^52 < 2^53).
local SPENT_CAP = 4503599627370496

