//! A delivery's worker slot, lent back while its handler waits for
//! something other than a server (a draw waiting for its pool's refill).
//!
//! The slots bound the deliveries whose handlers work at once. A handler
//! that sleeps (a short pool's wait, seconds at most) does no work, and
//! holding its slot meanwhile would let a few requests for one short pool
//! take every slot from the draws of every other pool. Inside
//! [`without_slot`] the delivery holds no slot; it takes one again, in
//! turn with the others, before the handler goes on.

use std::{future::Future, sync::Arc};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

tokio::task_local! {
    static HELD: Held;
}

/// The slot of the delivery whose handler runs in this task.
#[derive(Clone)]
pub(super) struct Held(Arc<std::sync::Mutex<State>>);

struct State {
    slots: Arc<Semaphore>,
    permit: Option<OwnedSemaphorePermit>,
    /// How many of the handler's futures are inside [`without_slot`] (a
    /// `draw.batch` waits for several pools at once): the slot is lent
    /// while any is.
    away: usize,
}

impl Held {
    pub(super) fn new(slots: Arc<Semaphore>, permit: OwnedSemaphorePermit) -> Self {
        Self(Arc::new(std::sync::Mutex::new(State {
            slots,
            permit: Some(permit),
            away: 0,
        })))
    }

    /// Runs `handler` with this slot lendable from inside it.
    pub(super) async fn scope<F: Future>(self, handler: F) -> F::Output {
        HELD.scope(self, handler).await
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs `wait` without the current delivery's worker slot, and takes a
/// slot again before returning. Outside a delivery's handler it only runs
/// `wait`.
pub async fn without_slot<F: Future>(wait: F) -> F::Output {
    let Ok(held) = HELD.try_with(Held::clone) else {
        return wait.await;
    };
    {
        let mut state = held.state();
        state.away += 1;
        if state.away == 1 {
            drop(state.permit.take());
        }
    }
    let out = wait.await;
    let slots = {
        let mut state = held.state();
        state.away -= 1;
        (state.away == 0 && state.permit.is_none()).then(|| state.slots.clone())
    };
    if let Some(slots) = slots {
        // The semaphore is never closed.
        if let Ok(permit) = slots.acquire_owned().await {
            let mut state = held.state();
            // Another wait may have begun meanwhile: then the slot stays
            // lent, and its end takes it again.
            if state.away == 0 && state.permit.is_none() {
                state.permit = Some(permit);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_lends_the_slot_and_takes_one_again() {
        let slots = Arc::new(Semaphore::new(1));
        let permit = slots.clone().acquire_owned().await.unwrap();
        let held = Held::new(slots.clone(), permit);
        let probe = slots.clone();
        held.clone()
            .scope(async move {
                assert_eq!(probe.available_permits(), 0);
                let (lent, ()) = tokio::join!(
                    without_slot(async { probe.available_permits() }),
                    without_slot(tokio::time::sleep(std::time::Duration::from_millis(20))),
                );
                // Lent while either waited, held again after both.
                assert_eq!(lent, 1);
                assert_eq!(probe.available_permits(), 0);
            })
            .await;
        assert!(held.state().permit.is_some());
        drop(held);
        assert_eq!(slots.available_permits(), 1);
    }

    #[tokio::test]
    async fn outside_a_delivery_a_wait_only_waits() {
        assert_eq!(without_slot(async { 7 }).await, 7);
    }
}
