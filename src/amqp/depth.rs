//! Queue depths as metrics: `prizepool_queue_messages{queue}` for every work
//! queue and dead-letter queue, read every few seconds by the refill worker
//! (one replica is enough; every replica may), so the dashboard and the
//! alerts need nothing but the workers' own `/metrics`.

use std::time::Duration;

use lapin::{options::QueueDeclareOptions, types::FieldTable, Connection};
use tokio_util::sync::CancellationToken;

/// How often the depths are read.
const EVERY: Duration = Duration::from_secs(5);

/// Reads the depths every [`EVERY`] until `shutdown`, on a connection of
/// its own (reconnecting when it is lost). A failure costs one reading.
pub async fn watch(amqp_url: String, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(EVERY);
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
        if let Err(error) = read(c).await {
            tracing::debug!(%error, "queue depths not read");
        }
    }
    if let Some(c) = conn {
        let _ = c.close(200, "bye".into()).await;
    }
}

async fn read(conn: &Connection) -> anyhow::Result<()> {
    let channel = conn.create_channel().await?;
    for route in super::ROUTES {
        for queue in [route.queue, route.dlq] {
            // Passive: reads the queue's state, never creates it.
            let q = channel
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            metrics::gauge!("prizepool_queue_messages", "queue" => queue)
                .set(f64::from(q.message_count()));
        }
    }
    let _ = channel.close(200, "bye".into()).await;
    Ok(())
}
