//! The admin listener: `/metrics`, `/admin/state`, `/admin/degrade`, `/admin/drain` and the
//! dashboard (one static page, no CDN, polling `/admin/state`).

use crate::error::GatewayError;
use crate::gateway::Gateway;
use axum::extract::State;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::Deserialize;
use std::sync::Arc;
use tower_http::catch_panic::CatchPanicLayer;

const DASHBOARD: &str = include_str!("../assets/dashboard.html");

/// The admin router.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/dashboard", get(dashboard))
        .route("/metrics", get(metrics))
        .route("/admin/state", get(state))
        .route("/admin/degrade", post(degrade).get(degrade_get))
        .route("/admin/drain", post(drain))
        .fallback(|req: axum::extract::Request| async move {
            GatewayError::not_found(req.uri().path()).into_response()
        })
        .layer(CatchPanicLayer::custom(crate::routes::panic_response))
        .with_state(gw)
}

async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD)
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    gw.refresh_backend_metrics();
    (
        [(
            http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        gw.metrics.encode(),
    )
        .into_response()
}

async fn state(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    Json(gw.state_json())
}

/// Body of `POST /admin/degrade`: `{"level": 2}` forces level 2, `{"level": "auto"}` (or
/// `null`) returns to automatic.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DegradeBody {
    level: serde_json::Value,
}

async fn degrade(State(gw): State<Arc<Gateway>>, body: Bytes) -> Response {
    let parsed: Result<DegradeBody, _> = serde_json::from_slice(&body);
    let level = match parsed.as_ref().map(|b| &b.level) {
        Ok(serde_json::Value::Null) => None,
        Ok(serde_json::Value::String(s)) if s == "auto" => None,
        Ok(v) if v.as_u64().is_some() => v.as_u64().map(|n| n as usize),
        _ => {
            return GatewayError::bad_request(
                "send {\"level\": N} to force a level or {\"level\": \"auto\"}",
            )
            .into_response()
        }
    };
    {
        let mut d = gw.degrader.lock();
        if let Some(l) = level {
            if l > d.max_level() {
                return GatewayError::bad_request(format!(
                    "level {l} is above the highest configured level {}",
                    d.max_level()
                ))
                .into_response();
            }
        }
        d.force(level);
    }
    gw.update_degrade();
    tracing::info!(
        ?level,
        "degradation level set by operator (None = automatic)"
    );
    Json(gw.degrader.lock().state_json()).into_response()
}

async fn degrade_get(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    Json(gw.degrader.lock().state_json())
}

async fn drain(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    gw.drain();
    Json(
        serde_json::json!({"draining": true, "in_flight": gw.in_flight.load(std::sync::atomic::Ordering::Relaxed)}),
    )
}
