//! The ceilings a run is compared with, measured in the same run: the
//! Redis round trip of the run's draw step, called through the library's
//! seam ([`Kinds`]) as the draw worker calls it, and the raw RabbitMQ round
//! trip through a quorum queue with windowed confirms.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use futures_util::{stream::FuturesUnordered, StreamExt};
use lapin::{
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
        QueueDeclareOptions, QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable},
    BasicProperties,
};
use prizepool::{
    config::Config,
    kinds::{self, Ask, Kinds, Step},
    redis_conn::RedisConn,
};
use tokio::sync::Mutex;

use super::{
    kinds::Target,
    stats::{Latencies, Percentiles},
};

/// A measured rate with its latencies.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub(crate) struct Rate {
    pub(crate) per_s: f64,
    pub(crate) latency: Percentiles,
    /// CPU time of the local RabbitMQ per message, where measured. It falls
    /// as the rate rises (the broker batches its work), so compare it only
    /// between runs at the same rate.
    pub(crate) broker_cpu_us_per_msg: Option<f64>,
}

/// How [`redis_draws`] calls Redis. Every caller but `Trivial` goes
/// through the seam: the pool's kind resolved and its draw routed as the
/// draw worker does it ([`Kinds::route`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Caller {
    /// The worker's own path, one draw a call ([`Kinds::draw`]), its
    /// answer read into the award.
    Wrapper,
    /// The same script with the same keys and arguments as a bare FCALL
    /// ([`Kinds::script_call`]), reply ignored: the raw ceiling of the draw
    /// step.
    Raw,
    /// A script that only reads one field of the pool's meta hash: the price
    /// of a round trip without the draw's work.
    Trivial,
    /// The worker's path for this many draws of one pool at once
    /// ([`Kinds::draw_all`]): one call for a kind whose draws coalesce
    /// (lucky gifts), one a draw for the others.
    Coalesced(usize),
}

impl Caller {
    /// Draws one call makes.
    fn draws_per_call(self) -> u64 {
        match self {
            Self::Coalesced(k) => k as u64,
            _ => 1,
        }
    }
}

/// How long the passes keep their result keys.
const TTL_S: u64 = 120;

/// The answer token of call `id`, as the worker builds it (each call has an
/// id of its own and asks the same).
fn token(id: &str) -> Vec<u8> {
    let fingerprint = kinds::fingerprint("bench", &[]);
    kinds::Tokens::new("bench", "rq", id, fingerprint, TTL_S).answer
}

/// One caller of a pass: a dispatch of its own, as one draw worker has, so
/// no caller's draws join another's call.
struct Drawer {
    kinds: Kinds,
    conn: RedisConn,
    trivial: Arc<prizepool::scripts::Script>,
}

impl Drawer {
    /// Makes the `n`th call of a pass on `target` as `caller` says; `false`
    /// once the pool has run out (or refuses) and the pass should end.
    async fn call(&mut self, target: &Target, caller: Caller, n: u64) -> anyhow::Result<bool> {
        let (pool, user) = target.draw(n);
        if caller == Caller::Trivial {
            let _: redis::Value = self
                .trivial
                .key(self.kinds.keys(pool).meta())
                .invoke_async(&mut self.conn)
                .await?;
            return Ok(true);
        }
        let (kind, pool) = self
            .kinds
            .route(pool, user)
            .await?
            .with_context(|| format!("no pool {pool}"))?;
        let ids: Vec<String> = {
            let id = ulid::Ulid::new().to_string();
            match caller {
                Caller::Coalesced(k) => (0..k).map(|i| format!("{id}-{i}")).collect(),
                _ => vec![id],
            }
        };
        let tokens: Vec<Vec<u8>> = ids.iter().map(|id| token(id)).collect();
        let asks: Vec<Ask<'_>> = ids
            .iter()
            .zip(&tokens)
            .map(|(id, token)| Ask {
                request_id: id,
                pool: &pool,
                user,
                count: target.count,
                token,
                result_ttl_s: TTL_S,
            })
            .collect();
        match caller {
            Caller::Raw => {
                let call = self.kinds.script_call(kind, &asks[0]).await?;
                let reply: redis::Value = call.invoke_async(&mut self.conn).await?;
                // Every draw script answers {status, ...}; anything but a
                // draw ends the pass.
                Ok(matches!(&reply, redis::Value::Array(items)
                    if matches!(items.first(), Some(redis::Value::BulkString(s)) if s.as_slice() == b"ok")))
            }
            _ => {
                let steps = self.kinds.draw_all(kind, &asks).await;
                let mut awarded = true;
                for step in steps {
                    awarded &= matches!(step?, Step::Awarded(_));
                }
                Ok(awarded)
            }
        }
    }
}

/// One pass of [`redis_draws`]: `concurrency` tasks sharing one multiplexed
/// connection draw from `target` for `duration` or until it runs out.
#[derive(Clone, Debug)]
pub(crate) struct Pass {
    pub(crate) target: Target,
    pub(crate) concurrency: usize,
    pub(crate) duration: Duration,
    pub(crate) caller: Caller,
}

/// Calls a draw step as `pass` says.
///
/// The loop runs on a runtime of its own with a thread per core and a
/// connection of its own, so the client's work (building calls, parsing
/// replies) is spread as a worker fleet spreads it, and the rate is Redis's
/// ceiling rather than that of one client thread.
pub(crate) async fn redis_draws(config: &Config, pass: Pass) -> anyhow::Result<Rate> {
    let (url, prefix) = (config.redis_url.clone(), config.redis_prefix.clone());
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let redis = prizepool::redis_conn::connect(&url).await?;
            draw_loop(&redis, &prefix, pass).await
        })
    })
    .await?
}

async fn draw_loop(redis: &RedisConn, prefix: &str, pass: Pass) -> anyhow::Result<Rate> {
    let Pass {
        target,
        concurrency,
        duration,
        caller,
    } = pass;
    let target = Arc::new(target);
    let trivial = Arc::new(prizepool::scripts::Script::new(
        "return redis.call('HGET', KEYS[1], 'kind')",
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let mut drawer = Drawer {
            kinds: Kinds::new(redis.clone(), prefix),
            conn: redis.clone(),
            trivial: trivial.clone(),
        };
        let (target, stop, calls, done) =
            (target.clone(), stop.clone(), calls.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Latencies::default();
            while !stop.load(Ordering::Relaxed) && started.elapsed() < duration {
                let n = calls.fetch_add(1, Ordering::Relaxed);
                let t = Instant::now();
                if !drawer.call(&target, caller, n).await? {
                    stop.store(true, Ordering::Relaxed);
                    break;
                }
                lat.record(t.elapsed());
                done.fetch_add(caller.draws_per_call(), Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(lat)
        }));
    }
    let mut all = Latencies::default();
    for t in tasks {
        all.extend(t.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(Rate {
        per_s: done.load(Ordering::Relaxed) as f64 / elapsed,
        latency: all.percentiles(),
        broker_cpu_us_per_msg: None,
    })
}

/// Publishes `body_len`-byte messages to a fresh quorum queue with up to
/// `window` unconfirmed publishes, consumes and acks them, and measures
/// publish→consume latency. With `rate`, publishes at that rate (open loop);
/// otherwise as fast as confirms allow.
pub(super) async fn amqp_round_trip(
    config: &Config,
    body_len: usize,
    window: usize,
    duration: Duration,
    rate: Option<f64>,
) -> anyhow::Result<Rate> {
    let conn = prizepool::amqp::connect(&config.amqp_url, "prizepool-bench-ceiling").await?;
    let queue = format!("prizepool.bench.{}", ulid::Ulid::new());
    let pub_ch = quorum_queue(&conn, &queue).await?;
    // The consumer gets a connection of its own, as a worker would.
    let sub_conn =
        prizepool::amqp::connect(&config.amqp_url, "prizepool-bench-ceiling-consumer").await?;
    let sub_ch = sub_conn.create_channel().await?;
    sub_ch.basic_qos(1000, Default::default()).await?;
    let consumer = sub_ch
        .basic_consume(
            queue.as_str().into(),
            "ceiling".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let ports = super::stats::ServicePorts::of(config);
    let broker_before = super::stats::service_cpu(&ports);
    let epoch = Instant::now();
    let latencies = Arc::new(Mutex::new(Latencies::default()));
    let received = Arc::new(AtomicU64::new(0));
    let reader = read_and_ack(consumer, epoch, latencies.clone(), received.clone());
    let publishing = Publishing {
        channel: &pub_ch,
        queue: &queue,
        body_len,
        window,
        epoch,
    };
    let started = Instant::now();
    let sent = publishing.run(started, duration, rate).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while received.load(Ordering::Relaxed) < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let broker_cpu_s = super::stats::service_cpu_since(&ports, &broker_before)
        .into_iter()
        .find(|(name, _)| *name == "rabbitmq")
        .map(|(_, s)| s);
    // Cancelling ends the consumer stream, so the reader hands in its last samples.
    let _ = sub_ch
        .basic_cancel("ceiling".into(), Default::default())
        .await;
    let _ = tokio::time::timeout(Duration::from_secs(5), reader).await;
    let _ = pub_ch
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "bench".into()).await;
    let _ = sub_conn.close(200, "bench".into()).await;
    let mut lat = std::mem::take(&mut *latencies.lock().await);
    let received = received.load(Ordering::Relaxed);
    Ok(Rate {
        per_s: received as f64 / elapsed,
        latency: lat.percentiles(),
        broker_cpu_us_per_msg: broker_cpu_s.map(|s| s * 1e6 / received.max(1) as f64),
    })
}

/// A durable quorum queue named `queue`, declared on a new channel of
/// `conn` that publishes with confirms.
async fn quorum_queue(conn: &lapin::Connection, queue: &str) -> anyhow::Result<lapin::Channel> {
    let channel = conn.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".as_bytes().to_vec().into()),
    );
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// Reads `consumer` until it is cancelled, acking every delivery and
/// recording its latency (its body starts with the microseconds since
/// `epoch` it was sent at) into `latencies`, and counting it in `received`.
fn read_and_ack(
    mut consumer: lapin::Consumer,
    epoch: Instant,
    latencies: Arc<Mutex<Latencies>>,
    received: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut batch = Latencies::default();
        let mut acks = FuturesUnordered::new();
        while let Some(Ok(d)) = consumer.next().await {
            let sent = u64::from_le_bytes(
                d.data
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .unwrap_or([0; 8]),
            );
            batch.record(epoch.elapsed().saturating_sub(Duration::from_micros(sent)));
            // One ack per message, but not one I/O round per message: the
            // acks are in flight while the next deliveries are read.
            acks.push(async move { d.ack(BasicAckOptions::default()).await });
            while futures_util::FutureExt::now_or_never(acks.next())
                .flatten()
                .is_some()
            {}
            received.fetch_add(1, Ordering::Relaxed);
            if batch.len() >= 1000 {
                latencies.lock().await.extend(std::mem::take(&mut batch));
            }
        }
        while acks.next().await.is_some() {}
        latencies.lock().await.extend(batch);
    })
}

/// The publishing side of the RabbitMQ ceiling.
struct Publishing<'a> {
    channel: &'a lapin::Channel,
    queue: &'a str,
    body_len: usize,
    /// Most unconfirmed publishes.
    window: usize,
    /// What the send times in the bodies count from.
    epoch: Instant,
}

impl Publishing<'_> {
    /// Publishes from `started` for `duration`, at `rate` or as fast as
    /// confirms allow, and waits for the last confirms: how many were sent.
    async fn run(
        &self,
        started: Instant,
        duration: Duration,
        rate: Option<f64>,
    ) -> anyhow::Result<u64> {
        let mut pending = FuturesUnordered::new();
        let mut sent = 0u64;
        let mut body = vec![b'x'; self.body_len.max(8)];
        while started.elapsed() < duration {
            if let Some(rate) = rate {
                // Open loop: keep the schedule, whatever the confirms do.
                let due = started + Duration::from_secs_f64(sent as f64 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    tokio::time::sleep(wait).await;
                }
            }
            body[..8].copy_from_slice(&(self.epoch.elapsed().as_micros() as u64).to_le_bytes());
            let confirm = self
                .channel
                .basic_publish(
                    "".into(),
                    self.queue.into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default(),
                )
                .await?;
            pending.push(confirm);
            sent += 1;
            while pending.len() >= self.window {
                if let Some(c) = pending.next().await {
                    c?;
                }
            }
        }
        while let Some(c) = pending.next().await {
            c?;
        }
        Ok(sent)
    }
}
