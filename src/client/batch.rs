//! The `draw.batch` wire format as the client writes and reads it
//! (`docs/protocol.md`, "draw.batch"): the envelope is built by joining the
//! entries' bodies, each serialised once by its caller, and the reply is
//! split back into one [`DrawResult`] per entry, in request order.
//!
//! The body is what [`DrawBatch`](crate::messages::DrawBatch) serialises
//! to, written without building the entries again; the reply is read as a
//! [`DrawResultBatch`].

use crate::messages::{DrawResult, DrawResultBatch, Status, MAX_MESSAGE_BYTES};

/// The request type of a batch.
pub const BATCH_TYPE: &str = "draw.batch";
/// The reply type of a batch.
pub const BATCH_REPLY_TYPE: &str = "draw_result.batch";
/// Entries a worker takes in one batch unless its `MAX_BATCH` says
/// otherwise.
pub const DEFAULT_MAX_BATCH: usize = 100;

/// What goes before the first entry of a batch's body.
const PREFIX: &[u8] = br#"{"type":"draw.batch","requests":["#;
/// What goes after the last entry.
const SUFFIX: &[u8] = b"]}";

/// The bytes a batch of entries of `entry_bytes` bytes in total takes once
/// framed: prefix, entries, the commas between them and the suffix.
pub(crate) fn framed_len(entries: usize, entry_bytes: usize) -> usize {
    PREFIX.len() + entry_bytes + entries.saturating_sub(1) + SUFFIX.len()
}

/// Whether one more entry of `next` bytes keeps a batch of `entries`
/// entries of `entry_bytes` bytes within `max_entries` and the 64 KiB a
/// message may take.
pub(crate) fn fits(entries: usize, entry_bytes: usize, next: usize, max_entries: usize) -> bool {
    entries < max_entries && framed_len(entries + 1, entry_bytes + next) <= MAX_MESSAGE_BYTES
}

/// The body of a message carrying `entries` (each the JSON of one `draw`
/// message): the entry itself when it is alone, a `draw.batch` otherwise.
pub(crate) fn encode<'a>(entries: impl ExactSizeIterator<Item = &'a [u8]>) -> Vec<u8> {
    let n = entries.len();
    let mut entries = entries.peekable();
    if n == 1 {
        return entries.next().map(<[u8]>::to_vec).unwrap_or_default();
    }
    let mut body = Vec::with_capacity(PREFIX.len() + SUFFIX.len() + n * 128);
    body.extend_from_slice(PREFIX);
    for (i, entry) in entries.enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(entry);
    }
    body.extend_from_slice(SUFFIX);
    body
}

/// Why a reply could not be handed to its callers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    /// The worker refused the envelope as a whole (`invalid_request`): no
    /// entry was drawn. Sending it again cannot help.
    #[error("the worker refused the batch: {0}")]
    Rejected(String),
    /// The reply does not answer what was sent.
    #[error("unexpected reply: {0}")]
    Protocol(String),
}

/// Splits the reply to a message that carried `request_ids` (in order) into
/// one result per entry. A message of one entry was a plain `draw` and is
/// answered by a plain `draw_result`.
pub(crate) fn decode_reply(
    body: &[u8],
    request_ids: &[&str],
) -> Result<Vec<DrawResult>, ReplyError> {
    let results = if request_ids.len() == 1 {
        vec![serde_json::from_slice::<DrawResult>(body)
            .map_err(|e| ReplyError::Protocol(format!("not a draw_result: {e}")))?]
    } else {
        let batch: DrawResultBatch = serde_json::from_slice(body)
            .map_err(|e| ReplyError::Protocol(format!("not a draw_result.batch: {e}")))?;
        if batch.status == Status::Rejected {
            let message = batch
                .error
                .map_or_else(|| "no reason given".to_owned(), |e| e.message);
            return Err(ReplyError::Rejected(message));
        }
        batch
            .results
            .into_iter()
            .map(serde_json::from_value::<DrawResult>)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ReplyError::Protocol(format!("not a draw_result: {e}")))?
    };
    if results.len() != request_ids.len() {
        return Err(ReplyError::Protocol(format!(
            "{} results for {} requests",
            results.len(),
            request_ids.len()
        )));
    }
    // Results come in request order; one out of place means the reply is
    // not for this message, and handing it out would give a caller another
    // caller's prizes.
    if let Some((got, want)) = results
        .iter()
        .zip(request_ids)
        .find(|(r, id)| r.request_id != **id)
    {
        return Err(ReplyError::Protocol(format!(
            "result for {} where {want} was expected",
            got.request_id
        )));
    }
    // A big draw's compact prizes are expanded here, so every caller sees
    // the list whichever form its draw was answered in.
    let mut results = results;
    for r in &mut results {
        r.expand_prizes()
            .map_err(|e| ReplyError::Protocol(format!("result for {}: {e}", r.request_id)))?;
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{typed_json, DrawRequest};

    fn entry(id: &str) -> Vec<u8> {
        typed_json(
            "draw",
            &DrawRequest {
                request_id: id.into(),
                pool: "gift-1".into(),
                user_id: 42,
                count: 10,
            },
        )
    }

    #[test]
    fn one_entry_goes_out_as_a_plain_draw() {
        let e = entry("a1");
        assert_eq!(encode([e.as_slice()].into_iter()), e);
    }

    #[test]
    fn entries_are_joined_into_a_batch_that_decodes_and_is_as_long_as_predicted() {
        let (a, b) = (entry("a1"), entry("a2"));
        let body = encode([a.as_slice(), b.as_slice()].into_iter());
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["type"], BATCH_TYPE);
        // Each entry is the single draw's own body, `"type":"draw"` included,
        // which the protocol allows.
        assert_eq!(value["requests"][0]["type"], "draw");
        // The worker reads it as a batch whose entries are draws.
        let crate::messages::DrawQueueMessage::Batch(batch) =
            serde_json::from_value(value.clone()).unwrap()
        else {
            panic!("not read as a draw.batch: {value}");
        };
        assert_eq!(batch.entry(1).unwrap().request_id, "a2");
        assert_eq!(value["requests"][1]["request_id"], "a2");
        assert_eq!(value["requests"].as_array().unwrap().len(), 2);
        assert_eq!(body.len(), framed_len(2, a.len() + b.len()));
    }

    #[test]
    fn a_batch_stops_at_its_entry_count_and_at_64_kib() {
        assert!(fits(0, 0, 100, 2));
        assert!(fits(1, 100, 100, 2));
        assert!(!fits(2, 200, 100, 2));
        let big = MAX_MESSAGE_BYTES - PREFIX.len() - SUFFIX.len();
        assert!(fits(0, 0, big, 100));
        assert!(!fits(0, 0, big + 1, 100));
        assert!(!fits(1, big - 10, 10, 100), "the comma counts");
        assert!(fits(1, big - 11, 10, 100));
    }

    fn ok(id: &str) -> serde_json::Value {
        serde_json::json!({"type":"draw_result","request_id":id,"status":"ok","pool":"gift-1",
            "user_id":42,"prizes":[{"multiplier":10,"combo":"c1"}],"total_multiplier":10,
            "reward":100,"asset":"coin"})
    }

    #[test]
    fn a_batch_reply_is_split_in_request_order() {
        let reply = serde_json::json!({"type":BATCH_REPLY_TYPE,"results":[ok("a1"), ok("a2")]});
        let results = decode_reply(&serde_json::to_vec(&reply).unwrap(), &["a1", "a2"]).unwrap();
        assert_eq!(results[0].request_id, "a1");
        assert_eq!(results[1].reward, Some(100));
        let single = decode_reply(&serde_json::to_vec(&ok("a1")).unwrap(), &["a1"]).unwrap();
        assert_eq!(single[0].status, Status::Ok);
    }

    #[test]
    fn a_reply_that_does_not_match_what_was_sent_is_refused() {
        let swapped = serde_json::json!({"type":BATCH_REPLY_TYPE,"results":[ok("a2"), ok("a1")]});
        let body = serde_json::to_vec(&swapped).unwrap();
        assert!(matches!(
            decode_reply(&body, &["a1", "a2"]),
            Err(ReplyError::Protocol(_))
        ));
        assert!(matches!(
            decode_reply(&body, &["a2", "a1", "a3"]),
            Err(ReplyError::Protocol(_))
        ));
        assert!(matches!(
            decode_reply(b"not json", &["a1"]),
            Err(ReplyError::Protocol(_))
        ));
    }

    #[test]
    fn a_rejected_envelope_fails_every_entry_with_its_reason() {
        let reply = serde_json::json!({"type":BATCH_REPLY_TYPE,"status":"rejected",
            "error":{"code":"invalid_request","message":"a draw.batch holds 1 to 100 entries"},
            "results":[]});
        assert_eq!(
            decode_reply(&serde_json::to_vec(&reply).unwrap(), &["a1", "a2"]),
            Err(ReplyError::Rejected(
                "a draw.batch holds 1 to 100 entries".into()
            ))
        );
    }
}
