//! The public routes and the request pipeline, as named phases a reader finds by name:
//! [`authenticate`] (per-IP guard, API key → tenant and tier) → [`classify`] (model, the
//! lane's degradation, prompt count, completion budget, context check) → [`admit_phase`]
//! (levee-policy's one admission path: limits, watermark, fair share, KV budget, predicted
//! wait, the fair queue) → [`dispatch`] (the backend it was placed on) → [`proxy_phase`]
//! (send, resend once if the backend could not be reached, stream back) → settle
//! ([`RequestSettle`]: breaker, reconcile, metrics).
//!
//! Each request runs in a `tracing` span (at `debug` level) named `request` (fields `request_id`, `tenant`,
//! `model`, `backend`, `queue_ms`, `outcome`, `http.response.status_code`; never a key or a
//! body) with one child span per phase, named as above (and `read_body`). A served request's
//! span ends when it settles, after the last byte of its answer; with the `otel` feature
//! these spans are exported as an OpenTelemetry trace (see `crate::otel`).
//!
//! Degradation is decided before admission rather than after it: queues are per model, so
//! routing to a fallback model and shedding a tier must happen before a request joins a
//! queue. The `max_tokens` cap is applied when the upstream body is built.

use crate::error::{GatewayError, RateInfo};
use crate::gateway::{Gateway, Model, Runtime, Tenant};
use crate::lane::{self, Admitted, Lane, QueueSpot};
use crate::metrics::TierLabel;
use crate::proxy::{self, Outcome, Settle, Settlement, StreamLimits};
use crate::request_log::{ms, RequestId, RequestLine};
use crate::upstream::{advised_retry, Backend, Verdict};
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use levee_policy::{
    AdmissionRequest, Clock, Completion, Key, Outcome as BreakerOutcome, RefusalReason,
};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tower_http::catch_panic::CatchPanicLayer;
use tracing::field::Empty;
use tracing::{debug_span, Instrument, Span};

/// The public router.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route(
            "/v1/tasks",
            post(crate::tasks::submit).get(crate::tasks::list),
        )
        .route(
            "/v1/tasks/{id}",
            get(crate::tasks::show).delete(crate::tasks::cancel),
        )
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

/// The key or token of `Authorization: Bearer ...` (or `api-key`).
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
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

async fn models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Err(e) = tenant_of(&gw, &headers) {
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

/// Labels for the request's metrics, filled in as the pipeline learns them. `model` only
/// ever holds a configured model's name (or `-`): a client's string never becomes a label.
struct Labels {
    tenant: Key,
    tier: String,
    model: Key,
    lane: Option<Arc<Lane>>,
    request: Option<RequestId>,
    /// The request's `tracing` span; phases are its children.
    span: Span,
}

/// The request's span: its fields are filled in as the pipeline learns them.
fn request_span(path: &'static str, request: Option<&RequestId>) -> Span {
    debug_span!(
        "request",
        otel.kind = "server",
        http.request.method = "POST",
        http.route = path,
        request_id = request.map(RequestId::as_str),
        tenant = Empty,
        model = Empty,
        backend = Empty,
        queue_ms = Empty,
        outcome = Empty,
        http.response.status_code = Empty,
        otel.status_code = Empty,
    )
}

/// Records how a request ended on its span.
fn record_end(span: &Span, outcome: &str, status: u16) {
    span.record("outcome", outcome);
    span.record("http.response.status_code", status);
    if status >= 500 || status == 0 {
        span.record("otel.status_code", "ERROR");
    }
}

async fn handle(
    gw: Arc<Gateway>,
    peer: SocketAddr,
    req: Box<Request>,
    path: &'static str,
) -> Response {
    // Position comments are opt-in (header, or a tier's `queue_updates`): only then does the
    // request run beside a watcher that may start the response before dispatch.
    let watch = req
        .headers()
        .get("x-levee-queue-updates")
        .is_some_and(|v| v.as_bytes() == b"1")
        || gw.config().tiers.values().any(|t| t.queue_updates);
    if watch {
        return crate::queue_updates::watched(gw, peer, req, path).await;
    }
    handle_with(gw, peer, req, path, None).await
}

/// The pipeline with its error accounting; `spot` reports where the request waits.
pub(crate) async fn handle_with(
    gw: Arc<Gateway>,
    peer: SocketAddr,
    req: Box<Request>,
    path: &'static str,
    spot: Option<&QueueSpot>,
) -> Response {
    let dash = Key::new("-");
    let request = req.extensions().get::<RequestId>().cloned();
    let span = request_span(path, request.as_ref());
    let mut labels = Labels {
        tenant: dash.clone(),
        tier: "-".into(),
        model: dash,
        lane: None,
        request,
        span: span.clone(),
    };
    let arrived = Instant::now();
    match pipeline(&gw, peer, req, path, &mut labels, spot)
        .instrument(span)
        .await
    {
        Ok(resp) => resp,
        Err(mut e) => {
            account_error(&gw, &labels, &e);
            if let Some(id) = &labels.request {
                RequestLine {
                    request_id: id.as_str(),
                    tenant: &labels.tenant,
                    tier: &labels.tier,
                    model: &labels.model,
                    backend: None,
                    client: id.peer,
                    outcome: e.code,
                    status: e.status.as_u16(),
                    code: Some(e.code),
                    queue_ms: None,
                    ttft_ms: None,
                    duration_ms: ms(arrived.elapsed()),
                    prompt_tokens: None,
                    completion_tokens: None,
                }
                .emit(id.seq, gw.config().observe.request_log_sample);
            }
            if e.code == "capacity_overload" && gw.tasks().is_some() {
                // The seeds' switch to async: a long job need not hold a connection open.
                e.message.push_str(
                    "; for long jobs, submit the same body to POST /v1/tasks: it waits in \
                     line durably and answers at once with its position and ETA",
                );
            }
            e.into_response()
        }
    }
}

/// Metrics and the log line of a request that ended in an error.
fn account_error(gw: &Gateway, labels: &Labels, e: &GatewayError) {
    if e.status == StatusCode::TOO_MANY_REQUESTS || e.status == StatusCode::SERVICE_UNAVAILABLE {
        gw.metrics.reject(&labels.tier, e.code);
    }
    gw.metrics.request(&labels.tenant, &labels.model, e.code);
    record_end(&labels.span, e.code, e.status.as_u16());
    // A refusal (429, 503) is counted in levee_rejected_total above, not logged: under a
    // flood or an outage a line each would drown the log.
    let refusal =
        e.status == StatusCode::TOO_MANY_REQUESTS || e.status == StatusCode::SERVICE_UNAVAILABLE;
    if e.origin == crate::error::Origin::Upstream && !refusal {
        tracing::warn!(tenant = %labels.tenant, model = %labels.model, "{e}");
    } else {
        tracing::debug!(tenant = %labels.tenant, model = %labels.model, "{e}");
    }
}

/// Reads the body; the request head is dropped here so its buffer is not held while queued.
pub(crate) async fn read_body(req: Request, limit: usize) -> Result<Bytes, GatewayError> {
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

/// What classification learned about a request: everything admission and the upstream call
/// need, with the prompt text already counted and dropped.
struct Classified {
    parsed: proxy::ClientRequest,
    /// The model served (the requested one, or its fallback under degradation).
    target: Arc<Model>,
    lane: Arc<Lane>,
    prompt_tokens: u64,
    /// The completion budget per choice after degradation and the default.
    max_tokens: u32,
    /// What to write as `max_tokens` upstream, when it differs from what the client sent.
    cap: Option<u32>,
    /// Measures applied (`max_tokens=256`, `fallback=small`).
    degraded: Vec<String>,
    /// The request's id, for its log line.
    request: Option<RequestId>,
    /// The request's span, kept until it settles.
    span: Span,
}

/// The pipeline, one named phase after another (each a function below):
/// authenticate → classify → admit → dispatch → proxy → settle.
async fn pipeline(
    gw: &Arc<Gateway>,
    peer: SocketAddr,
    req: Box<Request>,
    path: &'static str,
    labels: &mut Labels,
    spot: Option<&QueueSpot>,
) -> Result<Response, GatewayError> {
    let rt = gw.runtime();
    let tenant = debug_span!("authenticate").in_scope(|| authenticate(gw, peer, req.headers()))?;
    let asked_updates = req
        .headers()
        .get("x-levee-queue-updates")
        .is_some_and(|v| v.as_bytes() == b"1");
    labels.tenant = tenant.name.clone();
    labels.span.record("tenant", &*tenant.name);
    let seat = Seat::of(&tenant);
    let body = Box::pin(read_body(*req, rt.cfg.server.max_body_bytes))
        .instrument(debug_span!("read_body"))
        .await?;
    let seat_updates = seat.queue_updates;
    let served = serve(gw, &rt, tenant, seat, &body, path, labels, spot, |stream| {
        stream && (asked_updates || seat_updates)
    });
    Box::pin(served).await
}

/// Runs one task's request through the same phases as a client's (classify → admit in the
/// batch band → dispatch → proxy, buffered), for [`crate::tasks`].
pub(crate) async fn serve_task(
    gw: &Arc<Gateway>,
    tenant: Arc<Tenant>,
    seat: Seat,
    body: &[u8],
    path: &'static str,
    spot: &QueueSpot,
) -> Result<Response, GatewayError> {
    let rt = gw.runtime();
    let dash = Key::new("-");
    let span = request_span(path, None);
    span.record("tenant", &*tenant.name);
    let mut labels = Labels {
        tenant: tenant.name.clone(),
        tier: seat.tier.clone(),
        model: dash,
        lane: None,
        request: None,
        span: span.clone(),
    };
    let served = serve(
        gw,
        &rt,
        tenant,
        seat,
        body,
        path,
        &mut labels,
        Some(spot),
        |_| false,
    );
    let r = Box::pin(served.instrument(span)).await;
    if let Err(e) = &r {
        account_error(gw, &labels, e);
    }
    r
}

/// Everything after authentication: classify → admit → dispatch → proxy → settle.
#[allow(clippy::too_many_arguments)]
async fn serve(
    gw: &Arc<Gateway>,
    rt: &Runtime,
    tenant: Arc<Tenant>,
    seat: Seat,
    body: &[u8],
    path: &'static str,
    labels: &mut Labels,
    spot: Option<&QueueSpot>,
    wants_updates: impl FnOnce(bool) -> bool,
) -> Result<Response, GatewayError> {
    labels.tier = seat.tier.clone();
    let c = debug_span!("classify").in_scope(|| classify(gw, rt, &seat, body, labels));
    labels.span.record("model", &*labels.model);
    let c = c?;
    if let Some(s) = spot {
        s.updates.store(
            wants_updates(c.parsed.stream),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    let admitted = match admit_phase(gw, &tenant, &seat, &c, spot)
        .instrument(debug_span!("admit"))
        .await
    {
        Ok(a) => a,
        Err(e) => {
            let unservable = matches!(e.refusal, Some(RefusalReason::Unservable(_)));
            return match (&c.target.fallback_response, unservable) {
                (Some(text), true) => {
                    record_end(&labels.span, "fallback_response", StatusCode::OK.as_u16());
                    Ok(fallback_reply(gw, &tenant, &c, path, text, &e))
                }
                _ => Err(e),
            };
        }
    };
    labels.span.record("queue_ms", ms(admitted.waited));
    gw.metrics.admitted_for(&tenant.metrics, &seat.tier);
    for d in &c.degraded {
        let measure = d.split('=').next().unwrap_or("degraded").to_string();
        gw.metrics
            .degraded
            .get_or_create(&crate::metrics::ReasonLabels {
                tier: seat.tier.clone(),
                reason: measure,
            })
            .inc();
    }
    let (admitted, backend) = debug_span!("dispatch").in_scope(|| dispatch(admitted, &c))?;
    Box::pin(
        proxy_phase(gw, rt, tenant, c, admitted, backend, path).instrument(debug_span!("proxy")),
    )
    .await
}

/// The tier a request is admitted in: the tenant's own, or the batch band for its tasks.
#[derive(Debug, Clone)]
pub(crate) struct Seat {
    /// Tier name (metric label).
    pub tier: String,
    /// Its strict priority.
    pub priority: u8,
    /// Degradation may shed it.
    pub sheddable: bool,
    /// Waiting streams of this tier get position comments without asking.
    pub queue_updates: bool,
}

impl Seat {
    /// The tenant's own tier.
    pub fn of(t: &Tenant) -> Seat {
        Seat {
            tier: t.tier.clone(),
            priority: t.priority,
            sheddable: t.sheddable,
            queue_updates: t.queue_updates,
        }
    }
}

/// Authenticate: the per-IP guard first (a flood of bad keys costs one map lookup each),
/// then the API key decides tenant and tier; no client header can.
fn authenticate(
    gw: &Gateway,
    peer: SocketAddr,
    headers: &HeaderMap,
) -> Result<Arc<Tenant>, GatewayError> {
    if gw.is_draining() {
        return Err(GatewayError::draining(Duration::from_millis(
            gw.config().server.drain_retry_after_ms,
        )));
    }
    if let Err(wait) = gw.check_ip(peer.ip()) {
        return Err(GatewayError::rate_limited(
            "per-IP request rate",
            wait,
            RateInfo::default(),
        ));
    }
    tenant_of(gw, headers)
}

pub(crate) fn tenant_of(gw: &Gateway, headers: &HeaderMap) -> Result<Arc<Tenant>, GatewayError> {
    let key = bearer(headers).ok_or_else(|| GatewayError::unauthorized(true))?;
    if key.is_empty() {
        return Err(GatewayError::unauthorized(true));
    }
    gw.runtime()
        .tenant_for_key(key)
        .cloned()
        .ok_or_else(|| GatewayError::unauthorized(false))
}

/// The longest context of `model`: configured, else the smallest any backend reported.
fn max_context(model: &Model, lane: &Lane) -> Option<u64> {
    model.max_context_tokens.or_else(|| {
        lane.backends()
            .iter()
            .filter_map(|b| b.learned().max_context)
            .min()
    })
}

/// Classify: parse the body, resolve the model and its lane, apply the lane's degradation
/// (shed, fallback model, `max_tokens` cap), count the prompt, inject the default
/// completion budget, and refuse at once what can never fit the model's context.
fn classify(
    gw: &Gateway,
    rt: &Runtime,
    tenant: &Seat,
    body: &[u8],
    labels: &mut Labels,
) -> Result<Classified, GatewayError> {
    // Copied into an allocation of its own: the body read from hyper is a view into the
    // connection's read buffer, and a queued request holding it would keep that buffer alive.
    let (parsed, prompt) = proxy::ClientRequest::parse(Bytes::copy_from_slice(body))?;
    let Some(model) = rt.models.get(&parsed.model).cloned() else {
        // Never a metric label from an unvalidated client string.
        labels.model = "unknown".into();
        return Err(GatewayError::unknown_model(&parsed.model));
    };
    labels.model = model.name.clone();
    let decision = gw.degrader.lock().decision(&model.name);
    let mut degraded: Vec<String> = Vec::new();
    if let Some(p) = decision.shed_from_priority {
        if tenant.sheddable && tenant.priority >= p {
            gw.metrics
                .shed
                .get_or_create(&TierLabel {
                    tier: tenant.tier.clone(),
                })
                .inc();
            return Err(GatewayError::capacity_overload(
                &format!(
                    "degradation level {} of model {:?} sheds tier {}",
                    decision.level, &*model.name, tenant.tier
                ),
                Duration::from_secs(1),
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
    let Some(lane) = gw.lane(&target.name) else {
        return Err(GatewayError::unknown_model(&target.name));
    };
    labels.lane = Some(lane.clone());
    let prompt_tokens = target.counter.count(&prompt);
    drop(prompt);
    let context = max_context(&target, &lane);
    let requested = parsed.max_tokens;
    if let Some(ctx) = context {
        let asked = prompt_tokens + u64::from(requested.unwrap_or(0));
        if prompt_tokens >= ctx || (requested.is_some() && asked > ctx) {
            return Err(GatewayError::context_length_exceeded(format!(
                "this model's maximum context length is {ctx} tokens; this request asks for \
                 about {asked} (prompt ≈ {prompt_tokens}{}); shorten the prompt or lower \
                 max_tokens",
                requested
                    .map(|m| format!(" + max_tokens {m}"))
                    .unwrap_or_default()
            )));
        }
    }
    let mut max_tokens = requested.unwrap_or(target.default_max_tokens);
    if let Some(ctx) = context {
        // An injected default never asks for more than the context leaves.
        let room = u32::try_from(ctx.saturating_sub(prompt_tokens)).unwrap_or(u32::MAX);
        max_tokens = max_tokens.min(room.max(1));
    }
    if let Some(cap) = decision.max_tokens_cap {
        if max_tokens > cap {
            max_tokens = cap;
            degraded.push(format!("max_tokens={cap}"));
        }
    }
    let cap = (requested != Some(max_tokens)).then_some(max_tokens);
    Ok(Classified {
        parsed,
        target,
        lane,
        prompt_tokens,
        max_tokens,
        cap,
        degraded,
        request: labels.request.clone(),
        span: labels.span.clone(),
    })
}

/// Admit: levee-policy's one admission path (limits, the lane's watermark, fair share, KV
/// budget, predicted wait), waiting in the lane's fair queue if it must.
async fn admit_phase(
    gw: &Arc<Gateway>,
    tenant: &Tenant,
    seat: &Seat,
    c: &Classified,
    spot: Option<&QueueSpot>,
) -> Result<Admitted, GatewayError> {
    let req = AdmissionRequest {
        tenant: tenant.name.clone(),
        model: c.target.name.clone(),
        tier: levee_policy::Tier(seat.priority),
        prompt_tokens: c.prompt_tokens,
        completion_tokens: u64::from(c.max_tokens) * u64::from(c.parsed.choices),
        max_wait: None,
    };
    gw.scaling.arrival(&c.target.name);
    // Fleet-wide rates first (a refusal here costs the local state nothing); the charge
    // comes back if the local admission then refuses.
    let charge = match (&gw.shared, rt_scopes(gw, tenant)) {
        (Some(shared), Some(scopes)) => Box::pin(shared.take(&scopes, req.tokens())).await?,
        _ => None,
    };
    let waiting = gw.metrics.queued_wait(&tenant.name);
    let admitted = Box::pin(lane::admit(gw, &c.lane, &seat.tier, req, spot)).await;
    waiting.done();
    let mut admitted = admitted?;
    admitted.attach(charge);
    Ok(admitted)
}

/// The tenant's scopes in the shared limit store, when there is one.
fn rt_scopes(gw: &Gateway, tenant: &Tenant) -> Option<Arc<[levee_store::ScopeLimits]>> {
    gw.shared.as_ref()?;
    gw.runtime().shared_scopes.get(&tenant.name).cloned()
}

/// Dispatch: the backend the admission placed the request on.
fn dispatch(admitted: Admitted, c: &Classified) -> Result<(Admitted, Arc<Backend>), GatewayError> {
    match admitted.backend() {
        Some(b) => Ok((admitted, b)),
        // Its backend was removed by a reload between the decision and now.
        None => Err(GatewayError::no_healthy_backend(
            &c.target.name,
            Duration::from_secs(1),
        )),
    }
}

/// Proxy: send upstream (once more to another backend if the first could not be reached),
/// then stream or buffer the answer back. Settlement travels with the response body.
async fn proxy_phase(
    gw: &Arc<Gateway>,
    rt: &Runtime,
    tenant: Arc<Tenant>,
    c: Classified,
    mut admitted: Admitted,
    mut backend: Arc<Backend>,
    path: &'static str,
) -> Result<Response, GatewayError> {
    // With `strip_usage`, levee asks for the usage chunk so tokens can be reconciled; it is
    // removed on the way back because this client did not ask for it.
    let strip_usage = c.parsed.stream && !c.parsed.client_wants_usage;
    let extra = response_headers(gw, &tenant, &c, &admitted);
    // The deadline starts at dispatch: the gateway's own queue wait is not the backend's.
    let request_timeout = Duration::from_millis(rt.cfg.server.request_timeout_ms);
    let dispatched = Instant::now();
    let outlier = &rt.cfg.outlier;
    let mut resent = false;
    // Set when the failed attempt's outcome already went to its breaker and ejection.
    let mut judged = false;
    let (resp, sent_at) = loop {
        let upstream_model = backend.upstream_model.as_deref().unwrap_or(&c.target.name);
        let upstream_body = c.parsed.upstream_body(upstream_model, c.cap, strip_usage)?;
        let sent_at = Instant::now();
        admitted.mark_sent();
        let sent = Box::pin(proxy::send(
            &gw.client,
            &backend,
            path,
            upstream_body,
            sent_at + request_timeout,
            c.request.as_ref(),
        ))
        .await;
        let verdict = match &sent {
            Ok(r) => Verdict::of_response(
                r.status(),
                advised_retry(r.headers()),
                backend.is_routable(),
                outlier,
            ),
            // Nothing listens: the request never reached the backend.
            Err(e) if e.code == "upstream_unreachable" => Verdict::Unavailable { advised: None },
            Err(_) => Verdict::Failure,
        };
        // Nothing reached the client yet: a request this backend failed (or refused) goes
        // once more to another backend with room, within its deadline.
        if !resent && verdict.worth_another_backend() && sent_at.elapsed() < request_timeout {
            eject_if_due(gw, &c.lane, &backend, verdict, outlier);
            if admitted.redispatch(verdict.breaker_outcome()) {
                if let Some(other) = admitted.backend() {
                    tracing::warn!(model = %c.target.name, ?verdict, "backend {} failed before the first byte; resending to {}", backend.id, other.id);
                    backend = other;
                    resent = true;
                    continue;
                }
            }
            // No other backend has room: the backend's own answer (or error) stands.
            judged = true;
            if let Err(e) = sent {
                // The admission drops here: the slot frees and the charges come back.
                return Err(e);
            }
        }
        match sent {
            Ok(r) => break (r, sent_at),
            Err(e) => {
                eject_if_due(gw, &c.lane, &backend, verdict, outlier);
                // The admission drops here: the slot frees and the charges come back.
                return Err(e);
            }
        }
    };
    let backend_id = backend.id.clone();
    c.span.record("backend", &*backend_id);
    let queued = admitted.waited;
    let settle = RequestSettle {
        gw: gw.clone(),
        queued,
        sent_at,
        admitted: Some(admitted),
        backend,
        tenant,
        model: c.target.name.clone(),
        lane: c.lane.clone(),
        prompt_estimate: c.prompt_tokens,
        streamed: c.parsed.stream,
        outlier: rt.cfg.outlier.clone(),
        judged,
        request: c.request.clone(),
        span: c.span.clone(),
    };
    let settlement = Settlement::new(Box::new(settle));
    if c.parsed.stream && resp.status().is_success() {
        let total = Duration::from_millis(rt.cfg.server.stream_timeout_ms);
        let limits = StreamLimits {
            idle: Duration::from_millis(rt.cfg.server.stream_idle_timeout_ms),
            deadline: dispatched + total,
            total,
        };
        Ok(proxy::stream_response(
            resp,
            settlement,
            strip_usage,
            sent_at,
            limits,
            &backend_id,
            &extra,
        ))
    } else {
        Box::pin(proxy::finish_buffered(
            resp,
            settlement,
            sent_at + request_timeout,
            sent_at,
            &extra,
        ))
        .await
    }
}

/// The headers levee adds to a served response: queue wait, degradation, the tenant's
/// rate-limit figures.
fn response_headers(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    admitted: &Admitted,
) -> Vec<(&'static str, HeaderValue)> {
    let mut extra: Vec<(&'static str, HeaderValue)> = Vec::new();
    if admitted.waited > Duration::ZERO {
        if let Ok(v) = HeaderValue::from_str(&admitted.waited.as_millis().to_string()) {
            extra.push(("x-levee-queue-ms", v));
        }
    }
    if !c.degraded.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&c.degraded.join(", ")) {
            extra.push(("x-levee-degraded", v));
        }
    }
    let now = gw.clock.now();
    let mut rate = gw.admission.lock().rate_limit_headers(&tenant.name, now);
    if let Some(f) = admitted.shared_figures() {
        rate.requests = f.requests;
        rate.tokens = f.tokens;
    }
    let info = RateInfo {
        limit_requests: rate.requests.map(|i| i.limit),
        remaining_requests: rate.requests.map(|i| i.remaining),
        reset_requests: rate.requests.map(|i| i.reset_after),
        limit_tokens: rate.tokens.map(|i| i.limit),
        remaining_tokens: rate.tokens.map(|i| i.remaining),
        reset_tokens: rate.tokens.map(|i| i.reset_after),
    };
    record_limiter_gauges(gw, &tenant.name, &info);
    let mut rate_headers = HeaderMap::new();
    info.write_headers(&mut rate_headers);
    for (k, v) in rate_headers.iter() {
        if let Some(name) = static_rate_header(k.as_str()) {
            extra.push((name, v.clone()));
        }
    }
    extra
}

/// The model's canned reply when none of its backends can serve.
fn fallback_reply(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    path: &str,
    text: &str,
    e: &GatewayError,
) -> Response {
    gw.metrics
        .degraded
        .get_or_create(&crate::metrics::ReasonLabels {
            tier: tenant.tier.clone(),
            reason: "fallback_response".into(),
        })
        .inc();
    gw.metrics
        .request(&tenant.name, &c.target.name, "fallback_response");
    canned_response(path, &c.target.name, c.parsed.stream, text, e.code)
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
    gw.metrics
        .limiter_remaining(tenant, r.remaining_requests, r.remaining_tokens);
}

/// Feeds a verdict to the backend's outlier ejection; an ejection holds the backend's breaker
/// open for its length, so it leaves routing at once and comes back through probes.
fn eject_if_due(
    gw: &Gateway,
    lane: &Lane,
    backend: &Backend,
    verdict: Verdict,
    outlier: &crate::config::OutlierConfig,
) {
    let now = gw.clock.now();
    if let Some(until) = backend.observe(verdict, now, outlier) {
        gw.admission
            .lock()
            .eject(&lane.model, &backend.key, until, now);
        lane.wake();
    }
}

/// Settle: everything an admitted request must give back or report when it ends.
struct RequestSettle {
    gw: Arc<Gateway>,
    queued: Duration,
    sent_at: Instant,
    admitted: Option<Admitted>,
    backend: Arc<Backend>,
    tenant: Arc<Tenant>,
    model: Key,
    lane: Arc<Lane>,
    prompt_estimate: u64,
    /// Streamed: its time to first token is the end of its prefill (the prefill fit).
    streamed: bool,
    outlier: crate::config::OutlierConfig,
    /// The outcome already went to outlier ejection (see `proxy_phase`).
    judged: bool,
    request: Option<RequestId>,
    /// The request's span: it ends when this is dropped, at the end of `settle`.
    span: Span,
}

impl Settle for RequestSettle {
    fn settle(mut self: Box<Self>, outcome: Outcome) {
        let _settling = debug_span!(parent: &self.span, "settle").entered();
        let now = self.gw.clock.now();
        let verdict = outcome.verdict(self.backend.is_routable(), &self.outlier);
        if !self.judged {
            eject_if_due(&self.gw, &self.lane, &self.backend, verdict, &self.outlier);
        }
        let breaker_outcome = verdict.breaker_outcome();
        if let Some(code) = outcome.stream_cut {
            self.gw.metrics.stream_cut(&self.backend.id, code);
        }
        let failed = breaker_outcome == BreakerOutcome::BackendFailure;
        let in_flight = self
            .gw
            .admission
            .lock()
            .lane(&self.model)
            .and_then(|l| l.in_flight_of(&self.backend.key))
            .unwrap_or(0);
        self.backend
            .adaptive_sample(outcome.ttft, failed, in_flight);
        // Reconcile: real usage replaces the estimate; a backend that produced nothing
        // (an error before any token) charges nothing.
        let actual_tokens = match outcome.usage {
            Some(u) => Some(u.total()),
            None if outcome.transport_error || outcome.status >= 400 || outcome.status == 0 => {
                Some(0)
            }
            None => None,
        };
        if let Some(a) = self.admitted.take() {
            a.complete(Completion {
                outcome: breaker_outcome,
                actual_tokens,
            });
        }
        if let Some(u) = outcome.usage {
            self.gw.metrics.tokens_for(
                &self.tenant.metrics,
                &self.tenant.name,
                u.prompt_tokens,
                u.completion_tokens,
            );
            if u.prompt_tokens > 0 {
                self.gw
                    .metrics
                    .estimate_ratio
                    .get_or_create(&crate::metrics::ModelLabel {
                        model: self.model.to_string(),
                    })
                    .observe(self.prompt_estimate as f64 / u.prompt_tokens as f64);
            }
        }
        if let Some(t) = outcome.ttft {
            self.gw
                .metrics
                .ttft_for(&self.tenant.metrics, &self.tenant.tier, t.as_secs_f64());
            self.lane.note_ttft(now, t);
            if self.streamed && (200..300).contains(&outcome.status) {
                self.lane.note_prefill(self.prompt_estimate, t);
            }
        }
        let label = if let Some(code) = outcome.stream_cut {
            code
        } else if outcome.client_gone {
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
        record_end(&self.span, label, outcome.status);
        self.gw.scaling.completion(&self.model);
        let times = crate::metrics::RequestTimes {
            queued: self.queued,
            ttft: outcome.ttft.map(|t| self.queued + t),
            total: self.queued + self.sent_at.elapsed(),
            abandoned: outcome.client_gone,
        };
        self.gw
            .metrics
            .request_times(&self.model, &self.tenant.name, &self.tenant.tier, &times);
        if let Some(id) = &self.request {
            RequestLine {
                request_id: id.as_str(),
                tenant: &self.tenant.name,
                tier: &self.tenant.tier,
                model: &self.model,
                backend: Some(&self.backend.id),
                client: id.peer,
                outcome: label,
                status: outcome.status,
                code: outcome.stream_cut,
                queue_ms: Some(ms(times.queued)),
                ttft_ms: times.ttft.map(ms),
                duration_ms: ms(times.total),
                prompt_tokens: outcome.usage.map(|u| u.prompt_tokens),
                completion_tokens: outcome.usage.map(|u| u.completion_tokens),
            }
            .emit(id.seq, self.gw.config().observe.request_log_sample);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(b: &[u8]) -> Result<proxy::ClientRequest, GatewayError> {
        proxy::ClientRequest::parse(Bytes::copy_from_slice(b)).map(|(r, _)| r)
    }

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
