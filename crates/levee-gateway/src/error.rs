//! One error type for every refusal and failure the gateway answers with.
//!
//! An error is one of the [`ErrorCode`]s; each maps, in one place ([`ErrorCode::spec`]), to
//! where it came from ([`Origin`]: the client, the gateway itself, or an upstream backend),
//! its HTTP status and its OpenAI `type` and `code`. Callers branch on the code, never on a
//! string. A refusal that a retry can cure carries when to come back;
//! [`GatewayError::into_response`] renders the OpenAI error JSON and the `Retry-After` /
//! `x-ratelimit-*` headers every refusal carries.

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
        const LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
        const REMAINING_REQUESTS: HeaderName =
            HeaderName::from_static("x-ratelimit-remaining-requests");
        const RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
        const LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
        const REMAINING_TOKENS: HeaderName =
            HeaderName::from_static("x-ratelimit-remaining-tokens");
        const RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
        let count = |h: &mut HeaderMap, name, v: Option<u64>| {
            if let Some(v) = v {
                h.insert(name, HeaderValue::from(v));
            }
        };
        let reset = |h: &mut HeaderMap, name, v: Option<Duration>| {
            if let Some(v) = v.and_then(|d| HeaderValue::from_str(&openai_duration(d)).ok()) {
                h.insert(name, v);
            }
        };
        count(h, LIMIT_REQUESTS, self.limit_requests);
        count(h, REMAINING_REQUESTS, self.remaining_requests);
        reset(h, RESET_REQUESTS, self.reset_requests);
        count(h, LIMIT_TOKENS, self.limit_tokens);
        count(h, REMAINING_TOKENS, self.remaining_tokens);
        reset(h, RESET_TOKENS, self.reset_tokens);
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

/// What went wrong: the OpenAI `error.code` levee answers with, one variant each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// 400: the request is malformed or asks for something impossible.
    InvalidRequest,
    /// 400: prompt + completion do not fit the model's context or any backend's KV budget.
    ContextLengthExceeded,
    /// 405: the route exists, the method does not.
    MethodNotAllowed,
    /// 413: the body is larger than `server.max_body_bytes`.
    RequestTooLarge,
    /// 415: the body comes compressed (`Content-Encoding`), which levee does not decode.
    UnsupportedContentEncoding,
    /// 404: no such model.
    ModelNotFound,
    /// 404: no such route.
    NotFound,
    /// 404: no such task for this key.
    TaskNotFound,
    /// 401: no API key, or an unknown one.
    InvalidApiKey,
    /// 401: the admin token is missing or wrong.
    InvalidAdminToken,
    /// 403: admin actions are off on this listener.
    AdminActionsDisabled,
    /// 403: an admin request without the token that a browser on another site could have
    /// sent (wrong content type, foreign Origin, or a Host that is not this listener's).
    AdminRequestRefused,
    /// 408: the client did not send its request body in time.
    RequestTimeout,
    /// 429: a tenant's (or the per-IP) quota.
    RateLimitExceeded,
    /// 429: the gateway refuses to protect capacity (watermark, full queue, predicted wait).
    CapacityOverload,
    /// 429: the request waited its whole budget in the queue.
    QueueTimeout,
    /// 429: its time to first token, predicted from its wait and the backends' learned
    /// latency, misses its tier's `ttft_slo_ms` even if it were admitted now.
    SloUnattainable,
    /// 503: every backend of the model is failing.
    CircuitOpen,
    /// 503: no backend of the model is healthy.
    NoHealthyBackend,
    /// 503: the shared limit store is down and the gateway fails closed.
    SharedStateUnavailable,
    /// 503: the task store could not be read or written.
    TaskStoreUnavailable,
    /// 503: this gateway is draining.
    Draining,
    /// 502: the backend answered with something levee cannot pass on.
    UpstreamError,
    /// 502: the backend could not be reached (the request never got there).
    UpstreamUnreachable,
    /// 504: the backend did not answer in time.
    UpstreamTimeout,
    /// The backend's stream broke off mid-answer.
    StreamBroken,
    /// The backend sent nothing for too long mid-stream.
    StreamIdleTimeout,
    /// A stream ran past `server.stream_timeout_ms`.
    StreamTimeout,
    /// A stream's backend had no room in its KV budget to hold more of its answer
    /// (`kv.grow_streams`).
    StreamKvBudget,
    /// 500: a bug in the gateway.
    Internal,
}

impl ErrorCode {
    /// Where it comes from, its HTTP status, and its OpenAI `type` and `code`: the one place
    /// an error kind is mapped (the four functions below, each one match).
    pub fn spec(self) -> (Origin, StatusCode, &'static str, &'static str) {
        (
            self.origin(),
            self.status(),
            self.openai_type(),
            self.as_str(),
        )
    }

    /// The OpenAI `error.code`.
    pub fn as_str(self) -> &'static str {
        use ErrorCode::*;
        match self {
            InvalidRequest => "invalid_request",
            ContextLengthExceeded => "context_length_exceeded",
            MethodNotAllowed => "method_not_allowed",
            RequestTooLarge => "request_too_large",
            UnsupportedContentEncoding => "unsupported_content_encoding",
            ModelNotFound => "model_not_found",
            NotFound => "not_found",
            TaskNotFound => "task_not_found",
            InvalidApiKey => "invalid_api_key",
            InvalidAdminToken => "invalid_admin_token",
            AdminActionsDisabled => "admin_actions_disabled",
            AdminRequestRefused => "admin_request_refused",
            RequestTimeout => "request_timeout",
            RateLimitExceeded => "rate_limit_exceeded",
            CapacityOverload => "capacity_overload",
            QueueTimeout => "queue_timeout",
            SloUnattainable => "slo_unattainable",
            CircuitOpen => "circuit_open",
            NoHealthyBackend => "no_healthy_backend",
            SharedStateUnavailable => "shared_state_unavailable",
            TaskStoreUnavailable => "task_store_unavailable",
            Draining => "draining",
            UpstreamError => "upstream_error",
            UpstreamUnreachable => "upstream_unreachable",
            UpstreamTimeout => "upstream_timeout",
            StreamBroken => "stream_broken",
            StreamIdleTimeout => "stream_idle_timeout",
            StreamTimeout => "stream_timeout",
            StreamKvBudget => "stream_kv_budget",
            Internal => "internal_error",
        }
    }

    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        use ErrorCode::*;
        match self {
            InvalidRequest | ContextLengthExceeded => StatusCode::BAD_REQUEST,
            MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            UnsupportedContentEncoding => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ModelNotFound | NotFound | TaskNotFound => StatusCode::NOT_FOUND,
            InvalidApiKey | InvalidAdminToken => StatusCode::UNAUTHORIZED,
            AdminActionsDisabled | AdminRequestRefused => StatusCode::FORBIDDEN,
            RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            RateLimitExceeded | CapacityOverload | QueueTimeout | SloUnattainable => {
                StatusCode::TOO_MANY_REQUESTS
            }
            CircuitOpen
            | NoHealthyBackend
            | SharedStateUnavailable
            | TaskStoreUnavailable
            | Draining
            | StreamKvBudget => StatusCode::SERVICE_UNAVAILABLE,
            UpstreamError | UpstreamUnreachable | StreamBroken => StatusCode::BAD_GATEWAY,
            UpstreamTimeout | StreamIdleTimeout | StreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Where it comes from (the `x-levee-error-origin` header).
    pub fn origin(self) -> Origin {
        use ErrorCode::*;
        match self {
            CapacityOverload
            | QueueTimeout
            | SloUnattainable
            | SharedStateUnavailable
            | TaskStoreUnavailable
            | Draining
            | StreamTimeout
            | StreamKvBudget
            | Internal => Origin::Gateway,
            CircuitOpen | NoHealthyBackend | UpstreamError | UpstreamUnreachable
            | UpstreamTimeout | StreamBroken | StreamIdleTimeout => Origin::Upstream,
            _ => Origin::Client,
        }
    }

    /// The OpenAI `error.type`.
    pub fn openai_type(self) -> &'static str {
        use ErrorCode::*;
        match self {
            InvalidApiKey | InvalidAdminToken => "authentication_error",
            AdminActionsDisabled | AdminRequestRefused => "permission_error",
            RateLimitExceeded | CapacityOverload | QueueTimeout | SloUnattainable => {
                "rate_limit_error"
            }
            CircuitOpen
            | NoHealthyBackend
            | SharedStateUnavailable
            | TaskStoreUnavailable
            | Draining
            | StreamKvBudget => "service_unavailable",
            UpstreamError | UpstreamUnreachable | UpstreamTimeout | StreamBroken
            | StreamIdleTimeout | StreamTimeout | Internal => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// Whether the gateway refused to protect capacity (what degradation counts).
    pub fn is_capacity_refusal(self) -> bool {
        matches!(
            self,
            ErrorCode::CapacityOverload | ErrorCode::QueueTimeout | ErrorCode::SloUnattainable
        )
    }

    /// Whether sending the same request again, later, may succeed.
    pub fn retryable(self) -> bool {
        let s = self.status();
        s == StatusCode::TOO_MANY_REQUESTS || s.is_server_error()
    }
}

/// Every way a request can fail at or behind the gateway: a code and what the client should
/// know about this occurrence (message, field, when to come back, quota figures).
#[derive(Debug, Clone)]
pub struct GatewayError {
    code: ErrorCode,
    /// What failed and what to do.
    message: String,
    /// OpenAI `error.param`: the request field at fault, if any.
    param: Option<&'static str>,
    /// When a retry may succeed (sets `Retry-After` and `retry-after-ms`).
    retry_after: Option<Duration>,
    /// Rate-limit figures for the `x-ratelimit-*` headers (boxed: most errors have none,
    /// and a small error keeps every `Result` on the request path small).
    rate: Option<Box<RateInfo>>,
    /// The admission decision behind a refusal.
    refusal: Option<levee_policy::RefusalReason>,
    /// The place in the queue the request had or would have had (`x-levee-queue-position`).
    position: Option<u32>,
}

impl std::fmt::Display for GatewayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (origin, status, _, code) = self.code.spec();
        write!(
            f,
            "{} error {} ({code}): {}",
            origin.as_str(),
            status.as_u16(),
            self.message
        )
    }
}

impl std::error::Error for GatewayError {}

impl GatewayError {
    /// An error of `code` saying `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        GatewayError {
            code,
            message: message.into(),
            param: None,
            retry_after: None,
            rate: None,
            refusal: None,
            position: None,
        }
    }

    /// What went wrong.
    pub fn code(&self) -> ErrorCode {
        self.code
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.code.status()
    }

    /// Where it came from.
    pub fn origin(&self) -> Origin {
        self.code.origin()
    }

    /// The request field at fault, if any.
    pub fn param(&self) -> Option<&'static str> {
        self.param
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// When a retry may succeed.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The admission decision behind a refusal.
    pub fn refusal(&self) -> Option<levee_policy::RefusalReason> {
        self.refusal
    }

    /// The place in the queue the request had or would have had.
    pub fn position(&self) -> Option<u32> {
        self.position
    }

    /// Whether sending the same request again, later, may succeed.
    pub fn retryable(&self) -> bool {
        self.code.retryable()
    }

    /// Records the admission decision behind a refusal.
    pub fn with_refusal(mut self, r: levee_policy::RefusalReason) -> Self {
        self.refusal = Some(r);
        self
    }

    /// Records the place in the queue.
    pub fn with_position(mut self, p: u32) -> Self {
        self.position = Some(p);
        self
    }

    /// Names the request field at fault.
    pub fn with_param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
        self
    }

    /// Says when to come back.
    pub fn with_retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// Adds the tenant's quota figures.
    pub fn with_rate(mut self, r: RateInfo) -> Self {
        self.rate = Some(Box::new(r));
        self
    }

    /// Adds a sentence of advice to the message.
    pub fn with_advice(mut self, advice: &str) -> Self {
        self.message.push_str("; ");
        self.message.push_str(advice);
        self
    }

    /// 400 `context_length_exceeded`.
    pub fn context_length_exceeded(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::ContextLengthExceeded, message).with_param("messages")
    }

    /// 400 `invalid_request`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    /// 405 `method_not_allowed`.
    pub fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self::new(
            ErrorCode::MethodNotAllowed,
            format!("method {method} is not allowed on {path}"),
        )
    }

    /// 413 `request_too_large`.
    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            ErrorCode::RequestTooLarge,
            format!("request body is larger than {limit} bytes; send a smaller request"),
        )
    }

    /// 415 `unsupported_content_encoding`.
    pub fn compressed_body(encoding: &str) -> Self {
        Self::new(
            ErrorCode::UnsupportedContentEncoding,
            format!(
                "the request body is sent with content-encoding {encoding:?}, which levee does \
                 not decode; send it uncompressed"
            ),
        )
    }

    /// 404 `model_not_found`.
    pub fn unknown_model(model: &str) -> Self {
        Self::new(
            ErrorCode::ModelNotFound,
            format!("the model {model:?} does not exist; GET /v1/models lists the models"),
        )
        .with_param("model")
    }

    /// 404 `not_found`.
    pub fn not_found(path: &str) -> Self {
        Self::new(ErrorCode::NotFound, format!("no route for {path}"))
    }

    /// 404 `task_not_found`.
    pub fn task_not_found(id: &str) -> Self {
        Self::new(
            ErrorCode::TaskNotFound,
            format!("no task {id:?} for this API key (finished tasks are removed after the retention period)"),
        )
    }

    /// 401 `invalid_api_key`.
    pub fn unauthorized(missing: bool) -> Self {
        let msg = if missing {
            "missing API key: send `Authorization: Bearer <key>`"
        } else {
            "invalid API key"
        };
        Self::new(ErrorCode::InvalidApiKey, msg)
    }

    /// 401 `invalid_admin_token`.
    pub fn admin_unauthorized(missing: bool) -> Self {
        let msg = if missing {
            "admin routes need the admin token: send `Authorization: Bearer <token>` \
             (the value of LEVEE_ADMIN_TOKEN)"
        } else {
            "wrong admin token: send the value of LEVEE_ADMIN_TOKEN as `Authorization: Bearer <token>`"
        };
        Self::new(ErrorCode::InvalidAdminToken, msg)
    }

    /// 403 `admin_actions_disabled`.
    pub fn admin_actions_disabled(bound: std::net::SocketAddr) -> Self {
        Self::new(
            ErrorCode::AdminActionsDisabled,
            format!(
                "admin actions are refused: the admin listener is bound to {bound}, not \
                 loopback, and no admin token is set; set LEVEE_ADMIN_TOKEN (or \
                 admin.token_sha256) and restart, or bind the admin listener to 127.0.0.1"
            ),
        )
    }

    /// 429 `rate_limit_exceeded`: `scope` names the quota.
    pub fn rate_limited(scope: &str, retry_after: Duration, rate: RateInfo) -> Self {
        Self::new(
            ErrorCode::RateLimitExceeded,
            format!(
                "rate limit exceeded ({scope}); retry after {} ms",
                retry_after.as_millis()
            ),
        )
        .with_retry_after(retry_after)
        .with_rate(rate)
    }

    /// 429 `capacity_overload`: `why` says which protection refused.
    pub fn capacity_overload(why: &str, retry_after: Duration) -> Self {
        Self::new(
            ErrorCode::CapacityOverload,
            format!("the service is over capacity ({why}); retry later"),
        )
        .with_retry_after(retry_after)
    }

    /// 429 `slo_unattainable`: the request's predicted time to first token misses its tier's
    /// objective even if it were admitted now.
    pub fn slo_unattainable(model: &str, retry_after: Duration) -> Self {
        Self::new(
            ErrorCode::SloUnattainable,
            format!(
                "the predicted time to first token on {model:?} misses this tier's objective \
                 (ttft_slo_ms) even if the request were admitted now; retry later"
            ),
        )
        .with_retry_after(retry_after)
    }

    /// 429 `capacity_overload`: a peer with less waiting took this request's place.
    pub fn displaced(retry_after: Duration) -> Self {
        Self::capacity_overload(
            "the queue was full, and a tenant with fewer requests waiting took this one's place",
            retry_after,
        )
    }

    /// 429 `queue_timeout`.
    pub fn queue_timeout(waited: Duration, retry_after: Duration) -> Self {
        Self::new(
            ErrorCode::QueueTimeout,
            format!(
                "waited {} ms in the queue without a free backend; retry later",
                waited.as_millis()
            ),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `circuit_open`.
    pub fn circuit_open(model: &str, retry_after: Duration) -> Self {
        Self::new(
            ErrorCode::CircuitOpen,
            format!("every backend for {model:?} is failing (circuit open); retry later"),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `no_healthy_backend`.
    pub fn no_healthy_backend(model: &str, retry_after: Duration) -> Self {
        Self::new(
            ErrorCode::NoHealthyBackend,
            format!("no healthy backend for {model:?}; retry later"),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `shared_state_unavailable`.
    pub fn shared_state_unavailable(why: &str, retry_after: Duration) -> Self {
        Self::new(
            ErrorCode::SharedStateUnavailable,
            format!(
                "the shared limit store is unavailable ({why}) and this gateway is configured \
                 to refuse rather than decide limits alone ([state] on_failure = \"fail_closed\"); \
                 retry later"
            ),
        )
        .with_retry_after(retry_after)
    }

    /// 503 `task_store_unavailable`.
    pub fn task_store_unavailable(why: &str) -> Self {
        Self::new(
            ErrorCode::TaskStoreUnavailable,
            format!("{why}; the task was not stored or changed, retry shortly"),
        )
        .with_retry_after(Duration::from_secs(1))
    }

    /// 503 `draining`.
    pub fn draining(retry_after: Duration) -> Self {
        Self::new(
            ErrorCode::Draining,
            "this gateway is draining; retry (another replica will answer)",
        )
        .with_retry_after(retry_after)
    }

    /// 502 `upstream_error`.
    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::UpstreamError, message)
    }

    /// 502 `upstream_unreachable`: the connection to the backend could not be made, so the
    /// request never reached it (safe to send elsewhere).
    pub fn upstream_unreachable(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::UpstreamUnreachable, message)
    }

    /// 504 `upstream_timeout`: the request passed its deadline waiting for the backend.
    pub fn upstream_timeout(after: Duration) -> Self {
        Self::new(
            ErrorCode::UpstreamTimeout,
            format!("the backend did not answer within {} ms", after.as_millis()),
        )
    }

    /// `stream_broken`: the backend's stream broke off mid-answer (connection reset, a
    /// malformed body). Sent to the client as an SSE error event, since the response head
    /// already went out; the status applies only where a head has not.
    pub fn stream_broken(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::StreamBroken, message)
    }

    /// `stream_kv_budget`: the stream's backend has no room in its KV budget to hold more of
    /// its answer after `generated` tokens.
    pub fn stream_kv_budget(backend: &str, generated: u64) -> Self {
        Self::new(
            ErrorCode::StreamKvBudget,
            format!(
                "backend {backend} has no room in its KV cache budget to hold more of this \
                 answer after {generated} tokens; the answer is incomplete, retry the request \
                 (or send it unstreamed: a non-streamed request holds its whole max_tokens \
                 from the start and waits for room instead)"
            ),
        )
    }

    /// `stream_kv_budget` for a stream whose KV hold went to a stream of a tenant within its
    /// fair share, its own tenant holding more than its share of `backend`'s cache.
    pub fn stream_kv_taken(backend: &str, generated: u64) -> Self {
        Self::new(
            ErrorCode::StreamKvBudget,
            format!(
                "this answer was cut after {generated} tokens: its tenant held more than its \
                 fair share of backend {backend}'s KV cache budget, and a tenant within its \
                 share needed the room; the answer is incomplete, retry the request (or send \
                 it unstreamed: a non-streamed request holds its whole max_tokens from the \
                 start and waits for room instead)"
            ),
        )
    }

    /// `stream_idle_timeout`: the backend sent nothing for `idle` in the middle of a stream.
    pub fn stream_idle_timeout(idle: Duration) -> Self {
        Self::new(
            ErrorCode::StreamIdleTimeout,
            format!(
                "the backend sent nothing for {} ms mid-stream; the answer is incomplete, retry the request",
                idle.as_millis()
            ),
        )
    }

    /// `stream_timeout`: a stream ran past `server.stream_timeout_ms` from dispatch.
    pub fn stream_timeout(limit: Duration) -> Self {
        Self::new(
            ErrorCode::StreamTimeout,
            format!(
                "the stream ran past its {} ms limit and was cut; the answer is incomplete, \
                 ask for fewer tokens or retry",
                limit.as_millis()
            ),
        )
    }

    /// 500 `internal_error`: a bug in the gateway (a caught panic).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    /// The OpenAI error body.
    pub fn body_json(&self) -> serde_json::Value {
        let (_, _, kind, code) = self.code.spec();
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": kind,
                "code": code,
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

/// A panic in a handler becomes an OpenAI-shaped 500 instead of a dropped connection.
pub(crate) fn panic_response(_err: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("handler panicked; answered 500");
    GatewayError::internal("internal error in the gateway").into_response()
}

/// Whole seconds, rounded up, never 0 for a non-zero wait (clients read 0 as "now").
pub fn retry_after_secs(d: Duration) -> u64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    s.max(1)
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let body = self.body_json().to_string();
        let (origin, status, _, _) = self.code.spec();
        let mut resp = (status, body).into_response();
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
        // Which check refused: finer than the code (`capacity_overload` has five), for
        // clients and load tests that tally refusals by cause.
        if let Some(r) = self.refusal {
            h.insert(
                HeaderName::from_static("x-levee-refusal"),
                HeaderValue::from_static(r.label()),
            );
        }
        if origin != Origin::Upstream || status == StatusCode::SERVICE_UNAVAILABLE {
            h.insert(
                HeaderName::from_static("x-levee-error-origin"),
                HeaderValue::from_static(origin.as_str()),
            );
        }
        // The codings that would have been accepted (RFC 9110, 12.5.3): none but the body
        // as it is.
        if self.code == ErrorCode::UnsupportedContentEncoding {
            h.insert(
                http::header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
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

    #[test]
    fn every_code_maps_to_a_distinct_openai_code_of_its_status_class() {
        use ErrorCode::*;
        let all = [
            InvalidRequest,
            ContextLengthExceeded,
            MethodNotAllowed,
            RequestTooLarge,
            UnsupportedContentEncoding,
            ModelNotFound,
            NotFound,
            TaskNotFound,
            InvalidApiKey,
            InvalidAdminToken,
            AdminActionsDisabled,
            AdminRequestRefused,
            RequestTimeout,
            RateLimitExceeded,
            CapacityOverload,
            QueueTimeout,
            SloUnattainable,
            CircuitOpen,
            NoHealthyBackend,
            SharedStateUnavailable,
            TaskStoreUnavailable,
            Draining,
            UpstreamError,
            UpstreamUnreachable,
            UpstreamTimeout,
            StreamBroken,
            StreamIdleTimeout,
            StreamTimeout,
            StreamKvBudget,
            Internal,
        ];
        let codes: std::collections::HashSet<_> = all.iter().map(|c| c.as_str()).collect();
        assert_eq!(codes.len(), all.len(), "two kinds share an OpenAI code");
        for c in all {
            let (origin, status, _, _) = c.spec();
            assert_eq!(
                c.retryable(),
                status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error(),
                "{c:?}"
            );
            if status.is_client_error() && status != StatusCode::TOO_MANY_REQUESTS {
                assert_eq!(origin, Origin::Client, "{c:?}");
            }
        }
        assert!(CapacityOverload.is_capacity_refusal() && QueueTimeout.is_capacity_refusal());
        assert!(
            !RateLimitExceeded.is_capacity_refusal()
                && !ContextLengthExceeded.is_capacity_refusal()
        );
    }
}
