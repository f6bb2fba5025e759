//! `draw.batch` and its `draw_result.batch` reply, held to the message
//! size limit.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    rejected_reply, DrawRequest, ErrorBody, ErrorCode, Invalid, Status, ID_FIELDS,
    MAX_MESSAGE_BYTES,
};

/// `{"type":"draw.batch","requests":[...]}`: up to `MAX_BATCH` draws in one
/// message, for any mix of pools and kinds. Each entry is a [`DrawRequest`]
/// (its `"type":"draw"` may be left out) and keeps every rule of a single
/// draw: its own id, idempotency and validation. The entries stay JSON
/// values here so that a bad entry is answered on its own, never failing
/// the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DrawBatch {
    pub requests: Vec<Value>,
}

impl DrawBatch {
    /// Checks the envelope: 1 to `max` entries. (Its size is bounded by the
    /// 64 KiB every message is held to.)
    pub fn validate(&self, max: usize) -> Result<(), Invalid> {
        if self.requests.is_empty() {
            return Err(Invalid::new("a draw.batch with no requests"));
        }
        if self.requests.len() > max {
            return Err(Invalid::new(format!(
                "a draw.batch of {} requests; at most {max} are allowed",
                self.requests.len()
            )));
        }
        Ok(())
    }

    /// Refuses a batch whose reply could pass [`MAX_MESSAGE_BYTES`] even with
    /// every entry shortened to its id, status and error code
    /// ([`bounded_batch_reply`]): many entries with long ids.
    pub fn check_reply_room(&self) -> Result<(), Invalid> {
        let mut bytes = 0;
        for i in 0..self.requests.len() {
            let longest = rejected_reply(
                Some(&self.entry_message(i)),
                ErrorCode::InsufficientFunds,
                "",
            );
            bytes += shorten(
                &serde_json::to_vec(&longest).unwrap_or_default(),
                Shorten::Stub,
            )
            .len();
        }
        let reply = batch_reply_len(self.requests.len(), bytes);
        if reply > MAX_MESSAGE_BYTES {
            return Err(Invalid::new(format!(
                "a draw.batch whose {} answers could take {reply} bytes even shortened, above the {MAX_MESSAGE_BYTES} byte message limit; send fewer requests",
                self.requests.len()
            )));
        }
        Ok(())
    }

    /// Entry `i` as a single draw request, or why it is not one.
    pub fn entry(&self, i: usize) -> Result<DrawRequest, Invalid> {
        let Some(Value::Object(fields)) = self.requests.get(i) else {
            return Err(Invalid::new("a draw.batch entry that is not an object"));
        };
        let mut fields = fields.clone();
        match fields.remove("type") {
            None => {}
            Some(Value::String(t)) if t == "draw" => {}
            Some(other) => {
                return Err(Invalid::new(format!(
                    "a draw.batch entry of type {other}; entries are draws"
                )))
            }
        }
        DrawRequest::deserialize(Value::Object(fields)).map_err(|e| Invalid::new(e.to_string()))
    }

    /// Entry `i` as a single `draw` message, as it is answered or
    /// dead-lettered on its own.
    pub fn entry_message(&self, i: usize) -> Value {
        match self.requests.get(i) {
            Some(Value::Object(fields)) => {
                let mut message = serde_json::Map::with_capacity(fields.len() + 1);
                message.insert("type".into(), Value::String("draw".into()));
                for (k, v) in fields {
                    if k != "type" {
                        message.insert(k.clone(), v.clone());
                    }
                }
                Value::Object(message)
            }
            Some(other) => other.clone(),
            None => Value::Null,
        }
    }
}

/// `{"type":"draw_result.batch","status":"ok","results":[...]}`: the reply
/// to a `draw.batch`, one `draw_result` per request in request order (each
/// with its own `status`). A batch whose envelope is bad is answered
/// `rejected` with its `error` and no results.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct DrawResultBatch {
    /// `ok` when the batch was taken (its entries say how each went),
    /// `rejected` when it was refused whole. (Read as `ok` when absent, as
    /// in replies of versions that wrote it only for a refusal.)
    #[serde(default)]
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    pub results: Vec<Value>,
}

/// How every taken batch's reply begins; its results follow.
const BATCH_REPLY_HEAD: &[u8] = br#"{"type":"draw_result.batch","status":"ok","results":["#;

/// The `draw_result.batch` reply made of `results`, each one entry's
/// serialised `draw_result`.
pub fn batch_reply(results: &[Vec<u8>]) -> Vec<u8> {
    let len = results.iter().map(|r| r.len() + 1).sum::<usize>();
    let mut out = Vec::with_capacity(len + 48);
    out.extend_from_slice(BATCH_REPLY_HEAD);
    for (i, r) in results.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(r);
    }
    out.extend_from_slice(b"]}");
    out
}

/// Fields an entry of a `draw_result.batch` loses first when the reply
/// would pass [`MAX_MESSAGE_BYTES`]: the prizes and the records that grow
/// with them. The totals stay, so the entry still says what it pays.
const DETAIL_FIELDS: [&str; 8] = [
    "prizes",
    "prize_codes",
    "positions",
    "held_back",
    "held_back_min_multiplier",
    "revealed",
    "pick",
    "previous",
];

/// How far an entry of a batch reply is shortened.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shorten {
    /// Without [`DETAIL_FIELDS`] and refusal messages.
    Detail,
    /// Only `type`, the id, `status` and the error code.
    Stub,
}

/// `result` (one serialised `draw_result`) shortened as `how` says and
/// marked `"omitted":true`; a result that does not read is kept as it is.
fn shorten(result: &[u8], how: Shorten) -> Vec<u8> {
    let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(result) else {
        return result.to_vec();
    };
    match how {
        Shorten::Detail => fields.retain(|k, _| !DETAIL_FIELDS.contains(&k.as_str())),
        Shorten::Stub => fields.retain(|k, _| {
            matches!(k.as_str(), "type" | "status" | "error") || ID_FIELDS.contains(&k.as_str())
        }),
    }
    if let Some(Value::Object(error)) = fields.get_mut("error") {
        error.retain(|k, _| k == "code");
        error.insert("message".into(), Value::String(String::new()));
    }
    fields.insert("omitted".into(), Value::Bool(true));
    serde_json::to_vec(&Value::Object(fields)).unwrap_or_else(|_| result.to_vec())
}

/// Bytes [`batch_reply`] makes of results of `bytes` bytes in all.
fn batch_reply_len(results: usize, bytes: usize) -> usize {
    BATCH_REPLY_HEAD.len() + "]}".len() + bytes + results.saturating_sub(1)
}

/// The `draw_result.batch` reply made of `results` (each one entry's
/// serialised `draw_result`), held to [`MAX_MESSAGE_BYTES`]: while it would
/// be larger, the largest entries are shortened, first to their totals
/// (the prizes and fairness record left out), then, if that is not enough,
/// to their id, status and error code, each marked `"omitted":true` (sent
/// again alone, such an entry replays its whole answer). A batch whose
/// entries all fit shortened is guaranteed by [`DrawBatch::check_reply_room`].
pub fn bounded_batch_reply(mut results: Vec<Vec<u8>>) -> Vec<u8> {
    let mut bytes: usize = results.iter().map(Vec::len).sum();
    if batch_reply_len(results.len(), bytes) <= MAX_MESSAGE_BYTES {
        return batch_reply(&results);
    }
    let mut largest: Vec<usize> = (0..results.len()).collect();
    largest.sort_by_key(|&i| std::cmp::Reverse(results[i].len()));
    for how in [Shorten::Detail, Shorten::Stub] {
        for &i in &largest {
            if batch_reply_len(results.len(), bytes) <= MAX_MESSAGE_BYTES {
                return batch_reply(&results);
            }
            let short = shorten(&results[i], how);
            if short.len() < results[i].len() {
                bytes = bytes - results[i].len() + short.len();
                results[i] = short;
            }
        }
    }
    batch_reply(&results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{typed_json, DrawResult, Prize, Status};

    /// A batch reply never passes 64 KiB. Twenty draws
    /// of a thousand prizes each would take about 600 KB listed; the reply
    /// keeps every entry in order, with its id, status and totals, and
    /// leaves out the prizes of as few entries as it must.
    #[test]
    fn batch_replies_are_held_to_64_kib() {
        let big = |i: usize| {
            let result = DrawResult {
                request_id: format!("req-{i}"),
                status: Status::Ok,
                pool: Some("gift".into()),
                user_id: Some(7),
                prizes: (0..1000)
                    .map(|k| Prize::Multiplier {
                        multiplier: k % 7,
                        combo: format!("{:0>64}", k % 3),
                    })
                    .collect(),
                total_multiplier: Some(2997),
                reward: Some(299_700),
                asset: Some("coin".into()),
                serial: Some(i as i64 + 1),
                version: Some(1),
                ..DrawResult::default()
            };
            typed_json("draw_result", &result)
        };
        let small = typed_json(
            "draw_result",
            &DrawResult {
                request_id: "req-small".into(),
                status: Status::Ok,
                reward: Some(5),
                prizes: vec![Prize::Multiplier {
                    multiplier: 5,
                    combo: "c".into(),
                }],
                ..DrawResult::default()
            },
        );
        let mut results: Vec<Vec<u8>> = (0..20).map(big).collect();
        results.insert(3, small.clone());
        assert!(results.iter().map(Vec::len).sum::<usize>() > 10 * MAX_MESSAGE_BYTES);
        let reply = bounded_batch_reply(results);
        assert!(reply.len() <= MAX_MESSAGE_BYTES, "{}", reply.len());
        let batch: DrawResultBatch = serde_json::from_slice(&reply).unwrap();
        assert_eq!(batch.results.len(), 21);
        let read: Vec<DrawResult> = batch
            .results
            .iter()
            .map(|v| serde_json::from_value(v.clone()).unwrap())
            .collect();
        assert_eq!(
            read[3],
            serde_json::from_slice::<DrawResult>(&small).unwrap()
        );
        let mut whole = 0;
        for (k, r) in read.iter().enumerate().filter(|(k, _)| *k != 3) {
            let i = if k < 3 { k } else { k - 1 };
            assert_eq!(r.request_id, format!("req-{i}"));
            assert_eq!(r.status, Status::Ok);
            if r.omitted {
                assert!(r.prizes.is_empty() && r.prize_codes.is_none());
                assert_eq!(
                    r.reward,
                    Some(299_700),
                    "a shortened entry keeps its totals"
                );
            } else {
                assert_eq!(r.prizes.len(), 1000);
                whole += 1;
            }
        }
        // As many whole entries as fit: one of ~90 KB fits none, so the
        // small one alone stays whole; then the reply is the shortened rest.
        assert_eq!(whole, 0);
        // A batch that fits is the plain concatenation.
        let fits = vec![small.clone(), small.clone()];
        assert_eq!(bounded_batch_reply(fits.clone()), batch_reply(&fits));
    }

    /// A batch reply that would not fit even with every entry cut to its
    /// id, status and code is refused at the envelope, before any draw.
    #[test]
    fn batches_whose_answers_cannot_fit_are_refused_whole() {
        let entry = |i: usize| serde_json::json!({"request_id": format!("{i:0>120}"), "pool": "p", "user_id": 1, "count": 1});
        let ok = DrawBatch {
            requests: (0..100).map(entry).collect(),
        };
        ok.check_reply_room().unwrap();
        let too_many = DrawBatch {
            requests: (0..400).map(entry).collect(),
        };
        let e = too_many.check_reply_room().unwrap_err();
        assert!(e.message.contains("message limit"), "{}", e.message);
    }
}
