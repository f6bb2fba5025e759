//! The store of remembered answers and claims (`lua/lib/answer.lua`) on the
//! real Redis: every claim and answer is found again however the buckets
//! grow, records are told apart by all 16 bytes of their digests, an id is
//! bound to its first content, buckets stay compact, and where a record
//! lives follows the epochs kept in the store, never the TTL setting.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::TestEnv;
use prizepool::kinds::{
    answer::{self, Claim, Refusal, ScriptReply, Tokens},
    fingerprint,
};
use prizepool::messages::ErrorCode;

fn tokens(env: &TestEnv, id: &str, content: u32, ttl: u64) -> Tokens {
    Tokens::new(
        &env.config.redis_prefix,
        "rq",
        id,
        fingerprint("draw", &[&"pool", &1, &content]),
        ttl,
    )
}

async fn remember(
    env: &TestEnv,
    store: &str,
    token: &[u8],
    code: ErrorCode,
) -> Option<ScriptReply> {
    let mut redis = env.redis.clone();
    answer::remember(
        &mut redis,
        &env.scripts,
        store,
        token,
        &Refusal::new(code),
        false,
    )
    .await
    .unwrap()
}

/// Claims a raw claim token (`"<ttl>::" ‖ digest ‖ fingerprint`) in `store`.
async fn claim_raw(env: &TestEnv, store: &str, token: &[u8]) -> i64 {
    let mut redis = env.redis.clone();
    let (ours, _now): (i64, u64) = env
        .scripts
        .claim
        .key(store)
        .arg(token)
        .arg("claim")
        .invoke_async(&mut redis)
        .await
        .unwrap();
    ours
}

/// What `store` holds for a raw token, read as the operators' script reads it.
async fn peek(env: &TestEnv, store: &str, token: &[u8]) -> Option<Vec<u8>> {
    let mut redis = env.redis.clone();
    env.scripts
        .forget
        .key(store)
        .arg(token)
        .arg("answer")
        .arg("peek")
        .invoke_async(&mut redis)
        .await
        .unwrap()
}

/// Claims the id of `tokens` for their content.
async fn claimed(env: &TestEnv, tokens: &mut Tokens) -> Claim {
    let mut redis = env.redis.clone();
    answer::claim(&mut redis, &env.scripts, tokens)
        .await
        .unwrap()
}

async fn keys(env: &TestEnv, pattern: &str) -> Vec<String> {
    let mut redis = env.redis.clone();
    redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut redis)
        .await
        .unwrap()
}

async fn encodings(env: &TestEnv, pattern: &str) -> Vec<String> {
    let mut redis = env.redis.clone();
    let mut out = Vec::new();
    for key in keys(env, pattern).await {
        out.push(
            redis::cmd("OBJECT")
                .arg("ENCODING")
                .arg(key)
                .query_async(&mut redis)
                .await
                .unwrap(),
        );
    }
    out
}

/// Hash buckets (the layout new epochs get) and string buckets (the
/// earlier one, `ANSWER_BUCKETS=strings`) keep the same promises.
#[tokio::test]
async fn every_claim_and_answer_is_found_again_however_the_hash_buckets_grow() {
    found_again_however_the_buckets_grow(false).await;
}

#[tokio::test]
async fn every_claim_and_answer_is_found_again_however_the_string_buckets_grow() {
    found_again_however_the_buckets_grow(true).await;
}

async fn found_again_however_the_buckets_grow(strings: bool) {
    let tokens = |env: &TestEnv, id: &str, content: u32, ttl: u64| {
        tokens(env, id, content, ttl).with_hash_buckets(!strings)
    };
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let store = env.keys("grow").results();
    let n = 6_000;
    for i in 0..n {
        let mut t = tokens(&env, &format!("id-{i}"), 1, 90_000);
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &mut t)
                .await
                .unwrap(),
            Claim::Ours
        );
        assert_eq!(
            remember(&env, &store, &t.answer, ErrorCode::SoldOut).await,
            None
        );
    }
    // The buckets split many times; every id is
    // still bound to its content and its answer.
    for i in (0..n).step_by(7) {
        let id = format!("id-{i}");
        let mut same = tokens(&env, &id, 1, 90_000);
        let mut other = tokens(&env, &id, 2, 90_000);
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &mut same)
                .await
                .unwrap(),
            Claim::Ours,
            "{id}"
        );
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &mut other)
                .await
                .unwrap(),
            Claim::Reused,
            "{id}"
        );
        // The stored answer wins over a later refusal, and replays.
        assert_eq!(
            remember(&env, &store, &same.answer, ErrorCode::PoolExhausted).await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
            "{id}"
        );
        // An answer is found for its id and content only: the same id
        // with other content has none (its claim refuses it first).
        assert_eq!(peek(&env, &store, &other.answer).await, None, "{id}");
    }
    // A freed claim binds nothing: other content may take the id.
    let freed = tokens(&env, "id-3", 1, 90_000);
    answer::release(&mut redis, &env.scripts, &freed)
        .await
        .unwrap();
    assert_eq!(
        answer::claim(
            &mut redis,
            &env.scripts,
            &mut tokens(&env, "id-3", 2, 90_000)
        )
        .await
        .unwrap(),
        Claim::Ours
    );
    // Compact: buckets are plain strings or listpack hashes (no bucket
    // past Redis's 128 fields of a listpack).
    let buckets = encodings(&env, &format!("{store}:*")).await;
    let compact = if strings {
        ["raw", "embstr"]
    } else {
        ["listpack", "listpack"]
    };
    assert!(
        buckets.iter().all(|e| compact.contains(&e.as_str())),
        "{buckets:?}"
    );
    // About one bucket per 128 records (strings), per 40 (hashes).
    let per = if strings { 128 } else { 40 };
    assert!(
        (n / (2 * per)..=2 * n / per).contains(&buckets.len()),
        "{} buckets for {n} answers",
        buckets.len()
    );
}

/// A claim store's string buckets hold about 64 records (its records are
/// read into Lua whole on every claim, so they are kept smaller than an
/// answer store's 128): every claim is found again, and the buckets number
/// about one per 64 claims.
#[tokio::test]
async fn a_claim_store_keeps_buckets_of_about_64_claims() {
    let env = TestEnv::new(&[]).await;
    let claims = format!("{}:rq:{{11}}", env.config.redis_prefix);
    let n = 4_000usize;
    let all: Vec<_> = (0..n)
        .map(|i| tokens(&env, &format!("small-{i}"), 1, 90_000))
        .collect();
    for t in &all {
        assert_eq!(claim_raw(&env, &claims, &t.claim).await, 1);
    }
    for (i, t) in all.iter().enumerate().step_by(13) {
        assert_eq!(claim_raw(&env, &claims, &t.claim).await, 1, "claim {i}");
        let other = tokens(&env, &format!("small-{i}"), 2, 90_000);
        assert_eq!(claim_raw(&env, &claims, &other.claim).await, 0, "claim {i}");
    }
    let buckets = encodings(&env, &format!("{claims}:*")).await;
    assert!(
        buckets.iter().all(|e| e == "raw" || e == "embstr"),
        "{buckets:?}"
    );
    assert!(
        (n / 96..=n / 48).contains(&buckets.len()),
        "{} buckets for {n} claims",
        buckets.len()
    );
}

#[tokio::test]
async fn digests_that_differ_in_any_one_byte_are_two_requests() {
    let env = TestEnv::new(&[]).await;
    let claims = format!("{}:rq:{{7}}", env.config.redis_prefix);
    let answers = env.keys("twins").results();
    // Enough records first that the store has split into many buckets.
    for i in 0..2_000u32 {
        let t = tokens(&env, &format!("filler-{i}"), 1, 90_000);
        assert_eq!(claim_raw(&env, &claims, &t.claim).await, 1);
        assert_eq!(
            remember(&env, &answers, &t.answer, ErrorCode::SoldOut).await,
            None
        );
    }
    let digest: Vec<u8> = (0..16u8)
        .map(|b| b.wrapping_mul(37).wrapping_add(11))
        .collect();
    let token = |d: &[u8], fp: u8| {
        let mut t = b"90000::".to_vec();
        t.extend_from_slice(d);
        t.extend_from_slice(&[fp; 8]);
        t
    };
    let base = token(&digest, 1);
    assert_eq!(claim_raw(&env, &claims, &base).await, 1);
    assert_eq!(
        remember(&env, &answers, &base, ErrorCode::SoldOut).await,
        None
    );
    for at in 0..16 {
        // A twin that agrees on 15 of the 16 bytes (same store, and for
        // most bytes the same bucket) with other content.
        let mut twin = digest.clone();
        twin[at] ^= 0x80;
        let t = token(&twin, 2);
        assert_eq!(claim_raw(&env, &claims, &t).await, 1, "byte {at}");
        assert_eq!(peek(&env, &answers, &t).await, None, "byte {at}");
        assert_eq!(
            remember(&env, &answers, &t, ErrorCode::PoolExhausted).await,
            None,
            "byte {at}"
        );
        assert_eq!(
            peek(&env, &answers, &t).await.as_deref(),
            Some(&b"!pool_exhausted"[..]),
            "byte {at}"
        );
    }
    // The original is untouched: its claim binds its own content, its
    // answer is its own.
    assert_eq!(claim_raw(&env, &claims, &base).await, 1);
    assert_eq!(claim_raw(&env, &claims, &token(&digest, 2)).await, 0);
    assert_eq!(
        peek(&env, &answers, &base).await.as_deref(),
        Some(&b"!sold_out"[..])
    );
}

#[tokio::test]
async fn a_changed_ttl_finds_every_answer_stored_before() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("ttl-change").results();
    let mut redis = env.redis.clone();
    // Workers with a long TTL, then workers with a short one, then both at
    // once (a rolling deploy): each finds what every other stored.
    for (i, (write, read)) in [(90_000, 30), (30, 90_000), (90_000, 7_200), (7_200, 90_000)]
        .into_iter()
        .enumerate()
    {
        let id = format!("ttl-{i}");
        let mut first = tokens(&env, &id, 1, write);
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &mut first)
                .await
                .unwrap(),
            Claim::Ours
        );
        assert_eq!(
            remember(&env, &store, &first.answer, ErrorCode::SoldOut).await,
            None
        );
        let mut retry = tokens(&env, &id, 1, read);
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &mut retry)
                .await
                .unwrap(),
            Claim::Ours
        );
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &mut tokens(&env, &id, 2, read))
                .await
                .unwrap(),
            Claim::Reused,
            "written with TTL {write}, read with {read}"
        );
        assert_eq!(
            remember(&env, &store, &retry.answer, ErrorCode::PoolExhausted).await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
            "written with TTL {write}, read with {read}"
        );
    }
}

/// The tokens of request `id` (content 1, TTL `ttl`) carrying the time `now`.
fn tokens_at(env: &TestEnv, id: &str, ttl: u64, now: u64) -> Tokens {
    let mut t = tokens(env, id, 1, ttl);
    t.at(now);
    t
}

#[tokio::test]
async fn an_answer_is_kept_its_ttl_and_the_skew_and_forgotten_a_quarter_later() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("epochs").results();
    let mut redis = env.redis.clone();
    let (ttl, skew) = (86_400, answer::CLOCK_SKEW_S);
    // Epochs last a quarter of the TTL and the clock skew allowed. The
    // tokens name the times; Redis's clock only expires the buckets.
    let len = (ttl + skew).div_ceil(4);
    let (start, _): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    let found = {
        let (env, store) = (&env, &store);
        move |id: &'static str, now: u64| {
            let t = tokens_at(env, id, ttl, now);
            async move { peek(env, store, &t.answer).await }
        }
    };
    // Stores `sold_out` for request `id` at `now`; says whether it was new.
    let stored = {
        let (env, store) = (&env, &store);
        move |id: String, now: u64| {
            let t = tokens_at(env, &id, ttl, now);
            async move {
                remember(env, store, &t.answer, ErrorCode::SoldOut)
                    .await
                    .is_none()
            }
        }
    };
    assert!(stored("first".to_owned(), start).await);
    // Every bucket expires five epochs and the skew after its epoch starts.
    for key in keys(&env, &format!("{store}:*")).await {
        let left: u64 = redis::cmd("TTL")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(
            (5 * len + skew - 10..=5 * len + skew).contains(&left),
            "{key}: {left}"
        );
    }
    // A request answered in the last second of the epoch, by a step whose
    // `now` (its claim's) is behind the time it ran, is found a whole TTL
    // later by a reader whose clock runs the allowed skew ahead.
    // The epoch's last second, as the store's meta hash gives it.
    let epochs: String = redis::cmd("HGET")
        .arg(env.keys("epochs").meta())
        .arg("r.e")
        .query_async(&mut redis)
        .await
        .unwrap();
    let geometry: Vec<u64> = epochs
        .split(':')
        .take(2)
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(geometry, [start, len], "{epochs}");
    let last = start + len - 1;
    assert!(stored("last".to_owned(), last).await);
    assert_eq!(
        found("last", last + ttl + skew - 1).await.as_deref(),
        Some(&b"!sold_out"[..]),
        "kept its TTL and the skew"
    );
    // A write in each later epoch opens it; the first answer is found in
    // every one of them.
    for i in 1..5 {
        let now = start + i * len;
        let id = format!("epoch-{i}");
        assert!(stored(id.clone(), now).await);
        assert_eq!(
            found("first", now + len - 1).await.as_deref(),
            Some(&b"!sold_out"[..]),
            "kept through epoch {i}"
        );
    }
    let after = start + 5 * len;
    assert!(stored("after".to_owned(), after).await);
    assert_eq!(
        found("first", after).await,
        None,
        "forgotten five epochs on"
    );
    assert_eq!(found("last", after).await, None, "forgotten five epochs on");
    assert_eq!(
        found("after", after).await.as_deref(),
        Some(&b"!sold_out"[..])
    );
}

#[tokio::test]
async fn a_long_answer_is_kept_whole_in_a_key_of_its_own() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("long").results();
    let mut redis = env.redis.clone();
    let t = tokens(&env, "long-1", 1, 90_000);
    // A refusal detail long enough to leave the bucket.
    let detail = format!("already_grabbed:{}:1", "9".repeat(300));
    let (status, text, _): (String, String, u64) = env
        .scripts
        .remember_refusal
        .key(&store)
        .arg(&t.answer)
        .arg(&detail)
        .invoke_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        (status.as_str(), text.as_str()),
        ("refused", detail.as_str())
    );
    assert_eq!(
        peek(&env, &store, &t.answer).await,
        Some(format!("!{detail}").into_bytes())
    );
    assert_eq!(keys(&env, &format!("{store}:x:*")).await.len(), 1);
    let (_, answer) = answer::stored(&mut redis, &env.scripts, &store, &t, true)
        .await
        .unwrap();
    assert_eq!(answer, Some(format!("!{detail}").into_bytes()));
    assert_eq!(peek(&env, &store, &t.answer).await, None);
    assert!(keys(&env, &format!("{store}:x:*")).await.is_empty());
}

#[tokio::test]
async fn a_refusal_for_a_missing_pool_expires_unless_the_pool_is_loaded() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    // A sharded pool's own meta hash is written by the load (its sub-pools
    // by their configuration), and must be kept all the same.
    for (pool, load) in [
        ("ghost", None),
        ("later", Some("")),
        ("split", Some("shards = 2")),
    ] {
        let store = env.keys(pool).results();
        let meta = env.keys(pool).meta();
        let t = tokens(&env, &format!("{pool}-1"), 1, 90_000);
        assert_eq!(
            remember(&env, &store, &t.answer, ErrorCode::UnknownPool).await,
            None
        );
        // The meta hash holds the store's epochs only, and expires with them.
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg(&meta)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(fields, vec!["r.e".to_owned()], "{pool}");
        let ttl: i64 = redis::cmd("TTL")
            .arg(&meta)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(ttl > 90_000, "{pool}: {ttl}");
        if let Some(extra) = load {
            env.load(&common::pool_toml(pool, extra, &[("a", &[(1, 10)])]))
                .await;
            let ttl: i64 = redis::cmd("TTL")
                .arg(&meta)
                .query_async(&mut redis)
                .await
                .unwrap();
            assert_eq!(ttl, -1, "a loaded pool's meta hash is kept");
        }
        // Either way the refusal is still the request's answer.
        assert_eq!(
            remember(&env, &store, &t.answer, ErrorCode::PoolExhausted).await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::UnknownPool))),
            "{pool}"
        );
    }
}

#[tokio::test]
async fn a_claim_taken_by_two_copies_is_not_freed_by_one_refused_as_invalid() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    for strings in [true, false] {
        let tokens = |id: &str, content: u32| {
            tokens(&env, &format!("{strings}-{id}"), content, 90_000).with_hash_buckets(!strings)
        };
        // Two copies of one request claim its id; one is refused as
        // invalid (its pool changed) and frees what it claimed, while the
        // other may have drawn: the id stays bound to its content.
        let mut first = tokens("twice", 1);
        let mut second = tokens("twice", 1);
        for copy in [&mut first, &mut second] {
            assert_eq!(claimed(&env, copy).await, Claim::Ours);
        }
        answer::release(&mut redis, &env.scripts, &first)
            .await
            .unwrap();
        assert_eq!(
            claimed(&env, &mut tokens("twice", 2)).await,
            Claim::Reused,
            "strings: {strings}"
        );
        assert_eq!(claimed(&env, &mut tokens("twice", 1)).await, Claim::Ours);
        // A claim of one copy is freed: other content may take the id.
        let once = tokens("once", 1);
        assert_eq!(claimed(&env, &mut once.clone()).await, Claim::Ours);
        answer::release(&mut redis, &env.scripts, &once)
            .await
            .unwrap();
        assert_eq!(
            claimed(&env, &mut tokens("once", 2)).await,
            Claim::Ours,
            "strings: {strings}"
        );
    }
}

#[tokio::test]
async fn an_unknown_pool_is_remembered_only_while_the_pool_is_not_there() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let unknown = Refusal::new(ErrorCode::UnknownPool);
    // A pool that is not there: the refusal is stored.
    let t = tokens(&env, "ghost-1", 1, 90_000);
    let store = env.keys("ghost").results();
    assert_eq!(
        answer::remember(&mut redis, &env.scripts, &store, &t.answer, &unknown, true)
            .await
            .unwrap(),
        None
    );
    // A pool whose load finished after the request was routed (sharded or
    // not): nothing is stored under its own id, the request routes again.
    for (pool, extra) in [("plain", ""), ("split", "shards = 2")] {
        env.load(&common::pool_toml(pool, extra, &[("a", &[(1, 10)])]))
            .await;
        let t = tokens(&env, &format!("{pool}-1"), 1, 90_000);
        let store = env.keys(pool).results();
        assert_eq!(
            answer::remember(&mut redis, &env.scripts, &store, &t.answer, &unknown, true)
                .await
                .unwrap(),
            Some(ScriptReply::Retry),
            "{pool}"
        );
        assert_eq!(peek(&env, &store, &t.answer).await, None, "{pool}");
        let epochs: Option<String> = redis::cmd("HGET")
            .arg(env.keys(pool).meta())
            .arg("r.e")
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(
            epochs, None,
            "{pool}: no answer store under the pool's own id"
        );
    }
}

/// Runs claim.lua (`op`: "claim" or "release") or forget.lua (`op`:
/// "forget") in claim store `store` for digest `d` and content `c`, with
/// TTL `ttl`, at time `now`, opening hash buckets with `hashes`.
async fn claim_at(env: &TestEnv, store: &str, d: u8, c: u8, at: (u64, u64, bool), op: &str) -> i64 {
    let (ttl, now, hashes) = at;
    let mut token = format!("{ttl}{}:{now}:", if hashes { "h" } else { "" }).into_bytes();
    token.extend_from_slice(&[d; 16]);
    token.extend_from_slice(&[c; 8]);
    let mut redis = env.redis.clone();
    if op == "forget" {
        let forgot: Option<Vec<u8>> = env
            .scripts
            .forget
            .key(store)
            .arg(token)
            .arg("claim")
            .arg("forget")
            .invoke_async(&mut redis)
            .await
            .unwrap();
        return i64::from(forgot.is_some());
    }
    let (verdict, _now): (i64, u64) = env
        .scripts
        .claim
        .key(store)
        .arg(token)
        .arg(op)
        .invoke_async(&mut redis)
        .await
        .unwrap();
    verdict
}

#[tokio::test]
async fn a_shared_mark_lives_and_dies_with_its_claim() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let (t, _): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    // Steps of claim.lua and forget.lua: (claim store and digest, content,
    // TTL, seconds after t, operation, verdict). TTL 100 s: epochs of
    // 100 s, read for 500 s.
    let steps: &[(u8, u8, u64, u64, &str, i64)] = &[
        (1, 1, 100, 0, "claim", 1),
        // A copy comes 450 s later: the claim is shared, and it lives on
        // with its mark (the first epoch is no longer read at t + 500).
        (1, 1, 100, 450, "claim", 1),
        (1, 1, 100, 460, "release", 0),
        (1, 2, 100, 560, "claim", 0),
        // Both gone together: a new binding of the id is one copy's, and
        // is freed when that copy is refused as invalid.
        (1, 2, 100, 960, "claim", 1),
        (1, 2, 100, 961, "release", 1),
        (1, 3, 100, 962, "claim", 1),
        // Copies with different TTLs: the mark expires with the claim, not
        // with the shorter TTL of the copy that made it.
        (2, 1, 86_400, 0, "claim", 1),
        (2, 1, 100, 10, "claim", 1),
        (2, 1, 100, 600, "release", 0),
        (2, 2, 100, 600, "claim", 0),
        // Forgetting a claim forgets its mark.
        (3, 1, 100, 0, "claim", 1),
        (3, 1, 100, 1, "claim", 1),
        (3, 1, 100, 2, "forget", 1),
        (3, 1, 100, 3, "claim", 1),
        (3, 1, 100, 4, "release", 1),
        (3, 2, 100, 5, "claim", 1),
    ];
    for hashes in [false, true] {
        for &(d, c, ttl, after, op, verdict) in steps {
            let store = format!("{}:rq:{{{d}{hashes}}}", env.config.redis_prefix);
            assert_eq!(
                claim_at(&env, &store, d, c, (ttl, t + after, hashes), op).await,
                verdict,
                "hashes: {hashes}, id {d}, content {c}, {op} at t + {after}"
            );
        }
    }
}

#[tokio::test]
async fn a_meta_hash_that_expires_outlives_the_epochs_it_lists() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    // A closed red packet's meta hash is kept a while, then expires; a
    // loaded pool's is kept for good. Answers stored after the packet
    // closed open epochs the hash must outlive.
    for (pool, expires) in [("closing", true), ("kept", false)] {
        let meta = env.keys(pool).meta();
        let mut set = redis::pipe();
        set.cmd("HSET")
            .arg(&meta)
            .arg("kind")
            .arg("red_packet")
            .ignore();
        if expires {
            set.cmd("EXPIRE").arg(&meta).arg(60).ignore();
        }
        set.query_async::<()>(&mut redis).await.unwrap();
        let t = tokens(&env, &format!("{pool}-1"), 1, 90_000);
        let store = env.keys(pool).results();
        assert_eq!(
            remember(&env, &store, &t.answer, ErrorCode::SoldOut).await,
            None
        );
        let ttl: i64 = redis::cmd("TTL")
            .arg(&meta)
            .query_async(&mut redis)
            .await
            .unwrap();
        if expires {
            assert!(
                ttl > 90_000,
                "{pool}: the hash expires before its epochs: {ttl}"
            );
        } else {
            assert_eq!(ttl, -1, "{pool}: a hash kept for good stays so");
        }
        assert_eq!(
            peek(&env, &store, &t.answer).await.as_deref(),
            Some(&b"!sold_out"[..])
        );
    }
}

/// One step of the model test: claim a request and remember an answer
/// for it, with the TTL a worker of the fleet might have.
#[derive(Clone, Debug)]
struct Op {
    /// The request's digest: bytes 0 or 1 only, so requests share
    /// prefixes, stores and buckets and differ in a byte or two.
    digest: [u8; 16],
    content: u8,
    ttl: u64,
    code: ErrorCode,
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    (
        proptest::array::uniform16(0u8..2),
        0u8..3,
        prop_oneof![Just(90_000u64), Just(86_400), Just(400_000)],
        prop_oneof![
            Just(ErrorCode::SoldOut),
            Just(ErrorCode::PoolExhausted),
            Just(ErrorCode::UnknownPool)
        ],
    )
        .prop_map(|(digest, content, ttl, code)| Op {
            digest,
            content,
            ttl,
            code,
        })
}

/// Claims and answers driven by generated requests on the real Redis
/// agree with a model that compares ids and contents in full: an id is
/// bound to its first content, an answer is the first stored for its id
/// and content, whatever the TTL each step was run with.
#[test]
fn the_store_agrees_with_a_model_of_exact_ids() {
    use std::collections::HashMap;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let env = rt.block_on(TestEnv::new(&[]));
    let n = std::sync::atomic::AtomicUsize::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases: 12,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    });
    runner
        .run(&proptest::collection::vec(op(), 1..300), |ops| {
            let case = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            rt.block_on(async {
                let claims = format!("{}:model{case}:{{1}}", env.config.redis_prefix);
                let answers = env.keys(&format!("model{case}")).results();
                let mut bound: HashMap<[u8; 16], u8> = HashMap::new();
                let mut answered: HashMap<([u8; 16], u8), ErrorCode> = HashMap::new();
                for op in ops {
                    let mut claim = format!("{}::", op.ttl).into_bytes();
                    claim.extend_from_slice(&op.digest);
                    claim.extend_from_slice(&[op.content; 8]);
                    let first = *bound.entry(op.digest).or_insert(op.content);
                    let ours = claim_raw(&env, &claims, &claim).await;
                    proptest::prop_assert_eq!(ours, i64::from(first == op.content), "{:?}", op);
                    if first != op.content {
                        continue;
                    }
                    // The answer's digest covers the content: another
                    // content of the same id is another record.
                    let mut digest = op.digest;
                    digest[15] ^= op.content.wrapping_mul(16);
                    let mut answer = format!("{}::", op.ttl).into_bytes();
                    answer.extend_from_slice(&digest);
                    answer.extend_from_slice(&[op.content; 8]);
                    let stored = remember(&env, &answers, &answer, op.code).await;
                    match answered.get(&(op.digest, op.content)) {
                        None => {
                            proptest::prop_assert_eq!(stored, None, "{:?}", op);
                            answered.insert((op.digest, op.content), op.code);
                        }
                        Some(code) => proptest::prop_assert_eq!(
                            stored,
                            Some(ScriptReply::Refused(Refusal::new(*code))),
                            "{:?}",
                            op
                        ),
                    }
                }
                Ok(())
            })
        })
        .unwrap();
}

/// Answer token `i` of ids aimed at one bucket: digests that agree on the
/// bytes that place a record (4-6) and not on those that split buckets
/// (7-8, 257, never a multiple of 40 or 128), as ids crafted by an
/// attacker would; `mark` is the token's layout mark (`h` for hashes).
/// Every string bucket of `store` stops at its cap (32 KiB, and the one
/// record of at most `record` bytes that crossed it), and the records past
/// it have keys of their own.
async fn assert_capped(env: &TestEnv, store: &str, record: usize) {
    let mut redis = env.redis.clone();
    let buckets: Vec<String> = keys(env, &format!("{store}:*:*"))
        .await
        .into_iter()
        .filter(|k| !k.contains(":o:"))
        .collect();
    for b in &buckets {
        let len: usize = redis::cmd("STRLEN")
            .arg(b)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(len <= 32_768 + record, "{b}: {len} bytes");
    }
    assert!(
        !keys(env, &format!("{store}:*:o:*")).await.is_empty(),
        "records past the full bucket of {store} have keys of their own"
    );
}

fn aimed_token(i: u32, mark: &str) -> Vec<u8> {
    let mut d = [7u8; 16];
    d[6] = 1;
    d[7] = 1;
    d[8..12].copy_from_slice(&i.to_be_bytes());
    let mut t = format!("90000{mark}::").into_bytes();
    t.extend_from_slice(&d);
    t.extend_from_slice(&[1; 8]);
    t
}

#[tokio::test]
async fn ids_aimed_at_one_string_bucket_cannot_make_it_grow_without_bound() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("aimed").results();
    let token = |i: u32| aimed_token(i, "");
    let n = 2_000;
    for i in 0..n {
        assert_eq!(
            remember(&env, &store, &token(i), ErrorCode::SoldOut).await,
            None,
            "{i}"
        );
    }
    assert_capped(&env, &store, 64).await;
    // Every one is still found, and replays its first answer.
    for i in (0..n).step_by(37) {
        assert_eq!(
            remember(&env, &store, &token(i), ErrorCode::PoolExhausted).await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
            "{i}"
        );
    }
}

/// Ids aimed at one bucket of a claim store (its buckets are the smaller
/// ones): the bucket stops growing at its cap, the records past it get keys
/// of their own, every id stays bound to its content, and a reused id with
/// other content is refused.
#[tokio::test]
async fn ids_aimed_at_one_claim_bucket_stay_bound_to_their_content() {
    let env = TestEnv::new(&[]).await;
    let claims = format!("{}:rq:{{5}}", env.config.redis_prefix);
    let n = 2_000;
    for i in 0..n {
        assert_eq!(
            claim_raw(&env, &claims, &aimed_token(i, "")).await,
            1,
            "{i}"
        );
    }
    assert_capped(&env, &claims, 24).await;
    for i in (0..n).step_by(37) {
        let same = aimed_token(i, "");
        assert_eq!(claim_raw(&env, &claims, &same).await, 1, "{i}");
        // The same id (digest) with another content fingerprint.
        let mut other = same.clone();
        let last = other.len() - 1;
        other[last] ^= 0xff;
        assert_eq!(claim_raw(&env, &claims, &other).await, 0, "{i}");
    }
}

/// A fleet whose workers disagree on `ANSWER_BUCKETS` (a rolling upgrade)
/// or that changes it loses nothing: an epoch keeps the layout it was
/// opened with, and every answer and claim is found whichever layout the
/// retry's worker writes, in the store's old and new epochs alike.
#[tokio::test]
async fn answers_and_claims_survive_a_change_of_bucket_layout() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let n = 300;
    for (first, then) in [(true, false), (false, true)] {
        let store = env.keys(&format!("layout-{first}")).results();
        let id = |i: u32| format!("{first}-{i}");
        let mut now = 0;
        // The first epoch: opened in layout `first`, then written by
        // workers of both settings (it keeps its layout).
        for i in 0..n {
            let mut t = tokens(&env, &id(i), 1, 90_000).with_hash_buckets(first != (i % 2 == 0));
            assert_eq!(
                answer::claim(&mut redis, &env.scripts, &mut t)
                    .await
                    .unwrap(),
                Claim::Ours
            );
            now = t
                .answer
                .split(|&b| b == b':')
                .nth(1)
                .map_or(0, |n| String::from_utf8_lossy(n).parse::<u64>().unwrap());
            assert_eq!(
                remember(&env, &store, &t.answer, ErrorCode::SoldOut).await,
                None
            );
        }
        // Retries a quarter of the TTL later, past the first epoch: a new
        // epoch opens, in layout `then`, and every answer is found in the
        // old one; new requests go to the new one.
        let later = now + (90_000 + answer::CLOCK_SKEW_S).div_ceil(4) + 1;
        // A new request at `later`, by a worker of layout `hashes`.
        let fresh = |i: u32, hashes: bool| {
            let mut t = tokens(&env, &format!("new-{}", id(i)), 1, 90_000);
            t.at(later);
            t.with_hash_buckets(hashes)
        };
        for i in 0..n {
            let mut t = tokens(&env, &id(i), 1, 90_000);
            let mut other = tokens(&env, &id(i), 2, 90_000);
            assert_eq!(
                (claimed(&env, &mut t).await, claimed(&env, &mut other).await),
                (Claim::Ours, Claim::Reused),
                "{}",
                id(i)
            );
            t.at(later);
            let t = t.with_hash_buckets(!then);
            assert_eq!(
                remember(&env, &store, &t.answer, ErrorCode::PoolExhausted).await,
                Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
                "{}",
                id(i)
            );
            assert_eq!(
                remember(&env, &store, &fresh(i, !then).answer, ErrorCode::SoldOut).await,
                None
            );
        }
        for i in 0..n {
            assert_eq!(
                remember(
                    &env,
                    &store,
                    &fresh(i, !first).answer,
                    ErrorCode::PoolExhausted
                )
                .await,
                Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
                "new-{}",
                id(i)
            );
        }
        // Both layouts were written: the first epoch's and the second's.
        let encodings = encodings(&env, &format!("{store}:*")).await;
        assert!(encodings.iter().any(|e| e == "listpack"), "{encodings:?}");
        assert!(
            encodings.iter().any(|e| e == "raw" || e == "embstr"),
            "{encodings:?}"
        );
    }
}

/// Ids aimed at one hash bucket make it a larger hash: Redis turns it from
/// a listpack into a hash table past 128 fields, where a write costs the
/// same however many records the bucket holds (a string bucket would be
/// rewritten whole: see the test above). Every record is found again.
#[tokio::test]
async fn ids_aimed_at_one_hash_bucket_cost_no_more_per_write() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("aimed").results();
    let token = |i: u32| aimed_token(i, "h");
    let n = 2_000;
    for i in 0..n {
        assert_eq!(
            remember(&env, &store, &token(i), ErrorCode::SoldOut).await,
            None,
            "{i}"
        );
    }
    let buckets = keys(&env, &format!("{store}:*:*")).await;
    assert_eq!(
        buckets.len(),
        1,
        "one bucket took every record: {buckets:?}"
    );
    assert_eq!(encodings(&env, &buckets[0]).await, ["hashtable"]);
    for i in (0..n).step_by(37) {
        assert_eq!(
            remember(&env, &store, &token(i), ErrorCode::PoolExhausted).await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
            "{i}"
        );
    }
}

async fn used_memory(redis: &mut redis::aio::MultiplexedConnection) -> u64 {
    prizepool::redis_conn::used_memory(redis).await.unwrap()
}

/// What a remembered result costs, on a private Redis: 100,000 requests
/// (`RESULTS` to change it) claimed and answered with the stored body of a
/// count-1 award. Printed for the record; `prizepool bench` measures a
/// million.
#[tokio::test]
async fn what_a_remembered_result_costs() {
    let dir = common::tempdir("mem");
    let port = common::free_port();
    let _server = common::redis_server(port, &dir, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut redis = loop {
        // A thousand calls in flight on a busy machine: the workers'
        // response timeout (5 s), not the client's default of 500 ms.
        let config =
            redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(5)));
        if let Ok(c) = redis::Client::open(url.as_str())
            .unwrap()
            .get_multiplexed_async_connection_with_config(&config)
            .await
        {
            break c;
        }
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let env = TestEnv::new(&[("REDIS_URL", &url)]).await;
    // The scripts' function libraries are a fixed cost, loaded once per
    // server, not part of what a result costs.
    env.scripts.claim.load(&mut redis).await.unwrap();
    env.scripts.remember_refusal.load(&mut redis).await.unwrap();
    let store = env.keys("mem").results();
    let n: u32 = std::env::var("RESULTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    // `ANSWER_BUCKETS=hashes` measures the hash layout.
    let hashes = std::env::var("ANSWER_BUCKETS").as_deref() == Ok("hashes");
    let all: Vec<Tokens> = (0..n)
        .map(|i| tokens(&env, &format!("01JDRQ5T3WZ8{i:014}"), 1, 90_000).with_hash_buckets(hashes))
        .collect();
    let before = used_memory(&mut redis).await;
    for chunk in all.chunks(1_000) {
        let calls = chunk.iter().map(|t| {
            let mut r = redis.clone();
            let mut t = t.clone();
            let scripts = &env.scripts;
            async move { answer::claim(&mut r, scripts, &mut t).await.unwrap() }
        });
        futures_util::future::join_all(calls).await;
    }
    let claimed = used_memory(&mut redis).await;
    // A count-1 award as a pool about a million draws old stores it
    // (lua/lib/award.lua: byte 2, varints of serial 1,048,576, version 3,
    // no trigger, batch 7 and position 21,044, then the code).
    let mut body = vec![2, 128, 128, 64, 3, 0, 7, 180, 164, 1];
    body.extend_from_slice(b"5");
    let body = &body;
    for chunk in all.chunks(1_000) {
        let calls = chunk.iter().map(|t| {
            let mut r = redis.clone();
            let scripts = &env.scripts;
            let store = &store;
            async move {
                let (status, _, _): (String, Vec<u8>, u64) = scripts
                    .remember_refusal
                    .key(store)
                    .arg(&t.answer)
                    .arg(body.as_slice())
                    .invoke_async(&mut r)
                    .await
                    .unwrap();
                assert_eq!(status, "refused");
            }
        });
        futures_util::future::join_all(calls).await;
    }
    let answered = used_memory(&mut redis).await;
    let per = |b: u64| b as f64 / f64::from(n);
    println!(
        "claim {:.1} B + answer {:.1} B = {:.1} B per remembered result ({}-byte body)",
        per(claimed - before),
        per(answered - claimed),
        per(answered - before),
        body.len() + 1
    );
    assert!(per(answered - before) < 100.0);
}
