//! The draw worker: what every prize kind shares. It decodes a request,
//! validates it, binds its id to its content, resolves the pool's kind, asks
//! the kind for one step (see [`crate::kinds`]), waits for a refill when the
//! pool is short, and builds the outcome: the reply and the messages it
//! causes (settlement, refill, event).
//!
//! Order matters. The id is claimed before the pool step, so an id reused
//! on another pool or for another user or count is refused before anything
//! moves. The kind's step stores its answer atomically with its effect, so a
//! redelivered request replays its first answer and republishes the same
//! settlement (which the ledger applies once). A `pool_exhausted` decided
//! here is stored with `SET NX`: if a concurrent copy of the request drew
//! meanwhile, its award wins and is the answer.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use backon::{BackoffBuilder, ExponentialBuilder};
use serde_json::Value;

use crate::{
    amqp::{self, grouped::DRAW_COMPLETED, HandleError, Handler, Outcome, Outgoing, Publisher},
    config::{Config, DrawEvents},
    kinds::{self, answer, lottery, Ask, Award, Claim, Kinds, Refusal, Step, Tokens},
    messages::{
        decode_typed, retype, typed_json, DrawQueueMessage, DrawRequest, DrawResult, ErrorBody,
        ErrorCode, GrantRequest, GrantResult, RefillRequest, Status,
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
}

/// Most pools whose last urgent refill a worker remembers.
const MAX_URGENT_POOLS: usize = 10_000;

impl DrawWorker {
    /// Builds the worker from its connections.
    pub fn new(config: Config, redis: RedisConn) -> Self {
        let kinds = Kinds::new(redis, &config.redis_prefix);
        Self {
            config,
            kinds,
            urgent: Mutex::new(HashMap::new()),
            sealer: crate::ledger::FleetSealer::default(),
        }
    }

    /// Handles one draw request, whatever the pool's kind.
    pub async fn draw(
        &self,
        req: DrawRequest,
        publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        req.validate()?;
        let fingerprint = kinds::fingerprint("draw", &[&req.pool, &req.user_id, &req.count]);
        let ttl = self.config.result_ttl.as_secs();
        let mut conn = self.kinds.redis();
        let scripts = self.kinds.scripts();
        let tokens = Tokens::new(
            &self.config.redis_prefix,
            "rq",
            &req.request_id,
            fingerprint,
            ttl,
        );
        if kinds::claim(&mut conn, scripts, &tokens).await? == Claim::Reused {
            return Err(answer::reused("request_id", &req.request_id));
        }
        let ask = Ask {
            request_id: &req.request_id,
            pool: &req.pool,
            user: req.user_id,
            count: req.count,
            token: &tokens.answer,
            result_ttl_s: ttl,
        };
        let Some(kind) = self.kinds.resolve(&req.pool).await? else {
            return self
                .refuse(&ask, Refusal::new(ErrorCode::UnknownPool))
                .await;
        };
        let mut delays = ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(Duration::from_millis(10))
            .with_max_delay(Duration::from_millis(250))
            .with_total_delay(Some(self.config.short_pool_wait))
            .without_max_times()
            .build();
        let mut asked = None;
        loop {
            let step = match self.kinds.draw(kind, &ask).await {
                Err(HandleError::Invalid(why)) => {
                    // Bad for this pool (a count past its maximum, a grab
                    // of two shares): nothing was stored, so the id stays
                    // free for the request the upstream meant to send.
                    answer::release(&mut conn, scripts, &tokens).await?;
                    return Err(HandleError::Invalid(why));
                }
                step => step?,
            };
            let (in_pool, generation) = match step {
                Step::Awarded(award) => {
                    metrics::counter!("prizepool_draws_total", "kind" => kind.label(), "outcome" => "ok")
                        .increment(1);
                    return Ok(self.awarded(*award));
                }
                Step::Refused(refusal) => {
                    metrics::counter!("prizepool_draws_total", "kind" => kind.label(), "outcome" => refusal.code.as_str())
                        .increment(1);
                    return Ok(refused(&ask, refusal));
                }
                Step::Short {
                    in_pool,
                    generation,
                } => (in_pool, generation),
            };
            if asked != Some(generation) {
                self.ask_refill(&req.pool, generation, publisher).await?;
                asked = Some(generation);
            }
            match delays.next() {
                Some(delay) => tokio::time::sleep(delay).await,
                None => {
                    tracing::debug!(in_pool, count = req.count, "no refill arrived in time");
                    metrics::counter!("prizepool_pool_exhausted_total").increment(1);
                    return self
                        .refuse(&ask, Refusal::new(ErrorCode::PoolExhausted))
                        .await;
                }
            }
        }
    }

    /// Asks for batch `generation + 1` of `pool` now, unless this worker
    /// asked for it within the short-pool wait; the refill worker stocks one
    /// batch per trigger however often it is asked.
    async fn ask_refill(
        &self,
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
                typed_json("refill", &refill),
            ))
            .await?;
        metrics::counter!("prizepool_urgent_refills_total").increment(1);
        Ok(())
    }

    /// Stores `refusal` as the request's answer and replies with it; if the
    /// request was answered meanwhile (a concurrent copy), that answer wins.
    async fn refuse(&self, ask: &Ask<'_>, refusal: Refusal) -> Result<Outcome, HandleError> {
        let mut conn = self.kinds.redis();
        let results = self.kinds.keys(ask.pool).results();
        match kinds::remember(
            &mut conn,
            self.kinds.scripts(),
            &results,
            ask.token,
            &refusal,
        )
        .await?
        {
            None => Ok(refused(ask, refusal)),
            Some(kinds::ScriptReply::Refused(stored)) => Ok(refused(ask, stored)),
            // An award stored meanwhile: the kind's step replays it.
            Some(_) => match self.kinds.resolve(ask.pool).await? {
                Some(kind) => match self.kinds.draw(kind, ask).await? {
                    Step::Awarded(award) => Ok(self.awarded(*award)),
                    Step::Refused(stored) => Ok(refused(ask, stored)),
                    Step::Short { .. } => Err(HandleError::internal(format!(
                        "request {} has a stored award its pool cannot replay",
                        ask.request_id
                    ))),
                },
                None => Err(HandleError::internal(format!(
                    "request {} has a stored award on an unknown pool",
                    ask.request_id
                ))),
            },
        }
    }

    /// The outcome of an award of any kind: the reply, the ledger entry, the
    /// refill it triggered, and the `draw.completed` event as `DRAW_EVENTS`
    /// says. The result is serialised once; the event is the reply retyped.
    fn awarded(&self, award: Award) -> Outcome {
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
        let mut events = Vec::new();
        match self.config.draw_events {
            DrawEvents::Grouped => events.push(event()),
            DrawEvents::Each => {
                effects.push(Outgoing::event_raw(DRAW_COMPLETED.routing_key, event()))
            }
            DrawEvents::Off => {}
        }
        metrics::counter!("prizepool_prizes_drawn_total").increment(award.prizes_drawn);
        Outcome {
            reply: Some(retype("draw_result", &fields)),
            effects,
            ledger: award.entry.into_iter().collect(),
            events,
        }
    }

    async fn grant(&self, grant: GrantRequest) -> Result<Outcome, HandleError> {
        grant.validate()?;
        let fingerprint =
            kinds::fingerprint("grant", &[&grant.activity, &grant.user_id, &grant.chances]);
        let mut conn = self.kinds.redis();
        let tokens = Tokens::new(
            &self.config.redis_prefix,
            "gr",
            &grant.grant_id,
            fingerprint,
            lottery::GRANT_TTL_S,
        );
        if kinds::claim(&mut conn, self.kinds.scripts(), &tokens).await? == Claim::Reused {
            return Err(answer::reused("grant_id", &grant.grant_id));
        }
        let keys = self.kinds.keys(&grant.activity);
        let reply = match lottery::grant(
            &mut conn,
            self.kinds.scripts(),
            &keys,
            &grant.activity,
            &grant.grant_id,
            grant.user_id,
            grant.chances,
        )
        .await?
        {
            lottery::Granted::Ok(total) => GrantResult {
                grant_id: grant.grant_id,
                status: Status::Ok,
                chances: Some(grant.chances),
                chances_left: Some(total),
                error: None,
            },
            lottery::Granted::Unknown => GrantResult {
                error: Some(ErrorBody {
                    code: ErrorCode::UnknownPool,
                    message: format!("no activity named {}", grant.activity),
                }),
                ..GrantResult::rejected(grant.grant_id)
            },
            lottery::Granted::Reused => return Err(answer::reused("grant_id", &grant.grant_id)),
        };
        Ok(Outcome {
            reply: Some(typed_json("grant_result", &reply)),
            ..Outcome::default()
        })
    }
}

/// A `rejected` draw result: a business refusal, not bad input.
fn refused(ask: &Ask<'_>, refusal: Refusal) -> Outcome {
    let result = DrawResult {
        request_id: ask.request_id.to_owned(),
        status: Status::Rejected,
        pool: Some(ask.pool.to_owned()),
        user_id: Some(ask.user),
        error: Some(ErrorBody {
            code: refusal.code,
            message: refusal_message(ask, refusal.code),
        }),
        previous: refusal.previous,
        ..DrawResult::default()
    };
    Outcome {
        reply: Some(typed_json("draw_result", &result)),
        ..Outcome::default()
    }
}

/// The message of a refusal; the same for the first answer and its replays.
fn refusal_message(ask: &Ask<'_>, code: ErrorCode) -> String {
    let (pool, user, count) = (ask.pool, ask.user, ask.count);
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

    async fn handle(
        &self,
        envelope: &Value,
        publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        let mut outcome = match decode_typed::<DrawQueueMessage>(envelope)? {
            DrawQueueMessage::Draw(req) => self.draw(req, publisher).await,
            DrawQueueMessage::Grant(grant) => self.grant(grant).await,
        }?;
        let mut conn = self.kinds.redis();
        outcome.ledger = self
            .sealer
            .seal_all(&mut conn, &self.config, outcome.ledger)
            .await?;
        Ok(outcome)
    }
}

/// Runs a draw worker until `shutdown`.
pub async fn run(
    config: Config,
    health: crate::ops::Health,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    match crate::redis_conn::persistence(&mut redis).await {
        crate::redis_conn::Persistence::Durable => {
            tracing::info!("Redis persists every step before answering")
        }
        crate::redis_conn::Persistence::Lossy(why)
        | crate::redis_conn::Persistence::Unknown(why) => {
            tracing::warn!(%why, "Redis persistence is not zero-loss")
        }
    }
    let worker = Arc::new(DrawWorker::new(config.clone(), redis));
    amqp::run(&config, worker, health, shutdown).await
}
