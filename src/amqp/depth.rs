//! Queue depths as metrics: `prizepool_queue_messages{queue}` for every
//! queue its caller names (the refill worker names every work queue, draw
//! shard, consumer queue and dead-letter queue), read every few seconds by
//! the refill worker (one replica is enough; every replica may), so the
//! dashboard, the alerts and queue-depth autoscaling need nothing but the
//! workers' own `/metrics`.

use std::time::Duration;

use lapin::{options::QueueDeclareOptions, types::FieldTable, Connection};
use tokio_util::sync::CancellationToken;

/// How often the depths are read.
const EVERY: Duration = Duration::from_secs(5);

/// Reads the depths of `queues` every [`EVERY`] until `shutdown`, on a
/// connection of its own (reconnecting when it is lost). A failure costs
/// one reading; a queue that does not exist (yet) costs only its own.
pub async fn watch(amqp_url: String, queues: Vec<String>, shutdown: CancellationToken) {
    // The first reading comes one period after the start, not at once: by
    // then the workers have declared the queues, and a passive declaration
    // does not meet a queue that is still being declared (the broker closes
    // the channel, and lapin logs that as an error).
    let mut every = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
    let mut conn: Option<Connection> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        if conn.as_ref().is_none_or(|c| !c.status().connected()) {
            conn = super::connect(&amqp_url, "prizepool-depths").await.ok();
        }
        let Some(c) = &conn else { continue };
        if let Err(error) = read(c, &queues).await {
            tracing::debug!(%error, "queue depths not read");
        }
    }
    if let Some(c) = conn {
        let _ = c.close(200, "bye".into()).await;
    }
}

async fn read(conn: &Connection, queues: &[String]) -> anyhow::Result<()> {
    let mut channel = conn.create_channel().await?;
    for queue in queues {
        // Passive: reads the queue's state, never creates it. The broker
        // closes the channel of a passive declaration of a missing queue,
        // so the next queue gets a new one.
        match channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
        {
            Ok(q) => metrics::gauge!("prizepool_queue_messages", "queue" => queue.clone())
                .set(f64::from(q.message_count())),
            Err(error) => {
                tracing::debug!(%error, queue, "queue depth not read");
                channel = conn.create_channel().await?;
            }
        }
    }
    let _ = channel.close(200, "bye".into()).await;
    Ok(())
}
