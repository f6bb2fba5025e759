//! Coalesced draw calls: concurrent draws of one pool share one Lua call.
//!
//! Redis runs one script at a time, so draws of one pool are applied one
//! after another anyway; what costs is each call (its round trip, the
//! script's setup, the reply). A worker keeps, per pool, at most one draw
//! call in flight: a draw that finds one running joins the pool's queue,
//! and when the call returns, everything queued meanwhile (up to
//! [`MAX_PER_CALL`] draws and [`MAX_PRIZES_PER_CALL`] prizes) goes out as
//! the next call, applied in queue order
//! (`lua/lib/many.lua`). Under light load every call carries one draw and
//! nothing waits; under load the calls grow with the load.
//!
//! The calls run in a task of their own per busy pool, so a draw whose
//! caller gives up (a delivery dropped at shutdown) cannot strand the
//! draws queued behind it. Each draw is answered exactly as its own call
//! would have answered it: the script applies each all or nothing, in
//! order, and a draw that is short or refused affects no other.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use tokio::sync::oneshot;

use super::{
    draw::{draw_many, Pending},
    DrawStep, Storage,
};
use crate::{amqp::HandleError, redis_conn::RedisConn, scripts::PoolKeys};

/// Most draws one call applies.
pub const MAX_PER_CALL: usize = 64;
/// Most prizes one call takes (past the first draw): a call holds Redis for
/// as long as its draws take together, so it is kept to what one large draw
/// takes alone.
pub const MAX_PRIZES_PER_CALL: u64 = 10_000;

type Answer = Result<DrawStep, HandleError>;
/// Each busy pool's draws waiting for a call, with where their steps go.
type Waiting = HashMap<String, Vec<(Pending, oneshot::Sender<Answer>)>>;
type Queues = Arc<Mutex<Waiting>>;

/// The per-pool queues of draws waiting for their call.
#[derive(Debug, Default)]
pub struct Coalescer {
    queues: Queues,
}

impl Coalescer {
    /// Applies `draws` to `pool` (behind `keys`), in order, as part of the
    /// pool's next call; their steps in the same order.
    pub async fn draw(
        &self,
        redis: &RedisConn,
        keys: &PoolKeys,
        storage: Storage,
        pool: &str,
        draws: Vec<Pending>,
    ) -> Vec<Answer> {
        let mut receivers = Vec::with_capacity(draws.len());
        let start = {
            let mut queues = lock(&self.queues);
            let start = !queues.contains_key(pool);
            let queue = queues.entry(pool.to_owned()).or_default();
            for d in draws {
                let (tx, rx) = oneshot::channel();
                queue.push((d, tx));
                receivers.push(rx);
            }
            start
        };
        if start {
            tokio::spawn(run(Runner {
                queues: self.queues.clone(),
                pool: pool.to_owned(),
                armed: true,
                redis: redis.clone(),
                keys: keys.clone(),
                storage,
            }));
        }
        let mut answers = Vec::with_capacity(receivers.len());
        for rx in receivers {
            answers.push(rx.await.unwrap_or_else(|_| {
                Err(HandleError::Transient(anyhow::anyhow!(
                    "the draw call of pool {pool} stopped before answering"
                )))
            }));
        }
        answers
    }
}

/// The task that makes one busy pool's calls until its queue is empty.
struct Runner {
    queues: Queues,
    pool: String,
    /// Whether dropping the runner must take the pool's queue with it (it
    /// stopped without emptying the queue: a panic), so that the draws
    /// queued are answered with an error and the next draw starts a runner.
    armed: bool,
    redis: RedisConn,
    keys: PoolKeys,
    storage: Storage,
}

impl Drop for Runner {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.queues).remove(&self.pool);
        }
    }
}

async fn run(mut runner: Runner) {
    loop {
        let calls: Vec<_> = {
            let mut queues = lock(&runner.queues);
            match queues.get_mut(&runner.pool) {
                Some(queue) if !queue.is_empty() => {
                    let mut prizes = 0;
                    let n = queue
                        .iter()
                        .take(MAX_PER_CALL)
                        .take_while(|(d, _)| {
                            prizes += u64::from(d.count);
                            prizes <= MAX_PRIZES_PER_CALL
                        })
                        .count()
                        .max(1);
                    queue.drain(..n).collect()
                }
                _ => {
                    queues.remove(&runner.pool);
                    runner.armed = false;
                    return;
                }
            }
        };
        let (draws, senders): (Vec<_>, Vec<_>) = calls.into_iter().unzip();
        metrics::histogram!("prizepool_draws_per_call").record(draws.len() as f64);
        match draw_many(
            &mut runner.redis,
            runner.storage.draw_script(),
            &runner.keys,
            runner.storage,
            &draws,
        )
        .await
        {
            Ok(steps) => {
                for (tx, step) in senders.into_iter().zip(steps) {
                    let _ = tx.send(step);
                }
            }
            Err(e) => {
                for tx in senders {
                    let _ = tx.send(Err(again(&e)));
                }
            }
        }
    }
}

/// The same failure, for another draw of the failed call.
fn again(e: &HandleError) -> HandleError {
    match e {
        HandleError::Invalid(invalid) => HandleError::Invalid(invalid.clone()),
        HandleError::Transient(e) => HandleError::Transient(anyhow::anyhow!("{e:#}")),
        HandleError::Internal(e) => HandleError::internal(format!("{e:#}")),
    }
}

fn lock(queues: &Queues) -> MutexGuard<'_, Waiting> {
    queues.lock().unwrap_or_else(|e| e.into_inner())
}
