//! The `prizepool` subcommands. The `prizepool` binary adds `bench`, which
//! lives outside the library (`bench/`).

mod demo;

use std::{path::PathBuf, time::Duration};

use anyhow::Context;
use clap::Subcommand;

use crate::{
    amqp::{self, dlq, rpc::RpcClient},
    client::{Client, ClientConfig},
    config::Config,
    kinds::lucky_gift,
    messages::{with_type, DrawRequest, RefillRequest},
    scripts::{PoolKeys, Scripts},
};

/// The library's subcommands: everything `prizepool` does but `bench`.
/// Flatten it into a command line (`#[command(flatten)]`) and [`run`] it.
#[derive(Debug)]
pub struct Command(Subcommands);

// Delegated by hand so the subcommands and their options stay private.
impl clap::FromArgMatches for Command {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Subcommands::from_arg_matches(matches).map(Self)
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        self.0.update_from_arg_matches(matches)
    }
}

impl Subcommand for Command {
    fn augment_subcommands(cmd: clap::Command) -> clap::Command {
        Subcommands::augment_subcommands(cmd)
    }

    fn augment_subcommands_for_update(cmd: clap::Command) -> clap::Command {
        Subcommands::augment_subcommands_for_update(cmd)
    }

    fn has_subcommand(name: &str) -> bool {
        Subcommands::has_subcommand(name)
    }
}

#[derive(Debug, Subcommand)]
enum Subcommands {
    /// Create the database if needed and apply migrations.
    Migrate,
    /// Load, inspect and refill lucky-gift pools.
    Pool {
        #[command(subcommand)]
        command: PoolCommand,
    },
    /// Publish a draw and print the reply.
    Draw {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        user: i64,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Idempotency id (default: a fresh ULID).
        #[arg(long)]
        request_id: Option<String>,
        /// Seconds to wait for the reply, per attempt.
        #[arg(long, default_value_t = 10)]
        timeout: u64,
        /// Attempts after the first when no reply comes or the connection
        /// breaks, each with the same request id (the worker answers a
        /// request id it has seen with its first answer).
        #[arg(long, default_value_t = crate::client::DEFAULT_RETRIES)]
        retries: usize,
    },
    /// Print an account's balances.
    Balance {
        account: i64,
        #[arg(long)]
        json: bool,
    },
    /// Inspect and replay dead-letter queues.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Load lottery activities and read their statistics.
    Activity {
        #[command(subcommand)]
        command: ActivityCommand,
    },
    /// Check provably fair batches against their commitments and draws.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Run a whole fleet against the local services and print a summary.
    Demo(demo::DemoArgs),
}

#[derive(Debug, Subcommand)]
enum ActivityCommand {
    /// Validate an activity file and store a new version of each activity.
    Load { file: PathBuf },
    /// PV, UV and prizes awarded on one day.
    Stats {
        id: String,
        /// The UTC day, `YYYYMMDD` (default: today).
        #[arg(long)]
        day: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum PoolCommand {
    /// Validate a pool file, store a new config version, stock first batches.
    Load { file: PathBuf },
    /// Show a pool's counters.
    Status {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Ask the refill worker for the next batch now.
    Refill { id: String },
}

#[derive(Debug, Subcommand)]
enum AuditCommand {
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
    /// Check a closed red packet: its revealed split against the commitment
    /// its create answered, every grab the ledger paid against its share,
    /// and the refund (docs/fairness.md). Exits 1 when something does not hold.
    Packet {
        packet_id: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// Show dead letters and why they are there.
    List {
        /// A queue that dead-letters (`prizepool.draw`, `prizepool.refill`,
        /// `prizepool.settle`, `prizepool.audit`) or its DLQ.
        queue: String,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Move dead letters back to their work queue: at most the messages
    /// the DLQ holds when the replay starts, so messages that fail again
    /// are not replayed twice in one run.
    Replay {
        queue: String,
        #[arg(long, default_value_t = usize::MAX)]
        limit: usize,
        #[arg(long)]
        dry_run: bool,
    },
}

impl Command {
    /// Whether the subcommand runs whole workers in this process (the demo),
    /// and so wants a runtime thread per core. The others spend less CPU on
    /// one thread: their tasks never wake a second runtime thread.
    pub fn runs_workers(&self) -> bool {
        matches!(self.0, Subcommands::Demo(_))
    }

    /// The log filter when `RUST_LOG` is unset: warnings and errors, which
    /// a user should act on. The demo's own output is its summary, which
    /// reports Redis persistence in a line of its own (the draw workers'
    /// start-up warning), and its draw workers probe for draw shards a
    /// larger `DRAW_SHARDS` left behind with passive declarations, which
    /// the broker answers for a missing queue by closing the channel (lapin
    /// logs each such close as an error; the probe expects it).
    pub fn default_log_filter(&self) -> &'static str {
        if self.runs_workers() {
            "warn,prizepool::draw=error,lapin::channel=off"
        } else {
            "warn"
        }
    }
}

/// Runs one subcommand.
pub async fn run(command: Command) -> anyhow::Result<()> {
    let config = Config::from_env().context("reading configuration")?;
    match command.0 {
        Subcommands::Migrate => {
            crate::db::migrate(&config.database_url).await?;
            println!(
                "migrations applied to {}",
                crate::db::redact(&config.database_url)
            );
            let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
            match crate::redis_conn::persistence(&mut redis).await {
                crate::redis_conn::Persistence::Durable => {
                    println!("redis: appendonly yes, appendfsync always (zero loss)")
                }
                crate::redis_conn::Persistence::Lossy(why) => println!("redis: warning: {why}"),
                crate::redis_conn::Persistence::Unknown(why) => {
                    println!("redis: persistence unknown ({why})")
                }
            }
        }
        Subcommands::Pool { command } => pool(&config, command).await?,
        Subcommands::Draw {
            pool,
            user,
            count,
            request_id,
            timeout,
            retries,
        } => {
            // A one-off draw has nothing to wait for: no linger, and a batch
            // of one goes out as a plain `draw`.
            let client = Client::connect(
                ClientConfig::new(&config.amqp_url)
                    .connection_name("prizepool-cli")
                    .declare_topology(&config)
                    .linger(Duration::ZERO)
                    .timeout(Duration::from_secs(timeout))
                    .retries(retries),
            )
            .await?;
            let request = DrawRequest {
                request_id: request_id.unwrap_or_else(|| ulid::Ulid::new().to_string()),
                pool,
                user_id: user,
                count,
            };
            let reply = client.draw(request).await;
            client.close().await;
            println!(
                "{}",
                serde_json::to_string_pretty(&with_type("draw_result", &reply?))?
            );
        }
        Subcommands::Balance { account, json } => {
            let db = crate::db::connect(&config.database_url).await?;
            let balances = crate::ledger::balances(&db, account).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&balances)?);
            } else if balances.is_empty() {
                println!("account {account} has no balance");
            } else {
                println!("account {account}");
                for b in balances {
                    println!("  {:<24} {:>16}", b.asset, b.balance);
                }
            }
        }
        Subcommands::Dlq { command } => dlq_command(&config, command).await?,
        Subcommands::Activity { command } => activity(&config, command).await?,
        Subcommands::Audit { command } => audit(&config, command).await?,
        Subcommands::Demo(args) => demo::run(&config, args).await?,
    }
    Ok(())
}

async fn audit(config: &Config, command: AuditCommand) -> anyhow::Result<()> {
    let db = crate::db::connect(&config.database_url).await?;
    let (pool, generation, json) = match command {
        AuditCommand::Verify {
            pool,
            generation,
            json,
        } => (pool, generation, json),
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

async fn pool(config: &Config, command: PoolCommand) -> anyhow::Result<()> {
    let scripts = Scripts::new();
    match command {
        PoolCommand::Load { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let configs = lucky_gift::parse_file(&text)
                .with_context(|| format!("{} is not a valid pool file", file.display()))?;
            let db = crate::db::migrate(&config.database_url).await?;
            let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
            let loaded = crate::pools::load(
                &db,
                &mut redis,
                &scripts,
                &config.redis_prefix,
                &configs,
                config.refill_chunk,
            )
            .await?;
            for l in loaded {
                let stocked = match l.first_batch {
                    Some(lucky_gift::StockOutcome::Stocked { size, .. }) => {
                        format!(", first batch of {size} prizes stocked")
                    }
                    _ => String::new(),
                };
                println!("pool {} loaded as version {}{stocked}", l.pool, l.version);
            }
        }
        PoolCommand::Status { id, json } => {
            let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
            let keys = PoolKeys::new(&config.redis_prefix, &id);
            let whole = crate::pools::status(&mut redis, &scripts, &config.redis_prefix, &id)
                .await?
                .with_context(|| format!("no pool named {id}"))?;
            if !whole.shards.is_empty() {
                return print_shards(&whole, json);
            }
            let status = whole.total;
            let fair = lucky_gift::fair_state(&mut redis, &keys).await?;
            if json {
                let mut value = serde_json::to_value(&status)?;
                value["fairness"] = serde_json::to_value(&fair)?;
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                print_counters(&status, None);
                println!("drawing batch  {}", fair.drawing);
                for (g, version, commitment) in &fair.committed {
                    println!(
                        "committed      batch {g} (config v{version}): sha256(seed) = {commitment}"
                    );
                }
                if let Some((g, version, seed)) = &fair.last_revealed {
                    println!("last revealed  batch {g} (config v{version}): seed = {seed}");
                }
                let storage = lucky_gift::storage_of(&mut redis, &keys)
                    .await?
                    .unwrap_or(lucky_gift::Storage::List);
                let bytes = lucky_gift::storage_bytes(&mut redis, &keys, storage).await?;
                let label = storage.label();
                if storage.stores_every_prize() {
                    println!(
                        "memory         {bytes} bytes ({label}), {:.2} bytes per prize in pool",
                        bytes as f64 / status.in_pool.max(1) as f64
                    );
                } else {
                    // Zeros take no room in sparse storage, so a figure per
                    // prize in pool would mean nothing.
                    println!("memory         {bytes} bytes ({label})");
                }
            }
        }
        PoolCommand::Refill { id } => {
            let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
            let status = crate::pools::status(&mut redis, &scripts, &config.redis_prefix, &id)
                .await?
                .with_context(|| format!("no pool named {id}"))?;
            // A sharded pool is refilled as a whole: each sub-pool gets its
            // next batch.
            let targets = if status.shards.is_empty() {
                vec![status.total]
            } else {
                status.shards
            };
            let client = RpcClient::connect(config).await?;
            for target in targets {
                // An operator's refill makes the current batch due, which
                // the refill worker checks (a forged request cannot).
                redis::cmd("HSET")
                    .arg(PoolKeys::new(&config.redis_prefix, &target.pool).meta())
                    .arg("due")
                    .arg(target.generation)
                    .query_async::<()>(&mut redis)
                    .await?;
                let request = RefillRequest {
                    pool: target.pool,
                    trigger: target.generation,
                    urgent: true,
                };
                let reply = client
                    .call(
                        amqp::REFILL.routing_key,
                        &with_type("refill", &request),
                        Duration::from_secs(60),
                    )
                    .await?;
                println!("{}", serde_json::to_string_pretty(&reply)?);
            }
            client.close().await;
        }
    }
    Ok(())
}

/// Prints a pool's counters (and its number of sub-pools, if sharded).
fn print_counters(status: &lucky_gift::PoolStatus, sub_pools: Option<usize>) {
    println!("pool           {}", status.pool);
    println!("kind           {}", status.kind);
    println!("config version {}", status.version);
    if let Some(n) = sub_pools {
        println!("sub-pools      {n}");
    }
    println!("batches        {}", status.generation);
    println!("stocked        {}", status.stocked);
    println!("drawn          {}", status.drawn);
    println!(
        "in pool        {} ({} jackpots waiting)",
        status.in_pool, status.held_jackpots
    );
    println!("spent today    {}", status.spent_today);
}

/// Prints the status of a pool stocked as several sub-pools: the whole
/// pool's counters, then each sub-pool's.
fn print_shards(status: &crate::pools::Status, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(status)?);
        return Ok(());
    }
    print_counters(&status.total, Some(status.shards.len()));
    for s in &status.shards {
        println!(
            "{:<14} batches {}, stocked {}, drawn {}, in pool {}, spent today {}",
            s.pool, s.generation, s.stocked, s.drawn, s.in_pool, s.spent_today
        );
    }
    Ok(())
}

async fn activity(config: &Config, command: ActivityCommand) -> anyhow::Result<()> {
    match command {
        ActivityCommand::Load { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let activities = crate::kinds::lottery::parse_file(&text)
                .with_context(|| format!("{} is not a valid activity file", file.display()))?;
            let db = crate::db::migrate(&config.database_url).await?;
            let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
            let loaded = crate::kinds::lottery::load(
                &db,
                &mut redis,
                &Scripts::new(),
                &config.redis_prefix,
                &activities,
            )
            .await?;
            for (id, version) in loaded {
                println!("activity {id} loaded as version {version}");
            }
        }
        ActivityCommand::Stats { id, day, json } => {
            let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
            let day = day.unwrap_or_else(crate::scripts::utc_day);
            let keys = PoolKeys::new(&config.redis_prefix, &id);
            let stats = crate::kinds::lottery::stats(&mut redis, &keys, &id, &day)
                .await?
                .with_context(|| format!("no activity named {id}"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&stats)?);
            } else {
                println!(
                    "activity {} on {}: PV {}, UV {}",
                    stats.activity, stats.day, stats.pv, stats.uv
                );
                for (prize, awarded, left) in stats.prizes {
                    let left = left.map_or("unlimited".to_owned(), |l| l.to_string());
                    println!("  {prize:<20} awarded {awarded:>8}   stock left {left}");
                }
            }
        }
    }
    Ok(())
}

async fn dlq_command(config: &Config, command: DlqCommand) -> anyhow::Result<()> {
    // Every queue that dead-letters: the work queues and the audit trail's.
    let route = |name: &str| {
        amqp::ROUTES
            .into_iter()
            .chain([crate::audit::ROUTE])
            .find(|r| r.queue == name || r.dlq == name)
            .with_context(|| {
                format!(
                    "unknown queue {name}; expected prizepool.draw, prizepool.refill, \
                     prizepool.settle or prizepool.audit"
                )
            })
    };
    let conn = amqp::connect(&config.amqp_url, "prizepool-dlq").await?;
    match command {
        DlqCommand::List { queue, limit, json } => {
            let route = route(&queue)?;
            let letters = dlq::list(&conn, route, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&letters)?);
            } else {
                println!("{} dead letters in {}", letters.len(), route.dlq);
                for l in letters {
                    println!(
                        "- [{}] {}: {}\n    {}",
                        l.code.as_deref().unwrap_or("-"),
                        l.message_type.as_deref().unwrap_or("?"),
                        l.reason,
                        l.body
                    );
                }
            }
        }
        DlqCommand::Replay {
            queue,
            limit,
            dry_run,
        } => {
            let route = route(&queue)?;
            let report = dlq::replay(&conn, route, limit, dry_run).await?;
            let verb = if dry_run { "would move" } else { "moved" };
            let n = if dry_run {
                report.messages.len()
            } else {
                report.moved
            };
            println!(
                "{verb} {n} of the {} messages in {} to {}",
                report.found, route.dlq, route.queue
            );
            for l in report.messages {
                println!(
                    "- {}: {}",
                    l.message_type.as_deref().unwrap_or("?"),
                    l.reason
                );
            }
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}
