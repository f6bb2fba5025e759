//! Every reply and every `draw.completed` event of a lucky-gift draw fits
//! one message, however many jackpots the draw holds back or takes from
//! the parked ones, and whatever the prizes of earlier config versions
//! still in the pool: the fairness record is bounded by construction
//! (`docs/fairness.md`), and the pool loader bounds the rest. All over the
//! wire, through a fleet of draw, refill and settle workers with the audit
//! consumer, with 128-byte request ids of JSON-escaped characters and a
//! pool name of the longest length.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::TestEnv;
use futures_util::StreamExt;
use prizepool::{
    audit,
    messages::{DrawResult, Status, MAX_ID_LEN, MAX_MESSAGE_BYTES},
};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// A request id of exactly 128 bytes, numbered `n`, made of the characters
/// JSON escapes (`"` and `\`), so it takes twice its length in a body.
fn escaped_id(n: usize) -> String {
    let mut id = format!("{n:06}");
    while id.len() < MAX_ID_LEN {
        id.push(if id.len() % 2 == 0 { '"' } else { '\\' });
    }
    id
}

/// A pool name of the longest length a name may have.
fn long_pool(tag: &str) -> String {
    let head = format!("jackpots-{tag}-");
    format!("{head}{}", "x".repeat(MAX_ID_LEN - head.len()))
}

/// A pool of 14,000 prizes a batch whose jackpots (5000 and 7000) are gated
/// until the day's consumption reaches `threshold`: a combo of 9,000
/// jackpots in a row, a combo where jackpots and plain prizes alternate at
/// random, and a combo of plain prizes; 3,000 prizes of a batch are not
/// jackpots.
fn jackpot_pool(id: &str, storage: &str, threshold: i64) -> String {
    format!(
        "[[pools]]\nid = \"{id}\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = 10000\n\
         refill_at = 0.5\nstorage = \"{storage}\"\n\
         jackpot = {{ min_multiplier = 5000, daily_consumption_threshold = {threshold} }}\n\
         [[pools.combos]]\nid = \"row\"\nstock = {{ \"5000\" = 9000 }}\n\
         [[pools.combos]]\nid = \"mixed\"\nstock = {{ \"1\" = 2000, \"7000\" = 2000 }}\n\
         [[pools.combos]]\nid = \"plain\"\nstock = {{ \"2\" = 1000 }}\n"
    )
}

fn draw_body(request_id: &str, pool: &str, user: i64, count: u32) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "type": "draw", "request_id": request_id, "pool": pool, "user_id": user, "count": count,
    }))
    .unwrap()
}

/// Waits until the audit consumer listens on its queue.
async fn wait_for_audit_consumer(env: &TestEnv) {
    common::eventually(T, || async {
        let n = env.consumers(audit::ROUTE.queue).await;
        (n > 0).then_some(()).ok_or(format!("{n} audit consumers"))
    })
    .await;
}

/// The draws of one test: every reply's size, and what the replies promise.
#[derive(Default)]
struct Drawn {
    replies: Vec<usize>,
    ok: i64,
    promised: i64,
    held_back: u64,
    taken_from_held: usize,
}

impl Drawn {
    /// Draws `count` prizes for `user` with a fresh escaped id; checks the
    /// reply's size and keeps what it promises.
    async fn draw(
        &mut self,
        rpc: &prizepool::amqp::rpc::RpcClient,
        pool: &str,
        user: i64,
        count: u32,
    ) -> DrawResult {
        let id = escaped_id(self.replies.len());
        let reply = rpc
            .request("draw", &draw_body(&id, pool, user, count), T)
            .await
            .unwrap();
        self.replies.push(reply.len());
        assert!(
            reply.len() <= MAX_MESSAGE_BYTES,
            "a reply of {} bytes to a draw of {count}",
            reply.len()
        );
        let mut result: DrawResult = serde_json::from_slice(&reply).unwrap();
        assert_eq!(result.status, Status::Ok, "{result:?}");
        assert_eq!(result.request_id, id);
        result.expand_prizes().unwrap();
        assert_eq!(result.prizes.len(), count as usize);
        self.ok += 1;
        self.promised += result.reward.unwrap();
        self.held_back += result.positions.iter().map(|r| r.held_back).sum::<u64>();
        result
    }
}

/// The worst a gated pool does to its records, end to end: twelve draws of
/// one prize meet the 9,000 jackpots in a row and the alternating ones and
/// hold them all back; then the gate opens and draws take the parked
/// jackpots back out, at most 32 runs of them a draw, until none waits.
/// Every reply and every sealed event fits 64 KiB, the ledger pays what
/// the replies promise, the audit trail records every draw and verifies
/// every position of the first batch (drawn, held back, then drawn), and no
/// dead-letter queue holds anything.
async fn gated_draws_publish_bounded_records(storage: &str) {
    let mut env = TestEnv::new(&[("DRAW_EVENTS", "each")]).await;
    let pool = long_pool(storage);
    // Gated for the first 3,001 prizes (a batch's plain ones and one more),
    // open from the draw of 10,000 that follows.
    env.load(&jackpot_pool(&pool, storage, 13_001)).await;
    env.start_fleet().await;
    wait_for_audit_consumer(&env).await;
    let (_events_conn, mut events) = env.listen("draw.completed").await;
    let rpc = env.client().await;
    let mut drawn = Drawn::default();

    // Gated: every jackpot met is held back, the record names the rule.
    for user in 0..12 {
        let r = drawn.draw(&rpc, &pool, user, 1).await;
        assert!(r.held_back.is_empty(), "{r:?}");
    }
    // The plain prizes of the first batch, then one of the next batch: the
    // draws read every jackpot of the first batch, whatever its order.
    for count in [1000, 1000, 988, 1] {
        let r = drawn.draw(&rpc, &pool, 20, count).await;
        // A retry replays the identical answer from its stored form.
        let again = rpc
            .request("draw", &draw_body(&r.request_id, &pool, 20, count), T)
            .await
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<DrawResult>(&again)
                .map(|mut a| {
                    a.expand_prizes().unwrap();
                    a
                })
                .unwrap(),
            r
        );
        let jackpots = r.prizes.iter().any(|p| {
            matches!(p, prizepool::messages::Prize::Multiplier { multiplier, .. } if *multiplier >= 5000)
        });
        assert!(!jackpots, "a gated draw wins no jackpot: {r:?}");
    }
    let status = env.status(&pool).await;
    eprintln!(
        "gated: {} jackpots held back, {} waiting",
        drawn.held_back, status.held_jackpots
    );
    assert!(status.held_jackpots >= 11_000, "{status:?}");
    assert_eq!(drawn.held_back, status.held_jackpots);

    // Open: the parked jackpots come first, 32 runs of them a draw at most.
    common::eventually(T, || async {
        let status = env.status(&pool).await;
        (status.generation >= 2)
            .then_some(())
            .ok_or(format!("{status:?}"))
    })
    .await;
    let mut waiting = status.held_jackpots;
    let first = drawn.draw(&rpc, &pool, 30, 10_000).await;
    assert!(first.revealed.len() <= 40);
    for round in 0.. {
        let status = env.status(&pool).await;
        assert!(status.held_jackpots < waiting || round == 0, "{status:?}");
        drawn.taken_from_held += (waiting - status.held_jackpots) as usize;
        waiting = status.held_jackpots;
        if waiting == 0 {
            break;
        }
        assert!(round < 400, "parked jackpots still waiting: {status:?}");
        let count = waiting.min(500) as u32;
        drawn.draw(&rpc, &pool, 40 + round, count).await;
    }
    eprintln!(
        "{} jackpots taken back out in {} draws",
        drawn.taken_from_held,
        drawn.replies.len() - 17
    );

    // Every event fits and is sealed.
    let mut largest_event = 0;
    for _ in 0..drawn.ok {
        let delivery = tokio::time::timeout(T, events.next())
            .await
            .expect("a draw.completed event for every draw")
            .unwrap()
            .unwrap();
        assert!(
            delivery.data.len() <= MAX_MESSAGE_BYTES,
            "an event of {} bytes",
            delivery.data.len()
        );
        largest_event = largest_event.max(delivery.data.len());
        let event: Value = serde_json::from_slice(&delivery.data).unwrap();
        assert!(event["seal"].is_string(), "{event}");
    }
    eprintln!(
        "{} draws: largest reply {} bytes, largest event {largest_event} bytes",
        drawn.ok,
        drawn.replies.iter().max().unwrap()
    );

    // The ledger pays what the replies promised; conservation holds.
    assert_eq!(env.wait_ledger(&pool, drawn.promised).await, drawn.promised);
    let status = env.status(&pool).await;
    assert_eq!(status.stocked, status.drawn + status.in_pool, "{status:?}");

    // The trail records every draw and verifies the first batch whole.
    common::eventually(T, || async {
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM fair_draws WHERE pool = $1")
            .bind(&pool)
            .fetch_one(&env.db)
            .await
            .unwrap();
        (n == drawn.ok)
            .then_some(())
            .ok_or(format!("{n} of {} draws recorded", drawn.ok))
    })
    .await;
    let verdict = audit::verify(&env.db, &pool, None).await.unwrap();
    assert!(verdict.ok, "{verdict:?}");
    let first = &verdict.batches[0];
    assert_eq!((first.generation, first.status), (1, "ok"), "{first:?}");
    assert!(first.complete, "{first:?}");
    assert_eq!(first.prizes_checked, 14_000, "{first:?}");
    let out = env.cli(&["audit", "verify", &pool]).await;
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    for queue in [
        "prizepool.draw.dlq",
        "prizepool.refill.dlq",
        "prizepool.settle.dlq",
        audit::ROUTE.dlq,
    ] {
        assert_eq!(env.queue_depth(queue).await, 0, "{queue}");
    }
    rpc.close().await;
    env.stop_workers().await;
}

#[tokio::test]
async fn gated_draws_publish_bounded_records_in_list_storage() {
    gated_draws_publish_bounded_records("list").await;
}

#[tokio::test]
async fn gated_draws_publish_bounded_records_in_sparse_storage() {
    gated_draws_publish_bounded_records("sparse").await;
}

/// A combo id of 64 bytes, numbered `n`.
fn long_combo(n: usize) -> String {
    format!("{n:0>64}")
}

/// A new version is bounded over the prizes of the versions before it: a
/// pool first loaded with many long combo ids, then reloaded with one
/// short combo and `max_count = 10000`, would let a draw of 10,000 cross
/// the first version's batch still in the pool and answer past 64 KiB.
/// The reload is refused, naming how many prizes fit; with that many it
/// loads, and a draw of that many across both versions' batches fits.
#[tokio::test]
async fn a_reload_is_bounded_over_the_prizes_still_in_the_pool() {
    let mut env = TestEnv::new(&[("DRAW_EVENTS", "each")]).await;
    let pool = long_pool("versions");
    let mut v1 = format!(
        "[[pools]]\nid = \"{pool}\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = 100\n"
    );
    for n in 0..80 {
        v1.push_str(&format!(
            "[[pools.combos]]\nid = \"{}\"\nstock = {{ \"0\" = 10, \"1\" = 1, \"2\" = 1, \"3\" = 1, \"4\" = 1 }}\n",
            long_combo(n)
        ));
    }
    env.load(&v1).await;
    let v2 = |max_count: u32| {
        format!(
            "[[pools]]\nid = \"{pool}\"\nkind = \"lucky_gift\"\nunit_price = 1\nmax_count = {max_count}\n\
             [[pools.combos]]\nid = \"c\"\nstock = {{ \"0\" = 5000, \"1\" = 5000 }}\n"
        )
    };
    let configs = prizepool::kinds::lucky_gift::parse_file(&v2(10_000))
        .expect("the new version is fine on its own");
    let e = format!("{:#}", env.try_load(&configs).await.unwrap_err());
    assert!(
        e.contains("earlier versions") && e.contains("at most"),
        "{e}"
    );
    let fits: u32 = e
        .rsplit("at most ")
        .next()
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    eprintln!("the reload refused: {e}");
    env.load(&v2(fits)).await;

    env.start_fleet().await;
    wait_for_audit_consumer(&env).await;
    let (_events_conn, mut events) = env.listen("draw.completed").await;
    let rpc = env.client().await;
    let mut drawn = Drawn::default();
    // The first version's batch (1,120 prizes of 400 kinds) is still in
    // the pool: the draw takes all of it and the rest from the second.
    let r = drawn.draw(&rpc, &pool, 7, fits).await;
    let versions: std::collections::BTreeSet<usize> = r
        .prizes
        .iter()
        .map(|p| match p {
            prizepool::messages::Prize::Multiplier { combo, .. } => combo.len(),
            _ => 0,
        })
        .collect();
    assert!(
        versions.contains(&64) && versions.contains(&1),
        "{versions:?}"
    );
    let delivery = tokio::time::timeout(T, events.next())
        .await
        .expect("the draw's event")
        .unwrap()
        .unwrap();
    eprintln!(
        "a draw of {fits} across both versions: reply {} bytes, event {} bytes",
        drawn.replies[0],
        delivery.data.len()
    );
    assert!(delivery.data.len() <= MAX_MESSAGE_BYTES);
    assert_eq!(env.wait_ledger(&pool, drawn.promised).await, drawn.promised);
    rpc.close().await;
    env.stop_workers().await;
}
