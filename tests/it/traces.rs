//! Trace export: worker binaries with `OTEL_EXPORTER_OTLP_ENDPOINT` send
//! their spans to an OTLP/HTTP collector (a small one in this test), and a
//! request's W3C trace context (`traceparent` in its AMQP headers) runs
//! through the draw, its reply, its `draw.completed` event and its settlement.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{body::Bytes, extract::State, routing::post, Router};
use common::{draw, free_port, pool_toml, spawn_binary_with, KillOnDrop, TestEnv};
use futures_util::StreamExt;
use lapin::{
    options::{BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
    BasicProperties,
};
use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest, common::v1::any_value,
};
use prost::Message;

const T: Duration = Duration::from_secs(30);

/// A span as the collector received it.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
}

type Spans = Arc<Mutex<Vec<Received>>>;

/// An OTLP/HTTP trace receiver (protobuf) on `port`, keeping every span.
async fn collector(port: u16) -> Spans {
    async fn receive(State(spans): State<Spans>, body: Bytes) -> &'static [u8] {
        let request = ExportTraceServiceRequest::decode(body).unwrap();
        for resource_spans in request.resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                    any_value::Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.lock().unwrap().push(Received {
                        service: service.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                    });
                }
            }
        }
        // An empty ExportTraceServiceResponse.
        b""
    }
    let spans = Spans::default();
    let app = Router::new()
        .route("/v1/traces", post(receive))
        .with_state(spans.clone());
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    spans
}

/// The `traceparent` header of a message.
fn traceparent(properties: &BasicProperties) -> String {
    match properties
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("traceparent").cloned())
    {
        Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
        other => panic!("no traceparent: {other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn random_hex(bytes: usize) -> String {
    hex(&(0..bytes).map(|_| rand::random::<u8>()).collect::<Vec<_>>())
}

/// Waits for a span of `service` named `name` in `trace_id`.
async fn wait_span(spans: &Spans, service: &str, name: &str, trace_id: &str) -> Received {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let found = spans
            .lock()
            .unwrap()
            .iter()
            .find(|s| s.service == service && s.name == name && s.trace_id == trace_id)
            .cloned();
        if let Some(span) = found {
            return span;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {name} span from {service} in trace {trace_id}; received: {:?}",
            spans.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_trace_runs_through_the_draw_its_reply_its_event_and_its_settlement() {
    let port = free_port();
    let spans = collector(port).await;
    let env = TestEnv::new(&[]).await;
    env.load(&pool_toml("traced", "", &[("a", &[(1, 20)])]))
        .await;
    let endpoint = format!("http://127.0.0.1:{port}");
    let traced = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        // Batches leave every 100 ms instead of every 5 s.
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        // Traces follow RUST_LOG: the delivery spans are at info.
        ("RUST_LOG", "warn,prizepool=info"),
    ];
    let _workers: Vec<KillOnDrop> = [
        ("draw-worker", env!("CARGO_BIN_EXE_draw-worker")),
        ("settle-worker", env!("CARGO_BIN_EXE_settle-worker")),
    ]
    .into_iter()
    .map(|(name, exe)| KillOnDrop(spawn_binary_with(&env, name, exe, &traced)))
    .collect();

    // An upstream that traces: its request carries a traceparent.
    let conn = prizepool::amqp::connect(&env.config.amqp_url, "upstream")
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    prizepool::amqp::declare_topology(&channel, env.config.delivery_limit)
        .await
        .unwrap();
    let replies = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut consumer = channel
        .basic_consume(
            replies.name().as_str().into(),
            "upstream".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    // A downstream listener of the draw events.
    let events = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            events.name().as_str().into(),
            prizepool::amqp::EVENTS.into(),
            "draw.completed".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut listener = channel
        .basic_consume(
            events.name().as_str().into(),
            "listener".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (trace_id, upstream_span) = (random_hex(16), random_hex(8));
    let mut headers = FieldTable::default();
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString(
            format!("00-{trace_id}-{upstream_span}-01")
                .into_bytes()
                .into(),
        ),
    );
    let properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_reply_to(replies.name().clone())
        .with_correlation_id("traced-1".into())
        .with_headers(headers);
    channel
        .basic_publish(
            prizepool::amqp::EXCHANGE.into(),
            "draw".into(),
            BasicPublishOptions::default(),
            &serde_json::to_vec(&draw("traced", 5, 2)).unwrap(),
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let reply = tokio::time::timeout(T, consumer.next())
        .await
        .expect("a reply")
        .unwrap()
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&reply.data).unwrap();
    assert_eq!(body["status"], "ok", "{body}");

    // The draw's delivery span continues the upstream's trace…
    let delivery = wait_span(&spans, "draw-worker", "delivery", &trace_id).await;
    assert_eq!(delivery.parent_span_id, upstream_span);
    // …its reply carries the delivery's context back…
    let in_trace = format!("00-{trace_id}-{}-01", delivery.span_id);
    assert_eq!(traceparent(&reply.properties), in_trace);
    // …and so does its draw.completed event…
    let event = tokio::time::timeout(T, listener.next())
        .await
        .expect("a draw.completed event")
        .unwrap()
        .unwrap();
    assert_eq!(traceparent(&event.properties), in_trace);
    // …and the settle worker books the reward in the same trace, under the draw.
    let settle = wait_span(&spans, "settle-worker", "settle.batch", &trace_id).await;
    assert_eq!(settle.parent_span_id, delivery.span_id);
    let _ = conn.close(200, "bye".into()).await;
}
