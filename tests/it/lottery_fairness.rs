//! Provably fair lottery picks (`docs/fairness.md`, "Lotteries") on the
//! real fleet: each period's seed is committed in Postgres before a draw
//! uses it, every value is the one the seed gives the request, the seeds
//! are revealed once their period is over, `audit verify` holds, and
//! tampered records are caught with the right first mismatch. A seed whose
//! commitment is on record nowhere is never used.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use chrono::{DateTime, Duration as Span, Utc};
use common::{draw, TestEnv};
use prizepool::{
    fairness::{lottery_context, lottery_pick, lottery_values, Seed},
    kinds::lottery::seeds,
};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

/// A `wheel` activity with short seed periods.
fn activity(id: &str, starts: DateTime<Utc>, ends: DateTime<Utc>, period_s: u64) -> String {
    format!(
        "[[activities]]\nid = \"{id}\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\nseed_period_s = {period_s}\nprizes = [ {{ id = \"ipad\", weight = 1, stock = 2 }}, {{ id = \"coupon-5\", weight = 30, stock = 8 }} ]\nconsolation = {{ id = \"points-10\", weight = 60 }}\n",
        starts.to_rfc3339(),
        ends.to_rfc3339()
    )
}

fn grant(id: &str, activity: &str, user: i64, chances: u32) -> Value {
    json!({"type": "lottery.grant", "grant_id": id, "activity": activity, "user_id": user, "chances": chances})
}

/// Waits until the clock is past `unix_s`.
async fn wait_until(unix_s: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while (Utc::now().timestamp() as u64) < unix_s {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the clock stands still"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `sql` (a count) reaches `n`; its last value otherwise.
async fn wait_count(env: &TestEnv, sql: &str, n: i64) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let seen: i64 = sqlx::query_scalar(sql).fetch_one(&env.db).await.unwrap();
        if seen >= n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{sql}: {seen}, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The verdict of `audit verify <activity>` as the CLI prints it with
/// `--json`.
async fn verdict(env: &TestEnv, activity: &str) -> Value {
    let v = prizepool::audit::verify_activity(&env.db, activity)
        .await
        .unwrap();
    serde_json::to_value(v).unwrap()
}

/// Runs `sql` on the append-only trail, triggers off: what a tamperer with
/// the database's keys could do.
async fn tamper(env: &TestEnv, table: &str, sql: &str) {
    let mut conn = env.db.acquire().await.unwrap();
    sqlx::query(&format!("ALTER TABLE {table} DISABLE TRIGGER USER"))
        .execute(&mut *conn)
        .await
        .unwrap();
    let changed = sqlx::query(sql).execute(&mut *conn).await.unwrap();
    assert_eq!(changed.rows_affected(), 1, "{sql}");
    sqlx::query(&format!("ALTER TABLE {table} ENABLE TRIGGER USER"))
        .execute(&mut *conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn draws_use_committed_seeds_are_revealed_and_verify_and_tampering_is_caught() {
    let mut env = TestEnv::new(&[]).await;
    let now = Utc::now();
    let id = "fair-wheel";
    let len = 3u64;
    env.load_activities(&activity(
        id,
        now - Span::hours(1),
        now + Span::hours(1),
        len,
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    for user in 0..6 {
        let r = client
            .call("draw", &grant(&format!("g-{user}"), id, user, 4), T)
            .await
            .unwrap();
        assert_eq!(r["status"], "ok", "{r}");
    }
    // Draws over three periods; each reply is kept with when it came.
    let mut replies: Vec<(Value, DateTime<Utc>)> = Vec::new();
    let first = seeds::period_of(Utc::now().timestamp() as u64, len);
    for round in 0..3u64 {
        wait_until(first + round * len).await;
        for user in 0..6 {
            if (user + round as i64) % 3 == 0 {
                continue;
            }
            let r = client.call("draw", &draw(id, user, 1), T).await.unwrap();
            assert_eq!(r["status"], "ok", "{r}");
            replies.push((r, Utc::now()));
        }
    }
    let n = replies.len() as i64;
    wait_count(
        &env,
        &format!("SELECT count(*) FROM fair_lottery_draws WHERE activity = '{id}'"),
        n,
    )
    .await;
    // The commitment of each draw's period was in Postgres before the
    // draw was answered.
    for (r, answered) in &replies {
        let period = r["pick"]["period"].as_i64().unwrap();
        let recorded: DateTime<Utc> = sqlx::query_scalar(
            "SELECT recorded_at FROM fair_lottery_seeds WHERE activity = $1 AND period = $2",
        )
        .bind(id)
        .bind(period)
        .fetch_one(&env.db)
        .await
        .unwrap();
        assert!(recorded < *answered, "{r}: committed at {recorded}");
    }
    // Before its period is over a seed stays secret: unrevealed.
    let v = verdict(&env, id).await;
    assert_eq!(v["ok"], true, "{v}");
    assert!(
        v["periods"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["status"] == "unrevealed"),
        "{v}"
    );
    // Every period drawn in is over (plus the grace): reveal them all.
    let last = replies
        .iter()
        .map(|(r, _)| r["pick"]["period"].as_u64().unwrap())
        .max()
        .unwrap();
    wait_until(last + len + seeds::REVEAL_GRACE_S + 1).await;
    let revealed = seeds::reveal_ended(
        &env.db,
        &env.redis,
        &env.config.redis_prefix,
        id,
        prizepool::scripts::now_ms(),
    )
    .await
    .unwrap();
    assert!(revealed >= 2, "{revealed}");
    // Each reply's value is the one its period's revealed seed gives the
    // request, by the page's derivation, and lands on its prize.
    for (r, _) in &replies {
        let period = r["pick"]["period"].as_u64().unwrap();
        let seed: String = sqlx::query_scalar(
            "SELECT seed FROM fair_lottery_reveals WHERE activity = $1 AND period = $2",
        )
        .bind(id)
        .bind(period as i64)
        .fetch_one(&env.db)
        .await
        .unwrap();
        let seed = Seed::from_hex(&seed).unwrap();
        let request = r["request_id"].as_str().unwrap();
        let values = lottery_values(&seed, &lottery_context(id, period, request), 0, 4);
        let weights: Vec<u64> = r["pick"]["weights"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["weight"].as_u64().unwrap())
            .collect();
        let (value, index) = lottery_pick(&values, &weights).unwrap();
        assert_eq!(r["pick"]["value"].as_u64(), Some(value), "{r}");
        assert_eq!(
            r["pick"]["weights"][index]["prize"], r["prizes"][0]["prize"],
            "{r}"
        );
    }
    let v = verdict(&env, id).await;
    assert_eq!(v["ok"], true, "{v}");
    let periods = v["periods"].as_array().unwrap();
    assert!(periods.iter().all(|p| p["status"] == "ok"), "{v}");
    let checked: u64 = periods
        .iter()
        .map(|p| p["draws_checked"].as_u64().unwrap())
        .sum();
    assert_eq!(checked, n as u64, "{v}");
    // The stock was never exceeded: at most 2 ipads, 8 coupons.
    let ipads = replies
        .iter()
        .filter(|(r, _)| r["prizes"][0]["prize"] == "ipad")
        .count();
    assert!(ipads <= 2);

    // Tampered records: each is caught, and the first mismatch names it.
    let (serial, period): (i64, i64) = sqlx::query_as(
        "SELECT serial, period FROM fair_lottery_draws WHERE activity = $1 ORDER BY serial OFFSET 2 LIMIT 1",
    )
    .bind(id)
    .fetch_one(&env.db)
    .await
    .unwrap();
    let first_mismatch = |v: &Value| {
        v["periods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["status"] == "mismatch")
            .map(|p| (p["period"].as_i64().unwrap(), p["first_mismatch"].clone()))
            .unwrap_or_else(|| panic!("no mismatch in {v}"))
    };
    tamper(
        &env,
        "fair_lottery_draws",
        &format!("UPDATE fair_lottery_draws SET value = value + 1 WHERE activity = '{id}' AND serial = {serial}"),
    )
    .await;
    let v = verdict(&env, id).await;
    assert_eq!(v["ok"], false);
    let (p, m) = first_mismatch(&v);
    assert_eq!(
        (p, m["check"].as_str(), m["serial"].as_i64()),
        (period, Some("value"), Some(serial)),
        "{m}"
    );
    tamper(
        &env,
        "fair_lottery_draws",
        &format!("UPDATE fair_lottery_draws SET value = value - 1 WHERE activity = '{id}' AND serial = {serial}"),
    )
    .await;
    assert_eq!(verdict(&env, id).await["ok"], true);

    // A weight changed: the ipad's weight 1 made 1000 (a heavier ipad).
    tamper(
        &env,
        "fair_lottery_draws",
        &format!(
            "UPDATE fair_lottery_draws SET weights = jsonb_set(weights, '{{0,weight}}', '1000') WHERE activity = '{id}' AND serial = {serial}"
        ),
    )
    .await;
    let v = verdict(&env, id).await;
    let (p, m) = first_mismatch(&v);
    assert_eq!(
        (p, m["check"].as_str(), m["serial"].as_i64()),
        (period, Some("weight"), Some(serial)),
        "{m}"
    );
    assert_eq!(m["found"], "1000", "{m}");
    tamper(
        &env,
        "fair_lottery_draws",
        &format!(
            "UPDATE fair_lottery_draws SET weights = jsonb_set(weights, '{{0,weight}}', '1') WHERE activity = '{id}' AND serial = {serial}"
        ),
    )
    .await;
    assert_eq!(verdict(&env, id).await["ok"], true);

    // The prize awarded changed to another candidate.
    let prize: String = sqlx::query_scalar(
        "SELECT prize FROM fair_lottery_draws WHERE activity = $1 AND serial = $2",
    )
    .bind(id)
    .bind(serial)
    .fetch_one(&env.db)
    .await
    .unwrap();
    let other = if prize == "points-10" {
        "coupon-5"
    } else {
        "points-10"
    };
    tamper(
        &env,
        "fair_lottery_draws",
        &format!("UPDATE fair_lottery_draws SET prize = '{other}' WHERE activity = '{id}' AND serial = {serial}"),
    )
    .await;
    let (p, m) = first_mismatch(&verdict(&env, id).await);
    assert_eq!(
        (p, m["check"].as_str(), m["found"].as_str()),
        (period, Some("prize"), Some(other)),
        "{m}"
    );
    tamper(
        &env,
        "fair_lottery_draws",
        &format!("UPDATE fair_lottery_draws SET prize = '{prize}' WHERE activity = '{id}' AND serial = {serial}"),
    )
    .await;
    assert_eq!(verdict(&env, id).await["ok"], true);

    // Another seed revealed for the period: not the committed one.
    let other_seed = Seed([7; 32]).to_hex();
    tamper(
        &env,
        "fair_lottery_reveals",
        &format!("UPDATE fair_lottery_reveals SET seed = '{other_seed}' WHERE activity = '{id}' AND period = {period}"),
    )
    .await;
    let v = verdict(&env, id).await;
    let (p, m) = first_mismatch(&v);
    assert_eq!(
        (p, m["check"].as_str()),
        (period, Some("commitment")),
        "{m}"
    );
    assert_eq!(m["found"], Seed([7; 32]).commitment(), "{m}");
    env.stop_workers().await;
}

#[tokio::test]
async fn a_seed_whose_commitment_is_on_record_nowhere_is_never_used() {
    let mut env = TestEnv::new(&[("SHORT_POOL_WAIT_MS", "300")]).await;
    let id = "outage-wheel";
    // Opens in a moment: `activity load` commits no seed for it.
    let starts = Utc::now() + Span::seconds(2);
    env.load_activities(&activity(id, starts, starts + Span::hours(1), 86_400))
        .await;
    // Only a draw worker: nobody answers its `lottery.seed`.
    env.start_draw_worker().await;
    let client = env.client().await;
    let r = client
        .call("draw", &grant("g-1", id, 1, 2), T)
        .await
        .unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    wait_until(starts.timestamp() as u64 + 1).await;
    let period = seeds::period_of(Utc::now().timestamp() as u64, 86_400);

    // Postgres away and no outbox: the seed is chosen, not committed.
    let away = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy(&format!(
            "postgres://postgres@127.0.0.1:{}/away",
            common::free_port()
        ))
        .unwrap();
    let mut redis = env.redis.clone();
    let prefix = env.config.redis_prefix.clone();
    let refused = seeds::commit(&away, &mut redis, &prefix, id, period, 86_400, None).await;
    assert!(
        matches!(refused, Err(prizepool::amqp::HandleError::Transient(_))),
        "{refused:?}"
    );
    // A draw finds no committed seed: it waits, then answers
    // pool_exhausted, spending no chance and awarding nothing.
    let r = client.call("draw", &draw(id, 1, 1), T).await.unwrap();
    assert_eq!(r["error"]["code"], "pool_exhausted", "{r}");
    let left = prizepool::kinds::lottery::chances_left(&mut redis, &env.keys(id), 1)
        .await
        .unwrap();
    assert_eq!(left, Some(2));

    // Postgres still away, the outbox takes the commitment: now it is on
    // record (in Redis, beside the activity) and the seed is committed,
    // the one chosen first.
    let chosen: String = redis::cmd("HGET")
        .arg(env.keys(id).lottery_seeds())
        .arg(format!("n:{period}"))
        .query_async(&mut redis)
        .await
        .unwrap();
    let committed = seeds::commit(
        &away,
        &mut redis,
        &prefix,
        id,
        period,
        86_400,
        Some(&env.redis),
    )
    .await
    .unwrap();
    assert_eq!(committed, seeds::Committed::Ready);
    let kept: String = redis::cmd("HGET")
        .arg(env.keys(id).fair_outbox())
        .arg(format!("{}{period}", seeds::OUTBOX_FIELD))
        .query_async(&mut redis)
        .await
        .unwrap();
    let kept: seeds::SeedCommitment = serde_json::from_str(&kept).unwrap();
    assert_eq!(kept.commitment, &chosen[..64]);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM fair_lottery_seeds")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(rows, 0);
    let r = client.call("draw", &draw(id, 1, 1), T).await.unwrap();
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["pick"]["period"].as_u64(), Some(period), "{r}");
    let seed = Seed::from_hex(&chosen[65..]).unwrap();
    let request = r["request_id"].as_str().unwrap();
    let values = lottery_values(&seed, &lottery_context(id, period, request), 0, 4);
    let weights: Vec<u64> = r["pick"]["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["weight"].as_u64().unwrap())
        .collect();
    assert_eq!(
        r["pick"]["value"].as_u64(),
        lottery_pick(&values, &weights).map(|(v, _)| v)
    );

    // Postgres back: the outbox reaches it, with the commitment chosen.
    let written = prizepool::audit::drain_outbox(&env.db, &env.redis, &prefix)
        .await
        .unwrap();
    assert_eq!(written, 1);
    let recorded: String = sqlx::query_scalar(
        "SELECT commitment FROM fair_lottery_seeds WHERE activity = $1 AND period = $2",
    )
    .bind(id)
    .bind(period as i64)
    .fetch_one(&env.db)
    .await
    .unwrap();
    assert_eq!(recorded, seed.commitment());
    env.stop_workers().await;
}
