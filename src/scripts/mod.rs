//! How the Redis Lua scripts run, the scripts every kind shares, and the
//! names of a pool's keys. Each kind keeps its own scripts in its folder
//! (`kinds/<kind>/scripts.rs`), built with the macros here.
//!
//! The scripts live in `lua/` as plain files with a contract header. Each one
//! receives every key it touches in `KEYS` (Redis Cluster needs that), and all
//! keys of one pool share the pool's `{hash tag}`, so a script touches one slot.
//! Each runs as a Redis function ([`Script`]): its shared preludes from
//! `lua/lib/` run once when its library is loaded, and a call that finds the
//! library missing (after a restart or failover) loads it and calls again.

mod function;

pub use function::{Script, ScriptInvocation};

/// A script that answers requests: `lua/lib/answer.lua` (fingerprints,
/// stored answers, integer formatting) as its prelude, then the script
/// (`answering!("claim.lua")`, a file of `lua/`).
macro_rules! answering {
    ($file:literal) => {
        $crate::scripts::Script::with_prelude(
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/lib/answer.lua")),
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/lua/", $file)),
        )
    };
}

/// A script without a prelude (`plain!("stock_begin.lua")`, a file of
/// `lua/`).
macro_rules! plain {
    ($file:literal) => {
        $crate::scripts::Script::new(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/lua/",
            $file
        )))
    };
}

pub(crate) use {answering, plain};

/// The scripts every kind shares: the claim of a request id and the
/// answer store (`kinds::answer`). Each kind's own scripts live in its
/// folder (`kinds/<kind>/scripts.rs`), as statics: a script is loaded into
/// Redis by its digest when a call first finds it missing, so nothing
/// needs a list of them.
#[derive(Clone, Debug)]
pub struct Scripts {
    pub claim: Script,
    pub remember_refusal: Script,
    pub forget: Script,
}

impl Scripts {
    /// Builds the script table (hashing only; nothing is sent to Redis yet).
    pub fn new() -> Self {
        Self {
            claim: answering!("claim.lua"),
            remember_refusal: answering!("remember_refusal.lua"),
            forget: answering!("forget.lua"),
        }
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}

/// Names the Redis keys of one pool (or packet, or activity: they share one
/// namespace). Every key carries the id as its cluster hash tag.
#[derive(Clone, Debug)]
pub struct PoolKeys {
    base: String,
}

impl PoolKeys {
    /// Keys of pool `id` under `prefix` (`pp:{gift-1001}:…`).
    pub fn new(prefix: &str, id: &str) -> Self {
        Self {
            base: format!("{prefix}:{{{id}}}:"),
        }
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.base)
    }

    /// Hash of settings and counters; its `kind` field names the prize kind.
    pub fn meta(&self) -> String {
        self.key("meta")
    }

    /// List of stocked prizes.
    pub fn queue(&self) -> String {
        self.key("q")
    }

    /// List of gated jackpots waiting for a draw that may win them.
    pub fn held(&self) -> String {
        self.key("held")
    }

    /// Consumption counter of one UTC day (`YYYYMMDD`).
    pub fn spent(&self, day: &str) -> String {
        self.key(&format!("spent:{day}"))
    }

    /// Commitments of this pool's batches that Postgres has not taken yet
    /// (a hash of generation to the commitment's JSON): on the pool's own
    /// slot, so it is there whenever the pool can be stocked.
    pub fn fair_outbox(&self) -> String {
        self.key("fair-outbox")
    }

    /// Sparse pool: stored non-zero prizes, by bucket of indices.
    pub fn sparse(&self) -> String {
        self.key("sp")
    }

    /// Sparse pool: combo runs (first index and zero-prize code).
    pub fn segments(&self) -> String {
        self.key("seg")
    }

    /// Sparse pool: flagged refill points (index and batch number).
    pub fn flags(&self) -> String {
        self.key("flags")
    }

    /// Red packet: remaining shares.
    pub fn shares(&self) -> String {
        self.key("shares")
    }

    /// Red packet: who grabbed which share.
    pub fn grabbed(&self) -> String {
        self.key("grabbed")
    }

    /// Lottery: chances left per user.
    pub fn chances(&self) -> String {
        self.key("chances")
    }

    /// Lottery: stock left per prize.
    pub fn stock(&self) -> String {
        self.key("stock")
    }

    /// Lottery: prizes awarded so far.
    pub fn awarded(&self) -> String {
        self.key("awarded")
    }

    /// Lottery: the seeds of its periods (`lua/lottery_seed.lua`): the
    /// committed seed of each period not revealed yet, a seed chosen but not
    /// committed yet, one retired and not yet in Postgres, and the last
    /// period retired.
    pub fn lottery_seeds(&self) -> String {
        self.key("seeds")
    }

    /// Lottery: a processed grant, for idempotent grants.
    pub fn grant(&self, grant_id: &str) -> String {
        self.key(&format!("g:{grant_id}"))
    }

    /// Lottery: draws attempted on one UTC day.
    pub fn pv(&self, day: &str) -> String {
        self.key(&format!("pv:{day}"))
    }

    /// Lottery: distinct users on one UTC day (HyperLogLog).
    pub fn uv(&self, day: &str) -> String {
        self.key(&format!("uv:{day}"))
    }

    /// The store of the answers of the pool's requests, for idempotent
    /// replays (`lua/lib/answer.lua`: a meta hash, its buckets beside it).
    pub fn results(&self) -> String {
        self.key("rs")
    }
}

/// Today's UTC day as `YYYYMMDD`, the suffix of daily counters.
pub fn utc_day() -> String {
    use chrono::Datelike;
    let today = chrono::Utc::now().date_naive();
    // Plain integer formatting: this runs on every draw.
    format!("{:04}{:02}{:02}", today.year(), today.month(), today.day())
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
