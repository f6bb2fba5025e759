//! The Rust side of `lua/lib/answer.lua`: request fingerprints, id claims,
//! stored answers and the replies every answering script gives.
//!
//! A request's answer is stored in its pool's answer store (a field of a
//! hash bucket that expires whole, so a remembered answer costs a few dozen
//! bytes, not a key of its own; the layout is in `lua/lib/answer.lua`):
//! the body is the kind's award or `"!<code>[:<detail>]"` for a refusal.
//! The fingerprint binds the id to the content it first asked for (Stripe's
//! rule): the same id with other content is refused and moves nothing.
//!
//! Answers live in the pool's slot (the answer is written in the same
//! atomic step as the draw), so they alone cannot see an id reused on
//! another pool. The claim does: an entry per id in a claim store outside
//! any pool, bound to the fingerprint before the pool step. A claim that is
//! set but whose pool step never ran (the worker died in between) is
//! harmless: the redelivery finds the same fingerprint and runs the step.
//!
//! Both stores name a request by 16 bytes (128 bits) of SHA-256, compared
//! in full: the claim store by a digest of the id, holding the 8-byte
//! content fingerprint; the answer store by a digest of the fingerprint and
//! the id, so an answer is found only for the id and the content it
//! answered. Two requests share a record only if SHA-256 collides on them.
//! Where a record lives depends on stored epochs, never on the TTL setting
//! (`lua/lib/answer.lua`), so a changed `RESULT_TTL_S` forgets nothing.
//!
//! # Races and ordering
//!
//! - **Two copies of one request at once** (a redelivery while the first
//!   attempt still runs, or a client resend to another worker). Both claim
//!   the same fingerprint and both run the pool step; the steps are atomic
//!   and run one after the other, so the first stores its answer with its
//!   effect and the second replays it. Both then publish the same reply
//!   and the same ledger entry, which the ledger applies once.
//! - **The same id with other content at once.** The claim is one atomic
//!   step (`lua/claim.lua`): whichever copy claims first binds the id, and the
//!   other is refused before its pool step, on whatever pool it names.
//! - **An answer decided outside a pool step** (`pool_exhausted`, after the
//!   short-pool wait) is stored only if no answer exists ([`remember`]): a
//!   copy that drew meanwhile wins, and its award is the answer.
//! - **Expiry.** A claim and an answer live for the request's result TTL;
//!   a request sent again after that is a new request to its kind (a new
//!   lucky-gift or lottery draw, paid under a new entry id; a red-packet
//!   grab that finds the user's share already taken).

use std::fmt::Display;

use redis::aio::ConnectionLike;
use sha2::{Digest, Sha256};

use crate::{
    amqp::HandleError,
    messages::{ErrorCode, Invalid, Prize},
    scripts::Scripts,
};

/// A short, stable fingerprint of a request's content: the first 8 bytes of
/// SHA-256 over the kind and the fields. Stable across versions and
/// machines (a rolling deploy must not see a reuse where there is none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 8]);

impl Fingerprint {
    /// In lowercase hex, as grant keys store it.
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// The [`Fingerprint`] of a request of `kind` with `fields`.
pub fn fingerprint(kind: &str, fields: &[&dyn Display]) -> Fingerprint {
    let mut hash = Sha256::new();
    hash.update(kind.as_bytes());
    for field in fields {
        // Ids never contain a newline (see `messages::check_id`).
        hash.update(b"\n");
        hash.update(field.to_string().as_bytes());
    }
    let digest = hash.finalize();
    let mut bytes = [0; 8];
    bytes.copy_from_slice(&digest[..8]);
    Fingerprint(bytes)
}

/// The ledger entry id of draw `serial` of `pool` asked by `request_id`,
/// in namespace `scheme` (`draw`, `lottery`): `<scheme>:<pool>:<request_id>:<serial>`.
///
/// The id has the scope of the answer it pays for. The pool is in it because
/// a request id is bound to one pool only while its answer is kept: sent
/// again later on another pool, it is a new draw there, paid under an id of
/// its own even when both pools' serials agree. The serial (the pool's draw
/// counter, stored with the answer) tells a replay (same id, paid once) from
/// a new draw of the same request id after its answer expired. Pool ids
/// have no `:` (see [`crate::messages::check_name`]), so the pool ends at
/// the first `:` and no two draws share an id.
pub fn entry_id(scheme: &str, pool: &str, request_id: &str, serial: impl Display) -> String {
    format!("{scheme}:{pool}:{request_id}:{serial}")
}

/// Claim groups: ids spread over this many claim stores (and so over the
/// slots of a Redis Cluster).
const CLAIM_GROUPS: u16 = 1024;

/// Bytes of SHA-256 that name a request in a store: 128 bits, so two
/// requests share a record only if SHA-256 collides on them.
pub const DIGEST_BYTES: usize = 16;

/// Clock skew an answer store tolerates between the nodes whose clocks name
/// its epochs (`SKEW` in `lua/lib/answer.lua`).
pub const CLOCK_SKEW_S: u64 = 300;

/// When the last answer of a store can expire, unix seconds, from its
/// epochs (a pool's meta field `ep`: per epoch four big-endian u32, start,
/// length, buckets and count) and `r.e` (the earlier layout's epochs in the meta
/// hash, "<start>:<length>:<buckets>…;…"): an epoch's buckets expire two
/// lengths after it starts (`expiry_of` in `lua/lib/answer.lua`), an
/// earlier epoch's five lengths and [`CLOCK_SKEW_S`] after; 0 when neither
/// names one.
pub fn store_end(epochs: Option<&[u8]>, earlier: Option<&str>) -> u64 {
    let numbers: Vec<u64> = epochs
        .unwrap_or_default()
        .chunks_exact(4)
        .map(|b| u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        .collect();
    let mut end = numbers
        .chunks_exact(4)
        .map(|e| e[0] + 2 * e[1])
        .max()
        .unwrap_or(0);
    for epoch in earlier.unwrap_or("").split(';') {
        let mut parts = epoch.split(':');
        let (Some(t), Some(l)) = (parts.next(), parts.next()) else {
            continue;
        };
        if let (Ok(t), Ok(l)) = (t.parse::<u64>(), l.parse::<u64>()) {
            end = end.max(
                t.saturating_add(l.saturating_mul(5))
                    .saturating_add(CLOCK_SKEW_S),
            );
        }
    }
    end
}

/// The token's flag on the TTL: read the earlier layout too.
const EARLIER: u32 = 1 << 31;

/// Notes, once per deployment (`<prefix>:store:since`, kept a year),
/// whether the answer stores may hold records of the earlier layout, and
/// returns until when (unix seconds) workers read it: two TTLs and skews
/// after the first worker of this layout started, so records stored by the
/// earlier version before the upgrade, and by its workers still running
/// while the upgrade rolls out, are found until they expire; 0 for a
/// deployment the earlier layout never ran in (none of its claim stores,
/// `<prefix>:rq:{<group>}` and `<prefix>:gr:{<group>}` hashes with `r.e`,
/// is there).
pub async fn start_layout<C: ConnectionLike + Clone + Send>(
    conn: &mut C,
    prefix: &str,
    ttl_s: u64,
) -> Result<u64, HandleError> {
    let key = format!("{prefix}:store:since");
    let since: Option<u64> = redis::cmd("GET").arg(&key).query_async(conn).await?;
    let since = match since {
        Some(since) => since,
        None => {
            let (now, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
            let probes = ["rq", "gr"].into_iter().flat_map(|space| {
                (0..CLAIM_GROUPS).map(move |g| format!("{prefix}:{space}:{{{g}}}"))
            });
            let found = futures_util::future::try_join_all(probes.map(|store| {
                let mut conn = conn.clone();
                async move {
                    redis::cmd("HEXISTS")
                        .arg(store)
                        .arg("r.e")
                        .query_async::<bool>(&mut conn)
                        .await
                }
            }))
            .await?;
            let since = if found.into_iter().any(|f| f) { now } else { 0 };
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(since)
                .arg("NX")
                .arg("EX")
                .arg(366 * 86_400)
                .query_async(conn)
                .await?;
            redis::cmd("GET").arg(&key).query_async(conn).await?
        }
    };
    Ok(if since == 0 {
        0
    } else {
        since.saturating_add(2 * (ttl_s + CLOCK_SKEW_S))
    })
}

/// Whether tokens made now ask to read the earlier layout too, for a
/// worker that reads it until `until` ([`start_layout`]).
pub fn reads_earlier_layout(until: u64) -> bool {
    until == u64::MAX || chrono::Utc::now().timestamp().max(0).unsigned_abs() < until
}

/// A token as `lua/lib/answer.lua` reads it: the request's digest, its
/// fingerprint, the TTL and `now` (0: the script reads the clock) as
/// big-endian u32.
fn token(digest: &[u8], fingerprint: &Fingerprint, ttl_s: u64, now: u64, earlier: bool) -> Vec<u8> {
    [
        &digest[..DIGEST_BYTES],
        &fingerprint.0,
        &tail(ttl_s, now, earlier),
    ]
    .concat()
}

/// A token's last 8 bytes: the TTL (with its flag) and `now`.
fn tail(ttl_s: u64, now: u64, earlier: bool) -> [u8; 8] {
    let mut ttl = u32::try_from(ttl_s).unwrap_or(EARLIER - 1).min(EARLIER - 1);
    if earlier {
        ttl |= EARLIER;
    }
    let mut tail = [0; 8];
    tail[..4].copy_from_slice(&ttl.to_be_bytes());
    tail[4..].copy_from_slice(&u32::try_from(now).unwrap_or(u32::MAX).to_be_bytes());
    tail
}

/// Where one request's claim and answer live, and what it asked: the
/// tokens `lua/lib/answer.lua` reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokens {
    /// The claim store of the id's group: `<prefix>:<space>:{<group>}`.
    pub claim_store: String,
    /// 16 bytes of SHA-256(id) ‖ 8 fingerprint bytes ‖ TTL ‖ 0 (see [`token`]).
    pub claim: Vec<u8>,
    /// 16 bytes of SHA-256(fingerprint ‖ id) ‖ 8 fingerprint bytes ‖ TTL ‖
    /// now; `now` is 0 until [`Tokens::at`] sets it.
    pub answer: Vec<u8>,
    id: String,
    ttl_s: u64,
    fingerprint: Fingerprint,
    /// Whether the scripts read the earlier layout too.
    earlier: bool,
}

/// Sets the TTL (with its flag) and `now` of a token, past its digest and
/// fingerprint: a token made again costs no SHA-256.
fn retime(token: &mut Vec<u8>, ttl_s: u64, now: u64, earlier: bool) {
    let head = token[..DIGEST_BYTES + 8].to_vec();
    *token = [head.as_slice(), &tail(ttl_s, now, earlier)].concat();
}

impl Tokens {
    /// The tokens of id `id` in namespace `space` (`rq` for request ids,
    /// `gr` for grant ids) under `prefix`, asking `fingerprint`, remembered
    /// for `ttl_s` seconds; they ask to read the earlier layout too (see
    /// [`Tokens::with_earlier`]).
    pub fn new(prefix: &str, space: &str, id: &str, fingerprint: Fingerprint, ttl_s: u64) -> Self {
        let h = Sha256::digest(id.as_bytes());
        let group = u16::from_be_bytes([h[0], h[1]]) % CLAIM_GROUPS;
        let mut tokens = Self {
            claim_store: format!("{prefix}:{space}:{{{group}}}"),
            claim: token(&h, &fingerprint, ttl_s, 0, true),
            answer: Vec::new(),
            id: id.to_owned(),
            ttl_s,
            fingerprint,
            earlier: true,
        };
        tokens.answer = tokens.answer_token(0);
        tokens
    }

    /// The same tokens, asking to read the earlier layout too or not
    /// ([`reads_earlier_layout`]).
    pub fn with_earlier(mut self, earlier: bool) -> Self {
        self.earlier = earlier;
        retime(&mut self.claim, self.ttl_s, 0, earlier);
        retime(&mut self.answer, self.ttl_s, 0, earlier);
        self
    }

    /// The same request asking `fingerprint` instead.
    pub fn with_fingerprint(&self, fingerprint: Fingerprint) -> Self {
        let mut tokens = self.clone();
        tokens.claim = token(&self.claim, &fingerprint, self.ttl_s, 0, self.earlier);
        tokens.fingerprint = fingerprint;
        tokens.answer = tokens.answer_token(0);
        tokens
    }

    /// Sets the time (unix seconds, Redis's clock) the answer token carries:
    /// the time the request's claim read, so its pool step reads no clock.
    pub fn at(&mut self, now: u64) {
        retime(&mut self.answer, self.ttl_s, now, self.earlier);
    }

    fn answer_token(&self, now: u64) -> Vec<u8> {
        let mut hash = Sha256::new();
        hash.update(self.fingerprint.0);
        hash.update(self.id.as_bytes());
        token(
            &hash.finalize(),
            &self.fingerprint,
            self.ttl_s,
            now,
            self.earlier,
        )
    }
}

/// What claiming an id found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The id is new, or was claimed before for the same content.
    Ours,
    /// The id was first used for other content.
    Reused,
}

/// Binds the id of `tokens` to its fingerprint for the answer TTL, unless it
/// is bound already; says whether the id may go on. The answer token then
/// carries the time the claim read ([`Tokens::at`]).
pub async fn claim<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    tokens: &mut Tokens,
) -> Result<Claim, HandleError> {
    let (ours, now): (i64, u64) = scripts
        .claim
        .key(&tokens.claim_store)
        .arg(&tokens.claim)
        .arg("claim")
        .invoke_async(conn)
        .await?;
    tokens.at(now);
    Ok(if ours == 1 {
        Claim::Ours
    } else {
        Claim::Reused
    })
}

/// Frees the claim of `tokens` if it still binds their fingerprint: for a
/// request refused as invalid before anything was stored (Stripe's rule: a
/// request that failed validation binds nothing). A claim bound to other
/// content is left alone.
pub async fn release<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    tokens: &Tokens,
) -> Result<(), HandleError> {
    let _: (i64, u64) = scripts
        .claim
        .key(&tokens.claim_store)
        .arg(&tokens.claim)
        .arg("release")
        .invoke_async(conn)
        .await?;
    Ok(())
}

/// What the stores hold for a request: its claim's fingerprint and its
/// answer's body in the answer store `results`. The answer is looked up for
/// the content the claim binds (for the fingerprint of `tokens` when there is
/// no claim). With `forget`, both are removed, as their expiry would a day
/// later: for operators and tests.
pub async fn stored<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    results: &str,
    tokens: &Tokens,
    forget: bool,
) -> Result<(Option<Vec<u8>>, Option<Vec<u8>>), HandleError> {
    let how = if forget { "forget" } else { "peek" };
    let claim: Option<Vec<u8>> = scripts
        .forget
        .key(&tokens.claim_store)
        .arg(&tokens.claim)
        .arg("claim")
        .arg(how)
        .invoke_async(conn)
        .await?;
    // A claim holds the fingerprint, and `s` after it once shared.
    let claim = claim.map(|mut record| {
        record.truncate(8);
        record
    });
    let bound = claim
        .as_deref()
        .and_then(|fp| <[u8; 8]>::try_from(fp).ok())
        .map(|fp| tokens.with_fingerprint(Fingerprint(fp)));
    let answer: Option<Vec<u8>> = scripts
        .forget
        .key(results)
        .arg(&bound.as_ref().unwrap_or(tokens).answer)
        .arg("answer")
        .arg(how)
        .invoke_async(conn)
        .await?;
    Ok((claim, answer))
}

/// The refusal of a request whose id was first used for other content.
pub fn reused(field: &str, id: &str) -> HandleError {
    Invalid::new(format!(
        "`{field}` {id:?} was first used for another request (another pool, user, count or amount); an id names one request"
    ))
    .into()
}

/// Stores `refusal` as the answer of the request with `token` in the answer
/// store `results`, unless it has an answer already. Returns `None` when the
/// refusal was stored, or the stored answer's reply. With
/// `only_while_absent` (an `unknown_pool` decided before the pool's load
/// finished), a pool that is there now stores nothing and answers
/// [`ScriptReply::Retry`]: the request is routed again.
pub async fn remember<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    results: &str,
    token: &[u8],
    refusal: &Refusal,
    only_while_absent: bool,
) -> Result<Option<ScriptReply>, HandleError> {
    // A stored award comes back in its stored form (binary: lua/lib/award.lua);
    // the caller replays it through the kind's step, so its text is not read.
    let mut call = scripts.remember_refusal.key(results);
    call.arg(token).arg(&refusal.body()[1..]);
    if only_while_absent {
        call.arg("absent");
    }
    let (status, text, number): (String, Vec<u8>, u64) = call.invoke_async(conn).await?;
    let text = String::from_utf8_lossy(&text).into_owned();
    match ScriptReply::read(&status, text, number, "request_id", "")? {
        ScriptReply::Refused(stored) if status == "refused" && stored == *refusal => Ok(None),
        other => Ok(Some(other)),
    }
}

/// A final refusal: a code of the wire contract and, for `already_grabbed`,
/// the share the user holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub previous: Option<Prize>,
}

impl Refusal {
    /// A refusal with `code` and nothing held.
    pub fn new(code: ErrorCode) -> Self {
        Self {
            code,
            previous: None,
        }
    }

    /// Reads `"<code>[:<detail>]"` as the scripts write it.
    pub fn parse(text: &str) -> Result<Self, HandleError> {
        let (code, detail) = match text.split_once(':') {
            Some((code, detail)) => (code, Some(detail)),
            None => (text, None),
        };
        let code = ErrorCode::parse(code)
            .ok_or_else(|| HandleError::internal(format!("unknown refusal {text:?} in Redis")))?;
        let previous = match (code, detail) {
            (ErrorCode::AlreadyGrabbed, Some(detail)) => {
                let (share, amount) = detail
                    .split_once(':')
                    .and_then(|(s, a)| Some((s.parse().ok()?, a.parse().ok()?)))
                    .ok_or_else(|| {
                        HandleError::internal(format!("malformed share {detail:?} in Redis"))
                    })?;
                Some(Prize::Share { share, amount })
            }
            _ => None,
        };
        Ok(Self { code, previous })
    }

    /// The stored body: `"!<code>[:<detail>]"`.
    pub fn body(&self) -> String {
        match &self.previous {
            Some(Prize::Share { share, amount }) => format!("!{}:{share}:{amount}", self.code),
            _ => format!("!{}", self.code),
        }
    }
}

/// What an answering script replied, before the kind reads its award body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScriptReply {
    /// An award made now; its body.
    Awarded(String),
    /// The request's first answer was an award; its body.
    Replayed(String),
    /// A refusal, made now or before.
    Refused(Refusal),
    /// Fewer prizes than asked; nothing changed.
    Short { in_pool: u64, generation: u64 },
    /// `count` is above the pool's `max_count`; nothing changed.
    TooMany { max_count: u64 },
    /// The script could not decide with the random values it was given;
    /// nothing changed, call again.
    Retry,
}

impl ScriptReply {
    /// Reads a `{status, text, number}` reply. `field` and `id` name the
    /// request id for the refusal of a reused id. A status nobody expects is
    /// an internal error, never a business answer.
    pub fn read(
        status: &str,
        text: String,
        number: u64,
        field: &str,
        id: &str,
    ) -> Result<Self, HandleError> {
        Ok(match status {
            "ok" => Self::Awarded(text),
            "dup" => match text.strip_prefix('!') {
                Some(refusal) => Self::Refused(Refusal::parse(refusal)?),
                None => Self::Replayed(text),
            },
            "refused" => Self::Refused(Refusal::parse(&text)?),
            "reused" => return Err(reused(field, id)),
            "short" => Self::Short {
                in_pool: text.parse().map_err(|_| {
                    HandleError::internal(format!("malformed short reply {text:?}"))
                })?,
                generation: number,
            },
            "too_many" => Self::TooMany {
                max_count: text.parse().map_err(|_| {
                    HandleError::internal(format!("malformed too_many reply {text:?}"))
                })?,
            },
            "retry" => Self::Retry,
            other => {
                return Err(HandleError::internal(format!(
                    "unexpected script status {other:?} ({text:?})"
                )))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_holds_answers_until_its_newest_epoch_expires() {
        // lua/lib/answer.lua: buckets expire two lengths after their epoch
        // starts; the earlier layout's five lengths and the skew after.
        let lua = include_str!("../../lua/lib/answer.lua");
        assert!(lua.contains("return t + 2 * l\n") && lua.contains("local SKEW = 300\n"));
        let be =
            |numbers: &[u32]| -> Vec<u8> { numbers.iter().flat_map(|n| n.to_be_bytes()).collect() };
        let epochs = be(&[1000, 10, 4, 0, 900, 40, 1, 3]);
        assert_eq!(store_end(Some(&epochs), None), 1000 + 20);
        assert_eq!(
            store_end(None, Some("1000:10:4;900:40:1o")),
            900 + 200 + 300
        );
        assert_eq!(store_end(Some(&epochs), Some("1000:10:4")), 1000 + 50 + 300);
        assert_eq!(store_end(Some(b""), Some("")), 0);
        assert_eq!(store_end(None, Some("junk;1:x:1")), 0);
    }

    #[test]
    fn fingerprints_differ_by_every_field_and_are_stable() {
        let base = fingerprint("draw", &[&"gift-1", &42, &10]);
        assert_eq!(base, fingerprint("draw", &[&"gift-1", &42, &10]));
        for other in [
            fingerprint("draw", &[&"gift-2", &42, &10]),
            fingerprint("draw", &[&"gift-1", &43, &10]),
            fingerprint("draw", &[&"gift-1", &42, &11]),
            fingerprint("grant", &[&"gift-1", &42, &10]),
            // Field boundaries count: ("ab", 1) is not ("a", "b1").
            fingerprint("draw", &[&"gift-14", &2, &10]),
        ] {
            assert_ne!(base, other);
        }
        // Pinned: a change of the scheme would refuse every replay across a deploy.
        let digest = Sha256::digest(b"draw\np\n1\n1");
        assert_eq!(fingerprint("draw", &[&"p", &1, &1]).0, digest[..8]);
        assert_eq!(
            fingerprint("draw", &[&"p", &1, &1]).hex(),
            digest[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
    }

    #[test]
    fn tokens_carry_full_digests_the_fingerprint_the_ttl_and_the_time() {
        let fp = fingerprint("draw", &[&"p", &1, &1]);
        let t = Tokens::new("pp", "rq", "req-1", fp, 90_000);
        let h = Sha256::digest(b"req-1");
        let group = u16::from_be_bytes([h[0], h[1]]) % CLAIM_GROUPS;
        assert_eq!(t.claim_store, format!("pp:rq:{{{group}}}"));
        // Digest, fingerprint, TTL (with the flag to read the earlier
        // layout: this process never ran start_layout), no time yet.
        let tail = |ttl: u32, now: u32| [(ttl | EARLIER).to_be_bytes(), now.to_be_bytes()].concat();
        assert_eq!(t.claim[..16], h[..16]);
        assert_eq!(t.claim[16..24], fp.0);
        assert_eq!(t.claim[24..], tail(90_000, 0)[..]);
        // The answer's digest covers the fingerprint and the id.
        let mut both = fp.0.to_vec();
        both.extend_from_slice(b"req-1");
        let a = Sha256::digest(&both);
        assert_eq!(t.answer[..16], a[..16]);
        assert_eq!(t.answer[16..24], fp.0);
        // The claim's time rides in the answer token only.
        let mut timed = t.clone();
        timed.at(1_700_000_000);
        assert_eq!(timed.answer[24..], tail(90_000, 1_700_000_000)[..]);
        assert_eq!(timed.answer[..24], t.answer[..24]);
        assert_eq!(timed.claim, t.claim);
        // Another id, another digest; another content, another fingerprint
        // and another answer digest.
        let other_id = Tokens::new("pp", "rq", "req-2", fp, 90_000);
        assert_ne!(other_id.claim, t.claim);
        assert_ne!(other_id.answer, t.answer);
        let other = fingerprint("draw", &[&"p", &1, &2]);
        let changed = Tokens::new("pp", "rq", "req-1", other, 90_000);
        assert_eq!(changed.claim[..16], t.claim[..16]);
        assert_ne!(changed.claim, t.claim);
        assert_ne!(changed.answer[..16], t.answer[..16]);
        assert_eq!(t.with_fingerprint(other), changed);
    }

    #[test]
    fn refusals_round_trip_and_unknown_codes_are_internal() {
        for text in ["sold_out", "already_grabbed:3:731", "pool_exhausted"] {
            let refusal = Refusal::parse(text).unwrap();
            assert_eq!(refusal.body(), format!("!{text}"));
        }
        assert!(matches!(
            Refusal::parse("no_such_code"),
            Err(HandleError::Internal(_))
        ));
        assert!(matches!(
            Refusal::parse("already_grabbed:x"),
            Err(HandleError::Internal(_))
        ));
    }

    #[test]
    fn script_replies_are_read_strictly() {
        assert_eq!(
            ScriptReply::read("dup", "!sold_out".into(), 0, "request_id", "r").unwrap(),
            ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))
        );
        assert!(matches!(
            ScriptReply::read("reused", String::new(), 0, "request_id", "r"),
            Err(HandleError::Invalid(_))
        ));
        assert!(matches!(
            ScriptReply::read("weird", String::new(), 0, "request_id", "r"),
            Err(HandleError::Internal(_))
        ));
        assert!(matches!(
            ScriptReply::read("short", "x".into(), 0, "request_id", "r"),
            Err(HandleError::Internal(_))
        ));
    }
}
