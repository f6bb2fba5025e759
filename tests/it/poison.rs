//! Poison and plumbing: a handler that panics, bad input answered with its
//! id, dead letters that stay put, a replay that ends, and exactly one reply
//! per request across a graceful stop of the fleet.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use common::{draw, pool_toml, TestEnv};
use futures_util::StreamExt;
use lapin::{
    options::{BasicConsumeOptions, BasicPublishOptions},
    types::FieldTable,
    BasicProperties, Channel, Connection,
};
use prizepool::amqp::{self, HandleError, Handler, Outcome, Publisher, Route};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(20);

/// A draw-queue handler that panics on any request with a `panic` field and
/// answers every other one `ok`.
struct Poison;

impl Handler for Poison {
    fn route(&self) -> Route {
        amqp::DRAW
    }

    async fn handle(
        &self,
        envelope: &Value,
        _publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        let id = envelope["request_id"].as_str().unwrap_or_default();
        if envelope.get("panic").is_some() {
            panic!("poisoned by {id}");
        }
        let reply = json!({"type": "draw_result", "request_id": id, "status": "ok"});
        Ok(Outcome {
            reply: Some(serde_json::to_vec(&reply).unwrap()),
            ..Outcome::default()
        })
    }
}

/// A connection and a confirming channel on the test's vhost, with the
/// topology declared.
async fn channel(env: &TestEnv) -> (Connection, Channel) {
    env.confirm_channel("poison-test").await
}

/// Publishes `body` as is and waits for the broker's confirm.
async fn publish_raw(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) {
    let confirm = ch
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack() && confirm.take_message().is_none());
}

#[tokio::test]
async fn a_panicking_handler_dead_letters_answers_internal_and_carries_on() {
    // A window of two: two deliveries whose tasks died unsettled would stop
    // the broker from sending any more.
    let mut env = TestEnv::new(&[("PREFETCH", "2"), ("CONCURRENCY", "2")]).await;
    env.start_handler(Poison).await;
    let client = env.client().await;
    for i in 0..5 {
        let body = json!({"type": "draw", "request_id": format!("p-{i}"), "panic": true});
        let reply = client.call("draw", &body, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{reply}");
        assert_eq!(reply["error"]["code"], "internal", "{reply}");
        assert_eq!(reply["request_id"], format!("p-{i}"), "{reply}");
        assert_eq!(reply["type"], "draw_result");
    }
    // The worker carries on.
    let body = json!({"type": "draw", "request_id": "fine"});
    let reply = client.call("draw", &body, T).await.unwrap();
    assert_eq!(
        reply,
        json!({"type": "draw_result", "request_id": "fine", "status": "ok"})
    );
    env.stop_workers().await;

    // Each poison message is in the DLQ once, with the reason; none is
    // waiting for redelivery.
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 0);
    let conn = amqp::connect(&env.config.amqp_url, "t").await.unwrap();
    let letters = amqp::dlq::list(&conn, amqp::DRAW, 100).await.unwrap();
    assert_eq!(letters.len(), 5, "{letters:?}");
    for l in &letters {
        assert_eq!(l.code.as_deref(), Some("internal"));
        assert!(l.reason.contains("panicked"), "{}", l.reason);
        assert!(l.reason.contains("poisoned by p-"), "{}", l.reason);
    }
}

#[tokio::test]
async fn a_rejected_reply_to_bad_input_carries_the_request_id_through_the_broker() {
    let mut env = TestEnv::new(&[]).await;
    env.start_draw_worker().await;
    let client = env.client().await;
    let oversize = format!(
        r#"{{"type":"draw","request_id":"big","pool":"g","user_id":1,"count":1,"pad":"{}"}}"#,
        "x".repeat(70_000)
    );
    let cases: Vec<(&str, Vec<u8>, &str, &str, &str)> = vec![
        (
            "no type",
            br#"{"request_id":"no-type","pool":"g","user_id":1,"count":1}"#.to_vec(),
            "request_id",
            "no-type",
            "draw_result",
        ),
        (
            "type not a string",
            br#"{"type":["draw"],"request_id":"odd-type","pool":"g"}"#.to_vec(),
            "request_id",
            "odd-type",
            "draw_result",
        ),
        (
            "unknown type",
            br#"{"type":"teleport","request_id":"tele"}"#.to_vec(),
            "request_id",
            "tele",
            "draw_result",
        ),
        (
            "oversize",
            oversize.into_bytes(),
            "request_id",
            "big",
            "draw_result",
        ),
        (
            "typed decoding fails",
            br#"{"type":"lottery.grant","grant_id":"g-x","activity":"a","user_id":1,"chances":"3"}"#
                .to_vec(),
            "grant_id",
            "g-x",
            "grant_result",
        ),
    ];
    for (name, body, field, id, reply_type) in &cases {
        let reply = client.call_raw("draw", body, T).await.unwrap();
        assert_eq!(reply["status"], "rejected", "{name}: {reply}");
        assert_eq!(reply["error"]["code"], "invalid_request", "{name}: {reply}");
        assert_eq!(reply[*field], *id, "{name}: {reply}");
        assert_eq!(reply["type"], *reply_type, "{name}: {reply}");
    }
    let reply = client.call_raw("draw", b"{oops", T).await.unwrap();
    assert_eq!(reply["error"]["code"], "invalid_request");
    assert!(reply.get("request_id").is_none(), "{reply}");
    env.stop_workers().await;
}

#[tokio::test]
async fn a_dead_letter_keeps_no_expiration_and_stays_in_the_dlq() {
    let mut env = TestEnv::new(&[]).await;
    env.start_handler(Poison).await;
    let (_conn, ch) = channel(&env).await;
    let properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_expiration("1000".into());
    publish_raw(&ch, amqp::EXCHANGE, "draw", b"{not json", properties).await;
    env.wait_depth(amqp::DRAW.dlq, 1).await;
    // Past the message's own TTL it is still there.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(env.queue_depth(amqp::DRAW.dlq).await, 1);
    env.stop_workers().await;
    let got = ch
        .basic_get(amqp::DRAW.dlq.into(), Default::default())
        .await
        .unwrap()
        .expect("the dead letter is there");
    let props = &got.delivery.properties;
    assert_eq!(props.expiration(), &None);
    assert_eq!(
        props.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    assert_eq!(&got.delivery.data[..], b"{not json");
}

#[tokio::test]
async fn a_replay_moves_only_what_the_dlq_held_when_it_began_then_ends() {
    let env = TestEnv::new(&[]).await;
    let (conn, ch) = channel(&env).await;
    // Every message replayed to the draw queue fails again at once: a
    // consumer rejects it, and the queue dead-letters it back to the DLQ
    // while the replay is still running.
    let failing = conn.create_channel().await.unwrap();
    let mut rejecting = failing
        .basic_consume(
            amqp::DRAW.queue.into(),
            "fails-again".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    tokio::spawn(async move {
        while let Some(Ok(delivery)) = rejecting.next().await {
            let _ = delivery
                .acker
                .reject(lapin::options::BasicRejectOptions { requeue: false })
                .await;
        }
    });
    for i in 0..5 {
        let body = format!(r#"{{"type":"draw","request_id":"d-{i}"}}"#);
        publish_raw(
            &ch,
            amqp::DLX,
            amqp::DRAW.queue,
            body.as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    let dry = amqp::dlq::replay(&conn, amqp::DRAW, usize::MAX, true)
        .await
        .unwrap();
    assert_eq!((dry.found, dry.moved, dry.messages.len()), (5, 0, 5));
    let report = tokio::time::timeout(T, amqp::dlq::replay(&conn, amqp::DRAW, usize::MAX, false))
        .await
        .expect("the replay ends")
        .unwrap();
    assert_eq!((report.found, report.moved), (5, 5));
    assert_eq!(report.messages.len(), 5);
    env.wait_depth(amqp::DRAW.dlq, 5).await;
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 0);
    // A limit below the count still holds.
    let report = amqp::dlq::replay(&conn, amqp::DRAW, 2, false)
        .await
        .unwrap();
    assert_eq!((report.found, report.moved), (5, 2));
}

#[tokio::test]
async fn replaying_letters_that_fail_again_ends_and_counts() {
    let mut env = TestEnv::new(&[]).await;
    env.start_handler(Poison).await;
    let (conn, ch) = channel(&env).await;
    for i in 0..4 {
        let body = format!(r#"{{"type":"draw","request_id":"again-{i}","panic":true}}"#);
        publish_raw(
            &ch,
            amqp::EXCHANGE,
            "draw",
            body.as_bytes(),
            BasicProperties::default(),
        )
        .await;
    }
    env.wait_depth(amqp::DRAW.dlq, 4).await;
    for _ in 0..2 {
        let report =
            tokio::time::timeout(T, amqp::dlq::replay(&conn, amqp::DRAW, usize::MAX, false))
                .await
                .expect("the replay ends")
                .unwrap();
        assert_eq!((report.found, report.moved), (4, 4));
        // The worker fails them again, and they are back.
        env.wait_depth(amqp::DRAW.dlq, 4).await;
    }
    env.stop_workers().await;
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 0);
}

/// Replies received on one queue, by request id.
type Replies = Arc<Mutex<HashMap<String, Vec<Value>>>>;

const SENTINEL: &str = "sentinel";

/// Consumes `queue` into a table of replies per `request_id`; returns when
/// the sentinel message arrives.
async fn collect_replies(ch: Channel, queue: &str, replies: Replies) {
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "replies".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery.unwrap();
        let reply: Value = serde_json::from_slice(&delivery.data).unwrap();
        if reply == json!(SENTINEL) {
            return;
        }
        let id = reply["request_id"].as_str().unwrap().to_owned();
        assert_eq!(
            delivery
                .properties
                .correlation_id()
                .as_ref()
                .unwrap()
                .as_str(),
            id,
            "the reply carries the request's correlation id"
        );
        replies.lock().unwrap().entry(id).or_default().push(reply);
    }
}

fn answered(replies: &Replies) -> usize {
    replies.lock().unwrap().len()
}

async fn wait_answered(replies: &Replies, n: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while answered(replies) < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} requests answered",
            answered(replies)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Draws in flight when the fleet stops gracefully are answered exactly
/// once: before the stop, or after the restart (a redelivered draw that was
/// answered but whose ack was lost would be answered twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_mid_stream_answers_every_draw_exactly_once() {
    const DRAWS: usize = 10_000;
    const COUNT: u32 = 3;
    let mut env = TestEnv::new(&[]).await;
    env.load(&pool_toml(
        "mid",
        "refill_at = 0.5\nmax_count = 100",
        &[
            ("a", &[(0, 6000), (1, 1200), (5, 400)]),
            ("b", &[(0, 4000), (2, 1000), (10, 200)]),
        ],
    ))
    .await;
    env.start_fleet().await;

    let (conn, ch) = channel(&env).await;
    let reply_queue = "test.replies";
    ch.queue_declare(
        reply_queue.into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let replies: Replies = Arc::default();
    let collector = tokio::spawn(collect_replies(
        conn.create_channel().await.unwrap(),
        reply_queue,
        replies.clone(),
    ));

    let started = Instant::now();
    let requests: Vec<Value> = (0..DRAWS)
        .map(|i| draw("mid", (i % 97) as i64, COUNT))
        .collect();
    // Windowed confirms: a thousand publishes in flight at a time.
    for chunk in requests.chunks(1000) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for request in chunk {
            let id = request["request_id"].as_str().unwrap();
            let properties = BasicProperties::default()
                .with_content_type("application/json".into())
                .with_delivery_mode(2)
                .with_reply_to(reply_queue.into())
                .with_correlation_id(id.into());
            confirms.push(
                ch.basic_publish(
                    amqp::EXCHANGE.into(),
                    "draw".into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &serde_json::to_vec(request).unwrap(),
                    properties,
                )
                .await
                .unwrap(),
            );
        }
        for confirm in confirms {
            let confirm = confirm.await.unwrap();
            assert!(confirm.is_ack() && confirm.take_message().is_none());
        }
    }

    // Stop mid-stream, with draws in hand and more queued.
    wait_answered(&replies, DRAWS / 10, Duration::from_secs(60)).await;
    env.stop_workers().await;
    let at_stop = answered(&replies);
    // Draws still queued after the stop: the worker stopped with a full
    // prefetch window of them in hand.
    let left = env.queue_depth(amqp::DRAW.queue).await;
    assert!(
        left > 0,
        "every draw was taken before the stop: nothing was in flight"
    );

    env.start_fleet().await;
    wait_answered(&replies, DRAWS, Duration::from_secs(120)).await;
    let elapsed = started.elapsed();

    // What the replies promise, the ledger pays.
    let (rewards, prizes) = {
        let replies = replies.lock().unwrap();
        replies.values().fold((0i64, 0u64), |(r, p), answers| {
            let first = &answers[0];
            assert_eq!(first["status"], "ok", "{first}");
            (
                r + first["reward"].as_i64().unwrap(),
                p + first["prizes"].as_array().unwrap().len() as u64,
            )
        })
    };
    assert_eq!(env.wait_ledger("mid", rewards).await, rewards);
    let s = env.status("mid").await;
    assert_eq!(s.drawn, prizes);
    assert_eq!(prizes, DRAWS as u64 * u64::from(COUNT));
    assert_eq!(s.stocked, s.drawn + s.in_pool, "{s:?}");

    // Stop again, so that nothing is left in flight, then read every reply
    // the broker holds: the sentinel is queued behind all of them.
    env.stop_workers().await;
    assert_eq!(env.queue_depth(amqp::DRAW.queue).await, 0);
    publish_raw(
        &ch,
        "",
        reply_queue,
        &serde_json::to_vec(&json!(SENTINEL)).unwrap(),
        BasicProperties::default(),
    )
    .await;
    tokio::time::timeout(T, collector).await.unwrap().unwrap();

    let replies = replies.lock().unwrap();
    let twice: Vec<(&String, usize)> = replies
        .iter()
        .filter(|(_, answers)| answers.len() > 1)
        .map(|(id, answers)| (id, answers.len()))
        .collect();
    assert!(
        twice.is_empty(),
        "{} requests answered more than once: {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    assert_eq!(replies.len(), DRAWS);
    for request in &requests {
        assert!(replies.contains_key(request["request_id"].as_str().unwrap()));
    }
    eprintln!(
        "{DRAWS} draws, {at_stop} answered and {left} still queued at the stop, \
         all answered once in {elapsed:?}"
    );
}

fn rabbitmqctl(args: &[&str]) {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A draw whose ledger entry the broker refuses is not answered: it is
/// requeued, and answered once, when its entry is finally confirmed. A reply
/// published alongside the entry would go out on every failed attempt.
#[tokio::test]
async fn a_draw_is_answered_only_once_the_ledger_entry_it_promises_is_confirmed() {
    const DRAWS: usize = 5;
    let mut env = TestEnv::new(&[("DELIVERY_LIMIT", "10000")]).await;
    env.load(&pool_toml("led", "", &[("a", &[(1, 500)])])).await;
    env.start_draw_worker().await;
    let (conn, ch) = channel(&env).await;
    // The settle queue takes nothing more: a quorum queue refuses a publish
    // once it is at its length limit, so it holds one entry (of another
    // pool) and may hold none.
    let filler = prizepool::messages::SettleRequest::new(
        "filler",
        1,
        "coin",
        1,
        "topup",
        json!({"pool": "filler"}),
    );
    publish_raw(
        &ch,
        amqp::EXCHANGE,
        amqp::SETTLE.routing_key,
        &serde_json::to_vec(&filler).unwrap(),
        BasicProperties::default(),
    )
    .await;
    rabbitmqctl(&[
        "set_policy",
        "-p",
        &env.vhost,
        "settle-full",
        "^prizepool\\.settle$",
        r#"{"max-length":0}"#,
        "--apply-to",
        "queues",
    ]);
    let reply_queue = "test.replies";
    ch.queue_declare(
        reply_queue.into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let replies: Replies = Arc::default();
    let collector = tokio::spawn(collect_replies(
        conn.create_channel().await.unwrap(),
        reply_queue,
        replies.clone(),
    ));
    let requests: Vec<Value> = (0..DRAWS).map(|i| draw("led", i as i64, 2)).collect();
    for request in &requests {
        let properties = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_reply_to(reply_queue.into())
            .with_correlation_id(request["request_id"].as_str().unwrap().into());
        publish_raw(
            &ch,
            amqp::EXCHANGE,
            "draw",
            &serde_json::to_vec(request).unwrap(),
            properties,
        )
        .await;
    }
    // Every draw took its prizes...
    let deadline = Instant::now() + T;
    while env.status("led").await.drawn < (DRAWS * 2) as u64 {
        assert!(Instant::now() < deadline, "the draws did not run");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and keeps failing to publish its ledger entry for a while (each
    // failed attempt would have answered, were the reply not last).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.queue_depth(amqp::SETTLE.queue).await, 1);
    assert_eq!(
        answered(&replies),
        0,
        "answered before the ledger took the entry"
    );

    // The requeued draws spin through the worker as fast as the broker
    // redelivers them; stop it, let the ledger take entries again, and
    // start over.
    env.stop_workers().await;
    assert_eq!(answered(&replies), 0, "answered while stopping");
    rabbitmqctl(&["clear_policy", "-p", &env.vhost, "settle-full"]);
    env.start_draw_worker().await;
    env.start_settle_worker().await;
    wait_answered(&replies, DRAWS, T).await;
    let rewards: i64 = replies
        .lock()
        .unwrap()
        .values()
        .map(|answers| answers[0]["reward"].as_i64().unwrap())
        .sum();
    assert_eq!(rewards, (DRAWS * 2 * 10) as i64);
    assert_eq!(env.wait_ledger("led", rewards).await, rewards);
    env.stop_workers().await;
    assert_eq!(env.status("led").await.drawn, (DRAWS * 2) as u64);

    publish_raw(
        &ch,
        "",
        reply_queue,
        &serde_json::to_vec(&json!(SENTINEL)).unwrap(),
        BasicProperties::default(),
    )
    .await;
    tokio::time::timeout(T, collector).await.unwrap().unwrap();
    for (id, answers) in replies.lock().unwrap().iter() {
        assert_eq!(answers.len(), 1, "{id} answered {} times", answers.len());
    }
}

fn is_transient(e: impl Into<HandleError>) -> bool {
    match e.into() {
        HandleError::Transient(_) => true,
        HandleError::Internal(_) => false,
        HandleError::Invalid(invalid) => panic!("a server error is not bad input: {invalid}"),
    }
}

/// The classification of errors as a live Redis and Postgres raise them.
#[tokio::test]
async fn server_errors_are_classified_as_they_arrive() {
    let env = TestEnv::new(&[]).await;
    let mut redis = env.redis.clone();
    // A script that fails fails again: internal.
    for script in [
        "return error('boom')",
        "return redis.error_reply('BADPOOL corrupt')",
        "return redis.call('INCR', KEYS[1])",
    ] {
        let key = format!("{}:{{classify}}:text", env.config.redis_prefix);
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg("not a number")
            .query_async(&mut redis)
            .await
            .unwrap();
        let e = prizepool::scripts::Script::new(script)
            .key(&key)
            .invoke_async::<i64>(&mut redis)
            .await
            .unwrap_err();
        assert!(!is_transient(e), "{script}");
    }
    // A reply of the wrong shape: internal.
    let e = redis::cmd("PING")
        .query_async::<i64>(&mut redis)
        .await
        .unwrap_err();
    assert!(!is_transient(e));
    // Nobody listening: transient.
    let port = common::free_port();
    let e = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_err();
    assert!(is_transient(e));

    // Postgres: a statement that fails fails again; a connection that
    // cannot be made, or is cut, may work later.
    for sql in [
        "SELECT 1 / 0",
        "SELECT * FROM no_such_table",
        "INSERT INTO ledger_entries (entry_id) VALUES (NULL)",
    ] {
        let e = sqlx::query(sql).execute(&env.db).await.unwrap_err();
        assert!(!is_transient(e), "{sql}");
    }
    let e = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect(&format!("postgres://postgres@127.0.0.1:{port}/test"))
        .await
        .unwrap_err();
    assert!(is_transient(e));
    // The administrator ends the session (SQLSTATE 57P01).
    let mut conn = sqlx::Connection::connect(&env.config.database_url)
        .await
        .map(|c: sqlx::PgConnection| c)
        .unwrap();
    let (pid,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let _: (bool,) = sqlx::query_as("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&env.db)
        .await
        .unwrap();
    let e = sqlx::query("SELECT 1")
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(is_transient(e));
}
