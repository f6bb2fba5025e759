//! The ledger reasons the red-packet kind books, sealed: the ledger's list
//! of reasons (`ledger/reasons.rs`) reads them here.

use super::names::KIND;
use crate::ledger::reason::{
    Direction::{Credit, Debit},
    Reason,
};

/// The escrow a create takes from the sender, a grabbed share, and the
/// refund of what is left at expiry.
/// (`redpacket:<packet>:escrow`, `redpacket:<packet>:grab:<user>`,
/// `redpacket:<packet>:refund`.)
pub const REASONS: &[Reason] = &[
    Reason::of_kind(KIND, "red_packet_escrow", Debit, ENTRY_IDS),
    Reason::of_kind(KIND, "red_packet", Credit, ENTRY_IDS),
    Reason::of_kind(KIND, "red_packet_refund", Credit, ENTRY_IDS),
];

/// The namespace of its entry ids.
pub const ENTRY_IDS: &str = "redpacket";
