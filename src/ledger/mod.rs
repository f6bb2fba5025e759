//! The Postgres ledger: every movement of value is one entry with a unique
//! `entry_id`, and balances per account and asset follow from the entries.
//! Prize kinds and the settle worker both write through this module; the
//! draw and refill workers publish the entries they owe through it
//! ([`Unsealed`], grouped as [`ENTRIES`]).
//!
//! Rules the ledger keeps, whoever writes:
//!
//! - An `entry_id` is bound to its content (account, asset, amount, reason):
//!   the same entry again is a [`Verdict::Duplicate`] and moves nothing, the
//!   same id with other content is a [`Verdict::Conflict`] and moves nothing.
//! - Only debit reasons may carry a negative amount, only credit reasons a
//!   positive one (each reason is declared once, in [`reasons`]); a debit
//!   never takes a balance below zero ([`Verdict::InsufficientFunds`]).
//! - Every amount stays within [`MAX_AMOUNT`] (2^53 − 1), so every figure
//!   is exact in any JSON reader and no sum can overflow. A credit from
//!   outside the fleet may not take a balance above it either; a prize the
//!   fleet already promised in a reply (a kind's reason, sealed) is
//!   paid even past it (a balance is a 64-bit integer): a reply's promise is
//!   never dead-lettered unpaid.
//!
//! A batch is written in one transaction: its new entries are inserted
//! first (which serialises concurrent writers of one id) and the balances
//! they touch are locked in a fixed order and moved by the sum of their
//! entries, all in one statement (`insert.sql`); each entry is judged in
//! batch order against its running balance, and the refused ones are taken
//! out again, with the balances they moved, before the commit. A batch
//! whose entries all land costs that one statement and the commit.

mod entries;
mod fleet_key;
mod read;
pub mod reason;
pub mod reasons;
mod refused;
mod seal;

pub use entries::{Unsealed, ENTRIES};
pub use fleet_key::{FleetSealer, KEY_REFRESH};
pub use read::{balances, credited, pool_total, totals, Balance};
pub use reasons::{check_movement, MAX_AMOUNT};
pub use refused::{is_permanent, Refused};
pub use seal::{is_internal_id, Sealer, KEY_RING};

use std::collections::HashMap;

use serde_json::Value;
use sqlx::{types::Json, PgConnection, PgPool};

use crate::messages::{ErrorCode, SettleRequest};

/// What the ledger made of one entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Written now; the balance moved.
    Applied,
    /// The same entry (id and content) is in the ledger already.
    Duplicate,
    /// The id is in the ledger (or earlier in the batch) with other content.
    Conflict,
    /// A debit larger than the balance it would take from.
    InsufficientFunds { balance: i64 },
    /// A credit that would take the balance above [`MAX_AMOUNT`].
    Overflow { balance: i64 },
    /// The entry breaks [`check_movement`].
    Invalid(String),
}

impl Verdict {
    /// Whether the entry is in the ledger after this batch.
    pub fn landed(&self) -> bool {
        matches!(self, Self::Applied | Self::Duplicate)
    }

    /// A short name for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Duplicate => "duplicate",
            Self::Conflict => "conflict",
            Self::InsufficientFunds { .. } => "insufficient_funds",
            Self::Overflow { .. } => "overflow",
            Self::Invalid(_) => "invalid",
        }
    }

    /// The wire error code of a refusal: the request is wrong
    /// (`invalid_request`), the account is short (`insufficient_funds`), or
    /// it can never be booked (`internal`).
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Applied | Self::Duplicate => None,
            Self::Conflict | Self::Invalid(_) => Some(ErrorCode::InvalidRequest),
            Self::InsufficientFunds { .. } => Some(ErrorCode::InsufficientFunds),
            Self::Overflow { .. } => Some(ErrorCode::Internal),
        }
    }

    /// Why `entry` was refused, for a reply or a dead letter.
    pub fn describe(&self, entry: &SettleRequest) -> String {
        let SettleRequest {
            entry_id,
            account,
            asset,
            amount,
            ..
        } = entry;
        match self {
            Self::Applied => format!("entry {entry_id} applied"),
            Self::Duplicate => format!("entry {entry_id} was applied before"),
            Self::Conflict => format!(
                "refused by the ledger: entry_id {entry_id} is already bound to other content"
            ),
            Self::InsufficientFunds { balance } => format!(
                "account {account} holds {balance} {asset}, the debit needs {}",
                amount.unsigned_abs()
            ),
            Self::Overflow { balance } => format!(
                "refused by the ledger: account {account} holds {balance} {asset}; \
                 {amount} more would overflow the limit of {MAX_AMOUNT}"
            ),
            Self::Invalid(why) => format!("refused by the ledger: {why}"),
        }
    }
}

/// What one batch changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    /// Entries written now (duplicates excluded).
    pub inserted: i64,
}

/// Writes `entries` to the ledger in one transaction, all or nothing:
/// duplicates are skipped, and any refused entry fails the whole call with
/// a [`Refused`] database error (nothing is written then).
pub async fn apply<'a>(
    db: &PgPool,
    entries: impl IntoIterator<Item = &'a SettleRequest>,
) -> Result<Applied, sqlx::Error> {
    let mut tx = db.begin().await?;
    let applied = apply_in(&mut tx, entries).await?;
    tx.commit().await?;
    Ok(applied)
}

/// [`apply`] inside the caller's transaction (red-packet escrow uses this to
/// debit the sender atomically with the packet's creation). On a refusal the
/// caller must roll back.
pub async fn apply_in<'a>(
    conn: &mut PgConnection,
    entries: impl IntoIterator<Item = &'a SettleRequest>,
) -> Result<Applied, sqlx::Error> {
    let entries: Vec<&SettleRequest> = entries.into_iter().collect();
    let verdicts = apply_each_in(conn, &entries).await?;
    let mut inserted = 0;
    for (entry, verdict) in entries.iter().zip(&verdicts) {
        match verdict {
            Verdict::Applied => inserted += 1,
            Verdict::Duplicate => {}
            refused => return Err(Refused::new(entry, refused).into()),
        }
    }
    Ok(Applied { inserted })
}

/// Writes what it can of `entries` in one transaction and returns one
/// verdict per entry, in order: the settle worker's call, where each entry
/// has its own fate.
pub async fn apply_each(
    db: &PgPool,
    entries: &[&SettleRequest],
) -> Result<Vec<Verdict>, sqlx::Error> {
    let mut tx = db.begin().await?;
    let verdicts = apply_each_in(&mut tx, entries).await?;
    tx.commit().await?;
    Ok(verdicts)
}

/// [`apply_each`] inside the caller's transaction.
pub async fn apply_each_in(
    conn: &mut PgConnection,
    entries: &[&SettleRequest],
) -> Result<Vec<Verdict>, sqlx::Error> {
    let mut verdicts: Vec<Option<Verdict>> = vec![None; entries.len()];
    // The entries the ledger may take at all, as parallel columns; `at`
    // maps a column position back to the entry.
    let mut columns = Columns::default();
    let mut at = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        match check_movement(&entry.reason, entry.amount) {
            Ok(()) => {
                columns.push(entry);
                at.push(i);
            }
            Err(why) => verdicts[i] = Some(Verdict::Invalid(why)),
        }
    }
    if !at.is_empty() {
        judge(conn, entries, &columns, &at, &mut verdicts).await?;
    }
    verdicts
        .into_iter()
        .map(|v| v.ok_or_else(|| sqlx::Error::Protocol("an entry got no verdict".into())))
        .collect()
}

/// Inserts, compares, checks balances and fills `verdicts` for the entries
/// at `at` (whose columns are `columns`).
async fn judge(
    conn: &mut PgConnection,
    entries: &[&SettleRequest],
    columns: &Columns<'_>,
    at: &[usize],
    verdicts: &mut [Option<Verdict>],
) -> Result<(), sqlx::Error> {
    let (is_written, mut locked) = insert_and_lock(conn, columns, at.len()).await?;
    if is_written.iter().any(|w| !w) {
        judge_repeats(conn, columns, at, &is_written, verdicts).await?;
    }
    lock_unmoved(conn, entries, at, &is_written, &mut locked).await?;
    let mut balances: HashMap<(i64, &str), Running> = locked
        .iter()
        .map(|(account, asset, stored, created, moved)| {
            let running = Running {
                balance: stored - moved,
                stored: *stored,
                created: *created,
                moved: false,
            };
            ((*account, asset.as_str()), running)
        })
        .collect();
    let refused_ids = judge_written(entries, at, &is_written, &mut balances, verdicts)?;
    if !refused_ids.is_empty() {
        take_back(conn, entries, at, &is_written, &refused_ids, verdicts).await?;
    }
    write_balances(conn, &balances).await
}

/// A balance locked for the batch: account, asset, the balance the row
/// holds now, whether the batch created the row, and the sum `insert.sql`
/// moved it by (0 when it did not).
type Locked = (i64, String, i64, bool, i64);

/// Writes the new entries of `columns` (`n` of them) and locks the balances
/// they touch (`insert.sql`): which entries were written, by position, and
/// the balances locked.
async fn insert_and_lock(
    conn: &mut PgConnection,
    columns: &Columns<'_>,
    n: usize,
) -> Result<(Vec<bool>, Vec<Locked>), sqlx::Error> {
    type Row = (
        Option<i64>,
        Option<i64>,
        Option<String>,
        Option<i64>,
        Option<bool>,
        Option<i64>,
    );
    let rows: Vec<Row> = sqlx::query_as(include_str!("insert.sql"))
        .bind(&columns.ids)
        .bind(&columns.accounts)
        .bind(&columns.assets)
        .bind(&columns.amounts)
        .bind(&columns.reasons)
        .bind(&columns.refs)
        .fetch_all(&mut *conn)
        .await?;
    let mut is_written = vec![false; n];
    let mut locked = Vec::new();
    for row in rows {
        match row {
            (Some(n), None, None, None, None, None) => *position(&mut is_written, n)? = true,
            (None, Some(account), Some(asset), Some(balance), Some(created), Some(moved)) => {
                locked.push((account, asset, balance, created, moved))
            }
            other => {
                return Err(sqlx::Error::Protocol(format!(
                    "insert.sql returned an unexpected row {other:?}"
                )))
            }
        }
    }
    Ok((is_written, locked))
}

/// Adds to `locked` the balances of written entries that `insert.sql` left
/// where they were (their sum would have left the 64-bit range): locked by
/// it all the same, so read as they stand.
async fn lock_unmoved(
    conn: &mut PgConnection,
    entries: &[&SettleRequest],
    at: &[usize],
    is_written: &[bool],
    locked: &mut Vec<Locked>,
) -> Result<(), sqlx::Error> {
    let mut missing: std::collections::HashSet<(i64, &str)> = is_written
        .iter()
        .zip(at)
        .filter(|(written, _)| **written)
        .map(|(_, &i)| (entries[i].account, entries[i].asset.as_str()))
        .collect();
    for (account, asset, ..) in locked.iter() {
        missing.remove(&(*account, asset.as_str()));
    }
    if missing.is_empty() {
        return Ok(());
    }
    let (accounts, assets): (Vec<i64>, Vec<&str>) = missing.into_iter().unzip();
    let rows: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT b.account, b.asset, b.balance FROM balances AS b \
         JOIN unnest($1::bigint[], $2::text[]) AS v(account, asset) USING (account, asset)",
    )
    .bind(&accounts)
    .bind(&assets)
    .fetch_all(&mut *conn)
    .await?;
    locked.extend(
        rows.into_iter()
            .map(|(account, asset, balance)| (account, asset, balance, false, 0)),
    );
    Ok(())
}

/// The verdicts of the entries that were not written: the same entry again
/// (a duplicate), or the id with other content (a conflict).
async fn judge_repeats(
    conn: &mut PgConnection,
    columns: &Columns<'_>,
    at: &[usize],
    is_written: &[bool],
    verdicts: &mut [Option<Verdict>],
) -> Result<(), sqlx::Error> {
    let stored: Vec<(i64, bool)> = sqlx::query_as(include_str!("compare.sql"))
        .bind(&columns.ids)
        .bind(&columns.accounts)
        .bind(&columns.assets)
        .bind(&columns.amounts)
        .bind(&columns.reasons)
        .fetch_all(&mut *conn)
        .await?;
    for (n, same) in stored {
        let k = usize::try_from(n - 1)
            .ok()
            .filter(|&k| k < at.len())
            .ok_or_else(|| sqlx::Error::Protocol(format!("position {n} out of range")))?;
        if !is_written[k] {
            verdicts[at[k]] = Some(if same {
                Verdict::Duplicate
            } else {
                Verdict::Conflict
            });
        }
    }
    Ok(())
}

/// Judges each written entry in batch order against its locked balance,
/// moving `balances`; returns the verdict of each id refused (it leaves the
/// ledger again).
fn judge_written<'e>(
    entries: &[&'e SettleRequest],
    at: &[usize],
    is_written: &[bool],
    balances: &mut HashMap<(i64, &'e str), Running>,
    verdicts: &mut [Option<Verdict>],
) -> Result<HashMap<&'e str, Verdict>, sqlx::Error> {
    let mut refused_ids = HashMap::new();
    for (k, _) in is_written.iter().enumerate().filter(|(_, w)| **w) {
        let entry = entries[at[k]];
        let running = balances
            .get_mut(&(entry.account, entry.asset.as_str()))
            .ok_or_else(|| sqlx::Error::Protocol("a balance was not locked".into()))?;
        let promised = reasons::is_sealed(&entry.reason);
        let verdict = running.take(entry.amount, promised);
        if !verdict.landed() {
            refused_ids.insert(entry.entry_id.as_str(), verdict.clone());
        }
        verdicts[at[k]] = Some(verdict);
    }
    Ok(refused_ids)
}

/// Takes the refused entries out of the ledger again; a later repeat of one
/// in this batch shares its fate: a reply never promises what is not booked.
async fn take_back(
    conn: &mut PgConnection,
    entries: &[&SettleRequest],
    at: &[usize],
    is_written: &[bool],
    refused_ids: &HashMap<&str, Verdict>,
    verdicts: &mut [Option<Verdict>],
) -> Result<(), sqlx::Error> {
    for (k, &i) in at.iter().enumerate() {
        if is_written[k] {
            continue;
        }
        if let (Some(Verdict::Duplicate), Some(verdict)) =
            (&verdicts[i], refused_ids.get(entries[i].entry_id.as_str()))
        {
            verdicts[i] = Some(verdict.clone());
        }
    }
    let ids: Vec<&str> = refused_ids.keys().copied().collect();
    sqlx::query("DELETE FROM ledger_entries WHERE entry_id = ANY($1)")
        .bind(&ids)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The 0-based slot of 1-based position `n` in `slots`.
fn position(slots: &mut [bool], n: i64) -> Result<&mut bool, sqlx::Error> {
    usize::try_from(n - 1)
        .ok()
        .and_then(|k| slots.get_mut(k))
        .ok_or_else(|| sqlx::Error::Protocol(format!("position {n} out of range")))
}

/// A locked balance while a batch is judged.
struct Running {
    balance: i64,
    /// What the row holds now (`insert.sql` moved it by the batch's sum).
    stored: i64,
    /// Whether locking created the row (at zero).
    created: bool,
    moved: bool,
}

impl Running {
    /// Judges a movement of `amount` against the running balance and books
    /// it when it passes.
    /// Moves the balance by `amount`, unless that overdraws it or, for a
    /// credit that was not `promised` in a reply, takes it past [`MAX_AMOUNT`].
    fn take(&mut self, amount: i64, promised: bool) -> Verdict {
        let Some(next) = self.balance.checked_add(amount) else {
            return Verdict::Overflow {
                balance: self.balance,
            };
        };
        // A debit may not take a balance below zero; a credit may not take
        // it above the exact range. A movement towards the range is always
        // allowed (a balance from before these rules may lie outside it).
        if amount < 0 && next < 0 {
            return Verdict::InsufficientFunds {
                balance: self.balance,
            };
        }
        if amount > 0 && next > MAX_AMOUNT && !promised {
            return Verdict::Overflow {
                balance: self.balance,
            };
        }
        self.balance = next;
        self.moved = true;
        Verdict::Applied
    }
}

/// Puts right the balances a refusal left other than `insert.sql` moved
/// them, and removes the rows created for nothing; in the common case
/// (every entry landed) there is nothing to write.
async fn write_balances(
    conn: &mut PgConnection,
    balances: &HashMap<(i64, &str), Running>,
) -> Result<(), sqlx::Error> {
    let mut moved = (Vec::new(), Vec::new(), Vec::new());
    let mut unused = (Vec::new(), Vec::new());
    for ((account, asset), running) in balances {
        if running.created && !running.moved {
            unused.0.push(*account);
            unused.1.push(*asset);
        } else if running.balance != running.stored {
            moved.0.push(*account);
            moved.1.push(*asset);
            moved.2.push(running.balance);
        }
    }
    if !moved.0.is_empty() {
        sqlx::query(
            "UPDATE balances AS b SET balance = v.balance, updated_at = now() \
             FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS v(account, asset, balance) \
             WHERE b.account = v.account AND b.asset = v.asset",
        )
        .bind(&moved.0)
        .bind(&moved.1)
        .bind(&moved.2)
        .execute(&mut *conn)
        .await?;
    }
    if !unused.0.is_empty() {
        sqlx::query(
            "DELETE FROM balances AS b USING unnest($1::bigint[], $2::text[]) AS v(account, asset) \
             WHERE b.account = v.account AND b.asset = v.asset",
        )
        .bind(&unused.0)
        .bind(&unused.1)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// Entries as the columns the `unnest` statements bind, borrowed from the
/// entries (nothing is copied per entry but the two numbers).
#[derive(Default)]
struct Columns<'a> {
    ids: Vec<&'a str>,
    accounts: Vec<i64>,
    assets: Vec<&'a str>,
    amounts: Vec<i64>,
    reasons: Vec<&'a str>,
    refs: Vec<Json<&'a Value>>,
}

/// The `ref` of an entry without one: JSON `null`.
static NO_REF: Value = Value::Null;

impl<'a> Columns<'a> {
    fn push(&mut self, e: &'a SettleRequest) {
        self.ids.push(&e.entry_id);
        self.accounts.push(e.account);
        self.assets.push(&e.asset);
        self.amounts.push(e.amount);
        self.reasons.push(&e.reason);
        self.refs
            .push(Json(e.reference.as_ref().unwrap_or(&NO_REF)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_a_permanent_database_error_with_its_sqlstate() {
        let entry = SettleRequest::new("e", 1, "coin", 5, "topup", Value::Null);
        for (verdict, code) in [
            (Verdict::Conflict, "23505"),
            (Verdict::InsufficientFunds { balance: 0 }, "23514"),
            (Verdict::Overflow { balance: 0 }, "22003"),
        ] {
            let error = sqlx::Error::from(Refused::new(&entry, &verdict));
            assert!(is_permanent(&error), "{error}");
            let sqlx::Error::Database(e) = &error else {
                panic!("{error}")
            };
            assert_eq!(e.code().as_deref(), Some(code));
        }
        assert!(!is_permanent(&sqlx::Error::PoolTimedOut));
    }

    #[test]
    fn a_running_balance_refuses_overdrafts_and_overflows() {
        let mut r = Running {
            balance: 10,
            stored: 10,
            created: false,
            moved: false,
        };
        assert_eq!(
            r.take(-11, false),
            Verdict::InsufficientFunds { balance: 10 }
        );
        assert_eq!(r.take(-10, false), Verdict::Applied);
        assert_eq!(r.take(MAX_AMOUNT, false), Verdict::Applied);
        assert_eq!(
            r.take(1, false),
            Verdict::Overflow {
                balance: MAX_AMOUNT
            }
        );
        assert_eq!(r.balance, MAX_AMOUNT);
        assert!(r.moved);
        // A prize a reply promised is paid past the bound, up to what a
        // balance can hold.
        assert_eq!(r.take(MAX_AMOUNT, true), Verdict::Applied);
        assert_eq!(r.balance, 2 * MAX_AMOUNT);
        r.balance = i64::MAX - 1;
        assert_eq!(
            r.take(2, true),
            Verdict::Overflow {
                balance: i64::MAX - 1
            }
        );
    }
}
