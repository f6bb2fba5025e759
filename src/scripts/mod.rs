//! Every Redis Lua script, loaded once and called through a typed wrapper.
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
/// stored answers, integer formatting) as its prelude, then the script.
macro_rules! answering {
    ($path:literal) => {
        Script::with_prelude(
            include_str!("../../lua/lib/answer.lua"),
            include_str!($path),
        )
    };
}

/// A lottery strategy's draw script: the answer prelude and
/// `lua/lib/lottery.lua` (window, chances, visits, the award), then the
/// strategy's pick.
macro_rules! lottery {
    ($path:literal) => {
        Script::with_prelude(
            concat!(
                include_str!("../../lua/lib/answer.lua"),
                include_str!("../../lua/lib/lottery.lua")
            ),
            include_str!($path),
        )
    };
}

/// A lucky-gift script on its parked jackpots: the answer prelude,
/// `lua/lib/award.lua` (how an award is stored) and `lua/lib/jackpot.lua`
/// (the jackpot rule, once for both storages), then the script.
macro_rules! lucky_gift {
    ($path:literal) => {
        Script::with_prelude(
            concat!(
                include_str!("../../lua/lib/answer.lua"),
                include_str!("../../lua/lib/award.lua"),
                include_str!("../../lua/lib/jackpot.lua")
            ),
            include_str!($path),
        )
    };
}

/// A lucky-gift storage's draw script, applying several draws of one pool
/// per call: the [`lucky_gift!`] preludes, `lua/lib/draw.lua` (the frame
/// every storage's draw shares: short answer, the award's last writes) and
/// the script's body as a function of its arguments make the prelude; the
/// driver `lua/lib/many.lua`, which calls it once per draw (ARGV[1] =
/// arguments per draw, then each draw's arguments), is the body.
macro_rules! coalesced {
    ($path:literal) => {
        Script::with_prelude(
            concat!(
                include_str!("../../lua/lib/answer.lua"),
                include_str!("../../lua/lib/award.lua"),
                include_str!("../../lua/lib/jackpot.lua"),
                include_str!("../../lua/lib/draw.lua"),
                "local function step(ARGV)\n",
                include_str!($path),
                "\nend\n"
            ),
            include_str!("../../lua/lib/many.lua"),
        )
    };
}

/// The compiled-in scripts.
#[derive(Clone, Debug)]
pub struct Scripts {
    pub draw_lucky_gift: Script,
    pub stock_begin: Script,
    pub stock_trim: Script,
    pub stock_push: Script,
    pub stock_commit: Script,
    pub fair_seed: Script,
    pub configure_pool: Script,
    pub regate_held: Script,
    pub pool_status: Script,
    pub stock_red_packet: Script,
    pub grab_red_packet: Script,
    pub close_red_packet: Script,
    pub configure_activity: Script,
    pub draw_wheel: Script,
    pub draw_ladder: Script,
    pub grant_chances: Script,
    pub draw_sparse: Script,
    pub sparse_stock: Script,
    pub red_packet_status: Script,
    pub claim: Script,
    pub remember_refusal: Script,
    pub forget: Script,
    pub red_packet_expiry: Script,
}

impl Scripts {
    /// Builds the script table (hashing only; nothing is sent to Redis yet).
    pub fn new() -> Self {
        Self {
            draw_lucky_gift: coalesced!("../../lua/draw_lucky_gift.lua"),
            regate_held: lucky_gift!("../../lua/regate_held.lua"),
            stock_begin: Script::new(include_str!("../../lua/stock_begin.lua")),
            stock_trim: Script::new(include_str!("../../lua/stock_trim.lua")),
            stock_push: Script::new(include_str!("../../lua/stock_push.lua")),
            stock_commit: Script::new(include_str!("../../lua/stock_commit.lua")),
            fair_seed: Script::new(include_str!("../../lua/fair_seed.lua")),
            configure_pool: Script::new(include_str!("../../lua/configure_pool.lua")),
            pool_status: Script::new(include_str!("../../lua/pool_status.lua")),
            stock_red_packet: Script::new(include_str!("../../lua/stock_red_packet.lua")),
            grab_red_packet: answering!("../../lua/grab_red_packet.lua"),
            close_red_packet: answering!("../../lua/close_red_packet.lua"),
            configure_activity: lottery!("../../lua/configure_activity.lua"),
            draw_wheel: lottery!("../../lua/draw_wheel.lua"),
            draw_ladder: lottery!("../../lua/draw_ladder.lua"),
            grant_chances: Script::new(include_str!("../../lua/grant_chances.lua")),
            draw_sparse: coalesced!("../../lua/draw_sparse.lua"),
            sparse_stock: Script::new(include_str!("../../lua/sparse_stock.lua")),
            red_packet_status: Script::new(include_str!("../../lua/red_packet_status.lua")),
            claim: answering!("../../lua/claim.lua"),
            remember_refusal: answering!("../../lua/remember_refusal.lua"),
            forget: answering!("../../lua/forget.lua"),
            red_packet_expiry: Script::new(include_str!("../../lua/red_packet_expiry.lua")),
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
