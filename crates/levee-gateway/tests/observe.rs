//! What operators see and steer: admin access rules, the per-tenant metrics and their
//! cardinality bound, abandonment, the replica recommendation. In-process gateway and mock
//! backends on ephemeral ports; synchronisation by polling state with a bounded wait.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::{hash_key, start};
use serde_json::Value;

/// The admin URL reached over loopback, whatever address the listener is bound to.
fn admin_url(gw: &levee_gateway::GatewayHandle) -> String {
    format!("http://127.0.0.1:{}", gw.admin_addr().port())
}

async fn status(req: reqwest::RequestBuilder) -> u16 {
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn non_loopback_admin_needs_the_token() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.listen.admin = "0.0.0.0:0".parse().unwrap();
    cfg.admin.token_sha256 = Some(hash_key("s3cret"));
    let gw = start(cfg).await.unwrap();
    let base = admin_url(&gw);
    let c = client();
    for path in ["/admin/state", "/metrics", "/admin/degrade"] {
        let r = c.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 401, "{path} without a token");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_admin_token");
        let wrong = c.get(format!("{base}{path}")).bearer_auth("guess");
        assert_eq!(status(wrong).await, 401, "{path} with a wrong token");
        let right = c.get(format!("{base}{path}")).bearer_auth("s3cret");
        assert_eq!(status(right).await, 200, "{path} with the token");
    }
    let force = c
        .post(format!("{base}/admin/degrade"))
        .json(&serde_json::json!({"level": 2}));
    assert_eq!(status(force).await, 401);
    assert_eq!(gw.gateway().degradation_json()["forced"], false);
    let force = c
        .post(format!("{base}/admin/degrade"))
        .bearer_auth("s3cret")
        .json(&serde_json::json!({"level": 2}));
    assert_eq!(status(force).await, 200);
    assert_eq!(gw.gateway().degradation_json()["level"], 2);
    assert_eq!(status(c.post(format!("{base}/admin/drain"))).await, 401);
    assert!(!gw.gateway().is_draining());
    // The page itself holds no data and loads without the token.
    assert_eq!(status(c.get(format!("{base}/"))).await, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn non_loopback_admin_without_a_token_refuses_actions() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.listen.admin = "0.0.0.0:0".parse().unwrap();
    let gw = start(cfg).await.unwrap();
    let base = admin_url(&gw);
    let c = client();
    assert_eq!(status(c.get(format!("{base}/admin/state"))).await, 200);
    assert_eq!(status(c.get(format!("{base}/metrics"))).await, 200);
    let r = c
        .post(format!("{base}/admin/degrade"))
        .json(&serde_json::json!({"level": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let body: Value = r.json().await.unwrap();
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("LEVEE_ADMIN_TOKEN"), "{msg}");
    assert_eq!(status(c.post(format!("{base}/admin/drain"))).await, 403);
    assert!(!gw.gateway().is_draining());
    gw.shutdown().await;
}

#[tokio::test]
async fn loopback_admin_without_a_token_is_open() {
    let m = mock().await;
    let gw = start(config(&[m.url()], 4)).await.unwrap();
    let c = client();
    let r = c
        .post(format!("{}/admin/degrade", gw.admin_url()))
        .json(&serde_json::json!({"level": 1}));
    assert_eq!(status(r).await, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn per_tenant_series_are_bounded_and_abandonment_is_counted() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = config(&[m.url()], 1);
    // Tenants in config order: p, s, f, a, b. Only the first two get series of their own.
    cfg.observe.max_tenant_series = 2;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let first = spawn_chat(&c, &base, "s", "first");
    wait_until("first at backend", || m.count() == 1).await;
    // `a` queues behind it, then leaves.
    let gone = spawn_chat(&c, &base, "a", "gone");
    wait_until("queued", || g.queued() == 1).await;
    gone.abort();
    wait_until("left the queue", || g.queued() == 0).await;
    m.hold(false);
    m.release(1);
    assert_eq!(first.await.unwrap().status(), 200);
    assert_eq!(chat(&c, &base, "b", "b1").await.status(), 200);
    assert_eq!(chat(&c, &base, "b", "b2").await.status(), 200);
    let text = metrics_text(&gw).await;
    assert!(
        text.contains("levee_tenant_abandoned_total{tenant=\"other\",phase=\"queued\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("levee_request_duration_seconds_count{model=\"m\",tenant=\"s\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("levee_request_duration_seconds_count{model=\"m\",tenant=\"other\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("levee_request_ttft_seconds_count{model=\"m\",tenant=\"other\"} 2"),
        "{text}"
    );
    assert!(
        !text.contains("tenant=\"b\",le="),
        "b has no series of its own"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn recommendation_is_in_state_and_metrics() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.autoscale.min_replicas = 3;
    cfg.autoscale.warm_pool = 1;
    let gw = start(cfg).await.unwrap();
    let c = client();
    assert_eq!(chat(&c, &gw.public_url(), "s", "x").await.status(), 200);
    gw.gateway().update_scaling();
    let state: Value = c
        .get(format!("{}/admin/state", gw.admin_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let a = &state["autoscale"]["m"];
    assert_eq!(a["replicas"], 3, "{state}");
    assert_eq!(a["slots_per_replica"], 4, "{state}");
    let text = metrics_text(&gw).await;
    assert!(
        text.contains("levee_recommended_replicas{model=\"m\"} 3"),
        "{text}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn every_answer_carries_a_request_id() {
    let m = mock().await;
    let gw = start(config(&[m.url()], 4)).await.unwrap();
    let c = client();
    let base = gw.public_url();
    let a = chat(&c, &base, "s", "a").await;
    let b = chat(&c, &base, "nobody", "refused").await;
    assert_eq!(b.status(), 401);
    let (a, b) = (&a.headers()["x-request-id"], &b.headers()["x-request-id"]);
    assert_ne!(a, b);
    let echoed = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-s")
        .header("x-request-id", "trace-7")
        .json(&chat_body("c"))
        .send()
        .await
        .unwrap();
    assert_eq!(echoed.headers()["x-request-id"], "trace-7");
    gw.shutdown().await;
}

/// Issue 22: a loopback admin listener without a token is not open to a web page in the
/// operator's browser: a cross-origin `text/plain` POST, a form POST and a DNS-rebound
/// `Host` are refused (403 `admin_request_refused`) and change nothing; a JSON POST from
/// the listener's own origin still acts, and a drain can be undone.
#[tokio::test]
async fn loopback_admin_refuses_what_a_browser_page_could_forge() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.server.drain_grace_ms = 0;
    let gw = start(cfg).await.unwrap();
    let base = gw.admin_url();
    let c = client();
    let refused = |r: reqwest::RequestBuilder| async move {
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 403);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "admin_request_refused", "{body}");
    };
    refused(
        c.post(format!("{base}/admin/degrade"))
            .header("content-type", "text/plain")
            .header("origin", "http://attacker.example")
            .body(r#"{"level": 3}"#),
    )
    .await;
    assert_eq!(gw.gateway().degradation_json()["forced"], false);
    refused(
        c.post(format!("{base}/admin/drain"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body("x=1"),
    )
    .await;
    refused(
        c.post(format!("{base}/admin/drain"))
            .header("origin", "http://attacker.example")
            .json(&serde_json::json!({})),
    )
    .await;
    assert!(!gw.gateway().is_leaving());
    refused(
        c.get(format!("{base}/admin/state"))
            .header("host", "attacker.example"),
    )
    .await;
    refused(
        c.get(format!("{base}/metrics"))
            .header("host", "attacker.example:9090"),
    )
    .await;
    // The listener's own origin (the dashboard) acts; a drain can be undone.
    let own = format!("http://{}", gw.admin_addr());
    let r = c
        .post(format!("{base}/admin/drain"))
        .header("origin", &own)
        .json(&serde_json::json!({}));
    assert_eq!(status(r).await, 200);
    wait_until("draining", || gw.gateway().is_draining()).await;
    let ready = c.get(format!("{}/readyz", gw.public_url()));
    assert_eq!(status(ready).await, 503);
    let r = c
        .post(format!("{base}/admin/undrain"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["was_draining"], true);
    assert!(!gw.gateway().is_draining() && !gw.gateway().is_leaving());
    let ready = c.get(format!("{}/readyz", gw.public_url()));
    assert_eq!(status(ready).await, 200);
    gw.shutdown().await;
}
