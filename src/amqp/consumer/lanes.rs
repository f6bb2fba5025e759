//! Lanes: the worker's slots shared by the dependencies its deliveries
//! need ([`super::Handler::lane`]), so one dependency that is away cannot
//! take every slot.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{HandleError, Outcome};

/// How often a delivery waiting for a slot of its lane checks whether the
/// lane is failing.
const LANE_CHECK: std::time::Duration = std::time::Duration::from_millis(250);

/// The slots of each lane ([`super::Handler::lane`]): a lane holds at most half of
/// the worker's `CONCURRENCY` slots. While every slot of a lane is taken
/// and its last attempt failed transiently, a delivery of that lane is
/// handed back at once instead of waiting for one.
#[derive(Debug)]
pub(super) struct Lanes {
    share: usize,
    lanes: std::sync::Mutex<HashMap<&'static str, Arc<Lane>>>,
}

#[derive(Debug)]
struct Lane {
    slots: Arc<Semaphore>,
    /// Whether the lane's last attempt ended in a transient failure.
    failing: AtomicBool,
}

/// A delivery's way into its lane.
pub(super) enum Entered {
    /// In: a slot of the lane held (none for a delivery of no lane).
    In(InLane),
    /// The lane is full and failing: hand the delivery back.
    Failing(&'static str),
}

/// A slot of a lane, held while the handler runs.
pub(super) struct InLane(Option<(Arc<Lane>, OwnedSemaphorePermit)>);

impl InLane {
    /// Records how the lane's latest attempt ended.
    pub(super) fn record(&self, result: &Result<Outcome, HandleError>) {
        if let Some((lane, _)) = &self.0 {
            let failing = matches!(result, Err(HandleError::Transient(_)));
            lane.failing.store(failing, Ordering::Relaxed);
        }
    }
}

impl Lanes {
    /// Lanes sharing a worker's `concurrency` slots.
    pub(super) fn new(concurrency: usize) -> Self {
        Self {
            share: (concurrency / 2).max(1),
            lanes: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Takes a slot of lane `name`: at once when one is free, after a wait
    /// while the lane works, never while it is full and failing.
    pub(super) async fn enter(&self, name: Option<&'static str>) -> Entered {
        let Some(name) = name else {
            return Entered::In(InLane(None));
        };
        let lane = self
            .lanes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name)
            .or_insert_with(|| {
                Arc::new(Lane {
                    slots: Arc::new(Semaphore::new(self.share)),
                    failing: AtomicBool::new(false),
                })
            })
            .clone();
        // A lane that turns failing while a delivery waits for it hands
        // that delivery back too: checked every LANE_CHECK.
        let permit = loop {
            match lane.slots.clone().try_acquire_owned() {
                Ok(permit) => break permit,
                Err(_) if lane.failing.load(Ordering::Relaxed) => return Entered::Failing(name),
                Err(_) => {}
            }
            match tokio::time::timeout(LANE_CHECK, lane.slots.clone().acquire_owned()).await {
                Ok(Ok(permit)) => break permit,
                // The semaphore is never closed.
                Ok(Err(_)) => return Entered::In(InLane(None)),
                Err(_) => continue,
            }
        };
        Entered::In(InLane(Some((lane, permit))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_lane_hands_back_only_while_it_fails() {
        let lanes = Lanes::new(2);
        let Entered::In(held) = lanes.enter(Some("postgres")).await else {
            panic!("a free lane is entered");
        };
        // No lane: never limited.
        assert!(matches!(lanes.enter(None).await, Entered::In(_)));
        held.record(&Err(HandleError::Transient(anyhow::anyhow!("away"))));
        assert!(matches!(
            lanes.enter(Some("postgres")).await,
            Entered::Failing("postgres")
        ));
        // Another lane has slots of its own.
        assert!(matches!(lanes.enter(Some("other")).await, Entered::In(_)));
        held.record(&Ok(Outcome::default()));
        let waiting = tokio::spawn(async move {
            let lanes = lanes;
            matches!(lanes.enter(Some("postgres")).await, Entered::In(_))
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waiting.is_finished(),
            "a working lane that is full is waited for"
        );
        drop(held);
        assert!(waiting.await.unwrap());
    }
}
