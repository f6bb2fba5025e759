//! `prizepool bench`: the fleet's throughput, latency and cost, measured
//! against the machine's own ceilings in the same run.
//!
//! Ceilings: the draw script of the run's kind and storage in a tight
//! multiplexed Redis loop (and a trivial script on the same pool, to price
//! the script itself), and a
//! raw RabbitMQ round trip (publish with windowed confirms → consume → ack)
//! through a quorum queue. Then, for each draw-worker count, the fleet runs
//! as separate processes: a closed loop at full speed, then an open loop at
//! half that rate. Results go to `results/<time>/` and `results/latest/` as
//! JSON, Markdown and an SVG plot.

mod ceilings;
mod fleet;
mod plan;
mod report;
mod stats;

use std::{sync::Arc, time::Duration};

use anyhow::Context;

use stats::Latencies;

use prizepool::{
    amqp::rpc::RpcClient,
    client::{Client, ClientConfig},
    config::Config,
    kinds::{
        lucky_gift::{self, PoolConfig, StockOutcome, Storage},
        red_packet,
    },
    messages::{RedPacketCreate, SettleRequest},
    redis_conn::RedisConn,
    scripts::{PoolKeys, Scripts},
};

/// The prize kind a run draws from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub(crate) enum BenchKind {
    LuckyGift,
    RedPacket,
    Lottery,
}

/// Options of `prizepool bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Draw-worker counts to run, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    workers: Vec<usize>,
    /// Seconds of each load phase.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Simulated users.
    #[arg(long, default_value_t = 10_000)]
    users: u64,
    /// Draws in flight in the closed loop.
    #[arg(long, default_value_t = 512)]
    in_flight: usize,
    /// Open-loop rate in draws/s instead of the closed loop (0: closed loop,
    /// then an open loop at half the rate it reached).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Prizes per lucky-gift draw.
    #[arg(long, default_value_t = 10)]
    count: u32,
    /// Prize kind to draw.
    #[arg(long, value_enum, default_value_t = BenchKind::LuckyGift)]
    kind: BenchKind,
    /// Storage of the lucky-gift pool under load.
    #[arg(long, default_value = "list")]
    storage: String,
    /// Skip the slow one-off measurements (pool-size flatness, 3M-prize stocking).
    #[arg(long)]
    quick: bool,
    /// Requests claimed and answered to measure what a remembered result
    /// costs (default 1,000,000; 100,000 with `--quick`).
    #[arg(long)]
    results: Option<u64>,
    /// Measure nothing: print what a peak of RATE draws/s (for SECONDS, or
    /// steady) needs, from the costs of an earlier run (`--plan-from`).
    #[arg(long, value_name = "RATE[:SECONDS]")]
    plan: Option<plan::Peak>,
    /// The report a plan is made from.
    #[arg(long, default_value = "results/latest/report.json")]
    plan_from: std::path::PathBuf,
    /// Cores of one node, for the plan.
    #[arg(long, default_value_t = 16.0)]
    node_cores: f64,
    /// Share of each core a part may use at the peak, for the plan.
    #[arg(long, default_value_t = 0.6)]
    utilisation: f64,
    /// Memory one Redis master may fill, in GB, for the plan.
    #[arg(long, default_value_t = 25.0)]
    redis_master_gb: f64,
    /// Draws per message: drive the fleet through the library's batching
    /// client (`prizepool::client`) with batches of at most K draws. Several
    /// sizes, comma separated (`--batch 1,10,50,100`), sweep them: one run
    /// per size and worker count, with a table and `batch.svg`. Without it,
    /// each draw is one `draw` message from a plain request/reply client.
    #[arg(long, value_name = "K", value_delimiter = ',')]
    batch: Vec<usize>,
    /// The batching client's linger: how long a batch waits for more draws
    /// after its first.
    #[arg(long, default_value_t = 2.0)]
    linger_ms: f64,
    /// Where reports are written.
    #[arg(long, default_value = "results")]
    out: std::path::PathBuf,
}

fn pool_config(
    id: &str,
    storage: Storage,
    combos: &[(&str, &[(u64, u64)])],
    refill_at: f64,
) -> PoolConfig {
    PoolConfig {
        id: id.to_owned(),
        unit_price: 100,
        storage,
        refill_at,
        max_count: 1000,
        asset: "coin".into(),
        jackpot: Some(lucky_gift::config::Jackpot {
            min_multiplier: 5000,
            daily_consumption_threshold: 5_000_000,
        }),
        combos: combos
            .iter()
            .map(|(id, stock)| lucky_gift::config::Combo {
                id: (*id).to_owned(),
                stock: stock.to_vec(),
            })
            .collect(),
        shards: 1,
    }
}

/// The SPEC's combo, scaled by `k`.
fn spec_combos(k: u64) -> Vec<(String, Vec<(u64, u64)>)> {
    (1..=3)
        .map(|c| {
            (
                format!("c{c}"),
                vec![
                    (0, 29994 * k),
                    (10, 293 * k),
                    (50, 139 * k),
                    (500, 27 * k),
                    (5000, k),
                ],
            )
        })
        .collect()
}

fn borrow(combos: &[(String, Vec<(u64, u64)>)]) -> Vec<(&str, &[(u64, u64)])> {
    combos
        .iter()
        .map(|(id, s)| (id.as_str(), s.as_slice()))
        .collect()
}

/// This run's id. Every pool, packet and activity the run creates is named
/// `<what>-<run>-<n>`, so its Redis keys can be found and removed at the end.
fn run_id() -> &'static str {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    RUN.get_or_init(|| ulid::Ulid::new().to_string().to_lowercase())
}

fn unique(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{}-{n}", run_id())
}

/// The patterns the Redis keys of this run match: every key of the run
/// lives under a key prefix of its own ([`run`]), its pools' and the claim
/// stores of its request ids alike.
fn run_keys(config: &Config) -> [String; 1] {
    [format!("{}:*", config.redis_prefix)]
}

/// Keys looked at per `SCAN` step of the cleanup. A step of 10,000 kept
/// Redis busy for 20 ms (and the `UNLINK` of what it found for 21–26 ms,
/// slow log of a full run); with 1,000, no step of the next full run's
/// cleanup reached the slow log's 10 ms, so the server's other clients
/// never wait long behind it.
const CLEANUP_SCAN_COUNT: u64 = 1_000;

/// Removes every Redis key of the pools this run created: their prizes,
/// result keys and counters (millions of keys and hundreds of megabytes
/// after a full run, which would otherwise slow the next run down). The
/// ledger entries stay in Postgres, like any other.
/// `None` on a Redis Cluster, which has no single keyspace to scan.
async fn remove_run_keys(config: &Config) -> anyhow::Result<Option<u64>> {
    let RedisConn::Single(mut conn) = prizepool::redis_conn::connect(&config.redis_url).await?
    else {
        return Ok(None);
    };
    let mut removed = 0u64;
    for pattern in run_keys(config) {
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(CLEANUP_SCAN_COUNT)
                .query_async(&mut conn)
                .await?;
            if !keys.is_empty() {
                removed += redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async::<u64>(&mut conn)
                    .await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(Some(removed))
}

/// Runs the benchmark and writes its reports.
pub(crate) async fn run(config: &Config, args: BenchArgs) -> anyhow::Result<()> {
    if let Some(peak) = args.plan {
        let text = std::fs::read_to_string(&args.plan_from)
            .with_context(|| format!("reading {}", args.plan_from.display()))?;
        let report: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", args.plan_from.display()))?;
        let shape = plan::Shape {
            cores_per_node: args.node_cores,
            utilisation: args.utilisation,
            gb_per_redis_master: args.redis_master_gb,
            result_ttl_s: config.result_ttl.as_secs_f64(),
        };
        println!("{}", plan::plan(&report, peak, shape)?);
        return Ok(());
    }
    // The run's keys, its workers' included, live under a prefix of its own,
    // so the cleanup finds them all and removes nothing else.
    let config = &Config {
        redis_prefix: format!("{}-bench-{}", config.redis_prefix, run_id()),
        ..config.clone()
    };
    // Ctrl-C or SIGTERM stops the fleet (dropped with `measure`) and still
    // removes what the run created.
    let interrupted = prizepool::shutdown::signal();
    let result = tokio::select! {
        result = measure(config, args) => result,
        _ = interrupted.cancelled() => Err(anyhow::anyhow!("interrupted; no report written")),
    };
    match remove_run_keys(config).await {
        Ok(Some(n)) => println!("removed the run's {n} Redis keys"),
        Ok(None) => println!(
            "on a Redis Cluster the run's keys stay: delete the keys matching {} on each node",
            run_keys(config).join(" and ")
        ),
        Err(error) => eprintln!("could not remove the run's Redis keys: {error:#}"),
    }
    result
}

async fn measure(config: &Config, args: BenchArgs) -> anyhow::Result<()> {
    let storage = match args.storage.as_str() {
        "list" => Storage::List,
        "sparse" => Storage::Sparse,
        other => anyhow::bail!("unknown storage {other:?}"),
    };
    let svc = Services {
        config,
        db: prizepool::db::migrate(&config.database_url).await?,
        redis: prizepool::redis_conn::connect(&config.redis_url).await?,
        scripts: Scripts::new(),
    };
    let Services { redis, .. } = &svc;
    let mut rep = report::Report::new(&args, storage, config);
    // The topology must exist before the first publish.
    RpcClient::connect(config).await?.close().await;
    // Flatness and the stall probe first, on a keyspace the ceiling passes
    // have not yet filled with result keys.
    if !args.quick {
        println!("pool-size flatness (1 thousand vs 10 million prizes)");
        rep.flatness = Some(flatness(&svc).await?);
        println!("stocking stall (a 3-million-prize batch)");
        rep.stall = Some(stall(&svc).await?);
    }

    println!("ceilings");
    let ceiling_pool = pool_config(
        &unique("bench-ceiling"),
        Storage::List,
        &borrow(&spec_combos(7)),
        1.0,
    );
    svc.load(&ceiling_pool).await?;
    let keys = PoolKeys::new(&config.redis_prefix, &ceiling_pool.id);
    rep.memory.list_bytes_per_prize = list_bytes_per_prize(redis, &keys).await?;
    let results = args
        .results
        .unwrap_or(if args.quick { 100_000 } else { 1_000_000 });
    println!("remembered results ({results})");
    let award = stored_award(&svc, &keys).await?;
    rep.memory.results = remembered_results(&svc, results, &award).await?;
    println!(
        "  {:.1} bytes per result (claim {:.1}, answer {:.1})",
        rep.memory.results.total_bytes,
        rep.memory.results.claim_bytes,
        rep.memory.results.answer_bytes
    );
    (
        rep.memory.sparse_bytes_per_nonzero,
        rep.memory.sparse_bytes_for_zeros,
    ) = sparse_memory(&svc).await?;
    use ceilings::{Caller, Pass, Step};
    let pass = |step, caller| Pass {
        step,
        concurrency: 64,
        duration: Duration::from_secs(CEILING_PASS_S),
        caller,
    };
    let trivial = Step::LuckyGift {
        keys,
        storage: Storage::List,
        count: args.count,
    };
    rep.ceilings.redis_trivial =
        ceilings::redis_draws(&config.redis_url, pass(trivial, Caller::Trivial)).await?;
    // Each drawing pass gets a fresh pool big enough to last it; the two
    // callers alternate and each keeps its best pass, so neither pays for
    // the state the other left behind.
    let mut lottery = None;
    for caller in [Caller::Raw, Caller::Wrapper, Caller::Raw, Caller::Wrapper] {
        let step = match args.kind {
            BenchKind::LuckyGift => ceiling_pool_step(&svc, storage, args.count).await?,
            BenchKind::RedPacket => {
                let shares = packet_shares(args.users);
                let grabs = 40_000 * CEILING_PASS_S;
                let packets = svc
                    .red_packets(&unique("bench-ceiling"), shares, grabs.div_ceil(shares))
                    .await?;
                Step::RedPacket {
                    packets: Arc::new(
                        packets
                            .iter()
                            .map(|p| PoolKeys::new(&config.redis_prefix, p))
                            .collect(),
                    ),
                    shares,
                }
            }
            // A lottery never runs out (its consolation prize is unlimited):
            // one activity serves every pass.
            BenchKind::Lottery => match &lottery {
                Some(step) => Step::clone(step),
                None => {
                    let id = unique("bench-ceiling");
                    svc.lottery(&id, args.users).await?;
                    let step = Step::Lottery {
                        keys: PoolKeys::new(&config.redis_prefix, &id),
                        strategy: prizepool::kinds::lottery::strategy("wheel")
                            .context("the wheel strategy is registered")?,
                        users: args.users,
                    };
                    lottery = Some(step.clone());
                    step
                }
            },
        };
        let rate = ceilings::redis_draws(&config.redis_url, pass(step, caller)).await?;
        let best = match caller {
            Caller::Raw => &mut rep.ceilings.redis_raw,
            _ => &mut rep.ceilings.redis_draw,
        };
        if rate.per_s > best.per_s {
            *best = rate;
        }
    }
    if let BenchKind::LuckyGift = args.kind {
        // The same step as the workers coalesce it, two passes on fresh
        // pools, the best kept like the others.
        let mut best = ceilings::Rate::default();
        for _ in 0..2 {
            let step = ceiling_pool_step(&svc, storage, args.count).await?;
            let caller = Caller::Coalesced(report::COALESCED);
            let rate = ceilings::redis_draws(&config.redis_url, pass(step, caller)).await?;
            if rate.per_s > best.per_s {
                best = rate;
            }
        }
        println!(
            "  redis: the draw step coalesced, {} draws a call: {:.0} draws/s",
            report::COALESCED,
            best.per_s
        );
        rep.ceilings.redis_coalesced = Some(best);
    }
    println!(
        "  redis: raw draw script {:.0}/s, as workers call it {:.0}/s, trivial script {:.0}/s",
        rep.ceilings.redis_raw.per_s,
        rep.ceilings.redis_draw.per_s,
        rep.ceilings.redis_trivial.per_s
    );
    rep.ceilings.amqp = ceilings::amqp_round_trip(
        config,
        160,
        512,
        Duration::from_secs(args.duration.min(10)),
        None,
    )
    .await?;
    println!(
        "  rabbitmq: {:.0} msg/s, p99 {:.2} ms",
        rep.ceilings.amqp.per_s, rep.ceilings.amqp.latency.p99_ms
    );

    // No --batch: one run per worker count with single draws. With it, one
    // run per worker count and batch size, through the batching client.
    let batches: Vec<Option<usize>> = if args.batch.is_empty() {
        vec![None]
    } else {
        args.batch.iter().map(|&k| Some(k.max(1))).collect()
    };
    for &n in &args.workers {
        for &batch in &batches {
            match batch {
                Some(k) => println!("fleet with {n} draw workers, batches of up to {k} draws"),
                None => println!("fleet with {n} draw workers"),
            }
            let run = fleet_run(&svc, &args, storage, n, batch).await?;
            println!(
                "  {:.0} draws/s, {:.0} prizes/s, p99 {:.1} ms; at half rate p99 {:.1} ms (rabbitmq {:.1} ms)",
                run.max.draws_per_s, run.max.prizes_per_s, run.max.latency.p99_ms, run.half.latency.p99_ms, run.amqp_at_half.latency.p99_ms
            );
            if let Some(per) = run.draws_per_message {
                println!("  {per:.1} draws per message");
            }
            rep.runs.push(run);
        }
    }
    let dir = rep.write(&args.out).context("writing the reports")?;
    println!("\n{}", rep.markdown());
    println!("reports written to {}", dir.display());
    Ok(())
}

/// The services a run talks to, opened once.
struct Services<'a> {
    config: &'a Config,
    db: sqlx::PgPool,
    redis: prizepool::redis_conn::RedisConn,
    scripts: Scripts,
}

impl Services<'_> {
    /// Loads `pool` (stocking its first batch).
    async fn load(&self, pool: &PoolConfig) -> anyhow::Result<()> {
        let mut conn = self.redis.clone();
        prizepool::pools::load(
            &self.db,
            &mut conn,
            &self.scripts,
            &self.config.redis_prefix,
            std::slice::from_ref(pool),
            self.config.refill_chunk,
        )
        .await?;
        Ok(())
    }

    /// Creates `count` red packets `<id>-<n>` of `shares` shares each, all
    /// funded by one top-up, and returns their ids.
    async fn red_packets(&self, id: &str, shares: u64, count: u64) -> anyhow::Result<Vec<String>> {
        let packets: Vec<String> = (0..count).map(|n| format!("{id}-{n}")).collect();
        // Shares of 1 to about 200 coins, like small packets in a chat group.
        let total = shares as i64 * 100;
        let sender = 990_000_001;
        let topup = SettleRequest::new(
            format!("topup:{id}"),
            sender,
            "coin",
            total * count as i64,
            "topup",
            serde_json::json!({ "pool": id }),
        );
        prizepool::settle::apply(&self.db, std::slice::from_ref(&topup)).await?;
        let mut conn = self.redis.clone();
        for packet in &packets {
            let create = RedPacketCreate {
                packet_id: packet.clone(),
                sender,
                total,
                count: shares as i64,
                min: 1,
                expires_in_s: 3600,
                asset: "coin".into(),
            };
            red_packet::create(
                &self.db,
                &mut conn,
                &self.scripts,
                &self.config.redis_prefix,
                &create,
            )
            .await?;
        }
        Ok(packets)
    }

    /// Loads a running wheel activity `id` and grants each of `users` users a
    /// million chances.
    async fn lottery(&self, id: &str, users: u64) -> anyhow::Result<()> {
        let text = format!(
            "[[activities]]\nid = \"{id}\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\n\
             prizes = [ {{ id = \"ipad\", weight = 1, stock = 100 }}, {{ id = \"coupon-5\", weight = 100, stock = 100000 }} ]\n\
             consolation = {{ id = \"points-10\", weight = 500 }}\n",
            (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339(),
            (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339(),
        );
        let activities = prizepool::kinds::lottery::parse_file(&text)?;
        let mut conn = self.redis.clone();
        let prefix = &self.config.redis_prefix;
        prizepool::kinds::lottery::load(&self.db, &mut conn, &self.scripts, prefix, &activities)
            .await?;
        let keys = PoolKeys::new(prefix, id);
        for user in 1..=users {
            prizepool::kinds::lottery::grant(
                &mut conn,
                &self.scripts,
                &keys,
                id,
                &format!("bench-{user}"),
                user as i64,
                1_000_000,
            )
            .await?;
        }
        Ok(())
    }
}

/// Seconds of each Redis ceiling pass.
const CEILING_PASS_S: u64 = 3;

/// Shares of each red packet a run grabs: one per simulated user, within
/// the largest packet allowed.
fn packet_shares(users: u64) -> u64 {
    users.clamp(1, u64::from(red_packet::split::MAX_SHARES))
}

async fn list_bytes_per_prize(
    redis: &prizepool::redis_conn::RedisConn,
    keys: &PoolKeys,
) -> anyhow::Result<f64> {
    let mut conn = redis.clone();
    let bytes = lucky_gift::storage_bytes(&mut conn, keys, Storage::List).await?;
    let len: u64 = redis::cmd("LLEN")
        .arg(keys.queue())
        .query_async(&mut conn)
        .await?;
    Ok(bytes as f64 / len.max(1) as f64)
}

/// Redis `used_memory`, in bytes.
async fn used_memory(conn: &mut prizepool::redis_conn::RedisConn) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .context("INFO memory has no used_memory")
}

/// The stored answer (fingerprint bytes left out) of one real count-1 draw
/// from the lucky-gift pool behind `keys`, as the draw worker makes it.
/// A draw step of `count` prizes on a fresh lucky-gift pool in `storage`,
/// big enough to last a ceiling pass.
async fn ceiling_pool_step(
    svc: &Services<'_>,
    storage: Storage,
    count: u32,
) -> anyhow::Result<ceilings::Step> {
    let pool = pool_config(
        &unique("bench-ceiling"),
        storage,
        &borrow(&spec_combos(20)),
        1.0,
    );
    svc.load(&pool).await?;
    Ok(ceilings::Step::LuckyGift {
        keys: PoolKeys::new(&svc.config.redis_prefix, &pool.id),
        storage,
        count,
    })
}

async fn stored_award(svc: &Services<'_>, keys: &PoolKeys) -> anyhow::Result<Vec<u8>> {
    let mut conn = svc.redis.clone();
    let id = unique("award");
    let ttl = svc.config.result_ttl.as_secs();
    let tokens = prizepool::kinds::Tokens::new(
        &svc.config.redis_prefix,
        "rq",
        &id,
        prizepool::kinds::fingerprint("bench", &[]),
        ttl,
    );
    lucky_gift::draw_once(
        &mut conn,
        &svc.scripts,
        keys,
        Storage::List,
        &id,
        1,
        ttl,
        &tokens.answer,
    )
    .await?;
    let (_, answer) =
        prizepool::kinds::answer::stored(&mut conn, &svc.scripts, &keys.results(), &tokens, false)
            .await?;
    let answer = answer.context("the draw stored no answer")?;
    Ok(answer.get(2..).unwrap_or_default().to_vec())
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
    let claim_sha = scripts.claim.prepare_invoke().load_async(&mut conn).await?;
    let answer_sha = scripts
        .remember_refusal
        .prepare_invoke()
        .load_async(&mut conn)
        .await?;
    let fingerprint = prizepool::kinds::fingerprint("bench", &[]);
    let ids: Vec<String> = (0..n).map(|i| unique(&format!("r{i}"))).collect();
    let mut memory = [used_memory(&mut conn).await?, 0, 0];
    let mut samples = [String::new(), String::new()];
    for (half, sha) in [&claim_sha, &answer_sha].into_iter().enumerate() {
        for chunk in ids.chunks(500) {
            let mut pipe = redis::pipe();
            for id in chunk {
                let tokens = prizepool::kinds::Tokens::new(
                    &svc.config.redis_prefix,
                    "rq",
                    id,
                    fingerprint,
                    ttl,
                );
                if half == 0 {
                    pipe.cmd("EVALSHA")
                        .arg(sha)
                        .arg(1)
                        .arg(&tokens.claim_store)
                        .arg(&tokens.claim)
                        .arg("claim")
                        .ignore();
                } else {
                    pipe.cmd("EVALSHA")
                        .arg(sha)
                        .arg(1)
                        .arg(&store)
                        .arg(&tokens.answer)
                        .arg(award)
                        .ignore();
                }
            }
            let _: () = pipe.query_async(&mut conn).await?;
        }
        memory[half + 1] = used_memory(&mut conn).await?;
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

/// Draw-step cost with 1 thousand vs 10 million prizes stocked.
async fn flatness(svc: &Services<'_>) -> anyhow::Result<report::Flatness> {
    let Services {
        config,
        redis,
        scripts,
        ..
    } = svc;
    let small = pool_config(
        &unique("bench-small"),
        Storage::List,
        &[("c1", &[(0, 990), (10, 10)])],
        1.0,
    );
    let big = pool_config(
        &unique("bench-big"),
        Storage::List,
        &[("c1", &[(0, 9_900_000), (10, 100_000)])],
        1.0,
    );
    svc.load(&small).await?;
    svc.load(&big).await?;
    let (sk, bk) = (
        PoolKeys::new(&config.redis_prefix, &small.id),
        PoolKeys::new(&config.redis_prefix, &big.id),
    );
    let table = lucky_gift::CodeTable::extend(None, &small);
    let mut small_rates = Vec::new();
    let mut big_rates = Vec::new();
    // Many short alternating passes, compared by their medians: one pass
    // takes about 30 ms, so a single preemption on a busy machine can move
    // it by a tenth (with 9 rounds, one full run read 1.13).
    for _ in 0..25 {
        // 960 single-prize draws each, 16 at a time; the small pool is restocked per round.
        small_rates.push(fixed_draws(redis, &sk, 960).await?);
        big_rates.push(fixed_draws(redis, &bk, 960).await?);
        let mut conn = redis.clone();
        let gen = lucky_gift::status(&mut conn, scripts, &sk, &small.id)
            .await?
            .map_or(0, |s| s.generation);
        lucky_gift::stock_next(&mut conn, scripts, &sk, &small, &table, gen, 4000, 30_000).await?;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (s, b) = (median(&mut small_rates), median(&mut big_rates));
    println!("  {s:.0} draws/s with 1k prizes, {b:.0} draws/s with 10M prizes");
    Ok(report::Flatness {
        small_per_s: s,
        big_per_s: b,
        ratio: b / s,
    })
}

async fn fixed_draws(
    redis: &prizepool::redis_conn::RedisConn,
    keys: &PoolKeys,
    n: usize,
) -> anyhow::Result<f64> {
    let scripts = Arc::new(Scripts::new());
    let started = std::time::Instant::now();
    let per_task = n / 16;
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (mut conn, keys, scripts) = (redis.clone(), keys.clone(), scripts.clone());
        tasks.push(tokio::spawn(async move {
            let fingerprint = prizepool::kinds::fingerprint("bench", &[]);
            for _ in 0..per_task {
                let id = ulid::Ulid::new().to_string();
                let token = prizepool::kinds::Tokens::new("bench", "rq", &id, fingerprint, 120);
                lucky_gift::draw_once(
                    &mut conn,
                    &scripts,
                    &keys,
                    Storage::List,
                    &id,
                    1,
                    120,
                    &token.answer,
                )
                .await?;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok((per_task * 16) as f64 / started.elapsed().as_secs_f64())
}

/// Longest time Redis stopped answering while a 3-million-prize batch was stocked.
async fn stall(svc: &Services<'_>) -> anyhow::Result<report::Stall> {
    let Services {
        config,
        redis,
        scripts,
        ..
    } = svc;
    let pool = pool_config(
        &unique("bench-stall"),
        Storage::List,
        &[("c1", &[(0, 2_970_000), (10, 30_000)])],
        1.0,
    );
    svc.load(&pool).await?;
    let keys = PoolKeys::new(&config.redis_prefix, &pool.id);
    let table = lucky_gift::CodeTable::extend(None, &pool);
    // A probe on its own connection, so it waits only for Redis itself.
    let client = redis::Client::open(config.redis_url.as_str())?;
    let mut probe = client.get_connection()?;
    let mut admin = client.get_multiplexed_async_connection().await?;
    let _: redis::RedisResult<()> = redis::cmd("CONFIG")
        .arg("SET")
        .arg("latency-monitor-threshold")
        .arg(1)
        .query_async(&mut admin)
        .await;
    let _: redis::RedisResult<()> = redis::cmd("LATENCY")
        .arg("RESET")
        .query_async(&mut admin)
        .await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    // Its own OS thread and a blocking connection: the probe must not wait
    // for this process's async tasks (the stocker keeps them busy).
    let prober = std::thread::spawn(move || {
        let mut lat = Latencies::default();
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            let t = std::time::Instant::now();
            let _: redis::RedisResult<String> = redis::cmd("PING").query(&mut probe);
            lat.record(t.elapsed());
        }
        lat
    });
    // Batch 2 is due as if a draw had taken batch 1's refill point (the
    // refill worker stocks only due batches).
    let mut conn = redis.clone();
    let _: () = redis::cmd("HSET")
        .arg(keys.meta())
        .arg("due")
        .arg(1)
        .query_async(&mut conn)
        .await?;
    let started = std::time::Instant::now();
    let outcome = lucky_gift::stock_next(
        &mut conn,
        scripts,
        &keys,
        &pool,
        &table,
        1,
        config.refill_chunk,
        60_000,
    )
    .await?;
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut lat = prober
        .join()
        .map_err(|_| anyhow::anyhow!("the probe thread panicked"))?;
    anyhow::ensure!(
        matches!(
            outcome,
            StockOutcome::Stocked {
                size: 3_000_000,
                ..
            }
        ),
        "unexpected stocking outcome {outcome:?}"
    );
    let latest: redis::RedisResult<Vec<(String, i64, i64, i64)>> = redis::cmd("LATENCY")
        .arg("LATEST")
        .query_async(&mut admin)
        .await;
    let monitor_max_ms = latest.ok().and_then(|rows| rows.iter().map(|r| r.3).max());
    let _: redis::RedisResult<()> = redis::cmd("CONFIG")
        .arg("SET")
        .arg("latency-monitor-threshold")
        .arg(0)
        .query_async(&mut admin)
        .await;
    let probe = lat.percentiles();
    println!("  stocked 3,000,000 prizes in {took:.2?}; probe PING max {:.2} ms, p99 {:.2} ms; LATENCY monitor max {monitor_max_ms:?} ms", probe.max_ms, probe.p99_ms);
    Ok(report::Stall {
        prizes: 3_000_000,
        seconds: took.as_secs_f64(),
        probe,
        latency_monitor_max_ms: monitor_max_ms,
    })
}

async fn fleet_run(
    svc: &Services<'_>,
    args: &BenchArgs,
    storage: Storage,
    workers: usize,
    batch: Option<usize>,
) -> anyhow::Result<report::Run> {
    let Services { config, db, .. } = svc;
    let id = unique("bench");
    // The ids whose ledger credits the run's rewards must add up to.
    let mut pools = vec![id.clone()];
    let make = match args.kind {
        BenchKind::LuckyGift => {
            let pool = pool_config(&id, storage, &borrow(&spec_combos(2)), 0.5);
            svc.load(&pool).await?;
            fleet::lucky_gift_requests(id.clone(), args.users, args.count)
        }
        BenchKind::RedPacket => {
            // Enough shares for the warm-up and the full-speed phase at up to
            // 40k grabs/s; the half-rate phase needs a quarter of that again.
            let shares = packet_shares(args.users);
            let grabs = 40_000 * (1 + args.duration * 3 / 2);
            pools = svc.red_packets(&id, shares, grabs.div_ceil(shares)).await?;
            fleet::red_packet_grabs(pools.clone(), shares)
        }
        BenchKind::Lottery => {
            svc.lottery(&id, args.users).await?;
            let (id, users) = (id.clone(), args.users);
            Arc::new(move |i| fleet::draw_request(&id, i, users, 1))
        }
    };
    let fleet = fleet::Fleet::start(config, workers).await?;
    // Two connections either way, so batching is the one difference.
    let clients = Arc::new(match batch {
        None => fleet::Driver::Single(vec![
            Arc::new(RpcClient::connect(config).await?),
            Arc::new(RpcClient::connect(config).await?),
        ]),
        Some(k) => {
            let mut clients = Vec::new();
            for _ in 0..2 {
                clients.push(
                    Client::connect(
                        ClientConfig::new(&config.amqp_url)
                            .connection_name("prizepool-bench")
                            .batch_size(k)
                            .linger(Duration::from_secs_f64(args.linger_ms.max(0.0) / 1000.0))
                            // Like the single draws: one attempt, a failure
                            // is counted, not retried.
                            .timeout(Duration::from_secs(30))
                            .retries(0)
                            .queue_capacity(args.in_flight.max(4096)),
                    )
                    .await?,
                );
            }
            fleet::Driver::Batching(clients)
        }
    });
    // Warm-up: connections, script cache, first refill.
    let warm = fleet::drive(
        &clients,
        make.clone(),
        Duration::from_secs(1),
        args.in_flight,
        None,
    )
    .await;

    let cpu_before = fleet.cpu();
    let services_before = stats::service_cpu();
    let own_before = stats::cpu_time(std::process::id()).unwrap_or_default();
    let duration = Duration::from_secs(args.duration);
    let rate = (args.rate > 0.0).then_some(args.rate);
    let messages_before = clients.messages();
    let phase = std::time::Instant::now();
    let max = fleet::drive(&clients, make.clone(), duration, args.in_flight, rate).await;
    let phase_s = phase.elapsed().as_secs_f64();
    let messages = clients
        .messages()
        .zip(messages_before)
        .map(|(after, before)| after.saturating_sub(before));
    let cpu_after = fleet.cpu();
    let services: Vec<report::ServiceCpu> = stats::service_cpu_since(&services_before)
        .into_iter()
        .map(|(name, cpu_s)| report::ServiceCpu { name, cpu_s })
        .collect();
    let own = stats::cpu_time(std::process::id())
        .unwrap_or_default()
        .saturating_sub(own_before);
    // Settlement lag: from the last reply until the ledger holds every reward.
    let lag_started = std::time::Instant::now();
    // The pool is new: its ledger total is what warm-up and load won.
    let expected = warm.reward + max.reward;
    let mut settled = prizepool::settle::credited(db, &pools, "coin").await?;
    while settled < expected && lag_started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(5)).await;
        settled = prizepool::settle::credited(db, &pools, "coin").await?;
    }
    let settle_lag_ms = lag_started.elapsed().as_secs_f64() * 1000.0;

    let half_rate = max.draws_per_s / 2.0;
    let half = fleet::drive(
        &clients,
        make.clone(),
        duration,
        args.in_flight.max(4096),
        Some(half_rate),
    )
    .await;
    if let Ok(clients) = Arc::try_unwrap(clients) {
        clients.close().await;
    }
    fleet.stop();
    let amqp_at_half =
        ceilings::amqp_round_trip(config, 160, 512, duration, Some(half_rate)).await?;

    let processes: Vec<report::ProcessCpu> = cpu_before
        .iter()
        .zip(&cpu_after)
        .map(|((name, pid, b), (_, _, a))| report::ProcessCpu {
            name: name.clone(),
            pid: *pid,
            cpu_s: a.saturating_sub(*b).as_secs_f64(),
        })
        .collect();
    let worker_cpu: f64 = processes.iter().map(|p| p.cpu_s).sum();
    let broker_cpu_per_draw_us = services
        .iter()
        .find(|s| s.name == "rabbitmq")
        .map(|s| s.cpu_s * 1e6 / max.ok.max(1) as f64);
    let cpu_budget = report::CpuBudget::new(
        services
            .iter()
            .map(|s| (s.name.to_owned(), s.cpu_s))
            .chain(processes.iter().map(|p| (p.name.clone(), p.cpu_s)))
            .chain([("load generator".to_owned(), own.as_secs_f64())]),
        max.ok,
        phase_s,
        report::cores(),
    );
    let sent = messages.unwrap_or(max.ok + max.rejected + max.failed);
    Ok(report::Run {
        batch,
        linger_ms: batch.map(|_| args.linger_ms),
        messages_per_s: sent as f64 / phase_s.max(f64::MIN_POSITIVE),
        draws_per_message: messages
            .map(|m| (max.ok + max.rejected + max.failed) as f64 / m.max(1) as f64),
        services,
        broker_cpu_per_draw_us,
        cpu_budget,
        draw_workers: workers,
        cpu_per_draw_us: worker_cpu * 1e6 / max.ok.max(1) as f64,
        load_generator_cpu_s: own.as_secs_f64(),
        ledger_matches: settled == expected,
        settle_lag_ms,
        max,
        half,
        amqp_at_half,
        processes,
    })
}
