//! What an activity has counted: the chances each user has left, and each
//! day's visits, visitors and awards per prize. The draw scripts keep them
//! in the activity's `meta` hash (`lua/lib/lottery.lua`); an activity
//! loaded before keeps some in hashes of their own until they move.

use redis::aio::ConnectionLike;

use super::KIND;
use crate::scripts::PoolKeys;

/// The chances `user` has left in the activity of `keys`, `None` when the
/// user was never granted any: meta's `u:<user>`, or the chances hash of an
/// activity loaded before the counters moved into meta.
pub async fn chances_left<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    user: i64,
) -> Result<Option<i64>, redis::RedisError> {
    let (now, before): (Option<i64>, Option<i64>) = redis::pipe()
        .cmd("HGET")
        .arg(keys.meta())
        .arg(format!("u:{user}"))
        .cmd("HGET")
        .arg(keys.chances())
        .arg(user)
        .query_async(conn)
        .await?;
    Ok(now.or(before))
}

/// An activity's counters for one day.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub activity: String,
    pub day: String,
    pub pv: u64,
    pub uv: u64,
    /// (prize, awarded, stock left; `None` for the consolation prize)
    pub prizes: Vec<(String, u64, Option<u64>)>,
}

/// Meta's kind, prizes, consolation, counters, `c` and today's `pv`.
type Meta = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// Awards and stock left per prize id.
type Counts = std::collections::HashMap<String, u64>;

/// PV, UV and per-prize counts of `activity` on `day` (`YYYYMMDD`).
pub async fn stats<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    activity: &str,
    day: &str,
) -> Result<Option<Stats>, redis::RedisError> {
    let ((kind, prizes, consolation, counters, c, today), past_pv, uv): (Meta, Option<u64>, u64) =
        redis::pipe()
            .cmd("HMGET")
            .arg(keys.meta())
            .arg(&["kind", "prizes", "consolation", "counters", "c", "pv"])
            .cmd("GET")
            .arg(keys.pv(day))
            .cmd("PFCOUNT")
            .arg(keys.uv(day))
            .query_async(conn)
            .await?;
    if kind.as_deref() != Some(KIND) {
        return Ok(None);
    }
    let (awarded, stock) = if counters.as_deref() == Some("meta") {
        counts_of(c.as_deref().unwrap_or_default())
    } else {
        redis::pipe()
            .cmd("HGETALL")
            .arg(keys.awarded())
            .cmd("HGETALL")
            .arg(keys.stock())
            .query_async(conn)
            .await?
    };
    let id_of = |entry: &str| entry.split(':').next().unwrap_or_default().to_owned();
    let mut rows: Vec<(String, u64, Option<u64>)> = prizes
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|entry| {
            let id = id_of(entry);
            let left = stock.get(&id).copied().unwrap_or(0);
            (
                id.clone(),
                awarded.get(&id).copied().unwrap_or(0),
                Some(left),
            )
        })
        .collect();
    if let Some(c) = consolation.filter(|c| !c.is_empty()) {
        let id = id_of(&c);
        rows.push((id.clone(), awarded.get(&id).copied().unwrap_or(0), None));
    }
    // Today's visits are meta's `pv` ("<day>:<n>") until the next day's
    // first visit moves them to the day's own key.
    let pv = match today.as_deref().and_then(|t| t.split_once(':')) {
        Some((d, n)) if d == day => n.parse().unwrap_or(0),
        _ => past_pv.unwrap_or(0),
    };
    Ok(Some(Stats {
        activity: activity.to_owned(),
        day: day.to_owned(),
        pv,
        uv,
        prizes: rows,
    }))
}

/// Awards and stock left per prize from meta's `c`
/// ("<prize>:<stock left>:<awards>,...", `lua/lib/lottery.lua`).
fn counts_of(c: &str) -> (Counts, Counts) {
    let mut awarded = Counts::new();
    let mut stock = Counts::new();
    for entry in c.split(',') {
        let mut parts = entry.split(':');
        if let (Some(id), Some(left), Some(a)) = (parts.next(), parts.next(), parts.next()) {
            stock.insert(id.to_owned(), left.parse().unwrap_or(0));
            awarded.insert(id.to_owned(), a.parse().unwrap_or(0));
        }
    }
    (awarded, stock)
}
