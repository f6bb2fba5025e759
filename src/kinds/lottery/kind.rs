//! Lottery as the registry knows it ([`crate::kinds::registry`]): its
//! label, its ledger reason and a draw per strategy. Its grants are their
//! own message on the draw queue ([`crate::kinds::Kinds::grant`]).

use futures_util::future::BoxFuture;

use super::{draw, Pick, Strategy, KIND};
use crate::{
    amqp::HandleError,
    kinds::{
        registry::{At, Draw, Lifecycle, Meta, PrizeKind},
        Ask, Step,
    },
    scripts::{PoolKeys, ScriptInvocation},
};

/// The lottery kind, registered in [`crate::kinds::KINDS`].
pub static LOTTERY: Lottery = Lottery;

/// See [`LOTTERY`].
#[derive(Debug)]
pub struct Lottery;

/// The draw of the activities of one strategy ([`REGISTRY`]).
#[derive(Debug)]
pub(super) struct ByStrategy(pub(super) &'static dyn Strategy);

impl PrizeKind for Lottery {
    fn label(&self) -> &'static str {
        KIND
    }

    fn meta_fields(&self) -> &'static [&'static str] {
        &["strategy"]
    }

    /// The commitment of a period's seed (`lottery.seed`), which a short
    /// draw asks for.
    fn lifecycle(&self) -> &'static [Lifecycle] {
        super::lifecycle::LIFECYCLE
    }

    /// The activity's strategy, resolved once: `activity load` refuses to
    /// change an activity's strategy, so it cannot go stale.
    fn resolve(&self, id: &str, meta: &Meta<'_>) -> Result<&'static dyn Draw, HandleError> {
        let strategy = meta.get("strategy");
        match strategy.and_then(by_strategy) {
            Some(s) => Ok(s),
            None => Err(HandleError::internal(format!(
                "activity {id} names no registered strategy ({strategy:?})"
            ))),
        }
    }
}

impl Draw for ByStrategy {
    fn label(&self) -> &'static str {
        KIND
    }

    /// One draw call per ask, in order.
    fn draw_pool<'a>(
        &'a self,
        at: At<'a>,
        asks: &'a [Ask<'a>],
    ) -> BoxFuture<'a, Vec<Result<Step, HandleError>>> {
        let (keys, strategy) = (at.keys, self.0);
        at.one_by_one(asks, move |mut conn, ask| async move {
            draw(&mut conn, keys, strategy, ask).await
        })
    }

    /// A short lottery draw waits for its period's seed to be committed.
    fn short_message(&self) -> &'static str {
        super::seeds::SEED_MESSAGE
    }

    /// The call without a committed seed: a `wheel` draw answers `short`
    /// (the ladder ignores the seed).
    fn script_call(&self, keys: &PoolKeys, ask: &Ask<'_>) -> ScriptInvocation<'static> {
        self.0
            .invocation(keys, ask, &Pick::unseeded(crate::scripts::now_ms()))
    }

    /// The call with the period's committed seed, as a step's first try.
    fn prepared_call<'a>(
        &'a self,
        redis: &'a crate::redis_conn::RedisConn,
        keys: &'a PoolKeys,
        ask: &'a Ask<'a>,
    ) -> futures_util::future::BoxFuture<'a, Result<ScriptInvocation<'static>, HandleError>> {
        Box::pin(async move {
            let now_ms = crate::scripts::now_ms();
            if !self.0.seeded() {
                return Ok(self.0.invocation(keys, ask, &Pick::unseeded(now_ms)));
            }
            let mut conn = redis.clone();
            let pick = match super::seeds::current(&mut conn, keys, now_ms).await? {
                Ok(seed) => Pick::seeded(now_ms, &seed, ask, 0),
                Err(period) => Pick {
                    period,
                    ..Pick::unseeded(now_ms)
                },
            };
            Ok(self.0.invocation(keys, ask, &pick))
        })
    }
}

/// Every registered strategy, each as the draw of the activities that name
/// it. A new one is a module and a line here.
static REGISTRY: &[ByStrategy] = &[
    ByStrategy(&super::wheel::Wheel),
    ByStrategy(&super::ladder::Ladder),
];

/// The strategy registered under `label`.
pub fn strategy(label: &str) -> Option<&'static dyn Strategy> {
    by_strategy(label).map(|s| s.0)
}

/// The draw of the activities of strategy `label`.
fn by_strategy(label: &str) -> Option<&'static ByStrategy> {
    REGISTRY.iter().find(|s| s.0.label() == label)
}

/// The registered labels.
pub fn labels() -> Vec<&'static str> {
    REGISTRY.iter().map(|s| s.0.label()).collect()
}
