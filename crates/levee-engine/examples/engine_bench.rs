//! Load benchmark of one simulated engine: can it hold thousands of concurrent streams on
//! this machine while keeping its simulated step time?
//!
//! Two roles, run as two processes by `bench/engine_bench.sh`:
//! - `engine_bench serve --port P [engine flags]`: one engine (the same flags as `levee engine`).
//! - `engine_bench load --url http://127.0.0.1:P --streams N --seconds S --engine-pid PID`:
//!   opens N concurrent streaming chat requests, waits until all are running, then measures
//!   over S seconds: achieved vs configured mean step time (from `/admin/state`), tokens/s
//!   received, and the engine process's CPU (from /proc).

// A benchmark tool: failing loudly on a broken setup is what we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::{Parser, Subcommand};
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(Subcommand)]
enum Role {
    /// Run one engine until killed.
    Serve(levee_engine::EngineArgs),
    /// Drive an engine with concurrent streams and report.
    Load {
        #[arg(long)]
        url: String,
        #[arg(long, default_value_t = 2000)]
        streams: usize,
        #[arg(long, default_value_t = 20.0)]
        seconds: f64,
        /// The engine's process id, to read its CPU time.
        #[arg(long)]
        engine_pid: Option<u32>,
        /// Tokens per stream (ignore_eos): long enough to outlast the measurement.
        #[arg(long, default_value_t = 3000)]
        max_tokens: u32,
    },
    /// Closed loop of non-streaming requests: what one request costs the engine (use the
    /// `zero` profile to measure the HTTP and scheduling overhead alone).
    Rps {
        #[arg(long)]
        url: String,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        #[arg(long)]
        engine_pid: Option<u32>,
        #[arg(long, default_value_t = 16)]
        max_tokens: u32,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.role {
        Role::Serve(args) => rt.block_on(levee_engine::run_cli(args)),
        Role::Load {
            url,
            streams,
            seconds,
            engine_pid,
            max_tokens,
        } => rt.block_on(load(url, streams, seconds, engine_pid, max_tokens)),
        Role::Rps {
            url,
            concurrency,
            seconds,
            engine_pid,
            max_tokens,
        } => rt.block_on(rps(url, concurrency, seconds, engine_pid, max_tokens)),
    }
}

/// utime + stime of a process, in seconds.
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

async fn state(client: &reqwest::Client, url: &str) -> Value {
    client
        .get(format!("{url}/admin/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn load(
    url: String,
    streams: usize,
    seconds: f64,
    engine_pid: Option<u32>,
    max_tokens: u32,
) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(streams)
        .build()?;
    let models: Value = client
        .get(format!("{url}/v1/models"))
        .send()
        .await?
        .json()
        .await?;
    let model = models["data"][0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let tokens = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(streams);
    for i in 0..streams {
        let client = client.clone();
        let url = url.clone();
        let tokens = tokens.clone();
        let errors = errors.clone();
        let body = json!({
            "model": model,
            "messages": [{"role": "user", "content": format!("stream {i}: tell me a long story about rivers")}],
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
        });
        tasks.push(tokio::spawn(async move {
            let resp = match client
                .post(format!("{url}/v1/chat/completions"))
                .json(&body)
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => r,
                _ => {
                    errors.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            };
            let mut body = resp.bytes_stream();
            while let Some(piece) = body.next().await {
                match piece {
                    Ok(b) => {
                        // One `"content"` per token chunk (the role chunk has content "").
                        let n = b.windows(11).filter(|w| w == b"\"content\":\"").count();
                        tokens.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
        }));
    }
    // Warm up: every stream admitted and running.
    let warm = Instant::now();
    loop {
        let s = state(&client, &url).await;
        if s["stats"]["running"].as_u64().unwrap_or(0) as usize >= streams {
            break;
        }
        anyhow::ensure!(
            warm.elapsed() < Duration::from_secs(120),
            "streams did not all start within 120 s: {s}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let warmup_secs = warm.elapsed().as_secs_f64();
    let s0 = state(&client, &url).await;
    let t0 = Instant::now();
    let tok0 = tokens.load(Ordering::Relaxed);
    let cpu0 = engine_pid.and_then(cpu_secs);
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let s1 = state(&client, &url).await;
    let wall = t0.elapsed().as_secs_f64();
    let tok1 = tokens.load(Ordering::Relaxed);
    let cpu1 = engine_pid.and_then(cpu_secs);

    let f = |s: &Value, k: &str| s["stats"][k].as_f64().unwrap_or(0.0);
    let steps = f(&s1, "steps") - f(&s0, "steps");
    let busy = f(&s1, "busy_secs") - f(&s0, "busy_secs");
    let sim = f(&s1, "sim_time_secs") - f(&s0, "sim_time_secs");
    let late = f(&s1, "late_steps") - f(&s0, "late_steps");
    let configured_ms = busy / steps * 1e3;
    let achieved_ms = sim / steps * 1e3;
    let report = json!({
        "streams": streams,
        "running_at_end": s1["stats"]["running"],
        "warmup_secs": warmup_secs,
        "window_secs": wall,
        "steps": steps,
        "configured_step_ms": configured_ms,
        "achieved_step_ms": achieved_ms,
        "achieved_over_configured": achieved_ms / configured_ms,
        "late_steps_over_1ms": late,
        "tokens_per_sec_received": (tok1 - tok0) as f64 / wall,
        "tokens_per_sec_configured": streams as f64 / (configured_ms / 1e3),
        "engine_cpu_cores": match (cpu0, cpu1) { (Some(a), Some(b)) => json!((b - a) / wall), _ => Value::Null },
        "stream_errors": errors.load(Ordering::Relaxed),
        "crashes": s1["stats"]["crashes"],
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    for t in &tasks {
        t.abort();
    }
    Ok(())
}

async fn rps(
    url: String,
    concurrency: usize,
    seconds: f64,
    engine_pid: Option<u32>,
    max_tokens: u32,
) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let models: Value = client
        .get(format!("{url}/v1/models"))
        .send()
        .await?
        .json()
        .await?;
    let model = models["data"][0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let cpu0 = engine_pid.and_then(cpu_secs);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let client = client.clone();
        let url = url.clone();
        let model = model.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut i = 0u64;
            while Instant::now() < deadline {
                i += 1;
                let body = json!({
                    "model": model,
                    "messages": [{"role": "user", "content": format!("worker {w} request {i}")}],
                    "max_tokens": max_tokens,
                    "ignore_eos": true,
                });
                let sent = Instant::now();
                let ok = match client
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                {
                    Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                    _ => false,
                };
                if ok {
                    latencies.push(sent.elapsed());
                } else {
                    errors += 1;
                }
            }
            (latencies, errors)
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await?;
        latencies.extend(l);
        errors += e;
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu1 = engine_pid.and_then(cpu_secs);
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .map(|d| d.as_secs_f64() * 1e3)
    };
    let report = json!({
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "requests_per_sec": latencies.len() as f64 / wall,
        "latency_ms_p50": pct(0.5),
        "latency_ms_p99": pct(0.99),
        "errors": errors,
        "engine_cpu_cores": match (cpu0, cpu1) { (Some(a), Some(b)) => json!((b - a) / wall), _ => Value::Null },
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
