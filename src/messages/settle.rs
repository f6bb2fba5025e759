//! The settle queue's messages: `settle`, `settle.batch`, their reply, and
//! the `ref` of the entries the fleet books itself.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    check_account, check_entry_id, check_id, decode_envelope, decode_typed, shallow_envelope,
    ErrorBody, ErrorCode, Invalid, Status,
};

/// `{"type":"settle_result", ...}`: the reply to a `settle` (with its
/// `entry_id`) or to a `settle.batch` (with the number of `entries` that are
/// in the ledger and the `refused` ones). A refused `settle`, and a
/// `settle.batch` refused whole, are answered `rejected` with an `error`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SettleResult {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_id: Option<String>,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries: Option<usize>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<SettleRefusal>,
    /// Why the `settle` (or the whole `settle.batch`) was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// One entry of a `settle.batch` the ledger refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SettleRefusal {
    /// The entry's id, when it had one usable as an id (a string of at
    /// most [`MAX_ENTRY_ID_LEN`] bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_id: Option<String>,
    pub code: ErrorCode,
    /// Why; left out when the reply would not fit the wire limit otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}
/// `{"type":"settle", ...}`: one ledger movement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SettleRequest {
    #[serde(rename = "type")]
    pub kind: SettleType,
    #[schemars(length(min = 1, max = 320), regex(pattern = r"^[!-z|~]+$"))]
    pub entry_id: String,
    #[schemars(range(min = 0))]
    pub account: i64,
    pub asset: String,
    #[schemars(range(min = -9_007_199_254_740_991i64, max = 9_007_199_254_740_991i64))]
    pub amount: i64,
    pub reason: String,
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<Value>,
    /// The fleet's seal on its own entries (see [`crate::ledger::Sealer`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<String>,
}

/// The only `type` the settle queue accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum SettleType {
    #[serde(rename = "settle")]
    Settle,
}

impl SettleRequest {
    /// A credit (positive) or debit (negative) of `amount` units of `asset`.
    pub fn new(
        entry_id: impl Into<String>,
        account: i64,
        asset: impl Into<String>,
        amount: i64,
        reason: impl Into<String>,
        reference: Value,
    ) -> Self {
        Self {
            kind: SettleType::Settle,
            entry_id: entry_id.into(),
            account,
            asset: asset.into(),
            amount,
            reason: reason.into(),
            reference: Some(reference),
            seal: None,
        }
    }
}

/// The `ref` of an entry the fleet books itself: the pool (or red packet, or
/// lottery activity) it belongs to and, for a prize, the request that won it
/// and where it came from. Written as `{"pool":…,"request_id":…,"share":…,
/// "version":…}` without the fields a kind does not use; the ledger and the
/// red-packet audit read `ref->>'pool'` and `ref->>'share'`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct EntryRef {
    pub pool: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The red-packet share a grab took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<u32>,
    /// The lucky-gift pool config version a prize was drawn under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
}

impl EntryRef {
    /// A `ref` naming `pool` alone.
    pub fn pool(pool: impl Into<String>) -> Self {
        Self {
            pool: pool.into(),
            ..Self::default()
        }
    }

    /// A `ref` naming `pool` and the request `request_id` that won a prize.
    pub fn prize(pool: impl Into<String>, request_id: impl Into<String>) -> Self {
        Self {
            request_id: Some(request_id.into()),
            ..Self::pool(pool)
        }
    }
}

impl SettleRequest {
    /// An entry the fleet books itself, its `ref` an [`EntryRef`].
    pub fn fleet(
        entry_id: impl Into<String>,
        account: i64,
        asset: impl Into<String>,
        amount: i64,
        reason: impl Into<String>,
        reference: EntryRef,
    ) -> Self {
        // A struct of strings and numbers always serialises.
        let reference = serde_json::to_value(reference).unwrap_or_default();
        Self::new(entry_id, account, asset, amount, reason, reference)
    }
}
/// The most entries one `settle.batch` message may carry.
pub const MAX_SETTLE_BATCH: usize = 1000;

/// What the settle queue carries: one `settle` entry, or a `settle.batch`
/// of them (how workers publish the entries of concurrent draws).
#[derive(Debug)]
pub enum SettleMessage {
    One(SettleRequest),
    /// Each entry decoded on its own, so one bad entry spoils only itself.
    Batch(Vec<Result<SettleRequest, BadEntry>>),
}

/// An entry of a `settle.batch` that is not a valid `settle` message.
#[derive(Debug)]
pub struct BadEntry {
    pub body: Value,
    pub invalid: Invalid,
}

/// A `settle.batch` read straight into its entries, without a JSON value
/// in between ([`SettleMessage::from_body`]). Its `type` was read by the
/// shallow envelope already; here it is only allowed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TypedBatch {
    #[serde(rename = "type")]
    _kind: serde::de::IgnoredAny,
    entries: Vec<SettleRequest>,
}

impl SettleMessage {
    /// Decodes and validates a settle-queue message from its body.
    ///
    /// A `settle.batch` whose entries all hold is read straight into them,
    /// after its shallow envelope ([`shallow_envelope`]: the body less its
    /// `entries`, taken exactly when the whole envelope is). A message
    /// without `entries` is decoded from that envelope, which is then the
    /// whole one. Anything else (a bad entry, a key given twice) is read
    /// through its JSON value by [`Self::decode`], so a message's fate, its
    /// refusals and its dead letters are the same as if it had been read
    /// that way only.
    pub fn from_body(body: &[u8]) -> Result<Self, Invalid> {
        match shallow_envelope(body, "entries") {
            Some((envelope, false)) => Self::decode(&envelope),
            Some((envelope, true)) => match Self::straight_batch(body, &envelope) {
                Some(batch) => Ok(batch),
                None => Self::decode(&decode_envelope(body)?),
            },
            None => decode_envelope(body).and_then(|value| Self::decode(&value)),
        }
    }

    /// The `settle.batch` of `body` (whose shallow envelope is `envelope`)
    /// read straight, when it is one and every entry of it holds.
    fn straight_batch(body: &[u8], envelope: &Value) -> Option<Self> {
        if envelope.get("type").and_then(Value::as_str) != Some("settle.batch") {
            return None;
        }
        let batch = serde_json::from_slice::<TypedBatch>(body).ok()?;
        let fits = (1..=MAX_SETTLE_BATCH).contains(&batch.entries.len());
        if !fits || batch.entries.iter().any(|e| e.validate().is_err()) {
            return None;
        }
        Some(Self::Batch(batch.entries.into_iter().map(Ok).collect()))
    }

    /// Decodes and validates a settle-queue message.
    pub fn decode(envelope: &Value) -> Result<Self, Invalid> {
        if envelope.get("type").and_then(Value::as_str) != Some("settle.batch") {
            let entry: SettleRequest = decode_typed(envelope)?;
            entry.validate()?;
            return Ok(Self::One(entry));
        }
        if let Some(field) = envelope
            .as_object()
            .and_then(|o| o.keys().find(|k| *k != "type" && *k != "entries"))
        {
            return Err(Invalid::new(format!(
                "unknown field `{field}` in settle.batch"
            )));
        }
        let entries = envelope
            .get("entries")
            .and_then(Value::as_array)
            .ok_or_else(|| Invalid::new("`entries` must be an array of settle messages"))?;
        if entries.is_empty() || entries.len() > MAX_SETTLE_BATCH {
            return Err(Invalid::new(format!(
                "a settle.batch holds 1 to {MAX_SETTLE_BATCH} entries, got {}",
                entries.len()
            )));
        }
        Ok(Self::Batch(
            entries
                .iter()
                .map(|body| {
                    decode_typed::<SettleRequest>(body)
                        .and_then(|entry| entry.validate().map(|()| entry))
                        .map_err(|invalid| BadEntry {
                            body: body.clone(),
                            invalid,
                        })
                })
                .collect(),
        ))
    }
}

impl SettleRequest {
    /// Checks ids, the asset name and the movement: a known reason, the
    /// sign its direction asks for and a bounded amount (the ledger's rules,
    /// `ledger/reasons.rs`).
    pub fn validate(&self) -> Result<(), Invalid> {
        check_entry_id(&self.entry_id)?;
        check_id("asset", &self.asset)?;
        check_account("account", self.account)?;
        crate::ledger::reasons::check_movement(&self.reason, self.amount).map_err(Invalid::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::MAX_MESSAGE_BYTES;

    /// Every body reads the same whichever way it is read: straight into
    /// its entries when all of it holds, through its JSON value otherwise;
    /// and the straight read is taken exactly for the bodies that hold.
    #[test]
    fn a_settle_body_reads_the_same_straight_or_through_its_value() {
        let entry = |id: &str, amount: i64| {
            let e = SettleRequest::new(
                id,
                7,
                "coin",
                amount,
                "topup",
                serde_json::json!({"pool": "p"}),
            );
            serde_json::to_string(&e).unwrap()
        };
        let batch = |entries: &[String]| {
            format!(
                r#"{{"type":"settle.batch","entries":[{}]}}"#,
                entries.join(",")
            )
        };
        let many: Vec<String> = (0..=MAX_SETTLE_BATCH)
            .map(|i| entry(&format!("e{i}"), 5))
            .collect();
        let straight = [
            batch(&[entry("a", 5), entry("b", 6)]),
            // As many entries as fit the wire limit (it holds fewer than MAX_SETTLE_BATCH).
            batch(&many[..500]),
            // Keys in another order.
            format!(r#"{{"entries":[{}],"type":"settle.batch"}}"#, entry("a", 5)),
            // Inside `entries` both reads take an entry as an array and a
            // `type` as a map, as they always did.
            r#"{"type":"settle.batch","entries":[["settle","e1",7,"coin",5,"topup"]]}"#.into(),
            r#"{"type":"settle.batch","entries":[{"type":{"settle":null},"entry_id":"e1","account":7,"asset":"coin","amount":5,"reason":"topup"}]}"#.into(),
        ];
        let through_value = [
            // A `settle` is decoded from its envelope, which is the whole one.
            entry("a", 5),
            // `ref` with a key twice (the last wins either way).
            r#"{"amount":5,"asset":"coin","reason":"topup","account":7,"entry_id":"x","type":"settle","ref":{"a":1,"a":2}}"#.into(),
            batch(&[entry("a", 5), entry("b", -6)]),
            batch(&[entry("a", 5), r#"{"type":"settle","entry_id":"b"}"#.into()]),
            batch(&[entry("a", 5), entry("{bad:id}", 5)]),
            batch(&[]),
            // Over the wire limit and over MAX_SETTLE_BATCH.
            batch(&many),
            r#"{"type":"settle.batch","entries":[],"extra":1}"#.into(),
            r#"{"type":"settle.batch","type":"settle.batch","entries":[]}"#.into(),
            r#"{"type":"settle","entry_id":"a","entry_id":"b","account":7,"asset":"coin","amount":5,"reason":"topup"}"#.into(),
            r#"{"type":"settle","entry_id":"a","account":7,"asset":"coin","amount":5.0,"reason":"topup"}"#.into(),
            r#"{"type":"settle.batches","entries":[]}"#.into(),
            r#"[1,2]"#.into(),
            // serde reads a struct from an array and an enum from a map; the
            // envelope every consumer checks takes neither.
            r#"["settle","u-1",7,"coin",5,"topup"]"#.into(),
            r#"{"type":"settle.batch","entries":[["settle","e1",7,"coin",5,"topup",null,null,9]]}"#.into(),
            r#"{"$serde_json::private::RawValue":"{}","type":"settle","entry_id":"u-1","account":7,"asset":"coin","amount":5,"reason":"topup"}"#.into(),
            format!(r#"["settle.batch",[{}]]"#, entry("a", 5)),
            r#"{"type":{"settle":null},"entry_id":"u-1","account":7,"asset":"coin","amount":5,"reason":"topup"}"#.into(),
            format!(r#"{{"type":{{"settle.batch":null}},"entries":[{}]}}"#, entry("a", 5)),
            r#"{"type":"settle","entry_id":"u-1","account":7,"asset":"coin","amount":5,"reason":"topup","ref":{"x":"\ud800"}}"#.into(),
            r#"{"type":"settle","entry_id":"u-1","account":7,"asset":"coin","amount":5,"reason":"topup","ref":[1e400]}"#.into(),
            "not json".into(),
            format!(r#"{{"type":"settle","entry_id":"{}"}}"#, "x".repeat(MAX_MESSAGE_BYTES)),
        ];
        for (body, fast) in straight
            .iter()
            .map(|b| (b, true))
            .chain(through_value.iter().map(|b| (b, false)))
        {
            let body = body.as_bytes();
            let straight = shallow_envelope(body, "entries")
                .is_some_and(|(env, _)| SettleMessage::straight_batch(body, &env).is_some());
            assert_eq!(
                straight,
                fast,
                "{}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            );
            // Read straight only what the envelope every consumer checks takes.
            if fast {
                assert!(decode_envelope(body).is_ok());
            }
            let slow = decode_envelope(body).and_then(|v| SettleMessage::decode(&v));
            assert_eq!(
                format!("{:?}", SettleMessage::from_body(body)),
                format!("{slow:?}"),
                "{}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            );
        }
    }

    #[test]
    fn entry_refs_are_written_as_the_ledger_reads_them() {
        let text = |r: EntryRef| {
            let entry = SettleRequest::fleet("e", 1, "coin", 5, "lottery", r);
            serde_json::to_string(&entry.reference).unwrap()
        };
        assert_eq!(text(EntryRef::pool("rp-1")), r#"{"pool":"rp-1"}"#);
        assert_eq!(
            text(EntryRef::prize("act", "r1")),
            r#"{"pool":"act","request_id":"r1"}"#
        );
        assert_eq!(
            text(EntryRef {
                share: Some(3),
                ..EntryRef::prize("rp-1", "r1")
            }),
            r#"{"pool":"rp-1","request_id":"r1","share":3}"#
        );
        assert_eq!(
            text(EntryRef {
                version: Some(2),
                ..EntryRef::prize("gift-1", "r1")
            }),
            r#"{"pool":"gift-1","request_id":"r1","version":2}"#
        );
    }
}
