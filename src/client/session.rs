//! The client's background task: one connection at a time, the batch being
//! gathered, the batches waiting for their replies.

use std::{
    collections::HashMap,
    future::Future,
    pin::Pin,
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use anyhow::Context;
use backon::{ExponentialBuilder, Retryable};
use futures_util::{stream::FuturesUnordered, StreamExt};
use lapin::{
    options::{BasicPublishOptions, ConfirmSelectOptions},
    BasicProperties, Channel, Confirmation, Connection, Consumer,
};
use tokio::{
    sync::{mpsc, oneshot},
    time::Instant,
};
use tokio_util::sync::CancellationToken;

use super::{batch, ClientConfig, ClientError, Stats};
use crate::{
    amqp::{rpc::REPLY_TO, DRAW, EXCHANGE},
    messages::DrawResult,
};

/// How often batches whose callers all gave up are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Connection attempts per round before queued calls are failed.
const CONNECT_ATTEMPTS: usize = 3;

type Answer = Result<DrawResult, ClientError>;

/// One call's attempt, queued for the task.
#[derive(Debug)]
pub(super) struct Job {
    pub(super) request_id: Arc<str>,
    /// The `draw` message's JSON, serialised by the caller.
    pub(super) body: Arc<[u8]>,
    /// Goes out as a plain `draw`, in no batch: a big draw, or an entry
    /// whose batch reply had no room for its answer.
    pub(super) alone: bool,
    pub(super) reply: oneshot::Sender<Answer>,
}

/// A published message waiting for its reply.
#[derive(Debug)]
struct InFlight {
    calls: Vec<(Arc<str>, oneshot::Sender<Answer>)>,
}

impl InFlight {
    fn fail(self, error: &ClientError) {
        for (_, tx) in self.calls {
            let _ = tx.send(Err(error.clone()));
        }
    }
}

/// An open connection: the channel publishes in confirm mode and consumes
/// direct replies.
#[derive(Debug)]
pub(super) struct Session {
    conn: Connection,
    channel: Channel,
    replies: Consumer,
}

impl Session {
    /// Connects to a node of `config.amqp_url` and starts consuming replies.
    pub(super) async fn open(config: &ClientConfig) -> anyhow::Result<Self> {
        let conn = crate::amqp::connect(&config.amqp_url, &config.connection_name).await?;
        let channel = conn.create_channel().await.context("opening a channel")?;
        if let Some(fleet) = &config.declare_topology {
            crate::amqp::declare_topology_for(&channel, fleet).await?;
        }
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .context("enabling publisher confirms")?;
        // Direct reply-to: on this channel, before the first publish.
        let replies = crate::amqp::rpc::consume_replies(&channel).await?;
        Ok(Self {
            conn,
            channel,
            replies,
        })
    }

    async fn close(self) {
        let _ = self.channel.close(200, "bye".into()).await;
        let _ = self.conn.close(200, "bye".into()).await;
    }
}

/// How a session ended.
enum Ended {
    /// The client closed and every call is answered or given up.
    Closed,
    /// The connection broke; calls not yet sent are kept.
    Lost(String),
}

type ConfirmWait =
    Pin<Box<dyn Future<Output = (u64, Result<lapin::Result<Confirmation>, ()>)> + Send>>;

/// The task's state across sessions.
struct Batcher {
    config: Arc<ClientConfig>,
    stats: Arc<Stats>,
    /// Calls gathered for the next message.
    open: Vec<Job>,
    /// Bytes of the gathered calls' bodies.
    open_bytes: usize,
    /// When the first gathered call arrived.
    opened_at: Option<Instant>,
    /// Messages waiting for their replies, by correlation id.
    in_flight: HashMap<u64, InFlight>,
    next_id: u64,
}

/// The background task: serves sessions until the client is closed (or
/// every handle is dropped), reconnecting when one is lost.
pub(super) async fn run(
    config: Arc<ClientConfig>,
    first: Session,
    mut jobs: mpsc::Receiver<Job>,
    closing: CancellationToken,
    stats: Arc<Stats>,
) {
    let mut batcher = Batcher {
        config: config.clone(),
        stats,
        open: Vec::new(),
        open_bytes: 0,
        opened_at: None,
        in_flight: HashMap::new(),
        next_id: 0,
    };
    let mut session = Some(first);
    loop {
        let current = match session.take() {
            Some(s) => s,
            None => match connect(&config, &closing).await {
                Some(Ok(s)) => {
                    batcher.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                    s
                }
                Some(Err(error)) => {
                    // No node answers: the calls waiting fail (their callers
                    // retry on their own schedule), and the next call starts
                    // another round of connection attempts.
                    let error = ClientError::Connect(format!("{error:#}"));
                    batcher.fail_open(&error);
                    while let Ok(job) = jobs.try_recv() {
                        let _ = job.reply.send(Err(error.clone()));
                    }
                    tokio::select! {
                        job = jobs.recv() => match job {
                            Some(job) => batcher.gather(job),
                            None => return,
                        },
                        _ = closing.cancelled() => {
                            jobs.close();
                            while let Ok(job) = jobs.try_recv() {
                                let _ = job.reply.send(Err(ClientError::Closed));
                            }
                            return;
                        }
                    }
                    continue;
                }
                None => return,
            },
        };
        match batcher.serve(current, &mut jobs, &closing).await {
            Ended::Closed => return,
            Ended::Lost(why) => {
                tracing::warn!(error = %why, "draw client lost its connection; reconnecting");
            }
        }
    }
}

/// A few connection attempts with backoff; `None` if the client closes
/// meanwhile.
async fn connect(
    config: &ClientConfig,
    closing: &CancellationToken,
) -> Option<anyhow::Result<Session>> {
    let backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(super::MAX_RETRY_DELAY)
        .with_max_times(CONNECT_ATTEMPTS)
        .with_jitter();
    let open = || Session::open(config);
    tokio::select! {
        result = open.retry(backoff).notify(|error: &anyhow::Error, delay| {
            tracing::warn!(error = %format!("{error:#}"), ?delay, "draw client cannot connect; trying again");
        }) => Some(result),
        _ = closing.cancelled() => None,
    }
}

impl Batcher {
    /// Adds a call to the gathered batch (calls whose caller gave up are
    /// dropped here).
    fn gather(&mut self, job: Job) {
        if job.reply.is_closed() {
            return;
        }
        if self.open.is_empty() {
            self.opened_at = Some(Instant::now());
        }
        self.open_bytes += job.body.len();
        self.open.push(job);
    }

    /// Whether `job` may join the gathered batch without taking it past its
    /// size or 64 KiB.
    fn fits(&self, job: &Job) -> bool {
        batch::fits(
            self.open.len(),
            self.open_bytes,
            job.body.len(),
            self.config.batch_size,
        )
    }

    fn full(&self) -> bool {
        self.open.len() >= self.config.batch_size
    }

    fn fail_open(&mut self, error: &ClientError) {
        for job in self.open.drain(..) {
            let _ = job.reply.send(Err(error.clone()));
        }
        self.open_bytes = 0;
        self.opened_at = None;
    }

    /// Serves one connection until it breaks or the client closes.
    async fn serve(
        &mut self,
        mut session: Session,
        jobs: &mut mpsc::Receiver<Job>,
        closing: &CancellationToken,
    ) -> Ended {
        let mut confirms: FuturesUnordered<ConfirmWait> = FuturesUnordered::new();
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut inputs_open = true;
        // Calls gathered before a reconnect go out first.
        if !self.open.is_empty() && (self.full() || self.lingered()) {
            if let Err(why) = self.flush(&session, &mut confirms).await {
                return self.lost(session, why);
            }
        }
        loop {
            if !inputs_open && self.open.is_empty() && self.in_flight.is_empty() {
                session.close().await;
                return Ended::Closed;
            }
            let linger_until = self
                .opened_at
                .map(|t| t + self.config.linger)
                .unwrap_or_else(|| Instant::now() + SWEEP_EVERY);
            tokio::select! {
                // Replies first: they free callers and memory.
                biased;
                delivery = session.replies.next() => match delivery {
                    Some(Ok(delivery)) => self.answer(&delivery),
                    Some(Err(e)) => return self.lost(session, format!("reply consumer: {e}")),
                    None => return self.lost(session, "reply consumer ended".into()),
                },
                Some((id, confirmed)) = confirms.next(), if !confirms.is_empty() => {
                    if let Err(why) = self.confirmed(id, confirmed) {
                        return self.lost(session, why);
                    }
                }
                job = jobs.recv(), if inputs_open => match job {
                    Some(job) => {
                        if let Err(why) = self.take(job, jobs, &session, &mut confirms).await {
                            return self.lost(session, why);
                        }
                    }
                    None => {
                        inputs_open = false;
                        if let Err(why) = self.flush(&session, &mut confirms).await {
                            return self.lost(session, why);
                        }
                    }
                },
                _ = tokio::time::sleep_until(linger_until), if !self.open.is_empty() => {
                    if let Err(why) = self.flush(&session, &mut confirms).await {
                        return self.lost(session, why);
                    }
                }
                _ = sweep.tick() => {
                    // A batch whose callers all timed out will never be
                    // wanted: its reply (if any) is dropped on arrival.
                    self.in_flight
                        .retain(|_, f| f.calls.iter().any(|(_, tx)| !tx.is_closed()));
                }
                _ = closing.cancelled(), if inputs_open => {
                    // The queued calls still arrive, then `recv` ends.
                    jobs.close();
                }
            }
        }
    }

    /// Fails the calls of batch `id` if the broker refused it (unroutable
    /// or nacked); `Err` when the confirm did not come: the connection is
    /// lost.
    fn confirmed(
        &mut self,
        id: u64,
        confirmed: Result<lapin::Result<Confirmation>, ()>,
    ) -> Result<(), String> {
        let error = match confirmed {
            Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => return Ok(()),
            Ok(Ok(Confirmation::Ack(Some(_)))) => ClientError::Unroutable,
            Ok(Ok(Confirmation::Nack(_))) => ClientError::Nacked,
            Ok(Err(e)) => return Err(format!("publisher confirm: {e}")),
            Err(()) => {
                return Err(format!(
                    "no publisher confirm within {:?}",
                    self.config.timeout
                ))
            }
        };
        if let Some(flight) = self.in_flight.remove(&id) {
            flight.fail(&error);
        }
        Ok(())
    }

    /// Takes `job` and whatever else is already queued, publishing each
    /// batch that fills.
    async fn take(
        &mut self,
        job: Job,
        jobs: &mut mpsc::Receiver<Job>,
        session: &Session,
        confirms: &mut FuturesUnordered<ConfirmWait>,
    ) -> Result<(), String> {
        let mut next = Some(job);
        while let Some(job) = next.take() {
            let alone = job.alone;
            if alone || !self.fits(&job) {
                self.flush(session, confirms).await?;
            }
            self.gather(job);
            if alone || self.full() {
                self.flush(session, confirms).await?;
            }
            // Calls already queued join now rather than one wake-up each.
            next = jobs.try_recv().ok();
        }
        if self.config.linger.is_zero() {
            self.flush(session, confirms).await?;
        }
        Ok(())
    }

    fn lingered(&self) -> bool {
        self.opened_at
            .is_some_and(|t| t.elapsed() >= self.config.linger)
    }

    /// Publishes the gathered calls as one message.
    async fn flush(
        &mut self,
        session: &Session,
        confirms: &mut FuturesUnordered<ConfirmWait>,
    ) -> Result<(), String> {
        self.opened_at = None;
        self.open_bytes = 0;
        let jobs: Vec<Job> = self
            .open
            .drain(..)
            .filter(|j| !j.reply.is_closed())
            .collect();
        if jobs.is_empty() {
            return Ok(());
        }
        let body = batch::encode(jobs.iter().map(|j| &*j.body));
        let id = self.next_id;
        self.next_id += 1;
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_reply_to(REPLY_TO.into())
            .with_correlation_id(id.to_string().into());
        let entries = jobs.len() as u64;
        self.in_flight.insert(
            id,
            InFlight {
                calls: jobs.into_iter().map(|j| (j.request_id, j.reply)).collect(),
            },
        );
        let published = session
            .channel
            .basic_publish(
                EXCHANGE.into(),
                DRAW.routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &body,
                props,
            )
            .await;
        match published {
            Ok(confirm) => {
                self.stats.messages.fetch_add(1, Ordering::Relaxed);
                self.stats.entries.fetch_add(entries, Ordering::Relaxed);
                let timeout = self.config.timeout;
                confirms.push(Box::pin(async move {
                    (
                        id,
                        tokio::time::timeout(timeout, confirm).await.map_err(|_| ()),
                    )
                }));
                Ok(())
            }
            Err(e) => Err(format!("publishing: {e}")),
        }
    }

    /// Hands a reply's results to their callers.
    fn answer(&mut self, delivery: &lapin::message::Delivery) {
        let Some(id) = delivery
            .properties
            .correlation_id()
            .as_ref()
            .and_then(|id| id.as_str().parse::<u64>().ok())
        else {
            return;
        };
        // Unknown ids are replies to batches whose callers gave up.
        let Some(flight) = self.in_flight.remove(&id) else {
            return;
        };
        let ids: Vec<&str> = flight.calls.iter().map(|(id, _)| &**id).collect();
        match batch::decode_reply(&delivery.data, &ids) {
            Ok(results) => {
                for ((_, tx), result) in flight.calls.into_iter().zip(results) {
                    let _ = tx.send(Ok(result));
                }
            }
            Err(error) => {
                tracing::warn!(%error, "draw client: a reply does not answer its request");
                flight.fail(&error.into());
            }
        }
    }

    /// Fails the calls the broken connection carried (their callers retry
    /// at once with the same request ids) and keeps the gathered ones for
    /// the next connection.
    fn lost(&mut self, session: Session, why: String) -> Ended {
        let error = ClientError::ConnectionLost(why.clone());
        for (_, flight) in self.in_flight.drain() {
            flight.fail(&error);
        }
        // A connection that only stopped answering may still be open: closed
        // aside, briefly, so the next one does not wait for it.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(1), session.close()).await;
        });
        Ended::Lost(why)
    }
}
