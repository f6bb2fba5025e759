//! The operations side of a worker: its start-up sequence ([`run_worker`]:
//! log the configuration, bind the ops endpoint, wait for every dependency,
//! then consume), the endpoint itself — `/metrics` (Prometheus), `/healthz`
//! (the process is alive) and `/readyz` (it is consuming and its servers
//! answer) — the periodic pings that keep `/readyz` honest, and the stall
//! check that makes both endpoints fail when a worker holds deliveries and
//! answers none while its servers answer (see [`Health`]).

use std::{
    future::Future,
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, OnceLock,
    },
    time::Duration,
};

use anyhow::Context;
use axum::{extract::State, http::StatusCode, routing::get, Router};
use backon::{ExponentialBuilder, Retryable};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use crate::{config::Config, redis_conn::RedisConn};

/// A server a worker depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dependency {
    /// RabbitMQ (`AMQP_URL`).
    Broker,
    /// Redis (`REDIS_URL`).
    Redis,
    /// Postgres (`DATABASE_URL`).
    Postgres,
}

impl Dependency {
    fn name(self) -> &'static str {
        match self {
            Self::Broker => "broker",
            Self::Redis => "redis",
            Self::Postgres => "postgres",
        }
    }
}

/// Readiness shared between a worker, its dependency pings and its ops
/// endpoint. Ready means: the consumer runs, no pinged server is down, and
/// the worker is not stalled. A fresh `Health` is not ready (nothing
/// consumes yet) and counts every server as up until a ping says otherwise.
///
/// # Stalls
///
/// The consume loop tells `Health` which deliveries it holds
/// ([`Health::taken`]) and when it answers one ([`Health::answered`]: a
/// reply, a dead letter, anything but a hand-back). A worker that has held
/// deliveries for [`Config::stall_after`] without answering any, while
/// Redis and Postgres answer its pings, is stalled: something inside it
/// stopped making progress that no server outage explains (a client
/// connection that stopped answering, a deadlock). [`watch`] checks for it;
/// a stalled worker fails `/readyz` and `/healthz` alike, so the
/// orchestrator takes it out of rotation and restarts it, logs why once,
/// and sets `prizepool_stalled` to 1 (and counts `prizepool_stalls_total`).
/// It recovers by itself if it answers again before it is restarted.
#[derive(Clone, Debug, Default)]
pub struct Health {
    inner: Arc<HealthFlags>,
}

#[derive(Debug, Default)]
struct HealthFlags {
    consuming: AtomicBool,
    redis_down: AtomicBool,
    postgres_down: AtomicBool,
    /// Deliveries the consume loop holds.
    in_hand: AtomicUsize,
    /// Milliseconds since [`epoch`] of the last answer, or of the moment
    /// the worker took a delivery while it held none, whichever is later.
    progress_at: AtomicU64,
    stalled: AtomicBool,
}

/// The origin of [`HealthFlags::progress_at`].
fn epoch() -> tokio::time::Instant {
    static EPOCH: OnceLock<tokio::time::Instant> = OnceLock::new();
    *EPOCH.get_or_init(tokio::time::Instant::now)
}

fn millis_now() -> u64 {
    u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A delivery the consume loop holds ([`Health::taken`]), until dropped.
#[derive(Debug)]
pub struct InHand {
    health: Health,
}

impl Drop for InHand {
    fn drop(&mut self) {
        self.health.inner.in_hand.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Health {
    /// Marks the worker ready (consuming) or not.
    pub fn set_ready(&self, ready: bool) {
        self.inner.consuming.store(ready, Ordering::Relaxed);
    }

    /// Records the outcome of the latest ping of `dependency`. The broker's
    /// state is the consumer's ([`Health::set_ready`]).
    pub fn set_up(&self, dependency: Dependency, up: bool) {
        let flag = match dependency {
            Dependency::Broker => return self.set_ready(up),
            Dependency::Redis => &self.inner.redis_down,
            Dependency::Postgres => &self.inner.postgres_down,
        };
        flag.store(!up, Ordering::Relaxed);
    }

    /// Whether the worker is consuming, every pinged server answers, and
    /// it is not stalled.
    pub fn is_ready(&self) -> bool {
        self.not_ready_because().is_none()
    }

    /// What keeps the worker from being ready, if anything.
    pub fn not_ready_because(&self) -> Option<&'static str> {
        if self.is_stalled() {
            Some(STALLED)
        } else if self.inner.redis_down.load(Ordering::Relaxed) {
            Some("redis unreachable")
        } else if self.inner.postgres_down.load(Ordering::Relaxed) {
            Some("postgres unreachable")
        } else if !self.inner.consuming.load(Ordering::Relaxed) {
            Some("not consuming")
        } else {
            None
        }
    }

    /// Whether the last stall check found the worker stalled (see
    /// [`Health`]); `/healthz` fails while it is.
    pub fn is_stalled(&self) -> bool {
        self.inner.stalled.load(Ordering::Relaxed)
    }

    /// Records that the consume loop took a delivery; it holds it until the
    /// returned guard is dropped. A worker that held none starts its stall
    /// clock now, not at its last answer (maybe hours ago).
    pub fn taken(&self) -> InHand {
        if self.inner.in_hand.fetch_add(1, Ordering::Relaxed) == 0 {
            self.inner
                .progress_at
                .store(millis_now(), Ordering::Relaxed);
        }
        InHand {
            health: self.clone(),
        }
    }

    /// Records that a delivery was answered (replied, dead-lettered or
    /// rejected: settled for good, not handed back for later).
    pub fn answered(&self) {
        self.inner
            .progress_at
            .store(millis_now(), Ordering::Relaxed);
    }

    /// How long the worker has held deliveries without answering any, or
    /// `None` when it holds none.
    pub fn unanswered_for(&self) -> Option<Duration> {
        if self.inner.in_hand.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let since = self.inner.progress_at.load(Ordering::Relaxed);
        Some(Duration::from_millis(millis_now().saturating_sub(since)))
    }

    /// One stall check: stalled when the worker has held deliveries for
    /// `bound` without answering any while every pinged server answers.
    /// Logs and counts a change; returns whether it is stalled now.
    pub fn check_stall(&self, bound: Duration) -> bool {
        let servers_up = !self.inner.redis_down.load(Ordering::Relaxed)
            && !self.inner.postgres_down.load(Ordering::Relaxed);
        let unanswered = self.unanswered_for();
        let stalled = servers_up && unanswered.is_some_and(|d| d >= bound);
        let was = self.inner.stalled.swap(stalled, Ordering::Relaxed);
        if stalled && !was {
            metrics::counter!("prizepool_stalls_total").increment(1);
            tracing::error!(
                in_hand = self.inner.in_hand.load(Ordering::Relaxed),
                unanswered_for = ?unanswered.unwrap_or_default(),
                ?bound,
                "stalled: deliveries in hand and none answered while Redis and Postgres answer \
                 their pings; /healthz and /readyz fail until one is answered"
            );
        } else if was && !stalled {
            tracing::info!("answering again; no longer stalled");
        }
        metrics::gauge!("prizepool_stalled").set(if stalled { 1.0 } else { 0.0 });
        stalled
    }
}

/// What `/readyz` and `/healthz` say of a stalled worker.
const STALLED: &str = "stalled: deliveries in hand, none answered while its servers answer";

#[derive(Clone)]
struct OpsState {
    health: Health,
    metrics: PrometheusHandle,
    process: metrics_process::Collector,
}

/// Buckets of the latency histograms (`*_seconds`): 1 ms to 10 s.
const SECONDS_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Buckets of the size histograms (entries or bodies per batch).
const SIZE_BUCKETS: [f64; 10] = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

/// Every `prizepool_*` metric with its `# HELP` text. `tests/it/observability.rs`
/// checks that each metric the code names is here and that a worker's
/// `/metrics` describes each one it exports.
pub const METRIC_HELP: &[(&str, &str)] = &[
    ("prizepool_acks_held_ahead", "Acks of finished deliveries held back until every earlier delivery of the channel is settled"),
    ("prizepool_audit_refused_total", "Draw records and batch facts the audit trail refused (a bad or missing seal)"),
    ("prizepool_batch_draws_total", "Draws that arrived inside draw.batch messages"),
    ("prizepool_batches_stocked_total", "Lucky-gift batches stocked by the refill worker"),
    ("prizepool_build_info", "Always 1; the version label names the running build"),
    ("prizepool_completed_batches", "Completed batches (every prize paid, none parked), by lucky-gift pool and the config version the batch was stocked under, read from Redis by the refill worker every 5 s"),
    ("prizepool_completed_paid_multiplier", "Sum of the multipliers the prizes of completed batches paid (in unit prices), by lucky-gift pool and batch config version, read from Redis by the refill worker every 5 s"),
    ("prizepool_completed_prizes", "Prizes of completed batches, by lucky-gift pool and batch config version, read from Redis by the refill worker every 5 s"),
    ("prizepool_configured_rtp", "Configured return to player of a lucky-gift pool's config version (sum of multiplier x stock over sum of stock), read from Redis by the refill worker every 5 s"),
    ("prizepool_draws_per_call", "Draws served by one call of a draw script (coalesced draws of one pool)"),
    ("prizepool_draws_total", "Draws answered, by prize kind and outcome (ok or the refusal's error code)"),
    ("prizepool_group_bodies", "Bodies per grouped message (settle.batch, draw.completed.batch), by type"),
    ("prizepool_handed_back_total", "Deliveries handed back through their queue's retry queue while a server they need is away, by queue"),
    ("prizepool_handle_seconds", "Seconds a worker spent on one delivery, up to its reply (a settle delivery: from its batch's arrival to its ack), by queue"),
    ("prizepool_handler_panics_total", "Handler panics caught (the delivery is dead-lettered with code internal)"),
    ("prizepool_ledger_entries_total", "Ledger entries written by the settle worker (duplicates not counted)"),
    ("prizepool_messages_total", "Deliveries handled, by queue and outcome (acked, dead_lettered, requeued, rejected)"),
    ("prizepool_paid_multiplier_total", "Sum of the multipliers of the prizes lucky-gift draws paid (first answers only, in unit prices), by pool and the draw's config version"),
    ("prizepool_pool_batches", "Batches stocked so far, by lucky-gift pool (every sub-pool of a sharded pool together), read by the refill worker every 5 s"),
    ("prizepool_pool_draws_total", "Draws awarded, by pool or activity (every red packet under pool=\"red-packets\")"),
    ("prizepool_pool_paid_total", "What awards paid through the ledger, by pool or activity and asset (red packets under pool=\"red-packets\")"),
    ("prizepool_pool_prizes_drawn_total", "Prizes drawn, by pool or activity (red packets under pool=\"red-packets\")"),
    ("prizepool_pool_stock", "Prizes in the pool now, by lucky-gift pool (every sub-pool of a sharded pool together), read by the refill worker every 5 s"),
    ("prizepool_pool_exhausted_total", "Draws answered pool_exhausted after an urgent refill and the bounded wait"),
    ("prizepool_oversized_bodies_total", "Grouped bodies refused before publishing for being larger than a message (a producer's bug: its delivery fails)"),
    ("prizepool_short_waits_in_slot_total", "Short draws that waited in their worker slot, because PREFETCH − CONCURRENCY draws already waited without one"),
    ("prizepool_prizes_drawn_total", "Prizes drawn (a draw of count N draws N)"),
    ("prizepool_queue_messages", "Messages ready in a queue, read by the refill worker every 5 s, by queue"),
    ("prizepool_ready", "1 while the worker consumes, its last pings of Redis and Postgres succeeded and it is not stalled, else 0"),
    ("prizepool_red_packets_lost_total", "Red packets whose stock was found missing in Redis at expiry"),
    ("prizepool_refill_seconds", "Seconds from a refill request to the batch drawable"),
    ("prizepool_redis_connections_replaced_total", "Redis Cluster connections replaced after a call timed out while a new connection answered"),
    ("prizepool_replies_given_up_total", "Replies given up after retries on fresh connections (the requester is gone)"),
    ("prizepool_retries_total", "Deliveries retried after a transient Redis or Postgres failure"),
    ("prizepool_settle_batch_entries", "Ledger entries per settle batch"),
    ("prizepool_settle_commit_seconds", "Seconds Postgres took to commit one settle batch"),
    ("prizepool_settle_entries_total", "Settle entries handled, by outcome and reason"),
    ("prizepool_settle_lag_seconds", "Age in seconds of the oldest message of the settle batch being booked, updated every second while it waits for the ledger; 0 once the queue is drained (nothing to take for 250 ms, no batch in hand)"),
    ("prizepool_stalled", "1 while the worker holds deliveries and has answered none for STALL_AFTER_MS while Redis and Postgres answer its pings (/healthz and /readyz fail), else 0"),
    ("prizepool_stalls_total", "Times the worker was found stalled (deliveries in hand, none answered for STALL_AFTER_MS, its servers up)"),
    ("prizepool_urgent_refills_total", "Urgent refills asked by draws that found their pool short"),
    ("prizepool_version_prizes_drawn_total", "Prizes lucky-gift draws paid (first answers only), by pool and the draw's config version"),
];

/// Registers the `# HELP` text of every `prizepool_*` metric.
fn describe_metrics() {
    for (name, help) in METRIC_HELP {
        // The exporter prints HELP once per name whatever the kind it was
        // described as, so one kind fits all.
        metrics::describe_gauge!(*name, *help);
    }
}

/// The Prometheus recorder, installed globally. Every histogram is
/// exported as a Prometheus histogram (`_bucket`, `_sum`, `_count`), which
/// sums across replicas, never as a summary.
fn recorder(service: &'static str) -> anyhow::Result<PrometheusHandle> {
    use metrics_exporter_prometheus::Matcher;
    PrometheusBuilder::new()
        // Every series names the worker kind, so one query tells the draw,
        // refill and settle workers apart whatever the scrape labels.
        .add_global_label("worker", service)
        .set_buckets(&SIZE_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        })
        .context("configuring the histogram buckets")?
        .install_recorder()
        .context("installing the metrics recorder")
}

/// Installs the Prometheus recorder and serves the ops endpoint on `addr`
/// until `shutdown`. Returns the bound address; an address that does not
/// parse or cannot be bound is an error.
pub async fn serve(
    service: &'static str,
    addr: &str,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<std::net::SocketAddr> {
    // Bind first: a taken port must fail before anything global happens.
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the ops endpoint to {addr}"))?;
    let metrics = recorder(service)?;
    let process = metrics_process::Collector::default();
    process.describe();
    describe_metrics();
    metrics::gauge!("prizepool_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    // Counters of rare events exist from the start, at zero, so a rate over
    // them means "none" rather than "no data".
    for name in [
        "prizepool_retries_total",
        "prizepool_handler_panics_total",
        "prizepool_pool_exhausted_total",
        "prizepool_urgent_refills_total",
        "prizepool_batches_stocked_total",
        "prizepool_prizes_drawn_total",
        "prizepool_ledger_entries_total",
        "prizepool_stalls_total",
    ] {
        metrics::counter!(name).increment(0);
    }
    metrics::gauge!("prizepool_stalled").set(0.0);
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<OpsState>| async move {
                s.process.collect();
                metrics::gauge!("prizepool_ready").set(if s.health.is_ready() { 1.0 } else { 0.0 });
                s.metrics.render()
            }),
        )
        .route(
            "/healthz",
            get(|State(s): State<OpsState>| async move {
                if s.health.is_stalled() {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not live: {STALLED}"),
                    )
                } else {
                    (StatusCode::OK, "ok".to_owned())
                }
            }),
        )
        .route(
            "/readyz",
            get(|State(s): State<OpsState>| async move {
                match s.health.not_ready_because() {
                    None => (StatusCode::OK, "ready".to_owned()),
                    Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
                }
            }),
        )
        .with_state(OpsState {
            health,
            metrics,
            process,
        });
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(error) = served {
            tracing::warn!(%error, "ops endpoint stopped");
        }
    });
    tracing::info!(%bound, "serving /metrics, /healthz, /readyz");
    Ok(bound)
}

/// Runs a worker binary from start to exit: logs the effective
/// configuration (URLs redacted), serves the ops endpoint (a bad or taken
/// `METRICS_ADDR` ends the process), waits for every server in `needs` with
/// jittered backoff while `/readyz` says not ready, keeps pinging Redis and
/// Postgres for `/readyz`, and then runs `run` until SIGTERM or SIGINT.
/// Every failure is logged through `tracing` (one JSON object per line
/// under `LOG_FORMAT=json`) and turns into a non-zero exit code.
pub async fn run_worker<F, Fut>(
    service: &'static str,
    config: Config,
    needs: &[Dependency],
    run: F,
) -> ExitCode
where
    F: FnOnce(Config, Health, CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let result = async {
        config.tls.install();
        tracing::info!(service, config = %config.summary(), "effective configuration");
        if config.ledger_seal_key.is_none() {
            tracing::warn!(
                "LEDGER_SEAL_KEY is unset: the seal key is the one kept in Redis, and a Redis that \
                 loses it makes the workers disagree on it (set it from a secret store in production)"
            );
        }
        // Kept to the end: dropping it sends the last spans.
        let _traces = crate::telemetry::export_traces(config.otel_endpoint.as_deref(), service)
            .context("OTEL_EXPORTER_OTLP_ENDPOINT")?;
        let shutdown = crate::shutdown::signal();
        let health = Health::default();
        if let Some(addr) = &config.metrics_addr {
            serve(service, addr, health.clone(), shutdown.clone())
                .await
                .context("METRICS_ADDR")?;
        }
        if !wait_for(&config, service, needs, &shutdown).await {
            return Ok(());
        }
        watch(&config, needs, &health, &shutdown).await;
        run(config, health, shutdown).await
    };
    exit(service, result.await)
}

/// Maps a worker's result to its exit code, logging a failure with every
/// URL in its chain redacted.
pub fn exit(service: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => {
            tracing::info!(service, "stopped");
            ExitCode::SUCCESS
        }
        Err(error) => {
            let error = crate::db::redact_text(&format!("{error:#}"));
            tracing::error!(service, error, "stopped by an error");
            ExitCode::FAILURE
        }
    }
}

/// The backoff between attempts to reach a server at start: jittered,
/// growing from 100 ms to 5 s, without end (a worker waits for as long as
/// its servers are away; the orchestrator decides when that is too long).
pub(crate) fn startup_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_jitter()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times()
}

/// Waits until every server in `needs` answers. The servers are awaited
/// side by side, so the log names every one that is away, not only the
/// first. Returns `false` when `shutdown` came first.
pub async fn wait_for(
    config: &Config,
    service: &str,
    needs: &[Dependency],
    shutdown: &CancellationToken,
) -> bool {
    let waits = needs.iter().map(|&dependency| async move {
        let attempt = || ping_once(config, service, dependency);
        let result = attempt
            .retry(startup_backoff())
            .notify(|error: &anyhow::Error, delay: Duration| {
                tracing::warn!(
                    dependency = dependency.name(),
                    error = crate::db::redact_text(&format!("{error:#}")),
                    ?delay,
                    "waiting for a dependency"
                );
            })
            .await;
        // Retries without end: only success ends the wait.
        if result.is_ok() {
            tracing::info!(dependency = dependency.name(), "dependency reachable");
        }
    });
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = futures_util::future::join_all(waits) => true,
    }
}

/// One connection attempt (and, for Redis and Postgres, one round trip).
async fn ping_once(config: &Config, service: &str, dependency: Dependency) -> anyhow::Result<()> {
    const ATTEMPT: Duration = Duration::from_secs(5);
    let attempt = async {
        match dependency {
            Dependency::Broker => {
                let conn = crate::amqp::connect(&config.amqp_url, service).await?;
                // Best effort: the connection only proved the broker is there.
                let _ = conn.close(200, "start-up check".into()).await;
                Ok(())
            }
            Dependency::Redis => {
                let mut redis =
                    crate::redis_conn::connect_with(&config.redis_url, &config.tls).await?;
                ping_redis(&mut redis).await.with_context(|| {
                    format!("reaching Redis at {}", crate::db::redact(&config.redis_url))
                })
            }
            Dependency::Postgres => {
                let pool = ping_pool(&config.database_url)?;
                let pinged = ping_postgres(&pool).await;
                pool.close().await;
                pinged.with_context(|| {
                    format!(
                        "reaching Postgres at {}",
                        crate::db::redact(&config.database_url)
                    )
                })
            }
        }
    };
    tokio::time::timeout(ATTEMPT, attempt)
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {ATTEMPT:?}")))
}

fn ping_pool(url: &str) -> anyhow::Result<sqlx::PgPool> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy(url)
        .with_context(|| format!("parsing DATABASE_URL {}", crate::db::redact(url)))
}

async fn ping_redis(redis: &mut RedisConn) -> anyhow::Result<()> {
    redis::cmd("PING")
        .query_async::<String>(redis)
        .await
        .context("PING")?;
    Ok(())
}

async fn ping_postgres(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::query("SELECT 1")
        .execute(pool)
        .await
        .context("SELECT 1")?;
    Ok(())
}

/// Pings Redis and Postgres (those in `needs`) every
/// `HEALTH_CHECK_INTERVAL_MS` until `shutdown`, recording each outcome in
/// `health`: losing either makes `/readyz` not ready, as losing the broker
/// does. Checks for a stall ([`Health::check_stall`]) at the same pace. The connections are the pinger's own, so a busy worker pool never
/// delays a ping, and a ping never takes a worker's connection.
pub async fn watch(
    config: &Config,
    needs: &[Dependency],
    health: &Health,
    shutdown: &CancellationToken,
) {
    let interval = config.health_check_interval;
    // A ping slower than the interval counts as a failure.
    let limit = interval.max(Duration::from_millis(500));
    {
        let (health, shutdown, bound) = (health.clone(), shutdown.clone(), config.stall_after);
        tokio::spawn(async move {
            let mut timer = ticker(interval);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = timer.tick() => {}
                }
                health.check_stall(bound);
            }
        });
    }
    if needs.contains(&Dependency::Redis) {
        let (url, tls) = (config.redis_url.clone(), config.tls.clone());
        let (health, shutdown) = (health.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut timer = ticker(interval);
            let mut redis: Option<RedisConn> = None;
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = timer.tick() => {}
                }
                if redis.is_none() {
                    let connecting = crate::redis_conn::connect_with(&url, &tls);
                    redis = tokio::time::timeout(limit, connecting)
                        .await
                        .ok()
                        .and_then(Result::ok);
                }
                let up = match redis.as_mut() {
                    Some(conn) => matches!(
                        tokio::time::timeout(limit, ping_redis(conn)).await,
                        Ok(Ok(()))
                    ),
                    None => false,
                };
                report(&health, Dependency::Redis, up);
            }
        });
    }
    if needs.contains(&Dependency::Postgres) {
        if let Ok(pool) = ping_pool(&config.database_url) {
            let (health, shutdown) = (health.clone(), shutdown.clone());
            tokio::spawn(async move {
                let mut timer = ticker(interval);
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = timer.tick() => {}
                    }
                    let up = matches!(
                        tokio::time::timeout(limit, ping_postgres(&pool)).await,
                        Ok(Ok(()))
                    );
                    report(&health, Dependency::Postgres, up);
                }
                pool.close().await;
            });
        }
    }
}

fn ticker(interval: Duration) -> tokio::time::Interval {
    let mut timer = tokio::time::interval(interval);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer
}

/// Records a ping, logging only changes.
fn report(health: &Health, dependency: Dependency, up: bool) {
    let was_down = match dependency {
        Dependency::Redis => health.inner.redis_down.load(Ordering::Relaxed),
        Dependency::Postgres => health.inner.postgres_down.load(Ordering::Relaxed),
        Dependency::Broker => false,
    };
    if was_down == up {
        if up {
            tracing::info!(dependency = dependency.name(), "dependency reachable again");
        } else {
            tracing::warn!(
                dependency = dependency.name(),
                "dependency unreachable; not ready"
            );
        }
    }
    health.set_up(dependency, up);
}

/// Puts the calling thread, and every thread it starts from now on (lapin's
/// I/O thread, the blocking pool), under Linux's `SCHED_BATCH` policy.
///
/// A batch thread does not preempt the running thread when it wakes up. A
/// draw hands work back and forth between the runtime thread and lapin's
/// I/O thread several times, and on a busy machine each hand-off otherwise
/// costs a context switch at once; under this policy the waker runs on and
/// the switches come in fewer, larger batches. It needs no privilege and
/// leaves priorities alone. Measured effect in `docs/performance.md`.
pub fn batch_scheduling() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid, initialised `sched_param` that lives
        // across the call; pid 0 names the calling thread.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "SCHED_BATCH exists on Linux only",
        ))
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn batch_scheduling_applies_to_the_thread_and_the_threads_it_starts() {
        std::thread::spawn(|| {
            // SAFETY: plain queries of the calling thread's policy.
            let policy = || unsafe { libc::sched_getscheduler(0) };
            assert_eq!(policy(), libc::SCHED_OTHER);
            super::batch_scheduling().expect("SCHED_BATCH needs no privilege");
            assert_eq!(policy(), libc::SCHED_BATCH);
            let child = std::thread::spawn(policy).join().expect("child ran");
            assert_eq!(child, libc::SCHED_BATCH);
        })
        .join()
        .expect("the checks passed");
    }
}

#[cfg(test)]
mod stall_tests {
    use super::{Dependency, Health};
    use std::time::Duration;

    const LONG: Duration = Duration::from_secs(3600);

    /// Waits until the clock has moved past `d` (the checks below only need
    /// time to have passed, never to have not).
    fn pass(d: Duration) {
        std::thread::sleep(d + Duration::from_millis(2));
    }

    #[test]
    fn a_stall_needs_deliveries_in_hand_no_answer_for_the_bound_and_servers_up() {
        let bound = Duration::from_millis(20);
        let health = Health::default();
        health.set_ready(true);
        // Idle past the bound: no stall, whatever the time since the last
        // answer.
        pass(bound);
        assert!(!health.check_stall(bound));
        assert_eq!(health.unanswered_for(), None);

        // Holding a delivery: the clock starts when it was taken.
        let held = health.taken();
        assert!(!health.check_stall(LONG));
        pass(bound);
        assert!(health.check_stall(bound));
        assert!(health.is_stalled() && !health.is_ready());
        assert!(health.not_ready_because().unwrap().starts_with("stalled"));

        // A server that does not answer explains the silence: not a stall.
        health.set_up(Dependency::Redis, false);
        assert!(!health.check_stall(bound));
        health.set_up(Dependency::Redis, true);
        health.set_up(Dependency::Postgres, false);
        assert!(!health.check_stall(bound));
        health.set_up(Dependency::Postgres, true);
        assert!(health.check_stall(bound));

        // An answer restarts the clock.
        health.answered();
        assert!(!health.check_stall(LONG));
        assert!(health.is_ready());
        pass(bound);
        assert!(health.check_stall(bound));

        // Nothing in hand: not stalled, however long ago the last answer.
        drop(held);
        assert!(!health.check_stall(bound));
        let second = health.taken();
        assert!(!health.check_stall(LONG), "a new delivery starts the clock");
        drop(second);
    }
}
