//! Sparse storage: prizes occupy consecutive indices, and only the non-zero
//! ones are stored; every other index holds the zero prize of its combo.
//!
//! Redis layout of pool `id` (hash tag `{id}`), besides the keys every
//! storage shares ([`super::super`]):
//!
//! | key / field      | type   | holds |
//! |------------------|--------|-------|
//! | `sp`             | hash   | field `<bucket>` = `"<offset>.<code>;…"`: the non-zero prizes of indices `bucket × B … bucket × B + B − 1` ([`SPARSE_BUCKET`] = B) |
//! | `seg`            | zset   | combo runs: score = first index, member = `"<first index>:<zero code>"` |
//! | `flags`          | zset   | refill points: score = flagged index, member = batch number |
//! | meta `cur`       | int    | the next index to draw; also the running position of the fairness record (`lua/lib/jackpot.lua`) |
//! | meta `max_index` | int    | the end of the drawable indices; a batch being stocked is staged at and above it |
//! | meta `staged_n`, `staged_hi` | int | what the stocking attempt has staged (prizes, highest bucket), for the commit's check and a takeover's clean-up |
//!
//! A pool of mostly zero prizes costs only its non-zero ones. A draw reads
//! indices from `cur` (one bucket and one combo run at a time) and moves
//! `cur` at the end, forgetting the buckets and runs wholly behind it;
//! reading past `max_index` is a short pool, never a silent run of zeros.
//!
//! Scripts: `lua/draw_sparse.lua` (draw) and `lua/sparse_stock.lua`, whose
//! steps `begin`, `trim`, `push` and `commit` mirror the list's stocking
//! scripts. A draw reads without writing until its plan is complete, so a
//! short draw has nothing to undo.

use crate::kinds::lucky_gift::scripts as lua;
use std::collections::HashSet;

use crate::scripts::{Script, ScriptInvocation};
use futures_util::future::BoxFuture;

use super::{Conn, Layout};
use crate::{
    kinds::lucky_gift::{
        stocking::{unclaimed, Attempt, Claimed, Filling, StockError, StockOutcome},
        SPARSE_BUCKET, SPENT_TTL_S,
    },
    scripts::{now_ms, PoolKeys},
};

/// Sparse storage.
#[derive(Debug)]
pub(super) struct Sparse;

/// A call of one step of `lua/sparse_stock.lua`, its keys and step name set.
fn step<'a>(at: &Attempt<'a>, name: &'static str) -> ScriptInvocation<'a> {
    let mut inv = lua::SPARSE_STOCK.prepare_invoke();
    inv.key(at.keys.meta())
        .key(at.keys.sparse())
        .key(at.keys.segments())
        .key(at.keys.flags())
        .arg(name);
    inv
}

/// Stages `buckets` (bucket, `"<off>.<code>;…"`) at and above `max_index`.
async fn push(
    conn: &mut Conn<'_>,
    at: &Attempt<'_>,
    buckets: Vec<(u64, String)>,
) -> Result<(), StockError> {
    let mut inv = step(at, "push");
    inv.arg(at.token).arg(now_ms()).arg(at.lease_ms);
    for (bucket, text) in &buckets {
        inv.arg(bucket).arg(text);
    }
    let (status, _): (String, i64) = inv.invoke_async(conn).await?;
    if status != "ok" {
        return Err(StockError::LeaseLost);
    }
    Ok(())
}

impl Layout for Sparse {
    fn draw_script(&self) -> &'static Script {
        &lua::DRAW_SPARSE
    }

    fn draw_keys(&self, call: &mut ScriptInvocation<'_>, keys: &PoolKeys, day: &str) {
        call.key(keys.meta())
            .key(keys.sparse())
            .key(keys.segments())
            .key(keys.flags())
            .key(keys.held())
            .key(keys.spent(day))
            .key(keys.results());
    }

    fn args_per_draw(&self) -> usize {
        5
    }

    fn draw_args(
        &self,
        call: &mut ScriptInvocation<'_>,
        count: u32,
        result_ttl_s: u64,
        token: &[u8],
    ) {
        call.arg(count)
            .arg(result_ttl_s)
            .arg(SPENT_TTL_S)
            .arg(SPARSE_BUCKET)
            .arg(token);
    }

    fn drawable_fields(&self) -> &'static [&'static str] {
        &["max_index", "cur"]
    }

    fn drawable(&self, field: &dyn Fn(&str) -> i64) -> u64 {
        (field("max_index") - field("cur")).max(0).unsigned_abs()
    }

    fn prize_keys(&self, keys: &PoolKeys) -> Vec<String> {
        vec![keys.sparse(), keys.segments(), keys.flags()]
    }

    fn stores_every_prize(&self) -> bool {
        false
    }

    fn claim<'a>(
        &'a self,
        conn: &'a mut Conn<'_>,
        at: &'a Attempt<'a>,
    ) -> BoxFuture<'a, Result<Claimed, StockError>> {
        Box::pin(async move {
            let (status, number): (String, i64) = step(at, "begin")
                .arg(at.token)
                .arg(at.trigger)
                .arg(now_ms())
                .arg(at.lease_ms)
                .invoke_async(conn)
                .await?;
            if let Some(outcome) = unclaimed(&status, number) {
                return Ok(Claimed::Not(outcome));
            }
            // Clean up what a dead attempt may have staged, a few buckets
            // per step.
            loop {
                let (status, left): (String, i64) = step(at, "trim")
                    .arg(at.token)
                    .arg((at.chunk / 8).max(1))
                    .arg(SPARSE_BUCKET)
                    .invoke_async(conn)
                    .await?;
                if status != "ok" {
                    return Err(StockError::LeaseLost);
                }
                if left == 0 {
                    break;
                }
            }
            // The batch starts at `max_index`, which only a commit moves.
            Ok(Claimed::At(number.unsigned_abs()))
        })
    }

    fn fill<'a>(
        &'a self,
        conn: &'a mut Conn<'_>,
        at: &'a Attempt<'a>,
        filling: &'a Filling<'a>,
    ) -> BoxFuture<'a, Result<StockOutcome, StockError>> {
        Box::pin(async move {
            let (batch, table, start) = (filling.batch, filling.table, filling.start);
            let size = batch.codes.len();
            let zero: HashSet<u32> = (0..table.len() as u32)
                .filter(|c| table.decode(*c).is_some_and(|(_, m)| m == 0))
                .collect();
            // (bucket, "<off>.<code>;...") in index order, flushed every
            // `chunk` prizes.
            let mut pending: Vec<(u64, String)> = Vec::new();
            let mut in_chunk = 0usize;
            let mut nonzero = 0usize;
            for (i, &code) in batch.codes.iter().enumerate() {
                if zero.contains(&code) {
                    continue;
                }
                let index = start + i as u64;
                let (bucket, off) = (index / SPARSE_BUCKET, index % SPARSE_BUCKET);
                match pending.last_mut() {
                    Some((b, text)) if *b == bucket => text.push_str(&format!("{off}.{code};")),
                    _ => pending.push((bucket, format!("{off}.{code};"))),
                }
                in_chunk += 1;
                nonzero += 1;
                if in_chunk >= at.chunk {
                    push(conn, at, std::mem::take(&mut pending)).await?;
                    in_chunk = 0;
                }
            }
            if !pending.is_empty() {
                push(conn, at, pending).await?;
            }
            let segments: Vec<String> = batch
                .combos
                .iter()
                .map(|(combo, s, _)| {
                    let zero = table.code_of(combo, 0).map_or(-1, i64::from);
                    format!("{}:{zero}", start + *s as u64)
                })
                .collect();
            let (status, number): (String, i64) = step(at, "commit")
                .arg(at.token)
                .arg(at.trigger)
                .arg(size)
                .arg(nonzero)
                .arg(start + batch.flag_at as u64)
                .arg(filling.seed.to_hex())
                .arg(filling.version)
                .arg(&segments)
                .invoke_async(conn)
                .await?;
            match status.as_str() {
                "ok" => Ok(StockOutcome::Stocked {
                    generation: number.unsigned_abs(),
                    size,
                }),
                "mismatch" => Err(StockError::Mismatch {
                    pushed: number,
                    expected: nonzero,
                }),
                _ => Err(StockError::LeaseLost),
            }
        })
    }
}
