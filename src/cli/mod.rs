//! The `prizepool` subcommands. The `prizepool` binary adds `bench`, which
//! lives outside the library (`bench/`).

mod analyze;
mod audit;
mod demo;
mod dlq;
mod status;

use std::{path::PathBuf, time::Duration};

use anyhow::Context;
use clap::Subcommand;

use crate::{
    amqp::{self, rpc::RpcClient},
    client::{Client, ClientConfig},
    config::Config,
    kinds::lucky_gift,
    messages::{with_type, DrawRequest, RefillRequest},
    scripts::PoolKeys,
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
        command: dlq::DlqCommand,
    },
    /// Load lottery activities and read their statistics.
    Activity {
        #[command(subcommand)]
        command: ActivityCommand,
    },
    /// Check provably fair batches against their commitments and draws.
    Audit {
        #[command(subcommand)]
        command: audit::AuditCommand,
    },
    /// The fleet at a glance: queues, consumers, dead letters, pools, payouts,
    /// the settle lag, and what looks wrong.
    Status(status::StatusArgs),
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
    Load {
        file: PathBuf,
        /// Load a version that returns more per prize than the pool's last
        /// one (refused otherwise).
        #[arg(long)]
        accept_rtp_change: bool,
    },
    /// What each pool of a pool file pays, from the file alone (no server):
    /// return to player, hit rate, spread per draw size, the most a batch
    /// pays, the jackpot rule's effect.
    /// An activity file: each prize's odds, the expected cost of a chance
    /// and how the stock runs out. `--red-packet`: a share's bounds.
    Analyze {
        /// A pool file or an activity file.
        file: Option<PathBuf>,
        /// Print the figures as JSON.
        #[arg(long)]
        json: bool,
        /// Also write a picture of each combo's payout to this SVG file.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
        /// The draw rate an activity's stock is run out at.
        #[arg(long, value_name = "RATE", default_value_t = 100.0)]
        draws_per_second: f64,
        /// The bounds of one share of a red packet of TOTAL in COUNT shares
        /// of at least MIN (0 when left out).
        #[arg(long, value_name = "TOTAL,COUNT[,MIN]")]
        red_packet: Option<String>,
    },
    /// Show a pool's counters.
    Status {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Ask the refill worker for the next batch now.
    Refill { id: String },
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
            // `status` and `dlq` probe queues with passive declarations, which
            // the broker answers for a missing queue by closing the channel:
            // the command reports that itself (`queue_missing`, an error), so
            // lapin's own ERROR line would only clutter the report.
            "warn,lapin::channel=off"
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
            let request = DrawRequest {
                request_id: request_id.unwrap_or_else(|| ulid::Ulid::new().to_string()),
                pool,
                user_id: user,
                count,
            };
            draw(&config, request, timeout, retries).await?;
        }
        Subcommands::Balance { account, json } => {
            let db = crate::db::connect(&config.database_url).await?;
            let balances = crate::ledger::balances(&db, account).await?;
            if json {
                let out = serde_json::json!({"account": account, "balances": balances});
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else if balances.is_empty() {
                println!("account {account} has no balance");
            } else {
                println!("account {account}");
                for b in balances {
                    println!("  {:<24} {:>16}", b.asset, b.balance);
                }
            }
        }
        Subcommands::Dlq { command } => dlq::run(&config, command).await?,
        Subcommands::Activity { command } => activity(&config, command).await?,
        Subcommands::Audit { command } => audit::run(&config, command).await?,
        Subcommands::Status(args) => status::run(&config, args).await?,
        Subcommands::Demo(args) => demo::run(&config, args).await?,
    }
    Ok(())
}

/// Exit code of `prizepool draw` when no reply came: the request may still
/// be drawn (it stays queued until a worker takes it).
const EXIT_NO_REPLY: i32 = 3;

/// Publishes one draw, prints its reply, and exits 1 when it was rejected
/// or [`EXIT_NO_REPLY`] when no reply came.
async fn draw(
    config: &Config,
    request: DrawRequest,
    timeout: u64,
    retries: usize,
) -> anyhow::Result<()> {
    // A one-off draw has nothing to wait for: no linger, and a batch of one
    // goes out as a plain `draw`.
    let client = Client::connect(
        ClientConfig::new(&config.amqp_url)
            .connection_name("prizepool-cli")
            .declare_topology(config)
            .linger(Duration::ZERO)
            .timeout(Duration::from_secs(timeout))
            .retries(retries),
    )
    .await?;
    let id = request.request_id.clone();
    let reply = client.draw(request).await;
    client.close().await;
    let reply = match reply {
        Ok(reply) => reply,
        Err(crate::client::ClientError::Timeout(waited)) => {
            eprintln!(
                "no reply to request {id} within {waited:?} (after {retries} retries). The \
                 broker took the request: it stays queued in {} until a draw worker takes it. \
                 Send the same --request-id again to read its answer; it is drawn at most once.",
                amqp::DRAW.queue
            );
            println!(
                "{}",
                serde_json::json!({"request_id": id, "status": "no_reply"})
            );
            std::process::exit(EXIT_NO_REPLY);
        }
        Err(error) => {
            return Err(anyhow::Error::new(error).context(format!("drawing request {id}")))
        }
    };
    println!(
        "{}",
        serde_json::to_string_pretty(&with_type("draw_result", &reply))?
    );
    if reply.status != crate::messages::Status::Ok {
        let code = reply.error.as_ref().map_or("?", |e| e.code.as_str());
        eprintln!("draw {id} rejected: {code}");
        std::process::exit(1);
    }
    Ok(())
}

async fn pool(config: &Config, command: PoolCommand) -> anyhow::Result<()> {
    match command {
        PoolCommand::Load {
            file,
            accept_rtp_change,
        } => {
            let change = if accept_rtp_change {
                crate::pools::RtpChange::Accept
            } else {
                crate::pools::RtpChange::Refuse
            };
            pool_load(config, &file, change).await
        }
        PoolCommand::Analyze {
            file,
            json,
            svg,
            draws_per_second,
            red_packet,
        } => analyze::run(&analyze::Asked {
            file: file.as_deref(),
            json,
            svg: svg.as_deref(),
            draws_per_second,
            red_packet: red_packet.as_deref(),
        }),
        PoolCommand::Status { id, json } => pool_status(config, &id, json).await,
        PoolCommand::Refill { id } => pool_refill(config, &id).await,
    }
}

/// `pool load FILE`: stores and stocks every pool of a pool file.
async fn pool_load(
    config: &Config,
    file: &std::path::Path,
    rtp_change: crate::pools::RtpChange,
) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let configs = lucky_gift::parse_file(&text)
        .with_context(|| format!("{} is not a valid pool file", file.display()))?;
    let db = crate::db::migrate(&config.database_url).await?;
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    let loaded = crate::pools::load_checked(
        &db,
        &mut redis,
        &config.redis_prefix,
        &configs,
        config.refill_chunk,
        rtp_change,
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
    Ok(())
}

/// `pool status ID`: a pool's counters, fairness state and memory, or its
/// sub-pools' counters for a sharded pool.
async fn pool_status(config: &Config, id: &str, json: bool) -> anyhow::Result<()> {
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    let keys = PoolKeys::new(&config.redis_prefix, id);
    let whole = crate::pools::status(&mut redis, &config.redis_prefix, id)
        .await?
        .with_context(|| format!("no pool named {id}"))?;
    if !whole.shards.is_empty() {
        return print_shards(&whole, json);
    }
    let status = whole.total;
    let fair = lucky_gift::fair_state(&mut redis, &keys).await?;
    if json {
        let mut value = serde_json::to_value(&status)?;
        value["fairness"] = fairness_json(&fair);
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_counters(&status, None);
        println!("drawing batch  {}", fair.drawing);
        for (g, version, commitment) in &fair.committed {
            println!("committed      batch {g} (config v{version}): sha256(seed) = {commitment}");
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
    Ok(())
}

/// `pool refill ID`: makes the current batch (of each sub-pool) due and
/// asks the refill worker for the next one.
async fn pool_refill(config: &Config, id: &str) -> anyhow::Result<()> {
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    let status = crate::pools::status(&mut redis, &config.redis_prefix, id)
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
    Ok(())
}

/// A pool's fairness state with named fields (`pool status --json`).
fn fairness_json(fair: &lucky_gift::FairState) -> serde_json::Value {
    let committed: Vec<_> = fair
        .committed
        .iter()
        .map(|(generation, version, commitment)| {
            serde_json::json!({"generation": generation, "version": version, "commitment": commitment})
        })
        .collect();
    let revealed = fair.last_revealed.as_ref().map(|(generation, version, seed)| {
        serde_json::json!({"generation": generation, "version": version, "seed": seed})
    });
    serde_json::json!({"drawing": fair.drawing, "committed": committed, "last_revealed": revealed})
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
            let loaded =
                crate::kinds::lottery::load(&db, &mut redis, &config.redis_prefix, &activities)
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
                let prizes: Vec<_> = stats
                    .prizes
                    .iter()
                    .map(|(prize, awarded, left)| {
                        serde_json::json!({"prize": prize, "awarded": awarded, "stock_left": left})
                    })
                    .collect();
                let out = serde_json::json!({"activity": stats.activity, "day": stats.day,
                    "pv": stats.pv, "uv": stats.uv, "prizes": prizes});
                println!("{}", serde_json::to_string_pretty(&out)?);
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
