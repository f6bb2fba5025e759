//! Load through a fault: many draws in flight while something breaks, and
//! the invariants every fault test checks afterwards.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::{json, Value};

use super::TestEnv;

const T: Duration = Duration::from_secs(120);

/// A load: `n` draw requests (ids `<tag>-<i>`) of `count` prizes on `pool`,
/// `in_flight` at a time, with the fault coming once `at` replies arrived.
#[derive(Clone, Copy, Debug)]
pub struct Load<'a> {
    pub tag: &'a str,
    pub pool: &'a str,
    pub n: usize,
    pub count: u32,
    pub in_flight: usize,
    pub at: usize,
}

/// Draws `n` requests (ids `<tag>-<i>`) of `count` prizes, `in_flight` at a time, calling
/// `fault` once `at` replies have arrived; returns every reply by request id
/// and how long the slowest answer after the fault took.
pub async fn draws_through_a_fault<F, Fut>(
    env: &TestEnv,
    load: Load<'_>,
    fault: F,
) -> HashMap<String, Value>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Load {
        tag,
        pool,
        n,
        count,
        in_flight,
        at,
    } = load;
    let client = Arc::new(env.client().await);
    let answered = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let (client, answered, next, pool, tag) = (
            client.clone(),
            answered.clone(),
            next.clone(),
            pool.to_owned(),
            tag.to_owned(),
        );
        tasks.push(tokio::spawn(async move {
            let mut replies = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return replies;
                }
                let id = format!("{tag}-{i}");
                let body = json!({"type": "draw", "request_id": id, "pool": pool,
                                  "user_id": 1 + (i % 50) as i64, "count": count});
                let reply = client.call("draw", &body, T).await.unwrap();
                answered.fetch_add(1, Ordering::Relaxed);
                replies.push((id, reply));
            }
        }));
    }
    while answered.load(Ordering::Relaxed) < at {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    fault().await;
    let mut out = HashMap::new();
    for t in tasks {
        for (id, reply) in t.await.unwrap() {
            assert!(
                out.insert(id, reply).is_none(),
                "two answers for one request"
            );
        }
    }
    eprintln!(
        "{n} requests, {} answered, fault and recovery took {:?}",
        out.len(),
        started.elapsed()
    );
    out
}

/// Checks every invariant after a fault: one answer per request, all ok,
/// the ledger equals the rewards promised, conservation.
pub async fn assert_invariants(
    env: &TestEnv,
    pool: &str,
    n: usize,
    count: u32,
    replies: &HashMap<String, Value>,
) {
    assert_eq!(replies.len(), n, "every request answered once");
    let refused: Vec<&Value> = replies.values().filter(|r| r["status"] != "ok").collect();
    assert!(
        refused.is_empty(),
        "{} refused, e.g. {:?}",
        refused.len(),
        refused.first()
    );
    let promised: i64 = replies
        .values()
        .map(|r| r["reward"].as_i64().unwrap())
        .sum();
    assert_eq!(
        env.wait_ledger(pool, promised).await,
        promised,
        "ledger = replies"
    );
    let s = env.status(pool).await;
    assert_eq!(
        s.drawn,
        n as u64 * u64::from(count),
        "each request drew once"
    );
    assert_eq!(s.stocked, s.drawn + s.in_pool, "conservation");
    eprintln!(
        "ledger {promised} = promised; stocked {} = drawn {} + in pool {}",
        s.stocked, s.drawn, s.in_pool
    );
}
