//! The engine through HTTP: in-process servers on 127.0.0.1:0, paused tokio time (the
//! simulated clock follows tokio's, so every time below is virtual and exact).

// Helpers outside #[test] fns are test code too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use futures::StreamExt;
use levee_engine::{spawn, EngineConfig, EngineHandle, EngineState, FaultsUpdate, OverloadMode};
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::Instant;

async fn start(config: EngineConfig) -> (EngineHandle, reqwest::Client) {
    let engine = spawn(config, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    (engine, reqwest::Client::new())
}

fn chat(model: &str, prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    })
}

/// What a streaming response delivered.
#[derive(Debug, Default)]
struct Streamed {
    chunks: Vec<Value>,
    done: bool,
    cut: bool,
    /// Virtual time from the request to the first content token.
    ttft: Option<Duration>,
}

impl Streamed {
    fn content(&self) -> String {
        self.chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect()
    }

    fn tokens(&self) -> usize {
        self.chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty())
            })
            .count()
    }

    fn usage(&self) -> Option<&Value> {
        self.chunks
            .iter()
            .rev()
            .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
    }
}

/// Sends a streaming chat request and reads it to the end (or until it is cut).
async fn stream_chat(client: &reqwest::Client, engine: &EngineHandle, body: Value) -> Streamed {
    let sent = Instant::now();
    let resp = client
        .post(format!("{}/v1/chat/completions", engine.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut out = Streamed::default();
    if resp.status() != 200 {
        out.cut = true;
        return out;
    }
    let mut bytes = resp.bytes_stream();
    let mut buf = String::new();
    while let Some(piece) = bytes.next().await {
        let Ok(piece) = piece else {
            out.cut = true;
            break;
        };
        buf.push_str(std::str::from_utf8(&piece).unwrap());
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let data = event.trim().strip_prefix("data: ").unwrap().to_string();
            if data == "[DONE]" {
                out.done = true;
            } else {
                let chunk: Value = serde_json::from_str(&data).unwrap();
                let has_token = chunk["choices"][0]["delta"]["content"]
                    .as_str()
                    .is_some_and(|s| !s.is_empty());
                if has_token && out.ttft.is_none() {
                    out.ttft = Some(sent.elapsed());
                }
                out.chunks.push(chunk);
            }
        }
    }
    out
}

async fn get(client: &reqwest::Client, engine: &EngineHandle, path: &str) -> reqwest::Response {
    client
        .get(format!("{}{path}", engine.base_url()))
        .send()
        .await
        .unwrap()
}

async fn post(
    client: &reqwest::Client,
    engine: &EngineHandle,
    path: &str,
    body: Value,
) -> reqwest::Response {
    client
        .post(format!("{}{path}", engine.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// The value of a metric line `name{labels} value` whose labels contain `label` (or any).
fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| l.contains(label))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

#[tokio::test(start_paused = true)]
async fn chat_and_completions_follow_the_openai_shapes_with_exact_usage() {
    let (engine, client) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();

    // Non-streaming chat: natural length within 8..=16, usage exact.
    let prompt = "Why do rivers need levees?";
    let resp = post(
        &client,
        &engine,
        "/v1/chat/completions",
        json!({"model": model, "messages": [{"role": "user", "content": prompt}]}),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let usage = &body["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((8..=16).contains(&completion), "{usage}");
    assert_eq!(content.split_whitespace().count() as u64, completion);
    // The engine's own count: "Why", " do", " rivers", " need", " levees", "?", plus 4
    // per prompt and 5 per message (levee's rule would say 7 + 6 = 13).
    assert_eq!(usage["prompt_tokens"], 6 + 4 + 5);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");

    // max_tokens caps the length and makes the finish reason "length".
    let resp = post(
        &client,
        &engine,
        "/v1/chat/completions",
        json!({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3}),
    )
    .await;
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 3);
    assert_eq!(body["choices"][0]["finish_reason"], "length");

    // Streaming chat: role chunk, one chunk per token, finish, usage chunk, [DONE];
    // the same prompt gives the same text.
    let s = stream_chat(&client, &engine, chat(&model, prompt, 12, true)).await;
    assert!(s.done && !s.cut);
    assert_eq!(s.chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(s.tokens(), 12);
    assert_eq!(s.usage().unwrap()["completion_tokens"], 12);
    assert_eq!(s.content().split_whitespace().count(), 12);
    let last_choice = s
        .chunks
        .iter()
        .rev()
        .find(|c| !c["choices"].as_array().unwrap().is_empty());
    assert_eq!(
        last_choice.unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    let again = stream_chat(&client, &engine, chat(&model, prompt, 12, true)).await;
    assert_eq!(again.content(), s.content());

    // Legacy completions, non-streaming and streaming.
    let resp = post(
        &client,
        &engine,
        "/v1/completions",
        json!({"model": model, "prompt": "abcdefgh", "max_tokens": 5, "ignore_eos": true}),
    )
    .await;
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    // A begin-of-sequence token, "abcdef", "gh".
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    assert_eq!(body["usage"]["completion_tokens"], 5);
    let resp = post(
        &client,
        &engine,
        "/v1/completions",
        json!({"model": model, "prompt": "abcdefgh", "max_tokens": 5, "stream": true}),
    )
    .await;
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(text.matches("\"text_completion\"").count(), 5 + 1);

    // Models, unknown model, too long.
    let models: Value = get(&client, &engine, "/v1/models")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], model);
    let resp = post(
        &client,
        &engine,
        "/v1/chat/completions",
        chat("gpt-4", "x", 2, false),
    )
    .await;
    assert_eq!(resp.status(), 404);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "model_not_found");
    let resp = post(
        &client,
        &engine,
        "/v1/chat/completions",
        chat(&model, "x", 5000, false),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    engine.shutdown().await.unwrap();
}

/// The value of a label in a Prometheus sample line (`name{a="1",b="2"} v`).
fn label_value<'a>(line: &'a str, label: &str) -> &'a str {
    let start = line.find(&format!("{label}=\"")).unwrap() + label.len() + 2;
    let len = line[start..].find('"').unwrap();
    &line[start..start + len]
}

#[tokio::test(start_paused = true)]
async fn describes_its_kv_cache_and_context_like_vllm() {
    let mut config = EngineConfig::tiny_fast();
    config.gpu.kv_capacity_tokens = 3 * 1024 + 16;
    config.gpu.max_model_len = 777;
    let (engine, client) = start(config).await;

    // vLLM's cache config: an info gauge (always 1) whose labels page the KV capacity.
    let metrics = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    let lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("vllm:cache_config_info{"))
        .collect();
    assert_eq!(lines.len(), 1, "{metrics}");
    assert!(
        metrics.contains("# TYPE vllm:cache_config_info gauge"),
        "{metrics}"
    );
    let block_size: u32 = label_value(lines[0], "block_size").parse().unwrap();
    let blocks: u32 = label_value(lines[0], "num_gpu_blocks").parse().unwrap();
    assert_eq!(block_size, levee_engine::KV_BLOCK_SIZE);
    assert_eq!(block_size * blocks, 3 * 1024 + 16);
    assert_eq!(metric(&metrics, "vllm:cache_config_info", ""), 1.0);

    // vLLM's context length on each model object.
    let models: Value = get(&client, &engine, "/v1/models")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 777);
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn ttft_rises_with_queue_length() {
    let (engine, client) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();
    // 24 equal requests, 8 run at once: three waves, each waiting for the ones before.
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let client = client.clone();
            let url = engine.base_url();
            let body = chat(&model, &format!("question {i:02}"), 20, true);
            tokio::spawn(async move {
                let sent = Instant::now();
                let resp = client
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let ttft = sent.elapsed();
                let text = resp.text().await.unwrap();
                assert!(text.ends_with("data: [DONE]\n\n"));
                ttft
            })
        })
        .collect();
    let stats = engine.wait_for(|s| s.waiting == 16).await.unwrap();
    assert_eq!(stats.running, 8);
    let mut ttfts = Vec::new();
    for t in tasks {
        ttfts.push(t.await.unwrap());
    }
    ttfts.sort();
    // Later waves wait for whole earlier requests: strictly longer TTFT.
    assert!(ttfts[7] < ttfts[8] && ttfts[15] < ttfts[16], "{ttfts:?}");
    assert!(ttfts[16] > ttfts[0] * 2, "{ttfts:?}");
    let metrics = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&metrics, "vllm:time_to_first_token_seconds_count", ""),
        24.0
    );
    engine.shutdown().await.unwrap();
}

fn overloadable(mode: OverloadMode) -> EngineConfig {
    let mut c = EngineConfig::tiny_fast();
    c.gpu.kv_capacity_tokens = 512;
    c.gpu.max_model_len = 512;
    c.gpu.max_running_seqs = 16;
    c.gpu.overload = mode;
    c
}

#[tokio::test(start_paused = true)]
async fn preempt_mode_keeps_kv_within_capacity_and_finishes_every_request() {
    let (engine, client) = start(overloadable(OverloadMode::Preempt)).await;
    let model = engine.config().model.clone();
    // 16 requests that each grow to ~130 tokens (2,000+ in all) share a 512-token cache.
    // (The step-by-step invariant is proven in the model's unit tests; here we sample.)
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let client = client.clone();
            let body = chat(&model, &format!("{i:03} {}", "x".repeat(100)), 100, true);
            let url = engine.base_url();
            tokio::spawn(async move {
                let resp = client
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                resp.text().await.unwrap()
            })
        })
        .collect();
    let mut max_kv = 0;
    let mut done = 0;
    for t in tasks {
        let text = t.await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"));
        assert_eq!(text.matches("\"content\"").count(), 1 + 100);
        done += 1;
        let s = engine.stats();
        max_kv = max_kv.max(s.kv_used_tokens);
        assert!(s.kv_used_tokens <= s.kv_capacity_tokens);
    }
    assert_eq!(done, 16);
    let s = engine.stats();
    assert!(s.preemptions > 0, "{s:?}");
    assert_eq!((s.crashes, s.completed, s.kv_used_tokens), (0, 16, 0));
    let metrics = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&metrics, "vllm:num_preemptions_total", ""),
        s.preemptions as f64
    );
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn crash_mode_overload_fails_in_flight_then_recovers_after_restart_secs() {
    let (engine, client) = start(overloadable(OverloadMode::Crash)).await;
    let model = engine.config().model.clone();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let client = client.clone();
            let body = chat(&model, &format!("{i:03} {}", "x".repeat(100)), 100, true);
            let url = engine.base_url();
            tokio::spawn(async move {
                let resp = client
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = resp.status().as_u16();
                // A stream cut mid-way is a body error; a failure before the first token
                // is a 500.
                let text = resp.text().await;
                (
                    status,
                    text.map(|t| t.ends_with("data: [DONE]\n\n"))
                        .unwrap_or(false),
                )
            })
        })
        .collect();
    let (mut before_first_token, mut cut_mid_stream) = (0, 0);
    for t in tasks {
        let (status, completed) = t.await.unwrap();
        assert!(!completed, "a request completed through a crash");
        match status {
            500 => before_first_token += 1,
            200 => cut_mid_stream += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    // The cache filled at admission and overflowed while growing: the running streams were
    // cut after their first tokens, the queued ones got a 500.
    assert!(cut_mid_stream > 0, "{cut_mid_stream} {before_first_token}");
    assert_eq!(cut_mid_stream + before_first_token, 16);
    let s = engine.stats();
    assert_eq!(s.state, EngineState::Crashed);
    assert_eq!((s.crashes, s.failed, s.running, s.waiting), (1, 16, 0, 0));
    let restart_in = s.restart_in_secs.unwrap();
    assert!(restart_in > 4.0 && restart_in <= 5.0, "{restart_in}");

    // Down: health and new requests answer 503.
    assert_eq!(get(&client, &engine, "/health").await.status(), 503);
    let resp = post(
        &client,
        &engine,
        "/v1/chat/completions",
        chat(&model, "hi", 2, false),
    )
    .await;
    assert_eq!(resp.status(), 503);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "engine_unavailable");
    // An overload crash is not an injected one; the refusal while down is counted.
    assert_eq!(engine.injected_crashes(), 0);
    assert_eq!(engine.refused_while_down(), 1);
    assert_eq!(engine.refused_after_first_failure(), 0);
    // A second request in the same down period arrives after the engine said it was down.
    let again = post(
        &client,
        &engine,
        "/v1/chat/completions",
        chat(&model, "hi", 2, false),
    )
    .await;
    assert_eq!(again.status(), 503);
    assert_eq!(engine.refused_while_down(), 2);
    assert_eq!(engine.refused_after_first_failure(), 1);

    // Still down just before restart_secs have passed, up just after.
    tokio::time::sleep(Duration::from_secs_f64(restart_in - 0.05)).await;
    let s = engine.stats();
    assert_eq!(s.state, EngineState::Crashed);
    assert!(s.restart_in_secs.unwrap() <= 0.05 + 1e-6, "{s:?}");
    assert_eq!(get(&client, &engine, "/health").await.status(), 503);
    let s = engine
        .wait_for(|s| s.state == EngineState::Healthy)
        .await
        .unwrap();
    assert_eq!((s.running, s.waiting, s.kv_used_tokens), (0, 0, 0));
    assert_eq!(get(&client, &engine, "/health").await.status(), 200);
    let resp = post(
        &client,
        &engine,
        "/v1/chat/completions",
        chat(&model, "hi", 2, false),
    )
    .await;
    assert_eq!(resp.status(), 200);

    let metrics = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(metric(&metrics, "levee_engine_crashes_total", ""), 1.0);
    assert_eq!(
        metric(
            &metrics,
            "levee_engine_requests_failed_total",
            "reason=\"crash\""
        ),
        16.0
    );
    assert_eq!(
        metric(
            &metrics,
            "levee_engine_requests_failed_total",
            "reason=\"unavailable\""
        ),
        2.0
    );
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn crash_mode_survives_the_same_load_when_concurrency_is_limited() {
    // What levee does for a crash-prone engine: the same 16 requests, 3 at a time
    // (3 x ~130 tokens fit in 512), never overflow the cache.
    let (engine, client) = start(overloadable(OverloadMode::Crash)).await;
    let model = engine.config().model.clone();
    let limit = std::sync::Arc::new(tokio::sync::Semaphore::new(3));
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let client = client.clone();
            let limit = limit.clone();
            let body = chat(&model, &format!("{i:03} {}", "x".repeat(100)), 100, false);
            let url = engine.base_url();
            tokio::spawn(async move {
                let _permit = limit.acquire().await.unwrap();
                let resp = client
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                resp.status().as_u16()
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let s = engine.stats();
    assert_eq!((s.crashes, s.completed), (0, 16));
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_disconnected_stream_frees_its_slot_and_kv_at_once() {
    let mut config = EngineConfig::tiny_fast();
    config.gpu.max_running_seqs = 1;
    let (engine, client) = start(config).await;
    let model = engine.config().model.clone();
    // A long request holds the only slot; a second one waits behind it.
    let long = client
        .post(format!("{}/v1/chat/completions", engine.base_url()))
        .json(&chat(&model, "long", 900, true))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let waiting = {
        let client = client.clone();
        let url = engine.base_url();
        let body = chat(&model, "short", 4, true);
        tokio::spawn(async move {
            let resp = client
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            resp.text().await.unwrap()
        })
    };
    let s = engine.wait_for(|s| s.waiting == 1).await.unwrap();
    assert_eq!(s.running, 1);
    assert!(s.kv_used_tokens > 0);
    // The client goes away: dropping the response drops the connection.
    drop(long);
    let s = engine.wait_for(|s| s.cancelled == 1).await.unwrap();
    assert_eq!(s.completed, 0);
    let text = waiting.await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    let s = engine.wait_for(|s| s.running == 0).await.unwrap();
    assert_eq!((s.completed, s.cancelled, s.kv_used_tokens), (1, 1, 0));
    let metrics = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&metrics, "levee_engine_requests_cancelled_total", ""),
        1.0
    );
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn metrics_match_what_the_engine_did() {
    let mut config = EngineConfig::tiny_fast();
    // Live gauges: this test reads them right after the last request.
    config.metrics_refresh_secs = 0.0;
    let (engine, client) = start(config).await;
    let model = engine.config().model.clone();
    let (mut prompt_total, mut completion_total) = (0u64, 0u64);
    let mut lengths = 0;
    for i in 0..6u32 {
        let prompt = format!("metrics question number {i} {}", "y".repeat(i as usize * 7));
        let body = json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8 + i,
            "stream": i % 2 == 0,
            "stream_options": {"include_usage": true},
        });
        let usage = if i % 2 == 0 {
            let s = stream_chat(&client, &engine, body).await;
            assert!(s.done);
            s.usage().unwrap().clone()
        } else {
            let b: Value = post(&client, &engine, "/v1/chat/completions", body)
                .await
                .json()
                .await
                .unwrap();
            if b["choices"][0]["finish_reason"] == "length" {
                lengths += 1;
            }
            b["usage"].clone()
        };
        prompt_total += usage["prompt_tokens"].as_u64().unwrap();
        completion_total += usage["completion_tokens"].as_u64().unwrap();
    }
    let m = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    assert!(m.contains("model_name=\"levee-sim-tiny\""), "{m}");
    assert_eq!(
        metric(&m, "vllm:prompt_tokens_total", ""),
        prompt_total as f64
    );
    assert_eq!(
        metric(&m, "vllm:generation_tokens_total", ""),
        completion_total as f64
    );
    assert_eq!(metric(&m, "vllm:request_success_total", ""), 6.0);
    assert!(
        metric(
            &m,
            "vllm:request_success_total",
            "finished_reason=\"length\""
        ) >= lengths as f64
    );
    assert_eq!(
        metric(&m, "vllm:time_to_first_token_seconds_count", ""),
        6.0
    );
    assert_eq!(
        metric(&m, "vllm:e2e_request_latency_seconds_count", ""),
        6.0
    );
    assert_eq!(metric(&m, "vllm:num_requests_running", ""), 0.0);
    assert_eq!(metric(&m, "vllm:num_requests_waiting", ""), 0.0);
    assert_eq!(metric(&m, "vllm:kv_cache_usage_perc", ""), 0.0);
    let state: Value = get(&client, &engine, "/admin/state")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(state["stats"]["completed"], 6);
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn admin_faults_inject_errors_latency_hang_and_crash() {
    let (engine, client) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();

    // Error rate 1: every request fails at once with the OpenAI error shape.
    let state: Value = post(
        &client,
        &engine,
        "/admin/faults",
        json!({"error_rate": 1.0}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(state["faults"]["error_rate"], 1.0);
    let resp = post(
        &client,
        &engine,
        "/v1/chat/completions",
        chat(&model, "a", 2, false),
    )
    .await;
    assert_eq!(resp.status(), 500);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], "injected_error");
    assert_eq!(
        post(
            &client,
            &engine,
            "/admin/faults",
            json!({"error_rate": 2.0})
        )
        .await
        .status(),
        400
    );
    assert_eq!(
        post(&client, &engine, "/admin/faults", json!({"bogus": 1}))
            .await
            .status(),
        400
    );

    // Added latency: TTFT grows by (at least) the added simulated time.
    post(&client, &engine, "/admin/clear", json!({})).await;
    let base = stream_chat(&client, &engine, chat(&model, "b", 2, true))
        .await
        .ttft
        .unwrap();
    post(
        &client,
        &engine,
        "/admin/faults",
        json!({"added_latency_ms": 3000.0}),
    )
    .await;
    let slow = stream_chat(&client, &engine, chat(&model, "b", 2, true))
        .await
        .ttft
        .unwrap();
    assert!(slow >= base + Duration::from_secs(3), "{base:?} {slow:?}");
    post(&client, &engine, "/admin/clear", json!({})).await;

    // Hang: accepted but not answered; health still 200; answered after unhang.
    let state: Value = post(&client, &engine, "/admin/hang", json!({}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(state["faults"]["hang"], true);
    engine
        .wait_for(|s| s.state == EngineState::Hung)
        .await
        .unwrap();
    let pending = {
        let client = client.clone();
        let url = engine.base_url();
        let body = chat(&model, "c", 2, false);
        tokio::spawn(async move {
            client
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    engine.wait_for(|s| s.waiting == 1).await.unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!pending.is_finished());
    assert_eq!(get(&client, &engine, "/health").await.status(), 200);
    post(&client, &engine, "/admin/unhang", json!({})).await;
    assert_eq!(pending.await.unwrap(), 200);

    // Crash now: down, then back after restart_secs.
    let state: Value = post(&client, &engine, "/admin/crash", json!({}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(state["stats"]["state"], "crashed");
    assert_eq!(state["stats"]["crashes"], 1);
    assert_eq!(engine.injected_crashes(), 1);
    assert_eq!(get(&client, &engine, "/health").await.status(), 503);
    engine
        .wait_for(|s| s.state == EngineState::Healthy)
        .await
        .unwrap();
    assert_eq!(get(&client, &engine, "/health").await.status(), 200);

    // The in-process API does the same.
    engine
        .set_faults(&FaultsUpdate {
            error_rate: Some(1.0),
            ..FaultsUpdate::default()
        })
        .unwrap();
    assert_eq!(
        post(
            &client,
            &engine,
            "/v1/chat/completions",
            chat(&model, "d", 2, false)
        )
        .await
        .status(),
        500
    );
    engine.clear_faults().unwrap();
    engine.crash_now();
    engine.wait_for(|s| s.crashes == 2).await.unwrap();
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn shutdown_fails_in_flight_requests() {
    let (engine, client) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();
    let resp = client
        .post(format!("{}/v1/chat/completions", engine.base_url()))
        .json(&chat(&model, "long", 900, true))
        .send()
        .await
        .unwrap();
    engine.shutdown().await.unwrap();
    // The stream ends without [DONE].
    let text = resp.text().await.unwrap_or_default();
    assert!(!text.contains("[DONE]"));
}

#[tokio::test(start_paused = true)]
async fn time_scale_runs_the_gpu_faster_and_reports_simulated_seconds() {
    let mut config = EngineConfig::tiny_fast();
    config.time_scale = 10.0;
    let (engine, client) = start(config).await;
    let model = engine.config().model.clone();
    let started = Instant::now();
    // 20 tokens alone: prefill + 20 decode steps of 11 simulated ms = ~0.22 s simulated.
    let s = stream_chat(&client, &engine, chat(&model, "scale", 20, true)).await;
    assert!(s.done);
    let wall = started.elapsed().as_secs_f64();
    let m = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    let e2e = metric(&m, "vllm:e2e_request_latency_seconds_sum", "");
    assert!((0.22..0.23).contains(&e2e), "simulated e2e {e2e}");
    // Wall time is a tenth of it (virtual time, so exact up to the scheduler's turns).
    assert!(wall < e2e / 5.0, "wall {wall} vs simulated {e2e}");
    assert!(wall >= e2e / 10.0 - 1e-3, "wall {wall} vs simulated {e2e}");
    // Restart time is simulated too: 5 simulated seconds are half a real second.
    engine.crash_now();
    let s = engine.wait_for(|s| s.crashes == 1).await.unwrap();
    assert_eq!(s.state, EngineState::Crashed);
    let crashed_at = Instant::now();
    engine
        .wait_for(|s| s.state == EngineState::Healthy)
        .await
        .unwrap();
    let down = crashed_at.elapsed();
    assert!(
        down >= Duration::from_millis(490) && down <= Duration::from_millis(510),
        "{down:?}"
    );
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_non_streaming_client_that_gives_up_frees_its_sequence() {
    let (engine, _) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();
    // The client times out long before 900 tokens are generated.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let err = client
        .post(format!("{}/v1/chat/completions", engine.base_url()))
        .json(&chat(&model, "long", 900, false))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let s = engine.wait_for(|s| s.cancelled == 1).await.unwrap();
    assert_eq!((s.running, s.kv_used_tokens, s.completed), (0, 0, 0));
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_crash_while_hung_restarts_on_time_and_clears_the_hang() {
    let (engine, _) = start(EngineConfig::tiny_fast()).await;
    engine
        .set_faults(&FaultsUpdate {
            hang: Some(true),
            ..FaultsUpdate::default()
        })
        .unwrap();
    engine
        .wait_for(|s| s.state == EngineState::Hung)
        .await
        .unwrap();
    engine.crash_now();
    let s = engine
        .wait_for(|s| s.state == EngineState::Crashed)
        .await
        .unwrap();
    let restart_in = s.restart_in_secs.unwrap();
    assert!(restart_in > 4.9 && restart_in <= 5.0, "{restart_in}");
    engine
        .wait_for(|s| s.state == EngineState::Healthy)
        .await
        .unwrap();
    assert!(!engine.admin_state().faults.hang);
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn tokenize_answers_the_count_that_usage_reports() {
    let (engine, client) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();
    let messages = json!([
        {"role": "system", "content": "You answer questions about flood defences."},
        {"role": "user", "content": "堤坝为什么会渗水？"},
    ]);
    let tools = json!([{"type": "function", "function": {"name": "gauge_level",
        "description": "Water level at a gauge, in millimetres",
        "parameters": {"type": "object", "properties": {"gauge": {"type": "string"}}}}}]);
    let t: Value = post(
        &client,
        &engine,
        "/tokenize",
        json!({"model": model, "messages": messages, "tools": tools}),
    )
    .await
    .json()
    .await
    .unwrap();
    let count = t["count"].as_u64().unwrap();
    assert_eq!(t["tokens"].as_array().unwrap().len() as u64, count);
    assert_eq!(t["max_model_len"], 1024);
    // The same chat sent for completion reports the same prompt tokens.
    let body: Value = post(
        &client,
        &engine,
        "/v1/chat/completions",
        json!({"model": model, "messages": messages, "tools": tools, "max_tokens": 2}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(body["usage"]["prompt_tokens"].as_u64().unwrap(), count);
    // Without the reply header: 3 tokens fewer. A plain prompt: BOS and its tokens.
    let t: Value = post(
        &client,
        &engine,
        "/tokenize",
        json!({"messages": messages, "tools": tools, "add_generation_prompt": false}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(t["count"].as_u64().unwrap(), count - 3);
    let t: Value = post(
        &client,
        &engine,
        "/tokenize",
        json!({"prompt": "river 2024"}),
    )
    .await
    .json()
    .await
    .unwrap();
    // BOS, "river", " ", "202", "4".
    assert_eq!(t["count"], 5);
    // Another model, or neither prompt nor messages: errors in OpenAI's shape.
    let r = post(
        &client,
        &engine,
        "/tokenize",
        json!({"model": "x", "prompt": "a"}),
    )
    .await;
    assert_eq!(r.status(), 404);
    let r = post(&client, &engine, "/tokenize", json!({"model": model})).await;
    assert_eq!(r.status(), 400);
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn usage_counts_text_parts_tools_tool_calls_and_images() {
    let (engine, client) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();
    let prompt_tokens = |body: Value| {
        let (client, url) = (client.clone(), engine.base_url());
        async move {
            let r: Value = client
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            r["usage"]["prompt_tokens"].as_u64().unwrap()
        }
    };
    let user = |content: Value| {
        json!({"model": model, "max_tokens": 1,
        "messages": [{"role": "user", "content": content}]})
    };
    let text = prompt_tokens(user(json!("Check the gauge"))).await;
    assert_eq!(text, 3 + 4 + 5);
    // The same text as an array of parts counts the same; a second part adds itself and a
    // newline.
    let parts = prompt_tokens(user(json!([{"type": "text", "text": "Check the gauge"}]))).await;
    assert_eq!(parts, text);
    let two = prompt_tokens(user(json!([{"type": "text", "text": "Check the gauge"},
        {"type": "text", "text": "now"}])))
    .await;
    assert_eq!(two, text + 2);
    // An image part costs a fixed 256 tokens, whatever its URL.
    let image = prompt_tokens(user(json!([{"type": "text", "text": "Check the gauge"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])))
    .await;
    assert_eq!(
        image,
        text + u64::from(levee_engine::tokenizer::IMAGE_TOKENS)
    );
    // Tool definitions are rendered into the prompt.
    let mut with_tools = user(json!("Check the gauge"));
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "gauge_level",
        "parameters": {"type": "object", "properties": {"gauge": {"type": "string"}}}}}]);
    let tools = prompt_tokens(with_tools).await;
    assert!(tools > text + 10, "{tools} vs {text}");
    // An assistant's tool call counts its name and arguments.
    let call = json!({"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Check the gauge"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "gauge_level", "arguments": "{\"gauge\":\"A-17\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4125"},
    ]});
    let with_call = prompt_tokens(call).await;
    let call_tokens = levee_engine::tokenizer::count_text("gauge_level")
        + levee_engine::tokenizer::count_text("{\"gauge\":\"A-17\"}")
        + 2;
    assert_eq!(with_call, text + 5 + u64::from(call_tokens) + 5 + 2);
    // levee's rule on request counts exactly as levee's fallback does: text only.
    engine.shutdown().await.unwrap();
    let mut config = EngineConfig::tiny_fast();
    config.tokenizer = levee_engine::TokenizerKind::LeveeRule;
    let (engine, client) = start(config).await;
    let r: Value = client
        .post(format!("{}/v1/chat/completions", engine.base_url()))
        .json(
            &json!({"model": model, "max_tokens": 1, "messages": [{"role": "user",
            "content": [{"type": "text", "text": "水水水水水"},
                {"type": "image_url", "image_url": {"url": "x"}}]}]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        r["usage"]["prompt_tokens"],
        levee_engine::estimate_chat_prompt_tokens(["水水水水水"])
    );
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn gauges_show_the_engine_as_of_the_last_refresh() {
    let mut config = EngineConfig::tiny_fast();
    config.metrics_refresh_secs = 2.0;
    config.gpu.max_model_len = 1024;
    let (engine, client) = start(config).await;
    let model = engine.config().model.clone();
    let running = || {
        let (client, url) = (client.clone(), engine.base_url());
        async move {
            let text = client
                .get(format!("{url}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            metric(&text, "vllm:num_requests_running", "")
        }
    };
    let t0 = Instant::now();
    // 500 tokens at ~11 ms a step: running for about 5.5 s.
    let body = chat(&model, "a long answer please", 500, true);
    let stream = tokio::spawn({
        let (client, url) = (client.clone(), engine.base_url());
        async move {
            client
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    });
    engine.wait_for(|s| s.running == 1).await.unwrap();
    // Running now, but the gauges were last refreshed at start: still 0.
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(running().await, 0.0);
    // After the refresh at 2 s they show it.
    tokio::time::sleep_until(t0 + Duration::from_millis(2_001)).await;
    assert_eq!(running().await, 1.0);
    // It finishes before 6 s; the gauge says 1 until the refresh after that.
    let text = stream.await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    let done = t0.elapsed();
    assert!(done < Duration::from_secs(6), "{done:?}");
    assert_eq!(engine.stats().running, 0);
    assert_eq!(running().await, 1.0);
    tokio::time::sleep_until(t0 + Duration::from_millis(6_001)).await;
    assert_eq!(running().await, 0.0);
    engine.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_conversation_resent_with_its_history_hits_the_prefix_cache() {
    let (engine, client) = start(EngineConfig::tiny_fast()).await;
    let model = engine.config().model.clone();
    let send = |messages: Value| {
        let (client, url, model) = (client.clone(), engine.base_url(), model.clone());
        async move {
            let r: Value = client
                .post(format!("{url}/v1/chat/completions"))
                .json(&json!({"model": model, "messages": messages, "max_tokens": 12}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            r
        }
    };
    let question = "How high does the river rise in a wet spring, and how quickly? ".repeat(4);
    let first = send(json!([{"role": "user", "content": question}])).await;
    let p1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap();
    // The next turn resends the first question and the answer, then asks again: the
    // first turn's prompt and answer are a prefix of it, cached in whole blocks.
    let second = send(json!([
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And in a dry one?"},
    ]))
    .await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // The first turn's prompt and 12 answer tokens, less the partial last block.
    assert_eq!(cached, (p1 + 12) / 16 * 16, "{second}");
    // A different conversation misses.
    let other = send(json!([{"role": "user", "content": "Something else entirely."}])).await;
    assert_eq!(other["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let m = get(&client, &engine, "/metrics")
        .await
        .text()
        .await
        .unwrap();
    let p2 = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let p3 = other["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        metric(&m, "vllm:prefix_cache_queries_total", ""),
        (p1 + p2 + p3) as f64
    );
    assert_eq!(
        metric(&m, "vllm:prefix_cache_hits_total", ""),
        cached as f64
    );
    // With the prefix cache off nothing is cached.
    engine.shutdown().await.unwrap();
    let mut config = EngineConfig::tiny_fast();
    config.gpu.prefix_caching = false;
    let (engine, client) = start(config).await;
    for _ in 0..2 {
        let r: Value = client
            .post(format!("{}/v1/chat/completions", engine.base_url()))
            .json(&json!({"model": model, "max_tokens": 2,
                "messages": [{"role": "user", "content": question}]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    }
    engine.shutdown().await.unwrap();
}
