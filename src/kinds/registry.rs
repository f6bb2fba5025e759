//! What a prize kind declares, once, in its own folder, and the one list of
//! the kinds ([`KINDS`]).
//!
//! A kind is a value implementing [`PrizeKind`] (`lucky_gift::LUCKY_GIFT`,
//! …): its label, how a pool's meta hash resolves into
//! its [`Draw`], and its lifecycle messages on the refill queue. The seam's
//! dispatch ([`super::Kinds`]) and the refill worker read this list. The
//! ledger, which this module builds on, reads the kinds' reasons from its
//! own list (`KIND_REASONS` in `ledger/reasons.rs`, each kind's
//! `reasons.rs`), and a test checks the two lists agree. So a new kind is
//! its folder, its module line in `kinds/mod.rs`, its line in [`KINDS`] and
//! its line in `KIND_REASONS`.
//!
//! The draw is a `&'static dyn Draw` chosen once per pool and cached with
//! it: lucky gift has one per storage, the lottery one per strategy, so a
//! draw step costs one virtual call and no match on the kind.

use std::any::Any;

use futures_util::future::BoxFuture;

use super::{lottery, lucky_gift, red_packet, Ask, Step};
use crate::{
    amqp::HandleError,
    ledger::Unsealed,
    redis_conn::RedisConn,
    scripts::{PoolKeys, ScriptInvocation, Scripts},
};

/// Every prize kind, one line each: the seam and the refill worker know the
/// kinds from this list alone (the ledger from `KIND_REASONS`, checked
/// against it).
pub static KINDS: &[&dyn PrizeKind] = &[
    &lucky_gift::LUCKY_GIFT,
    &red_packet::RED_PACKET,
    &lottery::LOTTERY,
];

/// A prize kind: what the fleet's shared parts need to know of it.
pub trait PrizeKind: std::fmt::Debug + Send + Sync {
    /// The label its pools carry (`meta.kind` in Redis, `pools.kind` in
    /// Postgres): the `KIND` of its folder.
    fn label(&self) -> &'static str;

    /// The fields of a pool's meta hash [`PrizeKind::resolve`] reads, past
    /// `kind`, `shards` and `r.e`: they are fetched in the seam's one
    /// `HMGET`.
    fn meta_fields(&self) -> &'static [&'static str] {
        &[]
    }

    /// The draw of pool `id`, from its meta fields. Called once per pool
    /// and worker: the answer is cached with the pool.
    fn resolve(&self, id: &str, meta: &Meta<'_>) -> Result<&'static dyn Draw, HandleError>;

    /// What one dispatch ([`super::Kinds`]) keeps for this kind's draws
    /// (lucky gift: its coalescer and code tables); handed to each
    /// [`Draw::draw_pool`] as [`At::state`].
    fn open(&self) -> Box<dyn Any + Send + Sync> {
        Box::new(())
    }

    /// Its lifecycle messages on the refill queue (issue, expiry, refund,
    /// stocking), each with its handler.
    fn lifecycle(&self) -> &'static [Lifecycle] {
        &[]
    }

    /// What one refill worker keeps for this kind's lifecycle steps; handed
    /// to each [`Lifecycle::handle`] as [`Life::state`].
    fn open_life(&self) -> Box<dyn Any + Send + Sync> {
        Box::new(())
    }
}

/// How the pools of a kind draw: one value per kind, or per variant of a
/// kind (a lucky-gift storage, a lottery strategy).
pub trait Draw: std::fmt::Debug + Send + Sync {
    /// The label of the kind.
    fn label(&self) -> &'static str;

    /// Whether a pool of this kind may be stocked as sub-pools (`shards`),
    /// its draws routed by user ([`super::Kinds::route`]).
    fn routes_sub_pools(&self) -> bool {
        false
    }

    /// Draw steps for `asks`, all of the pool behind [`At::keys`], applied
    /// in order; their steps in the same order.
    fn draw_pool<'a>(
        &'a self,
        at: At<'a>,
        asks: &'a [Ask<'a>],
    ) -> BoxFuture<'a, Vec<Result<Step, HandleError>>>;

    /// The `type` of the message a short draw asks the refill worker for
    /// ([`super::Step::Short`]): the next batch (`refill`), or for a lottery
    /// the commitment of the period's seed (`lottery.seed`). Its body is a
    /// [`crate::messages::RefillRequest`].
    fn short_message(&self) -> &'static str {
        "refill"
    }

    /// The Lua call one draw step makes for `ask`, with the same keys and
    /// arguments, but nothing around it (`prizepool bench`).
    fn script_call(&self, keys: &PoolKeys, ask: &Ask<'_>) -> ScriptInvocation<'static>;

    /// [`Draw::script_call`] with what a step reads before its call (a
    /// lottery's committed seed), so the call draws as a step's would.
    fn prepared_call<'a>(
        &'a self,
        _redis: &'a RedisConn,
        keys: &'a PoolKeys,
        ask: &'a Ask<'a>,
    ) -> BoxFuture<'a, Result<ScriptInvocation<'static>, HandleError>> {
        let call = self.script_call(keys, ask);
        Box::pin(async move { Ok(call) })
    }
}

/// What a draw step gets of its dispatch.
#[derive(Clone, Copy)]
pub struct At<'a> {
    pub redis: &'a RedisConn,
    pub scripts: &'a Scripts,
    /// The keys of the pool the asks draw from.
    pub keys: &'a PoolKeys,
    /// What [`PrizeKind::open`] made for this dispatch.
    pub state: &'a (dyn Any + Send + Sync),
}

impl std::fmt::Debug for At<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("At").field("keys", self.keys).finish()
    }
}

impl<'a> At<'a> {
    /// The steps of `asks` one call each, in order: the draw of a kind
    /// whose Lua step applies one ask (a red-packet grab, a lottery draw).
    pub fn one_by_one<F, Fut>(
        self,
        asks: &'a [Ask<'a>],
        step: F,
    ) -> BoxFuture<'a, Vec<Result<Step, HandleError>>>
    where
        F: Fn(RedisConn, &'a Ask<'a>) -> Fut + Send + 'a,
        Fut: std::future::Future<Output = Result<Step, HandleError>> + Send + 'a,
    {
        Box::pin(async move {
            let mut steps = Vec::with_capacity(asks.len());
            for ask in asks {
                steps.push(step(self.redis.clone(), ask).await);
            }
            steps
        })
    }
}

impl At<'_> {
    /// The kind's state, as the type [`PrizeKind::open`] made it; `None`
    /// if it is another type (see [`At::foreign`]).
    pub fn state<T: 'static>(&self) -> Option<&T> {
        self.state.downcast_ref()
    }

    /// The steps of `asks` when a draw got a state it did not make: a kind
    /// registered wrong, which no retry mends.
    pub fn foreign<T>(asks: &[Ask<'_>]) -> Vec<Result<T, HandleError>> {
        asks.iter()
            .map(|_| {
                Err(HandleError::internal(
                    "a kind's draw got another kind's state",
                ))
            })
            .collect()
    }
}

/// The fields of a pool's meta hash the seam read, by name.
#[derive(Debug)]
pub struct Meta<'a> {
    pub(super) names: &'a [&'static str],
    pub(super) values: &'a [Option<String>],
}

impl Meta<'_> {
    /// Field `name`, if the pool has it (and some kind asked for it).
    pub fn get(&self, name: &str) -> Option<&str> {
        let i = self.names.iter().position(|n| *n == name)?;
        self.values.get(i)?.as_deref()
    }
}

/// One lifecycle message of a kind on the refill queue.
#[derive(Debug)]
pub struct Lifecycle {
    /// The message's `type` (`redpacket.create`).
    pub message: &'static str,
    /// The `type` of its reply (`redpacket_result`), also when it is
    /// refused as bad input before its step runs.
    pub reply: &'static str,
    /// Whether its step needs Postgres (its lane in the worker, so a
    /// Postgres outage stalls no other message).
    pub postgres: bool,
    /// The step: decodes the envelope and answers what it owes (reply,
    /// events, ledger entries), which the worker seals and publishes.
    pub handle: for<'a> fn(&'a Life<'a>, &'a serde_json::Value) -> LifeStep<'a>,
}

/// What a lifecycle step answers.
pub type LifeStep<'a> = BoxFuture<'a, Result<Unsealed, HandleError>>;

/// What a lifecycle step gets of the refill worker.
pub struct Life<'a> {
    pub config: &'a crate::config::Config,
    pub db: &'a sqlx::PgPool,
    pub redis: &'a RedisConn,
    pub scripts: &'a Scripts,
    /// Seals what the step publishes that the audit trail must believe.
    pub sealer: &'a crate::ledger::FleetSealer,
    /// What [`PrizeKind::open_life`] made for this worker.
    pub state: &'a (dyn Any + Send + Sync),
}

impl std::fmt::Debug for Life<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Life").finish_non_exhaustive()
    }
}

impl Life<'_> {
    /// The kind's state, as the type [`PrizeKind::open_life`] made it;
    /// `None` if it is another type (a kind registered wrong).
    pub fn state<T: 'static>(&self) -> Option<&T> {
        self.state.downcast_ref()
    }
}

/// The kind labelled `label`, with its place in [`KINDS`].
pub fn find(label: &str) -> Option<(usize, &'static dyn PrizeKind)> {
    KINDS
        .iter()
        .enumerate()
        .find(|(_, k)| k.label() == label)
        .map(|(i, k)| (i, *k))
}

/// The lifecycle step handling messages of type `message`, with the place
/// of its kind in [`KINDS`].
pub fn lifecycle(message: &str) -> Option<(usize, &'static Lifecycle)> {
    KINDS.iter().enumerate().find_map(|(i, k)| {
        k.lifecycle()
            .iter()
            .find(|l| l.message == message)
            .map(|l| (i, l))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_resolves_its_pools_to_a_draw_of_its_own() {
        let names = ["kind", "storage", "strategy"];
        let values = [None, Some("sparse".to_owned()), Some("ladder".to_owned())];
        let meta = Meta {
            names: &names,
            values: &values,
        };
        for kind in KINDS {
            let draw = kind.resolve("p", &meta).unwrap();
            assert_eq!(draw.label(), kind.label());
            // Only lucky-gift pools are stocked as sub-pools.
            assert_eq!(draw.routes_sub_pools(), kind.label() == "lucky_gift");
        }
        let unknown = [None, None, Some("no_such".to_owned())];
        let (_, lottery) = find("lottery").unwrap();
        let meta = Meta {
            names: &names,
            values: &unknown,
        };
        assert!(lottery.resolve("a", &meta).is_err());
        assert!(find("scratch_card").is_none());
    }

    #[test]
    fn lifecycle_messages_reach_their_kind_and_name_their_reply() {
        let (slot, refill) = lifecycle("refill").unwrap();
        assert_eq!(KINDS[slot].label(), "lucky_gift");
        assert_eq!((refill.reply, refill.postgres), ("refill_result", false));
        for message in ["redpacket.create", "redpacket.expire"] {
            let (slot, step) = lifecycle(message).unwrap();
            assert_eq!(KINDS[slot].label(), "red_packet");
            assert!(step.postgres, "{message}");
            assert_eq!(
                crate::messages::reply_type(Some(message)),
                "redpacket_result"
            );
        }
        assert!(lifecycle("draw").is_none());
        assert_eq!(crate::messages::reply_type(Some("refill")), "refill_result");
        assert_eq!(crate::messages::reply_type(Some("nonsense")), "draw_result");
    }
}
