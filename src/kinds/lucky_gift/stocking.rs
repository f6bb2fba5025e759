//! What a stocking attempt and a storage's stocking steps hand each other
//! (`batches.rs` drives an attempt, `storage/` writes its batch): the
//! attempt, the claim's answer, the batch to write, and what came of it.

use std::time::Duration;

use super::codes::{Batch, CodeTable};
use crate::{fairness::Seed, scripts::PoolKeys};

/// What a stocking request achieved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StockOutcome {
    /// This call stocked batch `generation` of `size` prizes.
    Stocked { generation: u64, size: usize },
    /// The batch after the trigger existed already (a duplicate request).
    AlreadyDone { generation: u64 },
    /// Another live attempt is stocking it; ask again after `retry_in`.
    Busy { retry_in: Duration },
    /// The trigger names a batch that was never stocked: a bogus request.
    Ahead { generation: u64 },
    /// Batch `generation` is the current one, but no draw took its refill
    /// flag or found the pool short: nobody asked for its successor.
    NotDue { generation: u64 },
    /// No pool under these keys.
    Unknown,
}

/// A stocking step failed.
#[derive(Debug, thiserror::Error)]
pub enum StockError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("another attempt took over the stocking lease")]
    LeaseLost,
    #[error("the stocked tail holds {pushed} prizes, expected {expected}")]
    Mismatch { pushed: i64, expected: usize },
    #[error("no batch seed: {0}")]
    Entropy(String),
}

/// What a `begin` step answered when it did not hand us the lease.
pub(super) fn unclaimed(status: &str, number: i64) -> Option<StockOutcome> {
    match status {
        "claimed" => None,
        "done" => Some(StockOutcome::AlreadyDone {
            generation: number.unsigned_abs(),
        }),
        "busy" => Some(StockOutcome::Busy {
            retry_in: Duration::from_millis(number.clamp(10, 1000) as u64),
        }),
        "ahead" => Some(StockOutcome::Ahead {
            generation: number.unsigned_abs(),
        }),
        "not_due" => Some(StockOutcome::NotDue {
            generation: number.unsigned_abs(),
        }),
        _ => Some(StockOutcome::Unknown),
    }
}

/// One stocking attempt, as the storage's steps see it.
#[derive(Debug)]
pub(super) struct Attempt<'a> {
    pub(super) keys: &'a PoolKeys,
    /// The batch whose successor is stocked (0: the first batch).
    pub(super) trigger: u64,
    /// The attempt's name, holding the lease.
    pub(super) token: &'a str,
    /// Most prizes one write step carries (at least 1).
    pub(super) chunk: usize,
    /// How long the lease lasts past each step.
    pub(super) lease_ms: i64,
}

/// What a storage's claim step achieved.
#[derive(Debug)]
pub(super) enum Claimed {
    /// The lease is ours and nothing stale is left; the batch starts at
    /// this position of the storage's running count (the sparse index of
    /// its first prize; a storage that places batches by appending says 0).
    At(u64),
    /// The lease is not ours, for this reason.
    Not(StockOutcome),
}

/// A shuffled batch, ready to be written.
#[derive(Debug)]
pub(super) struct Filling<'a> {
    pub(super) batch: &'a Batch,
    pub(super) table: &'a CodeTable,
    /// The seed the batch was shuffled from; the commit checks it is the
    /// one `fair_seed.lua` kept.
    pub(super) seed: &'a Seed,
    /// The config version the batch was shuffled under.
    pub(super) version: i64,
    /// Where [`Claimed::At`] placed it.
    pub(super) start: u64,
}
