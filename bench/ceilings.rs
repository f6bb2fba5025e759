//! The ceilings a run is compared with, measured in the same run: the raw
//! Redis round trip of the draw script, and the raw RabbitMQ round trip
//! through a quorum queue with windowed confirms.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use futures_util::{stream::FuturesUnordered, StreamExt};
use lapin::{
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
        QueueDeclareOptions, QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable},
    BasicProperties,
};
use prizepool::redis_conn::RedisConn;
use tokio::sync::Mutex;

use super::stats::{Latencies, Percentiles};
use prizepool::{
    config::Config,
    kinds::{
        self as kinds,
        lottery::{self, Strategy},
        lucky_gift, red_packet, Ask,
    },
    scripts::{PoolKeys, Scripts},
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

/// How [`redis_draws`] calls Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Caller {
    /// The worker's own path (`lucky_gift::draw`, `red_packet::grab`, the
    /// lottery strategy's `draw`), reply parsed.
    Wrapper,
    /// A bare EVALSHA of the same script with the same keys and arguments,
    /// reply ignored: the raw ceiling of the draw step.
    Raw,
    /// A script that only reads one field of the pool's meta hash: the price
    /// of a round trip without the draw's work.
    Trivial,
    /// The worker's coalesced path for a lucky gift: this many draws of the
    /// pool in one call (`lucky_gift::draw_many`), replies parsed. Other
    /// kinds draw one per call, as the worker does.
    Coalesced(usize),
}

impl Caller {
    /// Draws one call of `step` makes.
    fn draws_per_call(self, step: &Step) -> u64 {
        match (self, step) {
            (Self::Coalesced(k), Step::LuckyGift { .. }) => k as u64,
            _ => 1,
        }
    }
}

/// The draw step a pass calls: that of the run's prize kind.
#[derive(Clone, Debug)]
pub(super) enum Step {
    /// `count` prizes from the lucky-gift pool behind `keys`.
    LuckyGift {
        keys: PoolKeys,
        storage: lucky_gift::Storage,
        count: u32,
    },
    /// One share a grab, spread over `packets` as [`super::fleet::grab_of`] says.
    RedPacket {
        packets: Arc<Vec<PoolKeys>>,
        shares: u64,
    },
    /// One chance a draw, for one of `users` users who all hold plenty.
    Lottery {
        keys: PoolKeys,
        strategy: &'static dyn Strategy,
        users: u64,
    },
}

/// How long the passes keep their result keys.
const TTL_S: u64 = 120;
/// The answer token of call `id`, as the worker builds it (each call has an
/// id of its own and asks the same).
fn token(id: &str) -> Vec<u8> {
    let fingerprint = kinds::fingerprint("bench", &[]);
    kinds::Tokens::new("bench", "rq", id, fingerprint, TTL_S).answer
}

impl Step {
    /// The keys and user of the `n`th call of a pass (lucky-gift draws name
    /// no user).
    fn target(&self, n: u64) -> (&PoolKeys, i64) {
        match self {
            Self::LuckyGift { keys, .. } => (keys, 0),
            Self::RedPacket { packets, shares } => {
                let (packet, user) = super::fleet::grab_of(n, *shares, packets.len());
                (&packets[packet], user)
            }
            Self::Lottery { keys, users, .. } => (keys, 1 + (n % users) as i64),
        }
    }

    /// The draw script's call, exactly as the worker's path makes it.
    fn invocation<'a>(
        &self,
        scripts: &'a Scripts,
        keys: &PoolKeys,
        day: &str,
        id: &str,
        user: i64,
    ) -> redis::ScriptInvocation<'a> {
        match self {
            Self::LuckyGift { storage, count, .. } => lucky_gift::draw_call(
                lucky_gift::draw_script(scripts, *storage),
                keys,
                *storage,
                day,
                *count,
                TTL_S,
                &token(id),
            ),
            Self::RedPacket { .. } => {
                red_packet::grab_call(&scripts.grab_red_packet, keys, user, TTL_S, &token(id))
            }
            Self::Lottery { strategy, .. } => strategy.invocation(
                scripts,
                keys,
                &Ask {
                    request_id: id,
                    pool: "",
                    user,
                    count: 1,
                    token: &token(id),
                    result_ttl_s: TTL_S,
                },
                &lottery::random_values(),
            ),
        }
    }

    /// The worker's own path: whether it drew.
    async fn wrapped(
        &self,
        conn: &mut RedisConn,
        scripts: &Scripts,
        keys: &PoolKeys,
        id: &str,
        user: i64,
    ) -> anyhow::Result<bool> {
        let token = token(id);
        let ask = Ask {
            request_id: id,
            pool: "bench",
            user,
            count: 1,
            token: &token,
            result_ttl_s: TTL_S,
        };
        let step = match self {
            Self::LuckyGift { storage, count, .. } => {
                let ask = Ask {
                    count: *count,
                    ..ask
                };
                let drawn = lucky_gift::draw_once(
                    conn, scripts, keys, *storage, id, ask.count, TTL_S, &token,
                )
                .await?;
                return Ok(matches!(drawn, lucky_gift::DrawStep::Drawn(_)));
            }
            Self::RedPacket { .. } => red_packet::grab(conn, scripts, keys, &ask).await?,
            Self::Lottery { strategy, .. } => {
                lottery::draw(conn, scripts, keys, *strategy, &ask).await?
            }
        };
        Ok(matches!(step, kinds::Step::Awarded(_)))
    }

    /// Makes the `n`th call of a pass as `caller` says; `false` once the
    /// pool has run out and the pass should end.
    async fn call(
        &self,
        conn: &mut RedisConn,
        scripts: &Scripts,
        bare: &redis::Script,
        caller: Caller,
        day: &str,
        n: u64,
    ) -> anyhow::Result<bool> {
        let id = ulid::Ulid::new().to_string();
        let (keys, user) = self.target(n);
        let reply: redis::Value = match caller {
            Caller::Coalesced(k) => {
                let Self::LuckyGift { storage, count, .. } = self else {
                    return self.wrapped(conn, scripts, keys, &id, user).await;
                };
                let draws: Vec<lucky_gift::Pending> = (0..k)
                    .map(|i| {
                        let id = format!("{id}-{i}");
                        lucky_gift::Pending {
                            token: token(&id),
                            request_id: id,
                            count: *count,
                            result_ttl_s: TTL_S,
                        }
                    })
                    .collect();
                let steps = lucky_gift::draw_many(
                    conn,
                    lucky_gift::draw_script(scripts, *storage),
                    keys,
                    *storage,
                    &draws,
                )
                .await?;
                return Ok(steps
                    .iter()
                    .all(|s| matches!(s, Ok(lucky_gift::DrawStep::Drawn(_)))));
            }
            Caller::Wrapper => return self.wrapped(conn, scripts, keys, &id, user).await,
            Caller::Trivial => {
                let _: redis::Value = bare.key(keys.meta()).invoke_async(conn).await?;
                return Ok(true);
            }
            Caller::Raw => {
                self.invocation(scripts, keys, day, &id, user)
                    .invoke_async(conn)
                    .await?
            }
        };
        // Every draw script answers {status, ...}; anything but a draw ends the pass.
        Ok(matches!(&reply, redis::Value::Array(items)
            if matches!(items.first(), Some(redis::Value::BulkString(s)) if s.as_slice() == b"ok")))
    }
}

/// One pass of [`redis_draws`]: `concurrency` tasks sharing one multiplexed
/// connection call `step` for `duration` or until the pool runs out.
#[derive(Clone, Debug)]
pub(super) struct Pass {
    pub(crate) step: Step,
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
pub(super) async fn redis_draws(redis_url: &str, pass: Pass) -> anyhow::Result<Rate> {
    let url = redis_url.to_owned();
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let redis = prizepool::redis_conn::connect(&url).await?;
            draw_loop(&redis, pass).await
        })
    })
    .await?
}

async fn draw_loop(redis: &RedisConn, pass: Pass) -> anyhow::Result<Rate> {
    let Pass {
        step,
        concurrency,
        duration,
        caller,
    } = pass;
    let step = Arc::new(step);
    let scripts = Arc::new(Scripts::new());
    let bare = Arc::new(redis::Script::new(
        "return redis.call('HGET', KEYS[1], 'kind')",
    ));
    let day: Arc<str> = prizepool::scripts::utc_day().into();
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (mut conn, step, scripts, bare, day, stop, calls, done) = (
            redis.clone(),
            step.clone(),
            scripts.clone(),
            bare.clone(),
            day.clone(),
            stop.clone(),
            calls.clone(),
            done.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut lat = Latencies::default();
            while !stop.load(Ordering::Relaxed) && started.elapsed() < duration {
                let n = calls.fetch_add(1, Ordering::Relaxed);
                let t = Instant::now();
                if !step
                    .call(&mut conn, &scripts, &bare, caller, &day, n)
                    .await?
                {
                    stop.store(true, Ordering::Relaxed);
                    break;
                }
                lat.record(t.elapsed());
                done.fetch_add(caller.draws_per_call(&step), Ordering::Relaxed);
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
    let pub_ch = conn.create_channel().await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".as_bytes().to_vec().into()),
    );
    pub_ch
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
    pub_ch
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    // The consumer gets a connection of its own, as a worker would.
    let sub_conn =
        prizepool::amqp::connect(&config.amqp_url, "prizepool-bench-ceiling-consumer").await?;
    let sub_ch = sub_conn.create_channel().await?;
    sub_ch.basic_qos(1000, Default::default()).await?;
    let mut consumer = sub_ch
        .basic_consume(
            queue.as_str().into(),
            "ceiling".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let broker_before = super::stats::service_cpu();
    let epoch = Instant::now();
    let latencies = Arc::new(Mutex::new(Latencies::default()));
    let received = Arc::new(AtomicU64::new(0));
    let (lat2, rec2) = (latencies.clone(), received.clone());
    let reader = tokio::spawn(async move {
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
            rec2.fetch_add(1, Ordering::Relaxed);
            if batch.len() >= 1000 {
                lat2.lock().await.extend(std::mem::take(&mut batch));
            }
        }
        while acks.next().await.is_some() {}
        lat2.lock().await.extend(batch);
    });

    let mut pending = FuturesUnordered::new();
    let mut sent = 0u64;
    let started = Instant::now();
    let mut body = vec![b'x'; body_len.max(8)];
    while started.elapsed() < duration {
        if let Some(rate) = rate {
            // Open loop: keep the schedule, whatever the confirms do.
            let due = started + Duration::from_secs_f64(sent as f64 / rate);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                tokio::time::sleep(wait).await;
            }
        }
        body[..8].copy_from_slice(&(epoch.elapsed().as_micros() as u64).to_le_bytes());
        let confirm = pub_ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default(),
            )
            .await?;
        pending.push(confirm);
        sent += 1;
        while pending.len() >= window {
            if let Some(c) = pending.next().await {
                c?;
            }
        }
    }
    while let Some(c) = pending.next().await {
        c?;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while received.load(Ordering::Relaxed) < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let broker_cpu_s = super::stats::service_cpu_since(&broker_before)
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
