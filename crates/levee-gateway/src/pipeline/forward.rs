//! Proxy: send upstream (once more to another backend if the first failed before anything
//! reached the client), then stream or buffer the answer back. The request's settlement
//! travels with the response body and runs when it ends.

use super::classify::Classified;
use super::settle::RequestSettle;
use crate::conn_pool::Lease;
use crate::error::{ErrorCode, GatewayError};
use crate::gateway::Gateway;
use crate::lane::Lane;
use crate::lane::{rate_info, Admitted};
use crate::proxy::{self, Settlement, StreamLimits};
use crate::runtime::{Runtime, Tenant};
use crate::upstream::{advised_retry, Backend, Verdict};
use axum::response::Response;
use http::{HeaderMap, HeaderValue};
use hyper::body::Incoming;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The proxy phase.
pub(super) async fn forward(
    gw: &Arc<Gateway>,
    rt: &Runtime,
    tenant: Arc<Tenant>,
    c: Classified,
    mut admitted: Admitted,
    backend: Arc<Backend>,
    path: &'static str,
) -> Result<Response, GatewayError> {
    // With `strip_usage`, levee asks for the usage chunk so tokens can be reconciled; it is
    // removed on the way back because this client did not ask for it.
    let strip_usage = c.parsed.stream && !c.parsed.client_wants_usage;
    // The deadline starts at dispatch: the gateway's own queue wait is not the backend's.
    let request_timeout = Duration::from_millis(rt.cfg.server.request_timeout_ms);
    let dispatched = Instant::now();
    let sent = send_with_one_resend(gw, rt, &c, &mut admitted, backend, path, strip_usage).await?;
    let Sent {
        resp,
        ahead,
        lease,
        sent_at,
        backend,
        judged,
    } = sent;
    let backend_id = backend.id.clone();
    super::record(&c.span, "backend", &*backend_id);
    let extra = answer_headers(gw, &tenant, &c, &admitted, &resp, &backend);
    let settle = RequestSettle {
        gw: gw.clone(),
        queued: admitted.waited,
        sent_at,
        admitted: Some(admitted),
        backend,
        tenant,
        model: c.target.name.clone(),
        lane: c.lane.clone(),
        prompt_estimate: c.prompt_estimate,
        prompt_kind: c.prompt_kind,
        outlier: rt.cfg.outlier.clone(),
        judged,
        request: c.request.clone(),
        log_sample: rt.cfg.observe.request_log_sample,
        span: c.span.clone(),
    };
    let mut settlement = Settlement::new(Box::new(settle));
    settlement.keep_alive(lease);
    if c.parsed.stream && resp.status().is_success() {
        let total = Duration::from_millis(rt.cfg.server.stream_timeout_ms);
        let limits = StreamLimits {
            idle: Duration::from_millis(rt.cfg.server.stream_idle_timeout_ms),
            deadline: dispatched + total,
            total,
        };
        Ok(proxy::stream_response(
            (resp, ahead),
            settlement,
            strip_usage,
            sent_at,
            limits,
            &backend_id,
            &extra,
        ))
    } else {
        let keep = super::cached::keeper(gw, &c);
        Box::pin(proxy::finish_buffered(
            (resp, ahead),
            settlement,
            sent_at + request_timeout,
            sent_at,
            &extra,
            rt.cfg.server.max_response_bytes,
            keep,
        ))
        .await
    }
}

/// The backend's answer head, when it was sent, by whom, and whether its outcome already
/// went to outlier ejection.
struct Sent {
    resp: http::Response<hyper::body::Incoming>,
    /// What of its body was read before the head went on ([`send_unless_cut`]).
    ahead: proxy::ReadAhead,
    /// The connection it came on.
    lease: Lease,
    sent_at: Instant,
    backend: Arc<Backend>,
    judged: bool,
}

/// Sends the request; if the backend failed (or refused) before anything reached the
/// client, sends it once more to another backend with room, within its deadline.
async fn send_with_one_resend(
    gw: &Gateway,
    rt: &Runtime,
    c: &Classified,
    admitted: &mut Admitted,
    mut backend: Arc<Backend>,
    path: &'static str,
    strip_usage: bool,
) -> Result<Sent, GatewayError> {
    let request_timeout = Duration::from_millis(rt.cfg.server.request_timeout_ms);
    let outlier = &rt.cfg.outlier;
    let mut resent = false;
    loop {
        let upstream_model = backend.upstream_model.as_deref().unwrap_or(&c.target.name);
        // A backend that cancels only streams is asked for one, read whole here.
        let whole = !c.parsed.stream && backend.cancels_only_streams();
        let upstream_body = c
            .parsed
            .upstream_body(upstream_model, c.cap, strip_usage || whole)?;
        let sent_at = Instant::now();
        admitted.mark_sent();
        let send = Box::pin(proxy::send(
            gw.connector(),
            &backend,
            path,
            upstream_body,
            sent_at + request_timeout,
            c.request.as_deref(),
        ));
        // Cut short: the send was dropped (the upstream request aborted) before the wait.
        let whole = whole.then_some(Whole {
            deadline: sent_at + request_timeout,
            sent_at,
            max_bytes: rt.cfg.server.max_response_bytes,
        });
        let Some(sent) = send_unless_cut(rt, c, admitted, send, whole).await else {
            backend = requeue(rt, c, admitted).await?;
            continue;
        };
        let verdict = match &sent {
            Ok(((r, _), _)) => {
                admitted.answered();
                // Only backpressure has a Retry-After worth reading.
                let status = r.status();
                let advised = (status == http::StatusCode::TOO_MANY_REQUESTS
                    || status == http::StatusCode::SERVICE_UNAVAILABLE)
                    .then(|| advised_retry(r.headers()))
                    .flatten();
                Verdict::of_response(status, advised, backend.is_routable(), outlier)
            }
            // Nothing listens: the request never reached the backend.
            Err(e) if e.code() == ErrorCode::UpstreamUnreachable => {
                Verdict::Unavailable { advised: None }
            }
            Err(_) => Verdict::Failure,
        };
        let retry = !resent && verdict.worth_another_backend();
        if retry && sent_at.elapsed() < request_timeout {
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
            return finish_send(sent, admitted, sent_at, backend, true);
        }
        if sent.is_err() {
            eject_if_due(gw, &c.lane, &backend, verdict, outlier);
        }
        return finish_send(sent, admitted, sent_at, backend, false);
    }
}

/// A stream to read whole in place of a non-streamed answer: by when, and how much of it.
struct Whole {
    deadline: Instant,
    sent_at: Instant,
    max_bytes: usize,
}

/// Awaits `send` — unless the request is cut short first (`None`; dropping the send aborts
/// the upstream request). A stream that may still be cut short keeps its answer from the
/// client until its first event (engines send it once the prompt is prefilled; some send
/// the head before), which comes back with the head. With `whole`, a stream asked for in
/// place of a non-streamed answer is read to its end here, still cut short if it must be.
async fn send_unless_cut(
    rt: &Runtime,
    c: &Classified,
    admitted: &Admitted,
    send: impl std::future::Future<Output = Result<(http::Response<Incoming>, Lease), GatewayError>>,
    whole: Option<Whole>,
) -> Option<Result<(proxy::Answer, Lease), GatewayError>> {
    let cut = admitted.cut_signal();
    let (resp, lease) = match unless_cut(cut.as_deref(), send).await? {
        Ok(sent) => sent,
        Err(e) => return Some(Err(e)),
    };
    let (parts, mut body) = resp.into_parts();
    let resp = http::Response::from_parts(parts, ());
    let ahead = match whole {
        Some(w) if proxy::is_event_stream(&resp) => {
            let read = proxy::read_whole_stream(&mut body, w.deadline, w.sent_at, w.max_bytes);
            match unless_cut(cut.as_deref(), read).await? {
                Ok(whole) => proxy::ReadAhead::Whole(whole),
                Err(e) => return Some(Err(e)),
            }
        }
        _ if cut.is_some() && c.parsed.stream && resp.status().is_success() => {
            let idle = Duration::from_millis(rt.cfg.server.stream_idle_timeout_ms);
            proxy::ReadAhead::First(
                unless_cut(cut.as_deref(), proxy::first_frame(&mut body, idle)).await?,
            )
        }
        _ => proxy::ReadAhead::Nothing,
    };
    Some(Ok(((resp.map(|()| body), ahead), lease)))
}

/// Awaits `f` unless `cut` is notified first (`None`: `f` is dropped).
async fn unless_cut<F: std::future::Future>(cut: Option<&Notify>, f: F) -> Option<F::Output> {
    let Some(cut) = cut else {
        return Some(f.await);
    };
    tokio::select! {
        out = f => Some(out),
        () = cut.notified() => None,
    }
}

/// Cut short for a tenant under its fair share before its answer started: queued again,
/// then sent to the backend it is placed on next.
async fn requeue(
    rt: &Runtime,
    c: &Classified,
    admitted: &mut Admitted,
) -> Result<Arc<Backend>, GatewayError> {
    let priority = admitted.priority().unwrap_or(0);
    let tier = rt
        .tier_names()
        .get(usize::from(priority))
        .cloned()
        .unwrap_or_else(|| format!("priority{priority}"));
    tracing::debug!(model = %c.target.name, "cut short for a tenant under its share; queued again");
    let wait = admitted.requeue(&tier)?;
    let mut next = Box::pin(wait.wait(&c.lane, None)).await?;
    next.take_over(admitted);
    *admitted = next;
    admitted
        .backend()
        .ok_or_else(|| GatewayError::no_healthy_backend(&c.target.name, Duration::from_secs(1)))
}

/// The answer of the last send. A request that never reached its backend is refunded when
/// its admission drops; one that did keeps its charges.
fn finish_send(
    sent: Result<(proxy::Answer, Lease), GatewayError>,
    admitted: &mut Admitted,
    sent_at: Instant,
    backend: Arc<Backend>,
    judged: bool,
) -> Result<Sent, GatewayError> {
    match sent {
        Ok(((resp, ahead), lease)) => Ok(Sent {
            resp,
            ahead,
            lease,
            sent_at,
            backend,
            judged,
        }),
        Err(e) => {
            if e.code() == ErrorCode::UpstreamUnreachable {
                admitted.never_reached();
            }
            Err(e)
        }
    }
}

/// The headers levee adds to a backend's answer. A backend's own refusal (429, or 503)
/// is not levee's: it carries no `x-ratelimit-*` figures of levee's (the tenant's quota
/// did not refuse it), and a `Retry-After` from the fleet's state
/// ([`fleet_retry_after`]) instead of the backend's, which spoke only for itself.
fn answer_headers(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    admitted: &Admitted,
    resp: &http::Response<hyper::body::Incoming>,
    backend: &Backend,
) -> HeaderMap {
    const RETRY_AFTER_MS: http::HeaderName = http::HeaderName::from_static("retry-after-ms");
    let status = resp.status();
    let refused = status == http::StatusCode::TOO_MANY_REQUESTS
        || status == http::StatusCode::SERVICE_UNAVAILABLE;
    let mut extra = response_headers(gw, tenant, c, admitted, !refused);
    if refused {
        let wait = fleet_retry_after(gw, &c.lane, backend, advised_retry(resp.headers()));
        extra.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from(crate::error::retry_after_secs(wait)),
        );
        extra.insert(
            RETRY_AFTER_MS,
            HeaderValue::from(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)),
        );
    }
    extra
}

/// When a client the backends refused may come back: the soonest any backend of the
/// lane is in routing again (the one that answered counted out for at least its own
/// Retry-After), at least a second.
pub(super) fn fleet_retry_after(
    gw: &Gateway,
    lane: &Lane,
    answered: &Backend,
    advised: Option<Duration>,
) -> Duration {
    let now = gw.now();
    let out_for = |b: &Backend| {
        b.ejected_until(now)
            .map_or(Duration::ZERO, |u| u.saturating_duration_since(now))
    };
    let soonest = lane
        .backends()
        .iter()
        .filter(|b| b.is_routable() || b.key == answered.key)
        .map(|b| {
            if b.key == answered.key {
                out_for(b).max(advised.unwrap_or(Duration::ZERO))
            } else {
                out_for(b)
            }
        })
        .min()
        .unwrap_or(Duration::ZERO);
    soonest.max(Duration::from_secs(1))
}

/// The headers levee adds to a served response: queue wait, degradation, and (`rate`)
/// the tenant's rate-limit figures.
fn response_headers(
    gw: &Gateway,
    tenant: &Tenant,
    c: &Classified,
    admitted: &Admitted,
    rate: bool,
) -> HeaderMap {
    const QUEUE_MS: http::HeaderName = http::HeaderName::from_static("x-levee-queue-ms");
    const DEGRADED: http::HeaderName = http::HeaderName::from_static("x-levee-degraded");
    let mut extra = HeaderMap::new();
    if admitted.waited > Duration::ZERO {
        let ms = u64::try_from(admitted.waited.as_millis()).unwrap_or(u64::MAX);
        extra.insert(QUEUE_MS, HeaderValue::from(ms));
    }
    if !c.degraded.is_empty() {
        if let Ok(v) = HeaderValue::from_str(&c.degraded.join(", ")) {
            extra.insert(DEGRADED, v);
        }
    }
    if !rate {
        return extra;
    }
    let mut rate = gw.limits().rate_limit_headers(&tenant.name, gw.now());
    if let Some(f) = admitted.shared_figures() {
        rate.requests = f.requests;
        rate.tokens = f.tokens;
    }
    let info = rate_info(&rate);
    gw.metrics().limiter_remaining_for(
        &tenant.metrics,
        &tenant.name,
        info.remaining_requests,
        info.remaining_tokens,
    );
    info.write_headers(&mut extra);
    extra
}

/// Feeds a verdict to the backend's outlier ejection; an ejection holds the backend's breaker
/// open for its length, so it leaves routing at once and comes back through probes.
pub(super) fn eject_if_due(
    gw: &Gateway,
    lane: &Lane,
    backend: &Backend,
    verdict: Verdict,
    outlier: &crate::config::OutlierConfig,
) {
    if let Some(until) = backend.observe(verdict, gw.now(), outlier) {
        lane.eject(&backend.key, until);
    }
}
