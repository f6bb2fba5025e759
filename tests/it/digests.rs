//! Ids crafted to collide on part of their SHA-256 digest, sent over the
//! wire to every kind: each id of a pair is a request of its own, drawn,
//! granted, grabbed and paid as such, and each replays its own answer.
//!
//! A store that keyed requests by a few bytes of a hash would answer the
//! second id of a pair with the first id's prizes and pay them again; a
//! birthday search finds such pairs in seconds for 6 bytes and in minutes
//! for 8. prizepool names a request by 16 bytes (`answer::DIGEST_BYTES`),
//! compared in full. The pairs below were made by `examples/twin_ids.rs`
//! (the same search an attacker runs); the tests check that each pair does
//! collide before using it.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use chrono::{Duration as Days, Utc};
use common::{activity_toml, pool_toml, TestEnv};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const T: Duration = Duration::from_secs(30);

/// Ids whose SHA-256 agree on (bytes, at offset): the digest a claim is
/// keyed by.
const ID_TWINS: &[(&str, &str, usize, usize)] = &[
    ("twin-0000e93fac2ff19b", "twin-0000e63b269ce9bd", 6, 0),
    ("twin-0000befad6852103", "twin-00006ed192204e22", 6, 5),
    ("twin-0000344cdd8ccf0c", "twin-00002abe3f5948b4", 6, 10),
    ("twin-0000986eb557ad84", "twin-00009f02a7519df6", 6, 14),
    ("twin-000073cf561a6cee", "twin-0000756fb4a6d0eb", 6, 26),
    ("twin-c3991c76cbe1f5d8", "twin-1966bca43dbf1c41", 8, 0),
    ("twin-4d3b21ff2f857e87", "twin-adcd3dae3e93223b", 8, 8),
];

/// Ids whose SHA-256 of `fingerprint ‖ id` agree on 6 bytes at offset 0,
/// for the content of a draw of 10 prizes by user 7 on pool "twins": the
/// digest that draw's answer is keyed by.
const ANSWER_TWINS: (&str, &str) = ("twin-0000a822165c6017", "twin-0000d14baf15e6cd");

fn window(data: &[u8], len: usize, at: usize) -> Vec<u8> {
    Sha256::digest(data)[at..at + len].to_vec()
}

/// Every pair used here, checked to collide where it says.
fn pairs() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for &(a, b, len, at) in ID_TWINS {
        assert_ne!(a, b);
        assert_eq!(
            window(a.as_bytes(), len, at),
            window(b.as_bytes(), len, at),
            "{a} and {b} should agree on {len} bytes at {at}"
        );
        assert_ne!(Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
        out.push((a.to_owned(), b.to_owned()));
    }
    let fp = prizepool::kinds::fingerprint("draw", &[&"twins", &7, &10]);
    let (a, b) = ANSWER_TWINS;
    let salted = |id: &str| [&fp.0[..], id.as_bytes()].concat();
    assert_eq!(window(&salted(a), 6, 0), window(&salted(b), 6, 0));
    out.push((a.to_owned(), b.to_owned()));
    out
}

/// Polls `query` (one bigint) until it reads `expected` or the time is up;
/// returns what it read last.
async fn settled(env: &TestEnv, query: &str, expected: i64) -> i64 {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let (got,): (i64,) = sqlx::query_as(query).fetch_one(&env.db).await.unwrap();
        if got == expected || tokio::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn draw_as(request_id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"type": "draw", "request_id": request_id, "pool": pool, "user_id": user, "count": count})
}

#[tokio::test]
async fn twin_ids_are_two_lucky_gift_draws_each_paid_once() {
    let pairs = pairs();
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "twins",
        "",
        &[("a", &[(0, 300), (1, 300), (5, 100)])],
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let mut promised = 0;
    let mut draws = 0;
    for (a, b) in &pairs {
        let first = client
            .call("draw", &draw_as(a, "twins", 7, 10), T)
            .await
            .unwrap();
        let second = client
            .call("draw", &draw_as(b, "twins", 7, 10), T)
            .await
            .unwrap();
        assert_eq!(first["status"], "ok", "{first}");
        assert_eq!(
            second["status"], "ok",
            "{a} / {b}: the twin must draw: {second}"
        );
        assert_eq!(first["request_id"], a.as_str());
        assert_eq!(second["request_id"], b.as_str());
        assert_ne!(
            first["serial"], second["serial"],
            "two draws, two ledger entries"
        );
        promised += first["reward"].as_i64().unwrap() + second["reward"].as_i64().unwrap();
        draws += 2;
        // Each id replays its own answer.
        for (id, reply) in [(a, &first), (b, &second)] {
            let again = client
                .call("draw", &draw_as(id, "twins", 7, 10), T)
                .await
                .unwrap();
            assert_eq!(&again, reply, "{id} replays its own answer");
        }
        // And each is bound to its own content.
        let other = client
            .call("draw", &draw_as(b, "twins", 8, 10), T)
            .await
            .unwrap();
        assert_eq!(other["error"]["code"], "invalid_request", "{other}");
    }
    assert_eq!(env.wait_ledger("twins", promised).await, promised);
    let status = env.status("twins").await;
    assert_eq!(status.drawn, draws * 10, "every draw took its own prizes");
    env.stop_workers().await;
}

#[tokio::test]
async fn twin_ids_in_one_batch_are_two_entries() {
    let pairs = pairs();
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "twins",
        "",
        &[("a", &[(0, 300), (1, 300), (5, 100)])],
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let entries: Vec<Value> = pairs
        .iter()
        .flat_map(|(a, b)| [a, b])
        .map(|id| json!({"request_id": id, "pool": "twins", "user_id": 7, "count": 10}))
        .collect();
    let reply = client
        .call(
            "draw",
            &json!({"type": "draw.batch", "requests": entries}),
            T,
        )
        .await
        .unwrap();
    let results = reply["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), entries.len(), "{reply}");
    let mut promised = 0;
    let mut refs = std::collections::HashSet::new();
    for (r, e) in results.iter().zip(&entries) {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["request_id"], e["request_id"]);
        assert!(
            refs.insert(r["serial"].to_string()),
            "one ledger entry each: {r}"
        );
        promised += r["reward"].as_i64().unwrap();
    }
    assert_eq!(env.wait_ledger("twins", promised).await, promised);
    assert_eq!(env.status("twins").await.drawn, entries.len() as u64 * 10);
    // The same batch again replays every entry as it was.
    let again = client
        .call(
            "draw",
            &json!({"type": "draw.batch", "requests": entries}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(again["results"], reply["results"]);
    env.stop_workers().await;
}

#[tokio::test]
async fn twin_ids_are_two_lottery_draws_and_two_grants() {
    let pairs = pairs();
    let mut env = TestEnv::new(&[]).await;
    let now = Utc::now();
    env.load_activities(&activity_toml(
        "twin-act",
        now - Days::hours(1),
        now + Days::hours(1),
        "{ id = \"x\", weight = 1, stock = 100 }",
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    for (k, (a, b)) in pairs.iter().enumerate() {
        let user = 100 + k as i64;
        // Twin grant ids are two grants.
        let ga = client
            .call("draw", &json!({"type": "lottery.grant", "grant_id": a, "activity": "twin-act", "user_id": user, "chances": 1}), T)
            .await
            .unwrap();
        let gb = client
            .call("draw", &json!({"type": "lottery.grant", "grant_id": b, "activity": "twin-act", "user_id": user + 50, "chances": 1}), T)
            .await
            .unwrap();
        assert_eq!(
            (ga["status"].as_str(), ga["chances_left"].as_u64()),
            (Some("ok"), Some(1)),
            "{ga}"
        );
        assert_eq!(
            (gb["status"].as_str(), gb["chances_left"].as_u64()),
            (Some("ok"), Some(1)),
            "{gb}"
        );
        // One chance, twin draw ids: one draw, then no chance left.
        let first = client
            .call("draw", &draw_as(a, "twin-act", user, 1), T)
            .await
            .unwrap();
        let second = client
            .call("draw", &draw_as(b, "twin-act", user, 1), T)
            .await
            .unwrap();
        assert_eq!(first["status"], "ok", "{first}");
        assert_eq!(second["error"]["code"], "no_chances", "{a} / {b}: {second}");
        // Each replays its own answer.
        let again = client
            .call("draw", &draw_as(b, "twin-act", user, 1), T)
            .await
            .unwrap();
        assert_eq!(again, second);
        let again = client
            .call("draw", &draw_as(a, "twin-act", user, 1), T)
            .await
            .unwrap();
        assert_eq!(again, first);
    }
    // One prize per user that drew, paid once each.
    let paid = settled(
        &env,
        "SELECT count(*) FROM ledger_entries WHERE reason = 'lottery' OR entry_id LIKE 'lottery:%'",
        pairs.len() as i64,
    )
    .await;
    assert_eq!(paid, pairs.len() as i64);
    env.stop_workers().await;
}

#[tokio::test]
async fn twin_ids_are_two_red_packet_grabs() {
    let pairs = pairs();
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(1, 10_000).await;
    let created = client
        .call(
            "refill",
            &json!({"type": "redpacket.create", "packet_id": "rp-twins", "sender": 1,
                    "total": 1_000, "count": 20, "min": 1, "expires_in_s": 3600}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(created["status"], "ok", "{created}");
    let mut grabbed = 0;
    for (k, (a, b)) in pairs.iter().enumerate() {
        // Two users with twin ids: two shares.
        let (ua, ub) = (200 + k as i64, 300 + k as i64);
        let first = client
            .call("draw", &draw_as(a, "rp-twins", ua, 1), T)
            .await
            .unwrap();
        let second = client
            .call("draw", &draw_as(b, "rp-twins", ub, 1), T)
            .await
            .unwrap();
        assert_eq!(first["status"], "ok", "{first}");
        assert_eq!(second["status"], "ok", "{a} / {b}: {second}");
        assert_ne!(first["prizes"], second["prizes"], "two shares");
        grabbed += first["reward"].as_i64().unwrap() + second["reward"].as_i64().unwrap();
        let again = client
            .call("draw", &draw_as(b, "rp-twins", ub, 1), T)
            .await
            .unwrap();
        assert_eq!(again, second);
    }
    // What the replies promised is what the grabbers hold.
    let held = settled(
        &env,
        "SELECT coalesce(sum(balance), 0)::bigint FROM balances WHERE account >= 200 AND asset = 'coin'",
        grabbed,
    )
    .await;
    assert_eq!(held, grabbed);
    env.stop_workers().await;
}

#[tokio::test]
async fn a_retry_under_another_result_ttl_replays_its_answer() {
    let mut env = TestEnv::new(&[("RESULT_TTL_S", "400000")]).await;
    env.load(&pool_toml(
        "ttl",
        "",
        &[("a", &[(0, 300), (1, 300), (5, 100)])],
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let mut first = Vec::new();
    for i in 0..20 {
        let reply = client
            .call("draw", &draw_as(&format!("ttl-{i}"), "ttl", i, 10), T)
            .await
            .unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        first.push(reply);
    }
    env.stop_workers().await;
    // The fleet restarts with a shorter TTL: every answer is still found.
    let mut shorter = env.sharing(|c| c.result_ttl = Duration::from_secs(86_400));
    shorter.start_fleet().await;
    for (i, reply) in first.iter().enumerate() {
        let again = client
            .call(
                "draw",
                &draw_as(&format!("ttl-{i}"), "ttl", i as i64, 10),
                T,
            )
            .await
            .unwrap();
        assert_eq!(&again, reply, "ttl-{i} under RESULT_TTL_S=86400");
    }
    // And one more draw, then back to the longer TTL beside it (a rollout
    // with two values): each finds what the other stored.
    let late = client
        .call("draw", &draw_as("ttl-late", "ttl", 99, 10), T)
        .await
        .unwrap();
    assert_eq!(late["status"], "ok", "{late}");
    let mut longer = env.sharing(|c| c.result_ttl = Duration::from_secs(400_000));
    longer.start_draw_worker().await;
    for _ in 0..6 {
        let again = client
            .call("draw", &draw_as("ttl-late", "ttl", 99, 10), T)
            .await
            .unwrap();
        assert_eq!(again, late);
    }
    let promised: i64 = first
        .iter()
        .chain([&late])
        .map(|r| r["reward"].as_i64().unwrap())
        .sum();
    assert_eq!(env.wait_ledger("ttl", promised).await, promised);
    assert_eq!(env.status("ttl").await.drawn, 21 * 10);
    longer.stop_workers().await;
    shorter.stop_workers().await;
}
