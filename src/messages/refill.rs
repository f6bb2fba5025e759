//! The refill queue's lucky-gift messages: `refill`, its reply and the
//! `pool.refilled` event. The refill worker reads each message of its queue
//! by its `type`, as the kind that registered it says
//! (`kinds::registry::Lifecycle`).

use serde::{Deserialize, Serialize};

use super::{check_id, ErrorBody, Invalid, Status};

/// `{"type":"refill_result", ...}`: the reply to a `refill`: the batch
/// after the trigger exists (stocked now or before).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct RefillResult {
    pub status: Status,
    pub pool: String,
    /// The pool's batch generation now.
    pub generation: u64,
    /// Why the refill was refused (then `generation` is left out, and
    /// `pool` too when the request had no usable one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// `{"type":"pool.refilled", ...}` (event): batch `generation` of `pool`,
/// `size` prizes of config `version`, became drawable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PoolRefilled {
    pub pool: String,
    pub generation: u64,
    pub size: usize,
    pub version: i64,
    /// Asked by a draw that found the pool short.
    pub urgent: bool,
    /// `SHA-256` of the batch's secret seed, committed before the batch
    /// became visible (`docs/fairness.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commitment: Option<String>,
    /// The combos the batch was built from, in configuration order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub composition: Option<Vec<crate::fairness::ComboStock>>,
}
/// `{"type":"refill","pool":…,"trigger":N}`: batch `trigger` of `pool` reached
/// its refill point (or ran short), so batch `trigger + 1` must exist. The
/// pair (`pool`, `trigger`) is the idempotency id: any number of requests for
/// one trigger stock one batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RefillRequest {
    pub pool: String,
    pub trigger: u64,
    /// Set when a draw found the pool short rather than at its refill point.
    #[serde(default)]
    pub urgent: bool,
}
impl RefillRequest {
    /// Checks the pool id.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_id("pool", &self.pool)
    }
}
