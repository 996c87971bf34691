//! Async tasks survive `kill -9` of the real `levee serve` process (issue 11): tasks queued
//! and running when the gateway dies are all there after a restart, the queued ones in
//! their order, the running one queued again (sent upstream once more), and each reaches
//! exactly one final state with its result.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::routing::post;
use common::{free_port, ready, serve, task, wait_status, Gateway};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A backend that records the tag of each request and, while `hold` is set, never answers.
#[derive(Default)]
struct Backend {
    hold: AtomicBool,
    seen: Mutex<Vec<String>>,
}

async fn backend() -> (String, Arc<Backend>) {
    let st = Arc::new(Backend::default());
    let s2 = st.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::Json<Value>| {
            let st = s2.clone();
            async move {
                let tag = common::tag(&body);
                st.seen.lock().unwrap().push(tag.clone());
                while st.hold.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                common::completion(&format!("done {tag}"), 1)
            }
        }),
    );
    (serve(app).await, st)
}

#[tokio::test]
async fn kill_9_with_tasks_queued_and_running_then_restart() {
    let (url, be) = backend().await;
    be.hold.store(true, Ordering::SeqCst);
    let dir = common::fresh_dir("kill9");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let config = format!(
        r#"
[listen]
public = "127.0.0.1:{port}"
admin = "127.0.0.1:{admin}"

[scrape]
interval_ms = 0

[tiers.standard]
priority = 1
[tiers.batch]
priority = 3
queue_wait_ms = 600000
soft_queue_wait_ms = 600000

[[tenants]]
name = "a"
tier = "standard"
key_sha256 = ["{key}"]

[[models]]
name = "m"
[[models.backends]]
url = "{url}"
max_in_flight = 1

[tasks]
enabled = true
store_path = "{store}"
tier = "batch"
max_running = 2
"#,
        admin = free_port(),
        key = levee_gateway::hash_key(common::KEY),
        store = dir.join("tasks.redb").display(),
    );
    let cfg_path = dir.join("levee.toml");
    std::fs::write(&cfg_path, config).unwrap();
    let c = reqwest::Client::new();

    let gw = Gateway::spawn(&cfg_path, &[]);
    ready(&c, &base).await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let r = c
            .post(format!("{base}/v1/tasks"))
            .bearer_auth(common::KEY)
            .json(&json!({"model": "m", "max_tokens": 4,
                "messages": [{"role": "user", "content": format!("t{i}")}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        ids.push(
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    // t0 runs (held by the backend), t1 waits in the fair queue, t2 and t3 for the band.
    wait_status(&c, &base, &ids[0], "running").await;
    assert_eq!(task(&c, &base, &ids[1]).await["status"], "queued");

    drop(gw); // SIGKILL: no drain, no shutdown, the store as the crash left it
    be.hold.store(false, Ordering::SeqCst);
    let before = be.seen.lock().unwrap().clone();
    assert_eq!(before, vec!["t0"]);

    let _gw = Gateway::spawn(&cfg_path, &[]);
    ready(&c, &base).await;
    let mut results = Vec::new();
    for id in &ids {
        results.push(wait_status(&c, &base, id, "succeeded").await);
    }
    let after: Vec<String> = be.seen.lock().unwrap()[before.len()..].to_vec();
    assert_eq!(
        after,
        vec!["t0", "t1", "t2", "t3"],
        "the running one first, then the queued ones in submission order"
    );
    for (i, r) in results.iter().enumerate() {
        assert_eq!(
            r["result"]["choices"][0]["message"]["content"],
            format!("done t{i}")
        );
    }
    assert_eq!(results[0]["attempts"], 2, "re-sent after the crash");
    for r in &results[1..] {
        assert_eq!(r["attempts"], 1);
    }
    // Exactly one final state each: the list holds the four, each once, each succeeded.
    let list: Value = c
        .get(format!("{base}/v1/tasks?limit=100"))
        .bearer_auth(common::KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed: Vec<(&str, &str)> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["id"].as_str().unwrap(), t["status"].as_str().unwrap()))
        .collect();
    let want: Vec<(&str, &str)> = ids.iter().map(|i| (i.as_str(), "succeeded")).collect();
    assert_eq!(listed, want);
    let _ = std::fs::remove_dir_all(&dir);
}
