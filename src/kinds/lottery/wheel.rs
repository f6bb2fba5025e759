//! The `wheel` strategy: weighted odds over prizes with stock left, plus an
//! unlimited consolation prize, so every draw wins something.

use rand::Rng;

use super::{ActivityConfig, Strategy};
use crate::scripts::{PoolKeys, Scripts};

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

    fn invocation<'a>(
        &self,
        scripts: &'a Scripts,
        keys: &PoolKeys,
        request_id: &str,
        user: i64,
        result_ttl_s: u64,
    ) -> redis::ScriptInvocation<'a> {
        let day = crate::scripts::utc_day();
        let spin: u32 = rand::rng().random_range(0..(1u32 << 31));
        let mut call = scripts.draw_wheel.prepare_invoke();
        call.key(keys.meta())
            .key(keys.chances())
            .key(keys.stock())
            .key(keys.awarded())
            .key(keys.result(request_id))
            .key(keys.pv(&day))
            .key(keys.uv(&day))
            .arg(user)
            .arg(crate::scripts::now_ms())
            .arg(spin)
            .arg(result_ttl_s)
            .arg(super::STATS_TTL_S);
        call
    }
}
