//! Lucky gift as the registry knows it ([`crate::kinds::registry`]): its
//! label, its ledger reason, a draw per storage, and its refill on the
//! refill queue.

use std::any::Any;

use futures_util::future::BoxFuture;

use super::{draw, draw_call, draw_script, refill, Coalescer, Decoder, Storage, KIND};
use crate::{
    amqp::HandleError,
    kinds::{
        registry::{At, Draw, Lifecycle, Meta, PrizeKind},
        Ask, Step,
    },
    scripts::{PoolKeys, ScriptInvocation},
};

/// The lucky-gift kind, registered in [`crate::kinds::KINDS`].
pub static LUCKY_GIFT: LuckyGift = LuckyGift;

/// See [`LUCKY_GIFT`].
#[derive(Debug)]
pub struct LuckyGift;

/// The draw of each storage, by [`Storage::ALL`]'s order.
static DRAWS: [Storage; Storage::ALL.len()] = Storage::ALL;

/// What one dispatch keeps for lucky-gift draws.
#[derive(Debug)]
struct Dispatch {
    /// The pools' draws in flight, coalesced per pool.
    calls: Coalescer,
    /// The pools' code tables.
    codes: Decoder,
}

impl PrizeKind for LuckyGift {
    fn label(&self) -> &'static str {
        KIND
    }

    fn meta_fields(&self) -> &'static [&'static str] {
        &["storage"]
    }

    fn resolve(&self, _id: &str, meta: &Meta<'_>) -> Result<&'static dyn Draw, HandleError> {
        let storage = Storage::from_label(meta.get("storage"));
        DRAWS
            .iter()
            .find(|s| **s == storage)
            .map(|s| s as &'static dyn Draw)
            .ok_or_else(|| HandleError::internal(format!("no draw for storage {storage:?}")))
    }

    fn open(&self) -> Box<dyn Any + Send + Sync> {
        Box::new(Dispatch {
            calls: Coalescer::default(),
            codes: Decoder::default(),
        })
    }

    fn lifecycle(&self) -> &'static [Lifecycle] {
        refill::LIFECYCLE
    }

    fn open_life(&self) -> Box<dyn Any + Send + Sync> {
        Box::new(refill::Attempts::default())
    }
}

impl Draw for Storage {
    fn label(&self) -> &'static str {
        KIND
    }

    fn routes_sub_pools(&self) -> bool {
        true
    }

    /// Applies the asks in one call, shared with the draws of other
    /// deliveries in flight ([`Coalescer`]).
    fn draw_pool<'a>(
        &'a self,
        at: At<'a>,
        asks: &'a [Ask<'a>],
    ) -> BoxFuture<'a, Vec<Result<Step, HandleError>>> {
        Box::pin(async move {
            let Some(dispatch) = at.state::<Dispatch>() else {
                return At::foreign(asks);
            };
            draw(
                at.redis,
                &dispatch.calls,
                &dispatch.codes,
                at.keys,
                *self,
                asks,
            )
            .await
        })
    }

    fn script_call(&self, keys: &PoolKeys, ask: &Ask<'_>) -> ScriptInvocation<'static> {
        draw_call(
            draw_script(*self),
            keys,
            *self,
            &crate::scripts::utc_day(),
            ask.count,
            ask.result_ttl_s,
            ask.token,
        )
    }
}
