//! The settle worker: applies credits and debits to the Postgres ledger.
//!
//! Messages are gathered into batches (up to `SETTLE_BATCH_SIZE`, waiting at
//! most `SETTLE_BATCH_WAIT_MS` for a batch to fill) and written in one
//! transaction with a single `unnest` insert. A duplicate `entry_id` is
//! skipped by the database, so redeliveries and replays change nothing. The
//! batch is acknowledged only after the commit; when Postgres is down the
//! batch is retried with backoff and never acknowledged early.

mod worker;

use serde_json::Value;
use sqlx::PgPool;

pub use worker::run;

use crate::messages::SettleRequest;

/// What one batch changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    /// Entries written now (duplicates excluded).
    pub inserted: i64,
}

/// Writes `entries` to the ledger in one transaction.
pub async fn apply<'a>(
    db: &PgPool,
    entries: impl IntoIterator<Item = &'a SettleRequest>,
) -> Result<Applied, sqlx::Error> {
    let columns = Columns::of(entries);
    let mut tx = db.begin().await?;
    let applied = columns.insert(&mut tx).await?;
    tx.commit().await?;
    Ok(applied)
}

/// Writes `entries` inside the caller's transaction (red-packet escrow uses
/// this to debit the sender atomically with the packet's creation).
pub async fn apply_in<'a>(
    conn: &mut sqlx::PgConnection,
    entries: impl IntoIterator<Item = &'a SettleRequest>,
) -> Result<Applied, sqlx::Error> {
    Columns::of(entries).insert(conn).await
}

/// Entries as the columns the `unnest` insert binds.
#[derive(Default)]
struct Columns {
    ids: Vec<String>,
    accounts: Vec<i64>,
    assets: Vec<String>,
    amounts: Vec<i64>,
    reasons: Vec<String>,
    refs: Vec<Value>,
}

impl Columns {
    fn of<'a>(entries: impl IntoIterator<Item = &'a SettleRequest>) -> Self {
        let mut c = Self::default();
        for e in entries {
            c.ids.push(e.entry_id.clone());
            c.accounts.push(e.account);
            c.assets.push(e.asset.clone());
            c.amounts.push(e.amount);
            c.reasons.push(e.reason.clone());
            c.refs.push(e.reference.clone().unwrap_or(Value::Null));
        }
        c
    }

    async fn insert(&self, conn: &mut sqlx::PgConnection) -> Result<Applied, sqlx::Error> {
        let (inserted, _accounts): (i64, i64) = sqlx::query_as(include_str!("ledger.sql"))
            .bind(&self.ids)
            .bind(&self.accounts)
            .bind(&self.assets)
            .bind(&self.amounts)
            .bind(&self.reasons)
            .bind(&self.refs)
            .fetch_one(conn)
            .await?;
        Ok(Applied { inserted })
    }
}

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
