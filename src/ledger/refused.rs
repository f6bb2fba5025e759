//! A ledger write the ledger itself refused, shaped like the database error
//! a constraint would have raised, and which write errors are for good.

use std::borrow::Cow;

use sqlx::error::{DatabaseError, ErrorKind};

use super::Verdict;
use crate::messages::SettleRequest;

/// An entry the ledger refused, as the database error [`apply`] and
/// [`apply_in`] return: it carries the SQLSTATE a constraint would have
/// raised (23505 for a conflicting id, 23514 for a short balance or a bad
/// movement, 22003 for an overflow), so callers classify it like one.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    /// The refused entry's id.
    pub entry_id: String,
    /// What the ledger made of it.
    pub verdict: Verdict,
    message: String,
}

impl Refused {
    pub(super) fn new(entry: &SettleRequest, verdict: &Verdict) -> Self {
        Self {
            entry_id: entry.entry_id.clone(),
            verdict: verdict.clone(),
            message: verdict.describe(entry),
        }
    }
}

impl DatabaseError for Refused {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(match self.verdict {
            Verdict::Conflict => "23505",
            Verdict::Overflow { .. } => "22003",
            _ => "23514",
        }))
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> ErrorKind {
        match self.verdict {
            Verdict::Conflict => ErrorKind::UniqueViolation,
            Verdict::Overflow { .. } => ErrorKind::Other,
            _ => ErrorKind::CheckViolation,
        }
    }
}

/// Whether a ledger write failed for good: Postgres refused the entries
/// themselves (SQLSTATE class 22, data exception; 23, integrity violation;
/// 54, a program limit), or the ledger did ([`Refused`] carries such a
/// code). Retrying cannot help: the caller should give up on the entry.
/// Everything else, including the errors of a server shutting down or
/// refusing connections (57P01, 55000, class 08), a deadlock (40P01) and a
/// serialisation failure (40001), is an outage: keep the entries and retry.
pub fn is_permanent(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23") || c.starts_with("54")),
        _ => false,
    }
}
