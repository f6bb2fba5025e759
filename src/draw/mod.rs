//! The draw worker: what every prize kind shares. It decodes a request,
//! validates it, hands it to the seam ([`Kinds::open`]: the id bound to its
//! content, the pool's kind and home pool resolved), runs its steps, waits
//! for a refill while the pool is short, and builds the outcome: the reply
//! and the messages it causes (settlement, refill, event).
//!
//! Everything about idempotency and stored answers is the seam's
//! (`kinds/request.rs`); what is left here is the wire and the wait. A
//! short pool makes this worker ask for the next batch (at most once per
//! pool and generation within the wait, however many draws find it short)
//! and step again with jittered backoff; when `SHORT_POOL_WAIT_MS` is over
//! the seam stores `pool_exhausted`, unless a concurrent copy of the
//! request drew meanwhile (then that award is the answer). A draw that
//! waits for a refill gives its worker slot back ([`amqp::release_slot`]),
//! so requests for a pool that stays short cannot take the slots of every
//! other pool's draws; its later steps and its answer do not queue for a
//! slot again (new deliveries would take the refill it waited for). Each
//! still holds a delivery of the prefetch, so at most `PREFETCH −
//! CONCURRENCY` (at least half of `CONCURRENCY`) wait without a slot at
//! once; past that a draw waits in its slot, as every draw did before: what
//! a draw is answered never depends on how many wait. The reply is
//! published last, after the broker confirmed the settlement, the refill
//! and the event it causes (see [`crate::amqp`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use backon::{BackoffBuilder, ExponentialBuilder};
use serde_json::Value;

mod batch;

use crate::{
    amqp::{self, Group, HandleError, Handler, Outcome, Outgoing, Publisher},
    config::{Config, DrawEvents},
    kinds::{Award, Kinds, Opened, Prepared, Refusal, Step},
    ledger::{self, Unsealed},
    messages::{
        decode_typed, retype, typed_json, DrawQueueMessage, DrawRequest, DrawResult, ErrorBody,
        ErrorCode, GrantRequest, RefillRequest, Status,
    },
    redis_conn::RedisConn,
};

/// Everything a draw needs; shared by all in-flight deliveries.
#[derive(Debug)]
pub struct DrawWorker {
    config: Config,
    kinds: Kinds,
    /// The urgent refill last asked per pool: (generation, when). One per
    /// pool and generation is in flight at a time, however many draws find
    /// the pool short.
    urgent: Mutex<HashMap<String, (u64, Instant)>>,
    /// Seals the entries this worker sends to the ledger.
    sealer: crate::ledger::FleetSealer,
    /// Draws that may wait for a refill without a worker slot at once
    /// (`PREFETCH − CONCURRENCY`, at least half of `CONCURRENCY`): each
    /// holds a delivery of the prefetch while it waits, and the rest of the
    /// prefetch is left to the draws that work.
    waits: Arc<tokio::sync::Semaphore>,
}

pub use crate::audit::DRAW_COMPLETED;

/// Most pools whose last urgent refill a worker remembers.
const MAX_URGENT_POOLS: usize = 10_000;

impl DrawWorker {
    /// Builds the worker from its connections.
    pub fn new(config: Config, redis: RedisConn) -> Self {
        let kinds = Kinds::new(redis, &config.redis_prefix);
        let budget = usize::from(config.prefetch)
            .saturating_sub(config.concurrency)
            .max(config.concurrency / 2)
            .max(1);
        let waits = Arc::new(tokio::sync::Semaphore::new(budget));
        Self {
            config,
            kinds,
            urgent: Mutex::new(HashMap::new()),
            sealer: crate::ledger::FleetSealer::default(),
            waits,
        }
    }

    /// Handles one draw request, whatever the pool's kind.
    pub async fn draw(
        &self,
        req: DrawRequest,
        publisher: &Publisher,
    ) -> Result<Unsealed, HandleError> {
        req.validate()?;
        match self
            .kinds
            .open(req, self.config.result_ttl.as_secs())
            .await?
        {
            Opened::Answered(req, step) => self.answer(&req, step),
            Opened::Ready(draw) => {
                let first = self.kinds.step(&draw).await;
                self.finish(&draw, first, publisher).await
            }
        }
    }

    /// Everything after the first pool step `first`: the award or refusal
    /// it is, or, while the pool is short, an urgent refill and more steps
    /// until it arrives or the short-pool wait is over (`pool_exhausted`).
    async fn finish(
        &self,
        draw: &Prepared,
        first: Result<Step, HandleError>,
        publisher: &Publisher,
    ) -> Result<Unsealed, HandleError> {
        let mut delays = ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(Duration::from_millis(10))
            .with_max_delay(Duration::from_millis(250))
            .with_total_delay(Some(self.config.short_pool_wait))
            .without_max_times()
            .build();
        let mut asked = None;
        let mut waiting = None;
        let mut step = first?;
        loop {
            let Step::Short {
                in_pool,
                generation,
            } = step
            else {
                let outcome = match &step {
                    Step::Refused(refusal) => refusal.code.as_str(),
                    _ => "ok",
                };
                metrics::counter!("prizepool_draws_total", "kind" => draw.kind().label(), "outcome" => outcome)
                    .increment(1);
                return self.answer(draw.request(), step);
            };
            if asked != Some(generation) {
                self.ask_refill(
                    draw.kind().short_message(),
                    draw.ask().pool,
                    generation,
                    publisher,
                )
                .await?;
                asked = Some(generation);
            }
            if waiting.is_none() {
                waiting = self.waits.clone().try_acquire_owned().ok();
                if waiting.is_some() {
                    amqp::release_slot();
                } else {
                    metrics::counter!("prizepool_short_waits_in_slot_total").increment(1);
                }
            }
            match delays.next() {
                Some(delay) => tokio::time::sleep(delay).await,
                None => {
                    tracing::debug!(
                        in_pool,
                        count = draw.request().count,
                        "no refill arrived in time"
                    );
                    metrics::counter!("prizepool_pool_exhausted_total").increment(1);
                    let last = self.kinds.exhausted(draw).await?;
                    return self.answer(draw.request(), last);
                }
            }
            step = self.kinds.step(draw).await?;
        }
    }

    /// The outcome of a final step of `req`.
    fn answer(&self, req: &DrawRequest, step: Step) -> Result<Unsealed, HandleError> {
        match step {
            Step::Awarded(award) => Ok(self.awarded(*award)),
            Step::Refused(refusal) => Ok(refused(req, refusal)),
            Step::Short { .. } => Err(HandleError::internal(format!(
                "request {} was answered while its pool was short",
                req.request_id
            ))),
        }
    }

    /// Asks for batch `generation + 1` of `pool` now (for a lottery, with
    /// `message` `lottery.seed`: the commitment of the seed of period
    /// `generation`), unless this worker asked for it within the short-pool
    /// wait; the refill worker stocks one batch per trigger however often
    /// it is asked.
    async fn ask_refill(
        &self,
        message: &'static str,
        pool: &str,
        generation: u64,
        publisher: &Publisher,
    ) -> Result<(), HandleError> {
        {
            let mut urgent = self.urgent.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            if let Some((g, at)) = urgent.get(pool) {
                if *g == generation && now.duration_since(*at) < self.config.short_pool_wait {
                    return Ok(());
                }
            }
            if urgent.len() >= MAX_URGENT_POOLS {
                urgent.clear();
            }
            urgent.insert(pool.to_owned(), (generation, now));
        }
        let refill = RefillRequest {
            pool: pool.to_owned(),
            trigger: generation,
            urgent: true,
        };
        publisher
            .publish(Outgoing::work_raw(
                amqp::REFILL.routing_key,
                typed_json(message, &refill),
            ))
            .await?;
        metrics::counter!("prizepool_urgent_refills_total").increment(1);
        Ok(())
    }

    /// The outcome of an award of any kind: the reply, the ledger entry, the
    /// refill it triggered, and the `draw.completed` event as `DRAW_EVENTS`
    /// says. The result is serialised once; the event is the reply retyped.
    fn awarded(&self, award: Award) -> Unsealed {
        tracing::debug!(reward = ?award.result.reward, "draw completed");
        let fields = serde_json::to_vec(&award.result).unwrap_or_default();
        let mut effects = Vec::new();
        if let Some(refill) = &award.refill {
            effects.push(Outgoing::work_raw(
                amqp::REFILL.routing_key,
                typed_json("refill", refill),
            ));
        }
        let event = || crate::audit::draw_completed(&self.sealer, &self.config, &fields);
        let mut grouped = Vec::new();
        match self.config.draw_events {
            DrawEvents::Grouped => grouped.push((&DRAW_COMPLETED, event())),
            DrawEvents::Each => effects.push(DRAW_COMPLETED.single(event())),
            DrawEvents::Off => {}
        }
        metrics::counter!("prizepool_prizes_drawn_total").increment(award.prizes_drawn);
        record_pool_metrics(&award);
        Unsealed {
            reply: Some(retype("draw_result", &fields)),
            effects,
            grouped,
            ledger: award.entry.into_iter().collect(),
        }
    }

    async fn grant(&self, grant: GrantRequest) -> Result<Unsealed, HandleError> {
        grant.validate()?;
        let reply = self.kinds.grant(grant).await?;
        Ok(Unsealed {
            reply: Some(typed_json("grant_result", &reply)),
            ..Unsealed::default()
        })
    }
}

/// A `rejected` draw result: a business refusal, not bad input, naming the
/// pool as the request did.
fn refused(req: &DrawRequest, refusal: Refusal) -> Unsealed {
    let result = DrawResult {
        request_id: req.request_id.clone(),
        status: Status::Rejected,
        pool: Some(req.pool.clone()),
        user_id: Some(req.user_id),
        error: Some(ErrorBody {
            code: refusal.code,
            message: refusal_message(req, refusal.code),
        }),
        previous: refusal.previous,
        ..DrawResult::default()
    };
    Unsealed {
        reply: Some(typed_json("draw_result", &result)),
        ..Unsealed::default()
    }
}

/// The message of a refusal; the same for the first answer and its replays.
fn refusal_message(req: &DrawRequest, code: ErrorCode) -> String {
    let (pool, user, count) = (&req.pool, req.user_id, req.count);
    match code {
        ErrorCode::UnknownPool => format!("no pool named {pool}"),
        ErrorCode::PoolClosed => format!("{pool} is closed"),
        ErrorCode::SoldOut => format!("{pool} has no prize left"),
        ErrorCode::AlreadyGrabbed => format!("user {user} already grabbed a share of {pool}"),
        ErrorCode::NotStarted => format!("activity {pool} has not started"),
        ErrorCode::Ended => format!("activity {pool} has ended"),
        ErrorCode::NoChances => format!("user {user} has no chance left in {pool}"),
        ErrorCode::PoolExhausted => format!(
            "pool {pool} held fewer than the {count} prizes asked, and no refill arrived in time"
        ),
        other => format!("refused: {other}"),
    }
}

impl Handler for DrawWorker {
    fn route(&self) -> amqp::Route {
        amqp::DRAW
    }

    fn span_fields(&self) -> amqp::SpanFields {
        amqp::SpanFields {
            pool: &["pool", "activity"],
            user: &["user_id"],
        }
    }

    fn groups(&self) -> &'static [Group] {
        match self.config.draw_events {
            DrawEvents::Grouped => &[ledger::ENTRIES, DRAW_COMPLETED],
            DrawEvents::Each | DrawEvents::Off => &[ledger::ENTRIES],
        }
    }

    async fn handle(
        &self,
        envelope: &Value,
        publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        let unsealed = match decode_typed::<DrawQueueMessage>(envelope)? {
            DrawQueueMessage::Draw(req) => self.draw(req, publisher).await,
            DrawQueueMessage::Grant(grant) => self.grant(grant).await,
            DrawQueueMessage::Batch(batch) => self.batch(batch, publisher).await,
        }?;
        let mut conn = self.kinds.redis();
        unsealed.seal(&self.sealer, &mut conn, &self.config).await
    }
}

/// Runs a draw worker until `shutdown`.
pub async fn run(
    config: Config,
    health: crate::ops::Health,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    let earlier = crate::kinds::answer::start_layout(
        &mut redis,
        &config.redis_prefix,
        config.result_ttl.as_secs(),
    )
    .await?;
    match crate::redis_conn::persistence(&mut redis).await {
        crate::redis_conn::Persistence::Durable => {
            tracing::info!("Redis persists every step before answering")
        }
        crate::redis_conn::Persistence::Lossy(why)
        | crate::redis_conn::Persistence::Unknown(why) => {
            tracing::warn!(%why, "Redis persistence is not zero-loss")
        }
    }
    // The audit trail's queue exists before the first event goes out.
    if config.draw_events != DrawEvents::Off
        && !crate::audit::declare_queue(&config, &shutdown).await?
    {
        return Ok(());
    }
    let worker = Arc::new(DrawWorker::new(config.clone(), redis));
    worker.kinds.read_earlier_layout_until(earlier);
    amqp::run(&config, worker, health, shutdown).await
}

/// Per-pool counters of a new award: draws, prizes and what it pays, by
/// asset. Lucky-gift pools and lottery activities are configured, so few;
/// red packets are many and short-lived, so they count together under
/// `pool="red-packets"`. A replay counts nothing: it was counted once.
fn record_pool_metrics(award: &crate::kinds::Award) {
    if award.replayed {
        return;
    }
    let red_packet = matches!(
        award.result.prizes.first(),
        Some(crate::messages::Prize::Share { .. })
    ) || award
        .entry
        .as_ref()
        .is_some_and(|e| e.reason == "red_packet");
    let pool = if red_packet {
        "red-packets".to_owned()
    } else {
        award.result.pool.clone().unwrap_or_default()
    };
    metrics::counter!("prizepool_pool_draws_total", "pool" => pool.clone()).increment(1);
    metrics::counter!("prizepool_pool_prizes_drawn_total", "pool" => pool.clone())
        .increment(award.prizes_drawn);
    // Lucky gift: prizes and the multipliers they paid, by the config
    // version of the draw (the one its reply names), so realised RTP can be
    // read while a pool runs. Pools are configured and their versions
    // counted by loads: the labels stay few.
    if let (Some(total), Some(version)) = (award.result.total_multiplier, award.result.version) {
        let labels = [("pool", pool.clone()), ("version", version.to_string())];
        metrics::counter!("prizepool_version_prizes_drawn_total", &labels)
            .increment(award.prizes_drawn);
        metrics::counter!("prizepool_paid_multiplier_total", &labels).increment(total);
    }
    if let Some(entry) = &award.entry {
        let paid = u64::try_from(entry.amount).unwrap_or(0);
        metrics::counter!("prizepool_pool_paid_total", "pool" => pool, "asset" => entry.asset.clone())
            .increment(paid);
    }
}
