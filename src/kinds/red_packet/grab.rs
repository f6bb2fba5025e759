//! A red-packet grab: one share per user, in one Lua step
//! (`lua/grab_red_packet.lua`).
//!
//! Ledger entry ids: `redpacket:<packet>:grab:<user>`, one per packet and
//! user, so even two requests of one user cannot be credited twice; the
//! grab script guarantees the user holds at most one share. A request id is
//! bound to its user and packet (see [`crate::kinds::answer`]): replayed
//! under another user it is refused, never paid to that user.

use crate::kinds::red_packet::scripts as lua;
use redis::aio::ConnectionLike;

use crate::{
    amqp::HandleError,
    kinds::{Ask, Award, ScriptReply, Step},
    messages::{DrawResult, EntryRef, Invalid, Prize, SettleRequest, Status},
    scripts::PoolKeys,
};

/// The grab script's call with its keys and arguments: what a grab makes,
/// and what [`crate::kinds::Kinds::script_call`] hands out. `script` is
/// `grab_red_packet.lua`.
pub(crate) fn grab_call<'a>(
    script: &'a crate::scripts::Script,
    keys: &PoolKeys,
    user: i64,
    result_ttl_s: u64,
    token: &[u8],
) -> crate::scripts::ScriptInvocation<'a> {
    let mut call = script.prepare_invoke();
    call.key(keys.meta())
        .key(keys.shares())
        .key(keys.grabbed())
        .key(keys.results())
        .arg(user)
        .arg(crate::scripts::now_ms())
        .arg(result_ttl_s)
        .arg(token);
    call
}

/// Grabs one share for the asking user, as the seam asks it.
pub async fn grab<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &PoolKeys,
    ask: &Ask<'_>,
) -> Result<Step, HandleError> {
    if ask.count != 1 {
        return Err(Invalid::new(format!(
            "a red packet is grabbed one share at a time; `count` must be 1, got {}",
            ask.count
        ))
        .into());
    }
    let (status, text, _): (String, String, u64) =
        grab_call(&lua::GRAB, keys, ask.user, ask.result_ttl_s, ask.token)
            .invoke_async(conn)
            .await?;
    let (body, replayed) = match ScriptReply::read(&status, text, 0, "request_id", ask.request_id)?
    {
        ScriptReply::Awarded(body) => (body, false),
        ScriptReply::Replayed(body) => (body, true),
        ScriptReply::Refused(refusal) => return Ok(Step::Refused(refusal)),
        other => {
            return Err(HandleError::internal(format!(
                "unexpected grab answer {other:?}"
            )))
        }
    };
    // "<share>:<amount>:<asset>"
    let mut parts = body.splitn(3, ':');
    let parsed = (|| {
        let share: u32 = parts.next()?.parse().ok()?;
        let amount: i64 = parts.next()?.parse().ok()?;
        let asset = parts.next().filter(|a| !a.is_empty())?;
        Some((share, amount, asset.to_owned()))
    })();
    let (share, amount, asset) =
        parsed.ok_or_else(|| HandleError::internal(format!("malformed grab answer {body:?}")))?;
    let entry = SettleRequest::fleet(
        format!(
            "{}:{}:grab:{}",
            super::reasons::ENTRY_IDS,
            ask.pool,
            ask.user
        ),
        ask.user,
        asset.as_str(),
        amount,
        "red_packet",
        EntryRef {
            share: Some(share),
            ..EntryRef::prize(ask.pool, ask.request_id)
        },
    );
    Ok(Step::Awarded(Box::new(Award {
        result: DrawResult {
            request_id: ask.request_id.to_owned(),
            status: Status::Ok,
            pool: Some(ask.pool.to_owned()),
            user_id: Some(ask.user),
            prizes: vec![Prize::Share { share, amount }],
            reward: Some(amount),
            asset: Some(asset),
            ..DrawResult::default()
        },
        entry: Some(entry),
        refill: None,
        replayed,
        prizes_drawn: u64::from(!replayed),
    })))
}
