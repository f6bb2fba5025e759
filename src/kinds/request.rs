//! A draw request's way through the seam, whatever its kind.
//!
//! The draw worker hands a validated request to [`Kinds::open`] and gets
//! back either a final answer or a [`Prepared`] draw; it runs the prepared
//! draw's steps ([`Kinds::step_all`]) and, if the pool stays short past the
//! worker's wait, ends it with [`Kinds::exhausted`]. Everything between the
//! request and its [`Step`] is written here once, for every kind:
//!
//! 1. **The id is bound to its content before anything moves.**
//!    [`Kinds::open`] claims the request id for the fingerprint of (pool,
//!    user, count). The claim is one `SET NX` of the fingerprint in the
//!    claim store (`claim.lua`): two copies of one request sent at once
//!    both pass it (same fingerprint), while the same id with other content
//!    is refused as `invalid_request` and draws nothing, whatever the pool.
//! 2. **The pool is routed once.** The pool's kind, and for a sharded
//!    lucky-gift pool the sub-pool of the user, come from
//!    [`Kinds::route`]; every later call uses the keys of that home pool,
//!    so a retry of the request meets the answer its first copy stored.
//! 3. **Every final answer is stored.** A kind's step stores its award or
//!    refusal atomically with its effect, in the home pool's answer store;
//!    refusals decided outside a step (an unknown pool, a pool that stayed
//!    short) are stored here with `remember`, which stores only if nothing
//!    is there yet. If a concurrent copy of the request drew meanwhile, its
//!    stored award wins: the kind's step replays it and both copies answer
//!    the same.
//!    An `unknown_pool` is stored only while the pool is not there: a
//!    load that finished after the route routes the request again, so no
//!    answer lands under a sharded pool's own id once its draws go to its
//!    sub-pools.
//! 4. **Bad for this pool frees the id.** A step that finds the request
//!    invalid for its pool (a count past the pool's maximum) stored nothing;
//!    the claim is released so the id can carry the request the upstream
//!    meant to send. A claim two copies of the request took is kept: the
//!    other copy may have drawn meanwhile (`claim.lua`).

use super::{
    answer::{self, Claim, Refusal, ScriptReply, Tokens},
    fingerprint, lottery, Ask, Kind, Kinds, Step,
};
use crate::{
    amqp::HandleError,
    messages::{DrawRequest, ErrorBody, ErrorCode, GrantRequest, GrantResult, Status},
};

/// A draw request whose id is claimed for its content and whose pool's
/// kind and home pool are known: ready for its steps.
#[derive(Debug)]
pub struct Prepared {
    req: DrawRequest,
    tokens: Tokens,
    kind: Kind,
    /// The pool whose keys hold the draw: the pool the request named, or
    /// the sub-pool its user's draws go to ([`Kinds::route`]).
    home: String,
    ttl: u64,
}

impl Prepared {
    /// What the kind's step is asked.
    pub fn ask(&self) -> Ask<'_> {
        Ask {
            request_id: &self.req.request_id,
            pool: &self.home,
            user: self.req.user_id,
            count: self.req.count,
            token: &self.tokens.answer,
            result_ttl_s: self.ttl,
        }
    }

    /// The request as it came.
    pub fn request(&self) -> &DrawRequest {
        &self.req
    }

    /// The pool's kind.
    pub fn kind(&self) -> Kind {
        self.kind
    }
}

/// A request after [`Kinds::open`].
#[derive(Debug)]
pub enum Opened {
    /// Its steps can run.
    Ready(Prepared),
    /// It is answered already (an unknown pool), with the answer stored.
    Answered(DrawRequest, Step),
}

impl Kinds {
    /// Binds the request's id to its content and resolves its pool; an
    /// unknown pool is answered (and the answer stored) here. The request
    /// must be valid ([`DrawRequest::validate`]); answers are kept
    /// `ttl` seconds.
    pub async fn open(&self, req: DrawRequest, ttl: u64) -> Result<Opened, HandleError> {
        let fingerprint = fingerprint("draw", &[&req.pool, &req.user_id, &req.count]);
        let mut tokens = Tokens::new(&self.prefix, "rq", &req.request_id, fingerprint, ttl)
            .with_earlier(self.reads_earlier_layout());
        let mut conn = self.redis();
        if answer::claim(&mut conn, self.scripts(), &mut tokens).await? == Claim::Reused {
            return Err(answer::reused("request_id", &req.request_id));
        }
        let mut routed = self.route(&req.pool, req.user_id).await?;
        if routed.is_none() {
            let ask = Ask {
                request_id: &req.request_id,
                pool: &req.pool,
                user: req.user_id,
                count: req.count,
                token: &tokens.answer,
                result_ttl_s: ttl,
            };
            let unknown = Refusal::new(ErrorCode::UnknownPool);
            // Stored only while the pool is not there: a load that finished
            // since the route routes the request again, so no answer lands
            // under a pool's own id once its draws go elsewhere.
            if let Some(step) = self.settle_refusal(&ask, unknown.clone(), true).await? {
                return Ok(Opened::Answered(req, step));
            }
            routed = self.route(&req.pool, req.user_id).await?;
            if routed.is_none() {
                // There, but not a pool a draw may name (a sub-pool).
                let step = self.settle_refusal(&ask, unknown, false).await?;
                let step = step.ok_or_else(|| {
                    HandleError::internal("a refusal was stored only while its pool is absent")
                })?;
                return Ok(Opened::Answered(req, step));
            }
        }
        let Some((kind, home)) = routed else {
            return Err(HandleError::internal("a routed request lost its route"));
        };
        if home != req.pool && self.answered_before(&req.pool).await? {
            if let Some(refusal) = self.answer_before_shards(&req.pool, &tokens).await? {
                return Ok(Opened::Answered(req, Step::Refused(refusal)));
            }
        }
        Ok(Opened::Ready(Prepared {
            req,
            tokens,
            kind,
            home,
            ttl,
        }))
    }

    /// The refusal stored for the request in the answer store of `pool`
    /// itself, before `pool` was loaded with shards: an `unknown_pool`
    /// answered while the id named no pool. Draws of a sharded pool run on
    /// their user's sub-pool and store their answers there; a retry of a
    /// request refused before the load must meet that first answer, not
    /// draw. Only pools whose own store holds answers pay this look-up.
    async fn answer_before_shards(
        &self,
        pool: &str,
        tokens: &Tokens,
    ) -> Result<Option<Refusal>, HandleError> {
        let mut conn = self.redis();
        let stored: Option<Vec<u8>> = self
            .scripts()
            .forget
            .key(self.keys(pool).results())
            .arg(&tokens.answer)
            .arg("answer")
            .arg("peek")
            .invoke_async(&mut conn)
            .await?;
        let Some(body) = stored else {
            return Ok(None);
        };
        // Only refusals are stored under a sharded pool's own id: its
        // awards are its sub-pools'.
        match String::from_utf8_lossy(&body).strip_prefix('!') {
            Some(refusal) => Refusal::parse(refusal).map(Some),
            None => Err(HandleError::internal(format!(
                "pool {pool} holds an award under its own id though its draws run on sub-pools"
            ))),
        }
    }

    /// One step of each prepared draw, all of one kind, applied in order
    /// per home pool (see [`Kinds::draw_all`]); their steps in the same
    /// order. A step that finds its request invalid for the pool releases
    /// the request's id.
    pub async fn step_all(&self, draws: &[&Prepared]) -> Vec<Result<Step, HandleError>> {
        let Some(first) = draws.first() else {
            return Vec::new();
        };
        let asks: Vec<Ask<'_>> = draws.iter().map(|d| d.ask()).collect();
        let steps = self.draw_all(first.kind, &asks).await;
        let mut out = Vec::with_capacity(steps.len());
        for (draw, step) in draws.iter().zip(steps) {
            out.push(match step {
                Err(HandleError::Invalid(why)) => {
                    let mut conn = self.redis();
                    answer::release(&mut conn, self.scripts(), &draw.tokens)
                        .await
                        .and(Err(HandleError::Invalid(why)))
                }
                other => other,
            });
        }
        out
    }

    /// One more step of a prepared draw (after a refill was asked for).
    pub async fn step(&self, draw: &Prepared) -> Result<Step, HandleError> {
        self.step_all(&[draw])
            .await
            .pop()
            .unwrap_or_else(|| Err(HandleError::internal("a draw step answered nothing")))
    }

    /// Ends a draw whose pool stayed short: stores `pool_exhausted` as its
    /// answer, unless a concurrent copy of the request was answered
    /// meanwhile (then that answer is the draw's).
    pub async fn exhausted(&self, draw: &Prepared) -> Result<Step, HandleError> {
        self.settle_refusal(&draw.ask(), Refusal::new(ErrorCode::PoolExhausted), false)
            .await?
            .ok_or_else(|| HandleError::internal("a pool_exhausted was not stored"))
    }

    /// Stores `refusal` as the answer of `ask` in its pool's answer store;
    /// the answer stored already, if any, wins (an award is replayed by
    /// the kind's step). With `only_while_absent`, a pool that is there
    /// now stores nothing and gives `None`: the caller routes again.
    async fn settle_refusal(
        &self,
        ask: &Ask<'_>,
        refusal: Refusal,
        only_while_absent: bool,
    ) -> Result<Option<Step>, HandleError> {
        let mut conn = self.redis();
        let results = self.keys(ask.pool).results();
        let stored = answer::remember(
            &mut conn,
            self.scripts(),
            &results,
            ask.token,
            &refusal,
            only_while_absent,
        )
        .await?;
        let step = match stored {
            None => Step::Refused(refusal),
            Some(ScriptReply::Retry) if only_while_absent => return Ok(None),
            Some(ScriptReply::Refused(stored)) => Step::Refused(stored),
            Some(_) => match self.resolve(ask.pool).await? {
                Some(kind) => match self.draw(kind, ask).await? {
                    Step::Short { .. } => {
                        return Err(HandleError::internal(format!(
                            "request {} has a stored award its pool cannot replay",
                            ask.request_id
                        )))
                    }
                    replayed => replayed,
                },
                None => {
                    return Err(HandleError::internal(format!(
                        "request {} has a stored award on an unknown pool",
                        ask.request_id
                    )))
                }
            },
        };
        Ok(Some(step))
    }

    /// A lottery grant: binds the grant id to its content, then adds the
    /// chances once ([`lottery::grant`]). The request must be valid.
    pub async fn grant(&self, grant: GrantRequest) -> Result<GrantResult, HandleError> {
        let fingerprint = fingerprint("grant", &[&grant.activity, &grant.user_id, &grant.chances]);
        let mut tokens = Tokens::new(
            &self.prefix,
            "gr",
            &grant.grant_id,
            fingerprint,
            lottery::GRANT_TTL_S,
        )
        .with_earlier(self.reads_earlier_layout());
        let mut conn = self.redis();
        if answer::claim(&mut conn, self.scripts(), &mut tokens).await? == Claim::Reused {
            return Err(answer::reused("grant_id", &grant.grant_id));
        }
        let keys = self.keys(&grant.activity);
        match lottery::grant(
            &mut conn,
            &keys,
            &grant.activity,
            &grant.grant_id,
            grant.user_id,
            grant.chances,
        )
        .await?
        {
            lottery::Granted::Ok(total) => Ok(GrantResult {
                grant_id: grant.grant_id,
                status: Status::Ok,
                chances: Some(grant.chances),
                chances_left: Some(total),
                error: None,
            }),
            lottery::Granted::Unknown => Ok(GrantResult {
                error: Some(ErrorBody {
                    code: ErrorCode::UnknownPool,
                    message: format!("no activity named {}", grant.activity),
                }),
                ..GrantResult::rejected(grant.grant_id)
            }),
            lottery::Granted::Reused => Err(answer::reused("grant_id", &grant.grant_id)),
        }
    }
}
