//! How a lucky-gift pool keeps its prizes in Redis: one file per storage,
//! each implementing [`Layout`] — its keys (a layout table in its doc
//! comment), its Lua calls and their decoding — for the four things the
//! rest of the kind asks of a storage:
//!
//! - **stock**: claim the stocking lease and write a batch out of the draws'
//!   sight, then make it drawable in one step ([`super::batches`] runs the
//!   protocol around it: seed, shuffle, commitment);
//! - **draw**: the draw script and its keys and arguments ([`super::draw`]
//!   makes the call, decodes the common reply and builds the award);
//! - **status**: how many prizes are drawable, from the meta counters;
//! - **memory**: which keys hold the prizes.
//!
//! What every storage shares is written once, outside these files: the
//! jackpot rule (`lua/lib/jackpot.lua`, [`super::jackpot`]), the frame of a
//! draw (`lua/lib/draw.lua`), the answer store, the fairness record, and the
//! keys `meta`, `held`, `spent:YYYYMMDD` and `rs` (see [`super`]).
//!
//! Adding a storage: a file here implementing [`Layout`], a variant of
//! [`Storage`] (`name.rs`) with its label and its place in [`Storage::ALL`],
//! its arm in [`Storage::layout`], and its draw script in
//! `kinds/lucky_gift/scripts.rs`.

mod list;
pub(super) mod name;
mod sparse;

pub use name::Storage;

use futures_util::future::BoxFuture;
use redis::{aio::ConnectionLike, Cmd, Pipeline, RedisFuture, Value};

use super::stocking::{Attempt, Claimed, Filling, StockError, StockOutcome};
use crate::scripts::{PoolKeys, Script, ScriptInvocation};

impl Storage {
    /// The implementation of this storage: the one place storages are
    /// registered.
    pub(super) fn layout(self) -> &'static dyn Layout {
        match self {
            Self::List => &list::List,
            Self::Sparse => &sparse::Sparse,
        }
    }

    /// The draw script of this storage.
    pub fn draw_script(self) -> &'static Script {
        self.layout().draw_script()
    }

    /// The keys that hold the prizes of the pool behind `keys`, the gated
    /// jackpots waiting in `held` included (for memory accounting).
    pub fn prize_keys(self, keys: &PoolKeys) -> Vec<String> {
        let mut out = self.layout().prize_keys(keys);
        out.push(keys.held());
        out
    }

    /// Whether every prize in the pool takes room of its own, so that bytes
    /// per prize in pool mean something (not so when zeros are implicit).
    pub fn stores_every_prize(self) -> bool {
        self.layout().stores_every_prize()
    }
}

/// What one storage implements: the Redis side of stocking, drawing,
/// counting and measuring a pool's prizes. Implementations are unit
/// structs; [`Storage::layout`] hands them out.
pub(super) trait Layout: Send + Sync {
    /// The storage's draw script (`lua/draw_*.lua`, built by `coalesced!`).
    fn draw_script(&self) -> &'static Script;

    /// Appends every key of a draw call, in the order the script's header
    /// lists them (`day` names the consumption counter).
    fn draw_keys(&self, call: &mut ScriptInvocation<'_>, keys: &PoolKeys, day: &str);

    /// How many arguments one draw takes (`lua/lib/many.lua` needs it).
    fn args_per_draw(&self) -> usize;

    /// Appends one draw's arguments, in the order the script's header
    /// lists them.
    fn draw_args(
        &self,
        call: &mut ScriptInvocation<'_>,
        count: u32,
        result_ttl_s: u64,
        token: &[u8],
    );

    /// The meta fields [`Layout::drawable`] counts from.
    fn drawable_fields(&self) -> &'static [&'static str];

    /// Prizes drawable now (not counting `held`), from the meta fields
    /// (`field` reads one of [`Layout::drawable_fields`], 0 when absent).
    fn drawable(&self, field: &dyn Fn(&str) -> i64) -> u64;

    /// The keys of the pool's prizes, besides `held`.
    fn prize_keys(&self, keys: &PoolKeys) -> Vec<String>;

    /// See [`Storage::stores_every_prize`].
    fn stores_every_prize(&self) -> bool;

    /// Claims the stocking lease for the batch after `at.trigger` and
    /// removes what a dead attempt left staged, or says why not.
    fn claim<'a>(
        &'a self,
        conn: &'a mut Conn<'_>,
        at: &'a Attempt<'a>,
    ) -> BoxFuture<'a, Result<Claimed, StockError>>;

    /// Writes the batch out of the draws' sight, in chunks that renew the
    /// lease, then makes it drawable in one step.
    fn fill<'a>(
        &'a self,
        conn: &'a mut Conn<'_>,
        at: &'a Attempt<'a>,
        batch: &'a Filling<'a>,
    ) -> BoxFuture<'a, Result<StockOutcome, StockError>>;
}

/// Any connection, borrowed, as the storages' boxed stocking steps take it
/// (a [`Layout`] is used as a trait object, so its steps cannot be generic).
pub(super) struct Conn<'c>(pub(super) &'c mut (dyn ConnectionLike + Send));

impl ConnectionLike for Conn<'_> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.0.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.0.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.0.get_db()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_config_names() {
        for s in Storage::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.label());
            assert_eq!(Storage::from_name(s.label()), Some(s));
            assert_eq!(Storage::from_label(Some(s.label())), s);
        }
        assert_eq!(Storage::from_label(None), Storage::List);
        assert_eq!(Storage::from_name("tape"), None);
        assert_eq!(Storage::names(), "\"list\" or \"sparse\"");
    }
}
