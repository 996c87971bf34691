//! A request's session, for affinity: the client's session header, or its conversation's
//! opening. Both are hashed with a key drawn once per process (SipHash), so a client cannot
//! aim its sessions at one slot of the session map, and a header's value is never kept.

use crate::lite::Lite;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

fn state() -> &'static RandomState {
    static STATE: OnceLock<RandomState> = OnceLock::new();
    STATE.get_or_init(RandomState::new)
}

/// Feeds bytes written to it into a hasher (serialising a JSON value hashes it in place).
struct Feed<H: Hasher>(H);

impl<H: Hasher> std::io::Write for Feed<H> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The session named by header `name`, if the request carries it (non-empty).
pub(crate) fn from_header(headers: &http::HeaderMap, name: &str) -> Option<u64> {
    if name.is_empty() {
        return None;
    }
    let v = headers.get(name)?.as_bytes();
    if v.is_empty() {
        return None;
    }
    let mut h = state().build_hasher();
    h.write_u8(b'h');
    h.write(v);
    Some(h.finish())
}

/// The conversation a chat request continues: its messages up to and including the first
/// user message (system prompt and opening question), which every later turn of the same
/// conversation resends unchanged. `None` without a user message.
pub(crate) fn of_conversation(messages: Option<&Lite<'_>>) -> Option<u64> {
    let list = messages?.as_array()?;
    let first_user = list
        .iter()
        .position(|m| m.get("role").and_then(|r| r.as_str()) == Some("user"))?;
    let mut feed = Feed(state().build_hasher());
    feed.0.write_u8(b'c');
    for m in &list[..=first_user] {
        // Role and content only: clients add and drop other fields (names, ids) freely.
        for field in ["role", "content"] {
            serde_json::to_writer(&mut feed, &m.get(field)).ok()?;
        }
    }
    Some(feed.0.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The conversation key of a chat's `messages`, read as the request path reads them.
    fn key(messages: serde_json::Value) -> Option<u64> {
        let text = messages.to_string();
        of_conversation(Some(&serde_json::from_str::<Lite>(&text).unwrap()))
    }

    #[test]
    fn later_turns_share_the_opening_key() {
        let t1 = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"}
        ]);
        let t2 = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello", "name": "ann"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "and then?"}
        ]);
        let other = json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "goodbye"}
        ]);
        let k1 = key(t1.clone());
        assert!(k1.is_some());
        assert_eq!(k1, key(t2.clone()));
        assert_ne!(k1, key(other.clone()));
        assert_eq!(key(json!([{"role": "system", "content": "x"}])), None);
        assert_eq!(key(json!("text")), None);
        assert_eq!(of_conversation(None), None);
    }

    #[test]
    fn the_header_names_a_session() {
        let mut h = http::HeaderMap::new();
        assert_eq!(from_header(&h, "x-session-id"), None);
        h.insert("x-session-id", http::HeaderValue::from_static("abc"));
        let a = from_header(&h, "x-session-id");
        assert!(a.is_some());
        assert_eq!(a, from_header(&h, "X-Session-Id"));
        assert_eq!(from_header(&h, ""), None);
        h.insert("x-session-id", http::HeaderValue::from_static("abd"));
        assert_ne!(a, from_header(&h, "x-session-id"));
    }
}
