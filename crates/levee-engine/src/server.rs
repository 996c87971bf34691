//! The HTTP surface: OpenAI-compatible routes, `/health`, `/metrics` and `/admin/*`.

use crate::gpu::{FailReason, SubmitError};
use crate::scheduler::{
    Command, EngineState, EngineStats, Faults, FaultsUpdate, SeqEvent, Shared, Submission,
};
use crate::tokenizer::{Message, TokenId};
use crate::tokens;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The engine's routes.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/state", get(admin_state))
        .route("/admin/faults", post(admin_faults))
        .route("/admin/crash", post(admin_crash))
        .route("/admin/hang", post(admin_hang))
        .route("/admin/unhang", post(admin_unhang))
        .route("/admin/clear", post(admin_clear))
        .fallback(not_found)
        .with_state(shared)
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "code", "param"}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code,
            message: message.into(),
        }
    }

    fn unavailable() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: "engine_unavailable",
            message: "the engine is restarting after a crash; retry later".into(),
        }
    }

    fn failed(reason: FailReason) -> Self {
        match reason {
            FailReason::Crash => Self {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: "server_error",
                code: "engine_crashed",
                message: "the engine crashed (simulated CUDA out of memory) while serving this \
                          request; retry later"
                    .into(),
            },
            FailReason::Unavailable => Self::unavailable(),
            FailReason::Shutdown => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "server_error",
                code: "engine_shutting_down",
                message: "the engine is shutting down".into(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "code": self.code,
            "param": null,
        }});
        (self.status, Json(body)).into_response()
    }
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<serde_json::Map<String, Value>>,
    /// Tool definitions: the template renders them into the prompt.
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(flatten)]
    sampling: Sampling,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: Value,
    #[serde(flatten)]
    sampling: Sampling,
}

/// The generation options both APIs share.
#[derive(Debug, Deserialize)]
struct Sampling {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    min_tokens: Option<u32>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    n: Option<u32>,
}

impl Sampling {
    /// The generation these options ask for, with `max_tokens` as the API resolved it.
    fn generation(
        self,
        kind: Kind,
        model: String,
        prompt: Vec<TokenId>,
        seed: u64,
        max_tokens: Option<u32>,
    ) -> Generation {
        Generation {
            kind,
            model,
            prompt_tokens: u32::try_from(prompt.len()).unwrap_or(u32::MAX),
            prompt,
            seed,
            max_tokens,
            min_tokens: self.min_tokens.unwrap_or(0),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
        }
    }
}

/// OpenAI's default `max_tokens` for the legacy completions API.
const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// What both endpoints reduce a request to.
#[derive(Debug)]
struct Generation {
    kind: Kind,
    model: String,
    prompt_tokens: u32,
    /// The prompt's token ids (the prefix cache's keys).
    prompt: Vec<TokenId>,
    seed: u64,
    max_tokens: Option<u32>,
    min_tokens: u32,
    ignore_eos: bool,
    stream: bool,
    include_usage: bool,
}

/// The messages of a chat request as the template reads them.
fn chat_messages(messages: Vec<serde_json::Map<String, Value>>) -> Vec<Message> {
    messages
        .into_iter()
        .map(|m| Message::from_json(&Value::Object(m)))
        .collect()
}

/// The completion seed of a chat: a hash of its messages' text.
fn chat_seed(messages: &[Message]) -> u64 {
    let texts: Vec<String> = messages.iter().map(Message::text).collect();
    tokens::prompt_seed(&texts.join("\n"))
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(
            "invalid_request",
            format!("the request body is not a valid request: {e}"),
        )
    })
}

fn check_n(n: Option<u32>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad_request(
            "unsupported_parameter",
            format!("n = {n} is not supported by the simulated engine; send n = 1"),
        )),
    }
}

async fn chat_completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let req: ChatRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = check_n(req.sampling.n) {
        return e.into_response();
    }
    let messages = chat_messages(req.messages);
    let prompt = shared
        .config
        .tokenizer
        .render_chat(&messages, req.tools.as_ref(), true);
    let seed = chat_seed(&messages);
    let max_tokens = req.max_completion_tokens.or(req.sampling.max_tokens);
    let generation = req
        .sampling
        .generation(Kind::Chat, req.model, prompt, seed, max_tokens);
    generate(shared, generation).await
}

async fn completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let req: CompletionRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = check_n(req.sampling.n) {
        return e.into_response();
    }
    // A string, a one-string array, or a token-id array (counted as given).
    let tokenizer = shared.config.tokenizer;
    let (prompt, seed) = match &req.prompt {
        Value::String(s) => (tokenizer.encode_prompt(s), tokens::prompt_seed(s)),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            let s = items[0].as_str().unwrap_or_default();
            (tokenizer.encode_prompt(s), tokens::prompt_seed(s))
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            let text = items
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(",");
            let ids = items
                .iter()
                .map(|v| v.as_u64().and_then(|id| TokenId::try_from(id).ok()))
                .map(|id| id.unwrap_or(TokenId::MAX))
                .collect();
            (ids, tokens::prompt_seed(&text))
        }
        _ => {
            return ApiError::bad_request(
                "invalid_prompt",
                "prompt must be a string, a one-string array, or an array of token ids \
                 (batched prompts are not supported by the simulated engine)",
            )
            .into_response()
        }
    };
    let max_tokens = Some(
        req.sampling
            .max_tokens
            .unwrap_or(COMPLETIONS_DEFAULT_MAX_TOKENS),
    );
    let generation = req
        .sampling
        .generation(Kind::Completion, req.model, prompt, seed, max_tokens);
    generate(shared, generation).await
}

/// Tells the scheduler to drop a request whose handler or stream is dropped (the client
/// went away), so its sequence and KV are freed at once.
struct CancelGuard {
    id: u64,
    shared: Arc<Shared>,
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.shared.commands.send(Command::Cancel(self.id));
        }
    }
}

/// One draw of the injected error rate; a cheap deterministic sequence is enough here.
fn injected_error(shared: &Shared, id: u64) -> bool {
    let rate = shared.faults.lock().error_rate;
    if rate <= 0.0 {
        return false;
    }
    let draw = (tokens::mix(id ^ 0x5eed) >> 11) as f64 / (1u64 << 53) as f64;
    draw < rate
}

async fn generate(shared: Arc<Shared>, g: Generation) -> Response {
    let arrived = shared.clock.now();
    let cfg = &shared.config;
    if g.model != cfg.model {
        return model_not_found(&g.model, &cfg.model);
    }
    let max_model_len = cfg.gpu.max_model_len;
    let max_tokens = match g.max_tokens {
        Some(0) => {
            return ApiError::bad_request("invalid_max_tokens", "max_tokens must be at least 1")
                .into_response()
        }
        Some(m) => m,
        None => max_model_len.saturating_sub(g.prompt_tokens).max(1),
    };
    let requested = g.prompt_tokens.saturating_add(max_tokens);
    if requested > max_model_len {
        return ApiError::bad_request(
            "context_length_exceeded",
            format!(
                "this model's maximum context length is {max_model_len} tokens; the request \
                 has {} prompt tokens and max_tokens {max_tokens} ({requested} in total): \
                 shorten the prompt or lower max_tokens",
                g.prompt_tokens
            ),
        )
        .into_response();
    }
    let (state, crashes) = {
        let stats = shared.stats.borrow();
        (stats.state, stats.crashes)
    };
    if state == EngineState::Crashed {
        shared.refuse_while_down(crashes);
        return ApiError::unavailable().into_response();
    }
    let id = shared.next_id();
    if injected_error(&shared, id) {
        shared.metrics.fail("injected_error");
        return ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: "injected_error",
            message: "injected fault: the engine failed this request on purpose".into(),
        }
        .into_response();
    }
    let latency_ms = shared.faults.lock().added_latency_ms;
    if latency_ms > 0.0 {
        let sim = Duration::from_secs_f64(latency_ms / 1000.0);
        tokio::time::sleep(shared.clock.real(sim)).await;
    }
    let completion_tokens = tokens::completion_tokens(
        g.seed,
        max_tokens,
        g.min_tokens,
        g.ignore_eos,
        cfg.output_tokens_min,
        cfg.output_tokens_max,
    );
    let finish_reason = if completion_tokens >= max_tokens {
        "length"
    } else {
        "stop"
    };
    // The prefix cache's keys: the blocks of prompt and completion, the completion's tokens
    // being known in advance (the same prompt always yields the same text).
    let hashes = if cfg.gpu.prefix_caching {
        let mut ids = g.prompt;
        ids.extend(
            (0..completion_tokens)
                .map(|i| cfg.tokenizer.generated_id(tokens::token_text(g.seed, i))),
        );
        crate::kv::block_hashes(&ids)
    } else {
        Vec::new()
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut guard = CancelGuard {
        id,
        shared: shared.clone(),
        armed: true,
    };
    let submitted = shared.commands.send(Command::Submit(Submission {
        id,
        prompt_tokens: g.prompt_tokens,
        completion_tokens,
        hashes,
        finish_reason,
        arrived,
        events: tx,
    }));
    if submitted.is_err() {
        guard.armed = false;
        return ApiError::failed(FailReason::Shutdown).into_response();
    }
    // Answer only once the first token exists (or the request failed), so a request that
    // fails before its first token gets a proper error status.
    let mut cached_tokens = 0;
    let first = loop {
        match rx.recv().await {
            Some(SeqEvent::Admitted { cached }) => cached_tokens = cached,
            Some(SeqEvent::Token(index)) => break index,
            Some(SeqEvent::Finished) | None => {
                guard.armed = false;
                return ApiError::failed(FailReason::Shutdown).into_response();
            }
            Some(SeqEvent::Failed(reason)) => {
                guard.armed = false;
                return ApiError::failed(reason).into_response();
            }
            Some(SeqEvent::Rejected(e)) => {
                guard.armed = false;
                return match e {
                    SubmitError::Unavailable => ApiError::unavailable(),
                    SubmitError::TooLong { .. } | SubmitError::DuplicateId => {
                        ApiError::bad_request("invalid_request", format!("rejected: {e:?}"))
                    }
                }
                .into_response();
            }
        }
    };
    let reply = Reply {
        kind: g.kind,
        id: match g.kind {
            Kind::Chat => format!("chatcmpl-{id}"),
            Kind::Completion => format!("cmpl-{id}"),
        },
        created: unix_now(),
        model: g.model,
        seed: g.seed,
        prompt_tokens: g.prompt_tokens,
        cached_tokens,
        completion_tokens,
        finish_reason,
        include_usage: g.include_usage,
    };
    if g.stream {
        stream_response(reply, first, rx, guard)
    } else {
        // The handler future holds the guard: if the client goes away, hyper drops the
        // future and the guard cancels the sequence.
        let mut last = first;
        loop {
            match rx.recv().await {
                Some(SeqEvent::Token(index)) => last = index,
                Some(SeqEvent::Admitted { .. }) => {}
                Some(SeqEvent::Finished) => break,
                Some(SeqEvent::Failed(reason)) => {
                    guard.armed = false;
                    return ApiError::failed(reason).into_response();
                }
                Some(SeqEvent::Rejected(_)) | None => {
                    guard.armed = false;
                    return ApiError::failed(FailReason::Shutdown).into_response();
                }
            }
        }
        guard.armed = false;
        debug_assert_eq!(last + 1, completion_tokens);
        Json(reply.full_body()).into_response()
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Everything needed to render a response or its chunks.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    seed: u64,
    prompt_tokens: u32,
    /// Prompt tokens found in the prefix cache.
    cached_tokens: u32,
    completion_tokens: u32,
    finish_reason: &'static str,
    include_usage: bool,
}

impl Reply {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn full_body(&self) -> Value {
        let text = tokens::completion_text(self.seed, self.completion_tokens);
        match self.kind {
            Kind::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": self.finish_reason,
                }],
                "usage": self.usage(),
            }),
            Kind::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": self.finish_reason,
                }],
                "usage": self.usage(),
            }),
        }
    }

    /// One SSE chunk whose choice carries `delta` (chat) or `text` (completions).
    fn chunk(&self, out: &mut Vec<u8>, text: Option<&str>, role: bool, finish: bool) {
        let finish_reason = if finish {
            Value::from(self.finish_reason)
        } else {
            Value::Null
        };
        let mut body = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{
                        "index": 0,
                        "delta": delta,
                        "logprobs": null,
                        "finish_reason": finish_reason,
                    }],
                })
            }
            Kind::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": text.unwrap_or(""),
                    "logprobs": null,
                    "finish_reason": finish_reason,
                }],
            }),
        };
        if self.include_usage {
            if let Some(obj) = body.as_object_mut() {
                obj.insert("usage".into(), Value::Null);
            }
        }
        sse_data(out, &body);
    }

    /// The end of a stream: the finish chunk, the usage chunk when asked for, `[DONE]`.
    fn finish(&self, out: &mut Vec<u8>) {
        self.chunk(out, None, false, true);
        if self.include_usage {
            let object = match self.kind {
                Kind::Chat => "chat.completion.chunk",
                Kind::Completion => "text_completion",
            };
            let body = json!({
                "id": self.id,
                "object": object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.usage(),
            });
            sse_data(out, &body);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
}

fn sse_data(out: &mut Vec<u8>, body: &Value) {
    out.extend_from_slice(b"data: ");
    // Writing JSON into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, body);
    out.extend_from_slice(b"\n\n");
}

struct StreamState {
    reply: Reply,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    guard: CancelGuard,
    pending: Option<Vec<u8>>,
    done: bool,
}

impl StreamState {
    /// Renders one event; returns Err when the request failed mid-stream.
    fn render(&mut self, event: SeqEvent, out: &mut Vec<u8>) -> Result<(), std::io::Error> {
        match event {
            SeqEvent::Admitted { .. } => Ok(()),
            SeqEvent::Token(index) => {
                let text = tokens::token_text(self.reply.seed, index);
                self.reply.chunk(out, Some(text), false, false);
                Ok(())
            }
            SeqEvent::Finished => {
                self.reply.finish(out);
                self.guard.armed = false;
                self.done = true;
                Ok(())
            }
            SeqEvent::Failed(reason) => {
                self.guard.armed = false;
                self.done = true;
                Err(std::io::Error::other(format!(
                    "the engine failed this stream: {reason:?}"
                )))
            }
            SeqEvent::Rejected(_) => {
                self.guard.armed = false;
                self.done = true;
                Err(std::io::Error::other("the engine rejected this stream"))
            }
        }
    }
}

/// An SSE response. Every token available when the body is polled goes out in one frame, so
/// a busy engine writes once per stream per step, not once per token. A failure mid-stream
/// (a crash) ends the body with an error: the connection is cut without `[DONE]`, as when a
/// real engine dies.
fn stream_response(
    reply: Reply,
    first: u32,
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    guard: CancelGuard,
) -> Response {
    let mut head = Vec::with_capacity(512);
    // OpenAI's first chat chunk carries the role; the token follows in its own chunk.
    if reply.kind == Kind::Chat {
        reply.chunk(&mut head, Some(""), true, false);
    }
    let mut state = StreamState {
        reply,
        rx,
        guard,
        pending: None,
        done: false,
    };
    let mut out = head;
    // The first token was already received; a render error cannot happen for a token.
    let _ = state.render(SeqEvent::Token(first), &mut out);
    state.pending = Some(out);
    let body = futures::stream::unfold(state, |mut st| async move {
        if let Some(out) = st.pending.take() {
            return Some((Ok(Bytes::from(out)), st));
        }
        if st.done {
            return None;
        }
        let event = st
            .rx
            .recv()
            .await
            .unwrap_or(SeqEvent::Failed(FailReason::Shutdown));
        let mut out = Vec::with_capacity(256);
        let mut result = st.render(event, &mut out);
        while result.is_ok() && !st.done {
            match st.rx.try_recv() {
                Ok(event) => result = st.render(event, &mut out),
                Err(_) => break,
            }
        }
        match result {
            Ok(()) => Some((Ok(out), st)),
            Err(e) => Some((Err(e), st)),
        }
        .map(|(r, st)| (r.map(Bytes::from), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| {
            ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                kind: "server_error",
                code: "internal_error",
                message: format!("could not build the stream response: {e}"),
            }
            .into_response()
        })
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        code: "not_found",
        message: format!(
            "no route {}: the engine serves /v1/chat/completions, /v1/completions, \
             /v1/models, /tokenize, /health, /metrics and /admin/*",
            uri.path()
        ),
    }
    .into_response()
}

/// The body of `POST /tokenize`, in vLLM's shape: a plain `prompt`, or chat `messages`
/// (with optional `tools`) rendered through the template.
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<serde_json::Map<String, Value>>>,
    #[serde(default)]
    tools: Option<Value>,
    /// Whether the reply header ends the rendered chat (vLLM's default: true).
    #[serde(default)]
    add_generation_prompt: Option<bool>,
}

/// `POST /tokenize`: the prompt's token ids as this engine counts them, so a gateway can ask
/// for exact counts. `{"count", "max_model_len", "tokens"}`.
async fn tokenize(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let req: TokenizeRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let cfg = &shared.config;
    if let Some(model) = req.model.as_deref().filter(|m| *m != cfg.model) {
        return model_not_found(model, &cfg.model);
    }
    if shared.stats.borrow().state == EngineState::Crashed {
        return ApiError::unavailable().into_response();
    }
    let ids = match (req.prompt, req.messages) {
        (Some(prompt), None) => cfg.tokenizer.encode_prompt(&prompt),
        (None, Some(messages)) => cfg.tokenizer.render_chat(
            &chat_messages(messages),
            req.tools.as_ref(),
            req.add_generation_prompt.unwrap_or(true),
        ),
        _ => {
            return ApiError::bad_request(
                "invalid_request",
                "send either `prompt` (a string) or `messages` (a chat), not both",
            )
            .into_response()
        }
    };
    Json(json!({
        "count": ids.len(),
        "max_model_len": cfg.gpu.max_model_len,
        "tokens": ids,
    }))
    .into_response()
}

fn model_not_found(asked: &str, served: &str) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        code: "model_not_found",
        message: format!("the model `{asked}` does not exist; this engine serves `{served}`"),
    }
    .into_response()
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    if shared.stats.borrow().state == EngineState::Crashed {
        return ApiError::unavailable().into_response();
    }
    let cfg = &shared.config;
    Json(json!({
        "object": "list",
        "data": [{
            "id": cfg.model,
            "object": "model",
            "created": 0,
            "owned_by": "levee-engine",
            "max_model_len": cfg.gpu.max_model_len,
        }],
    }))
    .into_response()
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    match shared.stats.borrow().state {
        EngineState::Healthy | EngineState::Hung => StatusCode::OK.into_response(),
        EngineState::Crashed | EngineState::Stopped => ApiError::unavailable().into_response(),
    }
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    match shared.metrics.render() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: "metrics_encoding",
            message: format!("could not encode metrics: {e}"),
        }
        .into_response(),
    }
}

/// The body of `GET /admin/state` (and of every admin POST's answer).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdminState {
    /// The profile the config started from.
    pub profile: String,
    /// The served model name.
    pub model: String,
    /// `preempt` or `crash`.
    pub overload: crate::config::OverloadMode,
    /// Simulated seconds a crash keeps the engine down.
    pub restart_secs: f64,
    /// Simulated seconds per real second.
    pub time_scale: f64,
    /// What the engine is doing.
    pub stats: EngineStats,
    /// Faults in force.
    pub faults: Faults,
}

pub(crate) fn admin_state_of(shared: &Shared) -> AdminState {
    AdminState {
        profile: shared.config.profile.clone(),
        model: shared.config.model.clone(),
        overload: shared.config.gpu.overload,
        restart_secs: shared.config.gpu.restart_secs,
        time_scale: shared.config.time_scale,
        stats: shared.stats_now(),
        faults: shared.faults.lock().clone(),
    }
}

async fn admin_state(State(shared): State<Arc<Shared>>) -> Json<AdminState> {
    Json(admin_state_of(&shared))
}

async fn admin_faults(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let update: FaultsUpdate = match serde_json::from_slice(&body) {
        Ok(u) => u,
        Err(e) => {
            return ApiError::bad_request(
                "invalid_faults",
                format!("body must be JSON with any of added_latency_ms, error_rate, hang: {e}"),
            )
            .into_response()
        }
    };
    match shared.update_faults(&update) {
        Ok(_) => Json(admin_state_of(&shared)).into_response(),
        Err(e) => ApiError::bad_request("invalid_faults", e.to_string()).into_response(),
    }
}

/// Applies `cmd` and answers with the state once the scheduler has published a snapshot
/// that reflects it.
async fn admin_after(
    shared: Arc<Shared>,
    cmd: Command,
    done: fn(&EngineStats) -> bool,
) -> Response {
    if shared.commands.send(cmd).is_err() {
        return ApiError::failed(FailReason::Shutdown).into_response();
    }
    let mut rx = shared.stats.clone();
    // The scheduler publishes after every command; a stopped engine ends the wait too.
    let _ = rx
        .wait_for(|s| done(s) || s.state == EngineState::Stopped)
        .await;
    Json(admin_state_of(&shared)).into_response()
}

async fn admin_crash(State(shared): State<Arc<Shared>>) -> Response {
    admin_after(shared, Command::Crash, |s| s.state == EngineState::Crashed).await
}

async fn admin_hang(State(shared): State<Arc<Shared>>) -> Response {
    set_hang(&shared, true)
}

async fn admin_unhang(State(shared): State<Arc<Shared>>) -> Response {
    set_hang(&shared, false)
}

fn set_hang(shared: &Shared, hang: bool) -> Response {
    if let Err(e) = shared.update_faults(&FaultsUpdate {
        hang: Some(hang),
        ..FaultsUpdate::default()
    }) {
        return ApiError::bad_request("invalid_faults", e.to_string()).into_response();
    }
    Json(admin_state_of(shared)).into_response()
}

async fn admin_clear(State(shared): State<Arc<Shared>>) -> Response {
    let cleared = FaultsUpdate {
        added_latency_ms: Some(0.0),
        error_rate: Some(0.0),
        hang: Some(false),
    };
    if let Err(e) = shared.update_faults(&cleared) {
        return ApiError::bad_request("invalid_faults", e.to_string()).into_response();
    }
    Json(admin_state_of(&shared)).into_response()
}
