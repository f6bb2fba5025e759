//! The refill queue's lottery message, `lottery.seed`: commits an
//! activity's seed for its current period and reveals the periods that are
//! over ([`super::seeds`]). Apart from the seeds, so the kinds' registry is
//! needed only here.

use serde_json::Value;

use super::seeds::{commit, period_len, period_of, reveal_ended, Committed, SEED_MESSAGE};
use crate::{
    amqp::HandleError,
    kinds::registry::{self, LifeStep, Lifecycle},
    ledger::Unsealed,
    messages::{decode_payload, typed_json, RefillRequest, RefillResult, Status},
    scripts::PoolKeys,
};

/// The refill queue's lottery message.
pub(super) const LIFECYCLE: &[Lifecycle] = &[Lifecycle {
    message: SEED_MESSAGE,
    reply: "refill_result",
    postgres: false,
    handle: handle_seed,
}];

fn handle_seed<'a>(life: &'a registry::Life<'a>, envelope: &'a Value) -> LifeStep<'a> {
    Box::pin(async move {
        let request: RefillRequest = decode_payload(envelope)?;
        request.validate()?;
        seed_step(life, &request.pool).await
    })
}

/// A `lottery.seed`: commits the seed of the activity's current period (the
/// period by this worker's clock, whatever the message names: an internal
/// message is checked against state, and only the current period may get
/// a seed) and reveals the periods that are over.
async fn seed_step(life: &registry::Life<'_>, activity: &str) -> Result<Unsealed, HandleError> {
    let prefix = &life.config.redis_prefix;
    let now = crate::scripts::now_ms();
    let keys = PoolKeys::new(prefix, activity);
    let mut conn = life.redis.clone();
    let len = period_len(&mut conn, &keys).await?;
    let period = period_of(u64::try_from(now / 1000).unwrap_or(0), len);
    let committed = commit(
        life.db,
        &mut conn,
        prefix,
        activity,
        period,
        len,
        Some(life.redis),
    )
    .await?;
    tracing::debug!(%activity, period, ?committed, "lottery seed asked for");
    if committed != Committed::Unknown {
        // Postgres away: the reveal waits for the next request or sweep.
        if let Err(e) = reveal_ended(life.db, life.redis, prefix, activity, now).await {
            tracing::info!(%activity, error = %e, "lottery seeds not revealed yet");
        }
    }
    let reply = RefillResult {
        status: Status::Ok,
        pool: activity.to_owned(),
        generation: period,
        error: None,
    };
    Ok(Unsealed {
        reply: Some(typed_json("refill_result", &reply)),
        ..Unsealed::default()
    })
}
