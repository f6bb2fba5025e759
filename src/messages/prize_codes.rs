//! The compact form of a big lucky-gift draw (`docs/protocol.md`, "Big
//! draws"), and the run syntax it shares with the answers kept in Redis.
//!
//! A draw of up to [`PRIZE_LIST_MAX`] prizes is answered with the plain
//! `prizes` list, one object per prize. A bigger one is answered with
//! `prize_codes` instead:
//!
//! ```json
//! "prize_codes":{"count":250,
//!   "table":[{"multiplier":0,"combo":"c1"},{"multiplier":10,"combo":"c1"},{"multiplier":0,"combo":"c2"}],
//!   "codes":"0*57,1,0*12,2*179,1"}
//! ```
//!
//! `table` holds each distinct prize of the draw once, in the order of its
//! first appearance; `codes` lists the prizes in draw order as indices into
//! `table`, comma-separated, a run of `n ≥ 2` equal indices written
//! `<index>*<n>`. The list is the expansion: 57 × table[0], table[1], …
//!
//! Why it fits: the text of a prize is its index and a comma, so a draw
//! costs at most `count × (digits(table length − 1) + 1)` bytes of codes
//! plus its table, whatever the combo ids; runs only shorten it (a combo is
//! drawn to its end before the next begins, and most prizes of a pool are
//! alike, so real draws are mostly runs). [`max_len`] is that bound; the
//! pool loader refuses a pool whose largest draw could exceed the message
//! limit by it, and the tests check it against encodings of every shape.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{Prize, MAX_DRAW_COUNT};

/// Draws of up to this many prizes are answered with the per-prize
/// `prizes` list; bigger ones with [`PrizeCodes`]. A hundred prizes of the
/// longest combo ids (128 bytes, every byte escaped) and multipliers take
/// under 30 KB, so the list always fits.
pub const PRIZE_LIST_MAX: usize = 100;

/// One distinct prize of a compact draw: the same object as a `prizes`
/// item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct TablePrize {
    pub multiplier: u64,
    pub combo: String,
}

/// `prize_codes`: the prizes of a big lucky-gift draw (see the module).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PrizeCodes {
    /// How many prizes `codes` expands to.
    pub count: u64,
    /// The distinct prizes, in order of first appearance.
    pub table: Vec<TablePrize>,
    /// Indices into `table` in draw order, runs as `<index>*<n>`.
    pub codes: String,
}

/// Why a `prize_codes` does not expand.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed prize_codes: {0}")]
pub struct Malformed(pub String);

impl PrizeCodes {
    /// The compact form of `prizes` ((combo, multiplier) in draw order).
    pub fn encode<'a>(prizes: impl IntoIterator<Item = (&'a str, u64)>) -> Self {
        let mut builder = Builder::default();
        for (combo, multiplier) in prizes {
            builder.push((combo, multiplier), combo, multiplier);
        }
        builder.finish()
    }

    /// The prizes in draw order. Refuses a form whose codes name no table
    /// entry, whose count is not what the codes expand to, or which expands
    /// past [`MAX_DRAW_COUNT`] prizes (checked before anything is built).
    pub fn expand(&self) -> Result<Vec<Prize>, Malformed> {
        let limit = MAX_DRAW_COUNT as usize;
        if self.count > limit as u64 {
            return Err(Malformed(format!(
                "a count of {} is above the {limit} prizes a draw may hold",
                self.count
            )));
        }
        let codes = parse_runs(&self.codes, limit)
            .ok_or_else(|| Malformed(format!("codes {:?} do not read", self.codes)))?;
        if codes.len() as u64 != self.count {
            return Err(Malformed(format!(
                "codes expand to {} prizes, count says {}",
                codes.len(),
                self.count
            )));
        }
        codes
            .into_iter()
            .map(|code| {
                self.table
                    .get(code as usize)
                    .map(|p| Prize::Multiplier {
                        multiplier: p.multiplier,
                        combo: p.combo.clone(),
                    })
                    .ok_or_else(|| {
                        Malformed(format!(
                            "code {code} is past the table's {} entries",
                            self.table.len()
                        ))
                    })
            })
            .collect()
    }
}

/// Builds a [`PrizeCodes`] prize by prize. Prizes are told apart by a key
/// of the caller's (a pool's own prize code, or the pair itself), so the
/// table is built without comparing combo ids prize by prize.
#[derive(Debug)]
pub struct Builder<K> {
    index: HashMap<K, u32>,
    table: Vec<TablePrize>,
    codes: String,
    count: u64,
    /// The run being written: (index, length).
    run: Option<(u32, u64)>,
}

impl<K> Default for Builder<K> {
    fn default() -> Self {
        Self {
            index: HashMap::new(),
            table: Vec::new(),
            codes: String::new(),
            count: 0,
            run: None,
        }
    }
}

impl<K: std::hash::Hash + Eq> Builder<K> {
    /// Adds the next prize, known by `key`, of `combo` and `multiplier`.
    pub fn push(&mut self, key: K, combo: &str, multiplier: u64) {
        let next = self.table.len() as u32;
        let index = *self.index.entry(key).or_insert(next);
        if index == next {
            self.table.push(TablePrize {
                multiplier,
                combo: combo.to_owned(),
            });
        }
        self.count += 1;
        match &mut self.run {
            Some((i, n)) if *i == index => *n += 1,
            _ => {
                self.flush();
                self.run = Some((index, 1));
            }
        }
    }

    fn flush(&mut self) {
        use std::fmt::Write;
        if let Some((index, n)) = self.run.take() {
            if !self.codes.is_empty() {
                self.codes.push(',');
            }
            // Writing to a String cannot fail.
            let _ = if n >= 2 {
                write!(self.codes, "{index}*{n}")
            } else {
                write!(self.codes, "{index}")
            };
        }
    }

    /// The compact form of the prizes pushed.
    pub fn finish(mut self) -> PrizeCodes {
        self.flush();
        PrizeCodes {
            count: self.count,
            table: self.table,
            codes: self.codes,
        }
    }
}

/// The codes of a comma-separated run list: each item `<code>` or
/// `<code>*<n>` (`n ≥ 2` equal codes in a row; a single code is written
/// plain, so each list has one spelling). Empty items are skipped (an empty text is no
/// code). `None` if an item does not read or the codes would number more
/// than `max_total` (checked before they are expanded, so a forged run
/// cannot make a reader allocate more).
pub fn parse_runs(text: &str, max_total: usize) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for item in text.split(',').filter(|s| !s.is_empty()) {
        let (code, n) = match item.split_once('*') {
            None => (item, 1),
            Some((code, n)) => (code, strict_number(n).filter(|n| *n >= 2)?),
        };
        let code: u32 = strict_number(code)?.try_into().ok()?;
        if n > (max_total - out.len()) as u64 {
            return None;
        }
        out.extend(std::iter::repeat_n(code, n as usize));
    }
    Some(out)
}

/// A decimal number of digits only (no sign, no blank), below 2^53.
fn strict_number(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 16 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok().filter(|n| *n < 1u64 << 53)
}

/// Bytes a `prizes` item (or a `table` entry) of `combo` and `multiplier`
/// takes in JSON, without the comma that separates it from the next.
pub fn prize_json_len(combo: &str, multiplier: u64) -> usize {
    // A &str always serialises.
    let combo = serde_json::to_string(combo).map_or(combo.len() + 2, |s| s.len());
    r#"{"multiplier":,"combo":}"#.len() + digits(multiplier) + combo
}

/// Decimal digits of `n`.
pub fn digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// The most bytes `,"prize_codes":{…}` can take for a draw of `count`
/// prizes whose distinct prizes are among those whose JSON lengths
/// ([`prize_json_len`]) are `entries`: the table of the longest entries
/// that can appear (at most `count` of them), and for every prize an index
/// of the widest width that table needs, with its comma (runs only make
/// the codes shorter).
pub fn max_len(count: usize, entries: &[usize]) -> usize {
    let mut longest = entries.to_vec();
    longest.sort_unstable_by(|a, b| b.cmp(a));
    longest.truncate(count.max(1));
    let table: usize = longest.iter().map(|len| len + 1).sum();
    let widest = digits(longest.len().saturating_sub(1) as u64);
    let codes = count * (widest + 1);
    r#","prize_codes":{"count":,"table":[],"codes":""}"#.len()
        + digits(count as u64)
        + table
        + codes
}

/// The most bytes `,"prizes":[…]` can take for `count` prizes whose JSON
/// lengths are at most `longest`.
pub fn max_list_len(count: usize, longest: usize) -> usize {
    r#","prizes":[]"#.len() + count * (longest + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::MAX_MESSAGE_BYTES;
    use proptest::prelude::*;

    fn pairs(prizes: &[Prize]) -> Vec<(String, u64)> {
        prizes
            .iter()
            .map(|p| match p {
                Prize::Multiplier { multiplier, combo } => (combo.clone(), *multiplier),
                other => panic!("not a multiplier prize: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn the_documented_example_reads() {
        let codes: PrizeCodes = serde_json::from_str(
            r#"{"count":250,
                "table":[{"multiplier":0,"combo":"c1"},{"multiplier":10,"combo":"c1"},{"multiplier":0,"combo":"c2"}],
                "codes":"0*57,1,0*12,2*179,1"}"#,
        )
        .unwrap();
        let prizes = pairs(&codes.expand().unwrap());
        assert_eq!(prizes.len(), 250);
        assert_eq!(prizes[56], ("c1".into(), 0));
        assert_eq!(prizes[57], ("c1".into(), 10));
        assert_eq!(prizes[70], ("c2".into(), 0));
        assert_eq!(prizes[249], ("c1".into(), 10));
        // Encoding the expansion gives the same form back.
        let again = PrizeCodes::encode(prizes.iter().map(|(c, m)| (c.as_str(), *m)));
        assert_eq!(again, codes);
    }

    #[test]
    fn runs_read_strictly_and_are_bounded() {
        assert_eq!(parse_runs("", 10), Some(vec![]));
        assert_eq!(parse_runs("3", 10), Some(vec![3]));
        assert_eq!(parse_runs("3*2,1,0*3", 10), Some(vec![3, 3, 1, 0, 0, 0]));
        assert_eq!(parse_runs("1*10", 10).map(|c| c.len()), Some(10));
        for bad in [
            "5*1",
            "1*11",
            "1*5,2*6",
            "1*0",
            "1*",
            "*3",
            "1**2",
            "1*2*3",
            "a",
            "1*x",
            "-1",
            "+1",
            " 1",
            "1*-2",
            "4294967296",
            "1*99999999999999999999",
        ] {
            assert_eq!(parse_runs(bad, 10), None, "{bad:?}");
        }
        // A forged run of 10^15 prizes is refused before anything is built.
        assert_eq!(parse_runs("0*999999999999999", 10_000), None);
    }

    #[test]
    fn malformed_forms_are_refused() {
        let good = PrizeCodes::encode([("a", 1), ("a", 1), ("b", 2)]);
        assert_eq!(good.codes, "0*2,1");
        assert_eq!(good.expand().unwrap().len(), 3);
        let mut bad = good.clone();
        bad.count = 4;
        assert!(bad.expand().is_err());
        let mut bad = good.clone();
        bad.codes = "0*2,2".into();
        assert!(bad.expand().is_err());
        let mut bad = good.clone();
        bad.count = u64::from(MAX_DRAW_COUNT) + 1;
        bad.codes = format!("0*{}", MAX_DRAW_COUNT + 1);
        assert!(bad.expand().is_err());
    }

    /// The serialised `,"prize_codes":…` of `codes`, as a reply carries it.
    fn wire_len(codes: &PrizeCodes) -> usize {
        r#","prize_codes":"#.len() + serde_json::to_vec(codes).unwrap().len()
    }

    /// A combo id of 64 bytes that needs no escaping, numbered `i`.
    fn combo64(i: usize) -> String {
        format!("{i:0>64}")
    }

    /// The worst case the issue names: 10,000 prizes, combo ids of 64
    /// bytes, the highest multipliers, every prize unlike its neighbour
    /// (no run), as many distinct prizes as the draw can hold under the
    /// pool loader's limit: the compact form stays far below 64 KiB, and
    /// below its bound.
    #[test]
    fn ten_thousand_prizes_with_64_byte_combos_fit() {
        let count = MAX_DRAW_COUNT as usize;
        for distinct in [2usize, 10, 64, 100, 150] {
            let table: Vec<(String, u64)> = (0..distinct)
                .map(|i| (combo64(i), 1_000_000 - i as u64))
                .collect();
            let prizes: Vec<(&str, u64)> = (0..count)
                .map(|k| {
                    let (c, m) = &table[k % distinct];
                    (c.as_str(), *m)
                })
                .collect();
            let codes = PrizeCodes::encode(prizes.iter().copied());
            let entries: Vec<usize> = table.iter().map(|(c, m)| prize_json_len(c, *m)).collect();
            let bound = max_len(count, &entries);
            let len = wire_len(&codes);
            assert!(len <= bound, "{distinct} distinct: {len} > bound {bound}");
            // Room left for the rest of the reply (ids, totals, the
            // fairness record) and the event's seal.
            assert!(
                bound + 8 * 1024 <= MAX_MESSAGE_BYTES,
                "{distinct} distinct: bound {bound}"
            );
            assert_eq!(pairs(&codes.expand().unwrap()).len(), count);
        }
        // Combo ids of 64 bytes that all need escaping double the table,
        // and still fit.
        let quoted: Vec<usize> = (0..100)
            .map(|_| prize_json_len(&"\"".repeat(64), 1_000_000))
            .collect();
        assert!(max_len(count, &quoted) + 8 * 1024 <= MAX_MESSAGE_BYTES);
    }

    #[test]
    fn the_list_form_of_a_hundred_prizes_fits_whatever_the_combo_ids() {
        let longest = prize_json_len(&"\\".repeat(crate::messages::MAX_ID_LEN), 1_000_000);
        assert!(max_list_len(PRIZE_LIST_MAX, longest) + 8 * 1024 <= MAX_MESSAGE_BYTES);
    }

    proptest! {
        /// Any draw round-trips through the compact form, its text stays
        /// within the bound computed from the distinct prizes it may hold,
        /// and it survives JSON.
        #[test]
        fn compact_form_round_trips_within_its_bound(
            kinds in proptest::collection::vec((0usize..200, 0u64..=1_000_000), 1..40),
            picks in proptest::collection::vec((0usize..40, 1usize..300), 1..200),
        ) {
            let combos: Vec<String> = kinds
                .iter()
                .map(|(len, _)| "c".repeat(len % 64 + 1) + &len.to_string())
                .collect();
            let mut prizes: Vec<(&str, u64)> = Vec::new();
            for (pick, run) in &picks {
                let i = pick % kinds.len();
                for _ in 0..*run {
                    if prizes.len() < MAX_DRAW_COUNT as usize {
                        prizes.push((combos[i].as_str(), kinds[i].1));
                    }
                }
            }
            let codes = PrizeCodes::encode(prizes.iter().copied());
            let back = pairs(&codes.expand().unwrap());
            let want: Vec<(String, u64)> = prizes.iter().map(|(c, m)| ((*c).to_owned(), *m)).collect();
            prop_assert_eq!(&back, &want);
            let text = serde_json::to_string(&codes).unwrap();
            let read: PrizeCodes = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(&read, &codes);
            let entries: Vec<usize> = combos
                .iter()
                .zip(&kinds)
                .map(|(c, (_, m))| prize_json_len(c, *m))
                .collect();
            prop_assert!(wire_len(&codes) <= max_len(prizes.len(), &entries));
        }

        /// Without runs the codes are as long as the bound allows: every
        /// prize differs from the one before.
        #[test]
        fn alternating_draws_meet_the_bound(distinct in 2usize..120, count in 101usize..=10_000) {
            let combos: Vec<String> = (0..distinct).map(combo64).collect();
            let prizes: Vec<(&str, u64)> =
                (0..count).map(|k| (combos[k % distinct].as_str(), 7)).collect();
            let codes = PrizeCodes::encode(prizes.iter().copied());
            let entries: Vec<usize> = combos.iter().map(|c| prize_json_len(c, 7)).collect();
            prop_assert!(wire_len(&codes) <= max_len(count, &entries));
            prop_assert_eq!(codes.expand().unwrap().len(), count);
        }

        /// Run lists round-trip: a reader takes what a writer writes.
        #[test]
        fn runs_round_trip(codes in proptest::collection::vec(0u32..5, 0..500)) {
            let mut builder = Builder::default();
            for c in &codes {
                builder.push(*c, "x", u64::from(*c));
            }
            let form = builder.finish();
            let indices = parse_runs(&form.codes, 10_000).unwrap();
            let back: Vec<u32> = indices
                .iter()
                .map(|i| form.table[*i as usize].multiplier as u32)
                .collect();
            prop_assert_eq!(back, codes);
        }
    }
}
