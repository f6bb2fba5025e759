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
