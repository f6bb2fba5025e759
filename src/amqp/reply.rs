//! Replies leave on a connection of their own.
//!
//! A reply goes to the requester's `reply_to`, usually a direct reply-to
//! address (`amq.rabbitmq.reply-to.…`) that names the requester's connection
//! and the cluster node it lives on. When that node is down, RabbitMQ 3.10's
//! channel crashes on the publish and the broker closes the whole
//! connection with `INTERNAL_ERROR`. Were replies sent on the consuming
//! connection, every redelivery of the request would crash it again: one
//! requester lost with its node would wedge the worker. So replies are
//! published on a separate connection, and a reply that crashes fresh
//! connections again and again is given up: its requester is gone, and its
//! answer is stored with the request, so sending the same id again replays it.
//!
//! Only the first attempt uses the shared connection; retries each open a
//! connection of their own, so a reply that cannot be delivered never takes
//! other requesters' replies down with it more than once.

use std::sync::Arc;

use lapin::Connection;
use tokio::sync::Mutex;

use super::publish::{Outgoing, Publisher};

/// Attempts on fresh connections after the shared one failed.
const RETRIES: usize = 2;

/// How long a reply's confirm may take before its connection is given up
/// on (a node going down can leave a confirm unanswered).
const CONFIRM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Sends replies on a connection of their own; cheap to clone.
#[derive(Clone, Debug)]
pub struct Replier {
    url: Arc<str>,
    name: Arc<str>,
    shared: Arc<Mutex<Option<Arc<Link>>>>,
}

/// One reply connection and its confirming channel.
#[derive(Debug)]
struct Link {
    conn: Connection,
    publisher: Publisher,
}

/// What became of a reply.
#[derive(Debug, PartialEq, Eq)]
pub enum Sent {
    /// The broker confirmed it.
    Confirmed,
    /// Every attempt failed: the requester (or the broker) is unreachable.
    GivenUp,
}

impl Replier {
    /// A replier connecting to `url` (any node of the list) on first use.
    pub fn new(url: &str, name: &str) -> Self {
        Self {
            url: url.into(),
            name: format!("{name}-replies").into(),
            shared: Arc::new(Mutex::new(None)),
        }
    }

    /// Publishes `replies` and waits for their confirms. If the shared
    /// connection fails, each reply is tried alone on connections of its
    /// own, so one reply that cannot be delivered costs the others nothing;
    /// [`Sent::GivenUp`] when at least one was given up.
    pub async fn send(&self, replies: Vec<Outgoing>) -> Sent {
        if replies.is_empty() {
            return Sent::Confirmed;
        }
        match self.shared_link().await {
            Ok(link) => {
                match tokio::time::timeout(
                    CONFIRM_TIMEOUT,
                    link.publisher.publish_all(replies.clone()),
                )
                .await
                {
                    Ok(Ok(())) => return Sent::Confirmed,
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "a reply failed on the shared reply connection");
                    }
                    Err(_) => tracing::warn!(
                        "a reply was not confirmed in time on the shared reply connection"
                    ),
                }
                self.forget(&link).await;
            }
            Err(error) => tracing::warn!(error = format!("{error:#}"), "no reply connection"),
        }
        let mut sent = Sent::Confirmed;
        for reply in replies {
            if !self.alone(reply).await {
                metrics::counter!("prizepool_replies_given_up_total").increment(1);
                sent = Sent::GivenUp;
            }
        }
        sent
    }

    /// Tries one reply on connections of its own; whether it was confirmed.
    async fn alone(&self, reply: Outgoing) -> bool {
        for _ in 0..RETRIES {
            match self.on_own_connection(vec![reply.clone()]).await {
                Ok(()) => return true,
                Err(error) => tracing::warn!(
                    error = format!("{error:#}"),
                    to = reply.routing_key,
                    "a reply failed on a connection of its own"
                ),
            }
        }
        false
    }

    async fn shared_link(&self) -> anyhow::Result<Arc<Link>> {
        let mut shared = self.shared.lock().await;
        if let Some(link) = shared.as_ref() {
            if link.conn.status().connected() {
                return Ok(link.clone());
            }
        }
        let conn = super::connect(&self.url, &self.name).await?;
        let publisher = super::bounded("opening the reply channel", async {
            Publisher::new(conn.create_channel().await?).await
        })
        .await?;
        let link = Arc::new(Link { conn, publisher });
        *shared = Some(link.clone());
        Ok(link)
    }

    /// Drops the shared connection if it is still `failed`, so the next
    /// reply opens a new one.
    async fn forget(&self, failed: &Arc<Link>) {
        let mut shared = self.shared.lock().await;
        if shared.as_ref().is_some_and(|l| Arc::ptr_eq(l, failed)) {
            *shared = None;
            let _ = super::bounded(
                "closing a reply connection",
                failed.conn.close(200, "replaced".into()),
            )
            .await;
        }
    }

    async fn on_own_connection(&self, replies: Vec<Outgoing>) -> anyhow::Result<()> {
        let conn = super::connect(&self.url, &self.name).await?;
        let result = tokio::time::timeout(CONFIRM_TIMEOUT, async {
            let publisher = Publisher::new(conn.create_channel().await?).await?;
            publisher.publish_all(replies).await?;
            anyhow::Ok(())
        })
        .await
        .unwrap_or_else(|_| Err(anyhow::anyhow!("no confirm within {CONFIRM_TIMEOUT:?}")));
        let _ = super::bounded(
            "closing a reply connection",
            conn.close(200, "reply sent".into()),
        )
        .await;
        result
    }
}
