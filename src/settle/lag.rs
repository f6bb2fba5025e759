//! The settle lag gauge: how far behind the ledger is, kept up to date
//! while a batch waits (a stalled ledger shows a growing lag, not a frozen
//! one), and back at 0 once the ledger has caught up (a lag an outage left
//! does not stay on the gauge, and its alert firing, after the backlog is
//! booked).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use lapin::message::Delivery;

/// Records how long the oldest message of the batch waited since it was
/// published, when its publisher stamped it (`timestamp`, in seconds).
///
/// The stamp is the publisher's word, and anyone may publish a top-up: a
/// stamp in the future is ignored, and a message is never counted as older
/// than `floor` (unix seconds): the worker's start, or later the last time
/// it found the queue empty. A forged old stamp can show no more lag than
/// the queue really has.
///
/// The figure is set at once and again every second until the returned
/// guard is dropped (when the batch is booked or given up). A guard marked
/// [`Lag::booked`] (a batch booked that its wait closed before it was full:
/// the queue held nothing more behind it) sets the gauge to 0 when no other
/// batch began within [`CAUGHT_UP`] of it: nothing lags.
pub(super) fn keep_lag(batch: &[Delivery], floor: u64) -> Lag {
    let began = BATCHES.fetch_add(1, Ordering::Relaxed) + 1;
    let stamps: Vec<u64> = batch
        .iter()
        .filter_map(|d| *d.properties.timestamp())
        .collect();
    let record = move || {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if let Some(lag) = lag_of(stamps.iter().copied(), now, floor) {
            metrics::gauge!("prizepool_settle_lag_seconds").set(lag as f64);
        }
    };
    record();
    let ticking = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            record();
        }
    }));
    Lag {
        _ticking: ticking,
        began,
        booked: false,
    }
}

/// Batches begun by this worker, so a booked batch can tell whether
/// another began after it.
static BATCHES: AtomicU64 = AtomicU64::new(0);

/// How long after a booked batch the gauge waits for the next one before
/// it reads 0. Batches of a backlog follow each other within milliseconds,
/// and each sets its own lag as it begins.
const CAUGHT_UP: Duration = Duration::from_secs(2);

/// The gauge kept for one batch: see [`keep_lag`].
#[derive(Debug)]
pub(super) struct Lag {
    _ticking: tokio_util::task::AbortOnDropHandle<()>,
    /// This batch's number in [`BATCHES`].
    began: u64,
    booked: bool,
}

impl Lag {
    /// The batch is in the ledger: nothing of it lags any more.
    pub(super) fn booked(mut self) {
        self.booked = true;
    }
}

impl Drop for Lag {
    fn drop(&mut self) {
        if !self.booked {
            // Given up: the batch comes again and its lag goes on counting.
            return;
        }
        let began = self.began;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                tokio::time::sleep(CAUGHT_UP).await;
                if BATCHES.load(Ordering::Relaxed) == began {
                    metrics::gauge!("prizepool_settle_lag_seconds").set(0.0);
                }
            });
        }
    }
}

/// The lag, in seconds, of the oldest of `stamps` at `now`, counted from no
/// earlier than `floor`; `None` without a stamp to trust.
fn lag_of(stamps: impl Iterator<Item = u64>, now: u64, floor: u64) -> Option<u64> {
    let oldest = stamps.filter(|&stamp| stamp <= now).min()?;
    Some(now.saturating_sub(oldest.max(floor)))
}

#[cfg(test)]
mod tests {
    use super::lag_of;

    #[test]
    fn the_lag_trusts_no_stamp_before_the_floor_or_in_the_future() {
        let (now, floor) = (1_000_000, 999_000);
        assert_eq!(lag_of([999_990, 999_995].into_iter(), now, floor), Some(10));
        // Stamped 0: counted from the floor, not from 1970.
        assert_eq!(lag_of([0, 999_995].into_iter(), now, floor), Some(1_000));
        // From the future: ignored.
        assert_eq!(lag_of([now + 3_600].into_iter(), now, floor), None);
        assert_eq!(
            lag_of([now + 3_600, 999_998].into_iter(), now, floor),
            Some(2)
        );
        assert_eq!(lag_of(std::iter::empty(), now, floor), None);
    }
}
