//! Async tasks shared by gateway replicas through Redis (`[state] backend = "redis"`), in
//! process on ephemeral ports, against one mock backend: a task submitted on one replica is
//! read, listed and cancelled on the others (the cancel reaches the replica that runs it and
//! cuts its upstream request) with exactly one final state written; the tenant's quota is
//! fleet-wide and a task no replica holds reports its place in the fleet's queue; a replica
//! shutting down hands its tasks back at once; consumers gone long ago leave the group; the
//! store's compare-and-set loses no update and lets one of many racing writers finish a
//! task; and a submit that cannot be stored answers 503 `task_store_unavailable` saying what
//! failed.
//!
//! The shared Redis on 127.0.0.1:6379 is used under a key prefix of this run's own, deleted
//! at the end. Without Redis the Redis tests are skipped with a message, unless
//! `LEVEE_REQUIRE_REDIS=1`, where they fail. The kill -9 test of a replica with tasks
//! queued and running is `crates/levee/tests/fleet_tasks_kill.rs` (real processes).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::config::{StateBackend, TierConfig};
use levee_gateway::task_store::{Inserted, Status, Task, TaskStore};
use levee_gateway::task_store_redis::RedisTaskStore;
use levee_gateway::{start, Config, GatewayHandle};
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

const URL: &str = "redis://127.0.0.1:6379";

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
    s.heartbeat("probe", Duration::from_millis(10))
        .await
        .is_ok()
}

async fn clear(url: &str, prefix: &str) {
    let s = levee_store::RedisStore::new(url, prefix, Duration::from_secs(1)).unwrap();
    s.clear().await.unwrap();
}

async fn redis_conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(URL)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Tasks on, in a `batch` tier, the band 2 wide on each replica, state in Redis at `url`.
fn fleet_task_config(backend: &str, url: &str, prefix: &str) -> Config {
    let mut cfg = config(&[backend.to_string()], 16);
    cfg.ip_guard.enabled = false;
    cfg.tiers.insert(
        "batch".into(),
        TierConfig {
            priority: 3,
            queue_wait_ms: 600_000,
            soft_queue_wait_ms: 600_000,
            sheddable: false,
            queue_updates: false,
            ..Default::default()
        },
    );
    cfg.tasks.enabled = true;
    cfg.tasks.max_running = 2;
    cfg.tasks.visibility_ms = 5_000;
    cfg.state.backend = StateBackend::Redis;
    cfg.state.url = url.to_string();
    cfg.state.key_prefix = prefix.to_string();
    cfg.state.timeout_ms = 2000;
    cfg.state.heartbeat_ms = 100;
    cfg
}

async fn submit(c: &reqwest::Client, base: &str, who: &str, tag: &str) -> reqwest::Response {
    c.post(format!("{base}/v1/tasks"))
        .bearer_auth(format!("key-{who}"))
        .json(&chat_body(tag))
        .send()
        .await
        .unwrap()
}

async fn get(c: &reqwest::Client, base: &str, who: &str, id: &str) -> reqwest::Response {
    c.get(format!("{base}/v1/tasks/{id}"))
        .bearer_auth(format!("key-{who}"))
        .send()
        .await
        .unwrap()
}

async fn delete(c: &reqwest::Client, base: &str, who: &str, id: &str) -> reqwest::Response {
    c.delete(format!("{base}/v1/tasks/{id}"))
        .bearer_auth(format!("key-{who}"))
        .send()
        .await
        .unwrap()
}

/// The value of the series `name` (with its labels) in a Prometheus text page.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// Tasks this replica holds in its band (placed: in a fair queue or at a backend).
fn placed(g: &GatewayHandle) -> f64 {
    metric(
        &g.gateway().metrics().encode(),
        "levee_task_band{state=\"placed\"}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_submitted_on_one_replica_is_read_listed_and_cancelled_on_another() {
    if !redis_up(URL).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    m.hold(true);
    let prefix = unique_prefix("fleet-tasks");
    let cfg = fleet_task_config(&m.url(), URL, &prefix);
    let mut gws = Vec::new();
    for _ in 0..3 {
        gws.push(start(cfg.clone()).await.unwrap());
    }
    let c = client();
    let r = submit(&c, &gws[0].public_url(), "a", "shared").await;
    assert_eq!(r.status(), 202);
    let t: Value = r.json().await.unwrap();
    let id = t["id"].as_str().unwrap().to_string();
    assert_eq!(t["status"], "queued");
    // Some replica takes it and sends it upstream (held there).
    wait_until("the task reaches the backend", || m.count() == 1).await;
    let mut runner = None;
    for _ in 0..1000 {
        runner = (0..3).find(|i| placed(&gws[*i]) == 1.0);
        if runner.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let runner = runner.expect("no replica shows the task placed in its band");
    let other = (runner + 1) % 3;
    let third = (runner + 2) % 3;
    // Every replica answers for it; another tenant gets 404 everywhere.
    for g in &gws {
        let r = get(&c, &g.public_url(), "a", &id).await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["id"], id.as_str());
        assert_eq!(get(&c, &g.public_url(), "b", &id).await.status(), 404);
    }
    assert_eq!(
        delete(&c, &gws[other].public_url(), "b", &id)
            .await
            .status(),
        404
    );
    let listed: Value = c
        .get(format!("{}/v1/tasks", gws[third].public_url()))
        .bearer_auth("key-a")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["data"][0]["id"], id.as_str(), "{listed}");
    // Cancelled on a replica that does not run it: the runner learns it at its next tick
    // and cuts the upstream request.
    let r = delete(&c, &gws[other].public_url(), "a", &id).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "cancelled", "{v}");
    wait_until("the runner cuts the upstream request", || {
        m.state.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    wait_until("the runner frees its band place", || {
        placed(&gws[runner]) == 0.0
    })
    .await;
    for g in &gws {
        let v: Value = get(&c, &g.public_url(), "a", &id)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["status"], "cancelled", "{v}");
    }
    // One final write, counted by the script itself; the queue holds nothing more.
    let mut conn = redis_conn().await;
    let finals: u32 = redis::cmd("HGET")
        .arg(format!("{prefix}task:v1:{id}"))
        .arg("finals")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(finals, 1);
    let left: u64 = redis::cmd("XLEN")
        .arg(format!("{prefix}tasks:v1:queue"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0);
    // The worker that was cut wrote nothing after the cancel: still one final state, and
    // the backend saw the task once.
    assert_eq!(m.count(), 1);
    m.release(16);
    for g in gws {
        g.shutdown().await;
    }
    clear(URL, &prefix).await;
}

/// The tenant's quota of unfinished tasks holds for the fleet, not per replica, and a task
/// no replica has taken yet reports its place among the fleet's unfinished tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_quota_is_fleet_wide_and_a_queued_task_has_its_fleet_position() {
    if !redis_up(URL).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    m.hold(true);
    let prefix = unique_prefix("fleet-tasks-quota");
    let mut cfg = fleet_task_config(&m.url(), URL, &prefix);
    cfg.tasks.max_running = 1;
    cfg.tasks.max_queued_per_tenant = 3;
    let gws = vec![
        start(cfg.clone()).await.unwrap(),
        start(cfg.clone()).await.unwrap(),
    ];
    let c = client();
    let mut ids = Vec::new();
    for (i, g) in gws.iter().enumerate() {
        let r = submit(&c, &g.public_url(), "a", &format!("q{i}")).await;
        assert_eq!(r.status(), 202);
        ids.push(
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    // One running on each replica (bands of one).
    wait_until("both replicas run a task", || m.count() == 2).await;
    let r = submit(&c, &gws[0].public_url(), "a", "q2").await;
    assert_eq!(r.status(), 202);
    let third: Value = r.json().await.unwrap();
    let id3 = third["id"].as_str().unwrap().to_string();
    // No replica has room: it waits in the stream behind the two running ones.
    assert_eq!(third["position"], 3, "{third}");
    for g in &gws {
        let v: Value = get(&c, &g.public_url(), "a", &id3)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["status"], "queued", "{v}");
        assert_eq!(v["position"], 3, "{v}");
    }
    // Three open in the fleet: a fourth is refused on either replica, though each holds
    // fewer than three.
    for g in &gws {
        let r = submit(&c, &g.public_url(), "a", "q3").await;
        assert_eq!(r.status(), 429);
        assert!(r.headers().get("retry-after").is_some());
    }
    // Another tenant has its own count.
    assert_eq!(
        submit(&c, &gws[1].public_url(), "b", "b0").await.status(),
        202
    );
    // A final state frees a place at once, fleet-wide.
    let v: Value = delete(&c, &gws[1].public_url(), "a", &ids[0])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "cancelled", "{v}");
    assert_eq!(
        submit(&c, &gws[0].public_url(), "a", "q3").await.status(),
        202
    );
    m.release(16);
    for g in gws {
        g.shutdown().await;
    }
    clear(URL, &prefix).await;
}

/// A callback receiver answering 500 while `fail` is set; counts calls and successes.
struct Receiver {
    url: String,
    fail: Arc<std::sync::atomic::AtomicBool>,
    calls: Arc<std::sync::atomic::AtomicUsize>,
    ok: Arc<std::sync::atomic::AtomicUsize>,
}

async fn receiver() -> Receiver {
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    let fail = Arc::new(AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let ok = Arc::new(AtomicUsize::new(0));
    let (f, c, o) = (fail.clone(), calls.clone(), ok.clone());
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move || {
            let (f, c, o) = (f.clone(), c.clone(), o.clone());
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                if f.load(Ordering::SeqCst) {
                    http::StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    o.fetch_add(1, Ordering::SeqCst);
                    http::StatusCode::OK
                }
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    Receiver {
        url: format!("http://{addr}/hook"),
        fail,
        calls,
        ok,
    }
}

fn callbacks(g: &GatewayHandle, state: &str) -> f64 {
    metric(
        &g.gateway().metrics().encode(),
        &format!("levee_task_callbacks_total{{state=\"{state}\"}}"),
    )
}

/// A callback the stopping replica was still retrying is taken over by another replica
/// (here through the hand-back at shutdown: the visibility timeout is far beyond the test)
/// and delivered, its attempts counted on from where the first replica left them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_a_stopping_replica_was_retrying_is_delivered_by_another() {
    if !redis_up(URL).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    std::env::set_var("LEVEE_TEST_FLEET_CALLBACK_SECRET", "fleet-s3cret");
    let m = mock().await;
    let rcv = receiver().await;
    let prefix = unique_prefix("fleet-tasks-callback");
    let mut cfg = fleet_task_config(&m.url(), URL, &prefix);
    cfg.tasks.visibility_ms = 600_000;
    cfg.tasks.callback_backoff_ms = 20;
    cfg.tasks.callback_attempts = 1000;
    cfg.tasks.callback_allow = vec!["127.0.0.1".into()];
    cfg.server.shutdown_grace_ms = 100;
    cfg.tenants[3].callback_secret_env = Some("LEVEE_TEST_FLEET_CALLBACK_SECRET".into());
    let mut gws = vec![
        start(cfg.clone()).await.unwrap(),
        start(cfg.clone()).await.unwrap(),
    ];
    let c = client();
    let mut body = chat_body("called back");
    body["callback_url"] = serde_json::json!(rcv.url);
    let t: Value = c
        .post(format!("{}/v1/tasks", gws[0].public_url()))
        .bearer_auth("key-a")
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = t["id"].as_str().unwrap().to_string();
    let calls = rcv.calls.clone();
    wait_until("two failed callback attempts", || {
        calls.load(Ordering::SeqCst) >= 2
    })
    .await;
    let first = (0..2)
        .find(|i| callbacks(&gws[*i], "failed") > 0.0)
        .expect("one replica is delivering");
    let stopping = gws.remove(first);
    stopping.shutdown().await;
    let other = &gws[0];
    // The other replica takes the delivery over and tries too (the receiver still fails).
    let mut took_over = false;
    for _ in 0..1000 {
        if callbacks(other, "failed") > 0.0 {
            took_over = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(took_over, "the other replica never tried the callback");
    rcv.fail.store(false, Ordering::SeqCst);
    let ok = rcv.ok.clone();
    wait_until("the callback is delivered", || {
        ok.load(Ordering::SeqCst) >= 1
    })
    .await;
    let mut last = Value::Null;
    for _ in 0..400 {
        last = get(&c, &other.public_url(), "a", &id)
            .await
            .json()
            .await
            .unwrap();
        if last["callback"]["delivered"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(last["callback"]["delivered"], true, "{last}");
    assert!(
        last["callback"]["attempts"].as_u64().unwrap() >= 3,
        "{last}"
    );
    assert_eq!(callbacks(other, "delivered"), 1.0);
    // Nothing left to deliver.
    let mut conn = redis_conn().await;
    let mut pending = 1;
    for _ in 0..400 {
        pending = redis::cmd("ZCARD")
            .arg(format!("{prefix}tasks:v1:callbacks"))
            .query_async(&mut conn)
            .await
            .unwrap();
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(pending, 0);
    for g in gws {
        g.shutdown().await;
    }
    clear(URL, &prefix).await;
}

/// With a visibility timeout far beyond the test, only the clean shutdown's hand-back lets
/// another replica take the task the stopping one was running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_shuts_down_hands_its_tasks_back_at_once() {
    if !redis_up(URL).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    m.hold(true);
    let prefix = unique_prefix("fleet-tasks-leave");
    let mut cfg = fleet_task_config(&m.url(), URL, &prefix);
    cfg.tasks.visibility_ms = 600_000;
    cfg.server.shutdown_grace_ms = 100;
    let mut gws = Vec::new();
    for _ in 0..2 {
        gws.push(start(cfg.clone()).await.unwrap());
    }
    let c = client();
    let t: Value = submit(&c, &gws[0].public_url(), "a", "handed")
        .await
        .json()
        .await
        .unwrap();
    let id = t["id"].as_str().unwrap().to_string();
    wait_until("the task reaches the backend", || m.count() == 1).await;
    let mut runner = None;
    for _ in 0..1000 {
        runner = (0..2).find(|i| placed(&gws[*i]) == 1.0);
        if runner.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopping = gws.remove(runner.expect("no replica shows the task placed"));
    stopping.shutdown().await;
    // The other replica claims it and sends it upstream again (at-least-once).
    wait_until("the other replica runs the task", || m.count() == 2).await;
    let reclaimed = metric(
        &gws[0].gateway().metrics().encode(),
        "levee_tasks_reclaimed_total",
    );
    assert_eq!(reclaimed, 1.0);
    let base = gws[0].public_url();
    let mut last = Value::Null;
    for _ in 0..400 {
        last = get(&c, &base, "a", &id).await.json().await.unwrap();
        if last["attempts"] == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(last["status"], "running", "{last}");
    assert_eq!(last["attempts"], 2, "{last}");
    // Both copies may now answer (the stopped replica's worker is still alive in this
    // process): one final state either way.
    m.hold(false);
    m.release(16);
    for _ in 0..400 {
        last = get(&c, &base, "a", &id).await.json().await.unwrap();
        if last["status"] == "succeeded" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(last["status"], "succeeded", "{last}");
    let mut conn = redis_conn().await;
    let finals: u32 = redis::cmd("HGET")
        .arg(format!("{prefix}task:v1:{id}"))
        .arg("finals")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(finals, 1);
    for g in gws {
        g.shutdown().await;
    }
    clear(URL, &prefix).await;
}

/// Consumers of replicas gone long ago (idle ten visibility timeouts, nothing pending) are
/// removed from the group; a live replica's consumer comes back with the first entry it
/// reads, so removing an idle one costs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_of_replicas_gone_long_ago_are_removed() {
    if !redis_up(URL).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let m = mock().await;
    let prefix = unique_prefix("fleet-tasks-tidy");
    let queue = format!("{prefix}tasks:v1:queue");
    let mut conn = redis_conn().await;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&queue)
        .arg("levee")
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg(&queue)
        .arg("levee")
        .arg("ghost")
        .query_async(&mut conn)
        .await
        .unwrap();
    let names = |v: &Vec<Vec<redis::Value>>| -> Vec<String> {
        v.iter()
            .map(|c| match &c[1] {
                redis::Value::BulkString(b) => String::from_utf8(b.clone()).unwrap(),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    // Ten visibility timeouts of 20 ms: the ghost must be idle 200 ms.
    let mut cfg = fleet_task_config(&m.url(), URL, &prefix);
    cfg.tasks.visibility_ms = 20;
    cfg.state.replica_id = "live".into();
    let mut idle = 0;
    for _ in 0..400 {
        let info: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(&queue)
            .arg("levee")
            .query_async(&mut conn)
            .await
            .unwrap();
        idle = match info[0][5] {
            redis::Value::Int(n) => n,
            ref other => panic!("{other:?}"),
        };
        if idle > 250 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(idle > 250, "the ghost consumer never aged");
    let gw = start(cfg).await.unwrap();
    let consumers = |mut conn: redis::aio::MultiplexedConnection| {
        let queue = queue.clone();
        async move {
            let info: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
                .arg("CONSUMERS")
                .arg(&queue)
                .arg("levee")
                .query_async(&mut conn)
                .await
                .unwrap();
            names(&info)
        }
    };
    let mut left = vec!["ghost".to_string()];
    for _ in 0..400 {
        left = consumers(conn.clone()).await;
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(left.is_empty(), "{left:?}");
    // The live replica still takes and runs tasks; its consumer is back.
    let c = client();
    let t: Value = submit(&c, &gw.public_url(), "a", "after")
        .await
        .json()
        .await
        .unwrap();
    let id = t["id"].as_str().unwrap();
    let mut last = Value::Null;
    for _ in 0..400 {
        last = get(&c, &gw.public_url(), "a", id)
            .await
            .json()
            .await
            .unwrap();
        if last["status"] == "succeeded" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(last["status"], "succeeded", "{last}");
    assert_eq!(consumers(conn.clone()).await, ["live"]);
    gw.shutdown().await;
    clear(URL, &prefix).await;
}

/// The store itself: concurrent writers lose no update (compare-and-set with retries), and
/// of many writers racing to finish a task exactly one does — once — which frees the
/// tenant's quota place and deletes the stream entry in the same step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_lose_no_update_and_make_one_final_state() {
    if !redis_up(URL).await {
        return skip("Redis on 127.0.0.1:6379 is unreachable");
    }
    let prefix = unique_prefix("task-store");
    let store = Arc::new(
        RedisTaskStore::new(
            URL,
            URL,
            &prefix,
            "solo",
            Duration::from_secs(30),
            Duration::from_secs(60),
            Duration::from_secs(60),
        )
        .unwrap(),
    );
    let seq = store.next_seq().await.unwrap();
    let id = format!("task_{seq:016x}00000000");
    let task = Task {
        id: id.clone(),
        seq,
        tenant: "a".into(),
        endpoint: "/v1/chat/completions".into(),
        model: "m".into(),
        body: "{}".into(),
        callback_url: None,
        status: Status::Queued,
        created_ms: 0,
        started_ms: None,
        finished_ms: None,
        attempts: 0,
        result: None,
        error: None,
        callback: None,
    };
    assert_eq!(store.insert(&task, 1).await.unwrap(), Inserted::Stored);
    let mut other = task.clone();
    other.id = format!("task_{:016x}00000000", seq + 1);
    other.seq = seq + 1;
    // The tenant's one place is taken.
    assert_eq!(
        store.insert(&other, 1).await.unwrap(),
        Inserted::Full { open: 1 }
    );
    const WRITERS: u32 = 12;
    let bumps = (0..WRITERS).map(|_| {
        let (store, id) = (store.clone(), id.clone());
        tokio::spawn(async move {
            store
                .update(
                    &id,
                    Box::new(|t| {
                        t.attempts += 1;
                        true
                    }),
                )
                .await
        })
    });
    for b in futures::future::join_all(bumps).await {
        assert!(b.unwrap().unwrap().is_some());
    }
    let t = store.get(&id).await.unwrap().unwrap();
    assert_eq!(t.attempts, WRITERS, "every increment landed once");
    let finals = [
        Status::Succeeded,
        Status::Failed,
        Status::Cancelled,
        Status::Expired,
    ];
    let racers = (0..WRITERS).map(|i| {
        let (store, id) = (store.clone(), id.clone());
        let to = finals[i as usize % finals.len()];
        tokio::spawn(async move {
            store
                .update(
                    &id,
                    Box::new(move |t| {
                        if t.status.is_final() {
                            return false;
                        }
                        t.status = to;
                        true
                    }),
                )
                .await
        })
    });
    let mut won = Vec::new();
    for r in futures::future::join_all(racers).await {
        if let Some(t) = r.unwrap().unwrap() {
            won.push(t.status);
        }
    }
    assert_eq!(won.len(), 1, "{won:?}");
    assert_eq!(store.get(&id).await.unwrap().unwrap().status, won[0]);
    let mut conn = redis_conn().await;
    let (finals_written, left): (u32, u64) = redis::pipe()
        .cmd("HGET")
        .arg(format!("{prefix}task:v1:{id}"))
        .arg("finals")
        .cmd("XLEN")
        .arg(format!("{prefix}tasks:v1:queue"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!((finals_written, left), (1, 0));
    // A final state is never replaced by another one.
    let flip = store
        .update(
            &id,
            Box::new(|t| {
                t.status = Status::Queued;
                true
            }),
        )
        .await
        .unwrap();
    assert!(flip.is_none());
    // The place is free again.
    assert_eq!(store.insert(&other, 1).await.unwrap(), Inserted::Stored);
    clear(URL, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_that_cannot_be_stored_answers_503_saying_what_failed() {
    // A port nothing listens on: every Redis command fails to connect.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let m = mock().await;
    let url = format!("redis://127.0.0.1:{port}");
    let cfg = fleet_task_config(&m.url(), &url, "levee-test:down:");
    let gw = start(cfg).await.unwrap();
    let c = client();
    let r = submit(&c, &gw.public_url(), "a", "lost").await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().get("retry-after").is_some());
    let e = error_json(r).await;
    assert_eq!(e["error"]["code"], "task_store_unavailable", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("Redis at redis://127.0.0.1:{port}")) && msg.contains("not stored"),
        "{msg}"
    );
    let r = get(&c, &gw.public_url(), "a", "task_00000000000000000000000000").await;
    assert_eq!(r.status(), 503);
    assert_eq!(m.count(), 0);
    gw.shutdown().await;
}
