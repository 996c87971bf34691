//! The admin listener: `/metrics`, `/admin/state`, `/admin/degrade`, `/admin/drain` and the
//! dashboard (one static page, no CDN, polling `/admin/state`).
//!
//! Access: with an admin token set (`LEVEE_ADMIN_TOKEN`, or its SHA-256 in
//! `admin.token_sha256`), every route but the static dashboard page needs
//! `Authorization: Bearer <token>` (401 otherwise). Without a token, a listener bound to
//! loopback is open; one bound elsewhere serves reads and refuses actions (403), and says so
//! at start. Every action is logged with who did what.

use crate::config::ADMIN_TOKEN_ENV;
use crate::error::{ErrorCode, GatewayError};
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
        None => {
            let hosts = &gw.config().admin.hosts;
            if let Err(why) = browser_safe(req.method(), req.headers(), hosts) {
                tracing::warn!(%peer, path, "admin request refused: {why}");
                return GatewayError::new(ErrorCode::AdminRequestRefused, why).into_response();
            }
            if access.bound.ip().is_loopback() {
                "loopback"
            } else if is_read(req.method()) {
                "read-only"
            } else {
                return GatewayError::admin_actions_disabled(access.bound).into_response();
            }
        }
    };
    req.extensions_mut()
        .insert(AdminCaller(format!("{peer} ({how})")));
    next.run(req).await
}

fn is_read(m: &http::Method) -> bool {
    m == http::Method::GET || m == http::Method::HEAD
}

/// Without an admin token, what stands between the admin listener and a web page open in
/// a browser on the same machine (the listener is on loopback, or tunnelled to a laptop).
/// A page can make the browser send a "simple" cross-origin POST (a form, or `text/plain`
/// from `fetch`) without asking, and can point its own name at 127.0.0.1 (DNS rebinding) to
/// read answers. So: every request must name the listener in `Host` by an IP address,
/// `localhost` or a name in `admin.hosts` (a rebinding page's `Host` is its own name), and an
/// action must carry `Content-Type: application/json` (which a page cannot send
/// cross-origin without a CORS preflight, and levee answers none) and, when the browser
/// sends an `Origin`, one whose host is the `Host`.
fn browser_safe(
    method: &http::Method,
    headers: &http::HeaderMap,
    hosts: &[String],
) -> Result<(), String> {
    let host = headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if !host_is_local(host, hosts) {
        return Err(format!(
            "Host {host:?} is not this admin listener's address; use its IP address or \
             localhost, add the name to admin.hosts, or set an admin token"
        ));
    }
    if is_read(method) {
        return Ok(());
    }
    let json = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(
            "admin actions without the admin token need Content-Type: application/json".into(),
        );
    }
    if let Some(origin) = headers.get(http::header::ORIGIN) {
        let o = origin.to_str().unwrap_or("null");
        let same = o
            .split_once("://")
            .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host));
        if !same {
            return Err(format!(
                "a request from origin {o:?} may not act on {host:?}"
            ));
        }
    }
    Ok(())
}

/// Whether a `Host` header names this listener: an IP literal or `localhost` (any port),
/// or one of the operator's `admin.hosts`.
fn host_is_local(host: &str, hosts: &[String]) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => {
            return v6
                .split(']')
                .next()
                .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok())
        }
        None => host.rsplit_once(':').map_or(host, |(n, _)| n),
    };
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || hosts.iter().any(|h| h.eq_ignore_ascii_case(name))
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
        .route("/admin/undrain", post(undrain))
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

/// `POST /admin/undrain`: undoes a drain (an operator's mistake, or a forged one): the
/// gateway advertises itself again (`/readyz` 200) and accepts new requests.
async fn undrain(
    State(gw): State<Arc<Gateway>>,
    Extension(who): Extension<AdminCaller>,
) -> Json<serde_json::Value> {
    let was = gw.undrain();
    tracing::info!(who = %who.0, action = "undrain", was_draining = was, "admin: drain undone");
    Json(serde_json::json!({
        "draining": gw.is_draining(),
        "ready": !gw.is_leaving(),
        "was_draining": was,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut m = http::HeaderMap::new();
        for (k, v) in pairs {
            m.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        m
    }

    #[test]
    fn browser_forgeable_admin_requests_are_refused() {
        let post = http::Method::POST;
        let get = http::Method::GET;
        let json = ("content-type", "application/json");
        let ok = |m: &http::Method, hs: &[(&str, &str)]| browser_safe(m, &h(hs), &[]).is_ok();
        assert!(ok(&get, &[("host", "127.0.0.1:9090")]));
        assert!(ok(&get, &[("host", "localhost:9090")]));
        assert!(ok(&get, &[("host", "[::1]:9090")]));
        assert!(!ok(&get, &[("host", "attacker.example")]), "DNS rebinding");
        assert!(!ok(&get, &[("host", "attacker.example:9090")]));
        assert!(!ok(&get, &[]), "no Host");
        assert!(ok(&post, &[("host", "127.0.0.1:9090"), json]));
        assert!(
            !ok(
                &post,
                &[("host", "127.0.0.1:9090"), ("content-type", "text/plain")]
            ),
            "a simple cross-origin POST"
        );
        assert!(
            !ok(
                &post,
                &[
                    ("host", "127.0.0.1:9090"),
                    ("content-type", "application/x-www-form-urlencoded")
                ]
            ),
            "a form POST"
        );
        assert!(!ok(&post, &[("host", "127.0.0.1:9090")]), "no content type");
        assert!(!ok(
            &post,
            &[
                ("host", "127.0.0.1:9090"),
                json,
                ("origin", "http://attacker.example")
            ]
        ));
        assert!(!ok(
            &post,
            &[("host", "127.0.0.1:9090"), json, ("origin", "null")]
        ));
        assert!(ok(
            &post,
            &[
                ("host", "127.0.0.1:9090"),
                json,
                ("origin", "http://127.0.0.1:9090")
            ]
        ));
        let named = ["levee-admin.internal".to_string()];
        assert!(browser_safe(&get, &h(&[("host", "levee-admin.internal:9090")]), &named).is_ok());
    }
}
