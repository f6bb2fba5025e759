//! The operations endpoint each worker serves: `/metrics` (Prometheus),
//! `/healthz` (the process is alive) and `/readyz` (it is consuming).

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use anyhow::Context;
use axum::{extract::State, http::StatusCode, routing::get, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

/// Readiness shared between a worker and its ops endpoint.
#[derive(Clone, Debug, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
}

impl Health {
    /// Marks the worker ready (consuming) or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Whether the worker is consuming.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
struct OpsState {
    health: Health,
    metrics: PrometheusHandle,
}

/// Installs the Prometheus recorder and serves the ops endpoint on `addr`
/// until `shutdown`. Returns the bound address.
pub async fn serve(
    addr: &str,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<std::net::SocketAddr> {
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<OpsState>| async move { s.metrics.render() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(s): State<OpsState>| async move {
                if s.health.is_ready() {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .with_state(OpsState { health, metrics });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the ops endpoint to {addr}"))?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(error) = served {
            tracing::warn!(%error, "ops endpoint stopped");
        }
    });
    tracing::info!(%bound, "serving /metrics, /healthz, /readyz");
    Ok(bound)
}

/// Puts the calling thread, and every thread it starts from now on (lapin's
/// I/O thread, the blocking pool), under Linux's `SCHED_BATCH` policy.
///
/// A batch thread does not preempt the running thread when it wakes up. A
/// draw hands work back and forth between the runtime thread and lapin's
/// I/O thread several times, and on a busy machine each hand-off otherwise
/// costs a context switch at once; under this policy the waker runs on and
/// the switches come in fewer, larger batches. It needs no privilege and
/// leaves priorities alone. Measured effect in `docs/performance.md`.
pub fn batch_scheduling() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid, initialised `sched_param` that lives
        // across the call; pid 0 names the calling thread.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "SCHED_BATCH exists on Linux only",
        ))
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn batch_scheduling_applies_to_the_thread_and_the_threads_it_starts() {
        std::thread::spawn(|| {
            // SAFETY: plain queries of the calling thread's policy.
            let policy = || unsafe { libc::sched_getscheduler(0) };
            assert_eq!(policy(), libc::SCHED_OTHER);
            super::batch_scheduling().expect("SCHED_BATCH needs no privilege");
            assert_eq!(policy(), libc::SCHED_BATCH);
            let child = std::thread::spawn(policy).join().expect("child ran");
            assert_eq!(child, libc::SCHED_BATCH);
        })
        .join()
        .expect("the checks passed");
    }
}
