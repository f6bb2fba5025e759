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

use super::{stored::Drawn, CodeTable, Storage};
use crate::{
    amqp::HandleError,
    kinds::{Ask, Award, ScriptReply, Step},
    messages::{DrawResult, EntryRef, Prize, RefillRequest, SettleRequest, Status, PRIZE_LIST_MAX},
    scripts::PoolKeys,
};

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
pub fn draw_script(storage: Storage) -> &'static crate::scripts::Script {
    storage.draw_script()
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
    keys: &PoolKeys,
    storage: Storage,
    request_id: &str,
    count: u32,
    result_ttl_s: u64,
    token: &[u8],
) -> Result<DrawStep, HandleError> {
    let day = crate::scripts::utc_day();
    let (status, text, number): (String, String, u64) = draw_call(
        draw_script(storage),
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

/// The prizes of `codes` as the reply gives them, and their total
/// multiplier. Up to PRIZE_LIST_MAX prizes the reply lists them one by one;
/// past it, in the compact form, built from the pool's codes without a
/// string per prize (docs/protocol.md, "Big draws").
fn prizes_of(
    ask: &Ask<'_>,
    codes: &[u32],
    table: &CodeTable,
) -> Result<
    (
        Vec<Prize>,
        Option<crate::messages::prize_codes::PrizeCodes>,
        u64,
    ),
    HandleError,
> {
    let compact = codes.len() > PRIZE_LIST_MAX;
    let mut prizes = Vec::with_capacity(if compact { 0 } else { codes.len() });
    let mut builder = crate::messages::prize_codes::Builder::default();
    let mut total: u64 = 0;
    for &code in codes {
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
    Ok((prizes, compact.then(|| builder.finish()), total))
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
    let (prizes, prize_codes, total) = prizes_of(ask, &drawn.codes, table)?;
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
            crate::kinds::answer::entry_id(
                super::reasons::ENTRY_IDS,
                ask.pool,
                ask.request_id,
                drawn.serial,
            ),
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
            held_back_min_multiplier: drawn.held_back_min_multiplier,
            revealed: drawn.revealed,
            ..DrawResult::default()
        },
        entry,
        refill,
        replayed,
        prizes_drawn,
    })
}
