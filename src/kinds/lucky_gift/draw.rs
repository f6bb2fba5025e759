//! The lucky-gift draw: one Lua step that pops `count` prizes or nothing
//! (`lua/draw_lucky_gift.lua`, `lua/draw_sparse.lua`), and the award it
//! makes.
//!
//! Ledger entry ids: `draw:<pool>:<request_id>:<serial>`
//! ([`crate::kinds::answer::entry_id`]), where the serial is the pool's
//! `drawn` counter after the draw, stored with the answer. A request id
//! names one request across all pools while its answer is kept (the draw
//! worker claims it before the step, see [`crate::kinds::answer`]), and the
//! pool and serial name the draw for ever: a replay pays under the same id,
//! while the same request id sent again after its answer expired, on this
//! pool or another, is a new draw and is paid under a new id. A reply and its payment are one-to-one. The stored answer
//! keeps the unit price, asset and config version the draw used, so a
//! replay after a `pool load` pays what the first answer said.

use std::{collections::HashMap, sync::Arc};

use redis::aio::ConnectionLike;
use tokio::sync::RwLock;

use super::{CodeTable, Storage};
use crate::{
    amqp::HandleError,
    kinds::{answer::Tokens, Ask, Award, ScriptReply, Step},
    messages::{
        BatchPosition, DrawResult, EntryRef, Prize, PrizeRun, RefillRequest, Reveal, SettleRequest,
        Status, PRIZE_LIST_MAX,
    },
    scripts::{PoolKeys, Scripts},
};

/// An award as stored in Redis:
/// `"<serial>|<version>|<unit_price>|<trigger>|<codes>[/<runs>/<parked>/<reveals>]|<asset>"`
/// (answers stored before batches were committed lack the fairness record).
/// `<codes>` are the prizes' codes in draw order, comma-separated, each
/// `<code>` or a run `<code>*<n>` of `n` equal codes in a row
/// ([`crate::messages::prize_codes::parse_runs`]); a list that expands past
/// [`crate::messages::MAX_DRAW_COUNT`] prizes is malformed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drawn {
    /// The pool's `drawn` counter after this draw: names the draw for ever.
    pub serial: i64,
    /// The config version the draw used.
    pub version: i64,
    /// Unit price the draw was charged at.
    pub unit_price: i64,
    /// The batch whose refill flag this draw took, if any.
    pub trigger: Option<u64>,
    /// Prize codes in draw order.
    pub codes: Vec<u32>,
    /// The asset the reward is paid in.
    pub asset: String,
    /// Where the prizes came from, in the order of `codes`.
    pub positions: Vec<PrizeRun>,
    /// Jackpots the draw parked, where they came from.
    pub held_back: Vec<BatchPosition>,
    /// Batch seeds this draw revealed.
    pub revealed: Vec<Reveal>,
}

impl Drawn {
    fn parse(body: &str) -> Result<Self, HandleError> {
        let bad = || HandleError::internal(format!("malformed draw answer {body:?} in Redis"));
        let mut parts = body.splitn(6, '|');
        let mut number = || -> Result<i64, HandleError> {
            parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)
        };
        let serial = number()?;
        let version = number()?;
        let unit_price = number()?;
        let trigger = number()?;
        let mut record = parts.next().ok_or_else(bad)?.split('/');
        let codes = expand_codes(record.next().unwrap_or_default()).ok_or_else(bad)?;
        let positions = list(record.next().unwrap_or_default(), |s| {
            let [generation, position, count] = numbers(s)?;
            Some(PrizeRun {
                generation,
                position,
                count,
            })
        })
        .ok_or_else(bad)?;
        let held_back = list(record.next().unwrap_or_default(), |s| {
            let [generation, position] = numbers(s)?;
            Some(BatchPosition {
                generation,
                position,
            })
        })
        .ok_or_else(bad)?;
        let revealed = list(record.next().unwrap_or_default(), |s| {
            let mut it = s.splitn(3, '.');
            let generation = it.next()?.parse().ok()?;
            let version = it.next()?.parse().ok()?;
            let seed = it.next()?;
            crate::fairness::Seed::from_hex(seed)?;
            Some(Reveal {
                generation,
                version,
                seed: seed.to_owned(),
            })
        })
        .ok_or_else(bad)?;
        let covered: u64 = positions.iter().map(|r| r.count).sum();
        if record.next().is_some() || (!positions.is_empty() && covered != codes.len() as u64) {
            return Err(bad());
        }
        let asset = parts.next().filter(|a| !a.is_empty()).ok_or_else(bad)?;
        Ok(Self {
            serial,
            version,
            unit_price,
            trigger: u64::try_from(trigger).ok(),
            codes,
            asset: asset.to_owned(),
            positions,
            held_back,
            revealed,
        })
    }
}

/// The codes of an award written as runs (`lua/lib/award.lua`): each item
/// `<code>` or `<code>*<n>` (n ≥ 2 of that code in a row); `None` if an item
/// does not read or the runs add up to more than a draw can hold. The same
/// syntax as the `codes` of a big draw's reply
/// ([`crate::messages::prize_codes::parse_runs`]).
fn expand_codes(text: &str) -> Option<Vec<u32>> {
    crate::messages::prize_codes::parse_runs(text, crate::messages::MAX_DRAW_COUNT as usize)
}

/// The comma-separated items of `text`, each read by `item`; `None` if one
/// does not read.
fn list<T>(text: &str, item: impl Fn(&str) -> Option<T>) -> Option<Vec<T>> {
    text.split(',')
        .filter(|s| !s.is_empty())
        .map(item)
        .collect()
}

/// Exactly `N` dot-separated integers.
fn numbers<const N: usize>(text: &str) -> Option<[u64; N]> {
    let mut out = [0u64; N];
    let mut it = text.split('.');
    for slot in &mut out {
        *slot = it.next()?.parse().ok()?;
    }
    it.next().is_none().then_some(out)
}

/// The award stored for request `request_id` of `user` for `count` prizes
/// on pool `pool` (behind `keys`), if its answer is still kept and is an
/// award, as an operator or a test reads it back (the audit trail trusts a
/// `draw.completed` record by its seal instead). `None` also when the
/// stored answer was asked by other content (another user or count).
#[allow(clippy::too_many_arguments)]
pub async fn stored_award<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    prefix: &str,
    keys: &PoolKeys,
    pool: &str,
    request_id: &str,
    user: i64,
    count: u32,
    result_ttl_s: u64,
) -> Result<Option<Drawn>, HandleError> {
    let fingerprint = crate::kinds::fingerprint("draw", &[&pool, &user, &count]);
    let tokens = Tokens::new(prefix, "rq", request_id, fingerprint, result_ttl_s);
    let (claim, answer) =
        crate::kinds::answer::stored(conn, scripts, &keys.results(), &tokens, false).await?;
    // An answer is looked up for the content the claim binds: another
    // content's answer is not this request's.
    if claim.is_some_and(|bound| bound[..] != fingerprint.0[..]) {
        return Ok(None);
    }
    let Some(answer) = answer else {
        return Ok(None);
    };
    // The stored form (lua/lib/award.lua): byte 1, varints of serial,
    // version and trigger + 1, then the codes and the fairness record; or
    // byte 2, the same varints, the batch and first position of the draw's
    // one run of positions, then the codes. Or, stored by an earlier
    // version, "<serial>|<version>|<trigger or nothing>|<codes>" or a full
    // body. Price and asset are not checked here.
    if let Some((&form @ (1 | 2), packed)) = answer.split_first() {
        let bad = || HandleError::internal("malformed stored award in Redis".to_owned());
        let mut rest = packed;
        let mut next = || -> Result<u64, HandleError> {
            let (n, used) = read_varint(rest).ok_or_else(bad)?;
            rest = &rest[used..];
            Ok(n)
        };
        let (serial, version, trigger) = (next()?, next()?, next()?);
        let run = if form == 2 {
            Some((next()?, next()?))
        } else {
            None
        };
        let codes = std::str::from_utf8(rest).map_err(|_| bad())?;
        let codes = match run {
            Some((generation, position)) => {
                let n = expand_codes(codes).ok_or_else(bad)?.len();
                format!("{codes}/{generation}.{position}.{n}")
            }
            None => codes.to_owned(),
        };
        let trigger = i128::from(trigger) - 1;
        return Drawn::parse(&format!("{serial}|{version}|0|{trigger}|{codes}|-")).map(Some);
    }
    let body = String::from_utf8_lossy(&answer);
    let parts: Vec<&str> = body.split('|').collect();
    let full = match parts[..] {
        [serial, version, trigger, codes] => {
            let trigger = if trigger.is_empty() { "-1" } else { trigger };
            format!("{serial}|{version}|0|{trigger}|{codes}|-")
        }
        _ => body.into_owned(),
    };
    Drawn::parse(&full).map(Some)
}

/// A base-128 varint (low group first) at the start of `bytes`, and the
/// bytes it took; `None` past 2^53 or at the end of the input.
fn read_varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut n = 0u64;
    for (i, b) in bytes.iter().enumerate().take(8) {
        n |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return (n < 1 << 53).then_some((n, i + 1));
        }
    }
    None
}

/// What one draw step answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DrawStep {
    /// Prizes were drawn now.
    Drawn(Drawn),
    /// This request was drawn before; here is its first answer.
    Replayed(Drawn),
    /// A final refusal (now or before).
    Refused(crate::kinds::Refusal),
    /// Fewer than `count` prizes are drawable; nothing was taken.
    Short { in_pool: u64, generation: u64 },
    /// `count` exceeds the pool's `max_count`; nothing was taken.
    TooMany { max_count: u64 },
}

/// The draw script of `storage`.
pub fn draw_script(scripts: &Scripts, storage: Storage) -> &crate::scripts::Script {
    storage.draw_script(scripts)
}

/// A call of `script` with the draw step's keys and arguments for `storage`,
/// in the order the draw scripts' contracts list them (the storage's file
/// under `storage/` knows them). `script` is the storage's [`draw_script`],
/// or any script that should see the same keys (the bench's round-trip
/// floor).
#[allow(clippy::too_many_arguments)]
pub(crate) fn draw_call<'a>(
    script: &'a crate::scripts::Script,
    keys: &PoolKeys,
    storage: Storage,
    day: &str,
    count: u32,
    result_ttl_s: u64,
    token: &[u8],
) -> crate::scripts::ScriptInvocation<'a> {
    let layout = storage.layout();
    let mut call = script.prepare_invoke();
    layout.draw_keys(&mut call, keys, day);
    // `lua/lib/many.lua` reads the draws' arguments in groups of this size.
    call.arg(layout.args_per_draw());
    layout.draw_args(&mut call, count, result_ttl_s, token);
    call
}

/// Draws `count` prizes for `request_id` from the pool behind `keys`, in one
/// atomic Lua step, storing its answer under `token`.
#[allow(clippy::too_many_arguments)]
pub async fn draw_once<C: ConnectionLike + Send>(
    conn: &mut C,
    scripts: &Scripts,
    keys: &PoolKeys,
    storage: Storage,
    request_id: &str,
    count: u32,
    result_ttl_s: u64,
    token: &[u8],
) -> Result<DrawStep, HandleError> {
    let day = crate::scripts::utc_day();
    let (status, text, number): (String, String, u64) = draw_call(
        draw_script(scripts, storage),
        keys,
        storage,
        &day,
        count,
        result_ttl_s,
        token,
    )
    .invoke_async(conn)
    .await?;
    step_of(&status, text, number, request_id)
}

/// One draw of a coalesced call: what it asks and where its step goes.
#[derive(Debug)]
pub struct Pending {
    pub request_id: String,
    pub count: u32,
    pub result_ttl_s: u64,
    pub token: Vec<u8>,
}

/// Applies `draws` to the pool behind `keys` in one Lua call, in order,
/// each exactly as [`draw_once`] would (`lua/lib/many.lua`). A reply of the
/// wrong length fails them all; a draw whose reply does not read fails alone.
pub async fn draw_many<C: ConnectionLike + Send>(
    conn: &mut C,
    script: &crate::scripts::Script,
    keys: &PoolKeys,
    storage: Storage,
    draws: &[Pending],
) -> Result<Vec<Result<DrawStep, HandleError>>, HandleError> {
    let Some(first) = draws.first() else {
        return Ok(Vec::new());
    };
    let day = crate::scripts::utc_day();
    let mut call = draw_call(
        script,
        keys,
        storage,
        &day,
        first.count,
        first.result_ttl_s,
        &first.token,
    );
    for d in &draws[1..] {
        storage
            .layout()
            .draw_args(&mut call, d.count, d.result_ttl_s, &d.token);
    }
    let replies: Vec<redis::Value> = call.invoke_async(conn).await?;
    if replies.len() != 3 * draws.len() {
        return Err(HandleError::internal(format!(
            "a coalesced draw of {} answered {} values",
            draws.len(),
            replies.len()
        )));
    }
    Ok(replies
        .chunks(3)
        .zip(draws)
        .map(|(reply, d)| {
            let (status, text, number): (String, String, u64) =
                redis::from_redis_value(redis::Value::Array(reply.to_vec())).map_err(|e| {
                    HandleError::internal(format!("a draw reply that does not read: {e}"))
                })?;
            step_of(&status, text, number, &d.request_id)
        })
        .collect())
}

/// The step one draw script reply says.
fn step_of(
    status: &str,
    text: String,
    number: u64,
    request_id: &str,
) -> Result<DrawStep, HandleError> {
    Ok(
        match ScriptReply::read(status, text, number, "request_id", request_id)? {
            ScriptReply::Awarded(body) => DrawStep::Drawn(Drawn::parse(&body)?),
            ScriptReply::Replayed(body) => DrawStep::Replayed(Drawn::parse(&body)?),
            ScriptReply::Refused(refusal) => DrawStep::Refused(refusal),
            ScriptReply::Short {
                in_pool,
                generation,
            } => DrawStep::Short {
                in_pool,
                generation,
            },
            ScriptReply::TooMany { max_count } => DrawStep::TooMany { max_count },
            ScriptReply::Retry => {
                return Err(HandleError::internal("the draw script asked for a retry"))
            }
        },
    )
}

/// Most pools whose code tables a worker keeps; past it the cache starts over.
const MAX_CACHED_TABLES: usize = 10_000;

/// Decoding tables per pool. Tables only grow and a code never changes
/// meaning, so a cached table is reloaded only when a code past its end
/// shows up (after a `pool load` that added prizes).
#[derive(Debug, Default)]
pub struct Decoder {
    tables: RwLock<HashMap<String, Arc<CodeTable>>>,
}

impl Decoder {
    async fn table<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &PoolKeys,
        pool: &str,
        highest: u32,
    ) -> Result<Arc<CodeTable>, HandleError> {
        if let Some(t) = self.tables.read().await.get(pool) {
            if (highest as usize) < t.len() {
                return Ok(t.clone());
            }
        }
        let (table, _) = super::load_codes(conn, keys)
            .await
            .map_err(HandleError::classify)?
            .ok_or_else(|| HandleError::internal(format!("pool {pool} has no code table")))?;
        let table = Arc::new(table);
        let mut tables = self.tables.write().await;
        if tables.len() >= MAX_CACHED_TABLES {
            tables.clear();
        }
        tables.insert(pool.to_owned(), table.clone());
        Ok(table)
    }
}

/// Draw steps of a lucky-gift pool for `asks` (all of one pool), applied in
/// order in the pool's next coalesced call; each step as the seam asks it.
pub async fn draw(
    redis: &crate::redis_conn::RedisConn,
    coalescer: &super::Coalescer,
    decoder: &Decoder,
    keys: &PoolKeys,
    storage: Storage,
    asks: &[Ask<'_>],
) -> Vec<Result<Step, HandleError>> {
    let Some(first) = asks.first() else {
        return Vec::new();
    };
    let pending = asks
        .iter()
        .map(|ask| Pending {
            request_id: ask.request_id.to_owned(),
            count: ask.count,
            result_ttl_s: ask.result_ttl_s,
            token: ask.token.to_vec(),
        })
        .collect();
    let steps = coalescer
        .draw(redis, keys, storage, first.pool, pending)
        .await;
    let mut out = Vec::with_capacity(asks.len());
    for (ask, step) in asks.iter().zip(steps) {
        out.push(match step {
            Ok(step) => seam_step(redis, decoder, keys, ask, step).await,
            Err(e) => Err(e),
        });
    }
    out
}

/// What one draw step means to the seam.
async fn seam_step(
    redis: &crate::redis_conn::RedisConn,
    decoder: &Decoder,
    keys: &PoolKeys,
    ask: &Ask<'_>,
    step: DrawStep,
) -> Result<Step, HandleError> {
    let (drawn, replayed) = match step {
        DrawStep::Drawn(drawn) => (drawn, false),
        DrawStep::Replayed(drawn) => (drawn, true),
        DrawStep::Refused(refusal) => return Ok(Step::Refused(refusal)),
        DrawStep::Short {
            in_pool,
            generation,
        } => {
            return Ok(Step::Short {
                in_pool,
                generation,
            })
        }
        DrawStep::TooMany { max_count } => {
            return Err(crate::messages::Invalid::new(format!(
                "`count` {} is above the max_count {max_count} of pool {}",
                ask.count, ask.pool
            ))
            .into())
        }
    };
    let highest = drawn.codes.iter().copied().max().unwrap_or(0);
    let mut conn = redis.clone();
    let table = decoder.table(&mut conn, keys, ask.pool, highest).await?;
    award(ask, drawn, &table, replayed).map(|a| Step::Awarded(Box::new(a)))
}

/// The award of `drawn`: prizes decoded, the reward computed exactly, its
/// ledger entry and the refill the draw triggered (sent again on a replay,
/// in case the first attempt stopped before publishing it: the refill
/// worker stocks one batch per trigger however often it is asked).
fn award(
    ask: &Ask<'_>,
    drawn: Drawn,
    table: &CodeTable,
    replayed: bool,
) -> Result<Award, HandleError> {
    // Up to PRIZE_LIST_MAX prizes the reply lists them one by one; past it,
    // in the compact form, built from the pool's codes without a string per
    // prize (docs/protocol.md, "Big draws").
    let compact = drawn.codes.len() > PRIZE_LIST_MAX;
    let mut prizes = Vec::with_capacity(if compact { 0 } else { drawn.codes.len() });
    let mut builder = crate::messages::prize_codes::Builder::default();
    let mut total: u64 = 0;
    for &code in &drawn.codes {
        let (combo, multiplier) = table.decode(code).ok_or_else(|| {
            HandleError::internal(format!(
                "code {code} is not in the table of pool {}",
                ask.pool
            ))
        })?;
        total = total
            .checked_add(multiplier)
            .ok_or_else(|| HandleError::internal("total multiplier overflows"))?;
        if compact {
            builder.push(code, combo, multiplier);
        } else {
            prizes.push(Prize::Multiplier {
                multiplier,
                combo: combo.to_owned(),
            });
        }
    }
    let prize_codes = compact.then(|| builder.finish());
    let reward = i64::try_from(total)
        .ok()
        .and_then(|t| t.checked_mul(drawn.unit_price))
        .filter(|r| *r < crate::messages::MAX_EXACT)
        .ok_or_else(|| HandleError::internal("reward overflows"))?;
    // A sharded pool's draw runs on a sub-pool; the reply and the ledger
    // name the pool, the entry id the sub-pool (serials count per sub-pool).
    let (pool, shard) = super::config::split_sub_pool(ask.pool);
    let entry = (reward != 0).then(|| {
        SettleRequest::fleet(
            crate::kinds::answer::entry_id("draw", ask.pool, ask.request_id, drawn.serial),
            ask.user,
            drawn.asset.as_str(),
            reward,
            "lucky_gift",
            EntryRef {
                version: Some(drawn.version),
                ..EntryRef::prize(pool, ask.request_id)
            },
        )
    });
    let refill = drawn.trigger.map(|trigger| RefillRequest {
        pool: ask.pool.to_owned(),
        trigger,
        urgent: false,
    });
    let prizes_drawn = if replayed {
        0
    } else {
        drawn.codes.len() as u64
    };
    Ok(Award {
        result: DrawResult {
            request_id: ask.request_id.to_owned(),
            status: Status::Ok,
            pool: Some(pool.to_owned()),
            shard,
            user_id: Some(ask.user),
            prizes,
            prize_codes,
            total_multiplier: Some(total),
            reward: Some(reward),
            asset: Some(drawn.asset),
            serial: Some(drawn.serial),
            version: Some(drawn.version),
            positions: drawn.positions,
            held_back: drawn.held_back,
            revealed: drawn.revealed,
            ..DrawResult::default()
        },
        entry,
        refill,
        replayed,
        prizes_drawn,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_answers_parse_strictly() {
        let d = Drawn::parse("9|3|100|-1|1,2,3|item:a|b").unwrap();
        assert_eq!(d.serial, 9);
        assert_eq!(d.version, 3);
        assert_eq!(d.unit_price, 100);
        assert_eq!(d.trigger, None);
        assert_eq!(d.codes, vec![1, 2, 3]);
        assert_eq!(d.asset, "item:a|b");
        assert_eq!(Drawn::parse("1|1|1|4||coin").unwrap().trigger, Some(4));
        // The varints of a packed award.
        assert_eq!(read_varint(&[0x05]), Some((5, 1)));
        assert_eq!(read_varint(&[0x80, 0x80, 0x40]), Some((1 << 20, 3)));
        assert_eq!(read_varint(&[0x80]), None);
        assert_eq!(read_varint(&[0xff; 9]), None);
        // Runs of equal codes, as the scripts store them.
        let d = Drawn::parse("9|3|100|-1|1*3,2,0*2|coin").unwrap();
        assert_eq!(d.codes, vec![1, 1, 1, 2, 0, 0]);
        for bad in ["1*1", "1*", "*2", "1*x", "1*10001", "0*5000,1*5001"] {
            assert!(
                Drawn::parse(&format!("9|3|100|-1|{bad}|coin")).is_err(),
                "{bad}"
            );
        }
        let seed = "ab".repeat(32);
        let d = Drawn::parse(&format!(
            "5|2|10|-1|7,8,9/3.10.2,0.0.1/3.12/2.1.{seed}|coin"
        ))
        .unwrap();
        assert_eq!(d.codes, vec![7, 8, 9]);
        assert_eq!(
            d.positions,
            vec![
                PrizeRun {
                    generation: 3,
                    position: 10,
                    count: 2
                },
                PrizeRun {
                    generation: 0,
                    position: 0,
                    count: 1
                }
            ]
        );
        assert_eq!(
            d.held_back,
            vec![BatchPosition {
                generation: 3,
                position: 12
            }]
        );
        assert_eq!(
            d.revealed,
            vec![Reveal {
                generation: 2,
                version: 1,
                seed
            }]
        );
        assert_eq!(
            Drawn::parse("5|2|10|-1|7///|coin").unwrap().positions,
            vec![]
        );
        for bad in [
            "",
            "1|1|1|1|1",
            "1|1|x|1|1|coin",
            "1|1|1|1|1,a|coin",
            "1|1|1|1|",
            "1e14|1|1|1|c",
            // runs that do not cover the prizes, junk in the record
            "1|1|1|1|1,2/3.0.1//|coin",
            "1|1|1|1|1/3.0/|coin",
            "1|1|1|1|1/3.0.1/x/|coin",
            "1|1|1|1|1/3.0.1//2.1.zz|coin",
            "1|1|1|1|1/3.0.1///|coin",
        ] {
            assert!(
                matches!(Drawn::parse(bad), Err(HandleError::Internal(_))),
                "{bad:?}"
            );
        }
    }

    /// Codes stored as runs (`<code>*<n>`) expand to the prizes they stand
    /// for, mixed with single codes and with the fairness record; a run
    /// that does not read, or that would hold more than a draw may, is a
    /// malformed answer.
    #[test]
    fn stored_runs_expand() {
        let d = Drawn::parse("9|3|100|-1|4*3,2,0*2|coin").unwrap();
        assert_eq!(d.codes, vec![4, 4, 4, 2, 0, 0]);
        let d = Drawn::parse("9|3|100|-1|1*10000/7.0.10000//|coin").unwrap();
        assert_eq!(d.codes.len(), 10_000);
        assert_eq!(d.positions.iter().map(|r| r.count).sum::<u64>(), 10_000);
        // The same prizes written out one by one read the same.
        let plain = ["1"; 3].join(",");
        assert_eq!(
            Drawn::parse(&format!("9|3|100|-1|{plain}|coin"))
                .unwrap()
                .codes,
            Drawn::parse("9|3|100|-1|1*3|coin").unwrap().codes
        );
        for bad in [
            "1|1|1|1|1*10001|coin",
            "1|1|1|1|1*5000,2*5001|coin",
            "1|1|1|1|1*0|coin",
            "1|1|1|1|1*|coin",
            "1|1|1|1|*2|coin",
            "1|1|1|1|1*2*2|coin",
            "1|1|1|1|1*x|coin",
            "1|1|1|1|1*99999999999999999999|coin",
            // a run the positions do not cover
            "1|1|1|1|1*3/3.0.2//|coin",
        ] {
            assert!(
                matches!(Drawn::parse(bad), Err(HandleError::Internal(_))),
                "{bad:?}"
            );
        }
    }
}
