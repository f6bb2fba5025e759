//! Draw records of concurrent deliveries, written together.
//!
//! The audit consumer handles several deliveries at once, and each used to
//! write its draws in a statement and a transaction of its own. A commit
//! costs Postgres far more than a row (it waits for the WAL to reach the
//! disk), so [`DrawWriter`] gathers what concurrent deliveries bring while
//! a write is under way and writes it in the next statement: one commit
//! for everything that arrived meanwhile. Nothing waits on a timer: a lone
//! delivery is written at once; under load the groups grow by themselves.
//!
//! Each delivery still learns the fate of its own draws, and is acked only
//! after they are committed. When Postgres refuses a group for its data
//! (an error retrying cannot mend), each delivery's draws are written on
//! their own, so that only the culprit fails.

use std::sync::Mutex;

use sqlx::PgPool;
use tokio::sync::oneshot;

use crate::{amqp::HandleError, messages::DrawResult};

/// One delivery's draws, waiting for a write, and where to send its fate.
type Waiting = (Vec<DrawResult>, oneshot::Sender<Result<(), HandleError>>);

/// Writes the draws of concurrent deliveries in shared statements.
#[derive(Debug, Default)]
pub(super) struct DrawWriter {
    /// Draws handed in and not yet taken by a write.
    waiting: Mutex<Vec<Waiting>>,
    /// Held by the delivery that writes; the others queue behind it and,
    /// when their turn comes, usually find their draws written already.
    writing: tokio::sync::Mutex<()>,
}

impl DrawWriter {
    /// Records `draws` (one delivery's), in a statement shared with the
    /// draws of deliveries that arrive meanwhile; returns once they are
    /// committed (or could not be).
    pub(super) async fn record(
        &self,
        db: &PgPool,
        draws: Vec<DrawResult>,
    ) -> Result<(), HandleError> {
        if !draws.iter().any(super::records::records_anything) {
            return Ok(());
        }
        let (done, fate) = oneshot::channel();
        self.lock_waiting().push((draws, done));
        {
            let _turn = self.writing.lock().await;
            // Everything handed in so far: ours, unless an earlier writer
            // took it with its own group.
            let group = std::mem::take(&mut *self.lock_waiting());
            if !group.is_empty() {
                write_group(db, group).await;
            }
        }
        // A writer that took our draws and was then dropped (its delivery
        // cancelled mid-write) sends nothing: try again later.
        fate.await.unwrap_or_else(|_| {
            Err(HandleError::Transient(anyhow::anyhow!(
                "the write of this delivery's draw records was abandoned"
            )))
        })
    }

    fn lock_waiting(&self) -> std::sync::MutexGuard<'_, Vec<Waiting>> {
        // The list stays whole whatever a panicking holder did: it only
        // pushes or takes it.
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Writes `group` in one statement and tells each delivery its fate; after
/// an error retrying cannot mend, writes each delivery's draws alone.
async fn write_group(db: &PgPool, group: Vec<Waiting>) {
    let result =
        super::records::record_draws_of(db, group.iter().flat_map(|(draws, _)| draws)).await;
    match result {
        // A delivery that is gone (stopped) finds its draws written when
        // it comes back; nobody needs its fate now.
        Ok(()) => {
            for (_, done) in group {
                let _ = done.send(Ok(()));
            }
        }
        Err(error) if group.len() > 1 && crate::ledger::is_permanent(&error) => {
            tracing::warn!(%error, "draw records refused by Postgres; writing each delivery's alone");
            for (draws, done) in group {
                let fate = super::record_draws(db, &draws).await;
                let _ = done.send(fate.map_err(HandleError::from));
            }
        }
        Err(error) => {
            let shared = HandleError::from(error);
            for (_, done) in group {
                let _ = done.send(Err(copy(&shared)));
            }
        }
    }
}

/// The same failure again, for another delivery of a group.
fn copy(error: &HandleError) -> HandleError {
    match error {
        HandleError::Invalid(invalid) => HandleError::Invalid(invalid.clone()),
        HandleError::Transient(e) => HandleError::Transient(anyhow::anyhow!("{e:#}")),
        HandleError::Internal(e) => HandleError::Internal(anyhow::anyhow!("{e:#}")),
    }
}
