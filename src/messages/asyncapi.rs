//! The AsyncAPI 2.6 document of the wire contract (`docs/asyncapi.json`),
//! built from the topology's constants and [`super::schema::messages`], so
//! it names exactly the exchanges, routing keys and queues the workers
//! declare. Message payloads refer to the schema files beside it.

use serde_json::{json, Map, Value};

use super::schema::{file_name, messages, Message, Role};
use crate::amqp;

const REPLY_CONVENTION: &str = "A request that carries the AMQP properties reply_to and correlation_id gets exactly one reply, published to the default exchange with routing key = reply_to and the same correlation_id. Direct reply-to works: consume amq.rabbitmq.reply-to (no_ack) on the channel BEFORE publishing the request with reply_to = amq.rabbitmq.reply-to. Publish with publisher confirms and mandatory = true: a confirm with a returned message means the request was unroutable (no queue), which is a failure. A request without reply_to gets no reply. Unknown fields are refused (invalid_request).";

/// An exchange as the AMQP channel binding describes it. No `vhost`: the
/// fleet declares its topology in the vhost `AMQP_URL` names (the server's
/// `vhost` variable), whichever it is.
fn amqp_exchange(name: &str, kind: &str) -> Value {
    json!({"name": name, "type": kind, "durable": true, "autoDelete": false})
}

/// How a reply finds its request. AsyncAPI's `correlationId` locates a
/// field of the application headers or of the payload; the AMQP
/// `correlation_id` is a message property, neither, so it is said here.
const CORRELATION: &str = "Correlated by the AMQP message property correlation_id (a property, like reply_to; not an application header nor a payload field): the reply carries the request's.";

fn message_ref(m: &Message) -> Value {
    json!({"$ref": format!("#/components/messages/{}", m.name)})
}

fn one_of(list: Vec<Value>) -> Value {
    match list.as_slice() {
        [one] => one.clone(),
        _ => json!({"oneOf": list}),
    }
}

/// A request channel: the routing key on exchange `prizepool` and the work
/// queue it reaches.
fn request_channel(route: amqp::Route, all: &[Message]) -> Value {
    let published: Vec<Value> = all
        .iter()
        .filter(|m| {
            m.routing_key == route.routing_key && matches!(m.role, Role::Request | Role::Internal)
        })
        .map(message_ref)
        .collect();
    json!({
        "description": format!(
            "Publish to exchange `{}` with routing key `{}`; the durable quorum queue `{}` holds the requests (dead letters go to exchange `{}` and queue `{}`). Messages marked internal are published by the fleet itself and checked against stored state.",
            amqp::EXCHANGE, route.routing_key, route.queue, amqp::DLX, route.dlq
        ),
        "bindings": {"amqp": {
            "is": "routingKey",
            "exchange": amqp_exchange(amqp::EXCHANGE, "direct"),
            "bindingVersion": "0.2.0"
        }},
        "publish": {
            "operationId": format!("publish_{}", route.routing_key),
            "bindings": {"amqp": {"deliveryMode": 2, "mandatory": true, "bindingVersion": "0.2.0"}},
            "message": one_of(published)
        }
    })
}

/// An event channel: a routing key on the topic exchange `prizepool.events`.
fn event_channel(key: &str, all: &[Message]) -> Value {
    let events: Vec<Value> = all
        .iter()
        .filter(|m| m.role == Role::Event && m.routing_key == key)
        .map(message_ref)
        .collect();
    json!({
        "description": format!("Facts for downstream consumers: bind a queue of your own to the topic exchange `{}` with `{key}` (at-least-once; read `type` to tell single events from batches).", amqp::EVENTS),
        "bindings": {"amqp": {
            "is": "routingKey",
            "exchange": amqp_exchange(amqp::EVENTS, "topic"),
            "bindingVersion": "0.2.0"
        }},
        "subscribe": {
            "operationId": format!("on_{}", key.replace('.', "_")),
            "message": one_of(events)
        }
    })
}

/// The document.
pub fn document() -> Value {
    let all = messages();
    let mut channels = Map::new();
    for route in amqp::ROUTES {
        channels.insert(route.routing_key.into(), request_channel(route, &all));
    }
    let replies: Vec<Value> = all
        .iter()
        .filter(|m| m.role == Role::Reply)
        .map(message_ref)
        .collect();
    channels.insert(
        "amq.rabbitmq.reply-to".into(),
        json!({
            "description": REPLY_CONVENTION,
            "bindings": {"amqp": {"is": "queue", "queue": {"name": "amq.rabbitmq.reply-to", "exclusive": true}, "bindingVersion": "0.2.0"}},
            "subscribe": {"operationId": "on_reply", "bindings": {"amqp": {"ack": false, "bindingVersion": "0.2.0"}}, "message": {"oneOf": replies}}
        }),
    );
    let mut keys: Vec<&str> = all
        .iter()
        .filter(|m| m.role == Role::Event)
        .map(|m| m.routing_key)
        .collect();
    keys.dedup();
    for key in keys {
        channels.insert(key.into(), event_channel(key, &all));
    }
    let mut components = Map::new();
    for m in &all {
        let mut message = json!({
            "name": m.name,
            "title": m.name,
            "summary": m.summary,
            "contentType": "application/json",
            "payload": {"$ref": format!("schema/{}", file_name(m.name))},
            "bindings": {"amqp": {"contentEncoding": "utf-8", "bindingVersion": "0.3.0"}}
        });
        if let Some(reply) = m.reply {
            message["description"] = json!(format!("Answered with `{reply}` when the request carries reply_to and correlation_id. At most 64 KiB. {CORRELATION}"));
        } else if m.role == Role::Reply {
            message["description"] = json!(format!("At most 64 KiB. {CORRELATION}"));
        }
        if m.role == Role::Internal {
            message["tags"] = json!([{"name": "internal"}]);
        }
        components.insert(m.name.into(), message);
    }
    json!({
        "asyncapi": "2.6.0",
        "info": {
            "title": "prizepool",
            "version": env!("CARGO_PKG_VERSION"),
            "description": format!("Prize draws over RabbitMQ: lucky-gift draws, red packets and lottery activities. {REPLY_CONVENTION} JSON bodies are UTF-8, content_type application/json, at most 64 KiB. Numbers: user ids are 0 to 2^63-1, but JavaScript numbers are exact only up to 2^53-1 (Number.MAX_SAFE_INTEGER): keep user_id and amounts below 2^53 from JavaScript. Full rules: docs/protocol.md.")
        },
        "defaultContentType": "application/json",
        "servers": {"rabbitmq": {
            "url": "{host}:{port}/{vhost}",
            "protocol": "amqp",
            "protocolVersion": "0.9.1",
            "description": "The broker and vhost AMQP_URL names (amqps:// for TLS); every worker declares the whole topology in that vhost.",
            "variables": {
                "host": {"default": "127.0.0.1"},
                "port": {"default": "5672", "description": "5671 for amqps"},
                "vhost": {"default": "%2F", "description": "the vhost, URL-encoded (%2F is the default vhost /)"}
            }
        }},
        "channels": Value::Object(channels),
        "components": {"messages": Value::Object(components)}
    })
}
