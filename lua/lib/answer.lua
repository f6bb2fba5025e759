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
-- and the four before it: one bucket each.
--
-- A slice's buckets grow by linear hashing, so that a lookup reads exactly
-- one bucket per slice however the traffic grew: with n buckets (2^L <= n
-- < 2^(L+1)) a field whose hash is h lives in bucket h mod 2^(L+1), or
-- h mod 2^L when that is n or more. Once the slice holds more than
-- PER_BUCKET answers per bucket, bucket n - 2^L splits: the answers of it
-- whose h mod 2^(L+1) is n move to a new bucket n. One split of about
-- PER_BUCKET answers per PER_BUCKET answers stored keeps the load near
-- PER_BUCKET, and the buckets waiting for their split (up to twice that)
-- under Redis's listpack limit of 128. A slice starts with as many
-- buckets as the previous slice ended with. h is the first three bytes of
-- the field, so a split can compute it from what a bucket holds. The store
-- key (KEYS[n] of the script) keeps per slice its bucket count and its
-- answer count:
--   <store>               hash: b<slice>, c<slice>
--   <store>:<slice>:<i>   hash: <field> -> <value>
-- Buckets of the layout before (per slice sizes doubling, fields
-- n/lo/hi/c, buckets <store>:<slice>:<size>:<selector mod size>) are still
-- read until they expire.
--
-- A request comes as a token built by the Rust side (src/kinds/answer.rs):
--   "<ttl s>:<selector>:" .. field .. fingerprint .. request id
-- with field and fingerprint bytes of a hash of the request id and of its
-- content (6 and 2 bytes for answers: the claim, with 8 and 8, has told the
-- ids and contents apart already). An answer's value is
-- fingerprint .. body, where body is a kind's award or "!<code>[:<detail>]".

local PER_BUCKET = 40
local SLICES_BACK = 4
-- The hash of a field has 24 bits: a slice has at most this many buckets.
local MAX_BUCKETS = 16777216
-- Bytes of the id hash and of the content fingerprint in an answer token.
local ANSWER_FIELD, ANSWER_PRINT = 6, 2

-- Where a field lives among a slice's buckets.
local function hash_of(field)
  local a, b, c = string.byte(field, 1, 3)
  return ((a or 0) * 256 + (b or 0)) * 256 + (c or 0)
end

-- 2^L for a slice of n buckets (2^L <= n < 2^(L+1)).
local function level_of(n)
  local p = 1
  while p * 2 <= n do p = p * 2 end
  return p
end

-- The bucket of hash h among n.
local function index_of(h, n)
  local p = level_of(n)
  local i = h % (2 * p)
  if i >= n then i = h % p end
  return i
end

-- The store of `key` for `token`, whose field is `flen` bytes and
-- fingerprint `plen` bytes.
local function store_of(key, token, flen, plen)
  local ttl, sel, rest = string.match(token, '^(%d+):(%d+):(.*)$')
  ttl = tonumber(ttl)
  local len = math.ceil(ttl / 4)
  local field = string.sub(rest, 1, flen)
  return {
    key = key, ttl = ttl, sel = tonumber(sel), len = len,
    cur = math.floor(tonumber(redis.call('TIME')[1]) / len),
    field = field, h = hash_of(field),
    fp = string.sub(rest, flen + 1, flen + plen),
    id = string.sub(rest, flen + plen + 1),
  }
end

local function bucket_at(s, slice, i)
  return s.key .. ':' .. string.format('%d:%d', slice, i)
end

-- The stored value of the store's field and the bucket holding it, if any.
local function lookup(s)
  local names = {}
  for back = 0, SLICES_BACK do
    local k = string.format('%d', s.cur - back)
    names[#names + 1] = 'b' .. k
    names[#names + 1] = 'lo' .. k
    names[#names + 1] = 'hi' .. k
  end
  local m = redis.call('HMGET', s.key, unpack(names))
  for back = 0, SLICES_BACK do
    local slice = s.cur - back
    local n = tonumber(m[3 * back + 1])
    if n then
      local bucket = bucket_at(s, slice, index_of(s.h, n))
      local v = redis.call('HGET', bucket, s.field)
      if v then return v, bucket end
    end
    local lo, size = tonumber(m[3 * back + 2]), tonumber(m[3 * back + 3])
    while lo and size and size >= lo do
      local bucket = s.key .. ':' .. string.format('%d:%d:%d', slice, size, s.sel % size)
      local v = redis.call('HGET', bucket, s.field)
      if v then return v, bucket end
      size = size / 2
    end
  end
  return nil
end

-- Splits bucket n - 2^L of slice `slice` (of n buckets) into itself and a
-- new bucket n.
local function split(s, slice, n, expires)
  local p = level_of(n)
  local from = bucket_at(s, slice, n - p)
  local all = redis.call('HGETALL', from)
  local moved, gone = {}, {}
  for i = 1, #all, 2 do
    if hash_of(all[i]) % (2 * p) == n then
      moved[#moved + 1] = all[i]
      moved[#moved + 1] = all[i + 1]
      gone[#gone + 1] = all[i]
    end
  end
  if #gone > 0 then
    local to = bucket_at(s, slice, n)
    redis.call('HSET', to, unpack(moved))
    redis.call('EXPIREAT', to, expires)
    redis.call('HDEL', from, unpack(gone))
  end
end

-- Stores `value` under the store's field in the current slice.
local function store(s, value)
  local k = string.format('%d', s.cur)
  local expires = (s.cur + 1) * s.len + s.ttl
  local m = redis.call('HMGET', s.key, 'b' .. k, 'c' .. k)
  local n, held = tonumber(m[1]), tonumber(m[2]) or 0
  if not n then
    -- The slice's first answer: as many buckets as the previous slice
    -- ended with (its answer count was n<slice> in the layout before).
    local p = string.format('%d', s.cur - 1)
    local before = redis.call('HMGET', s.key, 'n' .. p, 'c' .. p)
    local prev = tonumber(before[1]) or tonumber(before[2]) or 0
    n = math.max(1, math.min(MAX_BUCKETS, math.ceil(prev / PER_BUCKET)))
    local gone = string.format('%d', s.cur - SLICES_BACK - 1)
    redis.call('HDEL', s.key, 'b' .. gone, 'n' .. gone, 'lo' .. gone, 'hi' .. gone, 'c' .. gone)
    redis.call('HSET', s.key, 'b' .. k, n, 'c' .. k, 1)
    redis.call('EXPIRE', s.key, s.ttl + (SLICES_BACK + 2) * s.len)
  elseif held + 1 > n * PER_BUCKET and n < MAX_BUCKETS then
    split(s, s.cur, n, expires)
    n = n + 1
    redis.call('HSET', s.key, 'b' .. k, n, 'c' .. k, held + 1)
  else
    redis.call('HINCRBY', s.key, 'c' .. k, 1)
  end
  local bucket = bucket_at(s, s.cur, index_of(s.h, n))
  redis.call('HSET', bucket, s.field, value)
  redis.call('EXPIREAT', bucket, expires)
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

