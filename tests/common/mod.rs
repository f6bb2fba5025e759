//! Test harness: every test gets its own RabbitMQ vhost (the queue names are
//! the public contract, so tests cannot rename them), its own Redis key
//! prefix (so its pools live under hash tags no other test uses) and its own
//! Postgres database, a copy of a migrated template. All of it is removed
//! when the test ends. `services` sets up what the shared servers must offer
//! (plugins, the template).

#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::{process::Command, time::Duration};

use prizepool::redis_conn::RedisConn;
use prizepool::{
    amqp::rpc::RpcClient,
    config::Config,
    kinds::lucky_gift::{self, PoolConfig},
    ops::Health,
    scripts::{PoolKeys, Scripts},
};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct TestEnv {
    pub config: Config,
    pub vhost: String,
    pub db_name: String,
    pub db: PgPool,
    pub redis: RedisConn,
    pub scripts: Scripts,
    shutdown: CancellationToken,
    workers: Vec<JoinHandle<anyhow::Result<()>>>,
}

impl TestEnv {
    /// A connection named `name` and a confirming channel on this
    /// environment's vhost, with the topology declared.
    pub async fn confirm_channel(&self, name: &str) -> (lapin::Connection, lapin::Channel) {
        let conn = prizepool::amqp::connect(&self.config.amqp_url, name)
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        prizepool::amqp::declare_topology(&ch, self.config.delivery_limit)
            .await
            .unwrap();
        ch.confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .unwrap();
        (conn, ch)
    }

    /// Runs the `prizepool` command line against this environment without
    /// blocking the runtime (in-process workers keep running).
    pub async fn cli(&self, args: &[&str]) -> std::process::Output {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_prizepool"))
            .args(args)
            .envs(self.env())
            .env("RUST_LOG", "warn")
            .output()
            .await
            .unwrap()
    }

    /// A fresh vhost, Redis prefix and database, with `overrides` applied to
    /// the configuration.
    pub async fn new(overrides: &[(&str, &str)]) -> Self {
        let id = ulid::Ulid::new().to_string().to_lowercase();
        let vhost = format!("pp-test-{id}");
        services::add_vhost(&vhost);
        let db_name = format!("pp_test_{id}");
        services::create_database(&db_name).await;
        let db_url = services::database_url(&db_name);
        let mut vars: std::collections::HashMap<String, String> = [
            (
                "AMQP_URL",
                format!("amqp://guest:guest@127.0.0.1:5672/{vhost}"),
            ),
            ("DATABASE_URL", db_url.clone()),
            ("REDIS_PREFIX", format!("t{id}")),
            ("SETTLE_BATCH_WAIT_MS", "5".into()),
            ("SHUTDOWN_GRACE_MS", "5000".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        for (k, v) in overrides {
            vars.insert((*k).to_owned(), (*v).to_owned());
        }
        let config = Config::from_lookup(|name| vars.get(name).cloned()).unwrap();
        let db = prizepool::db::migrate(&config.database_url).await.unwrap();
        let redis = prizepool::redis_conn::connect(&config.redis_url)
            .await
            .unwrap();
        Self {
            config,
            vhost,
            db_name,
            db,
            redis,
            scripts: Scripts::new(),
            shutdown: CancellationToken::new(),
            workers: Vec::new(),
        }
    }

    /// Another handle on this test's vhost, Redis prefix and database, with
    /// `change` applied to a copy of the configuration (workers of another
    /// setting on the same servers). Whichever handle drops first removes
    /// the vhost and the database.
    pub fn sharing(&self, change: impl FnOnce(&mut Config)) -> Self {
        let mut config = self.config.clone();
        change(&mut config);
        Self {
            config,
            vhost: self.vhost.clone(),
            db_name: self.db_name.clone(),
            db: self.db.clone(),
            redis: self.redis.clone(),
            scripts: Scripts::new(),
            shutdown: CancellationToken::new(),
            workers: Vec::new(),
        }
    }

    /// Environment variables that point a worker process at this test's
    /// vhost, prefix and database.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AMQP_URL".into(), self.config.amqp_url.clone()),
            ("DATABASE_URL".into(), self.config.database_url.clone()),
            ("REDIS_PREFIX".into(), self.config.redis_prefix.clone()),
            ("REDIS_URL".into(), self.config.redis_url.clone()),
            // No ops endpoint unless a test asks for one: ports stay free.
            ("METRICS_ADDR".into(), String::new()),
            (
                "SHORT_POOL_WAIT_MS".into(),
                self.config.short_pool_wait.as_millis().to_string(),
            ),
        ]
    }

    pub fn keys(&self, pool: &str) -> PoolKeys {
        PoolKeys::new(&self.config.redis_prefix, pool)
    }

    /// The claim and answer tokens of request `id` (namespace `space`: `rq`
    /// or `gr`), as the workers build them; the fingerprint plays no part in
    /// finding what is stored.
    pub fn tokens(&self, space: &str, id: &str) -> prizepool::kinds::Tokens {
        prizepool::kinds::Tokens::new(
            &self.config.redis_prefix,
            space,
            id,
            prizepool::kinds::fingerprint("any", &[]),
            self.config.result_ttl.as_secs(),
        )
    }

    /// What is stored for request `id` on `pool`: its claim and its answer.
    pub async fn stored_answer(&self, pool: &str, id: &str) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
        let mut redis = self.redis.clone();
        let tokens = self.tokens("rq", id);
        prizepool::kinds::answer::stored(
            &mut redis,
            &self.scripts,
            &self.keys(pool).results(),
            &tokens,
            false,
        )
        .await
        .unwrap()
    }

    /// Forgets the answer and the claim of request `id` on `pool`, as
    /// `RESULT_TTL_S` does a day later.
    pub async fn forget_answer(&self, pool: &str, id: &str) {
        let mut redis = self.redis.clone();
        let tokens = self.tokens("rq", id);
        let (claim, answer) = prizepool::kinds::answer::stored(
            &mut redis,
            &self.scripts,
            &self.keys(pool).results(),
            &tokens,
            true,
        )
        .await
        .unwrap();
        assert!(
            claim.is_some() && answer.is_some(),
            "{id} on {pool} had no answer to forget"
        );
    }

    /// Loads pools from TOML text.
    pub async fn load(&self, toml: &str) -> Vec<PoolConfig> {
        let configs = lucky_gift::parse_file(toml).unwrap();
        self.try_load(&configs).await.unwrap();
        configs
    }

    /// Loads parsed pools as `prizepool pool load` does; its error, if any.
    pub async fn try_load(&self, configs: &[PoolConfig]) -> anyhow::Result<()> {
        let mut redis = self.redis.clone();
        prizepool::pools::load(
            &self.db,
            &mut redis,
            &self.config.redis_prefix,
            configs,
            self.config.refill_chunk,
        )
        .await
        .map(drop)
    }

    /// Loads lottery activities from TOML text.
    pub async fn load_activities(&self, toml: &str) {
        let activities = prizepool::kinds::lottery::parse_file(toml).unwrap();
        let mut redis = self.redis.clone();
        prizepool::kinds::lottery::load(
            &self.db,
            &mut redis,
            &self.config.redis_prefix,
            &activities,
        )
        .await
        .unwrap();
    }

    /// A pool's counters (a sharded pool's summed over its sub-pools).
    pub async fn status(&self, pool: &str) -> lucky_gift::PoolStatus {
        self.pool_status(pool).await.total
    }

    /// A pool's counters, with each sub-pool's if it is sharded.
    pub async fn pool_status(&self, pool: &str) -> prizepool::pools::Status {
        let mut redis = self.redis.clone();
        prizepool::pools::status(&mut redis, &self.config.redis_prefix, pool)
            .await
            .unwrap()
            .expect("pool exists")
    }

    async fn wait_ready(health: &Health) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !health.is_ready() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "worker not ready in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Spawns one in-process worker (`run` is `draw::run`, `refill::run` or
    /// `settle::run`) and waits until it consumes.
    async fn start<F, Fut>(&mut self, run: F)
    where
        F: FnOnce(prizepool::config::Config, Health, CancellationToken) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let health = Health::default();
        let ready = health.clone();
        self.workers.push(tokio::spawn(run(
            self.config.clone(),
            health,
            self.shutdown.clone(),
        )));
        Self::wait_ready(&ready).await;
    }

    pub async fn start_draw_worker(&mut self) {
        self.start(prizepool::draw::run).await;
    }

    pub async fn start_refill_worker(&mut self) {
        self.start(prizepool::refill::run).await;
    }

    pub async fn start_settle_worker(&mut self) {
        self.start(prizepool::settle::run).await;
    }

    pub async fn start_fleet(&mut self) {
        self.start_draw_worker().await;
        self.start_refill_worker().await;
        self.start_settle_worker().await;
    }

    /// Stops the in-process workers and waits for them to drain.
    pub async fn stop_workers(&mut self) {
        self.shutdown.cancel();
        for w in self.workers.drain(..) {
            w.await.unwrap().unwrap();
        }
        self.shutdown = CancellationToken::new();
    }

    pub async fn client(&self) -> RpcClient {
        RpcClient::connect(&self.config).await.unwrap()
    }

    /// Messages waiting in `queue` (ready, not unacked).
    pub async fn queue_depth(&self, queue: &str) -> u32 {
        self.queue(queue).await.message_count()
    }

    /// Consumers attached to `queue`.
    pub async fn consumers(&self, queue: &str) -> u32 {
        self.queue(queue).await.consumer_count()
    }

    async fn queue(&self, queue: &str) -> lapin::Queue {
        let conn = prizepool::amqp::connect(&self.config.amqp_url, "test")
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        let _ = conn.close(200, "bye".into()).await;
        q
    }

    /// Waits until the ledger holds `expected` in total for `pool`.
    pub async fn wait_ledger(&self, pool: &str, expected: i64) -> i64 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let total = prizepool::settle::pool_total(&self.db, pool, "coin")
                .await
                .unwrap();
            if total == expected || tokio::time::Instant::now() > deadline {
                return total;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        self.shutdown.cancel();
        services::delete_vhost(&self.vhost);
        services::drop_database(&self.db_name);
    }
}

/// A draw request body.
pub fn draw(pool: &str, user: i64, count: u32) -> serde_json::Value {
    serde_json::json!({
        "type": "draw", "request_id": ulid::Ulid::new().to_string(),
        "pool": pool, "user_id": user, "count": count,
    })
}

/// A pool file with one pool of the given combos (`(id, [(multiplier, stock)])`).
pub fn pool_toml(id: &str, extra: &str, combos: &[(&str, &[(u64, u64)])]) -> String {
    let mut text =
        format!("[[pools]]\nid = \"{id}\"\nkind = \"lucky_gift\"\nunit_price = 10\n{extra}\n");
    for (cid, stock) in combos {
        let items: Vec<String> = stock
            .iter()
            .map(|(m, n)| format!("\"{m}\" = {n}"))
            .collect();
        text.push_str(&format!(
            "[[pools.combos]]\nid = \"{cid}\"\nstock = {{ {} }}\n",
            items.join(", ")
        ));
    }
    text
}

/// An activity file with one `wheel` activity over `prizes` (TOML inline
/// tables) and an unlimited `points-10` consolation prize.
pub fn activity_toml(
    id: &str,
    starts: chrono::DateTime<chrono::Utc>,
    ends: chrono::DateTime<chrono::Utc>,
    prizes: &str,
) -> String {
    format!(
        "[[activities]]\nid = \"{id}\"\nstrategy = \"wheel\"\nstarts_at = \"{}\"\nends_at = \"{}\"\nprizes = [ {prizes} ]\nconsolation = {{ id = \"points-10\", weight = 1 }}\n",
        starts.to_rfc3339(),
        ends.to_rfc3339()
    )
}

/// A TCP port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub mod load;
pub mod pki;
pub mod raw;
pub mod redis_cluster;
pub mod services;

/// Starts worker binary `exe` (`env!("CARGO_BIN_EXE_<name>")`) on `env`'s
/// servers, its logs on the test's stderr.
pub fn spawn_binary(env: &TestEnv, name: &str, exe: &str) -> std::process::Child {
    spawn_binary_with(env, name, exe, &[])
}

/// [`spawn_binary`] with more environment variables (`extra` wins).
pub fn spawn_binary_with(
    env: &TestEnv,
    name: &str,
    exe: &str,
    extra: &[(&str, &str)],
) -> std::process::Child {
    std::process::Command::new(exe)
        .envs(env.env())
        .env("RUST_LOG", "warn")
        .env("METRICS_ADDR", "")
        .envs(extra.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {name}: {e}"))
}

/// Polls `probe` every 250 ms until it gives `Ok`, for at most `within`;
/// fails with the last reason it gave.
pub async fn eventually<T, F, Fut>(within: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(why) => assert!(tokio::time::Instant::now() < deadline, "{why}"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub async fn wait_exit(
    child: &mut std::process::Child,
    within: Duration,
) -> std::process::ExitStatus {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "worker did not exit within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A child process stopped when dropped (even when the test panics).
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a redis-server of the test's own on `port`, keeping nothing on
/// disk and its files in `dir`; `extra` adds options (cluster mode).
pub fn redis_server(port: u16, dir: &std::path::Path, extra: &[&str]) -> KillOnDrop {
    let port = port.to_string();
    KillOnDrop(
        Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(extra)
            .arg("--dir")
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    )
}

impl TestEnv {
    /// Credits `amount` coins to `account` straight in the ledger (a fresh
    /// top-up entry each call).
    pub async fn fund(&self, account: i64, amount: i64) {
        let topup = prizepool::messages::SettleRequest::new(
            format!("topup:{account}:{}", ulid::Ulid::new()),
            account,
            "coin",
            amount,
            "topup",
            serde_json::json!({}),
        );
        prizepool::settle::apply(&self.db, &[topup]).await.unwrap();
    }

    /// A queue of this test's own bound to `routing_key` on the events
    /// exchange, as a downstream consumer binds one, and its consumer
    /// (no acks). Keep the connection while consuming.
    pub async fn listen(&self, routing_key: &str) -> (lapin::Connection, lapin::Consumer) {
        self.listen_on(prizepool::amqp::EVENTS, routing_key).await
    }

    /// A queue of this test's own bound to `routing_key` on `exchange` (the
    /// work exchange too: a copy of every message routed there), and its
    /// consumer (no acks). Keep the connection while consuming.
    pub async fn listen_on(
        &self,
        exchange: &str,
        routing_key: &str,
    ) -> (lapin::Connection, lapin::Consumer) {
        let conn = prizepool::amqp::connect(&self.config.amqp_url, "events")
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        prizepool::amqp::declare_topology(&ch, self.config.delivery_limit)
            .await
            .unwrap();
        let queue = ch
            .queue_declare(
                "".into(),
                lapin::options::QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        ch.queue_bind(
            queue.name().clone(),
            exchange.into(),
            routing_key.into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
        let consumer = ch
            .basic_consume(
                queue.name().clone(),
                "events".into(),
                lapin::options::BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await
            .unwrap();
        (conn, consumer)
    }

    /// Spawns the shared consume loop (`amqp::run`) around `handler`, as a
    /// worker of this test's own, and waits until it consumes. It stops with
    /// the other workers.
    pub async fn start_handler<H: prizepool::amqp::Handler>(&mut self, handler: H) {
        let handler = std::sync::Arc::new(handler);
        self.start(move |config, health, shutdown| async move {
            prizepool::amqp::run(&config, handler, health, shutdown).await
        })
        .await;
    }

    /// Waits until `queue` holds `n` ready messages.
    pub async fn wait_depth(&self, queue: &str, n: u32) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let depth = self.queue_depth(queue).await;
            if depth == n {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{queue} holds {depth} messages, not {n}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A private Postgres run by the `postgres` user (initdb refuses root),
/// stopped and removed when dropped.
pub struct PrivatePostgres {
    dir: std::path::PathBuf,
    port: u16,
}

pub fn as_postgres(command: &str) {
    let out = Command::new("su")
        .args(["postgres", "-c", command])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{command}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl PrivatePostgres {
    pub fn init() -> Self {
        let dir = tempdir("pg");
        let chown = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(chown.success());
        as_postgres(&format!(
            "{PG_BIN}/initdb -D {}/data -U postgres --auth=trust -N >/dev/null",
            dir.display()
        ));
        Self {
            dir,
            port: free_port(),
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn start(&self) {
        let d = self.dir.display();
        as_postgres(&format!(
            "{PG_BIN}/pg_ctl -D {d}/data -l {d}/log -w -o \"-p {} -k {d} \
             -c listen_addresses=127.0.0.1\" start >/dev/null",
            self.port
        ));
    }

    pub fn stop(&self) {
        as_postgres(&format!(
            "{PG_BIN}/pg_ctl -D {}/data -m immediate -w stop >/dev/null",
            self.dir.display()
        ));
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = Command::new("su")
            .args([
                "postgres",
                "-c",
                &format!(
                    "{PG_BIN}/pg_ctl -D {}/data -m immediate -w stop",
                    self.dir.display()
                ),
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh directory under the system's temp dir.
pub fn tempdir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "pp-{tag}-{}",
        ulid::Ulid::new().to_string().to_lowercase()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `rabbitmqctl` against `node`.
pub fn node_ctl(node: &str, args: &[&str]) -> std::process::Output {
    Command::new("rabbitmqctl")
        .args(["-n", node])
        .args(args)
        .output()
        .expect("rabbitmqctl runs")
}

/// A RabbitMQ node of the test's own (SPEC §9's second-node recipe), stopped
/// and removed when dropped.
pub struct PrivateRabbit {
    pub dir: std::path::PathBuf,
    pub node: String,
    pub port: u16,
}

impl PrivateRabbit {
    /// Starts a node whose `rabbitmq.conf` is `listeners(port, dir)` plus
    /// `loopback_users = none`, after copying `files` into its directory.
    pub fn start(
        tag: &str,
        files: &[std::path::PathBuf],
        listeners: impl Fn(u16, &std::path::Path) -> String,
    ) -> Self {
        Self::start_with_plugins(tag, files, &[], listeners)
    }

    /// [`PrivateRabbit::start`] with `plugins` enabled from the start.
    pub fn start_with_plugins(
        tag: &str,
        files: &[std::path::PathBuf],
        plugins: &[&str],
        listeners: impl Fn(u16, &std::path::Path) -> String,
    ) -> Self {
        let dir = tempdir(tag);
        for file in files {
            std::fs::copy(file, dir.join(file.file_name().unwrap())).unwrap();
        }
        let (port, dist) = (free_port(), free_port());
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("{}loopback_users = none\n", listeners(port, &dir)),
        )
        .unwrap();
        std::fs::write(dir.join("plugins"), format!("[{}].\n", plugins.join(","))).unwrap();
        let chown = Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(chown.success());
        let node = format!("pp{tag}{}@localhost", free_port());
        let started = Command::new("rabbitmq-server")
            .arg("-detached")
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("plugins"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"))
            .status()
            .unwrap();
        assert!(started.success());
        let rabbit = Self { dir, node, port };
        rabbit.await_startup();
        rabbit
    }

    /// Waits until the node runs: `-detached` and `start_app` return before
    /// it is reachable, and until then `await_startup` fails at once.
    pub fn await_startup(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let out = node_ctl(&self.node, &["await_startup", "--timeout", "60"]);
            if out.status.success() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "node did not start: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let _ = node_ctl(&self.node, &["stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
