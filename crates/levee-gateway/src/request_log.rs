//! Request ids and request logs.
//!
//! Every request gets an id, returned as `x-request-id`: the client's own `x-request-id`
//! when it sends a short, plain one (letters, digits, `-`, `_`, `.`; at most 64), otherwise
//! one made here (a per-process random prefix and a sequence number). A sampled share of
//! requests (`observe.request_log_sample`) is written to standard output as one JSON line
//! each, when it ends: time, id, tenant, tier, model, backend, client address, outcome,
//! status, code, queue ms, TTFT ms, duration and tokens. Errors (a status of 500 and above,
//! a failed or cut upstream answer) are always written, whatever the sample. API keys and
//! bodies are never written (the line has no field for them).

use http::HeaderValue;
use serde::Serialize;
use std::hash::{BuildHasher, Hasher};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The header carrying the id both ways.
pub const REQUEST_ID_HEADER: http::HeaderName = http::HeaderName::from_static("x-request-id");
/// W3C trace context, passed on to the backend as the client sent it.
pub const TRACEPARENT: http::HeaderName = http::HeaderName::from_static("traceparent");
/// W3C trace context's vendor part.
pub const TRACESTATE: http::HeaderName = http::HeaderName::from_static("tracestate");

/// A request's id (a request extension from the connection layer on).
#[derive(Debug, Clone)]
pub struct RequestId {
    /// Arrival order in this process (drives sampling).
    pub seq: u64,
    /// The id as sent back.
    pub value: HeaderValue,
    /// The client's W3C `traceparent`, passed on to the backend.
    pub traceparent: Option<HeaderValue>,
    /// The client's W3C `tracestate`, passed on with it.
    pub tracestate: Option<HeaderValue>,
    /// The client's address (the TCP peer).
    pub peer: Option<std::net::SocketAddr>,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn process_prefix() -> u64 {
    static PREFIX: OnceLock<u64> = OnceLock::new();
    *PREFIX.get_or_init(|| {
        // RandomState is seeded from the OS per process: ids differ across restarts.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(u64::from(std::process::id()));
        h.finish()
    })
}

/// `{prefix:016x}-{seq:x}`, written into a stack buffer (this runs for every request).
fn made_id(prefix: u64, seq: u64) -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = [0u8; 33];
    for (i, b) in buf[..16].iter_mut().enumerate() {
        *b = HEX[((prefix >> (60 - 4 * i)) & 0xf) as usize];
    }
    buf[16] = b'-';
    let digits = (64 - seq.leading_zeros()).div_ceil(4).max(1) as usize;
    for i in 0..digits {
        buf[17 + i] = HEX[((seq >> (4 * (digits - 1 - i))) & 0xf) as usize];
    }
    HeaderValue::from_bytes(&buf[..17 + digits]).unwrap_or_else(|_| HeaderValue::from_static("-"))
}

fn plain_id(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

impl RequestId {
    /// The client's plain `x-request-id`, or a new one.
    pub fn for_request(headers: &http::HeaderMap, peer: Option<std::net::SocketAddr>) -> RequestId {
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let value = headers
            .get(REQUEST_ID_HEADER)
            .filter(|v| plain_id(v))
            .cloned()
            .unwrap_or_else(|| made_id(process_prefix(), seq));
        let traceparent = headers.get(TRACEPARENT).cloned();
        let tracestate = traceparent
            .as_ref()
            .and_then(|_| headers.get(TRACESTATE).cloned());
        RequestId {
            seq,
            value,
            traceparent,
            tracestate,
            peer,
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        self.value.to_str().unwrap_or("-")
    }
}

/// Whether request number `seq` is logged at sample rate `rate`: exactly
/// `floor(n · rate)` of the first `n` requests are, spread evenly.
pub fn sampled(seq: u64, rate: f64) -> bool {
    if rate >= 1.0 {
        return true;
    }
    if rate <= 0.0 || rate.is_nan() {
        return false;
    }
    ((seq + 1) as f64 * rate).floor() > (seq as f64 * rate).floor()
}

/// One request log line.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RequestLine<'a> {
    /// The request id (`x-request-id`).
    pub request_id: &'a str,
    /// Tenant name (`-` before authentication).
    pub tenant: &'a str,
    /// The tenant's tier (`-` before authentication).
    pub tier: &'a str,
    /// Model (`-` before the body was read).
    pub model: &'a str,
    /// The backend that served it (`model@url`), if one did.
    pub backend: Option<&'a str>,
    /// The client's address.
    pub client: Option<std::net::SocketAddr>,
    /// `ok`, `client_gone`, `upstream_5xx`, ... or the refusal code.
    pub outcome: &'a str,
    /// HTTP status sent to the client (0 when the client left first).
    pub status: u16,
    /// The error code levee answered with (a refusal, a failure, a stream cut), if any.
    pub code: Option<&'a str>,
    /// Time queued before dispatch.
    pub queue_ms: Option<f64>,
    /// Arrival to first response byte.
    pub ttft_ms: Option<f64>,
    /// Arrival to the end of the response.
    pub duration_ms: f64,
    /// Prompt tokens the backend reported.
    pub prompt_tokens: Option<u64>,
    /// Completion tokens the backend reported.
    pub completion_tokens: Option<u64>,
}

/// A line as written: the time it was written first.
#[derive(Serialize)]
struct Stamped<'a, 'b> {
    ts: String,
    #[serde(flatten)]
    line: &'b RequestLine<'a>,
}

impl RequestLine<'_> {
    /// Whether the request failed on levee's or the backend's side: such lines are written
    /// whatever the sample.
    pub fn is_error(&self) -> bool {
        self.status >= 500
            || matches!(
                self.outcome,
                "upstream_error"
                    | "upstream_5xx"
                    | "stream_broken"
                    | "stream_idle_timeout"
                    | "stream_timeout"
            )
    }

    /// Writes the line to standard output if request `seq` is sampled at `rate`, or if it
    /// is an error.
    pub fn emit(&self, seq: u64, rate: f64) {
        if !(sampled(seq, rate) || self.is_error()) {
            return;
        }
        let stamped = Stamped {
            ts: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
            line: self,
        };
        if let Ok(mut text) = serde_json::to_vec(&stamped) {
            text.push(b'\n');
            // One write of the whole line: lines from many tasks never interleave.
            let _ = std::io::stdout().lock().write_all(&text);
        }
    }
}

/// Milliseconds, for log lines.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_ids_are_the_prefix_and_the_sequence_in_hex() {
        for (p, q) in [
            (0u64, 0u64),
            (0xdead_beef, 1),
            (u64::MAX, u64::MAX),
            (1 << 40, 0x10),
        ] {
            assert_eq!(made_id(p, q), format!("{p:016x}-{q:x}").as_str());
        }
    }

    #[test]
    fn sampling_is_exact_and_even() {
        let n = 1000;
        for rate in [0.0, 0.01, 0.1, 0.25, 1.0 / 3.0, 1.0] {
            let hits = (0..n).filter(|&s| sampled(s, rate)).count();
            assert_eq!(hits, (n as f64 * rate).floor() as usize, "rate {rate}");
        }
        // At 0.25 every fourth request.
        let picked: Vec<u64> = (0..12).filter(|&s| sampled(s, 0.25)).collect();
        assert_eq!(picked, vec![3, 7, 11]);
    }

    #[test]
    fn ids_echo_plain_client_ids_only() {
        let mut h = http::HeaderMap::new();
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("trace-42.a_b"));
        assert_eq!(RequestId::for_request(&h, None).as_str(), "trace-42.a_b");
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("has space"));
        let made = RequestId::for_request(&h, None);
        assert_ne!(made.as_str(), "has space");
        let other = RequestId::for_request(&http::HeaderMap::new(), None);
        assert_ne!(made.as_str(), other.as_str());
        assert!(other.seq > made.seq);
    }

    #[test]
    fn line_is_one_json_object_without_secrets() {
        let line = RequestLine {
            request_id: "r1",
            tenant: "acme",
            tier: "premium",
            model: "m",
            backend: Some("m@http://10.0.0.7:8000"),
            client: Some("10.0.3.7:51422".parse().unwrap()),
            outcome: "ok",
            status: 200,
            code: None,
            queue_ms: Some(12.5),
            ttft_ms: Some(40.0),
            duration_ms: 90.0,
            prompt_tokens: Some(10),
            completion_tokens: Some(4),
        };
        let text = serde_json::to_string(&line).unwrap();
        assert!(!text.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["request_id"], "r1");
        assert_eq!(v["queue_ms"], 12.5);
        assert_eq!(v["client"], "10.0.3.7:51422");
        assert_eq!(v["backend"], "m@http://10.0.0.7:8000");
        let fields: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        assert!(fields.iter().all(|f| !f.contains("key")), "{fields:?}");
        let stamped = serde_json::to_value(Stamped {
            ts: "2026-01-01T00:00:00.000Z".into(),
            line: &line,
        })
        .unwrap();
        assert_eq!(stamped["ts"], "2026-01-01T00:00:00.000Z");
        assert_eq!(stamped["tier"], "premium");
    }

    #[test]
    fn errors_are_always_kept() {
        let line = |outcome, status| RequestLine {
            request_id: "r",
            tenant: "t",
            tier: "standard",
            model: "m",
            backend: None,
            client: None,
            outcome,
            status,
            code: None,
            queue_ms: None,
            ttft_ms: None,
            duration_ms: 1.0,
            prompt_tokens: None,
            completion_tokens: None,
        };
        assert!(line("upstream_timeout", 504).is_error());
        assert!(line("no_healthy_backend", 503).is_error());
        assert!(line("upstream_5xx", 500).is_error());
        assert!(
            line("stream_broken", 200).is_error(),
            "a cut stream began 200"
        );
        assert!(!line("ok", 200).is_error());
        assert!(
            !line("rate_limit_exceeded", 429).is_error(),
            "a refusal is not an error"
        );
        assert!(!line("client_gone", 0).is_error());
    }
}
