//! The pool registry in Postgres: one id namespace for every prize kind, and
//! the versioned configurations of lucky-gift pools.

use anyhow::Context;
use redis::aio::ConnectionLike;
use sqlx::PgPool;

use crate::{
    kinds::lucky_gift::{self, CodeTable, PoolConfig, StockOutcome},
    scripts::{PoolKeys, Scripts},
};

/// What loading one pool did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    pub pool: String,
    pub version: i32,
    /// The first batch, stocked when the pool had none.
    pub first_batch: Option<StockOutcome>,
}

/// Stores a new version of each pool in one transaction (all or nothing),
/// writes the settings to Redis, and stocks the first batch of pools that
/// have none.
pub async fn load<C: ConnectionLike + Send>(
    db: &PgPool,
    redis: &mut C,
    scripts: &Scripts,
    prefix: &str,
    configs: &[PoolConfig],
    chunk: usize,
) -> anyhow::Result<Vec<Loaded>> {
    let mut tx = db.begin().await?;
    let mut staged = Vec::with_capacity(configs.len());
    for config in configs {
        sqlx::query("INSERT INTO pools (id, kind) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
            .bind(&config.id)
            .bind(lucky_gift::KIND)
            .execute(&mut *tx)
            .await?;
        // Lock the pool row so concurrent loads number versions in turn.
        let (kind,): (String,) = sqlx::query_as("SELECT kind FROM pools WHERE id = $1 FOR UPDATE")
            .bind(&config.id)
            .fetch_one(&mut *tx)
            .await?;
        if kind != lucky_gift::KIND {
            anyhow::bail!(
                "id {:?} already names a {kind}, not a lucky-gift pool",
                config.id
            );
        }
        let previous: Option<(i32, sqlx::types::Json<CodeTable>)> = sqlx::query_as(
            "SELECT version, codes FROM pool_versions WHERE pool_id = $1 ORDER BY version DESC LIMIT 1",
        )
        .bind(&config.id)
        .fetch_optional(&mut *tx)
        .await?;
        let version = previous.as_ref().map_or(1, |(v, _)| v + 1);
        if previous.is_some() {
            let (storage,): (Option<String>,) =
                sqlx::query_as("SELECT config->>'storage' FROM pool_versions WHERE pool_id = $1 ORDER BY version DESC LIMIT 1")
                    .bind(&config.id)
                    .fetch_one(&mut *tx)
                    .await?;
            let wanted = serde_json::to_value(config.storage)?;
            anyhow::ensure!(
                storage.as_deref() == wanted.as_str(),
                "pool {:?}: field `storage`: cannot change from {:?} to {wanted} on a loaded pool",
                config.id,
                storage.unwrap_or_default()
            );
        }
        let table = CodeTable::extend(previous.as_ref().map(|(_, t)| &t.0), config);
        sqlx::query(
            "INSERT INTO pool_versions (pool_id, version, config, codes) VALUES ($1, $2, $3, $4)",
        )
        .bind(&config.id)
        .bind(version)
        .bind(sqlx::types::Json(config))
        .bind(sqlx::types::Json(&table))
        .execute(&mut *tx)
        .await?;
        staged.push((config, version, table));
    }
    tx.commit().await.context("storing pool versions")?;

    let mut loaded = Vec::with_capacity(staged.len());
    for (config, version, table) in staged {
        let keys = PoolKeys::new(prefix, &config.id);
        lucky_gift::configure(redis, scripts, &keys, config, i64::from(version), &table)
            .await
            .with_context(|| format!("writing pool {} to Redis", config.id))?;
        // The first batch is committed like any other: its commitment is
        // in Postgres before it is visible.
        let recorder = crate::audit::PgRecorder::new(db);
        let token = ulid::Ulid::new().to_string();
        let first_batch = match lucky_gift::stock_committed(
            redis,
            scripts,
            &keys,
            config,
            i64::from(version),
            &table,
            0,
            chunk,
            lucky_gift::DEFAULT_LEASE_MS,
            &token,
            &recorder,
        )
        .await
        .with_context(|| format!("stocking the first batch of {}", config.id))?
        {
            StockOutcome::AlreadyDone { .. } => None,
            other => Some(other),
        };
        loaded.push(Loaded {
            pool: config.id.clone(),
            version,
            first_batch,
        });
    }
    Ok(loaded)
}

/// The latest configuration of a lucky-gift pool and its code table.
pub async fn latest(
    db: &PgPool,
    pool: &str,
) -> Result<Option<(i32, PoolConfig, CodeTable)>, sqlx::Error> {
    let row: Option<(i32, sqlx::types::Json<PoolConfig>, sqlx::types::Json<CodeTable>)> = sqlx::query_as(
        "SELECT version, config, codes FROM pool_versions WHERE pool_id = $1 ORDER BY version DESC LIMIT 1",
    )
    .bind(pool)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(v, c, t)| (v, c.0, t.0)))
}
