//! RabbitMQ plumbing: connection, the topology of SPEC §2, publishing with
//! confirms, the shared consume loop (with coalesced acks and grouped
//! messages) and dead-letter tools. It knows bytes, routes and groups; what
//! the messages mean belongs to the workers.
//!
//! Topology, declared idempotently by every worker at start:
//!
//! ```text
//! prizepool (direct) --draw--> prizepool.draw   --dead letters--> prizepool.dlx --> prizepool.draw.dlq
//!                   --refill-> prizepool.refill --dead letters--> prizepool.dlx --> prizepool.refill.dlq
//!                   --settle-> prizepool.settle --dead letters--> prizepool.dlx --> prizepool.settle.dlq
//! prizepool.events (topic): draw.completed, pool.refilled, ...
//! ```
//!
//! With `DRAW_SHARDS = N > 1` the key `draw` no longer goes straight to
//! `prizepool.draw`: it goes to the exchange `prizepool.draw.shards`
//! (`x-random`, from the `rabbitmq_random_exchange` plugin that ships with
//! RabbitMQ), bound behind `prizepool`, which puts each request on one of N
//! quorum queues, `prizepool.draw` (shard 0), `prizepool.draw.1` …
//! `prizepool.draw.<N-1>`, whose leaders the broker spreads over the
//! cluster's nodes. Every draw worker consumes all of them; every shard
//! dead-letters to `prizepool.draw.dlq`. Upstreams still publish to
//! `prizepool` with key `draw`: the wire contract does not change.
//!
//! ```text
//! prizepool --draw--> prizepool.draw.shards (x-random) --> prizepool.draw | prizepool.draw.1 | …
//! ```

pub mod acks;
mod consumer;
pub mod depth;
pub mod dlq;
pub mod grouped;
mod publish;
mod reply;
pub mod rpc;
mod transient;

use anyhow::Context;

use crate::config::Config;
use lapin::{
    options::{
        ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
        QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable, LongString},
    Channel, Connection, ConnectionProperties, ExchangeKind,
};

pub use acks::Settle;
pub use consumer::{
    publish_dead_letter, publish_dead_letter_as, publish_dead_letter_part, release_slot, run,
    run_batches, Batch, BatchHandler, BatchLimits, Handler, Outcome, SpanFields,
};
pub use grouped::Group;
pub use publish::{part_body, Outgoing, Publisher};
pub use reply::{Replier, Sent};
pub use transient::HandleError;

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

pub use crate::config::MAX_DRAW_SHARDS;

/// The exchange that spreads routing key `draw` over the draw shards when
/// `DRAW_SHARDS` > 1 (type `x-random`: each message goes to one bound
/// queue, picked at random, whatever properties it carries).
pub const DRAW_SPREAD: &str = "prizepool.draw.shards";

/// The queue of draw shard `k`: shard 0 is `prizepool.draw` itself, so one
/// shard is exactly the unsharded topology.
pub fn draw_shard(k: u16) -> String {
    if k == 0 {
        DRAW.queue.to_owned()
    } else {
        format!("{}.{k}", DRAW.queue)
    }
}

/// A work queue, its routing key on [`EXCHANGE`], and its dead-letter queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub queue: &'static str,
    pub routing_key: &'static str,
    pub dlq: &'static str,
}

/// Delay queues, one fixed TTL each (a queue-wide TTL keeps expiry FIFO, so a
/// long delay never holds up a short one). Expired messages dead-letter to
/// [`EXCHANGE`] with routing key `refill`. A message that must wait longer
/// than a tier is sent through the largest tier that fits and re-delayed on
/// arrival until its time has come.
pub const DELAY_TIERS: [(&str, u64); 6] = [
    ("prizepool.delay.1s", 1_000),
    ("prizepool.delay.10s", 10_000),
    ("prizepool.delay.1m", 60_000),
    ("prizepool.delay.10m", 600_000),
    ("prizepool.delay.1h", 3_600_000),
    ("prizepool.delay.6h", 21_600_000),
];

/// The delay queue for a message due in `remaining_ms`: the largest tier
/// that does not overshoot, or the shortest one.
pub fn delay_queue(remaining_ms: u64) -> &'static str {
    DELAY_TIERS
        .iter()
        .rev()
        .find(|(_, ttl)| *ttl <= remaining_ms)
        .map_or(DELAY_TIERS[0].0, |(name, _)| name)
}

/// How long a delivery handed back after a transient failure waits in its
/// queue's retry queue before it returns (see [`retry_queue`]).
pub const RETRY_DELAY: std::time::Duration = std::time::Duration::from_secs(1);

/// The retry queue of `route`'s queue, `<queue>.retry`: a quorum queue
/// whose messages wait [`RETRY_DELAY`] and then return to `<queue>` (through
/// the default exchange, dead-lettered at least once). A consumer hands a
/// delivery back there when a dependency stays away, so the delivery frees
/// its slot meanwhile and its returns do not count towards the queue's
/// delivery limit.
pub fn retry_queue(route: Route) -> String {
    format!("{}.retry", route.queue)
}

/// Declares `route`'s retry queue ([`retry_queue`]). Idempotent; every
/// consumer of `route` declares it before it consumes.
pub(crate) async fn declare_retry_queue(channel: &Channel, route: Route) -> anyhow::Result<()> {
    let name = retry_queue(route);
    let mut args = quorum();
    args.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(RETRY_DELAY.as_millis() as i64),
    );
    args.insert("x-dead-letter-exchange".into(), text(""));
    args.insert("x-dead-letter-routing-key".into(), text(route.queue));
    args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
    args.insert("x-overflow".into(), text("reject-publish"));
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(name.as_str().into(), options, args)
        .await
        .with_context(|| format!("declaring queue {name}"))?;
    Ok(())
}

/// Header of a handed-back copy (see [`retry_queue`]): how many times the
/// request was handed back.
pub const RETRIES_HEADER: &str = "x-prizepool-retries";
/// Header of a handed-back copy: since when (unix milliseconds) the request
/// has been failing.
pub const FAILING_SINCE_HEADER: &str = "x-prizepool-failing-since";

/// Header carrying the error code of a message we dead-lettered.
pub const ERROR_CODE_HEADER: &str = "x-prizepool-error-code";
/// Header carrying the human-readable reason of a message we dead-lettered.
pub const ERROR_HEADER: &str = "x-prizepool-error";
/// Header carrying when we dead-lettered a message (Unix seconds, an AMQP
/// timestamp): `prizepool dlq` filters by age on it (or on the broker's
/// `x-death` time for messages the broker dead-lettered).
pub const DEAD_AT_HEADER: &str = "x-prizepool-dead-lettered-at";

/// How long the broker gets for a frame-level operation: an ack, a cancel, a
/// qos round trip, a close.
///
/// lapin 4 can leave such a call pending for good when the channel dies
/// under it: an ack queued just as the connection is closed (a node that is
/// stopping closes it) is dropped without resolving its promise. Before
/// this bound, the settle worker waited on such an ack forever, its
/// consumer gone with the connection and its queue filling up unseen, and
/// the shared loop's acker stopped acking for the whole session.
pub(crate) const BROKER_OP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs a frame-level broker operation for at most [`BROKER_OP_TIMEOUT`].
pub(crate) async fn bounded<T>(
    what: &'static str,
    op: impl std::future::Future<Output = lapin::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(BROKER_OP_TIMEOUT, op).await {
        Ok(result) => result.context(what),
        Err(_) => anyhow::bail!("{what}: no answer from the broker within {BROKER_OP_TIMEOUT:?}"),
    }
}

/// How long one node gets to open a connection.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The broker addresses of `AMQP_URL`: one URL, or several separated by
/// commas (the nodes of one RabbitMQ cluster, each a full URL with its
/// credentials and vhost).
pub fn addresses(url: &str) -> Vec<&str> {
    url.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .collect()
}

/// Opens a connection named after the process, for the management UI, to
/// a live node of `url` ([`addresses`]), trying them in random order so the
/// fleet spreads over the cluster and a stopped node only costs a failed
/// attempt. Every reconnect calls this again, so a worker whose node is lost
/// moves to another one.
///
/// `amqps://` URLs use TLS with the configured CA bundle and client
/// certificate ([`crate::config::TlsFiles::current`]) and never fall back to
/// plain TCP: a failed handshake is a failed connection.
pub async fn connect(url: &str, name: &str) -> anyhow::Result<Connection> {
    use rand::seq::SliceRandom;
    let mut nodes = addresses(url);
    anyhow::ensure!(!nodes.is_empty(), "AMQP_URL names no broker");
    nodes.shuffle(&mut rand::rng());
    let mut failures = Vec::new();
    for node in nodes {
        // A node that is stopping may take the TCP connection and never
        // finish the handshake: bounded, so the next node gets its turn.
        match tokio::time::timeout(CONNECT_TIMEOUT, connect_one(node, name)).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) => failures.push(format!("{e:#}")),
            Err(_) => failures.push(format!("no handshake within {CONNECT_TIMEOUT:?}")),
        }
    }
    anyhow::bail!("no broker node answered: {}", failures.join("; "))
}

async fn connect_one(url: &str, name: &str) -> anyhow::Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name(name.to_owned().into());
    let tls = crate::config::TlsFiles::current()
        .amqp()
        .context("loading the TLS files for RabbitMQ")?;
    let runtime = lapin::runtime::default_runtime()?;
    Connection::connect_with_config(url, props, tls, runtime)
        .await
        .with_context(|| format!("connecting to RabbitMQ at {}", crate::db::redact(url)))
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

/// Arguments of every quorum queue. Where a new queue's leader goes is left
/// to the broker's `queue_leader_locator` setting (`balanced` spreads the
/// leaders of a cluster's queues over its nodes; `docs/operations.md`):
/// RabbitMQ checks `x-queue-leader-locator` for equivalence, so setting it
/// here would make every queue declared without it refuse the fleet.
fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), text("quorum"));
    args
}

/// Routes key `draw` to the draw shards: straight to `prizepool.draw` for
/// one shard, through [`DRAW_SPREAD`] for more.
///
/// The old route is removed before the new one is added: in between, a
/// request is unroutable (its publisher's confirm says so and it sends
/// again) rather than delivered to two queues and answered twice.
async fn declare_draw_routing(
    channel: &Channel,
    delivery_limit: u32,
    draw_shards: u16,
) -> anyhow::Result<()> {
    if draw_shards <= 1 {
        // Deleting an exchange that does not exist is a no-op; deleting the
        // spread takes its bindings (to the shards and from `prizepool`)
        // with it. Queues of a larger DRAW_SHARDS stay, and the workers keep
        // consuming them until they are deleted (docs/operations.md).
        channel
            .exchange_delete(DRAW_SPREAD.into(), ExchangeDeleteOptions::default())
            .await
            .with_context(|| format!("deleting exchange {DRAW_SPREAD}"))?;
        channel
            .queue_bind(
                DRAW.queue.into(),
                EXCHANGE.into(),
                DRAW.routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        return Ok(());
    }
    for k in 1..draw_shards {
        let mut args = work_queue_args(delivery_limit, DRAW.queue);
        // New queues, so no older declaration to contradict: their leaders
        // go to the node with the fewest, spreading the shards.
        args.insert("x-queue-leader-locator".into(), text("balanced"));
        declare_work_queue(channel, &draw_shard(k), args, delivery_limit).await?;
    }
    channel
        .exchange_declare(
            DRAW_SPREAD.into(),
            ExchangeKind::Custom("x-random".into()),
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            anyhow::Error::new(Misconfigured(format!(
                "DRAW_SHARDS={draw_shards} needs the exchange type x-random, from the \
                 rabbitmq_random_exchange plugin (rabbitmq-plugins enable \
                 rabbitmq_random_exchange), but the broker refused it: {e}"
            )))
        })?;
    for k in 0..draw_shards {
        channel
            .queue_bind(
                draw_shard(k).as_str().into(),
                DRAW_SPREAD.into(),
                DRAW.routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    channel
        .queue_unbind(
            DRAW.queue.into(),
            EXCHANGE.into(),
            DRAW.routing_key.into(),
            FieldTable::default(),
        )
        .await?;
    channel
        .exchange_bind(
            DRAW_SPREAD.into(),
            EXCHANGE.into(),
            DRAW.routing_key.into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(())
}

/// The queues a worker of `route` consumes: the route's queue and, for the
/// draw route, every draw shard: the `shards` configured, and any further
/// one a larger `DRAW_SHARDS` left behind (found by a passive declare, so a
/// request already on it is still answered). Every shard number up to
/// [`MAX_DRAW_SHARDS`] is probed: an operator who deleted some of the
/// shards left behind (the empty ones) may have kept a higher one that
/// still holds requests.
pub(crate) async fn consumed_queues(
    conn: &Connection,
    route: Route,
    shards: u16,
) -> anyhow::Result<Vec<String>> {
    if route != DRAW {
        return Ok(vec![route.queue.to_owned()]);
    }
    let mut queues: Vec<String> = (0..shards.max(1)).map(draw_shard).collect();
    for k in shards.max(1)..MAX_DRAW_SHARDS {
        // A passive declare of a missing queue closes its channel: one
        // channel per probe.
        let probe = conn.create_channel().await?;
        let found = probe
            .queue_declare(
                draw_shard(k).as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok();
        if !found {
            // The broker closed the probe's channel; a gap, not the end.
            continue;
        }
        let _ = bounded("closing a probe", probe.close(200, "probed".into())).await;
        queues.push(draw_shard(k));
    }
    Ok(queues)
}

/// A setting the broker contradicts: retrying cannot help, so the worker
/// stops and says which setting.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Misconfigured(pub String);

/// Declares the whole SPEC §2 topology with one draw queue (`DRAW_SHARDS`
/// = 1). Idempotent: every worker calls it at start, with the same arguments
/// (a queue redeclared with other arguments would close the channel).
pub async fn declare_topology(channel: &Channel, delivery_limit: u32) -> anyhow::Result<()> {
    declare(channel, delivery_limit, 1).await
}

/// Declares the topology for `config`: [`declare_topology`] with its
/// `DRAW_SHARDS`. Every process of a fleet must use the same value: one
/// that declares one shard takes the spreading exchange away.
pub async fn declare_topology_for(channel: &Channel, config: &Config) -> anyhow::Result<()> {
    declare(channel, config.delivery_limit, config.draw_shards).await
}

/// The arguments of a work queue: quorum, the delivery limit, and
/// at-least-once dead-lettering to [`DLX`] under `dead_letter_key`.
fn work_queue_args(delivery_limit: u32, dead_letter_key: &str) -> FieldTable {
    let mut args = quorum();
    args.insert(
        "x-delivery-limit".into(),
        AMQPValue::LongLongInt(i64::from(delivery_limit)),
    );
    args.insert("x-dead-letter-exchange".into(), text(DLX));
    args.insert("x-dead-letter-routing-key".into(), text(dead_letter_key));
    // Without these two, RabbitMQ dead-letters at most once and may lose
    // a message the DLQ cannot take.
    args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
    args.insert("x-overflow".into(), text("reject-publish"));
    args
}

/// Declares a work queue, naming `DELIVERY_LIMIT` when the broker's queue
/// disagrees with it.
async fn declare_work_queue(
    channel: &Channel,
    queue: &str,
    args: FieldTable,
    delivery_limit: u32,
) -> anyhow::Result<()> {
    let queue_opts = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), queue_opts, args)
        .await
        .map_err(|e| {
            let text = e.to_string();
            if text.contains("x-delivery-limit") {
                anyhow::Error::new(Misconfigured(format!(
                    "DELIVERY_LIMIT={delivery_limit} disagrees with queue {queue} as the broker \
                     declared it ({text}): set DELIVERY_LIMIT to the queues' value, or \
                     delete and redeclare the queues"
                )))
            } else {
                anyhow::Error::new(e).context(format!("declaring queue {queue}"))
            }
        })?;
    Ok(())
}

async fn declare(channel: &Channel, delivery_limit: u32, draw_shards: u16) -> anyhow::Result<()> {
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
        channel
            .queue_declare(route.dlq.into(), queue_opts, quorum())
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
        declare_work_queue(
            channel,
            route.queue,
            work_queue_args(delivery_limit, route.queue),
            delivery_limit,
        )
        .await?;
        if route == DRAW {
            declare_draw_routing(channel, delivery_limit, draw_shards).await?;
            continue;
        }
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
    for (name, ttl) in DELAY_TIERS {
        let mut args = quorum();
        args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl as i64));
        args.insert("x-dead-letter-exchange".into(), text(EXCHANGE));
        args.insert("x-dead-letter-routing-key".into(), text(REFILL.routing_key));
        args.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        args.insert("x-overflow".into(), text("reject-publish"));
        channel
            .queue_declare(name.into(), queue_opts, args)
            .await
            .with_context(|| format!("declaring queue {name}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amqp_url_may_list_the_nodes_of_a_cluster() {
        assert_eq!(addresses("amqp://a/%2f"), vec!["amqp://a/%2f"]);
        assert_eq!(
            addresses(" amqp://u:p@a:5672/v , amqps://u:p@b:5671/v,,"),
            vec!["amqp://u:p@a:5672/v", "amqps://u:p@b:5671/v"]
        );
        assert!(addresses(" , ").is_empty());
    }

    #[test]
    fn delays_pick_the_largest_tier_that_fits() {
        assert_eq!(delay_queue(0), "prizepool.delay.1s");
        assert_eq!(delay_queue(9_999), "prizepool.delay.1s");
        assert_eq!(delay_queue(10_000), "prizepool.delay.10s");
        assert_eq!(delay_queue(86_400_000), "prizepool.delay.6h");
    }
}
