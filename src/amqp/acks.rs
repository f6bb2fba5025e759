//! Coalesced acknowledgements for one consuming channel.
//!
//! Deliveries finish out of order, but mostly in order: Redis answers a
//! multiplexed connection in order and the broker confirms publishes in order.
//! So instead of one `basic.ack` per delivery, finished deliveries go to one
//! acker task per channel, which sends a single `multiple` ack for the longest
//! run of finished delivery tags since the previous one. On a quorum queue
//! each ack frame is a log entry, so this takes work off the broker.
//!
//! A delivery that finishes ahead of a slower one is acked on its own at once:
//! a slow delivery (a short pool waiting for its refill) never holds finished
//! ones back, so the prefetch window never fills with work that is done.
//! Requeues and rejections are always sent on their own and before any
//! `multiple` ack, which therefore never covers a delivery meant to go back.

use std::collections::{BTreeMap, BTreeSet};

use lapin::{
    options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions},
    Channel,
};
use tokio::{
    sync::{mpsc, oneshot},
    task::JoinHandle,
};
use tokio_util::sync::CancellationToken;

/// How a delivery ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Done: remove it from the queue.
    Ack,
    /// Put it back for another attempt (counts towards the delivery limit).
    Requeue,
    /// Drop it, or dead-letter it where the queue has a dead-letter exchange.
    Reject,
}

/// A frame to send to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// `basic.ack` of this tag and, with `multiple`, of every earlier
    /// unsettled tag.
    Ack { tag: u64, multiple: bool },
    /// `basic.nack` with requeue.
    Requeue(u64),
    /// `basic.reject` without requeue.
    Reject(u64),
}

/// Which delivery tags are settled, and which frames settle them.
///
/// Tags on a channel start at 1 and grow by one per delivery.
#[derive(Debug)]
pub struct AckWindow {
    /// The lowest tag not yet finished.
    next: u64,
    /// Finished tags above `next`, each already settled by its own frame.
    ahead: BTreeSet<u64>,
    /// Finished tags from `next` upwards whose ack waits for the next flush.
    pending: BTreeMap<u64, Settle>,
}

impl Default for AckWindow {
    fn default() -> Self {
        Self {
            next: 1,
            ahead: BTreeSet::new(),
            pending: BTreeMap::new(),
        }
    }
}

impl AckWindow {
    /// Records that `tag` finished with `how`; frames go out at [`flush`](Self::flush).
    pub fn finish(&mut self, tag: u64, how: Settle) {
        if tag >= self.next && !self.ahead.contains(&tag) {
            self.pending.insert(tag, how);
        }
    }

    /// The frames that settle everything finished since the last flush, in
    /// the order they must be sent.
    pub fn flush(&mut self) -> Vec<Frame> {
        let mut frames = Vec::new();
        // Requeues and rejections first, each on its own.
        for (&tag, &how) in &self.pending {
            match how {
                Settle::Requeue => frames.push(Frame::Requeue(tag)),
                Settle::Reject => frames.push(Frame::Reject(tag)),
                Settle::Ack => {}
            }
        }
        // Then the run of finished tags starting at `next`: one multiple ack,
        // if any of them is an ack.
        let mut last_ack = None;
        loop {
            if let Some(how) = self.pending.remove(&self.next) {
                if how == Settle::Ack {
                    last_ack = Some(self.next);
                }
            } else if !self.ahead.remove(&self.next) {
                break;
            }
            self.next += 1;
        }
        // Finished tags past a gap are acked one by one, now.
        for (tag, how) in std::mem::take(&mut self.pending) {
            if how == Settle::Ack {
                frames.push(Frame::Ack {
                    tag,
                    multiple: false,
                });
            }
            self.ahead.insert(tag);
        }
        if let Some(tag) = last_ack {
            frames.push(Frame::Ack {
                tag,
                multiple: true,
            });
        }
        frames
    }

    /// Finished tags held above a gap (for metrics and tests).
    pub fn ahead(&self) -> usize {
        self.ahead.len()
    }
}

/// What the acker is handed.
#[derive(Debug)]
enum Note {
    /// A finished delivery.
    Finished(u64, Settle),
    /// Answered once everything handed on before it is sent.
    Barrier(oneshot::Sender<()>),
}

/// The sending half, cloned into every delivery's task.
#[derive(Debug, Clone)]
pub struct Acks {
    tx: mpsc::UnboundedSender<Note>,
    /// Cancelled once a frame could not be sent: the channel is gone or
    /// stuck, and the session should end (the broker redelivers whatever it
    /// had not seen settled).
    failed: CancellationToken,
}

impl Acks {
    /// Starts the acker task for `channel`. It ends once every [`Acks`] is
    /// dropped and the last frames are sent; await the handle to know that.
    pub fn start(channel: Channel) -> (Self, JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let failed = CancellationToken::new();
        let failing = failed.clone();
        let task = tokio::spawn(async move {
            let mut window = AckWindow::default();
            let mut batch = Vec::with_capacity(256);
            let mut barriers = Vec::new();
            while rx.recv_many(&mut batch, 1024).await > 0 {
                for note in batch.drain(..) {
                    match note {
                        Note::Finished(tag, how) => window.finish(tag, how),
                        Note::Barrier(done) => barriers.push(done),
                    }
                }
                // All of a round's frames are queued at once, in order (a
                // frame takes its place on the channel on its first poll),
                // so the connection writes them together.
                let frames = window.flush();
                let sent =
                    futures_util::future::join_all(frames.iter().map(|&f| send(&channel, f))).await;
                for (frame, result) in frames.iter().zip(sent) {
                    if let Err(error) = result {
                        // The channel is gone: the broker redelivers whatever
                        // it had not seen settled.
                        // Once per session: the rest fail the same way.
                        if !failing.is_cancelled() {
                            tracing::warn!(
                                error = format!("{error:#}"),
                                ?frame,
                                "settling a delivery failed; ending the session"
                            );
                        }
                        failing.cancel();
                    }
                }
                metrics::gauge!("prizepool_acks_held_ahead").set(window.ahead() as f64);
                // This round's frames are on the channel, ahead of anything
                // the caller of the barrier sends next.
                for done in barriers.drain(..) {
                    let _ = done.send(());
                }
            }
        });
        (Self { tx, failed }, task)
    }

    /// Resolves once a frame could not be sent.
    pub async fn failed(&self) {
        self.failed.cancelled().await;
    }

    /// Hands a finished delivery to the acker.
    pub fn finish(&self, tag: u64, how: Settle) {
        // Only fails once the acker is gone, and then so is the channel.
        let _ = self.tx.send(Note::Finished(tag, how));
    }

    /// Resolves once every delivery handed on before this call has had its
    /// frame sent (or the acker is gone). A closing session waits for it,
    /// not for the acker to end: deliveries still running past the grace
    /// period keep the acker alive, and the acks of those that were
    /// answered must not wait behind them.
    pub fn barrier(&self) -> impl std::future::Future<Output = ()> + use<> {
        let (done, sent) = oneshot::channel();
        let _ = self.tx.send(Note::Barrier(done));
        async move {
            let _ = sent.await;
        }
    }
}

async fn send(channel: &Channel, frame: Frame) -> anyhow::Result<()> {
    // Bounded: a frame lapin never resolves would stop this acker, and with
    // it every later ack of the session (see `super::BROKER_OP_TIMEOUT`).
    super::bounded("settling a delivery", async {
        match frame {
            Frame::Ack { tag, multiple } => {
                channel.basic_ack(tag, BasicAckOptions { multiple }).await
            }
            Frame::Requeue(tag) => {
                channel
                    .basic_nack(
                        tag,
                        BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        },
                    )
                    .await
            }
            Frame::Reject(tag) => {
                channel
                    .basic_reject(tag, BasicRejectOptions { requeue: false })
                    .await
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn in_order_finishes_become_one_multiple_ack() {
        let mut w = AckWindow::default();
        for tag in 1..=5 {
            w.finish(tag, Settle::Ack);
        }
        assert_eq!(
            w.flush(),
            vec![Frame::Ack {
                tag: 5,
                multiple: true
            }]
        );
        assert!(w.flush().is_empty());
    }

    #[test]
    fn a_slow_delivery_does_not_hold_back_later_ones() {
        let mut w = AckWindow::default();
        w.finish(2, Settle::Ack);
        w.finish(3, Settle::Ack);
        assert_eq!(
            w.flush(),
            vec![
                Frame::Ack {
                    tag: 2,
                    multiple: false
                },
                Frame::Ack {
                    tag: 3,
                    multiple: false
                }
            ]
        );
        w.finish(1, Settle::Ack);
        w.finish(4, Settle::Ack);
        assert_eq!(
            w.flush(),
            vec![Frame::Ack {
                tag: 4,
                multiple: true
            }]
        );
        assert_eq!(w.ahead(), 0);
    }

    #[test]
    fn requeues_go_out_before_the_multiple_ack_that_passes_them() {
        let mut w = AckWindow::default();
        w.finish(1, Settle::Ack);
        w.finish(2, Settle::Requeue);
        w.finish(3, Settle::Ack);
        w.finish(4, Settle::Reject);
        assert_eq!(
            w.flush(),
            vec![
                Frame::Requeue(2),
                Frame::Reject(4),
                Frame::Ack {
                    tag: 3,
                    multiple: true
                }
            ]
        );
    }

    /// What the broker does with the frames: the disposition of each tag.
    fn broker_view(frames: &[Frame], outstanding: &mut BTreeMap<u64, ()>) -> BTreeMap<u64, Settle> {
        let mut settled = BTreeMap::new();
        for frame in frames {
            match *frame {
                Frame::Ack { tag, multiple } => {
                    let tags: Vec<u64> = if multiple {
                        outstanding.range(..=tag).map(|(t, _)| *t).collect()
                    } else {
                        vec![tag]
                    };
                    for t in tags {
                        assert!(outstanding.remove(&t).is_some(), "tag {t} settled twice");
                        settled.insert(t, Settle::Ack);
                    }
                }
                Frame::Requeue(t) | Frame::Reject(t) => {
                    assert!(outstanding.remove(&t).is_some(), "tag {t} settled twice");
                    let how = if matches!(frame, Frame::Requeue(_)) {
                        Settle::Requeue
                    } else {
                        Settle::Reject
                    };
                    settled.insert(t, how);
                }
            }
        }
        settled
    }

    proptest! {
        /// Whatever the finishing order and flush points, the broker settles
        /// every finished delivery exactly once, as its task asked, and never
        /// touches one still in progress.
        #[test]
        fn every_delivery_is_settled_once_as_asked(
            n in 1u64..60,
            seed in any::<u64>(),
            flush_every in 1usize..8,
            unfinished in proptest::collection::btree_set(1u64..60, 0..4),
        ) {
            use rand::{seq::SliceRandom, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut order: Vec<u64> = (1..=n).filter(|t| !unfinished.contains(t)).collect();
            order.shuffle(&mut rng);
            let how = |t: u64| match t % 7 { 0 => Settle::Requeue, 3 => Settle::Reject, _ => Settle::Ack };
            let mut outstanding: BTreeMap<u64, ()> = (1..=n).map(|t| (t, ())).collect();
            let mut w = AckWindow::default();
            let mut settled = BTreeMap::new();
            for (i, &tag) in order.iter().enumerate() {
                w.finish(tag, how(tag));
                if (i + 1) % flush_every == 0 {
                    settled.extend(broker_view(&w.flush(), &mut outstanding));
                }
            }
            settled.extend(broker_view(&w.flush(), &mut outstanding));
            for t in 1..=n {
                if unfinished.contains(&t) {
                    prop_assert!(outstanding.contains_key(&t), "tag {} settled while in progress", t);
                } else {
                    prop_assert_eq!(settled.get(&t), Some(&how(t)), "tag {}", t);
                }
            }
        }
    }
}
