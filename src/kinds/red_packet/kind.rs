//! Red packet as the registry knows it ([`crate::kinds::registry`]): its
//! label, its ledger reasons, its grab, and its create and expiry on the
//! refill queue.

use crate::kinds::red_packet::scripts as lua;
use futures_util::future::BoxFuture;

use super::{grab, grab_call, lifecycle, KIND};
use crate::{
    amqp::HandleError,
    kinds::{
        registry::{At, Draw, Lifecycle, Meta, PrizeKind},
        Ask, Step,
    },
    scripts::{PoolKeys, ScriptInvocation},
};

/// The red-packet kind, registered in [`crate::kinds::KINDS`].
pub static RED_PACKET: RedPacket = RedPacket;

/// See [`RED_PACKET`].
#[derive(Debug)]
pub struct RedPacket;

/// A red packet's draw: a grab.
#[derive(Debug)]
struct Grab;

impl PrizeKind for RedPacket {
    fn label(&self) -> &'static str {
        KIND
    }

    fn resolve(&self, _id: &str, _meta: &Meta<'_>) -> Result<&'static dyn Draw, HandleError> {
        Ok(&Grab)
    }

    fn lifecycle(&self) -> &'static [Lifecycle] {
        lifecycle::LIFECYCLE
    }
}

impl Draw for Grab {
    fn label(&self) -> &'static str {
        KIND
    }

    /// One grab call per ask, in order.
    fn draw_pool<'a>(
        &'a self,
        at: At<'a>,
        asks: &'a [Ask<'a>],
    ) -> BoxFuture<'a, Vec<Result<Step, HandleError>>> {
        let keys = at.keys;
        at.one_by_one(asks, move |mut conn, ask| async move {
            grab(&mut conn, keys, ask).await
        })
    }

    fn script_call(&self, keys: &PoolKeys, ask: &Ask<'_>) -> ScriptInvocation<'static> {
        grab_call(&lua::GRAB, keys, ask.user, ask.result_ttl_s, ask.token)
    }
}
