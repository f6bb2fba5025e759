//! The fleet on a private three-node RabbitMQ cluster, given all three
//! addresses: the node that leads the draw queue is stopped under load and
//! started again. Draws go on through the other two (the workers and the
//! upstream reconnect to a live node); every request gets one answer, the
//! ledger pays exactly what was promised, conservation holds. Prints the
//! longest gap between two replies.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use common::{load::assert_invariants, node_ctl, pool_toml, PrivateRabbit, TestEnv};
use serde_json::json;

const GIFT: &[(&str, &[(u64, u64)])] = &[
    ("a", &[(0, 300), (1, 60), (5, 20)]),
    ("b", &[(0, 200), (2, 50), (10, 10)]),
];

fn node(tag: &str) -> PrivateRabbit {
    // x-random spreads the draw shards (DRAW_SHARDS > 1).
    PrivateRabbit::start_with_plugins(tag, &[], &["rabbitmq_random_exchange"], |port, _| {
        format!("listeners.tcp.default = 127.0.0.1:{port}\nqueue_leader_locator = balanced\n")
    })
}

/// The node that leads `queue` in the default vhost, as `node` sees it.
fn leader(node: &str, queue: &str) -> String {
    let out = node_ctl(node, &["list_queues", "-q", "name", "leader"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some(queue)).then(|| f.next().unwrap_or_default().to_owned())
        })
        .unwrap_or_default()
}

/// What the live nodes say about queues, channels and consumers: printed
/// when the fleet stalls, to tell a broker that holds messages from a
/// client that holds deliveries.
fn diagnose(nodes: &[PrivateRabbit], down: &str) -> String {
    let Some(live) = nodes.iter().find(|n| n.node != down) else {
        return String::new();
    };
    let mut out = String::new();
    for args in [
        &[
            "list_queues",
            "name",
            "leader",
            "members",
            "messages_ready",
            "messages_unacknowledged",
            "consumers",
        ][..],
        &[
            "list_channels",
            "connection",
            "number",
            "consumer_count",
            "messages_unacknowledged",
            "messages_unconfirmed",
        ][..],
        &[
            "list_consumers",
            "queue_name",
            "channel_pid",
            "prefetch_count",
            "active",
        ][..],
    ] {
        let o = node_ctl(&live.node, args);
        out.push_str(&String::from_utf8_lossy(&o.stdout));
        out.push('\n');
    }
    out
}

// Once intermittent (about one run in three, settlement stopped short of
// the replies after the leader's node returned): the settle worker awaited
// an ack lapin never resolved once the stopped node closed its connection.
// Every broker operation is bounded now (`amqp::bounded`, the publisher's
// confirm timeout, the session watchdog).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_node_that_leads_the_draw_queue_stalls_nothing() {
    leader_loss(1).await;
}

/// The same with `DRAW_SHARDS = 3`: three draw queues whose leaders the
/// cluster spreads over its nodes; the node leading `prizepool.draw` (shard
/// 0) is stopped and started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_draw_shards_lose_nothing_when_a_leaders_node_stops() {
    leader_loss(3).await;
}

/// One cluster at a time: three nodes and a fleet are what this machine
/// holds.
static CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn leader_loss(shards: u16) {
    let _one = CLUSTER.lock().await;
    let _ = tracing_subscriber::fmt()
        .with_env_filter("prizepool=info,lapin=warn")
        .with_test_writer()
        .try_init();
    let started = Instant::now();
    // The three nodes boot at once (an Erlang VM each, seconds apiece); they
    // join the first one after.
    let nodes = std::thread::scope(|s| {
        let [c1, c2, c3] = ["c1", "c2", "c3"].map(|tag| s.spawn(move || node(tag)));
        [c1, c2, c3].map(|h| h.join().unwrap())
    });
    for n in &nodes[1..] {
        for args in [
            vec!["stop_app"],
            vec!["join_cluster", nodes[0].node.as_str()],
            vec!["start_app"],
        ] {
            let out = node_ctl(&n.node, &args);
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        n.await_startup();
    }
    eprintln!("three nodes started and joined in {:?}", started.elapsed());
    let url = nodes
        .iter()
        .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", n.port))
        .collect::<Vec<_>>()
        .join(",");
    let shards_text = shards.to_string();
    let mut env = TestEnv::new(&[("AMQP_URL", &url), ("DRAW_SHARDS", &shards_text)]).await;
    env.load(&pool_toml("cl", "max_count = 100", GIFT)).await;
    env.start_fleet().await;
    if shards > 1 {
        let out = node_ctl(&nodes[0].node, &["list_queues", "-q", "name", "leader"]);
        let leaders: std::collections::HashSet<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("prizepool.draw") && !l.contains(".dlq"))
            .filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned))
            .collect();
        eprintln!("draw shard leaders: {leaders:?}");
        assert!(
            leaders.len() > 1,
            "the shards' leaders sit on different nodes"
        );
    }

    // Upstream senders run until told to stop, so the load covers the whole
    // outage however fast the fleet is. There are more of them than the
    // draw worker has slots (`CONCURRENCY`, 128): every slot is busy when
    // the node stops.
    let count = 3u32;
    let answered = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let last_reply = Arc::new(Mutex::new((Instant::now(), Duration::ZERO)));
    let mut tasks = Vec::new();
    for _ in 0..160 {
        let (answered, next, done, config, last_reply) = (
            answered.clone(),
            next.clone(),
            done.clone(),
            env.config.clone(),
            last_reply.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut replies = Vec::new();
            let mut client = None;
            while !done.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let id = format!("c-{i}");
                let body = json!({"type": "draw", "request_id": id, "pool": "cl",
                                  "user_id": 1 + (i % 50) as i64, "count": count});
                // An upstream that lost its node sends again, same id, to
                // whichever node answers, until it has the answer.
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
                {
                    let mut last = last_reply.lock().unwrap();
                    let gap = last.0.elapsed();
                    *last = (Instant::now(), last.1.max(gap));
                }
                answered.fetch_add(1, Ordering::Relaxed);
                replies.push((id, reply));
            }
            replies
        }));
    }
    let nodes = &nodes;
    let wait_for = |target: usize, what: &'static str, answered: Arc<AtomicUsize>| async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        while answered.load(Ordering::Relaxed) < target {
            if Instant::now() >= deadline {
                panic!(
                    "{what}: {} answered, waiting for {target}\n{}",
                    answered.load(Ordering::Relaxed),
                    diagnose(nodes, "")
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    wait_for(300, "before the stop", answered.clone()).await;
    let leading = leader(&nodes[0].node, prizepool::amqp::DRAW.queue);
    let stopped = nodes.iter().find(|n| n.node == leading).unwrap();
    assert!(node_ctl(&stopped.node, &["stop_app"]).status.success());
    let before = answered.load(Ordering::Relaxed);
    // Draws go on while the leader's node is away.
    let deadline = Instant::now() + Duration::from_secs(60);
    while answered.load(Ordering::Relaxed) < before + 300 {
        if Instant::now() >= deadline {
            let live = nodes.iter().find(|n| n.node != leading).unwrap();
            let out = node_ctl(
                &live.node,
                &[
                    "list_queues",
                    "name",
                    "leader",
                    "messages_ready",
                    "messages_unacknowledged",
                    "consumers",
                ],
            );
            let errors: String = nodes
                .iter()
                .filter(|n| n.node != leading)
                .flat_map(|n| {
                    let log = n.dir.join("log").join(format!("{}.log", n.node));
                    std::fs::read_to_string(log)
                        .unwrap_or_default()
                        .lines()
                        .filter(|l| l.contains("[error]"))
                        .take(20)
                        .map(|l| format!("{}: {l}\n", n.node))
                        .collect::<Vec<_>>()
                })
                .collect();
            panic!(
                "draws stalled without {leading}: {} answered before, {} now\n{}\n{errors}",
                before,
                answered.load(Ordering::Relaxed),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let during = answered.load(Ordering::Relaxed) - before;
    assert!(node_ctl(&stopped.node, &["start_app"]).status.success());
    stopped.await_startup();
    let back = answered.load(Ordering::Relaxed);
    wait_for(back + 200, "after the restart", answered.clone()).await;
    done.store(true, Ordering::Relaxed);
    let mut replies = HashMap::new();
    for t in tasks {
        for (id, reply) in t.await.unwrap() {
            assert!(
                replies.insert(id, reply).is_none(),
                "two answers for one request"
            );
        }
    }
    let n = replies.len();
    assert_eq!(
        next.load(Ordering::Relaxed),
        n,
        "every request sent was answered"
    );
    let gap = last_reply.lock().unwrap().1;
    eprintln!(
        "{n} requests, {} answered; {during} answered while {leading} (leader of the draw queue) was stopped; longest gap between replies {gap:?}",
        replies.len()
    );
    let promised: i64 = replies.values().filter_map(|r| r["reward"].as_i64()).sum();
    let settled = env.wait_ledger("cl", promised).await;
    if settled != promised {
        eprintln!(
            "ledger {settled} of {promised} promised\n{}",
            diagnose(nodes, "")
        );
    }
    assert_invariants(&env, "cl", n, count, &replies).await;
    env.stop_workers().await;
}
