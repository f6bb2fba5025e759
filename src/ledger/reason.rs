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
    /// The entry-id namespace a kind books this reason's entries under
    /// (`draw` for `draw:<pool>:…`); empty for an upstream reason. Every
    /// id in a kind's namespace is sealed whatever its reason (see
    /// [`super::Sealer::check`]), so an upstream cannot take such an id
    /// first with an unsealed top-up.
    pub id_namespace: &'static str,
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
            id_namespace: "",
        }
    }

    /// A reason the prize kind labelled `kind` books, sealed, under entry
    /// ids `<id_namespace>:…`: how a kind declares its reasons, in its
    /// folder.
    pub const fn of_kind(
        kind: &'static str,
        name: &'static str,
        direction: Direction,
        id_namespace: &'static str,
    ) -> Reason {
        Reason {
            name,
            direction,
            owner: Owner::Kind(kind),
            id_namespace,
        }
    }

    /// Whether `entry_id` lies in this reason's entry-id namespace.
    pub fn names(&self, entry_id: &str) -> bool {
        !self.id_namespace.is_empty()
            && entry_id
                .strip_prefix(self.id_namespace)
                .is_some_and(|rest| rest.starts_with(':'))
    }
}
