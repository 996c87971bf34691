//! The fuzz targets' entry points (`levee_gateway::fuzzing`, run by cargo-fuzz from
//! `fuzz/`) driven by proptest in every `cargo test`: random bytes and inputs shaped like
//! what each parser expects (request bodies, SSE streams, Prometheus text, TOML), a bounded
//! number of cases each. cargo-fuzz explores further with coverage; this keeps the
//! invariants checked on every run and on machines without it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

use levee_gateway::fuzzing;
use proptest::prelude::*;

fn cases() -> ProptestConfig {
    let n = std::env::var("LEVEE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// JSON-ish request bodies: the fields levee reads, with values of any type, and nesting.
fn request_like() -> impl Strategy<Value = Vec<u8>> {
    let scalar = prop_oneof![
        Just("null".to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| format!("{f}")),
        "[a-z \\\\\"\u{1F600}]{0,12}".prop_map(|s| format!("{s:?}")),
        Just("true".to_string()),
    ];
    let value = scalar.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4).prop_map(|kv| {
                let f: Vec<String> = kv.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
                format!("{{{}}}", f.join(", "))
            }),
        ]
    });
    let key = prop_oneof![
        Just("model"),
        Just("messages"),
        Just("prompt"),
        Just("max_tokens"),
        Just("max_completion_tokens"),
        Just("n"),
        Just("stream"),
        Just("stream_options"),
        Just("metadata"),
    ];
    let depth = 0usize..140;
    (prop::collection::vec((key, value), 0..8), depth).prop_map(|(fields, depth)| {
        let mut s = String::from("{");
        let parts: Vec<String> = fields.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
        s.push_str(&parts.join(", "));
        if depth > 0 {
            if !parts.is_empty() {
                s.push_str(", ");
            }
            s.push_str("\"deep\": ");
            s.push_str(&"[".repeat(depth));
            s.push_str(&"]".repeat(depth));
        }
        s.push('}');
        s.into_bytes()
    })
}

fn sse_like() -> impl Strategy<Value = Vec<u8>> {
    let line = prop_oneof![
        Just("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}],\"usage\":null}".to_string()),
        Just(
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}"
                .to_string()
        ),
        Just("data: [DONE]".to_string()),
        Just(
            "data: {\"choices\":[{\"index\":1,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\\\"\"}}]},\"finish_reason\":\"tool_calls\"}]}"
                .to_string()
        ),
        Just("data: {\"choices\":[{\"index\":0,\"text\":\" t\",\"logprobs\":{\"tokens\":[\" t\"]},\"finish_reason\":null}]}".to_string()),
        Just(": keep-alive".to_string()),
        "[ -~]{0,20}",
    ];
    let end = prop_oneof![Just("\n"), Just("\r\n"), Just("\r")];
    (
        any::<[u8; 8]>(),
        prop::collection::vec((line, end.clone(), end), 0..12),
    )
        .prop_map(|(cuts, lines)| {
            let mut v = cuts.to_vec();
            for (l, e1, e2) in lines {
                v.extend_from_slice(l.as_bytes());
                v.extend_from_slice(e1.as_bytes());
                v.extend_from_slice(e2.as_bytes());
            }
            v
        })
}

fn metrics_like() -> impl Strategy<Value = Vec<u8>> {
    let name = prop_oneof![
        Just("vllm:num_requests_running"),
        Just("vllm:num_requests_waiting"),
        Just("vllm:kv_cache_usage_perc"),
        Just("vllm:cache_config_info"),
        Just("llamacpp:requests_processing"),
        Just("llamacpp:kv_cache_usage_ratio"),
        Just("# HELP x"),
    ];
    let value = prop_oneof![
        any::<f64>().prop_map(|f| format!("{f}")),
        Just("NaN".to_string()),
        Just("-Inf".to_string()),
        Just("1e308".to_string()),
        "[0-9.e+-]{0,8}",
    ];
    let labels = prop_oneof![
        Just(String::new()),
        Just("{model_name=\"m\"}".to_string()),
        Just("{block_size=\"16\",num_gpu_blocks=\"99999999999999999999\"}".to_string()),
    ];
    prop::collection::vec((name, labels, value), 0..10).prop_map(|lines| {
        lines
            .iter()
            .map(|(n, l, v)| format!("{n}{l} {v}\n"))
            .collect::<String>()
            .into_bytes()
    })
}

fn toml_like() -> impl Strategy<Value = Vec<u8>> {
    let section = prop_oneof![
        Just("[listen]\npublic = \"127.0.0.1:0\"\n"),
        Just("[[tenants]]\nname = \"t\"\nkey_sha256 = [\"00\"]\n"),
        Just("[[models]]\nname = \"m\"\n[[models.backends]]\nurl = \"http://127.0.0.1:1\"\n"),
        Just("[queue]\nsafe = 5\nsoft = 2\nhard = 1\n"),
        Just("[server]\nmax_connections = 0\nidle_timeout_ms = 0\n"),
        Just("[tasks]\ncallback_allow = [\"10.0.0.0/33\", \"hooks\"]\n"),
        Just("[admin]\nhosts = [\"x\"]\n"),
        Just("[[degrade.levels]]\nmax_tokens = 1\n"),
        Just("garbage = [\n"),
    ];
    prop::collection::vec(section, 0..8).prop_map(|s| s.concat().into_bytes())
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn request_bodies_random(data in prop::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::request_body(&data);
    }

    #[test]
    fn request_bodies_shaped(data in request_like()) {
        fuzzing::request_body(&data);
    }

    #[test]
    fn sse_streams(data in sse_like()) {
        fuzzing::sse_stream(&data);
    }

    #[test]
    fn sse_random(data in prop::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::sse_stream(&data);
    }

    #[test]
    fn backend_metrics(data in metrics_like()) {
        fuzzing::backend_metrics(&data);
    }

    #[test]
    fn config_files(data in toml_like()) {
        fuzzing::config_file(&data);
    }

    #[test]
    fn config_random(data in prop::collection::vec(any::<u8>(), 0..256)) {
        fuzzing::config_file(&data);
    }
}

/// Issue 22's body: 200 levels of nesting without `max_tokens` (it was accepted, then
/// answered 500 when rewritten for the backend).
#[test]
fn deep_nesting_is_refused_before_it_is_accepted() {
    let mut body = String::from(r#"{"model": "m", "messages": [], "x": "#);
    body.push_str(&"{\"a\": ".repeat(200));
    body.push('1');
    body.push_str(&"}".repeat(200));
    body.push('}');
    fuzzing::request_body(body.as_bytes());
}

/// Found by cargo-fuzz: invalid UTF-8 inside a field levee does not read passed the first,
/// shallow reading and failed the rewrite (a 500 after admission). Now the read phase
/// refuses it (400), and escapes of lone surrogates in such a field are rewritten fine.
#[test]
fn invalid_utf8_or_lone_surrogates_in_an_unread_field_are_not_a_500() {
    let mut body = br#"{"model": "m", "prompt": "hi", "stream": true, "x": {"in"#.to_vec();
    body.extend_from_slice(&[0xea, 0xea, 0xea]);
    body.extend_from_slice(br#"": false}}"#);
    fuzzing::request_body(&body);
    fuzzing::request_body(br#"{"model": "m", "prompt": "hi", "x": {"\udc00": "\ud800"}}"#);
    fuzzing::request_body(
        br#"{"model": "m", "prompt": "hi", "max_tokens": 3, "x": "\ud800\u0041"}"#,
    );
}

/// Also found by cargo-fuzz: a number out of range in a field levee does not read (the
/// first reading skips it, the rewrite's full reading refused it: a 500 after admission).
/// Numbers with exponents or hundreds of digits that do fit are passed on.
#[test]
fn numbers_out_of_range_in_an_unread_field_are_not_a_500() {
    fuzzing::request_body(
        br#"{"model":"m", "matotens": 1e33333333333334, "messages": [{"role": "user", "content": "hi"}]}"#,
    );
    let long = format!(
        r#"{{"model": "m", "prompt": "hi", "x": {}}}"#,
        "9".repeat(400)
    );
    fuzzing::request_body(long.as_bytes());
    fuzzing::request_body(br#"{"model": "m", "prompt": "hi", "temperature": 1e-5, "x": [2.5E+3]}"#);
}
