//! Logging set-up: `RUST_LOG` filters (default `info` for workers (lapin's channel-close reports left out), `warn` for the CLI, whose own output is its report), `LOG_FORMAT=json`
//! switches to one JSON object per line, panics included.
//!
//! Traces: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, [`export_traces`] sends the
//! spans (one per delivery, with what happens inside it) to an OpenTelemetry
//! collector over OTLP/HTTP. The W3C trace context (`traceparent`,
//! `tracestate`) travels in AMQP headers: a delivery whose message carries
//! one continues that trace ([`continue_trace`]), and everything it publishes
//! (its reply, settlement, refill request, events, dead letter) carries the
//! delivery's context on ([`with_trace_context`]).

use std::sync::OnceLock;

use lapin::{
    types::{AMQPValue, FieldTable},
    BasicProperties,
};
use opentelemetry::{
    propagation::{Extractor, Injector, TextMapPropagator},
    trace::{TraceContextExt, TracerProvider as _},
};
use opentelemetry_sdk::{propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing::{span, subscriber::Subscriber, Event};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    fmt,
    layer::{Context, Layered},
    prelude::*,
    registry::Registry,
    EnvFilter, Layer,
};

/// The subscriber beneath the trace layer.
type Base = Layered<EnvFilter, Registry>;
/// The layer that turns spans into OpenTelemetry spans.
type OtelLayer =
    tracing_opentelemetry::OpenTelemetryLayer<Base, opentelemetry_sdk::trace::SdkTracer>;

/// The trace layer, set once by [`export_traces`] when the configuration is
/// known (logging starts before it is read, so start-up errors are logged).
static TRACE_LAYER: OnceLock<OtelLayer> = OnceLock::new();
/// Whether [`init`] installed the subscriber that holds [`Traces`].
static INSTALLED: OnceLock<()> = OnceLock::new();

/// Forwards to [`TRACE_LAYER`] once it is set, and does nothing before.
///
/// Not `tracing_subscriber::reload`: a reloadable layer refuses downcasts
/// (its inner layer may be swapped while a pointer is held), and
/// tracing-opentelemetry finds its context through a downcast, so spans
/// could neither take a remote parent nor hand their context on. A layer
/// in a static that is set once and never replaced can be downcast safely.
struct Traces;

impl<S> Layer<S> for Traces
where
    OtelLayer: Layer<S>,
    S: Subscriber,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(layer) = TRACE_LAYER.get() {
            layer.on_new_span(attrs, id, ctx);
        }
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        if let Some(layer) = TRACE_LAYER.get() {
            layer.on_record(id, values, ctx);
        }
    }

    fn on_follows_from(&self, id: &span::Id, follows: &span::Id, ctx: Context<'_, S>) {
        if let Some(layer) = TRACE_LAYER.get() {
            layer.on_follows_from(id, follows, ctx);
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        if let Some(layer) = TRACE_LAYER.get() {
            layer.on_event(event, ctx);
        }
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(layer) = TRACE_LAYER.get() {
            layer.on_enter(id, ctx);
        }
    }

    fn on_exit(&self, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(layer) = TRACE_LAYER.get() {
            layer.on_exit(id, ctx);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        if let Some(layer) = TRACE_LAYER.get() {
            layer.on_close(id, ctx);
        }
    }

    unsafe fn downcast_raw(&self, id: std::any::TypeId) -> Option<*const ()> {
        if id == std::any::TypeId::of::<Self>() {
            return Some(self as *const Self as *const ());
        }
        // SAFETY: the layer lives in a static that is never replaced, so a
        // pointer into it stays valid for the life of the process.
        unsafe { <OtelLayer as Layer<S>>::downcast_raw(TRACE_LAYER.get()?, id) }
    }
}

/// The workers' log filter when `RUST_LOG` is unset: `info`, without
/// lapin's own report of a channel the broker closed. The draw worker probes
/// for draw shards a larger `DRAW_SHARDS` left behind with passive
/// declarations, which the broker answers for each missing queue by closing
/// the probe's channel; and every other channel failure reaches the
/// worker's own code, which logs it with what it means.
pub const WORKER_LOG_FILTER: &str = "info,lapin::channel=off";

/// Installs the global subscriber for `service` with `RUST_LOG` as the filter,
/// or `default_level` when it is unset. Safe to call twice (the second call
/// is ignored), so tests may call it freely.
pub fn init(service: &str, default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let registry = tracing_subscriber::registry().with(filter).with(Traces);
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
        let _ = INSTALLED.set(());
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

/// Trace export while it lives: dropping it sends the spans still buffered
/// (a worker drops it as it exits).
#[derive(Debug, Default)]
#[must_use = "dropping it ends the trace export"]
pub struct TraceExport {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TraceExport {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Waits for the batch's last export (bounded by its timeout).
            if let Err(error) = provider.shutdown() {
                tracing::warn!(%error, "flushing the last traces failed");
            }
        }
    }
}

/// Starts exporting `service`'s spans to the OTLP/HTTP collector at
/// `endpoint` (its base URL: spans go to `<endpoint>/v1/traces`), in batches
/// from a thread of their own. `None` exports nothing. A collector that is
/// away costs dropped spans, never a stalled worker.
pub fn export_traces(endpoint: Option<&str>, service: &str) -> anyhow::Result<TraceExport> {
    use opentelemetry_otlp::WithExportConfig;
    let Some(endpoint) = endpoint else {
        return Ok(TraceExport::default());
    };
    anyhow::ensure!(
        INSTALLED.get().is_some(),
        "trace export needs telemetry::init first"
    );
    let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url.clone())
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service.to_owned())
                .build(),
        )
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("prizepool"));
    if TRACE_LAYER.set(layer).is_err() {
        // A second export in one process (tests): the first one stays.
        let _ = provider.shutdown();
        anyhow::bail!("traces are exported already");
    }
    tracing::info!(endpoint = %crate::db::redact(&url), "exporting traces");
    Ok(TraceExport {
        provider: Some(provider),
    })
}

/// Makes `span` (a delivery's) continue the trace whose context `headers`
/// carry (`traceparent`), if any. Without trace export, or without a valid
/// context in the headers, the span starts a trace of its own.
pub fn continue_trace(span: &tracing::Span, headers: Option<&FieldTable>) {
    let Some(headers) = headers else { return };
    let context = TraceContextPropagator::new().extract(&HeaderReader(headers));
    if context.span().span_context().is_valid() {
        // Fails only when the span is disabled (filtered out): nothing to link.
        let _ = span.set_parent(context);
    }
}

/// Makes `span` (one for a batch of deliveries) continue the trace of the
/// first delivery that carries one, and link to the traces of the others.
pub fn follow_traces<'a>(
    span: &tracing::Span,
    headers: impl IntoIterator<Item = Option<&'a FieldTable>>,
) {
    let propagator = TraceContextPropagator::new();
    let mut parented = false;
    for headers in headers.into_iter().flatten() {
        let context = propagator.extract(&HeaderReader(headers));
        let remote = context.span().span_context().clone();
        if !remote.is_valid() {
            continue;
        }
        if parented {
            span.add_link(remote);
        } else {
            parented = span.set_parent(context).is_ok();
        }
    }
}

/// `properties` with the current span's trace context added to its headers
/// (`traceparent`, and `tracestate` when there is one), so the consumer of
/// the message continues the trace. Unchanged when no trace is being
/// recorded.
pub fn with_trace_context(properties: BasicProperties) -> BasicProperties {
    let context = tracing::Span::current().context();
    if !context.span().span_context().is_valid() {
        return properties;
    }
    let mut headers = properties.headers().clone().unwrap_or_default();
    TraceContextPropagator::new().inject_context(&context, &mut HeaderWriter(&mut headers));
    properties.with_headers(headers)
}

/// AMQP headers as a place to read a trace context from.
struct HeaderReader<'a>(&'a FieldTable);

impl Extractor for HeaderReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match self.0.inner().get(key)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
            AMQPValue::ShortString(s) => Some(s.as_str()),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.0.inner().keys().map(|k| k.as_str()).collect()
    }
}

/// AMQP headers as a place to write a trace context to.
struct HeaderWriter<'a>(&'a mut FieldTable);

impl Injector for HeaderWriter<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0
            .insert(key.into(), AMQPValue::LongString(value.into_bytes().into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use opentelemetry::trace::{SpanId, TraceId};
    use opentelemetry_sdk::{
        error::OTelSdkResult,
        trace::{SpanData, SpanExporter},
    };

    /// Keeps the spans it is given.
    #[derive(Clone, Debug, Default)]
    struct Kept(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Kept {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    /// Runs `f` under a subscriber that records spans in memory, and returns
    /// the finished spans.
    fn recorded(f: impl FnOnce()) -> Vec<SpanData> {
        let kept = Kept::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(kept.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f);
        provider.force_flush().unwrap();
        let spans = kept.0.lock().unwrap().clone();
        spans
    }

    fn span<'a>(spans: &'a [SpanData], name: &str) -> &'a SpanData {
        spans.iter().find(|s| s.name == name).unwrap()
    }

    #[test]
    fn a_trace_context_published_with_a_message_parents_the_delivery_span_that_consumes_it() {
        let mut published = None;
        let spans = recorded(|| {
            // The publishing side: a request span, and a message sent in it.
            let request = tracing::info_span!("request");
            request.in_scope(|| {
                published = Some(with_trace_context(
                    BasicProperties::default().with_content_type("application/json".into()),
                ));
            });
            drop(request);
            // The consuming side, as the consume loop does it.
            let properties = published.clone().unwrap();
            let delivery = tracing::info_span!("delivery");
            continue_trace(&delivery, properties.headers().as_ref());
            // What the delivery publishes carries its context on.
            let reply = delivery.in_scope(|| with_trace_context(BasicProperties::default()));
            drop(delivery);
            published = Some(reply);
        });
        let (request, delivery) = (span(&spans, "request"), span(&spans, "delivery"));
        assert_eq!(
            delivery.span_context.trace_id(),
            request.span_context.trace_id()
        );
        assert_eq!(delivery.parent_span_id, request.span_context.span_id());
        assert_ne!(request.span_context.trace_id(), TraceId::INVALID);
        // The reply's traceparent names the delivery span as its parent.
        let reply = published.unwrap();
        let traceparent = HeaderReader(reply.headers().as_ref().unwrap())
            .get("traceparent")
            .unwrap()
            .to_owned();
        assert_eq!(
            traceparent,
            format!(
                "00-{}-{}-01",
                delivery.span_context.trace_id(),
                delivery.span_context.span_id()
            )
        );
    }

    #[test]
    fn a_batch_span_continues_the_first_trace_and_links_the_others() {
        let spans = recorded(|| {
            let headers: Vec<FieldTable> = ["first", "second"]
                .into_iter()
                .map(|name| {
                    let span = tracing::info_span!("request", which = name);
                    let properties =
                        span.in_scope(|| with_trace_context(BasicProperties::default()));
                    properties.headers().clone().unwrap()
                })
                .collect();
            let batch = tracing::info_span!("batch");
            follow_traces(&batch, [None, Some(&headers[0]), Some(&headers[1])]);
        });
        let requests: Vec<&SpanData> = spans.iter().filter(|s| s.name == "request").collect();
        let batch = span(&spans, "batch");
        assert_eq!(
            batch.span_context.trace_id(),
            requests[0].span_context.trace_id()
        );
        assert_eq!(batch.parent_span_id, requests[0].span_context.span_id());
        let links: Vec<_> = batch
            .links
            .iter()
            .map(|l| l.span_context.span_id())
            .collect();
        assert_eq!(links, [requests[1].span_context.span_id()]);
    }

    #[test]
    fn without_a_trace_context_a_delivery_starts_its_own_trace_and_headers_stay_untouched() {
        let mut headers = FieldTable::default();
        headers.insert(
            "traceparent".into(),
            AMQPValue::LongString(b"garbage".to_vec().into()),
        );
        let spans = recorded(|| {
            let delivery = tracing::info_span!("delivery");
            continue_trace(&delivery, Some(&headers));
            drop(delivery);
        });
        assert_eq!(span(&spans, "delivery").parent_span_id, SpanId::INVALID);
        // No span, no trace: nothing is added.
        let plain = with_trace_context(BasicProperties::default());
        assert!(plain.headers().is_none());
    }
}
