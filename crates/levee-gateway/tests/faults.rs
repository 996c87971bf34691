//! The fault table (issue 22): what levee does when a backend misbehaves — invalid JSON,
//! a stream that stalls halfway, a stream without end, a 10 MB answer, 500s, a 429 with
//! Retry-After, a connection accepted and never answered. Each case asserts the client's
//! answer and that nothing is left in flight or reserved. Then the accounting defects of
//! the issue that need a backend: a client that leaves before the answer head, the tier
//! an admission is counted in. (Redis killed and frozen: tests/fleet.rs; reloads with
//! broken configs: tests/reload.rs.) In-process servers on ephemeral ports.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use axum::response::IntoResponse;
use common::*;
use levee_gateway::{start, Config, GatewayHandle};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How a fault backend answers every completion.
#[derive(Clone, Copy, Debug)]
enum Fault {
    InvalidJson,
    StallMidStream,
    EndlessStream,
    Huge,
    Fail500,
    RateLimited { retry_after_s: u64 },
    AcceptNeverAnswer,
}

struct FaultBackend {
    url: String,
    calls: Arc<AtomicUsize>,
}

fn sse(n: usize) -> String {
    let c = json!({"id": "c", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": format!(" w{n}")}, "finish_reason": null}]});
    format!("data: {c}\n\n")
}

async fn answer(fault: Fault) -> axum::response::Response {
    let event_stream = [("content-type", "text/event-stream")];
    match fault {
        Fault::InvalidJson => ([("content-type", "application/json")], "{\"choices\": [tru").into_response(),
        Fault::StallMidStream => {
            let first = futures::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(sse(0)))]);
            let stall = futures::stream::pending();
            let body = axum::body::Body::from_stream(futures::StreamExt::chain(first, stall));
            (event_stream, body).into_response()
        }
        Fault::EndlessStream => {
            let s = futures::stream::unfold(0usize, |n| async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Some((Ok::<_, std::io::Error>(bytes::Bytes::from(sse(n))), n + 1))
            });
            (event_stream, axum::body::Body::from_stream(s)).into_response()
        }
        Fault::Huge => {
            let mut body = String::from("{\"choices\": [{\"message\": {\"content\": \"");
            body.push_str(&"x".repeat(10 << 20));
            body.push_str("\"}}]}");
            ([("content-type", "application/json")], body).into_response()
        }
        Fault::Fail500 => (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "application/json")],
            r#"{"error": {"message": "boom", "type": "server_error", "code": null, "param": null}}"#,
        )
            .into_response(),
        Fault::RateLimited { retry_after_s } => (
            http::StatusCode::TOO_MANY_REQUESTS,
            [
                ("content-type", "application/json".to_string()),
                ("retry-after", retry_after_s.to_string()),
                ("x-ratelimit-remaining-requests", "0".to_string()),
            ],
            r#"{"error": {"message": "slow down", "type": "rate_limit_error", "code": null, "param": null}}"#,
        )
            .into_response(),
        Fault::AcceptNeverAnswer => unreachable!("served by a raw listener"),
    }
}

async fn fault_backend(fault: Fault) -> FaultBackend {
    let calls = Arc::new(AtomicUsize::new(0));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    if let Fault::AcceptNeverAnswer = fault {
        let counted = calls.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                held.push(s);
            }
        });
        return FaultBackend { url, calls };
    }
    let c2 = calls.clone();
    let handler = move || {
        let calls = c2.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            answer(fault).await
        }
    };
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(handler))
        .route("/health", axum::routing::get(|| async { "ok" }));
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    FaultBackend { url, calls }
}

/// Nothing in flight, queued or reserved once every answer is over.
async fn assert_idle(gw: &GatewayHandle) {
    let g = gw.gateway().clone();
    wait_until("nothing in flight or queued", || {
        g.in_flight() == 0 && g.queued() == 0
    })
    .await;
    let s = g.state_json();
    for m in s["models"].as_array().unwrap() {
        for b in m["backends"].as_array().unwrap() {
            assert_eq!(b["in_flight"], 0, "{b}");
            assert_eq!(b["tokens_in_flight"], 0, "{b}");
        }
    }
}

fn fault_config(urls: &[String]) -> Config {
    let mut cfg = config(urls, 4);
    cfg.server.request_timeout_ms = 400;
    cfg.server.stream_idle_timeout_ms = 300;
    cfg.server.stream_timeout_ms = 600;
    cfg
}

async fn ask(gw: &GatewayHandle, stream: bool) -> (u16, http::HeaderMap, String) {
    let mut body = chat_body("fault");
    body["stream"] = json!(stream);
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap_or_default())
}

#[tokio::test]
async fn the_fault_table() {
    // (fault, streamed, max_response_bytes, status, what the body must contain)
    let table: Vec<(Fault, bool, Option<usize>, u16, &str)> = vec![
        // Passed on as the backend's answer; its estimate stays charged (no usage).
        (Fault::InvalidJson, false, None, 200, "{\"choices\": [tru"),
        (
            Fault::StallMidStream,
            true,
            None,
            200,
            "stream_idle_timeout",
        ),
        (Fault::EndlessStream, true, None, 200, "stream_timeout"),
        (Fault::Huge, false, None, 200, "xxxxxxxx"),
        (Fault::Huge, false, Some(1 << 20), 502, "max_response_bytes"),
        (Fault::Fail500, false, None, 500, "boom"),
        (
            Fault::AcceptNeverAnswer,
            false,
            None,
            504,
            "upstream_timeout",
        ),
        (
            Fault::AcceptNeverAnswer,
            true,
            None,
            504,
            "upstream_timeout",
        ),
    ];
    let mut failures = Vec::new();
    for (fault, stream, max, status, needle) in table {
        let b = fault_backend(fault).await;
        let mut cfg = fault_config(std::slice::from_ref(&b.url));
        if let Some(max) = max {
            cfg.server.max_response_bytes = max;
        }
        let gw = start(cfg).await.unwrap();
        let (got, _, text) = ask(&gw, stream).await;
        if got != status || !text.contains(needle) {
            let head: String = text.chars().take(300).collect();
            failures.push(format!(
                "{fault:?} stream={stream}: got {got} {head:?}, want {status} containing {needle:?}"
            ));
        }
        assert_idle(&gw).await;
        gw.shutdown().await;
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Issue 22: an upstream 429 with `Retry-After: 30` cools that backend for 30 s (the next
/// requests go elsewhere, not to it first again); a client the backends refused gets a
/// Retry-After from the fleet's state and no `x-ratelimit-*` figures of levee's.
#[tokio::test]
async fn an_upstream_429_cools_its_backend_and_tells_the_client_when_to_return() {
    let limited = fault_backend(Fault::RateLimited { retry_after_s: 30 }).await;
    let good = mock().await;
    let gw = start(fault_config(&[limited.url.clone(), good.url()]))
        .await
        .unwrap();
    for i in 0..6 {
        let (status, _, _) = ask(&gw, false).await;
        assert_eq!(status, 200, "request {i}");
    }
    assert_eq!(
        limited.calls.load(Ordering::SeqCst),
        1,
        "the cooled backend was tried again"
    );
    gw.shutdown().await;

    // Alone behind levee: the client hears the backend's refusal with the fleet's wait.
    let limited = fault_backend(Fault::RateLimited { retry_after_s: 30 }).await;
    let gw = start(fault_config(std::slice::from_ref(&limited.url)))
        .await
        .unwrap();
    let (status, headers, _) = ask(&gw, false).await;
    assert_eq!(status, 429);
    let secs: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((29..=30).contains(&secs), "Retry-After {secs}");
    assert!(headers.contains_key("retry-after-ms"));
    for h in [
        "x-ratelimit-remaining-requests",
        "x-ratelimit-limit-requests",
    ] {
        assert!(
            !headers.contains_key(h),
            "{h} is levee's only when levee refused"
        );
    }
    assert_idle(&gw).await;
    gw.shutdown().await;
}

fn series(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// Issue 22: a client that leaves while its request is at the backend, before the answer
/// head, gets an outcome in `levee_requests_total` and an abandonment count.
#[tokio::test]
async fn a_client_that_leaves_before_the_answer_head_is_counted() {
    let m = mock().await;
    m.hold(true);
    let gw = start(fault_config(&[m.url()])).await.unwrap();
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&chat_body("gone"))
        .send()
        .await;
    assert!(r.is_err(), "the client gave up");
    let state = m.state.clone();
    wait_until("the backend saw the request cancelled", || {
        state.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_idle(&gw).await;
    let text = metrics_text(&gw).await;
    assert_eq!(
        series(
            &text,
            "levee_requests_total{tenant=\"s\",model=\"m\",outcome=\"client_gone\"}"
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        series(
            &text,
            "levee_tenant_abandoned_total{tenant=\"s\",phase=\"dispatched\"}"
        ),
        1.0,
        "{text}"
    );
    gw.shutdown().await;
}

/// Issue 22: `levee_admitted_total{tier}` counts each admission in its own tier: a
/// premium tenant's requests after one of its async tasks are premium, not batch.
#[tokio::test]
async fn admissions_are_counted_in_their_own_tier_after_a_task() {
    let m = mock().await;
    let mut cfg = fault_config(&[m.url()]);
    cfg.tiers.insert(
        "batch".into(),
        levee_gateway::config::TierConfig {
            priority: 3,
            queue_wait_ms: 600_000,
            soft_queue_wait_ms: 600_000,
            sheddable: false,
            queue_updates: false,
            ..Default::default()
        },
    );
    cfg.tasks.enabled = true;
    cfg.tasks.store_path =
        std::env::temp_dir().join(format!("levee-faults-tier-{}.redb", std::process::id()));
    let _ = std::fs::remove_file(&cfg.tasks.store_path);
    let gw = start(cfg).await.unwrap();
    let c = client();
    let t: Value = c
        .post(format!("{}/v1/tasks", gw.public_url()))
        .bearer_auth("key-p")
        .json(&chat_body("task"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = t["id"].as_str().unwrap().to_string();
    let mut done = false;
    for _ in 0..400 {
        let v: Value = c
            .get(format!("{}/v1/tasks/{id}", gw.public_url()))
            .bearer_auth("key-p")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["status"] == "succeeded" {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(done, "the task never finished");
    for _ in 0..2 {
        assert_eq!(
            chat(&c, &gw.public_url(), "p", "interactive")
                .await
                .status(),
            200
        );
    }
    let text = metrics_text(&gw).await;
    assert_eq!(
        series(&text, "levee_admitted_total{tier=\"batch\"}"),
        1.0,
        "{text}"
    );
    assert_eq!(
        series(&text, "levee_admitted_total{tier=\"premium\"}"),
        2.0,
        "{text}"
    );
    gw.shutdown().await;
}
