-- Prelude of every script that answers a request (the prelude of its
-- scripts' function libraries, src/scripts/).
--
-- Every final answer is remembered, refusals included, so a request once
-- told "no" never draws later; and every answer is bound to what its request
-- asked, so an id reused with other content is refused instead of replaying
-- or drawing. Two layers: the store (records kept for a TTL, found in O(1))
-- and, at the end, the request rules on top of it (claim.lua, replay,
-- remember, refuse).
--
-- ## The store
--
-- A request is known by a 16-byte digest (SHA-256, computed by
-- src/kinds/answer.rs): of its id in a claim store, of its content
-- fingerprint and id in an answer store. One record per fact: a field of a
-- hash named by the digest, holding
--   - in a claim store, the 8-byte content fingerprint, and an `s` after it
--     once a second copy of the request claimed it (shared, claim.lua);
--   - in an answer store, the answer's body (a kind's award, or
--     "!<code>[:<detail>]" for a refusal); a body longer than INLINE bytes
--     lives in a key of its own (`<store>:x:<hex digest>`, same expiry) and
--     the field holds ''.
-- Digests and fingerprints are compared in full. Redis finds the field
-- (HGET, HSET): no bucket enters Lua, so a lookup moves the digest and its
-- record and a write the same, whatever the store holds.
--
-- Buckets. Millions of records are kept for a day, so a record is not a key
-- of its own: records live in hashes ("buckets") that expire whole. A
-- bucket of up to 128 fields of up to 64 bytes (Redis's defaults,
-- hash-max-listpack-entries and -value) is a listpack: each record costs
-- its bytes and two framing bytes a field and a value. A bucket holds the
-- field '' (no digest) from its first record on: HSET answers 2 when it
-- made the bucket, which then gets its expiry, and a bucket is never
-- emptied and made again without one. A bucket that ids aimed at one place
-- push past 128 fields becomes a hash table: each write still costs one
-- HSET, and only the aimer's own records cost more bytes.
--
-- Epochs. Buckets belong to an epoch. An epoch lasts its opener's TTL and
-- the clock SKEW (`l`); its buckets expire 2 l after it starts, so a record
-- written in it is kept at least l (the TTL and the skew) and at most 2 l.
-- A lookup reads the current epoch and the ones before it whose records
-- may still be kept (LIVE at most: one HGET each, usually two). An epoch
-- is planned: it has `n` buckets, enough for the volume the epoch before
-- it saw and half as much again at PER records a bucket, the volume
-- counted by sampling (one new record in SAMPLE is counted, chosen by a
-- byte of its digest, so without a counter per write). A store's first
-- epoch has FIRST buckets (a claim store's one). When an epoch has taken PER records a bucket,
-- the next epoch opens at once with GROW times its buckets (GROW_CLAIMS
-- in a claim store, which takes one id group's share) (growth), as
-- long as a lookup then reads at most LIVE epochs; past that, buckets grow
-- beyond 128 fields and stay correct. No record ever moves.
--
-- The epochs are kept in the field `ep` of a pool's meta hash (which its
-- draw step reads anyway, in one HMGET with its pool) or a string of a
-- claim store's own (`<store>:ep`), newest first, each as four big-endian
-- 32-bit numbers (struct '>I4I4I4I4'):
-- its start `t` (unix seconds), its length `l` (seconds), its buckets `n`
-- and the new records counted since the last epoch its time opened `c`
-- (an epoch opened by growth counts on).
-- Binary, so a step reads it in one C call (struct.unpack): parsing a
-- text form with Lua patterns cost more than the lookups themselves. A
-- claim store's expires with its last bucket; a pool's meta hash that
-- expires (a closed red packet's) is pushed back to it, and one that holds
-- only the store's field (a refusal for a pool that does not exist)
-- expires with it (loading the pool keeps it for good: PERSIST in the
-- loaders). Keys (`<store>` is KEYS[n] of the script: a pool's answer
-- store `<pool keys>rs`, a claim store `<prefix>:<space>:{<group>}`):
--   <pool keys>meta               hash: ep (a pool's answer store)
--   <store>:ep                    string: the epochs (a claim store)
--   <store>:e<epoch start>:<i>    hash: digest -> record, and '' -> ''
--   <store>:x:<hex digest>        string: a long body
--
-- A request comes as a token built by the Rust side (src/kinds/answer.rs):
-- its digest (16 bytes), its fingerprint (8 bytes), then the TTL and `now`
-- as big-endian 32-bit numbers (struct 'c16c8>I4I4'). `now` is the Redis
-- time the request's claim read (so the pool step needs no TIME of its
-- own); 0, the script reads TIME. The TTL's top bit (EARLIER) asks to read
-- the earlier layout too (below).

-- Clock skew tolerated between the nodes whose TIME names `now`.
local SKEW = 300
-- Records a bucket is planned to hold: at 80 on average, a bucket passes
-- Redis's 128 listpack fields at more than five standard deviations.
local PER = 80
-- Buckets of a store's first epoch (a claim store's FIRST_CLAIMS), and the
-- most an epoch has.
local FIRST, FIRST_CLAIMS = 4, 4
local MAX_BUCKETS = 16777216
-- One new record in SAMPLE is counted.
local SAMPLE = 16
-- Epochs a lookup reads at most (growth opens no epoch past it), and
-- how much larger an epoch opened by growth is.
local LIVE = 4
local GROW, GROW_CLAIMS = 16, 4
-- The TTL's flag in a token: read the earlier layout too.
local EARLIER = 2147483648
-- Longer bodies get a key of their own: a longer value would turn the
-- bucket from a listpack into a table (hash-max-listpack-value, 64).
local INLINE = 64
-- The fields of a pool's meta hash a draw step reads for its answer store.
local STORE_FIELDS = {'ep'}

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

-- The meta hash of store `key`: the pool's meta hash for a pool's answer
-- store, the store itself for a claim store (where the earlier layout kept
-- its epochs).
local function meta_of(key)
  if string.sub(key, -3) == ':rs' then return string.sub(key, 1, -3) .. 'meta' end
  return key
end

-- The epochs of a store: `s.ep` holds their numbers as the field stores
-- them, so epoch i's start is s.ep[4 * i - 3] (EP_T), its length, buckets
-- and count the next three; `s.k` epochs.
local EP_T, EP_L, EP_N, EP_C = -3, -2, -1, 0
-- The struct format of `ep` strings of `bytes` bytes. (Filled as they are
-- met: a library's load may not call `string`.)
local EP_FORMATS = {}
local function ep_format(bytes)
  local f = EP_FORMATS[bytes]
  if not f then
    f = '>' .. string.rep('I4', math.floor(bytes / 4))
    EP_FORMATS[bytes] = f
  end
  return f
end

-- When the buckets of the epoch that starts at `t` and lasts `l` expire.
local function expiry_of(t, l)
  return t + 2 * l
end

-- Whether the records of the store's epoch `i` (1: the newest) may still
-- be kept: an epoch takes writes until the next one starts (or its length
-- is over) and keeps them its length after.
local function readable(s, i)
  local ep, at = s.ep, 4 * i
  local stop = ep[at + EP_T] + ep[at + EP_L]
  if i > 1 and ep[at - 4 + EP_T] < stop then stop = ep[at - 4 + EP_T] end
  return s.now < stop + ep[at + EP_L]
end

-- Writes the store's epochs, to expire with its last bucket.
local function epochs_save(s)
  local ep, n, exp = s.ep, 4 * s.k, 0
  for i = 1, s.k do exp = math.max(exp, expiry_of(ep[4 * i + EP_T], ep[4 * i + EP_L])) end
  local field = struct.pack(ep_format(4 * n), unpack(ep, 1, n))
  if s.meta == s.key then
    redis.call('SET', s.key .. ':ep', field, 'EXAT', exp)
    return
  end
  redis.call('HSET', s.meta, 'ep', field)
  if s.opened then
    if s.ephemeral then
      redis.call('EXPIREAT', s.meta, exp)
    else
      -- GT leaves a hash kept for good (a loaded pool's) as it is.
      redis.call('EXPIREAT', s.meta, exp, 'GT')
    end
  end
end

-- The name of bucket `i` of epoch `t`. (The middle of the names of recent
-- epochs is kept: string.format costs more than the rest of the name.)
local EPOCH_NAMES, epoch_names = {}, 0
local function bucket_of(s, t, i)
  local middle = EPOCH_NAMES[t]
  if not middle then
    if epoch_names >= 1024 then EPOCH_NAMES, epoch_names = {}, 0 end
    middle = ':e' .. string.format('%d', t) .. ':'
    EPOCH_NAMES[t], epoch_names = middle, epoch_names + 1
  end
  return s.key .. middle .. int(i)
end

local legacy_open, legacy_find

-- Opens the store `key` for the request of `token`. `pre`, when given,
-- holds the STORE_FIELDS values the caller read from the pool's meta hash
-- already (from index `at` on).
local function store_open(key, token, pre, at)
  local d, fp, ttl, now = struct.unpack('c16c8>I4I4', token)
  if now == 0 then now = tonumber(redis.call('TIME')[1]) end
  local earlier = ttl >= EARLIER
  if earlier then ttl = ttl - EARLIER end
  local meta, field = meta_of(key)
  if meta == key then
    field = redis.call('GET', key .. ':ep')
  elseif pre then
    field = pre[at or 1]
  else
    field = redis.call('HGET', meta, 'ep')
  end
  field = field or ''
  -- Where the record lives among an epoch's buckets: bytes 4-6 of its
  -- digest (bytes 1-2 pick a claim's store among the id groups); byte 7
  -- says whether it is counted.
  local x, y, z, w = string.byte(d, 4, 7)
  local s = {key = key, meta = meta, now = now, len = ttl + SKEW, d = d, fp = fp,
    h = (x * 256 + y) * 256 + z, counted = w % SAMPLE == 0,
    ep = {struct.unpack(ep_format(#field), field)}, k = math.floor(#field / 16)}
  if earlier then legacy_open(s) end
  return s
end

local function long_body(s, v)
  if v == '' then return redis.call('GET', s.key .. ':x:' .. hex(s.d)) or nil end
  return v
end

-- The record stored for the store's request and the bucket that holds it
-- (false for a record of the earlier layout), or nil.
local function store_find(s)
  local ep = s.ep
  for i = 1, s.k do
    if readable(s, i) then
      local bucket = bucket_of(s, ep[4 * i + EP_T], s.h % ep[4 * i + EP_N])
      local v = redis.call('HGET', bucket, s.d)
      if v then return long_body(s, v), bucket end
    end
  end
  if s.old then
    local v = legacy_find(s)
    if v then return v, false end
  end
  return nil
end

-- Opens a new epoch of `n` buckets before the others, its count starting
-- at `counted`, and forgets those whose records are all expired.
local function open_epoch(s, n, counted)
  local ep, t = s.ep, s.now
  -- Two epochs opened in one second (growth) keep names of their own.
  if s.k > 0 and t <= ep[1] then t = ep[1] + 1 end
  for j = 4 * s.k, 1, -1 do ep[j + 4] = ep[j] end
  ep[1], ep[2], ep[3], ep[4] = t, s.len, n, counted
  s.k = s.k + 1
  while s.k > 1 and not readable(s, s.k) do s.k = s.k - 1 end
  s.opened = true
end

-- The buckets of the next epoch: those the volume counted in the current
-- one and half as much again need over the new epoch's length, or FIRST
-- for a new store.
local function planned(s)
  if s.k == 0 then
    if s.meta == s.key then return FIRST_CLAIMS end
    return FIRST
  end
  local n = math.ceil(1.5 * s.ep[4] * SAMPLE * s.len / s.ep[2] / PER)
  return math.max(1, math.min(n, MAX_BUCKETS))
end

local function live(s)
  local k = 0
  for i = 1, s.k do if readable(s, i) then k = k + 1 end end
  return k
end

-- Stores `value` as the store's new record, in the current epoch; opens a
-- new epoch when the current one is over or full.
local function store_put(s, value)
  local ep = s.ep
  local changed = false
  if s.k == 0 or s.now >= ep[1] + ep[2] then
    open_epoch(s, planned(s), 0)
    changed = true
  elseif ep[4] * SAMPLE >= ep[3] * PER and ep[3] < MAX_BUCKETS and live(s) < LIVE then
    -- The new epoch counts on from the one it relieves: its count is the
    -- period's, which plans the next period.
    local grow = GROW
    if s.meta == s.key then grow = GROW_CLAIMS end
    open_epoch(s, math.min(grow * ep[3], MAX_BUCKETS), ep[4])
    changed = true
  end
  local exp = expiry_of(ep[1], ep[2])
  if #value > INLINE then
    redis.call('SET', s.key .. ':x:' .. hex(s.d), value, 'EXAT', exp)
    value = ''
  end
  local bucket = bucket_of(s, ep[1], s.h % ep[3])
  if redis.call('HSET', bucket, '', '', s.d, value) == 2 then redis.call('EXPIREAT', bucket, exp) end
  if s.counted then
    ep[4] = ep[4] + 1
    changed = true
  end
  if changed then epochs_save(s) end
end

-- Removes the record store_find found in `bucket`.
local function store_drop(s, bucket, value)
  redis.call('HDEL', bucket, s.d)
  if value and #value > INLINE then redis.call('DEL', s.key .. ':x:' .. hex(s.d)) end
end

-- ## The earlier layout, read until its last epoch ends
--
-- Versions before this one kept records in string buckets (records
-- concatenated) or hash buckets, in epochs listed in the meta hash's `r.e`
-- ("<start>:<length>:<buckets>[o][h];...", newest first), a lookup reading
-- the bucket of each of the 5 live epochs (linear hashing over bytes 4-6 of
-- the digest). This layout reads them while the workers ask it to
-- (EARLIER in the token: for two TTLs after the first worker of this
-- layout started, src/kinds/answer.rs), a worker of the earlier version
-- still running meanwhile included. Records found there are never
-- rewritten; a claim found there and claimed again is stored again here,
-- shared. Remove this section once no store holds `r.e`.

local function legacy_bucket(s, e, h)
  local p = 1
  while p * 2 <= e[3] do p = p * 2 end
  local i = h % (2 * p)
  if i >= e[3] then i = h % p end
  return s.key .. ':' .. e[1] .. ':' .. i
end

-- The record of digest `d` in string bucket `b`: a claim store's records
-- are 24 bytes, an answer store's say their length after the digest.
local function legacy_record(b, d, fixed)
  local from = 1
  while b do
    local at = string.find(b, d, from, true)
    if not at then return nil end
    local pos = 1
    if fixed then
      pos = at - (at - 1) % 24
    else
      while pos < at do pos = pos + 17 + string.byte(b, pos + 16) end
    end
    if pos == at then
      if fixed then return string.sub(b, at + 16, at + 23) end
      return string.sub(b, at + 17, at + 16 + string.byte(b, at + 16))
    end
    from = at + 1
  end
  return nil
end

legacy_open = function(s)
  local field = redis.call('HGET', s.meta, 'r.e')
  if not field then return end
  s.old = {}
  for t, l, n, o, h in string.gmatch(field, '(%d+):(%d+):(%d+)(o?)(h?)') do
    local e = {t, tonumber(l), tonumber(n), o == 'o', h == 'h'}
    if s.now < tonumber(t) + 5 * e[2] and #s.old < 5 then s.old[#s.old + 1] = e end
  end
end

legacy_find = function(s)
  local fixed = s.meta == s.key
  local x, y, z = string.byte(s.d, 4, 6)
  local h = (x * 256 + y) * 256 + z
  for _, e in ipairs(s.old) do
    local bucket = legacy_bucket(s, e, h)
    local v
    if e[5] then
      v = redis.call('HGET', bucket, s.d)
    else
      v = legacy_record(redis.call('GET', bucket), s.d, fixed)
      if not v and e[4] then v = redis.call('GET', s.key .. ':' .. e[1] .. ':o:' .. hex(s.d)) end
    end
    if v then return long_body(s, v) end
  end
  return nil
end

-- ## The request rules

-- The answer store of the step now running, kept between replay() and
-- remember() of one request so its epochs are read once.
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
