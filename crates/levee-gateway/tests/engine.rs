//! End to end against the simulated engine (levee-engine's in-process API).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::start;
use serde_json::Value;

async fn engine() -> levee_engine::EngineHandle {
    let mut cfg = levee_engine::EngineConfig::tiny_fast();
    cfg.model = "m".into();
    levee_engine::spawn(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn chat_and_stream_through_the_engine() {
    let e = engine().await;
    let mut cfg = config(&[e.base_url()], 4);
    cfg.scrape.interval_ms = 100;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let r = chat(&c, &gw.public_url(), "s", "hello engine").await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    let mut body = chat_body("stream please");
    body["stream"] = Value::Bool(true);
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(
        !text.contains("\"choices\":[]"),
        "usage chunk leaked: {text}"
    );
    // The scraper reads the engine's vLLM metrics.
    let g = gw.gateway().clone();
    wait_until("engine load scraped", || {
        g.lanes()[0].backends()[0].load.lock().is_some()
    })
    .await;
    let metrics = c
        .get(format!("{}/metrics", gw.admin_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("levee_backend_kv_usage"), "{metrics}");
    assert!(metrics.contains("levee_tokens_total{tenant=\"s\",kind=\"completion\"}"));
    gw.shutdown().await;
    e.shutdown().await.unwrap();
}
