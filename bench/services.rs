//! The services a run talks to, the pools it loads, and the cleanup of
//! everything it created in Redis.

use prizepool::{
    config::Config,
    kinds::lucky_gift::{self, PoolConfig, Storage},
    redis_conn::RedisConn,
    scripts::Scripts,
};

/// The services a run talks to, opened once.
pub(crate) struct Services<'a> {
    pub(crate) config: &'a Config,
    pub(crate) db: sqlx::PgPool,
    pub(crate) redis: prizepool::redis_conn::RedisConn,
    pub(crate) scripts: Scripts,
}

impl Services<'_> {
    /// Loads `pool` (stocking its first batch).
    pub(crate) async fn load(&self, pool: &PoolConfig) -> anyhow::Result<()> {
        let mut conn = self.redis.clone();
        prizepool::pools::load(
            &self.db,
            &mut conn,
            &self.config.redis_prefix,
            std::slice::from_ref(pool),
            self.config.refill_chunk,
        )
        .await?;
        Ok(())
    }
}

impl<'a> Services<'a> {
    /// Opens the services of `config`, migrating the database.
    pub(crate) async fn open(config: &'a Config) -> anyhow::Result<Self> {
        Ok(Self {
            config,
            db: prizepool::db::migrate(&config.database_url).await?,
            redis: prizepool::redis_conn::connect(&config.redis_url).await?,
            scripts: Scripts::new(),
        })
    }
}

/// A lucky-gift pool `id` in `storage` stocked with `combos` (combo id, then
/// multiplier and count pairs), refilled when `refill_at` of a batch is drawn.
pub(crate) fn pool_config(
    id: &str,
    storage: Storage,
    combos: &[(&str, &[(u64, u64)])],
    refill_at: f64,
) -> PoolConfig {
    PoolConfig {
        id: id.to_owned(),
        unit_price: 100,
        storage,
        refill_at,
        max_count: 1000,
        asset: "coin".into(),
        jackpot: Some(lucky_gift::config::Jackpot {
            min_multiplier: 5000,
            daily_consumption_threshold: 5_000_000,
        }),
        combos: combos
            .iter()
            .map(|(id, stock)| lucky_gift::config::Combo {
                id: (*id).to_owned(),
                stock: stock.to_vec(),
            })
            .collect(),
        shards: 1,
        max_rtp: None,
    }
}

/// The SPEC's combo, scaled by `k`.
pub(crate) fn spec_combos(k: u64) -> Vec<(String, Vec<(u64, u64)>)> {
    (1..=3)
        .map(|c| {
            (
                format!("c{c}"),
                vec![
                    (0, 29994 * k),
                    (10, 293 * k),
                    (50, 139 * k),
                    (500, 27 * k),
                    (5000, k),
                ],
            )
        })
        .collect()
}

/// `combos` as [`pool_config`] takes them.
pub(crate) fn borrow(combos: &[(String, Vec<(u64, u64)>)]) -> Vec<(&str, &[(u64, u64)])> {
    combos
        .iter()
        .map(|(id, s)| (id.as_str(), s.as_slice()))
        .collect()
}

/// This run's id. Every pool, packet and activity the run creates is named
/// `<what>-<run>-<n>`, so its Redis keys can be found and removed at the end.
pub(crate) fn run_id() -> &'static str {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUN.get_or_init(|| ulid::Ulid::new().to_string().to_lowercase())
}

/// A fresh name `<prefix>-<run>-<n>` for something this run creates.
pub(crate) fn unique(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{}-{n}", run_id())
}

/// The patterns the Redis keys of this run match: every key of the run
/// lives under a key prefix of its own ([`super::run`]), its pools' and the claim
/// stores of its request ids alike.
pub(crate) fn run_keys(config: &Config) -> [String; 1] {
    [format!("{}:*", config.redis_prefix)]
}

/// Keys looked at per `SCAN` step of the cleanup. A step of 10,000 kept
/// Redis busy for 20 ms (and the `UNLINK` of what it found for 21–26 ms,
/// slow log of a full run); with 1,000, no step of the next full run's
/// cleanup reached the slow log's 10 ms, so the server's other clients
/// never wait long behind it.
const CLEANUP_SCAN_COUNT: u64 = 1_000;

/// Removes every Redis key of the pools this run created: their prizes,
/// result keys and counters (millions of keys and hundreds of megabytes
/// after a full run, which would otherwise slow the next run down). The
/// ledger entries stay in Postgres, like any other.
/// `None` on a Redis Cluster, which has no single keyspace to scan.
pub(crate) async fn remove_run_keys(config: &Config) -> anyhow::Result<Option<u64>> {
    let RedisConn::Single(mut conn) = prizepool::redis_conn::connect(&config.redis_url).await?
    else {
        return Ok(None);
    };
    let mut removed = 0u64;
    for pattern in run_keys(config) {
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(CLEANUP_SCAN_COUNT)
                .query_async(&mut conn)
                .await?;
            if !keys.is_empty() {
                removed += redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async::<u64>(&mut conn)
                    .await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(Some(removed))
}
