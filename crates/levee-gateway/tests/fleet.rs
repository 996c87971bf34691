//! Three gateway replicas sharing limits through Redis (`[state] backend = "redis"`), in
//! process on ephemeral ports, against one mock backend.
//!
//! * The fleet admits within the tenant's limit where in-memory state admits about three
//!   times as much (both run here).
//! * A Redis of the test's own (`redis-server --port <free> --save ''`) is frozen, then
//!   killed, mid-run: under `fail_open` requests keep flowing on local shares and none waits
//!   past the decision timeout; the fleet returns to shared limits when Redis is back.
//! * `fail_closed` answers 503 `shared_state_unavailable` while Redis is away.
//!
//! The shared Redis on 127.0.0.1:6379 is used under a key prefix of this run's own, deleted
//! at the end. Without Redis (or `redis-server` for the restart test) the tests are skipped
//! with a message, unless `LEVEE_REQUIRE_REDIS=1` (set by CI), where they fail. Replica
//! heartbeats are driven by the test (`Shared::beat`), never waited for.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::config::{OnFailure, StateBackend};
use levee_gateway::{start, Config, GatewayHandle};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn required() -> bool {
    std::env::var("LEVEE_REQUIRE_REDIS").as_deref() == Ok("1")
}

fn skip(why: &str) {
    assert!(!required(), "LEVEE_REQUIRE_REDIS=1 but {why}");
    eprintln!("SKIPPED: {why}; set LEVEE_REQUIRE_REDIS=1 to fail instead");
}

fn unique_prefix(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("levee-test:{tag}:{}:{nanos}:", std::process::id())
}

async fn redis_up(url: &str) -> bool {
    let Ok(s) = levee_store::RedisStore::new(url, "levee-test:probe:", Duration::from_secs(1))
    else {
        return false;
    };
    let up = s
        .heartbeat("probe", Duration::from_millis(10))
        .await
        .is_ok();
    if up {
        let _ = s.clear().await;
    }
    up
}

async fn clear(url: &str, prefix: &str) {
    let s = levee_store::RedisStore::new(url, prefix, Duration::from_secs(1)).unwrap();
    s.clear().await.unwrap();
}

/// The test config: tenant `a` limited to `rpm` with `burst`, state as given.
fn fleet_config(backend: &str, url: &str, prefix: &str, rpm: u32, burst: u32) -> Config {
    let mut cfg = config(&[backend.to_string()], 64);
    cfg.ip_guard.enabled = false;
    cfg.heavy.requests_per_minute = 0;
    cfg.tenants[3].requests_per_minute = rpm;
    cfg.tenants[3].requests_burst = burst;
    cfg.tenants[4].requests_per_minute = rpm;
    cfg.tenants[4].requests_burst = burst;
    cfg.state.backend = StateBackend::Redis;
    cfg.state.url = url.to_string();
    cfg.state.key_prefix = prefix.to_string();
    // Generous: on a loaded machine a slow answer must not send a replica to its local
    // share in tests that are about the shared limit. The outage tests shorten it.
    cfg.state.timeout_ms = 2000;
    cfg.state.heartbeat_ms = 100;
    cfg
}

async fn fleet(cfg: &Config, n: usize) -> Vec<GatewayHandle> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(start(cfg.clone()).await.unwrap());
    }
    // Two rounds of heartbeats: every replica has seen all of them.
    for _ in 0..2 {
        for g in &v {
            if let Some(s) = g.gateway().shared() {
                s.beat().await;
            }
        }
    }
    v
}

/// Sends `n` requests as tenant `a`, round-robin over the replicas, `conc` at a time;
/// returns (admitted, refused with 429, other statuses, the slowest answer).
async fn flood(gws: &[GatewayHandle], n: usize, conc: usize) -> (usize, usize, Vec<u16>, Duration) {
    flood_as(gws, "a", n, conc).await
}

async fn flood_as(
    gws: &[GatewayHandle],
    who: &'static str,
    n: usize,
    conc: usize,
) -> (usize, usize, Vec<u16>, Duration) {
    let c = client();
    let urls: Vec<String> = gws.iter().map(|g| g.public_url()).collect();
    let mut ok = 0;
    let mut limited = 0;
    let mut other = Vec::new();
    let mut slowest = Duration::ZERO;
    let mut sent = 0;
    while sent < n {
        let batch: Vec<_> = (sent..(sent + conc).min(n))
            .map(|i| {
                let (c, url) = (c.clone(), urls[i % urls.len()].clone());
                tokio::spawn(async move {
                    let t = Instant::now();
                    let r = chat(&c, &url, who, &format!("r{i}")).await;
                    (r.status().as_u16(), t.elapsed())
                })
            })
            .collect();
        sent += batch.len();
        for h in batch {
            let (status, took) = h.await.unwrap();
            slowest = slowest.max(took);
            match status {
                200 => ok += 1,
                429 => limited += 1,
                s => other.push(s),
            }
        }
    }
    (ok, limited, other, slowest)
}

fn state(g: &GatewayHandle) -> serde_json::Value {
    g.gateway().state_json()["state"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_hold_the_fleet_limit_where_memory_admits_three_times() {
    let url = "redis://127.0.0.1:6379";
    if !redis_up(url).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    let prefix = unique_prefix("fleet");
    // 60 per minute, burst 30: the fleet may admit 30 at once plus one per second.
    let (rpm, burst) = (60, 30);
    let cfg = fleet_config(&m.url(), url, &prefix, rpm, burst);
    let gws = fleet(&cfg, 3).await;
    for g in &gws {
        let st = state(g);
        assert_eq!(st["live_replicas"], 3, "{st}");
        assert_eq!(st["healthy"], true, "{st}");
    }
    let t = Instant::now();
    let (ok, limited, other, _) = flood(&gws, 150, 6).await;
    let secs = t.elapsed().as_secs_f64();
    let (mut from_redis, mut from_cache) = (0.0, 0.0);
    for g in &gws {
        let text = g.gateway().metrics().encode();
        from_redis += metric(&text, "levee_state_decisions_total{source=\"redis\"}");
        from_cache += metric(&text, "levee_state_decisions_total{source=\"cache\"}");
    }
    // Each replica's admin state shows the tenant's fleet-wide figures.
    for g in &gws {
        let tenants = g.gateway().state_json()["tenants"].clone();
        let a = tenants
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "a")
            .unwrap()
            .clone();
        assert_eq!(a["limits"]["requests_limit"], burst, "{a}");
        assert!(
            a["limits"]["requests_remaining"].as_u64().unwrap() < burst as u64,
            "{a}"
        );
    }
    for g in gws {
        g.shutdown().await;
    }
    clear(url, &prefix).await;
    eprintln!(
        "shared: {ok} of 150 admitted in {secs:.2} s (limit {burst} + {rpm}/min); \
         {from_redis} Redis calls, {from_cache} refusals remembered"
    );
    // Over its limit, a tenant costs Redis one call per replica per wait, not one per
    // request: the waits here (a second) outlast the flood.
    assert_eq!(from_redis + from_cache, 150.0);
    assert!(from_cache > 0.0, "no refusal was remembered");
    assert!(other.is_empty(), "unexpected statuses {other:?}");
    assert_eq!(ok + limited, 150);
    // Redis decides atomically, so the bound is exact: the burst plus what refilled while
    // the flood ran (the flood's own wall time encloses every decision). One request of
    // tolerance covers the scripts' half-microsecond rounding slack.
    let bound = burst as f64 + rpm as f64 * secs / 60.0;
    assert!(
        ok as f64 <= bound.floor() + 1.0,
        "shared: {ok} admitted in {secs:.2} s, fleet bound {bound:.1}"
    );
    assert!(
        ok >= burst as usize,
        "shared: the burst must be usable, got {ok}"
    );

    // The same flood on in-memory state: each replica holds the whole limit.
    let mut mem = cfg.clone();
    mem.state.backend = StateBackend::Memory;
    let gws = fleet(&mem, 3).await;
    let (ok_mem, _, other, _) = flood(&gws, 150, 6).await;
    for g in gws {
        g.shutdown().await;
    }
    eprintln!("memory: {ok_mem} of 150 admitted");
    assert!(other.is_empty(), "unexpected statuses {other:?}");
    assert!(
        ok_mem >= 3 * burst as usize,
        "memory: {ok_mem} admitted; three replicas each admit a whole burst of {burst}"
    );
    assert!(
        ok_mem as f64 >= 2.5 * ok as f64,
        "memory admitted {ok_mem}, shared {ok}: expected about three times as many"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_never_over_admits_and_saves_round_trips() {
    let url = "redis://127.0.0.1:6379";
    if !redis_up(url).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    let prefix = unique_prefix("batch");
    let (rpm, burst, batch) = (60, 30, 4);
    let mut cfg = fleet_config(&m.url(), url, &prefix, rpm, burst);
    cfg.state.batch = batch;
    let gws = fleet(&cfg, 3).await;
    let t = Instant::now();
    let (ok, limited, other, _) = flood(&gws, 150, 6).await;
    let secs = t.elapsed().as_secs_f64();
    let (mut from_redis, mut from_slices) = (0.0, 0.0);
    for g in &gws {
        let text = g.gateway().metrics().encode();
        from_redis += metric(&text, "levee_state_decisions_total{source=\"redis\"}");
        from_slices += metric(&text, "levee_state_decisions_total{source=\"slice\"}");
    }
    for g in gws {
        g.shutdown().await;
    }
    clear(url, &prefix).await;
    eprintln!(
        "batched: {ok} of 150 admitted in {secs:.2} s; {from_redis} Redis calls, \
         {from_slices} from slices"
    );
    assert!(other.is_empty(), "unexpected statuses {other:?}");
    assert_eq!(ok + limited, 150);
    // Slices are charged in Redis before use: the fleet bound is the unbatched one.
    let bound = burst as f64 + rpm as f64 * secs / 60.0;
    assert!(
        ok as f64 <= bound.floor() + 1.0,
        "{ok} admitted, bound {bound:.1}"
    );
    // What batching costs: budget sitting in other replicas' slices, at most
    // replicas × (batch − 1) requests.
    let stranded = 3 * (batch as usize - 1);
    assert!(
        ok + stranded >= burst as usize,
        "{ok} admitted; at most {stranded} stranded"
    );
    // Each slice taken serves up to `batch` requests.
    assert!(
        from_slices >= ok as f64 / 2.0,
        "{from_slices} of {ok} admitted came from slices ({from_redis} Redis calls in all)"
    );
}

/// A `redis-server` of the test's own on a free port.
struct OwnRedis {
    port: u16,
    child: Option<Child>,
}

impl OwnRedis {
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    async fn start(port: u16) -> Option<OwnRedis> {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let r = OwnRedis {
            port,
            child: Some(child),
        };
        for _ in 0..500 {
            if redis_up(&r.url()).await {
                return Some(r);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let ok = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill {sig} failed");
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_then_killed_fail_open_keeps_flowing_and_shared_limits_return() {
    let port = OwnRedis::free_port();
    let Some(mut redis) = OwnRedis::start(port).await else {
        return skip("redis-server could not be started");
    };
    let m = mock().await;
    // 600 per minute, burst 30: shares of 10 at once per replica while Redis is away.
    let mut cfg = fleet_config(&m.url(), &redis.url(), "levee-test:own:", 600, 30);
    cfg.state.timeout_ms = 200;
    let timeout = Duration::from_millis(cfg.state.timeout_ms);
    let gws = fleet(&cfg, 3).await;
    let (ok, _, other, _) = flood(&gws, 9, 3).await;
    assert_eq!((ok, other.len()), (9, 0));
    let decided = |gws: &[GatewayHandle], source: &str| -> f64 {
        gws.iter()
            .map(|g| {
                let text = g.gateway().metrics().encode();
                metric(
                    &text,
                    &format!("levee_state_decisions_total{{source=\"{source}\"}}"),
                )
            })
            .sum()
    };
    assert_eq!(decided(&gws, "redis"), 9.0);

    // Frozen: connections stay open and nothing answers. No request may wait for Redis
    // longer than the decision timeout (the bound below adds a generous margin for the
    // request's own work on a loaded machine; a wait for Redis would be unbounded).
    redis.signal("-STOP");
    let t = Instant::now();
    let (ok, limited, other, slowest) = flood(&gws, 60, 6).await;
    let secs = t.elapsed().as_secs_f64();
    eprintln!("frozen: {ok} admitted, {limited} refused, slowest {slowest:?}");
    assert!(other.is_empty(), "fail_open answered {other:?}");
    assert!(ok > 0, "fail_open: requests keep flowing");
    assert!(
        slowest < timeout + Duration::from_secs(2),
        "a request waited {slowest:?} with a {timeout:?} decision timeout"
    );
    // Local shares: a third of the burst per replica, plus the refill of a third of the
    // rate (10 per second per replica) while the flood ran.
    assert!(ok + limited == 60);
    let bound = 3.0 * (10.0 + 10.0 * secs);
    assert!(
        ok as f64 <= bound.floor() + 1.0,
        "local shares: {ok} admitted, bound {bound:.1}"
    );
    for g in &gws {
        let st = state(g);
        assert_eq!(st["healthy"], false, "{st}");
        assert_eq!(st["mode"], "fail_open", "{st}");
        assert_eq!(st["live_replicas"], 3, "{st}");
        let text = g.gateway().metrics().encode();
        assert_eq!(metric(&text, "levee_state_shared"), 0.0);
        assert_eq!(
            metric(&text, "levee_state_switches_total{to=\"local\"}"),
            1.0
        );
    }
    assert!(decided(&gws, "local") >= 60.0);

    // Killed: refused connections, same behaviour (tenant `b`, whose share is untouched).
    redis.signal("-CONT");
    redis.kill();
    let (ok, _, other, slowest) = flood_as(&gws, "b", 30, 6).await;
    assert!(other.is_empty() && ok > 0, "after kill: {ok} ok, {other:?}");
    assert!(slowest < timeout + Duration::from_secs(2));

    // Back: the next heartbeat switches every replica to shared limits again.
    let _redis = OwnRedis::start(port).await.expect("redis-server restarts");
    for g in &gws {
        g.gateway().shared().unwrap().beat().await;
        let st = state(g);
        assert_eq!(st["healthy"], true, "{st}");
        let text = g.gateway().metrics().encode();
        assert_eq!(metric(&text, "levee_state_shared"), 1.0);
        // At least once: a background heartbeat may also have seen the server in the
        // moment between thaw and kill.
        assert!(metric(&text, "levee_state_switches_total{to=\"shared\"}") >= 1.0);
    }
    let before = decided(&gws, "redis");
    let (ok, _, other, _) = flood(&gws, 9, 3).await;
    assert_eq!((ok, other.len()), (9, 0));
    assert_eq!(decided(&gws, "redis"), before + 9.0);
    for g in gws {
        g.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_answers_503_until_redis_is_back() {
    let port = OwnRedis::free_port();
    let m = mock().await;
    let mut cfg = fleet_config(
        &m.url(),
        &format!("redis://127.0.0.1:{port}"),
        "levee-test:closed:",
        600,
        30,
    );
    cfg.state.on_failure = OnFailure::FailClosed;
    cfg.state.timeout_ms = 200;
    let gws = fleet(&cfg, 1).await;
    let c = client();
    let r = chat(&c, &gws[0].public_url(), "a", "x").await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let v = error_json(r).await;
    assert_eq!(v["error"]["code"], "shared_state_unavailable", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("fail_closed") && msg.contains("127.0.0.1"),
        "{msg}"
    );
    assert_eq!(state(&gws[0])["mode"], "fail_closed");
    // A tenant with no shared limits is not affected.
    assert_eq!(chat(&c, &gws[0].public_url(), "s", "y").await.status(), 200);

    let Some(_redis) = OwnRedis::start(port).await else {
        for g in gws {
            g.shutdown().await;
        }
        return skip("redis-server could not be started");
    };
    gws[0].gateway().shared().unwrap().beat().await;
    assert_eq!(chat(&c, &gws[0].public_url(), "a", "z").await.status(), 200);
    // [state] is fixed at start: a reload that changes it is refused, the old one kept.
    let mut changed = cfg.clone();
    changed.state.on_failure = OnFailure::FailOpen;
    let errs = gws[0].reload(changed).unwrap_err();
    assert!(errs[0].contains("restart"), "{errs:?}");
    assert_eq!(state(&gws[0])["on_failure"], "fail_closed");
    for g in gws {
        g.shutdown().await;
    }
}

/// The value of the series `name` (with its labels) in a Prometheus text page.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_concurrency_is_one_set_of_leases_for_the_fleet() {
    let url = "redis://127.0.0.1:6379";
    if !redis_up(url).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    let prefix = unique_prefix("lease");
    let mut cfg = fleet_config(&m.url(), url, &prefix, 0, 0);
    cfg.tenants[3].max_concurrency = 2;
    // Leases live three heartbeats: long enough that a stalled machine cannot let a held
    // one lapse during the test.
    cfg.state.heartbeat_ms = 1000;
    let gws = fleet(&cfg, 3).await;
    let c = client();
    m.hold(true);
    // Two requests in flight on two replicas hold both leases...
    let held: Vec<_> = (0..2)
        .map(|i| spawn_chat(&c, &gws[i].public_url(), "a", &format!("h{i}")))
        .collect();
    wait_until("two requests at the backend", || m.count() == 2).await;
    // ...so the third replica refuses, where in-memory state would admit two more there.
    let r = chat(&c, &gws[2].public_url(), "a", "third").await;
    assert_eq!(r.status(), 429);
    let v = error_json(r).await;
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in flight"),
        "{v}"
    );
    m.release(2);
    for h in held {
        assert_eq!(h.await.unwrap().status(), 200);
    }
    m.hold(false);
    // The leases were freed when the requests ended (the settlement runs in the
    // background: bounded retries).
    let mut freed = false;
    for _ in 0..100 {
        if chat(&c, &gws[2].public_url(), "a", "after").await.status() == 200 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(freed, "leases not freed after the requests ended");
    for g in gws {
        g.shutdown().await;
    }
    clear(url, &prefix).await;
}

/// A replica that dies (its heartbeats stop; its request never ends) holds its lease only
/// until the lease expires, three heartbeats later; its peers then count one replica less.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_leases_expire_and_its_peers_stop_counting_it() {
    let url = "redis://127.0.0.1:6379";
    if !redis_up(url).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    let prefix = unique_prefix("dead");
    let mut cfg = fleet_config(&m.url(), url, &prefix, 0, 0);
    cfg.tenants[3].max_concurrency = 1;
    let gws = fleet(&cfg, 2).await;
    let c = client();
    m.hold(true);
    let held = spawn_chat(&c, &gws[0].public_url(), "a", "held");
    wait_until("the request at the backend", || m.count() == 1).await;
    assert_eq!(
        chat(&c, &gws[1].public_url(), "a", "refused")
            .await
            .status(),
        429
    );
    // Replica 0 "dies": its background tasks (heartbeat, lease renewal) stop, its request
    // stays in flight (held at the backend) for ever. New requests are not held.
    gws[0].gateway().stop();
    m.hold(false);
    let peer = gws[1].gateway().shared().cloned().unwrap();
    let mut admitted = false;
    for _ in 0..300 {
        if chat(&c, &gws[1].public_url(), "a", "after").await.status() == 200 {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(admitted, "the dead replica's lease never expired");
    let mut live = 0;
    for _ in 0..300 {
        peer.beat().await;
        live = peer.live_replicas();
        if live == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(live, 1, "the dead replica is still counted");
    m.release(1);
    let _ = held.await;
    for g in gws {
        g.shutdown().await;
    }
    clear(url, &prefix).await;
}

/// A TCP proxy to `upstream` that, while `hold` is set, keeps Redis's answers back.
async fn holding_proxy(upstream: &str) -> (String, tokio::sync::watch::Sender<bool>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}", l.local_addr().unwrap());
    let (tx, rx) = tokio::sync::watch::channel(false);
    let upstream = upstream.to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
            let mut hold = rx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    while *hold.borrow_and_update() {
                        if hold.changed().await.is_err() {
                            return;
                        }
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    (url, tx)
}

/// Issue 22: a client that leaves while Redis decides its admission (the take made in
/// Redis, its answer not yet back) does not leave that charge behind: the take runs to its
/// end and the charge nobody holds is refunded, so the tenant's only concurrency lease is
/// free again at once (before: held until the lease expired, 15 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_the_shared_take_leaves_no_charge_behind() {
    let direct = "redis://127.0.0.1:6379";
    if !redis_up(direct).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let (url, hold) = holding_proxy("127.0.0.1:6379").await;
    let m = mock().await;
    let prefix = unique_prefix("take-gone");
    let mut cfg = fleet_config(&m.url(), &url, &prefix, 0, 0);
    cfg.tenants[3].max_concurrency = 1;
    cfg.state.heartbeat_ms = 5000;
    let gws = fleet(&cfg, 1).await;
    let c = client();
    assert_eq!(
        chat(&c, &gws[0].public_url(), "a", "warm").await.status(),
        200
    );
    hold.send_replace(true);
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let gone = impatient
        .post(format!("{}/v1/chat/completions", gws[0].public_url()))
        .bearer_auth("key-a")
        .json(&chat_body("gone"))
        .send()
        .await;
    assert!(
        gone.is_err(),
        "the client gave up while Redis held its answer"
    );
    // Redis answers only once the gateway has seen the client leave (its request counted
    // `client_gone`); released before, the take would complete for a request still alive.
    let left = "levee_requests_total{tenant=\"a\",model=\"m\",outcome=\"client_gone\"} 1";
    let mut seen = false;
    for _ in 0..1000 {
        if metrics_text(&gws[0]).await.contains(left) {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(seen, "the gateway never saw the client leave");
    hold.send_replace(false);
    let mut admitted = false;
    for _ in 0..300 {
        if chat(&c, &gws[0].public_url(), "a", "after").await.status() == 200 {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        admitted,
        "the lease taken for the client that left was never given back"
    );
    assert_eq!(
        m.count(),
        2,
        "the request whose client left never reached the backend"
    );
    for g in gws {
        g.shutdown().await;
    }
    clear(direct, &prefix).await;
}
