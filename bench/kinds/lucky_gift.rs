//! Lucky gifts: pools stocked like the SPEC's combos, in the run's storage.

use futures_util::{future::BoxFuture, FutureExt};

use super::{spread, Load, Services, Target, Workload};
use crate::bench::services::{borrow, pool_config, spec_combos, unique};

/// Lucky-gift pools.
pub(super) struct LuckyGift;

impl Workload for LuckyGift {
    fn name(&self) -> &'static str {
        "lucky-gift"
    }

    fn label(&self) -> &'static str {
        "LuckyGift"
    }

    fn coalesces(&self) -> bool {
        true
    }

    fn ceiling<'a>(
        &'a self,
        svc: &'a Services<'a>,
        args: &'a Load,
    ) -> BoxFuture<'a, anyhow::Result<Target>> {
        async move {
            // Big enough to last a pass: 20 for a pass of 3 s, in proportion
            // for another length.
            let k = (20 * args.ceiling_pass_ms).div_ceil(3_000).max(1);
            let pool = pool_config(
                &unique("bench-ceiling"),
                args.storage()?,
                &borrow(&spec_combos(k)),
                1.0,
            );
            svc.load(&pool).await?;
            Ok(Target::one_pool(pool.id, args.count, |_| 0))
        }
        .boxed()
    }

    fn fleet<'a>(
        &'a self,
        svc: &'a Services<'a>,
        args: &'a Load,
        id: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Target>> {
        async move {
            let pool = pool_config(id, args.storage()?, &borrow(&spec_combos(2)), 0.5);
            svc.load(&pool).await?;
            let users = args.users;
            Ok(Target::one_pool(pool.id, args.count, move |n| {
                spread(n, users)
            }))
        }
        .boxed()
    }
}
