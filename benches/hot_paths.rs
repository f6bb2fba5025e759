//! Micro-benchmarks of the hot pure code: prize codes, batch building and
//! shuffling, the red-packet split, and weighted picks.
//! Run with `cargo bench --bench hot_paths`.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use prizepool::kinds::{
    lottery::pick_weighted,
    lucky_gift::{parse_file, Batch, CodeTable},
    red_packet::split::split,
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

criterion_group!(benches, codes, batches, red_packet, weighted);
criterion_main!(benches);
