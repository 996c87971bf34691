//! The public routes and the admission pipeline, in DESIGN.md's order:
//! per-IP guard → authenticate → limits → queue (watermarks, priority, fairness) →
//! degrade → backend choice → proxy → reconcile.
//!
//! Degradation is decided just before the queue rather than after it: queues are per
//! model, so routing to a fallback model and shedding a tier must happen before a request
//! joins a queue. The `max_tokens` cap is applied when the upstream body is built.

use crate::error::{GatewayError, RateInfo};
use crate::gateway::{Gateway, Tenant};
use crate::lane::{Slot, SlotRequest};
use crate::limits::Grant;
use crate::metrics::{TenantKindLabels, TierLabel};
use crate::proxy::{self, Outcome, Settle, Settlement};
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use levee_policy::{Clock, Outcome as BreakerOutcome, WatermarkAction};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tower_http::catch_panic::CatchPanicLayer;

/// The public router.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(CatchPanicLayer::custom(panic_response))
        .with_state(gw)
}

/// A panic in a handler becomes an OpenAI-shaped 500 instead of a dropped connection.
pub fn panic_response(_err: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("handler panicked; answered 500");
    GatewayError::internal("internal error in the gateway").into_response()
}

async fn not_found(req: Request) -> Response {
    GatewayError::not_found(req.uri().path()).into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    let mut e = GatewayError::bad_request(format!(
        "method {} is not allowed on {}",
        req.method(),
        req.uri().path()
    ));
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e.code = "method_not_allowed";
    e.into_response()
}

async fn healthz() -> Response {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        r#"{"status":"ok"}"#,
    )
        .into_response()
}

async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    let (status, why) = if gw.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if gw.at_hard_watermark() {
        (StatusCode::SERVICE_UNAVAILABLE, "at_hard_watermark")
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

fn bearer(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers.get(http::header::AUTHORIZATION) {
        let v = v.to_str().ok()?.trim();
        let rest = v
            .strip_prefix("Bearer ")
            .or_else(|| v.strip_prefix("bearer "))?;
        return Some(rest.trim());
    }
    // Azure-style clients send the key in `api-key`.
    headers.get("api-key").and_then(|v| v.to_str().ok())
}

fn authenticate(gw: &Gateway, headers: &HeaderMap) -> Result<Arc<Tenant>, GatewayError> {
    let key = bearer(headers).ok_or_else(|| GatewayError::unauthorized(true))?;
    if key.is_empty() {
        return Err(GatewayError::unauthorized(true));
    }
    gw.runtime()
        .tenant_for_key(key)
        .cloned()
        .ok_or_else(|| GatewayError::unauthorized(false))
}

async fn models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Err(e) = authenticate(&gw, &headers) {
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

/// Labels for the request's metrics, filled in as the pipeline learns them.
struct Labels {
    tenant: String,
    tier: String,
    model: String,
}

async fn handle(
    gw: Arc<Gateway>,
    peer: SocketAddr,
    req: Box<Request>,
    path: &'static str,
) -> Response {
    let mut labels = Labels {
        tenant: "-".into(),
        tier: "-".into(),
        model: "-".into(),
    };
    match pipeline(&gw, peer, req, path, &mut labels).await {
        Ok(resp) => resp,
        Err(e) => {
            if e.status == StatusCode::TOO_MANY_REQUESTS
                || e.status == StatusCode::SERVICE_UNAVAILABLE
            {
                gw.metrics.reject(&labels.tier, e.code);
            }
            gw.metrics.request(&labels.tenant, &labels.model, e.code);
            if e.origin == crate::error::Origin::Upstream {
                tracing::warn!(tenant = %labels.tenant, model = %labels.model, "{e}");
            } else {
                tracing::debug!(tenant = %labels.tenant, model = %labels.model, "{e}");
            }
            e.into_response()
        }
    }
}

/// The fields of a completion request the gateway reads, and its raw body.
type Parsed = proxy::ClientRequest;

/// Parses a body. The bytes are copied into an allocation of their own: the body read from
/// hyper is a view into the connection's read buffer, and a queued request holding it would
/// keep that 8 KiB buffer alive beside the new one hyper allocates for its next read.
fn parse(bytes: &[u8]) -> Result<Parsed, GatewayError> {
    proxy::ClientRequest::parse(Bytes::copy_from_slice(bytes))
}

/// Reads the body; the request head is dropped here so its buffer is not held while queued.
async fn read_body(req: Request, limit: usize) -> Result<Bytes, GatewayError> {
    let (parts, body) = req.into_parts();
    if let Some(len) = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
    {
        if len > limit {
            return Err(GatewayError::body_too_large(limit));
        }
    }
    drop(parts);
    match axum::body::to_bytes(body, limit).await {
        Ok(b) => Ok(b),
        Err(e) => {
            let too_big = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
                || e.to_string().contains("length limit");
            if too_big {
                Err(GatewayError::body_too_large(limit))
            } else {
                Err(GatewayError::bad_request(format!(
                    "could not read the request body: {e}"
                )))
            }
        }
    }
}

async fn pipeline(
    gw: &Arc<Gateway>,
    peer: SocketAddr,
    req: Box<Request>,
    path: &'static str,
    labels: &mut Labels,
) -> Result<Response, GatewayError> {
    let started = Instant::now();
    let rt = gw.runtime();
    let cfg = rt.cfg.clone();
    if gw.is_draining() {
        return Err(GatewayError::draining(Duration::from_millis(
            cfg.server.drain_retry_after_ms,
        )));
    }
    // 1. Per-IP guard, before any work on the key or body.
    if let Err(wait) = gw.check_ip(peer.ip()) {
        return Err(GatewayError::rate_limited(
            "per-IP request rate",
            wait,
            RateInfo::default(),
        ));
    }
    // 2. Authenticate: the key decides tenant and tier; no client header can.
    let tenant = authenticate(gw, req.headers())?;
    labels.tenant = tenant.name.clone();
    labels.tier = tenant.tier.clone();
    let bytes = Box::pin(read_body(*req, cfg.server.max_body_bytes)).await?;
    let parsed = parse(&bytes)?;
    drop(bytes); // a view into hyper's read buffer: not held while queued
    labels.model = parsed.model.clone();
    let Some(model) = rt.models.get(&parsed.model).cloned() else {
        return Err(GatewayError::unknown_model(&parsed.model));
    };
    let now = gw.clock.now();

    // Degradation plan in force (see the module doc for why it is read here).
    let decision = gw.degrader.lock().decision();
    let mut degraded: Vec<String> = Vec::new();
    if let Some(p) = decision.shed_from_priority {
        if tenant.sheddable && tenant.priority >= p {
            gw.metrics
                .shed
                .get_or_create(&TierLabel {
                    tier: tenant.tier.clone(),
                })
                .inc();
            let retry = gw
                .lane(&model.name)
                .map(|l| l.retry_estimate(gw))
                .unwrap_or(Duration::from_secs(1));
            return Err(GatewayError::capacity_overload(
                &format!(
                    "degradation level {} sheds tier {}",
                    decision.level, tenant.tier
                ),
                retry,
            ));
        }
    }
    let mut target = model.clone();
    if decision.use_fallback {
        if let Some(fb) = model.fallback.as_ref().and_then(|f| rt.models.get(f)) {
            target = fb.clone();
            degraded.push(format!("fallback={}", fb.name));
        }
    }
    let requested_max = parsed.max_tokens;
    let effective_max = match (decision.max_tokens_cap, requested_max) {
        (Some(cap), Some(r)) if r > cap => {
            degraded.push(format!("max_tokens={cap}"));
            Some(cap)
        }
        (Some(cap), None) => {
            degraded.push(format!("max_tokens={cap}"));
            Some(cap)
        }
        (_, r) => r,
    };

    // 3. Limits: tenant first (a flooding tenant is refused before it spends shared
    // budget), then heavy, model, global.
    let prompt_est = (parsed.len() as u64) / 4;
    let completion_est = u64::from(effective_max.unwrap_or(cfg.server.default_max_tokens));
    let estimate = prompt_est + completion_est;
    let heavy = (cfg.heavy.prompt_tokens_over > 0 && prompt_est > cfg.heavy.prompt_tokens_over)
        || (cfg.heavy.max_tokens_over > 0 && completion_est > cfg.heavy.max_tokens_over);
    let mut grant = Grant::new(gw.clock);
    let scopes = [
        Some(&tenant.limits),
        heavy.then_some(&tenant.heavy),
        Some(&target.limits),
        Some(&rt.global),
    ];
    for scope in scopes.into_iter().flatten() {
        if scope.is_unlimited() {
            continue;
        }
        if let Err(refusal) = scope.take(estimate, now, &mut grant) {
            let mut e = refusal.into_error();
            if e.rate.is_none() || !Arc::ptr_eq(scope, &tenant.limits) {
                // Report the tenant's own figures beside the scope that refused.
                let own = tenant.limits.rate_info(now);
                let r = e.rate.get_or_insert_with(Box::default);
                r.limit_requests = r.limit_requests.or(own.limit_requests);
                r.remaining_requests = r.remaining_requests.or(own.remaining_requests);
                r.reset_requests = r.reset_requests.or(own.reset_requests);
                r.limit_tokens = r.limit_tokens.or(own.limit_tokens);
                r.remaining_tokens = r.remaining_tokens.or(own.remaining_tokens);
                r.reset_tokens = r.reset_tokens.or(own.reset_tokens);
            }
            return Err(e);
        }
    }
    let tenant_rate = tenant.limits.rate_info(now);
    record_limiter_gauges(gw, &tenant.name, &tenant_rate);

    // 4. Queue: watermarks give the wait budget (or refuse at the hard mark). The load
    //    leaves out lower tiers' queued requests: this one would be served before them.
    let load = gw.load_for_priority(tenant.priority);
    let wm = rt.watermarks.decide(
        load,
        tenant.budget,
        &gw.drain_rate.lock(),
        &rt.retry_bounds,
        now,
    );
    let request_timeout = Duration::from_millis(cfg.server.request_timeout_ms);
    let budget = match wm.action {
        WatermarkAction::Refuse => {
            return Err(GatewayError::capacity_overload(
                &format!("load {} in zone {}", wm.load, wm.zone.as_str()),
                wm.retry_after.as_duration(),
            ))
        }
        WatermarkAction::Wait { budget } => budget,
        WatermarkAction::DispatchNow => tenant.budget.normal,
    }
    .min(request_timeout);
    let Some(lane) = gw.lane(&target.name) else {
        return Err(GatewayError::unknown_model(&target.name));
    };
    let retry_hint = lane.retry_estimate(gw);
    let acquired = lane
        .acquire(
            gw,
            SlotRequest {
                tenant: &tenant,
                cost: estimate,
                budget,
                retry_after: retry_hint,
            },
        )
        .await;
    let slot = match acquired {
        Ok(slot) => slot,
        Err(e) if e.code == "circuit_open" || e.code == "no_healthy_backend" => {
            let Some(text) = target.fallback_response.as_deref() else {
                return Err(e);
            };
            // The grant is dropped unreconciled: its tokens are refunded.
            gw.metrics
                .degraded
                .get_or_create(&crate::metrics::ReasonLabels {
                    tier: tenant.tier.clone(),
                    reason: "fallback_response".into(),
                })
                .inc();
            gw.metrics
                .request(&tenant.name, &target.name, "fallback_response");
            return Ok(canned_response(
                path,
                &target.name,
                parsed.stream,
                text,
                e.code,
            ));
        }
        Err(e) => return Err(e),
    };
    gw.metrics.admitted_for(&tenant.metrics, &tenant.tier);
    if !degraded.is_empty() {
        for d in &degraded {
            let measure = d.split('=').next().unwrap_or("degraded").to_string();
            gw.metrics
                .degraded
                .get_or_create(&crate::metrics::ReasonLabels {
                    tier: tenant.tier.clone(),
                    reason: measure,
                })
                .inc();
        }
    }

    // 5. Build the upstream request (the model name is set per backend, below).
    let mut slot = slot;
    let cap = effective_max.filter(|m| requested_max != Some(*m));
    // With `strip_usage`, levee asks for the usage chunk so tokens can be reconciled; it is
    // removed on the way back because this client did not ask for it.
    let strip_usage = parsed.stream && !parsed.client_wants_usage;

    let mut extra: Vec<(&'static str, HeaderValue)> = Vec::new();
    let queued_ms = slot.queued_for.as_millis();
    if queued_ms > 0 || slot.queued_for > Duration::ZERO {
        if let Ok(v) = HeaderValue::from_str(&queued_ms.to_string()) {
            extra.push(("x-levee-queue-ms", v));
        }
    }
    if !degraded.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&degraded.join(", ")) {
            extra.push(("x-levee-degraded", v));
        }
    }
    let mut rate_headers = HeaderMap::new();
    tenant_rate.write_headers(&mut rate_headers);
    for (k, v) in rate_headers.iter() {
        if let Some(name) = static_rate_header(k.as_str()) {
            extra.push((name, v.clone()));
        }
    }

    // 6. Proxy. The deadline covers the whole non-streaming exchange, and a stream's
    // response head.
    let deadline = started + request_timeout;
    let mut resent = false;
    let (resp, sent_at) = loop {
        let upstream_model = slot
            .backend
            .upstream_model
            .as_deref()
            .unwrap_or(&target.name);
        let upstream_body = parsed.upstream_body(upstream_model, cap, strip_usage)?;
        let sent_at = Instant::now();
        let backend = slot.backend.clone();
        // Boxed, like the other stages after the queue: a queued request's future stays small.
        match Box::pin(proxy::send(
            &gw.client,
            &backend,
            path,
            upstream_body,
            deadline,
        ))
        .await
        {
            Ok(r) => break (r, sent_at),
            Err(e) => {
                let now = gw.clock.now();
                slot.record(BreakerOutcome::BackendFailure, now);
                slot.backend.adaptive_sample(None, true);
                // A refused connection means the request never reached the backend: send
                // it once to another backend with a free slot, if there is one now.
                if e.code == "upstream_unreachable" && !resent {
                    if let Some(other) = lane.try_take_other(gw, &slot.backend.id) {
                        tracing::warn!(model = %target.name, "{e}; resending to {}", other.backend.id);
                        slot = other;
                        resent = true;
                        continue;
                    }
                }
                // The slot and the grant drop here: the slot frees, the tokens are refunded.
                return Err(e);
            }
        }
    };
    let settle = RequestSettle {
        gw: gw.clone(),
        slot: Some(slot),
        grant,
        estimate,
        tenant: tenant.clone(),
        model: target.name.clone(),
    };
    let settlement = Settlement::new(Box::new(settle));
    if parsed.stream && resp.status().is_success() {
        Ok(proxy::stream_response(
            resp,
            settlement,
            strip_usage,
            sent_at,
            &extra,
        ))
    } else {
        Box::pin(proxy::finish_buffered(
            resp, settlement, deadline, sent_at, &extra,
        ))
        .await
    }
}

/// The configured fallback reply in the OpenAI shape (chat or legacy completion, streamed
/// or not).
fn canned_response(path: &str, model: &str, stream: bool, text: &str, why: &str) -> Response {
    let chat = path.ends_with("/chat/completions");
    let mut resp = if stream {
        let chunk = if chat {
            serde_json::json!({"id": "levee-fallback", "object": "chat.completion.chunk", "created": 0,
                "model": model, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})
        } else {
            serde_json::json!({"id": "levee-fallback", "object": "text_completion", "created": 0,
                "model": model, "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
        };
        let body = format!("data: {chunk}\n\ndata: [DONE]\n\n");
        ([(http::header::CONTENT_TYPE, "text/event-stream")], body).into_response()
    } else {
        let usage =
            serde_json::json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
        let body = if chat {
            serde_json::json!({"id": "levee-fallback", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": usage})
        } else {
            serde_json::json!({"id": "levee-fallback", "object": "text_completion", "created": 0, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}], "usage": usage})
        };
        axum::Json(body).into_response()
    };
    let h = resp.headers_mut();
    h.insert(
        "x-levee-degraded",
        HeaderValue::from_static("fallback_response"),
    );
    if let Ok(v) = HeaderValue::from_str(why) {
        h.insert("x-levee-fallback-reason", v);
    }
    resp
}

fn static_rate_header(name: &str) -> Option<&'static str> {
    const NAMES: [&str; 6] = [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ];
    NAMES.into_iter().find(|n| *n == name)
}

fn record_limiter_gauges(gw: &Gateway, tenant: &str, r: &RateInfo) {
    if let Some(v) = r.remaining_requests {
        gw.metrics
            .limiter_remaining
            .get_or_create(&TenantKindLabels {
                tenant: tenant.to_string(),
                kind: "requests".into(),
            })
            .set(i64::try_from(v).unwrap_or(i64::MAX));
    }
    if let Some(v) = r.remaining_tokens {
        gw.metrics
            .limiter_remaining
            .get_or_create(&TenantKindLabels {
                tenant: tenant.to_string(),
                kind: "tokens".into(),
            })
            .set(i64::try_from(v).unwrap_or(i64::MAX));
    }
}

/// Everything an admitted request must give back or report when it ends.
struct RequestSettle {
    gw: Arc<Gateway>,
    slot: Option<Slot>,
    grant: Grant,
    estimate: u64,
    tenant: Arc<Tenant>,
    model: String,
}

impl Settle for RequestSettle {
    fn settle(mut self: Box<Self>, outcome: Outcome) {
        let now = self.gw.clock.now();
        let breaker_outcome = if outcome.transport_error {
            BreakerOutcome::BackendFailure
        } else if outcome.status == 429 || outcome.status == 503 {
            BreakerOutcome::Backpressure
        } else if outcome.status >= 500 {
            BreakerOutcome::BackendFailure
        } else if outcome.status >= 400 {
            BreakerOutcome::ClientError
        } else if outcome.client_gone && outcome.status == 0 {
            BreakerOutcome::Cancelled
        } else {
            BreakerOutcome::Success
        };
        if let Some(mut slot) = self.slot.take() {
            slot.record(breaker_outcome, now);
            slot.backend.adaptive_sample(
                outcome.ttft,
                breaker_outcome == BreakerOutcome::BackendFailure,
            );
            drop(slot); // frees the backend slot now, before metrics work
        }
        // Reconcile: real usage replaces the estimate; without usage the estimate stands,
        // except when the backend never produced anything (refund).
        match outcome.usage {
            Some(u) => {
                self.grant.reconcile(u.total(), now);
                self.gw.metrics.tokens_for(
                    &self.tenant.metrics,
                    &self.tenant.name,
                    u.prompt_tokens,
                    u.completion_tokens,
                );
            }
            None if outcome.transport_error || outcome.status >= 400 || outcome.status == 0 => {
                self.grant.refund(now)
            }
            None => self.grant.reconcile(self.estimate, now),
        }
        if let Some(t) = outcome.ttft {
            self.gw
                .metrics
                .ttft_for(&self.tenant.metrics, &self.tenant.tier, t.as_secs_f64());
        }
        let label = if outcome.client_gone {
            "client_gone"
        } else if outcome.transport_error {
            "upstream_error"
        } else if outcome.status >= 500 {
            "upstream_5xx"
        } else if outcome.status >= 400 {
            "upstream_4xx"
        } else {
            "ok"
        };
        self.gw
            .metrics
            .request_for(&self.tenant.metrics, &self.tenant.name, &self.model, label);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_reads_the_fields_we_need() {
        let p = parse(br#"{"model":"m","stream":true,"max_tokens":5,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(p.model, "m");
        assert!(p.stream);
        assert_eq!(p.max_tokens, Some(5));
        assert!(p.client_wants_usage);
        assert_eq!(parse(b"{").unwrap_err().status, StatusCode::BAD_REQUEST);
        assert_eq!(parse(b"[]").unwrap_err().status, StatusCode::BAD_REQUEST);
        assert_eq!(parse(br#"{"model":3}"#).unwrap_err().param, Some("model"));
        assert_eq!(
            parse(br#"{"model":"m","max_tokens":-1}"#)
                .unwrap_err()
                .param,
            Some("max_tokens")
        );
    }

    #[tokio::test]
    async fn future_sizes() {
        // Each queued request holds one of these; keep them small (see BENCHMARKS.md).
        let gw = Gateway::new(crate::Config::default()).unwrap();
        let req = Box::new(Request::new(axum::body::Body::empty()));
        let f = handle(
            gw,
            "127.0.0.1:1".parse().unwrap(),
            req,
            "/v1/chat/completions",
        );
        let size = std::mem::size_of_val(&f);
        eprintln!("handle future: {size} bytes");
        assert!(size < 16 * 1024, "{size}");
    }

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        assert!(bearer(&h).is_none());
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer abc"),
        );
        assert_eq!(bearer(&h), Some("abc"));
    }
}
