//! The response cache: stored answers to deterministic requests, served when the lane is
//! degraded past a configured level or when no backend can serve at all (a breaker
//! fallback), marked `x-levee-degraded: cache`.
//!
//! What may be stored and served (the hit, miss and bypass rules):
//! - only for a tenant that opted in (`response_cache = true`), and only its own answers:
//!   the key includes the tenant, so no tenant learns what another asked;
//! - only deterministic requests: `temperature` given and 0, one choice (`n`, `best_of`
//!   absent or 1); anything else bypasses the cache (never stored, never served);
//! - the key is exact: the tenant, the model asked for, the normalised messages (role,
//!   content, name, tool calls; strings trimmed; object keys in order) or prompt, and every
//!   other body field (sampling parameters, `max_tokens`, `seed`, `stop`, tools, format),
//!   except `stream`, `stream_options` and `user`, which do not change the answer;
//! - stored: a backend's 200 answer to a non-streamed, undegraded request; served to a
//!   streamed request as one SSE chunk;
//! - bounded memory: at most `max_bytes` of answer bodies, least recently used out first;
//!   an entry older than `ttl` is a miss.

use bytes::Bytes;
use levee_policy::Timestamp;
use parking_lot::Mutex;
use serde_json::Value;
use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;
use std::time::Duration;

/// A request's place in the cache (two independent keyed 64-bit hashes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct CacheKey(u64, u64);

/// Why a request does not use the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bypass {
    /// Sampling is random: `temperature` absent or not 0.
    NotDeterministic,
    /// More than one choice asked for.
    ManyChoices,
    /// The body is not a JSON object with messages or a prompt.
    Unreadable,
}

/// Body fields that do not change the answer.
const IGNORED: [&str; 4] = ["model", "stream", "stream_options", "user"];
/// Message fields that make up its meaning.
const MESSAGE_FIELDS: [&str; 5] = ["role", "content", "name", "tool_calls", "tool_call_id"];

fn states() -> &'static (RandomState, RandomState) {
    static S: OnceLock<(RandomState, RandomState)> = OnceLock::new();
    S.get_or_init(|| (RandomState::new(), RandomState::new()))
}

/// The cache key of `tenant`'s request `body` for `model`, or why it bypasses the cache.
pub(crate) fn key_of(tenant: &str, model: &str, body: &[u8]) -> Result<CacheKey, Bypass> {
    let v: Value = serde_json::from_slice(body).map_err(|_| Bypass::Unreadable)?;
    let obj = v.as_object().ok_or(Bypass::Unreadable)?;
    if !obj.contains_key("messages") && !obj.contains_key("prompt") {
        return Err(Bypass::Unreadable);
    }
    let zero = |f: &str| obj.get(f).and_then(Value::as_f64) == Some(0.0);
    if !zero("temperature") {
        return Err(Bypass::NotDeterministic);
    }
    let one = |f: &str| {
        obj.get(f)
            .is_none_or(|n| n.is_null() || n.as_u64() == Some(1))
    };
    if !one("n") || !one("best_of") {
        return Err(Bypass::ManyChoices);
    }
    let (s1, s2) = states();
    let (mut h1, mut h2) = (s1.build_hasher(), s2.build_hasher());
    let mut both = |bytes: &[u8]| {
        h1.write(bytes);
        h2.write(bytes);
    };
    for part in [tenant, model] {
        both(&(part.len() as u64).to_le_bytes());
        both(part.as_bytes());
    }
    let mut fields: Vec<(&String, &Value)> = obj
        .iter()
        .filter(|(k, _)| !IGNORED.contains(&k.as_str()))
        .collect();
    fields.sort_by(|a, b| a.0.cmp(b.0));
    for (k, val) in fields {
        both(k.as_bytes());
        both(b"=");
        if k == "messages" {
            normalised_messages(val, &mut both);
        } else {
            canonical(val, &mut both);
        }
    }
    Ok(CacheKey(h1.finish(), h2.finish()))
}

/// The messages, each reduced to the fields that make up its meaning.
fn normalised_messages(v: &Value, out: &mut impl FnMut(&[u8])) {
    let Some(list) = v.as_array() else {
        return canonical(v, out);
    };
    out(b"[");
    for m in list {
        out(b"{");
        for f in MESSAGE_FIELDS {
            if let Some(x) = m.get(f).filter(|x| !x.is_null()) {
                out(f.as_bytes());
                out(b":");
                canonical(x, out);
            }
        }
        out(b"}");
    }
    out(b"]");
}

/// A JSON value written with object keys sorted and strings trimmed, every item
/// length-prefixed (so no two different values write the same bytes).
fn canonical(v: &Value, out: &mut impl FnMut(&[u8])) {
    match v {
        Value::Null => out(b"n"),
        Value::Bool(b) => out(if *b { b"t" } else { b"f" }),
        Value::Number(n) => {
            // By value: 0, 0.0 and 0e0 are one number. Integers past 2^53, which an f64
            // would round, are written exactly.
            const EXACT: u64 = 1 << 53;
            match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) if u > EXACT => {
                    out(b"u");
                    out(&u.to_le_bytes());
                }
                (_, Some(i), _) if i.unsigned_abs() > EXACT => {
                    out(b"i");
                    out(&i.to_le_bytes());
                }
                (_, _, Some(f)) => {
                    out(b"#");
                    out(&(f + 0.0).to_bits().to_le_bytes());
                }
                _ => out(b"?"),
            }
        }
        Value::String(s) => {
            let s = s.trim();
            out(b"s");
            out(&(s.len() as u64).to_le_bytes());
            out(s.as_bytes());
        }
        Value::Array(a) => {
            out(b"[");
            out(&(a.len() as u64).to_le_bytes());
            a.iter().for_each(|x| canonical(x, out));
        }
        Value::Object(o) => {
            let mut keys: Vec<&String> = o.keys().collect();
            keys.sort();
            out(b"{");
            out(&(keys.len() as u64).to_le_bytes());
            for k in keys {
                out(&(k.len() as u64).to_le_bytes());
                out(k.as_bytes());
                canonical(&o[k], out);
            }
        }
    }
}

struct Stored {
    body: Bytes,
    at: Timestamp,
    tick: u64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<CacheKey, Stored>,
    /// Entries by last use (tick → key), oldest first.
    lru: BTreeMap<u64, CacheKey>,
    tick: u64,
    bytes: usize,
}

impl Inner {
    fn remove(&mut self, key: &CacheKey) {
        if let Some(s) = self.map.remove(key) {
            self.lru.remove(&s.tick);
            self.bytes -= s.body.len();
        }
    }
}

/// Stored answers, bounded by `max_bytes` of bodies.
pub(crate) struct ResponseCache {
    max_bytes: usize,
    ttl: Duration,
    inner: Mutex<Inner>,
}

impl ResponseCache {
    /// An empty cache of at most `max_bytes` of answers, each kept at most `ttl`.
    pub(crate) fn new(max_bytes: usize, ttl: Duration) -> Self {
        ResponseCache {
            max_bytes,
            ttl,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The stored answer for `key`, if there is one younger than the TTL.
    pub(crate) fn get(&self, key: &CacheKey, now: Timestamp) -> Option<Bytes> {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        let fresh = match inner.map.get(key) {
            None => return None,
            Some(s) => now.saturating_duration_since(s.at) <= self.ttl,
        };
        if !fresh {
            inner.remove(key);
            return None;
        }
        inner.tick += 1;
        let tick = inner.tick;
        let s = inner.map.get_mut(key)?;
        inner.lru.remove(&s.tick);
        s.tick = tick;
        inner.lru.insert(tick, *key);
        Some(s.body.clone())
    }

    /// Stores `body` as the answer for `key`, evicting the least recently used answers to
    /// stay within `max_bytes` (an answer larger than that is not stored).
    pub(crate) fn put(&self, key: CacheKey, body: Bytes, now: Timestamp) {
        if body.len() > self.max_bytes {
            return;
        }
        let mut g = self.inner.lock();
        let inner = &mut *g;
        inner.remove(&key);
        while inner.bytes + body.len() > self.max_bytes {
            let Some((_, oldest)) = inner.lru.pop_first() else {
                break;
            };
            if let Some(s) = inner.map.remove(&oldest) {
                inner.bytes -= s.body.len();
            }
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.bytes += body.len();
        inner.lru.insert(tick, key);
        inner.map.insert(
            key,
            Stored {
                body,
                at: now,
                tick,
            },
        );
    }

    /// Bytes of answers stored.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }

    /// Answers stored.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().map.len()
    }
}

/// A stored chat or completion answer as one SSE chunk, for a streamed request: the whole
/// text in one delta, then `[DONE]`. `None` when the stored body is not such an answer.
pub(crate) fn as_stream(body: &[u8]) -> Option<Bytes> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let chat = v.get("object").and_then(Value::as_str) == Some("chat.completion");
    let choices: Vec<Value> = v
        .get("choices")?
        .as_array()?
        .iter()
        .map(|c| {
            let mut out = serde_json::json!({
                "index": c.get("index").cloned().unwrap_or(Value::from(0)),
                "finish_reason": c.get("finish_reason").cloned().unwrap_or(Value::Null),
            });
            if chat {
                out["delta"] = c.get("message").cloned().unwrap_or(Value::Null);
            } else {
                out["text"] = c.get("text").cloned().unwrap_or(Value::Null);
            }
            out
        })
        .collect();
    let chunk = serde_json::json!({
        "id": v.get("id").cloned().unwrap_or(Value::Null),
        "object": if chat { "chat.completion.chunk" } else { "text_completion" },
        "created": v.get("created").cloned().unwrap_or(Value::from(0)),
        "model": v.get("model").cloned().unwrap_or(Value::Null),
        "choices": choices,
    });
    Some(Bytes::from(format!("data: {chunk}\n\ndata: [DONE]\n\n")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tenant: &str, body: &str) -> Result<CacheKey, Bypass> {
        key_of(tenant, "m", body.as_bytes())
    }

    #[test]
    fn exact_match_on_model_messages_and_sampling() {
        let a = key(
            "t",
            r#"{"model":"m","temperature":0,"max_tokens":8,
                "messages":[{"role":"user","content":"hi "}]}"#,
        )
        .unwrap();
        // Same meaning: whitespace around content, field order, stream, user, extra message
        // fields that do not change the answer.
        let same = key(
            "t",
            r#"{"messages":[{"content":"hi","role":"user","id":"x"}],"stream":true,
                "user":"u","max_tokens":8.0,"temperature":0.0,"model":"m"}"#,
        )
        .unwrap();
        assert_eq!(a, same);
        // A different sampling parameter, message, tenant or model is another key.
        let other = |body: &str| key("t", body).unwrap();
        assert_ne!(
            a,
            other(
                r#"{"temperature":0,"max_tokens":9,"messages":[{"role":"user","content":"hi"}]}"#
            )
        );
        assert_ne!(
            a,
            other(
                r#"{"temperature":0,"max_tokens":8,"seed":1,"messages":[{"role":"user","content":"hi"}]}"#
            )
        );
        assert_ne!(
            a,
            other(
                r#"{"temperature":0,"max_tokens":8,"messages":[{"role":"system","content":"hi"}]}"#
            )
        );
        let body =
            r#"{"temperature":0,"max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
        assert_ne!(a, key("u", body).unwrap());
        assert_ne!(a, key_of("t", "m2", body.as_bytes()).unwrap());
    }

    #[test]
    fn random_sampling_and_many_choices_bypass() {
        let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
        assert_eq!(
            key("t", &format!("{{{msgs}}}")),
            Err(Bypass::NotDeterministic)
        );
        assert_eq!(
            key("t", &format!(r#"{{"temperature":0.7,{msgs}}}"#)),
            Err(Bypass::NotDeterministic)
        );
        assert_eq!(
            key("t", &format!(r#"{{"temperature":0,"n":2,{msgs}}}"#)),
            Err(Bypass::ManyChoices)
        );
        assert!(key("t", &format!(r#"{{"temperature":0,"n":1,{msgs}}}"#)).is_ok());
        assert_eq!(key("t", r#"{"temperature":0}"#), Err(Bypass::Unreadable));
        assert_eq!(key("t", "[1]"), Err(Bypass::Unreadable));
    }

    #[test]
    fn memory_is_bounded_least_recently_used_out_first() {
        let c = ResponseCache::new(100, Duration::from_secs(60));
        let t0 = Timestamp::ZERO;
        let k = |i: u64| CacheKey(i, i);
        for i in 0..3 {
            c.put(k(i), Bytes::from(vec![b'x'; 40]), t0);
        }
        // 120 bytes do not fit in 100: the oldest went.
        assert_eq!(c.len(), 2);
        assert!(c.bytes() <= 100);
        assert!(c.get(&k(0), t0).is_none());
        // Using 1 makes 2 the least recently used.
        assert!(c.get(&k(1), t0).is_some());
        c.put(k(3), Bytes::from(vec![b'y'; 40]), t0);
        assert!(c.get(&k(2), t0).is_none());
        assert!(c.get(&k(1), t0).is_some());
        // Too large for the whole cache: not stored, nothing evicted.
        c.put(k(4), Bytes::from(vec![b'z'; 101]), t0);
        assert!(c.get(&k(4), t0).is_none());
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn an_old_answer_is_a_miss() {
        let c = ResponseCache::new(1000, Duration::from_secs(10));
        let t0 = Timestamp::ZERO;
        let k = CacheKey(1, 1);
        c.put(k, Bytes::from_static(b"a"), t0);
        assert!(c.get(&k, t0 + Duration::from_secs(10)).is_some());
        assert!(c.get(&k, t0 + Duration::from_secs(11)).is_none());
        assert_eq!(c.bytes(), 0);
    }

    #[test]
    fn a_stored_answer_streams_as_one_chunk() {
        let body = br#"{"id":"c1","object":"chat.completion","created":5,"model":"m",
            "choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}"#;
        let s = as_stream(body).unwrap();
        let text = std::str::from_utf8(&s).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        let first = text.lines().next().unwrap().strip_prefix("data: ").unwrap();
        let v: Value = serde_json::from_str(first).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["choices"][0]["delta"]["content"], "hello");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(as_stream(b"not json").is_none());
    }
}
