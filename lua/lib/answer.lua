-- Prelude of every script that answers a request (prepended by scripts.rs).
--
-- Every final answer is remembered, refusals included, so a request once
-- told "no" never draws later; and every answer is bound to what its request
-- asked, so an id reused with other content is refused instead of replaying
-- or drawing.
--
-- Where answers live. Millions of answers are kept for a day, so each costs
-- a few dozen bytes, not a key of its own: answers sit in small hashes
-- ("buckets", listpack-encoded by Redis while they hold at most 128 short
-- fields) that expire whole. Time is cut into slices of a quarter of the
-- answer TTL; an answer goes into a bucket of the current slice, and that
-- bucket expires a TTL after its slice ends, so an answer is kept at least
-- the TTL and at most a quarter longer. A lookup probes the current slice
-- and the four before it. The number of buckets of a slice grows with the
-- traffic (doubling once the buckets of the current size average
-- PER_BUCKET answers, and starting from what the previous slice needed); a
-- meta hash (the store key, KEYS[n] of the script) keeps per slice its
-- answer count, the smallest and largest bucket counts used, and the
-- answers in buckets of the largest:
--   <store>               hash: n<slice>, lo<slice>, hi<slice>, c<slice>
--   <store>:<slice>:<size>:<i>   hash: <field> -> <value>, i = selector mod size
--
-- A request comes as a token built by the Rust side (src/kinds/answer.rs):
--   "<ttl s>:<selector>:" .. field .. fingerprint .. request id
-- with field and fingerprint bytes of a hash of the request id and of its
-- content (6 and 2 bytes for answers: the claim, with 8 and 8, has told the
-- ids and contents apart already). An answer's value is
-- fingerprint .. body, where body is a kind's award or "!<code>[:<detail>]".

local PER_BUCKET = 80
local SLICES_BACK = 4
-- Bytes of the id hash and of the content fingerprint in an answer token.
local ANSWER_FIELD, ANSWER_PRINT = 6, 2

-- The store of `key` for `token`, whose field is `flen` bytes and
-- fingerprint `plen` bytes.
local function store_of(key, token, flen, plen)
  local ttl, sel, rest = string.match(token, '^(%d+):(%d+):(.*)$')
  ttl = tonumber(ttl)
  local len = math.ceil(ttl / 4)
  return {
    key = key, ttl = ttl, sel = tonumber(sel), len = len,
    cur = math.floor(tonumber(redis.call('TIME')[1]) / len),
    field = string.sub(rest, 1, flen),
    fp = string.sub(rest, flen + 1, flen + plen),
    id = string.sub(rest, flen + plen + 1),
  }
end

local function bucket_of(s, slice, size)
  return s.key .. ':' .. string.format('%d:%d:%d', slice, size, s.sel % size)
end

-- The stored value of the store's field and the bucket holding it, if any.
local function lookup(s)
  local names = {}
  for back = 0, SLICES_BACK do
    names[#names + 1] = 'lo' .. string.format('%d', s.cur - back)
    names[#names + 1] = 'hi' .. string.format('%d', s.cur - back)
  end
  local m = redis.call('HMGET', s.key, unpack(names))
  for back = 0, SLICES_BACK do
    local lo, size = tonumber(m[2 * back + 1]), tonumber(m[2 * back + 2])
    while lo and size and size >= lo do
      local bucket = bucket_of(s, s.cur - back, size)
      local v = redis.call('HGET', bucket, s.field)
      if v then return v, bucket end
      size = size / 2
    end
  end
  return nil
end

-- Stores `value` under the store's field in the current slice.
local function store(s, value)
  local k = string.format('%d', s.cur)
  redis.call('HINCRBY', s.key, 'n' .. k, 1)
  local m = redis.call('HMGET', s.key, 'hi' .. k, 'c' .. k)
  local size, held = tonumber(m[1]), tonumber(m[2]) or 0
  if not size then
    -- The slice's first answer: as many buckets as the previous slice needed.
    local before = tonumber(redis.call('HGET', s.key, 'n' .. string.format('%d', s.cur - 1))) or 0
    size = 1
    while size * PER_BUCKET < before do size = size * 2 end
    local gone = string.format('%d', s.cur - SLICES_BACK - 1)
    redis.call('HDEL', s.key, 'n' .. gone, 'lo' .. gone, 'hi' .. gone, 'c' .. gone)
    redis.call('HSET', s.key, 'lo' .. k, size, 'hi' .. k, size, 'c' .. k, 1)
    redis.call('EXPIRE', s.key, s.ttl + (SLICES_BACK + 2) * s.len)
  elseif held >= size * PER_BUCKET then
    -- This size's buckets hold PER_BUCKET answers each on average: the
    -- next answers go to twice as many.
    size = size * 2
    redis.call('HSET', s.key, 'hi' .. k, size, 'c' .. k, 1)
  else
    redis.call('HINCRBY', s.key, 'c' .. k, 1)
  end
  local bucket = bucket_of(s, s.cur, size)
  redis.call('HSET', bucket, s.field, value)
  redis.call('EXPIREAT', bucket, (s.cur + 1) * s.len + s.ttl)
end

local function hex(bytes)
  return (string.gsub(bytes, '.', function(c) return string.format('%02x', string.byte(c)) end))
end

-- The first answer of a request, if it has one: {"dup", body, 0}, or
-- {"reused", "", 0} when the id was first used for other content. `key` is
-- the pool's answer store, `token` the request's.
local function replay(key, token)
  local s = store_of(key, token, ANSWER_FIELD, ANSWER_PRINT)
  local prev = lookup(s)
  local fp, body
  if prev then
    fp, body = string.sub(prev, 1, ANSWER_PRINT), string.sub(prev, ANSWER_PRINT + 1)
  else
    -- An answer stored before answers moved into buckets: a key of its own,
    -- the pool's "...:r:<request id>" (the store key minus its last letter,
    -- then the id), holding "<hex fingerprint>;<body>". Such keys expire
    -- one answer TTL after the upgrade; until then they are replayed.
    local legacy = redis.call('GET', string.sub(key, 1, -2) .. ':' .. s.id)
    if not legacy then return nil end
    local at = string.find(legacy, ';', 1, true)
    if not at then return {'reused', '', 0} end
    fp, body = string.sub(legacy, 1, 2 * ANSWER_PRINT), string.sub(legacy, at + 1)
    if fp ~= hex(s.fp) then return {'reused', '', 0} end
    return {'dup', body, 0}
  end
  if fp ~= s.fp then return {'reused', '', 0} end
  return {'dup', body, 0}
end

-- Records the answer `body` of a request. (`ttl` is the token's; the
-- argument stays for the scripts' sake.)
local function remember(key, token, body, ttl)
  local s = store_of(key, token, ANSWER_FIELD, ANSWER_PRINT)
  store(s, s.fp .. body)
end

-- Records and returns a refusal; `code` is an error code of the wire
-- contract, optionally followed by ":<detail>".
local function refuse(key, token, ttl, code)
  remember(key, token, '!' .. code, ttl)
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

