//! Lottery activities: a running wheel whose simulated users each hold a
//! million chances. It never runs out (its consolation prize is
//! unlimited), so every ceiling pass shares one activity.

use futures_util::{future::BoxFuture, FutureExt};
use prizepool::scripts::PoolKeys;

use super::{spread, Load, Services, Target, Workload};

/// Lottery activities.
pub(super) struct Lottery;

impl Workload for Lottery {
    fn name(&self) -> &'static str {
        "lottery"
    }

    fn label(&self) -> &'static str {
        "Lottery"
    }

    fn ceiling<'a>(
        &'a self,
        svc: &'a Services<'a>,
        args: &'a Load,
    ) -> BoxFuture<'a, anyhow::Result<Target>> {
        async move {
            let id = crate::bench::services::unique("bench-ceiling");
            load(svc, &id, args.users).await?;
            let users = args.users.max(1);
            Ok(Target {
                endless: true,
                ..Target::one_pool(id, 1, move |n| 1 + (n % users) as i64)
            })
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
            load(svc, id, args.users).await?;
            let users = args.users;
            Ok(Target::one_pool(id.to_owned(), 1, move |n| {
                spread(n, users)
            }))
        }
        .boxed()
    }
}

/// Loads a running wheel activity `id` and grants each of `users` users a
/// million chances.
async fn load(svc: &Services<'_>, id: &str, users: u64) -> anyhow::Result<()> {
    let text = format!(
        "[[activities]]\nid = \"{id}\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\n\
         prizes = [ {{ id = \"ipad\", weight = 1, stock = 100 }}, {{ id = \"coupon-5\", weight = 100, stock = 100000 }} ]\n\
         consolation = {{ id = \"points-10\", weight = 500 }}\n",
        (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339(),
        (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339(),
    );
    let activities = prizepool::kinds::lottery::parse_file(&text)?;
    let mut conn = svc.redis.clone();
    let prefix = &svc.config.redis_prefix;
    prizepool::kinds::lottery::load(&svc.db, &mut conn, prefix, &activities).await?;
    let keys = PoolKeys::new(prefix, id);
    for user in 1..=users {
        prizepool::kinds::lottery::grant(
            &mut conn,
            &keys,
            id,
            &format!("bench-{user}"),
            user as i64,
            1_000_000,
        )
        .await?;
    }
    Ok(())
}
