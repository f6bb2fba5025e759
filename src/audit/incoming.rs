//! Draw records as the audit consumer receives them: read from an event's
//! JSON value, or, for a `draw.completed.batch` (the draw workers' grouped
//! events, most of what the trail reads), straight from the message's bytes
//! into each record's [`DrawResult`], without a JSON value of the whole
//! group in between.
//!
//! The straight read is taken only for a group every record of which reads;
//! anything else (a record that does not read, a key given twice, `events`
//! that is not a list) is read again through its JSON value, so a message
//! meets the same fate, with the same reasons, whichever way it was read.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::{value::RawValue, Value};

use crate::messages::{shallow_envelope, DrawResult, Invalid};

/// The `type` of the grouped draw events this module reads straight.
pub const GROUP_TYPE: &str = "draw.completed.batch";

/// One draw record to check: its result (or why it does not read), its
/// seal, and its request id as it came (named in the log of a record
/// refused in a group).
#[derive(Debug)]
pub struct Record {
    pub result: Result<DrawResult, Invalid>,
    pub seal: Option<String>,
    pub request_id: Option<String>,
}

impl Record {
    /// The record of a `draw.completed` event's JSON value.
    pub fn of_value(event: &Value) -> Self {
        let text = |field: &str| event.get(field).and_then(Value::as_str).map(str::to_owned);
        Self {
            result: DrawResult::deserialize(event).map_err(unreadable),
            seal: text("seal"),
            request_id: text("request_id"),
        }
    }

    /// The record of one event of a group, read from its bytes; `None`
    /// when it does not read (the group is then read through its value).
    fn of_raw(event: &RawValue) -> Option<Self> {
        /// The parts of an event beside its result.
        #[derive(Deserialize)]
        struct Around<'a> {
            #[serde(borrow, default)]
            seal: Option<Cow<'a, str>>,
        }
        let result: DrawResult = serde_json::from_str(event.get()).ok()?;
        let around: Around<'_> = serde_json::from_str(event.get()).ok()?;
        Some(Self {
            request_id: Some(result.request_id.clone()),
            seal: around.seal.map(Cow::into_owned),
            result: Ok(result),
        })
    }
}

/// Why an event does not read as a draw record.
fn unreadable(e: serde_json::Error) -> Invalid {
    Invalid::new(format!("a draw.completed that does not read: {e}"))
}

/// The records of a `draw.completed.batch` read straight from its bytes;
/// `None` when the body or any of its records does not read that way.
pub fn group_records(body: &[u8]) -> Option<Vec<Record>> {
    /// A group as its records' bytes.
    #[derive(Deserialize)]
    struct Group<'a> {
        #[serde(borrow)]
        events: Vec<&'a RawValue>,
    }
    let group: Group<'_> = serde_json::from_slice(body).ok()?;
    group.events.into_iter().map(Record::of_raw).collect()
}

/// The audit's envelope of `body`: for a `draw.completed.batch`, its
/// fields less `events` (checked, not built: [`shallow_envelope`]); for
/// anything else, its whole envelope. Refuses what
/// [`crate::messages::decode_envelope`] refuses, for the same reasons.
pub fn envelope(body: &[u8]) -> Result<Value, Invalid> {
    match shallow_envelope(body, "events") {
        Some((shallow, skipped))
            if !skipped || shallow.get("type").and_then(Value::as_str) == Some(GROUP_TYPE) =>
        {
            Ok(shallow)
        }
        _ => crate::messages::decode_envelope(body),
    }
}

/// Whether `envelope` is a group's shallow envelope, whose records are read
/// from the body.
pub fn is_shallow_group(envelope: &Value) -> bool {
    envelope.get("events").is_none()
        && envelope.get("type").and_then(Value::as_str) == Some(GROUP_TYPE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{decode_envelope, Status};

    fn record(id: &str, seal: Option<&str>) -> Value {
        let result = DrawResult {
            request_id: id.into(),
            status: Status::Ok,
            pool: Some("p".into()),
            user_id: Some(7),
            serial: Some(3),
            ..DrawResult::default()
        };
        let mut event = serde_json::to_value(result).unwrap();
        event["type"] = "draw.completed".into();
        if let Some(seal) = seal {
            event["seal"] = seal.into();
        }
        event
    }

    fn group(events: &[Value]) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"type": GROUP_TYPE, "events": events})).unwrap()
    }

    /// What the straight read gives, as text, to compare with the read
    /// through the value.
    fn shown(records: &[Record]) -> Vec<String> {
        records
            .iter()
            .map(|r| format!("{:?} {:?} {:?}", r.result, r.seal, r.request_id))
            .collect()
    }

    /// A group reads straight exactly when all of it reads, and then gives
    /// the records its value gives; otherwise it is read through its value.
    #[test]
    fn a_group_reads_the_same_straight_or_through_its_value() {
        let straight = [
            group(&[record("a", Some("ab")), record("b", None)]),
            group(&[record("a", Some("ab"))]),
            br#"{"events":[{"request_id":"x","status":"ok","seal":"00","extra":[1,{"y":2}]}],"type":"draw.completed.batch"}"#.to_vec(),
        ];
        for body in &straight {
            assert!(is_shallow_group(&envelope(body).unwrap()));
            let records = group_records(body).expect("a group of records that read");
            let value = decode_envelope(body).unwrap();
            let through: Vec<Record> = value["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(Record::of_value)
                .collect();
            assert_eq!(shown(&records), shown(&through));
        }
        let mut seal_not_text = record("a", None);
        seal_not_text["seal"] = 5.into();
        let through_value = [
            group(&[record("a", None), serde_json::json!({"request_id": 5})]),
            group(&[seal_not_text]),
            br#"{"type":"draw.completed.batch","events":{"a":1}}"#.to_vec(),
            br#"{"type":"draw.completed.batch","events":[],"events":[]}"#.to_vec(),
            br#"{"type":"draw.completed.batch"}"#.to_vec(),
            // An array is no record, though serde reads a struct from one.
            br#"{"type":"draw.completed.batch","events":[["a","ok"]]}"#.to_vec(),
        ];
        for body in &through_value {
            assert!(is_shallow_group(&envelope(body).unwrap()));
            let shown = String::from_utf8_lossy(body);
            assert!(group_records(body).is_none(), "{shown}");
        }
    }

    /// The audit's envelope refuses exactly what every consumer's refuses,
    /// and differs from it only by the `events` of a group, which it leaves
    /// out; so a delivery's span names the same request, pool and user.
    #[test]
    fn the_audit_envelope_takes_what_every_envelope_takes() {
        let mut bodies = crate::messages::envelope_probes(GROUP_TYPE, "events");
        bodies.extend(crate::messages::envelope_probes("draw.completed", "events"));
        bodies.extend(crate::messages::envelope_probes("pool.refilled", "x"));
        bodies.push(br#"{"type":"draw.completed.batch","request_id":"r-1","pool":"p","user_id":7,"events":[]}"#.to_vec());
        for body in &bodies {
            let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
            match (envelope(body), decode_envelope(body)) {
                (Err(ours), Err(theirs)) => assert_eq!(ours, theirs, "{shown}"),
                (Ok(ours), Ok(mut theirs)) => {
                    if is_shallow_group(&ours) {
                        theirs.as_object_mut().unwrap().shift_remove("events");
                    }
                    assert_eq!(ours.to_string(), theirs.to_string(), "{shown}");
                }
                (ours, theirs) => panic!("{shown}: audit {ours:?}, every consumer {theirs:?}"),
            }
        }
    }
}
