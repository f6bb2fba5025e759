-- Prelude of every script that answers a request (the prelude of its scripts' function libraries, src/scripts/).
--
-- Every final answer is remembered, refusals included, so a request once
-- told "no" never draws later; and every answer is bound to what its request
-- asked, so an id reused with other content is refused instead of replaying
-- or drawing.
--
-- Records. A request is known by a 16-byte digest (SHA-256, computed by
-- src/kinds/answer.rs): of its id in a claim store, of its content
-- fingerprint and id in an answer store. A claim's record is the digest and
-- the 8-byte content fingerprint; an answer's is the digest, one length
-- byte and the answer's body (a kind's award, or "!<code>[:<detail>]"
-- for a refusal). A body longer than INLINE bytes lives in a key of its own
-- (`<store>:x:<hex digest>`, same expiry) and the record holds length 0.
-- Digests are compared in full: two requests share an answer only if their
-- ids (and contents) agree on 128 bits of SHA-256.
--
-- Buckets. Millions of records are kept for a day, so a record is not a key
-- of its own: records live in "buckets" that expire whole, so a record
-- costs its bytes and little else. An epoch's buckets may be hashes (flag
-- `h` in `r.e`): a record is a field named by the digest holding the value,
-- read with one HGET and written with one HSET, kept by Redis as a compact
-- listpack while the bucket has at most 128 fields of at most 64 bytes
-- (Redis's defaults, hash-max-listpack-entries and -value); every bucket
-- also holds the field '' (no digest), so it is never emptied and made
-- again without its expiry. Other epochs (the default, ANSWER_BUCKETS=
-- strings) have string buckets: records concatenated, read with one MGET
-- for all such epochs and rewritten whole with one SET. A new epoch gets
-- hashes when its opener's token asks (a token "<ttl>h:..."); both are
-- read, whichever the token asks.
--
-- Epochs. Time is cut into epochs whose geometry is kept in the store's
-- meta hash, never derived from a setting: field `r.e` lists the live
-- epochs, newest first, as "<start>:<length>:<buckets>[o][h];..." (o: an
-- epoch whose full string buckets gave records keys of their own; the start also
-- names the epoch's buckets; the length is a quarter of the answer TTL of
-- the writer that opened it and of SKEW). A write at or after start +
-- length opens a new epoch; an epoch's buckets expire 5 lengths (and SKEW)
-- after it starts, and a lookup reads the current epoch and the EPOCHS - 1
-- before it (one HGET per hash epoch), so a record is kept at least 4
-- lengths (its opener's TTL and SKEW) and at most a quarter more. The SKEW
-- in the length keeps the TTL whole for a record whose `now` is behind the
-- time it is written (a step run a few seconds after its claim read the
-- clock, in the last seconds of an epoch) and for a reader whose clock runs
-- ahead. A fleet whose workers disagree on the TTL keeps every answer at
-- least the shorter of the two; changing the TTL changes the length of the
-- next epoch and loses nothing.
--
-- Growth. An epoch starts with one bucket and grows by linear hashing, so a
-- lookup reads exactly one bucket per epoch: with n buckets (2^L <= n <
-- 2^(L+1)) a record whose hash is h lives in bucket h mod 2^(L+1), or
-- h mod 2^L when that is n or more. One new record in PER_BUCKET
-- (PER_CLAIM_BUCKET in a claim store, PER_HASH in a hash epoch; chosen by
-- other bits of its digest, so without a counter) splits bucket n - 2^L
-- into itself and a new bucket n, which keeps about that many records a
-- bucket.
--
-- Keys (`<store>` is KEYS[n] of the script). A pool's answer store
-- (`<pool keys>rs`) keeps its epochs in the pool's meta hash
-- (`<pool keys>meta`), which its draw step reads anyway, so a draw reads
-- its pool and its answer store's geometry in one HMGET; a claim store keeps
-- them in its own hash:
--   <meta>                      hash: r.e
--   <store>:<epoch start>:<i>   hash: digest -> value (string: records)
--   <store>:x:<hex digest>      string: a long body
-- A meta hash that holds only a store's fields (a refusal remembered for a
-- pool that does not exist) expires with the store; loading the pool keeps
-- it for good (PERSIST in the loaders).
--
-- A request comes as a token built by the Rust side (src/kinds/answer.rs):
--   "<ttl s>[h]:<now s, or empty>:" .. digest (16 bytes) .. fingerprint (8 bytes)
-- (`h`: new epochs get hash buckets).
-- `now` is the Redis time the request's claim read (so the pool step needs
-- no TIME of its own); empty, the script reads TIME.

-- Records a bucket holds on average: a string bucket of answers
-- PER_BUCKET, of claims PER_CLAIM_BUCKET, a hash bucket PER_HASH. A string
-- bucket enters Lua whole on every lookup and is rebuilt on every write
-- (Redis's Lua hashes each byte of a string it takes in), so it costs its
-- size twice a request; a bucket's key costs about 130 bytes however full
-- it is. Claims (24-byte records) take the smaller buckets, which cut a
-- claim's instructions by a seventh to a third (docs/performance.md) for
-- under 2 bytes a result; answers keep 128. A hash bucket stays a
-- listpack up to hash-max-listpack-entries (128 by default) fields; with
-- linear hashing a bucket not yet split holds up to twice the average, so
-- 40 on average keeps every bucket below 128 but at five standard
-- deviations.
local PER_BUCKET = 128
local PER_CLAIM_BUCKET = 64
local PER_HASH = 40
-- A record's hash has 24 bits: an epoch has at most this many buckets.
local MAX_BUCKETS = 16777216
-- Longer bodies are stored in a key of their own: in a string bucket, and
-- in a hash bucket, where a longer value would turn the hash from Redis's
-- compact listpack into a table (hash-max-listpack-value, 64 by default).
local INLINE = 200
local HASH_INLINE = 64
-- A string bucket holds at most this many bytes (about 16 times its
-- share); a record for a full bucket gets a key of its own, so ids crafted
-- to land in one bucket cannot make every write to it cost its size. (A
-- hash bucket they aim at becomes a hash table: a write costs the same.)
local FULL = 32768
-- Clock skew tolerated between the nodes whose TIME names `now`.
local SKEW = 300
-- Epochs a lookup reads: the current one and those before it.
local EPOCHS = 5
-- The fields of a store's meta hash, in the order store_open reads them.
local STORE_FIELDS = {'r.e'}

-- An integer as decimal digits. Lua's tostring writes 1e+14 and above in
-- exponent notation, which neither Redis nor the Rust side read as an integer.
-- Small integers (prize codes, counts, bucket numbers) are formatted and
-- parsed once per library load and then looked up: `string.format` and
-- `tonumber` (strtod) cost more than the rest of a draw's work on a prize.
-- (Filled as they are met: a library's load may not call `string`.)
local SMALL, SMALL_OF = {}, {}
local function int(n)
  local s = SMALL[n]
  if s then return s end
  s = string.format('%d', n)
  if n >= 0 and n < 4096 then SMALL[n] = s end
  return s
end

-- tonumber(s), looked up for the decimal strings of small integers.
local function num(s)
  local n = SMALL_OF[s]
  if n then return n end
  n = tonumber(s)
  if n and n >= 0 and n < 4096 and n % 1 == 0 then SMALL_OF[s] = n end
  return n
end

local function hex(bytes)
  return (string.gsub(bytes, '.', function(c) return string.format('%02x', string.byte(c)) end))
end

-- Where a record lives among an epoch's buckets: bytes 4-6 of its digest
-- (bytes 1-2 pick a claim's store among the id groups).
local function hash_at(b, at)
  local x, y, z = string.byte(b, at + 3, at + 5)
  return (x * 256 + y) * 256 + z
end

-- 2^L for an epoch of n buckets (2^L <= n < 2^(L+1)).
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

-- Where the record that starts at `pos` of bucket `b` ends, and where its
-- value starts: a claim store's records are 24 bytes (digest and
-- fingerprint, no length byte), an answer store's say their length.
local function record_at(b, pos, fixed)
  if fixed then return pos + 23, pos + 16 end
  return pos + 16 + string.byte(b, pos + 16), pos + 17
end

-- The record of digest `d` in bucket string `b`: its value, its first and
-- its last byte; nil when there is none. The digest is searched with a
-- plain find; a hit counts only where a record starts.
local function record_in(b, d, fixed)
  if not b or b == '' then return nil end
  local from = 1
  while true do
    local at = string.find(b, d, from, true)
    if not at then return nil end
    local pos = 1
    if fixed then
      pos = at - (at - 1) % 24
    else
      while pos < at do pos = pos + 17 + string.byte(b, pos + 16) end
    end
    if pos == at then
      local last, value = record_at(b, at, fixed)
      return string.sub(b, value, last), at, last
    end
    from = at + 1
  end
end

-- The meta hash of store `key`: the pool's meta hash for a pool's answer
-- store, the store itself for a claim store.
local function meta_of(key)
  if string.sub(key, -3) == ':rs' then return string.sub(key, 1, -3) .. 'meta' end
  return key
end

-- When the buckets of an epoch that starts at `t` and lasts `l` expire.
local function expiry_of(t, l)
  return t + EPOCHS * l + SKEW
end

-- Opens the store `key` for the request of `token`. `pre`, when given,
-- holds the STORE_FIELDS values the caller read from the store's meta hash
-- already (from index `at` on). `s.epochs` lists the live epochs, newest
-- first, each {start, length, buckets}.
local function store_open(key, token, pre, at)
  local ttl, hashes, now, rest = string.match(token, '^(%d+)(h?):(%d*):(.*)$')
  if now == '' then now = tonumber(redis.call('TIME')[1]) else now = tonumber(now) end
  local s = {key = key, meta = meta_of(key), len = math.ceil((tonumber(ttl) + SKEW) / (EPOCHS - 1)),
    now = now, d = string.sub(rest, 1, 16), fp = string.sub(rest, 17, 24), epochs = {},
    hashes = hashes == 'h'}
  -- A claim store's records are all 24 bytes.
  s.fixed = s.meta == key
  s.h = hash_at(s.d, 1)
  local a, b = string.byte(s.d, 7, 8)
  s.split_at = a * 256 + b
  local field
  if pre then field = pre[at or 1] else field = redis.call('HGET', s.meta, 'r.e') end
  for t, l, n, o, h in string.gmatch(field or '', '(%d+):(%d+):(%d+)(o?)(h?)') do
    t, l, n = tonumber(t), tonumber(l), tonumber(n)
    -- An epoch is read until EPOCHS lengths from its start (its buckets
    -- stay SKEW longer, for a node whose clock runs behind).
    if now < t + EPOCHS * l and #s.epochs < EPOCHS then
      s.epochs[#s.epochs + 1] = {t, l, n, o == 'o', h == 'h'}
    end
  end
  return s
end

-- The key of a record that found its bucket full, in epoch `t`.
local function overflow_of(s, t)
  return s.key .. ':' .. int(t) .. ':o:' .. hex(s.d)
end

local function bucket_of(s, t, i)
  return s.key .. ':' .. int(t) .. ':' .. int(i)
end

-- A value as a record holds it: '' stands for a body in a key of its own.
local function long_body(s, v)
  if v == '' then return redis.call('GET', s.key .. ':x:' .. hex(s.d)) or nil end
  return v
end

-- The value stored for the store's request, or nil. Keeps the current
-- bucket's content for store_put when that bucket is a string.
local function store_find(s)
  local names, strings = {}, {}
  s.cur = ''
  for k, e in ipairs(s.epochs) do
    local name = bucket_of(s, e[1], index_of(s.h, e[3]))
    if e[5] then
      local v = redis.call('HGET', name, s.d)
      if v then return long_body(s, v) end
    else
      names[#names + 1] = name
      strings[#strings + 1] = k
    end
  end
  if #names == 0 then return nil end
  local got = redis.call('MGET', unpack(names))
  if strings[1] == 1 then s.cur = got[1] or '' end
  for j = 1, #names do
    local e = s.epochs[strings[j]]
    local v = record_in(got[j] or '', s.d, s.fixed)
    if not v and e[4] then
      -- An epoch with full buckets: the record may have a key of its own.
      v = redis.call('GET', overflow_of(s, e[1]))
      if v then return v end
    end
    if v then return long_body(s, v) end
  end
  return nil
end

-- The `r.e` field of the store's epochs.
local function epochs_text(s)
  local out = {}
  for _, e in ipairs(s.epochs) do
    out[#out + 1] = int(e[1]) .. ':' .. int(e[2]) .. ':' .. int(e[3]) .. (e[4] and 'o' or '')
      .. (e[5] and 'h' or '')
  end
  return table.concat(out, ';')
end

-- Splits bucket n - 2^L of the current epoch (of n buckets) into itself
-- and a new bucket n.
local function split(s)
  local e = s.epochs[1]
  local n = e[3]
  local p = level_of(n)
  local from = bucket_of(s, e[1], n - p)
  local exp = expiry_of(e[1], e[2])
  if e[5] then
    local to = bucket_of(s, e[1], n)
    local all = redis.call('HGETALL', from)
    local move = {}
    for i = 1, #all, 2 do
      local d = all[i]
      if #d == 16 and hash_at(d, 1) % (2 * p) == n then
        move[#move + 1] = d
        move[#move + 1] = all[i + 1]
      end
    end
    -- The new bucket exists from now on, with its epoch's expiry, even
    -- before its first record: the placeholder field '' is no digest.
    move[#move + 1] = ''
    move[#move + 1] = ''
    redis.call('HSET', to, unpack(move))
    redis.call('EXPIREAT', to, exp)
    if #move > 2 then
      local gone = {}
      for i = 1, #move - 2, 2 do gone[#gone + 1] = move[i] end
      redis.call('HDEL', from, unpack(gone))
    end
    e[3] = n + 1
    redis.call('HSET', s.meta, 'r.e', epochs_text(s))
    return
  end
  local b = redis.call('GET', from) or ''
  local keep, move = {}, {}
  local pos = 1
  while pos <= #b do
    local last = record_at(b, pos, s.fixed)
    local rec = string.sub(b, pos, last)
    if hash_at(b, pos) % (2 * p) == n then move[#move + 1] = rec else keep[#keep + 1] = rec end
    pos = last + 1
  end
  redis.call('SET', from, table.concat(keep), 'EXAT', exp)
  redis.call('SET', bucket_of(s, e[1], n), table.concat(move), 'EXAT', exp)
  e[3] = n + 1
  redis.call('HSET', s.meta, 'r.e', epochs_text(s))
end

-- Stores `value` as the store's record, after store_find (which read the
-- current bucket). Opens a new epoch when the current one is over.
local function store_put(s, value)
  if s.cur == nil then store_find(s) end
  local e = s.epochs[1]
  local opened = false
  if not e or s.now >= e[1] + e[2] then
    opened = true
    -- A new epoch, before the others; the oldest beyond EPOCHS is dropped
    -- (its buckets expire on their own).
    e = {s.now, s.len, 1, false, s.hashes}
    table.insert(s.epochs, 1, e)
    s.epochs[EPOCHS + 1] = nil
    s.cur = ''
    redis.call('HSET', s.meta, 'r.e', epochs_text(s))
    local exp = 0
    for _, x in ipairs(s.epochs) do exp = math.max(exp, expiry_of(x[1], x[2])) end
    if s.meta == s.key or s.ephemeral then
      redis.call('EXPIREAT', s.meta, exp)
    else
      -- A meta hash that expires (a red packet's, kept a while after it
      -- closed) lives at least as long as the epochs it lists, so answers
      -- stored after it was given its expiry keep their retention. GT
      -- leaves a hash kept for good (a loaded pool's) as it is.
      redis.call('EXPIREAT', s.meta, exp, 'GT')
    end
  end
  local exp = expiry_of(e[1], e[2])
  if e[5] then
    local name = bucket_of(s, e[1], index_of(s.h, e[3]))
    if #value > HASH_INLINE then
      redis.call('SET', s.key .. ':x:' .. hex(s.d), value, 'EXAT', exp)
      value = ''
    end
    s.cur = nil
    if opened then
      -- An epoch's first bucket is made by its first record, with the
      -- placeholder every bucket keeps ('' is no digest), so no bucket is
      -- ever emptied and made again without its expiry.
      redis.call('HSET', name, s.d, value, '', '')
      redis.call('EXPIREAT', name, exp)
    else
      redis.call('HSET', name, s.d, value)
    end
    if s.split_at % PER_HASH == 0 and e[3] < MAX_BUCKETS then split(s) end
    return
  end
  if #s.cur >= FULL then
    redis.call('SET', overflow_of(s, e[1]), value, 'EXAT', exp)
    if not e[4] then
      e[4] = true
      redis.call('HSET', s.meta, 'r.e', epochs_text(s))
    end
    s.cur = nil
    return
  end
  local rec
  if s.fixed then
    rec = s.d .. value
  elseif #value > INLINE then
    redis.call('SET', s.key .. ':x:' .. hex(s.d), value, 'EXAT', exp)
    rec = s.d .. '\0'
  else
    rec = s.d .. string.char(#value) .. value
  end
  -- The bucket is written whole with SET, not grown with APPEND: Redis
  -- grows an appended string to twice its length, which would double what
  -- a remembered result costs.
  redis.call('SET', bucket_of(s, e[1], index_of(s.h, e[3])), s.cur .. rec, 'EXAT', exp)
  s.cur = nil
  local per = PER_BUCKET
  if s.fixed then per = PER_CLAIM_BUCKET end
  if s.split_at % per == 0 and e[3] < MAX_BUCKETS then split(s) end
end

-- The shared mark of a claim (claim.lua), opened like the claim's store
-- `s`: a claim record under the id's digest with its last byte flipped, so
-- in the same bucket of every epoch (a record's bucket follows bytes 4-6 of
-- its digest). No id's digest is the flipped one short of breaking SHA-256.
local function claim_mark(s)
  local m = {}
  for k, v in pairs(s) do m[k] = v end
  m.epochs = {}
  for i, e in ipairs(s.epochs) do m.epochs[i] = {e[1], e[2], e[3], e[4], e[5]} end
  m.d = string.sub(s.d, 1, 15) .. string.char(255 - string.byte(s.d, 16))
  m.cur = nil
  return m
end

-- Removes the store's record, wherever it is; says whether there was one.
local function store_drop(s)
  for _, e in ipairs(s.epochs) do
    if e[5] then
      local name = bucket_of(s, e[1], index_of(s.h, e[3]))
      local v = redis.call('HGET', name, s.d)
      if v then
        redis.call('HDEL', name, s.d)
        if v == '' then redis.call('DEL', s.key .. ':x:' .. hex(s.d)) end
        return true
      end
    end
    if not e[5] then
      if e[4] and redis.call('DEL', overflow_of(s, e[1])) == 1 then return true end
      local name = bucket_of(s, e[1], index_of(s.h, e[3]))
      local b = redis.call('GET', name)
      local v, first, last = record_in(b, s.d, s.fixed)
      if v then
        redis.call('SET', name, string.sub(b, 1, first - 1) .. string.sub(b, last + 1), 'KEEPTTL')
        if v == '' then redis.call('DEL', s.key .. ':x:' .. hex(s.d)) end
        return true
      end
    end
  end
  return false
end

-- The answer store of the step now running, kept between replay() and
-- remember() of one request so its bucket is read once.
local OPEN = {}

-- The first answer of a request, if it has one: {"dup", body, 0}. `key` is
-- the pool's answer store, `token` the request's; `pre` and `at` as for
-- store_open.
local function replay(key, token, pre, at)
  local s = store_open(key, token, pre, at)
  local body = store_find(s)
  OPEN[key .. token] = s
  if body then return {'dup', body, 0} end
  return nil
end

-- Records the answer `body` of a request. (`ttl` is the token's; the
-- argument stays for the scripts' sake.)
local function remember(key, token, body, ttl)
  local s = OPEN[key .. token]
  OPEN[key .. token] = nil
  if not s then s = store_open(key, token) end
  store_put(s, body)
end

-- Records and returns a refusal; `code` is an error code of the wire
-- contract, optionally followed by ":<detail>".
local function refuse(key, token, ttl, code)
  remember(key, token, '!' .. code, ttl)
  return {'refused', code, 0}
end

-- The refusal of a request naming a pool that is not there (`kind` is the
-- kind its meta hash names, nil when there is none): if storing it creates
-- the meta hash, that hash expires with the store.
local function refuse_unknown(key, token, ttl, kind)
  local s = OPEN[key .. token]
  if s and not kind then s.ephemeral = true end
  return refuse(key, token, ttl, 'unknown_pool')
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

