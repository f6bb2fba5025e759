//! `prizepool status`: the fleet at a glance. Each queue's depth, consumers
//! and dead letters; each lucky-gift pool's stock, prizes drawn, payouts and
//! batches; the settle lag; and what looks wrong (a work queue nobody
//! consumes, dead letters waiting or growing, a pool short, the ledger
//! lagging, Postgres away). `--json` prints one object; `--watch` prints
//! again every few seconds.

use std::{collections::BTreeMap, time::Duration};

use anyhow::Context;
use clap::Args;
use lapin::{options::QueueDeclareOptions, types::FieldTable, Connection};
use serde::Serialize;

use crate::{amqp, config::Config};

/// Seconds the ledger may trail queued settlements before it counts as lagging
/// (the `PrizepoolSettleLagging` alert's threshold).
const LAG_LIMIT_S: i64 = 60;

#[derive(Debug, Args)]
pub(super) struct StatusArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Print the status again every SECONDS (5 when no value is given) until
    /// interrupted; dead-letter queues that grew since the last print are flagged.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "5")]
    watch: Option<u64>,
}

/// One queue that dead-letters.
#[derive(Clone, Debug, Serialize)]
struct QueueView {
    queue: String,
    /// Ready messages (`null` when the queue does not exist).
    messages: Option<u32>,
    consumers: Option<u32>,
    dlq: String,
    dlq_messages: Option<u32>,
}

/// What a pool or packet paid, per asset.
#[derive(Clone, Debug, Serialize)]
struct Payout {
    asset: String,
    amount: i64,
    entries: i64,
}

/// One lucky-gift pool.
#[derive(Clone, Debug, Serialize)]
struct PoolView {
    pool: String,
    batches: u64,
    stocked: u64,
    prizes_drawn: u64,
    in_pool: u64,
    max_count: Option<i64>,
    payouts: Vec<Payout>,
    /// A pool stocked as sub-pools (`shards = K`): each one's stock. A draw
    /// takes its prizes from one sub-pool, so one can run short alone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    sub_pools: Vec<SubPoolView>,
    /// Realised against configured return to player.
    rtp: RtpView,
}

/// A pool's realised return to player, read from the tally its draws keep
/// in Redis (`crate::kinds::lucky_gift::rtp`): exact, and current.
#[derive(Clone, Debug, Serialize)]
struct RtpView {
    /// Whether the pool keeps the tally (false for a pool last loaded by
    /// a version of prizepool that did not: load it again).
    tallied: bool,
    /// The first batch tallied.
    from_batch: Option<u64>,
    /// Per config version, over its completed batches.
    versions: Vec<VersionRtp>,
    /// The batches still open (the running one, and any whose parked
    /// jackpots wait): what they paid so far.
    in_progress: InProgress,
}

#[derive(Clone, Debug, Serialize)]
struct VersionRtp {
    version: i64,
    configured_rtp: Option<f64>,
    completed_batches: u64,
    completed_prizes: u64,
    /// Σ multiplier of the completed batches' prizes, in `unit_price`s.
    completed_paid: u64,
    realised_rtp: Option<f64>,
    /// Realised equals configured exactly (as fractions); `null` when
    /// nothing is completed or the configuration is not known.
    exact: Option<bool>,
}

#[derive(Clone, Debug, Serialize)]
struct InProgress {
    batches: Vec<u64>,
    prizes: u64,
    paid: u64,
    rtp: Option<f64>,
}

impl From<crate::kinds::lucky_gift::rtp::Realised> for RtpView {
    fn from(r: crate::kinds::lucky_gift::rtp::Realised) -> Self {
        let open = r.in_progress_total();
        Self {
            tallied: r.tallied,
            from_batch: r.from_batch,
            versions: r
                .versions
                .iter()
                .map(|(v, f)| VersionRtp {
                    version: *v,
                    configured_rtp: f.configured_rtp(),
                    completed_batches: f.batches,
                    completed_prizes: f.completed.prizes,
                    completed_paid: f.completed.paid,
                    realised_rtp: f.completed.rtp(),
                    exact: f.exact(),
                })
                .collect(),
            in_progress: InProgress {
                batches: r.in_progress.keys().copied().collect(),
                prizes: open.prizes,
                paid: open.paid,
                rtp: open.rtp(),
            },
        }
    }
}

/// One sub-pool of a sharded pool.
#[derive(Clone, Debug, Serialize)]
struct SubPoolView {
    /// `<pool>~<shard>`.
    pool: String,
    batches: u64,
    in_pool: u64,
}

/// How far the ledger trails what was answered.
#[derive(Clone, Debug, Serialize)]
struct SettleView {
    /// Settlements waiting in `prizepool.settle`.
    queued: Option<u32>,
    /// While settlements wait: seconds since the ledger's last entry (0 when
    /// nothing waits; `null` when the ledger has no entry yet).
    lag_seconds: Option<i64>,
}

/// Something that looks wrong.
#[derive(Clone, Debug, Serialize)]
struct Problem {
    /// `no_consumers`, `queue_missing`, `dead_letters`, `dlq_growing`,
    /// `pool_short`, `rtp_departs`, `settle_lagging`, `postgres_unreachable`.
    kind: &'static str,
    /// The queue or pool concerned.
    subject: String,
    detail: String,
}

#[derive(Clone, Debug, Serialize)]
struct FleetStatus {
    at: String,
    queues: Vec<QueueView>,
    pools: Vec<PoolView>,
    settle: SettleView,
    problems: Vec<Problem>,
}

pub(super) async fn run(config: &Config, args: StatusArgs) -> anyhow::Result<()> {
    let conn = amqp::connect(&config.amqp_url, "prizepool-status").await?;
    // Lazy: a Postgres that is away (a ledger stall) is one of the things
    // the status reports, not a reason to print none; and `--watch` sees
    // it come back.
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(&config.database_url)
        .context("reading DATABASE_URL")?;
    let mut redis = crate::redis_conn::connect(&config.redis_url).await?;
    let mut before: Option<FleetStatus> = None;
    loop {
        let queues = queues(&conn, config.draw_shards).await?;
        let postgres = sqlx::query("SELECT 1").execute(&db).await.with_context(|| {
            format!(
                "Postgres at {} is unreachable",
                crate::db::redact(&config.database_url)
            )
        });
        let mut now = FleetStatus {
            at: crate::messages::wire_time(chrono::Utc::now()),
            pools: Vec::new(),
            settle: SettleView {
                queued: settle_queued(&queues),
                lag_seconds: None,
            },
            queues,
            problems: Vec::new(),
        };
        if postgres.is_ok() {
            now.pools = pools(config, &db, &mut redis).await?;
            now.settle = settle(&now.queues, &db).await?;
        }
        now.problems = problems(&now, before.as_ref());
        if let Err(error) = postgres {
            now.problems.push(Problem {
                kind: "postgres_unreachable",
                subject: "postgres".into(),
                detail: format!(
                    "{error:#}: pools, payouts and the settle lag cannot be read, and the ledger books nothing ({} settlements queued)",
                    now.settle.queued.unwrap_or(0)
                ),
            });
        }
        if args.json {
            println!("{}", serde_json::to_string(&now)?);
        } else {
            print(&now);
        }
        let Some(every) = args.watch else { break };
        before = Some(now);
        tokio::time::sleep(Duration::from_secs(every.max(1))).await;
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(())
}

/// Depth and consumers of every queue that dead-letters, and of its DLQ:
/// the work queues, the audit queue and, with `DRAW_SHARDS` > 1, each
/// further draw shard (`prizepool.draw.<k>`, whose dead letters go to
/// `prizepool.draw.dlq`).
async fn queues(conn: &Connection, draw_shards: u16) -> anyhow::Result<Vec<QueueView>> {
    let shards = (1..draw_shards).map(|k| (amqp::draw_shard(k), amqp::DRAW.dlq));
    let queues = amqp::ROUTES
        .into_iter()
        .chain([crate::audit::ROUTE])
        .map(|route| (route.queue.to_owned(), route.dlq))
        .chain(shards);
    let mut out = Vec::new();
    for (name, dlq_name) in queues {
        let queue = declared(conn, &name).await?;
        let dlq = declared(conn, dlq_name).await?;
        out.push(QueueView {
            queue: name,
            messages: queue.map(|q| q.0),
            consumers: queue.map(|q| q.1),
            dlq: dlq_name.into(),
            dlq_messages: dlq.map(|q| q.0),
        });
    }
    Ok(out)
}

/// (ready messages, consumers) of `queue`, `None` if it does not exist.
async fn declared(conn: &Connection, queue: &str) -> anyhow::Result<Option<(u32, u32)>> {
    // A passive declare of a missing queue closes its channel: one each.
    let channel = conn.create_channel().await?;
    let found = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = channel.close(200, "counted".into()).await;
    Ok(found.ok().map(|q| (q.message_count(), q.consumer_count())))
}

/// Every lucky-gift pool in the registry: its counters in Redis and what
/// the ledger paid for it.
async fn pools(
    config: &Config,
    db: &sqlx::PgPool,
    redis: &mut crate::redis_conn::RedisConn,
) -> anyhow::Result<Vec<PoolView>> {
    let registered: Vec<(String, Option<i64>)> = sqlx::query_as(
        "SELECT p.id, (SELECT (v.config->>'max_count')::bigint FROM pool_versions v
                        WHERE v.pool_id = p.id ORDER BY v.version DESC LIMIT 1)
         FROM pools p WHERE p.kind = $1 ORDER BY p.id",
    )
    .bind(crate::kinds::lucky_gift::KIND)
    .fetch_all(db)
    .await
    .context("listing the pools")?;
    let paid: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT ref->>'pool', asset, coalesce(sum(amount), 0)::bigint, count(*)
         FROM ledger_entries WHERE reason = ANY($1) GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(
        crate::ledger::reasons::of_kind(crate::kinds::lucky_gift::KIND)
            .map(|r| r.name)
            .collect::<Vec<_>>(),
    )
    .fetch_all(db)
    .await
    .context("summing the payouts")?;
    let mut payouts: BTreeMap<String, Vec<Payout>> = BTreeMap::new();
    for (pool, asset, amount, entries) in paid {
        payouts.entry(pool).or_default().push(Payout {
            asset,
            amount,
            entries,
        });
    }
    let mut out = Vec::new();
    for (id, max_count) in registered {
        let Some(status) = crate::pools::status(redis, &config.redis_prefix, &id)
            .await
            .with_context(|| format!("reading pool {id}"))?
        else {
            continue;
        };
        let sub_pools = status
            .shards
            .iter()
            .map(|s| SubPoolView {
                pool: s.pool.clone(),
                batches: s.generation,
                in_pool: s.in_pool,
            })
            .collect();
        let shards = crate::pools::shards_of(redis, &config.redis_prefix, &id)
            .await
            .with_context(|| format!("reading the shards of pool {id}"))?;
        let rtp = crate::kinds::lucky_gift::rtp::realised(redis, &config.redis_prefix, &id, shards)
            .await
            .with_context(|| format!("reading the realised RTP of pool {id}"))?;
        let s = status.total;
        out.push(PoolView {
            rtp: rtp.into(),
            sub_pools,
            batches: s.generation,
            stocked: s.stocked,
            prizes_drawn: s.drawn,
            in_pool: s.in_pool,
            max_count,
            payouts: payouts.remove(&id).unwrap_or_default(),
            pool: id,
        });
    }
    Ok(out)
}

/// Settlements ready in the settle queue (`None` when it does not exist).
fn settle_queued(queues: &[QueueView]) -> Option<u32> {
    queues
        .iter()
        .find(|q| q.queue == amqp::SETTLE.queue)
        .and_then(|q| q.messages)
}

/// The settle queue's depth and, while it holds messages, how long the
/// ledger has taken no entry.
async fn settle(queues: &[QueueView], db: &sqlx::PgPool) -> anyhow::Result<SettleView> {
    let queued = settle_queued(queues);
    let lag_seconds = if queued.unwrap_or(0) == 0 {
        Some(0)
    } else {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT extract(epoch FROM now() - max(created_at))::bigint FROM ledger_entries",
        )
        .fetch_one(db)
        .await
        .context("reading the ledger's last entry")?
    };
    Ok(SettleView {
        queued,
        lag_seconds,
    })
}

/// What looks wrong now, and what grew since `before`.
fn problems(now: &FleetStatus, before: Option<&FleetStatus>) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut add = |kind, subject: &str, detail: String| {
        out.push(Problem {
            kind,
            subject: subject.to_owned(),
            detail,
        })
    };
    // Draw shards share `prizepool.draw.dlq`: each DLQ is judged once.
    let mut dlqs_seen = std::collections::BTreeSet::new();
    for q in &now.queues {
        match q.consumers {
            None => add(
                "queue_missing",
                &q.queue,
                "not declared: no worker ever started".into(),
            ),
            Some(0) => add(
                "no_consumers",
                &q.queue,
                format!(
                    "{} messages wait and no worker consumes",
                    q.messages.unwrap_or(0)
                ),
            ),
            Some(_) => {}
        }
        if !dlqs_seen.insert(q.dlq.as_str()) {
            continue;
        }
        let dead = q.dlq_messages.unwrap_or(0);
        let was = before
            .and_then(|b| b.queues.iter().find(|p| p.dlq == q.dlq))
            .and_then(|p| p.dlq_messages);
        match was {
            Some(was) if dead > was => add(
                "dlq_growing",
                &q.dlq,
                format!(
                    "{was} -> {dead} dead letters (prizepool dlq list {})",
                    q.queue
                ),
            ),
            _ if dead > 0 => add(
                "dead_letters",
                &q.dlq,
                format!("{dead} dead letters (prizepool dlq list {})", q.queue),
            ),
            _ => {}
        }
    }
    for p in &now.pools {
        for v in p.rtp.versions.iter().filter(|v| v.exact == Some(false)) {
            add(
                "rtp_departs",
                &p.pool,
                format!(
                    "version {}: {} completed batches paid {} over {} prizes, realised {} against configured {}: a fault or tampering (prizepool audit verify)",
                    v.version,
                    v.completed_batches,
                    v.completed_paid,
                    v.completed_prizes,
                    rtp_text(v.realised_rtp),
                    rtp_text(v.configured_rtp),
                ),
            );
        }
    }
    for p in &now.pools {
        let Some(max_count) = p.max_count else {
            continue;
        };
        let short = |in_pool: u64| (in_pool as i64) < max_count;
        let detail = |in_pool: u64| {
            format!(
                "{in_pool} prizes in pool, fewer than max_count {max_count}; is the refill worker running?"
            )
        };
        if short(p.in_pool) {
            add("pool_short", &p.pool, detail(p.in_pool));
            continue;
        }
        for sub in p.sub_pools.iter().filter(|s| short(s.in_pool)) {
            add("pool_short", &sub.pool, detail(sub.in_pool));
        }
    }
    if let Some(lag) = now.settle.lag_seconds.filter(|l| *l > LAG_LIMIT_S) {
        add(
            "settle_lagging",
            amqp::SETTLE.queue,
            format!(
                "{} settlements wait and the ledger took no entry for {lag} s",
                now.settle.queued.unwrap_or(0)
            ),
        );
    }
    out
}

fn print(s: &FleetStatus) {
    let n = |v: Option<u32>| v.map_or("-".to_owned(), |v| v.to_string());
    println!("prizepool status at {}", s.at);
    println!(
        "{:<20} {:>9} {:>9} {:>13}",
        "queue", "messages", "consumers", "dead letters"
    );
    for q in &s.queues {
        println!(
            "{:<20} {:>9} {:>9} {:>13}",
            q.queue,
            n(q.messages),
            n(q.consumers),
            n(q.dlq_messages)
        );
    }
    println!(
        "{:<20} {:>8} {:>10} {:>10} {:>10}  payouts",
        "pool", "batches", "stocked", "drawn", "in pool"
    );
    for p in &s.pools {
        let paid: Vec<String> = p
            .payouts
            .iter()
            .map(|x| format!("{} {} in {} entries", x.amount, x.asset, x.entries))
            .collect();
        println!(
            "{:<20} {:>8} {:>10} {:>10} {:>10}  {}",
            p.pool,
            p.batches,
            p.stocked,
            p.prizes_drawn,
            p.in_pool,
            paid.join(", ")
        );
        print_rtp(&p.rtp);
    }
    let lag = s
        .settle
        .lag_seconds
        .map_or("unknown".to_owned(), |l| format!("{l} s"));
    println!(
        "settle lag {lag} ({} settlements queued)",
        n(s.settle.queued)
    );
    if s.problems.is_empty() {
        println!("nothing looks wrong");
    }
    for p in &s.problems {
        println!("WRONG {} {}: {}", p.kind, p.subject, p.detail);
    }
}

/// An RTP as status prints it: six decimals, `-` when unknown.
fn rtp_text(rtp: Option<f64>) -> String {
    rtp.map_or("-".to_owned(), |r| format!("{r:.6}"))
}

/// A pool's realised RTP, a line per version and one for the open batches.
fn print_rtp(r: &RtpView) {
    if !r.tallied {
        println!("  rtp: not tallied (load the pool again to start)");
        return;
    }
    for v in &r.versions {
        let verdict = match v.exact {
            Some(true) => "exact",
            Some(false) => "DEPARTS",
            None => "-",
        };
        println!(
            "  rtp v{}: configured {}, realised {} over {} completed batches ({} prizes paid {}) {verdict}",
            v.version,
            rtp_text(v.configured_rtp),
            rtp_text(v.realised_rtp),
            v.completed_batches,
            v.completed_prizes,
            v.completed_paid,
        );
    }
    let open = &r.in_progress;
    let batches: Vec<String> = open.batches.iter().map(u64::to_string).collect();
    println!(
        "  rtp in progress: batches [{}]: {} prizes paid {} (realised {})",
        batches.join(", "),
        open.prizes,
        open.paid,
        rtp_text(open.rtp),
    );
}
