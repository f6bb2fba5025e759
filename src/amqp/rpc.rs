//! A request/reply client over RabbitMQ's direct reply-to, for the CLI, the
//! demo, the benchmark and tests. Many calls may be in flight at once; replies
//! are matched to callers by correlation id.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context;
use futures_util::StreamExt;
use lapin::{
    options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions},
    types::FieldTable,
    BasicProperties, Channel, Connection,
};
use serde_json::Value;
use tokio::sync::oneshot;

use super::EXCHANGE;

/// RabbitMQ's direct reply-to pseudo-queue.
pub(crate) const REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// Starts consuming direct replies on `channel`. RabbitMQ wants the
/// consume on the channel that publishes the requests, before the first of
/// them; no queue is declared or left behind.
pub(crate) async fn consume_replies(channel: &Channel) -> anyhow::Result<lapin::Consumer> {
    channel
        .basic_consume(
            REPLY_TO.into(),
            "prizepool-client".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .context("consuming direct replies")
}

type Waiters = Arc<Mutex<HashMap<String, oneshot::Sender<Vec<u8>>>>>;

/// How long the broker gets to confirm a request.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection that publishes requests and awaits their replies.
#[derive(Debug)]
pub struct RpcClient {
    conn: Connection,
    channel: Channel,
    waiters: Waiters,
    /// Cancelled once the reply consumer ended (the broker cancelled it, or
    /// the channel or connection closed): no reply can arrive any more, so
    /// calls fail at once and the caller reconnects.
    deaf: tokio_util::sync::CancellationToken,
}

impl RpcClient {
    /// Connects, declares the topology (so requests are routable before any
    /// worker started) and starts listening for replies.
    pub async fn connect(config: &crate::config::Config) -> anyhow::Result<Self> {
        let conn = super::connect(&config.amqp_url, "prizepool-client").await?;
        let channel = conn.create_channel().await?;
        super::declare_topology_for(&channel, config).await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let mut consumer = consume_replies(&channel).await?;
        let waiters: Waiters = Arc::default();
        let routes = waiters.clone();
        let deaf = tokio_util::sync::CancellationToken::new();
        let deafened = deaf.clone();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let Some(id) = delivery.properties.correlation_id() else {
                    continue;
                };
                let waiter = routes.lock().ok().and_then(|mut w| w.remove(id.as_str()));
                if let Some(tx) = waiter {
                    let _ = tx.send(delivery.data);
                }
            }
            // Every caller still waiting learns it now (its sender is
            // dropped), not when its own timeout ends.
            deafened.cancel();
            if let Ok(mut w) = routes.lock() {
                w.clear();
            }
        });
        Ok(Self {
            conn,
            channel,
            waiters,
            deaf,
        })
    }

    /// Whether the client can still publish and hear replies; a client that
    /// cannot is to be dropped and connected again.
    pub fn is_usable(&self) -> bool {
        !self.deaf.is_cancelled()
            && self.conn.status().connected()
            && self.channel.status().connected()
    }

    /// Publishes with `mandatory` and waits, for at most
    /// [`CONFIRM_TIMEOUT`], for the broker to confirm that a queue took it.
    async fn publish_confirmed(
        &self,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> anyhow::Result<()> {
        let confirm = tokio::time::timeout(CONFIRM_TIMEOUT, async {
            self.channel
                .basic_publish(
                    EXCHANGE.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    body,
                    props,
                )
                .await?
                .await
        })
        .await
        .map_err(|_| anyhow::anyhow!("the broker did not confirm within {CONFIRM_TIMEOUT:?}"))??;
        if confirm.is_nack() || confirm.take_message().is_some() {
            anyhow::bail!(
                "the broker did not accept the message (is a worker's topology declared?)"
            );
        }
        Ok(())
    }

    /// Publishes `body` to the `prizepool` exchange with `routing_key` and
    /// waits up to `timeout` for the reply.
    pub async fn call(
        &self,
        routing_key: &str,
        body: &Value,
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        self.call_raw(routing_key, &serde_json::to_vec(body)?, timeout)
            .await
    }

    /// Like [`call`](Self::call) with a body sent as is (which may be invalid on purpose).
    pub async fn call_raw(
        &self,
        routing_key: &str,
        body: &[u8],
        timeout: Duration,
    ) -> anyhow::Result<Value> {
        let reply = self.request(routing_key, body, timeout).await?;
        serde_json::from_slice(&reply).context("the reply is not JSON")
    }

    /// Publishes `body` as is and returns the reply's body unparsed, for a
    /// caller that reads only a few of its fields (the benchmark).
    pub async fn request(
        &self,
        routing_key: &str,
        body: &[u8],
        timeout: Duration,
    ) -> anyhow::Result<Vec<u8>> {
        let id = ulid::Ulid::new().to_string();
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .map_err(|_| anyhow::anyhow!("reply table poisoned"))?
            .insert(id.clone(), tx);
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_reply_to(REPLY_TO.into())
            .with_correlation_id(id.as_str().into());
        if !self.is_usable() {
            if let Ok(mut w) = self.waiters.lock() {
                w.remove(&id);
            }
            anyhow::bail!("the connection to the broker is gone");
        }
        if let Err(error) = self.publish_confirmed(routing_key, body, props).await {
            if let Ok(mut w) = self.waiters.lock() {
                w.remove(&id);
            }
            return Err(error);
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => anyhow::bail!("the reply consumer ended before the reply came"),
            Err(_) => {
                if let Ok(mut w) = self.waiters.lock() {
                    w.remove(&id);
                }
                anyhow::bail!("no reply within {timeout:?}")
            }
        }
    }

    /// Publishes without waiting for a reply (fire and forget, but confirmed).
    pub async fn send(&self, routing_key: &str, body: &Value) -> anyhow::Result<()> {
        self.publish_confirmed(
            routing_key,
            &serde_json::to_vec(body)?,
            BasicProperties::default()
                .with_content_type("application/json".into())
                .with_delivery_mode(2),
        )
        .await
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = super::bounded("closing the channel", self.channel.close(200, "bye".into())).await;
        let _ = super::bounded("closing the connection", self.conn.close(200, "bye".into())).await;
    }
}
