//! Dead letters as JSON: the export format of `prizepool dlq export`, one
//! object per line.

use lapin::{types::AMQPValue, BasicProperties};
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::{pass::DELIVERY_COUNT_HEADER, DeadLetter, Route};

/// One dead letter whole, as a line of `prizepool dlq export`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Exported {
    /// The DLQ it was read from.
    pub dlq: String,
    /// The work queue a replay moves it to.
    pub queue: String,
    /// Its description, as `dlq list` shows it (the body cut short there).
    #[serde(flatten)]
    pub letter: DeadLetter,
    /// The whole body: its JSON when it is JSON, otherwise its text
    /// (invalid UTF-8 replaced).
    pub payload: Value,
    /// Whether `payload` is the body's JSON (otherwise its text).
    pub payload_is_json: bool,
    /// The AMQP properties and headers (the broker's delivery count left out).
    pub properties: Value,
}

pub(super) fn export(
    route: Route,
    letter: DeadLetter,
    delivery: &lapin::message::Delivery,
) -> Exported {
    let (payload, payload_is_json) = match serde_json::from_slice::<Value>(&delivery.data) {
        Ok(v) => (v, true),
        Err(_) => (
            Value::String(String::from_utf8_lossy(&delivery.data).into_owned()),
            false,
        ),
    };
    Exported {
        dlq: route.dlq.into(),
        queue: route.queue.into(),
        letter,
        payload,
        payload_is_json,
        properties: properties(&delivery.properties),
    }
}

/// The properties that are set, by their AMQP names, headers as an object.
pub(super) fn properties(p: &BasicProperties) -> Value {
    let mut out = Map::new();
    let mut put = |name: &str, v: Option<Value>| {
        if let Some(v) = v {
            out.insert(name.into(), v);
        }
    };
    let s = |v: Option<&lapin::types::ShortString>| v.map(|v| json!(v.as_str()));
    put("content_type", s(p.content_type().as_ref()));
    put("content_encoding", s(p.content_encoding().as_ref()));
    put("delivery_mode", p.delivery_mode().map(|v| json!(v)));
    put("priority", p.priority().map(|v| json!(v)));
    put("correlation_id", s(p.correlation_id().as_ref()));
    put("reply_to", s(p.reply_to().as_ref()));
    put("expiration", s(p.expiration().as_ref()));
    put("message_id", s(p.message_id().as_ref()));
    put("timestamp", p.timestamp().map(|v| json!(v)));
    put("type", s(p.kind().as_ref()));
    put("user_id", s(p.user_id().as_ref()));
    put("app_id", s(p.app_id().as_ref()));
    if let Some(headers) = p.headers() {
        let headers: Map<String, Value> = headers
            .inner()
            .iter()
            .filter(|(k, _)| k.as_str() != DELIVERY_COUNT_HEADER)
            .map(|(k, v)| (k.as_str().to_owned(), value(v)))
            .collect();
        put("headers", Some(Value::Object(headers)));
    }
    Value::Object(out)
}

/// An AMQP field value as JSON: numbers as numbers, strings as text,
/// tables as objects, arrays as arrays, bytes as text.
fn value(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Timestamp(n) => json!(n),
        AMQPValue::Float(n) => json!(n),
        AMQPValue::Double(n) => json!(n),
        AMQPValue::DecimalValue(d) => json!(format!("{d:?}")),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ByteArray(b) => json!(String::from_utf8_lossy(b.as_slice())),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value).collect()),
        AMQPValue::FieldTable(t) => Value::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), value(v)))
                .collect(),
        ),
        AMQPValue::Void => Value::Null,
    }
}
