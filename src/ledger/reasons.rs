//! Every reason a ledger entry can carry, declared once: its direction, and
//! who may publish it. A reason a prize kind books (a draw's reward, a red
//! packet's escrow, share and refund, a lottery prize) is sealed: the
//! settle worker applies it only with the fleet's seal
//! ([`super::Sealer`]), so no upstream can publish it. The reasons upstream
//! services publish (top-ups, withdrawals, purchases) need no seal.
//!
//! Each reason is declared once: the upstream ones here ([`UPSTREAM`]),
//! each kind's in its own folder (`kinds/<kind>/reasons.rs`, with
//! [`Reason::of_kind`], listed in `KIND_REASONS`). [`reasons`] is every one of them, and the only
//! list: the settle worker's checks, the seal's rule and the error texts
//! all read it, so a reason cannot be a credit in one place and forgotten
//! by the seal in another, and a new kind's reasons are sealed by being
//! listed in `KIND_REASONS` (a test in `kinds/registry.rs` fails while that
//! list and the registry disagree).

pub use super::reason::{Direction, Owner, Reason};

use Direction::{Credit, Debit};

/// The reasons upstream services publish. The kinds' own follow them in
/// [`reasons`].
pub const UPSTREAM: &[Reason] = &[
    Reason::upstream("topup", Credit),
    Reason::upstream("withdrawal", Debit),
    Reason::upstream("purchase", Debit),
];

/// Each registered kind's reasons, declared in the kind's folder
/// (`kinds/<kind>/reasons.rs`; [`of_kind`] gives one kind's),
/// in the order of the registry; a test checks that every registered kind
/// has its reasons here and that every reason here is a registered kind's. The ledger reads them from here, not
/// through the registry, which builds on the ledger.
const KIND_REASONS: &[&[Reason]] = &[
    crate::kinds::lucky_gift::reasons::REASONS,
    crate::kinds::red_packet::reasons::REASONS,
    crate::kinds::lottery::reasons::REASONS,
];

/// Every reason: the upstream ones, then each registered kind's.
pub fn reasons() -> impl Iterator<Item = &'static Reason> {
    UPSTREAM
        .iter()
        .chain(KIND_REASONS.iter().flat_map(|reasons| reasons.iter()))
}

/// The reasons the prize kind labelled `kind` books (declared in its
/// folder, listed in `KIND_REASONS`).
pub fn of_kind(kind: &str) -> impl Iterator<Item = &'static Reason> + '_ {
    reasons().filter(move |r| matches!(r.owner, Owner::Kind(k) if k == kind))
}

/// The reason called `name`, if the ledger knows it.
pub fn find(name: &str) -> Option<&'static Reason> {
    reasons().find(|r| r.name == name)
}

/// Whether entries with reason `name` must be sealed (see [`Reason::sealed`]).
pub fn is_sealed(name: &str) -> bool {
    find(name).is_some_and(Reason::sealed)
}

/// The names of the reasons of one direction, comma separated.
fn names(direction: Direction) -> String {
    reasons()
        .filter(|r| r.direction == direction)
        .map(|r| r.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The largest magnitude of an amount, and the largest balance: 2^53 − 1,
/// the largest integer every JSON reader (and Lua) holds exactly.
pub const MAX_AMOUNT: i64 = (1 << 53) - 1;

/// Checks that `amount` may be booked under `reason`: a known reason, the
/// sign its direction asks for, a magnitude of 1 to [`MAX_AMOUNT`].
pub fn check_movement(reason: &str, amount: i64) -> Result<(), String> {
    if amount == 0 {
        return Err("`amount` must not be zero".into());
    }
    if amount.unsigned_abs() > MAX_AMOUNT.unsigned_abs() {
        return Err(format!(
            "`amount` must be between -{MAX_AMOUNT} and {MAX_AMOUNT}, got {amount}"
        ));
    }
    match find(reason).map(|r| r.direction) {
        Some(Debit) if amount > 0 => Err(format!(
            "reason {reason:?} is a debit: `amount` must be negative"
        )),
        Some(Credit) if amount < 0 => Err(format!(
            "reason {reason:?} is a credit: `amount` must be positive"
        )),
        Some(_) => Ok(()),
        None => Err(format!(
            "unknown reason {reason:?}; credits: {}; debits: {}",
            names(Credit),
            names(Debit)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_declared_once() {
        let all: Vec<_> = reasons().collect();
        for (i, r) in all.iter().enumerate() {
            assert!(
                all[i + 1..].iter().all(|o| o.name != r.name),
                "{} is declared twice",
                r.name
            );
        }
    }

    #[test]
    fn every_reason_a_kind_books_is_sealed_and_no_other() {
        for r in reasons() {
            assert_eq!(r.sealed(), matches!(r.owner, Owner::Kind(_)), "{}", r.name);
            assert_eq!(is_sealed(r.name), r.sealed(), "{}", r.name);
        }
        // Every credit but an upstream top-up is a kind's, and so sealed: a
        // credit an upstream could publish unsealed is only `topup`.
        let unsealed_credits: Vec<_> = reasons()
            .filter(|r| r.direction == Credit && !r.sealed())
            .map(|r| r.name)
            .collect();
        assert_eq!(unsealed_credits, ["topup"]);
        assert!(!is_sealed("no_such_reason"));
    }

    #[test]
    fn movements_follow_the_direction_of_their_reason() {
        assert!(check_movement("topup", 1).is_ok());
        assert!(check_movement("withdrawal", -1).is_ok());
        assert!(check_movement("red_packet_escrow", -MAX_AMOUNT).is_ok());
        assert!(check_movement("topup", -1).is_err());
        assert!(check_movement("lottery", -5).is_err());
        assert!(check_movement("lottery", 0).is_err());
        assert!(check_movement("lottery", MAX_AMOUNT + 1).is_err());
        assert!(check_movement("purchase", 5).is_err());
        assert!(check_movement("withdrawal", i64::MIN).is_err());
        let unknown = check_movement("gift", 5).unwrap_err();
        assert!(unknown.contains("credits: topup, lucky_gift"), "{unknown}");
        assert!(unknown.contains("debits: withdrawal, purchase, red_packet_escrow"));
    }
}
