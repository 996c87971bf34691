//! Each admission layer acting, with an in-process gateway and mock backends on ephemeral
//! ports. Synchronisation is by polling gateway/backend state with a bounded wait, never
//! by sleeping a guessed time; no timing is asserted.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use common::*;
use levee_gateway::start;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::time::Duration;

#[tokio::test]
async fn proxies_and_reports_rate_headers() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.tenants[1].requests_per_minute = 100;
    cfg.tenants[1].tokens_per_minute = 100_000;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let r = chat(&c, &gw.public_url(), "s", "hello").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ratelimit-limit-requests"], "100");
    assert!(r.headers().contains_key("x-ratelimit-remaining-tokens"));
    assert!(!r.headers().contains_key("x-levee-queue-ms"));
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["total_tokens"], 14);
    // The backend got the model and body through.
    assert_eq!(m.received()[0]["model"], "m");
    let models: Value = c
        .get(format!("{}/v1/models", gw.public_url()))
        .bearer_auth("key-s")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "m");
    gw.shutdown().await;
}

#[tokio::test]
async fn quota_429_has_headers_and_an_honest_retry_after() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    // Two per minute, burst two: the third request is over quota. (The honest-retry check
    // uses the per-second IP guard below, so the test does not wait 30 s.)
    cfg.tenants[1].requests_per_minute = 2;
    let gw = start(cfg).await.unwrap();
    let c = client();
    assert_eq!(chat(&c, &gw.public_url(), "s", "1").await.status(), 200);
    assert_eq!(chat(&c, &gw.public_url(), "s", "2").await.status(), 200);
    let r = chat(&c, &gw.public_url(), "s", "3").await;
    assert_eq!(r.status(), 429);
    let h = r.headers().clone();
    let ms: u64 = h["retry-after-ms"].to_str().unwrap().parse().unwrap();
    let secs: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    // 2 per minute: the next slot opens within 30 s; Retry-After is whole seconds, rounded up.
    assert!(ms > 0 && ms <= 30_000, "{ms}");
    assert_eq!(secs, ms.div_ceil(1000));
    assert_eq!(h["x-ratelimit-limit-requests"], "2");
    assert_eq!(h["x-ratelimit-remaining-requests"], "0");
    // The check that refused: the tenant's request quota.
    assert_eq!(h["x-levee-refusal"], "tenant_requests");
    assert!(h.contains_key("x-ratelimit-reset-requests"));
    let v = error_json(r).await;
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert!(v["error"].get("param").is_some());
    // The refused request never reached the backend.
    assert_eq!(m.count(), 2);
    gw.shutdown().await;
}

#[tokio::test]
async fn retry_at_retry_after_succeeds() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    // The per-IP guard: 2 per second, burst 1 → the next request is allowed 500 ms later.
    cfg.ip_guard.requests_per_second = 2.0;
    cfg.ip_guard.burst = 1;
    let gw = start(cfg).await.unwrap();
    let c = client();
    assert_eq!(chat(&c, &gw.public_url(), "s", "1").await.status(), 200);
    let r = chat(&c, &gw.public_url(), "s", "2").await;
    assert_eq!(r.status(), 429);
    let ms: u64 = r.headers()["retry-after-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(ms <= 500, "{ms}");
    // Honour the header exactly (this wait is the behaviour under test, not a sync guess).
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let r = chat(&c, &gw.public_url(), "s", "3").await;
    assert_eq!(r.status(), 200, "a retry at Retry-After must succeed");
    gw.shutdown().await;
}

#[tokio::test]
async fn queues_then_dispatches_when_a_slot_frees() {
    let m = mock().await;
    m.hold(true);
    let gw = start(config(&[m.url()], 1)).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let first = spawn_chat(&c, &base, "s", "first");
    wait_until("first at backend", || m.count() == 1).await;
    let second = spawn_chat(&c, &base, "s", "second");
    let g = gw.gateway().clone();
    wait_until("second queued", || g.queued() == 1).await;
    assert_eq!(m.count(), 1, "a queued request must not reach the backend");
    m.release(2);
    let r1 = first.await.unwrap();
    let r2 = second.await.unwrap();
    assert_eq!(r1.status(), 200);
    assert_eq!(r2.status(), 200);
    assert!(r2.headers().contains_key("x-levee-queue-ms"));
    assert_eq!(m.count(), 2);
    gw.shutdown().await;
}

#[tokio::test]
async fn hard_watermark_refuses_fast() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = config(&[m.url()], 1);
    cfg.queue.safe = 1;
    cfg.queue.soft = 2;
    cfg.queue.hard = 3;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(spawn_chat(&c, &base, "p", &format!("h{i}")));
        wait_until("load grows", || g.load() == i + 1).await;
    }
    let r = chat(&c, &base, "p", "over").await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    assert!(r.headers().contains_key("retry-after-ms"));
    assert_eq!(r.headers()["x-levee-refusal"], "hard_watermark");
    assert_eq!(error_json(r).await["error"]["code"], "capacity_overload");
    // Still ready: overload is answered with 429s, never by leaving the load balancer
    // (replicas at their watermark together would all leave at once).
    let ready = c.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    m.release(10);
    for h in held {
        assert_eq!(h.await.unwrap().status(), 200);
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn lower_tiers_at_the_hard_mark_do_not_lock_premium_out() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = config(&[m.url()], 1);
    cfg.queue.safe = 1;
    cfg.queue.soft = 2;
    cfg.queue.hard = 3;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    // One standard request in flight and two queued: the load is at the hard mark.
    let mut held = Vec::new();
    for (i, who) in ["s", "a", "b"].iter().enumerate() {
        held.push(spawn_chat(&c, &base, who, who));
        wait_until("load grows", || g.load() == i as u64 + 1).await;
    }
    // Another standard request is refused at once...
    let r = chat(&c, &base, "s", "over").await;
    assert_eq!(r.status(), 429);
    assert_eq!(error_json(r).await["error"]["code"], "capacity_overload");
    // ...but premium, which would be served before the queued standard ones, is queued.
    let premium = spawn_chat(&c, &base, "p", "prem");
    wait_until("premium queued", || g.queued() == 3).await;
    for n in 1..=3 {
        m.release(1);
        wait_until("next dispatched", || m.count() == n + 1).await;
    }
    m.release(1);
    assert_eq!(premium.await.unwrap().status(), 200);
    for h in held {
        assert_eq!(h.await.unwrap().status(), 200);
    }
    let order: Vec<String> = m.received().iter().map(tag_of).collect();
    assert_eq!(order, ["s", "prem", "a", "b"]);
    gw.shutdown().await;
}

#[tokio::test]
async fn queue_timeout_answers_429() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = config(&[m.url()], 1);
    cfg.tiers.get_mut("standard").unwrap().queue_wait_ms = 200;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let first = spawn_chat(&c, &base, "s", "first");
    wait_until("first at backend", || m.count() == 1).await;
    let r = chat(&c, &base, "s", "second").await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(error_json(r).await["error"]["code"], "queue_timeout");
    assert_eq!(gw.gateway().queued(), 0);
    assert_eq!(m.count(), 1);
    m.release(1);
    assert_eq!(first.await.unwrap().status(), 200);
    gw.shutdown().await;
}

/// Fills the single slot with `blocker`, then queues `queued` (tenant, tag) in order, each
/// confirmed queued before the next; releases one at a time; returns the dispatch order.
async fn dispatch_order(
    queued: &[(&str, &str)],
    cfg_edit: impl FnOnce(&mut levee_gateway::Config),
) -> Vec<String> {
    let m = mock().await;
    m.hold(true);
    let mut cfg = config(&[m.url()], 1);
    cfg_edit(&mut cfg);
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let mut tasks = vec![spawn_chat(&c, &base, "p", "blocker")];
    wait_until("blocker at backend", || m.count() == 1).await;
    for (i, (who, tag)) in queued.iter().enumerate() {
        tasks.push(spawn_chat(&c, &base, who, tag));
        wait_until("queued", || g.queued() == i as i64 + 1).await;
    }
    for n in 1..=queued.len() {
        m.release(1);
        wait_until("next dispatched", || m.count() == n + 1).await;
    }
    m.release(1);
    for t in tasks {
        assert_eq!(t.await.unwrap().status(), 200);
    }
    gw.shutdown().await;
    m.received().iter().skip(1).map(tag_of).collect()
}

#[tokio::test]
async fn priority_order_under_contention() {
    let order = dispatch_order(
        &[
            ("f", "free1"),
            ("s", "std1"),
            ("f", "free2"),
            ("p", "prem1"),
            ("s", "std2"),
        ],
        |_| {},
    )
    .await;
    assert_eq!(order, vec!["prem1", "std1", "std2", "free1", "free2"]);
}

#[tokio::test]
async fn fairness_between_two_tenants_of_one_tier() {
    // Tenant a queues six requests before b queues three; b must not wait behind all of a.
    let mut q: Vec<(&str, &str)> = vec![
        ("a", "a1"),
        ("a", "a2"),
        ("a", "a3"),
        ("a", "a4"),
        ("a", "a5"),
        ("a", "a6"),
    ];
    q.extend([("b", "b1"), ("b", "b2"), ("b", "b3")]);
    let order = dispatch_order(&q, |_| {}).await;
    let first_six = &order[..6];
    let bs = first_six.iter().filter(|t| t.starts_with('b')).count();
    assert_eq!(bs, 3, "b should get its share early: {order:?}");
    // FIFO inside each tenant.
    let a_order: Vec<_> = order
        .iter()
        .filter(|t| t.starts_with('a'))
        .cloned()
        .collect();
    assert_eq!(a_order, vec!["a1", "a2", "a3", "a4", "a5", "a6"]);
}

#[tokio::test]
async fn degradation_engages_and_releases_with_hysteresis() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = config(&[m.url()], 1);
    cfg.queue.safe = 1;
    cfg.queue.soft = 5;
    cfg.queue.hard = 10;
    cfg.degrade.enabled = true;
    cfg.degrade.min_dwell_ms = 0;
    cfg.degrade.levels = vec![levee_gateway::config::DegradeLevelConfig {
        enter: 0.3,
        exit: 0.1,
        max_tokens_cap: Some(2),
        ..Default::default()
    }];
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let mut tasks = Vec::new();
    for i in 0..3 {
        tasks.push(spawn_chat(&c, &base, "p", &format!("load{i}")));
        wait_until("load", || g.load() == i + 1).await;
    }
    // Load 3 of hard 10 = 0.3: level 1 engages.
    assert_eq!(g.update_degrade(), 1);
    let state: Value = c
        .get(format!("{}/admin/state", gw.admin_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["degradation"]["level"], 1);
    // A request admitted now is capped.
    let capped = spawn_chat(&c, &base, "p", "capped");
    wait_until("capped queued", || g.load() == 4).await;
    // Drain to load 2 (0.2): between exit (0.1) and enter (0.3) the level holds.
    m.release(2);
    wait_until("load 2", || g.load() == 2).await;
    assert_eq!(
        g.update_degrade(),
        1,
        "hysteresis: stays engaged above exit"
    );
    m.release(10);
    let mut capped_resp = None;
    for t in tasks {
        assert_eq!(t.await.unwrap().status(), 200);
    }
    if let Ok(r) = capped.await {
        capped_resp = Some(r);
    }
    let r = capped_resp.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-levee-degraded"], "max_tokens=2");
    let at_backend = m
        .received()
        .into_iter()
        .find(|v| tag_of(v) == "capped")
        .unwrap();
    assert_eq!(at_backend["max_tokens"], 2);
    wait_until("load 0", || g.load() == 0).await;
    assert_eq!(g.update_degrade(), 0, "released below exit");
    gw.shutdown().await;
}

#[tokio::test]
async fn forced_degradation_via_admin_and_shedding() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.degrade.levels[2].shed_from_priority = Some(2);
    // A default budget above the level's cap, so the cap shows.
    cfg.server.default_max_tokens = 1024;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let r = c
        .post(format!("{}/admin/degrade", gw.admin_url()))
        .json(&serde_json::json!({"level": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = chat(&c, &gw.public_url(), "f", "shed me").await;
    assert_eq!(r.status(), 429);
    assert_eq!(error_json(r).await["error"]["code"], "capacity_overload");
    // No max_tokens given: level 3 caps it at 256 and says so.
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-p")
        .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "keep me"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-levee-degraded"], "max_tokens=256");
    assert_eq!(m.received().last().unwrap()["max_tokens"], 256);
    let r = c
        .post(format!("{}/admin/degrade", gw.admin_url()))
        .json(&serde_json::json!({"level": "auto"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(chat(&c, &gw.public_url(), "f", "back").await.status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn breaker_opens_and_traffic_moves_to_the_healthy_backend() {
    let bad = mock().await;
    bad.fail(true);
    let good = mock().await;
    let mut cfg = config(&[bad.url(), good.url()], 4);
    cfg.breaker.consecutive_failures = 2;
    cfg.breaker.open_ms = 60_000;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let mut statuses = Vec::new();
    for i in 0..8 {
        statuses.push(
            chat(&c, &gw.public_url(), "p", &format!("r{i}"))
                .await
                .status()
                .as_u16(),
        );
    }
    assert!(
        bad.count() <= 2,
        "the failing backend got {} requests",
        bad.count()
    );
    assert!(statuses[2..].iter().all(|s| *s == 200), "{statuses:?}");
    let state: Value = c
        .get(format!("{}/admin/state", gw.admin_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let backends = state["models"][0]["backends"].as_array().unwrap();
    let bad_state = backends
        .iter()
        .find(|b| b["url"] == bad.url().as_str())
        .unwrap();
    assert_eq!(bad_state["breaker"]["state"], "open");
    let metrics = metrics_text(&gw).await;
    assert!(metrics.contains("levee_breaker_state"), "{metrics}");
    gw.shutdown().await;
}

#[tokio::test]
async fn all_breakers_open_answers_503_circuit_open() {
    let bad = mock().await;
    bad.fail(true);
    let mut cfg = config(&[bad.url()], 4);
    cfg.breaker.consecutive_failures = 1;
    cfg.breaker.open_ms = 60_000;
    let gw = start(cfg).await.unwrap();
    let c = client();
    assert_eq!(chat(&c, &gw.public_url(), "p", "x").await.status(), 500);
    let r = chat(&c, &gw.public_url(), "p", "y").await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(error_json(r).await["error"]["code"], "circuit_open");
    assert_eq!(bad.count(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn fallback_response_instead_of_503_when_configured() {
    let bad = mock().await;
    bad.fail(true);
    let mut cfg = config(&[bad.url()], 4);
    cfg.breaker.consecutive_failures = 1;
    cfg.breaker.open_ms = 60_000;
    cfg.models[0].fallback_response = Some("busy, try later".into());
    let gw = start(cfg).await.unwrap();
    let c = client();
    assert_eq!(chat(&c, &gw.public_url(), "p", "x").await.status(), 500);
    let r = chat(&c, &gw.public_url(), "p", "y").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-levee-degraded"], "fallback_response");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "busy, try later");
    assert_eq!(bad.count(), 1);
    gw.shutdown().await;
}

#[tokio::test]
async fn heavy_requests_get_their_own_tighter_limit() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 4);
    cfg.heavy.max_tokens_over = 100;
    cfg.heavy.requests_per_minute = 1;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let heavy = |tag: &str| {
        serde_json::json!({"model": "m", "max_tokens": 1000,
            "messages": [{"role": "user", "content": tag}]})
    };
    let url = format!("{}/v1/chat/completions", gw.public_url());
    let r = c
        .post(&url)
        .bearer_auth("key-s")
        .json(&heavy("h1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(&url)
        .bearer_auth("key-s")
        .json(&heavy("h2"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let v = error_json(r).await;
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("heavy"),
        "{v}"
    );
    // Light requests of the same tenant are not held back by the heavy limit.
    assert_eq!(chat(&c, &gw.public_url(), "s", "light").await.status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn disconnect_frees_queue_slot_and_backend_slot() {
    let m = mock().await;
    m.hold(true);
    let gw = start(config(&[m.url()], 1)).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let first = spawn_chat(&c, &base, "s", "first");
    wait_until("first at backend", || m.count() == 1).await;
    let queued = spawn_chat(&c, &base, "s", "gone");
    wait_until("queued", || g.queued() == 1).await;
    // The queued client goes away: it must leave the queue at once.
    queued.abort();
    wait_until("left the queue", || g.queued() == 0).await;
    // The in-flight client goes away: the backend request is cancelled, the slot freed.
    first.abort();
    wait_until("backend cancelled", || {
        m.state.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
    wait_until("slot freed", || g.in_flight() == 0).await;
    // The next request goes straight through, and the gone one never reached the backend.
    m.hold(false);
    let r = chat(&c, &base, "s", "next").await;
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("x-levee-queue-ms"));
    let tags: Vec<_> = m.received().iter().map(tag_of).collect();
    assert_eq!(tags, vec!["first", "next"]);
    gw.shutdown().await;
}

#[tokio::test]
async fn drain_first_stops_advertising_and_still_serves() {
    let m = mock().await;
    let mut cfg = config(&[m.url()], 1);
    cfg.server.drain_grace_ms = 600_000;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let r = c
        .post(format!("{}/admin/drain", gw.admin_url()))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["grace_ms"], 600_000);
    assert_eq!(answer["draining"], false);
    let ready = c.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    assert_eq!(ready.json::<Value>().await.unwrap()["status"], "leaving");
    // During the grace, requests are served as before; each HTTP/1 answer closes its
    // connection so the client reconnects to a replica still advertised.
    let r = chat(&c, &base, "s", "during grace").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["connection"], "close");
    assert!(!gw.gateway().is_draining());
    gw.shutdown().await;
}

#[tokio::test]
async fn drain_refuses_new_requests_and_lets_queued_and_in_flight_finish() {
    let m = mock().await;
    m.hold(true);
    let mut cfg = config(&[m.url()], 1);
    cfg.server.drain_grace_ms = 0;
    let gw = start(cfg).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let first = spawn_chat(&c, &base, "s", "first");
    wait_until("first at backend", || m.count() == 1).await;
    let queued = spawn_chat(&c, &base, "s", "queued");
    wait_until("queued", || g.queued() == 1).await;
    let r = c
        .post(format!("{}/admin/drain", gw.admin_url()))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    wait_until("draining after a grace of 0", || g.is_draining()).await;
    assert_eq!(
        c.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    let new = chat(&c, &base, "s", "new").await;
    assert_eq!(new.status(), 503);
    assert!(new.headers().contains_key("retry-after"));
    assert_eq!(error_json(new).await["error"]["code"], "draining");
    m.release(2);
    assert_eq!(first.await.unwrap().status(), 200);
    assert_eq!(
        queued.await.unwrap().status(),
        200,
        "queued requests finish"
    );
    let tags: Vec<_> = m.received().iter().map(tag_of).collect();
    assert_eq!(tags, vec!["first", "queued"]);
    gw.shutdown().await;
}

#[tokio::test]
async fn shutdown_answers_what_is_still_queued_with_503() {
    let m = mock().await;
    m.hold(true);
    let gw = start(config(&[m.url()], 1)).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let first = spawn_chat(&c, &base, "s", "first");
    wait_until("first at backend", || m.count() == 1).await;
    let queued = spawn_chat(&c, &base, "s", "queued");
    wait_until("queued", || g.queued() == 1).await;
    let shutdown = tokio::spawn(gw.shutdown());
    let q = queued.await.unwrap();
    assert_eq!(q.status(), 503);
    assert!(q.headers().contains_key("retry-after"));
    m.release(1);
    assert_eq!(first.await.unwrap().status(), 200);
    shutdown.await.unwrap();
    assert_eq!(m.count(), 1);
}

#[tokio::test]
async fn shutdown_lets_in_flight_stream_finish() {
    let m = mock().await;
    m.hold(true);
    let gw = start(config(&[m.url()], 1)).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let first = tokio::spawn({
        let (c, base) = (c.clone(), base.clone());
        async move {
            let mut body = chat_body("stream");
            body["stream"] = Value::Bool(true);
            let r = c
                .post(format!("{base}/v1/chat/completions"))
                .bearer_auth("key-s")
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status(), r.text().await.unwrap())
        }
    });
    wait_until("at backend", || m.count() == 1).await;
    let shutdown = tokio::spawn(gw.shutdown());
    m.release(1);
    let (status, text) = first.await.unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("[DONE]"), "{text}");
    shutdown.await.unwrap();
}

#[tokio::test]
async fn reload_swaps_config_keeps_in_flight_and_refuses_bad_config() {
    let m = mock().await;
    m.hold(true);
    let cfg = config(&[m.url()], 1);
    let gw = start(cfg.clone()).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let held = spawn_chat(&c, &base, "s", "held");
    wait_until("held at backend", || m.count() == 1).await;
    // A new tenant appears, tenant s disappears.
    let mut new_cfg = cfg.clone();
    new_cfg.tenants.retain(|t| t.name != "s");
    new_cfg.tenants.push(tenant("newbie", "standard"));
    gw.reload(new_cfg.clone()).unwrap();
    // A bad config is refused and the running one kept.
    let mut bad = new_cfg.clone();
    bad.tenants[0].tier = "platinum".into();
    let errs = gw.reload(bad).unwrap_err();
    assert!(errs[0].contains("tenants[0].tier"), "{errs:?}");
    m.hold(false);
    m.release(1);
    assert_eq!(
        held.await.unwrap().status(),
        200,
        "in-flight survives reload"
    );
    assert_eq!(chat(&c, &base, "newbie", "x").await.status(), 200);
    assert_eq!(chat(&c, &base, "s", "x").await.status(), 401);
    gw.shutdown().await;
}

#[tokio::test]
async fn reload_on_file_change() {
    let m = mock().await;
    let dir = std::env::temp_dir().join(format!("levee-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("levee.toml");
    let cfg = config(&[m.url()], 1);
    std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();
    let gw = start(cfg.clone()).await.unwrap();
    levee_gateway::reload::watch(gw.gateway().clone(), path.clone()).unwrap();
    let c = client();
    // A broken file is refused; the old config stays.
    std::fs::write(&path, "[queue]\nhard = \"many\"\n").unwrap();
    let mut new_cfg = cfg.clone();
    new_cfg.tenants.push(tenant("later", "free"));
    // Then a good file is applied.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(chat(&c, &gw.public_url(), "s", "still").await.status(), 200);
    std::fs::write(&path, toml::to_string(&new_cfg).unwrap()).unwrap();
    let g = gw.gateway().clone();
    wait_until("new tenant live", || {
        g.config().tenants.iter().any(|t| t.name == "later")
    })
    .await;
    assert_eq!(chat(&c, &gw.public_url(), "later", "x").await.status(), 200);
    gw.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn streaming_forwards_chunks_and_strips_usage_unless_asked() {
    let m = mock().await;
    let gw = start(config(&[m.url()], 4)).await.unwrap();
    let c = client();
    let mut body = chat_body("s1");
    body["stream"] = Value::Bool(true);
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    assert!(text.contains(" w0") && text.contains("[DONE]"), "{text}");
    // Neither the usage chunk levee asked for nor the `"usage": null` fields it causes.
    assert!(!text.contains("usage"), "usage was not asked for: {text}");
    // Levee asked upstream for it anyway (to reconcile tokens).
    assert_eq!(m.received()[0]["stream_options"]["include_usage"], true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let text = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("\"total_tokens\""), "{text}");
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("levee_tokens_total{tenant=\"s\",kind=\"completion\"} 8"),
        "{metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn admin_surfaces_dashboard_state_and_metrics() {
    let m = mock().await;
    m.hold(true);
    let gw = start(config(&[m.url()], 1)).await.unwrap();
    let base = gw.public_url();
    let c = client();
    let g = gw.gateway().clone();
    let first = spawn_chat(&c, &base, "s", "first");
    wait_until("first at backend", || m.count() == 1).await;
    let queued = spawn_chat(&c, &base, "f", "queued");
    wait_until("queued", || g.queued() == 1).await;
    let page = c
        .get(gw.admin_url())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("/admin/state") && !page.contains("http://") && !page.contains("https://")
    );
    let state: Value = c
        .get(format!("{}/admin/state", gw.admin_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["queued"], 1);
    assert_eq!(state["in_flight"], 1);
    let free = state["models"][0]["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "free")
        .unwrap()
        .clone();
    assert_eq!(free["queued"], 1);
    assert_eq!(state["models"][0]["backends"][0]["in_flight"], 1);
    assert_eq!(
        state["models"][0]["backends"][0]["breaker"]["state"],
        "closed"
    );
    assert!(state["tenants"].as_array().unwrap().len() >= 5);
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("levee_queue_depth{tier=\"free\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("levee_in_flight 1"), "{metrics}");
    assert!(metrics.contains("levee_queued 1"), "{metrics}");
    assert!(metrics.contains("levee_backend_in_flight{"), "{metrics}");
    m.release(2);
    assert_eq!(first.await.unwrap().status(), 200);
    assert_eq!(queued.await.unwrap().status(), 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn refused_connection_is_resent_to_another_backend() {
    // A port nobody listens on: connections are refused.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let good = mock().await;
    let mut cfg = config(&[dead.clone(), good.url()], 4);
    cfg.breaker.consecutive_failures = 100;
    cfg.breaker.min_requests = 100;
    let gw = start(cfg).await.unwrap();
    let c = client();
    for i in 0..4 {
        let r = chat(&c, &gw.public_url(), "s", &format!("r{i}")).await;
        assert_eq!(r.status(), 200, "request {i}");
    }
    assert_eq!(good.count(), 4);
    let state = gw.gateway().state_json();
    let dead_state = state["models"][0]["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == dead.as_str())
        .unwrap()
        .clone();
    // The refused connection ejected the dead backend at once: its breaker is held open.
    assert_eq!(dead_state["breaker"]["state"], "open", "{state}");
    assert_eq!(dead_state["breaker"]["opened_total"], 1, "{state}");
    assert_eq!(dead_state["in_flight"], 0);
    gw.shutdown().await;
}

/// A chat whose prompt levee estimates at about 750 tokens.
fn long_chat(tag: &str) -> Value {
    serde_json::json!({"model": "m", "max_tokens": 4,
        "messages": [{"role": "user", "content": format!("{tag} {}", "word ".repeat(600))}]})
}

#[tokio::test]
async fn a_long_prompt_is_reserved_by_the_engines_own_count() {
    let m = mock().await;
    // The engine counts the long prompt at 9,000 tokens: more than the backend's whole KV
    // budget, where levee's estimate (about 750) would fit.
    *m.state.tokenize.lock() = Some((9_000, Duration::ZERO));
    let mut cfg = config(&[m.url()], 4);
    cfg.models[0].backends[0].max_kv_tokens = Some(8_000);
    cfg.models[0].exact_count = Some(levee_gateway::config::ExactCountConfig {
        min_prompt_tokens: 500,
        timeout_ms: 2_000,
    });
    let gw = start(cfg).await.unwrap();
    let c = client();
    let ask = |body: Value| {
        c.post(format!("{}/v1/chat/completions", gw.public_url()))
            .bearer_auth("key-s")
            .json(&body)
            .send()
    };
    let r = ask(long_chat("long")).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["x-levee-refusal"], "exceeds_kv_budget");
    assert_eq!(m.count(), 0, "refused before it reached the engine");
    let asked = m.state.tokenized.lock().clone();
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0]["model"], "m");
    assert_eq!(asked[0]["add_generation_prompt"], true);
    assert!(asked[0]["messages"][0]["content"]
        .as_str()
        .unwrap()
        .starts_with("long word"));
    // A short prompt keeps the estimate: no count asked.
    let r = ask(chat_body("short")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(m.state.tokenized.lock().len(), 1);
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("levee_exact_counts_total{model=\"m\",outcome=\"counted\"} 1"),
        "{metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn a_count_that_takes_too_long_leaves_the_estimate() {
    let m = mock().await;
    *m.state.tokenize.lock() = Some((9_000, Duration::from_secs(5)));
    let mut cfg = config(&[m.url()], 4);
    cfg.models[0].backends[0].max_kv_tokens = Some(8_000);
    cfg.models[0].exact_count = Some(levee_gateway::config::ExactCountConfig {
        min_prompt_tokens: 500,
        timeout_ms: 50,
    });
    let gw = start(cfg).await.unwrap();
    let c = client();
    let r = c
        .post(format!("{}/v1/chat/completions", gw.public_url()))
        .bearer_auth("key-s")
        .json(&long_chat("slow"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "served on the estimate");
    assert_eq!(m.count(), 1);
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("levee_exact_counts_total{model=\"m\",outcome=\"timed_out\"} 1"),
        "{metrics}"
    );
    gw.shutdown().await;
}

/// A tier whose predicted misses of its TTFT objective degrade: once the big model's
/// backend has shown it cannot reach a first token within the objective, a request for it
/// gets a stored answer when its tenant opted in and one is kept, else the model's fallback
/// model (marked), and where the tier refuses instead it is refused `slo_unattainable`.
#[tokio::test]
async fn a_predicted_ttft_miss_degrades_to_a_stored_answer_or_the_fallback_model() {
    use levee_gateway::config::{ModelConfig, SloMiss};
    let big = mock().await;
    *big.state.first_token_delay.lock() = Duration::from_millis(60);
    let small = mock().await;
    let mut cfg = config(&[big.url()], 8);
    cfg.models[0].fallback = Some("small".into());
    let mut fb = cfg.models[0].clone();
    fb.name = "small".into();
    fb.fallback = None;
    fb.backends[0].url = small.url();
    cfg.models.push(ModelConfig { ..fb });
    for (tier, miss) in [("standard", SloMiss::Degrade), ("premium", SloMiss::Refuse)] {
        let t = cfg.tiers.get_mut(tier).unwrap();
        t.ttft_slo_ms = Some(30);
        t.slo_miss = miss;
    }
    cfg.tenants[1].response_cache = true; // `s`, standard
    cfg.cache.max_bytes = 1 << 20;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let ask = |key: &'static str, body: Value| {
        c.post(format!("{}/v1/chat/completions", gw.public_url()))
            .bearer_auth(key)
            .json(&body)
            .send()
    };
    let deterministic = serde_json::json!({"model": "m", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "kept"}]});
    // Before the backend's fit predicts anything, everything goes; this answer is kept.
    let r = ask("key-s", deterministic.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-levee-degraded").is_none());
    // Streamed answers teach levee the big backend's time to first token (about 60 ms);
    // the free tier has no objective, so they all go.
    for i in 0..20 {
        let mut body = chat_body(&format!("learn {i}"));
        body["stream"] = true.into();
        let r = ask("key-f", body).await.unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    let learned = big.count();
    // Premium refuses a predicted miss.
    let r = ask("key-p", chat_body("premium")).await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-levee-refusal"], "predicted_slo_miss");
    // Standard: the stored answer for the kept request...
    let r = ask("key-s", deterministic).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-levee-degraded"], "cache");
    // ...and the fallback model for anything else, which the small backend serves as its
    // own model.
    let r = ask("key-s", chat_body("other")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-levee-degraded"], "slo_fallback=small");
    assert_eq!(
        big.count(),
        learned,
        "nothing more reached the slow backend"
    );
    let served = small.received();
    assert_eq!(served.len(), 1);
    assert_eq!(served[0]["model"], "small");
    let metrics = metrics_text(&gw).await;
    assert!(
        metrics.contains("levee_degraded_total{tier=\"standard\",reason=\"slo_fallback\"} 1"),
        "{metrics}"
    );
    gw.shutdown().await;
}
