//! TLS that fails closed: private Redis and Postgres servers with
//! certificates made by the test (the `openssl` command), reached with the
//! right CA, refused with a wrong one, and never spoken to in plaintext when
//! the URL asks for TLS. RabbitMQ's test installs TLS files for the whole
//! process, so it is a test binary of its own: `tests/tls.rs`.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use common::{free_port, pki::Pki, redis_server, KillOnDrop};
use prizepool::config::{Config, TlsFiles};

fn tls_redis(pki: &Pki, port: u16, client_certs: bool) -> KillOnDrop {
    let port = port.to_string();
    let path = |n: &str| pki.path(n).display().to_string();
    let (cert, key, ca) = (path("server.pem"), path("server.key"), path("ca.pem"));
    let auth = if client_certs { "yes" } else { "no" };
    let server = redis_server(
        0,
        &pki.dir,
        &[
            "--port",
            "0",
            "--tls-port",
            &port,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            auth,
        ],
    );
    wait_port(&port);
    server
}

fn wait_port(port: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn redis_ping(url: &str, tls: &TlsFiles) -> anyhow::Result<String> {
    let mut conn = tokio::time::timeout(
        Duration::from_secs(10),
        prizepool::redis_conn::connect_with(url, tls),
    )
    .await??;
    Ok(redis::cmd("PING").query_async::<String>(&mut conn).await?)
}

#[tokio::test]
async fn redis_over_tls_needs_the_right_ca() {
    let pki = Pki::new("tls-redis");
    let port = free_port();
    let _server = tls_redis(&pki, port, false);
    let url = format!("rediss://127.0.0.1:{port}");

    assert_eq!(redis_ping(&url, &pki.trusting("ca")).await.unwrap(), "PONG");
    // The host name is checked too: `localhost` is in the certificate.
    let by_name = format!("rediss://localhost:{port}");
    assert_eq!(
        redis_ping(&by_name, &pki.trusting("ca")).await.unwrap(),
        "PONG"
    );

    // The refusals are tried at once: a refused connect retries until its
    // 10 s timeout, and one after the other they kept the suite's last
    // minute waiting.
    let plain_url = format!("redis://127.0.0.1:{port}");
    let (other_ca, no_ca, ca) = (
        pki.trusting("other-ca"),
        TlsFiles::default(),
        pki.trusting("ca"),
    );
    let (wrong, system, plain) = tokio::join!(
        redis_ping(&url, &other_ca),
        // Without a CA file only the system's roots count, which never
        // signed it.
        redis_ping(&url, &no_ca),
        // A plain URL does not talk to a TLS port either.
        redis_ping(&plain_url, &ca),
    );
    assert!(
        wrong.is_err(),
        "a server signed by an untrusted CA was accepted"
    );
    assert!(
        system.is_err(),
        "the test CA was trusted without being configured"
    );
    assert!(plain.is_err());
}

#[tokio::test]
async fn rediss_never_falls_back_to_a_plaintext_server() {
    let pki = Pki::new("tls-redis-plain");
    let port = free_port();
    let _server = redis_server(port, &pki.dir, &[]);
    wait_port(&port.to_string());
    // The server speaks plain RESP; `redis://` reaches it, `rediss://` must not.
    assert_eq!(
        redis_ping(&format!("redis://127.0.0.1:{port}"), &TlsFiles::default())
            .await
            .unwrap(),
        "PONG"
    );
    let tls = redis_ping(&format!("rediss://127.0.0.1:{port}"), &pki.trusting("ca")).await;
    assert!(tls.is_err(), "rediss:// talked to a plaintext server");
    // A cluster list that mixes TLS and plain nodes is refused outright.
    let mixed = format!("rediss://127.0.0.1:{port},redis://127.0.0.1:{port}");
    let err = redis_ping(&mixed, &pki.trusting("ca")).await.unwrap_err();
    assert!(format!("{err:#}").contains("mixes"), "{err:#}");
}

#[tokio::test]
async fn redis_client_certificates_are_presented_when_configured() {
    let pki = Pki::new("tls-redis-mtls");
    let port = free_port();
    let _server = tls_redis(&pki, port, true);
    let url = format!("rediss://127.0.0.1:{port}");
    assert_eq!(
        redis_ping(&url, &pki.with_client_cert()).await.unwrap(),
        "PONG"
    );
    let anonymous = redis_ping(&url, &pki.trusting("ca")).await;
    assert!(
        anonymous.is_err(),
        "the server's client-certificate demand was ignored"
    );
}

/// A private Postgres with `ssl=on`, owned by the `postgres` user (initdb
/// refuses root). Stopped when dropped.
struct TlsPostgres {
    dir: PathBuf,
    port: u16,
}

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

fn as_postgres(command: &str) {
    let out = Command::new("su")
        .args(["postgres", "-c", command])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{command}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TlsPostgres {
    fn start(pki: &Pki) -> Self {
        let dir = common::tempdir("tls-pg");
        // The server reads its key only if no one else may.
        for (from, to) in [
            ("server.pem", "server.pem"),
            ("server.key", "server.key"),
            ("ca.pem", "ca.pem"),
        ] {
            std::fs::copy(pki.path(from), dir.join(to)).unwrap();
        }
        let chown = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(chown.success());
        as_postgres(&format!("chmod 600 {}/server.key", dir.display()));
        let port = free_port();
        let d = dir.display();
        as_postgres(&format!(
            "{PG_BIN}/initdb -D {d}/data -U postgres --auth=trust -N >/dev/null"
        ));
        // Only TLS connections are let in: a plaintext attempt is refused
        // by the server, so a client that fell back would fail visibly.
        std::fs::write(
            dir.join("data/pg_hba.conf"),
            "hostssl all all 127.0.0.1/32 trust\nlocal all all trust\n",
        )
        .unwrap();
        as_postgres(&format!(
            "{PG_BIN}/pg_ctl -D {d}/data -l {d}/log -w -o \"-p {port} -k {d} \
             -c listen_addresses=127.0.0.1 -c ssl=on -c ssl_cert_file={d}/server.pem \
             -c ssl_key_file={d}/server.key -c ssl_ca_file={d}/ca.pem\" start >/dev/null"
        ));
        Self { dir, port }
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        let d = self.dir.display();
        let _ = Command::new("su")
            .args([
                "postgres",
                "-c",
                &format!("{PG_BIN}/pg_ctl -D {d}/data -m immediate -w stop"),
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn pg_select(url: &str) -> anyhow::Result<i32> {
    let pool = tokio::time::timeout(Duration::from_secs(10), prizepool::db::connect(url)).await??;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&pool).await?;
    pool.close().await;
    Ok(one)
}

#[tokio::test]
async fn postgres_over_tls_needs_the_right_ca() {
    let pki = Pki::new("tls-pg-pki");
    let pg = TlsPostgres::start(&pki);
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port);
    let ca = pki.path("ca.pem").display().to_string();
    let other = pki.path("other-ca.pem").display().to_string();

    let ok = format!("{base}?sslmode=verify-full&sslrootcert={ca}");
    assert_eq!(pg_select(&ok).await.unwrap(), 1);
    let wrong = format!("{base}?sslmode=verify-full&sslrootcert={other}");
    assert!(
        pg_select(&wrong).await.is_err(),
        "an untrusted CA was accepted"
    );
    // The server admits TLS only: a plaintext client is refused.
    let plain = format!("{base}?sslmode=disable");
    assert!(pg_select(&plain).await.is_err());

    // TLS_CA_FILE alone turns an ordinary URL into a verified TLS one.
    let config = |ca_file: &str| {
        let (base, ca_file) = (base.clone(), ca_file.to_owned());
        Config::from_lookup(move |n| match n {
            "DATABASE_URL" => Some(base.clone()),
            "TLS_CA_FILE" => Some(ca_file.clone()),
            _ => None,
        })
        .unwrap()
    };
    assert_eq!(pg_select(&config(&ca).database_url).await.unwrap(), 1);
    assert!(pg_select(&config(&other).database_url).await.is_err());
}

fn tls_redis_cli(pki: &Pki) -> Command {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["--tls", "--cacert"]).arg(pki.path("ca.pem"));
    cmd
}

/// A three-node Redis Cluster that speaks TLS only, on clients and on its
/// bus; the cluster client reaches every node through `rediss://` with the
/// right CA and none with a wrong one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_over_tls_needs_the_right_ca() {
    let pki = Pki::new("tls-cluster");
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let path = |n: &str| pki.path(n).display().to_string();
    let (cert, key, ca) = (path("server.pem"), path("server.key"), path("ca.pem"));
    let mut nodes = Vec::new();
    for port in &ports {
        let (port, conf) = (port.to_string(), format!("nodes-{port}.conf"));
        // The bus port defaults to the port + 10000, which may not exist.
        let bus = free_port().to_string();
        nodes.push(redis_server(
            0,
            &pki.dir,
            &[
                "--port",
                "0",
                "--tls-port",
                &port,
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &ca,
                "--tls-auth-clients",
                "no",
                "--tls-cluster",
                "yes",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                &conf,
                "--cluster-port",
                &bus,
            ],
        ));
        wait_port(&port);
    }
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let out = tls_redis_cli(&pki)
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cluster create: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    for port in &ports {
        loop {
            let info = tls_redis_cli(&pki)
                .args(["-p", &port.to_string(), "cluster", "info"])
                .output()
                .unwrap();
            if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                break;
            }
            assert!(Instant::now() < deadline, "cluster not ok on {port}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let url = ports
        .iter()
        .map(|p| format!("rediss://127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");

    let mut conn = prizepool::redis_conn::connect_with(&url, &pki.trusting("ca"))
        .await
        .unwrap();
    // Keys under many hash tags land on every node.
    for i in 0..30 {
        let key = format!("pp:{{tls-{i}}}:k");
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(i)
            .query_async(&mut conn)
            .await
            .unwrap();
        let got: i64 = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(got, i);
    }

    let wrong = tokio::time::timeout(
        Duration::from_secs(20),
        prizepool::redis_conn::connect_with(&url, &pki.trusting("other-ca")),
    )
    .await;
    assert!(
        !matches!(wrong, Ok(Ok(_))),
        "a cluster signed by an untrusted CA was accepted"
    );
    drop(nodes);
}
