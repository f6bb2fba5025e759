//! TLS to RabbitMQ that fails closed: a private node with a TLS listener
//! only and certificates made by the test, reached with the right CA,
//! refused with a wrong one and over plain TCP. A test binary of its own:
//! it installs TLS files for the whole process (`TlsFiles::install`), as a
//! worker does, and every later connection of the process would use them.
//! The other TLS tests are `tests/it/tls.rs`.

#![allow(clippy::unwrap_used)]

mod common;

use std::{path::PathBuf, time::Duration};

use common::{pki::Pki, PrivateRabbit};
use prizepool::config::TlsFiles;

/// A private RabbitMQ node with a TLS listener only (no plain TCP), run by
/// the `rabbitmq` user; about ten seconds to start. Stopped when dropped.
fn tls_rabbit(pki: &Pki) -> PrivateRabbit {
    let files: Vec<PathBuf> = ["server.pem", "server.key", "ca.pem"]
        .into_iter()
        .map(|name| pki.path(name))
        .collect();
    PrivateRabbit::start("tls", &files, |port, dir| {
        let d = dir.display();
        format!(
            "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:{port}\n\
             ssl_options.cacertfile = {d}/ca.pem\nssl_options.certfile = {d}/server.pem\n\
             ssl_options.keyfile = {d}/server.key\nssl_options.verify = verify_none\n\
             ssl_options.fail_if_no_peer_cert = false\n"
        )
    })
}

async fn amqp_open(url: &str, tls: &TlsFiles) -> anyhow::Result<()> {
    let connecting = lapin::Connection::connect_with_config(
        url,
        lapin::ConnectionProperties::default(),
        tls.amqp()?,
        lapin::runtime::default_runtime()?,
    );
    let conn = tokio::time::timeout(Duration::from_secs(10), connecting).await??;
    let channel = conn.create_channel().await?;
    channel.close(200, "done".into()).await?;
    conn.close(200, "done".into()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_over_tls_needs_the_right_ca() {
    let pki = Pki::new("tls-rabbit-pki");
    let rabbit = tls_rabbit(&pki);
    let url = format!("amqps://guest:guest@localhost:{}/%2f", rabbit.port);

    amqp_open(&url, &pki.trusting("ca")).await.unwrap();
    let wrong = amqp_open(&url, &pki.trusting("other-ca")).await;
    assert!(wrong.is_err(), "an untrusted CA was accepted");
    // The port speaks TLS only; a plain URL gets nowhere.
    let plain = format!("amqp://guest:guest@localhost:{}/%2f", rabbit.port);
    assert!(amqp_open(&plain, &pki.trusting("ca")).await.is_err());

    // The workers' own connect path, with the files a worker installs.
    pki.trusting("ca").install();
    let conn = prizepool::amqp::connect(&url, "tls-test").await.unwrap();
    conn.close(200, "done".into()).await.unwrap();
}
