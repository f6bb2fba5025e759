//! The draw queue's envelope, the `draw` request and the `draw_result`
//! reply with the records a prize carries (batch positions, reveals,
//! lottery picks).

use serde::{Deserialize, Serialize};

use super::{
    check_account, check_id, prize_codes, DrawBatch, ErrorBody, GrantRequest, Invalid, PrizeCodes,
    Status, MAX_DRAW_COUNT,
};
// Named by the doc comments of `DrawResult`, which are also the
// descriptions of the JSON Schemas (`docs/schema/`).
#[allow(unused_imports)]
use super::PRIZE_LIST_MAX;

/// A request the draw queue carries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum DrawQueueMessage {
    #[serde(rename = "draw")]
    Draw(DrawRequest),
    #[serde(rename = "lottery.grant")]
    Grant(GrantRequest),
    #[serde(rename = "draw.batch")]
    Batch(DrawBatch),
}
/// `{"type":"draw", ...}`: draw `count` prizes from `pool` for `user_id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DrawRequest {
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[!-z|~]+$"))]
    pub request_id: String,
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[!-z|~]+$"))]
    pub pool: String,
    #[schemars(range(min = 0))]
    pub user_id: i64,
    #[schemars(range(min = 1, max = 10_000))]
    pub count: u32,
}
impl DrawRequest {
    /// Checks the fields serde cannot: id shapes and the `count` range.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_id("request_id", &self.request_id)?;
        check_id("pool", &self.pool)?;
        check_account("user_id", self.user_id)?;
        if self.count == 0 || self.count > MAX_DRAW_COUNT {
            return Err(Invalid::new(format!(
                "`count` must be between 1 and {MAX_DRAW_COUNT}, got {}",
                self.count
            )));
        }
        Ok(())
    }
}
/// One prize of a draw result; which fields appear depends on the prize kind.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum Prize {
    /// A lucky-gift prize: its multiplier and the combo it came from.
    Multiplier { multiplier: u64, combo: String },
    /// A red-packet share.
    Share { share: u32, amount: i64 },
    /// A lottery prize.
    Item {
        prize: String,
        asset: String,
        amount: i64,
    },
}

/// `{"type":"draw_result", ...}`: the reply to a draw.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct DrawResult {
    pub request_id: String,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The sub-pool that served the draw, for a pool stocked as several
    /// (`shards`); its batch positions are that sub-pool's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prizes: Vec<Prize>,
    /// Lucky gift, a draw of more than [`PRIZE_LIST_MAX`] prizes: its
    /// prizes in compact form, in place of `prizes`
    /// ([`prize_codes`]; [`DrawResult::expand_prizes`] turns it into the list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prize_codes: Option<PrizeCodes>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_multiplier: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asset: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chances_left: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<Prize>,
    /// Lucky gift: how many prizes the pool (or its sub-pool) has given
    /// out, this draw's included: it counts prizes, not draws. Lottery: how
    /// many awards the activity has made, this one included (one per
    /// draw). The serial of the draw's ledger entry id; names the draw for
    /// ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<i64>,
    /// Lucky gift: the config version the draw used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
    /// Lucky gift: where the prizes came from, in the order of `prizes`
    /// (`docs/fairness.md`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub positions: Vec<PrizeRun>,
    /// Lucky gift: jackpots this draw met while they were gated and parked
    /// at the pool's head, where they came from, one by one. A draw that
    /// names the rule instead (`held_back_min_multiplier`) leaves it out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_back: Vec<BatchPosition>,
    /// Lucky gift: set when this draw held jackpots back: the jackpot
    /// rule's minimum multiplier. Its `positions` then cover every position
    /// the draw read, and the prizes there of at least this multiplier were
    /// held back (parked at the pool's head), not drawn; each run says how
    /// many (`held_back`). The other positions are the draw's prizes, in
    /// order (`docs/fairness.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_back_min_multiplier: Option<u64>,
    /// Lucky gift: the seeds of the batches this draw used up, revealed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub revealed: Vec<Reveal>,
    /// Lottery with a random pick: what the pick used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pick: Option<LotteryPick>,
    /// A `draw_result.batch` entry shortened to keep the batch reply within
    /// 64 KiB: its prizes (and fairness record, or refusal details) were
    /// left out. Sending the entry again alone, with the same id and
    /// content, replays its whole answer; nothing is drawn or paid again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub omitted: bool,
}

impl DrawResult {
    /// Turns a compact `prize_codes` into the `prizes` list it stands for
    /// (a result without one is left as it is), so a reader sees the same
    /// result whichever form the draw was answered in.
    pub fn expand_prizes(&mut self) -> Result<(), prize_codes::Malformed> {
        if let Some(codes) = self.prize_codes.take() {
            match codes.expand() {
                Ok(prizes) => self.prizes = prizes,
                Err(e) => {
                    self.prize_codes = Some(codes);
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

/// The random pick of a lottery draw: `value` (derived from the period's
/// committed seed, in `[0, 2^52)`, below the largest multiple of the total
/// weight) and the candidates it was read against, in order. The prize is the candidate where
/// `value mod total` falls when the weights are laid end to end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct LotteryPick {
    pub value: u64,
    pub weights: Vec<PrizeWeight>,
    /// The start (unix seconds) of the seed period whose committed seed
    /// `value` was derived from (`docs/fairness.md`, "Lotteries"); absent
    /// in answers stored before picks were seeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<u64>,
}

/// One candidate of a lottery pick.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PrizeWeight {
    pub prize: String,
    pub weight: u64,
}

impl LotteryPick {
    /// The prize this pick lands on (`None` if the weights are all zero).
    pub fn prize(&self) -> Option<&str> {
        let total: u64 = self.weights.iter().map(|w| w.weight).sum();
        let mut r = self.value.checked_rem(total)?;
        for w in &self.weights {
            if r < w.weight {
                return Some(&w.prize);
            }
            r -= w.weight;
        }
        None
    }
}

/// `count` consecutive positions `position`, `position + 1`, … of batch
/// `generation` (generation 0: a batch stocked before batches were
/// committed) a draw took its prizes from; of a draw that held jackpots
/// back (`held_back_min_multiplier`), the positions it read, `held_back`
/// of them held back and the others its prizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PrizeRun {
    pub generation: u64,
    pub position: u64,
    pub count: u64,
    /// How many of the run's positions were held back (absent: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held_back: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl PrizeRun {
    /// A run of `count` positions from `position` of batch `generation`,
    /// none held back.
    pub fn new(generation: u64, position: u64, count: u64) -> Self {
        Self {
            generation,
            position,
            count,
            held_back: 0,
        }
    }
}

/// A position in the order of batch `generation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct BatchPosition {
    pub generation: u64,
    pub position: u64,
}

/// A revealed batch seed: `SHA-256(seed)` is the batch's commitment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Reveal {
    pub generation: u64,
    pub version: i64,
    pub seed: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{decode_envelope, decode_typed, with_type};

    #[test]
    fn spec_draw_example_decodes() {
        let v = decode_envelope(
            br#"{"type":"draw","request_id":"01JD","pool":"gift-1001","user_id":42,"count":100}"#,
        )
        .unwrap();
        let msg: DrawQueueMessage = decode_typed(&v).unwrap();
        let DrawQueueMessage::Draw(d) = msg else {
            panic!("not a draw")
        };
        assert_eq!(d.count, 100);
        d.validate().unwrap();
    }
    #[test]
    fn draw_result_matches_the_spec_shape() {
        let r = DrawResult {
            request_id: "01JD".into(),
            pool: Some("gift-1001".into()),
            user_id: Some(42),
            prizes: vec![Prize::Multiplier {
                multiplier: 10,
                combo: "c3".into(),
            }],
            total_multiplier: Some(10),
            reward: Some(1000),
            asset: Some("coin".into()),
            ..Default::default()
        };
        let v = with_type("draw_result", &r);
        assert_eq!(
            v.to_string(),
            r#"{"type":"draw_result","request_id":"01JD","status":"ok","pool":"gift-1001","user_id":42,"prizes":[{"multiplier":10,"combo":"c3"}],"total_multiplier":10,"reward":1000,"asset":"coin"}"#
        );
    }
}
