//! A raw AMQP publisher with a reply queue of its own: for requests whose
//! properties an `RpcClient` would not send, and for counting every reply
//! (a second reply to one request included).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::StreamExt;
use lapin::{
    options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions},
    types::FieldTable,
    BasicProperties, Channel, Connection,
};
use prizepool::amqp;
use serde_json::Value;

use super::TestEnv;

const T: Duration = Duration::from_secs(30);

/// Replies received, with their correlation ids.
pub type Replies = Arc<Mutex<Vec<(Option<String>, Value)>>>;

/// A raw AMQP publisher with a private reply queue of its own, for requests
/// whose properties an `RpcClient` would not send.
pub struct Raw {
    conn: Connection,
    ch: Channel,
    pub reply_queue: String,
    pub replies: Replies,
}

impl Raw {
    /// Every reply received so far, by correlation id (request id), each
    /// copy kept: a request answered twice shows two.
    pub fn by_id(&self) -> std::collections::HashMap<String, Vec<Value>> {
        let mut by_id: std::collections::HashMap<String, Vec<Value>> =
            std::collections::HashMap::new();
        for (corr, reply) in self.replies.lock().unwrap().iter() {
            by_id
                .entry(corr.clone().unwrap_or_default())
                .or_default()
                .push(reply.clone());
        }
        by_id
    }

    pub async fn new(env: &TestEnv) -> Self {
        let (conn, ch) = env.confirm_channel("attacker").await;
        let q = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let reply_queue = q.name().as_str().to_owned();
        let mut consumer = ch
            .basic_consume(
                reply_queue.as_str().into(),
                "attacker".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let replies: Replies = Arc::default();
        let sink = replies.clone();
        tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.next().await {
                let corr = d
                    .properties
                    .correlation_id()
                    .as_ref()
                    .map(|c| c.as_str().to_owned());
                let body = serde_json::from_slice(&d.data)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&d.data).into()));
                sink.lock().unwrap().push((corr, body));
            }
        });
        Self {
            conn,
            ch,
            reply_queue,
            replies,
        }
    }

    /// Properties asking for a reply on this publisher's queue under `corr`.
    pub fn props(&self, corr: &str) -> BasicProperties {
        BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_reply_to(self.reply_queue.as_str().into())
            .with_correlation_id(corr.into())
    }

    pub async fn publish(&self, routing_key: &str, body: &[u8], props: BasicProperties) {
        let confirm = self
            .ch
            .basic_publish(
                amqp::EXCHANGE.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack() && confirm.take_message().is_none());
    }

    /// Publishes every `(routing key, body, correlation id)` with replies
    /// asked, a window of confirms in flight at a time.
    pub async fn publish_all(&self, messages: &[(&str, Vec<u8>, String)]) {
        for chunk in messages.chunks(500) {
            let mut confirms = Vec::with_capacity(chunk.len());
            for (routing_key, body, corr) in chunk {
                confirms.push(
                    self.ch
                        .basic_publish(
                            amqp::EXCHANGE.into(),
                            (*routing_key).into(),
                            BasicPublishOptions {
                                mandatory: true,
                                ..Default::default()
                            },
                            body,
                            self.props(corr),
                        )
                        .await
                        .unwrap(),
                );
            }
            for confirm in confirms {
                let confirm = confirm.await.unwrap();
                assert!(confirm.is_ack() && confirm.take_message().is_none());
            }
        }
    }

    /// The replies received under `corr` so far.
    pub fn replies_to(&self, corr: &str) -> Vec<Value> {
        self.replies
            .lock()
            .unwrap()
            .iter()
            .filter(|(c, _)| c.as_deref() == Some(corr))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Waits for the first reply under `corr`.
    pub async fn reply(&self, corr: &str) -> Value {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            if let Some(r) = self.replies_to(corr).into_iter().next() {
                return r;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no reply to {corr} within {T:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn close(self) {
        let _ = self.ch.close(200, "bye".into()).await;
        let _ = self.conn.close(200, "bye".into()).await;
    }
}
