//! `prizepool dlq` as an operator uses it: listings and dry runs leave a
//! dead-letter queue exactly as it was (order and content), a replay moves
//! what the listing showed in the order it showed it, and dead letters can
//! be filtered, exported, replayed and dropped one by one.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::TestEnv;
use lapin::{
    options::{BasicGetOptions, BasicPublishOptions},
    types::{AMQPValue, FieldTable},
    BasicProperties,
};
use prizepool::amqp;
use serde_json::Value;

/// More than 32: a quorum queue gives back more than 32 messages at once in
/// hash order, which is what reordered the DLQ before.
const LETTERS: usize = 90;

/// Runs the CLI, expects success, parses its stdout as one JSON object.
async fn json(env: &TestEnv, args: &[&str]) -> Value {
    let out = env.cli(args).await;
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v.is_object(), "{args:?} printed {v}");
    v
}

/// The bodies of a report's letters, in order.
fn bodies(report: &Value) -> Vec<String> {
    report["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["body"].as_str().unwrap().to_owned())
        .collect()
}

/// Dead-letters `LETTERS` distinct messages into `prizepool.draw.dlq` as
/// the fleet does (reason headers, dead-lettering time, reply address):
/// draws on pools `a` and `b`, a `lottery.grant` every fifth, and the
/// first third dead-lettered two hours ago. Returns their bodies in order.
async fn dead_letter_some(env: &TestEnv) -> Vec<String> {
    let (conn, ch) = env.confirm_channel("t").await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut sent = Vec::new();
    for i in 0..LETTERS {
        let body = if i % 5 == 4 {
            format!(
                r#"{{"type":"lottery.grant","grant_id":"g{i}","activity":"spring","user_id":{i},"chances":1}}"#
            )
        } else {
            let pool = if i % 2 == 0 { "a" } else { "b" };
            format!(
                r#"{{"type":"draw","request_id":"r{i}","pool":"{pool}","user_id":{i},"count":1}}"#
            )
        };
        let (code, reason) = if i % 3 == 0 {
            ("internal", "the handler panicked: boom")
        } else {
            ("invalid_request", "count out of range")
        };
        let mut headers = FieldTable::default();
        headers.insert(
            amqp::ERROR_CODE_HEADER.into(),
            AMQPValue::LongString(code.into()),
        );
        headers.insert(
            amqp::ERROR_HEADER.into(),
            AMQPValue::LongString(reason.into()),
        );
        let at = if i < LETTERS / 3 { now - 7_200 } else { now };
        headers.insert(amqp::DEAD_AT_HEADER.into(), AMQPValue::Timestamp(at));
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_reply_to("upstream.replies".into())
            .with_correlation_id(format!("c{i}").into())
            .with_headers(headers);
        let confirm = ch
            .basic_publish(
                amqp::DLX.into(),
                amqp::DRAW.queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body.as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack() && confirm.take_message().is_none());
        sent.push(body);
    }
    let _ = conn.close(200, "".into()).await;
    env.wait_depth(amqp::DRAW.dlq, LETTERS as u32).await;
    sent
}

/// Takes every message now in `queue`, acking each: (body, properties).
async fn drain(env: &TestEnv, queue: &str) -> Vec<(String, BasicProperties)> {
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let d = m.delivery;
        out.push((String::from_utf8(d.data).unwrap(), d.properties));
    }
    let _ = conn.close(200, "".into()).await;
    out
}

#[tokio::test]
async fn two_listings_and_a_dry_run_agree_and_the_replay_moves_exactly_that_in_order() {
    let env = TestEnv::new(&[]).await;
    let sent = dead_letter_some(&env).await;
    let all = "100000";
    let first = json(
        &env,
        &["dlq", "list", "prizepool.draw", "--limit", all, "--json"],
    )
    .await;
    let second = json(
        &env,
        &["dlq", "list", "prizepool.draw", "--limit", all, "--json"],
    )
    .await;
    // Identical, ids and positions included, and in the order dead-lettered.
    assert_eq!(bodies(&first), sent);
    assert_eq!(bodies(&second), sent);
    assert_eq!(first["messages"], second["messages"]);
    assert_eq!(first["found"], LETTERS);
    let dry = json(
        &env,
        &["dlq", "replay", "prizepool.draw", "--dry-run", "--json"],
    )
    .await;
    assert_eq!(dry["messages"], first["messages"]);
    assert_eq!(
        (dry["moved"].as_u64(), dry["dry_run"].as_bool()),
        (Some(0), Some(true))
    );
    let third = json(
        &env,
        &["dlq", "list", "prizepool.draw", "--limit", all, "--json"],
    )
    .await;
    assert_eq!(third["messages"], first["messages"]);
    assert_eq!(env.queue_depth(amqp::DRAW.dlq).await as usize, LETTERS);

    let replay = json(&env, &["dlq", "replay", "prizepool.draw", "--json"]).await;
    assert_eq!(replay["moved"], LETTERS);
    assert_eq!(replay["messages"], first["messages"]);
    assert_eq!(env.queue_depth(amqp::DRAW.dlq).await, 0);
    // The work queue got them in the listing's order, with their reply
    // address and reason headers, and without the broker's delivery count
    // that the listings' returns added on the DLQ.
    let moved = drain(&env, amqp::DRAW.queue).await;
    assert_eq!(
        moved.iter().map(|(b, _)| b.clone()).collect::<Vec<_>>(),
        sent
    );
    for (i, (_, props)) in moved.iter().enumerate() {
        assert_eq!(
            props.correlation_id().as_ref().unwrap().as_str(),
            format!("c{i}")
        );
        let headers = props.headers().as_ref().unwrap().inner();
        assert!(headers.contains_key(amqp::ERROR_HEADER));
        // The work queue counts its own deliveries afresh (0 on this first
        // one); the DLQ's count, 4 after three listings and a dry run, is gone.
        let count = headers.get("x-delivery-count");
        assert!(
            matches!(count, None | Some(AMQPValue::LongLongInt(0))),
            "{headers:?}"
        );
    }
}

#[tokio::test]
async fn dead_letters_are_filtered_exported_replayed_and_dropped_one_by_one() {
    let env = TestEnv::new(&[]).await;
    let sent = dead_letter_some(&env).await;
    let list = |args: &'static [&'static str]| {
        let mut full = vec![
            "dlq",
            "list",
            "prizepool.draw.dlq",
            "--limit",
            "100000",
            "--json",
        ];
        full.extend_from_slice(args);
        full
    };
    let everything = json(&env, &list(&[])).await;
    let letters = everything["messages"].as_array().unwrap().clone();
    let expect = |keep: &dyn Fn(usize) -> bool| -> Vec<String> {
        sent.iter()
            .enumerate()
            .filter(|(i, _)| keep(*i))
            .map(|(_, b)| b.clone())
            .collect()
    };
    // Each filter, and two at once.
    let grants = json(&env, &list(&["--type", "lottery.grant"])).await;
    assert_eq!(bodies(&grants), expect(&|i| i % 5 == 4));
    assert_eq!(grants["matched"], LETTERS / 5);
    let pool_a = json(&env, &list(&["--pool", "a"])).await;
    assert_eq!(bodies(&pool_a), expect(&|i| i % 5 != 4 && i % 2 == 0));
    let internal = json(&env, &list(&["--reason", "INTERNAL"])).await;
    assert_eq!(bodies(&internal), expect(&|i| i % 3 == 0));
    let old = json(&env, &list(&["--older-than", "1h"])).await;
    assert_eq!(bodies(&old), expect(&|i| i < LETTERS / 3));
    let new_internal = json(&env, &list(&["--newer-than", "1h", "--reason", "panicked"])).await;
    assert_eq!(
        bodies(&new_internal),
        expect(&|i| i >= LETTERS / 3 && i % 3 == 0)
    );
    // A limit shows the first ones and still counts every match.
    let two = json(
        &env,
        &[
            "dlq",
            "list",
            "prizepool.draw",
            "--pool",
            "b",
            "--limit",
            "2",
            "--json",
        ],
    )
    .await;
    assert_eq!(bodies(&two), expect(&|i| i % 5 != 4 && i % 2 == 1)[..2]);
    assert_eq!(two["matched"], expect(&|i| i % 5 != 4 && i % 2 == 1).len());

    // Export: one JSON object per line, whole body and properties, moving nothing.
    let out = env
        .cli(&["dlq", "export", "prizepool.draw", "--type", "lottery.grant"])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), LETTERS / 5);
    assert_eq!(lines[0]["payload"]["grant_id"], "g4");
    assert_eq!(lines[0]["properties"]["correlation_id"], "c4");
    assert_eq!(
        lines[0]["properties"]["headers"][amqp::ERROR_CODE_HEADER],
        "invalid_request"
    );
    assert!(lines[0]["properties"]["headers"]
        .get("x-delivery-count")
        .is_none());
    assert_eq!(lines[0]["queue"], "prizepool.draw");

    // Drop needs a choice; then drops exactly the chosen one.
    let out = env.cli(&["dlq", "drop", "prizepool.draw"]).await;
    assert!(!out.status.success());
    let victim = letters[7]["id"].as_str().unwrap();
    let dropped = json(
        &env,
        &["dlq", "drop", "prizepool.draw", "--id", victim, "--json"],
    )
    .await;
    assert_eq!(dropped["dropped"], 1);
    assert_eq!(dropped["messages"][0]["body"], sent[7].as_str());
    // Replay the old internal ones only.
    let replayed = json(
        &env,
        &[
            "dlq",
            "replay",
            "prizepool.draw",
            "--older-than",
            "1h",
            "--reason",
            "internal",
            "--json",
        ],
    )
    .await;
    let moved = expect(&|i| i < LETTERS / 3 && i % 3 == 0);
    assert_eq!(bodies(&replayed), moved);
    let in_work_queue: Vec<String> = drain(&env, amqp::DRAW.queue)
        .await
        .into_iter()
        .map(|(b, _)| b)
        .collect();
    assert_eq!(in_work_queue, moved);
    // What stays is the rest, in its order, ids unchanged.
    let rest = json(&env, &list(&[])).await;
    let kept: Vec<&Value> = letters
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 7 && !(*i < LETTERS / 3 && *i % 3 == 0))
        .map(|(_, l)| l)
        .collect();
    let rest_letters = rest["messages"].as_array().unwrap();
    assert_eq!(rest_letters.len(), kept.len());
    for (now, before) in rest_letters.iter().zip(kept) {
        assert_eq!((&now["id"], &now["body"]), (&before["id"], &before["body"]));
    }
}
