//! A delivery's worker slot, given back while its handler waits for
//! something other than a server (a draw waiting for its pool's refill).
//!
//! The slots bound the deliveries whose handlers work at once. A handler
//! that sleeps (a short pool's wait, seconds at most) does no work, and
//! holding its slot meanwhile would let a few requests for one short pool
//! take every slot from the draws of every other pool. [`release_slot`]
//! gives the slot back for the rest of the delivery: what the handler does
//! after (a step of its pool once the refill came, its answer) is brief,
//! and is not made to queue for a slot behind new deliveries, which would
//! let them take the refill it waited for. The deliveries a worker holds
//! stay bounded by its prefetch.

use std::sync::Arc;

use tokio::sync::OwnedSemaphorePermit;

tokio::task_local! {
    static HELD: Held;
}

/// The slot of the delivery whose handler runs in this task.
#[derive(Clone)]
pub(super) struct Held(Arc<std::sync::Mutex<Option<OwnedSemaphorePermit>>>);

impl Held {
    pub(super) fn new(permit: OwnedSemaphorePermit) -> Self {
        Self(Arc::new(std::sync::Mutex::new(Some(permit))))
    }

    /// Runs `handler` with this slot releasable from inside it.
    pub(super) async fn scope<F: std::future::Future>(self, handler: F) -> F::Output {
        HELD.scope(self, handler).await
    }

    #[cfg(test)]
    fn holds(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

/// Gives the current delivery's worker slot back for the rest of its
/// handling. Outside a delivery's handler, and once given back, it does
/// nothing.
pub fn release_slot() {
    if let Ok(held) = HELD.try_with(Held::clone) {
        drop(held.0.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    #[tokio::test]
    async fn a_released_slot_is_free_for_the_next_delivery() {
        let slots = Arc::new(Semaphore::new(1));
        let held = Held::new(slots.clone().acquire_owned().await.unwrap());
        let probe = slots.clone();
        held.clone()
            .scope(async move {
                assert_eq!(probe.available_permits(), 0);
                release_slot();
                assert_eq!(probe.available_permits(), 1);
                // Twice is once.
                release_slot();
                assert_eq!(probe.available_permits(), 1);
            })
            .await;
        assert!(!held.holds());
        drop(held);
        assert_eq!(slots.available_permits(), 1);
    }

    #[tokio::test]
    async fn outside_a_delivery_nothing_is_released() {
        release_slot();
    }
}
