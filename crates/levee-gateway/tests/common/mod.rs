//! Shared test fixtures: a controllable mock OpenAI backend and config helpers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use levee_gateway::config::{BackendConfig, ModelConfig, TenantConfig};
use levee_gateway::{hash_key, Config};
use parking_lot::Mutex;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// What the mock does with each request.
pub struct MockState {
    /// Bodies received, in arrival order.
    pub received: Mutex<Vec<Value>>,
    /// Requests being handled now.
    pub in_flight: AtomicUsize,
    /// Handlers dropped before they finished (client or gateway went away).
    pub cancelled: AtomicUsize,
    /// Answer 500 to everything.
    pub fail: AtomicBool,
    /// When set, each request waits for one permit before answering.
    pub hold: AtomicBool,
    /// Permits releasing held requests.
    pub gate: Semaphore,
    /// What `/props` answers (llama.cpp's self-description); 404 when unset.
    pub props: Mutex<Option<Value>>,
    /// What `/tokenize` (vLLM's shape) answers as `count`, and after how long; 404 when unset.
    pub tokenize: Mutex<Option<(u64, Duration)>>,
    /// Bodies `/tokenize` received.
    pub tokenized: Mutex<Vec<Value>>,
    /// How long a streamed answer takes to its first byte.
    pub first_token_delay: Mutex<Duration>,
    /// With `hold`, a streamed answer sends its head at once and holds its first event
    /// (as engines that answer the head before the prefill do).
    pub head_first: AtomicBool,
    /// Heads of held streamed answers handed to the server to send.
    pub heads: AtomicUsize,
}

impl Default for MockState {
    fn default() -> Self {
        MockState {
            received: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
            fail: AtomicBool::new(false),
            hold: AtomicBool::new(false),
            gate: Semaphore::new(0),
            props: Mutex::new(None),
            tokenize: Mutex::new(None),
            tokenized: Mutex::new(Vec::new()),
            first_token_delay: Mutex::new(Duration::ZERO),
            head_first: AtomicBool::new(false),
            heads: AtomicUsize::new(0),
        }
    }
}

/// A running mock backend.
pub struct Mock {
    pub addr: SocketAddr,
    pub state: Arc<MockState>,
}

impl Mock {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    pub fn received(&self) -> Vec<Value> {
        self.state.received.lock().clone()
    }
    pub fn count(&self) -> usize {
        self.state.received.lock().len()
    }
    /// Lets `n` held requests answer.
    pub fn release(&self, n: usize) {
        self.state.gate.add_permits(n);
    }
    pub fn hold(&self, on: bool) {
        self.state.hold.store(on, Ordering::SeqCst);
    }
    pub fn fail(&self, on: bool) {
        self.state.fail.store(on, Ordering::SeqCst);
    }
}

struct InFlight(Arc<MockState>, bool);
impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.1 {
            self.0.cancelled.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn completion(State(st): State<Arc<MockState>>, body: axum::body::Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    st.received.lock().push(v.clone());
    st.in_flight.fetch_add(1, Ordering::SeqCst);
    let mut guard = InFlight(st.clone(), false);
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let held_body = stream && st.head_first.load(Ordering::SeqCst);
    if st.hold.load(Ordering::SeqCst) && !held_body {
        let permit = st.gate.acquire().await;
        if let Ok(p) = permit {
            p.forget();
        }
    }
    if st.fail.load(Ordering::SeqCst) {
        guard.1 = true;
        return (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "application/json")],
            r#"{"error":{"message":"mock failure","type":"server_error","code":"mock","param":null}}"#,
        )
            .into_response();
    }
    let max = v
        .get("max_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(4)
        .min(8);
    let usage = serde_json::json!({"prompt_tokens": 10, "completion_tokens": max, "total_tokens": 10 + max});
    guard.1 = true;
    if !stream {
        let body = serde_json::json!({
            "id": "cmpl-mock", "object": "chat.completion", "model": v.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": usage,
        });
        return axum::Json(body).into_response();
    }
    let delay = *st.first_token_delay.lock();
    tokio::time::sleep(delay).await;
    let include_usage = v
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut events = Vec::new();
    for i in 0..max {
        let mut c = serde_json::json!({"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": format!(" w{i}")}, "finish_reason": null}]});
        if include_usage {
            c["usage"] = Value::Null;
        }
        events.push(format!("data: {c}\n\n"));
    }
    if include_usage {
        let c = serde_json::json!({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage});
        events.push(format!("data: {c}\n\n"));
    }
    events.push("data: [DONE]\n\n".to_string());
    // A held body waits for a permit before its first event; the handler's guard goes with
    // it, so a body dropped before it ends counts as cancelled.
    let gate = held_body.then(|| {
        guard.1 = false;
        st.heads.fetch_add(1, Ordering::SeqCst);
        (st.clone(), guard)
    });
    let first = futures::stream::once(async move {
        if let Some((st, mut guard)) = gate {
            if let Ok(p) = st.gate.acquire().await {
                p.forget();
            }
            guard.1 = true;
        }
        None
    });
    let s = first
        .chain(futures::stream::iter(events.into_iter().map(Some)))
        .filter_map(|e| async move { e.map(|e| Ok::<_, std::io::Error>(bytes::Bytes::from(e))) });
    (
        [("content-type", "text/event-stream")],
        axum::body::Body::from_stream(s),
    )
        .into_response()
}

async fn metrics(State(st): State<Arc<MockState>>) -> String {
    format!(
        "vllm:num_requests_running{{model_name=\"m\"}} {}\nvllm:num_requests_waiting{{model_name=\"m\"}} 0\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} 0.1\n",
        st.in_flight.load(Ordering::SeqCst)
    )
}

async fn props(State(st): State<Arc<MockState>>) -> Response {
    match st.props.lock().clone() {
        Some(v) => axum::Json(v).into_response(),
        None => http::StatusCode::NOT_FOUND.into_response(),
    }
}

async fn tokenize(State(st): State<Arc<MockState>>, body: axum::body::Bytes) -> Response {
    st.tokenized
        .lock()
        .push(serde_json::from_slice(&body).unwrap_or(Value::Null));
    let answer = *st.tokenize.lock();
    match answer {
        Some((count, delay)) => {
            tokio::time::sleep(delay).await;
            axum::Json(serde_json::json!({"count": count, "max_model_len": 32768, "tokens": []}))
                .into_response()
        }
        None => http::StatusCode::NOT_FOUND.into_response(),
    }
}

/// Starts a mock backend on an ephemeral port.
pub async fn mock() -> Mock {
    let state = Arc::new(MockState::default());
    let app = Router::new()
        .route("/v1/chat/completions", post(completion))
        .route("/v1/completions", post(completion))
        .route("/metrics", get(metrics))
        .route("/props", get(props))
        .route("/tokenize", post(tokenize))
        .route("/health", get(|| async { "ok" }))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Mock { addr, state }
}

/// A tenant with key `key-<name>`.
pub fn tenant(name: &str, tier: &str) -> TenantConfig {
    TenantConfig {
        name: name.into(),
        tier: tier.into(),
        key_sha256: vec![hash_key(&format!("key-{name}"))],
        ..TenantConfig::default()
    }
}

/// A config with one model `m` over `backends` (each max_in_flight `cap`), tenants
/// `p` (premium), `s` (standard), `f` (free), `a` and `b` (standard).
pub fn config(backends: &[String], cap: u32) -> Config {
    let mut cfg = Config::default();
    cfg.listen.public = "127.0.0.1:0".parse().unwrap();
    cfg.listen.admin = "127.0.0.1:0".parse().unwrap();
    cfg.scrape.interval_ms = 0;
    cfg.tenants = vec![
        tenant("p", "premium"),
        tenant("s", "standard"),
        tenant("f", "free"),
        tenant("a", "standard"),
        tenant("b", "standard"),
    ];
    cfg.models = vec![ModelConfig {
        name: "m".into(),
        backends: backends
            .iter()
            .map(|u| BackendConfig {
                url: u.clone(),
                max_in_flight: cap,
                ..BackendConfig::default()
            })
            .collect(),
        ..ModelConfig::default()
    }];
    // Automatic degradation off unless a test turns it on.
    cfg.degrade.enabled = false;
    cfg
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

pub fn chat_body(tag: &str) -> Value {
    serde_json::json!({"model": "m", "max_tokens": 4,
        "messages": [{"role": "user", "content": tag}]})
}

/// Sends a chat completion as tenant `who` from a task of its own (a client that waits
/// while the test goes on).
pub fn spawn_chat(
    c: &reqwest::Client,
    base: &str,
    who: &str,
    tag: &str,
) -> tokio::task::JoinHandle<reqwest::Response> {
    let (c, base, who, tag) = (
        c.clone(),
        base.to_string(),
        who.to_string(),
        tag.to_string(),
    );
    tokio::spawn(async move { chat(&c, &base, &who, &tag).await })
}

/// Sends a chat completion as tenant `who`.
pub async fn chat(c: &reqwest::Client, base: &str, who: &str, tag: &str) -> reqwest::Response {
    post_chat(c, base, who, &chat_body(tag)).await
}

/// Sends the chat completion `body` as tenant `who`.
pub async fn post_chat(
    c: &reqwest::Client,
    base: &str,
    who: &str,
    body: &Value,
) -> reqwest::Response {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(format!("key-{who}"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Polls `cond` every 10 ms for up to 10 s; panics with `what` if it never holds.
pub async fn wait_until<F: FnMut() -> bool>(what: &str, mut cond: F) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// The user message content of a received body (tests tag requests by content).
pub fn tag_of(v: &Value) -> String {
    v["messages"][0]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// The gateway's Prometheus exposition, from its admin listener.
pub async fn metrics_text(gw: &levee_gateway::GatewayHandle) -> String {
    client()
        .get(format!("{}/metrics", gw.admin_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

pub async fn error_json(r: reqwest::Response) -> Value {
    r.json::<Value>().await.unwrap()
}
