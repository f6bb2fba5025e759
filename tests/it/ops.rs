//! The worker binaries as operators meet them: their command line, their
//! start-up checks, what they log (never a password; one JSON object per
//! line under `LOG_FORMAT=json`) and `/readyz` while servers come and go.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    io::{Read, Write},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use common::{free_port, redis_server, tempdir, KillOnDrop, PrivatePostgres};

const WORKERS: [&str; 3] = [
    env!("CARGO_BIN_EXE_draw-worker"),
    env!("CARGO_BIN_EXE_refill-worker"),
    env!("CARGO_BIN_EXE_settle-worker"),
];

/// Every variable a worker reads, as `--help` must list it.
const VARIABLES: [&str; 27] = [
    "AMQP_URL",
    "REDIS_URL",
    "DATABASE_URL",
    "REDIS_PREFIX",
    "PREFETCH",
    "CONCURRENCY",
    "DELIVERY_LIMIT",
    "SETTLE_BATCH_SIZE",
    "SETTLE_BATCH_WAIT_MS",
    "REFILL_CHUNK",
    "SHORT_POOL_WAIT_MS",
    "MAX_BATCH",
    "DRAW_SHARDS",
    "RESULT_TTL_S",
    "TRANSIENT_RETRY_MS",
    "SHUTDOWN_GRACE_MS",
    "DRAW_EVENTS",
    "SCHED_BATCH",
    "METRICS_ADDR",
    "HEALTH_CHECK_INTERVAL_MS",
    "STALL_AFTER_MS",
    "LEDGER_SEAL_KEY",
    "TLS_CA_FILE",
    "TLS_CERT_FILE",
    "TLS_KEY_FILE",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "LOG_FORMAT",
];

/// A worker command with a clean environment: nothing inherited from the
/// test process can change what it does.
fn worker(bin: &str) -> Command {
    let mut cmd = Command::new(bin);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs `cmd` to its end, failing the test if that takes over 20 s.
fn run_to_end(mut cmd: Command) -> Output {
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "{cmd:?} did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Runs `cmd` for `how_long`, then kills it; returns what it printed and
/// whether it exited by itself (and how).
fn run_for(mut cmd: Command, how_long: Duration) -> (String, Option<std::process::ExitStatus>) {
    let mut child = cmd.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).unwrap();
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        stderr.read_to_string(&mut s).unwrap();
        s
    });
    let deadline = Instant::now() + how_long;
    let mut status = None;
    while Instant::now() < deadline {
        if let Some(s) = child.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if status.is_none() {
        child.kill().unwrap();
    }
    child.wait().unwrap();
    let text = out.join().unwrap() + &err.join().unwrap();
    (text, status)
}

fn assert_every_line_is_json(text: &str, context: &str) {
    assert!(!text.trim().is_empty(), "{context}: printed nothing");
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{context}: not one JSON object ({e}): {line}"));
        assert!(value.is_object(), "{context}: {line}");
    }
}

#[test]
fn every_worker_documents_every_variable_in_help_and_has_a_version() {
    for bin in WORKERS {
        let out = run_to_end({
            let mut c = worker(bin);
            // A password in the environment must not show up in the help.
            c.env("AMQP_URL", "amqp://app:help-secret@10.0.0.1/v")
                .arg("--help");
            c
        });
        assert!(out.status.success(), "{bin} --help: {:?}", out.status);
        let help = String::from_utf8(out.stdout).unwrap();
        for var in VARIABLES {
            assert!(help.contains(var), "{bin} --help does not list {var}");
        }
        for default in [
            "[default: 256]",
            "[default: 90000]",
            "[default: 0.0.0.0:9100]",
        ] {
            assert!(help.contains(default), "{bin} --help lacks {default}");
        }
        for unit in ["milliseconds", "seconds"] {
            assert!(help.contains(unit), "{bin} --help names no {unit}");
        }
        assert!(
            !help.contains("help-secret"),
            "{bin} --help shows a password"
        );

        let out = run_to_end({
            let mut c = worker(bin);
            c.arg("--version");
            c
        });
        assert!(out.status.success());
        let version = String::from_utf8(out.stdout).unwrap();
        assert!(
            version.contains(env!("CARGO_PKG_VERSION")),
            "{bin}: {version}"
        );
    }
}

#[test]
fn unknown_arguments_are_refused() {
    for bin in WORKERS {
        for args in [&["--bogus"][..], &["extra"][..], &["--prefetch"][..]] {
            let out = run_to_end({
                let mut c = worker(bin);
                c.args(args).env("LOG_FORMAT", "json");
                c
            });
            assert!(!out.status.success(), "{bin} {args:?} was accepted");
            let text =
                String::from_utf8(out.stdout).unwrap() + &String::from_utf8(out.stderr).unwrap();
            assert_every_line_is_json(&text, &format!("{bin} {args:?}"));
        }
    }
}

#[test]
fn bad_settings_stop_the_start_naming_the_variable() {
    let cases = [
        ("METRICS_ADDR", "localhost"),
        ("METRICS_ADDR", "127.0.0.1:70000"),
        ("RESULT_TTL_S", "3600"),
        ("REFILL_CHUNK", "8000"),
        ("REFILL_CHUNK", "0"),
        ("PREFETCH", "0"),
        ("CONCURRENCY", "0"),
        ("DRAW_EVENTS", "sometimes"),
        ("TLS_CA_FILE", "/nonexistent/ca.pem"),
    ];
    for bin in WORKERS {
        for (name, value) in cases {
            let out = run_to_end({
                let mut c = worker(bin);
                c.env(name, value).env("LOG_FORMAT", "json");
                c
            });
            assert!(!out.status.success(), "{bin} accepted {name}={value}");
            let text = String::from_utf8(out.stderr).unwrap();
            assert_every_line_is_json(&text, &format!("{bin} {name}={value}"));
            assert!(text.contains(name), "{bin} {name}={value}: {text}");
        }
    }
}

#[test]
fn a_taken_metrics_port_is_a_start_up_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    for bin in WORKERS {
        let (text, status) = run_for(
            {
                let mut c = worker(bin);
                c.env("METRICS_ADDR", &addr).env("LOG_FORMAT", "json");
                c
            },
            Duration::from_secs(15),
        );
        let status = status.unwrap_or_else(|| panic!("{bin} kept running: {text}"));
        assert!(!status.success(), "{bin}: {text}");
        assert!(text.contains("METRICS_ADDR"), "{bin}: {text}");
        assert_every_line_is_json(&text, bin);
    }
}

/// Passwords in every URL, against closed ports, wrong credentials and
/// URLs that do not even parse: whatever each worker prints while it waits
/// or fails, no password appears in it, and every line is JSON.
#[test]
fn no_password_ever_reaches_the_logs() {
    let closed = || format!("127.0.0.1:{}", free_port());
    let secret = "Pw-4f9c1e";
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let cases: Vec<[(&str, String); 4]> = vec![
        // Nothing listens anywhere.
        [
            ("AMQP_URL", format!("amqp://app:{secret}@{}/%2f", closed())),
            ("REDIS_URL", format!("redis://:{secret}@{}", closed())),
            (
                "DATABASE_URL",
                format!("postgres://ledger:{secret}@{}/prizepool", closed()),
            ),
            ("METRICS_ADDR", String::new()),
        ],
        // Real servers, wrong credentials; TLS URLs and ACL users.
        [
            (
                "AMQP_URL",
                format!("amqp://guest:{secret}@127.0.0.1:5672/%2f"),
            ),
            ("REDIS_URL", format!("rediss://app:{secret}@{}", closed())),
            (
                "DATABASE_URL",
                format!("postgres://nobody:{secret}@127.0.0.1:5432/pp_no_such_db?sslmode=require"),
            ),
            ("METRICS_ADDR", String::new()),
        ],
        // URLs that do not parse, a cluster list, a password in a query.
        [
            ("AMQP_URL", format!("amqps://app:{secret}@{}:x/v", closed())),
            (
                "REDIS_URL",
                format!(
                    "redis://:{secret}@{},redis://:{secret}@{}",
                    closed(),
                    closed()
                ),
            ),
            (
                "DATABASE_URL",
                format!("postgres://ledger@{}/db?password={secret}", closed()),
            ),
            ("METRICS_ADDR", String::new()),
        ],
        // A fatal start-up error with passwords in the configuration.
        [
            ("AMQP_URL", format!("amqp://app:{secret}@{}/%2f", closed())),
            ("REDIS_URL", format!("redis://:{secret}@{}", closed())),
            (
                "DATABASE_URL",
                format!("postgres://ledger:{secret}@{}/db", closed()),
            ),
            ("METRICS_ADDR", taken.clone()),
        ],
    ];
    // Every worker in every case at once: each runs its 4 s.
    let runs: Vec<(&str, usize, String)> = std::thread::scope(|scope| {
        let mut runs = Vec::new();
        for bin in WORKERS {
            for (i, case) in cases.iter().enumerate() {
                let mut cmd = worker(bin);
                cmd.env("LOG_FORMAT", "json").env("RUST_LOG", "debug");
                // The ledger seal key is a secret too.
                cmd.env("LEDGER_SEAL_KEY", format!("seal-{secret}"));
                for (name, value) in case {
                    cmd.env(name, value);
                }
                let run = scope.spawn(move || run_for(cmd, Duration::from_secs(4)).0);
                runs.push((bin, i, run));
            }
        }
        runs.into_iter()
            .map(|(bin, i, run)| (bin, i, run.join().unwrap()))
            .collect()
    });
    for (bin, i, text) in runs {
        assert!(
            !text.contains(secret),
            "{bin}, case {i}: a password leaked:\n{text}"
        );
        assert_every_line_is_json(&text, &format!("{bin}, case {i}"));
        // The effective configuration is logged, redacted.
        if i < 3 {
            assert!(text.contains("effective configuration"), "{bin}: {text}");
        }
    }
}

/// A bare HTTP/1.0 GET; returns the status code and body.
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    Some((status, body.to_owned()))
}

/// A worker whose servers are away serves `/healthz` at once and answers
/// not ready on `/readyz` while it waits.
#[test]
fn readyz_says_not_ready_while_a_worker_waits_for_its_servers() {
    let metrics = format!("127.0.0.1:{}", free_port());
    for bin in WORKERS {
        let mut cmd = worker(bin);
        cmd.env("AMQP_URL", format!("amqp://127.0.0.1:{}/%2f", free_port()))
            .env("REDIS_URL", format!("redis://127.0.0.1:{}", free_port()))
            .env(
                "DATABASE_URL",
                format!("postgres://127.0.0.1:{}/x", free_port()),
            )
            .env("METRICS_ADDR", &metrics)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let _worker = KillOnDrop(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(10);
        let healthz = loop {
            if let Some(got) = get(&metrics, "/healthz") {
                break got;
            }
            assert!(Instant::now() < deadline, "{bin}: no ops endpoint");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(healthz.0, 200);
        for _ in 0..5 {
            let (code, body) = get(&metrics, "/readyz").unwrap();
            assert_eq!(code, 503, "{bin}: {body}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Start-up waits for a Redis that is not there yet; once running, the
/// pings turn `/readyz` not ready when Redis goes away and ready again when
/// it is back, while the consumer itself never noticed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_waits_for_redis_and_readiness_follows_it() {
    use prizepool::ops::{self, Dependency, Health};
    use tokio_util::sync::CancellationToken;

    let dir = tempdir("readyz");
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let config = prizepool::config::Config::from_lookup(|n| match n {
        "REDIS_URL" => Some(url.clone()),
        "HEALTH_CHECK_INTERVAL_MS" => Some("100".into()),
        _ => None,
    })
    .unwrap();
    let shutdown = CancellationToken::new();
    let waiting = {
        let (config, shutdown) = (config.clone(), shutdown.clone());
        tokio::spawn(async move {
            ops::wait_for(&config, "test", &[Dependency::Redis], &shutdown).await
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!waiting.is_finished(), "start-up went on without Redis");
    let redis = redis_server(port, &dir, &[]);
    let waited = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("start-up noticed Redis")
        .unwrap();
    assert!(waited);

    let health = Health::default();
    health.set_ready(true);
    ops::watch(&config, &[Dependency::Redis], &health, &shutdown).await;
    let until = |want: bool| {
        let health = health.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while health.is_ready() != want {
                assert!(Instant::now() < deadline, "readiness never became {want}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    until(true).await;
    drop(redis);
    until(false).await;
    assert_eq!(health.not_ready_because(), Some("redis unreachable"));
    let _redis = redis_server(port, &dir, &[]);
    until(true).await;
    shutdown.cancel();
    std::fs::remove_dir_all(&dir).ok();
}

/// `wait_for` gives up waiting when the worker is told to stop.
#[tokio::test]
async fn waiting_for_servers_ends_on_shutdown() {
    let config = prizepool::config::Config::from_lookup(|n| {
        (n == "AMQP_URL").then(|| format!("amqp://127.0.0.1:{}/%2f", free_port()))
    })
    .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    shutdown.cancel();
    let needs = [prizepool::ops::Dependency::Broker];
    let waited = tokio::time::timeout(
        Duration::from_secs(5),
        prizepool::ops::wait_for(&config, "test", &needs, &shutdown),
    )
    .await
    .unwrap();
    assert!(!waited);
}

/// As for Redis: start-up waits for Postgres, and readiness drops while
/// Postgres is down and returns with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_waits_for_postgres_and_readiness_follows_it() {
    use prizepool::ops::{self, Dependency, Health};
    use tokio_util::sync::CancellationToken;

    let pg = PrivatePostgres::init();
    let url = pg.url();
    let config = prizepool::config::Config::from_lookup(|n| match n {
        "DATABASE_URL" => Some(url.clone()),
        "HEALTH_CHECK_INTERVAL_MS" => Some("100".into()),
        _ => None,
    })
    .unwrap();
    let shutdown = CancellationToken::new();
    let waiting = {
        let (config, shutdown) = (config.clone(), shutdown.clone());
        tokio::spawn(async move {
            ops::wait_for(&config, "test", &[Dependency::Postgres], &shutdown).await
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!waiting.is_finished(), "start-up went on without Postgres");
    pg.start();
    let waited = tokio::time::timeout(Duration::from_secs(15), waiting)
        .await
        .expect("start-up noticed Postgres")
        .unwrap();
    assert!(waited);

    let health = Health::default();
    health.set_ready(true);
    ops::watch(&config, &[Dependency::Postgres], &health, &shutdown).await;
    let until = |want: bool| {
        let health = health.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(15);
            while health.is_ready() != want {
                assert!(Instant::now() < deadline, "readiness never became {want}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    until(true).await;
    pg.stop();
    until(false).await;
    assert_eq!(health.not_ready_because(), Some("postgres unreachable"));
    pg.start();
    until(true).await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_limit_the_queues_contradict_stops_each_worker_naming_it() {
    let env = common::TestEnv::new(&[]).await;
    // The queues were declared with a delivery limit of 5.
    let conn = prizepool::amqp::connect(&env.config.amqp_url, "ops-test")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    prizepool::amqp::declare_topology(&channel, 5)
        .await
        .unwrap();
    let _ = conn.close(200, "declared".into()).await;
    for bin in WORKERS {
        let mut cmd = worker(bin);
        cmd.envs(env.env()).env("DELIVERY_LIMIT", "20");
        let out = tokio::task::spawn_blocking(move || run_to_end(cmd))
            .await
            .unwrap();
        assert!(!out.status.success(), "{bin} went on");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("DELIVERY_LIMIT=20 disagrees"),
            "{bin}: {text}"
        );
    }
}

/// A draw-queue handler that answers nothing until it is let go: a worker
/// stuck inside, as a client connection that stopped answering leaves it,
/// while every server answers.
struct Stuck {
    go: std::sync::Arc<tokio::sync::Semaphore>,
}

impl prizepool::amqp::Handler for Stuck {
    fn route(&self) -> prizepool::amqp::Route {
        prizepool::amqp::DRAW
    }

    async fn handle(
        &self,
        envelope: &serde_json::Value,
        _publisher: &prizepool::amqp::Publisher,
    ) -> Result<prizepool::amqp::Outcome, prizepool::amqp::HandleError> {
        let _go = self.go.acquire().await;
        let id = envelope["request_id"].as_str().unwrap_or_default();
        let reply = serde_json::json!({"type": "draw_result", "request_id": id, "status": "ok"});
        Ok(prizepool::amqp::Outcome {
            reply: Some(serde_json::to_vec(&reply).unwrap()),
            ..Default::default()
        })
    }
}

/// A worker that holds deliveries and answers none for `STALL_AFTER_MS`
/// while Redis and Postgres answer its pings reports itself stalled: not
/// ready and not live (the endpoints the chart probes), so it is taken out
/// and restarted. An idle worker never is, and one that answers again is
/// not any more.
#[tokio::test]
async fn a_worker_that_answers_nothing_while_its_servers_answer_reports_itself_stalled() {
    use prizepool::ops::{Dependency, Health};
    let env = common::TestEnv::new(&[
        ("STALL_AFTER_MS", "1000"),
        ("HEALTH_CHECK_INTERVAL_MS", "100"),
    ])
    .await;
    let go = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (health, shutdown) = (
        Health::default(),
        tokio_util::sync::CancellationToken::new(),
    );
    let worker = {
        let (config, handler) = (env.config.clone(), Stuck { go: go.clone() });
        let (health, shutdown) = (health.clone(), shutdown.clone());
        tokio::spawn(async move {
            prizepool::amqp::run(&config, std::sync::Arc::new(handler), health, shutdown).await
        })
    };
    prizepool::ops::watch(
        &env.config,
        &[Dependency::Redis, Dependency::Postgres],
        &health,
        &shutdown,
    )
    .await;
    let ready = common::eventually(Duration::from_secs(30), || {
        let health = health.clone();
        async move {
            health
                .is_ready()
                .then_some(())
                .ok_or_else(|| format!("not ready: {:?}", health.not_ready_because()))
        }
    });
    ready.await;
    // Idle for longer than the bound: not a stall.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(health.is_ready(), "{:?}", health.not_ready_because());

    let raw = common::raw::Raw::new(&env).await;
    let body = serde_json::json!({"type": "draw", "request_id": "stuck-1", "pool": "p", "user_id": 1, "count": 1});
    raw.publish(
        "draw",
        &serde_json::to_vec(&body).unwrap(),
        raw.props("stuck-1"),
    )
    .await;
    let stalled_at = {
        let health = health.clone();
        common::eventually(Duration::from_secs(30), move || {
            let health = health.clone();
            async move {
                health.is_stalled().then(Instant::now).ok_or_else(|| {
                    format!(
                        "not stalled: {:?} unanswered, {:?}",
                        health.unanswered_for(),
                        health.not_ready_because()
                    )
                })
            }
        })
        .await
    };
    let why = health.not_ready_because().unwrap();
    assert!(why.starts_with("stalled"), "{why}");
    assert!(!health.is_ready());

    // Let go: the delivery is answered and the stall is over.
    go.add_permits(1_000);
    assert_eq!(raw.reply("stuck-1").await["status"], "ok");
    let health_now = health.clone();
    common::eventually(Duration::from_secs(30), move || {
        let health = health_now.clone();
        async move {
            (!health.is_stalled())
                .then_some(())
                .ok_or_else(|| "still stalled".to_owned())
        }
    })
    .await;
    assert!(health.is_ready(), "{:?}", health.not_ready_because());
    eprintln!(
        "stalled {:?} after the delivery arrived",
        stalled_at.elapsed()
    );
    shutdown.cancel();
    worker.await.unwrap().unwrap();
}
