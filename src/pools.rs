//! The pool registry in Postgres: one id namespace for every prize kind, and
//! the versioned configurations of lucky-gift pools.

use anyhow::Context;
use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::{
    kinds::lucky_gift::{self, CodeTable, PoolConfig, StockOutcome},
    scripts::PoolKeys,
};

/// What loading one pool did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    pub pool: String,
    pub version: i32,
    /// Sub-pools the pool is stocked as (1: not sharded).
    pub shards: u32,
    /// The first batch (of the first sub-pool that had none), stocked when
    /// the pool had none.
    pub first_batch: Option<StockOutcome>,
}

/// Whether a new version may return more to players than the pool's
/// last one ([`load_checked`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RtpChange {
    /// A higher return to player is refused: `pool load` asks for
    /// `--accept-rtp-change` (a misplaced zero in a jackpot's stock is the
    /// costliest typo a pool file can have).
    Refuse,
    Accept,
}

/// Stores a new version of each pool in one transaction (all or nothing),
/// writes the settings to Redis, and stocks the first batch of pools that
/// have none. A version may change the pool's return to player either way
/// ([`load_checked`] is what `pool load` runs).
pub async fn load<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    prefix: &str,
    configs: &[PoolConfig],
    chunk: usize,
) -> anyhow::Result<Vec<Loaded>> {
    load_checked(db, redis, prefix, configs, chunk, RtpChange::Accept).await
}

/// [`load`], refusing with `RtpChange::Refuse` (before anything is stored)
/// a new version that returns more per prize than the pool's last one.
pub async fn load_checked<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    prefix: &str,
    configs: &[PoolConfig],
    chunk: usize,
    rtp_change: RtpChange,
) -> anyhow::Result<Vec<Loaded>> {
    let mut tx = db.begin().await?;
    let mut staged = Vec::with_capacity(configs.len());
    for config in configs {
        let (version, table) = stage(&mut tx, config, rtp_change).await?;
        staged.push((config, version, table));
    }
    tx.commit().await.context("storing pool versions")?;

    let mut loaded = Vec::with_capacity(staged.len());
    for (config, version, table) in staged {
        let mut first_batch = None;
        for sub in config.sub_pools() {
            let keys = PoolKeys::new(prefix, &sub.id);
            lucky_gift::configure(redis, &keys, &sub, i64::from(version), &table)
                .await
                .with_context(|| format!("writing pool {} to Redis", sub.id))?;
            // The first batch is committed like any other: its commitment is
            // in Postgres before it is visible.
            let recorder = crate::audit::PgRecorder::new(db);
            let token = ulid::Ulid::new().to_string();
            let outcome = lucky_gift::stock_committed(
                redis,
                &keys,
                &sub,
                i64::from(version),
                &table,
                0,
                chunk,
                lucky_gift::DEFAULT_LEASE_MS,
                &token,
                &recorder,
            )
            .await
            .with_context(|| format!("stocking the first batch of {}", sub.id))?;
            if first_batch.is_none() && !matches!(outcome, StockOutcome::AlreadyDone { .. }) {
                first_batch = Some(outcome);
            }
        }
        if config.shards > 1 {
            open_sharded(redis, prefix, config, version).await?;
        }
        loaded.push(Loaded {
            pool: config.id.clone(),
            version,
            shards: config.shards,
            first_batch,
        });
    }
    Ok(loaded)
}

/// Registers `config`'s pool (and its sub-pools) and stores it as the
/// pool's next version, with its code table extending the previous one:
/// that version and table.
async fn stage(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    config: &PoolConfig,
    rtp_change: RtpChange,
) -> anyhow::Result<(i32, CodeTable)> {
    register(tx, &config.id).await?;
    let previous: Option<(i32, sqlx::types::Json<CodeTable>, sqlx::types::Json<serde_json::Value>)> =
        sqlx::query_as(
            "SELECT version, codes, config FROM pool_versions WHERE pool_id = $1 ORDER BY version DESC LIMIT 1",
        )
        .bind(&config.id)
        .fetch_optional(&mut **tx)
        .await?;
    let version = previous.as_ref().map_or(1, |(v, _, _)| v + 1);
    if let Some((_, _, before)) = &previous {
        check_layout_kept(config, &before.0)?;
        if rtp_change == RtpChange::Refuse {
            check_rtp_kept(config, &before.0)?;
        }
    }
    if config.shards > 1 {
        for sub in config.sub_pools() {
            register(tx, &sub.id).await?;
        }
    }
    let table = CodeTable::extend(previous.as_ref().map(|(_, t, _)| &t.0), config);
    // Batches of earlier versions may still be in the pool: the largest
    // reply is bounded over every prize the table holds.
    lucky_gift::config::check_table_bounds(config, &table)
        .map_err(|e| anyhow::anyhow!("pool {:?}: field `max_count`: {e}", config.id))?;
    sqlx::query(
        "INSERT INTO pool_versions (pool_id, version, config, codes) VALUES ($1, $2, $3, $4)",
    )
    .bind(&config.id)
    .bind(version)
    .bind(sqlx::types::Json(config))
    .bind(sqlx::types::Json(&table))
    .execute(&mut **tx)
    .await?;
    Ok((version, table))
}

/// Refuses a new version that returns more per prize than `before` (the
/// stored config of the pool's last version), naming both figures.
fn check_rtp_kept(config: &PoolConfig, before: &serde_json::Value) -> anyhow::Result<()> {
    let Ok(before) = serde_json::from_value::<PoolConfig>(before.clone()) else {
        return Ok(());
    };
    let was = lucky_gift::economics::analyze(&before).batch;
    let now = lucky_gift::economics::analyze(config).batch;
    // Compared exactly, as fractions: Σ m·n ÷ Σ n.
    let raised = u128::from(now.multiplier_total) * u128::from(was.prizes)
        > u128::from(was.multiplier_total) * u128::from(now.prizes);
    anyhow::ensure!(
        !raised,
        "pool {:?}: this version returns {:.4} per prize, up from {:.4}; \
         check the file and load it again with --accept-rtp-change",
        config.id,
        now.rtp,
        was.rtp,
    );
    Ok(())
}

/// Refuses a new version that would move a loaded pool's prizes: they live
/// where its storage and shards put them, so neither can change once it
/// holds any. `before` is the stored config of its last version.
fn check_layout_kept(config: &PoolConfig, before: &serde_json::Value) -> anyhow::Result<()> {
    let storage = before.get("storage").and_then(|s| s.as_str()).unwrap_or("");
    let wanted = serde_json::to_value(config.storage)?;
    anyhow::ensure!(
        Some(storage) == wanted.as_str(),
        "pool {:?}: field `storage`: cannot change from {storage:?} to {wanted} on a loaded pool",
        config.id,
    );
    let shards = before.get("shards").and_then(|s| s.as_u64()).unwrap_or(1);
    anyhow::ensure!(
        shards == u64::from(config.shards),
        "pool {:?}: field `shards`: cannot change from {shards} to {} on a loaded pool",
        config.id,
        config.shards
    );
    Ok(())
}

/// Writes a sharded pool's own meta, last, once every sub-pool is
/// configured and stocked: from now on draws of the pool find it and go to
/// its sub-pools. The hash is kept for good (`PERSIST`, in the same
/// transaction): a refusal remembered for the pool before it was loaded
/// made the hash expire with the answer store's epochs, and a pool whose
/// meta expired would be unknown again.
async fn open_sharded<C: ConnectionLike + Send>(
    redis: &mut C,
    prefix: &str,
    config: &PoolConfig,
    version: i32,
) -> anyhow::Result<()> {
    let meta = PoolKeys::new(prefix, &config.id).meta();
    redis::pipe()
        .atomic()
        .cmd("HSET")
        .arg(&meta)
        .arg("kind")
        .arg(lucky_gift::KIND)
        .arg("storage")
        .arg(
            serde_json::to_value(config.storage)?
                .as_str()
                .unwrap_or("list"),
        )
        .arg("shards")
        .arg(config.shards)
        .arg("version")
        .arg(version)
        .ignore()
        .cmd("PERSIST")
        .arg(&meta)
        .ignore()
        .query_async::<()>(redis)
        .await
        .with_context(|| format!("writing pool {} to Redis", config.id))
}

/// Registers `id` as a lucky-gift pool in the one namespace of ids, under
/// a row lock so concurrent loads number versions in turn; an id that
/// names another kind is refused.
async fn register(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, id: &str) -> anyhow::Result<()> {
    sqlx::query("INSERT INTO pools (id, kind) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
        .bind(id)
        .bind(lucky_gift::KIND)
        .execute(&mut **tx)
        .await?;
    let (kind,): (String,) = sqlx::query_as("SELECT kind FROM pools WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_one(&mut **tx)
        .await?;
    anyhow::ensure!(
        kind == lucky_gift::KIND,
        "id {id:?} already names a {kind}, not a lucky-gift pool"
    );
    Ok(())
}

/// The counters of lucky-gift pool `pool`, summed over its sub-pools if it
/// is sharded (then `shards` lists each sub-pool's own); `None` if no such
/// pool exists.
pub async fn status<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    pool: &str,
) -> Result<Option<Status>, redis::RedisError> {
    let shards = shards_of(conn, prefix, pool).await?;
    if shards <= 1 {
        let keys = PoolKeys::new(prefix, pool);
        return Ok(lucky_gift::status(conn, &keys, pool)
            .await?
            .map(|total| Status {
                total,
                shards: Vec::new(),
            }));
    }
    let mut subs = Vec::with_capacity(shards as usize);
    for shard in 0..shards {
        let id = lucky_gift::config::sub_pool_id(pool, shard);
        let keys = PoolKeys::new(prefix, &id);
        match lucky_gift::status(conn, &keys, &id).await? {
            Some(status) => subs.push(status),
            None => return Ok(None),
        }
    }
    let mut total = subs[0].clone();
    total.pool = pool.to_owned();
    for s in &subs[1..] {
        total.version = total.version.max(s.version);
        total.generation += s.generation;
        total.stocked += s.stocked;
        total.drawn += s.drawn;
        total.in_pool += s.in_pool;
        total.held_jackpots += s.held_jackpots;
        total.spent_today += s.spent_today;
    }
    Ok(Some(Status {
        total,
        shards: subs,
    }))
}

/// The sub-pools lucky-gift pool `pool` is split into (1 if it is not
/// sharded or does not exist).
pub async fn shards_of<C: ConnectionLike + Send>(
    conn: &mut C,
    prefix: &str,
    pool: &str,
) -> Result<u32, redis::RedisError> {
    let shards: Option<u32> = redis::cmd("HGET")
        .arg(PoolKeys::new(prefix, pool).meta())
        .arg("shards")
        .query_async(conn)
        .await?;
    Ok(shards.unwrap_or(1))
}

/// A pool's counters: the whole pool's, and each sub-pool's if it is sharded.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Status {
    #[serde(flatten)]
    pub total: lucky_gift::PoolStatus,
    /// Each sub-pool's counters (empty for a pool that is not sharded).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<lucky_gift::PoolStatus>,
}

/// The latest configuration of a lucky-gift pool and its code table.
pub use crate::kinds::lucky_gift::refill::latest;
