//! The batching draw client (`prizepool::client`) against a responder of the
//! test's own on the real broker: the counterpart the client talks to,
//! answering `draw` and `draw.batch` as the protocol says, and recording
//! every message it got. Batching by size and by linger, retries with the
//! same request id, timeouts, a lost connection and a refused batch.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use common::TestEnv;
use futures_util::StreamExt;
use lapin::{
    options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions},
    types::FieldTable,
    BasicProperties,
};
use prizepool::{
    client::{draw_request, Client, ClientConfig, ClientError},
    messages::Status,
};
use serde_json::{json, Value};

/// A message the responder got: its type and the request ids it carried.
#[derive(Clone, Debug)]
struct Seen {
    kind: String,
    ids: Vec<String>,
}

/// What the responder does with a message: answer it, or leave it
/// unanswered (a lost reply), or refuse the envelope.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    Answer,
    Ignore,
    RejectEnvelope,
}

/// The answer to one entry: `ok`, with a reward of `user_id × count`.
fn result_of(entry: &Value) -> Value {
    let reward = entry["user_id"].as_i64().unwrap() * entry["count"].as_i64().unwrap();
    json!({"type":"draw_result","request_id":entry["request_id"],"status":"ok",
        "pool":entry["pool"],"user_id":entry["user_id"],
        "prizes":[{"multiplier":1,"combo":"c1"}],"total_multiplier":1,
        "reward":reward,"asset":"coin"})
}

/// Consumes `prizepool.draw` in `env`'s vhost and deals with each message
/// as `act` says (given the message and how many times each of its ids was
/// seen before).
async fn responder(
    env: &TestEnv,
    act: impl Fn(&Seen, usize) -> Act + Send + 'static,
) -> Arc<Mutex<Vec<Seen>>> {
    let conn = prizepool::amqp::connect(&env.config.amqp_url, "test-responder")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    prizepool::amqp::declare_topology_for(&channel, &env.config)
        .await
        .unwrap();
    let mut deliveries = channel
        .basic_consume(
            prizepool::amqp::DRAW.queue.into(),
            "responder".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        let _conn = conn;
        let mut times: HashMap<String, usize> = HashMap::new();
        while let Some(Ok(d)) = deliveries.next().await {
            let body: Value = serde_json::from_slice(&d.data).unwrap();
            let kind = body["type"].as_str().unwrap().to_owned();
            let entries: Vec<Value> = if kind == "draw.batch" {
                body["requests"].as_array().unwrap().clone()
            } else {
                vec![body.clone()]
            };
            let message = Seen {
                kind: kind.clone(),
                ids: entries
                    .iter()
                    .map(|e| e["request_id"].as_str().unwrap().to_owned())
                    .collect(),
            };
            let before = message
                .ids
                .iter()
                .map(|id| times.get(id).copied().unwrap_or(0))
                .max()
                .unwrap_or(0);
            for id in &message.ids {
                *times.entry(id.clone()).or_default() += 1;
            }
            let act = act(&message, before);
            log.lock().unwrap().push(message);
            let reply = match act {
                Act::Ignore => None,
                Act::RejectEnvelope => Some(json!({"type":"draw_result.batch","status":"rejected",
                    "error":{"code":"invalid_request","message":"too many entries"},"results":[]})),
                Act::Answer if kind == "draw.batch" => Some(json!({"type":"draw_result.batch",
                    "results": entries.iter().map(result_of).collect::<Vec<_>>()})),
                Act::Answer => Some(result_of(&body)),
            };
            if let (Some(reply), Some(to)) = (reply, d.properties.reply_to()) {
                let props = BasicProperties::default()
                    .with_correlation_id(d.properties.correlation_id().clone().unwrap());
                channel
                    .basic_publish(
                        "".into(),
                        to.clone(),
                        BasicPublishOptions::default(),
                        &serde_json::to_vec(&reply).unwrap(),
                        props,
                    )
                    .await
                    .unwrap();
            }
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    });
    seen
}

/// Leaves every request's first message unanswered (a lost reply) and
/// answers it when it comes again.
fn answer_from_the_second(_: &Seen, before: usize) -> Act {
    if before == 0 {
        Act::Ignore
    } else {
        Act::Answer
    }
}

fn config(env: &TestEnv) -> ClientConfig {
    ClientConfig::new(&env.config.amqp_url)
        .declare_topology(&env.config)
        .retry_delay(Duration::from_millis(10))
}

/// Draws `n` at once, user `i + 1` with count `i % 3 + 1`, and checks each
/// caller got its own result.
async fn draw_many(client: &Client, n: usize) {
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..n {
        let client = client.clone();
        calls.spawn(async move {
            let request = draw_request("gift-1", i as i64 + 1, (i % 3 + 1) as u32);
            let id = request.request_id.clone();
            let result = client.draw(request).await.unwrap();
            assert_eq!(result.request_id, id);
            assert_eq!(result.status, Status::Ok);
            assert_eq!(result.user_id, Some(i as i64 + 1));
            assert_eq!(result.reward, Some((i as i64 + 1) * (i % 3 + 1) as i64));
        });
    }
    while let Some(call) = calls.join_next().await {
        call.unwrap();
    }
}

#[tokio::test]
async fn concurrent_draws_are_sent_in_batches_of_the_batch_size() {
    let env = TestEnv::new(&[]).await;
    let seen = responder(&env, |_, _| Act::Answer).await;
    // A linger far longer than the test: only the size can send a batch.
    let client = Client::connect(config(&env).batch_size(10).linger(Duration::from_secs(60)))
        .await
        .unwrap();
    let started = Instant::now();
    draw_many(&client, 30).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for message in &seen {
        assert_eq!(message.kind, "draw.batch");
        assert_eq!(message.ids.len(), 10);
    }
    assert_eq!(client.stats().snapshot(), (3, 30, 0, 0));
    client.close().await;
}

#[tokio::test]
async fn a_batch_goes_out_when_its_linger_has_passed_and_one_draw_alone_as_a_plain_draw() {
    let env = TestEnv::new(&[]).await;
    let seen = responder(&env, |_, _| Act::Answer).await;
    let linger = Duration::from_millis(300);
    let client = Client::connect(config(&env).batch_size(50).linger(linger))
        .await
        .unwrap();
    let started = Instant::now();
    draw_many(&client, 1).await;
    let alone = started.elapsed();
    let started = Instant::now();
    draw_many(&client, 7).await;
    let together = started.elapsed();
    for took in [alone, together] {
        assert!(took >= linger, "answered after {took:?}, before the linger");
        assert!(took < linger * 10, "answered only after {took:?}");
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!((seen[0].kind.as_str(), seen[0].ids.len()), ("draw", 1));
    assert_eq!(
        (seen[1].kind.as_str(), seen[1].ids.len()),
        ("draw.batch", 7)
    );
    client.close().await;
}

#[tokio::test]
async fn a_lost_reply_is_retried_with_the_same_request_id() {
    let env = TestEnv::new(&[]).await;
    let seen = responder(&env, answer_from_the_second).await;
    let client = Client::connect(
        config(&env)
            .batch_size(5)
            .linger(Duration::from_millis(5))
            .timeout(Duration::from_millis(500)),
    )
    .await
    .unwrap();
    draw_many(&client, 5).await;
    let seen = seen.lock().unwrap().clone();
    // Each id went out twice, and nothing else did.
    let mut ids: Vec<String> = seen.iter().flat_map(|s| s.ids.clone()).collect();
    assert_eq!(ids.len(), 10, "{seen:?}");
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 5);
    assert_eq!(
        client
            .stats()
            .retries
            .load(std::sync::atomic::Ordering::Relaxed),
        5
    );
    client.close().await;
}

#[tokio::test]
async fn a_draw_nobody_answers_ends_in_a_timeout_after_its_retries() {
    let env = TestEnv::new(&[]).await;
    let seen = responder(&env, |_, _| Act::Ignore).await;
    let timeout = Duration::from_millis(300);
    let client = Client::connect(config(&env).timeout(timeout).retries(2))
        .await
        .unwrap();
    let request = draw_request("gift-1", 7, 1);
    let id = request.request_id.clone();
    let started = Instant::now();
    let error = client.draw(request).await.unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(error, ClientError::Timeout(t) if t == timeout),
        "{error:?}"
    );
    // Three attempts of 300 ms and two short pauses: an error, not a hang.
    assert!(
        took >= timeout * 3 && took < Duration::from_secs(5),
        "{took:?}"
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen.iter().all(|s| s.ids == [id.clone()]));
    client.close().await;
}

#[tokio::test]
async fn a_refused_batch_fails_its_calls_without_retrying() {
    let env = TestEnv::new(&[]).await;
    let seen = responder(&env, |_, _| Act::RejectEnvelope).await;
    let client = Client::connect(config(&env).batch_size(3).linger(Duration::from_secs(60)))
        .await
        .unwrap();
    let calls: Vec<_> = (0..3)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move { client.draw(draw_request("gift-1", i + 1, 1)).await })
        })
        .collect();
    for call in calls {
        let error = call.await.unwrap().unwrap_err();
        assert!(
            matches!(&error, ClientError::BatchRejected(m) if m == "too many entries"),
            "{error:?}"
        );
    }
    assert_eq!(seen.lock().unwrap().len(), 1);
    client.close().await;
}

/// The broker's ids of the connections named `name` in `vhost`.
fn connections(vhost: &str, name: &str) -> Vec<String> {
    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "vhost",
            "client_properties",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(vhost) && l.contains(name))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn a_lost_connection_sends_its_draws_again_on_a_new_one() {
    let env = TestEnv::new(&[]).await;
    // First messages go unanswered, so the draws are in flight when the
    // connection is closed under them.
    let seen = responder(&env, answer_from_the_second).await;
    let name = format!("client-{}", env.vhost);
    // A timeout longer than the test: only the lost connection can make
    // the client send the draws again.
    let client = Client::connect(
        config(&env)
            .connection_name(&name)
            .batch_size(4)
            .timeout(Duration::from_secs(60)),
    )
    .await
    .unwrap();
    let calls = {
        let client = client.clone();
        tokio::spawn(async move { draw_many(&client, 4).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while seen.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the batch never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pids = connections(&env.vhost, &name);
    assert_eq!(pids.len(), 1, "{pids:?}");
    let closed = std::process::Command::new("rabbitmqctl")
        .args(["close_connection", &pids[0], "test: connection lost"])
        .output()
        .unwrap();
    assert!(closed.status.success());
    tokio::time::timeout(Duration::from_secs(20), calls)
        .await
        .expect("the draws were not sent again")
        .unwrap();
    let (_, entries, retries, reconnects) = client.stats().snapshot();
    assert_eq!((entries, retries, reconnects), (8, 4, 1));
    // Each draw went out twice: in the batch that was lost, then again
    // (retries pause with jitter, so not necessarily in one batch).
    let seen = seen.lock().unwrap().clone();
    let mut counts: HashMap<String, usize> = HashMap::new();
    for id in seen.iter().flat_map(|s| s.ids.clone()) {
        *counts.entry(id).or_default() += 1;
    }
    assert_eq!(counts.len(), 4, "{seen:?}");
    assert!(counts.values().all(|&n| n == 2), "{seen:?}");
    client.close().await;
}

// --- Against the real fleet -------------------------------------------------

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 3000), (1, 600), (5, 200)]),
    ("b", &[(0, 2000), (2, 500), (10, 100)]),
];

/// Draws `n` at once from `pool` (user `i + 1`, count `i % 3 + 1`) and
/// returns what each caller got, checked to be its own `ok` result.
async fn fleet_draws(
    client: &Client,
    pool: &str,
    n: usize,
) -> Vec<prizepool::messages::DrawResult> {
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..n {
        let (client, pool) = (client.clone(), pool.to_owned());
        calls.spawn(async move {
            let count = (i % 3 + 1) as u32;
            let request = draw_request(pool, i as i64 + 1, count);
            let id = request.request_id.clone();
            let result = client.draw(request).await.unwrap();
            assert_eq!(result.request_id, id);
            assert_eq!(result.status, Status::Ok, "{result:?}");
            assert_eq!(result.user_id, Some(i as i64 + 1));
            assert_eq!(result.prizes.len(), count as usize);
            result
        });
    }
    let mut results = Vec::new();
    while let Some(call) = calls.join_next().await {
        results.push(call.unwrap());
    }
    results
}

/// Checks that the pool gave each answered draw its prizes once and the
/// ledger paid each answer once.
async fn assert_paid_once(env: &TestEnv, pool: &str, results: &[prizepool::messages::DrawResult]) {
    let prizes: u64 = results.iter().map(|r| r.prizes.len() as u64).sum();
    let rewards: i64 = results.iter().map(|r| r.reward.unwrap_or(0)).sum();
    assert_eq!(env.status(pool).await.drawn, prizes, "prizes drawn");
    assert_eq!(env.wait_ledger(pool, rewards).await, rewards, "ledger");
}

#[tokio::test]
async fn concurrent_draws_through_the_fleet_get_each_their_own_result() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&common::pool_toml("gift", "", GIFT)).await;
    env.start_fleet().await;
    let client = Client::connect(config(&env).batch_size(20).linger(Duration::from_millis(5)))
        .await
        .unwrap();
    let results = fleet_draws(&client, "gift", 200).await;
    assert_paid_once(&env, "gift", &results).await;
    let (messages, entries, retries, _) = client.stats().snapshot();
    assert_eq!((entries, retries), (200, 0));
    assert!(
        messages < 50,
        "{messages} messages for 200 draws: not batched"
    );
    client.close().await;
    env.stop_workers().await;
}

#[tokio::test]
async fn draws_retried_across_a_killed_worker_are_paid_once() {
    let mut env = TestEnv::new(&[]).await;
    env.load(&common::pool_toml("gift", "", GIFT)).await;
    env.start_refill_worker().await;
    env.start_settle_worker().await;
    let exe = env!("CARGO_BIN_EXE_draw-worker");
    let mut worker = common::KillOnDrop(common::spawn_binary(&env, "draw-worker", exe));
    let deadline = Instant::now() + Duration::from_secs(30);
    while env.consumers(prizepool::amqp::DRAW.queue).await == 0 {
        assert!(Instant::now() < deadline, "the draw worker did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Attempts shorter than the worker's absence: the draws in flight when
    // it dies are both redelivered by the broker and sent again by the
    // client, under the same request ids.
    let client = Client::connect(
        config(&env)
            .batch_size(10)
            .linger(Duration::from_millis(5))
            .timeout(Duration::from_millis(700))
            .retries(10),
    )
    .await
    .unwrap();
    let draws = {
        let client = client.clone();
        tokio::spawn(async move {
            let mut results = Vec::new();
            for _ in 0..6 {
                results.extend(fleet_draws(&client, "gift", 50).await);
            }
            results
        })
    };
    // The kill comes once the second round is on its way (the rounds run
    // one after the other: the first was answered, retries aside): draws in the
    // worker's hands and more behind them. A fixed 150 ms came after the
    // last answer once the dependencies were built optimised.
    let deadline = Instant::now() + Duration::from_secs(60);
    while client
        .stats()
        .entries
        .load(std::sync::atomic::Ordering::Relaxed)
        <= 50
    {
        assert!(
            Instant::now() < deadline && !draws.is_finished(),
            "the second round of draws never started"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _worker = common::KillOnDrop(common::spawn_binary(&env, "draw-worker", exe));
    let results = tokio::time::timeout(Duration::from_secs(60), draws)
        .await
        .expect("the draws were not all answered")
        .unwrap();
    assert_eq!(results.len(), 300);
    assert!(
        client
            .stats()
            .retries
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0,
        "no draw was retried: the kill came too late"
    );
    assert_paid_once(&env, "gift", &results).await;
    client.close().await;
    env.stop_workers().await;
}

#[tokio::test]
async fn a_draw_with_no_worker_to_answer_returns_a_timeout() {
    let env = TestEnv::new(&[]).await;
    let timeout = Duration::from_millis(400);
    let client = Client::connect(config(&env).timeout(timeout).retries(1))
        .await
        .unwrap();
    let started = Instant::now();
    let error = client.draw(draw_request("gift", 1, 1)).await.unwrap_err();
    assert!(matches!(error, ClientError::Timeout(_)), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // The draw waits in the queue: a worker started now answers it, to
    // nobody.
    assert_eq!(env.queue_depth(prizepool::amqp::DRAW.queue).await, 2);
    client.close().await;
}
