//! The store of remembered answers and claims (`lua/lib/answer.lua`) on the
//! real Redis: every claim and answer is found again however the buckets
//! grow, an id is bound to its first content, buckets stay compact, an
//! answer lives its TTL and not much longer, and answers stored before the
//! buckets (one key per answer) are still replayed.
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
    answer::remember(&mut redis, &env.scripts, store, token, &Refusal::new(code))
        .await
        .unwrap()
}

async fn encodings(env: &TestEnv, pattern: &str) -> Vec<String> {
    let mut redis = env.redis.clone();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query_async(&mut redis)
        .await
        .unwrap();
    let mut out = Vec::new();
    for key in &keys {
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

#[tokio::test]
async fn every_claim_and_answer_is_found_again_however_the_buckets_grow() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let store = env.keys("grow").results();
    let n = 6_000;
    for i in 0..n {
        let t = tokens(&env, &format!("id-{i}"), 1, 90_000);
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &t).await.unwrap(),
            Claim::Ours
        );
        assert_eq!(
            remember(&env, &store, &t.answer, ErrorCode::SoldOut).await,
            None
        );
    }
    // Past 40 answers per bucket the buckets split many times; every id is
    // still bound to its content and its answer.
    for i in (0..n).step_by(7) {
        let id = format!("id-{i}");
        let same = tokens(&env, &id, 1, 90_000);
        let other = tokens(&env, &id, 2, 90_000);
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &same)
                .await
                .unwrap(),
            Claim::Ours,
            "{id}"
        );
        assert_eq!(
            answer::claim(&mut redis, &env.scripts, &other)
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
        assert!(matches!(
            answer::remember(
                &mut redis,
                &env.scripts,
                &store,
                &other.answer,
                &Refusal::new(ErrorCode::SoldOut)
            )
            .await,
            Err(prizepool::amqp::HandleError::Invalid(_))
        ));
    }
    // A freed claim binds nothing: other content may take the id.
    let freed = tokens(&env, "id-3", 1, 90_000);
    answer::release(&mut redis, &env.scripts, &freed)
        .await
        .unwrap();
    assert_eq!(
        answer::claim(&mut redis, &env.scripts, &tokens(&env, "id-3", 2, 90_000))
            .await
            .unwrap(),
        Claim::Ours
    );
    // Compact: every bucket is a listpack (the splits keep each under 128
    // fields), and there are about n / 40 of them.
    let prefix = &env.config.redis_prefix;
    for pattern in [format!("{store}:*"), format!("{prefix}:rq:{{*}}:*")] {
        let found = encodings(&env, &pattern).await;
        assert!(!found.is_empty(), "{pattern}");
        assert!(
            found.iter().all(|e| e == "listpack"),
            "{pattern}: {found:?}"
        );
    }
    let answer_buckets = encodings(&env, &format!("{store}:*")).await.len();
    assert!(
        answer_buckets <= n / 32,
        "{answer_buckets} buckets for {n} answers"
    );
}

#[tokio::test]
async fn an_answer_lives_its_ttl_and_at_most_a_quarter_longer() {
    let env = TestEnv::new(&[]).await;
    let store = env.keys("ttl").results();
    // TTL 4 s: slices of 1 s; an answer is kept 4 to 5 s.
    let t = tokens(&env, "short-lived", 1, 4);
    assert_eq!(
        remember(&env, &store, &t.answer, ErrorCode::SoldOut).await,
        None
    );
    tokio::time::sleep(Duration::from_millis(3_600)).await;
    assert_eq!(
        remember(&env, &store, &t.answer, ErrorCode::PoolExhausted).await,
        Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))),
        "kept for its whole TTL"
    );
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert_eq!(
        remember(&env, &store, &t.answer, ErrorCode::PoolExhausted).await,
        None,
        "forgotten at most a quarter of its TTL after"
    );
}

#[tokio::test]
async fn answers_stored_one_key_each_are_still_replayed() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let store = env.keys("old").results();
    let mine = fingerprint("draw", &[&"pool", &1, &1u32]);
    // The layout before buckets: "<pool keys>r:<request id>" holding
    // "<hex fingerprint>;<body>".
    let legacy = format!("{}:{{old}}:r:before-upgrade", env.config.redis_prefix);
    let _: () = redis::cmd("SET")
        .arg(&legacy)
        .arg(format!("{};!sold_out", mine.hex()))
        .query_async(&mut redis)
        .await
        .unwrap();
    let t = tokens(&env, "before-upgrade", 1, 90_000);
    assert_eq!(
        remember(&env, &store, &t.answer, ErrorCode::PoolExhausted).await,
        Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut)))
    );
    let other = tokens(&env, "before-upgrade", 2, 90_000);
    assert!(matches!(
        answer::remember(
            &mut redis,
            &env.scripts,
            &store,
            &other.answer,
            &Refusal::new(ErrorCode::SoldOut)
        )
        .await,
        Err(prizepool::amqp::HandleError::Invalid(_))
    ));
}

#[tokio::test]
async fn answers_in_the_buckets_of_the_layout_before_are_still_replayed() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    let store = env.keys("sized").results();
    let t = tokens(&env, "before-linear-hashing", 1, 90_000);
    // The layout before: per slice, bucket sizes doubling from `lo` to
    // `hi`, a token's bucket being its selector modulo the size.
    let text = t.answer.clone();
    let mut parts = text.splitn(3, |b| *b == b':');
    let ttl: u64 = std::str::from_utf8(parts.next().unwrap())
        .unwrap()
        .parse()
        .unwrap();
    let selector: u64 = std::str::from_utf8(parts.next().unwrap())
        .unwrap()
        .parse()
        .unwrap();
    let rest = parts.next().unwrap();
    let (field, fp) = (&rest[..6], &rest[6..8]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Stored in the slice before this one, in the smaller of two sizes.
    let slice = now / ttl.div_ceil(4) - 1;
    let _: () = redis::cmd("HSET")
        .arg(&store)
        .arg(format!("lo{slice}"))
        .arg(2)
        .arg(format!("hi{slice}"))
        .arg(8)
        .query_async(&mut redis)
        .await
        .unwrap();
    let mut value = fp.to_vec();
    value.extend_from_slice(b"!sold_out");
    let _: () = redis::cmd("HSET")
        .arg(format!("{store}:{slice}:2:{}", selector % 2))
        .arg(field)
        .arg(value)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(
        remember(&env, &store, &t.answer, ErrorCode::PoolExhausted).await,
        Some(ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut)))
    );
    let other = tokens(&env, "before-linear-hashing", 2, 90_000);
    assert!(matches!(
        answer::remember(
            &mut redis,
            &env.scripts,
            &store,
            &other.answer,
            &Refusal::new(ErrorCode::SoldOut)
        )
        .await,
        Err(prizepool::amqp::HandleError::Invalid(_))
    ));
}
