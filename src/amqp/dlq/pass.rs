//! One pass over a dead-letter queue that leaves what it does not take in
//! the order it found it.
//!
//! RabbitMQ has no "peek". A quorum queue serves messages that were given
//! back (nack with requeue, or a channel that closed with them unacked)
//! *before* the others, in the order it applied the returns. Two ways of
//! giving back reorder a queue, and `dlq list` used both:
//!
//! - a channel that closes (or a `multiple` nack) returns everything it
//!   held in one command, which the queue applies in its map's order: by
//!   message id up to 32 messages, in hash order past that;
//! - single nacks sent faster than the queue applies them are stashed by
//!   the broker's queue client once 32 are in flight and then sent as one
//!   command: the same hash order.
//!
//! So a pass takes every message the queue held when it began (taking only
//! the first few would put them behind the rest of the returned ones), and
//! gives back the ones it keeps one nack each, a few at a time, waiting
//! until the queue counts each group as ready before sending the next.
//! The queue then serves them first, in the order they were taken, ahead of
//! anything dead-lettered meanwhile: its order and content are unchanged.
//! The broker counts each return in the message's `x-delivery-count`
//! header; listings hide it and a replay strips it.
//!
//! A pass that is killed before it gives its messages back loses none of
//! them (the broker returns them when the connection drops), but then in
//! the broker's order.

use std::time::Duration;

use anyhow::Context;
use lapin::{
    message::Delivery,
    options::{
        BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
        ConfirmSelectOptions, QueueDeclareOptions,
    },
    types::FieldTable,
    Acker, BasicProperties, Channel, Connection,
};

use super::super::Route;

/// Returns sent before waiting for the queue to apply them: well below the
/// 32 in flight past which the broker batches them out of order.
const GIVE_BACK_GROUP: usize = 8;

/// How long one group of returns may take to show up as ready messages.
const GIVE_BACK_DEADLINE: Duration = Duration::from_secs(20);

/// The header quorum queues add to count deliveries: broker bookkeeping,
/// not part of the message.
pub(super) const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// What to do with one dead letter of a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Choice {
    /// Leave it where it is.
    Keep,
    /// Republish it to its work queue, then remove it.
    Move,
    /// Remove it.
    Drop,
}

/// What a pass did.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Passed {
    /// Messages the queue held when the pass began.
    pub(super) found: usize,
    /// Messages moved back to the work queue.
    pub(super) moved: usize,
    /// Messages removed without being moved.
    pub(super) dropped: usize,
    /// Moved messages that were too big for their queue and went back as
    /// several ([`super::split`]).
    pub(super) split: usize,
    /// The messages those were replayed as.
    pub(super) parts: usize,
}

/// Takes each message `route`'s DLQ holds now, in order, asks `decide` what
/// to do with it (its position in the queue, starting at 0, and the
/// delivery), does it, and gives back the kept ones in their order.
pub(super) async fn pass<F>(
    conn: &Connection,
    route: Route,
    mut decide: F,
) -> anyhow::Result<Passed>
where
    F: FnMut(usize, &Delivery) -> Choice,
{
    let found = settled_count(conn, route.dlq).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut passed = Passed {
        found,
        ..Passed::default()
    };
    let mut held = Vec::new();
    let taken = take_all(&channel, route, &mut decide, &mut held, &mut passed).await;
    // Whatever happened while taking, the kept messages go back in order
    // before the channel closes (a close would return them shuffled).
    let given_back = give_back(&channel, route.dlq, &held).await;
    let _ = channel.close(200, "dead letters passed".into()).await;
    taken?;
    given_back?;
    Ok(passed)
}

async fn take_all<F>(
    channel: &Channel,
    route: Route,
    decide: &mut F,
    held: &mut Vec<Acker>,
    passed: &mut Passed,
) -> anyhow::Result<()>
where
    F: FnMut(usize, &Delivery) -> Choice,
{
    for position in 0..passed.found {
        let Some(message) = channel
            .basic_get(route.dlq.into(), BasicGetOptions { no_ack: false })
            .await
            .with_context(|| format!("reading {}", route.dlq))?
        else {
            break;
        };
        let delivery = message.delivery;
        match decide(position, &delivery) {
            Choice::Keep => held.push(delivery.acker),
            Choice::Move => {
                let published = republish(channel, route, &delivery).await?;
                delivery.acker.ack(BasicAckOptions::default()).await?;
                passed.moved += 1;
                if published > 1 {
                    passed.split += 1;
                    passed.parts += published;
                }
            }
            Choice::Drop => {
                delivery.acker.ack(BasicAckOptions::default()).await?;
                passed.dropped += 1;
            }
        }
    }
    Ok(())
}

/// Republishes a dead letter straight to the work queue it came from,
/// through the default exchange, and waits for the broker's confirm. A
/// grouped message too big for its queue's consumer ([`super::split`]) goes
/// back as the messages its bodies fit in, every one confirmed before the
/// letter is removed; the consumers take each body once, whichever message
/// brings it (ledger entries and fairness records are keyed by their ids),
/// so a replay cut short and run again moves nothing twice. Returns how
/// many messages it published.
///
/// Not through an exchange: that could also copy it to other consumers
/// (the events exchange feeds the audit queue and any downstream one), and
/// a dead letter goes back to the one queue that refused it.
async fn republish(channel: &Channel, route: Route, delivery: &Delivery) -> anyhow::Result<usize> {
    let properties = without_delivery_count(&delivery.properties);
    let bodies = super::split(delivery).unwrap_or_else(|| vec![delivery.data.clone()]);
    let mut confirms = Vec::with_capacity(bodies.len());
    for body in &bodies {
        confirms.push(
            channel
                .basic_publish(
                    "".into(),
                    route.queue.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    body,
                    properties.clone(),
                )
                .await?,
        );
    }
    for confirm in confirms {
        let confirm = confirm.await?;
        if confirm.is_nack() || confirm.take_message().is_some() {
            anyhow::bail!(
                "the broker did not take the replayed message (is {} declared?)",
                route.queue
            );
        }
    }
    Ok(bodies.len())
}

/// `properties` without the broker's delivery count: a replayed message
/// starts its work queue's delivery limit afresh.
pub(super) fn without_delivery_count(properties: &BasicProperties) -> BasicProperties {
    let Some(headers) = properties.headers() else {
        return properties.clone();
    };
    let mut kept = headers.inner().clone();
    kept.remove(DELIVERY_COUNT_HEADER);
    properties.clone().with_headers(FieldTable::from(kept))
}

/// Gives `held` back to `queue` in order: a few single nacks at a time,
/// each group applied (counted as ready) before the next is sent.
async fn give_back(channel: &Channel, queue: &str, held: &[Acker]) -> anyhow::Result<()> {
    if held.is_empty() {
        return Ok(());
    }
    let base = ready_on(channel, queue).await?;
    let requeue = BasicNackOptions {
        multiple: false,
        requeue: true,
    };
    let mut returned = 0;
    for group in held.chunks(GIVE_BACK_GROUP) {
        for acker in group {
            acker.nack(requeue).await?;
        }
        returned += group.len();
        let deadline = tokio::time::Instant::now() + GIVE_BACK_DEADLINE;
        loop {
            let ready = ready_on(channel, queue).await?;
            if ready >= base + returned {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!(
                    "{queue} counted {ready} ready messages, {} expected once {returned} \
                     dead letters were given back; the rest are returned by the broker",
                    base + returned
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    Ok(())
}

/// Messages ready in `queue` (a passive declare on `channel`, for a queue
/// known to exist).
async fn ready_on(channel: &Channel, queue: &str) -> anyhow::Result<usize> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("counting {queue}"))?;
    Ok(declared.message_count() as usize)
}

/// Messages ready in `queue` now (a passive declare: nothing is created).
async fn ready_messages(conn: &Connection, queue: &str) -> anyhow::Result<usize> {
    // A passive declare of a missing queue closes its channel, so it gets
    // one of its own.
    let channel = conn.create_channel().await?;
    let ready = ready_on(&channel, queue)
        .await
        .with_context(|| format!("looking up {queue}"));
    let _ = channel.close(200, "counted".into()).await;
    ready
}

/// Messages ready in `queue` once the count holds still: messages another
/// client just released return to the queue a moment later, and a count
/// taken meanwhile would miss them.
async fn settled_count(conn: &Connection, queue: &str) -> anyhow::Result<usize> {
    let mut last = ready_messages(conn, queue).await?;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = ready_messages(conn, queue).await?;
        if now == last {
            break;
        }
        last = now;
    }
    Ok(last)
}
