//! The ledger reasons the red-packet kind books, sealed: the ledger's list
//! of reasons (`ledger/reasons.rs`) reads them here.

use super::names::KIND;
use crate::ledger::reason::{
    Direction::{Credit, Debit},
    Reason,
};

/// The escrow a create takes from the sender, a grabbed share, and the
/// refund of what is left at expiry.
pub const REASONS: &[Reason] = &[
    Reason::of_kind(KIND, "red_packet_escrow", Debit),
    Reason::of_kind(KIND, "red_packet", Credit),
    Reason::of_kind(KIND, "red_packet_refund", Credit),
];
