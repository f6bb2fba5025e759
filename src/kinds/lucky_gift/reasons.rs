//! The kind's label and the ledger reasons it books, sealed: the ledger's
//! list of reasons (`ledger/reasons.rs`) reads them here.

use crate::ledger::reason::{Direction::Credit, Reason};

/// The kind's label: its pools' `kind` and its metrics' `kind`.
pub const KIND: &str = "lucky_gift";

/// A draw's reward (`lucky_gift:<pool>:<serial>`).
pub const REASONS: &[Reason] = &[Reason::of_kind(KIND, "lucky_gift", Credit)];
