//! The lottery requests of the draw queue: `lottery.grant` and its reply.

use serde::{Deserialize, Serialize};

use super::{check_account, check_id, ErrorBody, Invalid, Status};

/// `{"type":"grant_result", ...}`: the reply to a `lottery.grant`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct GrantResult {
    pub grant_id: String,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chances: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chances_left: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

impl GrantResult {
    /// A `rejected` answer to grant `grant_id`, its error to be filled in.
    pub fn rejected(grant_id: String) -> Self {
        Self {
            grant_id,
            status: Status::Rejected,
            chances: None,
            chances_left: None,
            error: None,
        }
    }
}
/// `{"type":"lottery.grant", ...}`: give `user_id` more chances in `activity`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GrantRequest {
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[!-z|~]+$"))]
    pub grant_id: String,
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[!-z|~]+$"))]
    pub activity: String,
    #[schemars(range(min = 0))]
    pub user_id: i64,
    #[schemars(range(min = 1, max = 1_000_000))]
    pub chances: u32,
}
impl GrantRequest {
    /// Checks ids and that at least one chance is granted.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_id("grant_id", &self.grant_id)?;
        check_id("activity", &self.activity)?;
        check_account("user_id", self.user_id)?;
        if self.chances == 0 || self.chances > 1_000_000 {
            return Err(Invalid::new("`chances` must be between 1 and 1000000"));
        }
        Ok(())
    }
}
