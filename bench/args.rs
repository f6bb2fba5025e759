//! The command line of `prizepool bench`.

use prizepool::kinds::lucky_gift::Storage;

use super::{
    kinds::{Kind, Load},
    plan,
};

/// Seconds of each Redis ceiling pass, unless `--ceiling-pass-ms` says
/// otherwise.
pub(crate) const CEILING_PASS_S: u64 = 3;

/// Options of `prizepool bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Draw-worker counts to run, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub(super) workers: Vec<usize>,
    /// Seconds of each load phase.
    #[arg(long, default_value_t = 10)]
    pub(super) duration: u64,
    /// Simulated users.
    #[arg(long, default_value_t = 10_000)]
    pub(super) users: u64,
    /// Draws in flight in the closed loop.
    #[arg(long, default_value_t = 512)]
    pub(super) in_flight: usize,
    /// Open-loop rate in draws/s instead of the closed loop (0: closed loop,
    /// then an open loop at half the rate it reached).
    #[arg(long, default_value_t = 0.0)]
    pub(super) rate: f64,
    /// Prizes per lucky-gift draw.
    #[arg(long, default_value_t = 10)]
    pub(super) count: u32,
    /// Prize kind to draw.
    #[arg(long, value_enum, default_value = "lucky-gift")]
    pub(super) kind: Kind,
    /// Storage of the lucky-gift pool under load.
    #[arg(long, default_value = "list")]
    pub(super) storage: String,
    /// Skip the slow one-off measurements (pool-size flatness, 3M-prize stocking).
    #[arg(long)]
    pub(super) quick: bool,
    /// Milliseconds of each Redis ceiling pass (a quick check of the
    /// bench itself, such as the tests' runs, can do with less).
    #[arg(long, value_name = "MS", default_value_t = CEILING_PASS_S * 1000,
          value_parser = clap::value_parser!(u64).range(100..))]
    pub(super) ceiling_pass_ms: u64,
    /// Requests claimed and answered to measure what a remembered result
    /// costs (default 1,000,000; 100,000 with `--quick`).
    #[arg(long)]
    pub(super) results: Option<u64>,
    /// Measure nothing: print what a peak of RATE draws/s (for SECONDS, or
    /// steady) needs, from the costs of an earlier run (`--plan-from`).
    #[arg(long, value_name = "RATE[:SECONDS]")]
    pub(super) plan: Option<plan::Peak>,
    /// The report a plan is made from.
    #[arg(long, default_value = "results/latest/report.json")]
    pub(super) plan_from: std::path::PathBuf,
    /// Cores of one node, for the plan.
    #[arg(long, default_value_t = 16.0)]
    pub(super) node_cores: f64,
    /// Share of each core a part may use at the peak, for the plan.
    #[arg(long, default_value_t = 0.6)]
    pub(super) utilisation: f64,
    /// Memory one Redis master may fill, in GB, for the plan.
    #[arg(long, default_value_t = 25.0)]
    pub(super) redis_master_gb: f64,
    /// Draws per message: drive the fleet through the library's batching
    /// client (`prizepool::client`) with batches of at most K draws. Several
    /// sizes, comma separated (`--batch 1,10,50,100`), sweep them: one run
    /// per size and worker count, with a table and `batch.svg`. Without it,
    /// each draw is one `draw` message from a plain request/reply client.
    #[arg(long, value_name = "K", value_delimiter = ',')]
    pub(super) batch: Vec<usize>,
    /// The batching client's linger: how long a batch waits for more draws
    /// after its first.
    #[arg(long, default_value_t = 2.0)]
    pub(super) linger_ms: f64,
    /// Where reports are written.
    #[arg(long, default_value = "results")]
    pub(super) out: std::path::PathBuf,
}

impl BenchArgs {
    /// The storage `--storage` names.
    pub(super) fn storage(&self) -> anyhow::Result<Storage> {
        self.load().storage()
    }

    /// What the kinds' workloads read of these options.
    pub(super) fn load(&self) -> Load {
        Load {
            users: self.users,
            count: self.count,
            storage: self.storage.clone(),
            duration: self.duration,
            ceiling_pass_ms: self.ceiling_pass_ms,
        }
    }
}
