//! The public listener's routes: the OpenAI-compatible endpoints run the request pipeline
//! ([`crate::pipeline`]), beside the task routes, the model list and the probes.

use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::pipeline;
use crate::tasks::Tasks;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http::{HeaderMap, StatusCode};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use tower_http::catch_panic::CatchPanicLayer;

/// The public router.
pub(crate) fn router(gw: Arc<Gateway>, tasks: Option<Arc<Tasks>>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(gw.clone())
        .merge(crate::tasks::router(gw, tasks))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(CatchPanicLayer::custom(crate::error::panic_response))
}

async fn not_found(req: Request) -> Response {
    GatewayError::not_found(req.uri().path()).into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    GatewayError::method_not_allowed(req.method(), req.uri().path()).into_response()
}

async fn healthz() -> Response {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        r#"{"status":"ok"}"#,
    )
        .into_response()
}

async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    // Ready means able to serve: overload is answered with 429s, never by leaving the
    // Service; only a drain stops advertising.
    let (status, why) = if gw.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if gw.is_leaving() {
        (StatusCode::SERVICE_UNAVAILABLE, "leaving")
    } else {
        (StatusCode::OK, "ready")
    };
    let body = serde_json::json!({"status": why, "load": gw.load()}).to_string();
    (
        status,
        [(http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

async fn models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Err(e) = pipeline::tenant_of(&gw, &headers) {
        return e.into_response();
    }
    let cfg = gw.config();
    let data: Vec<Value> = cfg
        .models
        .iter()
        .map(|m| serde_json::json!({"id": m.name, "object": "model", "created": 0, "owned_by": "levee"}))
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

// Plain functions returning `handle`'s future, and the request boxed: a queued request holds
// this future, and an async wrapper or a by-value `Request` argument (240 bytes, kept for the
// future's whole life at each level) would each make it bigger.
fn chat_completions(
    State(gw): State<Arc<Gateway>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> impl std::future::Future<Output = Response> {
    handle(gw, peer, Box::new(req), "/v1/chat/completions")
}

fn completions(
    State(gw): State<Arc<Gateway>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> impl std::future::Future<Output = Response> {
    handle(gw, peer, Box::new(req), "/v1/completions")
}

async fn handle(
    gw: Arc<Gateway>,
    peer: SocketAddr,
    req: Box<Request>,
    path: &'static str,
) -> Response {
    // Position comments are opt-in (header, or a tier's `queue_updates`): only then does the
    // request run beside a watcher that may start the response before dispatch.
    let watch = pipeline::wants_queue_updates(req.headers())
        || gw.config().tiers.values().any(|t| t.queue_updates);
    if watch {
        return crate::queue_updates::watched(gw, peer, req, path).await;
    }
    pipeline::serve_client(gw, peer, req, path, None).await
}
