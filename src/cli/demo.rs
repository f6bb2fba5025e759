//! `prizepool demo`: the whole fleet on the local services.
//!
//! Applies migrations, loads the example pool under a fresh id, starts two
//! draw workers, a refill worker and a settle worker (in this process, each
//! with its own broker connection, exactly as the binaries run them), sends
//! draws from simulated users, then prints a summary and checks that prizes
//! were conserved and the ledger matches the rewards.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::Context;
use futures_util::{stream, StreamExt};
use rand::Rng;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::{
    amqp::{self, rpc::RpcClient},
    config::Config,
    kinds::lucky_gift,
    ops::Health,
    scripts::PoolKeys,
};

/// Options of `prizepool demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Simulated users.
    #[arg(long, default_value_t = 20)]
    users: u32,
    /// Draws per user.
    #[arg(long, default_value_t = 40)]
    draws: u32,
    /// Largest `count` of one draw.
    #[arg(long, default_value_t = 100)]
    max_count: u32,
    /// Draw workers to start.
    #[arg(long, default_value_t = 2)]
    draw_workers: usize,
    /// Pool file whose first pool the demo loads (under a fresh id); a file
    /// that cannot be read is an error. Default: the built-in copy of
    /// `examples/pools.toml`.
    #[arg(long)]
    pool_file: Option<std::path::PathBuf>,
}

const EXAMPLE_POOLS: &str = include_str!("../../examples/pools.toml");

/// Runs the demo.
pub(crate) async fn run(config: &Config, args: DemoArgs) -> anyhow::Result<()> {
    println!("prizepool demo: migrations, one pool, {} draw workers + refill + settle, {} users x {} draws",
        args.draw_workers, args.users, args.draws);
    let db = crate::db::migrate(&config.database_url).await?;
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    let pool = load_pool(config, &db, &mut redis, &args).await?;
    let shutdown = CancellationToken::new();
    let workers = start_fleet(config, args.draw_workers, &shutdown).await?;

    let client = Arc::new(RpcClient::connect(config).await?);
    let started = std::time::Instant::now();
    let replies = call_all(&client, draw_requests(&pool, &args), 64).await;
    let tally = Tally::of(&replies);
    tally.print(&pool, started.elapsed());
    // Settlement runs behind the replies; wait for the ledger to catch up.
    let ledger_total = wait_for_ledger(&db, &pool.id, tally.total_reward).await?;
    let keys = PoolKeys::new(&config.redis_prefix, &pool.id);
    let status = lucky_gift::status(&mut redis, &keys, &pool.id)
        .await?
        .context("the demo pool vanished")?;
    let consistent = tally.check(&pool, &status, ledger_total);
    println!("redis            {}", persistence_line(&mut redis).await);

    let packet_ok = red_packet_demo(config, &db, &client).await?;
    let lottery_ok = lottery_demo(config, &db, &client).await?;
    shutdown.cancel();
    for w in workers {
        w.await??;
    }
    if let Ok(client) = Arc::try_unwrap(client) {
        client.close().await;
    }
    if !consistent || tally.failed > 0 || !packet_ok || !lottery_ok {
        anyhow::bail!("the demo found an inconsistency");
    }
    Ok(())
}

/// Loads the first pool of the pool file (or of `examples/pools.toml`)
/// under a fresh `demo-` id.
async fn load_pool(
    config: &Config,
    db: &sqlx::PgPool,
    redis: &mut crate::redis_conn::RedisConn,
    args: &DemoArgs,
) -> anyhow::Result<lucky_gift::PoolConfig> {
    let text = match &args.pool_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading the pool file {}", path.display()))?,
        None => EXAMPLE_POOLS.to_owned(),
    };
    let mut pool = lucky_gift::parse_file(&text)?
        .into_iter()
        .next()
        .context("the pool file defines no pool")?;
    pool.id = format!("demo-{}", ulid::Ulid::new().to_string().to_lowercase());
    crate::pools::load(
        db,
        redis,
        &config.redis_prefix,
        std::slice::from_ref(&pool),
        config.refill_chunk,
    )
    .await?;
    println!(
        "loaded pool {} (batch of {} prizes)",
        pool.id,
        pool.batch_size()
    );
    Ok(pool)
}

/// A worker task of the demo's fleet.
type WorkerTask = tokio::task::JoinHandle<anyhow::Result<()>>;

/// Starts `draw_workers` draw workers, a refill and a settle worker in
/// this process, and waits (up to 30 s) until every one is ready.
async fn start_fleet(
    config: &Config,
    draw_workers: usize,
    shutdown: &CancellationToken,
) -> anyhow::Result<Vec<WorkerTask>> {
    let mut workers = Vec::new();
    let mut healths = Vec::new();
    for _ in 0..draw_workers {
        let (c, s, h) = (config.clone(), shutdown.clone(), Health::default());
        healths.push(h.clone());
        workers.push(tokio::spawn(async move { crate::draw::run(c, h, s).await }));
    }
    let (c, s, h) = (config.clone(), shutdown.clone(), Health::default());
    healths.push(h.clone());
    workers.push(tokio::spawn(
        async move { crate::refill::run(c, h, s).await },
    ));
    let (c, s, h) = (config.clone(), shutdown.clone(), Health::default());
    healths.push(h.clone());
    workers.push(tokio::spawn(
        async move { crate::settle::run(c, h, s).await },
    ));
    let ready_by = tokio::time::Instant::now() + Duration::from_secs(30);
    while !healths.iter().all(Health::is_ready) {
        anyhow::ensure!(
            tokio::time::Instant::now() < ready_by,
            "the workers did not become ready within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(workers)
}

/// The demo's draws: `args.draws` per user, each of a random count.
fn draw_requests(pool: &lucky_gift::PoolConfig, args: &DemoArgs) -> Vec<Value> {
    let mut requests = Vec::new();
    let mut rng = rand::rng();
    for user in 1..=i64::from(args.users) {
        for _ in 0..args.draws {
            requests.push(json!({
                "type": "draw", "request_id": ulid::Ulid::new().to_string(), "pool": pool.id,
                "user_id": user, "count": rng.random_range(1..=args.max_count.min(pool.max_count)),
            }));
        }
    }
    requests
}

/// What the lucky-gift draws of the demo answered.
#[derive(Debug, Default)]
struct Tally {
    ok: u64,
    /// Refusals by error code.
    rejected: BTreeMap<String, u64>,
    /// Draws without a reply.
    failed: u64,
    prizes: u64,
    by_multiplier: BTreeMap<u64, u64>,
    total_reward: i64,
}

impl Tally {
    /// The tally of `replies`.
    fn of(replies: &[anyhow::Result<Value>]) -> Self {
        let mut tally = Self::default();
        for reply in replies {
            match reply {
                Ok(r) if r["status"] == "ok" => {
                    tally.ok += 1;
                    tally.total_reward += r["reward"].as_i64().unwrap_or(0);
                    for p in r["prizes"].as_array().into_iter().flatten() {
                        tally.prizes += 1;
                        *tally
                            .by_multiplier
                            .entry(p["multiplier"].as_u64().unwrap_or(0))
                            .or_default() += 1;
                    }
                }
                Ok(r) => {
                    *tally
                        .rejected
                        .entry(r["error"]["code"].as_str().unwrap_or("?").to_owned())
                        .or_default() += 1
                }
                Err(_) => tally.failed += 1,
            }
        }
        tally
    }

    /// Prints the draws, the prizes and the rewards of the tally, the
    /// draws answered in `elapsed`.
    fn print(&self, pool: &lucky_gift::PoolConfig, elapsed: Duration) {
        let replies = self.ok + self.rejected.values().sum::<u64>() + self.failed;
        println!();
        println!("== lucky gift ==");
        println!(
            "draws            {} ok, {} rejected {:?}, {} without reply, in {:.2?} ({:.0} draws/s)",
            self.ok,
            self.rejected.values().sum::<u64>(),
            self.rejected,
            self.failed,
            elapsed,
            replies as f64 / elapsed.as_secs_f64()
        );
        println!("prizes drawn     {}", self.prizes);
        println!(
            "by multiplier    {}",
            self.by_multiplier
                .iter()
                .map(|(m, n)| format!("{m}x: {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!("total reward     {} {}", self.total_reward, pool.asset);
    }

    /// Prints the ledger's total and the pool's counters, and checks that
    /// the pool conserved its prizes and the ledger holds every reward.
    fn check(
        &self,
        pool: &lucky_gift::PoolConfig,
        status: &lucky_gift::PoolStatus,
        ledger_total: i64,
    ) -> bool {
        let total_reward = self.total_reward;
        println!("ledger total     {ledger_total} {}", pool.asset);
        println!("pool             {} batches stocked, {} prizes stocked, {} drawn, {} in pool ({} jackpots waiting)",
            status.generation, status.stocked, status.drawn, status.in_pool, status.held_jackpots);
        let conserved =
            status.stocked == status.drawn + status.in_pool && status.drawn == self.prizes;
        let settled = ledger_total == total_reward;
        println!(
            "conservation     stocked {} = drawn {} + in pool {}: {}",
            status.stocked,
            status.drawn,
            status.in_pool,
            if conserved { "OK" } else { "FAILED" }
        );
        println!(
            "ledger check     ledger {ledger_total} = rewards {total_reward}: {}",
            if settled { "OK" } else { "FAILED" }
        );
        conserved && settled
    }
}

/// The summary's line on Redis persistence: what a crash of this Redis
/// could lose (the workers' start-up warning says the same; the demo's log
/// filter leaves it to this line).
async fn persistence_line(redis: &mut crate::redis_conn::RedisConn) -> String {
    match crate::redis_conn::persistence(redis).await {
        crate::redis_conn::Persistence::Durable => {
            "persists every step before answering (zero loss)".to_owned()
        }
        crate::redis_conn::Persistence::Lossy(why)
        | crate::redis_conn::Persistence::Unknown(why) => {
            format!("not zero-loss: {why} (fine for a demo; docs/design.md, Durability)")
        }
    }
}

async fn wait_for_ledger(db: &sqlx::PgPool, pool: &str, expected: i64) -> anyhow::Result<i64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let total = crate::ledger::pool_total(db, pool, "coin").await?;
        if total == expected || tokio::time::Instant::now() > deadline {
            return Ok(total);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A red packet: funded, created, grabbed by a crowd with repeat grabbers,
/// then closed by its expiry timer with the rest refunded.
async fn red_packet_demo(
    config: &Config,
    db: &sqlx::PgPool,
    client: &Arc<RpcClient>,
) -> anyhow::Result<bool> {
    let t = Duration::from_secs(30);
    let sender = 900_001;
    let packet = format!("rp-{}", ulid::Ulid::new().to_string().to_lowercase());
    let before = balance(db, sender).await?;
    let topup = json!({"type": "settle", "entry_id": format!("topup:{packet}"), "account": sender, "asset": "coin",
        "amount": 10_000, "reason": "topup", "ref": {"pool": "demo-topups"}});
    client.call(amqp::SETTLE.routing_key, &topup, t).await?;
    let create = json!({"type": "redpacket.create", "packet_id": packet, "sender": sender, "total": 8_800,
        "count": 50, "min": 10, "expires_in_s": 3});
    let created = client.call(amqp::REFILL.routing_key, &create, t).await?;
    anyhow::ensure!(
        created["status"] == "ok",
        "red packet not created: {created}"
    );
    let (outcomes, grabbed) = grab_crowd(client, &packet).await;
    let status = wait_closed(config, &packet).await?;
    // The refund settles through the queue; wait for it.
    let expected = before + 10_000 - 8_800 + status.refunded;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut after = balance(db, sender).await?;
    while after != expected && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = balance(db, sender).await?;
    }
    let conserved = status.total == status.grabbed + status.refunded + status.in_packet
        && grabbed == status.grabbed;
    println!();
    println!("== red packet ==");
    println!("packet           {packet}: 8800 coin in 50 shares, expires in 3 s");
    println!("80 grabs by 40   {outcomes:?}");
    println!(
        "after expiry     closed {}, grabbed {} in {} shares, refunded {} to the sender",
        status.closed, status.grabbed, status.grabbed_count, status.refunded
    );
    println!(
        "conservation     escrowed {} = grabbed {} + refunded {} + in packet {}: {}",
        status.total,
        status.grabbed,
        status.refunded,
        status.in_packet,
        if conserved { "OK" } else { "FAILED" }
    );
    println!(
        "sender balance   {after} (expected {expected}): {}",
        if after == expected { "OK" } else { "FAILED" }
    );
    Ok(status.closed && conserved && after == expected)
}

/// 40 users grabbing `packet`, each tapping twice, all at once: how many
/// grabs ended how (`ok` or the refusal's code), and what they took.
async fn grab_crowd(client: &Arc<RpcClient>, packet: &str) -> (BTreeMap<String, u64>, i64) {
    let grabs: Vec<Value> = call_all(
        client,
        (0..80).map(|i| {
            json!({"type": "draw", "request_id": ulid::Ulid::new().to_string(),
            "pool": packet, "user_id": 1 + i % 40, "count": 1})
        }),
        40,
    )
    .await
    .into_iter()
    .filter_map(Result::ok)
    .collect();
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut grabbed = 0;
    for g in &grabs {
        let key = if g["status"] == "ok" {
            "ok".to_owned()
        } else {
            g["error"]["code"].as_str().unwrap_or("?").to_owned()
        };
        *outcomes.entry(key).or_default() += 1;
        grabbed += g["reward"].as_i64().unwrap_or(0);
    }
    (outcomes, grabbed)
}

/// The status of `packet` once its expiry closed it, or as it is after
/// 20 s.
async fn wait_closed(
    config: &Config,
    packet: &str,
) -> anyhow::Result<crate::kinds::red_packet::PacketStatus> {
    let keys = PoolKeys::new(&config.redis_prefix, packet);
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let s = crate::kinds::red_packet::status(&mut redis, &keys)
            .await?
            .context("the packet vanished")?;
        if s.closed || tokio::time::Instant::now() > deadline {
            return Ok(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A lottery activity: chances granted, a burst of draws, PV/UV and prizes.
async fn lottery_demo(
    config: &Config,
    db: &sqlx::PgPool,
    client: &Arc<RpcClient>,
) -> anyhow::Result<bool> {
    let t = Duration::from_secs(30);
    let text = include_str!("../../examples/activities.toml");
    let mut activity = crate::kinds::lottery::parse_file(text)?
        .into_iter()
        .next()
        .context("no activity in the example")?;
    activity.id = format!("lottery-{}", ulid::Ulid::new().to_string().to_lowercase());
    activity.starts_at = chrono::Utc::now() - chrono::Duration::hours(1);
    activity.ends_at = chrono::Utc::now() + chrono::Duration::days(1);
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    crate::kinds::lottery::load(
        db,
        &mut redis,
        &config.redis_prefix,
        std::slice::from_ref(&activity),
    )
    .await?;
    for user in 1..=30 {
        let grant = json!({"type": "lottery.grant", "grant_id": format!("{}-{user}", activity.id), "activity": activity.id,
            "user_id": user, "chances": 3});
        client.call(amqp::DRAW.routing_key, &grant, t).await?;
    }
    let draws: Vec<Value> = call_all(
        client,
        (0..100).map(|i| {
            json!({"type": "draw", "request_id": ulid::Ulid::new().to_string(),
            "pool": activity.id, "user_id": 1 + i % 30, "count": 1})
        }),
        32,
    )
    .await
    .into_iter()
    .filter_map(Result::ok)
    .collect();
    let mut won: BTreeMap<String, u64> = BTreeMap::new();
    let mut refused: BTreeMap<String, u64> = BTreeMap::new();
    for d in &draws {
        if d["status"] == "ok" {
            *won.entry(d["prizes"][0]["prize"].as_str().unwrap_or("?").to_owned())
                .or_default() += 1;
        } else {
            *refused
                .entry(d["error"]["code"].as_str().unwrap_or("?").to_owned())
                .or_default() += 1;
        }
    }
    let keys = PoolKeys::new(&config.redis_prefix, &activity.id);
    let stats =
        crate::kinds::lottery::stats(&mut redis, &keys, &activity.id, &crate::scripts::utc_day())
            .await?
            .context("the activity vanished")?;
    let ok = won.values().sum::<u64>() == 90 && refused.get("no_chances") == Some(&10);
    println!();
    println!("== lottery ==");
    println!(
        "activity         {} (wheel), 30 users x 3 chances, 100 draws",
        activity.id
    );
    println!("prizes won       {won:?}");
    println!("refused          {refused:?}");
    println!("today            PV {}, UV {}", stats.pv, stats.uv);
    println!(
        "chances check    90 won, 10 without a chance: {}",
        if ok { "OK" } else { "FAILED" }
    );
    Ok(ok)
}

async fn balance(db: &sqlx::PgPool, account: i64) -> anyhow::Result<i64> {
    Ok(crate::ledger::balances(db, account)
        .await?
        .into_iter()
        .find(|b| b.asset == "coin")
        .map_or(0, |b| b.balance))
}

/// Sends every draw request with up to `in_flight` awaiting replies at once.
async fn call_all(
    client: &Arc<RpcClient>,
    requests: impl IntoIterator<Item = Value>,
    in_flight: usize,
) -> Vec<anyhow::Result<Value>> {
    stream::iter(requests)
        .map(|req| {
            let client = client.clone();
            async move {
                client
                    .call(amqp::DRAW.routing_key, &req, Duration::from_secs(30))
                    .await
            }
        })
        .buffer_unordered(in_flight)
        .collect()
        .await
}
