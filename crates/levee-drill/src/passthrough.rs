//! The baselines of `levee drill`: a round-robin reverse proxy, plain or capped.
//!
//! - Plain ([`Passthrough::start`]): no limits, no queue, no breaker — what many fleets run
//!   today (an nginx `upstream` block). Every request goes to the next backend.
//! - Capped ([`Passthrough::start_capped`]): what a careful operator adds without levee, nginx
//!   `max_conns` plus `queue`: at most [`Cap::per_backend`] requests in flight on each backend,
//!   the rest wait in one FIFO queue (bounded in length and in time, 503 beyond either) for
//!   the first free slot. No tenants, no priorities, no token accounting.
//!
//! Both stream the answer back, and a client that goes away drops the upstream request, as
//! nginx does. A slot is held until the answer's last byte has been passed on.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// The capped baseline's limits: nginx `max_conns` on every upstream server and a `queue`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cap {
    /// Most requests in flight on one backend (what the engine can hold: vLLM's
    /// `max_num_seqs`).
    pub per_backend: u32,
    /// Most requests waiting for a slot; more get 503 at once.
    pub queue_len: usize,
    /// Longest wait for a slot; past it the request gets 503.
    pub queue_timeout: Duration,
}

/// The slots of a capped proxy: one fair (FIFO) semaphore over all backends' slots, so that
/// holding a permit guarantees some backend has a free slot, and each backend's count.
struct Slots {
    cap: Cap,
    any: Arc<Semaphore>,
    in_flight: Vec<AtomicU32>,
    waiting: AtomicUsize,
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
}

/// A running pass-through proxy.
pub struct Passthrough {
    addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Passthrough {
    /// Starts a plain proxy on 127.0.0.1 (ephemeral port) in front of `backends` (base URLs).
    pub async fn start(backends: Vec<String>) -> anyhow::Result<Self> {
        Self::start_with(backends, None).await
    }

    /// Starts a capped proxy (see the module documentation) in front of `backends`.
    pub async fn start_capped(backends: Vec<String>, cap: Cap) -> anyhow::Result<Self> {
        anyhow::ensure!(
            cap.per_backend >= 1,
            "the capped pass-through needs at least one slot per backend"
        );
        Self::start_with(backends, Some(cap)).await
    }

    async fn start_with(backends: Vec<String>, cap: Option<Cap>) -> anyhow::Result<Self> {
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
        });
        let shared = Arc::new(Shared {
            backends,
            next: AtomicUsize::new(0),
            client,
            slots,
        });
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| anyhow::anyhow!("cannot bind the pass-through proxy on loopback: {e}"))?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new().fallback(forward).with_state(shared);
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stopped.cancelled().await });
            if let Err(e) = serve.await {
                tracing::warn!("pass-through proxy stopped with an error: {e}");
            }
        });
        Ok(Self { addr, stop, task })
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

/// A 503 in OpenAI's error shape, as the capped proxy's queue gives when full or too slow.
fn unavailable(message: &str, code: &str) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        axum::Json(serde_json::json!({"error": {
            "message": message,
            "type": "server_error",
            "code": code,
            "param": null,
        }})),
    )
        .into_response()
}

/// Waits in the FIFO queue for a slot and takes one on the first backend (in round-robin
/// order) that has one free.
async fn take_slot(shared: &Arc<Shared>, slots: &Slots) -> Result<Slot, Response> {
    let permit = match slots.any.clone().try_acquire_owned() {
        Ok(p) => p,
        Err(_) => {
            if slots.waiting.fetch_add(1, Ordering::AcqRel) >= slots.cap.queue_len {
                slots.waiting.fetch_sub(1, Ordering::AcqRel);
                return Err(unavailable(
                    "every backend is at its connection cap and the queue is full; retry later",
                    "queue_full",
                ));
            }
            let waited =
                tokio::time::timeout(slots.cap.queue_timeout, slots.any.clone().acquire_owned())
                    .await;
            slots.waiting.fetch_sub(1, Ordering::AcqRel);
            match waited {
                Ok(Ok(p)) => p,
                Ok(Err(_)) | Err(_) => {
                    return Err(unavailable(
                        "no backend slot freed up within the queue timeout; retry later",
                        "queue_timeout",
                    ))
                }
            }
        }
    };
    let n = shared.backends.len();
    let start = shared.next.fetch_add(1, Ordering::Relaxed);
    for k in 0..n {
        let index = (start + k) % n;
        let taken = slots.in_flight[index].fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
            (c < slots.cap.per_backend).then_some(c + 1)
        });
        if taken.is_ok() {
            return Ok(Slot {
                shared: shared.clone(),
                index,
                _permit: permit,
            });
        }
    }
    // Unreachable while every slot holder also holds a permit: the permits equal the slots.
    Err(unavailable(
        "no backend slot is free although the queue granted one; retry",
        "no_slot",
    ))
}

async fn forward(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let slot = match &shared.slots {
        Some(slots) => match take_slot(&shared, slots).await {
            Ok(slot) => Some(slot),
            Err(refused) => return refused,
        },
        None => None,
    };
    let i = match &slot {
        Some(s) => s.index,
        None => shared.next.fetch_add(1, Ordering::Relaxed) % shared.backends.len(),
    };
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".to_string());
    let url = format!("{}{}", shared.backends[i], path);
    let method = req.method().clone();
    let mut headers = req.headers().clone();
    strip_hop_headers(&mut headers);
    let body = reqwest::Body::wrap_stream(req.into_body().into_data_stream());
    let upstream = shared
        .client
        .request(method, url)
        .headers(headers)
        .body(body)
        .send()
        .await;
    match upstream {
        Ok(resp) => {
            let status = resp.status();
            let mut headers = resp.headers().clone();
            strip_hop_headers(&mut headers);
            // The slot goes back when the body is done (or the client left and dropped it).
            let body = resp.bytes_stream().map(move |chunk| {
                let _held = &slot;
                chunk
            });
            let mut out = Response::new(Body::from_stream(body));
            *out.status_mut() = status;
            *out.headers_mut() = headers;
            out
        }
        Err(e) => (
            StatusCode::BAD_GATEWAY,
            axum::Json(serde_json::json!({"error": {
                "message": format!("upstream failed: {e}"),
                "type": "upstream_error",
                "code": "bad_gateway",
                "param": null,
            }})),
        )
            .into_response(),
    }
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
}
