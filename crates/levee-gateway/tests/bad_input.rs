//! Bad input never panics and always gets the OpenAI error shape; slow or huge headers
//! are cut off; one bad request does not affect another.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::start;
use serde_json::Value;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn expect_error(r: reqwest::Response, status: u16, code: &str) {
    assert_eq!(r.status().as_u16(), status);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(v["error"]["message"].is_string());
    assert!(v["error"]["type"].is_string());
    assert!(v["error"].get("param").is_some());
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.server.max_body_bytes = 1024;
    let gw = start(cfg).await.unwrap();
    let url = format!("{}/v1/chat/completions", gw.public_url());
    let c = client();
    // Missing and wrong keys.
    expect_error(
        c.post(&url).json(&chat_body("x")).send().await.unwrap(),
        401,
        "invalid_api_key",
    )
    .await;
    expect_error(
        c.post(&url)
            .bearer_auth("nope")
            .json(&chat_body("x"))
            .send()
            .await
            .unwrap(),
        401,
        "invalid_api_key",
    )
    .await;
    // Malformed JSON.
    expect_error(
        c.post(&url)
            .bearer_auth("key-s")
            .body("{not json")
            .send()
            .await
            .unwrap(),
        400,
        "invalid_request",
    )
    .await;
    // Body over the limit.
    let big = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(4096)}]});
    expect_error(
        c.post(&url)
            .bearer_auth("key-s")
            .json(&big)
            .send()
            .await
            .unwrap(),
        413,
        "request_too_large",
    )
    .await;
    // A compressed body (levee reads JSON as sent), and `identity`, which is not one.
    let gzip = c
        .post(&url)
        .bearer_auth("key-s")
        .header("content-encoding", "gzip")
        .body(vec![0x1f, 0x8b, 0x08, 0x00])
        .send()
        .await
        .unwrap();
    assert_eq!(gzip.headers()["accept-encoding"], "identity");
    expect_error(gzip, 415, "unsupported_content_encoding").await;
    let identity = c
        .post(&url)
        .bearer_auth("key-s")
        .header("content-encoding", "identity")
        .json(&chat_body("plain"))
        .send()
        .await
        .unwrap();
    assert_eq!(identity.status(), 200);
    // Unknown model.
    let unknown = serde_json::json!({"model": "nope", "messages": []});
    expect_error(
        c.post(&url)
            .bearer_auth("key-s")
            .json(&unknown)
            .send()
            .await
            .unwrap(),
        404,
        "model_not_found",
    )
    .await;
    // Unknown route and wrong method.
    expect_error(
        c.get(format!("{}/v1/nothing", gw.public_url()))
            .send()
            .await
            .unwrap(),
        404,
        "not_found",
    )
    .await;
    expect_error(c.get(&url).send().await.unwrap(), 405, "method_not_allowed").await;
    // Nothing bad reached the backend (only the `identity` one did), and a good request
    // still works.
    assert_eq!(m.count(), 1);
    assert_eq!(chat(&c, &gw.public_url(), "s", "fine").await.status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn slow_headers_are_cut_off() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.server.header_read_timeout_ms = 200;
    let gw = start(cfg).await.unwrap();
    let mut s = tokio::net::TcpStream::connect(gw.public_addr())
        .await
        .unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    // Never finish the header block: the server must close the connection by itself.
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    assert!(
        read.is_ok(),
        "connection not closed by the header read timeout"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn huge_headers_are_refused() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.server.max_header_bytes = 8192;
    let gw = start(cfg).await.unwrap();
    let mut s = tokio::net::TcpStream::connect(gw.public_addr())
        .await
        .unwrap();
    let mut req = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: ".to_vec();
    req.extend(std::iter::repeat_n(b'a', 64 * 1024));
    req.extend_from_slice(b"\r\n\r\n");
    // The server may stop reading part-way; a write error is an acceptable cut-off too.
    let _ = s.write_all(&req).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    assert!(
        buf.is_empty() || text.starts_with("HTTP/1.1 431"),
        "huge header got: {text}"
    );
    // The server is still fine.
    let r = client()
        .get(format!("{}/healthz", gw.public_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.shutdown().await;
}
