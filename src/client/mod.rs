//! A draw client for upstream services that batches: [`Client::draw`]
//! returns one draw's result, while the client merges concurrent calls into
//! `draw.batch` messages (`docs/protocol.md`), the way a Kafka producer
//! merges records by `linger.ms` and `batch.size`.
//!
//! ```no_run
//! # async fn example() -> Result<(), prizepool::client::ClientError> {
//! use prizepool::client::{draw_request, Client, ClientConfig};
//!
//! let client = Client::connect(ClientConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
//! let result = client.draw(draw_request("gift-1001", 42, 10)).await?;
//! println!("{:?} {:?}", result.status, result.reward);
//! client.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! How it works. One background task ([`session`]) owns one connection, one
//! channel in confirm mode, and a consumer of direct reply-to
//! (`amq.rabbitmq.reply-to`) on that same channel (RabbitMQ asks for the
//! consume and the publishes on one channel). Each call serialises its draw
//! on its own task and hands it to the background task through a bounded
//! queue; the task gathers calls into a batch and publishes it when
//! [`ClientConfig::batch_size`] entries are gathered (or the next would take
//! the message past 64 KiB), or when [`ClientConfig::linger`] has passed
//! since the batch's first entry. A reply is matched by correlation id to its
//! batch and split back into one result per caller.
//!
//! **A batch of one goes out as a plain `draw`.** Its reply is then the
//! single `draw_result` the protocol always had, so the client (and the
//! `prizepool draw` command on top of it) works against workers that predate
//! `draw.batch`, and a quiet client, whose calls rarely meet, costs the
//! workers nothing new. Each entry keeps its own idempotency on the worker,
//! so a call retried alone may land in a batch and the other way round.
//!
//! **Failures.** Every attempt has [`ClientConfig::timeout`]. A call that
//! times out, or whose connection is lost, is sent again with the **same
//! `request_id`**, up to [`ClientConfig::retries`] times with jittered
//! exponential backoff (`backon`): the worker answers a request id it has
//! seen with its first answer, so a retry never draws twice. A lost
//! connection fails the calls it carried at once (they retry without waiting
//! out their timeout) and the task connects again, to any node of the
//! comma-separated URL ([`crate::amqp::connect`]). A publisher confirm that
//! does not come within the timeout counts as a lost connection: a node that
//! is stopping can keep the TCP connection open and answer nothing.
//!
//! **Big draws.** A lucky-gift draw of more than
//! [`PRIZE_LIST_MAX`](crate::messages::PRIZE_LIST_MAX) prizes is answered in
//! the compact `prize_codes` form; the client expands it, so every result it
//! hands out lists its prizes in `prizes`. Such a draw travels alone (its
//! reply may take most of a message), and an entry the worker shortened to
//! keep a batch reply within 64 KiB (`omitted`) is sent again alone with
//! the same `request_id`: the worker replays its whole answer.

mod batch;
mod session;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use backon::{ExponentialBuilder, Retryable};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_util::sync::CancellationToken;

pub use batch::{ReplyError, BATCH_REPLY_TYPE, BATCH_TYPE, DEFAULT_MAX_BATCH};

use crate::messages::{typed_json, DrawRequest, DrawResult, MAX_MESSAGE_BYTES};

/// Default time a batch waits for more calls after its first.
pub const DEFAULT_LINGER: Duration = Duration::from_millis(2);
/// Default entries per batch (at most the workers' `MAX_BATCH`, 100 unless
/// set otherwise).
pub const DEFAULT_BATCH_SIZE: usize = 50;
/// Default time one attempt waits for its reply.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default retries after the first attempt.
pub const DEFAULT_RETRIES: usize = 3;
/// Default first pause between attempts (doubling, with jitter, up to
/// [`MAX_RETRY_DELAY`]).
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_millis(100);
/// Longest pause between two attempts.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(2);

/// How a [`Client`] connects and batches. Built with defaults by
/// [`ClientConfig::new`] and adjusted with its builder methods.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `AMQP_URL`: one URL or the comma-separated nodes of a cluster.
    pub amqp_url: String,
    /// The connection's name in the broker's management UI.
    pub connection_name: String,
    /// How long a batch waits for more calls after its first one. Zero sends
    /// whatever has gathered at once (under load, calls still meet).
    pub linger: Duration,
    /// Entries per message, at most: 1 sends every draw on its own.
    pub batch_size: usize,
    /// How long one attempt waits for its reply (queueing, linger and the
    /// worker's time included).
    pub timeout: Duration,
    /// Attempts after the first, each with the same `request_id`.
    pub retries: usize,
    /// First pause before a retry.
    pub retry_delay: Duration,
    /// Calls waiting for the background task, at most; more wait in
    /// [`Client::draw`] (backpressure).
    pub queue_capacity: usize,
    /// Declare the fleet's topology on connecting, with the workers'
    /// settings (`DELIVERY_LIMIT`, `DRAW_SHARDS`: a declaration must agree
    /// with the fleet's), so draws are routable before any worker started.
    /// `None`: leave the topology to the workers.
    pub declare_topology: Option<Arc<crate::config::Config>>,
}

impl ClientConfig {
    /// The defaults: linger 2 ms, batches of 50, 10 s per attempt, 3 retries.
    pub fn new(amqp_url: impl Into<String>) -> Self {
        Self {
            amqp_url: amqp_url.into(),
            connection_name: "prizepool-client".into(),
            linger: DEFAULT_LINGER,
            batch_size: DEFAULT_BATCH_SIZE,
            timeout: DEFAULT_TIMEOUT,
            retries: DEFAULT_RETRIES,
            retry_delay: DEFAULT_RETRY_DELAY,
            queue_capacity: 4096,
            declare_topology: None,
        }
    }

    /// Sets [`linger`](Self::linger).
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Sets [`batch_size`](Self::batch_size) (at least 1).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`retries`](Self::retries).
    pub fn retries(mut self, retries: usize) -> Self {
        self.retries = retries;
        self
    }

    /// Sets [`retry_delay`](Self::retry_delay).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Sets [`connection_name`](Self::connection_name).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// Sets [`queue_capacity`](Self::queue_capacity) (at least 1).
    pub fn queue_capacity(mut self, capacity: usize) -> Self {
        self.queue_capacity = capacity.max(1);
        self
    }

    /// Declares the topology on connecting, as the fleet configured by
    /// `fleet` does ([`declare_topology`](Self::declare_topology)).
    pub fn declare_topology(mut self, fleet: &crate::config::Config) -> Self {
        self.declare_topology = Some(Arc::new(fleet.clone()));
        self
    }

    fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.retry_delay)
            .with_max_delay(MAX_RETRY_DELAY.max(self.retry_delay))
            .with_max_times(self.retries)
            .with_jitter()
    }
}

/// Why [`Client::draw`] has no result. A refusal by the worker
/// (`rejected`, with its code) is a result, not an error.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ClientError {
    /// No reply within the timeout, on every attempt.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The connection was lost while the draw was in flight.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// No broker node could be reached.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The broker refused the message (`nack`: a queue at its length limit,
    /// a node going down).
    #[error("the broker refused the message")]
    Nacked,
    /// No queue is bound for draws: the topology is not declared.
    #[error("no queue takes draws (is the fleet's topology declared?)")]
    Unroutable,
    /// The worker refused the batch as a whole; sending it again cannot
    /// help.
    #[error("the worker refused the batch: {0}")]
    BatchRejected(String),
    /// The reply did not answer the request.
    #[error("unexpected reply: {0}")]
    Protocol(String),
    /// The request cannot be sent as it is.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The client was closed.
    #[error("the client is closed")]
    Closed,
}

impl ClientError {
    /// Whether sending the same request again may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Timeout(_) | Self::ConnectionLost(_) | Self::Connect(_) | Self::Nacked
        )
    }
}

impl From<ReplyError> for ClientError {
    fn from(e: ReplyError) -> Self {
        match e {
            ReplyError::Rejected(m) => Self::BatchRejected(m),
            ReplyError::Protocol(m) => Self::Protocol(m),
        }
    }
}

/// A draw request for `user_id` with a fresh ULID as its `request_id`.
pub fn draw_request(pool: impl Into<String>, user_id: i64, count: u32) -> DrawRequest {
    DrawRequest {
        request_id: ulid::Ulid::new().to_string(),
        pool: pool.into(),
        user_id,
        count,
    }
}

/// Counters of what a client sent, for benchmarks and tests.
#[derive(Debug, Default)]
pub struct Stats {
    /// Messages published (batches and single draws, retries included).
    pub messages: AtomicU64,
    /// Draws those messages carried.
    pub entries: AtomicU64,
    /// Attempts that were retries.
    pub retries: AtomicU64,
    /// Connections opened after the first.
    pub reconnects: AtomicU64,
}

impl Stats {
    /// A snapshot: (messages, entries, retries, reconnects).
    pub fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.messages.load(Ordering::Relaxed),
            self.entries.load(Ordering::Relaxed),
            self.retries.load(Ordering::Relaxed),
            self.reconnects.load(Ordering::Relaxed),
        )
    }
}

/// A batching draw client. Cheap to clone: the clones share one connection
/// and one background task.
#[derive(Clone, Debug)]
pub struct Client {
    jobs: mpsc::Sender<session::Job>,
    config: Arc<ClientConfig>,
    stats: Arc<Stats>,
    closing: CancellationToken,
    task: Arc<Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

impl Client {
    /// Connects (an error if no node answers now) and starts the background
    /// task, which reconnects on its own from then on.
    pub async fn connect(config: ClientConfig) -> Result<Self, ClientError> {
        let stats = Arc::new(Stats::default());
        let first = session::Session::open(&config)
            .await
            .map_err(|e| ClientError::Connect(format!("{e:#}")))?;
        let (jobs, queue) = mpsc::channel(config.queue_capacity.max(1));
        let closing = CancellationToken::new();
        let config = Arc::new(config);
        let task = tokio::spawn(session::run(
            config.clone(),
            first,
            queue,
            closing.clone(),
            stats.clone(),
        ));
        Ok(Self {
            jobs,
            config,
            stats,
            closing,
            task: Arc::new(Mutex::new(Some(task))),
        })
    }

    /// Draws, and returns the worker's answer: `ok` with the prizes, or
    /// `rejected` with the reason. Retries with the same `request_id` on a
    /// timeout or a lost connection (see the module's documentation).
    pub async fn draw(&self, request: DrawRequest) -> Result<DrawResult, ClientError> {
        let body: Arc<[u8]> = typed_json("draw", &request).into();
        if batch::framed_len(1, body.len()) > MAX_MESSAGE_BYTES {
            return Err(ClientError::Invalid(format!(
                "a draw of {} bytes does not fit in a message",
                body.len()
            )));
        }
        let id: Arc<str> = request.request_id.into();
        // A big draw's reply can take most of a message: it goes alone.
        let big = request.count as usize > crate::messages::PRIZE_LIST_MAX;
        let result = self.send(&id, &body, big).await?;
        if !result.omitted {
            return Ok(result);
        }
        // The batch reply had no room for this entry's whole answer: ask
        // again alone, which replays it (nothing is drawn twice).
        self.send(&id, &body, true).await
    }

    /// Sends one draw (in a batch, or `alone`) until it is answered or the
    /// retries are spent.
    async fn send(
        &self,
        id: &Arc<str>,
        body: &Arc<[u8]>,
        alone: bool,
    ) -> Result<DrawResult, ClientError> {
        let first = std::sync::atomic::AtomicBool::new(true);
        let attempt = || async {
            if !first.swap(false, Ordering::Relaxed) {
                self.stats.retries.fetch_add(1, Ordering::Relaxed);
            }
            self.attempt(id.clone(), body.clone(), alone).await
        };
        attempt
            .retry(self.config.backoff())
            .when(ClientError::is_retryable)
            .notify(|error, delay| {
                tracing::debug!(request.id = %id, %error, ?delay, "draw attempt failed; retrying");
            })
            .await
    }

    /// One attempt: queue the draw, wait for its answer.
    async fn attempt(
        &self,
        id: Arc<str>,
        body: Arc<[u8]>,
        alone: bool,
    ) -> Result<DrawResult, ClientError> {
        let timeout = self.config.timeout;
        let attempt = async {
            let (reply, answer) = oneshot::channel();
            let job = session::Job {
                request_id: id,
                body,
                alone,
                reply,
            };
            self.jobs.send(job).await.map_err(|_| ClientError::Closed)?;
            // The task drops a call's sender only when it stops for good.
            answer.await.map_err(|_| ClientError::Closed)?
        };
        tokio::time::timeout(timeout, attempt)
            .await
            .map_err(|_| ClientError::Timeout(timeout))?
    }

    /// What this client (and its clones) sent so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The configuration in use.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Stops taking draws (for every clone), sends those already queued,
    /// waits for their answers (at most a timeout) and closes the
    /// connection.
    pub async fn close(self) {
        self.closing.cancel();
        let task = self.task.lock().await.take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}
