//! How a lucky-gift award is stored with its request's answer, and read
//! back: the packed forms `lua/lib/award.lua` writes, and the text reply of
//! the draw scripts.

use redis::aio::ConnectionLike;

use crate::{
    amqp::HandleError,
    kinds::answer::Tokens,
    messages::{BatchPosition, PrizeRun, Reveal},
    scripts::{PoolKeys, Scripts},
};

/// An award as stored in Redis:
/// `"<serial>|<version>|<unit_price>|<trigger>|<codes>[/<runs>/<parked>/<reveals>]|<asset>"`
/// (answers stored before batches were committed lack the fairness record).
/// `<runs>` are `g.p.n` items, or `g.p.n.h` with `h` positions held back;
/// `<parked>` is `g.p` items, one per jackpot held back, or `m<min>` for a
/// draw whose runs cover every position it read (`lua/lib/jackpot.lua`).
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
    /// The jackpot rule's minimum multiplier, for a draw whose runs cover
    /// every position it read, held back or not.
    pub held_back_min_multiplier: Option<u64>,
    /// Batch seeds this draw revealed.
    pub revealed: Vec<Reveal>,
}

impl Drawn {
    pub(super) fn parse(body: &str) -> Result<Self, HandleError> {
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
            let (s, held_back) = match s.matches('.').count() {
                3 => {
                    let (run, held) = s.rsplit_once('.')?;
                    (run, held.parse().ok().filter(|h| *h > 0)?)
                }
                _ => (s, 0),
            };
            let [generation, position, count] = numbers(s)?;
            (held_back <= count).then_some(PrizeRun {
                generation,
                position,
                count,
                held_back,
            })
        })
        .ok_or_else(bad)?;
        let parked = record.next().unwrap_or_default();
        let (held_back, held_back_min_multiplier) = match parked.strip_prefix('m') {
            Some(min) => (Vec::new(), Some(min.parse::<u64>().map_err(|_| bad())?)),
            None => {
                let held_back = list(parked, |s| {
                    let [generation, position] = numbers(s)?;
                    Some(BatchPosition {
                        generation,
                        position,
                    })
                })
                .ok_or_else(bad)?;
                (held_back, None)
            }
        };
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
        // The runs cover the prizes, and the positions held back besides
        // (which only a draw that names the rule may hold).
        let covered: u64 = positions.iter().map(|r| r.count - r.held_back).sum();
        let held: u64 = positions.iter().map(|r| r.held_back).sum();
        if record.next().is_some()
            || (!positions.is_empty() && covered != codes.len() as u64)
            || (held > 0) != held_back_min_multiplier.is_some()
        {
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
            held_back_min_multiplier,
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
    }

    #[test]
    fn packed_awards_read_their_varints_and_runs() {
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
    }

    #[test]
    fn the_fairness_record_of_a_stored_answer_parses() {
        let seed = "ab".repeat(32);
        let d = Drawn::parse(&format!(
            "5|2|10|-1|7,8,9/3.10.2,0.0.1/3.12/2.1.{seed}|coin"
        ))
        .unwrap();
        assert_eq!(d.codes, vec![7, 8, 9]);
        assert_eq!(
            d.positions,
            vec![PrizeRun::new(3, 10, 2), PrizeRun::new(0, 0, 1)]
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
    }

    /// A draw that held jackpots back names the rule: its runs cover every
    /// position it read, each with how many it held back.
    #[test]
    fn a_record_naming_the_rule_parses() {
        let d = Drawn::parse("5|2|10|-1|7,8,9/3.1.1,4.10.9000.8998/m5000|coin").unwrap();
        assert_eq!(d.codes, vec![7, 8, 9]);
        assert_eq!(
            d.positions,
            vec![
                PrizeRun::new(3, 1, 1),
                PrizeRun {
                    held_back: 8998,
                    ..PrizeRun::new(4, 10, 9000)
                }
            ]
        );
        assert!(d.held_back.is_empty());
        assert_eq!(d.held_back_min_multiplier, Some(5000));
        for bad in [
            // held back without the rule, the rule without any held back
            "5|2|10|-1|7/4.10.3.2/|coin",
            "5|2|10|-1|7,8,9/4.10.3/m5000|coin",
            // more held back than the run holds, a zero or junk count
            "5|2|10|-1|7/4.10.1.2/m5000|coin",
            "5|2|10|-1|7/4.10.1.0/m5000|coin",
            "5|2|10|-1|7/4.10.2.x/m5000|coin",
            "5|2|10|-1|7/4.10.3.1.1/m5000|coin",
            // runs that do not cover the prizes besides those held back
            "5|2|10|-1|7,8/4.10.3.2/m5000|coin",
            "5|2|10|-1|7/4.10.3.2/mx|coin",
        ] {
            assert!(
                matches!(Drawn::parse(bad), Err(HandleError::Internal(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn malformed_stored_answers_are_internal_errors() {
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
