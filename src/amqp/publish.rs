//! Publishing with confirms.
//!
//! Every publish goes through a channel in confirm mode. Callers publish all
//! the messages a request causes first and wait for their confirms together,
//! so one request costs one confirm round trip however many messages it sends.
//!
//! A confirm is waited for at most [`CONFIRM_TIMEOUT`]. A broker node that
//! loses a quorum queue's leader while a publish is in flight can leave the
//! confirm unanswered for good; a channel whose confirm did not come, or
//! that failed, is marked [`broken`](Publisher::broken), and the consume loop
//! then ends its session and reconnects instead of waiting forever with its
//! deliveries unacked.

use lapin::{
    options::BasicPublishOptions,
    types::{AMQPValue, FieldTable, ShortString},
    BasicProperties, Channel,
};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{EVENTS, EXCHANGE};

/// A message to publish.
#[derive(Clone, Debug)]
pub struct Outgoing {
    pub exchange: String,
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
    /// Unroutable is an error (work messages); events and replies may have no
    /// listener.
    pub mandatory: bool,
}

/// Persistent JSON, stamped with the publishing second (the settle worker's
/// lag is measured from it).
fn json_properties() -> BasicProperties {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_timestamp(now)
}

impl Outgoing {
    /// A work message on the request exchange (`draw`, `refill`, `settle`).
    pub fn work(routing_key: &str, body: &impl Serialize) -> Self {
        Self {
            exchange: EXCHANGE.into(),
            routing_key: routing_key.into(),
            body: serde_json::to_vec(body).unwrap_or_default(),
            properties: json_properties(),
            mandatory: true,
        }
    }

    /// A work message whose JSON body is already serialised.
    pub fn work_raw(routing_key: &str, body: Vec<u8>) -> Self {
        Self {
            exchange: EXCHANGE.into(),
            routing_key: routing_key.into(),
            body,
            properties: json_properties(),
            mandatory: true,
        }
    }

    /// A work message for the refill queue, delivered after about
    /// `remaining_ms` through a delay queue.
    pub fn delayed(remaining_ms: u64, body: &impl Serialize) -> Self {
        Self {
            exchange: String::new(),
            routing_key: super::delay_queue(remaining_ms).into(),
            body: serde_json::to_vec(body).unwrap_or_default(),
            properties: json_properties(),
            mandatory: true,
        }
    }

    /// A dead letter for `route`'s DLQ made of one part of a request (an
    /// entry of a batch), with the reason headers and no reply address: the
    /// rest of the request is answered as usual. The part is cut to fit a
    /// message ([`part_body`]).
    pub fn dead_letter_part(route: super::Route, body: Vec<u8>, code: &str, reason: &str) -> Self {
        let body = part_body(body);
        let mut headers = lapin::types::FieldTable::default();
        for (name, value) in [
            (super::ERROR_CODE_HEADER, code),
            (super::ERROR_HEADER, reason),
        ] {
            headers.insert(
                name.into(),
                lapin::types::AMQPValue::LongString(value.as_bytes().to_vec().into()),
            );
        }
        Self {
            exchange: super::DLX.into(),
            routing_key: route.queue.into(),
            body,
            properties: with_dead_letter_time(json_properties().with_headers(headers)),
            mandatory: true,
        }
    }

    /// A fact on the events exchange (`draw.completed`, `pool.refilled`, …).
    pub fn event(routing_key: &str, body: &serde_json::Value) -> Self {
        Self::event_raw(routing_key, serde_json::to_vec(body).unwrap_or_default())
    }

    /// A fact whose JSON body is already serialised.
    pub fn event_raw(routing_key: &str, body: Vec<u8>) -> Self {
        Self {
            exchange: EVENTS.into(),
            routing_key: routing_key.into(),
            body,
            properties: json_properties(),
            mandatory: false,
        }
    }

    /// A reply to `reply_to`, carrying the request's correlation id.
    pub fn reply(reply_to: &str, correlation_id: Option<&ShortString>, body: Vec<u8>) -> Self {
        let mut properties =
            BasicProperties::default().with_content_type("application/json".into());
        if let Some(id) = correlation_id {
            properties = properties.with_correlation_id(id.clone());
        }
        Self {
            exchange: String::new(),
            routing_key: reply_to.into(),
            body,
            properties,
            mandatory: false,
        }
    }
}

/// A publish failed or was refused by the broker.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("the broker refused (nack) a message for {0}")]
    Nacked(String),
    #[error("no queue is bound for {0} (unroutable)")]
    Unroutable(String),
    #[error("the broker did not confirm a message for {0} within {CONFIRM_TIMEOUT:?}")]
    Unconfirmed(String),
}

/// How long the broker gets to confirm a publish. A healthy cluster confirms
/// in milliseconds, and a quorum queue elects a new leader within seconds;
/// a confirm that takes longer is taken for lost.
pub(crate) const CONFIRM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A channel in confirm mode, shared by the tasks of one worker.
#[derive(Clone, Debug)]
pub struct Publisher {
    channel: Channel,
    /// Cancelled once a publish failed on the channel or its confirm did not
    /// come: the channel can no longer be trusted.
    broken: CancellationToken,
}

impl Publisher {
    /// Puts `channel` in confirm mode.
    pub async fn new(channel: Channel) -> Result<Self, lapin::Error> {
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            channel,
            broken: CancellationToken::new(),
        })
    }

    /// The underlying channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Resolves once the channel failed or lost a confirm; the session that
    /// owns it should end and reconnect.
    pub async fn broken(&self) {
        self.broken.cancelled().await;
    }

    /// Whether the channel failed or lost a confirm.
    pub fn is_broken(&self) -> bool {
        self.broken.is_cancelled() || !self.channel.status().connected()
    }

    /// Publishes every message, in order, then waits for all their confirms,
    /// for at most [`CONFIRM_TIMEOUT`].
    ///
    /// The publishes are handed to the connection together, so they leave in
    /// one write instead of one I/O round per message.
    pub async fn publish_all(&self, messages: Vec<Outgoing>) -> Result<(), PublishError> {
        let first = messages
            .first()
            .map(|m| format!("{}/{}", m.exchange, m.routing_key))
            .unwrap_or_default();
        match tokio::time::timeout(CONFIRM_TIMEOUT, self.publish_and_confirm(messages)).await {
            Ok(Err(PublishError::Amqp(error))) => {
                // The channel or its connection failed: every later publish
                // on it fails too.
                self.broken.cancel();
                Err(PublishError::Amqp(error))
            }
            Ok(result) => result,
            Err(_) => {
                tracing::warn!(
                    to = first,
                    "a publish was not confirmed in time; the channel is given up"
                );
                self.broken.cancel();
                Err(PublishError::Unconfirmed(first))
            }
        }
    }

    async fn publish_and_confirm(&self, messages: Vec<Outgoing>) -> Result<(), PublishError> {
        // `try_join_all` polls the publishes in order, and a publish takes
        // its place on the channel (and its confirm tag) on its first poll.
        let channel = &self.channel;
        let confirms = futures_util::future::try_join_all(messages.into_iter().map(|mut m| {
            // The publishing span's trace goes with the message.
            m.properties = crate::telemetry::with_trace_context(m.properties);
            async move {
                let confirm = channel
                    .basic_publish(
                        m.exchange.as_str().into(),
                        m.routing_key.as_str().into(),
                        BasicPublishOptions {
                            mandatory: m.mandatory,
                            ..BasicPublishOptions::default()
                        },
                        &m.body,
                        m.properties,
                    )
                    .await?;
                Ok::<_, lapin::Error>((m.exchange, m.routing_key, confirm))
            }
        }))
        .await?;
        for (exchange, routing_key, confirm) in confirms {
            let confirmation = confirm.await?;
            if confirmation.is_nack() {
                return Err(PublishError::Nacked(format!("{exchange}/{routing_key}")));
            }
            // An ack that carries a returned message means it went nowhere.
            if confirmation.take_message().is_some() {
                return Err(PublishError::Unroutable(format!(
                    "{exchange}/{routing_key}"
                )));
            }
        }
        Ok(())
    }

    /// Publishes one message and waits for its confirm.
    pub async fn publish(&self, message: Outgoing) -> Result<(), PublishError> {
        self.publish_all(vec![message]).await
    }
}

/// Adds a text header to `properties`.
pub(crate) fn with_header(properties: BasicProperties, name: &str, value: &str) -> BasicProperties {
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(
        name.into(),
        AMQPValue::LongString(value.as_bytes().to_vec().into()),
    );
    properties.with_headers(headers)
}

/// Adds the dead-lettering time header ([`super::DEAD_AT_HEADER`], now)
/// to a dead letter's properties.
pub(crate) fn with_dead_letter_time(properties: BasicProperties) -> BasicProperties {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut headers = properties.headers().clone().unwrap_or_default();
    headers.insert(super::DEAD_AT_HEADER.into(), AMQPValue::Timestamp(now));
    properties.with_headers(headers)
}

/// Reads a text header.
pub(crate) fn header_text(headers: Option<&FieldTable>, name: &str) -> Option<String> {
    match headers?.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        other => Some(format!("{other:?}")),
    }
}

/// `properties` without an `expiration`: a message republished from them
/// (a dead letter) keeps everything else but never expires.
pub(crate) fn without_expiration(properties: &BasicProperties) -> BasicProperties {
    // The properties' fields are private and have setters only, so the copy
    // is rebuilt field by field.
    let mut out = BasicProperties::default();
    if let Some(v) = properties.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = properties.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = properties.headers() {
        out = out.with_headers(v.clone());
    }
    if let Some(v) = properties.delivery_mode() {
        out = out.with_delivery_mode(*v);
    }
    if let Some(v) = properties.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = properties.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = properties.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = properties.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = properties.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = properties.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = properties.user_id() {
        out = out.with_user_id(v.clone());
    }
    if let Some(v) = properties.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = properties.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

/// The body a dead letter keeps of one part of a request (an entry of a
/// batch, written again from its parsed value): the part as written, or,
/// when writing it again made it larger than a message (numbers such as
/// `1e15` come back as `1000000000000000.0`), its first 4 KiB as text in
/// `{"cut":{"bytes":N,"head":"…"}}`. Only an entry refused as bad input can
/// be that large; the batch it came in is never kept whole by the fleet, so
/// the cut keeps every dead letter within the message limit.
pub fn part_body(body: Vec<u8>) -> Vec<u8> {
    if body.len() <= crate::messages::MAX_MESSAGE_BYTES {
        return body;
    }
    let mut end = 4096;
    let text = String::from_utf8_lossy(&body);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    serde_json::to_vec(&serde_json::json!({"cut": {"bytes": body.len(), "head": &text[..end]}}))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry of 13,000 numbers written `1e15` (65 KB) comes back from
    /// its parsed value as 247 KB; its dead letter keeps its head, within
    /// the limit. A part that fits is kept as it is.
    #[test]
    fn a_dead_letter_part_fits_a_message() {
        let numbers = vec!["1e15"; 13_000].join(",");
        let entry = format!(r#"{{"request_id":"r","x":[{numbers}]}}"#);
        assert!(entry.len() <= crate::messages::MAX_MESSAGE_BYTES);
        let value: serde_json::Value = serde_json::from_str(&entry).unwrap();
        let written = serde_json::to_vec(&value).unwrap();
        assert!(written.len() > 3 * crate::messages::MAX_MESSAGE_BYTES);
        let letter = Outgoing::dead_letter_part(
            super::super::DRAW,
            written.clone(),
            "invalid_request",
            "why",
        );
        assert!(letter.body.len() <= 5000, "{}", letter.body.len());
        let cut: serde_json::Value = serde_json::from_slice(&letter.body).unwrap();
        assert_eq!(cut["cut"]["bytes"], written.len());
        assert!(cut["cut"]["head"]
            .as_str()
            .unwrap()
            .starts_with(r#"{"request_id":"r""#));
        let small = br#"{"request_id":"r"}"#.to_vec();
        assert_eq!(part_body(small.clone()), small);
    }

    #[test]
    fn without_expiration_keeps_every_other_property() {
        let mut headers = FieldTable::default();
        headers.insert("h".into(), AMQPValue::LongString(b"v".to_vec().into()));
        let full = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_content_encoding("identity".into())
            .with_headers(headers)
            .with_delivery_mode(2)
            .with_priority(3)
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("1000".into())
            .with_message_id("m".into())
            .with_timestamp(7)
            .with_type("t".into())
            .with_user_id("guest".into())
            .with_app_id("a".into())
            .with_cluster_id("k".into());
        let stripped = without_expiration(&full);
        assert_eq!(stripped.expiration(), &None);
        // Setting the expiration again gives back the original: nothing
        // else was lost.
        assert_eq!(stripped.with_expiration("1000".into()), full);
    }
}
