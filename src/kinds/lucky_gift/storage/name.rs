//! The storages a pool file can name, by label; what each does is its
//! [`super::Layout`].

use serde::{Deserialize, Serialize};

/// How a pool keeps its prizes in Redis (`storage = "…"` in a pool file,
/// `meta.storage` in Redis). A pool never changes storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// Every prize is a list element (two bytes each for small codes).
    List,
    /// Only non-zero prizes are stored, by index.
    Sparse,
}

impl Storage {
    /// Every storage, in the order a config error lists them.
    pub const ALL: [Storage; 2] = [Storage::List, Storage::Sparse];

    /// The name pool files and `meta.storage` use.
    pub fn label(self) -> &'static str {
        match self {
            Self::List => "list",
            Self::Sparse => "sparse",
        }
    }

    /// The storage named `name` in a pool file, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.label() == name)
    }

    /// The storage a pool's `meta.storage` names (`list` when absent).
    pub fn from_label(label: Option<&str>) -> Self {
        label.and_then(Self::from_name).unwrap_or(Self::List)
    }

    /// The names pool files may use, as a config error lists them
    /// (`"list" or "sparse"`).
    pub fn names() -> String {
        Self::ALL
            .iter()
            .map(|s| format!("{:?}", s.label()))
            .collect::<Vec<_>>()
            .join(" or ")
    }
}
