//! The draw queue under a hostile or careless upstream: reused ids with
//! other content, ids full of key syntax, extreme numbers, forged refills,
//! repeated refusals. Whatever arrives, there is one clear answer, nothing
//! is created and nothing is lost.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::HashMap, time::Duration};

use chrono::Utc;
use common::{eventually, pool_toml, TestEnv};
use prizepool::{amqp, kinds::lucky_gift};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

fn draw_as(request_id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"type": "draw", "request_id": request_id, "pool": pool, "user_id": user, "count": count})
}

fn code(reply: &Value) -> &str {
    reply["error"]["code"].as_str().unwrap_or("")
}

/// Sum of the rewards `replies` promised, by user.
fn promised(replies: &[Value]) -> HashMap<i64, i64> {
    let mut by_user = HashMap::new();
    for r in replies.iter().filter(|r| r["status"] == "ok") {
        *by_user.entry(r["user_id"].as_i64().unwrap()).or_default() +=
            r["reward"].as_i64().unwrap();
    }
    by_user
}

async fn coins(env: &TestEnv, account: i64) -> i64 {
    prizepool::settle::balances(&env.db, account)
        .await
        .unwrap()
        .into_iter()
        .find(|b| b.asset == "coin")
        .map_or(0, |b| b.balance)
}

/// Waits until `queue` holds `n` messages (or the time is up) and returns its depth.
async fn wait_depth(env: &TestEnv, queue: &str, n: u32) -> u32 {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let depth = env.queue_depth(queue).await;
        if depth >= n || tokio::time::Instant::now() > deadline {
            return depth;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_request_id_names_one_request_whoever_sends_it_again() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("p1", "", GIFT)).await;
    env.load(&pool_toml("p2", "", GIFT)).await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;

    let first = client
        .call("draw", &draw_as("r-1", "p1", 1, 5), T)
        .await
        .unwrap();
    assert_eq!(first["status"], "ok", "{first}");
    // Another user, another pool, another count: refused, nothing moves.
    for reused in [
        draw_as("r-1", "p1", 2, 5),
        draw_as("r-1", "p2", 1, 5),
        draw_as("r-1", "p1", 1, 6),
    ] {
        let reply = client.call("draw", &reused, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{reused} -> {reply}");
        assert_eq!(code(&reply), "invalid_request", "{reply}");
        assert_eq!(reply["request_id"], "r-1");
    }
    // The same content replays the first answer exactly.
    let again = client
        .call("draw", &draw_as("r-1", "p1", 1, 5), T)
        .await
        .unwrap();
    assert_eq!(again, first);
    // Twenty concurrent copies under twenty users: only the first claimant's
    // content counts; the rest are refused.
    let copies = (0..20).map(|user| {
        let client = &client;
        async move {
            client
                .call("draw", &draw_as("r-race", "p2", 100 + user, 3), T)
                .await
                .unwrap()
        }
    });
    let raced: Vec<Value> = futures_util::future::join_all(copies).await;
    let won: Vec<&Value> = raced.iter().filter(|r| r["status"] == "ok").collect();
    assert_eq!(won.len(), 1, "{raced:?}");
    assert!(raced
        .iter()
        .filter(|r| r["status"] != "ok")
        .all(|r| code(r) == "invalid_request"));

    let s1 = env.status("p1").await;
    let s2 = env.status("p2").await;
    assert_eq!((s1.drawn, s2.drawn), (5, 3), "each request drew once");
    assert_eq!(s1.stocked, s1.drawn + s1.in_pool);
    assert_eq!(s2.stocked, s2.drawn + s2.in_pool);
    // What the replies promised, the ledger pays, to the right users only.
    let mut replies = vec![first];
    replies.extend(won.into_iter().cloned());
    let owed = promised(&replies);
    let total: i64 = owed.values().sum();
    env.wait_ledger("p1", owed.get(&1).copied().unwrap_or(0))
        .await;
    let winner = raced.iter().find(|r| r["status"] == "ok").unwrap();
    let winner_user = winner["user_id"].as_i64().unwrap();
    assert_eq!(
        env.wait_ledger("p2", winner["reward"].as_i64().unwrap())
            .await,
        winner["reward"].as_i64().unwrap()
    );
    for user in [1, 2].into_iter().chain(100..120) {
        let expected = owed.get(&user).copied().unwrap_or(0);
        assert_eq!(coins(&env, user).await, expected, "user {user}");
    }
    assert!(total >= 0 && owed.contains_key(&winner_user));
    // The refused requests are in the dead-letter queue with their reason.
    assert_eq!(wait_depth(&env, amqp::DRAW.dlq, 22).await, 22);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_refusal_is_the_answer_for_good() {
    let mut env = TestEnv::new(&[("SHORT_POOL_WAIT_MS", "200")]).await;
    env.load(&pool_toml("short", "", &[("a", &[(1, 10)])]))
        .await;
    let now = Utc::now();
    env.load_activities(&format!(
        "[[activities]]\nid = \"act\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\nprizes = [ {{ id = \"x\", weight = 1, stock = 1 }} ]\n",
        (now - chrono::Duration::hours(1)).to_rfc3339(),
        (now + chrono::Duration::hours(1)).to_rfc3339(),
    ))
    .await;
    env.start_draw_worker().await;
    let client = env.client().await;

    // pool_exhausted: no refill worker runs, so the short draw is refused.
    let short = draw_as("ex-1", "short", 1, 11);
    let reply = client.call("draw", &short, T).await.unwrap();
    assert_eq!(code(&reply), "pool_exhausted", "{reply}");
    // A refill arrives; the refused request still answers pool_exhausted and draws nothing.
    env.start_refill_worker().await;
    let deadline = tokio::time::Instant::now() + T;
    while env.status("short").await.generation < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        env.status("short").await.generation,
        2,
        "the urgent refill stocked"
    );
    let again = client.call("draw", &short, T).await.unwrap();
    assert_eq!(again, reply);
    assert_eq!(env.status("short").await.drawn, 0);

    // no_chances, then chances granted: the refused request still spends nothing.
    let no = draw_as("nc-1", "act", 7, 1);
    let reply = client.call("draw", &no, T).await.unwrap();
    assert_eq!(code(&reply), "no_chances", "{reply}");
    let grant = json!({"type": "lottery.grant", "grant_id": "g-7", "activity": "act", "user_id": 7, "chances": 2});
    let granted = client.call("draw", &grant, T).await.unwrap();
    assert_eq!(granted["chances_left"], 2, "{granted}");
    assert_eq!(client.call("draw", &no, T).await.unwrap(), reply);
    // The one prize goes; with no consolation the next draw is sold_out and
    // spends no chance; replayed, it stays sold_out.
    let won = client
        .call("draw", &draw_as("w-1", "act", 7, 1), T)
        .await
        .unwrap();
    assert_eq!(won["status"], "ok", "{won}");
    assert_eq!(won["chances_left"], 1);
    let sold = draw_as("so-1", "act", 7, 1);
    let reply = client.call("draw", &sold, T).await.unwrap();
    assert_eq!(code(&reply), "sold_out", "{reply}");
    assert_eq!(client.call("draw", &sold, T).await.unwrap(), reply);
    let mut redis = env.redis.clone();
    let left = prizepool::kinds::lottery::chances_left(&mut redis, &env.keys("act"), 7)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left, 1, "sold_out spent no chance");
    // A grant id reused for another grant is refused and grants nothing.
    let reused = json!({"type": "lottery.grant", "grant_id": "g-7", "activity": "act", "user_id": 7, "chances": 50});
    let reply = client.call("draw", &reused, T).await.unwrap();
    assert_eq!(code(&reply), "invalid_request", "{reply}");
    let left = prizepool::kinds::lottery::chances_left(&mut redis, &env.keys("act"), 7)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(left, 1);
    env.stop_workers().await;
}

#[tokio::test]
async fn ids_are_data_and_numbers_have_bounds() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("g", "", GIFT)).await;
    env.start_draw_worker().await;
    let client = env.client().await;
    let long = "x".repeat(129);
    let bodies = vec![
        // Key syntax in the pool id would name another slot or pool.
        draw_as("k-1", "g}:x:{g", 1, 1),
        draw_as("k-2", "{g}", 1, 1),
        draw_as("k-3", "g x", 1, 1),
        draw_as("k-4", "g\u{0}", 1, 1),
        draw_as("k-5", &long, 1, 1),
        draw_as("a{b}", "g", 1, 1),
        draw_as("a b", "g", 1, 1),
        draw_as("", "g", 1, 1),
        draw_as("é", "g", 1, 1),
        // Numbers out of range or of the wrong type.
        draw_as("n-1", "g", 1, 0),
        draw_as("n-2", "g", 1, 10_001),
        draw_as("n-3", "g", -1, 1),
        json!({"type": "draw", "request_id": "n-4", "pool": "g", "user_id": 1, "count": -1}),
        json!({"type": "draw", "request_id": "n-5", "pool": "g", "user_id": 1, "count": 1.5}),
        json!({"type": "draw", "request_id": "n-6", "pool": "g", "user_id": 1e300, "count": 1}),
        json!({"type": "draw", "request_id": "n-7", "pool": "g", "user_id": "1", "count": 1}),
        json!({"type": "draw", "request_id": "n-8", "pool": "g", "user_id": 1, "count": 4294967296u64}),
        json!({"type": "draw", "request_id": 5, "pool": "g", "user_id": 1, "count": 1}),
        json!({"type": "lottery.grant", "grant_id": "g-1", "activity": "a}b", "user_id": 1, "chances": 1}),
        json!({"type": "lottery.grant", "grant_id": "g-2", "activity": "g", "user_id": 1, "chances": 0}),
        // count above the pool's max_count (default 1000)
        draw_as("n-9", "g", 1, 1001),
    ];
    for body in &bodies {
        let reply = client.call("draw", body, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{body} -> {reply}");
        assert_eq!(code(&reply), "invalid_request", "{body} -> {reply}");
    }
    let s = env.status("g").await;
    assert_eq!(s.drawn, 0, "nothing was drawn");
    assert_eq!(
        wait_depth(&env, amqp::DRAW.dlq, bodies.len() as u32).await,
        bodies.len() as u32
    );
    // Nothing was written under a key outside the test's own pools (and
    // the deployment's note of its answer-store layout).
    let mut redis = env.redis.clone();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", env.config.redis_prefix))
        .query_async(&mut redis)
        .await
        .unwrap();
    for key in &keys {
        assert!(
            key.contains(":{g}:")
                || key.contains(":rq:{")
                || key.contains(":gr:{")
                || *key == format!("{}:store:since", env.config.redis_prefix),
            "unexpected key {key}"
        );
    }
    // Still serving.
    let ok = client
        .call("draw", &draw_as("fine", "g", 1, 1), T)
        .await
        .unwrap();
    assert_eq!(ok["status"], "ok", "{ok}");
    env.stop_workers().await;
}

#[test]
fn pool_files_refuse_key_syntax_and_unpayable_draws() {
    let base = pool_toml("ok", "", GIFT);
    assert!(lucky_gift::parse_file(&base).is_ok());
    for (text, field) in [
        (pool_toml("a{b}", "", GIFT), "id"),
        (pool_toml("a b", "", GIFT), "id"),
        (base.replace("id = \"a\"", "id = \"a}\""), "id"),
        (base.replace("unit_price = 10", "unit_price = 1000000001"), "unit_price"),
        (base.replace("\"10\" = 10", "\"1000001\" = 10"), "stock"),
        // 10,000 prizes × 1,000 × unit price 10^9 passes 2^53 (with the
        // highest multiplier 10 it would be 10^14: payable, and a reply of
        // 10,000 prizes fits in the compact form of big draws).
        (
            base.replace("unit_price = 10", "unit_price = 1000000000\nmax_count = 10000")
                .replace("\"10\" = 10", "\"1000\" = 10"),
            "max_count",
        ),
        // 10,000 prizes of 400 distinct prizes with a long combo id do not
        // fit a 64 KiB reply, even in the compact form of big draws.
        (
            pool_toml(
                "fat",
                "max_count = 10000",
                &[(&"c".repeat(100), &(1..=400).map(|m| (m, 10)).collect::<Vec<_>>())],
            ),
            "max_count",
        ),
        (
            base.replace(
                "unit_price = 10",
                "unit_price = 10\njackpot = { min_multiplier = 5, daily_consumption_threshold = 4503599627370497 }",
            ),
            "daily_consumption_threshold",
        ),
    ] {
        let err = lucky_gift::parse_file(&text).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
}

#[tokio::test]
async fn a_forged_refill_stocks_nothing() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("f", "", GIFT)).await;
    env.start_refill_worker().await;
    let client = env.client().await;
    // Batch 1 is current, but no draw took its refill point and the pool is full.
    for trigger in [1u64, 2, 5, u64::MAX] {
        let reply = client
            .call(
                "refill",
                &json!({"type": "refill", "pool": "f", "trigger": trigger, "urgent": true}),
                T,
            )
            .await
            .unwrap();
        assert_eq!(reply["status"], "rejected", "{trigger}: {reply}");
        assert_eq!(code(&reply), "invalid_request", "{trigger}: {reply}");
    }
    let s = env.status("f").await;
    assert_eq!((s.generation, s.stocked), (1, 640));
    assert_eq!(wait_depth(&env, amqp::REFILL.dlq, 4).await, 4);
    env.stop_workers().await;
}

#[tokio::test]
async fn forged_ledger_entries_move_nothing_and_cannot_squat_a_reward() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("sq", "", &[("a", &[(7, 50)])])).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let forged = [
        // A reward the fleet never granted.
        json!({"type": "settle", "entry_id": "draw:never", "account": 9, "asset": "coin",
               "amount": 1_000_000, "reason": "lucky_gift"}),
        // The id a real draw will use, taken first under an upstream reason.
        json!({"type": "settle", "entry_id": "draw:squat", "account": 9, "asset": "coin",
               "amount": 1, "reason": "topup"}),
        // An escrow debit from someone else's balance.
        json!({"type": "settle", "entry_id": "x-escrow", "account": 3, "asset": "coin",
               "amount": -5, "reason": "red_packet_escrow"}),
        // A seal that is not the fleet's.
        json!({"type": "settle", "entry_id": "lottery:l1", "account": 9, "asset": "item:x",
               "amount": 1, "reason": "lottery", "seal": "00".repeat(32)}),
    ];
    for body in &forged {
        let reply = client.call("settle", body, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{body} -> {reply}");
        assert_eq!(code(&reply), "invalid_request", "{body} -> {reply}");
    }
    assert_eq!(coins(&env, 9).await, 0);
    // The real draw under the squatted id is paid in full.
    env.start_draw_worker().await;
    let reply = client
        .call("draw", &draw_as("squat", "sq", 9, 3), T)
        .await
        .unwrap();
    assert_eq!(reply["reward"], 210, "{reply}");
    assert_eq!(env.wait_ledger("sq", 210).await, 210);
    assert_eq!(coins(&env, 9).await, 210);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_reload_takes_effect_at_once_and_a_replay_pays_what_it_first_said() {
    let mut env = TestEnv::new(&[]).await;
    let combos: &[(&str, &[(u64, u64)])] = &[("a", &[(3, 200)])];
    env.load(&pool_toml("re", "", combos)).await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let first = client
        .call("draw", &draw_as("re-1", "re", 4, 2), T)
        .await
        .unwrap();
    assert_eq!(
        (first["asset"].as_str(), first["reward"].as_i64()),
        (Some("coin"), Some(60))
    );
    // A new version pays in another asset at another price, for every worker at once.
    env.load(
        &pool_toml("re", "asset = \"gem\"", combos).replace("unit_price = 10", "unit_price = 20"),
    )
    .await;
    let second = client
        .call("draw", &draw_as("re-2", "re", 4, 2), T)
        .await
        .unwrap();
    assert_eq!(
        (second["asset"].as_str(), second["reward"].as_i64()),
        (Some("gem"), Some(120))
    );
    // The first request, replayed, still says and pays what it first said.
    let again = client
        .call("draw", &draw_as("re-1", "re", 4, 2), T)
        .await
        .unwrap();
    assert_eq!(again, first);
    let deadline = tokio::time::Instant::now() + T;
    let of = |b: &[prizepool::settle::Balance], asset: &str| {
        b.iter().find(|b| b.asset == asset).map_or(0, |b| b.balance)
    };
    loop {
        let b = prizepool::settle::balances(&env.db, 4).await.unwrap();
        if (of(&b, "coin"), of(&b, "gem")) == (60, 120) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "ledger {b:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.stop_workers().await;
}

#[tokio::test]
async fn a_request_id_sent_again_after_its_answer_expired_is_a_new_draw_paid_in_full() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("late", "", &[("a", &[(3, 100)])]))
        .await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let first = client
        .call("draw", &draw_as("late-1", "late", 6, 2), T)
        .await
        .unwrap();
    assert_eq!(first["reward"], 60, "{first}");
    assert_eq!(env.wait_ledger("late", 60).await, 60);
    // A day later the answer and the claim have expired (RESULT_TTL_S).
    env.forget_answer("late", "late-1").await;
    // The same id now names a new draw: it takes new prizes, and its reply
    // is paid too, under an entry of its own.
    let again = client
        .call("draw", &draw_as("late-1", "late", 6, 4), T)
        .await
        .unwrap();
    assert_eq!(again["reward"], 120, "{again}");
    assert_eq!(env.wait_ledger("late", 180).await, 180);
    assert_eq!(coins(&env, 6).await, 180);
    let s = env.status("late").await;
    assert_eq!((s.drawn, s.stocked), (6, s.drawn + s.in_pool));
    env.stop_workers().await;
}

/// Bodies the settle worker and the audit read straight into typed values
/// must not take: an envelope that is not a JSON object with a string
/// `type` (serde reads a struct from an array and an enum from a map), JSON
/// a value refuses (a lone surrogate, a number out of range, nesting past
/// the limit), serde_json's raw-value key. Over the wire, each is refused
/// and dead-lettered and moves nothing; the workers go on: the same top-up
/// well formed is booked, and a real draw's sealed record lands in the trail.
#[tokio::test]
async fn bodies_the_straight_reads_must_not_take_are_refused_over_the_wire() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml("sr", "", &[("a", &[(7, 50)])])).await;
    env.start_settle_worker().await;
    let raw = common::raw::Raw::new(&env).await;
    let topup = r#""entry_id":"sr-1","account":11,"asset":"coin","amount":5,"reason":"topup""#;
    let settle = [
        r#"["settle","sr-1",11,"coin",5,"topup"]"#.to_owned(),
        format!(r#"{{"type":{{"settle":null}},{topup}}}"#),
        format!(r#"{{"$serde_json::private::RawValue":"{{}}","type":"settle",{topup}}}"#),
        format!(r#"{{"type":"settle",{topup},"ref":{{"x":"\ud800"}}}}"#),
        format!(
            r#"{{"type":"settle.batch","entries":[{{"type":"settle",{topup},"ref":[1e400]}}]}}"#
        ),
        format!(r#"["settle.batch",[{{"type":"settle",{topup}}}]]"#),
        format!(r#"{{"type":{{"settle.batch":null}},"entries":[{{"type":"settle",{topup}}}]}}"#),
    ];
    for (i, body) in settle.iter().enumerate() {
        let corr = format!("bad-{i}");
        raw.publish("settle", body.as_bytes(), raw.props(&corr))
            .await;
        let reply = raw.reply(&corr).await;
        assert_eq!(reply["status"], "rejected", "{body} -> {reply}");
        assert_eq!(code(&reply), "invalid_request", "{body} -> {reply}");
    }
    let dead = settle.len() as u32;
    assert_eq!(wait_depth(&env, amqp::SETTLE.dlq, dead).await, dead);
    assert_eq!(coins(&env, 11).await, 0);
    let good = format!(r#"{{"type":"settle",{topup}}}"#);
    raw.publish("settle", good.as_bytes(), raw.props("good"))
        .await;
    assert_eq!(raw.reply("good").await["status"], "ok");
    assert_eq!(coins(&env, 11).await, 5);

    let (_conn, channel) = env.confirm_channel("forger").await;
    let deep = format!(
        r#"{{"type":"draw.completed.batch","events":[],"x":{}{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let audit_bodies = [
        r#"["draw.completed.batch"]"#.to_owned(),
        r#"{"type":"draw.completed.batch","events":[],"x":"\ud800"}"#.to_owned(),
        r#"{"type":"draw.completed.batch","events":[],"x":1e400}"#.to_owned(),
        r#"{"type":"draw.completed.batch","events":[{"request_id":"x","status":"ok","extra":{"$serde_json::private::RawValue":"nope"}}]}"#.to_owned(),
        deep,
    ];
    for body in &audit_bodies {
        let confirm = channel
            .basic_publish(
                amqp::EVENTS.into(),
                "draw.completed".into(),
                Default::default(),
                body.as_bytes(),
                lapin::BasicProperties::default(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "{body}");
    }
    let dead = audit_bodies.len() as u32;
    let audit_dlq = prizepool::audit::ROUTE.dlq;
    assert_eq!(wait_depth(&env, audit_dlq, dead).await, dead);
    // The audit goes on: a real draw, published as a group, is recorded.
    env.start_draw_worker().await;
    let client = env.client().await;
    let reply = client
        .call("draw", &draw_as("sr-real", "sr", 12, 2), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    eventually(T, || async {
        let (rows,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM fair_draws WHERE request_id = 'sr-real'")
                .fetch_one(&env.db)
                .await
                .unwrap();
        (rows == 1)
            .then_some(())
            .ok_or_else(|| format!("the real draw is in the trail {rows} times"))
    })
    .await;
    assert_eq!(env.queue_depth(audit_dlq).await, dead);
    env.stop_workers().await;
}
