//! `draw.batch`: many draws in one message, each answered exactly as the
//! single draw it stands for, in one `draw_result.batch` in request order.

use super::DrawWorker;
use crate::{
    amqp::{self, HandleError, Outgoing, Publisher},
    kinds::{Opened, Prepared},
    ledger::Unsealed,
    messages::{bounded_batch_reply, rejected_reply, DrawBatch, DrawRequest, ErrorCode},
};

impl DrawWorker {
    /// Handles a `draw.batch`: each entry exactly as the single draw it
    /// stands for, answered in one `draw_result.batch` in request order.
    ///
    /// Entries of one pool run one after another in request order (so a
    /// batch's draws of a pool take the pool's prizes in the order asked);
    /// pools run side by side. A bad entry (it does not decode, its id was
    /// used for other content, its count is past the pool's maximum) is
    /// answered `invalid_request` and dead-lettered alone as the `draw` it
    /// stands for; an internal failure of one entry is answered `internal`
    /// and dead-lettered alike. A transient failure (Redis away) fails the
    /// whole delivery, which is retried: the entries answered already
    /// replay their stored answers then, so none is drawn twice.
    pub(super) async fn batch(
        &self,
        batch: DrawBatch,
        publisher: &Publisher,
    ) -> Result<Unsealed, HandleError> {
        batch.validate(self.config.max_batch)?;
        batch.check_reply_room()?;
        let n = batch.requests.len();
        let mut answers: Vec<Option<Result<Unsealed, HandleError>>> = Vec::with_capacity(n);
        let mut by_pool: Vec<(String, Vec<(usize, DrawRequest)>)> = Vec::new();
        for i in 0..n {
            match batch.entry(i) {
                Ok(req) => {
                    answers.push(None);
                    match by_pool.iter_mut().find(|(pool, _)| *pool == req.pool) {
                        Some((_, entries)) => entries.push((i, req)),
                        None => by_pool.push((req.pool.clone(), vec![(i, req)])),
                    }
                }
                Err(invalid) => answers.push(Some(Err(invalid.into()))),
            }
        }
        let runs = by_pool
            .into_iter()
            .map(|(_, entries)| self.pool_entries(entries, publisher));
        for (i, answer) in futures_util::future::join_all(runs)
            .await
            .into_iter()
            .flatten()
        {
            answers[i] = Some(answer);
        }
        metrics::counter!("prizepool_batch_draws_total").increment(n as u64);
        let mut outcome = Unsealed::default();
        let mut replies = Vec::with_capacity(n);
        for (i, answer) in answers.into_iter().enumerate() {
            let (code, why) = match answer {
                Some(Ok(one)) => {
                    replies.push(one.reply.unwrap_or_default());
                    outcome.effects.extend(one.effects);
                    outcome.grouped.extend(one.grouped);
                    outcome.ledger.extend(one.ledger);
                    continue;
                }
                Some(Err(HandleError::Invalid(invalid))) => {
                    (ErrorCode::InvalidRequest, invalid.message)
                }
                Some(Err(HandleError::Internal(e))) => {
                    tracing::error!(
                        entry = i,
                        error = format!("{e:#}"),
                        "a draw.batch entry failed"
                    );
                    (ErrorCode::Internal, format!("{e:#}"))
                }
                Some(Err(transient @ HandleError::Transient(_))) => return Err(transient),
                None => {
                    return Err(HandleError::internal(format!(
                        "draw.batch entry {i} was never run"
                    )))
                }
            };
            let message = batch.entry_message(i);
            let reply = rejected_reply(Some(&message), code, &why);
            replies.push(serde_json::to_vec(&reply).unwrap_or_default());
            outcome.effects.push(Outgoing::dead_letter_part(
                amqp::DRAW,
                serde_json::to_vec(&message).unwrap_or_default(),
                code.as_str(),
                &why,
            ));
        }
        // Held to 64 KiB: entries too big to share it are shortened (and
        // marked `omitted`); their callers fetch them alone.
        outcome.reply = Some(bounded_batch_reply(replies));
        Ok(outcome)
    }
}

impl DrawWorker {
    /// The entries of one pool of a batch (with their places in it): claimed
    /// side by side, then drawn in one ordered step of the pool (one Lua
    /// call for a lucky gift), then finished each (a short entry waits for
    /// its refill alone).
    async fn pool_entries(
        &self,
        entries: Vec<(usize, DrawRequest)>,
        publisher: &Publisher,
    ) -> Vec<(usize, Result<Unsealed, HandleError>)> {
        let places: Vec<usize> = entries.iter().map(|(i, _)| *i).collect();
        let ttl = self.config.result_ttl.as_secs();
        let opened =
            futures_util::future::join_all(entries.into_iter().map(|(_, req)| async move {
                req.validate()?;
                self.kinds.open(req, ttl).await
            }))
            .await;
        let mut done = Vec::with_capacity(places.len());
        let mut drawing = Vec::new();
        for (i, opened) in places.into_iter().zip(opened) {
            match opened {
                Ok(Opened::Ready(draw)) => drawing.push((i, draw)),
                Ok(Opened::Answered(req, step)) => done.push((i, self.answer(&req, step))),
                Err(e) => done.push((i, Err(e))),
            }
        }
        let draws: Vec<&Prepared> = drawing.iter().map(|(_, d)| d).collect();
        let steps = self.kinds.step_all(&draws).await;
        let finished = futures_util::future::join_all(
            draws
                .iter()
                .zip(steps)
                .map(|(draw, step)| self.finish(draw, step, publisher)),
        )
        .await;
        done.extend(drawing.iter().map(|(i, _)| *i).zip(finished));
        done
    }
}
