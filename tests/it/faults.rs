//! Faults under load, on servers the tests start themselves: a Postgres
//! stopped while draws flow, and a Redis with AOF killed with SIGKILL and
//! restarted. After each, every request has exactly one final answer, the
//! ledger pays exactly what the answers promised, and conservation holds.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::load::{assert_invariants, draws_through_a_fault, Load};
use common::{
    free_port, node_ctl, pool_toml, redis_server, tempdir, PrivatePostgres, PrivateRabbit, TestEnv,
};
use serde_json::json;

/// One combo of 640 prizes a batch, so refills run all through a test.
const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

/// Postgres stopped for 15 s, seven times the retry budget, while draws
/// flow: draws keep being answered (refills stock from the config kept in
/// Redis), settlement waits and lands once Postgres is back, and nothing is
/// lost, doubled or dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_under_load_loses_and_doubles_nothing() {
    let pg = PrivatePostgres::init();
    pg.start();
    let url = pg.url();
    let mut env = TestEnv::new(&[("DATABASE_URL", &url), ("TRANSIENT_RETRY_MS", "2000")]).await;
    env.load(&pool_toml("pgf", "max_count = 100", GIFT)).await;
    env.start_fleet().await;
    let (n, count) = (1_500, 5);
    let replies = draws_through_a_fault(
        &env,
        Load {
            tag: "f",
            pool: "pgf",
            n,
            count,
            in_flight: 30,
            at: 200,
        },
        || async {
            pg.stop();
            tokio::time::sleep(Duration::from_secs(15)).await;
            pg.start();
        },
    )
    .await;
    assert!(env.status("pgf").await.generation > 10, "refills ran");
    assert_invariants(&env, "pgf", n, count, &replies).await;
    // The fairness trail survived the outage: every batch's commitment is
    // recorded (the refill worker's own record, or its sealed event once
    // Postgres was back), and the audit dead-lettered nothing genuine.
    assert_trail_whole(&env, "pgf").await;
    env.stop_workers().await;
}

/// Every dead-letter queue is empty, and once the audit consumer has
/// caught up, `audit verify` finds every batch of `pool` committed and
/// every revealed one matching its draws.
async fn assert_trail_whole(env: &TestEnv, pool: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let verdict = prizepool::audit::verify(&env.db, pool, None).await.unwrap();
        let generation = env.status(pool).await.generation;
        let recorded = verdict.batches.len() as u64;
        if verdict.ok && recorded >= generation {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{recorded} of {generation} batches recorded: {verdict:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let routes = prizepool::amqp::ROUTES
        .into_iter()
        .chain([prizepool::audit::ROUTE]);
    for route in routes {
        assert_eq!(
            env.queue_depth(route.dlq).await,
            0,
            "{} dead-lettered",
            route.queue
        );
    }
}

/// A Redis with `appendfsync always` killed with SIGKILL under a load that
/// keeps every worker slot busy and restarted on its files: deliveries wait
/// for it, no worker stays wedged (every request is answered), nothing that
/// was answered is lost, nothing is drawn twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_killed_under_load_with_aof_loses_and_doubles_nothing() {
    let dir = tempdir("aof");
    let port = free_port();
    let aof = ["--appendonly", "yes", "--appendfsync", "always"];
    let server = std::sync::Mutex::new(Some(redis_server(port, &dir, &aof)));
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "private redis did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Draws that find the pool short while Redis is away wait for the
    // refill longer than the outage and its reconnection take: this test is
    // about the outage, not about the wait's bound.
    let mut env = TestEnv::new(&[("REDIS_URL", &url), ("SHORT_POOL_WAIT_MS", "15000")]).await;
    env.load(&pool_toml("rf", "max_count = 100", GIFT)).await;
    env.start_fleet().await;
    // More requests in flight than the draw worker has slots
    // (`CONCURRENCY`, 128): every slot is busy when Redis dies, and a
    // backlog waits in the queue.
    let (n, count) = (3_000, 5);
    let replies = draws_through_a_fault(
        &env,
        Load {
            tag: "f",
            pool: "rf",
            n,
            count,
            in_flight: 300,
            at: 600,
        },
        || async {
            // SIGKILL, then the same files again a second later.
            server.lock().unwrap().take();
            tokio::time::sleep(Duration::from_secs(1)).await;
            *server.lock().unwrap() = Some(redis_server(port, &dir, &aof));
        },
    )
    .await;
    // The test's own connection saw the restart; let it reconnect.
    let mut redis = env.redis.clone();
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis::cmd("PING")
        .query_async::<String>(&mut redis)
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "redis did not come back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_invariants(&env, "rf", n, count, &replies).await;
    // A connection lost to the crash is a transient failure wherever it
    // met a worker: nothing was dead-lettered, the trail is whole.
    assert_trail_whole(&env, "rf").await;
    // This server is what zero loss asks for; the shared one (no AOF) is not.
    assert_eq!(
        prizepool::redis_conn::persistence(&mut env.redis.clone()).await,
        prizepool::redis_conn::Persistence::Durable
    );
    let mut shared = prizepool::redis_conn::connect("redis://127.0.0.1:6379")
        .await
        .unwrap();
    assert!(matches!(
        prizepool::redis_conn::persistence(&mut shared).await,
        prizepool::redis_conn::Persistence::Lossy(_)
    ));
    env.stop_workers().await;
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A plain-TCP RabbitMQ node of the test's own.
fn private_rabbit() -> PrivateRabbit {
    PrivateRabbit::start("fault", &[], |port, _| {
        format!("listeners.tcp.default = 127.0.0.1:{port}\n")
    })
}

/// The broker node stopped and started under load: the workers reconnect by
/// themselves, an upstream that sends again with the same request id gets
/// the first answer, and nothing is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_under_load_loses_and_doubles_nothing() {
    let rabbit = private_rabbit();
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.port);
    let mut env = TestEnv::new(&[("AMQP_URL", &url)]).await;
    env.load(&pool_toml("bf", "max_count = 100", GIFT)).await;
    env.start_fleet().await;
    let (n, count) = (600usize, 5u32);
    let answered = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (answered, next, config) = (answered.clone(), next.clone(), env.config.clone());
        tasks.push(tokio::spawn(async move {
            let mut replies = Vec::new();
            let mut client = None;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return replies;
                }
                let id = format!("b-{i}");
                let body = json!({"type": "draw", "request_id": id, "pool": "bf",
                                  "user_id": 1 + (i % 50) as i64, "count": count});
                // An upstream that lost its connection sends again, same id.
                let reply = loop {
                    if client.is_none() {
                        client = prizepool::amqp::rpc::RpcClient::connect(&config).await.ok();
                    }
                    if let Some(c) = &client {
                        match c.call("draw", &body, Duration::from_secs(5)).await {
                            Ok(reply) => break reply,
                            Err(_) => client = None,
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                answered.fetch_add(1, Ordering::Relaxed);
                replies.push((id, reply));
            }
        }));
    }
    while answered.load(Ordering::Relaxed) < 100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped = Instant::now();
    assert!(node_ctl(&rabbit.node, &["stop_app"]).status.success());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(node_ctl(&rabbit.node, &["start_app"]).status.success());
    rabbit.await_startup();
    let mut replies = HashMap::new();
    for t in tasks {
        for (id, reply) in t.await.unwrap() {
            assert!(replies.insert(id, reply).is_none());
        }
    }
    eprintln!(
        "{n} requests, {} answered, broker down and back, all answered {:?} after the stop",
        replies.len(),
        stopped.elapsed()
    );
    assert_invariants(&env, "bf", n, count, &replies).await;
    env.stop_workers().await;
}

/// A refill whose Redis dies under it fails as transient (kept and retried
/// by the consume loop), never as internal (dead-lettered): the first thing
/// it reads, the pool's config, crossed an `anyhow` error on its way, which
/// once turned a broken pipe into `internal: broken pipe`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refill_that_loses_redis_is_retried_not_dead_lettered() {
    let dir = tempdir("lost");
    let port = free_port();
    let server = redis_server(port, &dir, &[]);
    let url = format!("redis://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "private redis did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let env = TestEnv::new(&[("REDIS_URL", &url)]).await;
    env.load(&pool_toml("lost", "max_count = 100", GIFT)).await;
    let worker =
        prizepool::refill::RefillWorker::new(env.config.clone(), env.redis.clone(), env.db.clone());
    let request =
        serde_json::json!({"type": "refill", "pool": "lost", "trigger": 1, "urgent": true});
    // Its connection is cut (reset or broken pipe), then refused.
    drop(server);
    for _ in 0..2 {
        let result = tokio::time::timeout(Duration::from_secs(30), worker.step(&request))
            .await
            .expect("a refill without Redis ends");
        assert!(
            matches!(result, Err(prizepool::amqp::HandleError::Transient(_))),
            "{result:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
