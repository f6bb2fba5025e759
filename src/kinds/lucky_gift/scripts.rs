//! The lucky-gift scripts (`lua/`), built once per process: each is
//! loaded into Redis by its digest when a call first finds it missing.

use std::sync::LazyLock;

use crate::scripts::{plain, Script};

/// A lucky-gift script on its parked jackpots: the answer prelude,
/// `lua/lib/award.lua` (how an award is stored) and `lua/lib/jackpot.lua`
/// (the jackpot rule, once for both storages), then the script.
macro_rules! on_jackpots {
    ($file:literal) => {
        Script::with_prelude(
            concat!(
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/answer.lua")),
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/award.lua")),
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/jackpot.lua"))
            ),
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/", $file)),
        )
    };
}

/// A storage's draw script, applying several draws of one pool per call:
/// the [`on_jackpots!`] preludes, `lua/lib/draw.lua` (the frame every
/// storage's draw shares: short answer, the award's last writes) and the
/// script's body as a function of its arguments make the prelude; the
/// driver `lua/lib/many.lua`, which calls it once per draw (ARGV[1] =
/// arguments per draw, then each draw's arguments), is the body.
macro_rules! coalesced {
    ($file:literal) => {
        Script::with_prelude(
            concat!(
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/answer.lua")),
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/award.lua")),
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/jackpot.lua")),
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/draw.lua")),
                "local function step(ARGV)\n",
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/", $file)),
                "\nend\n"
            ),
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/many.lua")),
        )
    };
}

/// The list storage's draw.
pub static DRAW_LIST: LazyLock<Script> = LazyLock::new(|| coalesced!("draw_lucky_gift.lua"));
/// The sparse storage's draw.
pub static DRAW_SPARSE: LazyLock<Script> = LazyLock::new(|| coalesced!("draw_sparse.lua"));
/// Gates the parked jackpots again after a config change.
pub static REGATE_HELD: LazyLock<Script> = LazyLock::new(|| on_jackpots!("regate_held.lua"));
/// The list storage's stocking: its lease and the batch's start.
pub static STOCK_BEGIN: LazyLock<Script> = LazyLock::new(|| plain!("stock_begin.lua"));
/// The list storage's stocking: trims what an attempt before staged.
pub static STOCK_TRIM: LazyLock<Script> = LazyLock::new(|| plain!("stock_trim.lua"));
/// The list storage's stocking: a chunk of prizes.
pub static STOCK_PUSH: LazyLock<Script> = LazyLock::new(|| plain!("stock_push.lua"));
/// The list storage's stocking: makes the batch drawable.
pub static STOCK_COMMIT: LazyLock<Script> = LazyLock::new(|| plain!("stock_commit.lua"));
/// The sparse storage's stocking step.
pub static SPARSE_STOCK: LazyLock<Script> = LazyLock::new(|| plain!("sparse_stock.lua"));
/// A batch's secret seed.
pub static FAIR_SEED: LazyLock<Script> = LazyLock::new(|| plain!("fair_seed.lua"));
/// Writes a pool's settings.
pub static CONFIGURE_POOL: LazyLock<Script> = LazyLock::new(|| plain!("configure_pool.lua"));
/// A pool's counters.
pub static POOL_STATUS: LazyLock<Script> = LazyLock::new(|| plain!("pool_status.lua"));
