//! A rolling restart loses no request. Two gateways sit behind a round-robin front that,
//! like a Kubernetes Service, sends requests only to replicas whose `/readyz` answers 200
//! (it looks every 20 ms). Clients send steadily through the front. One gateway is taken
//! out as a pod is: `levee drain` (the preStop hook, the real binary), then shutdown (what
//! SIGTERM does). Every client request must succeed; a 429 would be allowed (it is levee
//! protecting capacity), any other status or a broken connection is an error.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::serve;
use levee_gateway::config::{BackendConfig, ModelConfig, TenantConfig};
use levee_gateway::{hash_key, Config};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An engine that takes 20 ms per answer.
async fn engine() -> String {
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(|| async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            common::completion("ok", 1)
        }),
    );
    serve(app).await
}

fn gateway_config(engine: &str) -> Config {
    let mut cfg = Config::default();
    cfg.listen.public = "127.0.0.1:0".parse().unwrap();
    cfg.listen.admin = "127.0.0.1:0".parse().unwrap();
    cfg.scrape.interval_ms = 0;
    cfg.degrade.enabled = false;
    // Longer than the front takes to notice /readyz many times over.
    cfg.server.drain_grace_ms = 1_500;
    cfg.tenants = vec![TenantConfig {
        name: "t".into(),
        key_sha256: vec![hash_key("key-t")],
        ..TenantConfig::default()
    }];
    cfg.models = vec![ModelConfig {
        name: "m".into(),
        backends: vec![BackendConfig {
            url: engine.to_string(),
            // Fewer slots than clients: requests queue in each gateway.
            max_in_flight: 2,
            ..BackendConfig::default()
        }],
        ..ModelConfig::default()
    }];
    cfg
}

/// The front: round-robin over the replicas whose `/readyz` said 200 last.
struct Front {
    replicas: Vec<String>,
    ready: Vec<AtomicBool>,
    next: AtomicUsize,
    client: reqwest::Client,
    /// Requests sent to each replica.
    sent: Vec<AtomicUsize>,
}

async fn forward(State(f): State<Arc<Front>>, headers: HeaderMap, body: Bytes) -> Response {
    let n = f.replicas.len();
    let start = f.next.fetch_add(1, Ordering::Relaxed);
    let Some(i) = (0..n)
        .map(|k| (start + k) % n)
        .find(|&i| f.ready[i].load(Ordering::SeqCst))
    else {
        return (StatusCode::BAD_GATEWAY, "no ready replica").into_response();
    };
    f.sent[i].fetch_add(1, Ordering::Relaxed);
    let mut req = f
        .client
        .post(format!("{}/v1/chat/completions", f.replicas[i]))
        .header("content-type", "application/json")
        .body(body);
    if let Some(auth) = headers.get("authorization") {
        req = req.header("authorization", auth.as_bytes());
    }
    match req.send().await {
        Ok(r) => {
            let status = StatusCode::from_u16(r.status().as_u16()).unwrap();
            (status, r.bytes().await.unwrap_or_default()).into_response()
        }
        Err(e) => (StatusCode::BAD_GATEWAY, format!("replica {i}: {e}")).into_response(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_replica_leaves_without_a_client_error() {
    let engine = engine().await;
    let a = levee_gateway::start(gateway_config(&engine)).await.unwrap();
    let b = levee_gateway::start(gateway_config(&engine)).await.unwrap();
    let front = Arc::new(Front {
        replicas: vec![a.public_url(), b.public_url()],
        ready: vec![AtomicBool::new(true), AtomicBool::new(true)],
        next: AtomicUsize::new(0),
        client: reqwest::Client::new(),
        sent: vec![AtomicUsize::new(0), AtomicUsize::new(0)],
    });
    let front_url = serve(
        axum::Router::new()
            .route("/v1/chat/completions", post(forward))
            .with_state(front.clone()),
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    // The endpoints controller: readiness of each replica, every 20 ms.
    let watcher = tokio::spawn({
        let (front, stop) = (front.clone(), stop.clone());
        async move {
            let c = reqwest::Client::new();
            while !stop.load(Ordering::SeqCst) {
                for (i, url) in front.replicas.iter().enumerate() {
                    let ok = matches!(
                        c.get(format!("{url}/readyz")).send().await,
                        Ok(r) if r.status() == 200
                    );
                    front.ready[i].store(ok, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    // Clients: 6 at a time, one request after another.
    let outcomes: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let clients: Vec<_> = (0..6)
        .map(|k| {
            let (front_url, stop, outcomes) = (front_url.clone(), stop.clone(), outcomes.clone());
            tokio::spawn(async move {
                let c = reqwest::Client::new();
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    let r = c
                        .post(format!("{front_url}/v1/chat/completions"))
                        .bearer_auth("key-t")
                        .json(&json!({"model": "m", "max_tokens": 1,
                            "messages": [{"role": "user", "content": format!("c{k} r{i}")}]}))
                        .send()
                        .await;
                    let key = match r {
                        Ok(r) => {
                            let status = r.status().as_u16();
                            let body = r.text().await.unwrap_or_default();
                            if status == 200 || status == 429 {
                                status.to_string()
                            } else {
                                format!("{status} {body}")
                            }
                        }
                        Err(e) => format!("transport: {e}"),
                    };
                    *outcomes.lock().unwrap().entry(key).or_default() += 1;
                    i += 1;
                }
            })
        })
        .collect();
    // Both replicas serve for a while.
    let served = |front: &Front, i: usize| front.sent[i].load(Ordering::Relaxed);
    while served(&front, 0) < 20 || served(&front, 1) < 20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The preStop hook, then SIGTERM's shutdown.
    let drain = tokio::process::Command::new(env!("CARGO_BIN_EXE_levee"))
        .args(["drain", "--admin", &a.admin_url(), "--timeout-secs", "20"])
        .output()
        .await
        .unwrap();
    let drain_log = String::from_utf8_lossy(&drain.stderr).to_string();
    assert!(drain.status.success(), "levee drain failed: {drain_log}");
    assert!(drain_log.contains("drained"), "{drain_log}");
    let g = a.gateway().clone();
    assert!(g.is_draining());
    assert_eq!(g.queued(), 0);
    assert_eq!(g.in_flight(), 0);
    let a_total = served(&front, 0);
    a.shutdown().await;
    // The other replica carries on alone.
    let b_before = served(&front, 1);
    while served(&front, 1) < b_before + 50 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.unwrap();
    }
    watcher.await.unwrap();
    b.shutdown().await;
    let outcomes = outcomes.lock().unwrap().clone();
    let errors: Vec<_> = outcomes
        .iter()
        .filter(|(k, _)| *k != "200" && *k != "429")
        .collect();
    assert!(
        errors.is_empty(),
        "client errors: {errors:?} (all: {outcomes:?})"
    );
    assert_eq!(
        served(&front, 0),
        a_total,
        "nothing reached the drained replica after"
    );
    eprintln!(
        "outcomes {outcomes:?}; replica a served {a_total}, b {}",
        served(&front, 1)
    );
}
