//! One hot pool past one Redis key: a pool declared with `shards = K` is
//! stocked as K sub-pools (`<id>~0` … `<id>~K-1`, each on a slot of its
//! own) with whole batches of the same config. A draw goes to the sub-pool
//! of its user; the reply, the ledger, `pool status` and `pool refill` see
//! one pool, and every invariant holds per sub-pool and for the whole.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::HashMap, time::Duration};

use common::{draw, pool_toml, TestEnv};
use prizepool::{audit, kinds::lucky_gift, scripts::PoolKeys};
use serde_json::{json, Value};

/// Ten prizes a batch, so a few hundred draws cross many refills.
const GIFT: &[(&str, &[(u64, u64)])] = &[("a", &[(0, 5), (1, 3), (5, 1), (20, 1)])];

const SHARDS: i64 = 4;

fn hot_toml(id: &str, shards: i64) -> String {
    pool_toml(
        id,
        &format!("shards = {shards}\nrefill_at = 0.5\nmax_count = 5"),
        GIFT,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_pool_spreads_its_draws_and_keeps_every_invariant() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&hot_toml("hot", SHARDS)).await;
    env.start_fleet().await;
    let client = env.client().await;

    // Each sub-pool is stocked with one whole batch of the config, under a
    // hash tag of its own.
    let status = env.pool_status("hot").await;
    assert_eq!(status.shards.len(), SHARDS as usize);
    assert_eq!(status.total.stocked, 10 * SHARDS as u64);
    for (i, sub) in status.shards.iter().enumerate() {
        assert_eq!(sub.pool, format!("hot~{i}"));
        assert_eq!((sub.stocked, sub.drawn, sub.generation), (10, 0, 1));
    }
    let tags: std::collections::HashSet<String> = (0..SHARDS)
        .map(|i| env.keys(&format!("hot~{i}")).meta())
        .collect();
    assert_eq!(tags.len(), SHARDS as usize);

    // 240 draws from 24 users, the users side by side, each user's draws
    // one after another: far more than the stock, so every sub-pool is
    // refilled several times.
    let mut sent: Vec<Value> = Vec::new();
    for user in 0..24i64 {
        for k in 0..10u32 {
            sent.push(draw("hot", user, 1 + k % 3));
        }
    }
    let replies: Vec<anyhow::Result<Value>> = {
        let per_user = sent.chunks(10).map(|bodies| {
            let client = &client;
            async move {
                let mut out = Vec::new();
                for body in bodies {
                    out.push(client.call("draw", body, Duration::from_secs(60)).await);
                }
                out
            }
        });
        futures_util::future::join_all(per_user)
            .await
            .into_iter()
            .flatten()
            .collect()
    };
    let mut promised = 0i64;
    let mut per_shard: HashMap<u64, u64> = HashMap::new();
    for (body, reply) in sent.iter().zip(replies) {
        let reply = reply.unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        // The reply names the pool the request named, and the sub-pool of
        // its user: user mod K.
        assert_eq!(reply["pool"], "hot");
        let user = body["user_id"].as_i64().unwrap();
        let shard = reply["shard"].as_u64().unwrap();
        assert_eq!(shard as i64, user.rem_euclid(SHARDS), "{reply}");
        *per_shard.entry(shard).or_default() += body["count"].as_u64().unwrap();
        promised += reply["reward"].as_i64().unwrap();
        // A replay answers the same; the id with other content is refused.
        let again = client
            .call("draw", body, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(again["prizes"], reply["prizes"]);
        assert_eq!(again["shard"], reply["shard"]);
    }
    let mut other = sent[0].clone();
    other["user_id"] = json!(sent[0]["user_id"].as_i64().unwrap() + 1);
    let reused = client
        .call("draw", &other, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(reused["error"]["code"], "invalid_request", "{reused}");

    // The ledger sees one pool and pays exactly what the replies promised.
    assert_eq!(env.wait_ledger("hot", promised).await, promised);
    // Status sums the sub-pools; each sub-pool drew what its users asked,
    // conserved its own prizes and was refilled on its own.
    let status = env.pool_status("hot").await;
    let drawn: u64 = per_shard.values().sum();
    assert_eq!(status.total.drawn, drawn);
    assert_eq!(
        status.total.stocked,
        status.total.drawn + status.total.in_pool
    );
    for (i, sub) in status.shards.iter().enumerate() {
        assert_eq!(sub.drawn, per_shard[&(i as u64)], "{}", sub.pool);
        assert_eq!(sub.stocked, sub.drawn + sub.in_pool, "{}", sub.pool);
        assert!(sub.generation > 1, "{} was refilled", sub.pool);
        assert_eq!(sub.stocked % 10, 0, "{}: whole batches", sub.pool);
    }

    // A draw.batch of the pool, entries of every sub-pool: each entry is
    // answered by its user's sub-pool, in request order.
    let entries: Vec<Value> = (0..8).map(|u| draw("hot", u, 1)).collect();
    let batch = client
        .call(
            "draw",
            &json!({"type": "draw.batch", "requests": entries}),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    let results = batch["results"].as_array().unwrap();
    for (entry, result) in entries.iter().zip(results) {
        assert_eq!(result["request_id"], entry["request_id"]);
        assert_eq!(result["status"], "ok", "{result}");
        assert_eq!(
            result["shard"].as_i64().unwrap(),
            entry["user_id"].as_i64().unwrap().rem_euclid(SHARDS)
        );
    }

    // The audit trail keeps each sub-pool's batches apart: once the
    // recorded draws are in, every revealed batch matches its commitment.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let verdicts = audit::verify_pool(&env.db, "hot", None).await.unwrap();
        assert_eq!(verdicts.len(), SHARDS as usize);
        assert!(verdicts.iter().all(|v| v.ok), "{verdicts:?}");
        let checked: Vec<u64> = verdicts
            .iter()
            .map(|v| {
                v.batches
                    .iter()
                    .filter(|b| b.status == "ok" && b.complete)
                    .count() as u64
            })
            .collect();
        if checked.iter().all(|&c| c > 0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "complete batches per sub-pool: {checked:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // `audit verify --json` answers a sharded pool in the shape of a plain
    // one: one object, its batches naming their sub-pools.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"))
        .args(["audit", "verify", "hot", "--json"])
        .envs(env.env())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let verdict: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&verdict["pool"], &verdict["ok"]),
        (&json!("hot"), &json!(true))
    );
    let batches = verdict["batches"].as_array().unwrap();
    let pools: std::collections::BTreeSet<&str> = batches
        .iter()
        .map(|b| b["pool"].as_str().unwrap())
        .collect();
    let subs: Vec<String> = (0..SHARDS).map(|i| format!("hot~{i}")).collect();
    assert_eq!(pools, subs.iter().map(String::as_str).collect());
    // Every refill of a sub-pool was a genuine `pool.refilled`: the audit
    // recorded each one (its commitment is the one the refill worker wrote)
    // and dead-lettered none.
    wait_audit_idle(&env).await;
    assert_eq!(
        env.queue_depth(audit::ROUTE.dlq).await,
        0,
        "audit dead letters"
    );
    let (recorded,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM fair_batches WHERE pool LIKE 'hot~%'")
            .fetch_one(&env.db)
            .await
            .unwrap();
    let generations: u64 = status.shards.iter().map(|s| s.generation).sum();
    assert!(
        recorded as u64 >= generations,
        "{recorded} of {generations}"
    );
    client.close().await;
}

/// Waits until the audit queue holds nothing, ready or unacked.
async fn wait_audit_idle(env: &TestEnv) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = std::process::Command::new("rabbitmqctl")
            .args(["list_queues", "-q", "-p", &env.vhost, "name", "messages"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let busy = text.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 2 && f[0] == audit::ROUTE.queue && f[1] != "0"
        });
        if out.status.success() && !busy {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the audit queue is still busy: {text}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A request refused as `unknown_pool` before its pool existed is answered
/// the same when it is retried after the pool was loaded with shards: the
/// refusal was stored under the pool's own id, the retry is routed to its
/// user's sub-pool, and it still meets its first answer instead of drawing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_stored_before_the_shards_is_found_after_them() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    let early: Vec<Value> = (0..6).map(|user| draw("late", user, 1)).collect();
    for body in &early {
        let reply = client
            .call("draw", body, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(reply["error"]["code"], "unknown_pool", "{reply}");
    }
    env.load(&hot_toml("late", 3)).await;
    // Retries, through the running workers and through a fresh one (no
    // cached kinds), answer as first answered and draw nothing.
    for round in 0..2 {
        for body in &early {
            let reply = client
                .call("draw", body, Duration::from_secs(30))
                .await
                .unwrap();
            assert_eq!(reply["error"]["code"], "unknown_pool", "{round}: {reply}");
        }
        assert_eq!(env.status("late").await.drawn, 0);
        env.stop_workers().await;
        env.start_fleet().await;
    }
    // A new request draws from its user's sub-pool.
    let reply = client
        .call("draw", &draw("late", 4, 1), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(reply["shard"], 1, "{reply}");
    assert_eq!(env.status("late").await.drawn, 1);
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_pool_is_no_pool_of_its_own() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&hot_toml("hot", 3)).await;
    env.start_fleet().await;
    let client = env.client().await;

    // Named directly, a sub-pool is an unknown pool, and nothing moves.
    for name in ["hot~0", "hot~2", "hot~3", "hot~", "hot~x"] {
        let reply = client
            .call("draw", &draw(name, 7, 1), Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(reply["error"]["code"], "unknown_pool", "{name}: {reply}");
    }
    assert_eq!(env.status("hot").await.drawn, 0);

    // Nor can a refill stock the parent pool, whose keys hold no prizes:
    // whoever sends it, with any trigger, urgent or not.
    for trigger in [0u64, 1, 2] {
        for urgent in [false, true] {
            let reply = client
                .call(
                    "refill",
                    &json!({"type": "refill", "pool": "hot", "trigger": trigger, "urgent": urgent}),
                    Duration::from_secs(30),
                )
                .await
                .unwrap();
            assert_eq!(reply["status"], "rejected", "{reply}");
        }
    }
    let mut redis = env.redis.clone();
    let parent_prizes: i64 = redis::cmd("LLEN")
        .arg(env.keys("hot").queue())
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(parent_prizes, 0);
    let (parent_batches,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM fair_batches WHERE pool = 'hot'")
            .fetch_one(&env.db)
            .await
            .unwrap();
    assert_eq!(parent_batches, 0);
    assert_eq!(env.status("hot").await.stocked, 30);

    // Its id is taken in the one namespace of ids: no red packet can be
    // created over a sub-pool's keys.
    env.fund(5, 1000).await;
    let created = client
        .call(
            "refill",
            &json!({"type": "redpacket.create", "packet_id": "hot~1", "sender": 5,
                    "total": 100, "count": 2, "min": 1, "expires_in_s": 60}),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(created["status"], "rejected", "{created}");
    let sub = env.pool_status("hot").await.shards[1].clone();
    assert_eq!((sub.kind.as_str(), sub.stocked), (lucky_gift::KIND, 10));

    // The shards of a loaded pool cannot change, and a pool name cannot
    // hold the separator; the same shards load a new version.
    let configs = lucky_gift::parse_file(&hot_toml("hot", 2)).unwrap();
    let changed = env.try_load(&configs).await.unwrap_err();
    assert!(format!("{changed:#}").contains("shards"), "{changed:#}");
    assert!(lucky_gift::parse_file(&hot_toml("a~1", 1)).is_err());
    env.load(&hot_toml("hot", 3)).await;
    assert_eq!(env.pool_status("hot").await.shards.len(), 3);

    // An unsharded pool cannot take the name of a sharded pool's sub-pool
    // either (the names cannot hold `~`), nor can a sharded pool be loaded
    // over an id another kind holds.
    let red = client
        .call(
            "refill",
            &json!({"type": "redpacket.create", "packet_id": "rp~0", "sender": 5,
                    "total": 100, "count": 2, "min": 1, "expires_in_s": 60}),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(red["status"], "ok", "{red}");
    let configs = lucky_gift::parse_file(&hot_toml("rp", 2)).unwrap();
    let taken = env.try_load(&configs).await.unwrap_err();
    assert!(format!("{taken:#}").contains("red_packet"), "{taken:#}");
    let keys = PoolKeys::new(&env.config.redis_prefix, "rp");
    let kind: Option<String> = redis::cmd("HGET")
        .arg(keys.meta())
        .arg("kind")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(kind, None, "nothing of the refused pool reached Redis");
    client.close().await;
}

#[test]
fn shards_are_validated_and_split_the_jackpot_threshold() {
    for bad in ["0", "65", "-1", "\"2\""] {
        let text = pool_toml("p", &format!("shards = {bad}"), GIFT);
        assert!(lucky_gift::parse_file(&text).is_err(), "shards = {bad}");
    }
    let long = "x".repeat(prizepool::messages::MAX_ID_LEN - 2);
    assert!(lucky_gift::parse_file(&hot_toml(&long, 2)).is_err());
    assert!(lucky_gift::parse_file(&hot_toml(&long, 1)).is_ok());
    let text = pool_toml(
        "j",
        "shards = 3\n[pools.jackpot]\nmin_multiplier = 20\ndaily_consumption_threshold = 1000",
        GIFT,
    );
    let config = lucky_gift::parse_file(&text).unwrap().remove(0);
    let subs = config.sub_pools();
    assert_eq!(subs.len(), 3);
    for (i, sub) in subs.iter().enumerate() {
        assert_eq!(sub.id, format!("j~{i}"));
        assert_eq!(sub.shards, 1);
        assert_eq!(sub.combos, config.combos);
        assert_eq!(sub.unit_price, config.unit_price);
        assert_eq!(
            sub.jackpot.as_ref().unwrap().daily_consumption_threshold,
            334
        );
    }
    // An unsharded pool is its own only sub-pool, and its stored config
    // reads as before.
    let plain = lucky_gift::parse_file(&pool_toml("p", "", GIFT))
        .unwrap()
        .remove(0);
    assert_eq!(plain.sub_pools(), vec![plain.clone()]);
    assert!(!serde_json::to_string(&plain).unwrap().contains("shards"));
}
