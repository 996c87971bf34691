//! Forwarding one admitted request to its backend: non-streaming bodies are read whole
//! (to learn the usage), SSE streams are forwarded chunk by chunk as they arrive.
//!
//! The backend slot and the token reservation travel with the response body inside a
//! [`Settlement`]; when the body finishes — or the client goes away and axum drops the
//! body — the settlement runs exactly once: it frees the slot, reconciles the tokens and
//! feeds the breaker. Dropping the upstream body closes the upstream connection, which is
//! how a client disconnect cancels the GPU work at once.

use crate::error::GatewayError;
use crate::tokenize::PromptText;
use crate::upstream::{Backend, HttpClient};
use axum::body::Body;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http::{HeaderValue, StatusCode};
use http_body_util::{BodyExt, Full};
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

/// The text of a chat message's `content`: a string, or the `text` of its text parts.
fn content_text(content: &serde_json::Value) -> String {
    match content {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// The prompt's text: each chat message's content, or each `prompt` string.
fn prompt_text(
    messages: Option<&serde_json::Value>,
    prompt: Option<&serde_json::Value>,
) -> PromptText {
    use serde_json::Value;
    if let Some(Value::Array(msgs)) = messages {
        return PromptText {
            parts: msgs
                .iter()
                .map(|m| m.get("content").map(content_text).unwrap_or_default())
                .collect(),
            chat: true,
            token_ids: 0,
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

impl ClientRequest {
    /// Parses a request body. `raw` should be an allocation of its own (see the type doc).
    /// The prompt's text comes back beside it, to be counted and dropped (a queued request
    /// keeps only its raw body).
    pub fn parse(raw: Bytes) -> Result<(ClientRequest, PromptText), GatewayError> {
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
        let count = |v: Option<Value>, name: &'static str| -> Result<u32, GatewayError> {
            match v {
                None | Some(Value::Null) => Ok(1),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| {
                        GatewayError::bad_request(format!("`{name}` must be a positive integer"))
                            .with_param(name)
                    }),
            }
        };
        let choices = count(head.n, "n")?.max(count(head.best_of, "best_of")?);
        let prompt = prompt_text(head.messages.as_ref(), head.prompt.as_ref());
        Ok((
            ClientRequest {
                raw,
                model,
                stream,
                max_tokens,
                client_wants_usage,
                choices,
                has_max_completion_tokens,
            },
            prompt,
        ))
    }

    /// Size of the body as received.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether the body is empty (never, for a parsed request).
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
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
}

impl Usage {
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
    /// Connect error, timeout, or a body that broke off.
    pub transport_error: bool,
    /// The client went away before the response finished.
    pub client_gone: bool,
    /// Time from sending to the first body byte.
    pub ttft: Option<Duration>,
}

impl Outcome {
    /// Whether the backend misbehaved (for the breaker). Client errors (4xx) are the client's
    /// fault and do not count against a backend; a client leaving early does not either.
    pub fn backend_failed(&self) -> bool {
        self.transport_error
            || self.status >= 500
            || self.status == 429
            || (self.status == 0 && !self.client_gone)
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

/// Sends the request upstream and waits for the response head until `deadline`.
pub async fn send(
    client: &HttpClient,
    backend: &Backend,
    path: &str,
    body: Bytes,
    deadline: Instant,
) -> Result<http::Response<Incoming>, GatewayError> {
    let base = &backend.base;
    let uri = backend.uri(path).map_err(GatewayError::upstream)?;
    let req = http::Request::post(uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| GatewayError::upstream(format!("cannot build upstream request: {e}")))?;
    let started = Instant::now();
    match tokio::time::timeout_at(deadline, client.request(req)).await {
        Ok(Ok(resp)) => Ok(resp),
        Ok(Err(e)) if e.is_connect() => Err(GatewayError::upstream_unreachable(format!(
            "cannot connect to backend {base}: {e}"
        ))),
        Ok(Err(e)) => Err(GatewayError::upstream(format!(
            "backend {base} failed: {e}"
        ))),
        Err(_) => Err(GatewayError::upstream_timeout(started.elapsed())),
    }
}

/// Reads a whole non-streaming response, learning its usage.
pub async fn finish_buffered(
    resp: http::Response<Incoming>,
    mut settlement: Settlement,
    deadline: Instant,
    sent_at: Instant,
    extra: &[(&'static str, HeaderValue)],
) -> Result<Response, GatewayError> {
    let (parts, body) = resp.into_parts();
    settlement.outcome.status = parts.status.as_u16();
    // The response head is the first byte a non-streaming client could see.
    settlement.outcome.ttft = Some(sent_at.elapsed());
    let bytes = match tokio::time::timeout_at(deadline, body.collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        Ok(Err(e)) => {
            settlement.outcome.transport_error = true;
            settlement.finish();
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

struct StreamState {
    body: Incoming,
    settlement: Settlement,
    pending: BytesMut,
    strip_usage: bool,
    sent_at: Instant,
    done: bool,
}

/// Turns an upstream SSE response into a client response that forwards each event as it
/// arrives. When `strip_usage` is set (levee asked for `include_usage`, the client did
/// not), the usage-only final chunk is read for reconciliation and not forwarded.
pub fn stream_response(
    resp: http::Response<Incoming>,
    mut settlement: Settlement,
    strip_usage: bool,
    sent_at: Instant,
    extra: &[(&'static str, HeaderValue)],
) -> Response {
    let (parts, body) = resp.into_parts();
    settlement.outcome.status = parts.status.as_u16();
    let state = StreamState {
        body,
        settlement,
        pending: BytesMut::new(),
        strip_usage,
        sent_at,
        done: false,
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            match st.body.frame().await {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: nothing to forward for SSE
                    };
                    if st.settlement.outcome.ttft.is_none() {
                        st.settlement.outcome.ttft = Some(st.sent_at.elapsed());
                    }
                    let out = st.process(data);
                    if !out.is_empty() {
                        return Some((Ok::<Bytes, std::io::Error>(out), st));
                    }
                }
                Some(Err(e)) => {
                    st.settlement.outcome.transport_error = true;
                    st.done = true;
                    let st_settle = std::mem::replace(
                        &mut st.settlement,
                        Settlement {
                            inner: None,
                            outcome: Outcome::default(),
                        },
                    );
                    st_settle.finish();
                    return Some((Err(std::io::Error::other(e)), st));
                }
                None => {
                    st.done = true;
                    let rest = st.pending.split().freeze();
                    let st_settle = std::mem::replace(
                        &mut st.settlement,
                        Settlement {
                            inner: None,
                            outcome: Outcome::default(),
                        },
                    );
                    st_settle.finish();
                    if rest.is_empty() {
                        return None;
                    }
                    return Some((Ok(rest), st));
                }
            }
        }
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
    /// Splits complete SSE events out of the buffer; returns what to forward now.
    fn process(&mut self, data: Bytes) -> Bytes {
        // Fast path: a chunk of whole events with no usage in it goes straight through.
        if self.pending.is_empty() && data.ends_with(b"\n\n") && !contains(&data, b"\"usage\"") {
            return data;
        }
        self.pending.extend_from_slice(&data);
        let Some(end) = rfind(&self.pending, b"\n\n") else {
            return Bytes::new();
        };
        let complete = self.pending.split_to(end + 2).freeze();
        if !contains(&complete, b"\"usage\"") {
            return complete;
        }
        let mut out = BytesMut::with_capacity(complete.len());
        for event in split_events(&complete) {
            if let Some(usage) = usage_of(event) {
                self.settlement.outcome.usage = Some(usage.0);
                if self.strip_usage && usage.1 {
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

/// Splits a buffer of whole events into events (each keeping its `\n\n`).
fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let n = find(rest, b"\n\n").map(|i| i + 2).unwrap_or(rest.len());
        let (ev, r) = rest.split_at(n);
        rest = r;
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
        .lines()
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

fn rfind(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).rposition(|w| w == n)
}

fn contains(h: &[u8], n: &[u8]) -> bool {
    find(h, n).is_some()
}

/// Status for a backend that answered with a non-success code but whose body we pass on.
pub fn is_backend_failure(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(r.len(), raw.len());
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
    fn parse_errors_keep_their_messages() {
        let e = ClientRequest::parse(Bytes::from_static(b"[1]")).unwrap_err();
        assert_eq!(e.message, "request body must be a JSON object");
        let e = ClientRequest::parse(Bytes::from_static(b"{\"model\":\"m\"} x")).unwrap_err();
        assert!(
            e.message.starts_with("request body is not valid JSON"),
            "{}",
            e.message
        );
        let e =
            ClientRequest::parse(Bytes::from_static(br#"{"model":"m","stream":1}"#)).unwrap_err();
        assert_eq!(e.param, Some("stream"));
        // Later duplicates win, as with a map.
        let (r, _) =
            ClientRequest::parse(Bytes::from_static(br#"{"model":"a","model":"b"}"#)).unwrap();
        assert_eq!(r.model, "b");
    }

    #[test]
    fn split_events_keeps_separators() {
        let v: Vec<&[u8]> = split_events(b"data: a\n\ndata: b\n\n").collect();
        assert_eq!(v, vec![&b"data: a\n\n"[..], &b"data: b\n\n"[..]]);
    }
}
