//! What a ledger reason is: a name, the direction its entries move a
//! balance, and who books it. The reasons themselves are declared in
//! [`super::reasons`] (upstream) and in each kind's folder.

/// Whether an entry adds to a balance or takes from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// `amount > 0`.
    Credit,
    /// `amount < 0`.
    Debit,
}

/// Who books a reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    /// An upstream service, unsealed.
    Upstream,
    /// A prize kind of the fleet (named as its pools' `kind`), sealed.
    Kind(&'static str),
}

/// One reason of the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reason {
    pub name: &'static str,
    pub direction: Direction,
    pub owner: Owner,
}

impl Reason {
    /// Whether entries with this reason must carry the fleet's seal: every
    /// reason a kind books, and no other.
    pub fn sealed(&self) -> bool {
        matches!(self.owner, Owner::Kind(_))
    }
}

impl Reason {
    /// A reason upstream services publish, unsealed.
    pub(super) const fn upstream(name: &'static str, direction: Direction) -> Reason {
        Reason {
            name,
            direction,
            owner: Owner::Upstream,
        }
    }

    /// A reason the prize kind labelled `kind` books, sealed: how a kind
    /// declares its reasons, in its folder.
    pub const fn of_kind(kind: &'static str, name: &'static str, direction: Direction) -> Reason {
        Reason {
            name,
            direction,
            owner: Owner::Kind(kind),
        }
    }
}
