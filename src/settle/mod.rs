//! The settle worker: applies credits and debits to the Postgres ledger.
//!
//! Messages are gathered into batches (up to `SETTLE_BATCH_SIZE`, waiting at
//! most `SETTLE_BATCH_WAIT_MS` for a batch to fill) and written in one
//! transaction through [`crate::ledger::apply_each`], which judges every
//! entry on its own: applied, a duplicate (skipped), or refused (an id bound
//! to other content, a forbidden or oversized movement, a short balance).
//! The batch is acknowledged only after the commit and after every refusal
//! is answered; when Postgres is down the batch is retried with backoff and
//! never acknowledged early, and an entry Postgres itself can never take is
//! dead-lettered alone while the rest lands. A message that is bad input as
//! a whole is dead-lettered, answered and acked on its own at once, so a
//! batch that goes back to the queue unbooked never answers it twice.
//!
//! It is a [`crate::amqp::BatchHandler`] on the consume loop the draw and
//! refill workers share ([`crate::amqp::run_batches`]): session,
//! reconnection, qos, coalesced acks, the watchdog and graceful stop are
//! theirs; the batching is the loop's, the transaction and the answers are
//! this module's.
//!
//! Metrics: `prizepool_settle_batch_entries` (histogram, entries per
//! batch), `prizepool_settle_commit_seconds` (histogram, one ledger
//! transaction), `prizepool_settle_entries_total{outcome, reason}`
//! (`outcome`: `applied`, `duplicate` or `refused`; a refusal's `reason`:
//! `conflict`, `invalid`, `insufficient_funds`, `overflow` or `internal`),
//! `prizepool_ledger_entries_total` (entries written) and
//! `prizepool_settle_lag_seconds` (gauge: how long the oldest message of the
//! batch being booked has waited, counted every second while it waits for
//! the ledger, and 0 once the ledger has caught up (see `lag.rs`), when its
//! publisher set the AMQP `timestamp`; a stamp
//! in the future is ignored and none counts from before the worker's start
//! or the last time it found its queue empty, so a forged stamp cannot fake
//! a lag).
//!
//! The audit consumer of provably fair batches runs beside it, on its own
//! queue ([`crate::audit`]).
//!
//! The ledger API lives in [`crate::ledger`]; the re-exports below keep the
//! older paths working.

mod lag;
mod worker;

/// Runs a settle worker and, beside it, the audit consumer
/// ([`crate::audit`]) until `shutdown`.
pub async fn run(
    config: crate::config::Config,
    health: crate::ops::Health,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let audit_stop = shutdown.child_token();
    let audit = tokio::spawn(crate::audit::run(
        config.clone(),
        health.clone(),
        audit_stop.clone(),
    ));
    let settled = worker::run(config, health, shutdown).await;
    // The audit consumer stops with the worker, whatever ended it.
    audit_stop.cancel();
    match audit.await {
        Ok(Err(e)) => tracing::error!(error = format!("{e:#}"), "audit consumer failed"),
        Err(e) => tracing::error!(error = %e, "audit consumer panicked"),
        Ok(Ok(())) => {}
    }
    settled
}

pub use crate::ledger::{
    apply, apply_in, balances, credited, pool_total, totals, Applied, Balance,
};
