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

/// The lottery vectors of the page ("Lotteries"): what the fleet's
/// derivation gives, written on the page, and each wrong reading the page
/// lists gives another answer.
#[test]
fn the_pages_lottery_vectors_hold_and_tell_wrong_readings_apart() {
    use prizepool::fairness::{lottery_context, lottery_pick, lottery_values};
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fairness.md")).unwrap();
    let context = lottery_context("spring-2027", 1_799_971_200, "r-1");
    assert_eq!(
        context,
        "prizepool/lottery/v1\nspring-2027\n1799971200\nr-1"
    );
    let mut stream = seed().stream(&context);
    let words: Vec<u64> = (0..2).map(|_| stream.next_u64()).collect();
    let values = lottery_values(&seed(), &context, 0, 4);
    assert_eq!(
        values,
        [
            3366721482123628,
            4331380465362076,
            1603442658340615,
            1848630284411929
        ]
    );
    let weights = [1, 100, 500];
    assert_eq!(lottery_pick(&values, &weights), Some((3366721482123628, 0)));
    for number in [
        "dcb4f026b93e26846c7d7317c84ed79ab8944bb1c91ecd3332a093ad6be0b256",
        "13790091190778384216",
        "3366721482123628",
        "4331380465362076",
    ] {
        assert!(page.contains(number), "the page lacks {number}");
    }
    // Wrong readings: another value, and another prize than `ipad`.
    let pick_of = |v: u64| lottery_pick(&[v], &weights).map(|(_, i)| i);
    let big_endian = u64::from_be_bytes(words[0].to_le_bytes()) >> 12;
    let low_bits = words[0] & ((1 << 52) - 1);
    let from_one = values[1];
    for (reading, value) in [
        ("big-endian", big_endian),
        ("low 52 bits", low_bits),
        ("counting from 1", from_one),
    ] {
        assert_ne!(pick_of(value), Some(0), "{reading}");
        assert!(page.contains(&value.to_string()), "{reading}: {value}");
    }
    let whole_word = words[0] % 601;
    assert_eq!(whole_word, 322);
    assert!(page.contains("322"));

    // Rejection against plain modulo: value 0 is rejected for a total of
    // 2^51 + 1, value 1 is used and lands on the first candidate; modulo
    // of value 0 would land on the second.
    let context = lottery_context("spring-2027", 1_799_971_200, "r-4");
    let values = lottery_values(&seed(), &context, 0, 2);
    assert_eq!(values, [4242066891580541, 542179691994928]);
    let weights = [1u64 << 50, (1 << 50) + 1];
    assert_eq!(lottery_pick(&values, &weights), Some((542179691994928, 0)));
    assert_eq!(lottery_pick(&values[..1], &weights), None);
    let total: u64 = weights.iter().sum();
    assert_eq!(values[0] % total, 1990267077895292);
    assert!(values[0] % total >= weights[0]);
    for number in ["4242066891580541", "542179691994928", "1990267077895292"] {
        assert!(page.contains(number), "the page lacks {number}");
    }
}
