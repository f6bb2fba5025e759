//! What the deliveries of a session share: the grouping publishers, the
//! reply connection, the slots and lanes, and the guard a delivery holds
//! from its reply until its ack is handed on.

use std::sync::Arc;

use tokio::sync::{OwnedRwLockReadGuard, RwLock, Semaphore};

use super::{lanes::Lanes, Group, Publisher, Replier, Settle};
use crate::{amqp::grouped::Grouper, config::Config};

/// What a delivery ended as: the label of its outcome metric, how it is
/// settled, and the guard held from its reply until its ack is handed on.
pub(super) type Ended = (&'static str, Settle, Replied);

/// The grouping publishers and the reply connection a worker's deliveries
/// share.
#[derive(Clone, Debug)]
pub(super) struct Groupers {
    /// One grouping publisher per group the handler declares.
    pub(super) grouped: Arc<[(Group, Grouper)]>,
    pub(super) replier: Replier,
    /// Set once the session stops answering. A delivery holds a read guard
    /// from its reply until its ack is handed on: a reply whose ack could
    /// be lost in the close would be sent again by the redelivery, two
    /// answers to one request.
    pub(super) closed: Arc<RwLock<bool>>,
}

impl Groupers {
    /// One grouping publisher per group in `groups`, on `publisher`, and
    /// the tasks that run them.
    pub(super) fn start(
        groups: &[Group],
        publisher: &Publisher,
        replier: &Replier,
    ) -> (Self, Vec<tokio::task::JoinHandle<()>>) {
        let (grouped, grouping): (Vec<_>, Vec<_>) = groups
            .iter()
            .map(|&group| {
                let (grouper, task) = Grouper::start(publisher.clone(), group);
                ((group, grouper), task)
            })
            .unzip();
        let groupers = Self {
            grouped: grouped.into(),
            replier: replier.clone(),
            closed: Arc::new(RwLock::new(false)),
        };
        (groupers, grouping)
    }

    /// Answers nothing from now on: a delivery still in hand is redelivered
    /// and answered then. Waiting for the write lock waits for those that
    /// were answered to hand their acks on, so the session's last flush
    /// sends them. Then lets the grouping publishers send what they hold.
    pub(super) async fn close(self, grouping: Vec<tokio::task::JoinHandle<()>>) {
        *self.closed.write().await = true;
        // The groupers end once every handle is gone and what they hold is
        // out.
        drop(self);
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            futures_util::future::join_all(grouping),
        )
        .await;
    }
}

/// What every delivery of a session shares.
#[derive(Debug)]
pub(super) struct Shared<H> {
    pub(super) config: Config,
    pub(super) handler: Arc<H>,
    /// The session's confirming channel.
    pub(super) publisher: Publisher,
    pub(super) groupers: Groupers,
    /// The worker's `CONCURRENCY` slots: one per delivery being handled.
    pub(super) slots: Arc<Semaphore>,
    pub(super) lanes: Lanes,
    /// The worker's health: deliveries in hand and answers, for its stall
    /// check.
    pub(super) health: crate::ops::Health,
}

/// Held from a delivery's reply until its ack is handed on.
pub(super) type Replied = Option<OwnedRwLockReadGuard<bool>>;
