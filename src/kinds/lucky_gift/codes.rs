//! Compact prize codes and batch building.
//!
//! A prize is stored in Redis as a small integer: its index in the pool's
//! code table of (combo, multiplier) pairs. Redis keeps integers below 128 in
//! one byte of a listpack entry plus one byte of back-length, so a list-mode
//! prize costs two bytes. The table only ever grows: a new config version
//! appends the pairs it introduces, so prizes stocked under an older version
//! still decode to what they were.

use std::collections::HashMap;

use rand::{seq::SliceRandom, Rng};
use serde::{Deserialize, Serialize};

use super::config::PoolConfig;

/// The (combo, multiplier) pair each code stands for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CodeTable {
    entries: Vec<(String, u64)>,
}

impl CodeTable {
    /// The table for `config`, extending `previous` (the table of the pool's
    /// last version) with the pairs it lacks.
    pub fn extend(previous: Option<&CodeTable>, config: &PoolConfig) -> Self {
        let mut table = previous.cloned().unwrap_or_default();
        let mut known: HashMap<(String, u64), u32> = table.index();
        for combo in &config.combos {
            for &(multiplier, _) in &combo.stock {
                let key = (combo.id.clone(), multiplier);
                if !known.contains_key(&key) {
                    known.insert(key.clone(), table.entries.len() as u32);
                    table.entries.push(key);
                }
            }
        }
        table
    }

    fn index(&self) -> HashMap<(String, u64), u32> {
        self.entries
            .iter()
            .enumerate()
            .map(|(code, pair)| (pair.clone(), code as u32))
            .collect()
    }

    /// The (combo, multiplier) of `code`, if the table has it.
    pub fn decode(&self, code: u32) -> Option<(&str, u64)> {
        self.entries
            .get(code as usize)
            .map(|(combo, m)| (combo.as_str(), *m))
    }

    /// The code of (combo, multiplier), if the table has it.
    pub fn code_of(&self, combo: &str, multiplier: u64) -> Option<u32> {
        self.entries
            .iter()
            .position(|(c, m)| c == combo && *m == multiplier)
            .map(|i| i as u32)
    }

    /// Every (combo, multiplier) pair of the table, in code order: the
    /// prizes of every version the pool was loaded with.
    pub fn pairs(&self) -> impl Iterator<Item = (&str, u64)> {
        self.entries.iter().map(|(c, m)| (c.as_str(), *m))
    }

    /// Number of codes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Codes whose multiplier the jackpot rule of `config` gates.
    pub fn jackpot_codes(&self, config: &PoolConfig) -> Vec<u32> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, (_, m))| config.is_jackpot(*m))
            .map(|(code, _)| code as u32)
            .collect()
    }
}

/// One batch: every combo once, combos in random order, prizes shuffled
/// within each combo, as codes in draw order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Codes in the order draws will take them.
    pub codes: Vec<u32>,
    /// Index of the prize that carries the refill flag.
    pub flag_at: usize,
    /// (combo id, first index, length) in draw order.
    pub combos: Vec<(String, usize, usize)>,
}

impl Batch {
    /// Builds a batch of `config` with codes from `table`.
    ///
    /// # Panics
    /// Never for a table built by [`CodeTable::extend`] from this config.
    pub fn build(config: &PoolConfig, table: &CodeTable, rng: &mut impl Rng) -> Self {
        let index = table.index();
        let mut order: Vec<usize> = (0..config.combos.len()).collect();
        order.shuffle(rng);
        let size = config.batch_size() as usize;
        let mut codes = Vec::with_capacity(size);
        let mut combos = Vec::with_capacity(order.len());
        for i in order {
            let combo = &config.combos[i];
            let start = codes.len();
            for &(multiplier, count) in &combo.stock {
                // The table was extended from this very config, so the pair is present.
                let code = index
                    .get(&(combo.id.clone(), multiplier))
                    .copied()
                    .unwrap_or(u32::MAX);
                codes.extend(std::iter::repeat_n(code, count as usize));
            }
            codes[start..].shuffle(rng);
            combos.push((combo.id.clone(), start, codes.len() - start));
        }
        let flag_at = flag_index(size, config.refill_at);
        Self {
            codes,
            flag_at,
            combos,
        }
    }

    /// Builds the committed batch of `config` (`docs/fairness.md`, "A
    /// lucky-gift batch"): combos shuffled by `stream`, then each combo's
    /// prizes (its (multiplier, count) pairs in configuration order, each
    /// as `count` copies) shuffled by the same stream, in the shuffled
    /// combo order. The same as [`crate::fairness::lucky_gift_batch`] on the
    /// config's composition, written on codes so 3 million prizes take one
    /// allocation.
    pub fn build_fair(
        config: &PoolConfig,
        table: &CodeTable,
        stream: &mut crate::fairness::Stream,
    ) -> Self {
        let index = table.index();
        let mut order: Vec<usize> = (0..config.combos.len()).collect();
        stream.shuffle(&mut order);
        let size = config.batch_size() as usize;
        let mut codes = Vec::with_capacity(size);
        let mut combos = Vec::with_capacity(order.len());
        for i in order {
            let combo = &config.combos[i];
            let start = codes.len();
            for &(multiplier, count) in &combo.stock {
                // The table was extended from this very config, so the pair is present.
                let code = index
                    .get(&(combo.id.clone(), multiplier))
                    .copied()
                    .unwrap_or(u32::MAX);
                codes.extend(std::iter::repeat_n(code, count as usize));
            }
            stream.shuffle(&mut codes[start..]);
            combos.push((combo.id.clone(), start, codes.len() - start));
        }
        let flag_at = flag_index(size, config.refill_at);
        Self {
            codes,
            flag_at,
            combos,
        }
    }

    /// The batch as Redis list elements; the flagged prize reads
    /// `"<code>f<batch number>"`.
    pub fn elements(&self, batch_number: u64) -> impl Iterator<Item = String> + '_ {
        self.codes.iter().enumerate().map(move |(i, code)| {
            if i == self.flag_at {
                format!("{code}f{batch_number}")
            } else {
                code.to_string()
            }
        })
    }
}

/// Index of the prize at the `refill_at` share of a batch of `size`
/// (`refill_at = 1` flags the last prize).
pub fn flag_index(size: usize, refill_at: f64) -> usize {
    let at = (size as f64 * refill_at).ceil() as usize;
    at.clamp(1, size.max(1)) - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::lucky_gift::config::parse_file;
    use proptest::prelude::*;

    fn config(stocks: &[(&str, &[(u64, i64)])]) -> PoolConfig {
        let mut text =
            String::from("[[pools]]\nid = \"p\"\nkind = \"lucky_gift\"\nunit_price = 10\n");
        for (id, stock) in stocks {
            let items: Vec<String> = stock
                .iter()
                .map(|(m, n)| format!("\"{m}\" = {n}"))
                .collect();
            text.push_str(&format!(
                "[[pools.combos]]\nid = \"{id}\"\nstock = {{ {} }}\n",
                items.join(", ")
            ));
        }
        parse_file(&text).unwrap().remove(0)
    }

    #[test]
    fn table_only_grows() {
        let v1 = config(&[("c1", &[(0, 5), (10, 1)])]);
        let v2 = config(&[("c1", &[(0, 5), (20, 1)]), ("c2", &[(10, 1)])]);
        let t1 = CodeTable::extend(None, &v1);
        let t2 = CodeTable::extend(Some(&t1), &v2);
        assert_eq!(t2.decode(0), Some(("c1", 0)));
        assert_eq!(t2.decode(1), Some(("c1", 10)));
        assert_eq!(t2.len(), 4);
    }

    proptest! {
        #[test]
        fn batch_holds_each_combo_once_contiguously(
            stocks in proptest::collection::vec(
                proptest::collection::btree_map(0u64..100, 1i64..50, 1..5), 1..6),
            refill_at in 0.01f64..=1.0,
            seed in any::<u64>(),
        ) {
            let named: Vec<(String, Vec<(u64, i64)>)> = stocks
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("c{i}"), s.iter().map(|(m, n)| (*m, *n)).collect()))
                .collect();
            let refs: Vec<(&str, &[(u64, i64)])> =
                named.iter().map(|(id, s)| (id.as_str(), s.as_slice())).collect();
            let mut cfg = config(&refs);
            cfg.refill_at = refill_at;
            let table = CodeTable::extend(None, &cfg);
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let batch = Batch::build(&cfg, &table, &mut rng);
            prop_assert_eq!(batch.codes.len() as u64, cfg.batch_size());
            prop_assert!(batch.flag_at < batch.codes.len());
            // Each combo appears once, as one contiguous run with exactly its stock.
            prop_assert_eq!(batch.combos.len(), cfg.combos.len());
            for (id, start, len) in &batch.combos {
                let combo = cfg.combos.iter().find(|c| &c.id == id).unwrap();
                let mut counts = std::collections::BTreeMap::new();
                for code in &batch.codes[*start..start + len] {
                    let (c, m) = table.decode(*code).unwrap();
                    prop_assert_eq!(c, id.as_str());
                    *counts.entry(m).or_insert(0u64) += 1;
                }
                let expected: std::collections::BTreeMap<u64, u64> = combo.stock.iter().copied().collect();
                prop_assert_eq!(counts, expected);
            }
        }
    }

    /// The stocked order is the reference derivation of `docs/fairness.md`
    /// applied to the config's composition, prize for prize.
    #[test]
    fn fair_batches_follow_the_reference_derivation() {
        let cfg = config(&[
            ("a", &[(0, 40), (10, 7), (500, 1)]),
            ("b", &[(0, 3)]),
            ("c", &[(5, 20), (50, 2)]),
        ]);
        let table = CodeTable::extend(None, &cfg);
        for n in 0..8u8 {
            let seed = crate::fairness::Seed([n; 32]);
            let context = crate::fairness::lucky_gift_context("p", u64::from(n) + 1, 3);
            let batch = Batch::build_fair(&cfg, &table, &mut seed.stream(&context));
            let composition: Vec<Vec<(u64, u64)>> =
                cfg.combos.iter().map(|c| c.stock.clone()).collect();
            let reference =
                crate::fairness::lucky_gift_batch(&mut seed.stream(&context), &composition);
            let expected: Vec<(&str, u64)> = reference
                .iter()
                .flat_map(|(c, prizes)| prizes.iter().map(|m| (cfg.combos[*c].id.as_str(), *m)))
                .collect();
            let ours: Vec<(&str, u64)> = batch
                .codes
                .iter()
                .map(|code| table.decode(*code).unwrap())
                .collect();
            assert_eq!(ours, expected, "seed {n}");
        }
    }

    #[test]
    fn flag_sits_at_the_refill_point() {
        assert_eq!(flag_index(10, 0.5), 4);
        assert_eq!(flag_index(10, 1.0), 9);
        assert_eq!(flag_index(10, 0.01), 0);
        assert_eq!(flag_index(1, 0.5), 0);
    }
}
