//! The fair shuffle (`src/fairness.rs`) against an independent
//! implementation of `docs/fairness.md` (`scripts/fairness-reference.py`):
//! both must derive the same commitment, key, shuffles and lucky-gift
//! batches from the same seeds, for random seeds, contexts and sizes.
#![allow(clippy::unwrap_used)]

use prizepool::fairness::{lucky_gift_batch, lucky_gift_context, Seed};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn reference(args: &[&str]) -> Value {
    let out = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/fairness-reference.py"
        ))
        .args(args)
        .output()
        .expect("python3 runs the reference implementation");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn shuffles_match_an_independent_implementation() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(20261124);
    for n in [0usize, 1, 2, 3, 17, 1000] {
        let seed = Seed(rng.random());
        let context = format!("ctx\n{}\u{00e9}", rng.random::<u32>());
        let mut items: Vec<usize> = (0..n).collect();
        seed.stream(&context).shuffle(&mut items);
        let theirs = reference(&[&seed.to_hex(), &context, &n.to_string()]);
        assert_eq!(theirs["commitment"], seed.commitment());
        assert_eq!(theirs["shuffle"], json!(items), "n = {n}");
    }
}

#[test]
fn lucky_gift_batches_match_an_independent_implementation() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for round in 0..4u64 {
        let seed = Seed(rng.random());
        let combos: Vec<Vec<(u64, u64)>> = (0..rng.random_range(1..6))
            .map(|_| {
                (0..rng.random_range(1..5))
                    .map(|_| (rng.random_range(0..1000), rng.random_range(0..40)))
                    .collect()
            })
            .collect();
        let (generation, version) = (round * 13 + 1, round as i64 + 2);
        let ours = lucky_gift_batch(
            &mut seed.stream(&lucky_gift_context("pool-x", generation, version)),
            &combos,
        );
        let theirs = reference(&[
            &seed.to_hex(),
            "pool-x",
            &generation.to_string(),
            &version.to_string(),
            &json!(combos).to_string(),
        ]);
        assert_eq!(theirs, json!(ours), "round {round}");
    }
}
