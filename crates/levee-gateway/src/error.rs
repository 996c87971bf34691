//! One error type for every refusal and failure the gateway answers with.
//!
//! Each error knows where it came from ([`Origin`]: the client, the gateway itself, or an
//! upstream backend), which HTTP status and OpenAI `code` it maps to, and — for refusals
//! that a retry can cure — when to come back. [`GatewayError::into_response`] renders the
//! OpenAI error JSON and the `Retry-After` / `x-ratelimit-*` headers every refusal carries.

use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use std::time::Duration;

/// Where a failure came from. Clients and operators read it from logs and metrics; it also
/// says whether retrying the same request can help (see [`GatewayError::retryable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The request itself is wrong (bad JSON, bad key, unknown model, over quota).
    Client,
    /// The gateway refused to protect capacity (queue full, queue timeout, draining).
    Gateway,
    /// A backend failed or none could take the request.
    Upstream,
}

impl Origin {
    /// Label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Client => "client",
            Origin::Gateway => "gateway",
            Origin::Upstream => "upstream",
        }
    }
}

/// OpenAI-style rate-limit figures for the `x-ratelimit-*` headers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RateInfo {
    /// `x-ratelimit-limit-requests`.
    pub limit_requests: Option<u64>,
    /// `x-ratelimit-remaining-requests`.
    pub remaining_requests: Option<u64>,
    /// `x-ratelimit-reset-requests`: time until the request budget is full again.
    pub reset_requests: Option<Duration>,
    /// `x-ratelimit-limit-tokens`.
    pub limit_tokens: Option<u64>,
    /// `x-ratelimit-remaining-tokens`.
    pub remaining_tokens: Option<u64>,
    /// `x-ratelimit-reset-tokens`.
    pub reset_tokens: Option<Duration>,
}

impl RateInfo {
    /// Writes the six OpenAI headers (those that are known).
    pub fn write_headers(&self, h: &mut HeaderMap) {
        fn put(h: &mut HeaderMap, name: &'static str, v: String) {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(HeaderName::from_static(name), v);
            }
        }
        if let Some(v) = self.limit_requests {
            put(h, "x-ratelimit-limit-requests", v.to_string());
        }
        if let Some(v) = self.remaining_requests {
            put(h, "x-ratelimit-remaining-requests", v.to_string());
        }
        if let Some(v) = self.reset_requests {
            put(h, "x-ratelimit-reset-requests", openai_duration(v));
        }
        if let Some(v) = self.limit_tokens {
            put(h, "x-ratelimit-limit-tokens", v.to_string());
        }
        if let Some(v) = self.remaining_tokens {
            put(h, "x-ratelimit-remaining-tokens", v.to_string());
        }
        if let Some(v) = self.reset_tokens {
            put(h, "x-ratelimit-reset-tokens", openai_duration(v));
        }
    }
}

/// Formats a duration the way OpenAI's reset headers do: `20ms`, `1s`, `6m0s`, `1h2m3s`.
pub fn openai_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    // Round up to whole seconds: a client that waits this long must find budget.
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

/// Every way a request can fail at or behind the gateway.
#[derive(Debug, Clone)]
pub struct GatewayError {
    /// Where it came from.
    pub origin: Origin,
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI `error.type`.
    pub kind: &'static str,
    /// OpenAI `error.code` (ours: `rate_limit_exceeded`, `capacity_overload`, ...).
    pub code: &'static str,
    /// Human-readable message: what failed and what to do.
    pub message: String,
    /// OpenAI `error.param`: the request field at fault, if any.
    pub param: Option<&'static str>,
    /// When a retry may succeed (sets `Retry-After` and `retry-after-ms`).
    pub retry_after: Option<Duration>,
    /// Rate-limit figures for the `x-ratelimit-*` headers (boxed: most errors have none,
    /// and a small error keeps every `Result` on the request path small).
    pub rate: Option<Box<RateInfo>>,
    /// The admission decision behind a refusal (typed: callers branch on it, not on
    /// `code`).
    pub refusal: Option<levee_policy::RefusalReason>,
    /// The place in the queue the request had or would have had (`x-levee-queue-position`).
    pub position: Option<u32>,
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} error {} ({}): {}",
            self.origin.as_str(),
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for GatewayError {}

impl GatewayError {
    fn new(
        origin: Origin,
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        GatewayError {
            origin,
            status,
            kind,
            code,
            message: message.into(),
            param: None,
            retry_after: None,
            rate: None,
            refusal: None,
            position: None,
        }
    }

    /// Records the admission decision behind this error.
    pub fn with_refusal(mut self, r: levee_policy::RefusalReason) -> Self {
        self.refusal = Some(r);
        self
    }

    /// Records the request's place in the queue.
    pub fn with_position(mut self, p: u32) -> Self {
        self.position = Some(p);
        self
    }

    /// 400 `context_length_exceeded`: prompt + completion budget longer than the model's
    /// context (or than any backend's KV cache).
    pub fn context_length_exceeded(message: impl Into<String>) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "context_length_exceeded",
            message,
        )
        .with_param("messages")
    }

    /// Whether the same request may succeed later without change.
    pub fn retryable(&self) -> bool {
        self.status == StatusCode::TOO_MANY_REQUESTS || self.status.is_server_error()
    }

    /// Sets `error.param`.
    pub fn with_param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
        self
    }

    /// Sets the Retry-After hint.
    pub fn with_retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// Sets the rate-limit headers.
    pub fn with_rate(mut self, r: RateInfo) -> Self {
        self.rate = Some(Box::new(r));
        self
    }

    /// 400: the body is not the JSON we need.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            message,
        )
    }

    /// 413: body over `server.max_body_bytes`.
    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("request body is larger than {limit} bytes; send a smaller request"),
        )
    }

    /// 404: the model is not configured.
    pub fn unknown_model(model: &str) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("the model {model:?} does not exist; GET /v1/models lists the models"),
        )
        .with_param("model")
    }

    /// 404 for a path the gateway does not serve.
    pub fn not_found(path: &str) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            format!("no route for {path}"),
        )
    }

    /// 404 `task_not_found`: no task with this id belongs to the caller (another tenant's
    /// task is answered the same way, so ids reveal nothing).
    pub fn task_not_found(id: &str) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "task_not_found",
            format!("no task {id:?} for this API key (finished tasks are removed after the retention period)"),
        )
    }

    /// 401: no key, or a key no tenant owns.
    pub fn unauthorized(missing: bool) -> Self {
        let msg = if missing {
            "missing API key: send `Authorization: Bearer <key>`"
        } else {
            "invalid API key"
        };
        Self::new(
            Origin::Client,
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            msg,
        )
    }

    /// 401 on the admin listener: no admin token, or a wrong one.
    pub fn admin_unauthorized(missing: bool) -> Self {
        let msg = if missing {
            "admin routes need the admin token: send `Authorization: Bearer <token>` \
             (the value of LEVEE_ADMIN_TOKEN)"
        } else {
            "wrong admin token: send the value of LEVEE_ADMIN_TOKEN as `Authorization: Bearer <token>`"
        };
        Self::new(
            Origin::Client,
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_admin_token",
            msg,
        )
    }

    /// 403: an admin action on a non-loopback admin listener that has no token.
    pub fn admin_actions_disabled(bound: std::net::SocketAddr) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::FORBIDDEN,
            "permission_error",
            "admin_actions_disabled",
            format!(
                "admin actions are refused: the admin listener is bound to {bound}, not \
                 loopback, and no admin token is set; set LEVEE_ADMIN_TOKEN (or \
                 admin.token_sha256) and restart, or bind the admin listener to 127.0.0.1"
            ),
        )
    }

    /// 429 `rate_limit_exceeded`: a quota (tenant, model, global, heavy or per-IP).
    pub fn rate_limited(scope: &str, retry_after: Duration, rate: RateInfo) -> Self {
        Self::new(
            Origin::Client,
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "rate_limit_exceeded",
            format!(
                "rate limit exceeded ({scope}); retry after {} ms",
                retry_after.as_millis()
            ),
        )
        .with_retry_after(retry_after)
        .with_rate(rate)
    }

    /// 429 `capacity_overload`: the queue is at its hard watermark, or the tier is shed.
    pub fn capacity_overload(why: &str, retry_after: Duration) -> Self {
        Self::new(
            Origin::Gateway,
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "capacity_overload",
            format!("the service is over capacity ({why}); retry later"),
        )
        .with_retry_after(retry_after)
    }

    /// 429 `capacity_overload`: it was queued, and when the queue was full a tenant of its
    /// tier with fewer requests waiting took its place.
    pub fn displaced(retry_after: Duration) -> Self {
        Self::capacity_overload(
            "the queue was full, and a tenant with fewer requests waiting took this one's place",
            retry_after,
        )
    }

    /// 429 `queue_timeout`: waited past the tier's budget or the request deadline.
    pub fn queue_timeout(waited: Duration, retry_after: Duration) -> Self {
        Self::new(
            Origin::Gateway,
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_timeout",
            format!(
                "waited {} ms in the queue without a free backend; retry later",
                waited.as_millis()
            ),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `circuit_open`: every backend of the model has its breaker open.
    pub fn circuit_open(model: &str, retry_after: Duration) -> Self {
        Self::new(
            Origin::Upstream,
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "circuit_open",
            format!("every backend for {model:?} is failing (circuit open); retry later"),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `no_healthy_backend`: no backend of the model is reachable.
    pub fn no_healthy_backend(model: &str, retry_after: Duration) -> Self {
        Self::new(
            Origin::Upstream,
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "no_healthy_backend",
            format!("no healthy backend for {model:?}; retry later"),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `shared_state_unavailable`: the shared limit store did not answer and the
    /// gateway is configured `fail_closed`.
    pub fn shared_state_unavailable(why: &str, retry_after: Duration) -> Self {
        Self::new(
            Origin::Gateway,
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "shared_state_unavailable",
            format!(
                "the shared limit store is unavailable ({why}) and this gateway is configured \
                 to refuse rather than decide limits alone ([state] on_failure = \"fail_closed\"); \
                 retry later"
            ),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `task_store_unavailable`: the task store failed (`why` says how); nothing was
    /// changed.
    pub fn task_store_unavailable(why: &str) -> Self {
        Self::new(
            Origin::Gateway,
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "task_store_unavailable",
            format!("{why}; the task was not stored or changed, retry shortly"),
        )
        .with_retry_after(Duration::from_secs(1))
    }

    /// 503 while draining or shutting down.
    pub fn draining(retry_after: Duration) -> Self {
        Self::new(
            Origin::Gateway,
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "draining",
            "this gateway is draining; retry (another replica will answer)",
        )
        .with_retry_after(retry_after)
    }

    /// 502: the backend failed mid-request (connection error, bad response).
    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(
            Origin::Upstream,
            StatusCode::BAD_GATEWAY,
            "server_error",
            "upstream_error",
            message,
        )
    }

    /// 502 `upstream_unreachable`: the connection to the backend could not be made, so the
    /// request never reached it (safe to send elsewhere).
    pub fn upstream_unreachable(message: impl Into<String>) -> Self {
        Self::new(
            Origin::Upstream,
            StatusCode::BAD_GATEWAY,
            "server_error",
            "upstream_unreachable",
            message,
        )
    }

    /// 504: the request passed its deadline waiting for the backend.
    pub fn upstream_timeout(after: Duration) -> Self {
        Self::new(
            Origin::Upstream,
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            "upstream_timeout",
            format!("the backend did not answer within {} ms", after.as_millis()),
        )
    }

    /// `stream_broken`: the backend's stream broke off mid-answer (connection reset, a
    /// malformed body). Sent to the client as an SSE error event, since the response head
    /// already went out; the status applies only where a head has not.
    pub fn stream_broken(message: impl Into<String>) -> Self {
        Self::new(
            Origin::Upstream,
            StatusCode::BAD_GATEWAY,
            "server_error",
            "stream_broken",
            message,
        )
    }

    /// `stream_idle_timeout`: the backend sent nothing for `idle` in the middle of a stream.
    pub fn stream_idle_timeout(idle: Duration) -> Self {
        Self::new(
            Origin::Upstream,
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            "stream_idle_timeout",
            format!(
                "the backend sent nothing for {} ms mid-stream; the answer is incomplete, retry the request",
                idle.as_millis()
            ),
        )
    }

    /// `stream_timeout`: a stream ran past `server.stream_timeout_ms` from dispatch.
    pub fn stream_timeout(limit: Duration) -> Self {
        Self::new(
            Origin::Gateway,
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            "stream_timeout",
            format!(
                "the stream ran past its {} ms limit and was cut; the answer is incomplete, \
                 ask for fewer tokens or retry",
                limit.as_millis()
            ),
        )
    }

    /// 500: a bug in the gateway (a caught panic).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            Origin::Gateway,
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }

    /// The OpenAI error body.
    pub fn body_json(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "code": self.code,
                "param": self.param,
            }
        })
    }

    /// The error as one SSE event (`data: {"error": ...}` and a blank line), the way an
    /// OpenAI stream reports a failure after its response head went out. OpenAI's SDKs
    /// raise it as an API error; a client that ignores it still sees no `[DONE]`.
    pub fn sse_event(&self) -> bytes::Bytes {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(self.body_json().to_string().as_bytes());
        out.extend_from_slice(b"\n\n");
        bytes::Bytes::from(out)
    }
}

/// Whole seconds, rounded up, never 0 for a non-zero wait (clients read 0 as "now").
pub fn retry_after_secs(d: Duration) -> u64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    s.max(1)
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let body = self.body_json().to_string();
        let mut resp = (self.status, body).into_response();
        let h = resp.headers_mut();
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(d) = self.retry_after {
            h.insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(d)),
            );
            // Milliseconds rounded up, so a client honouring it never comes back early.
            let ms = d.as_micros().div_ceil(1000).max(1);
            if let Ok(v) = HeaderValue::from_str(&ms.to_string()) {
                h.insert(HeaderName::from_static("retry-after-ms"), v);
            }
        }
        if let Some(r) = &self.rate {
            r.write_headers(h);
        }
        if let Some(p) = self.position {
            h.insert(
                HeaderName::from_static("x-levee-queue-position"),
                HeaderValue::from(p),
            );
        }
        if self.origin != Origin::Upstream || self.status == StatusCode::SERVICE_UNAVAILABLE {
            h.insert(
                HeaderName::from_static("x-levee-error-origin"),
                HeaderValue::from_static(self.origin.as_str()),
            );
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }

    #[test]
    fn openai_durations() {
        assert_eq!(openai_duration(Duration::from_millis(20)), "20ms");
        assert_eq!(openai_duration(Duration::from_millis(1500)), "2s");
        assert_eq!(openai_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(openai_duration(Duration::from_secs(3723)), "1h2m3s");
    }

    #[test]
    fn error_renders_openai_shape_and_headers() {
        let e = GatewayError::rate_limited(
            "tenant a requests/min",
            Duration::from_millis(1500),
            RateInfo {
                limit_requests: Some(60),
                remaining_requests: Some(0),
                reset_requests: Some(Duration::from_millis(1500)),
                ..RateInfo::default()
            },
        );
        let r = e.clone().into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()["retry-after"], "2");
        assert_eq!(r.headers()["retry-after-ms"], "1500");
        assert_eq!(r.headers()["x-ratelimit-limit-requests"], "60");
        assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "0");
        assert_eq!(r.headers()["x-ratelimit-reset-requests"], "2s");
        let b = e.body_json();
        assert_eq!(b["error"]["code"], "rate_limit_exceeded");
        assert!(b["error"]["param"].is_null());
    }
}
