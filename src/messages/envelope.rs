//! What every queue shares: the envelope check, the typed decode, the
//! idempotency id a reply echoes, and the `rejected` replies to bad input.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{ErrorCode, MAX_ENTRY_ID_LEN, MAX_ID_LEN, MAX_MESSAGE_BYTES};

/// Bad input: the message cannot be processed as sent. It is dead-lettered
/// with this reason in a header.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    pub message: String,
}

/// The longest reason a refusal carries, in bytes. A reason may quote the
/// input it refuses (serde quotes an offending value or an unknown field,
/// escaped), and it travels in the `rejected` reply and the dead letter's
/// reason header: longer ones are cut ([`bounded_reason`]), so a refusal
/// never outgrows the 64 KiB every message is held to, whatever the
/// request held.
pub const MAX_REASON_BYTES: usize = 1024;

impl Invalid {
    /// Bad input described by `message`, cut to [`MAX_REASON_BYTES`].
    pub fn new(message: impl Into<String>) -> Self {
        let message = message.into();
        let message = match bounded_reason(&message) {
            std::borrow::Cow::Borrowed(_) => message,
            std::borrow::Cow::Owned(cut) => cut,
        };
        Self { message }
    }
}

/// Checks the envelope every queue shares: size, JSON object, a string `type`.
pub fn decode_envelope(body: &[u8]) -> Result<Value, Invalid> {
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(Invalid::new(format!(
            "message is {} bytes, the limit is {MAX_MESSAGE_BYTES}",
            body.len()
        )));
    }
    let text = std::str::from_utf8(body).map_err(|e| Invalid::new(format!("not UTF-8: {e}")))?;
    let value: Value =
        serde_json::from_str(text).map_err(|e| Invalid::new(format!("not JSON: {e}")))?;
    match value.get("type") {
        Some(Value::String(_)) => Ok(value),
        Some(_) => Err(Invalid::new("field `type` must be a string")),
        None if value.is_object() => Err(Invalid::new("missing field `type`")),
        None => Err(Invalid::new("message must be a JSON object")),
    }
}

/// Decodes a typed payload from an envelope, turning serde's complaint into a
/// readable reason (`unknown variant` becomes `unknown type`). It reads the
/// envelope in place, so a retried delivery decodes again without a copy.
pub fn decode_typed<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, Invalid> {
    let kind = value
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    T::deserialize(value).map_err(|e| {
        let text = e.to_string();
        if text.contains("unknown variant") {
            Invalid::new(format!("unknown type {kind:?}"))
        } else {
            Invalid::new(text)
        }
    })
}
/// Decodes the payload of a message whose `type` was read already (a
/// kind's lifecycle message, dispatched by its type): the envelope without
/// `type`, as `T`, with the complaints [`decode_typed`] gives.
pub fn decode_payload<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, Invalid> {
    let mut payload = value.clone();
    if let Some(fields) = payload.as_object_mut() {
        fields.remove("type");
    }
    T::deserialize(payload).map_err(|e| Invalid::new(e.to_string()))
}
/// The idempotency-id fields, in the order a reply looks for them.
pub(super) const ID_FIELDS: [&str; 4] = ["request_id", "grant_id", "packet_id", "entry_id"];

/// Largest body [`request_ids`] still reads for ids: well past
/// [`MAX_MESSAGE_BYTES`], so an oversize request is answered with its id, but
/// bounded, so a huge body cannot make the worker parse megabytes for a reply.
pub const MAX_ID_SCAN_BYTES: usize = 4 * 1024 * 1024;

/// The idempotency id a message carries, whatever its type, for echoing in a
/// rejected reply even when the rest of the message is unusable. Only a
/// string of at most [`MAX_ID_LEN`] bytes counts: anything else could not
/// name a request, and echoing it would only make the reply bigger.
pub fn idempotency_id(value: &Value) -> Option<(&'static str, String)> {
    id_among(value, &ID_FIELDS)
}

/// The first of `fields` that `value` holds as a usable id (see
/// [`idempotency_id`]).
fn id_among(value: &Value, fields: &[&'static str]) -> Option<(&'static str, String)> {
    fields.iter().find_map(|&field| match value.get(field) {
        Some(Value::String(s))
            if s.len()
                <= if field == "entry_id" {
                    MAX_ENTRY_ID_LEN
                } else {
                    MAX_ID_LEN
                } =>
        {
            Some((field, s.clone()))
        }
        _ => None,
    })
}

/// What a reply to bad input can still learn from `body` when the envelope
/// does not decode (no `type`, a `type` that is not a string, oversize, not
/// an object for the typed decoder): a JSON object holding only the request's
/// string `type`, id fields and `pool`, and its integer `user_id` (what
/// [`rejected_reply`] may repeat), if the body is a JSON object of at most
/// [`MAX_ID_SCAN_BYTES`]. The body is scanned without building it: every
/// other field is skipped.
pub fn request_ids(body: &[u8]) -> Option<Value> {
    if body.len() > MAX_ID_SCAN_BYTES {
        return None;
    }
    let IdFields(fields) = serde_json::from_slice(body).ok()?;
    Some(Value::Object(fields))
}

/// The `type`, id fields, `pool` and `user_id` of a JSON object, others
/// skipped (see [`request_ids`]).
struct IdFields(serde_json::Map<String, Value>);

impl<'de> Deserialize<'de> for IdFields {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = IdFields;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<IdFields, A::Error> {
                let mut fields = serde_json::Map::new();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "type" || key == "pool" || ID_FIELDS.contains(&key.as_ref()) {
                        // Only strings are kept: a number where an id
                        // belongs names nothing.
                        if let Value::String(s) = map.next_value::<Value>()? {
                            fields.insert(key.into_owned(), Value::String(s));
                        }
                    } else if key == "user_id" {
                        if let Value::Number(n) = map.next_value::<Value>()? {
                            fields.insert(key.into_owned(), Value::Number(n));
                        }
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(IdFields(fields))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// The reply `type` for a request `type`; `draw_result` when the request
/// type is unknown or missing (the draw queue's reply is the common case).
pub fn reply_type(request_type: Option<&str>) -> &'static str {
    match request_type {
        Some("lottery.grant") => "grant_result",
        Some("settle" | "settle.batch") => "settle_result",
        Some("draw.batch") => "draw_result.batch",
        // A kind's lifecycle message names its reply where it is
        // registered.
        Some(other) => {
            crate::kinds::registry::lifecycle(other).map_or("draw_result", |(_, l)| l.reply)
        }
        None => "draw_result",
    }
}

/// What a `rejected` reply of type `reply_type` repeats of the request it
/// answers: the id fields it looks for (the first one found is echoed) and
/// the other fields its business refusals carry too, so that a refusal of
/// bad input reads like the other refusals of its type. A `draw_result`
/// also answers messages of a missing or unknown type, so it looks for
/// every id field; a `draw_result.batch` has no id.
pub fn echoed_fields(reply_type: &str) -> (&'static [&'static str], &'static [&'static str]) {
    match reply_type {
        "draw_result" => (&ID_FIELDS, &["pool", "user_id"]),
        "draw_result.batch" => (&[], &[]),
        "grant_result" => (&["grant_id"], &[]),
        "redpacket_result" => (&["packet_id"], &[]),
        "settle_result" => (&["entry_id"], &[]),
        "refill_result" => (&[], &["pool"]),
        _ => (&ID_FIELDS, &[]),
    }
}

/// Builds a `rejected` reply for a request that could not be processed.
/// `request` is the decoded envelope, or what [`request_ids`] found in a
/// body that did not decode. Its `type` follows the request's; it carries
/// the request's id whenever it had a usable one, and the other fields
/// [`echoed_fields`] names when the request had them in their wire types
/// (`pool` a string of at most [`MAX_ID_LEN`] bytes, `user_id` an integer
/// in `i64`), so the reply validates against its type's schema.
pub fn rejected_reply(request: Option<&Value>, code: ErrorCode, message: &str) -> Value {
    let request_type = request.and_then(|v| v.get("type")).and_then(Value::as_str);
    let reply_type = reply_type(request_type);
    let (ids, context) = echoed_fields(reply_type);
    let mut reply = serde_json::Map::new();
    reply.insert("type".into(), Value::String(reply_type.into()));
    if let Some((field, id)) = request.and_then(|r| id_among(r, ids)) {
        reply.insert(field.into(), Value::String(id));
    }
    reply.insert("status".into(), Value::String("rejected".into()));
    for &field in context {
        if let Some(value) = request.and_then(|r| echoable(r, field)) {
            reply.insert(field.into(), value);
        }
    }
    reply.insert(
        "error".into(),
        serde_json::json!({ "code": code, "message": bounded_reason(message) }),
    );
    if reply_type == "draw_result.batch" {
        // A batch refused whole answers none of its requests.
        reply.insert("results".into(), Value::Array(Vec::new()));
    }
    Value::Object(reply)
}

/// `message`, cut to at most [`MAX_REASON_BYTES`] (at a character
/// boundary, ending in `…`) when longer. Bad input is cut where it is
/// described ([`Invalid::new`]); a rejected reply cuts whatever reason it
/// is given (an internal failure's too).
pub fn bounded_reason(message: &str) -> std::borrow::Cow<'_, str> {
    if message.len() <= MAX_REASON_BYTES {
        return message.into();
    }
    let mut end = MAX_REASON_BYTES - '…'.len_utf8();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end]).into()
}

/// Field `field` of `request` when it holds a value a reply may repeat:
/// `pool` a string of at most [`MAX_ID_LEN`] bytes, `user_id` an integer
/// that fits an `i64`.
fn echoable(request: &Value, field: &str) -> Option<Value> {
    match (field, request.get(field)?) {
        ("pool", Value::String(s)) if s.len() <= MAX_ID_LEN => Some(Value::String(s.clone())),
        ("user_id", Value::Number(n)) => n.as_i64().map(Value::from),
        _ => None,
    }
}

/// The rejected reply to the raw `body` of a request: its envelope when it
/// decodes, else whatever ids [`request_ids`] can still find in it.
pub fn rejected_reply_to(body: &[u8], code: ErrorCode, message: &str) -> Value {
    let request = decode_envelope(body).ok().or_else(|| request_ids(body));
    rejected_reply(request.as_ref(), code, message)
}

/// `body` (a struct without a `type` field) serialised as a JSON object
/// whose first field is `"type": reply_type`: the same document as
/// [`with_type`], written straight to bytes.
pub fn typed_json(reply_type: &str, body: &impl Serialize) -> Vec<u8> {
    retype(reply_type, &serde_json::to_vec(body).unwrap_or_default())
}

/// The serialised JSON object `fields` with `"type": reply_type` put first,
/// so one serialisation serves several message types (a reply and its event).
pub fn retype(reply_type: &str, fields: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.len() + reply_type.len() + 12);
    out.extend_from_slice(b"{\"type\":");
    // A &str always serialises.
    let _ = serde_json::to_writer(&mut out, reply_type);
    match fields.strip_prefix(b"{") {
        Some(b"}") | None => out.push(b'}'),
        Some(rest) => {
            out.push(b',');
            out.extend_from_slice(rest);
        }
    }
    out
}

/// Serialises a reply body with its `type` field first.
pub fn with_type(reply_type: &str, body: &impl Serialize) -> Value {
    let mut map = serde_json::Map::new();
    map.insert("type".into(), Value::String(reply_type.into()));
    if let Ok(Value::Object(fields)) = serde_json::to_value(body) {
        map.extend(fields);
    }
    Value::Object(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{DrawQueueMessage, DrawRequest, DrawResult, Prize};

    /// serde quotes the value it refuses: a request of a string of 30,000
    /// `"` (60,000 bytes escaped) in a number's place, or of three-byte
    /// characters, is described in at most 1 KiB, cut on a character.
    #[test]
    fn a_refusal_quoting_huge_input_stays_short() {
        for filler in ["\\\"".repeat(30_000), "\u{200b}".repeat(21_000)] {
            let body = format!(
                r#"{{"type":"draw","request_id":"a","pool":"p","user_id":"{filler}","count":1}}"#
            );
            assert!(body.len() <= MAX_MESSAGE_BYTES);
            let value = decode_envelope(body.as_bytes()).unwrap();
            let invalid = decode_typed::<DrawQueueMessage>(&value).unwrap_err();
            assert!(
                invalid.message.len() <= MAX_REASON_BYTES,
                "{}",
                invalid.message.len()
            );
            assert!(
                invalid.message.starts_with("invalid type")
                    || invalid.message.contains("invalid type"),
                "{}",
                &invalid.message[..80]
            );
            assert!(invalid.message.ends_with('…'));
            let reply = serde_json::to_vec(&rejected_reply(
                Some(&value),
                ErrorCode::InvalidRequest,
                &invalid.message,
            ))
            .unwrap();
            assert!(reply.len() < 8 * MAX_REASON_BYTES, "{}", reply.len());
        }
    }

    #[test]
    fn bad_input_classes_are_invalid() {
        for (body, needle) in [
            (&b"not json"[..], "not JSON"),
            (br#"[1,2]"#, "JSON object"),
            (
                br#"{"type":"draw","request_id":"a","pool":"p","user_id":"x","count":1}"#,
                "invalid type",
            ),
            (
                br#"{"type":"draw","request_id":"a","pool":"p","count":1}"#,
                "missing field",
            ),
            (br#"{"type":"explode","request_id":"a"}"#, "unknown type"),
        ] {
            let err = decode_envelope(body)
                .and_then(|v| decode_typed::<DrawQueueMessage>(&v))
                .unwrap_err();
            assert!(err.message.contains(needle), "{body:?}: {err}");
        }
        let big = vec![b' '; MAX_MESSAGE_BYTES + 1];
        assert!(decode_envelope(&big).unwrap_err().message.contains("limit"));
        let zero = DrawRequest {
            request_id: "r".into(),
            pool: "p".into(),
            user_id: 1,
            count: 0,
        };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn rejected_reply_echoes_the_id() {
        let req = serde_json::json!({"type":"lottery.grant","grant_id":"g-1"});
        let reply = rejected_reply(Some(&req), ErrorCode::InvalidRequest, "bad");
        assert_eq!(reply["type"], "grant_result");
        assert_eq!(reply["grant_id"], "g-1");
        assert_eq!(reply["error"]["code"], "invalid_request");
    }

    /// The rejected reply a worker sends for `body`, given how decoding failed.
    fn reply_for(body: &[u8]) -> Value {
        let invalid = decode_envelope(body)
            .and_then(|v| decode_typed::<DrawQueueMessage>(&v).map(|_| ()))
            .expect_err("bad input");
        rejected_reply_to(body, ErrorCode::InvalidRequest, &invalid.message)
    }

    #[test]
    fn a_rejected_reply_to_a_request_without_a_type_carries_its_id() {
        let reply = reply_for(br#"{"request_id":"r-1","pool":"g","user_id":1,"count":1}"#);
        assert_eq!(reply["request_id"], "r-1");
        assert_eq!(reply["type"], "draw_result");
        assert_eq!(reply["status"], "rejected");
        assert_eq!(reply["error"]["code"], "invalid_request");
    }

    #[test]
    fn a_rejected_reply_to_a_request_whose_type_is_not_a_string_carries_its_id() {
        let reply = reply_for(br#"{"type":7,"grant_id":"g-1","activity":"a"}"#);
        assert_eq!(reply["grant_id"], "g-1");
        assert_eq!(reply["type"], "draw_result");
        let reply = reply_for(br#"{"type":"teleport","packet_id":"rp-1"}"#);
        assert_eq!(reply["packet_id"], "rp-1");
        assert_eq!(reply["type"], "draw_result");
    }

    #[test]
    fn a_rejected_reply_to_an_oversize_request_carries_its_id_and_type() {
        let body = format!(
            r#"{{"type":"lottery.grant","pad":"{}","grant_id":"g-big","activity":"a","nested":{{"request_id":"inner"}}}}"#,
            "x".repeat(MAX_MESSAGE_BYTES)
        );
        let reply = reply_for(body.as_bytes());
        assert!(reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit"));
        assert_eq!(reply["grant_id"], "g-big");
        assert_eq!(reply["type"], "grant_result");
        // Only top-level ids count.
        assert!(reply.get("request_id").is_none(), "{reply}");
    }

    /// A reason that quotes the request (an unknown field's name) is cut,
    /// so the reply stays small whatever the request held.
    #[test]
    fn a_reply_to_a_field_name_as_long_as_the_limit_allows_stays_small() {
        let name = "x".repeat(MAX_MESSAGE_BYTES - 60);
        let body = format!(r#"{{"type":"draw","request_id":"r-long","{name}":1}}"#);
        assert!(body.len() <= MAX_MESSAGE_BYTES);
        let reply = serde_json::to_vec(&reply_for(body.as_bytes())).unwrap();
        assert!(
            reply.len() < MAX_REASON_BYTES + 200,
            "{} bytes",
            reply.len()
        );
        let reply: Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(reply["request_id"], "r-long");
        let reason = reply["error"]["message"].as_str().unwrap();
        assert!(
            reason.starts_with("unknown field") && reason.ends_with('…'),
            "{reason}"
        );
    }

    #[test]
    fn a_body_past_the_scan_cap_is_answered_without_an_id() {
        let body = format!(
            r#"{{"request_id":"r-huge","pad":"{}"}}"#,
            "x".repeat(MAX_ID_SCAN_BYTES)
        );
        let reply = reply_for(body.as_bytes());
        assert!(reply.get("request_id").is_none());
        assert_eq!(reply["type"], "draw_result");
    }

    #[test]
    fn a_rejected_reply_to_a_request_that_fails_typed_decoding_carries_its_id() {
        let reply = reply_for(
            br#"{"type":"draw","request_id":"r-2","pool":"g","user_id":"one","count":1}"#,
        );
        assert_eq!(reply["request_id"], "r-2");
        assert_eq!(reply["type"], "draw_result");
        let reply = reply_for(br#"{"type":"lottery.grant","grant_id":"g-2","chances":"x"}"#);
        assert_eq!(reply["grant_id"], "g-2");
        assert_eq!(reply["type"], "grant_result");
    }

    /// Asserts that the reply to `body` echoes no id and is a `draw_result`.
    fn echoes_no_id(body: &[u8]) {
        let reply = reply_for(body);
        for field in ID_FIELDS {
            assert!(reply.get(field).is_none(), "{body:?}: {reply}");
        }
        assert_eq!(reply["type"], "draw_result");
    }

    #[test]
    fn a_body_that_is_not_json_echoes_no_id() {
        // An object cut short after a bare word, and one closed around it.
        echoes_no_id(b"\x7boops");
        echoes_no_id(b"{oops}");
    }

    #[test]
    fn a_body_that_is_not_an_object_echoes_no_id() {
        echoes_no_id(br#"["draw","r-3"]"#);
    }

    #[test]
    fn ids_that_are_not_strings_are_not_echoed() {
        echoes_no_id(br#"{"request_id":42,"type":"draw"}"#);
        echoes_no_id(br#"{"request_id":null}"#);
    }

    #[test]
    fn ids_longer_than_an_id_may_be_are_not_echoed() {
        let long = format!(r#"{{"request_id":"{}"}}"#, "r".repeat(MAX_ID_LEN + 1));
        assert!(reply_for(long.as_bytes()).get("request_id").is_none());
    }

    #[test]
    fn typed_json_writes_the_same_document_as_with_type() {
        let full = DrawResult {
            request_id: "01JD\"q".into(),
            pool: Some("gift-1001".into()),
            user_id: Some(42),
            prizes: vec![
                Prize::Multiplier {
                    multiplier: 10,
                    combo: "c3".into(),
                },
                Prize::Share {
                    share: 2,
                    amount: 7,
                },
            ],
            reward: Some(1000),
            ..Default::default()
        };
        #[derive(Serialize)]
        struct Empty {}
        for (kind, bytes, value) in [
            (
                "draw_result",
                typed_json("draw_result", &full),
                with_type("draw_result", &full),
            ),
            (
                "draw.completed",
                typed_json("draw.completed", &DrawResult::default()),
                with_type("draw.completed", &DrawResult::default()),
            ),
            (
                "x\"y",
                typed_json("x\"y", &Empty {}),
                with_type("x\"y", &Empty {}),
            ),
        ] {
            // Byte for byte: same fields, same order, `type` first.
            assert_eq!(
                String::from_utf8(bytes).unwrap(),
                value.to_string(),
                "{kind}"
            );
        }
    }
}
