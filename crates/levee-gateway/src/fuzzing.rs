//! Entry points for the fuzz targets (`fuzz/`, cargo-fuzz) and for their bounded
//! property-test run in CI (`tests/fuzz_props.rs`): each takes arbitrary bytes, runs the
//! code a hostile client or backend reaches with them, and panics when an invariant breaks.
//! None of them needs a socket or a runtime.

use crate::client_request::ClientRequest;
use crate::config::{BackendKind, Config};
use crate::error::ErrorCode;
use crate::pipeline::check_body;
use crate::proxy::{EventSplitter, Usage};
use bytes::Bytes;

/// A request body as the read and classify phases see it, then rewritten for a backend.
/// Invariants: a body the pipeline accepts is never refused later as a body levee cannot
/// re-read (the 500 of issue 22), and the rewritten body is JSON naming the backend's model
/// with the cap written.
pub fn request_body(data: &[u8]) {
    if check_body(data).is_err() {
        return; // the read phase answers 400
    }
    let Ok((parsed, _prompt)) = ClientRequest::parse(data) else {
        return; // 400
    };
    for (cap, usage) in [(None, false), (Some(7), true)] {
        let out = match parsed.upstream_body("upstream-model", cap, usage) {
            Ok(out) => out,
            Err(e) => {
                assert_ne!(e.code(), ErrorCode::Internal, "accepted, then refused: {e}");
                continue;
            }
        };
        let v: serde_json::Value = match serde_json::from_slice(&out) {
            Ok(v) => v,
            Err(e) => panic!("the rewritten body is not JSON: {e}"),
        };
        assert_eq!(v["model"], "upstream-model");
        if let Some(c) = cap {
            let written = v["max_tokens"] == c || v["max_completion_tokens"] == c;
            assert!(written, "the cap is not written: {v}");
        }
    }
}

/// A backend's SSE bytes, cut into chunks where the first bytes say. Invariants: without
/// usage stripping the client gets exactly the backend's bytes, whole events only (what is
/// forwarded is a prefix of the input ending at an event end); with it, nothing panics; and
/// the stream read whole in place of a non-streamed answer is either refused or a JSON
/// object with a `choices` list.
pub fn sse_stream(data: &[u8]) {
    let (cuts, body) = data.split_at(data.len().min(8));
    let chunks = chunk(body, cuts);
    for strip in [false, true] {
        let mut split = EventSplitter::with_strip_usage(strip);
        let mut usage: Option<Usage> = None;
        let mut out = Vec::new();
        for c in &chunks {
            out.extend_from_slice(&split.process(Bytes::copy_from_slice(c), &mut usage));
        }
        if !strip {
            assert!(
                body.starts_with(&out),
                "forwarded bytes the backend did not send"
            );
            whole_answer(&out);
        }
    }
}

/// The answer put together from whole events `events` (see [`sse_stream`]).
fn whole_answer(events: &[u8]) {
    let mut whole = crate::reassemble::Reassembly::default();
    for event in crate::proxy::split_events(events) {
        if whole.event(event).is_err() {
            return;
        }
    }
    let Ok(body) = whole.finish() else { return };
    let v: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => panic!("the answer read whole is not JSON: {e}"),
    };
    assert!(
        v["choices"].is_array(),
        "no choices in the answer read whole: {v}"
    );
}

fn chunk<'a>(body: &'a [u8], cuts: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut rest = body;
    for &c in cuts.iter().cycle().take(64) {
        if rest.is_empty() {
            break;
        }
        let n = (usize::from(c) % 64 + 1).min(rest.len());
        let (a, b) = rest.split_at(n);
        out.push(a);
        rest = b;
    }
    if !rest.is_empty() {
        out.push(rest);
    }
    out
}

/// A backend's `/metrics`, `/v1/models` and `/props` answers. Invariants: no panic, and
/// the load figures read are finite and not negative.
pub fn backend_metrics(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for kind in [BackendKind::Vllm, BackendKind::Llamacpp] {
        if let Some(l) = crate::upstream::parse_load(kind, &text) {
            for f in [l.running, l.waiting, l.kv_usage] {
                assert!(f.is_finite() && f >= 0.0, "load figure {f} from {text:?}");
            }
            assert!(l.kv_usage <= 1.0, "KV use {} from {text:?}", l.kv_usage);
        }
    }
    let _ = crate::upstream::parse_vllm_cache_tokens(&text);
    let _ = crate::upstream::parse_max_model_len(&text, "m");
    let _ = crate::upstream::parse_llamacpp_props(&text);
}

/// A configuration file. Invariants: no panic; a file accepted is one a gateway can be
/// built from (its own checks pass again after a round trip through TOML).
pub fn config_file(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(cfg) = Config::from_toml_str(&text) else {
        return;
    };
    let _ = cfg.check_serves();
    let _ = cfg.summary();
    if let Ok(again) = toml::to_string(&cfg) {
        if let Ok(back) = Config::from_toml_str(&again) {
            assert!(back.validate().is_empty());
        }
    }
}
