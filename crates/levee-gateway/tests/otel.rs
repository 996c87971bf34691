//! OpenTelemetry export (feature `otel`): a request through the gateway arrives at an
//! in-process fake OTLP/HTTP collector as one trace, a `request` span with one child span per
//! phase and the request's attributes, and never the API key.
//!
//! Run with `cargo test -p levee-gateway --features otel --test otel`.
#![cfg(feature = "otel")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use common::*;
use levee_gateway::start;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// What the fake collector received: one entry per POST /v1/traces.
#[derive(Default)]
struct Received {
    posts: Mutex<Vec<(String, Bytes)>>,
}

async fn traces(State(r): State<Arc<Received>>, headers: http::HeaderMap, body: Bytes) -> Vec<u8> {
    let ct = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    r.posts.lock().push((ct, body));
    // An empty ExportTraceServiceResponse: everything accepted.
    Vec::new()
}

async fn collector() -> (String, Arc<Received>) {
    let received = Arc::new(Received::default());
    let app = Router::new()
        .route("/v1/traces", post(traces))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), received)
}

// A protobuf reader just deep enough for OTLP traces (ExportTraceServiceRequest →
// ResourceSpans.scope_spans(2) → ScopeSpans.spans(2) → Span).

/// The fields of one message: field number → raw values (varints as their value's bytes
/// are not needed here, so only length-delimited values are kept).
fn fields(mut b: &[u8]) -> Vec<(u64, &[u8])> {
    fn varint(b: &mut &[u8]) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = b[0];
            *b = &b[1..];
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
        }
        v
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b);
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            0 => {
                varint(&mut b);
            }
            1 => b = &b[8..],
            2 => {
                let len = usize::try_from(varint(&mut b)).unwrap();
                out.push((field, &b[..len]));
                b = &b[len..];
            }
            5 => b = &b[4..],
            w => panic!("unexpected protobuf wire type {w}"),
        }
    }
    out
}

fn field(msg: &[u8], n: u64) -> Option<&[u8]> {
    fields(msg)
        .into_iter()
        .find(|(f, _)| *f == n)
        .map(|(_, v)| v)
}

fn repeated(msg: &[u8], n: u64) -> Vec<&[u8]> {
    fields(msg)
        .into_iter()
        .filter(|(f, _)| *f == n)
        .map(|(_, v)| v)
        .collect()
}

#[derive(Debug)]
struct Span {
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    name: String,
    /// String attributes by key; other attribute kinds are listed with an empty value.
    attrs: HashMap<String, String>,
}

fn spans(export: &[u8]) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in repeated(export, 1) {
        for ss in repeated(rs, 2) {
            for s in repeated(ss, 2) {
                let text = |n| String::from_utf8(field(s, n).unwrap_or(&[]).to_vec()).unwrap();
                let mut attrs = HashMap::new();
                for kv in repeated(s, 9) {
                    let key = String::from_utf8(field(kv, 1).unwrap().to_vec()).unwrap();
                    let value = field(kv, 2)
                        .and_then(|any| field(any, 1))
                        .map(|v| String::from_utf8(v.to_vec()).unwrap())
                        .unwrap_or_default();
                    attrs.insert(key, value);
                }
                out.push(Span {
                    trace: field(s, 1).unwrap_or(&[]).to_vec(),
                    id: field(s, 2).unwrap_or(&[]).to_vec(),
                    parent: field(s, 4).unwrap_or(&[]).to_vec(),
                    name: text(5),
                    attrs,
                });
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_exported_as_one_trace_with_its_phases() {
    let (endpoint, received) = collector().await;
    let (layer, exporter) = levee_gateway::otel::layer(&endpoint).unwrap();
    tracing_subscriber::registry().with(layer).init();

    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.observe.otlp_endpoint = Some(endpoint.clone());
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let ok = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-s")
        .header("x-request-id", "otel-served")
        .json(&chat_body("hello"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    ok.bytes().await.unwrap();
    let refused = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-nobody")
        .header("x-request-id", "otel-refused")
        .json(&chat_body("hello"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    // Shutdown waits for the connections, so both requests have settled; then the last batch
    // goes out (a blocking call: off the async workers).
    gw.shutdown().await;
    tokio::task::spawn_blocking(move || exporter.shutdown())
        .await
        .unwrap()
        .unwrap();

    let posts = received.posts.lock().clone();
    assert!(!posts.is_empty(), "the collector received no export");
    for (ct, body) in &posts {
        assert_eq!(ct, "application/x-protobuf");
        assert!(!body.is_empty());
        let raw = body.as_ref();
        assert!(
            !raw.windows(b"key-".len()).any(|w| w == b"key-"),
            "an API key reached the collector"
        );
    }
    let all: Vec<Span> = posts.iter().flat_map(|(_, b)| spans(b)).collect();
    let root = |id: &str| {
        let found: Vec<&Span> = all
            .iter()
            .filter(|s| {
                s.name == "request" && s.attrs.get("request_id").map(String::as_str) == Some(id)
            })
            .collect();
        assert_eq!(found.len(), 1, "one request span for {id}: {all:#?}");
        found[0]
    };

    let served = root("otel-served");
    assert!(served.parent.is_empty(), "the request span is a root");
    assert_eq!(served.attrs["tenant"], "s");
    assert_eq!(served.attrs["model"], "m");
    assert_eq!(served.attrs["outcome"], "ok");
    assert_eq!(
        served.attrs["backend"],
        format!("m@{}", m.url()),
        "{served:?}"
    );
    assert!(served.attrs.contains_key("queue_ms"), "{served:?}");
    assert!(
        served.attrs.contains_key("http.response.status_code"),
        "{served:?}"
    );
    let mut phases: Vec<&str> = all
        .iter()
        .filter(|s| s.parent == served.id)
        .inspect(|s| assert_eq!(s.trace, served.trace, "a phase in another trace"))
        .map(|s| s.name.as_str())
        .collect();
    phases.sort_unstable();
    assert_eq!(
        phases,
        [
            "admit",
            "authenticate",
            "classify",
            "dispatch",
            "proxy",
            "read_body",
            "settle"
        ]
    );

    let refused = root("otel-refused");
    assert_ne!(refused.trace, served.trace, "each request is its own trace");
    assert_eq!(refused.attrs["outcome"], "invalid_api_key");
    assert!(!refused.attrs.contains_key("tenant"), "{refused:?}");
    let phases: Vec<&str> = all
        .iter()
        .filter(|s| s.parent == refused.id)
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(phases, ["authenticate"]);
}
