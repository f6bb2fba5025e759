//! What the bench needs of each prize kind: pools to draw from, and who
//! draws from them. How a draw runs, and which kind a pool is, is the
//! library's alone ([`prizepool::kinds::Kinds`]): the bench draws through
//! that seam, as the draw worker does, and never names a kind's script.

mod lottery;
mod lucky_gift;
mod red_packet;

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::{fleet, services::Services};

/// What a workload reads of the bench's command line (`BenchArgs::load`).
#[derive(Clone, Debug)]
pub(crate) struct Load {
    /// Simulated users.
    pub(crate) users: u64,
    /// Prizes per lucky-gift draw.
    pub(crate) count: u32,
    /// Storage of the lucky-gift pool under load.
    pub(crate) storage: String,
    /// Seconds of each load phase.
    pub(crate) duration: u64,
    /// Milliseconds of each Redis ceiling pass.
    pub(crate) ceiling_pass_ms: u64,
}

impl Load {
    /// The storage `--storage` names.
    pub(crate) fn storage(&self) -> anyhow::Result<prizepool::kinds::lucky_gift::Storage> {
        use prizepool::kinds::lucky_gift::Storage;
        match self.storage.as_str() {
            "list" => Ok(Storage::List),
            "sparse" => Ok(Storage::Sparse),
            other => anyhow::bail!("unknown storage {other:?}"),
        }
    }
}

/// Every kind `--kind` can name, in its order. A new kind is a file here
/// and one entry in this list.
static KINDS: [Kind; 3] = [
    Kind(&lucky_gift::LuckyGift),
    Kind(&red_packet::RedPacket),
    Kind(&lottery::Lottery),
];

/// What the bench sets up to draw from one prize kind.
pub(crate) trait Workload: Sync {
    /// Its `--kind` value.
    fn name(&self) -> &'static str;
    /// Its name in the reports.
    fn label(&self) -> &'static str;
    /// Whether the draw worker applies concurrent draws of one pool in one
    /// call, so the coalesced ceiling is worth measuring.
    fn coalesces(&self) -> bool {
        false
    }
    /// Fresh pools for one Redis ceiling pass, enough to last it.
    fn ceiling<'a>(
        &'a self,
        svc: &'a Services<'a>,
        args: &'a Load,
    ) -> BoxFuture<'a, anyhow::Result<Target>>;
    /// The pools of one fleet run, named after `id`, enough to last its
    /// phases.
    fn fleet<'a>(
        &'a self,
        svc: &'a Services<'a>,
        args: &'a Load,
        id: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Target>>;
}

/// A prize kind of the bench (`--kind`).
#[derive(Clone, Copy)]
pub(crate) struct Kind(&'static dyn Workload);

impl std::ops::Deref for Kind {
    type Target = dyn Workload;

    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl std::fmt::Debug for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl clap::ValueEnum for Kind {
    fn value_variants<'a>() -> &'a [Self] {
        &KINDS
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()))
    }
}

/// Where a ceiling pass or a fleet run draws.
#[derive(Clone)]
pub(crate) struct Target {
    /// The pools drawn from: the ledger credits of a run add up over them.
    pub(crate) pools: Arc<Vec<String>>,
    /// The pool (an index into `pools`) and the user of draw number `n`.
    pub(crate) pick: Arc<dyn Fn(u64) -> (usize, i64) + Send + Sync>,
    /// Prizes per draw.
    pub(crate) count: u32,
    /// Whether the pools never run out, so every pass can share them.
    pub(crate) endless: bool,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("pools", &self.pools)
            .field("count", &self.count)
            .field("endless", &self.endless)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Draws of `count` prizes from the one pool `pool`, for the users
    /// `pick` names.
    pub(crate) fn one_pool(
        pool: String,
        count: u32,
        pick: impl Fn(u64) -> i64 + Send + Sync + 'static,
    ) -> Self {
        Self {
            pools: Arc::new(vec![pool]),
            pick: Arc::new(move |n| (0, pick(n))),
            count,
            endless: false,
        }
    }

    /// The pool and user of draw number `n`.
    pub(crate) fn draw(&self, n: u64) -> (&str, i64) {
        let (pool, user) = (self.pick)(n);
        (&self.pools[pool], user)
    }

    /// The draw requests of a fleet run.
    pub(crate) fn requests(&self) -> fleet::MakeRequest {
        let target = self.clone();
        Arc::new(move |n| {
            let (pool, user) = target.draw(n);
            fleet::request(pool, user, target.count)
        })
    }
}

/// User `1 + (n × 7919 mod users)`: consecutive draws of a fleet run spread
/// over the simulated users.
fn spread(n: u64, users: u64) -> i64 {
    (1 + (n * 7919) % users.max(1)) as i64
}
