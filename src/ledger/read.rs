//! What the ledger says: an account's balances, what a pool paid, the
//! totals by reason. Reads only.

use sqlx::PgPool;

/// One account's balance in one asset.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Balance {
    pub asset: String,
    pub balance: i64,
}

/// The balances of `account`, by asset.
pub async fn balances(db: &PgPool, account: i64) -> Result<Vec<Balance>, sqlx::Error> {
    sqlx::query_as("SELECT asset, balance FROM balances WHERE account = $1 ORDER BY asset")
        .bind(account)
        .fetch_all(db)
        .await
}

/// Sum of the entries of `asset` whose `ref.pool` is `pool`: what a pool,
/// packet or activity has moved through the ledger.
pub async fn pool_total(db: &PgPool, pool: &str, asset: &str) -> Result<i64, sqlx::Error> {
    let (total,): (i64,) = sqlx::query_as(
        "SELECT coalesce(sum(amount), 0)::bigint FROM ledger_entries WHERE ref->>'pool' = $1 AND asset = $2",
    )
    .bind(pool)
    .bind(asset)
    .fetch_one(db)
    .await?;
    Ok(total)
}

/// Sum of the credits (positive entries) of `asset` whose `ref.pool` is one
/// of `pools`: what draws and grabs paid out, without a packet's escrow.
pub async fn credited(db: &PgPool, pools: &[String], asset: &str) -> Result<i64, sqlx::Error> {
    let (total,): (i64,) = sqlx::query_as(
        "SELECT coalesce(sum(amount), 0)::bigint FROM ledger_entries \
         WHERE ref->>'pool' = ANY($1) AND asset = $2 AND amount > 0",
    )
    .bind(pools)
    .bind(asset)
    .fetch_one(db)
    .await?;
    Ok(total)
}

/// Sum of every entry for `reason` (or all reasons), per asset.
pub async fn totals(
    db: &PgPool,
    reason: Option<&str>,
) -> Result<Vec<(String, i64, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT asset, coalesce(sum(amount), 0)::bigint, count(*) FROM ledger_entries \
         WHERE $1::text IS NULL OR reason = $1 GROUP BY asset ORDER BY asset",
    )
    .bind(reason)
    .fetch_all(db)
    .await
}
