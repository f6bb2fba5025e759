//! The wire contract (SPEC §2): JSON payloads on the `prizepool` exchange,
//! their validation, and the error codes of `rejected` replies.
//!
//! Incoming messages are decoded in two steps: the envelope is checked first
//! (size, UTF-8 JSON object, known `type`), then the typed payload. Either step
//! failing is *bad input*: the message is dead-lettered and, when the request
//! asked for a reply, answered with `invalid_request`.
//!
//! One module per message family, all re-exported here (`messages::DrawRequest`):
//!
//! | module | messages |
//! |--------|----------|
//! | `envelope` | the envelope check, the typed decode, `rejected` replies to bad input |
//! | `ids` | the shapes of ids, names and accounts |
//! | `draw`, `batch` | `draw`, `draw.batch` and their results |
//! | `lottery` | `lottery.grant` and its result |
//! | `red_packet` | `redpacket.create`, `redpacket.expire`, their results and events |
//! | `refill` | `refill`, its result and `pool.refilled` |
//! | `settle` | `settle`, `settle.batch`, their result and the fleet's entry refs |
//! | [`prize_codes`] | the compact form of a large draw's prizes |
//! | [`schema`], [`asyncapi`] | the JSON Schemas and the AsyncAPI document of the contract |

use serde::{Deserialize, Serialize};

pub mod asyncapi;
mod batch;
mod draw;
mod envelope;
mod ids;
mod lottery;
pub mod prize_codes;
mod red_packet;
mod refill;
pub mod schema;
mod settle;
mod shallow;

pub use batch::*;
pub use draw::*;
pub use envelope::*;
pub use ids::*;
pub use lottery::*;
pub use prize_codes::{PrizeCodes, PRIZE_LIST_MAX};
pub use red_packet::*;
pub use refill::*;
pub use settle::*;
#[cfg(test)]
pub(crate) use shallow::probes as envelope_probes;
pub use shallow::shallow_envelope;

/// Largest message body accepted, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;
/// Largest `count` a single draw may ask for, whatever the pool allows.
pub const MAX_DRAW_COUNT: u32 = 10_000;
/// Every amount, count and product prizepool computes stays below this
/// (2^53): Lua numbers are doubles, exact up to here.
pub const MAX_EXACT: i64 = 1 << 53;
/// Longest idempotency id or pool id, in bytes.
pub const MAX_ID_LEN: usize = 128;
/// Longest ledger `entry_id`, in bytes (see [`check_entry_id`]).
pub const MAX_ENTRY_ID_LEN: usize = 320;

/// Why a request was refused. The names are part of the public contract:
/// they may be extended, never renamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidRequest,
    UnknownPool,
    PoolClosed,
    SoldOut,
    AlreadyGrabbed,
    NotStarted,
    Ended,
    NoChances,
    PoolExhausted,
    InsufficientFunds,
    Internal,
}

impl ErrorCode {
    /// The wire name (`"unknown_pool"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::UnknownPool => "unknown_pool",
            Self::PoolClosed => "pool_closed",
            Self::SoldOut => "sold_out",
            Self::AlreadyGrabbed => "already_grabbed",
            Self::NotStarted => "not_started",
            Self::Ended => "ended",
            Self::NoChances => "no_chances",
            Self::PoolExhausted => "pool_exhausted",
            Self::InsufficientFunds => "insufficient_funds",
            Self::Internal => "internal",
        }
    }
}

impl ErrorCode {
    /// Every code, for reading stored refusals.
    pub const ALL: [Self; 11] = [
        Self::InvalidRequest,
        Self::UnknownPool,
        Self::PoolClosed,
        Self::SoldOut,
        Self::AlreadyGrabbed,
        Self::NotStarted,
        Self::Ended,
        Self::NoChances,
        Self::PoolExhausted,
        Self::InsufficientFunds,
        Self::Internal,
    ];

    /// The code named `name` (`"sold_out"`).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
/// The `error` object of a rejected reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

/// `ok` or `rejected`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    #[default]
    Ok,
    Rejected,
}
