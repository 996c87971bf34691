//! A request's path through the gateway, as named phases over one per-request context
//! ([`RequestCtx`]). Their order, in one place ([`serve_client`] and [`serve`]):
//!
//! 1. **authenticate** — draining, the per-IP guard, API key → tenant and tier;
//! 2. **read** — the body, within its size limit and uncompressed;
//! 3. **classify** ([`classify`]) — model, the lane's degradation, prompt count, completion
//!    budget, context check; then **count** ([`count`]) — a long prompt counted by a backend
//!    itself, when the model asks for exact counts;
//! 4. **admit** ([`admit`]) — the fleet-wide rates (shared store), then levee-policy's one
//!    admission path in the model's lane (limits, watermark, fair share, KV budget,
//!    predicted wait, the fair queue); a refusal may become a degraded answer instead
//!    ([`fallback`]: a stored answer, the fallback model for a tier that degrades a
//!    predicted TTFT miss, the model's canned reply);
//! 5. **dispatch** — the backend the admission placed it on;
//! 6. **proxy** ([`forward`]) — send, resend once if the backend failed before answering,
//!    stream or buffer the answer back;
//! 7. **settle** ([`settle`]) — when the answer ends or the client goes away: the backend's
//!    slot, the reconciled charges, breaker and latency samples, metrics, the log line.
//!
//! Async tasks enter at classify ([`serve_task`]: their tenant and body are already known);
//! a request whose client wants queue-position comments runs the same phases beside a
//! watcher ([`crate::queue_updates`]). Neither imports the routes.
//!
//! Each request runs in a `tracing` span (at `debug` level) named `request` (fields
//! `request_id`, `tenant`, `model`, `backend`, `queue_ms`, `outcome`,
//! `http.response.status_code`; never a key or a body) with one child span per phase; a
//! served request's span ends when it settles, after the last byte of its answer. With the
//! `otel` feature these spans are exported as an OpenTelemetry trace.
//!
//! Degradation is decided before admission rather than after it: queues are per model, so
//! routing to a fallback model and shedding a tier must happen before a request joins a
//! queue. The `max_tokens` cap is applied when the upstream body is built.

mod admit;
mod cached;
mod classify;
mod count;
mod fallback;
mod forward;
mod settle;

use crate::error::{ErrorCode, GatewayError, RateInfo};
use crate::gateway::Gateway;
use crate::lane::QueueSpot;
use crate::lane::{self, Lane};
use crate::request_log::{ms, RequestId, RequestLine};
use crate::runtime::{Runtime, Tenant};
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::HeaderMap;
use levee_policy::Key;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{debug_span, Instrument, Span};

/// What the pipeline knows about one request, filled in phase by phase. `model` only ever
/// holds a configured model's name (or `-`): a client's string never becomes a label.
pub(crate) struct RequestCtx {
    path: &'static str,
    arrived: Instant,
    tenant: Key,
    tier: String,
    model: Key,
    lane: Option<Arc<Lane>>,
    request: Option<Arc<RequestId>>,
    /// The session its header names, when affinity is on.
    session: Option<u64>,
    /// Its tenant opted in to the response cache.
    response_cache: bool,
    /// The request's span; phases are its children.
    span: Span,
    /// Where the request is, for the count of a client that leaves before its answer.
    phase: Phase,
    /// Counts a request dropped before its answer (see the `Drop` below).
    gw: Arc<Gateway>,
    /// The outcome such a request is counted with: `client_gone`, or `cancelled` for a
    /// task.
    gone: &'static str,
}

/// How far a request got, for the count of one whose client leaves before the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading its body (or not yet authenticated).
    Reading,
    /// Deciding admission, perhaps waiting in the queue (that wait counts its own
    /// abandonment).
    Admitting,
    /// At its backend, before the response head.
    Dispatched,
    /// Answered: the error's count or the settlement takes over.
    Answered,
}

/// A client that leaves before its answer drops the request's future: the pipeline never
/// reaches an outcome, and the settlement (which counts one for a client that leaves
/// mid-answer) does not exist yet. Counted here, so that every request that arrived has
/// an outcome in `levee_requests_total`, and one that left at its backend an abandonment.
impl Drop for RequestCtx {
    fn drop(&mut self) {
        if self.phase == Phase::Answered {
            return;
        }
        let m = self.gw.metrics();
        m.request(&self.tenant, &self.model, self.gone);
        match self.phase {
            Phase::Reading if &*self.tenant != "-" => m.abandon(&self.tenant, "reading"),
            Phase::Dispatched => m.abandon(&self.tenant, "dispatched"),
            _ => {}
        }
        record_end(&self.span, self.gone, 499);
    }
}

/// Where a pipeline request came from, as its connection saw it: the request's id (with
/// the peer), and its count should its handler never run.
pub(crate) struct Arrival {
    id: Arc<RequestId>,
    unclaimed: Unclaimed,
}

impl Arrival {
    pub(crate) fn new(gw: &Arc<Gateway>, id: RequestId) -> Arrival {
        Arrival {
            id: Arc::new(id),
            unclaimed: Unclaimed(Some(gw.clone())),
        }
    }

    /// The client's address (unspecified for a request made without a connection).
    fn peer(&self) -> SocketAddr {
        self.id
            .peer
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

/// A request whose handler never runs (the client left before the request's future was
/// first polled, and the connection dropped it) is still counted, as `client_gone`;
/// [`serve_client`] claims it as it starts.
struct Unclaimed(Option<Arc<Gateway>>);

impl Unclaimed {
    fn claim(&mut self) {
        self.0 = None;
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if let Some(gw) = &self.0 {
            gw.metrics().request("-", "-", "client_gone");
        }
    }
}

impl RequestCtx {
    fn new(gw: &Arc<Gateway>, path: &'static str, request: Option<Arc<RequestId>>) -> Self {
        // One key shared by every request (a new one would allocate each time).
        static DASH: std::sync::LazyLock<Key> = std::sync::LazyLock::new(|| Key::new("-"));
        let dash = DASH.clone();
        RequestCtx {
            phase: Phase::Reading,
            gw: gw.clone(),
            gone: "client_gone",
            path,
            arrived: Instant::now(),
            tenant: dash.clone(),
            tier: "-".into(),
            model: dash,
            span: request_span(path, request.as_deref()),
            lane: None,
            request,
            session: None,
            response_cache: false,
        }
    }

    fn set_tenant(&mut self, tenant: &Tenant, seat: &Seat) {
        self.tenant = tenant.name.clone();
        self.response_cache = tenant.response_cache();
        self.tier = seat.tier.clone();
        record(&self.span, "tenant", &*tenant.name);
    }
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
    /// What a request predicted to miss the tier's TTFT objective gets.
    pub slo_miss: crate::config::SloMiss,
}

impl Seat {
    /// The tenant's own tier.
    pub fn of(t: &Tenant) -> Seat {
        Seat {
            tier: t.tier.clone(),
            priority: t.priority,
            sheddable: t.sheddable,
            queue_updates: t.queue_updates,
            slo_miss: t.slo_miss(),
        }
    }
}

/// A client's request, every phase: authenticate → read → classify → admit → dispatch →
/// proxy (settle travels with the answer). `spot` reports where it waits, for a watcher.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice while a request waits"
)]
pub(crate) fn serve_client<'a>(
    gw: Arc<Gateway>,
    rt: Arc<Runtime>,
    mut arrival: Arrival,
    req: Box<Request>,
    path: &'static str,
    spot: Option<&'a QueueSpot>,
) -> impl std::future::Future<Output = Response> + 'a {
    async move {
        arrival.unclaimed.claim();
        let mut ctx = RequestCtx::new(&gw, path, Some(arrival.id.clone()));
        let span = ctx.span.clone();
        let run = async {
            let tenant = debug_span!("authenticate")
                .in_scope(|| authenticate(&gw, &rt, arrival.peer(), req.headers()))?;
            let asked_updates = wants_queue_updates(req.headers());
            let affinity = &rt.cfg.affinity;
            if affinity.enabled {
                ctx.session = crate::session::from_header(req.headers(), &affinity.session_header);
            }
            let seat = Seat::of(&tenant);
            ctx.set_tenant(&tenant, &seat);
            let (limit, timeout) = {
                let ms = rt.cfg.server.body_read_timeout_ms;
                (rt.cfg.server.max_body_bytes, Duration::from_millis(ms))
            };
            let body = Box::pin(read_body(unbox(req), limit, timeout))
                .instrument(debug_span!("read_body"))
                .await?;
            let updates = asked_updates || seat.queue_updates;
            let served = serve(&gw, &rt, tenant, seat, body, &mut ctx, spot, |stream| {
                stream && updates
            });
            Box::pin(served).await
        };
        let answer = run.instrument(span).await;
        ctx.phase = Phase::Answered;
        match answer {
            Ok(resp) => resp,
            Err(e) => {
                account_error(&gw, &ctx, &e);
                log_error(&rt, &ctx, &e);
                if e.code() == ErrorCode::CapacityOverload && rt.cfg.tasks.enabled {
                    // A long job need not hold a connection open.
                    return e
                        .with_advice(
                            "for long jobs, submit the same body to POST /v1/tasks: it waits in \
                             line durably and answers at once with its position and ETA",
                        )
                        .into_response();
                }
                e.into_response()
            }
        }
    }
}

/// One async task's request through the same phases as a client's, from classify on
/// (admitted in the batch band, its answer buffered).
pub(crate) async fn serve_task(
    gw: &Arc<Gateway>,
    tenant: Arc<Tenant>,
    seat: Seat,
    body: &[u8],
    path: &'static str,
    spot: &QueueSpot,
) -> Result<Response, GatewayError> {
    let mut ctx = RequestCtx::new(gw, path, None);
    ctx.gone = "cancelled";
    ctx.set_tenant(&tenant, &seat);
    let span = ctx.span.clone();
    let body = Bytes::copy_from_slice(body);
    let rt = gw.runtime();
    let served = serve(gw, &rt, tenant, seat, body, &mut ctx, Some(spot), |_| false);
    let r = Box::pin(served.instrument(span)).await;
    ctx.phase = Phase::Answered;
    if let Err(e) = &r {
        account_error(gw, &ctx, e);
    }
    r
}

/// Everything after authentication: classify → admit → dispatch → proxy → settle. `body`
/// is dropped once classified: read from hyper it is a view into the connection's first read
/// buffer, which a queued request must not keep alive (hyper has already allocated a second
/// one by then; the first, freed, goes to the next connection's read:
/// `server::with_fresh_write_buffer`).
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice while a request waits"
)]
#[expect(
    clippy::too_many_arguments,
    reason = "the request's parts as the phases before it leave them"
)]
fn serve<'a>(
    gw: &'a Arc<Gateway>,
    rt: &'a Arc<Runtime>,
    tenant: Arc<Tenant>,
    seat: Seat,
    body: Bytes,
    ctx: &'a mut RequestCtx,
    spot: Option<&'a QueueSpot>,
    wants_updates: impl FnOnce(bool) -> bool + 'a,
) -> impl std::future::Future<Output = Result<Response, GatewayError>> + 'a {
    async move {
        let c = debug_span!("classify").in_scope(|| classify::classify(gw, rt, &seat, &body, ctx));
        drop(body);
        record(&ctx.span, "model", &*ctx.model);
        let mut c = c?;
        if let Some(resp) = cached::when_degraded(gw, &tenant, &c, ctx) {
            return Ok(resp);
        }
        count::exact(gw, &mut c).await;
        if let Some(s) = spot {
            s.updates.store(
                wants_updates(c.parsed.stream),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        ctx.phase = Phase::Admitting;
        // A block: the admission is gone from this future's locals before the proxy's wait.
        let proxied = {
            let admitted = match admission(gw, &tenant, &seat, &mut c, ctx, spot).await {
                Ok(a) => a,
                Err(answer) => return answer,
            };
            ctx.phase = Phase::Dispatched;
            record(&ctx.span, "queue_ms", ms(admitted.waited));
            admit::count_admitted(gw, &tenant, &seat, &c);
            let (admitted, backend) =
                debug_span!("dispatch").in_scope(|| admit::dispatch(admitted, &c))?;
            Box::pin(
                forward::forward(gw, rt, tenant, c, admitted, backend, ctx.path)
                    .instrument(debug_span!("proxy")),
            )
        };
        proxied.await
    }
}

/// The admit phase, and a refusal's degraded answer or the refusal itself (`Err`); a
/// predicted TTFT miss degraded to the fallback model is admitted there by that model's own
/// checks, once.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice while a request waits"
)]
fn admission<'a>(
    gw: &'a Arc<Gateway>,
    tenant: &'a Tenant,
    seat: &'a Seat,
    c: &'a mut classify::Classified,
    ctx: &'a RequestCtx,
    spot: Option<&'a QueueSpot>,
) -> impl std::future::Future<Output = Result<lane::Admitted, Result<Response, GatewayError>>> + 'a
{
    async move {
        let refused = match admit::admit(gw, tenant, seat, c, spot)
            .instrument(debug_span!("admit"))
            .await
        {
            Ok(a) => return Ok(a),
            Err(e) => e,
        };
        match fallback::on_refusal(gw, &gw.runtime(), tenant, seat, c, ctx, refused) {
            fallback::Next::Answer(r) => Err(r),
            // Boxed: only a refused request holds a second admission's state.
            fallback::Next::AdmitAgain => Box::pin(admit::admit(gw, tenant, seat, c, spot))
                .instrument(debug_span!("admit"))
                .await
                .map_err(|e| fallback::or_error(gw, tenant, c, ctx, e)),
        }
    }
}

/// Whether the client asked for queue-position comments (`x-levee-queue-updates: 1`).
pub(crate) fn wants_queue_updates(headers: &HeaderMap) -> bool {
    // A name, not a `&str`: looking up a `&str` first turns it into one, on every request.
    const QUEUE_UPDATES: http::HeaderName = http::HeaderName::from_static("x-levee-queue-updates");
    headers
        .get(QUEUE_UPDATES)
        .is_some_and(|v| v.as_bytes() == b"1")
}

/// Authenticate: draining first, then the per-IP guard (a flood of bad keys costs one map
/// lookup each), then the API key decides tenant and tier; no client header can.
fn authenticate(
    gw: &Gateway,
    rt: &Runtime,
    peer: SocketAddr,
    headers: &HeaderMap,
) -> Result<Arc<Tenant>, GatewayError> {
    if gw.is_draining() {
        return Err(GatewayError::draining(Duration::from_millis(
            rt.cfg.server.drain_retry_after_ms,
        )));
    }
    // The guard's lock is every request's: not taken while the guard is off.
    let guarded = if rt.cfg.ip_guard.enabled {
        gw.check_ip(peer.ip())
    } else {
        Ok(())
    };
    if let Err(wait) = guarded {
        return Err(GatewayError::rate_limited(
            "per-IP request rate",
            wait,
            RateInfo::default(),
        ));
    }
    tenant_in(rt, headers)
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

/// The tenant whose API key the request carries.
pub(crate) fn tenant_of(gw: &Gateway, headers: &HeaderMap) -> Result<Arc<Tenant>, GatewayError> {
    tenant_in(&gw.runtime(), headers)
}

/// The tenant whose API key the request carries, in runtime `rt`.
fn tenant_in(rt: &Runtime, headers: &HeaderMap) -> Result<Arc<Tenant>, GatewayError> {
    let key = bearer(headers).ok_or_else(|| GatewayError::unauthorized(true))?;
    if key.is_empty() {
        return Err(GatewayError::unauthorized(true));
    }
    rt.tenant_for_key(key)
        .ok_or_else(|| GatewayError::unauthorized(false))
}

/// The request out of its box, the box freed at once: moving out with `*req` would keep the
/// box's allocation until its scope ends, the request's whole life.
fn unbox(req: Box<Request>) -> Request {
    *req
}

/// Read: the body, within `limit` bytes; the request head is dropped here so its buffer is
/// not held while queued. A compressed body is refused (415) before it is read: its bytes
/// are not the JSON they stand for, and neither levee nor an OpenAI-style engine behind it
/// decodes them.
pub(crate) async fn read_body(
    req: Request,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, GatewayError> {
    let (parts, body) = req.into_parts();
    for encoding in parts.headers.get_all(http::header::CONTENT_ENCODING) {
        let encoding = String::from_utf8_lossy(encoding.as_bytes());
        if encoding
            .split(',')
            .any(|e| !e.trim().is_empty() && !e.trim().eq_ignore_ascii_case("identity"))
        {
            return Err(GatewayError::compressed_body(encoding.trim()));
        }
    }
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
    let Ok(read) = tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await else {
        return Err(GatewayError::new(
            ErrorCode::RequestTimeout,
            format!(
                "the request body did not arrive within {} ms (server.body_read_timeout_ms)",
                timeout.as_millis()
            ),
        ));
    };
    match read {
        Ok(b) => check_body(&b).map(|()| b),
        Err(e) => {
            let too_big = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
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

/// Refuses (400) a body the classify phase's reading would accept but the rewrite for the
/// backend, which reads every field, would not — after admission, as a 500. The first
/// reading skips the fields levee does not use without looking inside them; the rewrite
/// builds every value. So: nesting deeper than serde_json goes, text that is not UTF-8,
/// and, in a skipped field, a lone UTF-16 surrogate escape or a number out of range. Only
/// a body with a surrogate escape or a number with an exponent or 300+ digits pays for a
/// full reading here.
pub(crate) fn check_body(b: &[u8]) -> Result<(), GatewayError> {
    let found = scan(b);
    if found.depth > MAX_JSON_DEPTH {
        return Err(GatewayError::bad_request(format!(
            "the request body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels"
        )));
    }
    if std::str::from_utf8(b).is_err() {
        return Err(GatewayError::bad_request(
            "the request body is not UTF-8 (JSON must be)",
        ));
    }
    if found.needs_full_reading && serde_json::from_slice::<serde_json::Value>(b).is_err() {
        return Err(GatewayError::bad_request(
            "the request body holds a value levee cannot pass on: a lone UTF-16 surrogate \
             escape or a number out of range",
        ));
    }
    Ok(())
}

/// Deepest nesting of objects and arrays a request body may have. serde_json stops at 128
/// when it builds a value.
const MAX_JSON_DEPTH: usize = 100;

/// What one pass over a JSON text finds (a malformed text gives some answer, and fails to
/// parse later).
#[derive(Debug, Default, PartialEq, Eq)]
struct Scan {
    /// The deepest nesting of `{` / `[`, brackets inside strings not counted.
    depth: usize,
    /// A `\\uD800`–`\\uDFFF` escape, or a number with an exponent or of 300+ digits: what
    /// a full reading may refuse.
    needs_full_reading: bool,
}

fn scan(b: &[u8]) -> Scan {
    let (mut depth, mut digits) = (0usize, 0usize);
    let mut out = Scan::default();
    let mut prev = 0u8;
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'"' {
            // A string: jump from escape to escape to its closing quote.
            i += 1;
            loop {
                let Some(k) = memchr::memchr2(b'"', b'\\', &b[i.min(b.len())..]) else {
                    return out;
                };
                i += k;
                if b[i] == b'"' {
                    break;
                }
                if matches!(b.get(i + 1), Some(b'u' | b'U')) {
                    let surrogate = matches!(b.get(i + 2), Some(b'd' | b'D'))
                        && matches!(b.get(i + 3), Some(b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F'));
                    out.needs_full_reading |= surrogate;
                }
                i += 2;
            }
            digits = 0;
            prev = c;
            i += 1;
            continue;
        }
        if c.is_ascii_digit() {
            digits += 1;
            out.needs_full_reading |= digits >= 300;
        } else {
            let exponent = (c == b'e' || c == b'E') && (prev.is_ascii_digit() || prev == b'.');
            out.needs_full_reading |= exponent;
            digits = 0;
        }
        match c {
            b'{' | b'[' => {
                depth += 1;
                out.depth = out.depth.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        prev = c;
        i += 1;
    }
    out
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
    record(span, "outcome", outcome);
    record(span, "http.response.status_code", status);
    if status >= 500 || status == 0 {
        record(span, "otel.status_code", "ERROR");
    }
}

/// Records `value` as field `field` of `span`. A disabled span's fields go nowhere once a
/// subscriber is set (before one is, `tracing` may hand them to `log`), yet recording one
/// still looks the field up by name among the span's: skipped then.
fn record(span: &Span, field: &str, value: impl tracing::field::Value) {
    if !span.is_disabled() || !tracing::dispatcher::has_been_set() {
        span.record(field, value);
    }
}

/// Metrics and the span of a request that ended in an error.
fn account_error(gw: &Gateway, ctx: &RequestCtx, e: &GatewayError) {
    let code = e.code().as_str();
    let status = e.status();
    if status == http::StatusCode::TOO_MANY_REQUESTS
        || status == http::StatusCode::SERVICE_UNAVAILABLE
    {
        gw.metrics().reject(&ctx.tier, code);
    }
    gw.metrics().request(&ctx.tenant, &ctx.model, code);
    record_end(&ctx.span, code, e.status().as_u16());
    // A refusal (429, 503) is counted in levee_rejected_total above, not logged: under a
    // flood or an outage a line each would drown the log.
    let refusal = status == http::StatusCode::TOO_MANY_REQUESTS
        || status == http::StatusCode::SERVICE_UNAVAILABLE;
    if e.origin() == crate::error::Origin::Upstream && !refusal {
        tracing::warn!(tenant = %ctx.tenant, model = %ctx.model, "{e}");
    } else {
        tracing::debug!(tenant = %ctx.tenant, model = %ctx.model, "{e}");
    }
}

/// The request log line of a request that ended in an error.
fn log_error(rt: &Runtime, ctx: &RequestCtx, e: &GatewayError) {
    if let Some(id) = &ctx.request {
        RequestLine {
            request_id: id.as_str(),
            tenant: &ctx.tenant,
            tier: &ctx.tier,
            model: &ctx.model,
            backend: None,
            client: id.peer,
            outcome: e.code().as_str(),
            status: e.status().as_u16(),
            code: Some(e.code().as_str()),
            queue_ms: None,
            ttft_ms: None,
            duration_ms: ms(ctx.arrived.elapsed()),
            prompt_tokens: None,
            completion_tokens: None,
        }
        .emit(id.seq, rt.cfg.observe.request_log_sample);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[tokio::test]
    async fn future_sizes() {
        // Each queued request holds one of these; keep them small (see BENCHMARKS.md).
        let gw = Gateway::new(crate::Config::default()).unwrap();
        let req = Box::new(Request::new(axum::body::Body::empty()));
        let peer = "127.0.0.1:1".parse().unwrap();
        let arrival = Arrival::new(&gw, RequestId::for_request(&HeaderMap::new(), Some(peer)));
        let rt = gw.runtime();
        let f = serve_client(gw, rt, arrival, req, "/v1/chat/completions", None);
        let size = std::mem::size_of_val(&f);
        eprintln!("serve_client future: {size} bytes");
        // 424 bytes with rustc 1.95. What a request allocates is this future with the
        // connection's wrappers: `routes`' test `the_direct_future_fits_its_size_class`
        // holds that to the allocator's size class.
        assert!(size <= 512, "{size}");
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

    /// The scan as it was first written, a byte at a time: the reference the jumping one is
    /// held to.
    fn scan_bytewise(b: &[u8]) -> Scan {
        let (mut depth, mut in_str, mut escaped, mut digits) = (0usize, false, false, 0usize);
        let mut out = Scan::default();
        let mut prev = 0u8;
        for (i, &c) in b.iter().enumerate() {
            if in_str {
                match (escaped, c) {
                    (true, b'u' | b'U') => {
                        escaped = false;
                        let surrogate = matches!(b.get(i + 1), Some(b'd' | b'D'))
                            && matches!(
                                b.get(i + 2),
                                Some(b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F')
                            );
                        out.needs_full_reading |= surrogate;
                    }
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_str = false,
                    _ => {}
                }
                continue;
            }
            if c.is_ascii_digit() {
                digits += 1;
                out.needs_full_reading |= digits >= 300;
            } else {
                let exponent = (c == b'e' || c == b'E') && (prev.is_ascii_digit() || prev == b'.');
                out.needs_full_reading |= exponent;
                digits = 0;
            }
            match c {
                b'"' => in_str = true,
                b'{' | b'[' => {
                    depth += 1;
                    out.depth = out.depth.max(depth);
                }
                b'}' | b']' => depth = depth.saturating_sub(1),
                _ => {}
            }
            prev = c;
        }
        out
    }

    proptest::proptest! {
        /// The scan that jumps through strings finds what the byte-at-a-time one finds, on
        /// texts made of JSON's structural bytes, escapes, digits and exponents.
        #[test]
        fn the_jumping_scan_finds_what_the_bytewise_one_does(
            parts in proptest::collection::vec(proptest::sample::select(vec![
                "\"", "\\", "\\u", "d8", "DA", "dc", "00", "{", "}", "[", "]", "1", "123",
                "e", "E", ".", "5e3", "a", " ", ":", ",", "\\\"", "\\\\", "\u{e9}",
            ]), 0..60),
            long in 0usize..3,
        ) {
            let mut text: String = parts.concat();
            if long == 1 {
                text.push_str(&"7".repeat(301));
            }
            proptest::prop_assert_eq!(scan(text.as_bytes()), scan_bytewise(text.as_bytes()));
        }
    }
}
