//! Sessions: one connection to the broker from open to close. A session
//! connects, declares the topology and consumes; its deliveries run as
//! tasks ([`super::delivery`]) while it watches its links; on shutdown it
//! stops consuming, lets the deliveries in hand finish within the grace
//! period, makes sure the broker has processed and applied their acks, and
//! closes the channels, then the connection.

use std::{sync::Arc, time::Instant};

use anyhow::Context;
use futures_util::StreamExt;
use lapin::{
    message::Delivery,
    options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use tokio::sync::Semaphore;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{
    delivery,
    lanes::Lanes,
    shared::{Groupers, Shared},
    unix_now, Acks, Batch, BatchHandler, Handler, Publisher, Replier, Route, IDLE,
};
use crate::{config::Config, ops::Health};

/// How long connecting, declaring the topology and starting to consume may
/// take together.
const SETUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// How often a session checks that its connection and channels still stand.
const WATCHDOG: std::time::Duration = std::time::Duration::from_secs(1);

/// A session's links to the broker: the connection, the consuming channel
/// and its consumer, the confirming channel, and the acker.
struct Link {
    conn: lapin::Connection,
    channel: lapin::Channel,
    publisher: Publisher,
    /// Every consumer of the session (a draw worker consumes each draw
    /// shard), merged; each ends with a `None` item, which ends the session.
    consumer: futures_util::stream::SelectAll<Consumed>,
    tags: Vec<String>,
    prefetch: u16,
    acks: Acks,
    acker: tokio::task::JoinHandle<()>,
    watchdog: tokio::time::Interval,
}

/// One consumer's items, `None` last (when the broker cancelled it or its
/// channel closed).
type Consumed = std::pin::Pin<
    Box<dyn futures_util::Stream<Item = Option<lapin::Result<Delivery>>> + Send + Sync>,
>;

/// What the consumer gave, or why the session ends. Short-lived, one at a
/// time: boxing the delivery would cost an allocation per message.
#[allow(clippy::large_enum_variant)]
enum Next {
    Delivery(Delivery),
    /// The worker is asked to stop.
    Stop,
    /// A link to the broker is gone: end the session and reconnect.
    Lost(anyhow::Error),
}

impl Link {
    /// Connects, declares the topology, sets the prefetch and starts
    /// consuming `route`'s queue.
    ///
    /// Bounded: a node that is starting or stopping may take the connection
    /// and then never answer a declare or a consume (a quorum queue whose
    /// leader is being elected), which would hold the worker for good.
    async fn open(config: &Config, route: Route, prefetch: u16) -> anyhow::Result<Self> {
        let (conn, channel, publisher, consumer, tags) =
            tokio::time::timeout(SETUP_TIMEOUT, async {
                let conn = crate::amqp::connect(&config.amqp_url, route.queue).await?;
                let channel = conn.create_channel().await?;
                crate::amqp::declare_topology_for(&channel, config).await?;
                crate::amqp::declare_retry_queue(&channel, route).await?;
                channel
                    .basic_qos(prefetch, BasicQosOptions::default())
                    .await?;
                let publisher = Publisher::new(conn.create_channel().await?).await?;
                let queues = crate::amqp::consumed_queues(&conn, route, config.draw_shards).await?;
                // All on the one channel: delivery tags are the channel's, so
                // the acker's coalescing spans every queue consumed.
                let mut consumer = futures_util::stream::SelectAll::new();
                let mut tags = Vec::new();
                for queue in &queues {
                    let tag = format!("{queue}-{}", ulid::Ulid::new());
                    let stream = channel
                        .basic_consume(
                            queue.as_str().into(),
                            tag.as_str().into(),
                            BasicConsumeOptions::default(),
                            FieldTable::default(),
                        )
                        .await
                        .with_context(|| format!("consuming {queue}"))?;
                    let stream: Consumed = Box::pin(
                        stream
                            .map(Some)
                            .chain(futures_util::stream::once(std::future::ready(None))),
                    );
                    consumer.push(stream);
                    tags.push(tag);
                }
                anyhow::Ok((conn, channel, publisher, consumer, tags))
            })
            .await
            .map_err(|_| {
                anyhow::anyhow!("the broker did not set up the session within {SETUP_TIMEOUT:?}")
            })??;
        let (acks, acker) = Acks::start(channel.clone());
        Ok(Self {
            conn,
            channel,
            publisher,
            consumer,
            tags,
            prefetch,
            acks,
            acker,
            watchdog: tokio::time::interval(WATCHDOG),
        })
    }

    /// The next delivery, unless the worker is asked to stop or a link to
    /// the broker is gone first. Every way a link can fail ends the wait:
    /// the consumer's stream ends or errs (the broker cancelled the
    /// consumer: a quorum queue that lost its leader, a deleted queue; the
    /// channel or connection closed), the publishing channel failed or lost
    /// a confirm, the acker could not send a frame, or the watchdog finds a
    /// channel or the connection closed without the stream saying so.
    async fn next(&mut self, shutdown: &CancellationToken) -> Next {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Next::Stop,
                next = self.consumer.next() => return match next {
                    Some(Some(Ok(delivery))) => Next::Delivery(delivery),
                    Some(Some(Err(e))) => Next::Lost(anyhow::Error::from(e).context("consuming")),
                    Some(None) | None => {
                        Next::Lost(anyhow::anyhow!("the broker cancelled a consumer"))
                    }
                },
                () = self.publisher.broken() => return Next::Lost(anyhow::anyhow!(
                    "the publishing channel failed or lost a confirm"
                )),
                () = self.acks.failed() => return Next::Lost(anyhow::anyhow!(
                    "the broker did not take an ack"
                )),
                _ = self.watchdog.tick() => {
                    if let Some(lost) = self.lost() {
                        return Next::Lost(anyhow::anyhow!("{lost}"));
                    }
                }
            }
        }
    }

    /// What of the links is gone, if anything.
    fn lost(&self) -> Option<&'static str> {
        if !self.conn.status().connected() {
            Some("the connection to the broker was lost")
        } else if !self.channel.status().connected() {
            Some("the broker closed the consuming channel")
        } else if self.publisher.is_broken() {
            Some("the publishing channel failed or lost a confirm")
        } else {
            None
        }
    }

    /// Resolves once a link is gone (for waits other than [`Self::next`]).
    async fn lost_any(&mut self) -> anyhow::Error {
        loop {
            tokio::select! {
                () = self.publisher.broken() => return anyhow::anyhow!(
                    "the publishing channel failed or lost a confirm"
                ),
                () = self.acks.failed() => return anyhow::anyhow!("the broker did not take an ack"),
                _ = self.watchdog.tick() => {
                    if let Some(lost) = self.lost() {
                        return anyhow::anyhow!("{lost}");
                    }
                }
            }
        }
    }

    /// Stops new deliveries, then lets the ones in hand (`tracker`'s tasks)
    /// finish within `grace`; those that do not are redelivered.
    async fn drain(&self, tracker: &TaskTracker, grace: std::time::Duration) {
        self.cancel().await;
        tracker.close();
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(
                "deliveries in hand did not finish within the grace period; they will be redelivered"
            );
        }
    }

    /// Stops new deliveries.
    async fn cancel(&self) {
        for tag in &self.tags {
            let _ = crate::amqp::bounded(
                "cancelling the consumer",
                self.channel
                    .basic_cancel(tag.as_str().into(), BasicCancelOptions::default()),
            )
            .await;
        }
    }

    /// Sends the last acks, makes sure the broker processed them, and closes
    /// the channels, then the connection.
    async fn close(self) {
        let Self {
            conn,
            channel,
            publisher,
            prefetch,
            acks,
            acker,
            ..
        } = self;
        // Every ack handed on so far (those of every answered delivery: see
        // `Groupers::closed`) goes out before the flush below, however
        // long it takes a busy machine to get there: a lost ack is a
        // redelivery answered twice. Deliveries still running past the
        // grace period hold the acker open; they answer nothing.
        let sent = acks.barrier();
        drop(acks);
        if tokio::time::timeout(ACKS_SENT, sent).await.is_err() {
            tracing::warn!("the last acks were not sent in time; their deliveries come back");
        }
        // The acker ends once every handle is gone and its frames are out.
        let _ = tokio::time::timeout(std::time::Duration::from_millis(100), acker).await;
        // A synchronous round trip on the consuming channel: the broker
        // handles a channel's frames in order, so once qos-ok arrives every
        // ack sent before it has been processed (acks written just before a
        // close can be lost).
        let _ = crate::amqp::bounded(
            "flushing the acks",
            channel.basic_qos(prefetch, BasicQosOptions::default()),
        )
        .await;
        // Processed is not yet settled. RabbitMQ's quorum-queue client
        // (3.10 and later) holds a channel's settlements back while 32 of
        // its commands to a queue await the queue's log, and sends them
        // only as earlier ones are applied; a channel that closes meanwhile
        // drops them, and the queue hands those deliveries, answered
        // already, to the next consumer. Under a burst the last acks of a
        // session are held back like that, so the channel stays open a
        // moment for the queue to apply what it has and take the rest.
        tokio::time::sleep(SETTLEMENTS_APPLIED).await;
        // Each bounded: a connection that is already gone must not hold the
        // worker's reconnect.
        let _ = crate::amqp::bounded(
            "closing the channel",
            channel.close(200, "shutting down".into()),
        )
        .await;
        let _ = crate::amqp::bounded(
            "closing the publishing channel",
            publisher.channel().close(200, "shutting down".into()),
        )
        .await;
        let _ = crate::amqp::bounded(
            "closing the connection",
            conn.close(200, "shutting down".into()),
        )
        .await;
    }
}

/// How long a closing session waits for its last acks to be sent (each
/// frame is bounded on its own, `crate::amqp::BROKER_OP_TIMEOUT`).
const ACKS_SENT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a closing session keeps its consuming channel open after the
/// broker processed its last acks, for a quorum queue to apply them (a
/// few milliseconds when the broker is well; this is the margin for one
/// that is busy or writing slowly).
const SETTLEMENTS_APPLIED: std::time::Duration = std::time::Duration::from_secs(1);

/// One broker session of a [`Handler`]: consumes until `shutdown` or a
/// lost link, then drains, answers nothing more, and closes.
pub(super) async fn session<H: Handler>(
    config: &Config,
    handler: &Arc<H>,
    replier: &Replier,
    health: &Health,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let route = handler.route();
    let mut link = Link::open(config, route, config.prefetch).await?;
    health.set_ready(true);
    tracing::info!(queue = route.queue, "consuming");

    let tracker = TaskTracker::new();
    let (groupers, grouping) = Groupers::start(handler.groups(), &link.publisher, replier);
    let shared = Arc::new(Shared {
        config: config.clone(),
        handler: handler.clone(),
        publisher: link.publisher.clone(),
        groupers: groupers.clone(),
        slots: Arc::new(Semaphore::new(config.concurrency.max(1))),
        lanes: Lanes::new(config.concurrency),
        health: health.clone(),
    });
    let result = loop {
        let delivery = match link.next(shutdown).await {
            Next::Delivery(delivery) => delivery,
            Next::Stop => break Ok(()),
            Next::Lost(error) => break Err(error),
        };
        let (shared, acks, stop) = (shared.clone(), link.acks.clone(), shutdown.clone());
        // Held until the delivery is settled: the stall check's count.
        let in_hand = shared.health.taken();
        tracker.spawn(async move {
            let _in_hand = in_hand;
            let tag = delivery.delivery_tag;
            // None: the worker stopped before the delivery had a slot; it
            // stays unsettled and the broker redelivers it.
            let Some((how, replied)) = delivery::process_caught(&*shared, delivery, &stop).await
            else {
                return;
            };
            // The ack of a delivery that was answered is handed on before
            // the session may close (see `Groupers::closed`).
            acks.finish(tag, how);
            drop(replied);
        });
    };
    health.set_ready(false);

    link.drain(&tracker, config.shutdown_grace).await;
    drop(shared);
    groupers.close(grouping).await;
    link.close().await;
    result
}

pub(super) async fn batch_session<B: BatchHandler>(
    config: &Config,
    handler: &Arc<B>,
    replier: &Replier,
    health: &Health,
    shutdown: &CancellationToken,
    empty_since: &std::sync::atomic::AtomicU64,
) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;
    let route = handler.route();
    let limits = handler.limits();
    let mut link = Link::open(config, route, limits.prefetch).await?;
    health.set_ready(true);
    tracing::info!(queue = route.queue, "consuming");

    let tracker = TaskTracker::new();
    let result = loop {
        // The first delivery of a batch. A wait that lasts means the queue
        // was empty when it began.
        let waiting_since = unix_now();
        let started = Instant::now();
        let next = {
            let next = link.next(shutdown);
            tokio::pin!(next);
            // The same wait goes on after the handler heard the queue is idle.
            tokio::select! {
                next = &mut next => next,
                () = tokio::time::sleep(IDLE) => {
                    handler.idle();
                    next.await
                }
            }
        };
        let first = match next {
            Next::Delivery(delivery) => delivery,
            Next::Stop => break Ok(()),
            Next::Lost(error) => break Err(error),
        };
        let began = Instant::now();
        if began.duration_since(started) >= IDLE {
            empty_since.fetch_max(waiting_since, Ordering::Relaxed);
        }
        let mut deliveries = vec![first];
        let deadline = tokio::time::Instant::now() + limits.wait;
        let mut end = None;
        while deliveries.len() < limits.size {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break,
                next = link.next(shutdown) => match next {
                    Next::Delivery(delivery) => deliveries.push(delivery),
                    // The batch in hand is still handled.
                    Next::Stop => { end = Some(Ok(())); break }
                    Next::Lost(error) => { end = Some(Err(error)); break }
                },
            }
        }
        let batch = Batch {
            deliveries,
            publisher: link.publisher.clone(),
            replier: replier.clone(),
            shutdown: shutdown.clone(),
            empty_since: empty_since.load(Ordering::Relaxed),
            acks: link.acks.clone(),
            queue: route.queue,
            began,
        };
        let handler = handler.clone();
        let in_hand = health.taken();
        let mut handling = tracker.spawn(async move { handler.handle_batch(batch).await });
        // One batch at a time; a link lost meanwhile ends the session at
        // once (the batch's own acks would go nowhere).
        let handled = tokio::select! {
            handled = &mut handling => handled,
            error = link.lost_any() => break Err(error),
        };
        drop(in_hand);
        match handled {
            Ok(Ok(())) => health.answered(),
            Ok(Err(error)) => break Err(error),
            Err(join) => break Err(anyhow::anyhow!("the batch handler failed: {join}")),
        }
        if let Some(end) = end {
            break end;
        }
    };
    health.set_ready(false);

    link.drain(&tracker, config.shutdown_grace).await;
    link.close().await;
    result
}
