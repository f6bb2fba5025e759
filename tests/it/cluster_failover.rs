//! Redis Cluster faults under a load that keeps every worker slot busy:
//! draws are published faster than the fleet answers them, so each draw
//! worker always has all of its `CONCURRENCY` deliveries in hand, while a
//! node is killed (`SIGKILL`) and later started again.
//!
//! One cluster of three masters with a replica each goes through three
//! faults in turn, each one while draws of two pools (on two different
//! masters) flow: the master that holds neither pool's keys, the master of
//! one pool, then a replica. Each killed node rejoins (a killed master as a
//! replica of the node that replaced it) before the next fault. Draws of a
//! pool whose master lives never pause for longer than the failover takes;
//! draws of the failed master's pool resume within seconds of its
//! replica's promotion; every request is answered exactly once, the ledger
//! holds what the replies promised, stock is conserved and nothing is
//! dead-lettered.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use common::{
    load::assert_invariants,
    pool_toml,
    raw::Raw,
    redis_cluster::{cli, RedisCluster},
    TestEnv,
};
use serde_json::{json, Value};

/// Batches of 4,000 prizes, so refills keep up with the flow.
const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 1_900), (1, 500), (5, 100)]),
    ("b", &[(0, 1_200), (2, 250), (10, 50)]),
];

/// Draws published per second, every 100 ms a tenth, alternating pools.
/// Two draw workers (debug builds) answer 300 to 450 a second on two
/// shared cores, so the queue holds a growing backlog and every slot of
/// every worker is busy throughout.
const RATE: usize = 1_000;
/// How long each fault's draws are published.
const FLOW: Duration = Duration::from_secs(5);
/// When the node is killed, from the start of the flow.
const KILL_AT: Duration = Duration::from_secs(1);
/// When a killed replica is started again, from its kill. A killed master
/// is started again once its replica took over.
const RESTART_AFTER: Duration = Duration::from_secs(3);
/// Prizes per draw.
const COUNT: u32 = 2;
/// How long a pool whose master died may wait, from the promotion of the
/// master's replica, for its first answer: a handed-back delivery returns
/// from the retry queue after `RETRY_DELAY`, and the cluster client learns
/// the new master at its next slot refresh.
const RESUME_WITHIN: Duration = Duration::from_secs(5);
/// How much longer than the failover a pool whose master lives may pause:
/// while the dead master is still in the slot map, a replaced connection
/// can wedge again, and each replacement round takes about a second (a
/// probe after 0.5 s of silence, a 0.5 s PING, at most one a second). Two
/// rounds are allowed; on a busy machine one is often spent.
const REPLACEMENT_ROUNDS: Duration = Duration::from_secs(2);
/// The cluster's node timeout: a replica's loss must not pause draws for
/// as long as a failover would.
const NODE_TIMEOUT: Duration = Duration::from_secs(2);

/// The replies as they arrive: (when, correlation id).
type Arrivals = Arc<Mutex<Vec<(Instant, String)>>>;

/// Records the arrival time of every reply `raw` receives until `stop`.
fn watch_arrivals(raw: &Raw, stop: tokio_util::sync::CancellationToken) -> Arrivals {
    let arrivals: Arrivals = Arc::default();
    let (replies, out) = (raw.replies.clone(), arrivals.clone());
    tokio::spawn(async move {
        let mut seen = 0;
        while !stop.is_cancelled() {
            let now = Instant::now();
            let fresh: Vec<(Instant, String)> = replies.lock().unwrap()[seen..]
                .iter()
                .map(|(corr, _)| (now, corr.clone().unwrap_or_default()))
                .collect();
            seen += fresh.len();
            out.lock().unwrap().extend(fresh);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    arrivals
}

/// What one fault did to the draws of one pool.
#[derive(Debug)]
struct Seen {
    /// The longest stretch without an answer from the kill to the end of
    /// the flow.
    longest_pause: Duration,
    /// From the promotion to the pool's first answer after it.
    resumed_after_promotion: Option<Duration>,
}

/// One fault: draws of `pools` at [`RATE`] for [`FLOW`], the node on
/// `victim` killed [`KILL_AT`] in and started again once the replica on
/// `promoted` took over (a replica: [`RESTART_AFTER`] after its kill);
/// waits until every draw is answered and the cluster is whole.
/// Returns the request ids published, how long the failover took (from
/// the kill to the promotion; zero without one) and what each pool saw.
#[allow(clippy::too_many_arguments)]
async fn fault(
    cluster: &mut RedisCluster,
    raw: &Raw,
    arrivals: &Arrivals,
    tag: &str,
    pools: &[&str],
    victim: u16,
    promoted: Option<u16>,
) -> (Vec<String>, Duration, HashMap<String, Seen>) {
    let began = Instant::now();
    let (mut killed_at, mut restarted) = (None, false);
    let mut promotion = None;
    let mut ids: Vec<String> = Vec::new();
    let per_tick = RATE / 10;
    let ticks = (FLOW.as_millis() / 100) as usize;
    for tick in 0..ticks {
        let now = began.elapsed();
        if killed_at.is_none() && now >= KILL_AT {
            cluster.kill(victim);
            killed_at = Some(Instant::now());
            // The replica's promotion, watched beside the flow.
            promotion = promoted.map(|replica| {
                tokio::spawn(async move {
                    loop {
                        let role = tokio::task::spawn_blocking(move || cli(replica, &["role"]))
                            .await
                            .unwrap();
                        if role.starts_with("master") {
                            return Instant::now();
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
            });
        }
        let due = match &promotion {
            Some(watch) => watch.is_finished(),
            None => killed_at.is_some_and(|k| k.elapsed() >= RESTART_AFTER),
        };
        if !restarted && due {
            cluster.restart(victim).await;
            restarted = true;
        }
        let batch: Vec<(&str, Vec<u8>, String)> = (0..per_tick)
            .map(|i| {
                let n = tick * per_tick + i;
                let pool = pools[n % pools.len()];
                let id = format!("{tag}-{pool}-{n}");
                let body = json!({"type": "draw", "request_id": id, "pool": pool,
                                  "user_id": 1 + n as i64, "count": COUNT});
                ("draw", serde_json::to_vec(&body).unwrap(), id)
            })
            .collect();
        ids.extend(batch.iter().map(|(_, _, id)| id.clone()));
        raw.publish_all(&batch).await;
        tokio::time::sleep_until((began + Duration::from_millis(100 * (tick as u64 + 1))).into())
            .await;
    }
    let flow_ends = Instant::now();
    let killed_at = killed_at.unwrap();
    let promoted_at = match promotion {
        Some(watch) => Some(
            tokio::time::timeout(Duration::from_secs(30), watch)
                .await
                .expect("the replica took over within 30 s")
                .unwrap(),
        ),
        None => None,
    };
    if !restarted {
        tokio::time::sleep_until((killed_at + RESTART_AFTER).into()).await;
        cluster.restart(victim).await;
    }

    // Every draw answered, however long the backlog takes to drain.
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let replies = raw.by_id();
        let missing = ids.iter().filter(|id| !replies.contains_key(*id)).count();
        if missing == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{tag}: {missing} of {} draws never answered (the first: {:?})",
            ids.len(),
            ids.iter().find(|id| !replies.contains_key(*id))
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let answered_in = began.elapsed();
    cluster.wait_ok().await;
    cluster.wait_synced().await;

    let arrivals = arrivals.lock().unwrap().clone();
    let mut seen = HashMap::new();
    for pool in pools {
        let prefix = format!("{tag}-{pool}-");
        let times: Vec<Instant> = arrivals
            .iter()
            .filter(|(_, corr)| corr.starts_with(&prefix))
            .map(|(at, _)| *at)
            .collect();
        let mut longest_pause = Duration::ZERO;
        let mut last = killed_at;
        for at in times
            .iter()
            .filter(|at| **at > killed_at && **at <= flow_ends)
        {
            longest_pause = longest_pause.max(at.duration_since(last));
            last = *at;
        }
        let next = times.iter().find(|at| **at > last).copied().unwrap_or(last);
        longest_pause = longest_pause.max(next.min(flow_ends).saturating_duration_since(last));
        let resumed_after_promotion = promoted_at.map(|p| {
            times
                .iter()
                .find(|at| **at >= p)
                .map_or(Duration::MAX, |at| at.duration_since(p))
        });
        seen.insert(
            (*pool).to_owned(),
            Seen {
                longest_pause,
                resumed_after_promotion,
            },
        );
    }
    eprintln!(
        "{tag}: {} draws at {RATE}/s, node {victim} killed {KILL_AT:?} in, promoted {:?} after \
         the kill, all answered {answered_in:?} after the flow began; {seen:?}",
        ids.len(),
        promoted_at.map(|p| p.duration_since(killed_at)),
    );
    let failover = promoted_at.map_or(Duration::ZERO, |p| p.duration_since(killed_at));
    (ids, failover, seen)
}

/// The master serving `pool`'s keys.
fn home(cluster: &RedisCluster, env: &TestEnv, pool: &str) -> u16 {
    cluster.master_of(cluster.slot(&env.keys(pool).meta()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_faults_under_a_saturating_load_wedge_no_worker() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            std::env::var("RUST_LOG").unwrap_or_else(|_| "prizepool=warn,redis=warn".into()),
        )
        .with_test_writer()
        .try_init();
    let mut cluster = RedisCluster::start(3, 1).await;
    let mut env = TestEnv::new(&[("REDIS_URL", &cluster.url)]).await;
    // Two pools on two masters; the third master holds neither.
    let mut pools: Vec<(String, u16)> = Vec::new();
    for i in 0.. {
        let pool = format!("fo-{i}");
        let master = home(&cluster, &env, &pool);
        if pools.iter().all(|(_, m)| *m != master) {
            pools.push((pool, master));
        }
        if pools.len() == 2 {
            break;
        }
    }
    for (pool, _) in &pools {
        env.load(&pool_toml(pool, "max_count = 10", GIFT)).await;
    }
    // Two draw workers, as a fleet runs them.
    env.start_fleet().await;
    env.start_draw_worker().await;
    let raw = Raw::new(&env).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let arrivals = watch_arrivals(&raw, stop.clone());
    let (a, b) = (pools[0].0.as_str(), pools[1].0.as_str());
    let both = [a, b];
    let mut all: Vec<String> = Vec::new();

    // The master without either pool's keys.
    let other = cluster
        .topology()
        .into_iter()
        .find(|(_, port, master, _)| *master && pools.iter().all(|(_, m)| m != port))
        .map(|(_, port, _, _)| port)
        .unwrap();
    let replica = cluster.replica_of(other);
    let (ids, failover, seen) = fault(
        &mut cluster,
        &raw,
        &arrivals,
        "other",
        &both,
        other,
        Some(replica),
    )
    .await;
    all.extend(ids);
    for pool in both {
        assert!(
            seen[pool].longest_pause < failover + REPLACEMENT_ROUNDS,
            "other: draws of {pool} (its master alive) paused {:?}, the failover took {failover:?}",
            seen[pool].longest_pause
        );
    }

    // Pool a's own master: b's draws flow on, a's resume after the
    // promotion.
    let (home_a, home_b) = (home(&cluster, &env, a), home(&cluster, &env, b));
    let replica = cluster.replica_of(home_a);
    let (ids, failover, seen) = fault(
        &mut cluster,
        &raw,
        &arrivals,
        "home",
        &both,
        home_a,
        Some(replica),
    )
    .await;
    all.extend(ids);
    assert!(
        seen[b].longest_pause < failover + REPLACEMENT_ROUNDS,
        "home: draws of {b} (its master alive) paused {:?}, the failover took {failover:?}",
        seen[b].longest_pause
    );
    let resumed = seen[a].resumed_after_promotion.unwrap();
    assert!(
        resumed < RESUME_WITHIN,
        "home: draws of {a} resumed {resumed:?} after its replica took over"
    );

    // A replica (of b's master): nothing pauses.
    let replica = cluster.replica_of(home_b);
    let (ids, _, seen) = fault(
        &mut cluster,
        &raw,
        &arrivals,
        "replica",
        &both,
        replica,
        None,
    )
    .await;
    all.extend(ids);
    for pool in both {
        assert!(
            seen[pool].longest_pause < NODE_TIMEOUT,
            "replica: draws of {pool} paused {:?}",
            seen[pool].longest_pause
        );
    }

    // Late duplicates, had there been any, arrive within this.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    let replies = raw.by_id();
    for id in &all {
        let answers = replies.get(id).map_or(0, Vec::len);
        assert_eq!(answers, 1, "{id} answered {answers} times");
    }
    assert_eq!(replies.len(), all.len(), "no reply to anything else");
    for pool in both {
        let infix = format!("-{pool}-");
        let mine: HashMap<String, Value> = replies
            .iter()
            .filter(|(id, _)| id.contains(&infix))
            .map(|(id, r)| (id.clone(), r[0].clone()))
            .collect();
        let n = mine.len();
        assert_invariants(&env, pool, n, COUNT, &mine).await;
    }
    for route in [prizepool::amqp::DRAW, prizepool::amqp::REFILL] {
        assert_eq!(env.queue_depth(route.dlq).await, 0, "{}", route.dlq);
    }
    env.stop_workers().await;
}
