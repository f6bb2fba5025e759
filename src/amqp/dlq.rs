//! Dead-letter queues: list what is there and why, and move messages back.

use anyhow::Context;
use lapin::{
    options::{
        BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
        QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable},
    Connection,
};
use serde::Serialize;

use super::{publish::header_text, Route, ERROR_CODE_HEADER, ERROR_HEADER};

/// One dead letter, as `prizepool dlq list` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeadLetter {
    /// The message's `type` field, when it has one.
    pub message_type: Option<String>,
    /// Why it is here: our reason header, or the broker's `x-death` reason.
    pub reason: String,
    /// The error code header we set, if we dead-lettered it.
    pub code: Option<String>,
    /// The body, cut to 200 characters.
    pub body: String,
}

fn describe(data: &[u8], headers: Option<&FieldTable>) -> DeadLetter {
    let text = String::from_utf8_lossy(data);
    let message_type = serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned));
    let reason = header_text(headers, ERROR_HEADER)
        .or_else(|| death_reason(headers))
        .unwrap_or_else(|| "unknown".into());
    DeadLetter {
        message_type,
        reason,
        code: header_text(headers, ERROR_CODE_HEADER),
        body: text.chars().take(200).collect(),
    }
}

/// The broker's reason from the first `x-death` entry (`delivery_limit`, `rejected`, …).
fn death_reason(headers: Option<&FieldTable>) -> Option<String> {
    let AMQPValue::FieldArray(deaths) = headers?.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    header_text(Some(first), "reason").map(|r| format!("broker: {r}"))
}

/// Lists up to `limit` dead letters of `route` without removing them: they
/// are fetched unacknowledged and return to the queue when the channel closes.
pub async fn list(
    conn: &Connection,
    route: Route,
    limit: usize,
) -> anyhow::Result<Vec<DeadLetter>> {
    let channel = conn.create_channel().await?;
    let mut out = Vec::new();
    while out.len() < limit {
        let Some(msg) = channel
            .basic_get(route.dlq.into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        out.push(describe(
            &msg.delivery.data,
            msg.delivery.properties.headers().as_ref(),
        ));
    }
    channel.close(200, "listed".into()).await?;
    Ok(out)
}

/// What a replay did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Replay {
    /// Messages moved back to the work queue (0 on a dry run).
    pub moved: usize,
    /// Messages the dead-letter queue held when the replay began.
    pub found: usize,
    /// The messages concerned.
    pub messages: Vec<DeadLetter>,
}

/// Messages ready in `queue` now (a passive declare: nothing is created).
async fn ready_messages(conn: &Connection, queue: &str) -> anyhow::Result<usize> {
    // A passive declare of a missing queue closes its channel, so it gets
    // one of its own.
    let channel = conn.create_channel().await?;
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("looking up {queue}"))?;
    let _ = channel.close(200, "counted".into()).await;
    Ok(declared.message_count() as usize)
}

/// Messages ready in `queue` once the count holds still: messages another
/// client just released (a `dlq list` closing its channel) return to the
/// queue a moment later, and a count taken meanwhile would miss them.
async fn settled_count(conn: &Connection, queue: &str) -> anyhow::Result<usize> {
    let mut last = ready_messages(conn, queue).await?;
    for _ in 0..20 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let now = ready_messages(conn, queue).await?;
        if now == last {
            break;
        }
        last = now;
    }
    Ok(last)
}

/// Moves up to `limit` dead letters of `route` back to its work queue,
/// keeping their properties and headers. Each one is acked on the DLQ only
/// after the broker confirmed its republication. A dry run only lists.
///
/// A replay moves at most the messages the DLQ held when it began, then
/// ends: a replayed message that fails again is dead-lettered behind them,
/// and taking it once more would loop for as long as it keeps failing.
pub async fn replay(
    conn: &Connection,
    route: Route,
    limit: usize,
    dry_run: bool,
) -> anyhow::Result<Replay> {
    let found = settled_count(conn, route.dlq).await?;
    let limit = limit.min(found);
    if dry_run {
        let messages = list(conn, route, limit).await?;
        return Ok(Replay {
            moved: 0,
            found,
            messages,
        });
    }
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut report = Replay {
        found,
        ..Replay::default()
    };
    while report.moved < limit {
        let Some(msg) = channel
            .basic_get(route.dlq.into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        let delivery = msg.delivery;
        // Straight to the work queue through the default exchange: a dead
        // letter goes back to the one queue that refused it, never through
        // an exchange that would also copy it to other consumers (the
        // events exchange feeds the audit queue and any downstream one).
        let confirm = channel
            .basic_publish(
                "".into(),
                route.queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &delivery.data,
                delivery.properties.clone(),
            )
            .await?
            .await?;
        if confirm.is_nack() || confirm.take_message().is_some() {
            anyhow::bail!(
                "the broker did not take the replayed message (is {} declared?)",
                route.queue
            );
        }
        delivery.ack(BasicAckOptions::default()).await?;
        report.moved += 1;
        report.messages.push(describe(
            &delivery.data,
            delivery.properties.headers().as_ref(),
        ));
    }
    channel.close(200, "replayed".into()).await?;
    Ok(report)
}
