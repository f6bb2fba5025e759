//! `prizepool healthcheck`: asks a worker's ops endpoint whether it is ready,
//! for container health checks in an image without a shell or an HTTP client
//! (Docker's HEALTHCHECK, Compose's `healthcheck`). Kubernetes probes the
//! same endpoint with its own `httpGet`.

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{bail, Context};

/// Exit 0 when the worker in this container answers `/readyz` with 200, 1
/// otherwise (with the reason on stderr).
#[derive(Debug, clap::Args)]
pub(crate) struct HealthcheckArgs {
    /// The worker's ops endpoint. An unspecified address (0.0.0.0, [::]), as
    /// a worker binds it, is asked on the loopback address.
    #[arg(long, env = "METRICS_ADDR", default_value = prizepool::config::DEFAULT_METRICS_ADDR)]
    addr: SocketAddr,
    /// The path to ask: /readyz (consuming, its servers answer) or /healthz
    /// (the process is alive).
    #[arg(long, default_value = "/readyz")]
    path: String,
    /// Seconds to wait for the connection and for the answer.
    #[arg(long, default_value_t = 2)]
    timeout: u64,
}

/// Asks the endpoint and prints its status line.
pub(crate) fn run(args: &HealthcheckArgs) -> anyhow::Result<()> {
    let mut addr = args.addr;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    let timeout = Duration::from_secs(args.timeout);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    // HTTP/1.0: the server closes the connection after its answer.
    write!(
        stream,
        "GET {} HTTP/1.0\r\nHost: {addr}\r\nUser-Agent: prizepool-healthcheck\r\n\r\n",
        args.path
    )
    .with_context(|| format!("asking {addr}"))?;
    // The answer is a few bytes: "HTTP/1.1 200 OK", headers, "ready".
    let mut answer = Vec::new();
    stream
        .take(64 * 1024)
        .read_to_end(&mut answer)
        .with_context(|| format!("reading the answer of {addr}"))?;
    let answer = String::from_utf8_lossy(&answer);
    let status_line = answer.lines().next().unwrap_or_default();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.trim())
        .unwrap_or_default();
    match status_line.split_whitespace().nth(1) {
        Some("200") => {
            println!("{}{}: {status_line} {body}", addr, args.path);
            Ok(())
        }
        Some(_) => bail!("{addr}{}: {status_line} {body}", args.path),
        None => bail!("{addr}{}: not an HTTP answer: {status_line:?}", args.path),
    }
}
