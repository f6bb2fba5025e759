//! RabbitMQ plumbing: connection, the topology of SPEC §2, publishing with
//! confirms, the shared consume loop and dead-letter tools.
//!
//! Topology, declared idempotently by every worker at start:
//!
//! ```text
//! prizepool (direct) --draw--> prizepool.draw   --dead letters--> prizepool.dlx --> prizepool.draw.dlq
//!                   --refill-> prizepool.refill --dead letters--> prizepool.dlx --> prizepool.refill.dlq
//!                   --settle-> prizepool.settle --dead letters--> prizepool.dlx --> prizepool.settle.dlq
//! prizepool.events (topic): draw.completed, pool.refilled, ...
//! ```

mod consumer;
pub mod dlq;
mod publish;
pub mod rpc;

use anyhow::Context;
use lapin::{
    options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable, LongString},
    Channel, Connection, ConnectionProperties, ExchangeKind,
};

pub use consumer::{publish_dead_letter, run, HandleError, Handler, Outcome};
pub use publish::{Outgoing, Publisher};

/// The request exchange (direct).
pub const EXCHANGE: &str = "prizepool";
/// Where dead letters go (direct, keyed by the source queue's name).
pub const DLX: &str = "prizepool.dlx";
/// Facts for downstream consumers (topic).
pub const EVENTS: &str = "prizepool.events";

/// The draw queue: draws and lottery grants.
pub const DRAW: Route = Route {
    queue: "prizepool.draw",
    routing_key: "draw",
    dlq: "prizepool.draw.dlq",
};
/// The refill queue: refills, red-packet creation and expiry.
pub const REFILL: Route = Route {
    queue: "prizepool.refill",
    routing_key: "refill",
    dlq: "prizepool.refill.dlq",
};
/// The settle queue: ledger entries.
pub const SETTLE: Route = Route {
    queue: "prizepool.settle",
    routing_key: "settle",
    dlq: "prizepool.settle.dlq",
};
/// Every work queue.
pub const ROUTES: [Route; 3] = [DRAW, REFILL, SETTLE];

/// A work queue, its routing key on [`EXCHANGE`], and its dead-letter queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub queue: &'static str,
    pub routing_key: &'static str,
    pub dlq: &'static str,
}

impl Route {
    /// The route of a work queue or of its dead-letter queue, by name.
    pub fn by_queue(name: &str) -> Option<Route> {
        ROUTES
            .into_iter()
            .find(|r| r.queue == name || r.dlq == name)
    }
}

/// Header carrying the error code of a message we dead-lettered.
pub const ERROR_CODE_HEADER: &str = "x-prizepool-error-code";
/// Header carrying the human-readable reason of a message we dead-lettered.
pub const ERROR_HEADER: &str = "x-prizepool-error";

/// Opens a connection named after the process, for the management UI.
pub async fn connect(url: &str, name: &str) -> anyhow::Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name(name.to_owned().into());
    Connection::connect(url, props)
        .await
        .with_context(|| format!("connecting to RabbitMQ at {}", crate::db::redact(url)))
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

/// Declares the whole SPEC §2 topology. Idempotent: every worker calls it at
/// start, with the same arguments (a queue redeclared with other arguments
/// would close the channel).
pub async fn declare_topology(channel: &Channel, delivery_limit: u32) -> anyhow::Result<()> {
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    for (name, kind) in [
        (EXCHANGE, ExchangeKind::Direct),
        (DLX, ExchangeKind::Direct),
        (EVENTS, ExchangeKind::Topic),
    ] {
        channel
            .exchange_declare(name.into(), kind, durable, FieldTable::default())
            .await
            .with_context(|| format!("declaring exchange {name}"))?;
    }
    let queue_opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    for route in ROUTES {
        let mut dlq_args = FieldTable::default();
        dlq_args.insert("x-queue-type".into(), text("quorum"));
        channel
            .queue_declare(route.dlq.into(), queue_opts, dlq_args)
            .await
            .with_context(|| format!("declaring queue {}", route.dlq))?;
        channel
            .queue_bind(
                route.dlq.into(),
                DLX.into(),
                route.queue.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;

        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), text("quorum"));
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(delivery_limit)),
        );
        args.insert("x-dead-letter-exchange".into(), text(DLX));
        args.insert("x-dead-letter-routing-key".into(), text(route.queue));
        // Without these two, RabbitMQ dead-letters at most once and may lose
        // a message the DLQ cannot take.
        args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        args.insert("x-overflow".into(), text("reject-publish"));
        channel
            .queue_declare(route.queue.into(), queue_opts, args)
            .await
            .with_context(|| format!("declaring queue {}", route.queue))?;
        channel
            .queue_bind(
                route.queue.into(),
                EXCHANGE.into(),
                route.routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}
