//! The admin listener: `/metrics`, `/admin/state`, `/admin/degrade`, `/admin/drain` and the
//! dashboard (one static page, no CDN, polling `/admin/state`).
//!
//! Access: with an admin token set (`LEVEE_ADMIN_TOKEN`, or its SHA-256 in
//! `admin.token_sha256`), every route but the static dashboard page needs
//! `Authorization: Bearer <token>` (401 otherwise). Without a token, a listener bound to
//! loopback is open; one bound elsewhere serves reads and refuses actions (403), and says so
//! at start. Every action is logged with who did what.

use crate::config::ADMIN_TOKEN_ENV;
use crate::error::GatewayError;
use crate::gateway::Gateway;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::Arc;
use tower_http::catch_panic::CatchPanicLayer;

const DASHBOARD: &str = include_str!("../assets/dashboard.html");

/// Who may use the admin listener, fixed when it starts.
#[derive(Debug, Clone)]
pub struct AdminAccess {
    /// Where the admin listener is bound.
    pub bound: SocketAddr,
    /// SHA-256 of `LEVEE_ADMIN_TOKEN` as read at start (it wins over the config's hash).
    env_token: Option<[u8; 32]>,
}

impl AdminAccess {
    /// Reads `LEVEE_ADMIN_TOKEN` now; the config's `admin.token_sha256` is read per request
    /// (a reload applies to it).
    pub fn from_env(bound: SocketAddr) -> Self {
        let env_token = std::env::var(ADMIN_TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
            .map(|t| Sha256::digest(t.as_bytes()).into());
        AdminAccess { bound, env_token }
    }

    fn token(&self, gw: &Gateway) -> Option<[u8; 32]> {
        self.env_token.or_else(|| {
            let h = gw.config().admin.token_sha256.clone()?;
            hex::decode(h.to_ascii_lowercase()).ok()?.try_into().ok()
        })
    }

    /// Logs how the admin listener is protected; a warning when actions are refused.
    pub fn announce(&self, gw: &Gateway) {
        let bound = self.bound;
        if self.token(gw).is_some() {
            tracing::info!(%bound, "admin listener: routes need the admin token");
        } else if bound.ip().is_loopback() {
            tracing::info!(%bound, "admin listener: bound to loopback, no admin token set");
        } else {
            tracing::warn!(
                %bound,
                "admin listener is not on loopback and no admin token is set: \
                 admin actions (degrade, drain) are refused until {ADMIN_TOKEN_ENV} \
                 (or admin.token_sha256) is set; reads stay open"
            );
        }
    }
}

/// Who made an admin request, for the action log.
#[derive(Debug, Clone)]
pub struct AdminCaller(pub String);

/// Equal digests, in time independent of where they differ.
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn guard(
    State((gw, access)): State<(Arc<Gateway>, AdminAccess)>,
    mut req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    if path == "/" || path == "/dashboard" {
        // The page itself holds no data; it asks for the token and sends it with each call.
        return next.run(req).await;
    }
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string())
        .unwrap_or_else(|| "unknown".into());
    let how = match access.token(&gw) {
        Some(want) => {
            let Some(given) = crate::pipeline::bearer(req.headers()).filter(|t| !t.is_empty())
            else {
                return GatewayError::admin_unauthorized(true).into_response();
            };
            let given: [u8; 32] = Sha256::digest(given.as_bytes()).into();
            if !same_digest(&given, &want) {
                tracing::warn!(%peer, path, "admin request with a wrong token");
                return GatewayError::admin_unauthorized(false).into_response();
            }
            "admin token"
        }
        None if access.bound.ip().is_loopback() => "loopback",
        None if req.method() == http::Method::GET => "read-only",
        None => return GatewayError::admin_actions_disabled(access.bound).into_response(),
    };
    req.extensions_mut()
        .insert(AdminCaller(format!("{peer} ({how})")));
    next.run(req).await
}

/// The admin router for a listener bound to `access.bound`.
pub fn router(gw: Arc<Gateway>, access: AdminAccess) -> Router {
    let guarded = axum::middleware::from_fn_with_state((gw.clone(), access), guard);
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
        .layer(guarded)
        .layer(CatchPanicLayer::custom(crate::error::panic_response))
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
        gw.metrics().encode(),
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

async fn degrade(
    State(gw): State<Arc<Gateway>>,
    Extension(who): Extension<AdminCaller>,
    body: Bytes,
) -> Response {
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
    if let Some(l) = level {
        let max = gw.max_degradation();
        if l > max {
            return GatewayError::bad_request(format!(
                "level {l} is above the highest configured level {max}"
            ))
            .into_response();
        }
    }
    gw.force_degradation(level);
    gw.update_degrade();
    match level {
        Some(l) => {
            tracing::info!(who = %who.0, action = "degrade", level = l, "admin: degradation level forced")
        }
        None => {
            tracing::info!(who = %who.0, action = "degrade", level = "auto", "admin: degradation back to automatic")
        }
    }
    Json(gw.degradation_json()).into_response()
}

async fn degrade_get(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    Json(gw.degradation_json())
}

async fn drain(
    State(gw): State<Arc<Gateway>>,
    Extension(who): Extension<AdminCaller>,
) -> Json<serde_json::Value> {
    tracing::info!(who = %who.0, action = "drain", "admin: drain started");
    let grace = gw.begin_drain();
    Json(serde_json::json!({
        "draining": gw.is_draining(),
        "ready": false,
        "grace_ms": grace.as_millis() as u64,
        "in_flight": gw.in_flight(),
    }))
}
