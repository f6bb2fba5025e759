//! A packet as Postgres keeps it: what its create asked and, once closed,
//! what it refunded.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use super::split;
use crate::messages::RedPacketCreate;

/// A packet as Postgres keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub sender: i64,
    pub asset: String,
    pub total: i64,
    pub count: i64,
    /// The smallest share handed out (`max(min, 1)`).
    pub min_share: i64,
    /// `min` as the create asked it (`None` before this was recorded).
    pub min_asked: Option<i64>,
    /// `expires_in_s` as the create asked it (`None` before this was recorded).
    pub expires_in_s: Option<i64>,
    pub expires_at: DateTime<Utc>,
    /// What the close refunded, once it is recorded.
    pub refunded: Option<i64>,
    /// Whether the packet's first stocking in Redis is recorded.
    pub stocked: bool,
    /// The packet's commitment to its split, if it has one.
    pub commitment: Option<String>,
}

type StoredRow = (
    i64,
    String,
    i64,
    i32,
    i64,
    Option<i64>,
    Option<i64>,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<i64>,
    bool,
    Option<String>,
);

/// Reads packet `packet_id` from Postgres.
pub async fn stored(db: &PgPool, packet_id: &str) -> Result<Option<Stored>, sqlx::Error> {
    let row: Option<StoredRow> = sqlx::query_as(
        "SELECT sender, asset, total, share_count, min_share, min_asked, expires_in_s, expires_at, closed_at, refunded, stocked_at IS NOT NULL, commitment FROM red_packets WHERE id = $1",
    )
    .bind(packet_id)
    .fetch_optional(db)
    .await?;
    Ok(row.map(
        |(
            sender,
            asset,
            total,
            count,
            min_share,
            min_asked,
            expires_in_s,
            expires_at,
            closed_at,
            refunded,
            stocked,
            commitment,
        )| {
            Stored {
                sender,
                asset,
                total,
                count: i64::from(count),
                min_share,
                min_asked,
                expires_in_s,
                expires_at,
                refunded: closed_at.and(refunded),
                stocked,
                commitment,
            }
        },
    ))
}

impl Stored {
    /// The fields of `req` that differ from what the packet's first create
    /// asked (empty when it asks the same).
    pub fn differences(&self, req: &RedPacketCreate) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.sender != req.sender {
            out.push("sender");
        }
        if self.asset != req.asset {
            out.push("asset");
        }
        if self.total != req.total {
            out.push("total");
        }
        if self.count != req.count {
            out.push("count");
        }
        let same_min = match self.min_asked {
            Some(min) => min == req.min,
            None => self.min_share == split::floor(req.min),
        };
        if !same_min {
            out.push("min");
        }
        if self.expires_in_s.is_some_and(|e| e != req.expires_in_s) {
            out.push("expires_in_s");
        }
        out
    }
}
