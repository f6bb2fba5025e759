//! Logging set-up: `RUST_LOG` filters (default `info` for workers, `warn` for the CLI, whose own output is its report), `LOG_FORMAT=json`
//! switches to one JSON object per line, panics included.

use tracing_subscriber::{fmt, prelude::*, EnvFilter};

/// Installs the global subscriber for `service` with `RUST_LOG` as the filter,
/// or `default_level` when it is unset. Safe to call twice (the second call
/// is ignored), so tests may call it freely.
pub fn init(service: &str, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let registry = tracing_subscriber::registry().with(filter);
    let result = if json {
        registry
            .with(
                fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_writer(std::io::stderr),
            )
            .try_init()
    } else {
        registry
            .with(fmt::layer().with_writer(std::io::stderr))
            .try_init()
    };
    if result.is_ok() {
        if json {
            // A panic message would otherwise be the one plain-text line in
            // a JSON log; report it as an event instead.
            std::panic::set_hook(Box::new(|info| {
                let message = crate::db::redact_text(&info.to_string());
                tracing::error!(panic = message, "panicked");
            }));
        }
        tracing::debug!(service, "telemetry initialised");
    }
}
