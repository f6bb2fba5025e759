//! The settle worker over real RabbitMQ and Postgres, as an attacker sees
//! it: an `entry_id` is bound to its content, debits only where a debit is
//! allowed and never below zero, amounts and balances stay exact, and an
//! entry that can never be booked is dead-lettered at once while the rest
//! of its batch lands.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{collections::HashMap, time::Duration};

use common::TestEnv;
use futures_util::StreamExt;
use lapin::{
    options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions},
    BasicProperties,
};
use prizepool::{amqp, ledger::MAX_AMOUNT};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(20);

/// A `settle` body booked under `pool` (what `wait_ledger` sums by).
fn entry(id: &str, account: i64, amount: i64, reason: &str, pool: &str) -> Value {
    json!({"type": "settle", "entry_id": id, "account": account, "asset": "coin",
           "amount": amount, "reason": reason, "ref": {"pool": pool}})
}

async fn balance(env: &TestEnv, account: i64) -> i64 {
    prizepool::settle::balances(&env.db, account)
        .await
        .unwrap()
        .iter()
        .find(|b| b.asset == "coin")
        .map_or(0, |b| b.balance)
}

async fn rows(env: &TestEnv, id: &str) -> Vec<(i64, i64, String)> {
    sqlx::query_as("SELECT account, amount, reason FROM ledger_entries WHERE entry_id = $1")
        .bind(id)
        .fetch_all(&env.db)
        .await
        .unwrap()
}

/// Waits until the settle dead-letter queue holds `n` messages, then lists them.
async fn dead_letters(env: &TestEnv, n: u32) -> Vec<amqp::dlq::DeadLetter> {
    let deadline = tokio::time::Instant::now() + T;
    while env.queue_depth(amqp::SETTLE.dlq).await < n && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let letters = amqp::dlq::list(&conn, amqp::SETTLE, 100).await.unwrap();
    let _ = conn.close(200, "bye".into()).await;
    letters
}

#[tokio::test]
async fn a_duplicate_with_the_same_content_is_applied_once() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let topup = entry("same-1", 10, 250, "topup", "same");
    for _ in 0..3 {
        let reply = client.call("settle", &topup, T).await.unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        assert_eq!(reply["entry_id"], "same-1", "{reply}");
    }
    // Another ref is context, not content: still the same entry.
    let mut again = topup.clone();
    again["ref"] = json!({"pool": "same", "request_id": "other"});
    let reply = client.call("settle", &again, T).await.unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(balance(&env, 10).await, 250);
    assert_eq!(rows(&env, "same-1").await.len(), 1);
    env.stop_workers().await;
    assert_eq!(env.queue_depth(amqp::SETTLE.dlq).await, 0);
}

#[tokio::test]
async fn a_duplicate_with_other_content_is_refused_dead_lettered_and_moves_nothing() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let first = client
        .call("settle", &entry("bound-1", 20, 100, "topup", "bound"), T)
        .await
        .unwrap();
    assert_eq!(first["status"], "ok", "{first}");
    // Same id: another amount, another account, another reason.
    for other in [
        entry("bound-1", 20, 5000, "topup", "bound"),
        entry("bound-1", 21, 100, "topup", "bound"),
        entry("bound-1", 20, 100, "lottery", "bound"),
    ] {
        let reply = client.call("settle", &other, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{reply}");
        assert_eq!(reply["error"]["code"], "invalid_request", "{reply}");
        assert_eq!(reply["entry_id"], "bound-1", "{reply}");
    }
    assert_eq!(balance(&env, 20).await, 100);
    assert_eq!(balance(&env, 21).await, 0);
    assert_eq!(
        rows(&env, "bound-1").await,
        vec![(20, 100, "topup".to_owned())]
    );
    let letters = dead_letters(&env, 3).await;
    env.stop_workers().await;
    assert_eq!(letters.len(), 3, "{letters:?}");
    assert!(
        letters
            .iter()
            .all(|l| l.code.as_deref() == Some("invalid_request") && l.body.contains("bound-1")),
        "{letters:?}"
    );
    // The direct API refuses the same way, all or nothing.
    let conflicting = prizepool::messages::SettleRequest::new(
        "bound-1",
        20,
        "coin",
        7,
        "topup",
        json!({"pool": "bound"}),
    );
    let fresh =
        prizepool::messages::SettleRequest::new("bound-2", 20, "coin", 1, "topup", json!({}));
    let error = prizepool::settle::apply(&env.db, [&fresh, &conflicting])
        .await
        .unwrap_err();
    assert!(prizepool::ledger::is_permanent(&error), "{error}");
    assert!(rows(&env, "bound-2").await.is_empty());
    assert_eq!(balance(&env, 20).await, 100);
    // An account that never held anything has no balance row either.
    assert!(prizepool::settle::balances(&env.db, 21)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn one_id_twice_with_different_amounts_inside_one_settle_batch() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let reply = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": [
                entry("twice-1", 30, 10, "topup", "twice"),
                entry("twice-2", 30, 5, "topup", "twice"),
                entry("twice-1", 30, 20, "topup", "twice"),
                entry("twice-2", 30, 5, "topup", "twice"),
            ]}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    // twice-1 and twice-2 (its repeat is the same entry); the second twice-1 is refused.
    assert_eq!(reply["entries"], 3, "{reply}");
    let refused = reply["refused"].as_array().unwrap();
    assert_eq!(refused.len(), 1, "{reply}");
    assert_eq!(refused[0]["entry_id"], "twice-1");
    assert_eq!(refused[0]["code"], "invalid_request");
    assert_eq!(balance(&env, 30).await, 15);
    let letters = dead_letters(&env, 1).await;
    env.stop_workers().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert!(
        letters[0].body.contains("twice-1")
            && letters[0].body.contains("20")
            && !letters[0].body.contains("settle.batch"),
        "{letters:?}"
    );
}

#[tokio::test]
async fn one_id_twice_with_different_amounts_inside_one_worker_transaction() {
    // Both messages wait in the queue before the worker starts, so it takes
    // them in one batch.
    let mut env = TestEnv::new(&[("SETTLE_BATCH_WAIT_MS", "300")]).await;
    let bodies = [
        entry("tx-1", 31, 10, "topup", "tx"),
        entry("tx-2", 31, 1, "topup", "tx"),
        entry("tx-1", 31, 700, "topup", "tx"),
    ];
    let mut replies = Replies::publish(&env, &bodies).await;
    env.start_settle_worker().await;
    let answers = replies.collect(bodies.len()).await;
    assert_eq!(answers[&0][0]["status"], "ok", "{answers:?}");
    assert_eq!(answers[&1][0]["status"], "ok", "{answers:?}");
    assert_eq!(answers[&2][0]["status"], "rejected", "{answers:?}");
    assert_eq!(
        answers[&2][0]["error"]["code"], "invalid_request",
        "{answers:?}"
    );
    assert_eq!(rows(&env, "tx-1").await, vec![(31, 10, "topup".to_owned())]);
    assert_eq!(balance(&env, 31).await, 11);
    let letters = dead_letters(&env, 1).await;
    env.stop_workers().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert!(letters[0].body.contains("700"), "{letters:?}");
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test]
async fn the_worker_counts_batches_commits_outcomes_and_lag() {
    let env = TestEnv::new(&[]).await;
    let addr = format!("127.0.0.1:{}", common::free_port());
    let _worker = common::KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_settle-worker"))
            .envs(env.env())
            .env("METRICS_ADDR", &addr)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let bodies = [
        entry("m-1", 80, 10, "topup", "m"),
        entry("m-1", 80, 10, "topup", "m"),
        entry("m-1", 80, 99, "topup", "m"),
        entry("m-2", 80, -99, "withdrawal", "m"),
    ];
    let mut replies = Replies::publish(&env, &bodies).await;
    let answers = replies.collect(bodies.len()).await;
    replies.close().await;
    assert_eq!(answers[&3][0]["error"]["code"], "insufficient_funds");
    let deadline = tokio::time::Instant::now() + T;
    let text = loop {
        let text = metrics_text(&addr).await;
        if text.contains("prizepool_settle_lag_seconds") || tokio::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for line in [
        r#"prizepool_settle_entries_total{worker="settle-worker",outcome="applied",reason="none"} 1"#,
        r#"prizepool_settle_entries_total{worker="settle-worker",outcome="duplicate",reason="none"} 1"#,
        r#"prizepool_settle_entries_total{worker="settle-worker",outcome="refused",reason="conflict"} 1"#,
        r#"prizepool_settle_entries_total{worker="settle-worker",outcome="refused",reason="insufficient_funds"} 1"#,
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
    for name in [
        "prizepool_settle_batch_entries",
        "prizepool_settle_commit_seconds",
        "prizepool_settle_lag_seconds",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
}

/// The worker's `/metrics` page (empty while the endpoint is not up).
async fn metrics_text(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text).await;
    text
}

/// Messages published with replies to a private queue, for tests that
/// count every answer.
struct Replies {
    conn: lapin::Connection,
    consumer: lapin::Consumer,
}

impl Replies {
    /// Publishes `bodies` to the settle queue (confirmed), each asking for a
    /// reply whose correlation id is its position.
    async fn publish(env: &TestEnv, bodies: &[Value]) -> Self {
        let (conn, ch) = env.confirm_channel("replies").await;
        let queue = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        let consumer = ch
            .basic_consume(
                queue.name().clone(),
                "replies".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        let mut confirms = Vec::new();
        for (i, body) in bodies.iter().enumerate() {
            let confirm = ch
                .basic_publish(
                    amqp::EXCHANGE.into(),
                    "settle".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &serde_json::to_vec(body).unwrap(),
                    BasicProperties::default()
                        .with_content_type("application/json".into())
                        .with_reply_to(queue.name().clone())
                        .with_correlation_id(i.to_string().into())
                        .with_timestamp(now_secs()),
                )
                .await
                .unwrap();
            confirms.push(confirm);
        }
        for c in confirms {
            let c = c.await.unwrap();
            assert!(c.is_ack() && c.take_message().is_none());
        }
        Self { conn, consumer }
    }

    /// Waits for `n` replies, then makes sure no further one follows; the
    /// answers by position.
    async fn collect(&mut self, n: usize) -> HashMap<usize, Vec<Value>> {
        let mut answers: HashMap<usize, Vec<Value>> = HashMap::new();
        let deadline = tokio::time::Instant::now() + T;
        for _ in 0..n {
            let d = tokio::time::timeout_at(deadline, self.consumer.next())
                .await
                .expect("every message is answered")
                .unwrap()
                .unwrap();
            let at: usize = d
                .properties
                .correlation_id()
                .as_ref()
                .unwrap()
                .as_str()
                .parse()
                .unwrap();
            answers
                .entry(at)
                .or_default()
                .push(serde_json::from_slice(&d.data).unwrap());
        }
        // No second answer trails behind.
        let extra = tokio::time::timeout(Duration::from_millis(300), self.consumer.next()).await;
        assert!(extra.is_err(), "an extra reply: {extra:?}");
        assert_eq!(answers.len(), n, "{answers:?}");
        answers
    }

    async fn close(self) {
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

#[tokio::test]
async fn debits_only_for_debit_reasons_and_credits_only_for_credit_reasons() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let ok = client
        .call("settle", &entry("fund", 40, 1000, "topup", "signs"), T)
        .await
        .unwrap();
    assert_eq!(ok["status"], "ok", "{ok}");
    let forbidden = [
        entry("neg-topup", 40, -500, "topup", "signs"),
        entry("neg-gift", 40, -500, "lucky_gift", "signs"),
        entry("neg-refund", 40, -500, "red_packet_refund", "signs"),
        entry("neg-lottery", 40, -1, "lottery", "signs"),
        entry("neg-grab", 40, -1, "red_packet", "signs"),
        entry("pos-withdrawal", 40, 500, "withdrawal", "signs"),
        entry("pos-purchase", 40, 500, "purchase", "signs"),
        entry("unknown-reason", 40, -500, "bonus", "signs"),
        entry("zero", 40, 0, "topup", "signs"),
    ];
    for body in &forbidden {
        let reply = client.call("settle", body, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{body} → {reply}");
        assert_eq!(reply["error"]["code"], "invalid_request", "{reply}");
    }
    // The same inside a batch: refused one by one, the good debit lands.
    let reply = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": [
                entry("batch-neg-topup", 40, -500, "topup", "signs"),
                entry("batch-purchase", 40, -300, "purchase", "signs"),
            ]}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(reply["entries"], 1, "{reply}");
    assert_eq!(balance(&env, 40).await, 700);
    let letters = dead_letters(&env, forbidden.len() as u32 + 1).await;
    env.stop_workers().await;
    assert_eq!(letters.len(), forbidden.len() + 1, "{letters:?}");
    assert!(letters
        .iter()
        .all(|l| l.code.as_deref() == Some("invalid_request")));
    // The direct API keeps the same rules.
    let bad =
        prizepool::messages::SettleRequest::new("api-neg", 40, "coin", -1, "topup", json!({}));
    assert!(prizepool::settle::apply(&env.db, [&bad]).await.is_err());
    assert_eq!(balance(&env, 40).await, 700);
}

#[tokio::test]
async fn an_overdraft_is_refused_with_insufficient_funds_and_not_dead_lettered() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    let reply = client
        .call("settle", &entry("od-fund", 50, 100, "topup", "od"), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    let reply = client
        .call("settle", &entry("od-1", 50, -150, "withdrawal", "od"), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "rejected", "{reply}");
    assert_eq!(reply["error"]["code"], "insufficient_funds", "{reply}");
    // A debit from an account that never held anything.
    let reply = client
        .call("settle", &entry("od-2", 51, -1, "purchase", "od"), T)
        .await
        .unwrap();
    assert_eq!(reply["error"]["code"], "insufficient_funds", "{reply}");
    // Two debits in one batch that the balance covers one at a time.
    let reply = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": [
                entry("od-3", 50, -60, "withdrawal", "od"),
                entry("od-4", 50, -60, "purchase", "od"),
                entry("od-3", 50, -60, "withdrawal", "od"),
            ]}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(reply["entries"], 2, "{reply}");
    assert_eq!(reply["refused"][0]["entry_id"], "od-4", "{reply}");
    assert_eq!(reply["refused"][0]["code"], "insufficient_funds", "{reply}");
    assert_eq!(balance(&env, 50).await, 40);
    // A refused debit binds nothing: once the account is funded it may land.
    client
        .call("settle", &entry("od-fund-2", 50, 200, "topup", "od"), T)
        .await
        .unwrap();
    let reply = client
        .call("settle", &entry("od-1", 50, -150, "withdrawal", "od"), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(balance(&env, 50).await, 90);
    assert!(balance(&env, 51).await == 0);
    env.stop_workers().await;
    assert_eq!(env.queue_depth(amqp::SETTLE.dlq).await, 0);
}

#[tokio::test]
async fn amounts_beyond_the_exact_range_and_overflowing_balances_are_refused() {
    let mut env = TestEnv::new(&[]).await;
    env.start_settle_worker().await;
    let client = env.client().await;
    for (id, amount, reason) in [
        ("too-big", MAX_AMOUNT + 1, "topup"),
        ("i64-max", i64::MAX, "topup"),
        ("i64-min", i64::MIN, "withdrawal"),
        ("too-small", -MAX_AMOUNT - 1, "withdrawal"),
    ] {
        let reply = client
            .call("settle", &entry(id, 60, amount, reason, "big"), T)
            .await
            .unwrap();
        assert_eq!(reply["error"]["code"], "invalid_request", "{id}: {reply}");
    }
    let reply = client
        .call("settle", &entry("max", 60, MAX_AMOUNT, "topup", "big"), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    // One more coin would leave the exact range: refused as `internal`,
    // dead-lettered, and the rest of its batch lands.
    let reply = client
        .call("settle", &entry("over", 60, 1, "topup", "big"), T)
        .await
        .unwrap();
    assert_eq!(reply["error"]["code"], "internal", "{reply}");
    let reply = client
        .call(
            "settle",
            &json!({"type": "settle.batch", "entries": [
                entry("over-2", 60, MAX_AMOUNT, "topup", "big"),
                entry("spend", 60, -10, "purchase", "big"),
                entry("elsewhere", 61, MAX_AMOUNT, "topup", "big"),
            ]}),
            T,
        )
        .await
        .unwrap();
    assert_eq!(reply["entries"], 2, "{reply}");
    assert_eq!(reply["refused"][0]["code"], "internal", "{reply}");
    assert_eq!(balance(&env, 60).await, MAX_AMOUNT - 10);
    assert_eq!(balance(&env, 61).await, MAX_AMOUNT);
    let letters = dead_letters(&env, 6).await;
    env.stop_workers().await;
    assert_eq!(letters.len(), 6, "{letters:?}");
    assert_eq!(
        letters
            .iter()
            .filter(|l| l.code.as_deref() == Some("internal"))
            .count(),
        2,
        "{letters:?}"
    );
}

#[tokio::test]
async fn an_entry_postgres_can_never_take_is_dead_lettered_at_once_and_its_batch_lands() {
    let mut env = TestEnv::new(&[("SETTLE_BATCH_WAIT_MS", "200")]).await;
    // A constructed permanent failure: a constraint only this database has.
    sqlx::query(
        "ALTER TABLE ledger_entries ADD CONSTRAINT no_poison CHECK (entry_id NOT LIKE 'poison%')",
    )
    .execute(&env.db)
    .await
    .unwrap();
    env.start_settle_worker().await;
    let started = tokio::time::Instant::now();
    // jsonb cannot hold U+0000: Postgres refuses this entry whatever happens.
    let mut nul = entry("nul", 70, 7, "topup", "poison");
    nul["ref"]["note"] = json!("\u{0}");
    let bodies = [
        json!({"type": "settle.batch", "entries": [
            entry("ok-1", 70, 1, "topup", "poison"),
            entry("poison-1", 70, 100, "topup", "poison"),
            entry("ok-2", 70, 2, "topup", "poison"),
        ]}),
        entry("poison-2", 70, 100, "topup", "poison"),
        entry("ok-3", 70, 4, "topup", "poison"),
        nul,
    ];
    let mut replies = Replies::publish(&env, &bodies).await;
    let answers = replies.collect(bodies.len()).await;
    replies.close().await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let (batch, one, good, nul) = (
        &answers[&0][0],
        &answers[&1][0],
        &answers[&2][0],
        &answers[&3][0],
    );
    assert_eq!(batch["entries"], 2, "{batch}");
    assert_eq!(batch["refused"][0]["code"], "internal", "{batch}");
    assert_eq!(one["error"]["code"], "internal", "{one}");
    assert_eq!(nul["error"]["code"], "internal", "{nul}");
    assert_eq!(good["status"], "ok", "{good}");
    assert_eq!(balance(&env, 70).await, 7);
    let letters = dead_letters(&env, 3).await;
    env.stop_workers().await;
    assert_eq!(letters.len(), 3, "{letters:?}");
    assert!(letters
        .iter()
        .all(|l| l.code.as_deref() == Some("internal")));
}

/// One generated message of the property test.
#[derive(Clone, Debug)]
struct Op {
    id: u8,
    account: i64,
    amount: i64,
    reason: &'static str,
}

const REASONS: &[&str] = &["topup", "lottery", "withdrawal", "purchase"];

fn ops() -> impl proptest::strategy::Strategy<Value = Vec<Op>> {
    use proptest::prelude::*;
    let op = (
        0u8..12,
        0i64..3,
        1i64..400,
        0usize..4,
        proptest::bool::weighted(0.1),
    )
        .prop_map(|(id, account, amount, reason, flip)| {
            let reason = REASONS[reason];
            let debit = matches!(reason, "withdrawal" | "purchase");
            // Mostly the sign the reason asks for; sometimes the other one.
            let amount = if debit != flip { -amount } else { amount };
            Op {
                id,
                account,
                amount,
                reason,
            }
        });
    // Exact repeats of earlier messages besides the accidental id clashes.
    (
        proptest::collection::vec(op, 1..40),
        proptest::collection::vec(any::<proptest::sample::Index>(), 0..10),
    )
        .prop_map(|(mut ops, repeats)| {
            for r in repeats {
                let copy = ops[r.index(ops.len())].clone();
                ops.push(copy);
            }
            ops
        })
}

#[test]
fn random_mixes_of_entries_keep_balances_equal_to_the_accepted_entries() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut env = rt.block_on(TestEnv::new(&[("SETTLE_BATCH_SIZE", "16")]));
    // Two workers: their batches race for the same ids and balances.
    rt.block_on(env.start_settle_worker());
    rt.block_on(env.start_settle_worker());
    let case = std::sync::atomic::AtomicI64::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases: 16,
        ..Default::default()
    });
    runner
        .run(&ops(), |ops| {
            let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            rt.block_on(check_case(&env, n, &ops));
            Ok(())
        })
        .unwrap();
    rt.block_on(env.stop_workers());
}

/// Publishes `ops` at once and checks what the replies promise against the
/// ledger: one answer per message, each `ok` entry booked with its content,
/// every balance the sum of its booked entries and never negative.
async fn check_case(env: &TestEnv, case: i64, ops: &[Op]) {
    let account = |op: &Op| case * 10 + op.account + 1000;
    let id = |op: &Op| format!("p{case}-{}", op.id);
    let bodies: Vec<Value> = ops
        .iter()
        .map(|op| entry(&id(op), account(op), op.amount, op.reason, "prop"))
        .collect();
    let mut replies = Replies::publish(env, &bodies).await;
    let answers = replies.collect(ops.len()).await;
    replies.close().await;

    let mut promised: HashMap<String, &Op> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let reply = &answers[&i][0];
        let debit = matches!(op.reason, "withdrawal" | "purchase");
        let wrong_sign = debit != (op.amount < 0);
        if wrong_sign {
            assert_eq!(reply["error"]["code"], "invalid_request", "{op:?} {reply}");
        }
        if reply["status"] == "ok" {
            // Two `ok` for one id promise the same content.
            if let Some(earlier) = promised.insert(id(op), op) {
                assert_eq!(
                    (earlier.account, earlier.amount, earlier.reason),
                    (op.account, op.amount, op.reason)
                );
            }
        } else if reply["error"]["code"] == "insufficient_funds" {
            assert!(debit, "{op:?} {reply}");
        }
    }
    // The ledger holds exactly the promised entries, with their content.
    let booked: Vec<(String, i64, i64, String)> = sqlx::query_as(
        "SELECT entry_id, account, amount, reason FROM ledger_entries WHERE entry_id LIKE $1",
    )
    .bind(format!("p{case}-%"))
    .fetch_all(&env.db)
    .await
    .unwrap();
    assert_eq!(booked.len(), promised.len(), "{booked:?} {promised:?}");
    let mut sums: HashMap<i64, i64> = HashMap::new();
    for (entry_id, acc, amount, reason) in &booked {
        let op = promised[entry_id];
        assert_eq!(
            (*acc, *amount, reason.as_str()),
            (account(op), op.amount, op.reason)
        );
        *sums.entry(*acc).or_default() += amount;
    }
    for a in 0..3 {
        let acc = case * 10 + a + 1000;
        let b = balance(env, acc).await;
        assert_eq!(b, sums.get(&acc).copied().unwrap_or(0), "account {acc}");
        assert!(b >= 0);
    }
}

/// A balance the batch's sum would take out of the 64-bit range is locked
/// but left where it is by the writing statement, and judged from where it
/// stands: the credit is refused, the rest of the batch lands.
#[tokio::test]
async fn a_balance_at_the_edge_of_the_64_bit_range_is_judged_where_it_stands() {
    let env = TestEnv::new(&[]).await;
    // A balance from before the exact-range rules, near the 64-bit limit.
    sqlx::query("INSERT INTO balances (account, asset, balance) VALUES (77, 'coin', $1)")
        .bind(i64::MAX - 5)
        .execute(&env.db)
        .await
        .unwrap();
    let req = |id: &str, account: i64, amount: i64, reason: &str| {
        prizepool::messages::SettleRequest::new(
            id,
            account,
            "coin",
            amount,
            reason,
            json!({"pool": "edge"}),
        )
    };
    let over = req("edge-over", 77, 10, "topup");
    let back = req("edge-back", 77, -3, "withdrawal");
    let fine = req("edge-fine", 78, 10, "topup");
    let verdicts = prizepool::ledger::apply_each(&env.db, &[&over, &back, &fine])
        .await
        .unwrap();
    assert_eq!(
        verdicts,
        [
            prizepool::ledger::Verdict::Overflow {
                balance: i64::MAX - 5
            },
            prizepool::ledger::Verdict::Applied,
            prizepool::ledger::Verdict::Applied,
        ]
    );
    assert_eq!(balance(&env, 77).await, i64::MAX - 8);
    assert_eq!(balance(&env, 78).await, 10);
    assert!(rows(&env, "edge-over").await.is_empty());
    assert_eq!(rows(&env, "edge-fine").await.len(), 1);
}
