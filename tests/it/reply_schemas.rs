//! Every reply the fleet sends fits the published schema of its type, with
//! no field the schema does not name: a fleet answers each kind of request
//! in each way it can (awards of every kind, every business refusal, bad
//! input of every sort, batches with shortened entries, settle results),
//! and every reply and event received over the wire is checked against
//! `docs/schema/<type>.json` closed to unknown fields. The published reply
//! schemas stay open (consumers must ignore fields a later version adds,
//! docs/protocol.md); closing them here checks that they name every field
//! this version sends. And every request the contract calls valid fits its
//! request schema, as the workers read it.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    time::Duration,
};

use chrono::{Duration as Days, Utc};
use common::{activity_toml, pool_toml, raw::Raw, TestEnv};
use futures_util::StreamExt;
use prizepool::messages::{
    decode_envelope, decode_typed, DrawQueueMessage, RedPacketCreate, SettleMessage,
    MAX_MESSAGE_BYTES,
};
use serde_json::{json, Value};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `schema` with `"additionalProperties": false` on every object schema
/// that lists its properties and says nothing of others. An `if` is left
/// as it is: it only tests a field, and closing it would change its answer.
fn closed(schema: &Value) -> Value {
    match schema {
        Value::Object(map) => {
            let mut out = serde_json::Map::new();
            for (k, v) in map {
                let v = if k == "if" || k == "const" || k == "default" || k == "examples" {
                    v.clone()
                } else {
                    closed(v)
                };
                out.insert(k.clone(), v);
            }
            if out.contains_key("properties") && !out.contains_key("additionalProperties") {
                out.insert("additionalProperties".into(), Value::Bool(false));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(closed).collect()),
        other => other.clone(),
    }
}

/// The published schema of message type `name`, as published and closed.
fn schemas(name: &str) -> [(&'static str, jsonschema::Validator); 2] {
    let path = Path::new(ROOT).join(format!("docs/schema/{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (a reply of a type without a schema)",
            path.display()
        )
    });
    let schema: Value = serde_json::from_str(&text).unwrap();
    [
        ("", jsonschema::draft202012::new(&schema).unwrap()),
        (
            " (closed)",
            jsonschema::draft202012::new(&closed(&schema)).unwrap(),
        ),
    ]
}

/// The schema violations of `message` (by its `type`), each a line: it
/// must fit the schema as published (as a consumer validates it) and
/// closed to unknown fields.
pub(crate) fn violations(message: &Value) -> Vec<String> {
    let Some(kind) = message["type"].as_str() else {
        return vec![format!("no string type: {message}")];
    };
    schemas(kind)
        .iter()
        .flat_map(|(how, schema)| {
            schema
                .iter_errors(message)
                .map(move |e| format!("{kind}{how}: {e} at {}", e.instance_path()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A publisher that asks one request at a time and keeps every reply.
struct Asker {
    raw: Raw,
    n: usize,
    /// What was asked, by correlation id, for failure messages.
    asked: BTreeMap<String, String>,
}

impl Asker {
    async fn new(env: &TestEnv) -> Self {
        Self {
            raw: Raw::new(env).await,
            n: 0,
            asked: BTreeMap::new(),
        }
    }

    /// Publishes `body` under `routing_key` and waits for its reply.
    async fn ask_raw(&mut self, routing_key: &str, body: &[u8]) -> Value {
        self.n += 1;
        let corr = format!("c-{:04}", self.n);
        let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        self.asked.insert(corr.clone(), shown);
        self.raw
            .publish(routing_key, body, self.raw.props(&corr))
            .await;
        self.raw.reply(&corr).await
    }

    async fn ask(&mut self, routing_key: &str, body: &Value) -> Value {
        self.ask_raw(routing_key, &serde_json::to_vec(body).unwrap())
            .await
    }
}

fn draw(id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"type": "draw", "request_id": id, "pool": pool, "user_id": user, "count": count})
}

fn entry(id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"request_id": id, "pool": pool, "user_id": user, "count": count})
}

fn create(packet: &str, sender: i64, total: i64, count: i64, expires_in_s: i64) -> Value {
    json!({"type": "redpacket.create", "packet_id": packet, "sender": sender, "total": total,
        "count": count, "min": 1, "expires_in_s": expires_in_s})
}

fn settle(id: &str, account: i64, amount: i64, reason: &str) -> Value {
    json!({"type": "settle", "entry_id": id, "account": account, "asset": "coin",
        "amount": amount, "reason": reason})
}

fn grant(id: &str, activity: &str, user: i64, chances: u32) -> Value {
    json!({"type": "lottery.grant", "grant_id": id, "activity": activity, "user_id": user, "chances": chances})
}

/// How a reply (or a batch entry) went: `ok`, or its error code, with
/// `+omitted` for a shortened batch entry.
fn verdict(reply: &Value) -> String {
    let mut v = match reply["error"]["code"].as_str() {
        Some(code) => code.to_owned(),
        None => reply["status"].as_str().unwrap_or("?").to_owned(),
    };
    if reply["omitted"] == true {
        v.push_str("+omitted");
    }
    v
}

#[tokio::test]
async fn every_reply_and_event_fits_its_published_schema_with_no_unknown_field() {
    let mut env = TestEnv::new(&[("SHORT_POOL_WAIT_MS", "300")]).await;
    let now = Utc::now();
    env.load(&pool_toml(
        "gift",
        "max_count = 1000",
        &[
            ("c1", &[(0, 900), (2, 90), (10, 10)]),
            ("c2", &[(0, 500), (5, 500)]),
        ],
    ))
    .await;
    // Ten prizes and no refill worker yet: a draw of 20 stays short.
    env.load(&pool_toml(
        "short",
        "refill_at = 1.0\nmax_count = 100",
        &[("a", &[(0, 10)])],
    ))
    .await;
    // Jackpots gated for good: they are parked and named in `held_back`.
    env.load(&pool_toml(
        "gated",
        "max_count = 100\njackpot = { min_multiplier = 100, daily_consumption_threshold = 4503599627370496 }",
        &[("j", &[(0, 200), (100, 20)])],
    ))
    .await;
    env.load(&pool_toml(
        "split",
        "shards = 2\nmax_count = 100",
        &[("s", &[(0, 200), (3, 200)])],
    ))
    .await;
    // Prizes with 64-byte combo ids: ten draws of 100 take a batch reply
    // past 64 KiB, so some of its entries are shortened.
    let long_a = "a".repeat(64);
    let long_b = "b".repeat(64);
    env.load(&pool_toml(
        "long",
        "max_count = 100",
        &[
            (&long_a, &[(0, 1500), (1, 500)]),
            (&long_b, &[(0, 1000), (2, 1000)]),
        ],
    ))
    .await;
    for (id, starts, ends, prizes) in [
        (
            "open",
            now - Days::days(1),
            now + Days::days(1),
            "{ id = \"ipad\", weight = 1, stock = 5 }",
        ),
        (
            "future",
            now + Days::days(1),
            now + Days::days(2),
            "{ id = \"ipad\", weight = 1, stock = 5 }",
        ),
        (
            "past",
            now - Days::days(2),
            now - Days::days(1),
            "{ id = \"ipad\", weight = 1, stock = 5 }",
        ),
    ] {
        env.load_activities(&activity_toml(id, starts, ends, prizes))
            .await;
    }
    // An activity without consolation whose one prize goes first.
    env.load_activities(&format!(
        "[[activities]]\nid = \"scarce\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\nprizes = [ {{ id = \"pen\", weight = 1, stock = 1 }} ]\n",
        (now - Days::days(1)).to_rfc3339(),
        (now + Days::days(1)).to_rfc3339()
    ))
    .await;
    env.fund(7, 1_000_000).await;
    let (_events_conn, mut events) = env.listen("#").await;
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    let mut asker = Asker::new(&env).await;
    let mut replies: Vec<Value> = Vec::new();

    // A short pool, before any refill worker runs.
    replies.push(asker.ask("draw", &draw("d-short", "short", 1, 20)).await);
    env.start_refill_worker().await;

    // Lucky gifts: listed, compact, sharded, with parked jackpots; refused.
    for (id, pool, user, count) in [
        ("d-small", "gift", 1, 5),
        ("d-big", "gift", 2, 150),
        ("d-split", "split", 3, 4),
        ("d-gated-1", "gated", 4, 60),
        ("d-gated-2", "gated", 4, 60),
        ("d-nowhere", "nowhere", 5, 1),
    ] {
        replies.push(asker.ask("draw", &draw(id, pool, user, count)).await);
    }
    // The same draw again replays its answer.
    replies.push(asker.ask("draw", &draw("d-small", "gift", 1, 5)).await);

    // Red packets: created, refused, grabbed, grabbed twice, sold out, closed.
    for body in [
        create("rp-1", 7, 1_000, 1, 3600),
        create("rp-late", 7, 1_000, 10, 1),
        create("rp-broke", 8, 1_000, 10, 3600),
        json!({"type": "redpacket.create", "sender": 7, "total": 5, "count": 1, "expires_in_s": 60}),
        json!({"type": "redpacket.create", "packet_id": "rp-x", "sender": 7, "total": 5, "count": 9, "expires_in_s": 60}),
    ] {
        replies.push(asker.ask("refill", &body).await);
    }
    for (id, pool, user) in [
        ("g-1", "rp-1", 10),
        ("g-2", "rp-1", 10),
        ("g-3", "rp-1", 11),
    ] {
        replies.push(asker.ask("draw", &draw(id, pool, user, 1)).await);
    }
    // An expiry sent before its time closes nothing.
    replies.push(
        asker
            .ask(
                "refill",
                &json!({"type": "redpacket.expire", "packet_id": "rp-1"}),
            )
            .await,
    );
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    replies.push(asker.ask("draw", &draw("g-late", "rp-late", 12, 1)).await);

    // Lottery: grants, an award, and every refusal.
    replies.push(asker.ask("draw", &grant("gr-1", "open", 20, 2)).await);
    replies.push(asker.ask("draw", &grant("gr-2", "nowhere", 20, 2)).await);
    replies.push(asker.ask("draw", &grant("gr-3", "scarce", 21, 3)).await);
    replies.push(asker.ask("draw", &grant("gr-4", "future", 22, 1)).await);
    replies.push(asker.ask("draw", &grant("gr-5", "past", 22, 1)).await);
    for (id, pool, user) in [
        ("l-1", "open", 20),
        ("l-2", "open", 23),
        ("l-3", "future", 22),
        ("l-4", "past", 22),
        ("l-5", "scarce", 21),
        ("l-6", "scarce", 21),
    ] {
        replies.push(asker.ask("draw", &draw(id, pool, user, 1)).await);
    }

    // Settlements: a top-up, a refused debit, bad input, batches.
    replies.push(
        asker
            .ask("settle", &settle("top-1", 30, 500, "topup"))
            .await,
    );
    replies.push(
        asker
            .ask("settle", &settle("wd-1", 31, -500, "withdrawal"))
            .await,
    );
    replies.push(asker.ask("settle", &settle("bad-1", 31, 500, "gift")).await);
    replies.push(
        asker
            .ask(
                "settle",
                &json!({"type": "settle.batch", "entries": [
                    settle("top-2", 30, 5, "topup"),
                    settle("wd-2", 32, -5, "withdrawal"),
                    settle("bad-2", 30, -5, "topup"),
                    {"type": "settle", "account": 3},
                ]}),
            )
            .await,
    );
    replies.push(
        asker
            .ask("settle", &json!({"type": "settle.batch", "entries": []}))
            .await,
    );
    // An internal message: a refill nothing asked for is refused.
    replies.push(
        asker
            .ask(
                "refill",
                &json!({"type": "refill", "pool": "gift", "trigger": 40}),
            )
            .await,
    );

    // Bad input of every sort on the draw queue.
    let big = format!(
        r#"{{"type":"draw","request_id":"d-huge","pool":"gift","user_id":1,"count":1,"pad":"{}"}}"#,
        "x".repeat(MAX_MESSAGE_BYTES)
    );
    let bad: Vec<Vec<u8>> = vec![
        b"not json".to_vec(),
        br#"["draw"]"#.to_vec(),
        br#"{"request_id":"d-notype","pool":"gift","user_id":1,"count":1}"#.to_vec(),
        br#"{"type":7,"request_id":"d-numtype","pool":"gift","user_id":1}"#.to_vec(),
        br#"{"type":"teleport","packet_id":"rp-9","pool":"gift","user_id":1}"#.to_vec(),
        br#"{"type":"draw","pool":"gift","user_id":42,"count":1}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-badtype","pool":"gift","user_id":"one","count":1}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-zero","pool":"gift","user_id":1,"count":0}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-many","pool":"gift","user_id":1,"count":1001}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-extra","pool":"gift","user_id":1,"count":1,"x":1}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-{key}","pool":"gift","user_id":1,"count":1}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-many","pool":"gift","user_id":1,"count":1}"#.to_vec(),
        br#"{"type":"draw","request_id":"d-small","pool":"gift","user_id":1,"count":6}"#.to_vec(),
        br#"{"type":"draw","request_id":"l-9","pool":"open","user_id":20,"count":2}"#.to_vec(),
        br#"{"type":"lottery.grant","grant_id":"gr-9","activity":"open","user_id":1,"chances":0}"#.to_vec(),
        br#"{"type":"lottery.grant","request_id":"x","grant_id":"gr-10","activity":"open","user_id":1,"chances":1}"#.to_vec(),
        big.into_bytes(),
    ];
    for body in &bad {
        replies.push(asker.ask_raw("draw", body).await);
    }

    // Batches: a mix of kinds and of bad entries; shortened entries; one
    // refused whole.
    let mixed = json!({"type": "draw.batch", "requests": [
        entry("b-1", "gift", 40, 3),
        entry("b-2", "rp-1", 41, 1),
        {"type": "draw", "request_id": "b-3", "pool": "open", "user_id": 20, "count": 1},
        entry("b-4", "nowhere", 42, 1),
        7,
        {"type": "lottery.grant", "request_id": "b-6", "pool": "gift", "user_id": 43},
        {"request_id": "b-7", "pool": "gift", "user_id": 44},
        {"pool": "gift", "user_id": 45, "count": 1},
        entry("b-9", "gift", 46, 1001),
    ]});
    replies.push(asker.ask("draw", &mixed).await);
    let long: Vec<Value> = (0..10)
        .map(|i| entry(&format!("b-long-{i}"), "long", 50 + i, 100))
        .collect();
    replies.push(
        asker
            .ask("draw", &json!({"type": "draw.batch", "requests": long}))
            .await,
    );
    replies.push(
        asker
            .ask("draw", &json!({"type": "draw.batch", "requests": []}))
            .await,
    );

    // Every reply fits its schema, closed to unknown fields.
    let mut problems = Vec::new();
    for (corr, reply) in asker.raw.replies.lock().unwrap().iter() {
        for v in violations(reply) {
            let corr = corr.clone().unwrap_or_default();
            problems.push(format!(
                "{v}\n  asked: {}\n  reply: {reply}",
                asker.asked[&corr]
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // They covered what they are meant to: each kind of reply, each way.
    let mut seen: BTreeSet<String> = BTreeSet::new();
    for reply in &replies {
        let kind = reply["type"].as_str().unwrap_or("?");
        seen.insert(format!("{kind}:{}", verdict(reply)));
        for result in reply["results"].as_array().into_iter().flatten() {
            seen.insert(format!("{kind}/entry:{}", verdict(result)));
        }
    }
    for expected in [
        "draw_result:ok",
        "draw_result:pool_exhausted",
        "draw_result:unknown_pool",
        "draw_result:already_grabbed",
        "draw_result:sold_out",
        "draw_result:pool_closed",
        "draw_result:not_started",
        "draw_result:ended",
        "draw_result:no_chances",
        "draw_result:invalid_request",
        "grant_result:ok",
        "grant_result:unknown_pool",
        "grant_result:invalid_request",
        "redpacket_result:ok",
        "redpacket_result:insufficient_funds",
        "redpacket_result:invalid_request",
        "settle_result:ok",
        "settle_result:insufficient_funds",
        "settle_result:invalid_request",
        "refill_result:invalid_request",
        "draw_result.batch:ok",
        "draw_result.batch:invalid_request",
        "draw_result.batch/entry:ok",
        "draw_result.batch/entry:ok+omitted",
        "draw_result.batch/entry:unknown_pool",
        "draw_result.batch/entry:invalid_request",
    ] {
        assert!(seen.contains(expected), "no {expected} among {seen:?}");
    }
    let by_id = |id: &str| replies.iter().find(|r| r["request_id"] == id).unwrap();
    assert!(
        by_id("d-big")["prize_codes"].is_object(),
        "{}",
        by_id("d-big")
    );
    assert!(by_id("d-split")["shard"].is_u64(), "{}", by_id("d-split"));
    assert!(
        replies
            .iter()
            .any(|r| r["held_back_min_multiplier"].is_u64()
                && r["positions"].as_array().is_some_and(|runs| runs
                    .iter()
                    .any(|run| run["held_back"].as_u64() > Some(0)))),
        "no draw met a parked jackpot"
    );
    assert!(by_id("l-1")["pick"].is_object(), "{}", by_id("l-1"));
    let settled = &replies
        .iter()
        .find(|r| r["type"] == "settle_result" && r["entries"].is_u64())
        .unwrap();
    assert_eq!(settled["refused"].as_array().unwrap().len(), 3, "{settled}");

    // Invalid requests repeat the pool and user they named, like the other
    // refusals of their type; a draw without an id is answered without one.
    let anonymous = replies
        .iter()
        .find(|r| r["type"] == "draw_result" && r["user_id"] == 42 && r.get("request_id").is_none())
        .expect("the reply to a draw without request_id");
    assert_eq!(
        (
            &anonymous["status"],
            &anonymous["pool"],
            &anonymous["error"]["code"]
        ),
        (
            &json!("rejected"),
            &json!("gift"),
            &json!("invalid_request")
        ),
        "{anonymous}"
    );
    for id in [
        "d-badtype",
        "d-zero",
        "d-many",
        "d-extra",
        "d-huge",
        "d-notype",
    ] {
        let r = by_id(id);
        assert_eq!(
            (&r["error"]["code"], &r["pool"]),
            (&json!("invalid_request"), &json!("gift")),
            "{r}"
        );
        assert_eq!(
            r["user_id"],
            if id == "d-badtype" {
                Value::Null
            } else {
                json!(1)
            },
            "{r}"
        );
    }
    // A grant's refusal repeats its grant id, never another id field.
    let grant_bad = replies.iter().find(|r| r["grant_id"] == "gr-10").unwrap();
    assert!(grant_bad.get("request_id").is_none(), "{grant_bad}");
    // Every batch reply says how the batch went; its entries are answered
    // in order, bad ones with what they named.
    let batches: Vec<&Value> = replies
        .iter()
        .filter(|r| r["type"] == "draw_result.batch")
        .collect();
    assert!(
        batches.iter().all(|b| b["status"].is_string()),
        "{batches:?}"
    );
    let entries = batches[0]["results"].as_array().unwrap();
    assert_eq!(entries.len(), 9);
    for (i, user) in [(5, 43), (6, 44), (7, 45), (8, 46)] {
        assert_eq!(
            (
                &entries[i]["error"]["code"],
                &entries[i]["pool"],
                &entries[i]["user_id"]
            ),
            (&json!("invalid_request"), &json!("gift"), &json!(user)),
            "entry {i}: {}",
            entries[i]
        );
    }

    // Every event published meanwhile fits its schema too.
    let mut events_seen = BTreeSet::new();
    let mut problems = Vec::new();
    while let Ok(Some(Ok(d))) =
        tokio::time::timeout(Duration::from_millis(500), events.next()).await
    {
        let event: Value = serde_json::from_slice(&d.data).unwrap();
        events_seen.insert(event["type"].as_str().unwrap_or("?").to_owned());
        problems.extend(
            violations(&event)
                .into_iter()
                .map(|v| format!("{v}\n  event: {event}")),
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    for kind in ["pool.refilled", "redpacket.created", "redpacket.closed"] {
        assert!(
            events_seen.contains(kind),
            "no {kind} among {events_seen:?}"
        );
    }
    assert!(
        events_seen.contains("draw.completed") || events_seen.contains("draw.completed.batch"),
        "no draw.completed among {events_seen:?}"
    );
    asker.raw.close().await;
    env.stop_workers().await;
}

/// Requests the contract calls valid, at the edges of their bounds.
fn valid_requests() -> Vec<Value> {
    let id = |fill: char| -> String {
        // Every character an id may hold, `"` and `\` included, to 128 bytes.
        let all: String = (b'!'..=b'~')
            .map(char::from)
            .filter(|c| *c != '{' && *c != '}')
            .collect();
        let mut s = format!("{all}{}", fill.to_string().repeat(128));
        s.truncate(128);
        s
    };
    let entry_id = "e".repeat(320);
    let big_user = i64::MAX;
    let max_amount = (1i64 << 53) - 1;
    let mut batch: Vec<Value> = (0..100)
        .map(|i| json!({"request_id": format!("01JD{i:0>22}"), "pool": "gift-1001", "user_id": i, "count": 1}))
        .collect();
    batch.push(json!({"type": "draw", "request_id": "01JF", "pool": "spring-2027", "user_id": 44, "count": 1}));
    vec![
        json!({"type": "draw", "request_id": "01JD0000000000000000000000", "pool": "gift-1001", "user_id": 42, "count": 100}),
        json!({"type": "draw", "request_id": id('r'), "pool": id('p'), "user_id": big_user, "count": 10_000}),
        json!({"type": "draw", "request_id": "r", "pool": "rp-01JD", "user_id": 0, "count": 1}),
        json!({"type": "draw.batch", "requests": batch}),
        json!({"type": "draw.batch", "requests": [{"request_id": "x", "pool": "p", "user_id": 1, "count": 1}]}),
        json!({"type": "lottery.grant", "grant_id": "g-01JG", "activity": "spring-2027", "user_id": 42, "chances": 3}),
        json!({"type": "lottery.grant", "grant_id": id('g'), "activity": id('a'), "user_id": big_user, "chances": 1_000_000}),
        json!({"type": "redpacket.create", "packet_id": "rp-01JD", "sender": 7, "total": 10_000, "count": 10, "min": 1, "expires_in_s": 86_400}),
        json!({"type": "redpacket.create", "packet_id": id('k'), "sender": big_user, "total": 1_000_000_000_000i64, "count": 5_000, "expires_in_s": 2_592_000, "asset": "gem"}),
        json!({"type": "redpacket.create", "packet_id": "rp-1", "sender": 0, "total": 1, "count": 1, "min": 0, "expires_in_s": 1}),
        json!({"type": "settle", "entry_id": "topup:42:01JD", "account": 42, "asset": "coin", "amount": 6_000, "reason": "topup", "ref": {"order": "A-1"}}),
        json!({"type": "settle", "entry_id": entry_id, "account": big_user, "asset": "coin", "amount": max_amount, "reason": "topup"}),
        json!({"type": "settle", "entry_id": "wd-1", "account": 0, "asset": "coin", "amount": -max_amount, "reason": "withdrawal", "ref": null}),
        json!({"type": "settle", "entry_id": "buy-1", "account": 5, "asset": "item:coupon-5", "amount": -1, "reason": "purchase"}),
        json!({"type": "settle.batch", "entries": [
            {"type": "settle", "entry_id": "t-1", "account": 1, "asset": "coin", "amount": 5, "reason": "topup"},
            {"type": "settle", "entry_id": "t-2", "account": 2, "asset": "coin", "amount": 7, "reason": "topup", "ref": {}},
        ]}),
    ]
}

/// Whether the worker of `message`'s queue takes it as valid.
fn workers_accept(message: &Value) -> Result<(), String> {
    let body = serde_json::to_vec(message).unwrap();
    assert!(body.len() <= MAX_MESSAGE_BYTES);
    let value = decode_envelope(&body).map_err(|e| e.message)?;
    match value["type"].as_str().unwrap() {
        "draw" | "draw.batch" | "lottery.grant" => {
            match decode_typed::<DrawQueueMessage>(&value).map_err(|e| e.message)? {
                DrawQueueMessage::Draw(d) => d.validate(),
                DrawQueueMessage::Grant(g) => g.validate(),
                DrawQueueMessage::Batch(b) => b
                    .validate(1_000)
                    .and_then(|()| (0..b.requests.len()).try_for_each(|i| b.entry(i)?.validate())),
            }
            .map_err(|e| e.message)
        }
        "redpacket.create" => {
            let mut fields = value.clone();
            fields.as_object_mut().unwrap().remove("type");
            serde_json::from_value::<RedPacketCreate>(fields)
                .map(drop)
                .map_err(|e| e.to_string())
        }
        "settle" | "settle.batch" => match SettleMessage::decode(&value).map_err(|e| e.message)? {
            SettleMessage::One(_) => Ok(()),
            SettleMessage::Batch(entries) => entries
                .into_iter()
                .try_for_each(|e| e.map(drop).map_err(|bad| format!("{bad:?}"))),
        },
        other => Err(format!("no request of type {other}")),
    }
}

#[test]
fn every_request_the_contract_calls_valid_fits_its_request_schema() {
    for request in valid_requests() {
        let shown = &request.to_string()[..request.to_string().len().min(300)];
        workers_accept(&request).unwrap_or_else(|e| panic!("the workers refuse {shown}: {e}"));
        let problems = violations(&request);
        assert!(problems.is_empty(), "{shown}:\n{}", problems.join("\n"));
    }
}

/// Every `(path, value)` of `doc` whose key is `key`.
fn find_key<'a>(doc: &'a Value, key: &str, path: &str, out: &mut Vec<(String, &'a Value)>) {
    match doc {
        Value::Object(map) => {
            for (k, v) in map {
                let here = format!("{path}/{k}");
                if k == key {
                    out.push((here.clone(), v));
                }
                find_key(v, key, &here, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                find_key(v, key, &format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// The AsyncAPI document names the fleet's vhost as the server's variable
/// (the fleet runs in whichever vhost `AMQP_URL` names), and locates no
/// correlation id in the application headers: the AMQP `correlation_id` is
/// a message property, which AsyncAPI's `correlationId` cannot locate.
#[test]
fn the_asyncapi_document_pins_no_vhost_and_puts_no_correlation_id_in_headers() {
    let text = std::fs::read_to_string(Path::new(ROOT).join("docs/asyncapi.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let mut found = Vec::new();
    find_key(&doc, "vhost", "", &mut found);
    let pinned: Vec<_> = found
        .iter()
        .filter(|(path, _)| path.contains("/bindings/"))
        .collect();
    assert!(pinned.is_empty(), "vhost pinned at {pinned:?}");
    let server = &doc["servers"]["rabbitmq"];
    assert!(
        server["url"].as_str().unwrap().contains("{vhost}")
            && server["variables"]["vhost"].is_object(),
        "{server}"
    );
    let mut found = Vec::new();
    find_key(&doc, "correlationId", "", &mut found);
    assert!(found.is_empty(), "correlationId at {found:?}");
    let reply = &doc["components"]["messages"]["draw_result"]["description"];
    assert!(
        reply.as_str().unwrap().contains("correlation_id"),
        "{reply}"
    );
}
