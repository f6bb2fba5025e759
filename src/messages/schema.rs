//! The wire contract as documents other languages can read: a JSON Schema
//! (draft 2020-12) for every message and reply, generated from the serde
//! types of [`crate::messages`], and an AsyncAPI 2.6 document naming the
//! exchanges, routing keys, queues and the reply convention. Both are
//! written to `docs/schema/` and `docs/asyncapi.json`; `tests/it/contract.rs`
//! fails when the files there differ from what the types generate (run it
//! with `UPDATE_SCHEMAS=1` to rewrite them), so they cannot drift.
//!
//! A message's `type` is not a field of its Rust type (it is written by
//! [`super::with_type`] or read by the queue's tagged enum), so each
//! document adds it as a required constant.

use schemars::{generate::SchemaSettings, JsonSchema, SchemaGenerator};
use serde_json::{json, Map, Value};

use super::{
    ClosedEvent, CreatedReply, DrawBatch, DrawRequest, DrawResult, DrawResultBatch, ExpireReply,
    GrantRequest, GrantResult, PoolRefilled, RedPacketCreate, RedPacketExpire, RefillRequest,
    RefillResult, RejectedReply, SettleRequest, SettleResult,
};
use crate::amqp;

/// Who sends a message and where it travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A request an upstream service may publish.
    Request,
    /// A request only the fleet publishes (checked against stored state).
    Internal,
    /// A reply on the request's `reply_to`.
    Reply,
    /// A fact on the events exchange.
    Event,
}

/// One message of the wire contract and its schema.
#[derive(Clone, Debug)]
pub struct Message {
    /// Its `type`.
    pub name: &'static str,
    pub role: Role,
    /// The routing key it travels under (a request's work queue key, an
    /// event's key; empty for a reply).
    pub routing_key: &'static str,
    /// The `type` of the reply a request gets when it asks for one.
    pub reply: Option<&'static str>,
    pub summary: &'static str,
    /// The JSON Schema document, self-contained (`$defs` included).
    pub schema: Value,
}

/// The schema file of a message under `docs/schema/`.
pub fn file_name(name: &str) -> String {
    format!("{name}.json")
}

/// Schema-only shape of a `settle.batch` (the worker reads it by hand so
/// that a bad entry is refused alone).
#[derive(JsonSchema)]
#[schemars(deny_unknown_fields)]
#[allow(dead_code)]
struct SettleBatch {
    /// 1 to 1,000 `settle` messages.
    #[schemars(length(min = 1, max = 1000))]
    entries: Vec<SettleRequest>,
}

/// Schema-only shape of a `draw.completed.batch` event.
#[derive(JsonSchema)]
#[allow(dead_code)]
struct DrawCompletedBatch {
    /// `draw.completed` events, each with its `seal`.
    events: Vec<DrawResult>,
}

/// The schema of `T` from `generator`, with `type` as a required constant.
fn typed<T: JsonSchema>(generator: &mut SchemaGenerator, name: &str) -> Value {
    let reference = generator.subschema_for::<T>().to_value();
    let mut root = resolve(generator, &reference);
    add_type(&mut root, name, true);
    root
}

/// The schema of reply `T` of type `name`, as [`typed`], with its fields
/// required of an `ok` reply only: a `rejected` one carries `type`,
/// `status` and `error`, and the request's id and the other fields its
/// refusals repeat only when the request had them in their wire types
/// ([`super::rejected_reply`]: a message that is not JSON, or has no usable
/// id, is answered without one). A `draw_result` also answers messages of a
/// missing or unknown type, so it may repeat any of their id fields.
fn reply<T: JsonSchema>(generator: &mut SchemaGenerator, name: &str) -> Value {
    let mut root = typed::<T>(generator, name);
    let Some(object) = root.as_object_mut() else {
        return root;
    };
    let (always, when_ok): (Vec<Value>, Vec<Value>) = match object.get_mut("required") {
        Some(Value::Array(list)) => std::mem::take(list)
            .into_iter()
            .filter(|field| field != "error")
            .partition(|field| field == "type" || field == "status"),
        _ => (Vec::new(), Vec::new()),
    };
    object.insert("required".into(), Value::Array(always));
    let has_error = object
        .get("properties")
        .is_some_and(|p| p.get("error").is_some());
    if !when_ok.is_empty() || has_error {
        object.insert(
            "if".into(),
            json!({"properties": {"status": {"const": "ok"}}}),
        );
    }
    if !when_ok.is_empty() {
        object.insert("then".into(), json!({ "required": when_ok }));
    }
    if has_error {
        object.insert("else".into(), json!({"required": ["error"]}));
    }
    let (ids, _) = super::echoed_fields(name);
    if let Some(Value::Object(properties)) = object.get_mut("properties") {
        for &id in ids {
            properties.entry(id).or_insert_with(|| json!({
                "type": "string",
                "description": format!("A rejected reply to a message of a missing or unknown `type` repeats its `{id}`.")
            }));
        }
    }
    root
}

/// The schema of `T`, a reply that is always a refusal, of type `name`: as
/// [`typed`], with `status` the constant `rejected` (so it is told apart
/// from the other shapes of its type) and the request's id required only
/// when the request had a usable one, as for [`reply`].
fn refusal<T: JsonSchema>(generator: &mut SchemaGenerator, name: &str) -> Value {
    let mut root = typed::<T>(generator, name);
    root["properties"]["status"] = json!({"const": "rejected"});
    let (ids, _) = super::echoed_fields(name);
    if let Some(Value::Array(required)) = root.get_mut("required") {
        required.retain(|field| !ids.iter().any(|id| field == id));
    }
    root
}

/// The definition a `{"$ref": "#/$defs/X"}` points at (or the schema itself).
fn resolve(generator: &SchemaGenerator, schema: &Value) -> Value {
    schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/$defs/"))
        .and_then(|name| generator.definitions().get(name).cloned())
        .unwrap_or_else(|| schema.clone())
}

/// Adds `"type": {"const": name}` to an object schema, first, and to its
/// required fields when `required`.
fn add_type(schema: &mut Value, name: &str, required: bool) {
    let Some(object) = schema.as_object_mut() else {
        return;
    };
    let mut properties = Map::new();
    properties.insert("type".into(), json!({"const": name}));
    if let Some(Value::Object(old)) = object.remove("properties") {
        properties.extend(old.into_iter().filter(|(k, _)| k != "type"));
    }
    object.insert("properties".into(), Value::Object(properties));
    if required {
        let mut list = vec![json!("type")];
        if let Some(Value::Array(old)) = object.remove("required") {
            list.extend(old.into_iter().filter(|v| v != "type"));
        }
        object.insert("required".into(), Value::Array(list));
    }
}

/// Makes `root` a document: `$schema`, a title, and the definitions it
/// reaches.
fn document(generator: &SchemaGenerator, name: &str, summary: &str, mut root: Value) -> Value {
    let mut defs = Map::new();
    let mut pending = Vec::new();
    collect_refs(&root, &mut pending);
    while let Some(def) = pending.pop() {
        if defs.contains_key(&def) {
            continue;
        }
        if let Some(schema) = generator.definitions().get(&def) {
            collect_refs(schema, &mut pending);
            defs.insert(def, schema.clone());
        }
    }
    defs.sort_keys();
    let mut out = Map::new();
    out.insert(
        "$schema".into(),
        json!("https://json-schema.org/draft/2020-12/schema"),
    );
    out.insert("$id".into(), json!(file_name(name)));
    out.insert("title".into(), json!(name));
    out.insert("description".into(), json!(summary));
    if let Some(object) = root.as_object_mut() {
        object.shift_remove("description");
        object.shift_remove("title");
        out.extend(std::mem::take(object));
    }
    if !defs.is_empty() {
        out.insert("$defs".into(), Value::Object(defs));
    }
    Value::Object(out)
}

fn collect_refs(schema: &Value, out: &mut Vec<String>) {
    match schema {
        Value::Object(map) => {
            if let Some(def) = map
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix("#/$defs/"))
            {
                out.push(def.to_owned());
            }
            map.values().for_each(|v| collect_refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

/// How one message's schema is built from the types.
type Build = fn(&mut SchemaGenerator) -> Value;

/// One message of the contract, before its schema is built.
struct Spec {
    name: &'static str,
    role: Role,
    routing_key: &'static str,
    reply: Option<&'static str>,
    summary: &'static str,
    build: Build,
}

const DRAW: &str = amqp::DRAW.routing_key;
const REFILL: &str = amqp::REFILL.routing_key;
const SETTLE: &str = amqp::SETTLE.routing_key;

/// The contract, requests first, then replies, then events. Requests are
/// described as the workers read them, replies and events as they write them.
#[rustfmt::skip]
const SPECS: &[Spec] = &[
    Spec { name: "draw", role: Role::Request, routing_key: DRAW, reply: Some("draw_result"),
        summary: "One draw: a lucky-gift draw, a red-packet grab or a lottery draw, by the pool, packet or activity id.",
        build: |g| typed::<DrawRequest>(g, "draw") },
    Spec { name: "draw.batch", role: Role::Request, routing_key: DRAW, reply: Some("draw_result.batch"),
        summary: "Many draws in one message, each keeping every rule of the single draw it stands for.",
        build: |g| {
            let mut root = typed::<DrawBatch>(g, "draw.batch");
            root["properties"]["requests"]["items"] = batch_entry(g);
            root
        } },
    Spec { name: "lottery.grant", role: Role::Request, routing_key: DRAW, reply: Some("grant_result"),
        summary: "Grants a user chances in a lottery activity (idempotent by grant_id).",
        build: |g| typed::<GrantRequest>(g, "lottery.grant") },
    Spec { name: "redpacket.create", role: Role::Request, routing_key: REFILL, reply: Some("redpacket_result"),
        summary: "Creates a red packet: escrows the total from the sender and splits it into shares.",
        build: |g| typed::<RedPacketCreate>(g, "redpacket.create") },
    Spec { name: "settle", role: Role::Request, routing_key: SETTLE, reply: Some("settle_result"),
        summary: "One ledger movement; upstreams publish top-ups (reason topup), withdrawals and purchases.",
        build: |g| typed::<SettleRequest>(g, "settle") },
    Spec { name: "settle.batch", role: Role::Request, routing_key: SETTLE, reply: Some("settle_result"),
        summary: "Many ledger movements in one message, each applied on its own.",
        build: |g| typed::<SettleBatch>(g, "settle.batch") },
    Spec { name: "refill", role: Role::Internal, routing_key: REFILL, reply: Some("refill_result"),
        summary: "Internal: asks for the batch after a trigger (draw workers, `prizepool pool refill`).",
        build: |g| typed::<RefillRequest>(g, "refill") },
    Spec { name: "lottery.seed", role: Role::Internal, routing_key: REFILL, reply: Some("refill_result"),
        summary: "Internal: asks for the commitment of a lottery activity's current seed period (draw workers, when a draw finds none).",
        build: |g| typed::<RefillRequest>(g, "lottery.seed") },
    Spec { name: "redpacket.expire", role: Role::Internal, routing_key: REFILL, reply: Some("redpacket_result"),
        summary: "Internal: a red packet's expiry timer, through the delay queues.",
        build: |g| typed::<RedPacketExpire>(g, "redpacket.expire") },
    Spec { name: "draw_result", role: Role::Reply, routing_key: "", reply: None,
        summary: "The answer to a draw: status ok with the prizes, or rejected with an error.",
        build: |g| reply::<DrawResult>(g, "draw_result") },
    Spec { name: "draw_result.batch", role: Role::Reply, routing_key: "", reply: None,
        summary: "The answer to a draw.batch: one draw_result per request, in request order.",
        build: |g| {
            let mut root = reply::<DrawResultBatch>(g, "draw_result.batch");
            root["properties"]["results"]["items"] = reply::<DrawResult>(g, "draw_result");
            root
        } },
    Spec { name: "grant_result", role: Role::Reply, routing_key: "", reply: None,
        summary: "The answer to a lottery.grant.",
        build: |g| reply::<GrantResult>(g, "grant_result") },
    Spec { name: "redpacket_result", role: Role::Reply, routing_key: "", reply: None,
        summary: "The answer to a redpacket.create (created or rejected) or a redpacket.expire.",
        build: |g| json!({"oneOf": [
            typed::<CreatedReply>(g, "redpacket_result"),
            refusal::<RejectedReply>(g, "redpacket_result"),
            typed::<ExpireReply>(g, "redpacket_result"),
        ]}) },
    Spec { name: "settle_result", role: Role::Reply, routing_key: "", reply: None,
        summary: "The answer to a settle (its entry_id) or a settle.batch (entries and refused).",
        build: |g| reply::<SettleResult>(g, "settle_result") },
    Spec { name: "refill_result", role: Role::Reply, routing_key: "", reply: None,
        summary: "The answer to a refill.",
        build: |g| reply::<RefillResult>(g, "refill_result") },
    Spec { name: "draw.completed", role: Role::Event, routing_key: "draw.completed", reply: None,
        summary: "A completed draw: its draw_result with type draw.completed and the fleet's seal.",
        build: sealed_event },
    Spec { name: "draw.completed.batch", role: Role::Event, routing_key: "draw.completed", reply: None,
        summary: "Several draw.completed events in one message (DRAW_EVENTS=grouped), under the same routing key.",
        build: |g| {
            let mut root = typed::<DrawCompletedBatch>(g, "draw.completed.batch");
            root["properties"]["events"]["items"] = sealed_event(g);
            root
        } },
    Spec { name: "pool.refilled", role: Role::Event, routing_key: "pool.refilled", reply: None,
        summary: "A lucky-gift batch became drawable; its commitment and composition.",
        build: |g| {
            let mut root = typed::<PoolRefilled>(g, "pool.refilled");
            add_seal(&mut root, "the event's other fields");
            root
        } },
    Spec { name: "redpacket.created", role: Role::Event, routing_key: "redpacket.created", reply: None,
        summary: "A red packet was created.",
        build: |g| typed::<CreatedReply>(g, "redpacket.created") },
    Spec { name: "redpacket.closed", role: Role::Event, routing_key: "redpacket.closed", reply: None,
        summary: "A red packet closed at its expiry; the refund and the revealed split.",
        build: |g| typed::<ClosedEvent>(g, "redpacket.closed") },
];

/// Every message of the wire contract, requests first, with its schema.
pub fn messages() -> Vec<Message> {
    let mut requests = SchemaSettings::draft2020_12()
        .for_deserialize()
        .into_generator();
    let mut replies = SchemaSettings::draft2020_12()
        .for_serialize()
        .into_generator();
    SPECS
        .iter()
        .map(|spec| {
            let generator = match spec.role {
                Role::Request | Role::Internal => &mut requests,
                Role::Reply | Role::Event => &mut replies,
            };
            let root = (spec.build)(generator);
            Message {
                name: spec.name,
                role: spec.role,
                routing_key: spec.routing_key,
                reply: spec.reply,
                summary: spec.summary,
                schema: document(generator, spec.name, spec.summary, root),
            }
        })
        .collect()
}

/// A `draw.batch` entry: a draw request whose `"type":"draw"` may be left out.
fn batch_entry(generator: &mut SchemaGenerator) -> Value {
    let reference = generator.subschema_for::<DrawRequest>().to_value();
    let mut entry = resolve(generator, &reference);
    add_type(&mut entry, "draw", false);
    entry
}

/// A `draw.completed` event: a `draw_result` with its required `seal`.
fn sealed_event(generator: &mut SchemaGenerator) -> Value {
    let mut schema = typed::<DrawResult>(generator, "draw.completed");
    add_seal(&mut schema, "the result");
    schema
}

/// Adds the required last field `seal` the fleet puts on the events the
/// audit records (`crate::audit`): HMAC-SHA256 of `what` as serialised.
fn add_seal(schema: &mut Value, what: &str) {
    schema["properties"]["seal"] = json!({
        "type": "string",
        "pattern": "^[0-9a-f]{64}$",
        "description": format!("HMAC-SHA256 under the fleet's key of {what} as serialised (docs/fairness.md)")
    });
    if let Some(Value::Array(required)) = schema.get_mut("required") {
        required.push(json!("seal"));
    }
}
