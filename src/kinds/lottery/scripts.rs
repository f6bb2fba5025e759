//! The lottery scripts (`lua/`), built once per process: each is loaded
//! into Redis by its digest when a call first finds it missing.

use std::sync::LazyLock;

use crate::scripts::{plain, Script};

/// A lottery script: the answer prelude and `lua/lib/lottery.lua` (window,
/// chances, visits, the award), then the script (a strategy's pick).
macro_rules! lottery {
    ($file:literal) => {
        Script::with_prelude(
            concat!(
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/answer.lua")),
                include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/lottery.lua"))
            ),
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/", $file)),
        )
    };
}

/// Writes an activity's settings and stock.
pub static CONFIGURE_ACTIVITY: LazyLock<Script> =
    LazyLock::new(|| lottery!("configure_activity.lua"));
/// The `wheel` strategy's draw.
pub static DRAW_WHEEL: LazyLock<Script> = LazyLock::new(|| lottery!("draw_wheel.lua"));
/// The `ladder` strategy's draw.
pub static DRAW_LADDER: LazyLock<Script> = LazyLock::new(|| lottery!("draw_ladder.lua"));
/// Adds a grant's chances, once.
pub static GRANT_CHANCES: LazyLock<Script> = LazyLock::new(|| plain!("grant_chances.lua"));
/// Chooses the seed of a lottery period (`lottery_seed.lua`).
pub static LOTTERY_SEED: LazyLock<Script> = LazyLock::new(|| plain!("lottery_seed.lua"));
/// Commits a period's chosen seed once its commitment is on record.
pub static LOTTERY_SEED_COMMIT: LazyLock<Script> =
    LazyLock::new(|| plain!("lottery_seed_commit.lua"));
/// Takes the seeds of the periods that are over out of the draws' reach.
pub static LOTTERY_SEED_RETIRE: LazyLock<Script> =
    LazyLock::new(|| plain!("lottery_seed_retire.lua"));
