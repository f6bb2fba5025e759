//! The `ladder` strategy: prizes are awarded in the order the activity
//! lists them, each until its stock runs out, then the consolation prize
//! (if any); without one, a draw after every prize is gone answers
//! `sold_out` and spends no chance. Deterministic: the first users to draw
//! get the first prizes.

use super::{ActivityConfig, Pick, Strategy};
use crate::kinds::lottery::scripts as lua;
use crate::{kinds::Ask, scripts::PoolKeys};

/// The ladder strategy.
#[derive(Debug)]
pub(super) struct Ladder;

impl Strategy for Ladder {
    fn label(&self) -> &'static str {
        "ladder"
    }

    fn validate(&self, activity: &ActivityConfig) -> Result<(), String> {
        if activity.prizes.is_empty() {
            return Err("the ladder needs at least one prize".into());
        }
        Ok(())
    }

    fn invocation(
        &self,
        keys: &PoolKeys,
        ask: &Ask<'_>,
        pick: &Pick,
    ) -> crate::scripts::ScriptInvocation<'static> {
        super::wheel::call(&lua::DRAW_LADDER, keys, ask, pick)
    }
}
