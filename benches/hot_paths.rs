//! Micro-benchmarks of the hot pure code: prize codes, batch building and
//! shuffling, the red-packet split, weighted picks, and reading the
//! settle worker's grouped messages (through a JSON value, and straight).
//! Run with `cargo bench --bench hot_paths`.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use prizepool::kinds::{
    lottery::pick_weighted,
    lucky_gift::{parse_file, Batch, CodeTable},
    red_packet::split::split,
};
use prizepool::{
    audit::incoming,
    messages::{decode_envelope, DrawResult, Prize, SettleMessage, SettleRequest, Status},
};
use rand::{rngs::StdRng, SeedableRng};

const POOL: &str = r#"
[[pools]]
id = "gift-1001"
kind = "lucky_gift"
unit_price = 100
[[pools.combos]]
id = "c1"
stock = { "0" = 29994, "10" = 293, "50" = 139, "500" = 27, "5000" = 1 }
[[pools.combos]]
id = "c2"
stock = { "0" = 29994, "10" = 293, "50" = 139, "500" = 27, "5000" = 1 }
[[pools.combos]]
id = "c3"
stock = { "0" = 29994, "10" = 293, "50" = 139, "500" = 27, "5000" = 1 }
"#;

fn codes(c: &mut Criterion) {
    let config = parse_file(POOL).unwrap().remove(0);
    let table = CodeTable::extend(None, &config);
    let mut rng = StdRng::seed_from_u64(7);
    let batch = Batch::build(&config, &table, &mut rng);
    let n = batch.codes.len() as u64;
    let mut g = c.benchmark_group("codes");
    g.throughput(Throughput::Elements(n));
    g.bench_function("encode batch to list elements", |b| {
        b.iter(|| black_box(batch.elements(2).map(|e| e.len()).sum::<usize>()))
    });
    let payload: Vec<String> = batch.codes.iter().take(1000).map(u32::to_string).collect();
    let payload = payload.join(",");
    g.throughput(Throughput::Elements(1000));
    g.bench_function("decode 1000 codes", |b| {
        b.iter(|| {
            let total: u64 = payload
                .split(',')
                .filter_map(|s| s.parse::<u32>().ok())
                .filter_map(|code| table.decode(code))
                .map(|(_, m)| m)
                .sum();
            black_box(total)
        })
    });
    g.finish();
}

fn batches(c: &mut Criterion) {
    let config = parse_file(POOL).unwrap().remove(0);
    let table = CodeTable::extend(None, &config);
    let mut g = c.benchmark_group("batch");
    g.throughput(Throughput::Elements(config.batch_size()));
    g.sample_size(20);
    g.bench_function("build and shuffle 91,362 prizes", |b| {
        let mut rng = StdRng::seed_from_u64(1);
        b.iter(|| black_box(Batch::build(&config, &table, &mut rng).codes.len()))
    });
    g.finish();
}

fn red_packet(c: &mut Criterion) {
    let mut g = c.benchmark_group("red packet split");
    for count in [10i64, 100, 5000] {
        g.throughput(Throughput::Elements(count as u64));
        g.bench_function(format!("{count} shares"), |b| {
            let mut rng = StdRng::seed_from_u64(3);
            b.iter(|| black_box(split(count * 1000, count, 1, &mut rng).unwrap()))
        });
    }
    g.finish();
}

fn weighted(c: &mut Criterion) {
    let weights: Vec<u64> = vec![1, 100, 500, 20, 3, 70, 250, 9];
    let mut g = c.benchmark_group("weighted pick");
    g.bench_function("8 prizes", |b| {
        b.iter_batched(
            || rand::random::<u64>() >> 12,
            |r| black_box(pick_weighted(&weights, &[r])),
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// A `settle.batch` of `n` prize entries, as a draw worker groups them.
fn settle_batch(n: usize) -> Vec<u8> {
    let entries: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let mut e = SettleRequest::new(
                format!("lg:gift-1001:req-{i}:{}", 1000 + i),
                7_000 + i as i64,
                "coin",
                1_000,
                "lucky_gift",
                serde_json::json!({"pool": "gift-1001", "request_id": format!("req-{i}"), "version": 2}),
            );
            e.seal = Some("ab".repeat(32));
            serde_json::to_value(e).unwrap()
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({"type": "settle.batch", "entries": entries})).unwrap()
}

/// A `draw.completed.batch` of `n` sealed draws of 10 prizes.
fn draw_group(n: usize) -> Vec<u8> {
    let events: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let result = DrawResult {
                request_id: format!("req-{i}"),
                status: Status::Ok,
                pool: Some("gift-1001".into()),
                user_id: Some(7_000 + i as i64),
                prizes: (0..10)
                    .map(|p| Prize::Multiplier {
                        multiplier: [0, 10, 0, 50][p % 4],
                        combo: "c1".into(),
                    })
                    .collect(),
                total_multiplier: Some(120),
                reward: Some(12_000),
                asset: Some("coin".into()),
                serial: Some(1_000 + i as i64),
                version: Some(2),
                ..DrawResult::default()
            };
            let mut event = serde_json::to_value(result).unwrap();
            event["type"] = "draw.completed".into();
            event["seal"] = "cd".repeat(32).into();
            event
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({"type": "draw.completed.batch", "events": events}))
        .unwrap()
}

fn grouped(c: &mut Criterion) {
    let settle = settle_batch(100);
    let mut g = c.benchmark_group("settle.batch of 100 entries");
    g.throughput(Throughput::Elements(100));
    g.bench_function("through a JSON value", |b| {
        b.iter(|| {
            black_box(
                decode_envelope(&settle)
                    .and_then(|v| SettleMessage::decode(&v))
                    .unwrap(),
            )
        })
    });
    g.bench_function("straight (SettleMessage::from_body)", |b| {
        b.iter(|| black_box(SettleMessage::from_body(&settle).unwrap()))
    });
    g.finish();
    let draws = draw_group(20);
    let mut g = c.benchmark_group("draw.completed.batch of 20 draws");
    g.throughput(Throughput::Elements(20));
    g.bench_function("through a JSON value", |b| {
        b.iter(|| {
            let v = decode_envelope(&draws).unwrap();
            let records: Vec<incoming::Record> = v["events"]
                .as_array()
                .unwrap()
                .iter()
                .map(incoming::Record::of_value)
                .collect();
            black_box(records)
        })
    });
    g.bench_function("straight (the audit's envelope, then its records)", |b| {
        b.iter(|| {
            let v = incoming::envelope(&draws).unwrap();
            assert!(incoming::is_shallow_group(&v));
            black_box(incoming::group_records(&draws).unwrap())
        })
    });
    g.finish();
}

criterion_group!(benches, codes, batches, red_packet, weighted, grouped);
criterion_main!(benches);
