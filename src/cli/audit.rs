//! `prizepool audit`: check provably fair batches and red packets
//! (docs/fairness.md). Every check exits 1 when something does not hold,
//! and so does a pool the database does not know.

use anyhow::Context;
use clap::Subcommand;

use crate::config::Config;

#[derive(Debug, Subcommand)]
pub(super) enum AuditCommand {
    /// Recompute a pool's revealed batches from their seeds and check them
    /// against their commitments and every recorded draw (docs/fairness.md).
    /// Exits 1 when something does not hold.
    Verify {
        pool: String,
        /// Only this batch (default: every recorded batch of the pool).
        #[arg(long)]
        generation: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Reveal the seeds of a lottery activity's periods that are over
    /// (the refill worker does it too, within minutes) and print them
    /// (docs/fairness.md, Lotteries). The current period's seed stays
    /// secret.
    Reveal {
        activity: String,
        #[arg(long)]
        json: bool,
    },
    /// Check a closed red packet: its revealed split against the commitment
    /// its create answered, every grab the ledger paid against its share,
    /// and the refund (docs/fairness.md). Exits 1 when something does not hold.
    Packet {
        packet_id: String,
        #[arg(long)]
        json: bool,
    },
}

pub(super) async fn run(config: &Config, command: AuditCommand) -> anyhow::Result<()> {
    let db = crate::db::connect(&config.database_url).await?;
    let (pool, generation, json) = match command {
        AuditCommand::Verify {
            pool,
            generation,
            json,
        } => (pool, generation, json),
        AuditCommand::Reveal { activity, json } => {
            return reveal(config, &db, &activity, json).await;
        }
        AuditCommand::Packet { packet_id, json } => {
            let verdict = crate::kinds::red_packet::fair::verify(&db, &packet_id)
                .await
                .context("reading the packet and its ledger entries")?;
            if json {
                println!("{}", serde_json::to_string_pretty(&verdict)?);
            } else {
                match &verdict.mismatch {
                    None => println!(
                        "packet {packet_id}: ok: split matches commitment {}; {} grabs paid their shares; refund exact",
                        verdict.commitment.as_deref().unwrap_or_default(),
                        verdict.grabs
                    ),
                    Some(why) => println!("packet {packet_id}: MISMATCH: {why}"),
                }
            }
            if !verdict.ok {
                std::process::exit(1);
            }
            return Ok(());
        }
    };
    if generation.is_none() && crate::audit::is_activity(&db, &pool).await? {
        return verify_activity(&db, &pool, json).await;
    }
    if !pool_known(&db, &pool).await? {
        // Nothing to verify is no verdict: an operator who mistyped a pool
        // id must not read "ok".
        if json {
            let out = serde_json::json!({"pool": pool, "ok": false, "error": "unknown_pool",
                "message": format!("no pool named {pool}"), "batches": []});
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        eprintln!("no pool named {pool}: no configuration and no committed batch recorded");
        std::process::exit(1);
    }
    let verdicts = crate::audit::verify_pool(&db, &pool, generation)
        .await
        .context("reading the audit trail")?;
    let ok = verdicts.iter().all(|v| v.ok);
    if json {
        // One shape for every pool: a sharded pool's batches name their
        // sub-pools.
        let verdict = crate::audit::merged(&pool, verdicts);
        println!("{}", serde_json::to_string_pretty(&verdict)?);
    } else {
        for verdict in &verdicts {
            if verdicts.len() > 1 {
                println!("sub-pool {}:", verdict.pool);
            }
            print_verdict(verdict);
        }
        if verdicts.len() > 1 {
            println!("verdict: {}", if ok { "ok" } else { "MISMATCH" });
        }
    }
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

/// Whether `pool` is a lucky-gift pool this database knows: a stored
/// configuration, or batches in the audit trail.
async fn pool_known(db: &sqlx::PgPool, pool: &str) -> anyhow::Result<bool> {
    let known: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pool_versions WHERE pool_id = $1)
             OR EXISTS (SELECT 1 FROM fair_batches WHERE pool = $1)",
    )
    .bind(pool)
    .fetch_one(db)
    .await
    .context("looking the pool up")?;
    Ok(known)
}

/// Prints one pool's (or sub-pool's) verdict.
fn print_verdict(verdict: &crate::audit::Verdict) {
    let pool = &verdict.pool;
    if verdict.batches.is_empty() {
        println!("pool {pool}: no committed batch recorded");
    }
    for b in &verdict.batches {
        let commitment = b.commitment.as_deref().unwrap_or("(none recorded)");
        match b.status {
            "unrevealed" => println!(
                "batch {}: unrevealed (commitment {commitment}); it can be checked once its seed is revealed",
                b.generation
            ),
            "ok" => println!(
                "batch {}: ok: seed {} matches commitment {commitment}; {} draws, {} prizes checked{}",
                b.generation,
                b.seed.as_deref().unwrap_or_default(),
                b.draws_checked,
                b.prizes_checked,
                if b.complete { ", every position accounted for" } else { " (not every position has a recorded draw)" }
            ),
            _ => println!(
                "batch {}: MISMATCH: {}",
                b.generation,
                b.first_mismatch
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default()
            ),
        }
    }
    println!("verdict: {}", if verdict.ok { "ok" } else { "MISMATCH" });
}

/// `audit verify ACTIVITY`: every recorded period and draw of a lottery
/// activity; exits 1 on a mismatch.
async fn verify_activity(db: &sqlx::PgPool, activity: &str, json: bool) -> anyhow::Result<()> {
    let verdict = crate::audit::verify_activity(db, activity)
        .await
        .context("reading the audit trail")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&verdict)?);
    } else {
        if verdict.periods.is_empty() {
            println!("activity {activity}: no committed period recorded");
        }
        for p in &verdict.periods {
            let commitment = p.commitment.as_deref().unwrap_or("(none recorded)");
            match p.status {
                "unrevealed" => println!(
                    "period {}: unrevealed (commitment {commitment}); it can be checked once its seed is revealed",
                    p.period
                ),
                "ok" => println!(
                    "period {}: ok: seed {} matches commitment {commitment}; {} draws checked",
                    p.period,
                    p.seed.as_deref().unwrap_or_default(),
                    p.draws_checked
                ),
                _ => println!(
                    "period {}: MISMATCH: {}",
                    p.period,
                    p.first_mismatch
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default()
                ),
            }
        }
        println!("verdict: {}", if verdict.ok { "ok" } else { "MISMATCH" });
    }
    if !verdict.ok {
        std::process::exit(1);
    }
    Ok(())
}

/// `audit reveal ACTIVITY`: reveals the periods that are over and prints
/// every revealed seed of the activity.
async fn reveal(
    config: &Config,
    db: &sqlx::PgPool,
    activity: &str,
    json: bool,
) -> anyhow::Result<()> {
    let redis = crate::redis_conn::connect(&config.redis_url).await?;
    let now = crate::scripts::now_ms();
    let revealed =
        crate::kinds::lottery::seeds::reveal_ended(db, &redis, &config.redis_prefix, activity, now)
            .await
            .map_err(|e| anyhow::anyhow!("revealing the seeds of {activity}: {e}"))?;
    let seeds: Vec<(i64, String)> = sqlx::query_as(
        "SELECT period, seed FROM fair_lottery_reveals WHERE activity = $1 ORDER BY period",
    )
    .bind(activity)
    .fetch_all(db)
    .await?;
    if json {
        let seeds: Vec<_> = seeds
            .iter()
            .map(|(period, seed)| serde_json::json!({"period": period, "seed": seed}))
            .collect();
        let out =
            serde_json::json!({"activity": activity, "revealed_now": revealed, "seeds": seeds});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("activity {activity}: {revealed} seeds revealed now");
        for (period, seed) in seeds {
            println!("period {period}: seed {seed}");
        }
    }
    Ok(())
}
