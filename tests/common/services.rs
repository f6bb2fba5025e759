//! What the shared services must offer before a test starts, set up by the
//! tests themselves so that `cargo test` needs nothing but the three servers
//! running as their packages start them:
//!
//! - RabbitMQ's management plugin (vhosts are made and removed over its HTTP
//!   API: one request each, where `rabbitmqctl` boots an Erlang VM each time)
//!   and its random-exchange plugin (`DRAW_SHARDS` > 1). Both ship with
//!   RabbitMQ; enabling them is online and idempotent, once per process.
//! - A Postgres template database with every migration applied, built once
//!   per migration set (under an advisory lock, so concurrent test processes
//!   build it once); each test's database is a copy of it.

use std::{
    io::{Read, Write},
    net::TcpStream,
    sync::OnceLock,
    time::{Duration, Instant},
};

use sqlx::{Connection, PgConnection};

/// The shared broker's management API (the guest user reaches it from
/// loopback).
fn management_addr() -> String {
    std::env::var("TEST_RABBITMQ_MANAGEMENT").unwrap_or_else(|_| "127.0.0.1:15672".into())
}

/// Postgres server used to create per-test databases.
pub fn admin_url() -> String {
    std::env::var("TEST_DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// `admin_url` with its database replaced by `name`.
pub fn database_url(name: &str) -> String {
    let base = admin_url();
    match base.rfind('/') {
        Some(i) => format!("{}/{name}", &base[..i]),
        None => panic!("bad admin url {base}"),
    }
}

/// One HTTP/1.1 request to the management API as guest; the status code
/// and the body. `None` when nothing answers.
fn management(method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(management_addr()).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    // "guest:guest" in base64.
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The plugins the tests need, enabled if the broker lacks one; waits until
/// the management API answers. Once per process.
pub fn broker_ready() {
    static READY: OnceLock<()> = OnceLock::new();
    READY.get_or_init(|| {
        let has_plugins = || {
            management("GET", "/api/overview", "")
                .is_some_and(|(status, body)| status == 200 && body.contains("\"x-random\""))
        };
        if has_plugins() {
            return;
        }
        let out = std::process::Command::new("rabbitmq-plugins")
            .args(["enable", "--quiet"])
            .args(["rabbitmq_management", "rabbitmq_random_exchange"])
            .output()
            .expect("rabbitmq-plugins runs");
        assert!(
            out.status.success(),
            "enabling RabbitMQ's management and random-exchange plugins: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        while !has_plugins() {
            assert!(
                Instant::now() < deadline,
                "RabbitMQ's management API did not answer on {} within 60 s of enabling it",
                management_addr()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    });
}

/// A management API call that must succeed with a 2xx status.
fn manage(method: &str, path: &str, body: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match management(method, path, body) {
            Some((status, _)) if (200..300).contains(&status) => return,
            got => assert!(
                Instant::now() < deadline,
                "{method} {path} on the management API: {got:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Creates `vhost` with every permission for guest.
pub fn add_vhost(vhost: &str) {
    broker_ready();
    manage("PUT", &format!("/api/vhosts/{vhost}"), "");
    manage(
        "PUT",
        &format!("/api/permissions/{vhost}/guest"),
        r#"{"configure":".*","write":".*","read":".*"}"#,
    );
}

/// Deletes `vhost` and everything in it (best effort: a test that ends
/// should not fail here). About 0.2 s with a fleet's queues; done before
/// the test ends, so that the last test of a process leaves nothing behind.
pub fn delete_vhost(vhost: &str) {
    let _ = management("DELETE", &format!("/api/vhosts/{vhost}"), "");
}

/// The template database: every migration of [`prizepool::db::MIGRATOR`]
/// applied. Its name carries a digest of the migrations, so a changed
/// migration set gets a template of its own.
async fn template(admin: &mut PgConnection) -> String {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    for m in prizepool::db::MIGRATOR.iter() {
        digest.update(m.version.to_le_bytes());
        digest.update(&m.checksum);
    }
    let hex: String = digest.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let name = format!("pp_template_{hex}");
    if database_exists(admin, &name).await {
        return name;
    }
    // Another test process may be building it: one builds, the others wait.
    sqlx::query("SELECT pg_advisory_lock(hashtext('prizepool test template'))")
        .execute(&mut *admin)
        .await
        .unwrap();
    if !database_exists(admin, &name).await {
        // Built under another name and renamed when complete, so a template
        // under `name` is always whole.
        let building = format!("{name}_building");
        execute(
            admin,
            &format!("DROP DATABASE IF EXISTS {building} WITH (FORCE)"),
        )
        .await;
        execute(admin, &format!("CREATE DATABASE {building}")).await;
        let pool = prizepool::db::migrate(&database_url(&building))
            .await
            .unwrap();
        pool.close().await;
        execute(
            admin,
            &format!("ALTER DATABASE {building} RENAME TO {name}"),
        )
        .await;
    }
    sqlx::query("SELECT pg_advisory_unlock(hashtext('prizepool test template'))")
        .execute(&mut *admin)
        .await
        .unwrap();
    name
}

async fn database_exists(admin: &mut PgConnection, name: &str) -> bool {
    sqlx::query("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_optional(&mut *admin)
        .await
        .unwrap()
        .is_some()
}

async fn execute(admin: &mut PgConnection, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(&mut *admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Creates database `name` as a copy of the migrated template.
pub async fn create_database(name: &str) {
    let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
    let template = template(&mut admin).await;
    let sql = format!("CREATE DATABASE {name} TEMPLATE {template}");
    // Postgres refuses to copy a database someone is connected to; nobody
    // stays connected to the template, but a builder may just be leaving.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match sqlx::raw_sql(&sql).execute(&mut admin).await {
            Ok(_) => break,
            Err(e) if e.to_string().contains("accessed by other users") => {
                assert!(Instant::now() < deadline, "{sql}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{sql}: {e}"),
        }
    }
    let _ = admin.close().await;
}

/// Drops database `name` (best effort, from `Drop`: no runtime needed).
/// `DROP DATABASE` waits for a checkpoint, about a second here, so `psql`
/// runs on while the next test starts (and finishes even if this process
/// has ended by then).
pub fn drop_database(name: &str) {
    let psql = std::process::Command::new("psql")
        .args([
            &admin_url(),
            "-qc",
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    if let Ok(mut psql) = psql {
        std::thread::spawn(move || psql.wait());
    }
}
