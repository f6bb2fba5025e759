//! The wire contract (SPEC §2): JSON payloads on the `prizepool` exchange,
//! their validation, and the error codes of `rejected` replies.
//!
//! Incoming messages are decoded in two steps: the envelope is checked first
//! (size, UTF-8 JSON object, known `type`), then the typed payload. Either step
//! failing is *bad input*: the message is dead-lettered and, when the request
//! asked for a reply, answered with `invalid_request`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod prize_codes;

pub use prize_codes::{PrizeCodes, PRIZE_LIST_MAX};

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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// `{"type":"grant_result", ...}`: the reply to a `lottery.grant`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// `{"type":"refill_result", ...}`: the reply to a `refill`: the batch
/// after the trigger exists (stocked now or before).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefillResult {
    pub status: Status,
    pub pool: String,
    /// The pool's batch generation now.
    pub generation: u64,
}

/// `{"type":"pool.refilled", ...}` (event): batch `generation` of `pool`,
/// `size` prizes of config `version`, became drawable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// `{"type":"settle_result", ...}`: the reply to a `settle` (with its
/// `entry_id`) or to a `settle.batch` (with the number of `entries` that are
/// in the ledger and the `refused` ones).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleResult {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_id: Option<String>,
    pub status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries: Option<usize>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<SettleRefusal>,
}

/// One entry of a `settle.batch` the ledger refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleRefusal {
    /// The entry's id, when it had one usable as an id (a string of at
    /// most [`MAX_ENTRY_ID_LEN`] bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_id: Option<String>,
    pub code: ErrorCode,
    /// Why; left out when the reply would not fit the wire limit otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// The `error` object of a rejected reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

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

/// `{"type":"draw.batch","requests":[...]}`: up to `MAX_BATCH` draws in one
/// message, for any mix of pools and kinds. Each entry is a [`DrawRequest`]
/// (its `"type":"draw"` may be left out) and keeps every rule of a single
/// draw: its own id, idempotency and validation. The entries stay JSON
/// values here so that a bad entry is answered on its own, never failing
/// the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrawBatch {
    pub requests: Vec<Value>,
}

impl DrawBatch {
    /// Checks the envelope: 1 to `max` entries. (Its size is bounded by the
    /// 64 KiB every message is held to.)
    pub fn validate(&self, max: usize) -> Result<(), Invalid> {
        if self.requests.is_empty() {
            return Err(Invalid::new("a draw.batch with no requests"));
        }
        if self.requests.len() > max {
            return Err(Invalid::new(format!(
                "a draw.batch of {} requests; at most {max} are allowed",
                self.requests.len()
            )));
        }
        Ok(())
    }

    /// Refuses a batch whose reply could pass [`MAX_MESSAGE_BYTES`] even with
    /// every entry shortened to its id, status and error code
    /// ([`bounded_batch_reply`]): many entries with long ids.
    pub fn check_reply_room(&self) -> Result<(), Invalid> {
        let mut bytes = 0;
        for i in 0..self.requests.len() {
            let longest = rejected_reply(
                Some(&self.entry_message(i)),
                ErrorCode::InsufficientFunds,
                "",
            );
            bytes += shorten(
                &serde_json::to_vec(&longest).unwrap_or_default(),
                Shorten::Stub,
            )
            .len();
        }
        let reply = batch_reply_len(self.requests.len(), bytes);
        if reply > MAX_MESSAGE_BYTES {
            return Err(Invalid::new(format!(
                "a draw.batch whose {} answers could take {reply} bytes even shortened, above the {MAX_MESSAGE_BYTES} byte message limit; send fewer requests",
                self.requests.len()
            )));
        }
        Ok(())
    }

    /// Entry `i` as a single draw request, or why it is not one.
    pub fn entry(&self, i: usize) -> Result<DrawRequest, Invalid> {
        let Some(Value::Object(fields)) = self.requests.get(i) else {
            return Err(Invalid::new("a draw.batch entry that is not an object"));
        };
        let mut fields = fields.clone();
        match fields.remove("type") {
            None => {}
            Some(Value::String(t)) if t == "draw" => {}
            Some(other) => {
                return Err(Invalid::new(format!(
                    "a draw.batch entry of type {other}; entries are draws"
                )))
            }
        }
        DrawRequest::deserialize(Value::Object(fields)).map_err(|e| Invalid::new(e.to_string()))
    }

    /// Entry `i` as a single `draw` message, as it is answered or
    /// dead-lettered on its own.
    pub fn entry_message(&self, i: usize) -> Value {
        match self.requests.get(i) {
            Some(Value::Object(fields)) => {
                let mut message = serde_json::Map::with_capacity(fields.len() + 1);
                message.insert("type".into(), Value::String("draw".into()));
                for (k, v) in fields {
                    if k != "type" {
                        message.insert(k.clone(), v.clone());
                    }
                }
                Value::Object(message)
            }
            Some(other) => other.clone(),
            None => Value::Null,
        }
    }
}

/// `{"type":"draw_result.batch","results":[...]}`: the reply to a
/// `draw.batch`, one `draw_result` per request in request order. A batch
/// whose envelope is bad is answered `rejected` with its `error` and no
/// results.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrawResultBatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
    pub results: Vec<Value>,
}

/// The `draw_result.batch` reply made of `results`, each one entry's
/// serialised `draw_result`.
pub fn batch_reply(results: &[Vec<u8>]) -> Vec<u8> {
    let len = results.iter().map(|r| r.len() + 1).sum::<usize>();
    let mut out = Vec::with_capacity(len + 48);
    out.extend_from_slice(br#"{"type":"draw_result.batch","results":["#);
    for (i, r) in results.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(r);
    }
    out.extend_from_slice(b"]}");
    out
}

/// Fields an entry of a `draw_result.batch` loses first when the reply
/// would pass [`MAX_MESSAGE_BYTES`]: the prizes and the records that grow
/// with them. The totals stay, so the entry still says what it pays.
const DETAIL_FIELDS: [&str; 7] = [
    "prizes",
    "prize_codes",
    "positions",
    "held_back",
    "revealed",
    "pick",
    "previous",
];

/// How far an entry of a batch reply is shortened.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shorten {
    /// Without [`DETAIL_FIELDS`] and refusal messages.
    Detail,
    /// Only `type`, the id, `status` and the error code.
    Stub,
}

/// `result` (one serialised `draw_result`) shortened as `how` says and
/// marked `"omitted":true`; a result that does not read is kept as it is.
fn shorten(result: &[u8], how: Shorten) -> Vec<u8> {
    let Ok(Value::Object(mut fields)) = serde_json::from_slice::<Value>(result) else {
        return result.to_vec();
    };
    match how {
        Shorten::Detail => fields.retain(|k, _| !DETAIL_FIELDS.contains(&k.as_str())),
        Shorten::Stub => fields.retain(|k, _| {
            matches!(k.as_str(), "type" | "status" | "error") || ID_FIELDS.contains(&k.as_str())
        }),
    }
    if let Some(Value::Object(error)) = fields.get_mut("error") {
        error.retain(|k, _| k == "code");
        error.insert("message".into(), Value::String(String::new()));
    }
    fields.insert("omitted".into(), Value::Bool(true));
    serde_json::to_vec(&Value::Object(fields)).unwrap_or_else(|_| result.to_vec())
}

/// Bytes [`batch_reply`] makes of results of `bytes` bytes in all.
fn batch_reply_len(results: usize, bytes: usize) -> usize {
    r#"{"type":"draw_result.batch","results":[]}"#.len() + bytes + results.saturating_sub(1)
}

/// The `draw_result.batch` reply made of `results` (each one entry's
/// serialised `draw_result`), held to [`MAX_MESSAGE_BYTES`]: while it would
/// be larger, the largest entries are shortened, first to their totals
/// (the prizes and fairness record left out), then, if that is not enough,
/// to their id, status and error code, each marked `"omitted":true` (sent
/// again alone, such an entry replays its whole answer). A batch whose
/// entries all fit shortened is guaranteed by [`DrawBatch::check_reply_room`].
pub fn bounded_batch_reply(mut results: Vec<Vec<u8>>) -> Vec<u8> {
    let mut bytes: usize = results.iter().map(Vec::len).sum();
    if batch_reply_len(results.len(), bytes) <= MAX_MESSAGE_BYTES {
        return batch_reply(&results);
    }
    let mut largest: Vec<usize> = (0..results.len()).collect();
    largest.sort_by_key(|&i| std::cmp::Reverse(results[i].len()));
    for how in [Shorten::Detail, Shorten::Stub] {
        for &i in &largest {
            if batch_reply_len(results.len(), bytes) <= MAX_MESSAGE_BYTES {
                return batch_reply(&results);
            }
            let short = shorten(&results[i], how);
            if short.len() < results[i].len() {
                bytes = bytes - results[i].len() + short.len();
                results[i] = short;
            }
        }
    }
    batch_reply(&results)
}

/// `{"type":"draw", ...}`: draw `count` prizes from `pool` for `user_id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrawRequest {
    pub request_id: String,
    pub pool: String,
    pub user_id: i64,
    pub count: u32,
}

/// `{"type":"lottery.grant", ...}`: give `user_id` more chances in `activity`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantRequest {
    pub grant_id: String,
    pub activity: String,
    pub user_id: i64,
    pub chances: u32,
}

/// A request the refill queue carries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum RefillQueueMessage {
    #[serde(rename = "refill")]
    Refill(RefillRequest),
    #[serde(rename = "redpacket.create")]
    RedPacketCreate(RedPacketCreate),
    #[serde(rename = "redpacket.expire")]
    RedPacketExpire(RedPacketExpire),
}

/// `{"type":"redpacket.create", ...}`: escrow `total` from `sender` and split
/// it into `count` shares of at least `min`, grabbable for `expires_in_s`.
/// Idempotent by `packet_id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedPacketCreate {
    pub packet_id: String,
    pub sender: i64,
    pub total: i64,
    pub count: i64,
    #[serde(default)]
    pub min: i64,
    pub expires_in_s: i64,
    #[serde(default = "default_asset")]
    pub asset: String,
}

fn default_asset() -> String {
    "coin".into()
}

/// `{"type":"redpacket.expire", ...}`: close the packet if its time has come
/// (sent by the refill worker to itself through the delay queues).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedPacketExpire {
    pub packet_id: String,
    /// When the packet expires (informative: the packet's stored expiry
    /// decides).
    #[serde(default)]
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Which expiry message this is: an early one is delayed again only if
    /// its packet names it as its one pending expiry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// `{"type":"refill","pool":…,"trigger":N}`: batch `trigger` of `pool` reached
/// its refill point (or ran short), so batch `trigger + 1` must exist. The
/// pair (`pool`, `trigger`) is the idempotency id: any number of requests for
/// one trigger stock one batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefillRequest {
    pub pool: String,
    pub trigger: u64,
    /// Set when a draw found the pool short rather than at its refill point.
    #[serde(default)]
    pub urgent: bool,
}

/// `{"type":"settle", ...}`: one ledger movement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleRequest {
    #[serde(rename = "type")]
    pub kind: SettleType,
    pub entry_id: String,
    pub account: i64,
    pub asset: String,
    pub amount: i64,
    pub reason: String,
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub reference: Option<Value>,
    /// The fleet's seal on its own entries (see [`crate::ledger::Sealer`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<String>,
}

/// The only `type` the settle queue accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SettleType {
    #[serde(rename = "settle")]
    Settle,
}

impl SettleRequest {
    /// A credit (positive) or debit (negative) of `amount` units of `asset`.
    pub fn new(
        entry_id: impl Into<String>,
        account: i64,
        asset: impl Into<String>,
        amount: i64,
        reason: impl Into<String>,
        reference: Value,
    ) -> Self {
        Self {
            kind: SettleType::Settle,
            entry_id: entry_id.into(),
            account,
            asset: asset.into(),
            amount,
            reason: reason.into(),
            reference: Some(reference),
            seal: None,
        }
    }
}

/// The `ref` of an entry the fleet books itself: the pool (or red packet, or
/// lottery activity) it belongs to and, for a prize, the request that won it
/// and where it came from. Written as `{"pool":…,"request_id":…,"share":…,
/// "version":…}` without the fields a kind does not use; the ledger and the
/// red-packet audit read `ref->>'pool'` and `ref->>'share'`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryRef {
    pub pool: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The red-packet share a grab took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<u32>,
    /// The lucky-gift pool config version a prize was drawn under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
}

impl EntryRef {
    /// A `ref` naming `pool` alone.
    pub fn pool(pool: impl Into<String>) -> Self {
        Self {
            pool: pool.into(),
            ..Self::default()
        }
    }

    /// A `ref` naming `pool` and the request `request_id` that won a prize.
    pub fn prize(pool: impl Into<String>, request_id: impl Into<String>) -> Self {
        Self {
            request_id: Some(request_id.into()),
            ..Self::pool(pool)
        }
    }
}

impl SettleRequest {
    /// An entry the fleet books itself, its `ref` an [`EntryRef`].
    pub fn fleet(
        entry_id: impl Into<String>,
        account: i64,
        asset: impl Into<String>,
        amount: i64,
        reason: impl Into<String>,
        reference: EntryRef,
    ) -> Self {
        // A struct of strings and numbers always serialises.
        let reference = serde_json::to_value(reference).unwrap_or_default();
        Self::new(entry_id, account, asset, amount, reason, reference)
    }
}

/// One prize of a draw result; which fields appear depends on the prize kind.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Lucky gift: the pool's draw counter after this draw (the serial of
    /// its ledger entry id); names the draw for ever.
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
    /// at the pool's head, where they came from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_back: Vec<BatchPosition>,
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

/// The random pick of a lottery draw: `value` (uniform in `[0, 2^52)`,
/// below the largest multiple of the total weight) and the candidates it
/// was read against, in order. The prize is the candidate where
/// `value mod total` falls when the weights are laid end to end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LotteryPick {
    pub value: u64,
    pub weights: Vec<PrizeWeight>,
}

/// One candidate of a lottery pick.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// `count` consecutive prizes of a draw taken from positions `position`,
/// `position + 1`, … of batch `generation` (generation 0: a batch stocked
/// before batches were committed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrizeRun {
    pub generation: u64,
    pub position: u64,
    pub count: u64,
}

/// A position in the order of batch `generation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchPosition {
    pub generation: u64,
    pub position: u64,
}

/// A revealed batch seed: `SHA-256(seed)` is the batch's commitment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reveal {
    pub generation: u64,
    pub version: i64,
    pub seed: String,
}

/// `type` of every red-packet reply.
pub const REDPACKET_RESULT: &str = "redpacket_result";
/// `type` (and routing key) of the event of a created red packet.
pub const REDPACKET_CREATED: &str = "redpacket.created";
/// `type` (and routing key) of the event of a closed red packet.
pub const REDPACKET_CLOSED: &str = "redpacket.closed";

/// A time as the wire carries it: RFC 3339, whole seconds, `Z`.
pub fn wire_time(at: chrono::DateTime<chrono::Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// `{"type":"redpacket_result", ...}`: the answer to a `redpacket.create`,
/// and with `type` `redpacket.created` its event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CreatedReply {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub status: Status,
    pub count: i64,
    pub total: i64,
    pub expires_at: String,
    /// SHA-256 of the packet's split and salt, fixed before the first grab
    /// (`docs/fairness.md`); absent for a packet created before packets
    /// committed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub commitment: Option<String>,
}

/// A refused red-packet request's `redpacket_result`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RejectedReply {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub status: Status,
    pub error: ErrorBody,
}

impl RejectedReply {
    /// A refusal of packet `packet_id` with `code`.
    pub fn new(packet_id: &str, code: ErrorCode, message: String) -> Self {
        Self {
            kind: REDPACKET_RESULT,
            packet_id: packet_id.to_owned(),
            status: Status::Rejected,
            error: ErrorBody { code, message },
        }
    }
}

/// The `redpacket_result` answer to a `redpacket.expire`: closed with its
/// refund, or still open until its stored `expires_at`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExpireReply {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub status: Status,
    pub closed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refunded: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

impl ExpireReply {
    /// The packet is closed and `refunded` went back to the sender.
    pub fn closed(packet_id: &str, refunded: i64) -> Self {
        Self {
            kind: REDPACKET_RESULT,
            packet_id: packet_id.to_owned(),
            status: Status::Ok,
            closed: true,
            refunded: Some(refunded),
            expires_at: None,
        }
    }

    /// The packet stays open until `expires_at`.
    pub fn open_until(packet_id: &str, expires_at: chrono::DateTime<chrono::Utc>) -> Self {
        Self {
            kind: REDPACKET_RESULT,
            packet_id: packet_id.to_owned(),
            status: Status::Ok,
            closed: false,
            refunded: None,
            expires_at: Some(wire_time(expires_at)),
        }
    }
}

/// `{"type":"redpacket.closed", ...}` (event): a packet closed, its rest
/// refunded, its split revealed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClosedEvent {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub packet_id: String,
    pub refunded: i64,
    /// The revealed salt of the packet's commitment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
    /// The revealed split, in share order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shares: Option<Vec<i64>>,
}

impl ClosedEvent {
    /// Packet `packet_id` closed, refunding `refunded`, revealing nothing.
    pub fn new(packet_id: &str, refunded: i64) -> Self {
        Self {
            kind: REDPACKET_CLOSED,
            packet_id: packet_id.to_owned(),
            refunded,
            salt: None,
            shares: None,
        }
    }
}

/// `ok` or `rejected`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    #[default]
    Ok,
    Rejected,
}

/// Bad input: the message cannot be processed as sent. It is dead-lettered
/// with this reason in a header.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    pub message: String,
}

impl Invalid {
    /// Bad input described by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
        }
    }
}

/// Checks the envelope every queue shares: size, JSON object, a string `type`.
pub fn decode_envelope(body: &[u8]) -> Result<Value, Invalid> {
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(Invalid::new(format!(
            "message is {} bytes, the limit is {MAX_MESSAGE_BYTES}",
            body.len()
        )));
    }
    let text = std::str::from_utf8(body).map_err(|e| Invalid::new(format!("not UTF-8: {e}")))?;
    let value: Value =
        serde_json::from_str(text).map_err(|e| Invalid::new(format!("not JSON: {e}")))?;
    match value.get("type") {
        Some(Value::String(_)) => Ok(value),
        Some(_) => Err(Invalid::new("field `type` must be a string")),
        None if value.is_object() => Err(Invalid::new("missing field `type`")),
        None => Err(Invalid::new("message must be a JSON object")),
    }
}

/// Decodes a typed payload from an envelope, turning serde's complaint into a
/// readable reason (`unknown variant` becomes `unknown type`). It reads the
/// envelope in place, so a retried delivery decodes again without a copy.
pub fn decode_typed<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, Invalid> {
    let kind = value
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    T::deserialize(value).map_err(|e| {
        let text = e.to_string();
        if text.contains("unknown variant") {
            Invalid::new(format!("unknown type {kind:?}"))
        } else {
            Invalid::new(text)
        }
    })
}

/// Checks an id field: non-empty, at most [`MAX_ID_LEN`] bytes, printable
/// ASCII without `{` or `}`. Ids are data, never Redis key syntax: every id
/// of the wire contract and of the loaded configs passes here before it is
/// used in a key, so no id can name another pool's keys or break a Redis
/// Cluster hash tag (`pp:{<pool>}:…`).
pub fn check_id(field: &str, id: &str) -> Result<(), Invalid> {
    check_id_within(field, id, MAX_ID_LEN)
}

fn check_id_within(field: &str, id: &str, max_len: usize) -> Result<(), Invalid> {
    if id.is_empty() {
        return Err(Invalid::new(format!("`{field}` must not be empty")));
    }
    if id.len() > max_len {
        return Err(Invalid::new(format!(
            "`{field}` is longer than {max_len} bytes"
        )));
    }
    if let Some(c) = id.chars().find(|c| !valid_id_char(*c)) {
        return Err(Invalid::new(format!(
            "`{field}` must be printable ASCII without spaces, `{{` or `}}`; found {c:?}"
        )));
    }
    Ok(())
}

/// Checks the name of a pool or lottery activity, chosen by the operator
/// at load: an id ([`check_id`]) of ASCII letters, digits, `-`, `_` and `.`
/// only. A name never holds `:`, so ledger entry ids that start with one
/// (`draw:<pool>:…`, see [`crate::kinds::answer::entry_id`]) cannot collide.
pub fn check_name(field: &str, name: &str) -> Result<(), Invalid> {
    check_id(field, name)?;
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(Invalid::new(format!(
            "`{field}` may hold ASCII letters, digits, `-`, `_` and `.` only; found {c:?}"
        )));
    }
    Ok(())
}

/// Checks a ledger `entry_id`: like [`check_id`], up to
/// [`MAX_ENTRY_ID_LEN`] bytes, room for the fleet's own ids, which hold a
/// pool and a request id of [`MAX_ID_LEN`] each.
pub fn check_entry_id(id: &str) -> Result<(), Invalid> {
    check_id_within("entry_id", id, MAX_ENTRY_ID_LEN)
}

/// Whether `c` may appear in an id.
pub fn valid_id_char(c: char) -> bool {
    c.is_ascii_graphic() && c != '{' && c != '}'
}

/// Checks an account or user id: non-negative.
pub fn check_account(field: &str, account: i64) -> Result<(), Invalid> {
    if account < 0 {
        return Err(Invalid::new(format!("`{field}` must not be negative")));
    }
    Ok(())
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

/// The most entries one `settle.batch` message may carry.
pub const MAX_SETTLE_BATCH: usize = 1000;

/// What the settle queue carries: one `settle` entry, or a `settle.batch`
/// of them (how workers publish the entries of concurrent draws).
#[derive(Debug)]
pub enum SettleMessage {
    One(SettleRequest),
    /// Each entry decoded on its own, so one bad entry spoils only itself.
    Batch(Vec<Result<SettleRequest, BadEntry>>),
}

/// An entry of a `settle.batch` that is not a valid `settle` message.
#[derive(Debug)]
pub struct BadEntry {
    pub body: Value,
    pub invalid: Invalid,
}

impl SettleMessage {
    /// Decodes and validates a settle-queue message.
    pub fn decode(envelope: &Value) -> Result<Self, Invalid> {
        if envelope.get("type").and_then(Value::as_str) != Some("settle.batch") {
            let entry: SettleRequest = decode_typed(envelope)?;
            entry.validate()?;
            return Ok(Self::One(entry));
        }
        if let Some(field) = envelope
            .as_object()
            .and_then(|o| o.keys().find(|k| *k != "type" && *k != "entries"))
        {
            return Err(Invalid::new(format!(
                "unknown field `{field}` in settle.batch"
            )));
        }
        let entries = envelope
            .get("entries")
            .and_then(Value::as_array)
            .ok_or_else(|| Invalid::new("`entries` must be an array of settle messages"))?;
        if entries.is_empty() || entries.len() > MAX_SETTLE_BATCH {
            return Err(Invalid::new(format!(
                "a settle.batch holds 1 to {MAX_SETTLE_BATCH} entries, got {}",
                entries.len()
            )));
        }
        Ok(Self::Batch(
            entries
                .iter()
                .map(|body| {
                    decode_typed::<SettleRequest>(body)
                        .and_then(|entry| entry.validate().map(|()| entry))
                        .map_err(|invalid| BadEntry {
                            body: body.clone(),
                            invalid,
                        })
                })
                .collect(),
        ))
    }
}

impl SettleRequest {
    /// Checks ids, the asset name and the movement: a known reason, the
    /// sign its direction asks for and a bounded amount (the ledger's rules,
    /// `ledger/reasons.rs`).
    pub fn validate(&self) -> Result<(), Invalid> {
        check_entry_id(&self.entry_id)?;
        check_id("asset", &self.asset)?;
        check_account("account", self.account)?;
        crate::ledger::reasons::check_movement(&self.reason, self.amount).map_err(Invalid::new)
    }
}

impl RefillRequest {
    /// Checks the pool id.
    pub fn validate(&self) -> Result<(), Invalid> {
        check_id("pool", &self.pool)
    }
}

/// The idempotency-id fields, in the order a reply looks for them.
const ID_FIELDS: [&str; 4] = ["request_id", "grant_id", "packet_id", "entry_id"];

/// Largest body [`request_ids`] still reads for ids: well past
/// [`MAX_MESSAGE_BYTES`], so an oversize request is answered with its id, but
/// bounded, so a huge body cannot make the worker parse megabytes for a reply.
pub const MAX_ID_SCAN_BYTES: usize = 4 * 1024 * 1024;

/// The idempotency id a message carries, whatever its type, for echoing in a
/// rejected reply even when the rest of the message is unusable. Only a
/// string of at most [`MAX_ID_LEN`] bytes counts: anything else could not
/// name a request, and echoing it would only make the reply bigger.
pub fn idempotency_id(value: &Value) -> Option<(&'static str, String)> {
    ID_FIELDS
        .into_iter()
        .find_map(|field| match value.get(field) {
            Some(Value::String(s))
                if s.len()
                    <= if field == "entry_id" {
                        MAX_ENTRY_ID_LEN
                    } else {
                        MAX_ID_LEN
                    } =>
            {
                Some((field, s.clone()))
            }
            _ => None,
        })
}

/// What a reply to bad input can still learn from `body` when the envelope
/// does not decode (no `type`, a `type` that is not a string, oversize, not
/// an object for the typed decoder): a JSON object holding only the request's
/// string `type` and its id fields, if the body is a JSON object of at most
/// [`MAX_ID_SCAN_BYTES`]. The body is scanned without building it: every
/// other field is skipped.
pub fn request_ids(body: &[u8]) -> Option<Value> {
    if body.len() > MAX_ID_SCAN_BYTES {
        return None;
    }
    let IdFields(fields) = serde_json::from_slice(body).ok()?;
    Some(Value::Object(fields))
}

/// The `type` and id fields of a JSON object, others skipped (see
/// [`request_ids`]).
struct IdFields(serde_json::Map<String, Value>);

impl<'de> Deserialize<'de> for IdFields {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = IdFields;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<IdFields, A::Error> {
                let mut fields = serde_json::Map::new();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "type" || ID_FIELDS.contains(&key.as_ref()) {
                        // Only strings are kept: a number where an id
                        // belongs names nothing.
                        if let Value::String(s) = map.next_value::<Value>()? {
                            fields.insert(key.into_owned(), Value::String(s));
                        }
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(IdFields(fields))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// The reply `type` for a request `type`; `draw_result` when the request
/// type is unknown or missing (the draw queue's reply is the common case).
pub fn reply_type(request_type: Option<&str>) -> &'static str {
    match request_type {
        Some("lottery.grant") => "grant_result",
        Some("redpacket.create" | "redpacket.expire") => "redpacket_result",
        Some("refill") => "refill_result",
        Some("settle" | "settle.batch") => "settle_result",
        Some("draw.batch") => "draw_result.batch",
        _ => "draw_result",
    }
}

/// Builds a `rejected` reply for a request that could not be processed.
/// `request` is the decoded envelope, or what [`request_ids`] found in a
/// body that did not decode: the reply carries the request's id whenever it
/// had a usable one, and its `type` follows the request's.
pub fn rejected_reply(request: Option<&Value>, code: ErrorCode, message: &str) -> Value {
    let request_type = request.and_then(|v| v.get("type")).and_then(Value::as_str);
    let mut reply = serde_json::json!({
        "type": reply_type(request_type),
        "status": "rejected",
        "error": { "code": code, "message": message },
    });
    if let Some((field, id)) = request.and_then(idempotency_id) {
        reply[field] = Value::String(id);
    }
    if request_type == Some("draw.batch") {
        // A batch refused whole answers none of its requests.
        reply["results"] = Value::Array(Vec::new());
    }
    reply
}

/// The rejected reply to the raw `body` of a request: its envelope when it
/// decodes, else whatever ids [`request_ids`] can still find in it.
pub fn rejected_reply_to(body: &[u8], code: ErrorCode, message: &str) -> Value {
    let request = decode_envelope(body).ok().or_else(|| request_ids(body));
    rejected_reply(request.as_ref(), code, message)
}

/// `body` (a struct without a `type` field) serialised as a JSON object
/// whose first field is `"type": reply_type`: the same document as
/// [`with_type`], written straight to bytes.
pub fn typed_json(reply_type: &str, body: &impl Serialize) -> Vec<u8> {
    retype(reply_type, &serde_json::to_vec(body).unwrap_or_default())
}

/// The serialised JSON object `fields` with `"type": reply_type` put first,
/// so one serialisation serves several message types (a reply and its event).
pub fn retype(reply_type: &str, fields: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.len() + reply_type.len() + 12);
    out.extend_from_slice(b"{\"type\":");
    // A &str always serialises.
    let _ = serde_json::to_writer(&mut out, reply_type);
    match fields.strip_prefix(b"{") {
        Some(b"}") | None => out.push(b'}'),
        Some(rest) => {
            out.push(b',');
            out.extend_from_slice(rest);
        }
    }
    out
}

/// Serialises a reply body with its `type` field first.
pub fn with_type(reply_type: &str, body: &impl Serialize) -> Value {
    let mut map = serde_json::Map::new();
    map.insert("type".into(), Value::String(reply_type.into()));
    if let Ok(Value::Object(fields)) = serde_json::to_value(body) {
        map.extend(fields);
    }
    Value::Object(map)
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_have_no_key_or_entry_id_syntax() {
        assert!(super::check_name("id", "gift-2026_a.b").is_ok());
        for bad in ["a:b", "a b", "a{b}", "", "é"] {
            assert!(super::check_name("id", bad).is_err(), "{bad:?}");
        }
        assert!(super::check_name("id", &"a".repeat(super::MAX_ID_LEN + 1)).is_err());
    }

    #[test]
    fn entry_ids_hold_a_pool_and_a_request_id() {
        let longest = crate::kinds::answer::entry_id(
            "lottery",
            &"a".repeat(super::MAX_ID_LEN),
            &"r".repeat(super::MAX_ID_LEN),
            u64::MAX,
        );
        assert!(super::check_entry_id(&longest).is_ok(), "{}", longest.len());
        assert!(super::check_entry_id(&"e".repeat(super::MAX_ENTRY_ID_LEN + 1)).is_err());
        assert!(super::check_entry_id("a{b}").is_err());
        assert!(super::check_entry_id("").is_err());
    }

    use super::*;

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
    fn bad_input_classes_are_invalid() {
        for (body, needle) in [
            (&b"not json"[..], "not JSON"),
            (br#"[1,2]"#, "JSON object"),
            (
                br#"{"type":"draw","request_id":"a","pool":"p","user_id":"x","count":1}"#,
                "invalid type",
            ),
            (
                br#"{"type":"draw","request_id":"a","pool":"p","count":1}"#,
                "missing field",
            ),
            (br#"{"type":"explode","request_id":"a"}"#, "unknown type"),
        ] {
            let err = decode_envelope(body)
                .and_then(|v| decode_typed::<DrawQueueMessage>(&v))
                .unwrap_err();
            assert!(err.message.contains(needle), "{body:?}: {err}");
        }
        let big = vec![b' '; MAX_MESSAGE_BYTES + 1];
        assert!(decode_envelope(&big).unwrap_err().message.contains("limit"));
        let zero = DrawRequest {
            request_id: "r".into(),
            pool: "p".into(),
            user_id: 1,
            count: 0,
        };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn rejected_reply_echoes_the_id() {
        let req = serde_json::json!({"type":"lottery.grant","grant_id":"g-1"});
        let reply = rejected_reply(Some(&req), ErrorCode::InvalidRequest, "bad");
        assert_eq!(reply["type"], "grant_result");
        assert_eq!(reply["grant_id"], "g-1");
        assert_eq!(reply["error"]["code"], "invalid_request");
    }

    /// The rejected reply a worker sends for `body`, given how decoding failed.
    fn reply_for(body: &[u8]) -> Value {
        let invalid = decode_envelope(body)
            .and_then(|v| decode_typed::<DrawQueueMessage>(&v).map(|_| ()))
            .expect_err("bad input");
        rejected_reply_to(body, ErrorCode::InvalidRequest, &invalid.message)
    }

    #[test]
    fn a_rejected_reply_to_a_request_without_a_type_carries_its_id() {
        let reply = reply_for(br#"{"request_id":"r-1","pool":"g","user_id":1,"count":1}"#);
        assert_eq!(reply["request_id"], "r-1");
        assert_eq!(reply["type"], "draw_result");
        assert_eq!(reply["status"], "rejected");
        assert_eq!(reply["error"]["code"], "invalid_request");
    }

    #[test]
    fn a_rejected_reply_to_a_request_whose_type_is_not_a_string_carries_its_id() {
        let reply = reply_for(br#"{"type":7,"grant_id":"g-1","activity":"a"}"#);
        assert_eq!(reply["grant_id"], "g-1");
        assert_eq!(reply["type"], "draw_result");
        let reply = reply_for(br#"{"type":"teleport","packet_id":"rp-1"}"#);
        assert_eq!(reply["packet_id"], "rp-1");
        assert_eq!(reply["type"], "draw_result");
    }

    #[test]
    fn a_rejected_reply_to_an_oversize_request_carries_its_id_and_type() {
        let body = format!(
            r#"{{"type":"lottery.grant","pad":"{}","grant_id":"g-big","activity":"a","nested":{{"request_id":"inner"}}}}"#,
            "x".repeat(MAX_MESSAGE_BYTES)
        );
        let reply = reply_for(body.as_bytes());
        assert!(reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit"));
        assert_eq!(reply["grant_id"], "g-big");
        assert_eq!(reply["type"], "grant_result");
        // Only top-level ids count.
        assert!(reply.get("request_id").is_none(), "{reply}");
    }

    #[test]
    fn a_body_past_the_scan_cap_is_answered_without_an_id() {
        let body = format!(
            r#"{{"request_id":"r-huge","pad":"{}"}}"#,
            "x".repeat(MAX_ID_SCAN_BYTES)
        );
        let reply = reply_for(body.as_bytes());
        assert!(reply.get("request_id").is_none());
        assert_eq!(reply["type"], "draw_result");
    }

    #[test]
    fn a_rejected_reply_to_a_request_that_fails_typed_decoding_carries_its_id() {
        let reply = reply_for(
            br#"{"type":"draw","request_id":"r-2","pool":"g","user_id":"one","count":1}"#,
        );
        assert_eq!(reply["request_id"], "r-2");
        assert_eq!(reply["type"], "draw_result");
        let reply = reply_for(br#"{"type":"lottery.grant","grant_id":"g-2","chances":"x"}"#);
        assert_eq!(reply["grant_id"], "g-2");
        assert_eq!(reply["type"], "grant_result");
    }

    #[test]
    fn unusable_ids_are_not_echoed() {
        for body in [
            &b"{oops"[..],
            br#"["draw","r-3"]"#,
            br#"{"request_id":42,"type":"draw"}"#,
            br#"{"request_id":null}"#,
        ] {
            let reply = reply_for(body);
            for field in ID_FIELDS {
                assert!(reply.get(field).is_none(), "{body:?}: {reply}");
            }
            assert_eq!(reply["type"], "draw_result");
        }
        let long = format!(r#"{{"request_id":"{}"}}"#, "r".repeat(MAX_ID_LEN + 1));
        assert!(reply_for(long.as_bytes()).get("request_id").is_none());
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

    #[test]
    fn entry_refs_are_written_as_the_ledger_reads_them() {
        let text = |r: EntryRef| {
            let entry = SettleRequest::fleet("e", 1, "coin", 5, "lottery", r);
            serde_json::to_string(&entry.reference).unwrap()
        };
        assert_eq!(text(EntryRef::pool("rp-1")), r#"{"pool":"rp-1"}"#);
        assert_eq!(
            text(EntryRef::prize("act", "r1")),
            r#"{"pool":"act","request_id":"r1"}"#
        );
        assert_eq!(
            text(EntryRef {
                share: Some(3),
                ..EntryRef::prize("rp-1", "r1")
            }),
            r#"{"pool":"rp-1","request_id":"r1","share":3}"#
        );
        assert_eq!(
            text(EntryRef {
                version: Some(2),
                ..EntryRef::prize("gift-1", "r1")
            }),
            r#"{"pool":"gift-1","request_id":"r1","version":2}"#
        );
    }

    #[test]
    fn typed_json_writes_the_same_document_as_with_type() {
        let full = DrawResult {
            request_id: "01JD\"q".into(),
            pool: Some("gift-1001".into()),
            user_id: Some(42),
            prizes: vec![
                Prize::Multiplier {
                    multiplier: 10,
                    combo: "c3".into(),
                },
                Prize::Share {
                    share: 2,
                    amount: 7,
                },
            ],
            reward: Some(1000),
            ..Default::default()
        };
        #[derive(Serialize)]
        struct Empty {}
        for (kind, bytes, value) in [
            (
                "draw_result",
                typed_json("draw_result", &full),
                with_type("draw_result", &full),
            ),
            (
                "draw.completed",
                typed_json("draw.completed", &DrawResult::default()),
                with_type("draw.completed", &DrawResult::default()),
            ),
            (
                "x\"y",
                typed_json("x\"y", &Empty {}),
                with_type("x\"y", &Empty {}),
            ),
        ] {
            // Byte for byte: same fields, same order, `type` first.
            assert_eq!(
                String::from_utf8(bytes).unwrap(),
                value.to_string(),
                "{kind}"
            );
        }
    }

    /// Issue 26, point 8: a batch reply never passes 64 KiB. Twenty draws
    /// of a thousand prizes each would take about 600 KB listed; the reply
    /// keeps every entry in order, with its id, status and totals, and
    /// leaves out the prizes of as few entries as it must.
    #[test]
    fn batch_replies_are_held_to_64_kib() {
        let big = |i: usize| {
            let result = DrawResult {
                request_id: format!("req-{i}"),
                status: Status::Ok,
                pool: Some("gift".into()),
                user_id: Some(7),
                prizes: (0..1000)
                    .map(|k| Prize::Multiplier {
                        multiplier: k % 7,
                        combo: format!("{:0>64}", k % 3),
                    })
                    .collect(),
                total_multiplier: Some(2997),
                reward: Some(299_700),
                asset: Some("coin".into()),
                serial: Some(i as i64 + 1),
                version: Some(1),
                ..DrawResult::default()
            };
            typed_json("draw_result", &result)
        };
        let small = typed_json(
            "draw_result",
            &DrawResult {
                request_id: "req-small".into(),
                status: Status::Ok,
                reward: Some(5),
                prizes: vec![Prize::Multiplier {
                    multiplier: 5,
                    combo: "c".into(),
                }],
                ..DrawResult::default()
            },
        );
        let mut results: Vec<Vec<u8>> = (0..20).map(big).collect();
        results.insert(3, small.clone());
        assert!(results.iter().map(Vec::len).sum::<usize>() > 10 * MAX_MESSAGE_BYTES);
        let reply = bounded_batch_reply(results);
        assert!(reply.len() <= MAX_MESSAGE_BYTES, "{}", reply.len());
        let batch: DrawResultBatch = serde_json::from_slice(&reply).unwrap();
        assert_eq!(batch.results.len(), 21);
        let read: Vec<DrawResult> = batch
            .results
            .iter()
            .map(|v| serde_json::from_value(v.clone()).unwrap())
            .collect();
        assert_eq!(
            read[3],
            serde_json::from_slice::<DrawResult>(&small).unwrap()
        );
        let mut whole = 0;
        for (k, r) in read.iter().enumerate().filter(|(k, _)| *k != 3) {
            let i = if k < 3 { k } else { k - 1 };
            assert_eq!(r.request_id, format!("req-{i}"));
            assert_eq!(r.status, Status::Ok);
            if r.omitted {
                assert!(r.prizes.is_empty() && r.prize_codes.is_none());
                assert_eq!(
                    r.reward,
                    Some(299_700),
                    "a shortened entry keeps its totals"
                );
            } else {
                assert_eq!(r.prizes.len(), 1000);
                whole += 1;
            }
        }
        // As many whole entries as fit: one of ~90 KB fits none, so the
        // small one alone stays whole; then the reply is the shortened rest.
        assert_eq!(whole, 0);
        // A batch that fits is the plain concatenation.
        let fits = vec![small.clone(), small.clone()];
        assert_eq!(bounded_batch_reply(fits.clone()), batch_reply(&fits));
    }

    /// A batch reply that would not fit even with every entry cut to its
    /// id, status and code is refused at the envelope, before any draw.
    #[test]
    fn batches_whose_answers_cannot_fit_are_refused_whole() {
        let entry = |i: usize| serde_json::json!({"request_id": format!("{i:0>120}"), "pool": "p", "user_id": 1, "count": 1});
        let ok = DrawBatch {
            requests: (0..100).map(entry).collect(),
        };
        ok.check_reply_room().unwrap();
        let too_many = DrawBatch {
            requests: (0..400).map(entry).collect(),
        };
        let e = too_many.check_reply_room().unwrap_err();
        assert!(e.message.contains("message limit"), "{}", e.message);
    }
}
