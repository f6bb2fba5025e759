//! The store of remembered answers and claims (`lua/lib/answer.lua`) on the
//! real Redis: every claim and answer is found again however the store
//! grows, records are told apart by all 16 bytes of their digests, an id is
//! bound to its first content, buckets stay compact, a request costs a
//! bounded number of commands however many ids are aimed at one place,
//! where a record lives follows the epochs kept in the store, never the TTL
//! setting, and records of the earlier layout are found until they expire.
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

/// A raw token as `lua/lib/answer.lua` reads it: digest, fingerprint, TTL
/// and `now` (0: the script reads the clock).
fn raw_token(digest: &[u8], fingerprint: &[u8], ttl: u64, now: u64) -> Vec<u8> {
    let mut t = digest.to_vec();
    t.extend_from_slice(fingerprint);
    t.extend_from_slice(&u32::try_from(ttl).unwrap().to_be_bytes());
    t.extend_from_slice(&u32::try_from(now).unwrap().to_be_bytes());
    t
}

/// The store's epochs (a pool's meta field `ep`, a claim store's
/// `<store>:ep`): (start, length, buckets, counted) each, newest first.
async fn epochs(env: &TestEnv, store: &str) -> Vec<[u64; 4]> {
    let mut redis = env.redis.clone();
    let mut read = match store.strip_suffix(":rs") {
        Some(_) => redis::cmd("HGET"),
        None => redis::cmd("GET"),
    };
    match store.strip_suffix(":rs") {
        Some(pool) => read.arg(format!("{pool}:meta")).arg("ep"),
        None => read.arg(format!("{store}:ep")),
    };
    let field: Option<Vec<u8>> = read.query_async(&mut redis).await.unwrap();
    let numbers: Vec<u64> = field
        .unwrap_or_default()
        .chunks_exact(4)
        .map(|b| u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])))
        .collect();
    numbers
        .chunks_exact(4)
        .map(|e| [e[0], e[1], e[2], e[3]])
        .collect()
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

/// Claims a raw claim token ([`raw_token`]) in `store`.
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

/// Every claim and answer is found again while the store grows from its
/// first epoch of 4 buckets through the epochs it opens for the volume,
/// and every bucket stays a listpack.
#[tokio::test]
async fn every_claim_and_answer_is_found_again_however_the_store_grows() {
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
    // The store grew: a first epoch of 4 buckets, then 64 past 320
    // answers, then 1,024 past 5,120, at most four read.
    let list = epochs(&env, &store).await;
    assert_eq!(
        list.iter().map(|e| e[2]).collect::<Vec<_>>(),
        [1024, 64, 4],
        "{list:?}"
    );
    // Every id is still bound to its content and its answer.
    for i in (0..n).step_by(7) {
        let id = format!("id-{i}");
        let mut same = tokens(&env, &id, 1, 90_000);
        let mut other = tokens(&env, &id, 2, 90_000);
        assert_eq!(claimed(&env, &mut same).await, Claim::Ours, "{id}");
        assert_eq!(claimed(&env, &mut other).await, Claim::Reused, "{id}");
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
        claimed(&env, &mut tokens(&env, "id-3", 2, 90_000)).await,
        Claim::Ours
    );
    // Compact: every bucket a listpack.
    let buckets = encodings(&env, &format!("{store}:e[0-9]*")).await;
    assert!(buckets.iter().all(|e| e == "listpack"), "{buckets:?}");
}

/// An epoch is planned for the volume the one before it saw: a store that
/// took 20,000 answers in an epoch opens the next with about one bucket per
/// 80 of them, and those buckets, filled as much, stay listpacks.
#[tokio::test]
async fn each_epoch_is_planned_for_the_volume_of_the_one_before() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("planned").results();
    let (ttl, n) = (90_000, 20_000u32);
    let len = ttl + answer::CLOCK_SKEW_S;
    let mut redis = env.redis.clone();
    let (t0, _): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    let fill = |day: u64| {
        let env = &env;
        let store = &store;
        async move {
            let all: Vec<Tokens> = (0..n)
                .map(|i| {
                    let mut t = tokens(env, &format!("d{day}-{i}"), 1, ttl);
                    t.at(t0 + day * (len + 2));
                    t
                })
                .collect();
            for chunk in all.chunks(500) {
                let calls = chunk.iter().map(|t| async move {
                    assert_eq!(
                        remember(env, store, &t.answer, ErrorCode::SoldOut).await,
                        None
                    );
                });
                futures_util::future::join_all(calls).await;
            }
        }
    };
    fill(0).await;
    let first = epochs(&env, &store).await;
    assert_eq!(
        first.iter().map(|e| e[2]).collect::<Vec<_>>(),
        [1024, 64, 4],
        "{first:?}"
    );
    fill(1).await;
    let list = epochs(&env, &store).await;
    let planned = list[0][2];
    // The first day grew the store (4 buckets, then 64, then 1,024, a
    // second apart); the second day's epoch is planned for the first
    // day's 20,000 answers and half as much again: 375 buckets, give or
    // take the spread of counting one in 16; it takes the second day's
    // 20,000 without growing.
    assert!(
        (310..=440).contains(&planned),
        "{planned} buckets planned: {list:?}"
    );
    assert_eq!(list[0][0], t0 + len + 2, "{list:?}");
    let buckets = encodings(&env, &format!("{store}:e{}:*", t0 + len + 2)).await;
    assert_eq!(buckets.len() as u64, planned);
    assert!(buckets.iter().all(|e| e == "listpack"), "{buckets:?}");
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
    let token = |d: &[u8], fp: u8| raw_token(d, &[fp; 8], 90_000, 0);
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
async fn an_answer_is_kept_its_ttl_and_the_skew_and_forgotten_after_two_epochs() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("epochs").results();
    let mut redis = env.redis.clone();
    let (ttl, skew) = (86_400, answer::CLOCK_SKEW_S);
    // An epoch lasts the TTL and the clock skew allowed. The tokens name
    // the times; Redis's clock only expires the buckets.
    let len = ttl + skew;
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
    // Every bucket expires two lengths after the epoch starts.
    let keys = keys(&env, &format!("{store}:*")).await;
    assert!(!keys.is_empty(), "{keys:?}");
    for key in keys {
        let left: u64 = redis::cmd("TTL")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!((2 * len - 10..=2 * len).contains(&left), "{key}: {left}");
    }
    assert_eq!(epochs(&env, &store).await[0][..2], [start, len]);
    // A request answered in the last second of the epoch, by a step whose
    // `now` (its claim's) is behind the time it ran, is found a whole TTL
    // later by a reader whose clock runs the allowed skew ahead.
    let last = start + len - 1;
    assert!(stored("last".to_owned(), last).await);
    assert_eq!(
        found("last", last + ttl + skew - 1).await.as_deref(),
        Some(&b"!sold_out"[..]),
        "kept its TTL and the skew"
    );
    // A write after the epoch opens the next; the first answer is found
    // through it, and forgotten when its epoch's records are all past
    // their length.
    let next = start + len;
    assert!(stored("next".to_owned(), next).await);
    assert_eq!(epochs(&env, &store).await.len(), 2);
    assert_eq!(
        found("first", next + len - 1).await.as_deref(),
        Some(&b"!sold_out"[..]),
        "kept through the next epoch"
    );
    assert_eq!(found("first", next + len).await, None, "forgotten");
    assert_eq!(found("last", next + len).await, None, "forgotten");
    assert_eq!(
        found("next", next + len).await.as_deref(),
        Some(&b"!sold_out"[..])
    );
    // A third epoch forgets the first one's geometry.
    let third = next + len;
    assert!(stored("third".to_owned(), third).await);
    let list = epochs(&env, &store).await;
    assert_eq!(
        list.iter().map(|e| e[0]).collect::<Vec<_>>(),
        [third, next],
        "{list:?}"
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
        assert_eq!(fields, vec!["ep".to_owned()], "{pool}");
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
    {
        let tokens = |id: &str, content: u32| tokens(&env, id, content, 90_000);
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
        assert_eq!(claimed(&env, &mut tokens("twice", 2)).await, Claim::Reused);
        assert_eq!(claimed(&env, &mut tokens("twice", 1)).await, Claim::Ours);
        // A claim of one copy is freed: other content may take the id.
        let once = tokens("once", 1);
        assert_eq!(claimed(&env, &mut once.clone()).await, Claim::Ours);
        answer::release(&mut redis, &env.scripts, &once)
            .await
            .unwrap();
        assert_eq!(claimed(&env, &mut tokens("once", 2)).await, Claim::Ours);
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
        assert!(
            epochs(&env, &store).await.is_empty(),
            "{pool}: no answer store under the pool's own id"
        );
    }
}

/// Runs claim.lua (`op`: "claim" or "release") or forget.lua (`op`:
/// "forget") in claim store `store` for digest `d` and content `c`, with
/// TTL `ttl`, at time `now`.
async fn claim_at(env: &TestEnv, store: &str, d: u8, c: u8, at: (u64, u64), op: &str) -> i64 {
    let (ttl, now) = at;
    let token = raw_token(&[d; 16], &[c; 8], ttl, now);
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

/// A claim's shared state is its own record's: marked in place when a
/// second copy claims it, it lives and dies with the claim.
#[tokio::test]
async fn a_shared_claim_lives_and_dies_as_one_record() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let (t, _): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    // Steps of claim.lua and forget.lua: (claim store and digest, content,
    // TTL, seconds after t, operation, verdict). TTL 100 s: an epoch of
    // 400 s (the TTL and the skew), read until 800 s.
    let steps: &[(u8, u8, u64, u64, &str, i64)] = &[
        (1, 1, 100, 0, "claim", 1),
        // A copy comes 450 s later, past the epoch's end: the claim is
        // shared where it is.
        (1, 1, 100, 450, "claim", 1),
        (1, 1, 100, 460, "release", 0),
        (1, 2, 100, 560, "claim", 0),
        // Gone with its epoch, shared state and all: a new binding of the
        // id is one copy's, and is freed when that copy is refused as
        // invalid.
        (1, 2, 100, 960, "claim", 1),
        (1, 2, 100, 961, "release", 1),
        (1, 3, 100, 962, "claim", 1),
        // Copies with different TTLs: the claim keeps the epoch it was
        // first stored in, shared.
        (2, 1, 86_400, 0, "claim", 1),
        (2, 1, 100, 10, "claim", 1),
        (2, 1, 100, 600, "release", 0),
        (2, 2, 100, 600, "claim", 0),
        // Forgetting a claim forgets that it was shared.
        (3, 1, 100, 0, "claim", 1),
        (3, 1, 100, 1, "claim", 1),
        (3, 1, 100, 2, "forget", 1),
        (3, 1, 100, 3, "claim", 1),
        (3, 1, 100, 4, "release", 1),
        (3, 2, 100, 5, "claim", 1),
    ];
    for &(d, c, ttl, after, op, verdict) in steps {
        let store = format!("{}:rq:{{{d}}}", env.config.redis_prefix);
        assert_eq!(
            claim_at(&env, &store, d, c, (ttl, t + after), op).await,
            verdict,
            "id {d}, content {c}, {op} at t + {after}"
        );
    }
    // One record per claim: the shared one holds its fingerprint and `s`.
    let store = format!("{}:rq:{{2}}", env.config.redis_prefix);
    let record: Option<Vec<u8>> = env
        .scripts
        .forget
        .key(&store)
        .arg(raw_token(&[2; 16], &[1; 8], 100, t + 601))
        .arg("claim")
        .arg("peek")
        .invoke_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(record, Some([&[1u8; 8][..], b"s"].concat()));
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
                ttl > 2 * 90_000,
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
                    let claim = raw_token(&op.digest, &[op.content; 8], op.ttl, 0);
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
                    let answer = raw_token(&digest, &[op.content; 8], op.ttl, 0);
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

/// Digest `i` of ids aimed at one bucket: digests that agree on the bytes
/// that place a record (4-6) and on the byte that says whether it is
/// counted (7, not counted, so no epoch opens for them), as ids crafted by
/// an attacker would.
fn aimed_digest(i: u32) -> [u8; 16] {
    let mut d = [7u8; 16];
    d[6] = 1;
    d[8..12].copy_from_slice(&i.to_be_bytes());
    d
}

/// A private Redis (its command statistics are the test's alone).
async fn private_redis(
    tag: &str,
) -> (
    common::KillOnDrop,
    String,
    redis::aio::MultiplexedConnection,
) {
    let dir = common::tempdir(tag);
    let port = common::free_port();
    let server = common::redis_server(port, &dir, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let redis = loop {
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
    (server, url, redis)
}

/// The calls of each command since the last CONFIG RESETSTAT.
async fn command_calls(redis: &mut redis::aio::MultiplexedConnection) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(redis)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// 10,000 refusals and 10,000 claims aimed at one place of their stores
/// (free to a sender: `already_grabbed`, `unknown_pool` cost it nothing):
/// every one is found again and replays its first answer, the place they
/// hit becomes one larger hash, and a request costs the same few commands
/// as in an empty store, none of which reads a bucket whole (no HGETALL,
/// MGET or string GET of a bucket: the records Lua sees are the one it
/// looks up).
#[tokio::test]
async fn ten_thousand_ids_aimed_at_one_place_cost_each_request_a_few_commands() {
    let (_server, url, mut redis) = private_redis("aimed").await;
    let env = TestEnv::new(&[("REDIS_URL", &url)]).await;
    let answers = env.keys("aimed").results();
    let claims = format!("{}:rq:{{5}}", env.config.redis_prefix);
    let n = 10_000u32;
    let fill = |i: u32| {
        let (env, answers, claims) = (&env, &answers, &claims);
        async move {
            let d = aimed_digest(i);
            assert_eq!(
                claim_raw(env, claims, &raw_token(&d, &[1; 8], 90_000, 0)).await,
                1
            );
            assert_eq!(
                remember(
                    env,
                    answers,
                    &raw_token(&d, &[1; 8], 90_000, 0),
                    ErrorCode::UnknownPool
                )
                .await,
                None,
                "{i}"
            );
        }
    };
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        futures_util::future::join_all(chunk.iter().map(|&i| fill(i))).await;
    }
    for store in [&answers, &claims] {
        let buckets = keys(&env, &format!("{store}:e[0-9]*")).await;
        assert_eq!(
            buckets.len(),
            1,
            "one bucket took every record: {buckets:?}"
        );
        assert_eq!(encodings(&env, &buckets[0]).await, ["hashtable"]);
    }
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut redis)
        .await
        .unwrap();
    let probes = 200u32;
    for i in (0..n).step_by((n / probes) as usize) {
        let d = aimed_digest(i);
        // The same id and content: a replay; other content: refused.
        assert_eq!(
            claim_raw(&env, &claims, &raw_token(&d, &[1; 8], 90_000, 0)).await,
            1
        );
        assert_eq!(
            claim_raw(&env, &claims, &raw_token(&d, &[2; 8], 90_000, 0)).await,
            0
        );
        assert_eq!(
            remember(
                &env,
                &answers,
                &raw_token(&d, &[1; 8], 90_000, 0),
                ErrorCode::SoldOut
            )
            .await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::UnknownPool))),
            "{i}"
        );
        // A new id aimed at the same place is stored like any other.
        let fresh = aimed_digest(n + i);
        assert_eq!(
            claim_raw(&env, &claims, &raw_token(&fresh, &[1; 8], 90_000, 0)).await,
            1
        );
    }
    let calls = command_calls(&mut redis).await;
    let requests = 4 * u64::from(probes);
    let of = |name: &str| calls.iter().find(|(c, _)| c == name).map_or(0, |(_, n)| *n);
    for whole in [
        "hgetall", "hscan", "hvals", "hkeys", "mget", "getrange", "scan",
    ] {
        assert_eq!(of(whole), 0, "{whole}: {calls:?}");
    }
    // Each request: its clock, the epochs, a lookup in each epoch read (one
    // here), a write of a new record (and its bucket's expiry once), and
    // the FCALL itself.
    let inside: u64 = calls
        .iter()
        .filter(|(c, _)| c != "fcall" && c != "function|load" && c != "config|resetstat")
        .map(|(_, n)| *n)
        .sum();
    assert!(
        inside <= 4 * requests,
        "{inside} commands for {requests} requests: {calls:?}"
    );
    // GET reads only the epochs' keys (one a request): no bucket is a string.
    assert!(of("get") <= requests, "{calls:?}");
}

/// A fleet running the earlier layout (string or hash buckets listed in the
/// meta hash's `r.e`, claims shared through a second record) is upgraded
/// in place: every claim and answer it stored is found by this layout
/// until its epochs end, a worker of the earlier version still running
/// meanwhile is read too, new records go to this layout, and once the
/// earlier epochs are over they are no longer read.
#[tokio::test]
async fn records_of_the_earlier_layout_are_found_until_they_expire() {
    use prizepool::scripts::Script;
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let fixture = |name: &str| {
        std::fs::read_to_string(format!(
            "{}/tests/fixtures/store_v1/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    };
    let prelude = fixture("answer.lua");
    let old_claim = Script::with_prelude(&prelude, &fixture("claim.lua"));
    let old_remember = Script::with_prelude(&prelude, &fixture("remember_refusal.lua"));
    // The earlier tokens: "<ttl>[h]:<now>:" ‖ digest ‖ fingerprint.
    let old_token = |new: &[u8], hashes: bool, now: Option<u64>| {
        let mut t = format!(
            "90000{}:{}:",
            if hashes { "h" } else { "" },
            now.map(|n| n.to_string()).unwrap_or_default()
        )
        .into_bytes();
        t.extend_from_slice(&new[..24]);
        t
    };
    let (t0, _): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    let n = 400;
    for hashes in [false, true] {
        let store = env.keys(&format!("old-{hashes}")).results();
        let id = |i: u32| format!("old-{hashes}-{i}");
        // The earlier version claims and answers every request.
        for i in 0..n {
            let t = tokens(&env, &id(i), 1, 90_000);
            let (ours, _): (i64, u64) = old_claim
                .key(&t.claim_store)
                .arg(old_token(&t.claim, hashes, None))
                .arg("claim")
                .invoke_async(&mut redis)
                .await
                .unwrap();
            assert_eq!(ours, 1);
            let (status, _, _): (String, Vec<u8>, u64) = old_remember
                .key(&store)
                .arg(old_token(&t.answer, hashes, Some(t0)))
                .arg("sold_out")
                .invoke_async(&mut redis)
                .await
                .unwrap();
            assert_eq!(status, "refused");
        }
        // This version finds each: the same content goes on, other content
        // is refused, the answer replays; a new request is stored here.
        for i in 0..n {
            let mut same = tokens(&env, &id(i), 1, 90_000);
            let mut other = tokens(&env, &id(i), 2, 90_000);
            assert_eq!(claimed(&env, &mut other).await, Claim::Reused, "{}", id(i));
            assert_eq!(claimed(&env, &mut same).await, Claim::Ours, "{}", id(i));
            assert_eq!(
                remember(&env, &store, &same.answer, ErrorCode::PoolExhausted).await,
                Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
                "{}",
                id(i)
            );
            // Claimed again, the earlier claim is shared: a copy refused as
            // invalid frees nothing.
            answer::release(&mut redis, &env.scripts, &same)
                .await
                .unwrap();
            assert_eq!(claimed(&env, &mut other).await, Claim::Reused, "{}", id(i));
            let mut fresh = tokens(&env, &format!("new-{}", id(i)), 1, 90_000);
            assert_eq!(claimed(&env, &mut fresh).await, Claim::Ours);
            assert_eq!(
                remember(&env, &store, &fresh.answer, ErrorCode::SoldOut).await,
                None
            );
        }
        assert!(!epochs(&env, &store).await.is_empty());
        // A worker of the earlier version still running opens an epoch of
        // its own a quarter of its TTL on: read as well.
        let later = t0 + (90_000 + answer::CLOCK_SKEW_S).div_ceil(4) + 1;
        let late = tokens(&env, &format!("late-{hashes}"), 1, 90_000);
        let (status, _, _): (String, Vec<u8>, u64) = old_remember
            .key(&store)
            .arg(old_token(&late.answer, hashes, Some(later)))
            .arg("sold_out")
            .invoke_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(status, "refused");
        let mut late = late;
        late.at(later + 1);
        assert_eq!(
            remember(&env, &store, &late.answer, ErrorCode::PoolExhausted).await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut)))
        );
        // Past the earlier epochs' end, they are no longer read.
        let mut gone = tokens(&env, &id(0), 1, 90_000);
        gone.at(later + 5 * (90_000 + answer::CLOCK_SKEW_S).div_ceil(4) + answer::CLOCK_SKEW_S);
        assert_eq!(peek(&env, &store, &gone.answer).await, None);
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
    let (_server, url, mut redis) = private_redis("mem").await;
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
    let all: Vec<Tokens> = (0..n)
        .map(|i| tokens(&env, &format!("01JDRQ5T3WZ8{i:014}"), 1, 90_000))
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
    assert!(per(answered - before) < 120.0);
}

/// The earlier layout is read only in a deployment it ran in: the first
/// worker of this layout notes whether a claim store of the earlier one is
/// there, and every worker after it reads the earlier layout for two TTLs
/// and skews from that first start, or never.
#[tokio::test]
async fn the_earlier_layout_is_read_only_where_it_ran() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let ttl = 90_000;
    let fresh = format!("{}:fresh", env.config.redis_prefix);
    assert_eq!(
        answer::start_layout(&mut redis, &fresh, ttl).await.unwrap(),
        0
    );
    // Noted: a later worker agrees even once an earlier store shows up.
    let _: () = redis::cmd("HSET")
        .arg(format!("{fresh}:rq:{{3}}"))
        .arg("r.e")
        .arg("1:1:1")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        answer::start_layout(&mut redis, &fresh, ttl).await.unwrap(),
        0
    );
    assert!(!answer::reads_earlier_layout(0));
    // A deployment where the earlier layout ran (a grant claim store is
    // enough).
    let upgraded = format!("{}:upgraded", env.config.redis_prefix);
    let _: () = redis::cmd("HSET")
        .arg(format!("{upgraded}:gr:{{1000}}"))
        .arg("r.e")
        .arg("1:1:1")
        .query_async(&mut redis)
        .await
        .unwrap();
    let (now, _): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.unwrap();
    let until = answer::start_layout(&mut redis, &upgraded, ttl)
        .await
        .unwrap();
    let span = 2 * (ttl + answer::CLOCK_SKEW_S);
    assert!((now + span..=now + span + 2).contains(&until), "{until}");
    assert!(answer::reads_earlier_layout(until));
    assert_eq!(
        answer::start_layout(&mut redis, &upgraded, ttl)
            .await
            .unwrap(),
        until
    );
}

/// A TTL past what a token carries (32 bits, less the layout flag) is kept
/// as the longest a token carries: the request is claimed, answered and
/// found again, and other content is refused, the flag untouched.
#[tokio::test]
async fn a_ttl_past_what_a_token_carries_keeps_the_longest() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("huge-ttl").results();
    for (i, ttl) in [u64::from(u32::MAX), u64::MAX].into_iter().enumerate() {
        let id = format!("huge-{i}");
        let mut first = tokens(&env, &id, 1, ttl);
        assert_eq!(claimed(&env, &mut first).await, Claim::Ours);
        assert_eq!(
            remember(&env, &store, &first.answer, ErrorCode::SoldOut).await,
            None
        );
        assert_eq!(
            claimed(&env, &mut tokens(&env, &id, 2, ttl)).await,
            Claim::Reused
        );
        let mut retry = tokens(&env, &id, 1, 90_000);
        assert_eq!(claimed(&env, &mut retry).await, Claim::Ours);
        assert_eq!(
            remember(&env, &store, &retry.answer, ErrorCode::PoolExhausted).await,
            Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
            "TTL {ttl}"
        );
    }
    let list = epochs(&env, &store).await;
    assert_eq!(
        list[0][1],
        u64::from(u32::MAX >> 1) + answer::CLOCK_SKEW_S,
        "{list:?}"
    );
}
