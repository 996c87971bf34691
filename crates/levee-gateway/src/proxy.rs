//! Forwarding one admitted request to its backend: non-streaming bodies are read whole
//! (to learn the usage), SSE streams are forwarded chunk by chunk as they arrive.
//!
//! The backend slot and the token reservation travel with the response body inside a
//! [`Settlement`]; when the body finishes — or the client goes away and axum drops the
//! body — the settlement runs exactly once: it frees the slot, reconciles the tokens and
//! feeds the breaker. Dropping the upstream body closes the upstream connection, which is
//! how a client disconnect cancels the GPU work at once.

use crate::config::OutlierConfig;
use crate::conn_pool::{Connector, Lease};
use crate::error::{ErrorCode, GatewayError};
use crate::upstream::{Backend, Verdict};
use axum::body::Body;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use http::{HeaderValue, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use levee_policy::OverBudget;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::Notify;
use tokio::time::Instant;

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
    /// Time from sending to the engine's first token, where levee saw it: a stream's first
    /// frame (the client's own stream, or one read whole in place of a non-streamed
    /// answer). `None` for an answer the engine sent whole.
    pub engine_ttft: Option<Duration>,
    /// How a stream was cut after its head went out (the code of the SSE error event sent
    /// to the client: `stream_broken`, `stream_idle_timeout`, `stream_timeout`,
    /// `stream_kv_budget`).
    pub stream_cut: Option<ErrorCode>,
    /// Tokens read of a stream whose KV hold grows with its answer (`kv.grow_streams`), as
    /// counted on the way (an event each).
    pub generated: Option<u64>,
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

/// Whoever admitted the request: told once how it ended, and asked to hold more of the
/// backend's KV cache as a stream's answer grows.
pub trait Settle: Send + 'static {
    /// Frees the slot, reconciles tokens, feeds the breaker and metrics.
    fn settle(self: Box<Self>, outcome: Outcome);
    /// The count of the answer's tokens at which its KV hold must grow; `None` when it
    /// holds all it may need.
    fn grows_at(&self) -> Option<u64>;
    /// The answer has `generated` tokens: grows its hold where due; `Ok` with the next count
    /// to ask at, `Err` when the backend has no room (cut the stream).
    fn grow(&mut self, generated: u64) -> Result<Option<u64>, OverBudget>;
    /// Holds the answer's whole completion budget; `Err` when the backend has no room.
    fn hold_whole(&mut self) -> Result<(), OverBudget>;
    /// The signal that the answer's KV hold went to a stream of a tenant within its fair
    /// share: cut it at once. `None` before it grew (or tried to).
    fn taken_signal(&self) -> Option<Arc<Notify>>;
}

/// Runs the settlement exactly once, on finish or on drop (client disconnect).
pub struct Settlement {
    inner: Option<Box<dyn Settle>>,
    /// The upstream connection, given back at a clean finish.
    lease: Option<Lease>,
    /// The outcome so far; updated as the response progresses.
    pub outcome: Outcome,
}

impl Settlement {
    /// Wraps a settle target.
    pub fn new(inner: Box<dyn Settle>) -> Self {
        Settlement {
            inner: Some(inner),
            lease: None,
            outcome: Outcome::default(),
        }
    }

    /// Holds the answer's connection: given back to its pool if the answer is read whole
    /// ([`Settlement::finish`] with no transport error and no cut), closed otherwise.
    pub fn keep_alive(&mut self, lease: Lease) {
        self.lease = Some(lease);
    }

    /// See [`Settle::grows_at`]; `None` once settled.
    pub fn grows_at(&self) -> Option<u64> {
        self.inner.as_ref()?.grows_at()
    }

    /// See [`Settle::grow`].
    fn grow(&mut self, generated: u64) -> Result<Option<u64>, OverBudget> {
        self.inner.as_mut().map_or(Ok(None), |s| s.grow(generated))
    }

    /// See [`Settle::hold_whole`].
    fn hold_whole(&mut self) -> Result<(), OverBudget> {
        self.inner.as_mut().map_or(Ok(()), |s| s.hold_whole())
    }

    /// See [`Settle::taken_signal`].
    fn taken_signal(&self) -> Option<Arc<Notify>> {
        self.inner.as_ref()?.taken_signal()
    }

    /// Settles now with the outcome so far: the answer's body was read to its end (or
    /// failed, as the outcome says).
    pub fn finish(mut self) {
        let o = &self.outcome;
        if !o.transport_error && !o.client_gone && o.stream_cut.is_none() {
            if let Some(lease) = self.lease.take() {
                lease.give_back();
            }
        }
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

/// Sends the request upstream on one of the backend's keep-alive connections and waits for
/// the response head until `deadline`. `request` gives the headers passed on (request id,
/// trace context). The connection comes back beside the answer, to be given back once the
/// answer was read whole ([`Settlement::keep_alive`]).
pub async fn send(
    connector: &Connector,
    backend: &Backend,
    path: &str,
    body: Bytes,
    deadline: Instant,
    request: Option<&crate::request_log::RequestId>,
) -> Result<(http::Response<Incoming>, Lease), GatewayError> {
    let connector = backend.connector(connector);
    let base = &backend.base;
    let uri = backend.uri(path).map_err(GatewayError::upstream)?;
    // The request line names the path alone (origin form); the backend's fixed headers
    // carry its `Host`.
    let origin = uri.path_and_query().map_or_else(
        || http::Uri::from_static("/"),
        |pq| http::Uri::from(pq.clone()),
    );
    let started = Instant::now();
    // Sent again when the backend closed the connection without a word of answer: a
    // keep-alive connection it closed (llama-server closes one after a few requests or
    // seconds idle) before the request went out (`unsent`: up to twice, on other
    // connections), or as it went out (once: it never read the request, so nothing runs
    // twice; a backend that is really gone fails that try, or its connect, too).
    let (mut unsent_left, mut resent) = (2, false);
    let timeout = || GatewayError::upstream_timeout(started.elapsed());
    loop {
        let mut lease = tokio::time::timeout_at(deadline, backend.pool.checkout(connector, &uri))
            .await
            .map_err(|_| timeout())?
            .map_err(|e| {
                GatewayError::upstream_unreachable(format!(
                    "cannot connect to backend {base}: {}",
                    causes(&*e)
                ))
            })?;
        let mut req = backend.request(http::Method::POST, origin.clone(), body.clone());
        // Written straight into the request's headers, after the backend's fixed ones.
        crate::upstream::propagate(req.headers_mut(), request);
        req.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        return match tokio::time::timeout_at(deadline, lease.send(req)).await {
            Ok(Ok(resp)) => Ok((resp, lease)),
            Ok(Err(e)) if e.unsent && unsent_left > 0 => {
                unsent_left -= 1;
                continue;
            }
            Ok(Err(e)) if e.error.is_incomplete_message() && !resent => {
                resent = true;
                continue;
            }
            Ok(Err(e)) => {
                let why = if e.unsent || e.error.is_incomplete_message() {
                    " (it closed the connection without answering)"
                } else {
                    ""
                };
                Err(GatewayError::upstream(format!(
                    "backend {base} failed: {}{why}",
                    causes(&e.error)
                )))
            }
            Err(_) => Err(timeout()),
        };
    }
}

/// An error and its causes, as one line.
fn causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Reads a whole non-streaming response (unless it was read ahead), learning its usage;
/// `keep` sees the body of a 200.
pub async fn finish_buffered(
    (resp, ahead): Answer,
    mut settlement: Settlement,
    deadline: Instant,
    sent_at: Instant,
    extra: &http::HeaderMap,
    max_bytes: usize,
    keep: impl FnOnce(&Bytes),
) -> Result<Response, GatewayError> {
    let (parts, body) = resp.into_parts();
    settlement.outcome.status = parts.status.as_u16();
    // Only a refusal's advice is read (see `Verdict::of_response`).
    if matches!(
        parts.status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
    ) {
        settlement.outcome.advised_retry = crate::upstream::advised_retry(&parts.headers);
    }
    // The response head is the first byte a non-streaming client could see.
    settlement.outcome.ttft = Some(sent_at.elapsed());
    let mut headers = parts.headers;
    let read = match ahead {
        ReadAhead::Whole(whole) => {
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            settlement.outcome.engine_ttft = whole.first_frame;
            Ok(Ok(whole.body))
        }
        // Bounded: a backend that answers without end would otherwise grow this buffer
        // until the gateway runs out of memory.
        ReadAhead::Nothing | ReadAhead::First(_) => {
            let limited = http_body_util::Limited::new(body, max_bytes);
            tokio::time::timeout_at(deadline, limited.collect())
                .await
                .map(|r| r.map(|c| c.to_bytes()))
        }
    };
    let bytes = match read {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) => {
            settlement.outcome.transport_error = true;
            settlement.finish();
            if e.is::<http_body_util::LengthLimitError>() {
                return Err(too_large(max_bytes));
            }
            return Err(broke_off(&*e));
        }
        Err(_) => {
            settlement.outcome.transport_error = true;
            settlement.finish();
            return Err(GatewayError::upstream_timeout(sent_at.elapsed()));
        }
    };
    if parts.status.is_success() {
        settlement.outcome.usage = usage_of_body(&bytes);
        if parts.status == http::StatusCode::OK {
            keep(&bytes);
        }
    }
    settlement.finish();
    let mut out = Response::new(Body::from(bytes));
    *out.status_mut() = parts.status;
    copy_content_type(&headers, out.headers_mut());
    for (k, v) in extra {
        out.headers_mut().insert(k.clone(), v.clone());
    }
    Ok(out)
}

/// A non-streamed answer (or the stream read in its place) over `server.max_response_bytes`.
fn too_large(max_bytes: usize) -> GatewayError {
    GatewayError::upstream(format!(
        "the backend's answer is larger than server.max_response_bytes ({max_bytes})"
    ))
}

/// A non-streamed answer (or the stream read in its place) that broke off.
fn broke_off(e: &dyn std::fmt::Display) -> GatewayError {
    GatewayError::upstream(format!("backend response broke off: {e}"))
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

/// What of an answer's body was read before its head went on to the client.
#[derive(Debug)]
pub enum ReadAhead {
    /// Nothing: the body is read as it is passed on.
    Nothing,
    /// A stream's first frame ([`first_frame`]).
    First(FirstFrame),
    /// The whole answer, put together from the stream levee asked for in place of a
    /// non-streamed answer ([`read_whole_stream`]).
    Whole(WholeStream),
}

/// A stream read whole ([`read_whole_stream`]).
#[derive(Debug)]
pub struct WholeStream {
    /// The answer's body as the backend would have sent it unstreamed.
    body: Bytes,
    /// When its first frame came, from sending.
    first_frame: Option<Duration>,
}

/// A backend's answer: its head (and body), and what of the body was read ahead.
pub type Answer = (http::Response<Incoming>, ReadAhead);

/// Whether an answer is a stream levee may read whole in place of a non-streamed answer.
pub fn is_event_stream<B>(resp: &http::Response<B>) -> bool {
    resp.status() == StatusCode::OK
        && resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// Reads a stream levee asked for in place of a non-streamed answer to its end, by
/// `deadline`, and returns the answer's body as the backend would have sent it unstreamed
/// ([`crate::reassemble`]). At most `max_bytes` of stream are read.
pub async fn read_whole_stream(
    body: &mut Incoming,
    deadline: Instant,
    sent_at: Instant,
    max_bytes: usize,
) -> Result<WholeStream, GatewayError> {
    let mut events = EventSplitter::default();
    let mut whole = crate::reassemble::Reassembly::default();
    let mut read = 0usize;
    let mut first_frame = None;
    loop {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .map_err(|_| GatewayError::upstream_timeout(sent_at.elapsed()))?;
        let data = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                Err(_) => continue, // trailers
            },
            Some(Err(e)) => return Err(broke_off(&e)),
            None => break,
        };
        first_frame.get_or_insert_with(|| sent_at.elapsed());
        read += data.len();
        if read > max_bytes {
            return Err(too_large(max_bytes));
        }
        let mut usage = None;
        let complete = events.process(data, &mut usage);
        for event in split_events(&complete) {
            whole.event(event)?;
        }
    }
    let rest = events.pending.split().freeze();
    if !rest.is_empty() {
        whole.event(&rest)?;
    }
    Ok(WholeStream {
        body: whole.finish()?.into(),
        first_frame,
    })
}

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
    (resp, ahead): Answer,
    mut settlement: Settlement,
    strip_usage: bool,
    sent_at: Instant,
    limits: StreamLimits,
    backend: &str,
    extra: &http::HeaderMap,
) -> Response {
    let (parts, body) = resp.into_parts();
    settlement.outcome.status = parts.status.as_u16();
    let state = StreamState {
        body: Some(body),
        first: match ahead {
            ReadAhead::First(first) => Some(first),
            ReadAhead::Nothing | ReadAhead::Whole(_) => None,
        },
        settlement: Some(settlement),
        events: EventSplitter {
            strip_usage,
            ..EventSplitter::default()
        },
        sent_at,
        limits,
        backend: backend.to_string(),
    };
    let body = match state.settlement.as_ref().and_then(Settlement::grows_at) {
        Some(at) => pumped(state, at),
        None => Body::from_stream(futures::stream::unfold(state, |mut st| async move {
            let out = st.next_chunk().await?;
            Some((Ok::<Bytes, std::io::Error>(out), st))
        })),
    };
    let mut out = Response::new(body);
    *out.status_mut() = parts.status;
    copy_content_type(&parts.headers, out.headers_mut());
    out.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache"),
    );
    for (k, v) in extra {
        out.headers_mut().insert(k.clone(), v.clone());
    }
    out
}

/// Chunks a stream whose KV hold grows keeps for a client that reads slower than its
/// backend writes; past them the stream holds its whole completion budget.
const PUMP_CHUNKS: usize = 16;

/// A stream whose KV hold grows with its answer (`kv.grow_streams`), read by a task of its
/// own ([`pump`]) so that its tokens are counted as the backend sends them, whether or not
/// its client keeps up.
fn pumped(state: StreamState, grows_at: u64) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel(PUMP_CHUNKS);
    tokio::spawn(tracing::Instrument::in_current_span(pump(
        state, tx, grows_at,
    )));
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        let chunk = rx.recv().await?;
        Some((Ok::<Bytes, std::io::Error>(chunk), rx))
    }))
}

/// Reads a stream ahead of its client: counts its tokens (an event each) as they come,
/// grows its KV hold where due and cuts it (`stream_kv_budget`) when its backend has no
/// room, or at once when its hold went to a stream of a tenant within its share; once its
/// client falls [`PUMP_CHUNKS`] behind, the tokens the engine makes meanwhile are out of
/// sight, so it holds its whole completion budget (or is cut). A client gone ends it: the
/// upstream body is dropped, and the settlement runs as for any stream.
async fn pump(mut st: StreamState, tx: tokio::sync::mpsc::Sender<Bytes>, grows_at: u64) {
    let mut grows_at = Some(grows_at);
    let mut generated = 0u64;
    let mut taken: Option<Arc<Notify>> = None;
    loop {
        let next = tokio::select! {
            next = st.next_chunk() => next,
            () = tx.closed() => return,
            () = signalled(taken.as_deref()) => return cut_taken(st, &tx, None, generated).await,
        };
        let Some(out) = next else { return };
        generated += token_events(&out);
        if let Some(s) = st.settlement.as_mut() {
            s.outcome.generated = Some(generated);
        }
        if grows_at.is_some_and(|at| generated >= at) {
            let grown = st.grow(generated);
            taken = taken.or_else(|| st.taken_signal());
            match grown {
                Ok(next) => grows_at = next,
                Err(OverBudget) => return cut_over_budget(st, &tx, out, generated).await,
            }
        }
        let out = match tx.try_send(out) {
            Ok(()) => continue,
            Err(TrySendError::Closed(_)) => return,
            Err(TrySendError::Full(out)) => out,
        };
        // The client fell behind: what the engine makes meanwhile is out of sight.
        if grows_at.take().is_some() {
            let held = st.hold_whole();
            taken = taken.or_else(|| st.taken_signal());
            if held.is_err() {
                return cut_over_budget(st, &tx, out, generated).await;
            }
        }
        let room = tokio::select! {
            room = tx.reserve() => room,
            () = signalled(taken.as_deref()) => {
                return cut_taken(st, &tx, Some(out), generated).await;
            }
        };
        match room {
            Ok(room) => room.send(out),
            Err(_) => return,
        }
    }
}

/// Once `signal` (if any) fires; never without one.
async fn signalled(signal: Option<&Notify>) {
    match signal {
        Some(s) => s.notified().await,
        None => std::future::pending().await,
    }
}

/// Cuts a stream whose backend has no room to hold more of it: the upstream body goes at
/// once (the engine stops), then the client gets what was read and the error event.
async fn cut_over_budget(
    st: StreamState,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
    read: Bytes,
    generated: u64,
) {
    let err = GatewayError::stream_kv_budget(&st.backend, generated);
    cut_for_room(st, tx, Some(read), err).await;
}

/// Cuts a stream whose KV hold went to a stream of a tenant within its share, as
/// [`cut_over_budget`] (`read`: what was read and not yet sent).
async fn cut_taken(
    st: StreamState,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
    read: Option<Bytes>,
    generated: u64,
) {
    let err = GatewayError::stream_kv_taken(&st.backend, generated);
    cut_for_room(st, tx, read, err).await;
}

/// Drops the stream's upstream body at once (the engine stops), then sends its client what
/// was `read` and the error event `err`.
async fn cut_for_room(
    mut st: StreamState,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
    read: Option<Bytes>,
    err: GatewayError,
) {
    let cut = st.cut(err);
    if let Some(read) = read {
        if tx.send(read).await.is_err() {
            return;
        }
    }
    let _ = tx.send(cut).await;
}

/// Tokens in a run of whole SSE events as a stream's hold counts them: one per `data:`
/// line (engines send a token an event; the role, finish and usage events count too,
/// which errs high).
fn token_events(events: &[u8]) -> u64 {
    memchr::memmem::find_iter(events, b"data:").count() as u64
}

impl StreamState {
    /// Grows the stream's KV hold for `generated` tokens (see [`Settle::grow`]).
    fn grow(&mut self, generated: u64) -> Result<Option<u64>, OverBudget> {
        self.settlement
            .as_mut()
            .map_or(Ok(None), |s| s.grow(generated))
    }

    /// Holds the stream's whole completion budget (see [`Settle::hold_whole`]).
    fn hold_whole(&mut self) -> Result<(), OverBudget> {
        self.settlement
            .as_mut()
            .map_or(Ok(()), Settlement::hold_whole)
    }

    /// See [`Settle::taken_signal`].
    fn taken_signal(&self) -> Option<Arc<Notify>> {
        self.settlement.as_ref()?.taken_signal()
    }

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
                            s.outcome.engine_ttft = s.outcome.ttft;
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
            // A stream that outlived its total deadline, or that its backend's KV budget
            // could not hold, is not the backend's failure.
            s.outcome.transport_error = !matches!(
                err.code(),
                ErrorCode::StreamTimeout | ErrorCode::StreamKvBudget
            );
            s.outcome.stream_cut = Some(err.code());
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
pub(crate) fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
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
/// The `usage` of a whole (non-streamed) answer: found without reading the rest of it (the
/// choices' text is most of an answer).
fn usage_of_body(body: &[u8]) -> Option<Usage> {
    let value = std::str::from_utf8(crate::lite::top_level_value(body, "usage")?).ok()?;
    Option::<Usage>::deserialize(&mut serde_json::Deserializer::from_str(value))
        .ok()
        .flatten()
}

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
