//! The settle lag gauge: how far behind the ledger is, kept up to date
//! while a batch waits (a stalled ledger shows a growing lag, not a frozen
//! one), and back at 0 once the queue is drained ([`caught_up`]: a lag an
//! outage left does not stay on the gauge, and its alert firing, after the
//! backlog is booked).

use std::time::Duration;

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
/// handle is dropped (when the batch is booked or given up).
pub(super) fn keep_lag(batch: &[Delivery], floor: u64) -> tokio_util::task::AbortOnDropHandle<()> {
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
    tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            record();
        }
    }))
}

/// The queue is drained (the batch loop found nothing to take for a
/// while, with no batch in hand): nothing lags.
pub(super) fn caught_up() {
    metrics::gauge!("prizepool_settle_lag_seconds").set(0.0);
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
