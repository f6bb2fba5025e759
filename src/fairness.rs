//! Provably fair shuffles: the byte-exact derivation a committed batch is
//! shuffled with, so that anyone holding the revealed seed can recreate the
//! order (`docs/fairness.md` is the specification; this module is its
//! reference implementation, and its tests hold the test vectors).
//!
//! 1. A fresh 32-byte **seed** comes from the operating system's CSPRNG.
//! 2. Its **commitment**, `SHA-256(seed)` in lowercase hex, is published
//!    before the batch can be drawn.
//! 3. The batch's **key** is `HMAC-SHA256(seed, context)`, where `context`
//!    names what is shuffled (`"prizepool/lucky_gift/v1\n<pool>\n<generation>\n<version>"`
//!    for a lucky-gift batch), so one seed can never shuffle two batches alike.
//! 4. The key drives the **ChaCha20 keystream** (20 rounds, the key as is,
//!    nonce 0, block counter from 0), read 8 bytes at a time as
//!    little-endian unsigned 64-bit integers.
//! 5. A **uniform index** below `n` takes the next integer `x`, rejects it
//!    while `x >= 2^64 - (2^64 mod n)`, and answers `x mod n`.
//! 6. A **shuffle** of `a[0..n]` is Fisher-Yates from the end: for `i` from
//!    `n-1` down to `1`, `j = uniform(i+1)`, swap `a[i]` and `a[j]`.
//!
//! Every step uses one stream in order: the draws of a batch's shuffles
//! follow each other without gaps or restarts.

use hmac::{Hmac, Mac};
use rand::{rand_core::TryRngCore, RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};

/// A batch seed: 32 secret bytes, revealed once the batch is over.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Seed(pub [u8; 32]);

impl std::fmt::Debug for Seed {
    /// Never prints the secret itself: a seed in a log line before its
    /// reveal would let a reader predict the batch.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Seed(commitment {})", self.commitment())
    }
}

impl Seed {
    /// A fresh seed from the operating system's CSPRNG.
    pub fn fresh() -> Result<Self, rand::rand_core::OsError> {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.try_fill_bytes(&mut bytes)?;
        Ok(Self(bytes))
    }

    /// Parses a seed from 64 hex digits (a revealed seed).
    pub fn from_hex(text: &str) -> Option<Self> {
        let bytes = hex(text)?;
        Some(Self(bytes.try_into().ok()?))
    }

    /// The seed in lowercase hex, for its reveal.
    pub fn to_hex(&self) -> String {
        to_hex(&self.0)
    }

    /// `SHA-256(seed)` in lowercase hex: what is published before the batch
    /// is drawn.
    pub fn commitment(&self) -> String {
        to_hex(&Sha256::digest(self.0))
    }

    /// The keystream for what `context` names (see [`lucky_gift_context`]).
    pub fn stream(&self, context: &str) -> Stream {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        mac.update(context.as_bytes());
        let key: [u8; 32] = mac.finalize().into_bytes().into();
        Stream(ChaCha20Rng::from_seed(key))
    }
}

/// The context of lucky-gift batch `generation` of `pool` stocked under
/// config `version`.
pub fn lucky_gift_context(pool: &str, generation: u64, version: i64) -> String {
    format!("prizepool/lucky_gift/v1\n{pool}\n{generation}\n{version}")
}

/// The context of the draw of request `request_id` of lottery `activity`
/// in the seed period starting at `period` (unix seconds).
pub fn lottery_context(activity: &str, period: u64, request_id: &str) -> String {
    format!("prizepool/lottery/v1\n{activity}\n{period}\n{request_id}")
}

/// How many bits of each keystream word a lottery value keeps: the top 52
/// (Lua numbers are doubles, exact below 2^53).
pub const LOTTERY_VALUE_BITS: u32 = 52;

/// The lottery values `from .. from + n` of a draw (`docs/fairness.md`,
/// "Lotteries"): value `k` is the top 52 bits of keystream word `k` of
/// the draw's context, counting from 0.
pub fn lottery_values(seed: &Seed, context: &str, from: usize, n: usize) -> Vec<u64> {
    let mut stream = seed.stream(context);
    (0..from + n)
        .map(|_| stream.next_u64() >> (64 - LOTTERY_VALUE_BITS))
        .skip(from)
        .collect()
}

/// The pick of a lottery draw from its values and its candidates' weights
/// (in the order the draw walked them): the first value below the largest
/// multiple of the total weight that fits in 2^52 (rejection: no modulo
/// bias), and the index of the candidate where `value mod total` falls.
/// `None` when every weight is zero or every value is rejected.
pub fn lottery_pick(values: &[u64], weights: &[u64]) -> Option<(u64, usize)> {
    let total = weights.iter().try_fold(0u64, |a, w| a.checked_add(*w))?;
    let span = 1u64 << LOTTERY_VALUE_BITS;
    if total == 0 || total > span {
        return None;
    }
    let limit = span - span % total;
    let value = *values.iter().find(|v| **v < limit)?;
    let mut r = value % total;
    for (i, w) in weights.iter().enumerate() {
        if r < *w {
            return Some((value, i));
        }
        r -= w;
    }
    None
}

/// A ChaCha20 keystream read as little-endian `u64`s.
pub struct Stream(ChaCha20Rng);

impl std::fmt::Debug for Stream {
    /// Shows where the stream stands, never its key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(at word {})", self.0.get_word_pos())
    }
}

impl Stream {
    /// The next 8 keystream bytes as a little-endian integer.
    pub fn next_u64(&mut self) -> u64 {
        let mut bytes = [0u8; 8];
        self.0.fill_bytes(&mut bytes);
        u64::from_le_bytes(bytes)
    }

    /// A uniform index below `n` (`n > 0`), by rejection: no bias whatever `n`.
    pub fn uniform(&mut self, n: u64) -> u64 {
        assert!(n > 0, "uniform(0)");
        // 2^64 mod n, computed without 128-bit arithmetic.
        let excess = (u64::MAX % n + 1) % n;
        let zone = u64::MAX - excess; // accept x <= zone: (zone + 1) is a multiple of n
        loop {
            let x = self.next_u64();
            if excess == 0 || x <= zone {
                return x % n;
            }
        }
    }

    /// Fisher-Yates from the end, one [`uniform`](Self::uniform) per step.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.uniform(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// A lucky-gift batch in draw order (`docs/fairness.md`, "A lucky-gift
/// batch"): `combos[c]` lists combo `c`'s prizes as (prize, count) pairs in
/// configuration order; the answer lists (combo index, its prizes
/// shuffled), combos in their shuffled order.
pub fn lucky_gift_batch<T: Clone>(
    stream: &mut Stream,
    combos: &[Vec<(T, u64)>],
) -> Vec<(usize, Vec<T>)> {
    let mut order: Vec<usize> = (0..combos.len()).collect();
    stream.shuffle(&mut order);
    order
        .into_iter()
        .map(|c| {
            let mut prizes: Vec<T> = combos[c]
                .iter()
                .flat_map(|(prize, count)| std::iter::repeat_n(prize.clone(), *count as usize))
                .collect();
            stream.shuffle(&mut prizes);
            (c, prizes)
        })
        .collect()
}

/// One combo of a batch's composition: its id and its (multiplier, count)
/// pairs in configuration order.
#[derive(
    Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
pub struct ComboStock {
    pub combo: String,
    pub stock: Vec<(u64, u64)>,
}

/// The order of lucky-gift batch `generation` of `pool` under config
/// `version` with this composition, as (combo id, multiplier) per position:
/// what a verifier recomputes from a revealed seed.
pub fn lucky_gift_order(
    seed: &Seed,
    pool: &str,
    generation: u64,
    version: i64,
    composition: &[ComboStock],
) -> Vec<(String, u64)> {
    let combos: Vec<Vec<(u64, u64)>> = composition.iter().map(|c| c.stock.clone()).collect();
    let mut stream = seed.stream(&lucky_gift_context(pool, generation, version));
    lucky_gift_batch(&mut stream, &combos)
        .into_iter()
        .flat_map(|(c, prizes)| {
            let id = composition[c].combo.clone();
            prizes.into_iter().map(move |m| (id.clone(), m))
        })
        .collect()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_the_chacha20_keystream() {
        // RFC 7539 appendix A.1, test vector 1: key 0, nonce 0, block 0.
        let mut rng = ChaCha20Rng::from_seed([0; 32]);
        let mut block = [0u8; 32];
        rng.fill_bytes(&mut block);
        assert_eq!(
            to_hex(&block),
            "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        );
        let mut stream = Stream(ChaCha20Rng::from_seed([0; 32]));
        assert_eq!(
            stream.next_u64(),
            u64::from_le_bytes([0x76, 0xb8, 0xe0, 0xad, 0xa0, 0xf1, 0x3d, 0x90])
        );
    }

    /// The vector of `docs/fairness.md`: a third party's verifier must
    /// print the same.
    #[test]
    fn the_documented_test_vector_holds() {
        let seed =
            Seed::from_hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")
                .unwrap();
        assert_eq!(
            seed.commitment(),
            "630dcd2966c4336691125448bbb25b4ff412a49c732db2c8abc1b8581bd710dd"
        );
        let mut stream = seed.stream(&lucky_gift_context("gift", 7, 3));
        let mut items: Vec<u32> = (0..10).collect();
        stream.shuffle(&mut items);
        assert_eq!(items, vec![2, 7, 9, 1, 6, 4, 5, 8, 0, 3]);
    }

    /// The lucky-gift batch vector of `docs/fairness.md` (computed by
    /// `scripts/fairness-reference.py`).
    #[test]
    fn the_documented_batch_vector_holds() {
        let seed =
            Seed::from_hex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")
                .unwrap();
        let combo = |id: &str, stock: &[(u64, u64)]| ComboStock {
            combo: id.to_owned(),
            stock: stock.to_vec(),
        };
        let composition = [
            combo("c1", &[(0, 3), (10, 1)]),
            combo("c2", &[(0, 2), (50, 1)]),
            combo("c3", &[(5, 2)]),
        ];
        let order = lucky_gift_order(&seed, "gift", 7, 3, &composition);
        let expected = [
            ("c1", 0),
            ("c1", 0),
            ("c1", 10),
            ("c1", 0),
            ("c3", 5),
            ("c3", 5),
            ("c2", 0),
            ("c2", 50),
            ("c2", 0),
        ];
        let order: Vec<(&str, u64)> = order.iter().map(|(c, m)| (c.as_str(), *m)).collect();
        assert_eq!(order, expected);
    }

    #[test]
    fn hex_round_trips_and_rejects_junk() {
        let seed = Seed::fresh().unwrap();
        assert_eq!(Seed::from_hex(&seed.to_hex()), Some(seed));
        assert_eq!(Seed::from_hex("zz"), None);
        assert_eq!(Seed::from_hex(&"0".repeat(63)), None);
        assert_eq!(Seed::from_hex(&"0".repeat(66)), None);
        assert!(!format!("{seed:?}").contains(&seed.to_hex()));
    }

    #[test]
    fn uniform_rejects_the_biased_tail() {
        let mut stream = Seed([9; 32]).stream("t");
        for n in [1u64, 2, 3, 7, 1 << 40, u64::MAX] {
            for _ in 0..100 {
                assert!(stream.uniform(n) < n);
            }
        }
    }

    /// Every position of a 5-element shuffle is equally likely for every
    /// element: a chi-square test over 5x5 cells (16 degrees of freedom;
    /// 39.25 is the 0.999 quantile).
    #[test]
    fn shuffles_are_uniform() {
        let mut stream = Seed([7; 32]).stream("chi-square");
        let trials = 50_000u32;
        let mut counts = [[0u32; 5]; 5];
        for _ in 0..trials {
            let mut items = [0usize, 1, 2, 3, 4];
            stream.shuffle(&mut items);
            for (pos, &item) in items.iter().enumerate() {
                counts[item][pos] += 1;
            }
        }
        let expected = f64::from(trials) / 5.0;
        let chi2: f64 = counts
            .iter()
            .flatten()
            .map(|&c| (f64::from(c) - expected).powi(2) / expected)
            .sum();
        assert!(chi2 < 39.25, "chi-square {chi2}");
    }

    #[test]
    fn contexts_separate_batches() {
        let seed = Seed([1; 32]);
        let mut a = seed.stream(&lucky_gift_context("p", 1, 1));
        let mut b = seed.stream(&lucky_gift_context("p", 2, 1));
        assert_ne!(a.next_u64(), b.next_u64());
    }
}
