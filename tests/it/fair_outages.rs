//! The fairness trail across a Postgres outage: a batch stocked while
//! Postgres is away has its commitment kept in Redis (the outbox) before
//! the batch is visible, and written to Postgres once Postgres is back,
//! even when the `pool.refilled` event that also carries it never left.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{pool_toml, TestEnv};
use prizepool::{
    audit,
    kinds::{answer::Tokens, lucky_gift, Ask, Award, Kinds, Step},
};

/// Twelve prizes a batch.
const GIFT: &[(&str, &[(u64, u64)])] = &[("a", &[(0, 8), (1, 3), (5, 1)])];

const POOL: &str = "outbox";

/// Draw `n` of 3 prizes through the seam, recorded in the trail as the
/// audit consumer records it.
async fn draw(env: &TestEnv, kinds: &Kinds, n: usize) -> Box<Award> {
    let request_id = format!("{POOL}-{n}");
    let fingerprint = prizepool::kinds::fingerprint("draw", &[&POOL, &1i64, &3u32]);
    let ttl = env.config.result_ttl.as_secs();
    let tokens = Tokens::new(
        &env.config.redis_prefix,
        "rq",
        &request_id,
        fingerprint,
        ttl,
    );
    let ask = Ask {
        request_id: &request_id,
        pool: POOL,
        user: 1,
        count: 3,
        token: &tokens.answer,
        result_ttl_s: ttl,
    };
    let kind = kinds.resolve(POOL).await.unwrap().unwrap();
    match kinds.draw(kind, &ask).await.unwrap() {
        Step::Awarded(award) => {
            audit::record_draw(&env.db, &award.result).await.unwrap();
            award
        }
        other => panic!("{other:?}"),
    }
}

/// Stocks the batch after `trigger` as the refill worker does, recording
/// its commitment with `recorder`; publishes nothing.
async fn stock(env: &TestEnv, trigger: u64, recorder: &audit::PgRecorder<'_>) {
    let mut redis = env.redis.clone();
    let keys = env.keys(POOL);
    let (version, config, table) = lucky_gift::stored_config(&mut redis, &keys)
        .await
        .unwrap()
        .unwrap();
    let outcome = lucky_gift::stock_committed(
        &mut redis, &keys, &config, version, &table, trigger, 500, 30_000, "test", recorder,
    )
    .await
    .unwrap();
    assert!(
        matches!(outcome, lucky_gift::StockOutcome::Stocked { .. }),
        "{outcome:?}"
    );
}

async fn committed(env: &TestEnv, generation: i64) -> Vec<String> {
    sqlx::query_scalar("SELECT commitment FROM fair_batches WHERE pool = $1 AND generation = $2")
        .bind(POOL)
        .bind(generation)
        .fetch_all(&env.db)
        .await
        .unwrap()
}

/// The narrow case of a Postgres outage: the refill worker stocks batch 2
/// while Postgres is away and dies before its `pool.refilled` leaves; the
/// batch is used up (its seed revealed) before anything could tell the
/// commitment again. The outbox kept it: once Postgres is back it is
/// recorded, and `audit verify` finds batch 2 committed, revealed and
/// matching every draw.
#[tokio::test]
async fn a_commitment_postgres_missed_is_recorded_from_the_outbox() {
    let env = TestEnv::new(&[]).await;
    let kinds = Kinds::new(env.redis.clone(), &env.config.redis_prefix);
    env.load(&pool_toml(POOL, "refill_at = 0.5\nmax_count = 100", GIFT))
        .await;
    let prefix = env.config.redis_prefix.clone();
    // The pool's own outbox, on the pool's slot.
    let outbox = env.keys(POOL).fair_outbox();
    assert!(outbox.contains(&format!("{{{POOL}}}")), "{outbox}");
    let kept = || {
        let mut redis = env.redis.clone();
        let outbox = outbox.clone();
        async move {
            redis::cmd("HLEN")
                .arg(&outbox)
                .query_async::<u64>(&mut redis)
                .await
                .unwrap()
        }
    };
    // Draw to batch 1's refill point.
    let mut n = 0;
    let trigger = loop {
        let award = draw(&env, &kinds, n).await;
        n += 1;
        if let Some(refill) = award.refill {
            break refill.trigger;
        }
    };
    // Postgres is away for the refill worker: batch 2 is stocked at once,
    // its commitment in the outbox, not in Postgres; no event leaves.
    let away = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/nowhere")
        .unwrap();
    let recorder = audit::PgRecorder::new(&away).with_outbox(env.redis.clone(), &prefix);
    stock(&env, trigger, &recorder).await;
    let kept_back = recorder.take().unwrap();
    let commitment = kept_back.commitment.clone();
    assert!(committed(&env, 2).await.is_empty());
    assert_eq!(kept().await, 1);
    let index = format!("{prefix}{}", audit::OUTBOX_INDEX);
    let mut redis = env.redis.clone();
    let indexed: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&index)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(indexed, [POOL]);
    // Batch 2 is drawn to its end and revealed (batch 3 stocked on the way,
    // Postgres there for it).
    let mut revealed = false;
    for _ in 0..20 {
        let award = draw(&env, &kinds, n).await;
        n += 1;
        if let Some(refill) = award.refill {
            stock(&env, refill.trigger, &audit::PgRecorder::new(&env.db)).await;
        }
        if award.result.revealed.iter().any(|r| r.generation == 2) {
            revealed = true;
            break;
        }
    }
    assert!(revealed, "batch 2 was used up");
    // Before Postgres took the outbox, the trail misses batch 2's commitment.
    let before = audit::verify(&env.db, POOL, Some(2)).await.unwrap();
    assert!(!before.ok, "{before:?}");
    // Postgres is back, but the index lost the pool (its node was away when
    // the commitment was kept): the drain does not see it, the sweep of
    // every pool's outbox does; it is written, once, and emptied.
    redis::cmd("DEL")
        .arg(&index)
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
    let (db, outbox_redis, outbox_prefix) = (&env.db, &env.redis, prefix.as_str());
    let drain = move || async move {
        audit::drain_outbox(db, outbox_redis, outbox_prefix)
            .await
            .unwrap()
    };
    assert_eq!(drain().await, 0);
    assert_eq!(kept().await, 1);
    let written = audit::sweep_outboxes(&env.db, &env.redis, &prefix)
        .await
        .unwrap();
    assert_eq!(written, 1);
    assert_eq!(kept().await, 0);
    assert_eq!(committed(&env, 2).await, vec![commitment.clone()]);
    let verdict = audit::verify(&env.db, POOL, Some(2)).await.unwrap();
    assert!(
        verdict.ok && verdict.batches[0].status == "ok",
        "{verdict:?}"
    );
    assert!(verdict.batches[0].complete, "{verdict:?}");
    assert_eq!(drain().await, 0);
    // An outbox of an earlier version (one hash for every pool) is still
    // drained.
    let legacy = format!("{prefix}{}", audit::OUTBOX);
    redis::cmd("HSET")
        .arg(&legacy)
        .arg(format!("{POOL}|2"))
        .arg(serde_json::to_string(&kept_back).unwrap())
        .query_async::<()>(&mut redis)
        .await
        .unwrap();
    assert_eq!(drain().await, 1);
    let left: u64 = redis::cmd("HLEN")
        .arg(&legacy)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(left, 0);
    assert_eq!(committed(&env, 2).await, vec![commitment]);
}
