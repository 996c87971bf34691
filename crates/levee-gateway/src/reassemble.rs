//! A non-streamed answer put back together from the stream levee asked for in its place.
//!
//! llama-server notices that the client of a non-streamed request has gone only when a whole
//! second passes with nothing else for it to do (no other request's progress, no `/metrics`
//! read): under load it never does, and the abandoned request runs to its last token. A
//! stream is cancelled at its next token. So levee asks a llama-server for a stream whenever
//! its own client did not, reads it whole, and answers the client with the body the engine
//! would have sent unstreamed (docs/gateway.md, "Client gone").
//!
//! Chat chunks (`chat.completion.chunk`) become one `chat.completion`: per choice, the
//! deltas' strings appended (`content`, `reasoning_content`, …), `role` kept, `tool_calls`
//! merged by their index (their `arguments` appended), `logprobs` lists appended, the last
//! `finish_reason` kept. Text-completion chunks append their `text`. The top-level fields
//! come from the first chunk, `usage` and `timings` from the last that carried them.

use crate::error::GatewayError;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The answer so far, one SSE event at a time.
#[derive(Debug, Default)]
pub(crate) struct Reassembly {
    /// The first chunk's top-level fields, except its choices.
    head: Option<Map<String, Value>>,
    /// Top-level fields a later chunk sets (`usage`, `timings`): the last non-null wins.
    tail: Map<String, Value>,
    choices: BTreeMap<u64, Choice>,
    /// `[DONE]` came.
    done: bool,
}

#[derive(Debug, Default)]
struct Choice {
    /// Chat: the message's fields. Text completion: `text`.
    fields: Map<String, Value>,
    /// Chat: the tool calls, by their index.
    tool_calls: BTreeMap<u64, Map<String, Value>>,
    /// Other fields of the choice (`logprobs`, `finish_reason`, …).
    rest: Map<String, Value>,
    chat: bool,
}

impl Reassembly {
    /// Takes one SSE event (its lines, as the backend framed them). Comments and events
    /// without data are skipped.
    pub(crate) fn event(&mut self, event: &[u8]) -> Result<(), GatewayError> {
        let text = std::str::from_utf8(event)
            .map_err(|_| broken("an event of the stream is not UTF-8"))?;
        let data = text
            .split(['\r', '\n'])
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|l| l.strip_prefix(' ').unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
        let data = data.trim();
        if data.is_empty() {
            return Ok(());
        }
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let Value::Object(mut chunk) = serde_json::from_str::<Value>(data)
            .map_err(|e| broken(&format!("an event of the stream is not JSON ({e})")))?
        else {
            return Err(broken("an event of the stream is not a JSON object"));
        };
        if let Some(err) = chunk.get("error") {
            let message = err
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| err.to_string(), str::to_string);
            return Err(GatewayError::upstream(format!(
                "the backend failed mid-answer: {message}"
            )));
        }
        let choices = chunk.remove("choices");
        for key in ["usage", "timings"] {
            if let Some(v) = chunk.remove(key) {
                if !v.is_null() {
                    self.tail.insert(key.into(), v);
                }
            }
        }
        if self.head.is_none() {
            self.head = Some(chunk);
        }
        if let Some(Value::Array(choices)) = choices {
            for c in choices {
                if let Value::Object(c) = c {
                    self.choice(c);
                }
            }
        }
        Ok(())
    }

    fn choice(&mut self, mut c: Map<String, Value>) {
        let index = c.get("index").and_then(Value::as_u64).unwrap_or(0);
        let choice = self.choices.entry(index).or_default();
        if let Some(Value::Object(delta)) = c.remove("delta") {
            choice.chat = true;
            for (k, v) in delta {
                match (k.as_str(), v) {
                    ("tool_calls", Value::Array(calls)) => {
                        for call in calls {
                            if let Value::Object(call) = call {
                                choice.tool_call(call);
                            }
                        }
                    }
                    ("role", v) => {
                        choice.fields.insert(k, v);
                    }
                    (_, v) => append(&mut choice.fields, k, v),
                }
            }
        }
        if let Some(text) = c.remove("text") {
            append(&mut choice.fields, "text".into(), text);
        }
        for (k, v) in c {
            match k.as_str() {
                "index" => {}
                "logprobs" => append_lists(&mut choice.rest, k, v),
                _ if v.is_null() && choice.rest.contains_key(&k) => {}
                _ => {
                    choice.rest.insert(k, v);
                }
            }
        }
    }

    /// The whole answer's body. A stream that ended before its answer did (no
    /// `finish_reason`, no `[DONE]`) is an error: the answer would be cut off.
    pub(crate) fn finish(self) -> Result<Vec<u8>, GatewayError> {
        let finished = self
            .choices
            .values()
            .any(|c| c.rest.get("finish_reason").is_some_and(|f| !f.is_null()));
        if !(self.done || finished) {
            return Err(broken("the stream ended before the answer did"));
        }
        let mut out = self.head.unwrap_or_default();
        if let Some(Value::String(object)) = out.get_mut("object") {
            if let Some(whole) = object.strip_suffix(".chunk") {
                *object = whole.to_string();
            }
        }
        let choices = self
            .choices
            .into_iter()
            .map(|(index, c)| c.into_value(index))
            .collect();
        out.insert("choices".into(), Value::Array(choices));
        out.extend(self.tail);
        serde_json::to_vec(&out)
            .map_err(|e| GatewayError::internal(format!("cannot encode the answer: {e}")))
    }
}

impl Choice {
    fn tool_call(&mut self, mut call: Map<String, Value>) {
        let index = call.remove("index").and_then(|i| i.as_u64()).unwrap_or(0);
        let whole = self.tool_calls.entry(index).or_default();
        for (k, v) in call {
            match (k.as_str(), v) {
                ("function", Value::Object(f)) => {
                    let Value::Object(into) = whole
                        .entry("function")
                        .or_insert_with(|| Value::Object(Map::new()))
                    else {
                        continue;
                    };
                    for (fk, fv) in f {
                        append(into, fk, fv);
                    }
                }
                (_, Value::Null) => {
                    whole.entry(k).or_insert(Value::Null);
                }
                (_, v) => {
                    whole.insert(k, v);
                }
            }
        }
    }

    fn into_value(self, index: u64) -> Value {
        let mut out = Map::new();
        out.insert("index".into(), Value::from(index));
        if self.chat {
            let mut message = self.fields;
            message
                .entry("role")
                .or_insert_with(|| Value::from("assistant"));
            message.entry("content").or_insert(Value::Null);
            if !self.tool_calls.is_empty() {
                let calls = self.tool_calls.into_values().map(Value::Object).collect();
                message.insert("tool_calls".into(), Value::Array(calls));
            }
            out.insert("message".into(), Value::Object(message));
        } else {
            out.extend(self.fields);
        }
        out.extend(self.rest);
        out.entry("finish_reason").or_insert(Value::Null);
        Value::Object(out)
    }
}

/// Appends `v` to the field `k`: strings are concatenated; a null leaves what is there (or
/// sets null); anything else replaces it.
fn append(into: &mut Map<String, Value>, k: String, v: Value) {
    match (into.get_mut(&k), v) {
        (Some(Value::String(s)), Value::String(more)) => s.push_str(&more),
        (Some(_), Value::Null) => {}
        (_, v) => {
            into.insert(k, v);
        }
    }
}

/// Merges a chunk's `logprobs` into the answer's: every list in it appended to the list of
/// the same name (`content` for chat; `tokens`, `token_logprobs`, … for text completions).
fn append_lists(into: &mut Map<String, Value>, k: String, v: Value) {
    match (into.get_mut(&k), v) {
        (Some(Value::Object(have)), Value::Object(more)) => {
            for (field, value) in more {
                match (have.get_mut(&field), value) {
                    (Some(Value::Array(list)), Value::Array(items)) => list.extend(items),
                    (Some(_), Value::Null) => {}
                    (_, value) => {
                        have.insert(field, value);
                    }
                }
            }
        }
        (Some(_), Value::Null) => {}
        (_, v) => {
            into.insert(k, v);
        }
    }
}

fn broken(why: &str) -> GatewayError {
    GatewayError::upstream(format!(
        "the backend's answer stream broke off: {why}; retry the request"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn whole(events: &[Value]) -> Value {
        let mut r = Reassembly::default();
        for e in events {
            r.event(format!("data: {e}\n\n").as_bytes()).unwrap();
        }
        r.event(b"data: [DONE]\n\n").unwrap();
        serde_json::from_slice(&r.finish().unwrap()).unwrap()
    }

    fn chunk(choice: Value) -> Value {
        json!({"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
               "choices": [choice]})
    }

    #[test]
    fn chat_deltas_become_one_message_with_the_last_usage() {
        let got = whole(&[
            chunk(
                json!({"index": 0, "delta": {"role": "assistant", "content": null},
                         "finish_reason": null}),
            ),
            chunk(json!({"index": 0, "delta": {"content": "Hel"}, "finish_reason": null})),
            chunk(json!({"index": 0, "delta": {"reasoning_content": "think"}})),
            chunk(json!({"index": 0, "delta": {"content": "lo"}, "finish_reason": null})),
            chunk(json!({"index": 0, "delta": {}, "finish_reason": "length"})),
            json!({"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                   "total_tokens": 5}, "timings": {"prompt_n": 3}}),
        ]);
        assert_eq!(
            got,
            json!({"id": "c1", "object": "chat.completion", "created": 7, "model": "m",
                   "choices": [{"index": 0, "finish_reason": "length",
                                "message": {"role": "assistant", "content": "Hello",
                                            "reasoning_content": "think"}}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                   "timings": {"prompt_n": 3}})
        );
    }

    #[test]
    fn tool_calls_merge_by_index_and_logprobs_append() {
        let call = |i: u64, f: Value| {
            json!({"index": 0, "delta": {"tool_calls": [
            {"index": i, "function": f}]}})
        };
        let mut first = call(0, json!({"name": "get", "arguments": ""}));
        first["delta"]["tool_calls"][0]["id"] = json!("t0");
        first["delta"]["tool_calls"][0]["type"] = json!("function");
        let got = whole(&[
            chunk(first),
            chunk(call(0, json!({"arguments": "{\"a\":"}))),
            chunk(call(1, json!({"name": "put", "arguments": "{}"}))),
            chunk(call(0, json!({"arguments": "1}"}))),
            chunk(json!({"index": 0, "delta": {"content": "x"},
                         "logprobs": {"content": [{"token": "x"}]}})),
            chunk(json!({"index": 0, "delta": {"content": "y"},
                         "logprobs": {"content": [{"token": "y"}]},
                         "finish_reason": "tool_calls"})),
        ]);
        let c = &got["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls");
        assert_eq!(c["message"]["content"], "xy");
        assert_eq!(
            c["message"]["tool_calls"],
            json!([{"id": "t0", "type": "function",
                    "function": {"name": "get", "arguments": "{\"a\":1}"}},
                   {"function": {"name": "put", "arguments": "{}"}}])
        );
        assert_eq!(
            c["logprobs"],
            json!({"content": [{"token": "x"}, {"token": "y"}]})
        );
    }

    #[test]
    fn text_completions_append_their_text() {
        let text = |t: &str, f: Value| {
            json!({"id": "t", "object": "text_completion", "model": "m",
                   "choices": [{"index": 0, "text": t, "logprobs": null, "finish_reason": f}]})
        };
        let got = whole(&[
            text(" a", Value::Null),
            text(" time", Value::Null),
            text("", json!("stop")),
        ]);
        assert_eq!(
            got["choices"],
            json!([{"index": 0, "text": " a time", "logprobs": null, "finish_reason": "stop"}])
        );
        assert_eq!(got["object"], "text_completion");
    }

    #[test]
    fn a_stream_cut_before_its_end_or_carrying_an_error_is_an_error() {
        let mut r = Reassembly::default();
        r.event(
            format!(
                "data: {}\n\n",
                chunk(json!({"index": 0, "delta": {"content": "a"}}))
            )
            .as_bytes(),
        )
        .unwrap();
        let e = r.finish().unwrap_err();
        assert!(
            e.message().contains("ended before the answer did"),
            "{}",
            e.message()
        );
        let mut r = Reassembly::default();
        let e = r
            .event(b"data: {\"error\":{\"message\":\"context full\",\"code\":500}}\n\n")
            .unwrap_err();
        assert!(e.message().contains("context full"), "{}", e.message());
    }
}
