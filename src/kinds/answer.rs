//! The Rust side of `lua/lib/answer.lua`: request fingerprints, id claims,
//! stored answers and the replies every answering script gives.
//!
//! A request's answer is stored under its result key as
//! `"<fingerprint>;<body>"`, where the body is the kind's award or
//! `"!<code>[:<detail>]"` for a refusal. The fingerprint binds the id to the
//! content it first asked for (Stripe's rule): the same id with other
//! content is refused and moves nothing.
//!
//! Result keys live in the pool's slot (the answer is written in the same
//! atomic step as the draw), so they alone cannot see an id reused on
//! another pool. The claim does: one key per id, outside any pool, set to the
//! fingerprint before the pool step. A claim that is set but whose pool step
//! never ran (the worker died in between) is harmless: the redelivery finds
//! the same fingerprint and runs the step.

use std::fmt::Display;

use redis::aio::ConnectionLike;
use sha2::{Digest, Sha256};

use crate::{
    amqp::HandleError,
    messages::{ErrorCode, Invalid, Prize},
};

/// A short, stable fingerprint of a request's content: the first 8 bytes of
/// SHA-256 over the kind and the fields, in hex. Stable across versions and
/// machines (a rolling deploy must not see a reuse where there is none).
pub fn fingerprint(kind: &str, fields: &[&dyn Display]) -> String {
    let mut hash = Sha256::new();
    hash.update(kind.as_bytes());
    for field in fields {
        // Ids never contain a newline (see `messages::check_id`).
        hash.update(b"\n");
        hash.update(field.to_string().as_bytes());
    }
    hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The ledger entry id of draw `serial` of `pool` asked by `request_id`,
/// in namespace `scheme` (`draw`, `lottery`): `<scheme>:<pool>:<request_id>:<serial>`.
///
/// The id has the scope of the answer it pays for. The pool is in it because
/// a request id is bound to one pool only while its answer is kept: sent
/// again later on another pool, it is a new draw there, paid under an id of
/// its own even when both pools' serials agree. The serial (the pool's draw
/// counter, stored with the answer) tells a replay (same id, paid once) from
/// a new draw of the same request id after its answer expired. Pool ids
/// have no `:` (see [`crate::messages::check_name`]), so the pool ends at
/// the first `:` and no two draws share an id.
pub fn entry_id(scheme: &str, pool: &str, request_id: &str, serial: impl Display) -> String {
    format!("{scheme}:{pool}:{request_id}:{serial}")
}

/// The claim key of id `id` in namespace `space` (`rq` for request ids,
/// `gr` for grant ids): its own hash tag, so claims spread over the cluster.
pub fn claim_key(prefix: &str, space: &str, id: &str) -> String {
    format!("{prefix}:{space}:{{{id}}}")
}

/// What claiming an id found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The id is new, or was claimed before for the same content.
    Ours,
    /// The id was first used for other content.
    Reused,
}

/// Binds `key` (a [`claim_key`]) to `fingerprint` for `ttl_s` seconds, unless
/// it is bound already; says whether the id may go on.
pub async fn claim<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    fingerprint: &str,
    ttl_s: u64,
) -> Result<Claim, HandleError> {
    let previous: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(fingerprint)
        .arg("NX")
        .arg("GET")
        .arg("EX")
        .arg(ttl_s)
        .query_async(conn)
        .await?;
    Ok(match previous {
        Some(p) if p != fingerprint => Claim::Reused,
        _ => Claim::Ours,
    })
}

/// Frees the claim `key` if it still binds `fingerprint`: for a request
/// refused as invalid before anything was stored (Stripe's rule: a request
/// that failed validation binds nothing). A claim bound since to other
/// content is left alone.
pub async fn release<C: ConnectionLike + Send>(
    conn: &mut C,
    key: &str,
    fingerprint: &str,
) -> Result<(), HandleError> {
    static RELEASE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
        redis::Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
        )
    });
    let _: i64 = RELEASE.key(key).arg(fingerprint).invoke_async(conn).await?;
    Ok(())
}

/// The refusal of a request whose id was first used for other content.
pub fn reused(field: &str, id: &str) -> HandleError {
    Invalid::new(format!(
        "`{field}` {id:?} was first used for another request (another pool, user, count or amount); an id names one request"
    ))
    .into()
}

/// Stores `refusal` as the answer of the request behind `result_key`, unless
/// it has an answer already. Returns `None` when the refusal was stored, or
/// the stored answer's reply (see [`ScriptReply::read_stored`]).
pub async fn remember<C: ConnectionLike + Send>(
    conn: &mut C,
    result_key: &str,
    fingerprint: &str,
    refusal: &Refusal,
    ttl_s: u64,
) -> Result<Option<ScriptReply>, HandleError> {
    let previous: Option<String> = redis::cmd("SET")
        .arg(result_key)
        .arg(format!("{fingerprint};{}", refusal.body()))
        .arg("NX")
        .arg("GET")
        .arg("EX")
        .arg(ttl_s)
        .query_async(conn)
        .await?;
    previous
        .map(|stored| ScriptReply::read_stored(&stored, fingerprint))
        .transpose()
}

/// A final refusal: a code of the wire contract and, for `already_grabbed`,
/// the share the user holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub code: ErrorCode,
    pub previous: Option<Prize>,
}

impl Refusal {
    /// A refusal with `code` and nothing held.
    pub fn new(code: ErrorCode) -> Self {
        Self {
            code,
            previous: None,
        }
    }

    /// Reads `"<code>[:<detail>]"` as the scripts write it.
    pub fn parse(text: &str) -> Result<Self, HandleError> {
        let (code, detail) = match text.split_once(':') {
            Some((code, detail)) => (code, Some(detail)),
            None => (text, None),
        };
        let code = ErrorCode::parse(code)
            .ok_or_else(|| HandleError::internal(format!("unknown refusal {text:?} in Redis")))?;
        let previous = match (code, detail) {
            (ErrorCode::AlreadyGrabbed, Some(detail)) => {
                let (share, amount) = detail
                    .split_once(':')
                    .and_then(|(s, a)| Some((s.parse().ok()?, a.parse().ok()?)))
                    .ok_or_else(|| {
                        HandleError::internal(format!("malformed share {detail:?} in Redis"))
                    })?;
                Some(Prize::Share { share, amount })
            }
            _ => None,
        };
        Ok(Self { code, previous })
    }

    /// The stored body: `"!<code>[:<detail>]"`.
    pub fn body(&self) -> String {
        match &self.previous {
            Some(Prize::Share { share, amount }) => format!("!{}:{share}:{amount}", self.code),
            _ => format!("!{}", self.code),
        }
    }
}

/// What an answering script replied, before the kind reads its award body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScriptReply {
    /// An award made now; its body.
    Awarded(String),
    /// The request's first answer was an award; its body.
    Replayed(String),
    /// A refusal, made now or before.
    Refused(Refusal),
    /// Fewer prizes than asked; nothing changed.
    Short { in_pool: u64, generation: u64 },
    /// `count` is above the pool's `max_count`; nothing changed.
    TooMany { max_count: u64 },
    /// The script could not decide with the random values it was given;
    /// nothing changed, call again.
    Retry,
}

impl ScriptReply {
    /// Reads a `{status, text, number}` reply. `field` and `id` name the
    /// request id for the refusal of a reused id. A status nobody expects is
    /// an internal error, never a business answer.
    pub fn read(
        status: &str,
        text: String,
        number: u64,
        field: &str,
        id: &str,
    ) -> Result<Self, HandleError> {
        Ok(match status {
            "ok" => Self::Awarded(text),
            "dup" => match text.strip_prefix('!') {
                Some(refusal) => Self::Refused(Refusal::parse(refusal)?),
                None => Self::Replayed(text),
            },
            "refused" => Self::Refused(Refusal::parse(&text)?),
            "reused" => return Err(reused(field, id)),
            "short" => Self::Short {
                in_pool: text.parse().map_err(|_| {
                    HandleError::internal(format!("malformed short reply {text:?}"))
                })?,
                generation: number,
            },
            "too_many" => Self::TooMany {
                max_count: text.parse().map_err(|_| {
                    HandleError::internal(format!("malformed too_many reply {text:?}"))
                })?,
            },
            "retry" => Self::Retry,
            other => {
                return Err(HandleError::internal(format!(
                    "unexpected script status {other:?} ({text:?})"
                )))
            }
        })
    }

    /// Reads a stored `"<fingerprint>;<body>"` answer as its replay.
    pub fn read_stored(stored: &str, fingerprint: &str) -> Result<Self, HandleError> {
        match stored.split_once(';') {
            Some((fp, body)) if fp == fingerprint => {
                Self::read("dup", body.to_owned(), 0, "request_id", "")
            }
            _ => Err(Invalid::new(
                "`request_id` was first used for another request (another pool, user or count)",
            )
            .into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_differ_by_every_field_and_are_stable() {
        let base = fingerprint("draw", &[&"gift-1", &42, &10]);
        assert_eq!(base.len(), 16);
        assert_eq!(base, fingerprint("draw", &[&"gift-1", &42, &10]));
        for other in [
            fingerprint("draw", &[&"gift-2", &42, &10]),
            fingerprint("draw", &[&"gift-1", &43, &10]),
            fingerprint("draw", &[&"gift-1", &42, &11]),
            fingerprint("grant", &[&"gift-1", &42, &10]),
            // Field boundaries count: ("ab", 1) is not ("a", "b1").
            fingerprint("draw", &[&"gift-14", &2, &10]),
        ] {
            assert_ne!(base, other);
        }
        // Pinned: a change of the scheme would refuse every replay across a deploy.
        assert_eq!(fingerprint("draw", &[&"p", &1, &1]), {
            let digest = Sha256::digest(b"draw\np\n1\n1");
            digest[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        });
    }

    #[test]
    fn refusals_round_trip_and_unknown_codes_are_internal() {
        for text in ["sold_out", "already_grabbed:3:731", "pool_exhausted"] {
            let refusal = Refusal::parse(text).unwrap();
            assert_eq!(refusal.body(), format!("!{text}"));
        }
        assert!(matches!(
            Refusal::parse("no_such_code"),
            Err(HandleError::Internal(_))
        ));
        assert!(matches!(
            Refusal::parse("already_grabbed:x"),
            Err(HandleError::Internal(_))
        ));
    }

    #[test]
    fn script_replies_are_read_strictly() {
        assert_eq!(
            ScriptReply::read("dup", "!sold_out".into(), 0, "request_id", "r").unwrap(),
            ScriptReply::Refused(Refusal::new(ErrorCode::SoldOut))
        );
        assert!(matches!(
            ScriptReply::read("reused", String::new(), 0, "request_id", "r"),
            Err(HandleError::Invalid(_))
        ));
        assert!(matches!(
            ScriptReply::read("weird", String::new(), 0, "request_id", "r"),
            Err(HandleError::Internal(_))
        ));
        assert!(matches!(
            ScriptReply::read("short", "x".into(), 0, "request_id", "r"),
            Err(HandleError::Internal(_))
        ));
        assert!(matches!(
            ScriptReply::read_stored("other;!sold_out", "mine"),
            Err(HandleError::Invalid(_))
        ));
    }
}
