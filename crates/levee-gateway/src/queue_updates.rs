//! Position comments for streaming requests that wait in the queue (opt-in: request header
//! `x-levee-queue-updates: 1`, or a tier's `queue_updates`).
//!
//! While such a request waits, the client receives `: queued position=N eta_ms=M` SSE
//! comment lines (which OpenAI clients skip) at once and then every second, until the
//! request is dispatched; the backend's stream follows on the same response. The trade-off:
//! the first comment commits the response to `200 text/event-stream`, so a refusal after it
//! (the queue wait runs out, the backends fail) arrives as an SSE error event
//! (`data: {"error": ...}`) instead of a 429 or 503 with `Retry-After`.
//!
//! A request that is dispatched (or refused) without waiting is answered exactly as
//! without the option.

use crate::gateway::Gateway;
use crate::lane::QueueSpot;
use crate::pipeline;
use crate::runtime::Runtime;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Largest error body turned into an SSE error event.
const MAX_ERROR_BYTES: usize = 64 * 1024;

/// Serves `req` and, if it waits in a queue and wants updates, starts the SSE response with
/// position comments before dispatch.
pub(crate) async fn watched(
    gw: Arc<Gateway>,
    rt: Arc<Runtime>,
    arrival: pipeline::Arrival,
    req: Box<Request>,
    path: &'static str,
) -> Response {
    let spot = Arc::new(QueueSpot::default());
    let inner = spot.clone();
    let mut work =
        Box::pin(
            async move { pipeline::serve_client(gw, rt, arrival, req, path, Some(&inner)).await },
        );
    loop {
        tokio::select! {
            r = &mut work => return r,
            _ = spot.changed() => {
                if spot.updates.load(Ordering::Relaxed) && spot.position().is_some() {
                    break;
                }
            }
        }
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        // The first tick fires at once: the client learns its place as soon as it has one.
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let resp = loop {
            tokio::select! {
                r = &mut work => break r,
                _ = tick.tick() => {
                    if let Some(line) = comment(&spot) {
                        if tx.send(line).await.is_err() {
                            return;
                        }
                    }
                }
                // The client went away: dropping `work` withdraws the request from the queue.
                _ = tx.closed() => return,
            }
        };
        let streamed = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if resp.status().is_success() && streamed {
            let mut body = resp.into_body().into_data_stream();
            while let Some(chunk) = body.next().await {
                let chunk = match chunk {
                    Ok(b) => b,
                    Err(e) => crate::GatewayError::stream_broken(e.to_string()).sse_event(),
                };
                if tx.send(chunk).await.is_err() {
                    return;
                }
            }
        } else {
            // A refusal (or a non-streamed answer) after the head went out: one SSE event.
            let bytes = axum::body::to_bytes(resp.into_body(), MAX_ERROR_BYTES)
                .await
                .unwrap_or_default();
            let mut out = b"data: ".to_vec();
            out.extend_from_slice(bytes.trim_ascii());
            out.extend_from_slice(b"\n\n");
            let _ = tx.send(Bytes::from(out)).await;
        }
    });
    let body = futures::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|o| o.map(Ok::<Bytes, std::convert::Infallible>))
    });
    (
        [
            (http::header::CONTENT_TYPE, "text/event-stream"),
            (http::header::CACHE_CONTROL, "no-cache"),
        ],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// `: queued position=N eta_ms=M` for the request's place now; `None` once it left the
/// queue. The ETA is the position over the lane's measured dispatch rate (before any
/// dispatch is measured: position × mean service time ÷ requests in flight).
fn comment(spot: &QueueSpot) -> Option<Bytes> {
    let (lane, position) = spot.position()?;
    let eta = lane.eta(position).map(|d| d.as_secs_f64());
    let eta_ms = eta.map_or_else(
        || "unknown".to_string(),
        |s| format!("{}", (s * 1000.0).round() as u64),
    );
    Some(Bytes::from(format!(
        ": queued position={position} eta_ms={eta_ms}\n\n"
    )))
}
