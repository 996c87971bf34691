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
        g.state_json()["models"][0]["backends"][0]["reported"].is_object()
    })
    .await;
    let metrics = metrics_text(&gw).await;
    assert!(metrics.contains("levee_backend_kv_usage"), "{metrics}");
    assert!(metrics.contains("levee_tokens_total{tenant=\"s\",kind=\"completion\"}"));
    gw.shutdown().await;
    e.shutdown().await.unwrap();
}

#[tokio::test]
async fn failing_engine_opens_its_breaker_and_traffic_moves() {
    let bad = engine().await;
    bad.set_faults(&levee_engine::FaultsUpdate {
        error_rate: Some(1.0),
        ..Default::default()
    })
    .unwrap();
    let good = engine().await;
    let mut cfg = config(&[bad.base_url(), good.base_url()], 4);
    cfg.breaker.consecutive_failures = 2;
    cfg.breaker.open_ms = 60_000;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let mut statuses = Vec::new();
    for i in 0..6 {
        statuses.push(
            chat(&c, &gw.public_url(), "s", &format!("r{i}"))
                .await
                .status()
                .as_u16(),
        );
    }
    // At most the two failures that opened the breaker; then everything succeeds.
    assert!(statuses[2..].iter().all(|s| *s == 200), "{statuses:?}");
    let state = gw.gateway().state_json();
    let backends = state["models"][0]["backends"].as_array().unwrap().clone();
    let bad_b = backends
        .iter()
        .find(|b| b["url"] == bad.base_url().as_str())
        .unwrap();
    assert_eq!(bad_b["breaker"]["state"], "open", "{state}");
    assert!(good.stats().completed >= 4);
    gw.shutdown().await;
    bad.shutdown().await.unwrap();
    good.shutdown().await.unwrap();
}

#[tokio::test]
async fn client_disconnect_cancels_the_engine_sequence() {
    let e = engine().await;
    let gw = start(config(&[e.base_url()], 4)).await.unwrap();
    let c = client();
    let mut body = chat_body("a long one");
    body["stream"] = Value::Bool(true);
    body["max_tokens"] = Value::from(500);
    body["ignore_eos"] = Value::Bool(true);
    let mut r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Read the first chunk, then hang up.
    let first = r.chunk().await.unwrap();
    assert!(first.is_some());
    drop(r);
    let g = gw.gateway().clone();
    wait_until("gateway slot freed", || g.in_flight() == 0).await;
    let stats = e
        .wait_for(|s| s.cancelled >= 1 && s.running == 0)
        .await
        .unwrap();
    assert_eq!(stats.completed, 0);
    gw.shutdown().await;
    e.shutdown().await.unwrap();
}

#[tokio::test]
async fn crashed_engine_is_marked_unhealthy_and_avoided() {
    let mut crashy_cfg = levee_engine::EngineConfig::tiny_fast();
    crashy_cfg.model = "m".into();
    crashy_cfg.gpu.restart_secs = 3600.0;
    let crashy = levee_engine::spawn(crashy_cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let good = engine().await;
    let mut cfg = config(&[crashy.base_url(), good.base_url()], 4);
    cfg.scrape.interval_ms = 50;
    cfg.scrape.unhealthy_after = 1;
    let gw = start(cfg).await.unwrap();
    crashy.crash_now();
    let g = gw.gateway().clone();
    let url = crashy.base_url();
    wait_until("crashed engine unhealthy", || {
        g.state_json()["models"][0]["backends"]
            .as_array()
            .is_some_and(|bs| {
                bs.iter()
                    .any(|b| b["url"] == url.as_str() && b["healthy"] == false)
            })
    })
    .await;
    let c = client();
    for i in 0..4 {
        let r = chat(&c, &gw.public_url(), "s", &format!("after crash {i}")).await;
        assert_eq!(r.status(), 200);
    }
    gw.shutdown().await;
    crashy.shutdown().await.unwrap();
    good.shutdown().await.unwrap();
}
