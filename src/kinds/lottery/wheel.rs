//! The `wheel` strategy: weighted odds over prizes with stock left, plus an
//! optional consolation prize with unlimited stock. With one, every draw
//! wins something; without one, a draw after every prize is gone answers
//! `sold_out` and spends no chance.

use super::{ActivityConfig, Pick, Strategy};
use crate::kinds::lottery::scripts as lua;
use crate::{kinds::Ask, scripts::PoolKeys};

/// The wheel strategy.
#[derive(Debug)]
pub(super) struct Wheel;

impl Strategy for Wheel {
    fn label(&self) -> &'static str {
        "wheel"
    }

    fn validate(&self, activity: &ActivityConfig) -> Result<(), String> {
        if activity.prizes.is_empty() && activity.consolation.is_none() {
            return Err("the wheel needs at least one prize or a consolation prize".into());
        }
        Ok(())
    }

    fn seeded(&self) -> bool {
        true
    }

    fn invocation(
        &self,
        keys: &PoolKeys,
        ask: &Ask<'_>,
        pick: &Pick,
    ) -> crate::scripts::ScriptInvocation<'static> {
        call(&lua::DRAW_WHEEL, keys, ask, pick)
    }
}

/// The call of a lottery draw script with the keys and arguments
/// `draw_wheel.lua` lists (other strategies' scripts take the same).
pub(super) fn call<'a>(
    script: &'a crate::scripts::Script,
    keys: &PoolKeys,
    ask: &Ask<'_>,
    pick: &Pick,
) -> crate::scripts::ScriptInvocation<'a> {
    let day = crate::scripts::utc_day();
    let mut call = script.prepare_invoke();
    call.key(keys.meta())
        .key(keys.chances())
        .key(keys.stock())
        .key(keys.awarded())
        .key(keys.results())
        .key(keys.pv(&day))
        .key(keys.uv(&day))
        .key(keys.lottery_seeds())
        .arg(ask.user)
        .arg(pick.now_ms)
        .arg(&pick.values)
        .arg(ask.result_ttl_s)
        .arg(super::STATS_TTL_S)
        .arg(ask.token)
        .arg(pick.period)
        .arg(&pick.commitment);
    call
}
