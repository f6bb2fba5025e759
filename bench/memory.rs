//! What the pools and the remembered results of a run cost in Redis memory.

use anyhow::Context;
use prizepool::{
    kinds::{
        self,
        lucky_gift::{self, Storage},
        Ask, Kinds,
    },
    redis_conn::RedisConn,
    scripts::PoolKeys,
};

use super::{
    report,
    services::{borrow, pool_config, spec_combos, unique, Services},
};

/// The memory figures of a run: bytes per prize of list and sparse
/// storage, and what a remembered result costs (`results` of them, with
/// the stored body of an award from the lucky-gift pool `pool`).
pub(crate) async fn measure(
    svc: &Services<'_>,
    pool: &str,
    results: u64,
    memory: &mut report::Memory,
) -> anyhow::Result<()> {
    let keys = PoolKeys::new(&svc.config.redis_prefix, pool);
    memory.list_bytes_per_prize = list_bytes_per_prize(&svc.redis, &keys).await?;
    println!("remembered results ({results})");
    let award = stored_award(svc, pool).await?;
    memory.results = remembered_results(svc, results, &award).await?;
    println!(
        "  {:.1} bytes per result (claim {:.1}, answer {:.1})",
        memory.results.total_bytes, memory.results.claim_bytes, memory.results.answer_bytes
    );
    (
        memory.sparse_bytes_per_nonzero,
        memory.sparse_bytes_for_zeros,
    ) = sparse_memory(svc).await?;
    Ok(())
}

/// Bytes per prize of the list-stored pool behind `keys`.
async fn list_bytes_per_prize(redis: &RedisConn, keys: &PoolKeys) -> anyhow::Result<f64> {
    let mut conn = redis.clone();
    let bytes = lucky_gift::storage_bytes(&mut conn, keys, Storage::List).await?;
    let len: u64 = redis::cmd("LLEN")
        .arg(keys.queue())
        .query_async(&mut conn)
        .await?;
    Ok(bytes as f64 / len.max(1) as f64)
}

/// The stored answer (fingerprint bytes left out) of one real count-1 draw
/// from lucky-gift pool `pool`, drawn through the seam as the draw worker
/// draws it.
async fn stored_award(svc: &Services<'_>, pool: &str) -> anyhow::Result<Vec<u8>> {
    let id = unique("award");
    let ttl = svc.config.result_ttl.as_secs();
    let tokens = kinds::Tokens::new(
        &svc.config.redis_prefix,
        "rq",
        &id,
        kinds::fingerprint("bench", &[]),
        ttl,
    );
    let dispatch = Kinds::new(svc.redis.clone(), &svc.config.redis_prefix);
    let kind = dispatch
        .resolve(pool)
        .await?
        .with_context(|| format!("no pool {pool}"))?;
    let ask = Ask {
        request_id: &id,
        pool,
        user: 0,
        count: 1,
        token: &tokens.answer,
        result_ttl_s: ttl,
    };
    dispatch.draw(kind, &ask).await?;
    let mut conn = svc.redis.clone();
    let (_, answer) = kinds::answer::stored(
        &mut conn,
        &svc.scripts,
        &dispatch.keys(pool).results(),
        &tokens,
        false,
    )
    .await?;
    let answer = answer.context("the draw stored no answer")?;
    Ok(answer)
}

/// What remembering `n` results costs: `n` request ids claimed (the claim
/// stores of the id groups) and then answered (one pool's answer store,
/// each with the stored body of a real count-1 lucky-gift award, `award`)
/// through the workers' own scripts, with `used_memory` read around each
/// half. On a Redis Cluster, the figure is the node the connection reports
/// on.
async fn remembered_results(
    svc: &Services<'_>,
    n: u64,
    award: &[u8],
) -> anyhow::Result<report::Results> {
    let mut conn = svc.redis.clone();
    let scripts = &svc.scripts;
    let ttl = svc.config.result_ttl.as_secs();
    let store = PoolKeys::new(&svc.config.redis_prefix, &unique("bench-results")).results();
    scripts.claim.load(&mut conn).await?;
    scripts.remember_refusal.load(&mut conn).await?;
    let (claim_fn, answer_fn) = (scripts.claim.name(), scripts.remember_refusal.name());
    let fingerprint = kinds::fingerprint("bench", &[]);
    let ids: Vec<String> = (0..n).map(|i| unique(&format!("r{i}"))).collect();
    let mut memory = [prizepool::redis_conn::used_memory(&mut conn).await?, 0, 0];
    let mut samples = [String::new(), String::new()];
    for (half, function) in [claim_fn, answer_fn].into_iter().enumerate() {
        for chunk in ids.chunks(500) {
            let mut pipe = redis::pipe();
            for id in chunk {
                let tokens =
                    kinds::Tokens::new(&svc.config.redis_prefix, "rq", id, fingerprint, ttl);
                if half == 0 {
                    pipe.cmd("FCALL")
                        .arg(function)
                        .arg(1)
                        .arg(&tokens.claim_store)
                        .arg(&tokens.claim)
                        .arg("claim")
                        .ignore();
                } else {
                    pipe.cmd("FCALL")
                        .arg(function)
                        .arg(1)
                        .arg(&store)
                        .arg(&tokens.answer)
                        .arg(award)
                        .ignore();
                }
            }
            let _: () = pipe.query_async(&mut conn).await?;
        }
        memory[half + 1] = prizepool::redis_conn::used_memory(&mut conn).await?;
        let pattern = if half == 0 {
            format!("{}:rq:{{*}}:*", svc.config.redis_prefix)
        } else {
            format!("{store}:*")
        };
        let (_, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(0)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await?;
        if let Some(key) = keys.first() {
            samples[half] = redis::cmd("OBJECT")
                .arg("ENCODING")
                .arg(key)
                .query_async(&mut conn)
                .await?;
        }
    }
    let per = |bytes: u64| bytes as f64 / n.max(1) as f64;
    let (claim, answer) = (
        per(memory[1].saturating_sub(memory[0])),
        per(memory[2].saturating_sub(memory[1])),
    );
    Ok(report::Results {
        results: n,
        claim_bytes: claim,
        answer_bytes: answer,
        total_bytes: claim + answer,
        body_bytes: award.len() + 1,
        encodings: samples,
    })
}

/// Sparse storage: bytes per non-zero prize of a pool stocked like the
/// SPEC's combos, and bytes of a pool stocked with zeros alone.
async fn sparse_memory(svc: &Services<'_>) -> anyhow::Result<(f64, u64)> {
    let prizes = pool_config(
        &unique("bench-sparse"),
        Storage::Sparse,
        &borrow(&spec_combos(10)),
        1.0,
    );
    let nonzero: u64 = prizes
        .combos
        .iter()
        .flat_map(|c| &c.stock)
        .filter(|(m, _)| *m > 0)
        .map(|(_, n)| n)
        .sum();
    let zeros = pool_config(
        &unique("bench-zeros"),
        Storage::Sparse,
        &[("c1", &[(0, report::Memory::SPARSE_ZEROS)])],
        1.0,
    );
    let mut bytes = [0u64; 2];
    for (pool, bytes) in [&prizes, &zeros].into_iter().zip(&mut bytes) {
        svc.load(pool).await?;
        let keys = PoolKeys::new(&svc.config.redis_prefix, &pool.id);
        *bytes = lucky_gift::storage_bytes(&mut svc.redis.clone(), &keys, Storage::Sparse).await?;
    }
    Ok((bytes[0] as f64 / nonzero.max(1) as f64, bytes[1]))
}
