//! The public listener's routes: the OpenAI-compatible endpoints run the request pipeline
//! ([`crate::pipeline`]), beside the task routes, the model list and the probes.

use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::pipeline;
use crate::tasks::Tasks;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use futures::future::Either;
use futures::FutureExt;
use http::{HeaderMap, StatusCode};
use serde_json::Value;
use std::sync::Arc;
use tower_http::catch_panic::CatchPanicLayer;

/// The public router.
pub(crate) fn router(gw: Arc<Gateway>, tasks: Option<Arc<Tasks>>) -> Router {
    Router::new()
        // A POST to these paths never reaches the router: the connection serves it
        // directly ([`pipeline_direct`]); any other method is not allowed.
        .route("/v1/chat/completions", any(method_not_allowed))
        .route("/v1/completions", any(method_not_allowed))
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

/// The pipeline's routes: `POST` to one of these paths on the public listener is served by
/// [`pipeline_direct`], without the router.
pub(crate) fn pipeline_path(path: &str) -> Option<&'static str> {
    match path {
        "/v1/chat/completions" => Some("/v1/chat/completions"),
        "/v1/completions" => Some("/v1/completions"),
        _ => None,
    }
}

/// A pipeline request, straight from the connection: what the router would do for it (the
/// body as axum's, a panic while the request runs answered 500) without its routing and
/// layers, whose futures a queued request would hold for its whole wait. (Choosing its path,
/// in `handle`, reads a header and the config before the catch: nothing there panics.) `handle`'s future is the request's own,
/// and the request is boxed: a by-value `Request` (240 bytes) would be kept for the
/// future's whole life.
pub(crate) fn pipeline_direct(
    gw: Arc<Gateway>,
    arrival: pipeline::Arrival,
    req: http::Request<hyper::body::Incoming>,
    path: &'static str,
) -> impl std::future::Future<Output = Response> {
    direct(gw, arrival, Box::new(req.map(axum::body::Body::new)), path)
}

/// [`pipeline_direct`] once the body is axum's: the future the connection keeps.
fn direct(
    gw: Arc<Gateway>,
    arrival: pipeline::Arrival,
    req: Box<Request>,
    path: &'static str,
) -> impl std::future::Future<Output = Response> {
    std::panic::AssertUnwindSafe(handle(gw, arrival, req, path))
        .catch_unwind()
        .map(|r| r.unwrap_or_else(crate::error::panic_response))
}

fn handle(
    gw: Arc<Gateway>,
    arrival: pipeline::Arrival,
    req: Box<Request>,
    path: &'static str,
) -> impl std::future::Future<Output = Response> {
    // Position comments are opt-in (header, or a tier's `queue_updates`): only then does the
    // request run beside a watcher that may start the response before dispatch. Decided
    // here, not in an async body: the request's future is then just the path it takes.
    // The runtime it starts with is the one it keeps, whatever reloads meanwhile.
    let rt = gw.runtime();
    let watch = pipeline::wants_queue_updates(req.headers()) || rt.queue_updates;
    if watch {
        Either::Left(crate::queue_updates::watched(gw, rt, arrival, req, path))
    } else {
        Either::Right(pipeline::serve_client(gw, rt, arrival, req, path, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request_log::RequestId;

    #[tokio::test]
    async fn the_direct_future_fits_its_size_class() {
        // The future the connection boxes for each pipeline request (server::service) and a
        // queued request holds for its whole wait: 432 bytes with rustc 1.95, inside
        // jemalloc's 448-byte size class. Each class above costs every queued request more
        // (512: 0.6 MB more for the 10,000 queued requests of bench/gateway-overhead.sh,
        // 100 MB on the default runtime, 77 MB on event loops; 640: 1.9 MB).
        let gw = Gateway::new(crate::Config::default()).unwrap();
        let peer = "127.0.0.1:1".parse().unwrap();
        let id = RequestId::for_request(&HeaderMap::new(), Some(peer));
        let arrival = pipeline::Arrival::new(&gw, id);
        let req = Box::new(Request::new(axum::body::Body::empty()));
        let f =
            direct(gw, arrival, req, "/v1/chat/completions").map(Ok::<_, std::convert::Infallible>);
        let size = std::mem::size_of_val(&f);
        eprintln!("the direct pipeline future: {size} bytes");
        assert!(size <= 448, "{size}");
    }
}
