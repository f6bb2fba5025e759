//! Dead-letter queues: list what is there and why, export it, and move
//! chosen messages back or drop them, without ever changing the order or
//! content of what stays (see [`pass`] for how, on a broker with no peek).
//!
//! Every operation is one pass over the queue: it reads each message the
//! DLQ held when it began, in order, acts on the ones its [`Filter`]
//! selects (at most `limit` of them), and leaves the rest in place. Two
//! listings in a row show the same messages in the same order, and a replay
//! with the same filter then moves exactly those, in that order.

mod json;
mod pass;

use std::time::Duration;

use lapin::{message::Delivery, types::AMQPValue, types::FieldTable, Connection};
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::{
    grouped::Group, publish::header_text, Route, DEAD_AT_HEADER, ERROR_CODE_HEADER, ERROR_HEADER,
};
use pass::Choice;

pub use json::Exported;

/// One dead letter, as `prizepool dlq list` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// Where it stood in the DLQ when the pass began (0 is the head).
    pub position: usize,
    /// A fingerprint of the message (body, properties and headers but the
    /// broker's delivery count): the same message shows the same id in
    /// every listing, so an operator can pick it with `--id`.
    pub id: String,
    /// The message's `type` field, when it has one.
    pub message_type: Option<String>,
    /// Why it is here: our reason header, or the broker's `x-death` reason.
    pub reason: String,
    /// The error code header we set, if we dead-lettered it.
    pub code: Option<String>,
    /// The pools, packets or activities the message names (a `draw.batch`
    /// names several).
    pub pools: Vec<String>,
    /// When it was dead-lettered (Unix seconds), when known: our header, or
    /// the broker's `x-death` time.
    pub dead_at: Option<u64>,
    /// The body, cut to 200 characters.
    pub body: String,
}

/// Which dead letters an operation concerns. Every field that is set must
/// match; an empty filter selects every message.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// A part of the error code or reason (`invalid_request`, `delivery_limit`,
    /// `seal`, …), case-insensitive.
    pub reason: Option<String>,
    /// The message's `type`, exactly.
    pub message_type: Option<String>,
    /// A pool, packet or activity id the message names, exactly.
    pub pool: Option<String>,
    /// Dead-lettered at least this long ago.
    pub older_than: Option<Duration>,
    /// Dead-lettered less than this long ago.
    pub newer_than: Option<Duration>,
    /// Only these message ids ([`DeadLetter::id`]), when not empty.
    pub ids: Vec<String>,
}

impl Filter {
    /// Whether the filter selects every message.
    pub fn is_empty(&self) -> bool {
        self.reason.is_none()
            && self.message_type.is_none()
            && self.pool.is_none()
            && self.older_than.is_none()
            && self.newer_than.is_none()
            && self.ids.is_empty()
    }

    /// Whether `letter` is selected, at Unix second `now`. A message whose
    /// dead-lettering time is unknown matches no age condition.
    pub fn matches(&self, letter: &DeadLetter, now: u64) -> bool {
        let reason_ok = self.reason.as_deref().is_none_or(|wanted| {
            let wanted = wanted.to_lowercase();
            letter.reason.to_lowercase().contains(&wanted)
                || letter
                    .code
                    .as_deref()
                    .is_some_and(|c| c.to_lowercase().contains(&wanted))
        });
        let type_ok = self
            .message_type
            .as_deref()
            .is_none_or(|t| letter.message_type.as_deref() == Some(t));
        let pool_ok = self
            .pool
            .as_deref()
            .is_none_or(|p| letter.pools.iter().any(|q| q == p));
        let age = letter.dead_at.map(|at| now.saturating_sub(at));
        let older_ok = self
            .older_than
            .is_none_or(|d| age.is_some_and(|a| a >= d.as_secs()));
        let newer_ok = self
            .newer_than
            .is_none_or(|d| age.is_some_and(|a| a < d.as_secs()));
        let id_ok = self.ids.is_empty() || self.ids.contains(&letter.id);
        reason_ok && type_ok && pool_ok && older_ok && newer_ok && id_ok
    }
}

/// What an operation found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Messages the dead-letter queue held when the operation began.
    pub found: usize,
    /// Messages the filter selected (all of them, also past the limit).
    pub matched: usize,
    /// Messages moved back to the work queue.
    pub moved: usize,
    /// Messages removed without being moved.
    pub dropped: usize,
    /// Moved messages that were too big for their queue's consumer (grouped
    /// ledger entries or fairness records), each replayed as several
    /// messages that fit.
    pub split: usize,
    /// The messages those were replayed as.
    pub parts: usize,
    /// The messages acted on (or listed), at most the limit, in queue order.
    pub messages: Vec<DeadLetter>,
}

/// What an operation does with the messages it selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Only list them.
    List,
    /// Republish them to their work queue and remove them from the DLQ.
    Replay,
    /// Remove them from the DLQ.
    Drop,
}

/// Lists, replays or drops the dead letters of `route` that `filter`
/// selects, at most `limit` of them, in queue order. The messages it does
/// not take keep their order and content.
pub async fn run(
    conn: &Connection,
    route: Route,
    action: Action,
    filter: &Filter,
    limit: usize,
) -> anyhow::Result<Report> {
    let now = unix_now();
    let mut report = Report::default();
    let passed = pass::pass(conn, route, |position, delivery| {
        let letter = describe(position, delivery);
        if !filter.matches(&letter, now) {
            return Choice::Keep;
        }
        report.matched += 1;
        if report.messages.len() >= limit {
            return Choice::Keep;
        }
        report.messages.push(letter);
        match action {
            Action::List => Choice::Keep,
            Action::Replay => Choice::Move,
            Action::Drop => Choice::Drop,
        }
    })
    .await?;
    report.found = passed.found;
    report.moved = passed.moved;
    report.dropped = passed.dropped;
    report.split = passed.split;
    report.parts = passed.parts;
    Ok(report)
}

/// Every selected dead letter whole (body, properties, headers), at most
/// `limit`, in queue order, for `prizepool dlq export`. Moves nothing.
pub async fn export(
    conn: &Connection,
    route: Route,
    filter: &Filter,
    limit: usize,
) -> anyhow::Result<Vec<Exported>> {
    let now = unix_now();
    let mut out = Vec::new();
    pass::pass(conn, route, |position, delivery| {
        let letter = describe(position, delivery);
        if out.len() < limit && filter.matches(&letter, now) {
            out.push(json::export(route, letter, delivery));
        }
        Choice::Keep
    })
    .await?;
    Ok(out)
}

/// Lists up to `limit` dead letters of `route`, leaving the queue as it was.
pub async fn list(
    conn: &Connection,
    route: Route,
    limit: usize,
) -> anyhow::Result<Vec<DeadLetter>> {
    Ok(run(conn, route, Action::List, &Filter::default(), limit)
        .await?
        .messages)
}

/// Moves up to `limit` dead letters of `route` back to its work queue,
/// keeping their properties and headers; a dry run only lists them.
///
/// A replay moves at most the messages the DLQ held when it began, then
/// ends: a replayed message that fails again is dead-lettered behind them,
/// and taking it once more would loop for as long as it keeps failing.
pub async fn replay(
    conn: &Connection,
    route: Route,
    limit: usize,
    dry_run: bool,
) -> anyhow::Result<Report> {
    let action = if dry_run {
        Action::List
    } else {
        Action::Replay
    };
    run(conn, route, action, &Filter::default(), limit).await
}

/// The grouped messages the fleet publishes, which a replay splits when
/// they are too big for their consumer: the same frames as
/// [`crate::ledger::ENTRIES`] and [`crate::audit::DRAW_COMPLETED`].
const SPLITTABLE: [Group; 2] = [
    Group::work("settle", "settle.batch", "entries"),
    Group::event("draw.completed", "draw.completed.batch", "events"),
];

/// The bodies a dead letter too big for its queue's consumer is replayed
/// as: a grouped message of the fleet's (`settle.batch`,
/// `draw.completed.batch`) larger than
/// [`MAX_MESSAGE_BYTES`](crate::messages::MAX_MESSAGE_BYTES), cut between
/// its bodies into messages that fit, each body byte for byte as it was (a
/// seal stays valid). `None` for every other letter, replayed whole: one
/// that fits, one that is no such group, and one that asks for a reply (an
/// upstream's top-up batch, whose requester must get one answer).
pub(super) fn split(delivery: &Delivery) -> Option<Vec<Vec<u8>>> {
    if delivery.data.len() <= crate::messages::MAX_MESSAGE_BYTES
        || delivery
            .properties
            .reply_to()
            .as_ref()
            .is_some_and(|to| !to.as_str().is_empty())
    {
        return None;
    }
    let fields: std::collections::BTreeMap<&str, &serde_json::value::RawValue> =
        serde_json::from_slice(&delivery.data).ok()?;
    let kind: &str = serde_json::from_str(fields.get("type")?.get()).ok()?;
    let group = SPLITTABLE.iter().find(|g| g.batch_type == kind)?;
    if fields.len() != 2 {
        return None;
    }
    let bodies: Vec<&serde_json::value::RawValue> =
        serde_json::from_str(fields.get(group.field)?.get()).ok()?;
    let bodies = bodies
        .into_iter()
        .map(|b| b.get().as_bytes().to_vec())
        .collect();
    super::grouped::pack(group, bodies)
}

/// Describes the dead letter at `position`.
fn describe(position: usize, delivery: &Delivery) -> DeadLetter {
    let data = &delivery.data;
    let headers = delivery.properties.headers().as_ref();
    let value = serde_json::from_slice::<serde_json::Value>(data).ok();
    let message_type = value
        .as_ref()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned));
    let reason = header_text(headers, ERROR_HEADER)
        .or_else(|| death_field(headers, "reason").map(|r| format!("broker: {}", text(&r))))
        .unwrap_or_else(|| "unknown".into());
    let dead_at = header_time(headers, DEAD_AT_HEADER).or_else(|| {
        death_field(headers, "time").and_then(|t| match t {
            AMQPValue::Timestamp(t) => Some(t),
            _ => None,
        })
    });
    DeadLetter {
        position,
        id: fingerprint(delivery),
        message_type,
        reason,
        code: header_text(headers, ERROR_CODE_HEADER),
        pools: value.as_ref().map(pools_named).unwrap_or_default(),
        dead_at,
        body: String::from_utf8_lossy(data).chars().take(200).collect(),
    }
}

/// The pools, packets and activities a message names: its own `pool`,
/// `packet_id` or `activity`, a settlement's `ref.pool`, and those of a
/// batch's entries.
fn pools_named(value: &serde_json::Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut add = |v: &serde_json::Value| {
        for field in ["pool", "packet_id", "activity"] {
            if let Some(p) = v.get(field).and_then(|p| p.as_str()) {
                out.push(p.to_owned());
            }
        }
        if let Some(p) = v.pointer("/ref/pool").and_then(|p| p.as_str()) {
            out.push(p.to_owned());
        }
    };
    add(value);
    for list in ["requests", "entries"] {
        for entry in value
            .get(list)
            .and_then(|l| l.as_array())
            .into_iter()
            .flatten()
        {
            add(entry);
        }
    }
    out.sort();
    out.dedup();
    out
}

/// A field of the newest `x-death` entry (`reason`, `time`, `queue`, …).
fn death_field(headers: Option<&FieldTable>, field: &str) -> Option<AMQPValue> {
    let AMQPValue::FieldArray(deaths) = headers?.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    first.inner().get(field).cloned()
}

fn text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        other => format!("{other:?}"),
    }
}

/// A header holding Unix seconds, as a timestamp or an integer.
fn header_time(headers: Option<&FieldTable>, name: &str) -> Option<u64> {
    match headers?.inner().get(name)? {
        AMQPValue::Timestamp(t) => Some(*t),
        AMQPValue::LongLongInt(t) => u64::try_from(*t).ok(),
        _ => None,
    }
}

/// 16 hex digits of SHA-256 over the body and the properties (headers
/// included, the broker's delivery count left out).
fn fingerprint(delivery: &Delivery) -> String {
    let properties = json::properties(&delivery.properties);
    let mut hash = Sha256::new();
    hash.update((delivery.data.len() as u64).to_be_bytes());
    hash.update(&delivery.data);
    hash.update(properties.to_string().as_bytes());
    hash.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter() -> DeadLetter {
        DeadLetter {
            position: 0,
            id: "00ff".into(),
            message_type: Some("draw".into()),
            reason: "broker: delivery_limit".into(),
            code: None,
            pools: vec!["gift-1".into()],
            dead_at: Some(1_000),
            body: String::new(),
        }
    }

    #[test]
    fn a_filter_selects_by_every_field_it_sets() {
        let l = letter();
        assert!(Filter::default().matches(&l, 2_000));
        let by = |f: Filter| f.matches(&l, 2_000);
        assert!(by(Filter {
            reason: Some("DELIVERY".into()),
            ..Filter::default()
        }));
        assert!(!by(Filter {
            reason: Some("invalid_request".into()),
            ..Filter::default()
        }));
        assert!(!by(Filter {
            message_type: Some("settle".into()),
            ..Filter::default()
        }));
        assert!(by(Filter {
            pool: Some("gift-1".into()),
            older_than: Some(Duration::from_secs(1_000)),
            ..Filter::default()
        }));
        assert!(!by(Filter {
            older_than: Some(Duration::from_secs(1_001)),
            ..Filter::default()
        }));
        assert!(by(Filter {
            newer_than: Some(Duration::from_secs(1_001)),
            ..Filter::default()
        }));
        assert!(!by(Filter {
            ids: vec!["beef".into()],
            ..Filter::default()
        }));
        let unknown_age = DeadLetter {
            dead_at: None,
            ..letter()
        };
        assert!(!Filter {
            newer_than: Some(Duration::from_secs(10)),
            ..Filter::default()
        }
        .matches(&unknown_age, 2_000));
    }

    #[test]
    fn the_splittable_groups_are_the_fleets_own() {
        for (ours, theirs) in SPLITTABLE
            .iter()
            .zip([crate::ledger::ENTRIES, crate::audit::DRAW_COMPLETED])
        {
            assert_eq!(
                (ours.routing_key, ours.batch_type, ours.field),
                (theirs.routing_key, theirs.batch_type, theirs.field)
            );
        }
    }

    #[test]
    fn a_batch_names_the_pools_of_its_entries() {
        let v = serde_json::json!({"type":"draw.batch","requests":[
            {"pool":"b"},{"pool":"a"},{"pool":"b"}]});
        assert_eq!(pools_named(&v), ["a", "b"]);
        let s = serde_json::json!({"type":"settle","ref":{"pool":"rp-1"}});
        assert_eq!(pools_named(&s), ["rp-1"]);
    }
}
