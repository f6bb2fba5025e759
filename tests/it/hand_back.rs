//! A dependency that is away holds no worker hostage: a delivery whose
//! transient failure outlasts its short retry in its slot is handed back to
//! the broker through its queue's retry queue, and deliveries of one lane
//! (red-packet creates and expiries, which need Postgres) hold at most half
//! of the worker's slots. Unrelated work goes on; the handed-back requests
//! are answered once, when their dependency is back; nothing is
//! dead-lettered.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use common::{pool_toml, raw::Raw, redis_cluster::RedisCluster, PrivatePostgres, TestEnv};
use serde_json::{json, Value};

/// One combo of 640 prizes a batch, so a few hundred draws need refills.
const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

const SENDER: i64 = 7;

/// Waits until every id of `ids` has a reply, or `within` is over.
async fn answered(raw: &Raw, ids: &[String], within: Duration) -> HashMap<String, Vec<Value>> {
    let deadline = Instant::now() + within;
    loop {
        let replies = raw.by_id();
        if ids.iter().all(|id| replies.contains_key(id)) || Instant::now() > deadline {
            return replies;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Postgres stopped with many red-packet creates in flight, more than the
/// refill worker has slots: lucky-gift refills (no Postgres needed) go on
/// beside them, so draws that empty batch after batch are all awarded (none
/// stores `pool_exhausted` for want of a refill). Once Postgres is back
/// every create is answered, once, and no queue dead-lettered anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_with_red_packet_creates_in_flight_starves_no_refill() {
    const CREATES: usize = 60;
    const DRAWS: usize = 400;
    let pg = PrivatePostgres::init();
    pg.start();
    let url = pg.url();
    let mut env = TestEnv::new(&[
        ("DATABASE_URL", &url),
        // Fewer slots than creates: before the hand-back, the creates'
        // retries held every slot of the refill worker.
        ("CONCURRENCY", "8"),
        ("SHORT_POOL_WAIT_MS", "3000"),
    ])
    .await;
    env.load(&pool_toml("lanes", "max_count = 10", GIFT)).await;
    env.fund(SENDER, 1_000_000).await;
    env.start_fleet().await;
    let raw = Raw::new(&env).await;

    pg.stop();
    let outage = Instant::now();
    let creates: Vec<(&str, Vec<u8>, String)> = (0..CREATES)
        .map(|i| {
            let id = format!("rp-{i}");
            let body = json!({"type": "redpacket.create", "packet_id": id, "sender": SENDER,
                              "total": 100, "count": 4, "min": 1, "expires_in_s": 3600});
            ("refill", serde_json::to_vec(&body).unwrap(), id)
        })
        .collect();
    raw.publish_all(&creates).await;
    // The creates are in the refill worker's hands (and failing) before
    // the draws begin.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let generation = env.status("lanes").await.generation;
    let draws: Vec<(&str, Vec<u8>, String)> = (0..DRAWS)
        .map(|i| {
            let id = format!("d-{i}");
            let body = json!({"type": "draw", "request_id": id, "pool": "lanes",
                              "user_id": 1 + i as i64, "count": 5});
            ("draw", serde_json::to_vec(&body).unwrap(), id)
        })
        .collect();
    let draw_ids: Vec<String> = draws.iter().map(|(_, _, id)| id.clone()).collect();
    let began = Instant::now();
    raw.publish_all(&draws).await;
    let replies = answered(&raw, &draw_ids, Duration::from_secs(60)).await;
    let took = began.elapsed();
    let refills = env.status("lanes").await.generation - generation;
    eprintln!(
        "{DRAWS} draws of 5 answered in {took:?} while Postgres was down, with {refills} refills \
         beside {CREATES} failing creates"
    );
    assert!(
        draw_ids.iter().all(|id| replies.contains_key(id)),
        "every draw answered while Postgres was down"
    );
    let exhausted = draw_ids
        .iter()
        .filter(|id| replies[*id][0]["error"]["code"] == "pool_exhausted")
        .count();
    assert_eq!(exhausted, 0, "no draw waited in vain for a refill");
    assert!(
        draw_ids.iter().all(|id| replies[id][0]["status"] == "ok"),
        "every draw awarded"
    );
    assert!(refills >= 3, "refills ran during the outage ({refills})");
    let create_ids: Vec<String> = creates.iter().map(|(_, _, id)| id.clone()).collect();
    assert!(
        raw.by_id().keys().all(|id| !create_ids.contains(id)),
        "no create answered while Postgres was down"
    );

    pg.start();
    eprintln!("Postgres back after {:?}", outage.elapsed());
    let replies = answered(&raw, &create_ids, Duration::from_secs(120)).await;
    for id in &create_ids {
        let answers = replies.get(id).map_or(0, Vec::len);
        assert_eq!(answers, 1, "{id} answered {answers} times");
        assert_eq!(replies[id][0]["status"], "ok", "{id}: {:?}", replies[id][0]);
    }
    // Late duplicates, had there been any, arrive within this.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let replies = raw.by_id();
    assert!(replies.values().all(|r| r.len() == 1), "one answer each");
    assert_eq!(replies.len(), CREATES + DRAWS);
    for route in [prizepool::amqp::DRAW, prizepool::amqp::REFILL] {
        assert_eq!(env.queue_depth(route.dlq).await, 0, "{}", route.dlq);
    }
    env.stop_workers().await;
}

/// A Redis Cluster master that holds none of a pool's keys killed under a
/// steady flow of draws of that pool. Draws whose request claims live on
/// that master wait for its replica's promotion (the cluster's node
/// timeout), handed back meanwhile; the others keep flowing: the longest
/// stretch without any answer stays far below the failover's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_without_the_pools_keys_stalls_no_draw_of_the_pool() {
    const ROUNDS: usize = 80;
    const PER_ROUND: usize = 25;
    let mut cluster = RedisCluster::start(3, 1).await;
    let mut env = TestEnv::new(&[("REDIS_URL", &cluster.url), ("CONCURRENCY", "32")]).await;
    env.load(&pool_toml("iso", "max_count = 10", GIFT)).await;
    env.start_fleet().await;
    let home = cluster.master_of(cluster.slot(&env.keys("iso").meta()));
    let victim = cluster
        .topology()
        .into_iter()
        .find(|(_, port, master, _)| *master && *port != home)
        .map(|(_, port, _, _)| port)
        .unwrap();
    let raw = Raw::new(&env).await;

    // Answers as they arrive: (when, how many so far).
    let arrivals = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(Instant, usize)>::new()));
    let watching = tokio_util::sync::CancellationToken::new();
    let watcher = {
        let (replies, arrivals, watching) =
            (raw.replies.clone(), arrivals.clone(), watching.clone());
        tokio::spawn(async move {
            let mut seen = 0;
            while !watching.is_cancelled() {
                let now = replies.lock().unwrap().len();
                if now > seen {
                    seen = now;
                    arrivals.lock().unwrap().push((Instant::now(), now));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    // 25 draws every 100 ms for 8 s; the master is killed 2 s in.
    let mut killed_at = None;
    let mut ids = Vec::new();
    let began = Instant::now();
    for round in 0..ROUNDS {
        if round == 20 {
            cluster.kill(victim);
            killed_at = Some(Instant::now());
        }
        let batch: Vec<(&str, Vec<u8>, String)> = (0..PER_ROUND)
            .map(|i| {
                let id = format!("k-{round}-{i}");
                let body = json!({"type": "draw", "request_id": id, "pool": "iso",
                                  "user_id": 1 + (round * PER_ROUND + i) as i64, "count": 1});
                ("draw", serde_json::to_vec(&body).unwrap(), id)
            })
            .collect();
        ids.extend(batch.iter().map(|(_, _, id)| id.clone()));
        raw.publish_all(&batch).await;
        let next = began + Duration::from_millis(100 * (round as u64 + 1));
        tokio::time::sleep_until(next.into()).await;
    }
    let killed_at = killed_at.unwrap();
    let flow_ends = Instant::now();
    let replies = answered(&raw, &ids, Duration::from_secs(60)).await;
    watching.cancel();
    watcher.await.unwrap();
    let all = Instant::now();

    // The longest stretch without an answer while requests kept coming.
    let arrivals = arrivals.lock().unwrap().clone();
    let mut stall = Duration::ZERO;
    let mut last = killed_at;
    for (at, _) in arrivals.iter().filter(|(at, _)| *at > killed_at) {
        if *at > flow_ends {
            break;
        }
        stall = stall.max(at.duration_since(last));
        last = *at;
    }
    stall = stall.max(flow_ends.saturating_duration_since(last));
    eprintln!(
        "master {victim} killed (pool on {home}): the longest stretch without an answer was \
         {stall:?}; all {} answered {:?} after the kill",
        ids.len(),
        all.duration_since(killed_at)
    );
    for id in &ids {
        let answers = replies.get(id).map_or(0, Vec::len);
        assert_eq!(answers, 1, "{id} answered {answers} times");
        assert_eq!(replies[id][0]["status"], "ok", "{id}: {:?}", replies[id][0]);
    }
    // The failover takes about 3 s (node timeout 2 s, then the election);
    // a stall of the pool's draws shorter than a third of it shows that
    // they did not wait for it. Draws are published every 100 ms.
    assert!(
        stall < Duration::from_secs(1),
        "draws of the pool stalled {stall:?}"
    );
    for route in [prizepool::amqp::DRAW, prizepool::amqp::REFILL] {
        assert_eq!(env.queue_depth(route.dlq).await, 0, "{}", route.dlq);
    }
    env.stop_workers().await;
}
