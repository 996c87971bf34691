//! The baselines of `levee drill`: a round-robin reverse proxy, plain or capped.
//!
//! - Plain ([`Passthrough::start`]): no limits, no queue, no breaker — what many fleets run
//!   today (an nginx `upstream` block). Every request goes to the next backend.
//! - Capped ([`Passthrough::start_capped`]): what a careful operator builds without levee
//!   (nginx `max_conns` + `queue` + `max_fails`/`fail_timeout` + `proxy_next_upstream`): at
//!   most [`Cap::per_backend`] requests in flight on each backend, the rest wait in one FIFO
//!   queue (bounded in length and in time, 503 beyond either) for the first free slot;
//!   passive health — a backend that failed [`Cap::fail_after`] times in a row (no answer,
//!   or a 5xx) is skipped for [`Cap::skip_for`]; one retry on another backend when the
//!   connection fails. No tenants, no priorities, no token accounting.
//!
//! Both stream the answer back, and a client that goes away drops the upstream request, as
//! nginx does. A slot is held until the answer's last byte has been passed on. A proxy
//! started with a [`Sample`] log also notes, for each answered request, the prompt tokens
//! the server reported (`usage.prompt_tokens`) and the request's `max_tokens`: what an
//! operator reads from access logs to size the cap.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// Largest request body the proxy buffers (it keeps the body to retry it).
const BODY_LIMIT: usize = 16 * 1024 * 1024;

/// The capped baseline's limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cap {
    /// Most requests in flight on one backend (the operator formula's cap).
    pub per_backend: u32,
    /// Most requests waiting for a slot; more get 503 at once.
    pub queue_len: usize,
    /// Longest wait for a slot; past it the request gets 503.
    pub queue_timeout: Duration,
    /// Failures in a row (no answer, or a 5xx) after which a backend is skipped.
    pub fail_after: u32,
    /// How long a failing backend is skipped.
    pub skip_for: Duration,
}

/// One request's sizes as the server reported them: `(usage.prompt_tokens, max_tokens)`.
pub type Sample = Arc<Mutex<Vec<(u32, Option<u32>)>>>;

/// Passive health of one backend.
#[derive(Default)]
struct Health {
    failures_in_a_row: u32,
    skipped_until: Option<Instant>,
}

/// The slots of a capped proxy: one fair (FIFO) semaphore over all backends' slots, so that
/// holding a permit guarantees some backend has a free slot, and each backend's count.
struct Slots {
    cap: Cap,
    any: Arc<Semaphore>,
    in_flight: Vec<AtomicU32>,
    waiting: AtomicUsize,
    health: Vec<Mutex<Health>>,
}

impl Slots {
    fn live(&self, index: usize, now: Instant) -> bool {
        self.health[index]
            .lock()
            .map_or(true, |h| h.skipped_until.is_none_or(|t| now >= t))
    }

    /// Notes an answer (or its absence) from backend `index`.
    fn note(&self, index: usize, failed: bool) {
        let Ok(mut h) = self.health[index].lock() else {
            return;
        };
        if failed {
            h.failures_in_a_row += 1;
            if h.failures_in_a_row >= self.cap.fail_after {
                h.skipped_until = Some(Instant::now() + self.cap.skip_for);
                h.failures_in_a_row = 0;
            }
        } else {
            h.failures_in_a_row = 0;
        }
    }
}

/// One taken slot on backend `index`, given back on drop (when the answer has been sent).
struct Slot {
    shared: Arc<Shared>,
    index: usize,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(slots) = &self.shared.slots {
            slots.in_flight[self.index].fetch_sub(1, Ordering::AcqRel);
        }
    }
}

struct Shared {
    backends: Vec<String>,
    next: AtomicUsize,
    client: reqwest::Client,
    slots: Option<Slots>,
    sample: Option<Sample>,
}

/// A running pass-through proxy.
pub struct Passthrough {
    #[cfg(test)]
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Passthrough {
    /// Starts a plain proxy on 127.0.0.1 (ephemeral port) in front of `backends` (base URLs).
    pub async fn start(backends: Vec<String>) -> anyhow::Result<Self> {
        Self::start_with(backends, None, None).await
    }

    /// A plain proxy that also notes each answer's reported sizes into `sample`.
    pub async fn start_sampling(backends: Vec<String>, sample: Sample) -> anyhow::Result<Self> {
        Self::start_with(backends, None, Some(sample)).await
    }

    /// Starts a capped proxy (see the module documentation) in front of `backends`.
    pub async fn start_capped(backends: Vec<String>, cap: Cap) -> anyhow::Result<Self> {
        anyhow::ensure!(
            cap.per_backend >= 1 && cap.fail_after >= 1,
            "the capped pass-through needs at least one slot per backend and fail_after ≥ 1"
        );
        Self::start_with(backends, Some(cap), None).await
    }

    async fn start_with(
        backends: Vec<String>,
        cap: Option<Cap>,
        sample: Option<Sample>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !backends.is_empty(),
            "the pass-through proxy needs at least one backend URL"
        );
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(4096)
            .build()
            .map_err(|e| anyhow::anyhow!("cannot build the pass-through HTTP client: {e}"))?;
        let slots = cap.map(|cap| Slots {
            cap,
            any: Arc::new(Semaphore::new(cap.per_backend as usize * backends.len())),
            in_flight: backends.iter().map(|_| AtomicU32::new(0)).collect(),
            waiting: AtomicUsize::new(0),
            health: backends.iter().map(|_| Mutex::default()).collect(),
        });
        let shared = Arc::new(Shared {
            backends,
            next: AtomicUsize::new(0),
            client,
            slots,
            sample,
        });
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| anyhow::anyhow!("cannot bind the pass-through proxy on loopback: {e}"))?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new()
            .fallback(forward)
            .with_state(shared.clone());
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stopped.cancelled().await });
            if let Err(e) = serve.await {
                tracing::warn!("pass-through proxy stopped with an error: {e}");
            }
        });
        Ok(Self {
            #[cfg(test)]
            shared,
            addr,
            stop,
            task,
        })
    }

    /// Base URL clients should use, e.g. `http://127.0.0.1:41234`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting and waits for the server task (open streams are dropped).
    pub async fn shutdown(self) {
        self.stop.cancel();
        self.task.abort();
        let _ = self.task.await;
    }
}

/// An error in OpenAI's shape.
fn refusal(status: StatusCode, message: &str, code: &str) -> Response {
    (
        status,
        axum::Json(serde_json::json!({"error": {
            "message": message,
            "type": "server_error",
            "code": code,
            "param": null,
        }})),
    )
        .into_response()
}

/// A 503 in OpenAI's error shape, as the capped proxy's queue gives when full or too slow.
fn unavailable(message: &str, code: &str) -> Response {
    refusal(StatusCode::SERVICE_UNAVAILABLE, message, code)
}

/// A permit from the FIFO queue, or the 503 the queue gives when full or too slow.
async fn queue_permit(slots: &Slots) -> Result<OwnedSemaphorePermit, Response> {
    if let Ok(p) = slots.any.clone().try_acquire_owned() {
        return Ok(p);
    }
    if slots.waiting.fetch_add(1, Ordering::AcqRel) >= slots.cap.queue_len {
        slots.waiting.fetch_sub(1, Ordering::AcqRel);
        return Err(unavailable(
            "every backend is at its connection cap and the queue is full; retry later",
            "queue_full",
        ));
    }
    let waited =
        tokio::time::timeout(slots.cap.queue_timeout, slots.any.clone().acquire_owned()).await;
    slots.waiting.fetch_sub(1, Ordering::AcqRel);
    match waited {
        Ok(Ok(p)) => Ok(p),
        Ok(Err(_)) | Err(_) => Err(unavailable(
            "no backend slot freed up within the queue timeout; retry later",
            "queue_timeout",
        )),
    }
}

/// A slot on the first live backend (in round-robin order, `not` excepted) with one free;
/// `None` when every free slot is on a backend being skipped for its failures (or, for a
/// retry, on the one that just failed).
fn place(
    shared: &Arc<Shared>,
    slots: &Slots,
    permit: OwnedSemaphorePermit,
    not: Option<usize>,
) -> Option<Slot> {
    let n = shared.backends.len();
    let start = shared.next.fetch_add(1, Ordering::Relaxed);
    let now = Instant::now();
    for k in 0..n {
        let index = (start + k) % n;
        if Some(index) == not || !slots.live(index, now) {
            continue;
        }
        let taken = slots.in_flight[index].fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
            (c < slots.cap.per_backend).then_some(c + 1)
        });
        if taken.is_ok() {
            return Some(Slot {
                shared: shared.clone(),
                index,
                _permit: permit,
            });
        }
    }
    None
}

/// The backend for one attempt, with its slot when capped.
async fn pick(shared: &Arc<Shared>, not: Option<usize>) -> Result<(usize, Option<Slot>), Response> {
    match &shared.slots {
        Some(slots) => {
            let permit = match not {
                // A retry does not queue again: it takes a free slot or fails.
                Some(_) => slots.any.clone().try_acquire_owned().map_err(|_| {
                    unavailable("no backend slot is free for a retry", "queue_full")
                })?,
                None => queue_permit(slots).await?,
            };
            // nginx's "no live upstreams".
            let slot = place(shared, slots, permit, not).ok_or_else(|| {
                refusal(
                    StatusCode::BAD_GATEWAY,
                    "no live backend has a free slot (the others failed repeatedly); retry later",
                    "no_live_backend",
                )
            })?;
            Ok((slot.index, Some(slot)))
        }
        None => {
            let i = shared.next.fetch_add(1, Ordering::Relaxed) % shared.backends.len();
            Ok((i, None))
        }
    }
}

async fn forward(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".to_string());
    let method = req.method().clone();
    let mut headers = req.headers().clone();
    strip_hop_headers(&mut headers);
    let Ok(body) = axum::body::to_bytes(req.into_body(), BODY_LIMIT).await else {
        return refusal(
            StatusCode::BAD_REQUEST,
            "request body unreadable",
            "bad_body",
        );
    };
    let (mut i, mut slot) = match pick(&shared, None).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    let mut retried = false;
    loop {
        let url = format!("{}{}", shared.backends[i], path);
        let sent = shared
            .client
            .request(method.clone(), url)
            .headers(headers.clone())
            .body(body.clone())
            .send()
            .await;
        let failed = sent.as_ref().map_or(true, |r| r.status().is_server_error());
        if let Some(slots) = &shared.slots {
            slots.note(i, failed);
        }
        match sent {
            Ok(resp) => return relay(&shared, &body, resp, slot).await,
            Err(e) if e.is_connect() && shared.slots.is_some() && !retried => {
                // One retry on another backend, as nginx's proxy_next_upstream does.
                retried = true;
                drop(slot);
                match pick(&shared, Some(i)).await {
                    Ok((j, s)) => (i, slot) = (j, s),
                    Err(refused) => return refused,
                }
            }
            Err(e) => {
                return refusal(
                    StatusCode::BAD_GATEWAY,
                    &format!("upstream failed: {e}"),
                    "bad_gateway",
                )
            }
        }
    }
}

/// Passes a backend's answer on, holding `slot` until its last byte.
async fn relay(
    shared: &Arc<Shared>,
    request: &Bytes,
    resp: reqwest::Response,
    slot: Option<Slot>,
) -> Response {
    let status = resp.status();
    let mut headers = resp.headers().clone();
    strip_hop_headers(&mut headers);
    let body = match &shared.sample {
        // A sampling proxy reads the whole answer first (it serves a low-rate sample run).
        Some(sample) => {
            let bytes = resp.bytes().await.unwrap_or_default();
            if let Some(prompt) = reported_prompt_tokens(&bytes) {
                if let Ok(mut s) = sample.lock() {
                    s.push((prompt, requested_max_tokens(request)));
                }
            }
            Body::from(bytes)
        }
        None => Body::from_stream(resp.bytes_stream().map(move |chunk| {
            let _held = &slot;
            chunk
        })),
    };
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

/// `usage.prompt_tokens` of an answer: a JSON body, or the SSE event that carries usage.
fn reported_prompt_tokens(body: &[u8]) -> Option<u32> {
    let of = |v: serde_json::Value| {
        v.get("usage")?
            .get("prompt_tokens")?
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
    };
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        return of(v);
    }
    String::from_utf8_lossy(body).lines().find_map(|line| {
        let data = line.strip_prefix("data:")?.trim();
        of(serde_json::from_str(data).ok()?)
    })
}

/// The request's `max_tokens` (or `max_completion_tokens`), if it set one.
fn requested_max_tokens(body: &[u8]) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let n = v
        .get("max_tokens")
        .or_else(|| v.get("max_completion_tokens"))?;
    n.as_u64().and_then(|n| u32::try_from(n).ok())
}

fn strip_hop_headers(h: &mut HeaderMap) {
    for name in [
        "host",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "content-length",
    ] {
        h.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn forwards_round_robin_and_streams() {
        let mut engines = Vec::new();
        for _ in 0..2 {
            let cfg = levee_engine::EngineConfig::profile("tiny-fast").unwrap();
            engines.push(
                levee_engine::spawn(cfg, "127.0.0.1:0".parse().unwrap())
                    .await
                    .unwrap(),
            );
        }
        let proxy = Passthrough::start(engines.iter().map(|e| e.base_url()).collect())
            .await
            .unwrap();
        let client = reqwest::Client::new();
        for _ in 0..4 {
            let body = client
                .post(format!("{}/v1/chat/completions", proxy.base_url()))
                .json(&serde_json::json!({
                    "model": engines[0].config().model,
                    "messages": [{"role": "user", "content": "hello there"}],
                    "max_tokens": 8,
                    "stream": true,
                }))
                .send()
                .await
                .unwrap()
                .error_for_status()
                .unwrap()
                .text()
                .await
                .unwrap();
            assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        }
        // Round robin: each engine served half.
        for e in &engines {
            assert_eq!(e.stats().completed, 2);
        }
        // A dead backend becomes a 502 in OpenAI's error shape, not a hang or a panic.
        let dead = Passthrough::start(vec!["http://127.0.0.1:1".into()])
            .await
            .unwrap();
        let resp = client
            .get(format!("{}/v1/models", dead.base_url()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 502);
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "bad_gateway");
        proxy.shutdown().await;
        dead.shutdown().await;
    }

    #[tokio::test]
    async fn the_capped_proxy_holds_a_slot_until_the_answer_ends_and_queues_in_order() {
        let cfg = levee_engine::EngineConfig::profile("tiny-fast").unwrap();
        let model = cfg.model.clone();
        let engine = levee_engine::spawn(cfg, "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let cap = Cap {
            per_backend: 1,
            queue_len: 0,
            queue_timeout: Duration::from_secs(30),
            fail_after: 3,
            skip_for: Duration::from_secs(5),
        };
        let proxy = Passthrough::start_capped(vec![engine.base_url()], cap)
            .await
            .unwrap();
        let client = reqwest::Client::new();
        let url = format!("{}/v1/chat/completions", proxy.base_url());
        let body = |n: u32| {
            serde_json::json!({
                "model": model,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": n,
                "stream": true,
            })
        };
        // The first stream holds the only slot while its body is unread.
        let first = client.post(&url).json(&body(64)).send().await.unwrap();
        assert_eq!(first.status(), 200);
        // No queue: the next request is refused at once, in OpenAI's error shape.
        let refused = client.post(&url).json(&body(4)).send().await.unwrap();
        assert_eq!(refused.status(), 503);
        let v: serde_json::Value = refused.json().await.unwrap();
        assert_eq!(v["error"]["code"], "queue_full");
        // Once the first answer has ended, its slot is free again.
        assert!(first.text().await.unwrap().contains("[DONE]"));
        let next = client.post(&url).json(&body(4)).send().await.unwrap();
        assert_eq!(next.status(), 200);
        next.text().await.unwrap();
        proxy.shutdown().await;

        // With a queue, a request waits for the slot instead of failing.
        let proxy = Passthrough::start_capped(
            vec![engine.base_url()],
            Cap {
                queue_len: 4,
                ..cap
            },
        )
        .await
        .unwrap();
        let url = format!("{}/v1/chat/completions", proxy.base_url());
        let first = client.post(&url).json(&body(64)).send().await.unwrap();
        let queued = tokio::spawn({
            let client = client.clone();
            let url = url.clone();
            let b = body(4);
            async move { client.post(&url).json(&b).send().await.unwrap().status() }
        });
        first.text().await.unwrap();
        assert_eq!(queued.await.unwrap(), 200);
        proxy.shutdown().await;
        engine.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn the_capped_proxy_retries_a_refused_connection_elsewhere_and_skips_a_failing_one() {
        let cfg = levee_engine::EngineConfig::profile("tiny-fast").unwrap();
        let model = cfg.model.clone();
        let engine = levee_engine::spawn(cfg, "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let cap = Cap {
            per_backend: 4,
            queue_len: 8,
            queue_timeout: Duration::from_secs(5),
            fail_after: 3,
            skip_for: Duration::from_secs(600),
        };
        // Port 1 on loopback refuses connections: a dead backend first in turn.
        let proxy =
            Passthrough::start_capped(vec!["http://127.0.0.1:1".into(), engine.base_url()], cap)
                .await
                .unwrap();
        let client = reqwest::Client::new();
        for _ in 0..6 {
            let resp = client
                .post(format!("{}/v1/chat/completions", proxy.base_url()))
                .json(&serde_json::json!({
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                }))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap();
        }
        assert_eq!(engine.stats().completed, 6);
        let Some(slots) = &proxy.shared.slots else {
            panic!("capped")
        };
        // Three refusals in a row: the dead backend is skipped now.
        assert!(!slots.live(0, Instant::now()));
        assert!(slots.live(1, Instant::now()));
        proxy.shutdown().await;
        engine.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn a_sampling_proxy_notes_the_servers_prompt_tokens_and_max_tokens() {
        let cfg = levee_engine::EngineConfig::profile("tiny-fast").unwrap();
        let model = cfg.model.clone();
        let engine = levee_engine::spawn(cfg, "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let sample = Sample::default();
        let proxy = Passthrough::start_sampling(vec![engine.base_url()], sample.clone())
            .await
            .unwrap();
        let client = reqwest::Client::new();
        for stream in [false, true] {
            let body = client
                .post(format!("{}/v1/chat/completions", proxy.base_url()))
                .json(&serde_json::json!({
                    "model": model,
                    "messages": [{"role": "user", "content": "x".repeat(400)}],
                    "max_tokens": 8,
                    "stream": stream,
                    "stream_options": {"include_usage": true},
                }))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            assert!(body.contains("prompt_tokens"), "{body}");
        }
        let noted = sample.lock().unwrap().clone();
        assert_eq!(noted.len(), 2);
        for (prompt, max) in noted {
            assert!(prompt > 60, "{prompt}: the text was not counted");
            assert_eq!(max, Some(8));
        }
        proxy.shutdown().await;
        engine.shutdown().await.unwrap();
    }
}
