//! When a backend fails: no black holes, no silent cuts, no request left waiting for
//! nothing. In-process gateway, simulated engines (levee-engine) and small scripted mock
//! backends on ephemeral ports. Waits are bounded and poll state or signals; no timing is
//! asserted (a bound only stops a test that would otherwise wait for ever).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use common::*;
use levee_gateway::start;
use serde_json::Value;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Semaphore};

/// A simulated engine serving model `m` that stays down for ten minutes once crashed.
async fn engine(output_tokens: Option<u32>) -> levee_engine::EngineHandle {
    let mut cfg = levee_engine::EngineConfig::tiny_fast();
    cfg.model = "m".into();
    cfg.gpu.restart_secs = 600.0;
    if let Some(n) = output_tokens {
        cfg.output_tokens_min = n;
        cfg.output_tokens_max = n;
    }
    levee_engine::spawn(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

/// Crashes an engine the way an operator would, over HTTP, and waits until it is down.
async fn crash(e: &levee_engine::EngineHandle) {
    let r = client()
        .post(format!("{}/admin/crash", e.base_url()))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    e.wait_for(|s| s.state == levee_engine::EngineState::Crashed)
        .await
        .unwrap();
}

fn stream_body(tag: &str, max_tokens: u32) -> Value {
    serde_json::json!({"model": "m", "max_tokens": max_tokens, "stream": true,
        "messages": [{"role": "user", "content": tag}]})
}

async fn post_json(c: &reqwest::Client, base: &str, body: &Value) -> reqwest::Response {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-s")
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Reads a streaming body to its end (bounded), keeping what arrived even if it broke off.
async fn read_stream(mut r: reqwest::Response) -> (String, bool) {
    let mut text = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match r.chunk().await {
                Ok(Some(c)) => text.extend_from_slice(&c),
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    })
    .await
    .expect("the stream never ended");
    (String::from_utf8_lossy(&text).into_owned(), read)
}

/// The last SSE event's JSON.
fn last_event(text: &str) -> Value {
    let last = text
        .trim_end()
        .rsplit("\n\n")
        .next()
        .unwrap()
        .trim_start()
        .strip_prefix("data: ")
        .unwrap_or_else(|| panic!("no data event at the end of {text:?}"));
    serde_json::from_str(last).unwrap()
}

/// Requests an engine refused because it was down (its own count).
async fn refused_while_down(e: &levee_engine::EngineHandle) -> u64 {
    let text = client()
        .get(format!("{}/metrics", e.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| {
            l.starts_with("levee_engine_requests_failed_total{")
                && l.contains("reason=\"unavailable\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}

#[tokio::test]
async fn after_a_crash_fifty_requests_at_once_all_succeed_on_the_other_engine() {
    let crashed = engine(None).await;
    let healthy = engine(None).await;
    let mut cfg = config(&[crashed.base_url(), healthy.base_url()], 64);
    // Ejected for longer than the test runs.
    cfg.outlier.base_ejection_ms = 60_000;
    let gw = start(cfg).await.unwrap();
    let c = client();
    // Both serve before the crash.
    for i in 0..4 {
        assert_eq!(
            chat(&c, &gw.public_url(), "s", &format!("warm {i}"))
                .await
                .status(),
            200
        );
    }
    crash(&crashed).await;
    let calls: Vec<_> = (0..50)
        .map(|i| spawn_chat(&c, &gw.public_url(), "s", &format!("after {i}")))
        .collect();
    let mut failures = Vec::new();
    for call in calls {
        let r = call.await.unwrap();
        if r.status() != 200 {
            failures.push((r.status(), r.text().await.unwrap()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 50 failed: {failures:?}",
        failures.len()
    );
    // Once levee has seen the crash, nothing more is sent to the crashed engine.
    let seen = refused_while_down(&crashed).await;
    assert!(seen >= 1, "the burst never met the crashed engine");
    for i in 0..20 {
        let r = chat(&c, &gw.public_url(), "s", &format!("later {i}")).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(refused_while_down(&crashed).await, seen);
    // The crashed engine was taken out of routing: it shows as ejected in the admin state.
    let state = gw.gateway().state_json();
    let backends = &state["models"][0]["backends"];
    let b = backends
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == crashed.base_url())
        .unwrap();
    assert_ne!(b["breaker"]["state"], "closed", "{b}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_backend_down_when_levee_starts_is_never_seen_by_a_client() {
    let down = engine(None).await;
    crash(&down).await;
    let up = engine(None).await;
    let mut cfg = config(&[down.base_url(), up.base_url()], 64);
    cfg.outlier.base_ejection_ms = 60_000;
    let gw = start(cfg).await.unwrap();
    let c = client();
    // One at a time: the first meets the dead engine and is resent; that one failure
    // ejects it, so it never sees another request (a breaker alone would wait for five).
    for i in 0..10 {
        let r = chat(&c, &gw.public_url(), "s", &format!("first {i}")).await;
        let status = r.status();
        let body = r.text().await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(!body.contains("engine_unavailable"), "{body}");
    }
    assert_eq!(refused_while_down(&down).await, 1);
    let calls: Vec<_> = (0..20)
        .map(|i| spawn_chat(&c, &gw.public_url(), "s", &format!("then {i}")))
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().status(), 200);
    }
    assert_eq!(refused_while_down(&down).await, 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_stream_cut_mid_answer_ends_with_an_error_event() {
    let e = engine(Some(900)).await;
    let gw = start(config(&[e.base_url()], 4)).await.unwrap();
    let c = client();
    let mut r = post_json(&c, &gw.public_url(), &stream_body("long", 900)).await;
    assert_eq!(r.status(), 200);
    // The answer has started reaching the client when the engine dies.
    let first = tokio::time::timeout(Duration::from_secs(10), r.chunk())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    crash(&e).await;
    let (text, clean_end) = read_stream(r).await;
    assert!(
        clean_end,
        "the client's stream was aborted instead of ended: {text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
    let err = last_event(&text);
    assert_eq!(err["error"]["code"], "stream_broken", "{text}");
    assert_eq!(err["error"]["type"], "server_error");
    assert!(err["error"].get("param").is_some());
    // Recorded as a broken stream.
    let m = metrics_text(&gw).await;
    assert!(
        m.contains("levee_requests_total{tenant=\"s\",model=\"m\",outcome=\"stream_broken\"} 1"),
        "{m}"
    );
    assert!(m.contains("reason=\"stream_broken\"} 1"), "{m}");
    gw.shutdown().await;
}

/// A scripted SSE backend: each request's body is whatever the test sends on the channel
/// it gets from `next_stream`; the body ends when the test drops the sender.
struct Scripted {
    url: String,
    streams: mpsc::UnboundedReceiver<mpsc::UnboundedSender<Bytes>>,
    requests: Arc<AtomicUsize>,
}

async fn scripted() -> Scripted {
    let (tx, streams) = mpsc::unbounded_channel::<mpsc::UnboundedSender<Bytes>>();
    let requests = Arc::new(AtomicUsize::new(0));
    let count = requests.clone();
    let app = Router::new()
        .route(
            "/v1/chat/completions",
            post(move || {
                let tx = tx.clone();
                let count = count.clone();
                async move {
                    count.fetch_add(1, Ordering::SeqCst);
                    let (body_tx, body_rx) = mpsc::unbounded_channel::<Bytes>();
                    let _ = tx.send(body_tx);
                    let body = futures::stream::unfold(body_rx, |mut rx| async move {
                        rx.recv().await.map(|b| (Ok::<_, std::io::Error>(b), rx))
                    });
                    (
                        [("content-type", "text/event-stream")],
                        axum::body::Body::from_stream(body),
                    )
                        .into_response()
                }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Scripted {
        url,
        streams,
        requests,
    }
}

impl Scripted {
    /// The body channel of the next request the backend receives.
    async fn next_stream(&mut self) -> mpsc::UnboundedSender<Bytes> {
        tokio::time::timeout(Duration::from_secs(10), self.streams.recv())
            .await
            .expect("the backend got no request")
            .unwrap()
    }
}

/// Reads the next chunk the client receives (bounded).
async fn next_chunk(r: &mut reqwest::Response) -> String {
    let c = tokio::time::timeout(Duration::from_secs(10), r.chunk())
        .await
        .expect("nothing reached the client")
        .unwrap()
        .expect("the stream ended");
    String::from_utf8(c.to_vec()).unwrap()
}

#[tokio::test]
async fn crlf_and_cr_framed_streams_reach_the_client_event_by_event() {
    let mut be = scripted().await;
    let gw = start(config(std::slice::from_ref(&be.url), 4))
        .await
        .unwrap();
    let c = client();
    for t in ["\r\n", "\r"] {
        let mut r = post_json(&c, &gw.public_url(), &stream_body("crlf", 8)).await;
        let tx = be.next_stream().await;
        assert_eq!(r.status(), 200);
        let e1 = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"a\"}}}}]}}{t}{t}");
        let e2 = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"b\"}}}}]}}{t}{t}");
        // The first event arrives in two pieces; it must reach the client whole, and before
        // the backend sends anything more.
        let (head, tail) = e1.split_at(10);
        tx.send(Bytes::from(head.to_string())).unwrap();
        tx.send(Bytes::from(tail.to_string())).unwrap();
        let mut got = next_chunk(&mut r).await;
        while got.len() < e1.len() {
            got.push_str(&next_chunk(&mut r).await);
        }
        assert_eq!(got, e1, "{t:?}");
        tx.send(Bytes::from(e2.clone())).unwrap();
        assert_eq!(next_chunk(&mut r).await, e2, "{t:?}");
        let done = format!("data: [DONE]{t}{t}");
        tx.send(Bytes::from(done.clone())).unwrap();
        drop(tx);
        let (rest, clean) = read_stream(r).await;
        assert!(clean);
        assert_eq!(rest, done, "{t:?}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_backend_that_hangs_mid_stream_frees_its_slot_after_the_idle_timeout() {
    let mut be = scripted().await;
    let mut cfg = config(std::slice::from_ref(&be.url), 1);
    cfg.server.stream_idle_timeout_ms = 300;
    cfg.tenants[1].max_concurrency = 1;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let mut r = post_json(&c, &gw.public_url(), &stream_body("hang", 8)).await;
    let tx = be.next_stream().await;
    tx.send(Bytes::from_static(b"data: {\"choices\":[]}\n\n"))
        .unwrap();
    assert_eq!(next_chunk(&mut r).await, "data: {\"choices\":[]}\n\n");
    // The backend now says nothing and keeps the connection open (`tx` is held).
    let (text, clean) = read_stream(r).await;
    assert!(clean, "{text}");
    assert_eq!(
        last_event(&text)["error"]["code"],
        "stream_idle_timeout",
        "{text}"
    );
    // The slot and the tenant's concurrency permit are back: the same tenant's next
    // request reaches the backend (cap 1, concurrency 1).
    let g = gw.gateway().clone();
    let state = g.state_json();
    assert_eq!(state["models"][0]["backends"][0]["in_flight"], 0, "{state}");
    let next = tokio::spawn({
        let (c, base) = (c.clone(), gw.public_url());
        async move { post_json(&c, &base, &stream_body("next", 8)).await }
    });
    let tx2 = be.next_stream().await;
    tx2.send(Bytes::from_static(b"data: [DONE]\n\n")).unwrap();
    drop(tx2);
    let r = next.await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(read_stream(r).await.0, "data: [DONE]\n\n");
    assert_eq!(be.requests.load(Ordering::SeqCst), 2);
    drop(tx);
    gw.shutdown().await;
}

/// A backend whose answers wait for a permit and whose health check can be failed.
struct Gated {
    url: String,
    gate: Arc<Semaphore>,
    down: Arc<AtomicBool>,
    received: Arc<AtomicUsize>,
}

async fn gated() -> Gated {
    let gate = Arc::new(Semaphore::new(0));
    let down = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicUsize::new(0));
    let (g, d, n) = (gate.clone(), down.clone(), received.clone());
    let app = Router::new()
        .route(
            "/v1/chat/completions",
            post(move || {
                let (g, n) = (g.clone(), n.clone());
                async move {
                    n.fetch_add(1, Ordering::SeqCst);
                    g.acquire().await.unwrap().forget();
                    axum::Json(serde_json::json!({"id": "x", "object": "chat.completion",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))
                    .into_response()
                }
            }),
        )
        .route(
            "/health",
            get(move || {
                let d = d.clone();
                async move {
                    if d.load(Ordering::SeqCst) {
                        http::StatusCode::SERVICE_UNAVAILABLE.into_response()
                    } else {
                        "ok".into_response()
                    }
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Gated {
        url,
        gate,
        down,
        received,
    }
}

#[tokio::test]
async fn queued_requests_fail_fast_when_every_backend_is_down() {
    let be = gated().await;
    let mut cfg = config(std::slice::from_ref(&be.url), 1);
    cfg.scrape.interval_ms = 50;
    cfg.scrape.unhealthy_after = 1;
    // Queued requests could wait a minute; they must not.
    cfg.tiers.get_mut("standard").unwrap().queue_wait_ms = 60_000;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let first = spawn_chat(&c, &gw.public_url(), "s", "in flight");
    wait_until("first request at the backend", || {
        be.received.load(Ordering::SeqCst) == 1
    })
    .await;
    let queued: Vec<_> = (0..2)
        .map(|i| spawn_chat(&c, &gw.public_url(), "s", &format!("queued {i}")))
        .collect();
    let g = gw.gateway().clone();
    wait_until("two queued", || g.queued() == 2).await;
    be.down.store(true, Ordering::SeqCst);
    for q in queued {
        let r = tokio::time::timeout(Duration::from_secs(10), q)
            .await
            .expect("a queued request waited although nothing could serve it")
            .unwrap();
        assert_eq!(r.status(), 503);
        assert!(r.headers().contains_key("retry-after"));
        assert_eq!(error_json(r).await["error"]["code"], "no_healthy_backend");
    }
    assert_eq!(be.received.load(Ordering::SeqCst), 1);
    be.gate.add_permits(1);
    assert_eq!(first.await.unwrap().status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn time_queued_in_levee_is_not_charged_to_the_backend() {
    let be = gated().await;
    let mut cfg = config(std::slice::from_ref(&be.url), 1);
    cfg.server.request_timeout_ms = 2_000;
    cfg.server.stream_timeout_ms = 2_000;
    // Any failure would show: one ejects, and the breaker would count it.
    cfg.outlier.consecutive_failures = 1;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let first = spawn_chat(&c, &gw.public_url(), "s", "first");
    wait_until("first at the backend", || {
        be.received.load(Ordering::SeqCst) == 1
    })
    .await;
    let second = spawn_chat(&c, &gw.public_url(), "s", "second");
    let g = gw.gateway().clone();
    wait_until("second queued", || g.queued() == 1).await;
    // The second waits 1.5 s in levee's queue, then the backend takes 1 s to answer it:
    // 2.5 s in all, but only 1 s of it is the backend's, inside its 2 s.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    be.gate.add_permits(1);
    assert_eq!(first.await.unwrap().status(), 200);
    wait_until("second at the backend", || {
        be.received.load(Ordering::SeqCst) == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    be.gate.add_permits(1);
    let r = second.await.unwrap();
    let status = r.status();
    assert_eq!(status, 200, "{}", r.text().await.unwrap());
    let state = g.state_json();
    let b = &state["models"][0]["backends"][0];
    assert_eq!(b["breaker"]["window_failures"], 0, "{b}");
    assert_eq!(b["breaker"]["state"], "closed", "{b}");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_thousand_junk_model_names_add_no_metric_series() {
    let m = mock().await;
    let gw = start(config(&[m.url()], 4)).await.unwrap();
    let c = client();
    // Series as `name{labels}`, without their values.
    let series = |text: &str| -> std::collections::BTreeSet<String> {
        text.lines()
            .filter(|l| l.starts_with("levee_"))
            .filter_map(|l| l.rsplit_once(' ').map(|(k, _)| k.to_string()))
            .collect()
    };
    assert_eq!(chat(&c, &gw.public_url(), "s", "real").await.status(), 200);
    let unknown = serde_json::json!({"model": "junk-0", "messages": []});
    assert_eq!(
        post_json(&c, &gw.public_url(), &unknown).await.status(),
        404
    );
    let before = series(&metrics_text(&gw).await);
    for i in 1..1_000 {
        let body = serde_json::json!({"model": format!("junk-{i}"), "messages": []});
        assert_eq!(post_json(&c, &gw.public_url(), &body).await.status(), 404);
    }
    let text = metrics_text(&gw).await;
    // Series may appear meanwhile for the configured model (the autoscaler's gauges after
    // its first tick), never for a name a client made up.
    let new: Vec<String> = series(&text).difference(&before).cloned().collect();
    assert!(
        new.iter().all(|k| k.contains("model=\"m\"")),
        "series added by unknown model names: {new:?}"
    );
    assert!(!text.contains("junk"));
    assert!(text.contains(
        "levee_requests_total{tenant=\"s\",model=\"unknown\",outcome=\"model_not_found\"} 1000"
    ));
    gw.shutdown().await;
}

/// A backend that closes the connection of its first chat request without answering (as
/// llama-server closes a keep-alive connection), then answers every request.
async fn closes_first_chat() -> (String, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let chats = Arc::new(AtomicUsize::new(0));
    let seen = chats.clone();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // One request per connection: the head, then its Content-Length body.
                let body_len = loop {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                        let len: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        break end + 4 + len;
                    }
                };
                while buf.len() < body_len {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let head = String::from_utf8_lossy(&buf);
                let body = if head.starts_with("POST /v1/chat/completions") {
                    if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                        return; // closed without a word
                    }
                    r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#
                } else {
                    ""
                };
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, chats)
}

#[tokio::test]
async fn a_connection_closed_without_an_answer_is_tried_once_more() {
    let (url, chats) = closes_first_chat().await;
    let gw = start(config(&[url], 4)).await.unwrap();
    let r = chat(&client(), &gw.public_url(), "s", "closed").await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(chats.load(Ordering::SeqCst), 2, "one close, one answer");
    gw.shutdown().await;
}

#[tokio::test]
async fn a_full_lane_answers_the_displaced_request_at_once() {
    let be = gated().await;
    let mut cfg = config(std::slice::from_ref(&be.url), 1);
    (cfg.queue.safe, cfg.queue.soft, cfg.queue.hard) = (1, 2, 3);
    let standard = cfg.tiers.get_mut("standard").unwrap();
    (standard.queue_wait_ms, standard.soft_queue_wait_ms) = (60_000, 60_000);
    let gw = start(cfg).await.unwrap();
    let c = client();
    let g = gw.gateway().clone();
    let first = spawn_chat(&c, &gw.public_url(), "a", "running");
    wait_until("a's first request at the backend", || {
        be.received.load(Ordering::SeqCst) == 1
    })
    .await;
    let older = spawn_chat(&c, &gw.public_url(), "a", "queued first");
    wait_until("one queued", || g.queued() == 1).await;
    let newest = spawn_chat(&c, &gw.public_url(), "a", "queued second");
    wait_until("two queued", || g.queued() == 2).await;
    // The lane is at its hard watermark (1 running + 2 queued): a peer with nothing waiting
    // takes the place of a's newest request, which is answered now, not after a minute.
    let peer = spawn_chat(&c, &gw.public_url(), "b", "peer");
    let r = tokio::time::timeout(Duration::from_secs(10), newest)
        .await
        .expect("the displaced request was left waiting")
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let e = error_json(r).await;
    assert_eq!(e["error"]["code"], "capacity_overload", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("took this one's place"),
        "{e}"
    );
    be.gate.add_permits(3);
    for h in [first, older, peer] {
        assert_eq!(h.await.unwrap().status(), 200);
    }
    assert_eq!(be.received.load(Ordering::SeqCst), 3);
    gw.shutdown().await;
}
