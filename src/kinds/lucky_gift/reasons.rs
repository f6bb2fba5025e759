//! The kind's label and the ledger reasons it books, sealed: the ledger's
//! list of reasons (`ledger/reasons.rs`) reads them here.

use crate::ledger::reason::{Direction::Credit, Reason};

/// The kind's label: its pools' `kind` and its metrics' `kind`.
pub const KIND: &str = "lucky_gift";

/// The namespace of its entry ids.
pub const ENTRY_IDS: &str = "draw";

/// A draw's reward (`draw:<pool>:<request_id>:<serial>`).
pub const REASONS: &[Reason] = &[Reason::of_kind(KIND, "lucky_gift", Credit, ENTRY_IDS)];
