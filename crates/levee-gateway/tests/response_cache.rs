//! The response cache through the gateway: what is kept, when a stored answer is served
//! (degradation at `cache.from_level` or past it; no backend able to serve), and what
//! bypasses it (random sampling, tenants that did not opt in, a lane not degraded enough).
//! In-process gateway and backends on ephemeral ports; waits poll state.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use common::*;
use levee_gateway::start;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Default)]
struct Backend {
    answered: AtomicUsize,
    down: AtomicBool,
}

/// A backend answering each chat request with a numbered reply; its health check fails
/// while `down`.
async fn backend() -> (String, Arc<Backend>) {
    let st = Arc::new(Backend::default());
    let app = Router::new()
        .route(
            "/v1/chat/completions",
            post(|State(st): State<Arc<Backend>>| async move {
                let n = st.answered.fetch_add(1, Ordering::SeqCst);
                axum::Json(json!({"id": format!("c{n}"), "object": "chat.completion",
                    "created": 1, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": format!("answer {n}")}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}))
            }),
        )
        .route(
            "/health",
            get(|State(st): State<Arc<Backend>>| async move {
                if st.down.load(Ordering::SeqCst) {
                    http::StatusCode::SERVICE_UNAVAILABLE.into_response()
                } else {
                    "ok".into_response()
                }
            }),
        )
        .with_state(st.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, st)
}

fn gateway_config(url: &str) -> levee_gateway::Config {
    let mut cfg = config(&[url.to_string()], 4);
    let mut c = tenant("c", "standard");
    c.response_cache = true;
    cfg.tenants.push(c);
    cfg
}

fn ask(content: &str, temperature: f64, stream: bool) -> Value {
    json!({"model": "m", "temperature": temperature, "max_tokens": 8, "stream": stream,
        "messages": [{"role": "user", "content": content}]})
}

struct Answer {
    marker: Option<String>,
    text: String,
    status: u16,
}

async fn send(base: &str, who: &str, body: &Value) -> Answer {
    let r = client()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(format!("key-{who}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let marker = r
        .headers()
        .get("x-levee-degraded")
        .map(|v| v.to_str().unwrap().to_string());
    let status = r.status().as_u16();
    Answer {
        marker,
        text: r.text().await.unwrap(),
        status,
    }
}

async fn degrade(admin: &str, level: u32) {
    let r = client()
        .post(format!("{admin}/admin/degrade"))
        .json(&json!({ "level": level }))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
}

#[tokio::test]
async fn hit_miss_and_bypass_under_degradation() {
    let (url, be) = backend().await;
    let gw = start(gateway_config(&url)).await.unwrap();
    let base = gw.public_url();
    let first = send(&base, "c", &ask("what is 2+2?", 0.0, false)).await;
    assert_eq!((first.status, first.marker.as_deref()), (200, None));
    assert_eq!(be.answered.load(Ordering::SeqCst), 1);

    degrade(&gw.admin_url(), 2).await;
    // Hit: the same request (whitespace and field order aside) gets the stored answer.
    let same = json!({"messages": [{"content": " what is 2+2? ", "role": "user"}],
        "max_tokens": 8, "model": "m", "temperature": 0});
    let hit = send(&base, "c", &same).await;
    assert_eq!((hit.status, hit.marker.as_deref()), (200, Some("cache")));
    assert_eq!(hit.text, first.text);
    // Streamed, it comes as one chunk.
    let streamed = send(&base, "c", &ask("what is 2+2?", 0.0, true)).await;
    assert_eq!(streamed.marker.as_deref(), Some("cache"));
    assert!(streamed.text.contains("answer 0") && streamed.text.ends_with("data: [DONE]\n\n"));
    assert_eq!(
        be.answered.load(Ordering::SeqCst),
        1,
        "a hit reaches no backend"
    );

    // Miss: another question goes to the backend; its answer, whole, is kept.
    let miss = send(&base, "c", &ask("what is 3+3?", 0.0, false)).await;
    assert_eq!((miss.status, miss.marker.as_deref()), (200, None));
    assert_eq!(be.answered.load(Ordering::SeqCst), 2);
    let again = send(&base, "c", &ask("what is 3+3?", 0.0, false)).await;
    assert_eq!(again.marker.as_deref(), Some("cache"));
    // A capped answer (level 2 caps max_tokens at 256) is not what was asked: not kept.
    let mut long = ask("what is 4+4?", 0.0, false);
    long["max_tokens"] = json!(1000);
    let capped = send(&base, "c", &long).await;
    assert_eq!(capped.marker.as_deref(), Some("max_tokens=256"));
    let capped_again = send(&base, "c", &long).await;
    assert_eq!(capped_again.marker.as_deref(), Some("max_tokens=256"));
    assert_eq!(be.answered.load(Ordering::SeqCst), 4);
    // Bypass: random sampling, and a tenant that did not opt in.
    let random = send(&base, "c", &ask("what is 2+2?", 0.7, false)).await;
    assert_ne!(random.marker.as_deref(), Some("cache"));
    let other = send(&base, "s", &ask("what is 2+2?", 0.0, false)).await;
    assert_ne!(other.marker.as_deref(), Some("cache"));
    assert_eq!(be.answered.load(Ordering::SeqCst), 6);
    // Below `cache.from_level` (2) the lane serves it again.
    degrade(&gw.admin_url(), 1).await;
    let served = send(&base, "c", &ask("what is 2+2?", 0.0, false)).await;
    assert_ne!(served.marker.as_deref(), Some("cache"));
    assert_eq!(be.answered.load(Ordering::SeqCst), 7);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_stored_answer_stands_in_when_no_backend_can_serve() {
    let (url, be) = backend().await;
    let mut cfg = gateway_config(&url);
    cfg.scrape.interval_ms = 50;
    cfg.scrape.unhealthy_after = 1;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let first = send(&base, "c", &ask("hello", 0.0, false)).await;
    assert_eq!(first.status, 200);
    be.down.store(true, Ordering::SeqCst);
    // Wait until the lane knows it cannot serve: a new question is refused.
    let mut refused = false;
    for i in 0..500 {
        let probe = ask(&format!("unknown {i}"), 0.0, false);
        if send(&base, "c", &probe).await.status == 503 {
            refused = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(refused, "the backend never left routing");
    let before = be.answered.load(Ordering::SeqCst);
    let hit = send(&base, "c", &ask("hello", 0.0, false)).await;
    assert_eq!((hit.status, hit.marker.as_deref()), (200, Some("cache")));
    assert_eq!(hit.text, first.text);
    // Not for another tenant, nor for random sampling.
    assert_eq!(
        send(&base, "s", &ask("hello", 0.0, false)).await.status,
        503
    );
    assert_eq!(
        send(&base, "c", &ask("hello", 0.5, false)).await.status,
        503
    );
    assert_eq!(be.answered.load(Ordering::SeqCst), before);
    gw.shutdown().await;
}
