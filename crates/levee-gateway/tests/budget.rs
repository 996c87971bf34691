//! Token- and KV-aware admission end to end: budgets learned from the engines, context
//! checks, the injected completion budget, choices counted, lanes isolated per model.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::config::{BackendConfig, BackendKind, ModelConfig};
use levee_gateway::start;
use serde_json::Value;
use std::time::Duration;

async fn state(c: &reqwest::Client, admin: &str) -> Value {
    c.get(format!("{admin}/admin/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A chat asking `max_tokens` with a prompt of about `prompt_tokens` tokens.
fn sized(prompt_tokens: usize, max_tokens: u64) -> Value {
    serde_json::json!({"model": "m", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "abcd".repeat(prompt_tokens)}]})
}

#[tokio::test]
async fn a_vllm_style_engine_is_budgeted_by_the_kv_tokens_it_reports() {
    // 2,048 KV tokens and 8 sequence slots, in crash mode: more tokens in flight than its
    // cache holds and it restarts, failing everything it runs.
    let mut ecfg = levee_engine::EngineConfig::tiny_fast();
    ecfg.model = "m".into();
    ecfg.gpu.overload = levee_engine::OverloadMode::Crash;
    let e = levee_engine::spawn(ecfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut cfg = config(&[e.base_url()], 8);
    cfg.scrape.interval_ms = 50;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let admin = gw.admin_url();
    // Learned: 128 blocks × 16 tokens, and max_model_len 1,024.
    let mut learned = Value::Null;
    for _ in 0..200 {
        learned = state(&c, &admin).await["models"][0]["backends"][0].clone();
        if learned["kv_tokens"] == 2048 && learned["learned"]["max_context"] == 1024 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(learned["kv_tokens"], 2048, "{learned}");
    assert_eq!(learned["learned"]["max_context"], 1024, "{learned}");
    // Longer than the context: refused at the gateway, before any queue.
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&sized(1_100, 16))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(
        error_json(r).await["error"]["code"],
        "context_length_exceeded"
    );
    // Eight requests of ~700 tokens each: 5,600 tokens would crash the engine; levee keeps
    // at most two in flight (1,945 usable tokens after 5% headroom) and serves them all.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (c, url) = (c.clone(), gw.public_url());
        tasks.push(tokio::spawn(async move {
            c.post(format!("{url}/v1/chat/completions"))
                .bearer_auth("key-s")
                .json(&sized(600, 100))
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    let mut peak = 0u64;
    while !tasks.iter().all(|t| t.is_finished()) {
        let b = state(&c, &admin).await["models"][0]["backends"][0].clone();
        peak = peak.max(b["tokens_in_flight"].as_u64().unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert!(peak <= 1_945, "peak {peak} tokens in flight");
    assert!(peak > 0);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_llamacpp_style_server_is_budgeted_by_its_slots_and_context() {
    let m = mock().await;
    *m.state.props.lock() = Some(serde_json::json!({
        "total_slots": 2,
        "default_generation_settings": {"n_ctx": 512},
    }));
    let mut cfg = config(&[m.url()], 64);
    cfg.models[0].backends[0].kind = BackendKind::Llamacpp;
    cfg.scrape.interval_ms = 50;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let mut b = Value::Null;
    for _ in 0..200 {
        b = state(&c, &gw.admin_url()).await["models"][0]["backends"][0].clone();
        if b["max_in_flight"] == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(b["max_in_flight"], 2, "{b}");
    assert_eq!(b["kv_tokens"], 1024, "{b}");
    assert_eq!(b["learned"]["max_context"], 512, "{b}");
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&sized(400, 200))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Two slots: a third request waits in levee, not in the server.
    m.hold(true);
    let held: Vec<_> = (0..3)
        .map(|i| spawn_chat(&c, &gw.public_url(), "s", &format!("h{i}")))
        .collect();
    let g = gw.gateway().clone();
    wait_until("two running, one queued", || {
        m.count() == 2 && g.queued() == 1
    })
    .await;
    m.release(3);
    for h in held {
        assert_eq!(h.await.unwrap().status(), 200);
    }
    assert_eq!(m.count(), 3);
    gw.shutdown().await;
}

#[tokio::test]
async fn the_default_completion_budget_is_injected_and_choices_multiply_it() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.models[0].default_max_tokens = Some(77);
    cfg.tenants[1].tokens_per_minute = 400;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let send = |body: Value| {
        c.post(format!("{}/v1/chat/completions", gw.public_url()))
            .bearer_auth("key-s")
            .json(&body)
            .send()
    };
    let r =
        send(serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
            .await
            .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(m.received().last().unwrap()["max_tokens"], 77);
    // n = 6 choices of 77 tokens: 462 tokens, more than the tenant's 400 per minute.
    let r = send(serde_json::json!({"model": "m", "n": 6,
        "messages": [{"role": "user", "content": "hi"}]}))
    .await
    .unwrap();
    assert_eq!(r.status(), 400, "{:?}", r.text().await);
    // The client's own max_tokens is sent as it is.
    let r = send(serde_json::json!({"model": "m", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}]}))
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(m.received().last().unwrap()["max_tokens"], 5);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_flood_on_one_model_leaves_another_alone() {
    let a = mock().await;
    let b = mock().await;
    let mut cfg = config(&[a.url()], 2);
    cfg.queue.safe = 2;
    cfg.queue.soft = 4;
    cfg.queue.hard = 6;
    cfg.models.push(ModelConfig {
        name: "other".into(),
        backends: vec![BackendConfig {
            url: b.url(),
            max_in_flight: 2,
            ..BackendConfig::default()
        }],
        ..ModelConfig::default()
    });
    let gw = start(cfg).await.unwrap();
    let c = client();
    a.hold(true);
    // Model m at its hard mark: 2 running, 4 queued, the rest refused.
    let flood: Vec<_> = (0..10)
        .map(|i| spawn_chat(&c, &gw.public_url(), "s", &format!("f{i}")))
        .collect();
    let g = gw.gateway().clone();
    wait_until("model m full", || a.count() == 2 && g.queued() == 4).await;
    // Model "other" is served at once.
    let mut body = chat_body("quiet");
    body["model"] = "other".into();
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-levee-queue-ms").is_none());
    a.release(10);
    let mut codes = Vec::new();
    for t in flood {
        codes.push(t.await.unwrap().status().as_u16());
    }
    assert_eq!(codes.iter().filter(|c| **c == 200).count(), 6, "{codes:?}");
    assert_eq!(codes.iter().filter(|c| **c == 429).count(), 4, "{codes:?}");
    gw.shutdown().await;
}

/// A streamed chat of a short prompt asking `max_tokens`; with `to_the_end` the engine
/// ignores its end of sequence and runs to `max_tokens`.
fn streamed(tag: &str, max_tokens: u64, to_the_end: bool) -> Value {
    serde_json::json!({"model": "m", "max_tokens": max_tokens, "stream": true,
        "ignore_eos": to_the_end, "messages": [{"role": "user", "content": tag}]})
}

/// Sends `body` and reads its stream to the end: its text.
async fn stream_text(c: reqwest::Client, url: String, body: Value) -> String {
    let r = post_chat(&c, &url, "s", &body).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// A simulated engine of model "m" (`speed` × its simulated speed) with `kv` KV tokens and
/// a context of `context`, in `overload` mode, behind levee with its budget learned.
async fn engine_behind_levee(
    (kv, context): (u32, u32),
    overload: levee_engine::OverloadMode,
    speed: f64,
) -> (levee_engine::EngineHandle, levee_gateway::GatewayHandle) {
    let mut ecfg = levee_engine::EngineConfig::tiny_fast();
    ecfg.model = "m".into();
    ecfg.time_scale = speed;
    ecfg.gpu.kv_capacity_tokens = kv;
    ecfg.gpu.max_model_len = context;
    ecfg.gpu.overload = overload;
    let e = levee_engine::spawn(ecfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let mut cfg = config(&[e.base_url()], 8);
    cfg.scrape.interval_ms = 50;
    let gw = start(cfg).await.unwrap();
    let (c, admin) = (client(), gw.admin_url());
    for _ in 0..200 {
        if state(&c, &admin).await["models"][0]["backends"][0]["kv_tokens"] == kv {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (e, gw)
}

/// Serves 40 streams asking `max_tokens` whose answers end at the engine's 8-16 tokens:
/// levee learns what answers use (the first 32 hold their whole `max_tokens`).
async fn teach_short_answers(c: &reqwest::Client, url: &str, max_tokens: u64) {
    let learn: Vec<_> = (0..40)
        .map(|i| {
            let body = streamed(&format!("q{i}"), max_tokens, false);
            tokio::spawn(stream_text(c.clone(), url.to_string(), body))
        })
        .collect();
    for t in learn {
        assert!(t.await.unwrap().contains("[DONE]"));
    }
}

/// `kv.grow_streams`: streams that ask far more than their answers use hold what answers
/// were seen to use, so more of them run at once; when some do run long, their holds grow
/// with their tokens, and one whose engine has no room left is cut (`stream_kv_budget`)
/// before the engine's cache overflows — an engine that crashes on overflow never does.
#[tokio::test]
async fn streams_hold_what_answers_use_and_grow_until_the_engine_has_no_room() {
    let (e, gw) = engine_behind_levee((1_024, 1_024), levee_engine::OverloadMode::Crash, 4.0).await;
    let (c, url, admin) = (client(), gw.public_url(), gw.admin_url());
    // Asked with max_tokens 400, the first 32 hold all of it (about two fit the 972 usable
    // tokens at once).
    teach_short_answers(&c, &url, 400).await;
    // Eight that run to all 400 tokens: 3,300 tokens if all ran, three times the cache.
    let long: Vec<_> = (0..8)
        .map(|i| {
            tokio::spawn(stream_text(
                c.clone(),
                url.clone(),
                streamed(&format!("long {i}"), 400, true),
            ))
        })
        .collect();
    let mut peak = 0;
    while !long.iter().all(|t| t.is_finished()) {
        let b = state(&c, &admin).await["models"][0]["backends"][0].clone();
        peak = peak.max(b["in_flight"].as_u64().unwrap_or(0));
        assert!(b["tokens_in_flight"].as_u64().unwrap_or(0) <= 972, "{b}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (mut whole, mut cut) = (0, 0);
    for t in long {
        let text = t.await.unwrap();
        if text.contains("[DONE]") {
            whole += 1;
        } else {
            assert!(text.contains("\"code\":\"stream_kv_budget\""), "{text}");
            cut += 1;
        }
    }
    assert_eq!(e.stats().crashes, 0, "the engine's cache overflowed");
    assert!(
        peak >= 4,
        "held whole, at most two would run at once; peak {peak}"
    );
    assert!(
        whole >= 1 && cut >= 1,
        "{whole} ran to their end, {cut} were cut"
    );
    let m = metrics_text(&gw).await;
    assert!(m.contains("reason=\"stream_kv_budget\""), "{m}");
    gw.shutdown().await;
}

/// `kv.grow_streams`: a client that stops reading its stream leaves the engine's tokens out
/// of levee's sight once its stream's buffers fill, so the stream holds its whole
/// `max_tokens` from then on.
#[tokio::test]
async fn a_stream_whose_client_stops_reading_holds_its_whole_budget() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_e, gw) = engine_behind_levee(
        (262_144, 200_000),
        levee_engine::OverloadMode::Preempt,
        100.0,
    )
    .await;
    let (c, url, admin) = (client(), gw.public_url(), gw.admin_url());
    teach_short_answers(&c, &url, 100).await;
    // A client with a 4 KB receive buffer that reads the head and then nothing: an answer
    // of 150,000 tokens runs on.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4_096).unwrap();
    let addr = url.trim_start_matches("http://").parse().unwrap();
    let mut conn = sock.connect(addr).await.unwrap();
    let body = streamed("never read", 150_000, true).to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: levee\r\nauthorization: Bearer key-s\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut head = [0u8; 512];
    let n = conn.read(&mut head).await.unwrap();
    assert!(
        head[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head[..n])
    );
    // Counted as it came, its hold would have doubled to at most twice what was read before
    // the buffers on the way filled (the kernel's alone take megabytes: some 30,000 tokens
    // here); held whole, it is all 150,000.
    let mut held = 0;
    for _ in 0..1_500 {
        let b = state(&c, &admin).await["models"][0]["backends"][0].clone();
        held = b["tokens_in_flight"].as_u64().unwrap_or(0);
        if held >= 150_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(held >= 150_000, "the stream holds {held} tokens");
    drop(conn);
    gw.shutdown().await;
}

/// `kv.grow_streams` keeps tenants apart: a tenant whose answers all run long (vLLM's
/// `ignore_eos`) is admitted at what answers were seen to use, then held to its fair share
/// as its streams grow; when a quiet tenant's long answer needs room the flooder took
/// meanwhile, the flooder's youngest streams are cut for it, never the quiet one, and the
/// engine (which crashes on overflow) never overflows.
///
/// Whether the quiet stream's growth finds the flooder holding its room, or the flooder's
/// own growth is refused first (freeing room), is a matter of timing: each run must keep the
/// quiet stream whole and the engine under its cache, and within three runs a flooder's
/// stream must have been cut for the quiet one (a run without it was seen once in six).
#[tokio::test]
async fn a_tenant_whose_answers_run_long_cannot_cut_a_quiet_tenants_stream() {
    for run in 1..=3 {
        if quiet_stream_beside_a_long_flood().await >= 1 {
            return;
        }
        eprintln!("run {run}: no flooder's stream was cut for the quiet one; again");
    }
    panic!("no flooder's stream gave its room back in three runs");
}

/// One run of [`a_tenant_whose_answers_run_long_cannot_cut_a_quiet_tenants_stream`]: the
/// flooder's streams cut for the quiet one.
async fn quiet_stream_beside_a_long_flood() -> usize {
    let (e, gw) = engine_behind_levee((2_048, 2_048), levee_engine::OverloadMode::Crash, 4.0).await;
    let (c, url, admin) = (client(), gw.public_url(), gw.admin_url());
    // Tenant "s" learns the lane short answers; then "a" floods with answers that run to
    // their 900 tokens, six at a time, sending again as each ends or is cut.
    teach_short_answers(&c, &url, 900).await;
    let (quiet_done, stop) = tokio::sync::watch::channel(false);
    let flood: Vec<_> = (0..6)
        .map(|i| {
            let (c, url, stop) = (c.clone(), url.clone(), stop.clone());
            tokio::spawn(async move {
                let mut texts = Vec::new();
                // It stops between answers, never in one: an answer cut as the quiet one
                // ends is still read and counted.
                for n in 0..20 {
                    if *stop.borrow() {
                        break;
                    }
                    let body = streamed(&format!("flood {i} {n}"), 900, true);
                    let answer = post_chat(&c, &url, "a", &body).await.text().await;
                    texts.push(answer.unwrap());
                }
                texts
            })
        })
        .collect();
    // Once the flooder holds more than half the cache, the quiet tenant's answer of 800
    // tokens starts.
    for _ in 0..500 {
        let b = state(&c, &admin).await["models"][0]["backends"][0].clone();
        if b["tokens_in_flight"].as_u64().unwrap_or(0) > 1_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let quiet = tokio::spawn(stream_text(
        c.clone(),
        url.clone(),
        streamed("quiet", 800, true),
    ));
    while !quiet.is_finished() {
        let b = state(&c, &admin).await["models"][0]["backends"][0].clone();
        assert!(b["tokens_in_flight"].as_u64().unwrap_or(0) <= 1_945, "{b}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let quiet = quiet.await.unwrap();
    quiet_done.send_replace(true);
    let mut taken = 0;
    for t in flood {
        for text in t.await.unwrap() {
            taken += usize::from(text.contains("a tenant within its share needed the room"));
        }
    }
    assert!(
        quiet.contains("[DONE]"),
        "the quiet tenant's stream was cut: {quiet}"
    );
    assert_eq!(e.stats().crashes, 0, "the engine's cache overflowed");
    gw.shutdown().await;
    taken
}
