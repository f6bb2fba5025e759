//! The envelope of a message without its largest field, for consumers that
//! read that field straight from the message's bytes into typed values
//! (the settle worker's `settle.batch`, the audit's `draw.completed.batch`).
//!
//! [`shallow_envelope`] takes exactly the bodies [`decode_envelope`] takes:
//! the skipped field is read in full and checked as building its JSON value
//! would check it (string escapes, numbers within range, nesting depth), and
//! only not built. So a consumer that reads the field itself refuses what
//! every other consumer refuses, for the same reasons, and its log lines
//! name the same request.
//!
//! [`decode_envelope`]: super::decode_envelope

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use super::MAX_MESSAGE_BYTES;

/// The envelope [`super::decode_envelope`] gives for `body`, less its field
/// `skip`, and whether `body` has that field; `None` when
/// [`super::decode_envelope`] refuses `body`, and for a body that uses
/// serde_json's raw-value key ([`RAW_VALUE_KEY`]), which is left to it.
pub fn shallow_envelope(body: &[u8], skip: &str) -> Option<(Value, bool)> {
    if body.len() > MAX_MESSAGE_BYTES || std::str::from_utf8(body).is_err() {
        return None;
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let (fields, skipped) = de.deserialize_map(Shallow { skip }).ok()?;
    de.end().ok()?;
    matches!(fields.get("type"), Some(Value::String(_))).then_some((Value::Object(fields), skipped))
}

/// The key to which serde_json gives a meaning of its own when it builds a
/// `Value` (its `raw_value` feature, which sqlx turns on): an object whose
/// first key it is stands for the JSON text of its string value. A body
/// that uses it anywhere is read through its value, where that happens.
const RAW_VALUE_KEY: &str = "$serde_json::private::RawValue";

/// Why a body is left to the whole envelope.
const LEFT_TO_THE_VALUE: &str = "serde_json's raw-value key: read through the value";

/// Reads a JSON object into its fields, all but `skip`, which is checked.
struct Shallow<'s> {
    skip: &'s str,
}

impl<'de> Visitor<'de> for Shallow<'_> {
    type Value = (Map<String, Value>, bool);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = Map::new();
        let mut skipped = false;
        let mut first = true;
        while let Some(key) = map.next_key::<String>()? {
            if first && key == RAW_VALUE_KEY {
                return Err(serde::de::Error::custom(LEFT_TO_THE_VALUE));
            }
            first = false;
            if key == self.skip {
                map.next_value_seed(Checked)?;
                skipped = true;
            } else {
                // A key given twice keeps its last value, as in a `Value`.
                fields.insert(key, map.next_value()?);
            }
        }
        Ok((fields, skipped))
    }
}

/// Any JSON value, read in full through `deserialize_any` (as building a
/// `Value` reads it) and dropped.
#[derive(Clone, Copy)]
struct Checked;

impl<'de> DeserializeSeed<'de> for Checked {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Checked {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        match map.next_key_seed(FirstKey)? {
            None => return Ok(()),
            Some(true) => return Err(serde::de::Error::custom(LEFT_TO_THE_VALUE)),
            Some(false) => map.next_value_seed(self)?,
        }
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }
}

/// The first key of an object: whether it is [`RAW_VALUE_KEY`] (as its
/// value would read it: after its escapes).
struct FirstKey;

impl<'de> DeserializeSeed<'de> for FirstKey {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for FirstKey {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a key")
    }

    fn visit_str<E>(self, key: &str) -> Result<bool, E> {
        Ok(key == RAW_VALUE_KEY)
    }
}

/// Bodies meant to probe every difference between reading a value and
/// skipping it: escapes, numbers, depth, duplicates, shapes, bytes.
#[cfg(test)]
pub(crate) fn probes(kind: &str, skip: &str) -> Vec<Vec<u8>> {
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let mut bodies: Vec<Vec<u8>> = [
        format!(r#"{{"type":"{kind}","{skip}":[1,2]}}"#),
        format!(r#"{{"{skip}":[],"type":"{kind}"}}"#),
        format!(r#"{{"type":"{kind}","{skip}":[],"x":"\ud800"}}"#),
        format!(r#"{{"type":"{kind}","{skip}":["\udc00"]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":["\ud83d\ude00"]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":[1e400]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":[1{}]}}"#, "0".repeat(400)),
        format!(
            r#"{{"type":"{kind}","{skip}":[18446744073709551616, -9223372036854775809, -0, 5.0]}}"#
        ),
        format!(r#"{{"type":"{kind}","{skip}":{}}}"#, deep(126)),
        format!(r#"{{"type":"{kind}","{skip}":{}}}"#, deep(127)),
        format!(r#"{{"type":"{kind}","{skip}":{}}}"#, deep(200)),
        format!(r#"{{"type":"{kind}","x":{}}}"#, deep(127)),
        format!(r#"{{"type":"{kind}","{skip}":[],"{skip}":{{}}}}"#),
        format!(r#"{{"type":"{kind}","type":5,"{skip}":[]}}"#),
        format!(r#"{{"type":5,"type":"{kind}","{skip}":[]}}"#),
        format!(r#"{{"type":{{"{kind}":null}},"{skip}":[]}}"#),
        format!(r#"{{"\u0074ype":"{kind}","{skip}":[]}}"#),
        format!(r#"["{kind}",[]]"#),
        format!(r#"{{"type":"{kind}","{skip}":[]}} x"#),
        format!(r#"{{"type":"{kind}","{skip}":[]}}  "#),
        format!(r#"{{"type":"{kind}","{skip}":[]"#),
        format!(r#"{{"type":"{kind}","{skip}":[{{"a":1,"a":[true,false,null]}}]}}"#),
        format!(r#"{{"{skip}":[]}}"#),
        format!(r#"{{"$serde_json::private::RawValue":"{{}}","type":"{kind}","{skip}":[]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":[{{"$serde_json::private::RawValue":"nope"}}]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":[{{"$serde_json::private::RawValue":"1","a":2}}]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":[{{"$serde_json::private::RawValue":1}}]}}"#),
        format!(
            r#"{{"type":"{kind}","{skip}":[{{"\u0024serde_json::private::RawValue":"nope"}}]}}"#
        ),
        format!(r#"{{"type":"{kind}","{skip}":[{{"$serde_json::private::RawValue":"[1]"}}]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":{{"a":1,"$serde_json::private::RawValue":"x"}}}}"#),
        format!(
            r#"{{"type":"{kind}","x":{{"$serde_json::private::RawValue":"nope"}},"{skip}":[]}}"#
        ),
        format!(
            r#"{{"type":"{kind}","{skip}":{}0{}}}"#,
            r#"{"a":"#.repeat(126),
            "}".repeat(126)
        ),
        format!(
            r#"{{"type":"{kind}","{skip}":{}0{}}}"#,
            r#"{"a":"#.repeat(127),
            "}".repeat(127)
        ),
        format!(r#"{{"type":"{kind}","{skip}":[1,]}}"#),
        format!(r#"{{"type":"{kind}","{skip}":{{"a":1,}}}}"#),
        format!(r#"{{"type":"{kind}","{skip}":[],}}"#),
        format!(r#" {{"type" : "{kind}" , "{skip}" : [ ] }} "#),
        format!(r#"{{"type":"{kind}","\u0065vents":[1e400]}}"#),
        "{}".into(),
        "null".into(),
        String::new(),
    ]
    .into_iter()
    .map(String::into_bytes)
    .collect();
    bodies.push(
        format!(r#"{{"type":"{kind}","{skip}":["#)
            .into_bytes()
            .into_iter()
            .chain(*b"\"\xff\"]}")
            .collect(),
    );
    bodies.push(
        format!(
            r#"{{"type":"{kind}","{skip}":"{}"}}"#,
            "x".repeat(MAX_MESSAGE_BYTES)
        )
        .into_bytes(),
    );
    let at_limit = format!(r#"{{"type":"{kind}","{skip}":""}}"#);
    let fill = "x".repeat(MAX_MESSAGE_BYTES - at_limit.len());
    bodies.push(format!(r#"{{"type":"{kind}","{skip}":"{fill}"}}"#).into_bytes());
    bodies
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::decode_envelope;

    /// The shallow envelope is taken exactly when the envelope is, and is
    /// the envelope less the skipped field.
    #[test]
    fn a_shallow_envelope_takes_what_the_envelope_takes() {
        for body in probes("t", "events") {
            let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
            let full = decode_envelope(&body);
            match (shallow_envelope(&body, "events"), full) {
                (None, Err(_)) => {}
                (None, Ok(_)) if body.windows(15).any(|w| w == b"private::RawVal") => {}
                (Some((shallow, skipped)), Ok(mut full)) => {
                    let had = full
                        .as_object_mut()
                        .unwrap()
                        .shift_remove("events")
                        .is_some();
                    // As text too: a map's equality does not see its order.
                    assert_eq!(shallow.to_string(), full.to_string(), "{shown}");
                    assert_eq!(skipped, had, "{shown}");
                }
                (shallow, full) => panic!("{shown}: shallow {shallow:?}, envelope {full:?}"),
            }
        }
    }
}
