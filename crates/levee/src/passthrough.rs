//! The unprotected baseline of `levee drill`: a plain round-robin reverse proxy with no
//! limits, no queue and no breaker — what many fleets run today (an nginx `upstream` block).
//! It forwards every request to the next backend and streams the answer back; a client that
//! goes away drops the upstream request, as nginx does.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

struct Shared {
    backends: Vec<String>,
    next: AtomicUsize,
    client: reqwest::Client,
}

/// A running pass-through proxy.
pub struct Passthrough {
    addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Passthrough {
    /// Starts a proxy on 127.0.0.1 (ephemeral port) in front of `backends` (base URLs).
    pub async fn start(backends: Vec<String>) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !backends.is_empty(),
            "the pass-through proxy needs at least one backend URL"
        );
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(4096)
            .build()
            .map_err(|e| anyhow::anyhow!("cannot build the pass-through HTTP client: {e}"))?;
        let shared = Arc::new(Shared {
            backends,
            next: AtomicUsize::new(0),
            client,
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

async fn forward(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let i = shared.next.fetch_add(1, Ordering::Relaxed) % shared.backends.len();
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
            let mut out = Response::new(Body::from_stream(resp.bytes_stream()));
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
}
