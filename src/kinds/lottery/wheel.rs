//! The `wheel` strategy: weighted odds over prizes with stock left, plus an
//! unlimited consolation prize, so every draw wins something.

use futures_util::future::BoxFuture;
use rand::Rng;

use super::{ActivityConfig, DrawContext, LotteryStep, Strategy};

/// The wheel strategy.
#[derive(Debug)]
pub(super) struct Wheel;

impl Strategy for Wheel {
    fn label(&self) -> &'static str {
        "wheel"
    }

    fn validate(&self, activity: &ActivityConfig) -> Result<(), String> {
        if activity.consolation.is_none() {
            return Err("the wheel needs a consolation prize (every draw wins something)".into());
        }
        Ok(())
    }

    fn draw<'a>(
        &'a self,
        ctx: DrawContext<'a>,
    ) -> BoxFuture<'a, Result<LotteryStep, redis::RedisError>> {
        Box::pin(async move {
            let day = crate::scripts::utc_day();
            let spin: u32 = rand::rng().random_range(0..(1u32 << 31));
            let (status, text): (String, String) = ctx
                .scripts
                .draw_wheel
                .key(ctx.keys.meta())
                .key(ctx.keys.chances())
                .key(ctx.keys.stock())
                .key(ctx.keys.awarded())
                .key(ctx.keys.result(ctx.request_id))
                .key(ctx.keys.pv(&day))
                .key(ctx.keys.uv(&day))
                .arg(ctx.user)
                .arg(crate::scripts::now_ms())
                .arg(spin)
                .arg(ctx.result_ttl_s)
                .arg(super::STATS_TTL_S)
                .invoke_async(ctx.conn)
                .await?;
            Ok(LotteryStep::from_reply(&status, &text))
        })
    }
}
