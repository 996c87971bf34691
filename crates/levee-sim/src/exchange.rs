//! One HTTP attempt: send a pre-built body, read the answer, time the tokens.

use crate::recorder::Kind;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde::Deserialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// The HTTP client every request of a run shares (pooled keep-alive connections).
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Builds the shared client: keep-alive pool without a per-host idle limit (an open-loop
/// flood needs as many connections as requests in flight), no Nagle delay.
pub(crate) fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(usize::MAX)
        .build(connector)
}

/// A small JSON exchange (async clients' task calls): the status and the JSON body (or
/// `Null`). `Err` when no answer came.
pub(crate) async fn call_json(
    client: &HttpClient,
    method: http::Method,
    url: &str,
    auth: Option<http::HeaderValue>,
    body: Option<Bytes>,
) -> Result<(u16, serde_json::Value), Kind> {
    let mut b = http::Request::builder()
        .method(method)
        .uri(url)
        .header(http::header::CONTENT_TYPE, "application/json");
    if let Some(a) = auth {
        b = b.header(http::header::AUTHORIZATION, a);
    }
    let request = b
        .body(Full::new(body.unwrap_or_default()))
        .map_err(|_| Kind::Connect)?;
    let response = client.request(request).await.map_err(|_| Kind::Connect)?;
    let status = response.status().as_u16();
    let bytes = Limited::new(response.into_body(), 16 << 20)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|_| Kind::BrokenStream)?;
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    ))
}

/// What one attempt produced.
#[derive(Debug)]
pub(crate) struct AttemptResult {
    pub kind: Kind,
    /// Whether the status was 2xx.
    pub admitted: bool,
    /// First content token, ns from the run's start.
    pub first_token_ns: Option<u64>,
    /// Output tokens: the usage figure when the server sent one, else content chunks.
    pub tokens: u32,
    /// Gaps between content chunks, µs.
    pub itl_us: Vec<u32>,
    /// The server's requested wait (Retry-After / retry-after-ms).
    pub retry_after: Option<Duration>,
    /// The answer's text, when the caller asked to keep it (a session's next turn resends
    /// it); empty otherwise.
    pub content: String,
}

impl AttemptResult {
    fn failed(kind: Kind) -> Self {
        Self {
            kind,
            admitted: false,
            first_token_ns: None,
            tokens: 0,
            itl_us: Vec::new(),
            retry_after: None,
            content: String::new(),
        }
    }
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    #[serde(default)]
    code: Option<serde_json::Value>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

#[derive(Deserialize, Default)]
struct Usage {
    #[serde(default)]
    completion_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<Delta>,
    /// `/v1/completions` streams carry `text` instead of a delta.
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    choices: Vec<CompletionChoice>,
}

#[derive(Deserialize)]
struct CompletionChoice {
    #[serde(default)]
    message: Option<Delta>,
    /// `/v1/completions` answers carry `text` instead of a message.
    #[serde(default)]
    text: Option<String>,
}

/// Largest error body read: enough for any OpenAI-style error, small enough that a
/// misbehaving server cannot make us buffer megabytes per failure.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

fn ns_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Sends one request and reads the whole answer. The caller applies the timeout (dropping
/// this future closes the connection: the client disconnects). `admitted` is set as soon as
/// a 2xx status arrives, so that a caller whose timeout cut a stream still knows the
/// server had accepted it. With `keep_content` the answer's text is kept in the result.
pub(crate) async fn attempt(
    client: &HttpClient,
    request: http::Request<Full<Bytes>>,
    start: Instant,
    admitted: &AtomicBool,
    keep_content: bool,
) -> AttemptResult {
    let response = match client.request(request).await {
        Ok(r) => r,
        Err(_) => return AttemptResult::failed(Kind::Connect),
    };
    let status = response.status();
    if status.is_success() {
        admitted.store(true, Ordering::Relaxed);
    }
    if !status.is_success() {
        let headers = response.headers();
        let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let retry_after = levee_client::retry_after::parse(
            get("retry-after"),
            get("retry-after-ms"),
            std::time::SystemTime::now(),
        );
        let levee_origin = headers.contains_key("x-levee-error-origin");
        // levee names the check that refused; kept with the code (`<code>:<check>`).
        let check = get("x-levee-refusal").map(str::to_owned);
        let body = Limited::new(response.into_body(), ERROR_BODY_LIMIT)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let kind = if status.as_u16() == 429 {
            let code = serde_json::from_slice::<ErrorBody>(&body)
                .ok()
                .and_then(|b| {
                    match b.error.code {
                        Some(serde_json::Value::String(s)) => Some(s),
                        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
                        _ => None,
                    }
                    .or(b.error.kind)
                })
                .unwrap_or_else(|| "unknown".into());
            Kind::RateLimited(match check {
                Some(check) => format!("{code}:{check}"),
                None => code,
            })
        } else if levee_origin {
            Kind::LeveeStatus(status.as_u16())
        } else {
            Kind::Status(status.as_u16())
        };
        return AttemptResult {
            retry_after,
            ..AttemptResult::failed(kind)
        };
    }
    let is_sse = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut body = response.into_body();
    if !is_sse {
        let bytes = match body.collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => {
                return AttemptResult {
                    admitted: true,
                    ..AttemptResult::failed(Kind::BrokenStream)
                }
            }
        };
        let completion = serde_json::from_slice::<Completion>(&bytes).ok();
        let tokens = completion
            .as_ref()
            .and_then(|c| c.usage.as_ref())
            .and_then(|u| u.completion_tokens)
            .unwrap_or(0);
        let content = completion
            .filter(|_| keep_content)
            .and_then(|c| c.choices.into_iter().next())
            .and_then(|c| c.message.and_then(|m| m.content).or(c.text))
            .unwrap_or_default();
        return AttemptResult {
            kind: Kind::Ok,
            admitted: true,
            first_token_ns: None,
            tokens,
            itl_us: Vec::new(),
            retry_after: None,
            content,
        };
    }

    let mut sse = SseState {
        keep_content,
        ..SseState::default()
    };
    loop {
        match body.frame().await {
            None => break,
            Some(Err(_)) => {
                return AttemptResult {
                    admitted: true,
                    first_token_ns: sse.first_ns,
                    ..AttemptResult::failed(Kind::BrokenStream)
                }
            }
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    sse.feed(data, ns_since(start));
                }
            }
        }
        if sse.done {
            break;
        }
    }
    let complete = sse.done || sse.finished;
    AttemptResult {
        kind: if complete {
            Kind::Ok
        } else {
            Kind::BrokenStream
        },
        admitted: true,
        first_token_ns: sse.first_ns,
        tokens: sse.usage_tokens.unwrap_or(sse.chunks),
        itl_us: sse.itl_us,
        retry_after: None,
        content: sse.content,
    }
}

/// Incremental server-sent-events parser: only `data:` lines matter for OpenAI streams.
#[derive(Default)]
struct SseState {
    pending: Vec<u8>,
    first_ns: Option<u64>,
    last_ns: Option<u64>,
    chunks: u32,
    usage_tokens: Option<u32>,
    itl_us: Vec<u32>,
    /// `data: [DONE]` seen.
    done: bool,
    /// A `finish_reason` seen (some servers omit `[DONE]`).
    finished: bool,
    /// Whether to keep the streamed text in `content`.
    keep_content: bool,
    content: String,
}

impl SseState {
    fn feed(&mut self, data: &[u8], now_ns: u64) {
        self.pending.extend_from_slice(data);
        let mut consumed = 0;
        while let Some(pos) = self.pending[consumed..].iter().position(|&b| b == b'\n') {
            let end = consumed + pos;
            let line = &self.pending[consumed..end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if let Some(payload) = line.strip_prefix(b"data:") {
                let payload = payload.trim_ascii();
                // Copy out so that `self` is free to update below.
                let payload = payload.to_vec();
                self.on_data(&payload, now_ns);
            }
            consumed = end + 1;
        }
        self.pending.drain(..consumed);
    }

    fn on_data(&mut self, payload: &[u8], now_ns: u64) {
        if payload == b"[DONE]" {
            self.done = true;
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk>(payload) else {
            return;
        };
        if let Some(n) = chunk.usage.and_then(|u| u.completion_tokens) {
            self.usage_tokens = Some(n);
        }
        let mut has_content = false;
        for choice in &chunk.choices {
            let text = choice
                .delta
                .as_ref()
                .and_then(|d| d.content.as_deref())
                .or(choice.text.as_deref());
            has_content |= text.is_some_and(|t| !t.is_empty());
            if self.keep_content {
                self.content.push_str(text.unwrap_or_default());
            }
            self.finished |= choice.finish_reason.is_some();
        }
        if has_content {
            self.chunks += 1;
            if self.first_ns.is_none() {
                self.first_ns = Some(now_ns);
            }
            if let Some(last) = self.last_ns {
                let gap = now_ns.saturating_sub(last) / 1000;
                self.itl_us.push(u32::try_from(gap).unwrap_or(u32::MAX));
            }
            self.last_ns = Some(now_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_split_across_frames_counts_tokens_and_usage() {
        let mut s = SseState::default();
        s.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\nda",
            1_000_000,
        );
        s.feed(
            b"ta: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\r\n\r\n",
            3_000_000,
        );
        s.feed(
            b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"completion_tokens\":7}}\n\ndata: [DONE]\n\n",
            4_000_000,
        );
        assert_eq!(s.chunks, 2);
        assert_eq!(s.first_ns, Some(1_000_000));
        assert_eq!(s.itl_us, vec![2000]);
        assert_eq!(s.usage_tokens, Some(7));
        assert!(s.done && s.finished);
    }
}
