//! Async tasks (issue 11): every state, cancel queued and running, expiry, the submit quota,
//! tenant isolation, signed callbacks with retries, positions in the real fair order, and
//! position comments for waiting streams. In-process gateway and mock backend on ephemeral
//! ports; each test has its own store file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use levee_gateway::config::TierConfig;
use levee_gateway::Config;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Polls are bounded: 400 × 25 ms = 10 s at most.
const POLLS: usize = 400;

fn store_path(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("levee-tasks-{name}-{}.redb", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// `config` with tasks on in a `batch` tier (priority 3), the band `width` wide.
fn task_config(backends: &[String], cap: u32, name: &str, width: u32) -> Config {
    let mut cfg = config(backends, cap);
    cfg.tiers.insert(
        "batch".into(),
        TierConfig {
            priority: 3,
            queue_wait_ms: 600_000,
            soft_queue_wait_ms: 600_000,
            sheddable: false,
            queue_updates: false,
            ..Default::default()
        },
    );
    cfg.tasks.enabled = true;
    cfg.tasks.store_path = store_path(name);
    cfg.tasks.max_running = width;
    cfg
}

async fn submit(c: &reqwest::Client, base: &str, who: &str, body: Value) -> reqwest::Response {
    c.post(format!("{base}/v1/tasks"))
        .bearer_auth(format!("key-{who}"))
        .json(&body)
        .send()
        .await
        .unwrap()
}

async fn get(c: &reqwest::Client, base: &str, who: &str, id: &str) -> reqwest::Response {
    c.get(format!("{base}/v1/tasks/{id}"))
        .bearer_auth(format!("key-{who}"))
        .send()
        .await
        .unwrap()
}

async fn delete(c: &reqwest::Client, base: &str, who: &str, id: &str) -> reqwest::Response {
    c.delete(format!("{base}/v1/tasks/{id}"))
        .bearer_auth(format!("key-{who}"))
        .send()
        .await
        .unwrap()
}

/// Polls until the task's status is `want`; returns the task.
async fn wait_status(c: &reqwest::Client, base: &str, who: &str, id: &str, want: &str) -> Value {
    let mut last = Value::Null;
    for _ in 0..POLLS {
        last = get(c, base, who, id).await.json().await.unwrap();
        if last["status"] == want {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("task {id} never reached {want}: {last}");
}

async fn wait_until(mut f: impl FnMut() -> bool, what: &str) {
    for _ in 0..POLLS {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("never: {what}");
}

#[tokio::test]
async fn task_succeeds_with_the_full_response_and_lists_page_by_page() {
    let m = mock().await;
    let gw = levee_gateway::start(task_config(&[m.url()], 4, "ok", 2))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let r = submit(&c, &base, "a", chat_body("one")).await;
    assert_eq!(r.status(), 202);
    assert!(r.headers().get("retry-after").is_some());
    let loc = r.headers()["location"].to_str().unwrap().to_string();
    let t: Value = r.json().await.unwrap();
    assert_eq!(t["status"], "queued");
    assert!(t["position"].as_u64().unwrap() >= 1);
    assert_eq!(loc, format!("/v1/tasks/{}", t["id"].as_str().unwrap()));
    let id = t["id"].as_str().unwrap().to_string();
    let done = wait_status(&c, &base, "a", &id, "succeeded").await;
    assert_eq!(done["result"]["choices"][0]["message"]["content"], "hi");
    assert_eq!(done["attempts"], 1);
    assert!(done.get("position").is_none());
    // The upstream body is the client's, without levee's own field.
    assert!(m.received()[0].get("callback_url").is_none());
    // Completions work too.
    let r = submit(
        &c,
        &base,
        "a",
        json!({"model": "m", "prompt": "x", "max_tokens": 2}),
    )
    .await;
    let id2 = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    wait_status(&c, &base, "a", &id2, "succeeded").await;
    let id3 = submit(&c, &base, "a", chat_body("three"))
        .await
        .json::<Value>()
        .await
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Pages, oldest first.
    let p1: Value = c
        .get(format!("{base}/v1/tasks?limit=2"))
        .bearer_auth("key-a")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = p1["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![id.as_str(), id2.as_str()]);
    assert_eq!(p1["has_more"], true);
    let p2: Value = c
        .get(format!("{base}/v1/tasks?limit=2&after={id2}"))
        .bearer_auth("key-a")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(p2["data"][0]["id"], id3.as_str());
    assert_eq!(p2["has_more"], false);
    gw.shutdown().await;
}

#[tokio::test]
async fn another_tenants_task_is_404_to_see_list_and_cancel() {
    let m = mock().await;
    m.hold(true);
    let gw = levee_gateway::start(task_config(&[m.url()], 4, "iso", 2))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let t: Value = submit(&c, &base, "a", chat_body("mine"))
        .await
        .json()
        .await
        .unwrap();
    let id = t["id"].as_str().unwrap();
    let r = get(&c, &base, "b", id).await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "task_not_found"
    );
    assert_eq!(delete(&c, &base, "b", id).await.status(), 404);
    assert_eq!(get(&c, &base, "b", "task_nonexistent").await.status(), 404);
    let list: Value = c
        .get(format!("{base}/v1/tasks"))
        .bearer_auth("key-b")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"].as_array().unwrap().len(), 0);
    // Untouched by b's attempts.
    assert_ne!(
        get(&c, &base, "a", id).await.json::<Value>().await.unwrap()["status"],
        "cancelled"
    );
    assert_eq!(get(&c, &base, "a", id).await.status(), 200);
    m.release(10);
    gw.shutdown().await;
}

#[tokio::test]
async fn cancel_a_queued_task_and_a_running_one_cuts_it_upstream() {
    let m = mock().await;
    m.hold(true);
    // Band of 1: the first task runs (held by the mock), the second waits for the band.
    let gw = levee_gateway::start(task_config(&[m.url()], 4, "cancel", 1))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let first: Value = submit(&c, &base, "a", chat_body("first"))
        .await
        .json()
        .await
        .unwrap();
    let second: Value = submit(&c, &base, "a", chat_body("second"))
        .await
        .json()
        .await
        .unwrap();
    let (first, second) = (
        first["id"].as_str().unwrap(),
        second["id"].as_str().unwrap(),
    );
    let running = wait_status(&c, &base, "a", first, "running").await;
    assert!(running["started_at"].is_u64());
    let queued = get(&c, &base, "a", second)
        .await
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(queued["status"], "queued");
    assert_eq!(queued["position"], 1);
    // Cancel the queued one: it never reaches the backend.
    let r = delete(&c, &base, "a", second).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "cancelled");
    assert_eq!(v["error"]["code"], "task_cancelled");
    // Cancel the running one: the backend sees its request dropped.
    assert_eq!(
        delete(&c, &base, "a", first)
            .await
            .json::<Value>()
            .await
            .unwrap()["status"],
        "cancelled"
    );
    let st = m.state.clone();
    wait_until(
        || st.cancelled.load(Ordering::SeqCst) == 1,
        "the running task's request is cut",
    )
    .await;
    assert_eq!(
        m.count(),
        1,
        "the cancelled queued task never went upstream"
    );
    // A second cancel changes nothing; the final state stays.
    assert_eq!(
        delete(&c, &base, "a", first)
            .await
            .json::<Value>()
            .await
            .unwrap()["status"],
        "cancelled"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn backend_error_fails_the_task_with_an_openai_error() {
    let m = mock().await;
    m.fail(true);
    let gw = levee_gateway::start(task_config(&[m.url()], 4, "fail", 2))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let t: Value = submit(&c, &base, "a", chat_body("x"))
        .await
        .json()
        .await
        .unwrap();
    let done = wait_status(&c, &base, "a", t["id"].as_str().unwrap(), "failed").await;
    assert!(done["error"]["message"].is_string(), "{done}");
    assert!(done.get("result").is_none());
    gw.shutdown().await;
}

#[tokio::test]
async fn a_task_queued_past_max_queue_ms_expires() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = task_config(&[m.url()], 4, "expire", 1);
    cfg.tasks.max_queue_ms = 300;
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let first: Value = submit(&c, &base, "a", chat_body("first"))
        .await
        .json()
        .await
        .unwrap();
    wait_status(&c, &base, "a", first["id"].as_str().unwrap(), "running").await;
    let second: Value = submit(&c, &base, "a", chat_body("second"))
        .await
        .json()
        .await
        .unwrap();
    let v = wait_status(&c, &base, "a", second["id"].as_str().unwrap(), "expired").await;
    assert_eq!(v["error"]["code"], "task_expired");
    // The running one does not expire (it left the queue).
    let first_now = get(&c, &base, "a", first["id"].as_str().unwrap())
        .await
        .json::<Value>()
        .await
        .unwrap();
    assert_eq!(first_now["status"], "running");
    m.release(10);
    wait_status(&c, &base, "a", first["id"].as_str().unwrap(), "succeeded").await;
    gw.shutdown().await;
}

#[tokio::test]
async fn finished_tasks_are_removed_after_retention() {
    let m = mock().await;
    let mut cfg = task_config(&[m.url()], 4, "retain", 2);
    cfg.tasks.result_retention_ms = 200;
    cfg.tasks.max_queue_ms = 200; // sweeps every 50 ms
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let t: Value = submit(&c, &base, "a", chat_body("x"))
        .await
        .json()
        .await
        .unwrap();
    let id = t["id"].as_str().unwrap();
    wait_status(&c, &base, "a", id, "succeeded").await;
    let mut gone = false;
    for _ in 0..POLLS {
        if get(&c, &base, "a", id).await.status() == 404 {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(gone, "the finished task was never removed");
    gw.shutdown().await;
}

#[tokio::test]
async fn submit_over_the_tenant_quota_is_429_with_retry_after() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = task_config(&[m.url()], 4, "quota", 1);
    cfg.tasks.max_queued_per_tenant = 2;
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    assert_eq!(submit(&c, &base, "a", chat_body("1")).await.status(), 202);
    assert_eq!(submit(&c, &base, "a", chat_body("2")).await.status(), 202);
    let r = submit(&c, &base, "a", chat_body("3")).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().get("retry-after").is_some());
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["code"],
        "rate_limit_exceeded"
    );
    // Another tenant's quota is its own.
    assert_eq!(submit(&c, &base, "b", chat_body("b")).await.status(), 202);
    // Bad bodies are refused at submit.
    assert_eq!(
        submit(&c, &base, "a", json!({"model": "m"})).await.status(),
        400
    );
    let mut streamed = chat_body("s");
    streamed["stream"] = json!(true);
    assert_eq!(submit(&c, &base, "b", streamed).await.status(), 400);
    let mut cb = chat_body("s");
    cb["callback_url"] = json!("http://127.0.0.1:1/hook");
    let r = submit(&c, &base, "b", cb).await;
    assert_eq!(r.status(), 400, "no callback secret for b");
    m.release(10);
    gw.shutdown().await;
}

#[tokio::test]
async fn positions_follow_the_fair_queue_then_the_band() {
    let m = mock().await;
    m.hold(true);
    // One backend slot, a band of 3: one task runs, two wait in the fair queue, the rest
    // wait for the band.
    let gw = levee_gateway::start(task_config(&[m.url()], 1, "position", 3))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let mut ids = Vec::new();
    for i in 0..5 {
        let t: Value = submit(&c, &base, "a", chat_body(&format!("t{i}")))
            .await
            .json()
            .await
            .unwrap();
        ids.push(t["id"].as_str().unwrap().to_string());
    }
    wait_status(&c, &base, "a", &ids[0], "running").await;
    let want = vec![json!(1), json!(2), json!(3), json!(4)];
    let mut positions = Vec::new();
    for _ in 0..POLLS {
        positions.clear();
        for id in &ids[1..] {
            let v: Value = get(&c, &base, "a", id).await.json().await.unwrap();
            positions.push(v["position"].clone());
        }
        if positions == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(positions, want);
    // An interactive request waiting in the same lane stands ahead of every task.
    let waiting = spawn_chat(&c, &base, "s", "interactive");
    let mut saw = Value::Null;
    for _ in 0..POLLS {
        saw = get(&c, &base, "a", &ids[1])
            .await
            .json::<Value>()
            .await
            .unwrap()["position"]
            .clone();
        if saw == json!(2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(saw, json!(2), "the interactive request is served first");
    m.release(100);
    assert_eq!(waiting.await.unwrap().status(), 200);
    for id in &ids {
        wait_status(&c, &base, "a", id, "succeeded").await;
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn the_band_takes_tenants_in_turn_not_in_submission_order() {
    let m = mock().await;
    m.hold(true);
    let gw = levee_gateway::start(task_config(&[m.url()], 4, "band-fair", 1))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let mut a = Vec::new();
    for i in 0..3 {
        let t: Value = submit(&c, &base, "a", chat_body(&format!("a{i}")))
            .await
            .json()
            .await
            .unwrap();
        a.push(t["id"].as_str().unwrap().to_string());
    }
    wait_status(&c, &base, "a", &a[0], "running").await;
    let b: Value = submit(&c, &base, "b", chat_body("b0"))
        .await
        .json()
        .await
        .unwrap();
    let b = b["id"].as_str().unwrap().to_string();
    // a1 is older at the same turn; b0 goes before a2 although a2 came first.
    assert_eq!(
        get(&c, &base, "a", &a[1])
            .await
            .json::<Value>()
            .await
            .unwrap()["position"],
        1
    );
    assert_eq!(
        get(&c, &base, "b", &b).await.json::<Value>().await.unwrap()["position"],
        2
    );
    assert_eq!(
        get(&c, &base, "a", &a[2])
            .await
            .json::<Value>()
            .await
            .unwrap()["position"],
        3
    );
    m.release(100);
    for id in &a {
        wait_status(&c, &base, "a", id, "succeeded").await;
    }
    wait_status(&c, &base, "b", &b, "succeeded").await;
    let order: Vec<String> = m
        .received()
        .iter()
        .map(|v| v["messages"][0]["content"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(order, vec!["a0", "a1", "b0", "a2"]);
    gw.shutdown().await;
}

/// A receiver that fails its first `fail_first` calls, then records the signed bodies.
struct Receiver {
    url: String,
    calls: Arc<AtomicUsize>,
    got: Arc<parking_lot::Mutex<Vec<(http::HeaderMap, bytes::Bytes)>>>,
}

async fn receiver(fail_first: usize) -> Receiver {
    let calls = Arc::new(AtomicUsize::new(0));
    let got = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (c2, g2) = (calls.clone(), got.clone());
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: http::HeaderMap, body: bytes::Bytes| {
            let (calls, got) = (c2.clone(), g2.clone());
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                if n < fail_first {
                    return http::StatusCode::INTERNAL_SERVER_ERROR;
                }
                got.lock().push((headers, body));
                http::StatusCode::OK
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    Receiver {
        url: format!("http://{addr}/hook"),
        calls,
        got,
    }
}

#[tokio::test]
async fn callback_is_signed_and_retried_past_a_failing_receiver() {
    use hmac::{KeyInit, Mac};
    let secret = "s3cret-for-callbacks";
    std::env::set_var("LEVEE_TEST_CALLBACK_SECRET", secret);
    let m = mock().await;
    let rcv = receiver(2).await;
    let mut cfg = task_config(&[m.url()], 4, "callback", 2);
    cfg.tasks.callback_backoff_ms = 20;
    // The receiver is on loopback: an internal receiver the operator lets through.
    cfg.tasks.callback_allow = vec!["127.0.0.1/32".into()];
    cfg.tenants[3].callback_secret_env = Some("LEVEE_TEST_CALLBACK_SECRET".into());
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let mut body = chat_body("cb");
    body["callback_url"] = json!(rcv.url);
    let t: Value = submit(&c, &base, "a", body).await.json().await.unwrap();
    let id = t["id"].as_str().unwrap().to_string();
    let got = rcv.got.clone();
    wait_until(|| !got.lock().is_empty(), "the callback is delivered").await;
    assert_eq!(
        rcv.calls.load(Ordering::SeqCst),
        3,
        "two failures, then delivered"
    );
    let (headers, raw) = rcv.got.lock()[0].clone();
    let ts = headers["x-levee-timestamp"].to_str().unwrap();
    let sig = headers["x-levee-signature"].to_str().unwrap();
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    mac.update(format!("{ts}.").as_bytes());
    mac.update(&raw);
    let want = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
    assert_eq!(sig, want, "the signature verifies");
    let mut bad = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"another secret").unwrap();
    bad.update(format!("{ts}.").as_bytes());
    bad.update(&raw);
    assert_ne!(
        sig,
        format!("sha256={}", hex::encode(bad.finalize().into_bytes()))
    );
    let payload: Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(payload["id"], id.as_str());
    assert_eq!(payload["status"], "succeeded");
    assert_eq!(headers["x-levee-task-id"], id.as_str());
    let mut seen = Value::Null;
    for _ in 0..POLLS {
        seen = get(&c, &base, "a", &id).await.json().await.unwrap();
        if seen["callback"]["delivered"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(seen["callback"]["delivered"], true);
    assert_eq!(seen["callback"]["attempts"], 3);
    let text = metrics_text(&gw).await;
    assert!(
        text.contains("levee_task_callbacks_total{state=\"failed\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("levee_task_callbacks_total{state=\"delivered\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("levee_tasks_finished_total{state=\"succeeded\"} 1"),
        "{text}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn waiting_stream_gets_position_comments_in_order_until_dispatch() {
    let m = mock().await;
    m.hold(true);
    let gw = levee_gateway::start(task_config(&[m.url()], 1, "sse", 1))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    // Two requests hold and wait for the one slot; the watched one is third in line.
    let busy = spawn_chat(&c, &base, "s", "busy");
    let st = m.state.clone();
    wait_until(
        || st.in_flight.load(Ordering::SeqCst) == 1,
        "the slot is taken",
    )
    .await;
    let ahead = spawn_chat(&c, &base, "s", "ahead");
    let gw_state = gw.gateway().clone();
    wait_until(|| gw_state.queued() == 1, "one waits").await;
    let mut body = chat_body("watched");
    body["stream"] = json!(true);
    let resp = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-s")
        .header("x-levee-queue-updates", "1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    use futures::StreamExt;
    let mut text = String::new();
    // The first comment arrives at once; let a few seconds' comments come, then free slots.
    while !text.contains("position=2") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .unwrap_or_else(|_| panic!("no comment yet: {text:?}"))
            .unwrap()
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    // The one ahead leaves the queue: the watched request is next.
    m.release(1);
    while !text.contains("position=1") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .unwrap_or_else(|_| panic!("no comment yet: {text:?}"))
            .unwrap()
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    m.release(10);
    while !text.contains("[DONE]") {
        let chunk = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .unwrap_or_else(|_| panic!("stalled: {text:?}"));
        let Some(chunk) = chunk else { break };
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(text.contains("[DONE]"), "{text}");
    let comments: Vec<usize> = text
        .lines()
        .filter_map(|l| l.strip_prefix(": queued position="))
        .map(|r| r.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(!comments.is_empty());
    assert_eq!(comments[0], 2);
    assert!(
        comments.windows(2).all(|w| w[1] <= w[0]),
        "positions never grow: {comments:?}"
    );
    let first_data = text.find("data: ").unwrap();
    assert!(
        !text[first_data..].contains(": queued"),
        "no comment after dispatch: {text}"
    );
    for l in text.lines().filter(|l| l.starts_with(": queued")) {
        assert!(l.contains(" eta_ms="), "{l}");
    }
    m.release(10);
    assert_eq!(busy.await.unwrap().status(), 200);
    assert_eq!(ahead.await.unwrap().status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn refusal_after_the_first_comment_is_an_sse_error_event() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = task_config(&[m.url()], 1, "sse-refused", 1);
    // Standard requests wait 300 ms at most.
    cfg.tiers.get_mut("standard").unwrap().queue_wait_ms = 300;
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let busy = spawn_chat(&c, &base, "p", "busy");
    let st = m.state.clone();
    wait_until(
        || st.in_flight.load(Ordering::SeqCst) == 1,
        "the slot is taken",
    )
    .await;
    let mut body = chat_body("watched");
    body["stream"] = json!(true);
    let resp = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-s")
        .header("x-levee-queue-updates", "1")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(5), resp.text())
        .await
        .unwrap()
        .unwrap();
    assert!(text.starts_with(": queued position=1"), "{text}");
    let event = text.lines().find(|l| l.starts_with("data: ")).unwrap();
    let v: Value = serde_json::from_str(&event["data: ".len()..]).unwrap();
    assert_eq!(v["error"]["code"], "queue_timeout");
    m.release(10);
    assert_eq!(busy.await.unwrap().status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_request_refused_after_waiting_carries_the_position_it_had() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = task_config(&[m.url()], 1, "position-header", 1);
    cfg.tiers.get_mut("standard").unwrap().queue_wait_ms = 300;
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let busy = spawn_chat(&c, &base, "p", "busy");
    let st = m.state.clone();
    wait_until(
        || st.in_flight.load(Ordering::SeqCst) == 1,
        "the slot is taken",
    )
    .await;
    let first = spawn_chat(&c, &base, "s", "first in line");
    let g = gw.gateway().clone();
    wait_until(|| g.queued() == 1, "one waits").await;
    let second = chat(&c, &base, "a", "second in line").await;
    assert_eq!(second.status(), 429);
    assert_eq!(second.headers()["x-levee-queue-position"], "2");
    let first = first.await.unwrap();
    assert_eq!(first.status(), 429);
    assert_eq!(first.headers()["x-levee-queue-position"], "1");
    m.release(10);
    assert_eq!(busy.await.unwrap().status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn capacity_overload_points_to_tasks() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = task_config(&[m.url()], 1, "overload", 1);
    cfg.queue.safe = 1;
    cfg.queue.soft = 2;
    cfg.queue.hard = 3;
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(spawn_chat(&c, &base, "p", &format!("h{i}")));
    }
    let g = gw.gateway().clone();
    wait_until(|| g.load() >= 3, "load at the hard watermark").await;
    let r = chat(&c, &base, "p", "one too many").await;
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "capacity_overload");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/tasks"),
        "{v}"
    );
    m.release(10);
    for h in held {
        assert_eq!(h.await.unwrap().status(), 200);
    }
    gw.shutdown().await;
}

/// A backend that answers every request after `delay`.
async fn slow_backend(delay: Duration) -> String {
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move || async move {
            tokio::time::sleep(delay).await;
            axum::Json(json!({"id": "x", "object": "chat.completion", "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    format!("http://{addr}")
}

/// The ETA promise on a steady load: tasks of 100 ms each through a band of 2; once the
/// band's rate is measured, a new task's `eta_seconds` is within ±30% (+100 ms for polling
/// and scheduling on a shared machine) of when it actually finishes.
#[tokio::test]
async fn eta_on_a_steady_load_is_within_30_percent_of_the_actual_time() {
    let url = slow_backend(Duration::from_millis(100)).await;
    let gw = levee_gateway::start(task_config(&[url], 8, "eta", 2))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let mut ids = Vec::new();
    for i in 0..14 {
        let t: Value = submit(&c, &base, "a", chat_body(&format!("w{i}")))
            .await
            .json()
            .await
            .unwrap();
        ids.push(t["id"].as_str().unwrap().to_string());
    }
    // Let the band's rate and run time be measured.
    for id in &ids[..4] {
        wait_status(&c, &base, "a", id, "succeeded").await;
    }
    let submitted = std::time::Instant::now();
    let t: Value = submit(&c, &base, "a", chat_body("probe"))
        .await
        .json()
        .await
        .unwrap();
    let eta = t["eta_seconds"]
        .as_f64()
        .unwrap_or_else(|| panic!("no ETA: {t}"));
    let id = t["id"].as_str().unwrap().to_string();
    let mut actual = None;
    for _ in 0..1_000 {
        let v: Value = get(&c, &base, "a", &id).await.json().await.unwrap();
        if v["status"] == "succeeded" {
            actual = Some(submitted.elapsed().as_secs_f64());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let actual = actual.expect("the probe task finished");
    eprintln!(
        "ETA {eta:.2} s at position {}, actual {actual:.2} s",
        t["position"]
    );
    assert!(
        (eta - actual).abs() <= 0.3 * actual + 0.1,
        "ETA {eta:.2} s vs actual {actual:.2} s"
    );
    gw.shutdown().await;
}

/// The band puts one long prompt at a time on a lane: a task's backend is fenced for the
/// prefill predicted from the lane's streamed responses, interactive requests go to the
/// other backend meanwhile, and a second task waits for the fence to end.
#[tokio::test]
async fn a_task_prefill_fences_its_backend_and_holds_the_next_task() {
    let (m1, m2) = (mock().await, mock().await);
    m1.hold(true);
    m2.hold(true);
    let gw = levee_gateway::start(task_config(&[m1.url(), m2.url()], 8, "fence", 2))
        .await
        .unwrap();
    let base = gw.public_url();
    let c = client();
    let total = || m1.count() + m2.count();
    // One streamed response measured: its first token came ≥ 150 ms after a 4-token
    // prompt, so a prompt of 100 tokens is predicted to take ≥ 3.75 s to prefill.
    let primer = {
        let (c, base) = (c.clone(), base.clone());
        tokio::spawn(async move {
            let body = json!({"model": "m", "max_tokens": 4, "stream": true,
                "messages": [{"role": "user", "content": "warm"}]});
            let r = c
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth("key-s")
                .json(&body)
                .send()
                .await
                .unwrap();
            r.text().await.unwrap()
        })
    };
    wait_until(|| total() == 1, "the primer reached a backend").await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    let first = if m1.count() == 1 { &m1 } else { &m2 };
    first.release(1);
    assert!(primer.await.unwrap().contains("[DONE]"));
    let long = "abcd".repeat(100);
    let task = |tag: &str| {
        json!({"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": format!("{tag} {long}")}]})
    };
    let t1: Value = submit(&c, &base, "a", task("t1"))
        .await
        .json()
        .await
        .unwrap();
    wait_until(|| total() == 2, "the first task reached a backend").await;
    let on = |m: &Mock, tag: &str| {
        m.received().iter().any(|v| {
            v["messages"][0]["content"]
                .as_str()
                .unwrap_or("")
                .starts_with(tag)
        })
    };
    let (fenced, other) = if on(&m1, "t1") {
        (&m1, &m2)
    } else {
        (&m2, &m1)
    };
    let t2: Value = submit(&c, &base, "a", task("t2"))
        .await
        .json()
        .await
        .unwrap();
    // Interactive requests while the first task's prompt is prefilled: all to the other
    // backend, although by fill alone they would alternate.
    let before = fenced.count();
    let mut chats = Vec::new();
    for i in 0..4 {
        chats.push(spawn_chat(&c, &base, "s", &format!("i{i}")));
        wait_until(
            || total() == 3 + i,
            "an interactive request reached a backend",
        )
        .await;
    }
    assert_eq!(
        fenced.count(),
        before,
        "no interactive request on the fenced backend"
    );
    assert_eq!(other.count(), 6 - before);
    // The second task waits for the fence: it is still queued, sent nowhere.
    let v: Value = get(&c, &base, "a", t2["id"].as_str().unwrap())
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "queued", "{v}");
    assert!(!on(&m1, "t2") && !on(&m2, "t2"));
    m1.release(100);
    m2.release(100);
    for ch in chats {
        assert_eq!(ch.await.unwrap().status(), 200);
    }
    for t in [&t1, &t2] {
        wait_status(&c, &base, "a", t["id"].as_str().unwrap(), "succeeded").await;
    }
    gw.shutdown().await;
}

/// Issue 22: a tenant's `callback_url` is not a way into the gateway's network. Loopback
/// (in its dotted, hex, short and IPv4-mapped forms), link-local metadata and a name that
/// resolves to loopback are refused after resolution, the receiver is never called, and
/// `last_error` says "refused by policy" whatever the address would have answered. A
/// refusal is final: the first attempt is the last, with attempts and time left.
#[tokio::test]
async fn callbacks_to_internal_addresses_are_refused_by_policy() {
    std::env::set_var("LEVEE_TEST_SSRF_SECRET", "ssrf-secret");
    let m = mock().await;
    let rcv = receiver(0).await;
    let port = rcv.url.trim_start_matches("http://127.0.0.1:");
    let port = port.trim_end_matches("/hook").to_string();
    let mut cfg = task_config(&[m.url()], 4, "ssrf", 4);
    cfg.tasks.callback_attempts = 3;
    cfg.tasks.callback_backoff_ms = 1;
    cfg.tenants[3].callback_secret_env = Some("LEVEE_TEST_SSRF_SECRET".into());
    let gw = levee_gateway::start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let admin_port = gw.admin_addr().port();
    let urls = [
        rcv.url.clone(),
        format!("http://0x7f000001:{port}/hook"),
        format!("http://127.1:{port}/hook"),
        format!("http://2130706433:{port}/hook"),
        format!("http://[::ffff:127.0.0.1]:{port}/hook"),
        format!("http://[::1]:{port}/hook"),
        format!("http://localhost:{port}/hook"),
        format!("http://127.0.0.1:{admin_port}/admin/drain"),
        "http://169.254.169.254/latest/meta-data/".to_string(),
        "http://10.0.0.1/hook".to_string(),
    ];
    let mut ids = Vec::new();
    for u in &urls {
        let mut body = chat_body("cb");
        body["callback_url"] = json!(u);
        let r = submit(&c, &base, "a", body).await;
        assert_eq!(r.status(), 202, "{u}");
        let t: Value = r.json().await.unwrap();
        ids.push(t["id"].as_str().unwrap().to_string());
    }
    for (u, id) in urls.iter().zip(&ids) {
        let mut seen = Value::Null;
        for _ in 0..POLLS {
            seen = get(&c, &base, "a", id).await.json().await.unwrap();
            if seen["callback"]["done"] == true {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(seen["callback"]["done"], true, "{u}: {seen}");
        assert_eq!(seen["callback"]["attempts"], 1, "{u}: {seen}");
        assert_eq!(seen["callback"]["delivered"], false, "{u}: {seen}");
        assert_eq!(
            seen["callback"]["last_error"], "refused by policy",
            "{u}: {seen}"
        );
    }
    assert_eq!(
        rcv.calls.load(Ordering::SeqCst),
        0,
        "no internal address was called"
    );
    assert!(
        !gw.gateway().is_leaving(),
        "the admin drain was never reached"
    );
    gw.shutdown().await;
}
