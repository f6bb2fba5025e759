//! A fresh-eyed review: attacks over the wire contract (and a few faults)
//! that still break an invariant of the fleet. Each test names the property
//! it proves and fails while the hole is open.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{activity_toml, eventually, raw::Raw, TestEnv};
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn draw_as(request_id: &str, pool: &str, user: i64, count: u32) -> Value {
    json!({"type": "draw", "request_id": request_id, "pool": pool, "user_id": user, "count": count})
}

fn create(packet: &str, sender: i64, total: i64, count: i64, min: i64, expires_in_s: i64) -> Value {
    json!({"type": "redpacket.create", "packet_id": packet, "sender": sender, "total": total,
           "count": count, "min": min, "expires_in_s": expires_in_s})
}

fn code(reply: &Value) -> &str {
    reply["error"]["code"].as_str().unwrap_or("")
}

/// Credits `amount` coins to `account` straight in the ledger.
async fn coins(env: &TestEnv, account: i64) -> i64 {
    prizepool::settle::balances(&env.db, account)
        .await
        .unwrap()
        .into_iter()
        .find(|b| b.asset == "coin")
        .map_or(0, |b| b.balance)
}

// ---------------------------------------------------------------------------
// Red packets
// ---------------------------------------------------------------------------

/// docs/protocol.md, redpacket.create: "Idempotent by `packet_id`: a repeat
/// returns the first result", and SPEC §7: "the first answer is the
/// result, rejections included". A create answered `insufficient_funds` is
/// not remembered: the same request sent again (a redelivery, or an
/// upstream retrying after telling its user "no") once the sender holds
/// enough escrows the sender's money and answers `ok`: two answers for one
/// packet id, and money moved after the requester was told nothing moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_create_refused_for_funds_stays_refused_and_moves_nothing_later() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 500).await;
    let req = create("rp-short", 7, 1_000, 5, 1, 3600);
    let first = client.call("refill", &req, T).await.unwrap();
    assert_eq!(code(&first), "insufficient_funds", "{first}");
    // The sender is paid in later (an unrelated top-up).
    env.fund(7, 1_000).await;
    let again = client.call("refill", &req, T).await.unwrap();
    assert_eq!(
        again["status"], first["status"],
        "one packet id, two answers: first {first}, then {again}"
    );
    assert_eq!(
        coins(&env, 7).await,
        1_500,
        "the sender was told `insufficient_funds`, yet the same request escrowed their money later"
    );
}

/// docs/protocol.md, "Who may publish what": a `redpacket.expire` is
/// internal and "an early one closes nothing and is delayed again". Every
/// forged early expiry is delayed again on its own: N forgeries become N
/// expiry messages cycling through the delay queues until the packet's
/// expiry (a 30-day packet hops through the 6 h queue ~120 times, each hop a
/// refill-queue delivery and a Postgres read), then N closes and N refund
/// publications. One upstream message buys the fleet unbounded work: a
/// packet must have one pending expiry, whatever is forged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_early_expiries_do_not_multiply_pending_expiries() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 10_000).await;
    let reply = client
        .call("refill", &create("rp-amp", 7, 1_000, 5, 1, 3 * 3600), T)
        .await
        .unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    let delayed = || async {
        let mut n = 0;
        for q in ["1s", "10s", "1m", "10m", "1h", "6h"] {
            n += env.queue_depth(&format!("prizepool.delay.{q}")).await;
        }
        n
    };
    let before = delayed().await;
    assert_eq!(before, 1, "the create schedules one expiry");
    let forged = 40;
    for _ in 0..forged {
        client
            .send(
                "refill",
                &json!({"type": "redpacket.expire", "packet_id": "rp-amp"}),
            )
            .await
            .unwrap();
    }
    // Let the refill worker take every forgery.
    let deadline = tokio::time::Instant::now() + T;
    while env.queue_depth("prizepool.refill").await > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = delayed().await;
    assert!(
        after <= 2,
        "{forged} forged early expiries left {after} expiry messages cycling through the delay queues (1 before)"
    );
}

// ---------------------------------------------------------------------------
// Settlement
// ---------------------------------------------------------------------------

/// SPEC §7 / protocol "Exactly one reply": "A dead letter is likewise
/// confirmed before its `rejected` reply" and the request is acked after.
/// The settle worker dead-letters and answers a bad message of a batch
/// before it books the batch, and acks the batch only after the booking:
/// a stop while Postgres is away (the booking keeps retrying, then gives up
/// on shutdown) leaves the bad message unacked, so after the restart it is
/// dead-lettered and answered a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_settle_message_is_answered_and_dead_lettered_once_across_a_stop_during_an_outage() {
    let mut env = TestEnv::new(&[]).await;
    // A settle worker whose database is away, batching for long enough to
    // take both messages in one batch.
    let mut away = env.config.clone();
    away.database_url = "postgres://postgres@127.0.0.1:1/nowhere".into();
    away.settle_batch_wait = Duration::from_millis(1_000);
    let stop = tokio_util::sync::CancellationToken::new();
    let health = prizepool::ops::Health::default();
    let worker = tokio::spawn(prizepool::settle::run(away, health.clone(), stop.clone()));
    let deadline = tokio::time::Instant::now() + T;
    while !health.is_ready() {
        assert!(tokio::time::Instant::now() < deadline, "worker not ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let raw = Raw::new(&env).await;
    raw.publish_all(&[
        ("settle", b"{not json".to_vec(), "bad".to_owned()),
        (
            "settle",
            serde_json::to_vec(
                &json!({"type": "settle", "entry_id": "topup:once", "account": 5,
                "asset": "coin", "amount": 100, "reason": "topup"}),
            )
            .unwrap(),
            "good".to_owned(),
        ),
    ])
    .await;
    let first = raw.reply("bad").await;
    assert_eq!(code(&first), "invalid_request", "{first}");
    // The good entry waits for the database; the worker is stopped.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.cancel();
    let _ = worker.await;
    // A worker with the database back.
    env.start_settle_worker().await;
    let good = raw.reply("good").await;
    assert_eq!(good["status"], "ok", "{good}");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let answers = raw.replies_to("bad");
    let dead = env.queue_depth("prizepool.settle.dlq").await;
    assert_eq!(
        (answers.len(), dead),
        (1, 1),
        "one bad message: {} replies {answers:?} and {dead} dead letters",
        answers.len()
    );
}

/// The settle lag gauge (`prizepool_settle_lag_seconds`, alerting above 60 s
/// in deploy/prometheus/alerts.yml) is the age of the oldest message of a
/// batch by its AMQP `timestamp`, which the publisher sets: one upstream
/// top-up stamped `timestamp: 0` reports a lag of 56 years and pages the
/// operators. The lag should come from the worker's own stamp (or ignore
/// stamps it cannot trust, e.g. from the future or before the worker began).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_timestamp_cannot_fake_the_settle_lag() {
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
    let raw = Raw::new(&env).await;
    let body = serde_json::to_vec(&json!({"type": "settle", "entry_id": "topup:stamp",
        "account": 5, "asset": "coin", "amount": 100, "reason": "topup"}))
    .unwrap();
    // Wait for the worker's queue, then publish with a forged stamp.
    let deadline = tokio::time::Instant::now() + T;
    while metrics_text(&addr).await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no metrics endpoint"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    raw.publish("settle", &body, raw.props("stamp").with_timestamp(0))
        .await;
    let reply = raw.reply("stamp").await;
    assert_eq!(reply["status"], "ok", "{reply}");
    let text = metrics_text(&addr).await;
    let lag: f64 = text
        .lines()
        .find(|l| l.starts_with("prizepool_settle_lag_seconds"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0);
    assert!(
        (0.0..60.0).contains(&lag),
        "a settle that waited under a second shows a lag of {lag} s (alert threshold 60 s)"
    );
}

/// While the ledger is away the settle lag keeps growing on the gauge (it
/// was set only when a batch arrived, so a stall froze the last figure and
/// the lag alert never fired), and falls back once the batch is booked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_settle_lag_grows_while_the_ledger_is_away() {
    let pg = common::PrivatePostgres::init();
    pg.start();
    let url = pg.url();
    let env = TestEnv::new(&[("DATABASE_URL", &url)]).await;
    let addr = format!("127.0.0.1:{}", common::free_port());
    let _worker = common::KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_settle-worker"))
            .envs(env.env())
            .env("METRICS_ADDR", &addr)
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let lag = || async {
        metrics_text(&addr)
            .await
            .lines()
            .find(|l| l.starts_with("prizepool_settle_lag_seconds"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let deadline = tokio::time::Instant::now() + T;
    while lag().await.is_none() {
        assert!(tokio::time::Instant::now() < deadline, "no lag gauge");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    pg.stop();
    let raw = Raw::new(&env).await;
    let body = serde_json::to_vec(&json!({"type": "settle", "entry_id": "topup:stall",
        "account": 6, "asset": "coin", "amount": 100, "reason": "topup"}))
    .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    raw.publish("settle", &body, raw.props("stall").with_timestamp(now))
        .await;
    // The batch waits for Postgres; its lag climbs second by second.
    eventually(T, || async {
        match lag().await.unwrap_or(-1.0) {
            seen if seen >= 4.0 => Ok(()),
            seen => Err(format!(
                "the lag stayed at {seen} s while the ledger was away"
            )),
        }
    })
    .await;
    pg.start();
    let reply = raw.reply("stall").await;
    assert_eq!(reply["status"], "ok", "{reply}");
    // Booked, and nothing else waits: the lag the outage left goes back to
    // 0 instead of staying on the gauge (and its alert firing).
    eventually(T, || async {
        let seen = lag().await.unwrap_or(-1.0);
        (seen == 0.0)
            .then_some(())
            .ok_or_else(|| format!("the lag stayed at {seen} s after the ledger caught up"))
    })
    .await;
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

// ---------------------------------------------------------------------------
// Lottery
// ---------------------------------------------------------------------------

/// SPEC §7: a redelivered request "returns its first result". A
/// `lottery.grant` sent again answers with the user's chances *now*
/// (`lua/grant_chances.lua` reads the chances hash on a replay), not the
/// answer it first gave: after one draw the same grant id says
/// `chances_left: 2` where it first said 3, so an upstream reconciling by
/// grant id sees one grant with two different outcomes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_sent_again_replays_its_first_answer() {
    let mut env = TestEnv::new(&[]).await;
    let now = chrono::Utc::now();
    env.load_activities(&activity_toml(
        "act-replay",
        now - chrono::Duration::hours(1),
        now + chrono::Duration::hours(1),
        r#"{ id = "cup", weight = 1, stock = 10 }"#,
    ))
    .await;
    env.start_fleet().await;
    let client = env.client().await;
    let grant = json!({"type": "lottery.grant", "grant_id": "g-replay", "activity": "act-replay",
                       "user_id": 9, "chances": 3});
    let first = client.call("draw", &grant, T).await.unwrap();
    assert_eq!(first["status"], "ok", "{first}");
    let drew = client
        .call("draw", &draw_as("d-replay", "act-replay", 9, 1), T)
        .await
        .unwrap();
    assert_eq!(drew["status"], "ok", "{drew}");
    let again = client.call("draw", &grant, T).await.unwrap();
    assert_eq!(
        again, first,
        "one grant id, two answers: first {first}, then {again}"
    );
}

/// The `redpacket_result` promises `expires_at` in whole seconds, cut down
/// (`wire_time` truncates), while the packet really closes at the stored
/// instant with its fraction: a grab made after the answer's `expires_at`
/// still takes a share (up to a second after the promised close). The
/// promised instant must not be earlier than the real one (round up, or
/// store the expiry in whole seconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_share_is_grabbed_after_the_expiry_the_create_answered() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 100_000).await;
    let mut late_grabs = Vec::new();
    for n in 0..3 {
        let id = format!("rp-late-{n}");
        let reply = client
            .call("refill", &create(&id, 7, 1_000, 10, 1, 2), T)
            .await
            .unwrap();
        assert_eq!(reply["status"], "ok", "{reply}");
        let promised: chrono::DateTime<chrono::Utc> =
            reply["expires_at"].as_str().unwrap().parse().unwrap();
        // Wait until the promised expiry has passed, then grab.
        let wait = (promised - chrono::Utc::now()).num_milliseconds() + 20;
        if wait > 0 {
            tokio::time::sleep(Duration::from_millis(wait.unsigned_abs())).await;
        }
        let grab = client
            .call("draw", &draw_as(&format!("late-{n}"), &id, 100 + n, 1), T)
            .await
            .unwrap();
        if grab["status"] == "ok" {
            late_grabs.push((promised.to_rfc3339(), grab));
        }
    }
    assert!(
        late_grabs.is_empty(),
        "shares were grabbed after the expiry the create answered: {late_grabs:?}"
    );
}

/// Fault: Redis loses a packet's keys (a restart or failover without
/// `appendfsync always`, which docs/design.md says costs "a second of
/// steps", or an eviction). A later `redpacket.create` sent again with the
/// same content (an upstream retrying a lost reply) stocks the packet again
/// from Postgres with *every* share, the ones already grabbed and paid
/// included: `existing()` cannot tell "never stocked" from "stocked, then
/// lost", so the escrow pays its shares twice. A packet stocked once must
/// never be stocked again (record the stocking in Postgres with the packet).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_create_sent_again_after_redis_lost_the_packet_never_pays_a_share_twice() {
    let mut env = TestEnv::new(&[]).await;
    env.start_fleet().await;
    let client = env.client().await;
    env.fund(7, 10_000).await;
    let req = create("rp-lost", 7, 1_000, 4, 1, 3600);
    let reply = client.call("refill", &req, T).await.unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    for u in 0..4 {
        let r = client
            .call(
                "draw",
                &draw_as(&format!("lost-a{u}"), "rp-lost", 100 + u, 1),
                T,
            )
            .await
            .unwrap();
        assert_eq!(r["status"], "ok", "{r}");
    }
    // Redis loses the packet (its keys gone as after a lossy restart).
    let keys = env.keys("rp-lost");
    let mut redis = env.redis.clone();
    let _: i64 = redis::cmd("DEL")
        .arg(keys.meta())
        .arg(keys.shares())
        .arg(keys.grabbed())
        .query_async(&mut redis)
        .await
        .unwrap();
    // The upstream sends its create again.
    let again = client.call("refill", &req, T).await.unwrap();
    assert_eq!(again["status"], "ok", "{again}");
    let mut paid_again = 0;
    for u in 0..4 {
        let r = client
            .call(
                "draw",
                &draw_as(&format!("lost-b{u}"), "rp-lost", 200 + u, 1),
                T,
            )
            .await
            .unwrap();
        paid_again += r["reward"].as_i64().unwrap_or(0);
    }
    assert_eq!(
        paid_again, 0,
        "the packet's 1000 were grabbed and paid, then the create sent again restocked it and paid {paid_again} more"
    );
}
