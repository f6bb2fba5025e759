//! Crafts two request ids whose SHA-256 digests agree on `len` bytes at
//! `offset`: the birthday search an attacker would run against a store that
//! keys requests by a few bytes of a hash. prizepool compares 16 bytes
//! (`kinds::answer::DIGEST_BYTES`), so such twins are two requests to it;
//! `tests/it/digests.rs` holds pairs made by this program and checks both that
//! they collide and that the fleet tells them apart.
//!
//! ```sh
//! cargo run --release --example twin_ids -- <len> <offset> [prefix] [salt-hex]
//! ```
//!
//! The digest is of `salt ‖ id` (no salt: of the id, as a claim is keyed;
//! the 8-byte content fingerprint as salt: as an answer is keyed). Ids are
//! `<prefix><16 hex digits>`. The search follows trails of the map "id →
//! the digest's window, as the next id's digits" to distinguished points
//! (van Oorschot and Wiener), so it needs no memory beyond the points: about
//! 2^(4·len) hashes, seconds for 6 bytes, minutes for 8.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use sha2::{Digest, Sha256};

struct Search {
    len: usize,
    offset: usize,
    prefix: Vec<u8>,
    salt: Vec<u8>,
}

impl Search {
    fn id(&self, x: u64) -> Vec<u8> {
        let mut id = self.prefix.clone();
        id.extend_from_slice(format!("{x:016x}").as_bytes());
        id
    }

    /// The window of the digest of id `x`, as the next point.
    fn step(&self, x: u64) -> u64 {
        let mut hash = Sha256::new();
        hash.update(&self.salt);
        hash.update(self.id(x));
        let d = hash.finalize();
        let mut v = 0u64;
        for b in &d[self.offset..self.offset + self.len] {
            v = (v << 8) | u64::from(*b);
        }
        v
    }

    /// Where two trails that reach one distinguished point merge: two
    /// different ids with the same window, or `None` when one trail runs
    /// into the other's start.
    fn merge(&self, (mut a, la): (u64, u64), (mut b, lb): (u64, u64)) -> Option<(u64, u64)> {
        let (mut la, mut lb) = (la, lb);
        while la > lb {
            a = self.step(a);
            la -= 1;
        }
        while lb > la {
            b = self.step(b);
            lb -= 1;
        }
        if a == b {
            return None;
        }
        loop {
            let (na, nb) = (self.step(a), self.step(b));
            if na == nb {
                return Some((a, b));
            }
            (a, b) = (na, nb);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let len: usize = args.first().map_or(6, |a| a.parse().unwrap());
    let offset: usize = args.get(1).map_or(0, |a| a.parse().unwrap());
    assert!(
        (1..=8).contains(&len) && offset + len <= 32,
        "len 1..=8 within 32 bytes"
    );
    let search = Search {
        len,
        offset,
        prefix: args
            .get(2)
            .map_or(b"twin-".to_vec(), |p| p.as_bytes().to_vec()),
        salt: args.get(3).map_or(Vec::new(), |s| {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        }),
    };
    // A trail ends where the low `bits` bits are zero: about 2^(4·len - 4)
    // points of 2^(4·len + 4) hashes each would be wasteful; 2^(2·len) apart
    // keeps the table small and the overshoot cheap.
    let bits = (2 * len as u32).min(20);
    let mask = (1u64 << bits) - 1;
    let mut seen: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut start = 1u64;
    loop {
        start += 1;
        let (mut x, mut n) = (start, 0u64);
        while x & mask != 0 && n < 64 << bits {
            x = search.step(x);
            n += 1;
        }
        if x & mask != 0 {
            continue;
        }
        if let Some(&other) = seen.get(&x) {
            if let Some((a, b)) = search.merge(other, (start, n)) {
                let (ia, ib) = (search.id(a), search.id(b));
                println!(
                    "{} {}",
                    String::from_utf8(ia).unwrap(),
                    String::from_utf8(ib).unwrap()
                );
                return;
            }
        } else {
            seen.insert(x, (start, n));
        }
    }
}
