//! A small fixed-rate (open-loop) HTTP load generator for bench/gateway-overhead.sh.
//!
//! Request `i` is due at `start + i / rate`; latency is measured from the time it was due
//! (so a stalled target cannot hide its queueing: no coordinated omission), and also from
//! the moment it was actually sent. Prints one JSON line.
//!
//! ```text
//! loadgen --url http://127.0.0.1:8080/v1/chat/completions --rate 5000 --secs 10 \
//!         [--warmup-secs 2] [--key KEY] [--model NAME] [--timeout-secs 30] [--count N] [--h2]
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark tool: fail loudly

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tokio::time::Instant;

struct Args {
    url: String,
    rate: f64,
    secs: f64,
    warmup_secs: f64,
    key: String,
    model: String,
    timeout: Duration,
    count: Option<u64>,
    h2: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        url: String::new(),
        rate: 1000.0,
        secs: 10.0,
        warmup_secs: 2.0,
        key: "bench".into(),
        model: "levee-sim-7b".into(),
        timeout: Duration::from_secs(30),
        count: None,
        h2: false,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--url" => a.url = v,
            "--rate" => a.rate = v.parse().unwrap(),
            "--secs" => a.secs = v.parse().unwrap(),
            "--warmup-secs" => a.warmup_secs = v.parse().unwrap(),
            "--key" => a.key = v,
            "--model" => a.model = v,
            "--timeout-secs" => a.timeout = Duration::from_secs_f64(v.parse().unwrap()),
            "--count" => a.count = Some(v.parse().unwrap()),
            "--h2" => {
                a.h2 = true;
                i += 1;
                continue;
            }
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    assert!(!a.url.is_empty(), "--url is required");
    a
}

#[derive(Default)]
struct Stats {
    due: Option<Histogram<u64>>,
    sent: Option<Histogram<u64>>,
    ok: u64,
    status_err: u64,
    io_err: u64,
    statuses: std::collections::BTreeMap<u16, u64>,
}

fn main() {
    let args = parse_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(args));
}

async fn run(args: Args) {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(100_000)
        .pool_idle_timeout(Duration::from_secs(60))
        .http2_only(args.h2)
        .build(conn);
    let body = Bytes::from(
        serde_json::json!({
            "model": args.model,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "benchmark prompt"}],
        })
        .to_string(),
    );
    let uri: http::Uri = args.url.parse().unwrap();
    let stats = Arc::new(Mutex::new(Stats {
        due: Some(Histogram::new_with_bounds(1, 60_000_000, 3).unwrap()),
        sent: Some(Histogram::new_with_bounds(1, 60_000_000, 3).unwrap()),
        ..Stats::default()
    }));
    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let total = args
        .count
        .unwrap_or(((args.secs + args.warmup_secs) * args.rate) as u64);
    let warmup = (args.warmup_secs * args.rate) as u64;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut max_lag = Duration::ZERO;
    for i in 0..total {
        let due = start + interval.mul_f64(i as f64);
        tokio::time::sleep_until(due).await;
        max_lag = max_lag.max(Instant::now() - due);
        let client = client.clone();
        let body = body.clone();
        let uri = uri.clone();
        let key = args.key.clone();
        let stats = stats.clone();
        let timeout = args.timeout;
        tasks.spawn(async move {
            let sent = Instant::now();
            let req = http::Request::post(uri)
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {key}"))
                .body(Full::new(body))
                .unwrap();
            let res = tokio::time::timeout(timeout, async {
                let resp = client.request(req).await?;
                let status = resp.status().as_u16();
                resp.into_body().collect().await?;
                Ok::<u16, Box<dyn std::error::Error + Send + Sync>>(status)
            })
            .await;
            let done = Instant::now();
            if i < warmup {
                return;
            }
            let mut s = stats.lock().await;
            match res {
                Ok(Ok(status)) => {
                    *s.statuses.entry(status).or_default() += 1;
                    if status == 200 {
                        s.ok += 1;
                        let d = (done - due).as_micros() as u64;
                        let x = (done - sent).as_micros() as u64;
                        let _ = s.due.as_mut().unwrap().record(d.max(1));
                        let _ = s.sent.as_mut().unwrap().record(x.max(1));
                    } else {
                        s.status_err += 1;
                    }
                }
                _ => s.io_err += 1,
            }
        });
        // Reap finished tasks so the set does not grow without bound.
        while let Some(r) = tasks.try_join_next() {
            let _ = r;
        }
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = (Instant::now() - start).as_secs_f64();
    let s = stats.lock().await;
    let due = s.due.as_ref().unwrap();
    let sent = s.sent.as_ref().unwrap();
    let q = |h: &Histogram<u64>, p: f64| h.value_at_quantile(p) as f64 / 1000.0;
    println!(
        "{}",
        serde_json::json!({
            "url": args.url,
            "rate": args.rate,
            "requests": total - warmup,
            "ok": s.ok,
            "non_200": s.status_err,
            "io_errors": s.io_err,
            "statuses": s.statuses,
            "elapsed_s": elapsed,
            "max_schedule_lag_ms": max_lag.as_secs_f64() * 1000.0,
            "ms_from_due": {"p50": q(due, 0.5), "p90": q(due, 0.9), "p99": q(due, 0.99), "p999": q(due, 0.999), "max": due.max() as f64 / 1000.0},
            "ms_from_sent": {"p50": q(sent, 0.5), "p90": q(sent, 0.9), "p99": q(sent, 0.99), "p999": q(sent, 0.999), "max": sent.max() as f64 / 1000.0},
        })
    );
}
