//! Forwarding one admitted request to its backend: non-streaming bodies are read whole
//! (to learn the usage), SSE streams are forwarded chunk by chunk as they arrive.
//!
//! The backend slot and the token reservation travel with the response body inside a
//! [`Settlement`]; when the body finishes — or the client goes away and axum drops the
//! body — the settlement runs exactly once: it frees the slot, reconciles the tokens and
//! feeds the breaker. Dropping the upstream body closes the upstream connection, which is
//! how a client disconnect cancels the GPU work at once.

use crate::config::OutlierConfig;
use crate::error::{ErrorCode, GatewayError};
use crate::tokenize::PromptText;
use crate::upstream::{closed_before_answer, Backend, HttpClient, Verdict};
use axum::body::Body;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http::{HeaderValue, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use std::time::Duration;
use tokio::time::Instant;

/// A client's completion request: the raw body as received (in an allocation of its own,
/// never a view into hyper's connection buffer, so a queued request does not pin that
/// buffer) and the few fields the gateway reads.
///
/// Parsing reads only those fields (everything else is validated and skipped without
/// allocating), and the upstream body is the raw body itself unless something must change
/// (the model name, a `max_tokens` cap, `include_usage`): the common request is forwarded
/// without being re-serialised.
#[derive(Debug)]
pub struct ClientRequest {
    raw: Bytes,
    /// `model`.
    pub model: String,
    /// `stream` (false when absent or null).
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u32>,
    /// `stream_options.include_usage`.
    pub client_wants_usage: bool,
    /// Completions asked for at once: the larger of `n` and `best_of` (1 when absent).
    pub choices: u32,
    /// The body names its cap `max_completion_tokens` (a cap is written under that key).
    has_max_completion_tokens: bool,
    /// The conversation it continues (see [`crate::session::of_conversation`]), when asked
    /// for at parse.
    pub conversation: Option<u64>,
}

/// The top-level fields of a request body the gateway reads; later duplicates win, as with
/// a JSON object parsed into a map.
#[derive(Default)]
struct Head {
    model: Option<serde_json::Value>,
    stream: Option<serde_json::Value>,
    max_tokens: Option<serde_json::Value>,
    max_completion_tokens: Option<serde_json::Value>,
    stream_options: Option<serde_json::Value>,
    messages: Option<serde_json::Value>,
    prompt: Option<serde_json::Value>,
    n: Option<serde_json::Value>,
    best_of: Option<serde_json::Value>,
    /// Tool (and legacy function) definitions: the engine renders them into the prompt.
    tools: Option<serde_json::Value>,
    functions: Option<serde_json::Value>,
}

enum HeadKey {
    Model,
    Stream,
    MaxTokens,
    MaxCompletionTokens,
    StreamOptions,
    Messages,
    Prompt,
    N,
    BestOf,
    Tools,
    Functions,
    Other,
}

impl<'de> Deserialize<'de> for HeadKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = HeadKey;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<HeadKey, E> {
                Ok(match v {
                    "model" => HeadKey::Model,
                    "stream" => HeadKey::Stream,
                    "max_tokens" => HeadKey::MaxTokens,
                    "max_completion_tokens" => HeadKey::MaxCompletionTokens,
                    "stream_options" => HeadKey::StreamOptions,
                    "messages" => HeadKey::Messages,
                    "prompt" => HeadKey::Prompt,
                    "n" => HeadKey::N,
                    "best_of" => HeadKey::BestOf,
                    "tools" => HeadKey::Tools,
                    "functions" => HeadKey::Functions,
                    _ => HeadKey::Other,
                })
            }
        }
        d.deserialize_identifier(V)
    }
}

impl<'de> Deserialize<'de> for Head {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Head;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Head, A::Error> {
                let mut h = Head::default();
                while let Some(k) = m.next_key::<HeadKey>()? {
                    let slot = match k {
                        HeadKey::Model => &mut h.model,
                        HeadKey::Stream => &mut h.stream,
                        HeadKey::MaxTokens => &mut h.max_tokens,
                        HeadKey::MaxCompletionTokens => &mut h.max_completion_tokens,
                        HeadKey::StreamOptions => &mut h.stream_options,
                        HeadKey::Messages => &mut h.messages,
                        HeadKey::Prompt => &mut h.prompt,
                        HeadKey::N => &mut h.n,
                        HeadKey::BestOf => &mut h.best_of,
                        HeadKey::Tools => &mut h.tools,
                        HeadKey::Functions => &mut h.functions,
                        HeadKey::Other => {
                            m.next_value::<serde::de::IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = Some(m.next_value()?);
                }
                Ok(h)
            }
        }
        d.deserialize_map(V)
    }
}

/// The text of a chat message's `content` — a string, or the `text` of its text parts —
/// and how many image parts it has.
fn content_text(content: &serde_json::Value) -> (String, u64) {
    match content {
        serde_json::Value::String(s) => (s.clone(), 0),
        serde_json::Value::Array(parts) => {
            let text = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
                .collect::<Vec<_>>()
                .join("");
            let images = parts
                .iter()
                .filter(|p| {
                    matches!(
                        p.get("type").and_then(|t| t.as_str()),
                        Some("image_url" | "input_image" | "image")
                    )
                })
                .count() as u64;
            (text, images)
        }
        _ => (String::new(), 0),
    }
}

/// One chat message's text: its content, and the name and arguments of each tool (or
/// function) call it makes, which the engine renders into the prompt too.
fn message_text(m: &serde_json::Value) -> (String, u64) {
    let (mut text, images) = m.get("content").map(content_text).unwrap_or_default();
    let calls = m
        .get("tool_calls")
        .and_then(|c| c.as_array())
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("function"))
        .chain(m.get("function_call"));
    for f in calls {
        for key in ["name", "arguments"] {
            if let Some(s) = f.get(key).and_then(|v| v.as_str()) {
                text.push_str(s);
            }
        }
    }
    (text, images)
}

/// The prompt's text: each chat message's content and tool calls, and the tool definitions
/// as their JSON (chat); or each `prompt` string.
fn prompt_text(
    messages: Option<&serde_json::Value>,
    prompt: Option<&serde_json::Value>,
    tools: &[Option<&serde_json::Value>],
) -> PromptText {
    use serde_json::Value;
    if let Some(Value::Array(msgs)) = messages {
        let mut images = 0;
        let parts: Vec<String> = msgs
            .iter()
            .map(|m| {
                let (text, n) = message_text(m);
                images += n;
                text
            })
            .collect();
        let tools: String = tools
            .iter()
            .flatten()
            .filter(|t| !t.is_null())
            .map(|t| t.to_string())
            .collect();
        return PromptText {
            tools: (!tools.is_empty()).then_some(tools),
            parts,
            chat: true,
            token_ids: 0,
            images,
        };
    }
    let mut out = PromptText::default();
    match prompt {
        Some(Value::String(s)) => out.parts.push(s.clone()),
        Some(Value::Array(items)) => {
            for i in items {
                match i {
                    Value::String(s) => out.parts.push(s.clone()),
                    Value::Number(_) => out.token_ids += 1,
                    Value::Array(ids) => out.token_ids += ids.len() as u64,
                    _ => {}
                }
            }
        }
        _ => {}
    }
    out
}

/// `n` or `best_of`: 1 when absent, else a positive integer.
fn choice_count(v: Option<serde_json::Value>, name: &'static str) -> Result<u32, GatewayError> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(1),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n >= 1)
            .ok_or_else(|| {
                GatewayError::bad_request(format!("`{name}` must be a positive integer"))
                    .with_param(name)
            }),
    }
}

impl ClientRequest {
    /// Parses a request body. `raw` should be an allocation of its own (see the type doc).
    /// The prompt's text comes back beside it, to be counted and dropped (a queued request
    /// keeps only its raw body).
    pub fn parse(raw: Bytes) -> Result<(ClientRequest, PromptText), GatewayError> {
        Self::parse_keyed(raw, false)
    }

    /// [`ClientRequest::parse`], also keying the conversation when `conversation` is set.
    pub fn parse_keyed(
        raw: Bytes,
        conversation: bool,
    ) -> Result<(ClientRequest, PromptText), GatewayError> {
        use serde_json::Value;
        let head: Head = serde_json::from_slice(&raw).map_err(|e| {
            if e.classify() == serde_json::error::Category::Data {
                GatewayError::bad_request("request body must be a JSON object")
            } else {
                GatewayError::bad_request(format!("request body is not valid JSON: {e}"))
            }
        })?;
        let model = match head.model {
            Some(Value::String(s)) if !s.is_empty() => s,
            _ => {
                return Err(
                    GatewayError::bad_request("`model` is required and must be a string")
                        .with_param("model"),
                )
            }
        };
        let stream = match head.stream {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(_) => {
                return Err(
                    GatewayError::bad_request("`stream` must be a boolean").with_param("stream")
                )
            }
        };
        let has_max_completion_tokens = head.max_completion_tokens.is_some();
        let max_tokens =
            match head.max_completion_tokens.or(head.max_tokens) {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(
                    || {
                        GatewayError::bad_request("`max_tokens` must be a non-negative integer")
                            .with_param("max_tokens")
                    },
                )?),
            };
        let client_wants_usage = head
            .stream_options
            .as_ref()
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let choices = choice_count(head.n, "n")?.max(choice_count(head.best_of, "best_of")?);
        let prompt = prompt_text(
            head.messages.as_ref(),
            head.prompt.as_ref(),
            &[head.tools.as_ref(), head.functions.as_ref()],
        );
        let conversation = conversation
            .then(|| crate::session::of_conversation(head.messages.as_ref()))
            .flatten();
        Ok((
            ClientRequest {
                raw,
                model,
                stream,
                max_tokens,
                client_wants_usage,
                choices,
                has_max_completion_tokens,
                conversation,
            },
            prompt,
        ))
    }

    /// The prompt as an engine's tokenizer endpoint takes it: a chat's `messages` (and
    /// `tools`), or a completion's `prompt` string; `None` for anything else (a prompt of
    /// token ids, a batch of prompts).
    pub fn prompt_source(&self) -> Option<crate::upstream::PromptSource> {
        use crate::upstream::PromptSource;
        use serde_json::Value;
        #[derive(serde::Deserialize)]
        struct Fields {
            messages: Option<Value>,
            tools: Option<Value>,
            prompt: Option<Value>,
        }
        let f: Fields = serde_json::from_slice(&self.raw).ok()?;
        match (f.messages, f.prompt) {
            (Some(m @ Value::Array(_)), _) => Some(PromptSource::Chat {
                messages: m,
                tools: f.tools.filter(|t| !t.is_null()),
            }),
            (None, Some(Value::String(p))) => Some(PromptSource::Text(p)),
            _ => None,
        }
    }

    /// The body to send upstream: `model` set to `model`, the cap written if `cap` is set,
    /// `stream_options.include_usage` set if `include_usage`. Unchanged bytes (no copy)
    /// when none of these changes anything.
    pub fn upstream_body(
        &self,
        model: &str,
        cap: Option<u32>,
        include_usage: bool,
    ) -> Result<Bytes, GatewayError> {
        use serde_json::{Map, Value};
        if model == self.model && cap.is_none() && !include_usage {
            return Ok(self.raw.clone());
        }
        let mut body: Map<String, Value> = serde_json::from_slice(&self.raw)
            .map_err(|e| GatewayError::internal(format!("cannot re-read the request body: {e}")))?;
        if let Some(m) = cap {
            let key = if self.has_max_completion_tokens {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            body.insert(key.into(), Value::from(m));
        }
        if include_usage {
            let opts = body
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(o) = opts {
                o.insert("include_usage".into(), Value::Bool(true));
            }
        }
        body.insert("model".into(), Value::String(model.to_string()));
        serde_json::to_vec(&body)
            .map(Bytes::from)
            .map_err(|e| GatewayError::internal(format!("cannot encode the upstream request: {e}")))
    }
}

/// Token usage reported by the backend.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Completion tokens.
    #[serde(default)]
    pub completion_tokens: u64,
    /// Total tokens.
    #[serde(default)]
    pub total_tokens: u64,
    /// What the backend says of the prompt (`cached_tokens`), if it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq, serde::Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens found in the engine's prefix cache (their prefill was skipped).
    #[serde(default)]
    pub cached_tokens: u64,
}

impl Usage {
    /// Prompt tokens the engine found in its prefix cache (0 when it does not say).
    pub fn cached_tokens(&self) -> u64 {
        self.prompt_tokens_details
            .map_or(0, |d| d.cached_tokens.min(self.prompt_tokens))
    }

    /// Total, falling back to the sum when a backend omits `total_tokens`.
    pub fn total(&self) -> u64 {
        if self.total_tokens > 0 {
            self.total_tokens
        } else {
            self.prompt_tokens + self.completion_tokens
        }
    }
}

/// How a proxied request ended, as far as the gateway can tell.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    /// Usage from the response, if the backend sent it.
    pub usage: Option<Usage>,
    /// Upstream status (0 if no response arrived).
    pub status: u16,
    /// The backend's advised wait on a 503 (`Retry-After`), for outlier ejection.
    pub advised_retry: Option<Duration>,
    /// Connect error, timeout, or a body that broke off.
    pub transport_error: bool,
    /// The client went away before the response finished.
    pub client_gone: bool,
    /// Time from sending to the first body byte.
    pub ttft: Option<Duration>,
    /// How a stream was cut after its head went out (the code of the SSE error event sent
    /// to the client: `stream_broken`, `stream_idle_timeout`, `stream_timeout`).
    pub stream_cut: Option<&'static str>,
}

impl Outcome {
    /// What this ending says about the backend. `healthy` is the backend's last health
    /// check (see [`Verdict`] for the rule).
    pub fn verdict(&self, healthy: bool, cfg: &OutlierConfig) -> Verdict {
        if self.transport_error || (self.status == 0 && !self.client_gone) {
            return Verdict::Failure;
        }
        if self.status == 0 || self.stream_cut.is_some() {
            // The client left before any answer, or the stream outlived its deadline while
            // the backend kept serving: nothing about the backend.
            return Verdict::Cancelled;
        }
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_GATEWAY);
        Verdict::of_response(status, self.advised_retry, healthy, cfg)
    }
}

/// Whoever admitted the request: told once how it ended.
pub trait Settle: Send + 'static {
    /// Frees the slot, reconciles tokens, feeds the breaker and metrics.
    fn settle(self: Box<Self>, outcome: Outcome);
}

/// Runs the settlement exactly once, on finish or on drop (client disconnect).
pub struct Settlement {
    inner: Option<Box<dyn Settle>>,
    /// The outcome so far; updated as the response progresses.
    pub outcome: Outcome,
}

impl Settlement {
    /// Wraps a settle target.
    pub fn new(inner: Box<dyn Settle>) -> Self {
        Settlement {
            inner: Some(inner),
            outcome: Outcome::default(),
        }
    }

    /// Settles now with the outcome so far.
    pub fn finish(mut self) {
        if let Some(s) = self.inner.take() {
            s.settle(self.outcome);
        }
    }
}

impl Drop for Settlement {
    fn drop(&mut self) {
        if let Some(s) = self.inner.take() {
            // Dropped before `finish`: the response never completed, so the client left.
            self.outcome.client_gone = true;
            s.settle(self.outcome);
        }
    }
}

/// Sends the request upstream and waits for the response head until `deadline`. `request`
/// gives the headers passed on (request id, trace context).
pub async fn send(
    client: &HttpClient,
    backend: &Backend,
    path: &str,
    body: Bytes,
    deadline: Instant,
    request: Option<&crate::request_log::RequestId>,
) -> Result<http::Response<Incoming>, GatewayError> {
    let client = backend.client(client);
    let mut headers = crate::upstream::propagated_headers(request);
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    let base = &backend.base;
    let uri = backend.uri(path).map_err(GatewayError::upstream)?;
    let started = Instant::now();
    // One more try when the backend closed the connection without a word of answer: a
    // keep-alive connection it closed (llama-server closes one after a few requests or
    // seconds idle) as the request went out. It never read the request, so nothing runs
    // twice; a backend that is really gone fails the second try (or its connect) too.
    let mut tries_left = 2;
    loop {
        tries_left -= 1;
        let req = backend
            .request(http::Method::POST, uri.clone(), body.clone(), &headers)
            .map_err(|e| GatewayError::upstream(format!("cannot build upstream request: {e}")))?;
        return match tokio::time::timeout_at(deadline, client.request(req)).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(GatewayError::upstream_unreachable(format!(
                "cannot connect to backend {base}: {e}"
            ))),
            Ok(Err(e)) if tries_left > 0 && closed_before_answer(&e) => continue,
            Ok(Err(e)) => {
                let why = if closed_before_answer(&e) {
                    " (it closed the connection without answering)"
                } else {
                    ""
                };
                Err(GatewayError::upstream(format!(
                    "backend {base} failed: {e}{why}"
                )))
            }
            Err(_) => Err(GatewayError::upstream_timeout(started.elapsed())),
        };
    }
}

/// Reads a whole non-streaming response, learning its usage; `keep` sees the body of a 200.
pub async fn finish_buffered(
    resp: http::Response<Incoming>,
    mut settlement: Settlement,
    deadline: Instant,
    sent_at: Instant,
    extra: &[(&'static str, HeaderValue)],
    max_bytes: usize,
    keep: impl FnOnce(&Bytes),
) -> Result<Response, GatewayError> {
    let (parts, body) = resp.into_parts();
    settlement.outcome.status = parts.status.as_u16();
    settlement.outcome.advised_retry = crate::upstream::advised_retry(&parts.headers);
    // The response head is the first byte a non-streaming client could see.
    settlement.outcome.ttft = Some(sent_at.elapsed());
    // Bounded: a backend that answers without end would otherwise grow this buffer until
    // the gateway runs out of memory.
    let limited = http_body_util::Limited::new(body, max_bytes);
    let bytes = match tokio::time::timeout_at(deadline, limited.collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) => {
            settlement.outcome.transport_error = true;
            settlement.finish();
            if e.is::<http_body_util::LengthLimitError>() {
                return Err(GatewayError::upstream(format!(
                    "the backend's answer is larger than server.max_response_bytes ({max_bytes})"
                )));
            }
            return Err(GatewayError::upstream(format!(
                "backend response broke off: {e}"
            )));
        }
        Err(_) => {
            settlement.outcome.transport_error = true;
            settlement.finish();
            return Err(GatewayError::upstream_timeout(sent_at.elapsed()));
        }
    };
    #[derive(Deserialize)]
    struct WithUsage {
        usage: Option<Usage>,
    }
    if parts.status.is_success() {
        settlement.outcome.usage = serde_json::from_slice::<WithUsage>(&bytes)
            .ok()
            .and_then(|w| w.usage);
        if parts.status == http::StatusCode::OK {
            keep(&bytes);
        }
    }
    settlement.finish();
    let mut out = Response::new(Body::from(bytes));
    *out.status_mut() = parts.status;
    copy_content_type(&parts.headers, out.headers_mut());
    for (k, v) in extra {
        out.headers_mut().insert(*k, v.clone());
    }
    Ok(out)
}

fn copy_content_type(from: &http::HeaderMap, to: &mut http::HeaderMap) {
    let ct = from
        .get(http::header::CONTENT_TYPE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("application/json"));
    to.insert(http::header::CONTENT_TYPE, ct);
}

/// Time limits of one stream.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// Longest silence between two body chunks (and before the first).
    pub idle: Duration,
    /// The stream is cut at this instant whatever it is doing.
    pub deadline: Instant,
    /// The configured total (for the error message).
    pub total: Duration,
}

/// Longest SSE event levee buffers while looking for its end; a backend that sends more
/// without a blank line is not speaking SSE, and its stream is cut.
const MAX_EVENT_BYTES: usize = 1 << 20;

/// The first frame of an upstream stream's body, read before the answer's head went to the
/// client (see [`first_frame`]).
#[derive(Debug)]
pub enum FirstFrame {
    /// What the body gave (`None`: it ended).
    Frame(Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>),
    /// Nothing within the stream's idle limit: the stream is cut for it at once.
    Silent,
}

/// A backend's answer: its head (and body), and its first frame when it was read ahead.
pub type Answer = (http::Response<Incoming>, Option<FirstFrame>);

/// Reads the first frame of a stream's body (its first event, which engines send once the
/// prompt is prefilled), waiting at most the stream's `idle` limit.
pub async fn first_frame(body: &mut Incoming, idle: Duration) -> FirstFrame {
    match tokio::time::timeout(idle, body.frame()).await {
        Ok(frame) => FirstFrame::Frame(frame),
        Err(_) => FirstFrame::Silent,
    }
}

struct StreamState {
    /// The upstream body; dropped (closing the connection, cancelling the work) as soon as
    /// the stream ends or is cut.
    body: Option<Incoming>,
    /// Its first frame, read ahead ([`first_frame`]).
    first: Option<FirstFrame>,
    settlement: Option<Settlement>,
    events: EventSplitter,
    sent_at: Instant,
    limits: StreamLimits,
    backend: String,
}

/// Turns an upstream SSE response into a client response that forwards each event as it
/// arrives. When `strip_usage` is set (levee asked for `include_usage`, the client did
/// not), the usage-only final chunk is read for reconciliation and not forwarded.
///
/// A stream the backend breaks off, or that stays silent for `limits.idle`, or runs past
/// `limits.deadline`, ends with an SSE error event in OpenAI's shape (and no `[DONE]`); the
/// upstream connection is dropped and the settlement runs at that moment.
pub fn stream_response(
    (resp, first): Answer,
    mut settlement: Settlement,
    strip_usage: bool,
    sent_at: Instant,
    limits: StreamLimits,
    backend: &str,
    extra: &[(&'static str, HeaderValue)],
) -> Response {
    let (parts, body) = resp.into_parts();
    settlement.outcome.status = parts.status.as_u16();
    let state = StreamState {
        body: Some(body),
        first,
        settlement: Some(settlement),
        events: EventSplitter {
            strip_usage,
            ..EventSplitter::default()
        },
        sent_at,
        limits,
        backend: backend.to_string(),
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        let out = st.next_chunk().await?;
        Some((Ok::<Bytes, std::io::Error>(out), st))
    });
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = parts.status;
    copy_content_type(&parts.headers, out.headers_mut());
    out.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache"),
    );
    for (k, v) in extra {
        out.headers_mut().insert(*k, v.clone());
    }
    out
}

impl StreamState {
    /// The next bytes for the client; `None` once the stream has ended.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            let body = self.body.as_mut()?;
            let idle_at = Instant::now() + self.limits.idle;
            let (wake_at, idle) = if idle_at < self.limits.deadline {
                (idle_at, true)
            } else {
                (self.limits.deadline, false)
            };
            let frame = match self.first.take() {
                Some(FirstFrame::Frame(frame)) => frame,
                Some(FirstFrame::Silent) => {
                    return Some(self.cut(GatewayError::stream_idle_timeout(self.limits.idle)))
                }
                None => match tokio::time::timeout_at(wake_at, body.frame()).await {
                    Ok(frame) => frame,
                    Err(_) if idle => {
                        return Some(self.cut(GatewayError::stream_idle_timeout(self.limits.idle)))
                    }
                    Err(_) => {
                        return Some(self.cut(GatewayError::stream_timeout(self.limits.total)))
                    }
                },
            };
            match frame {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: nothing to forward for SSE
                    };
                    if let Some(s) = self.settlement.as_mut() {
                        if s.outcome.ttft.is_none() {
                            s.outcome.ttft = Some(self.sent_at.elapsed());
                        }
                    }
                    let mut usage = None;
                    let out = self.events.process(data, &mut usage);
                    if let (Some(u), Some(s)) = (usage, self.settlement.as_mut()) {
                        s.outcome.usage = Some(u);
                    }
                    if self.events.pending.len() > MAX_EVENT_BYTES {
                        return Some(self.cut(GatewayError::stream_broken(format!(
                            "backend {} sent over {MAX_EVENT_BYTES} bytes without ending an SSE \
                             event; the answer is incomplete",
                            self.backend
                        ))));
                    }
                    if !out.is_empty() {
                        return Some(out);
                    }
                }
                Some(Err(e)) => {
                    return Some(self.cut(GatewayError::stream_broken(format!(
                        "backend {} broke off the stream mid-answer ({e}); the answer is \
                         incomplete, retry the request",
                        self.backend
                    ))))
                }
                None => {
                    self.body = None;
                    if let Some(s) = self.settlement.take() {
                        s.finish();
                    }
                    let rest = self.events.pending.split().freeze();
                    return (!rest.is_empty()).then_some(rest);
                }
            }
        }
    }

    /// Ends the stream on `err`: drops the upstream body, settles, and returns the error
    /// event for the client. A partial event still buffered is dropped: forwarding half a
    /// JSON chunk would only garble the error that follows.
    fn cut(&mut self, err: GatewayError) -> Bytes {
        self.body = None;
        self.events.pending.clear();
        if let Some(mut s) = self.settlement.take() {
            // A stream that outlived its total deadline is not the backend's failure.
            s.outcome.transport_error = err.code() != ErrorCode::StreamTimeout;
            s.outcome.stream_cut = Some(err.code().as_str());
            s.finish();
        }
        tracing::warn!(backend = %self.backend, code = err.code().as_str(), "{}", err.message());
        err.sse_event()
    }
}

/// Cuts a stream's bytes at SSE event ends, so the client gets whole events whatever the
/// backend's chunk boundaries, and reads the usage chunk on the way.
#[derive(Debug, Default)]
pub(crate) struct EventSplitter {
    /// Bytes of an event not yet complete.
    pending: BytesMut,
    framer: Framer,
    /// Drop the usage-only chunk and the `"usage":null` fields (levee asked for them, the
    /// client did not).
    strip_usage: bool,
}

impl EventSplitter {
    /// A splitter that drops the usage chunk when `strip_usage` (see the field).
    pub(crate) fn with_strip_usage(strip_usage: bool) -> EventSplitter {
        EventSplitter {
            strip_usage,
            ..EventSplitter::default()
        }
    }

    /// Takes the next chunk from the backend; returns what to forward now (whole events
    /// only) and sets `usage` if an event carried it.
    pub(crate) fn process(&mut self, data: Bytes, usage: &mut Option<Usage>) -> Bytes {
        // Fast path: a chunk of whole events with no usage in it goes straight through.
        if self.pending.is_empty() && ends_an_event(&data) && !contains(&data, b"\"usage\"") {
            return data;
        }
        self.pending.extend_from_slice(&data);
        let Some(end) = self.framer.last_event_end(&self.pending) else {
            return Bytes::new();
        };
        self.framer.consumed(end);
        let complete = self.pending.split_to(end).freeze();
        if !contains(&complete, b"\"usage\"") {
            return complete;
        }
        let mut out = BytesMut::with_capacity(complete.len());
        for event in split_events(&complete) {
            if let Some((u, usage_only)) = usage_of(event) {
                *usage = Some(u);
                if self.strip_usage && usage_only {
                    continue;
                }
            }
            if self.strip_usage {
                // With include_usage on, every chunk carries `"usage": null`; a client that
                // did not ask should see the chunks it would have had without it.
                strip_null_usage(event, &mut out);
            } else {
                out.extend_from_slice(event);
            }
        }
        out.freeze()
    }
}

/// Finds where SSE events end, per the SSE spec: a line ends at `\r\n`, `\n` or `\r`, and
/// an empty line ends an event. It resumes where its last scan stopped, so a long event
/// arriving in many small chunks is scanned once.
#[derive(Debug, Default)]
struct Framer {
    /// Where the next scan starts.
    pos: usize,
    /// Whether the line being scanned has any text yet.
    line_has_text: bool,
}

impl Framer {
    /// The end (exclusive) of the next complete event in `buf` after the last one found.
    fn next_event_end(&mut self, buf: &[u8]) -> Option<usize> {
        while self.pos < buf.len() {
            let i = self.pos;
            let len = match buf[i] {
                b'\n' => 1,
                b'\r' => match buf.get(i + 1) {
                    Some(b'\n') => 2,
                    Some(_) => 1,
                    // A CR as the last byte may be the first half of a CRLF. If it ends an
                    // empty line the event is complete either way; if it ends a text line,
                    // look at it again when more bytes arrive.
                    None if self.line_has_text => return None,
                    None => 1,
                },
                _ => {
                    self.line_has_text = true;
                    self.pos += 1;
                    continue;
                }
            };
            self.pos += len;
            let ended_event = !self.line_has_text;
            self.line_has_text = false;
            if ended_event {
                return Some(self.pos);
            }
        }
        None
    }

    /// The end (exclusive) of the last complete event in `buf`.
    fn last_event_end(&mut self, buf: &[u8]) -> Option<usize> {
        let mut last = None;
        while let Some(end) = self.next_event_end(buf) {
            last = Some(end);
        }
        last
    }

    /// The caller removed `n` bytes from the front of the buffer.
    fn consumed(&mut self, n: usize) {
        self.pos = self.pos.saturating_sub(n);
    }
}

/// Whether `data`, scanned from an event boundary, ends exactly at one (an O(1) check for
/// the fast path: the last line terminator must end an empty line).
fn ends_an_event(data: &[u8]) -> bool {
    let rest = if data.ends_with(b"\r\n") {
        &data[..data.len() - 2]
    } else if data.ends_with(b"\n") || data.ends_with(b"\r") {
        &data[..data.len() - 1]
    } else {
        return false;
    };
    rest.is_empty() || rest.ends_with(b"\n") || rest.ends_with(b"\r")
}

/// Copies `event` into `out` without `,"usage":null` (either JSON spacing).
fn strip_null_usage(event: &[u8], out: &mut BytesMut) {
    const PATTERNS: [&[u8]; 2] = [b",\"usage\":null", b", \"usage\": null"];
    let mut rest = event;
    'outer: while !rest.is_empty() {
        for p in PATTERNS {
            if let Some(i) = find(rest, p) {
                out.extend_from_slice(&rest[..i]);
                rest = &rest[i + p.len()..];
                continue 'outer;
            }
        }
        out.extend_from_slice(rest);
        break;
    }
}

/// Splits a buffer of whole events into events (each keeping its blank line).
fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut framer = Framer::default();
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= buf.len() {
            return None;
        }
        let end = framer.next_event_end(buf).unwrap_or(buf.len());
        let ev = &buf[start..end];
        start = end;
        Some(ev)
    })
}

/// If the event carries usage, returns it and whether the chunk is usage-only (no
/// choices), i.e. the extra chunk `include_usage` adds.
fn usage_of(event: &[u8]) -> Option<(Usage, bool)> {
    #[derive(Deserialize)]
    struct Chunk {
        usage: Option<Usage>,
        #[serde(default)]
        choices: Vec<serde::de::IgnoredAny>,
    }
    let text = std::str::from_utf8(event).ok()?;
    let data = text
        .split(['\r', '\n'])
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)
        .collect::<Vec<_>>()
        .join("\n");
    let chunk: Chunk = serde_json::from_str(&data).ok()?;
    chunk.usage.map(|u| (u, chunk.choices.is_empty()))
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn contains(h: &[u8], n: &[u8]) -> bool {
    find(h, n).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_for_an_engines_count_is_the_chat_or_the_prompt_string() {
        use crate::upstream::PromptSource;
        let src = |body: &str| {
            ClientRequest::parse(Bytes::from(body.to_string()))
                .unwrap()
                .0
                .prompt_source()
        };
        assert_eq!(
            src(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":null}"#),
            Some(PromptSource::Chat {
                messages: serde_json::json!([{"role":"user","content":"hi"}]),
                tools: None
            })
        );
        assert_eq!(
            src(
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#
            ),
            Some(PromptSource::Chat {
                messages: serde_json::json!([{"role":"user","content":"x"}]),
                tools: Some(serde_json::json!([{"type":"function"}]))
            })
        );
        assert_eq!(
            src(r#"{"model":"m","prompt":"once upon"}"#),
            Some(PromptSource::Text("once upon".into()))
        );
        // Token ids, or a batch of prompts: the estimate stands.
        assert_eq!(src(r#"{"model":"m","prompt":[1,2,3]}"#), None);
        assert_eq!(src(r#"{"model":"m","prompt":["a","b"]}"#), None);
    }

    #[test]
    fn tools_tool_calls_and_images_are_counted() {
        use crate::tokenize::{TokenCounter, TOKENS_PER_IMAGE};
        let count = |body: serde_json::Value| {
            let (_, p) = ClientRequest::parse(Bytes::from(body.to_string())).unwrap();
            TokenCounter::CharsPerToken.count(&p)
        };
        let plain = count(serde_json::json!({"model": "m",
            "messages": [{"role": "user", "content": "hi"}]}));
        assert_eq!(plain, 2 + 4 + 1);
        // 33 KB of tool definitions behind a 2-character message: about 8,250 tokens more.
        let schema = "x".repeat(33_000);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f",
            "description": schema, "parameters": {"type": "object"}}}]);
        let with_tools = count(serde_json::json!({"model": "m", "tools": tools,
            "messages": [{"role": "user", "content": "hi"}]}));
        let tools_chars = tools.to_string().chars().count() as u64;
        assert_eq!(with_tools, plain + tools_chars.div_ceil(4));
        assert!(with_tools > 8_000, "{with_tools}");
        // A tool call's name and arguments.
        let call = count(serde_json::json!({"model": "m", "messages": [
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "lookup", "arguments": "{\"city\": \"Paris\"}"}}]}]}));
        assert_eq!(call, 2 + 4 + ("lookup".len() as u64 + 17).div_ceil(4));
        // Image parts: a documented cost each, beside their text.
        let images = count(
            serde_json::json!({"model": "m", "messages": [{"role": "user",
            "content": [{"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}),
        );
        assert_eq!(images, 2 + 4 + 3 + 2 * TOKENS_PER_IMAGE);
    }

    #[test]
    fn usage_chunk_is_recognised() {
        let ev = b"data: {\"id\":\"x\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":5,\"total_tokens\":8}}\n\n";
        let (u, only) = usage_of(ev).unwrap();
        assert_eq!(u.total(), 8);
        assert!(only);
        let ev2 = b"data: {\"id\":\"x\",\"choices\":[{\"delta\":{}}],\"usage\":null}\n\n";
        assert!(usage_of(ev2).is_none());
        assert!(usage_of(b"data: [DONE]\n\n").is_none());
    }

    #[test]
    fn null_usage_is_stripped() {
        let mut out = BytesMut::new();
        strip_null_usage(b"data: {\"a\":1,\"usage\":null}\n\n", &mut out);
        assert_eq!(&out[..], b"data: {\"a\":1}\n\n");
        let mut out = BytesMut::new();
        strip_null_usage(b"data: {\"a\":1, \"usage\": null, \"b\":2}\n\n", &mut out);
        assert_eq!(&out[..], b"data: {\"a\":1, \"b\":2}\n\n");
    }

    #[test]
    fn unchanged_bodies_are_forwarded_as_received() {
        let raw =
            br#"{"model":"m","messages":[{"role":"user","content":"hi \u00e9"}],"max_tokens":5}"#;
        let (r, _) = ClientRequest::parse(Bytes::from_static(raw)).unwrap();
        let same = r.upstream_body("m", None, false).unwrap();
        assert_eq!(&same[..], &raw[..]);

        let v: serde_json::Value =
            serde_json::from_slice(&r.upstream_body("up", Some(3), true).unwrap()).unwrap();
        assert_eq!(v["model"], "up");
        assert_eq!(v["max_tokens"], 3);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["messages"][0]["content"], "hi \u{e9}");

        let (r, _) = ClientRequest::parse(Bytes::from_static(
            br#"{"model":"m","max_completion_tokens":9,"max_tokens":1}"#,
        ))
        .unwrap();
        assert_eq!(r.max_tokens, Some(9));
        let v: serde_json::Value =
            serde_json::from_slice(&r.upstream_body("m", Some(4), false).unwrap()).unwrap();
        assert_eq!(v["max_completion_tokens"], 4);
        assert_eq!(v["max_tokens"], 1);
    }

    #[test]
    fn parse_reads_the_fields_we_need() {
        let parse = |b: &'static [u8]| ClientRequest::parse(Bytes::from_static(b)).map(|(r, _)| r);
        let p = parse(br#"{"model":"m","stream":true,"max_tokens":5,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(p.model, "m");
        assert!(p.stream);
        assert_eq!(p.max_tokens, Some(5));
        assert!(p.client_wants_usage);
        assert_eq!(
            parse(b"{").unwrap_err().status(),
            http::StatusCode::BAD_REQUEST
        );
        assert_eq!(
            parse(b"[]").unwrap_err().status(),
            http::StatusCode::BAD_REQUEST
        );
        assert_eq!(parse(br#"{"model":3}"#).unwrap_err().param(), Some("model"));
        assert_eq!(
            parse(br#"{"model":"m","max_tokens":-1}"#)
                .unwrap_err()
                .param(),
            Some("max_tokens")
        );
    }

    #[test]
    fn parse_errors_keep_their_messages() {
        let e = ClientRequest::parse(Bytes::from_static(b"[1]")).unwrap_err();
        assert_eq!(e.message(), "request body must be a JSON object");
        let e = ClientRequest::parse(Bytes::from_static(b"{\"model\":\"m\"} x")).unwrap_err();
        assert!(
            e.message().starts_with("request body is not valid JSON"),
            "{}",
            e.message()
        );
        let e =
            ClientRequest::parse(Bytes::from_static(br#"{"model":"m","stream":1}"#)).unwrap_err();
        assert_eq!(e.param(), Some("stream"));
        // Later duplicates win, as with a map.
        let (r, _) =
            ClientRequest::parse(Bytes::from_static(br#"{"model":"a","model":"b"}"#)).unwrap();
        assert_eq!(r.model, "b");
    }

    #[test]
    fn split_events_keeps_separators() {
        let v: Vec<&[u8]> = split_events(b"data: a\n\ndata: b\n\n").collect();
        assert_eq!(v, vec![&b"data: a\n\n"[..], &b"data: b\n\n"[..]]);
        let v: Vec<&[u8]> = split_events(b"data: a\r\n\r\ndata: b\r\rdata: c\n\r\n").collect();
        assert_eq!(
            v,
            vec![
                &b"data: a\r\n\r\n"[..],
                &b"data: b\r\r"[..],
                &b"data: c\n\r\n"[..]
            ]
        );
    }

    /// A stream of `events` (each `data: <json>` lines) framed with terminator `t`.
    fn framed(events: &[&str], t: &str) -> String {
        events
            .iter()
            .map(|e| format!("{}{t}{t}", e.replace('\n', t)))
            .collect()
    }

    const EVENTS: [&str; 4] = [
        r#"data: {"choices":[{"delta":{"content":"a"}}],"usage":null}"#,
        ": a comment line\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}],\"usage\":null}",
        r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}"#,
        "data: [DONE]",
    ];

    #[test]
    fn every_sse_line_ending_frames_events_at_any_chunk_boundary() {
        for t in ["\n", "\r\n", "\r"] {
            let stream = framed(&EVENTS, t);
            let bytes = stream.as_bytes();
            let event_ends: Vec<usize> = split_events(bytes)
                .scan(0, |end, ev| {
                    *end += ev.len();
                    Some(*end)
                })
                .collect();
            assert_eq!(event_ends.len(), EVENTS.len(), "{t:?}");
            // Every way of cutting the stream in two or three chunks.
            for a in 0..=bytes.len() {
                for b in [a, (a + 7).min(bytes.len()), bytes.len()] {
                    let mut sp = EventSplitter::default();
                    let mut usage = None;
                    let mut out = Vec::new();
                    let mut at = 0;
                    for chunk in [&bytes[..a], &bytes[a..b], &bytes[b..]] {
                        let got = sp.process(Bytes::copy_from_slice(chunk), &mut usage);
                        at += got.len();
                        out.extend_from_slice(&got);
                        // Forwarded bytes always end at an event end, and every event
                        // complete in what arrived has been forwarded.
                        let arrived =
                            chunk.as_ptr() as usize + chunk.len() - bytes.as_ptr() as usize;
                        let due = event_ends.iter().filter(|e| **e <= arrived).max().copied();
                        // Or one byte short of it: a CR that ends a blank line ends the
                        // event whether or not an LF follows in the next chunk.
                        let cr_before_lf =
                            bytes[at.saturating_sub(1)] == b'\r' && bytes.get(at) == Some(&b'\n');
                        assert!(
                            at == 0 || event_ends.contains(&at) || cr_before_lf,
                            "{t:?} {a} {b}: at {at}"
                        );
                        if let Some(d) = due {
                            assert!(
                                at >= d,
                                "{t:?} {a} {b}: event ending at {d} held back (at {at})"
                            );
                        }
                    }
                    assert_eq!(out, bytes, "{t:?} split at {a}/{b}");
                    assert_eq!(usage.map(|u| u.total()), Some(8), "{t:?} {a} {b}");
                }
            }
        }
    }

    #[test]
    fn usage_chunk_is_stripped_whatever_the_framing() {
        for t in ["\n", "\r\n", "\r"] {
            let stream = framed(&EVENTS, t);
            let mut sp = EventSplitter {
                strip_usage: true,
                ..EventSplitter::default()
            };
            let mut usage = None;
            let mut out = Vec::new();
            for chunk in stream.as_bytes().chunks(5) {
                out.extend_from_slice(&sp.process(Bytes::copy_from_slice(chunk), &mut usage));
            }
            let text = String::from_utf8(out).unwrap();
            assert_eq!(usage.map(|u| u.total()), Some(8), "{t:?}");
            assert!(!text.contains("usage"), "{t:?}: {text}");
            assert!(
                text.ends_with(&format!("data: [DONE]{t}{t}")),
                "{t:?}: {text}"
            );
        }
    }

    #[test]
    fn a_trailing_cr_waits_only_when_it_may_end_a_text_line() {
        let mut f = Framer::default();
        // "data: x\r" may be followed by "\n": not an event end yet.
        assert_eq!(f.last_event_end(b"data: x\r"), None);
        assert_eq!(f.last_event_end(b"data: x\r\n"), None);
        assert_eq!(f.last_event_end(b"data: x\r\n\r"), Some(10));
        assert!(ends_an_event(b"data: x\n\n"));
        assert!(ends_an_event(b"data: x\r\n\r\n"));
        assert!(ends_an_event(b"data: x\r\r"));
        assert!(ends_an_event(b"data: x\n\r\n"));
        assert!(!ends_an_event(b"data: x\r\n"));
        assert!(!ends_an_event(b"data: x\n"));
    }
}
