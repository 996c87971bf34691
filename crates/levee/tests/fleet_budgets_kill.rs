//! One fleet, many gateways (issue 20): three real `levee serve` replicas on Redis in front
//! of two shared backends hold each backend's budget between them — requests in flight at
//! one (its slots) and KV reservations at the other (its KV tokens), measured by the
//! backends themselves all through a concurrent load — and a replica killed with `kill -9`
//! gives its slice back to the others once its lease has passed.
//!
//! Uses the Redis on 127.0.0.1:6379 under a key prefix of this run's own, deleted at the
//! end; skipped with a message when it is unreachable, unless `LEVEE_REQUIRE_REDIS=1`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use axum::routing::post;
use common::{clear, redis_or_skip, serve, Gateway, REDIS};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const REPLICAS: usize = 3;
const HEARTBEAT_MS: u64 = 200;
/// The lease: three heartbeats (what `Shared` sets).
const LEASE_MS: u64 = 3 * HEARTBEAT_MS;
/// The slots backend: requests in flight at most.
const SLOTS: u64 = 6;
/// The KV backend: its KV budget, and each request's completion budget.
const KV: u64 = 8_000;
const MAX_TOKENS: u64 = 1_000;

/// A backend that measures what it holds: requests in flight and the sum of their
/// `max_tokens` (a lower bound of levee's KV reservations for them), now and at most.
/// Requests whose tag starts with a held replica's name wait until it is released.
#[derive(Default)]
struct Meter {
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    tokens: AtomicU64,
    max_tokens: AtomicU64,
    served: AtomicU64,
    held: Mutex<Vec<String>>,
    /// Tags of the requests in flight.
    tags: Mutex<Vec<String>>,
    delay_ms: AtomicU64,
}

impl Meter {
    fn holds(&self, tag: &str) -> bool {
        self.held.lock().unwrap().iter().any(|h| tag.starts_with(h))
    }
    fn in_flight_of(&self, prefix: &str) -> usize {
        self.tags
            .lock()
            .unwrap()
            .iter()
            .filter(|t| t.starts_with(prefix))
            .count()
    }
}

/// Leaves the meter when the request ends, however it ends (a dropped connection too).
struct InFlight {
    m: Arc<Meter>,
    tokens: u64,
    tag: String,
}

impl InFlight {
    fn new(m: &Arc<Meter>, tokens: u64, tag: String) -> Self {
        m.tags.lock().unwrap().push(tag.clone());
        let n = m.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        m.max_in_flight.fetch_max(n, Ordering::SeqCst);
        let t = m.tokens.fetch_add(tokens, Ordering::SeqCst) + tokens;
        m.max_tokens.fetch_max(t, Ordering::SeqCst);
        InFlight {
            m: m.clone(),
            tokens,
            tag,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.m.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.m.tokens.fetch_sub(self.tokens, Ordering::SeqCst);
        let mut tags = self.m.tags.lock().unwrap();
        if let Some(i) = tags.iter().position(|t| *t == self.tag) {
            tags.swap_remove(i);
        }
    }
}

async fn backend() -> (String, Arc<Meter>) {
    let m = Arc::new(Meter::default());
    m.delay_ms.store(20, Ordering::SeqCst);
    let m2 = m.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::Json<Value>| {
            let m = m2.clone();
            async move {
                let tag = common::tag(&body);
                let tokens = body["max_tokens"].as_u64().unwrap_or(0);
                let _guard = InFlight::new(&m, tokens, tag.clone());
                while m.holds(&tag) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(m.delay_ms.load(Ordering::SeqCst))).await;
                m.served.fetch_add(1, Ordering::SeqCst);
                common::completion("ok", 5)
            }
        }),
    );
    (serve(app).await, m)
}

fn spawn(dir: &std::path::Path, i: usize, slots_url: &str, kv_url: &str, prefix: &str) -> Gateway {
    let config = |port, admin| {
        format!(
            r#"
[listen]
public = "127.0.0.1:{port}"
admin = "127.0.0.1:{admin}"

[scrape]
interval_ms = 0

[state]
backend = "redis"
url = "{REDIS}"
key_prefix = "{prefix}"
timeout_ms = 2000
heartbeat_ms = {HEARTBEAT_MS}
replica_id = "r{i}"

[tiers.standard]
priority = 1
queue_wait_ms = 30000
soft_queue_wait_ms = 30000

[[tenants]]
name = "a"
tier = "standard"
key_sha256 = ["{key}"]

[[models]]
name = "s"
[[models.backends]]
url = "{slots_url}"
max_in_flight = {SLOTS}

[[models]]
name = "k"
[[models.backends]]
url = "{kv_url}"
max_in_flight = 64
max_kv_tokens = {KV}
"#,
            key = levee_gateway::hash_key(common::KEY),
        )
    };
    Gateway::replica(dir, i, config, &[])
}

/// Waits until the replica answers and holds a granted slice of every backend.
async fn granted(c: &reqwest::Client, r: &Gateway) {
    for _ in 0..800 {
        if let Ok(resp) = c.get(format!("{}/admin/state", r.admin)).send().await {
            if let Ok(v) = resp.json::<Value>().await {
                let slices: Vec<bool> = v["models"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|m| m["backends"].as_array().cloned().unwrap_or_default())
                    .map(|b| b["fleet_slice"]["granted"] == true)
                    .collect();
                if slices.len() == 2 && slices.iter().all(|g| *g) {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("replica {} never got its slices", r.base);
}

/// One request of `model` through `base`, tagged `tag`: its status.
async fn ask(c: &reqwest::Client, base: &str, model: &str, tag: &str) -> u16 {
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(common::KEY)
        .json(&json!({"model": model, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": tag}]}))
        .send()
        .await;
    r.map(|r| r.status().as_u16()).unwrap_or(0)
}

/// Polls `cond` every 5 ms for at most `limit`: how long it took to hold.
async fn until(limit: Duration, cond: impl Fn() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_hold_each_backend_budget_and_a_killed_one_frees_its_slice() {
    let Some((mut conn, prefix)) = redis_or_skip("fleet-budget").await else {
        return;
    };
    let (slots_url, slots) = backend().await;
    let (kv_url, kv) = backend().await;
    let dir = common::fresh_dir("fleet-budget");
    let c = reqwest::Client::new();
    let mut replicas: Vec<Option<Gateway>> = (0..REPLICAS)
        .map(|i| Some(spawn(&dir, i, &slots_url, &kv_url, &prefix)))
        .collect();
    for r in replicas.iter().flatten() {
        granted(&c, r).await;
    }
    let bases: Vec<String> = replicas.iter().flatten().map(|r| r.base.clone()).collect();

    // 1. Concurrent load: eight clients per replica per model, each asking again as soon as
    //    it has its answer, for two seconds.
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for (i, base) in bases.iter().enumerate() {
        for model in ["s", "k"] {
            for j in 0..8 {
                let (c, base, stop) = (c.clone(), base.clone(), stop.clone());
                clients.push(tokio::spawn(async move {
                    let mut ok = 0u64;
                    let mut n = 0;
                    while !stop.load(Ordering::SeqCst) {
                        n += 1;
                        if ask(&c, &base, model, &format!("load-r{i}-{j}-{n}")).await == 200 {
                            ok += 1;
                        }
                    }
                    ok
                }));
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    let mut ok = 0;
    for t in clients {
        ok += t.await.unwrap();
    }
    let (max_slots, max_kv) = (
        slots.max_in_flight.load(Ordering::SeqCst),
        kv.max_tokens.load(Ordering::SeqCst),
    );
    eprintln!(
        "load: {ok} answered; slots backend: at most {max_slots} in flight (budget {SLOTS}), \
         {} served; KV backend: at most {max_kv} tokens of max_tokens in flight (budget {KV}), \
         {} served",
        slots.served.load(Ordering::SeqCst),
        kv.served.load(Ordering::SeqCst),
    );
    assert!(
        max_slots <= SLOTS,
        "{max_slots} in flight over the budget {SLOTS}"
    );
    assert!(
        max_kv <= KV,
        "{max_kv} KV tokens in flight over the budget {KV}"
    );
    assert!(slots.served.load(Ordering::SeqCst) > 0 && kv.served.load(Ordering::SeqCst) > 0);
    assert!(ok > 0);
    // Each replica's replica recommendation counts the fleet's arrivals: every replica
    // published its demand through Redis and sees the three.
    let admins: Vec<String> = replicas.iter().flatten().map(|r| r.admin.clone()).collect();
    for admin in &admins {
        let mut seen = Value::Null;
        for _ in 0..200 {
            let v: Value = c
                .get(format!("{admin}/admin/state"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            seen = v["autoscale"]["s"].clone();
            if seen["gateways"] == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(seen["gateways"], 3, "{admin}: {seen}");
    }

    // 2. kill -9. Slices settle while idle (each replica wants its margin), then each
    //    replica sends as many held requests as its share, and the survivors more, which
    //    wait in their queues.
    until(Duration::from_secs(5), || {
        slots.in_flight.load(Ordering::SeqCst) == 0
    })
    .await
    .expect("the load drained");
    tokio::time::sleep(Duration::from_millis(3 * HEARTBEAT_MS)).await;
    *slots.held.lock().unwrap() = vec!["kill-".to_string()];
    let share = SLOTS as usize / REPLICAS;
    let mut held = Vec::new();
    for (i, base) in bases.iter().enumerate() {
        for j in 0..share {
            let (c, base) = (c.clone(), base.clone());
            held.push(tokio::spawn(async move {
                ask(&c, &base, "s", &format!("kill-r{i}-{j}")).await
            }));
        }
    }
    let filled = until(Duration::from_secs(10), || {
        (0..REPLICAS).all(|i| slots.in_flight_of(&format!("kill-r{i}-")) == share)
    })
    .await;
    assert!(
        filled.is_some(),
        "each replica holds its share: in flight {:?}",
        slots.tags.lock().unwrap()
    );
    for (i, base) in bases.iter().enumerate().skip(1) {
        for j in share..2 * share {
            let (c, base) = (c.clone(), base.clone());
            held.push(tokio::spawn(async move {
                ask(&c, &base, "s", &format!("kill-r{i}-{j}")).await
            }));
        }
    }
    // The survivors' extra requests stay queued while r0 holds its slice.
    tokio::time::sleep(Duration::from_millis(2 * HEARTBEAT_MS)).await;
    assert_eq!(
        slots.in_flight.load(Ordering::SeqCst),
        SLOTS,
        "in flight {:?}",
        slots.tags.lock().unwrap()
    );
    drop(replicas[0].take());
    let killed = Instant::now();
    // The engine drops the dead replica's requests (their connections are gone).
    *slots.held.lock().unwrap() = vec!["kill-r1".into(), "kill-r2".into()];
    let back = until(Duration::from_secs(15), || {
        slots.in_flight_of("kill-r1-") + slots.in_flight_of("kill-r2-") == SLOTS as usize
    })
    .await;
    let back = back.map(|_| killed.elapsed());
    eprintln!(
        "kill -9: r0's slice ({share} slots) back to the survivors {back:?} after the kill \
         (lease {LEASE_MS} ms, heartbeat {HEARTBEAT_MS} ms); at most {} in flight (budget {SLOTS})",
        slots.max_in_flight.load(Ordering::SeqCst)
    );
    let back = back.expect("r0's slice never came back");
    // Within the lease and the survivors' next renewal (a heartbeat), with a margin for a
    // busy machine; never over the budget meanwhile.
    assert!(
        back <= Duration::from_millis(LEASE_MS + 2 * HEARTBEAT_MS) + Duration::from_secs(2),
        "back after {back:?}"
    );
    assert!(slots.max_in_flight.load(Ordering::SeqCst) <= SLOTS);
    slots.held.lock().unwrap().clear();
    for (i, h) in held.into_iter().enumerate().skip(share) {
        assert_eq!(h.await.unwrap(), 200, "held request {i}");
    }
    drop(replicas);
    clear(&mut conn, &prefix).await;
    let _ = std::fs::remove_dir_all(&dir);
}
