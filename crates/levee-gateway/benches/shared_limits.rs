//! Shared limits: what a decision costs through Redis versus in memory.
//!
//! For each store — in memory (levee-policy's limiters, what one replica uses), Redis (one
//! `EVALSHA` per decision) and Redis with local batching (slices of 16 requests) — it
//! measures:
//!
//! * decisions per second, closed loop, 64 decisions in flight;
//! * the latency of one decision (call to answer, not counting schedule lag) at an open-loop
//!   arrival rate of 1,000 and 5,000 decisions per second for 5 s each: p50, p99, max.
//!
//! A decision is the gateway's own call, `Shared::take` (or `MemoryStore::take` for memory)
//! for one of 100 tenants with request and token limits far above the load (nothing is
//! refused), followed by the settlement a served request makes (reconcile: actual tokens ≠
//! estimate, sent to Redis in the background as in the gateway). Redis is the server on
//! 127.0.0.1:6379, under a key prefix of this run's own, deleted at the end.
//!
//! `cargo bench -p levee-gateway --bench shared_limits`
#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: a panic is the report

use hdrhistogram::Histogram;
use levee_gateway::clock::TokioClock;
use levee_gateway::config::{StateBackend, StateConfig};
use levee_gateway::metrics::Metrics;
use levee_gateway::shared::Shared;
use levee_policy::{Quota, TokenQuota};
use levee_store::{LimitStore, MemoryStore, ScopeLimits, Settlement};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TENANTS: usize = 100;
const TOKENS: u64 = 300;

#[derive(Clone)]
enum Store {
    Memory(Arc<MemoryStore<TokioClock>>),
    Shared(Arc<Shared>),
}

impl Store {
    async fn decide(&self, scopes: &Arc<[ScopeLimits]>) {
        match self {
            Store::Memory(m) => {
                m.take(scopes, TOKENS, "").await.unwrap();
                m.settle(scopes, Settlement::reconcile(TOKENS, TOKENS / 2), "")
                    .await
                    .unwrap();
            }
            Store::Shared(s) => {
                let charge = s.take(scopes, TOKENS).await.unwrap().unwrap();
                charge.reconcile(TOKENS / 2);
            }
        }
    }
}

fn tenant_scopes() -> Vec<Arc<[ScopeLimits]>> {
    (0..TENANTS)
        .map(|i| {
            Arc::from(vec![
                ScopeLimits {
                    id: Arc::from("global"),
                    requests: Some(Quota::per_second(10_000_000)),
                    tokens: Some(TokenQuota::per_minute(1_000_000_000_000)),
                    concurrency: None,
                },
                ScopeLimits {
                    id: Arc::from(format!("t:bench-{i}")),
                    requests: Some(Quota::per_second(1_000_000)),
                    tokens: Some(TokenQuota::per_minute(100_000_000_000)),
                    concurrency: None,
                },
            ])
        })
        .collect()
}

async fn throughput(store: &Store, scopes: &[Arc<[ScopeLimits]>], secs: f64) -> f64 {
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for w in 0..64 {
        let (store, scopes) = (store.clone(), scopes.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            let mut i = w;
            while Instant::now() < until {
                store.decide(&scopes[i % scopes.len()]).await;
                i += 64;
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total as f64 / start.elapsed().as_secs_f64()
}

async fn latency(
    store: &Store,
    scopes: &[Arc<[ScopeLimits]>],
    rate: u64,
    secs: u64,
) -> Histogram<u64> {
    let hist = Arc::new(parking_lot::Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3).unwrap(),
    ));
    let n = rate * secs;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        tokio::time::sleep_until(start + interval * i as u32).await;
        let (store, scopes, hist) = (
            store.clone(),
            scopes[i as usize % scopes.len()].clone(),
            hist.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            store.decide(&scopes).await;
            let ns = t.elapsed().as_nanos() as u64;
            hist.lock().record(ns.max(1)).unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let h = hist.lock().clone();
    h
}

fn us(ns: u64) -> String {
    format!("{:.1} µs", ns as f64 / 1000.0)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let prefix = format!("levee-bench:{}:", std::process::id());
        let metrics = Metrics::new();
        let state = |batch: u32| StateConfig {
            backend: StateBackend::Redis,
            url: "redis://127.0.0.1:6379".into(),
            key_prefix: prefix.clone(),
            timeout_ms: 1000,
            batch,
            ..StateConfig::default()
        };
        let redis = Arc::new(Shared::new(&state(0), TokioClock::new(), &metrics).unwrap());
        redis.beat().await;
        assert!(redis.is_shared(), "Redis on 127.0.0.1:6379 is needed for this benchmark");
        let batched = Arc::new(Shared::new(&state(16), TokioClock::new(), &metrics).unwrap());
        let stores = [
            ("in memory", Store::Memory(Arc::new(MemoryStore::new(TokioClock::new())))),
            ("Redis", Store::Shared(redis.clone())),
            ("Redis, batch 16", Store::Shared(batched.clone())),
        ];
        let scopes = tenant_scopes();
        println!("| store | decisions/s (64 in flight) | at 1k/s p50 | p99 | max | at 5k/s p50 | p99 | max |");
        println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
        for (name, store) in &stores {
            // Warm up: scripts loaded, connections open, keys present.
            throughput(store, &scopes, 0.5).await;
            let tput = throughput(store, &scopes, 3.0).await;
            let mut cells = vec![format!("{tput:.0}")];
            for rate in [1000, 5000] {
                let h = latency(store, &scopes, rate, 5).await;
                cells.push(us(h.value_at_quantile(0.5)));
                cells.push(us(h.value_at_quantile(0.99)));
                cells.push(us(h.max()));
            }
            println!("| {name} | {} |", cells.join(" | "));
        }
        for s in [&redis, &batched] {
            s.leave().await;
        }
        let cleanup = levee_store::RedisStore::new("redis://127.0.0.1:6379", &prefix, Duration::from_secs(2)).unwrap();
        // Background settlements may still be landing.
        tokio::time::sleep(Duration::from_millis(200)).await;
        cleanup.clear().await.unwrap();
    });
}
