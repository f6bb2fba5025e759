//! Runs the fleet as separate processes and drives it with simulated users.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use lapin::options::QueueDeclareOptions;
use tokio::sync::{Mutex, Semaphore};

use super::stats::{cpu_time, Latencies, Percentiles};
use prizepool::{
    amqp::{self, rpc::RpcClient},
    client::Client,
    config::Config,
    messages::{typed_json, DrawRequest, Status},
};

/// The worker processes of one run.
#[derive(Debug)]
pub(super) struct Fleet {
    children: Vec<(String, Child)>,
}

fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the prizepool binary")?;
    let path = exe.with_file_name(name);
    anyhow::ensure!(
        path.exists(),
        "{} not found next to {}; build all binaries (`cargo build --release`)",
        name,
        exe.display()
    );
    Ok(path)
}

impl Fleet {
    /// Starts `draw_workers` draw workers, one refill and one settle worker,
    /// and waits until every one of them consumes.
    pub(super) async fn start(config: &Config, draw_workers: usize) -> anyhow::Result<Self> {
        let mut children = Vec::new();
        let mut names = vec!["refill-worker".to_owned(), "settle-worker".to_owned()];
        names.extend((0..draw_workers).map(|_| "draw-worker".to_owned()));
        for name in names {
            let mut command = Command::new(binary(&name)?);
            stop_with_parent(&mut command);
            let child = command
                // Warnings and errors only, without lapin's report of each
                // draw-shard queue a worker finds missing (as the workers'
                // own default leaves it out).
                .env("RUST_LOG", "warn,lapin::channel=off")
                .env("METRICS_ADDR", "")
                .env("AMQP_URL", &config.amqp_url)
                .env("REDIS_URL", &config.redis_url)
                .env("DATABASE_URL", &config.database_url)
                .env("REDIS_PREFIX", &config.redis_prefix)
                .stdout(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {name}"))?;
            children.push((name, child));
        }
        let fleet = Self { children };
        let conn = amqp::connect(&config.amqp_url, "prizepool-bench-probe").await?;
        let ch = conn.create_channel().await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        for (queue, want) in [
            (amqp::DRAW.queue, draw_workers),
            (amqp::REFILL.queue, 1),
            (amqp::SETTLE.queue, 1),
        ] {
            loop {
                let q = ch
                    .queue_declare(
                        queue.into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        Default::default(),
                    )
                    .await;
                if matches!(&q, Ok(q) if q.consumer_count() as usize >= want) {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "workers on {queue} did not start consuming"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let _ = conn.close(200, "bench".into()).await;
        Ok(fleet)
    }

    /// CPU time used so far by each process, by name.
    pub(super) fn cpu(&self) -> Vec<(String, u32, Duration)> {
        self.children
            .iter()
            .map(|(name, c)| (name.clone(), c.id(), cpu_time(c.id()).unwrap_or_default()))
            .collect()
    }

    /// Stops every process: SIGTERM (they finish their in-flight work), and
    /// SIGKILL for any still running after the grace period.
    pub(super) fn stop(mut self) {
        self.terminate();
    }

    fn terminate(&mut self) {
        for (_, c) in &self.children {
            if let Ok(pid) = i32::try_from(c.id()) {
                // SAFETY: a plain system call on the pid of a child not yet
                // reaped, so it cannot name another process.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
        let deadline = Instant::now() + STOP_GRACE;
        for (_, c) in &mut self.children {
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.children.clear();
    }
}

/// How long a stopped worker may take to drain before it is killed (more
/// than a worker's own shutdown grace).
const STOP_GRACE: Duration = Duration::from_secs(20);

impl Drop for Fleet {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// Has the kernel send the child SIGTERM when the bench dies, whatever kills
/// it: a fleet left behind would keep consuming the draw queue and skew the
/// next run. (The signal follows the thread that spawned the child; the bench
/// runs on one runtime thread, which lives as long as the process.)
fn stop_with_parent(command: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: the hook runs in the child between fork and exec, and calls
        // only `prctl` and `getppid`, which are async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The bench died before the request took hold.
                if libc::getppid() as u32 != parent {
                    return Err(std::io::Error::other("the bench is gone"));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// What a load phase measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(super) struct Load {
    pub(crate) draws_per_s: f64,
    pub(crate) prizes_per_s: f64,
    pub(crate) ok: u64,
    pub(crate) rejected: u64,
    pub(crate) failed: u64,
    pub(crate) latency: Percentiles,
    /// Sum of rewards of the `ok` replies, for the ledger check.
    #[serde(skip)]
    pub(crate) reward: i64,
}

/// Builds draw number `i`.
pub(super) type MakeRequest = Arc<dyn Fn(u64) -> DrawRequest + Send + Sync>;

/// The fields of a draw reply the load generator counts; the rest is skipped
/// unparsed.
#[derive(serde::Deserialize)]
struct Reply {
    status: String,
    #[serde(default)]
    prizes: Vec<serde::de::IgnoredAny>,
    /// A draw of more than 100 prizes lists them in the compact form.
    #[serde(default)]
    prize_codes: Option<PrizeCount>,
    #[serde(default)]
    reward: i64,
}

/// The prize count of a compact `prize_codes` (its table and codes skipped).
#[derive(serde::Deserialize)]
struct PrizeCount {
    count: u64,
}

/// A draw of `count` prizes from `pool` for `user`.
pub(super) fn request(pool: &str, user: i64, count: u32) -> DrawRequest {
    DrawRequest {
        // Named after the run, so the run's cleanup finds its id claims.
        request_id: super::services::unique("r"),
        pool: pool.to_owned(),
        user_id: user,
        count,
    }
}

/// How the load generator sends its draws.
#[derive(Debug)]
pub(super) enum Driver {
    /// One `draw` message per draw, through request/reply clients used in
    /// turn; the reply is read only for what is counted.
    Single(Vec<Arc<RpcClient>>),
    /// Through the library's batching clients, used in turn: draws merge
    /// into `draw.batch` messages by the client's linger and batch size.
    Batching(Vec<Client>),
}

/// What one draw came back with: `ok`, prizes and reward.
struct Answer {
    ok: bool,
    prizes: u64,
    reward: i64,
}

impl Driver {
    async fn draw(&self, i: u64, request: DrawRequest) -> anyhow::Result<Answer> {
        match self {
            Self::Single(clients) => {
                let client = &clients[(i as usize) % clients.len()];
                let body = typed_json("draw", &request);
                let reply = client
                    .request(amqp::DRAW.routing_key, &body, Duration::from_secs(30))
                    .await?;
                let r: Reply = serde_json::from_slice(&reply)?;
                Ok(Answer {
                    ok: r.status == "ok",
                    prizes: r.prizes.len() as u64 + r.prize_codes.map_or(0, |c| c.count),
                    reward: r.reward,
                })
            }
            Self::Batching(clients) => {
                let r = clients[(i as usize) % clients.len()].draw(request).await?;
                Ok(Answer {
                    ok: r.status == Status::Ok,
                    prizes: r.prizes.len() as u64,
                    reward: r.reward.unwrap_or(0),
                })
            }
        }
    }

    /// Messages the batching clients published so far (`None` for single
    /// draws: one message each).
    pub(super) fn messages(&self) -> Option<u64> {
        match self {
            Self::Single(_) => None,
            Self::Batching(clients) => Some(clients.iter().map(|c| c.stats().snapshot().0).sum()),
        }
    }

    /// Closes the connections.
    pub(super) async fn close(self) {
        match self {
            Self::Single(clients) => {
                for c in clients {
                    if let Ok(c) = Arc::try_unwrap(c) {
                        c.close().await;
                    }
                }
            }
            Self::Batching(clients) => {
                for c in clients {
                    c.close().await;
                }
            }
        }
    }
}

/// Sends draws for `duration`: `in_flight` at a time (closed loop), or at
/// `rate` per second (open loop, at most `in_flight` outstanding).
pub(super) async fn drive(
    driver: &Arc<Driver>,
    make: MakeRequest,
    duration: Duration,
    in_flight: usize,
    rate: Option<f64>,
) -> Load {
    let slots = Arc::new(Semaphore::new(in_flight));
    let latencies = Arc::new(Mutex::new(Latencies::default()));
    let counters = Arc::new([
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
    ]);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut i = 0u64;
    while started.elapsed() < duration {
        if let Some(rate) = rate {
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                tokio::time::sleep(wait).await;
            }
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let (driver, request) = (driver.clone(), make(i));
        let (latencies, counters) = (latencies.clone(), counters.clone());
        tasks.spawn(async move {
            let t = Instant::now();
            let reply = driver.draw(i, request).await;
            let took = t.elapsed();
            drop(permit);
            match reply {
                Ok(r) if r.ok => {
                    counters[0].fetch_add(1, Ordering::Relaxed);
                    counters[3].fetch_add(r.prizes, Ordering::Relaxed);
                    counters[4].fetch_add(r.reward.unsigned_abs(), Ordering::Relaxed);
                    latencies.lock().await.record(took);
                }
                Ok(_) => {
                    counters[1].fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    counters[2].fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        i += 1;
        // Reap finished tasks now and then so the set stays small.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = started.elapsed().as_secs_f64();
    let mut lat = std::mem::take(&mut *latencies.lock().await);
    let ok = counters[0].load(Ordering::Relaxed);
    Load {
        draws_per_s: ok as f64 / elapsed,
        prizes_per_s: counters[3].load(Ordering::Relaxed) as f64 / elapsed,
        ok,
        rejected: counters[1].load(Ordering::Relaxed),
        failed: counters[2].load(Ordering::Relaxed),
        latency: lat.percentiles(),
        reward: counters[4].load(Ordering::Relaxed) as i64,
    }
}
