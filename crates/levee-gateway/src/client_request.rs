//! A client's completion request as the gateway reads it: the few top-level fields it uses
//! and the prompt's text to count, read without building trees of owned JSON values (a
//! string without escapes is borrowed from the body, not copied).

use crate::error::GatewayError;
use crate::lite::Lite;
use crate::tokenize::PromptText;
use bytes::Bytes;
use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;

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
struct Head<'a> {
    model: Option<Lite<'a>>,
    stream: Option<Lite<'a>>,
    max_tokens: Option<Lite<'a>>,
    max_completion_tokens: Option<Lite<'a>>,
    stream_options: Option<Lite<'a>>,
    messages: Option<Lite<'a>>,
    prompt: Option<Lite<'a>>,
    n: Option<Lite<'a>>,
    best_of: Option<Lite<'a>>,
    /// Tool (and legacy function) definitions: the engine renders them into the prompt.
    tools: Option<Lite<'a>>,
    functions: Option<Lite<'a>>,
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
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HeadKey;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HeadKey, E> {
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

impl<'de> Deserialize<'de> for Head<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Head<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Head<'de>, A::Error> {
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
                            m.next_value::<IgnoredAny>()?;
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
fn content_text(content: Lite<'_>) -> (Cow<'_, str>, u64) {
    match content {
        Lite::Str(s) => (s, 0),
        Lite::Arr(parts) => {
            let mut text = Cow::Borrowed("");
            let mut images = 0;
            for mut p in parts {
                let kind = p.get("type").and_then(Lite::as_str);
                if matches!(kind, Some("image_url" | "input_image" | "image")) {
                    images += 1;
                }
                if let Some(Lite::Str(t)) = p.take("text") {
                    if text.is_empty() {
                        text = t;
                    } else {
                        text.to_mut().push_str(&t);
                    }
                }
            }
            (text, images)
        }
        _ => (Cow::Borrowed(""), 0),
    }
}

/// One chat message's text: its content, and the name and arguments of each tool (or
/// function) call it makes, which the engine renders into the prompt too.
fn message_text(mut m: Lite<'_>) -> (Cow<'_, str>, u64) {
    let (mut text, images) = m.take("content").map(content_text).unwrap_or_default();
    let calls = m
        .get("tool_calls")
        .and_then(Lite::as_array)
        .into_iter()
        .flatten()
        .filter_map(|c| c.get("function"))
        .chain(m.get("function_call"));
    for f in calls {
        for key in ["name", "arguments"] {
            if let Some(s) = f.get(key).and_then(Lite::as_str) {
                text.to_mut().push_str(s);
            }
        }
    }
    (text, images)
}

/// The prompt's text: each chat message's content and tool calls, and the tool definitions
/// as their JSON (chat); or each `prompt` string.
fn prompt_text<'a>(
    messages: Option<Lite<'a>>,
    prompt: Option<Lite<'a>>,
    tools: [Option<Lite<'a>>; 2],
) -> PromptText<'a> {
    if let Some(Lite::Arr(msgs)) = messages {
        let mut images = 0;
        let parts = msgs
            .into_iter()
            .map(|m| {
                let (text, n) = message_text(m);
                images += n;
                text
            })
            .collect();
        let tools: String = tools
            .iter()
            .flatten()
            .filter(|t| **t != Lite::Null)
            .filter_map(|t| serde_json::to_string(t).ok())
            .collect();
        return PromptText {
            tools: (!tools.is_empty()).then_some(Cow::Owned(tools)),
            parts,
            chat: true,
            token_ids: 0,
            images,
        };
    }
    let mut out = PromptText::default();
    match prompt {
        Some(Lite::Str(s)) => out.parts.push(s),
        Some(Lite::Arr(items)) => {
            for i in items {
                match i {
                    Lite::Str(s) => out.parts.push(s),
                    Lite::Num(_) => out.token_ids += 1,
                    Lite::Arr(ids) => out.token_ids += ids.len() as u64,
                    _ => {}
                }
            }
        }
        _ => {}
    }
    out
}

/// `n` or `best_of`: 1 when absent, else a positive integer.
fn choice_count(v: Option<Lite<'_>>, name: &'static str) -> Result<u32, GatewayError> {
    match v {
        None | Some(Lite::Null) => Ok(1),
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
    /// Parses a request body. The request keeps a copy of `body` in an allocation of its
    /// own (see the type doc); the prompt's text comes back beside it, borrowed from `body`
    /// where it can be, to be counted and dropped (a queued request keeps only its raw body).
    pub fn parse(body: &[u8]) -> Result<(ClientRequest, PromptText<'_>), GatewayError> {
        Self::parse_keyed(body, false)
    }

    /// [`ClientRequest::parse`], also keying the conversation when `conversation` is set.
    pub fn parse_keyed(
        body: &[u8],
        conversation: bool,
    ) -> Result<(ClientRequest, PromptText<'_>), GatewayError> {
        // Read as text, checked once: serde_json then checks no string again.
        let text = std::str::from_utf8(body).map_err(|_| {
            GatewayError::bad_request("the request body is not UTF-8 (JSON must be)")
        })?;
        let head: Head = serde_json::from_str(text).map_err(|e| {
            if e.classify() == serde_json::error::Category::Data {
                GatewayError::bad_request("request body must be a JSON object")
            } else {
                GatewayError::bad_request(format!("request body is not valid JSON: {e}"))
            }
        })?;
        let model = match head.model {
            Some(Lite::Str(s)) if !s.is_empty() => s.into_owned(),
            _ => {
                return Err(
                    GatewayError::bad_request("`model` is required and must be a string")
                        .with_param("model"),
                )
            }
        };
        let stream = match head.stream {
            None | Some(Lite::Null) => false,
            Some(Lite::Bool(b)) => b,
            Some(_) => {
                return Err(
                    GatewayError::bad_request("`stream` must be a boolean").with_param("stream")
                )
            }
        };
        let has_max_completion_tokens = head.max_completion_tokens.is_some();
        let max_tokens =
            match head.max_completion_tokens.or(head.max_tokens) {
                None | Some(Lite::Null) => None,
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
            .and_then(Lite::as_bool)
            .unwrap_or(false);
        let choices = choice_count(head.n, "n")?.max(choice_count(head.best_of, "best_of")?);
        let conversation = conversation
            .then(|| crate::session::of_conversation(head.messages.as_ref()))
            .flatten();
        let prompt = prompt_text(head.messages, head.prompt, [head.tools, head.functions]);
        Ok((
            ClientRequest {
                raw: Bytes::copy_from_slice(body),
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
    /// and with `stream_with_usage` a stream asked for with `stream_options.include_usage`
    /// (the client's own stream, or one levee reads whole in place of a non-streamed
    /// answer). Unchanged bytes (no copy) when none of these changes anything.
    pub fn upstream_body(
        &self,
        model: &str,
        cap: Option<u32>,
        stream_with_usage: bool,
    ) -> Result<Bytes, GatewayError> {
        use serde_json::{Map, Value};
        if model == self.model && cap.is_none() && !stream_with_usage {
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
        if stream_with_usage {
            body.insert("stream".into(), Value::Bool(true));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_for_an_engines_count_is_the_chat_or_the_prompt_string() {
        use crate::upstream::PromptSource;
        let src = |body: &str| {
            ClientRequest::parse(body.as_bytes())
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
            let body = body.to_string();
            let (_, p) = ClientRequest::parse(body.as_bytes()).unwrap();
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
    fn unchanged_bodies_are_forwarded_as_received() {
        let raw =
            br#"{"model":"m","messages":[{"role":"user","content":"hi \u00e9"}],"max_tokens":5}"#;
        let (r, _) = ClientRequest::parse(raw).unwrap();
        let same = r.upstream_body("m", None, false).unwrap();
        assert_eq!(&same[..], &raw[..]);

        let v: serde_json::Value =
            serde_json::from_slice(&r.upstream_body("up", Some(3), true).unwrap()).unwrap();
        assert_eq!(v["model"], "up");
        assert_eq!(v["max_tokens"], 3);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["stream"], true, "asked for a stream, with its usage");
        assert_eq!(v["messages"][0]["content"], "hi \u{e9}");

        let (r, _) =
            ClientRequest::parse(br#"{"model":"m","max_completion_tokens":9,"max_tokens":1}"#)
                .unwrap();
        assert_eq!(r.max_tokens, Some(9));
        let v: serde_json::Value =
            serde_json::from_slice(&r.upstream_body("m", Some(4), false).unwrap()).unwrap();
        assert_eq!(v["max_completion_tokens"], 4);
        assert_eq!(v["max_tokens"], 1);
    }

    #[test]
    fn parse_reads_the_fields_we_need() {
        let parse = |b: &'static [u8]| ClientRequest::parse(b).map(|(r, _)| r);
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
        let e = ClientRequest::parse(b"[1]").unwrap_err();
        assert_eq!(e.message(), "request body must be a JSON object");
        let e = ClientRequest::parse(b"{\"model\":\"m\"} x").unwrap_err();
        assert!(
            e.message().starts_with("request body is not valid JSON"),
            "{}",
            e.message()
        );
        let e = ClientRequest::parse(br#"{"model":"m","stream":1}"#).unwrap_err();
        assert_eq!(e.param(), Some("stream"));
        // Later duplicates win, as with a map.
        let (r, _) = ClientRequest::parse(br#"{"model":"a","model":"b"}"#).unwrap();
        assert_eq!(r.model, "b");
    }

    #[test]
    fn strings_are_borrowed_unless_escaped_and_repeated_keys_read_as_the_last() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"plain"},
            {"role":"user","content":"a\nb"},{"role":"user","content":"x","content":"last"},
            7, {"role":"user","content":[{"type":"text","text":"p1"},{"type":"text","text":"p2"},
            {"type":"input_image"},{"text":3}]}]}"#;
        let (_, p) = ClientRequest::parse(body).unwrap();
        assert!(matches!(p.parts[0], Cow::Borrowed("plain")));
        assert!(matches!(&p.parts[1], Cow::Owned(s) if s == "a\nb"));
        assert_eq!(p.parts[2], "last");
        // A message that is not an object still counts as one (its framing), with no text.
        assert_eq!(p.parts[3], "");
        assert_eq!(p.parts[4], "p1p2");
        assert_eq!(p.images, 1);
        assert!(p.chat);
        let (_, p) = ClientRequest::parse(br#"{"model":"m","prompt":["a",[1,2],3,null]}"#).unwrap();
        assert_eq!(p.parts, vec![Cow::Borrowed("a")]);
        assert_eq!(p.token_ids, 3);
        assert!(!p.chat);
    }
}
