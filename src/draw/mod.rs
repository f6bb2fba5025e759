//! The draw worker: decodes a request, dispatches it by the pool's kind, and
//! returns the reply plus the messages it causes (settlement, refill, event).
//!
//! The draw itself is one Lua step in Redis; everything around it is
//! idempotent, so a redelivered request replays its first result and
//! republishes the same settlement (which the ledger applies once).

use std::{collections::HashMap, sync::Arc, time::Duration};

use crate::redis_conn::RedisConn;
use backon::{BackoffBuilder, ExponentialBuilder};
use serde_json::{json, Value};
use tokio::sync::RwLock;

use crate::{
    amqp::{self, grouped::DRAW_COMPLETED, HandleError, Handler, Outcome, Outgoing, Publisher},
    config::{Config, DrawEvents},
    kinds::{
        lottery::{self, LotteryStep},
        lucky_gift::{self, CodeTable, DrawStep, Drawn, Storage},
        red_packet::{self, Grab},
    },
    messages::{
        decode_typed, retype, typed_json, DrawQueueMessage, DrawRequest, DrawResult, ErrorBody,
        ErrorCode, GrantRequest, Invalid, Prize, RefillRequest, SettleRequest, Status,
    },
    scripts::{PoolKeys, Scripts},
};

/// Everything a draw needs; shared by all in-flight deliveries.
#[derive(Debug)]
pub struct DrawWorker {
    config: Config,
    redis: RedisConn,
    scripts: Scripts,
    /// Decoding tables per pool. Tables only grow, so a cached table is
    /// reloaded only when a code past its end shows up.
    codes: RwLock<HashMap<String, Arc<(CodeTable, String)>>>,
    /// Kind of each pool id seen. An id never changes kind (the registry in
    /// Postgres enforces one namespace), so entries never go stale.
    kinds: RwLock<HashMap<String, Kind>>,
}

/// The prize kinds a draw can address.
#[derive(Clone, Copy, Debug)]
enum Kind {
    LuckyGift(Storage),
    RedPacket,
    /// The activity's strategy, resolved once: `activity load` refuses to
    /// change an activity's strategy, so the label cannot go stale.
    Lottery(&'static dyn lottery::Strategy),
}

impl DrawWorker {
    /// Builds the worker from its connections.
    pub fn new(config: Config, redis: RedisConn) -> Self {
        Self {
            config,
            redis,
            scripts: Scripts::new(),
            codes: RwLock::new(HashMap::new()),
            kinds: RwLock::new(HashMap::new()),
        }
    }

    /// The kind of pool `id`, from the cache or Redis; `None` if unknown.
    async fn kind(&self, keys: &PoolKeys, id: &str) -> Result<Option<Kind>, HandleError> {
        if let Some(kind) = self.kinds.read().await.get(id) {
            return Ok(Some(*kind));
        }
        let mut conn = self.redis.clone();
        let (label, storage, strategy): (Option<String>, Option<String>, Option<String>) =
            redis::cmd("HMGET")
                .arg(keys.meta())
                .arg("kind")
                .arg("storage")
                .arg("strategy")
                .query_async(&mut conn)
                .await?;
        let kind = match label.as_deref() {
            Some(lucky_gift::KIND) if storage.as_deref() == Some("sparse") => {
                Kind::LuckyGift(Storage::Sparse)
            }
            Some(lucky_gift::KIND) => Kind::LuckyGift(Storage::List),
            Some(red_packet::KIND) => Kind::RedPacket,
            Some(lottery::KIND) => match strategy.as_deref().and_then(lottery::strategy) {
                Some(s) => Kind::Lottery(s),
                None => {
                    return Err(anyhow::anyhow!(
                        "activity {id} names no registered strategy ({strategy:?})"
                    )
                    .into())
                }
            },
            _ => return Ok(None),
        };
        self.kinds.write().await.insert(id.to_owned(), kind);
        Ok(Some(kind))
    }

    /// The outcome of a successful draw of any kind: the reply, the messages
    /// it causes, and the `draw.completed` event as `DRAW_EVENTS` says. The
    /// result is serialised once; the event is the reply retyped.
    fn completed(
        &self,
        result: &DrawResult,
        mut effects: Vec<Outgoing>,
        ledger: Option<SettleRequest>,
    ) -> Outcome {
        let fields = serde_json::to_vec(result).unwrap_or_default();
        let event = || retype(DRAW_COMPLETED.routing_key, &fields);
        let mut events = Vec::new();
        match self.config.draw_events {
            DrawEvents::Grouped => events.push(event()),
            DrawEvents::Each => {
                effects.push(Outgoing::event_raw(DRAW_COMPLETED.routing_key, event()))
            }
            DrawEvents::Off => {}
        }
        Outcome {
            reply: Some(retype("draw_result", &fields)),
            effects,
            ledger: ledger.into_iter().collect(),
            events,
        }
    }

    /// Handles one draw request, whatever the pool's kind.
    pub async fn draw(
        &self,
        req: DrawRequest,
        publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        req.validate()?;
        let keys = PoolKeys::new(&self.config.redis_prefix, &req.pool);
        match self.kind(&keys, &req.pool).await? {
            Some(Kind::LuckyGift(storage)) => {
                self.draw_lucky_gift(req, keys, storage, publisher).await
            }
            Some(Kind::RedPacket) => self.grab(req, keys).await,
            Some(Kind::Lottery(strategy)) => self.draw_lottery(req, keys, strategy).await,
            None => Ok(rejected(
                &req,
                ErrorCode::UnknownPool,
                format!("no pool named {}", req.pool),
            )),
        }
    }

    /// A red-packet grab: one share per user.
    async fn grab(&self, req: DrawRequest, keys: PoolKeys) -> Result<Outcome, HandleError> {
        if req.count != 1 {
            return Err(Invalid::new(format!(
                "a red packet is grabbed one share at a time; `count` must be 1, got {}",
                req.count
            ))
            .into());
        }
        let mut conn = self.redis.clone();
        let grab = red_packet::grab(
            &mut conn,
            &self.scripts,
            &keys,
            &req.request_id,
            req.user_id,
            self.config.result_ttl.as_secs(),
        )
        .await?;
        let (share, amount, asset) = match grab {
            Grab::Got {
                share,
                amount,
                asset,
                ..
            } => (share, amount, asset),
            Grab::Already { share, amount } => {
                let mut result = rejected_result(
                    &req,
                    ErrorCode::AlreadyGrabbed,
                    format!(
                        "user {} already grabbed share {share} of {}",
                        req.user_id, req.pool
                    ),
                );
                result.previous = Some(Prize::Share { share, amount });
                return Ok(Outcome {
                    reply: Some(typed_json("draw_result", &result)),
                    ..Outcome::default()
                });
            }
            Grab::Closed => {
                return Ok(rejected(
                    &req,
                    ErrorCode::PoolClosed,
                    format!("red packet {} is closed", req.pool),
                ))
            }
            Grab::SoldOut => {
                return Ok(rejected(
                    &req,
                    ErrorCode::SoldOut,
                    format!("red packet {} is empty", req.pool),
                ))
            }
            Grab::Unknown => {
                return Ok(rejected(
                    &req,
                    ErrorCode::UnknownPool,
                    format!("no pool named {}", req.pool),
                ))
            }
        };

        let result = DrawResult {
            request_id: req.request_id.clone(),
            status: Status::Ok,
            pool: Some(req.pool.clone()),
            user_id: Some(req.user_id),
            prizes: vec![Prize::Share { share, amount }],
            reward: Some(amount),
            asset: Some(asset.clone()),
            ..DrawResult::default()
        };
        // One entry per (packet, user): even a different request id cannot credit twice.
        let entry = SettleRequest::new(
            format!("redpacket:{}:grab:{}", req.pool, req.user_id),
            req.user_id,
            asset,
            amount,
            "red_packet",
            json!({ "pool": req.pool, "request_id": req.request_id, "share": share }),
        );
        Ok(self.completed(&result, Vec::new(), Some(entry)))
    }

    /// A lottery draw through the activity's strategy.
    async fn draw_lottery(
        &self,
        req: DrawRequest,
        keys: PoolKeys,
        strategy: &'static dyn lottery::Strategy,
    ) -> Result<Outcome, HandleError> {
        if req.count != 1 {
            return Err(Invalid::new(format!(
                "a lottery draw spends one chance; `count` must be 1, got {}",
                req.count
            ))
            .into());
        }
        let mut conn = self.redis.clone();
        let step = strategy
            .draw(lottery::DrawContext {
                conn: &mut conn,
                scripts: &self.scripts,
                keys: &keys,
                request_id: &req.request_id,
                user: req.user_id,
                result_ttl_s: self.config.result_ttl.as_secs(),
            })
            .await?;
        let (prize, chances_left) = match step {
            LotteryStep::Won {
                prize,
                chances_left,
                ..
            } => (prize, chances_left),
            LotteryStep::NotStarted => {
                return Ok(rejected(
                    &req,
                    ErrorCode::NotStarted,
                    format!("activity {} has not started", req.pool),
                ))
            }
            LotteryStep::Ended => {
                return Ok(rejected(
                    &req,
                    ErrorCode::Ended,
                    format!("activity {} has ended", req.pool),
                ))
            }
            LotteryStep::NoChances => {
                return Ok(rejected(
                    &req,
                    ErrorCode::NoChances,
                    format!("user {} has no chance left in {}", req.user_id, req.pool),
                ))
            }
            LotteryStep::SoldOut => {
                return Ok(rejected(
                    &req,
                    ErrorCode::SoldOut,
                    format!("activity {} has no prize left", req.pool),
                ))
            }
            LotteryStep::Unknown => {
                return Ok(rejected(
                    &req,
                    ErrorCode::UnknownPool,
                    format!("no pool named {}", req.pool),
                ))
            }
        };
        let asset = format!("item:{prize}");
        let result = DrawResult {
            request_id: req.request_id.clone(),
            status: Status::Ok,
            pool: Some(req.pool.clone()),
            user_id: Some(req.user_id),
            prizes: vec![Prize::Item {
                prize,
                asset: asset.clone(),
                amount: 1,
            }],
            chances_left: Some(chances_left),
            ..DrawResult::default()
        };
        let entry = SettleRequest::new(
            format!("lottery:{}", req.request_id),
            req.user_id,
            asset,
            1,
            "lottery",
            json!({ "pool": req.pool, "request_id": req.request_id }),
        );
        Ok(self.completed(&result, Vec::new(), Some(entry)))
    }

    /// A lucky-gift draw, waiting for a refill when the pool is short.
    async fn draw_lucky_gift(
        &self,
        req: DrawRequest,
        keys: PoolKeys,
        storage: Storage,
        publisher: &Publisher,
    ) -> Result<Outcome, HandleError> {
        let mut conn = self.redis.clone();
        let mut delays = ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(Duration::from_millis(10))
            .with_max_delay(Duration::from_millis(250))
            .with_total_delay(Some(self.config.short_pool_wait))
            .without_max_times()
            .build();
        let mut refill_asked: Option<u64> = None;
        loop {
            let step = lucky_gift::draw(
                &mut conn,
                &self.scripts,
                &keys,
                storage,
                &req.request_id,
                req.count,
                self.config.result_ttl.as_secs(),
            )
            .await?;
            let (in_pool, generation) = match step {
                DrawStep::Drawn(drawn) | DrawStep::Replayed(drawn) => {
                    return self.drawn(&req, &keys, drawn).await
                }
                DrawStep::TooMany { max_count } => {
                    return Err(Invalid::new(format!(
                        "`count` {} is above the max_count {max_count} of pool {}",
                        req.count, req.pool
                    ))
                    .into())
                }
                DrawStep::Unknown => {
                    return Ok(rejected(
                        &req,
                        ErrorCode::UnknownPool,
                        format!("no pool named {}", req.pool),
                    ))
                }
                DrawStep::Short {
                    in_pool,
                    generation,
                } => (in_pool, generation),
            };
            // Ask for the next batch once per batch seen short; the refill
            // worker stocks one batch per trigger however often it is asked.
            if refill_asked != Some(generation) {
                let refill = RefillRequest {
                    pool: req.pool.clone(),
                    trigger: generation,
                    urgent: true,
                };
                publisher
                    .publish(Outgoing::work_raw(
                        amqp::REFILL.routing_key,
                        typed_json("refill", &refill),
                    ))
                    .await?;
                refill_asked = Some(generation);
                metrics::counter!("prizepool_urgent_refills_total").increment(1);
            }
            match delays.next() {
                Some(delay) => tokio::time::sleep(delay).await,
                None => {
                    metrics::counter!("prizepool_pool_exhausted_total").increment(1);
                    return Ok(rejected(
                        &req,
                        ErrorCode::PoolExhausted,
                        format!(
                            "pool {} holds {in_pool} prizes, fewer than {} asked, and no refill arrived in time",
                            req.pool, req.count
                        ),
                    ));
                }
            }
        }
    }

    async fn table(
        &self,
        keys: &PoolKeys,
        pool: &str,
        needed: u32,
    ) -> Result<Arc<(CodeTable, String)>, HandleError> {
        if let Some(t) = self.codes.read().await.get(pool) {
            if (needed as usize) < t.0.len() {
                return Ok(t.clone());
            }
        }
        let mut conn = self.redis.clone();
        let loaded = lucky_gift::load_codes(&mut conn, keys)
            .await?
            .ok_or_else(|| anyhow::anyhow!("pool {pool} has no code table"))?;
        let loaded = Arc::new(loaded);
        self.codes
            .write()
            .await
            .insert(pool.to_owned(), loaded.clone());
        Ok(loaded)
    }

    async fn drawn(
        &self,
        req: &DrawRequest,
        keys: &PoolKeys,
        drawn: Drawn,
    ) -> Result<Outcome, HandleError> {
        let highest = drawn.codes.iter().copied().max().unwrap_or(0);
        let table = self.table(keys, &req.pool, highest).await?;
        let (codes, asset) = (&table.0, &table.1);
        let mut prizes = Vec::with_capacity(drawn.codes.len());
        let mut total: u64 = 0;
        for &code in &drawn.codes {
            let (combo, multiplier) = codes.decode(code).ok_or_else(|| {
                anyhow::anyhow!("code {code} is not in the table of pool {}", req.pool)
            })?;
            total += multiplier;
            prizes.push(Prize::Multiplier {
                multiplier,
                combo: combo.to_owned(),
            });
        }
        let reward = i64::try_from(total)
            .ok()
            .and_then(|t| t.checked_mul(drawn.unit_price))
            .ok_or_else(|| anyhow::anyhow!("reward overflows"))?;
        let result = DrawResult {
            request_id: req.request_id.clone(),
            status: Status::Ok,
            pool: Some(req.pool.clone()),
            user_id: Some(req.user_id),
            prizes,
            total_multiplier: Some(total),
            reward: Some(reward),
            asset: Some(asset.clone()),
            ..DrawResult::default()
        };
        let mut effects = Vec::with_capacity(2);
        let entry = (reward != 0).then(|| {
            SettleRequest::new(
                format!("draw:{}", req.request_id),
                req.user_id,
                asset.as_str(),
                reward,
                "lucky_gift",
                json!({ "pool": req.pool, "request_id": req.request_id }),
            )
        });
        if let Some(trigger) = drawn.trigger {
            let refill = RefillRequest {
                pool: req.pool.clone(),
                trigger,
                urgent: false,
            };
            effects.push(Outgoing::work_raw(
                amqp::REFILL.routing_key,
                typed_json("refill", &refill),
            ));
        }
        metrics::counter!("prizepool_prizes_drawn_total").increment(drawn.codes.len() as u64);
        Ok(self.completed(&result, effects, entry))
    }

    async fn grant(&self, grant: GrantRequest) -> Result<Outcome, HandleError> {
        grant.validate()?;
        let keys = PoolKeys::new(&self.config.redis_prefix, &grant.activity);
        let mut conn = self.redis.clone();
        let reply = match lottery::grant(
            &mut conn,
            &self.scripts,
            &keys,
            &grant.grant_id,
            grant.user_id,
            grant.chances,
        )
        .await?
        {
            Some(total) => json!({
                "type": "grant_result", "grant_id": grant.grant_id, "status": "ok",
                "chances": grant.chances, "chances_left": total,
            }),
            None => json!({
                "type": "grant_result", "grant_id": grant.grant_id, "status": "rejected",
                "error": { "code": ErrorCode::UnknownPool, "message": format!("no activity named {}", grant.activity) },
            }),
        };
        Ok(Outcome {
            reply: Some(reply.to_string().into_bytes()),
            ..Outcome::default()
        })
    }
}

/// A `rejected` draw result: a business refusal, not bad input.
pub fn rejected(req: &DrawRequest, code: ErrorCode, message: String) -> Outcome {
    Outcome {
        reply: Some(typed_json(
            "draw_result",
            &rejected_result(req, code, message),
        )),
        ..Outcome::default()
    }
}

fn rejected_result(req: &DrawRequest, code: ErrorCode, message: String) -> DrawResult {
    DrawResult {
        request_id: req.request_id.clone(),
        status: Status::Rejected,
        pool: Some(req.pool.clone()),
        user_id: Some(req.user_id),
        error: Some(ErrorBody { code, message }),
        ..DrawResult::default()
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
        match decode_typed::<DrawQueueMessage>(envelope)? {
            DrawQueueMessage::Draw(req) => self.draw(req, publisher).await,
            DrawQueueMessage::Grant(grant) => self.grant(grant).await,
        }
    }
}

/// Runs a draw worker until `shutdown`.
pub async fn run(
    config: Config,
    health: crate::ops::Health,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let redis = crate::redis_conn::connect(&config.redis_url).await?;
    let worker = Arc::new(DrawWorker::new(config.clone(), redis));
    amqp::run(&config, worker, health, shutdown).await
}
