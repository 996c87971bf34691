// Test helpers outside #[test] fns may unwrap too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use levee_client::{Backoff, Client, ClientError, GiveUp, RetryBudgetConfig, RetryPolicy};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// A server that refuses the first `refusals` calls with 429 + retry-after-ms.
async fn server(refusals: u32) -> (String, Arc<Mutex<Vec<Instant>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let count = Arc::new(AtomicU32::new(0));
    let seen2 = seen.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let seen = seen2.clone();
            let count = count.clone();
            async move {
                seen.lock().await.push(Instant::now());
                if count.fetch_add(1, Ordering::SeqCst) < refusals {
                    (
                        StatusCode::TOO_MANY_REQUESTS,
                        [("retry-after-ms", "40"), ("retry-after", "1")],
                        r#"{"error":{"code":"capacity_overload"}}"#,
                    )
                        .into_response()
                } else {
                    (StatusCode::OK, r#"{"choices":[]}"#).into_response()
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

fn policy() -> RetryPolicy {
    RetryPolicy {
        backoff: Backoff {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(5),
            multiplier: 2.0,
        },
        max_attempts: 4,
        max_retry_after: Duration::from_secs(5),
        retry_after_jitter: 0.2,
    }
}

#[tokio::test]
async fn waits_as_asked_then_succeeds() {
    let (url, seen) = server(2).await;
    let client = Client::new(
        &url,
        Some("k".into()),
        policy(),
        RetryBudgetConfig::default(),
        Duration::from_secs(5),
        Some(1),
    )
    .unwrap();
    let response = client
        .chat_completion(&serde_json::json!({"model": "m"}))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let seen = seen.lock().await;
    assert_eq!(seen.len(), 3);
    for pair in seen.windows(2) {
        // retry-after-ms (40 ms) wins over Retry-After (1 s) and over the 5 ms backoff cap.
        assert!(pair[1] - pair[0] >= Duration::from_millis(40));
    }
}

#[tokio::test]
async fn gives_up_after_max_attempts_with_the_status() {
    let (url, seen) = server(100).await;
    let client = Client::new(
        &url,
        None,
        policy(),
        RetryBudgetConfig::default(),
        Duration::from_secs(5),
        Some(1),
    )
    .unwrap();
    let err = client
        .chat_completion(&serde_json::json!({}))
        .await
        .unwrap_err();
    match err {
        ClientError::Status {
            status,
            attempts,
            reason,
            body,
            ..
        } => {
            assert_eq!(status, 429);
            assert_eq!(attempts, 4);
            assert_eq!(reason, GiveUp::MaxAttempts);
            assert!(body.contains("capacity_overload"));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(seen.lock().await.len(), 4);
}

/// A server whose every answer carries `x-levee-degraded` with `status`.
async fn degraded_server(status: StatusCode) -> (String, Arc<AtomicU32>) {
    let count = Arc::new(AtomicU32::new(0));
    let c = count.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                (
                    status,
                    [
                        ("x-levee-degraded", "max_tokens=64"),
                        ("retry-after-ms", "1"),
                    ],
                    r#"{"choices":[]}"#,
                )
                    .into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), count)
}

#[tokio::test]
async fn a_degraded_answer_is_final() {
    let make = |url: &str| {
        Client::new(
            url,
            None,
            policy(),
            RetryBudgetConfig::default(),
            Duration::from_secs(5),
            Some(1),
        )
        .unwrap()
    };
    // A capped 200 comes back as it is, marked.
    let (url, count) = degraded_server(StatusCode::OK).await;
    let r = make(&url)
        .chat_completion(&serde_json::json!({}))
        .await
        .unwrap();
    let d = levee_client::Degradation::from_headers(r.headers()).unwrap();
    assert_eq!(d.max_tokens_cap(), Some(64));
    assert_eq!(count.load(Ordering::SeqCst), 1);
    // A degraded error is not retried either, though 503 alone would be.
    let (url, count) = degraded_server(StatusCode::SERVICE_UNAVAILABLE).await;
    match make(&url).chat_completion(&serde_json::json!({})).await {
        Err(ClientError::Status {
            status,
            attempts,
            reason,
            ..
        }) => {
            assert_eq!((status, attempts, reason), (503, 1, GiveUp::Degraded));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(count.load(Ordering::SeqCst), 1);
}
