//! List storage: every prize is one element of a Redis list, in draw order.
//!
//! Redis layout of pool `id` (hash tag `{id}`), besides the keys every
//! storage shares ([`super::super`]):
//!
//! | key / field   | type   | holds |
//! |---------------|--------|-------|
//! | `q`           | list   | prize codes in draw order; the first `visible` are drawable, any tail behind them is a batch being stocked. A batch's refill point is stored as `"<code>f<batch>"` |
//! | meta `visible`| int    | how many elements at the head of `q` are drawable |
//! | meta `qhead`  | int    | elements ever popped from `q`: the running position of the fairness record (`lua/lib/jackpot.lua`) |
//!
//! Small codes cost two bytes each in a listpack, so a batch of millions
//! fits in a few megabytes; a draw pops from the head (O(count)), a batch
//! is pushed at the tail behind `visible` and made drawable by raising
//! `visible` in one step.
//!
//! Scripts: `lua/draw_lucky_gift.lua` (draw), `lua/stock_begin.lua`,
//! `lua/stock_trim.lua`, `lua/stock_push.lua`, `lua/stock_commit.lua`
//! (stock). While the jackpot gate is closed, the draw pops prizes as it
//! reads them and pushes them back if the draw ends short, all in the one
//! step, so no other draw ever sees them out.

use crate::kinds::lucky_gift::scripts as lua;
use crate::scripts::{Script, ScriptInvocation};
use futures_util::future::BoxFuture;

use super::{Conn, Layout};
use crate::{
    kinds::lucky_gift::{
        stocking::{unclaimed, Attempt, Claimed, Filling, StockError, StockOutcome},
        SPENT_TTL_S,
    },
    scripts::{now_ms, PoolKeys},
};

/// List storage.
#[derive(Debug)]
pub(super) struct List;

impl Layout for List {
    fn draw_script(&self) -> &'static Script {
        &lua::DRAW_LIST
    }

    fn draw_keys(&self, call: &mut ScriptInvocation<'_>, keys: &PoolKeys, day: &str) {
        call.key(keys.meta())
            .key(keys.queue())
            .key(keys.held())
            .key(keys.spent(day))
            .key(keys.results());
    }

    fn args_per_draw(&self) -> usize {
        4
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
            .arg(token);
    }

    fn drawable_fields(&self) -> &'static [&'static str] {
        &["visible"]
    }

    fn drawable(&self, field: &dyn Fn(&str) -> i64) -> u64 {
        field("visible").max(0).unsigned_abs()
    }

    fn prize_keys(&self, keys: &PoolKeys) -> Vec<String> {
        vec![keys.queue()]
    }

    fn stores_every_prize(&self) -> bool {
        true
    }

    fn claim<'a>(
        &'a self,
        conn: &'a mut Conn<'_>,
        at: &'a Attempt<'a>,
    ) -> BoxFuture<'a, Result<Claimed, StockError>> {
        Box::pin(async move {
            let keys = at.keys;
            let (status, number): (String, i64) = lua::STOCK_BEGIN
                .key(keys.meta())
                .key(keys.queue())
                .arg(at.trigger)
                .arg(at.token)
                .arg(now_ms())
                .arg(at.lease_ms)
                .invoke_async(conn)
                .await?;
            if let Some(outcome) = unclaimed(&status, number) {
                return Ok(Claimed::Not(outcome));
            }
            // A dead attempt may have left part of a batch behind the
            // visible prizes: trimmed from the tail, a chunk per step.
            let mut stale = number;
            while stale > 0 {
                stale = lua::STOCK_TRIM
                    .key(keys.meta())
                    .key(keys.queue())
                    .arg(at.token)
                    .arg(at.chunk)
                    .invoke_async(conn)
                    .await?;
                if stale < 0 {
                    return Err(StockError::LeaseLost);
                }
            }
            // Batches are appended: no start position to hand on.
            Ok(Claimed::At(0))
        })
    }

    fn fill<'a>(
        &'a self,
        conn: &'a mut Conn<'_>,
        at: &'a Attempt<'a>,
        batch: &'a Filling<'a>,
    ) -> BoxFuture<'a, Result<StockOutcome, StockError>> {
        Box::pin(async move {
            let keys = at.keys;
            let size = batch.batch.codes.len();
            let elements: Vec<String> = batch.batch.elements(at.trigger + 1).collect();
            for piece in elements.chunks(at.chunk) {
                let pushed: i64 = lua::STOCK_PUSH
                    .key(keys.meta())
                    .key(keys.queue())
                    .arg(at.token)
                    .arg(now_ms())
                    .arg(at.lease_ms)
                    .arg(piece)
                    .invoke_async(conn)
                    .await?;
                if pushed < 0 {
                    return Err(StockError::LeaseLost);
                }
            }
            let (status, number): (String, i64) = lua::STOCK_COMMIT
                .key(keys.meta())
                .key(keys.queue())
                .arg(at.token)
                .arg(at.trigger)
                .arg(size)
                .arg(batch.seed.to_hex())
                .arg(batch.version)
                .invoke_async(conn)
                .await?;
            match status.as_str() {
                "ok" => Ok(StockOutcome::Stocked {
                    generation: number.unsigned_abs(),
                    size,
                }),
                "mismatch" => Err(StockError::Mismatch {
                    pushed: number,
                    expected: size,
                }),
                _ => Err(StockError::LeaseLost),
            }
        })
    }
}
