//! The test vectors of `docs/fairness.md`, checked against the code that
//! stocks batches, from a pool file as an operator writes it: the page and
//! the fleet cannot drift apart, and each vector tells apart the readings
//! of the page a verifier could otherwise pick between.
#![allow(clippy::unwrap_used)]

use prizepool::{
    fairness::{lucky_gift_batch, lucky_gift_context, Seed},
    kinds::lucky_gift::{self, Batch, CodeTable},
};

/// The seed of every vector: bytes 0 to 31.
fn seed() -> Seed {
    Seed(std::array::from_fn(|i| i as u8))
}

/// The batch the fleet stocks from `toml` (pool `gift`, generation 7,
/// config version 3), as `<combo> <multiplier>` per position.
fn stocked(toml: &str) -> Vec<String> {
    let config = lucky_gift::parse_file(toml).unwrap().remove(0);
    let table = CodeTable::extend(None, &config);
    let mut stream = seed().stream(&lucky_gift_context("gift", 7, 3));
    Batch::build_fair(&config, &table, &mut stream)
        .codes
        .iter()
        .map(|c| {
            let (combo, m) = table.decode(*c).unwrap();
            format!("{combo} {m}")
        })
        .collect()
}

/// The batch order a verifier derives when it lists each combo's prizes
/// as `combos` gives them.
fn derived(names: &[&str], combos: &[Vec<(u64, u64)>]) -> Vec<String> {
    let mut stream = seed().stream(&lucky_gift_context("gift", 7, 3));
    lucky_gift_batch(&mut stream, combos)
        .into_iter()
        .flat_map(|(c, prizes)| prizes.into_iter().map(move |m| format!("{} {m}", names[c])))
        .collect()
}

#[test]
fn the_pages_batch_vectors_are_what_the_fleet_stocks() {
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fairness.md")).unwrap();
    // The first vector: multipliers written in ascending order.
    let first = stocked(
        r#"[[pools]]
id = "gift"
kind = "lucky_gift"
unit_price = 10
[[pools.combos]]
id = "c1"
stock = { "0" = 3, "10" = 1 }
[[pools.combos]]
id = "c2"
stock = { "0" = 2, "50" = 1 }
[[pools.combos]]
id = "c3"
stock = { "5" = 2 }
"#,
    );
    assert!(
        page.contains(&format!("| batch order | `{}` |", first.join(", "))),
        "{first:?}"
    );
    // The second: multipliers written out of order. Prizes are listed by
    // multiplier, ascending as numbers: not as written, not as text.
    let second = stocked(
        r#"[[pools]]
id = "gift"
kind = "lucky_gift"
unit_price = 10
[[pools.combos]]
id = "c1"
stock = { "5" = 2, "10" = 1, "0" = 1 }
[[pools.combos]]
id = "c2"
stock = { "50" = 1, "0" = 2 }
"#,
    );
    assert!(
        page.contains(&format!("| batch order | `{}` |", second.join(", "))),
        "{second:?}"
    );
    let names = ["c1", "c2"];
    let ascending = vec![vec![(0, 1), (5, 2), (10, 1)], vec![(0, 2), (50, 1)]];
    assert_eq!(second, derived(&names, &ascending));
    let as_written = vec![vec![(5, 2), (10, 1), (0, 1)], vec![(50, 1), (0, 2)]];
    let as_text = vec![vec![(0, 1), (10, 1), (5, 2)], vec![(0, 2), (50, 1)]];
    assert_ne!(second, derived(&names, &as_written));
    assert_ne!(second, derived(&names, &as_text));
}
