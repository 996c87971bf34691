//! Admission pipeline behaviour with a manual clock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_policy::*;
use std::time::Duration;

fn req(tenant: &'static str, tier: u8, tokens: u64) -> AdmissionRequest<&'static str> {
    AdmissionRequest {
        tenant,
        model: "m",
        tier: Tier(tier),
        estimated_tokens: tokens,
        max_wait: None,
    }
}

fn cfg(slots: usize) -> AdmissionConfig {
    let mut c = AdmissionConfig::with_capacity(slots);
    c.watermarks = Watermarks::new(slots as u64, 2 * slots as u64, 3 * slots as u64).unwrap();
    c.queue_max_len = 100;
    c
}

fn dispatched<T: std::fmt::Debug, K: std::fmt::Debug>(a: Admit<T, K>) -> Dispatched<T, K> {
    match a {
        Admit::Dispatch(d) => d,
        other => panic!("expected dispatch, got {other:?}"),
    }
}

fn refusal<T: std::fmt::Debug, K: std::fmt::Debug>(a: Admit<T, K>) -> Refusal<T> {
    match a {
        Admit::Refused(r) => r,
        other => panic!("expected refusal, got {other:?}"),
    }
}

#[test]
fn dispatch_then_queue_then_refuse_at_hard() {
    let clock = ManualClock::new();
    let mut a: Admission<u32, &str> = Admission::new(cfg(2));
    let d1 = dispatched(a.admit(&req("a", 0, 10), 1, clock.now()));
    let _d2 = dispatched(a.admit(&req("a", 0, 10), 2, clock.now()));
    // Slots full: load 2 = safe → wait.
    let Admit::Queued {
        decision, deadline, ..
    } = a.admit(&req("b", 0, 10), 3, clock.now())
    else {
        panic!("expected queued")
    };
    assert_eq!(decision.zone, LoadZone::SafeToSoft);
    assert_eq!(deadline, clock.now() + Duration::from_secs(30));
    for i in 4..6 {
        assert!(matches!(
            a.admit(&req("b", 0, 10), i, clock.now()),
            Admit::Queued { .. }
        ));
    }
    // load 5 (2 in flight + 3 queued): between soft (4) and hard (6); tier 2 may not wait there.
    let r = refusal(a.admit(&req("c", 2, 10), 9, clock.now()));
    assert_eq!(r.reason, RefusalReason::Watermark(LoadZone::SoftToHard));
    assert_eq!(r.reason.code(), "capacity_overload");
    assert!(matches!(
        a.admit(&req("b", 0, 10), 6, clock.now()),
        Admit::Queued { .. }
    ));
    let r = refusal(a.admit(&req("b", 0, 10), 7, clock.now()));
    assert_eq!(r.reason, RefusalReason::Watermark(LoadZone::AtHard));
    assert!(r.retry_after.unwrap().as_millis() >= 250);
    // A slot frees: the oldest queued of the highest tier goes next.
    clock.advance(Duration::from_millis(100));
    assert!(a.dequeue(clock.now()).is_none(), "no slot yet");
    a.complete(d1.grant, 10, clock.now());
    let next = a.dequeue(clock.now()).unwrap();
    assert_eq!(next.item, 3);
    assert_eq!(next.waited, Duration::from_millis(100));
    assert!(next.grant.is_dispatched());
}

#[test]
fn new_request_does_not_overtake_equal_priority_queue() {
    let clock = ManualClock::new();
    let mut c = cfg(1);
    c.watermarks = Watermarks::new(10, 20, 30).unwrap();
    let mut a: Admission<u32, &str> = Admission::new(c);
    let d = dispatched(a.admit(&req("a", 1, 1), 1, clock.now()));
    assert!(matches!(
        a.admit(&req("a", 1, 1), 2, clock.now()),
        Admit::Queued { .. }
    ));
    drop(d.grant); // slot frees without the gateway dequeuing yet
                   // Same tier: must queue behind item 2 even though a slot is free.
    assert!(matches!(
        a.admit(&req("b", 1, 1), 3, clock.now()),
        Admit::Queued { .. }
    ));
    assert_eq!(a.dequeue(clock.now()).unwrap().item, 2);
}

#[test]
fn higher_tier_dispatches_past_lower_tier_queue() {
    let clock = ManualClock::new();
    let mut c = cfg(1);
    c.watermarks = Watermarks::new(10, 20, 30).unwrap();
    let mut a: Admission<u32, &str> = Admission::new(c);
    let d = dispatched(a.admit(&req("a", 2, 1), 1, clock.now()));
    assert!(matches!(
        a.admit(&req("a", 2, 1), 2, clock.now()),
        Admit::Queued { .. }
    ));
    drop(d.grant);
    let d = dispatched(a.admit(&req("vip", 0, 1), 3, clock.now()));
    assert_eq!(d.item, 3);
}

#[test]
fn rate_refusals_say_when_and_charge_nothing() {
    let clock = ManualClock::starting_at(Timestamp::from_nanos(1));
    let mut c = cfg(100);
    c.tenant_default = LimitSpec {
        requests_per_minute: Some(60),
        request_burst: Some(2),
        tokens_per_minute: Some(6_000),
        ..LimitSpec::UNLIMITED
    };
    let mut a: Admission<u32, &str> = Admission::new(c);
    let g1 = dispatched(a.admit(&req("a", 0, 1_000), 1, clock.now())).grant;
    let r = refusal(a.admit(&req("a", 0, 5_500), 2, clock.now()));
    assert_eq!(r.reason, RefusalReason::TokenRate(Scope::Tenant));
    assert_eq!(r.reason.code(), "rate_limit_exceeded");
    // 500 tokens short at 100 tokens/s.
    assert_eq!(r.retry_after.unwrap().as_millis(), 5_000);
    assert_eq!(r.retry_after.unwrap().header_secs(), 5);
    // The refused request charged no request cell: the second burst cell is still there.
    let _g2 = dispatched(a.admit(&req("a", 0, 10), 3, clock.now())).grant;
    let r = refusal(a.admit(&req("a", 0, 10), 4, clock.now()));
    assert_eq!(r.reason, RefusalReason::RequestRate(Scope::Tenant));
    assert_eq!(r.retry_after.unwrap().as_millis(), 1_000);
    let h = a.rate_limit_headers(&"a", clock.now());
    assert_eq!(h.requests.unwrap().remaining, 0);
    assert_eq!(h.tokens.unwrap().remaining, 6_000 - 1_010);
    // Reconcile: the first used only 100 of 1000 tokens.
    a.complete(g1, 100, clock.now());
    assert_eq!(
        a.rate_limit_headers(&"a", clock.now())
            .tokens
            .unwrap()
            .remaining,
        6_000 - 110
    );
    // Too large never fits: no retry.
    let r = refusal(a.admit(&req("b", 0, 7_000), 5, clock.now()));
    assert_eq!(r.reason, RefusalReason::TooLarge(Scope::Tenant));
    assert!(r.retry_after.is_none() && !r.reason.is_retryable());
}

#[test]
fn per_tenant_override_and_concurrency() {
    let clock = ManualClock::new();
    let mut c = cfg(100);
    c.tenant_default.max_concurrent = Some(1);
    let mut a: Admission<u32, &str> = Admission::new(c);
    a.set_tenant(
        "big",
        TenantSpec {
            limits: LimitSpec {
                max_concurrent: Some(3),
                ..LimitSpec::UNLIMITED
            },
            weight: 2,
        },
    );
    let g = dispatched(a.admit(&req("small", 0, 1), 1, clock.now())).grant;
    let r = refusal(a.admit(&req("small", 0, 1), 2, clock.now()));
    assert_eq!(r.reason, RefusalReason::Concurrency(Scope::Tenant));
    let bigs: Vec<_> = (0..3)
        .map(|i| dispatched(a.admit(&req("big", 0, 1), 10 + i, clock.now())))
        .collect();
    assert!(matches!(
        a.admit(&req("big", 0, 1), 20, clock.now()),
        Admit::Refused(_)
    ));
    drop(bigs);
    a.complete(g, 1, clock.now());
    assert!(matches!(
        a.admit(&req("small", 0, 1), 3, clock.now()),
        Admit::Dispatch(_)
    ));
}

#[test]
fn heavy_rule_and_model_limits() {
    let clock = ManualClock::new();
    let mut c = cfg(100);
    c.heavy = Some(HeavyRule {
        min_tokens: 8_000,
        max_concurrent: 1,
    });
    let mut a: Admission<u32, &str> = Admission::new(c);
    a.set_model_limits(
        "m",
        LimitSpec {
            requests_per_minute: Some(2),
            ..LimitSpec::UNLIMITED
        },
    );
    let h = dispatched(a.admit(&req("a", 0, 9_000), 1, clock.now()));
    let r = refusal(a.admit(&req("b", 0, 9_000), 2, clock.now()));
    assert_eq!(r.reason, RefusalReason::HeavyRequests);
    let _light = dispatched(a.admit(&req("b", 0, 100), 3, clock.now()));
    // The model's 2/min are used.
    let r = refusal(a.admit(&req("c", 0, 100), 4, clock.now()));
    assert_eq!(r.reason, RefusalReason::RequestRate(Scope::Model));
    assert_eq!(r.retry_after.unwrap().as_millis(), 30_000);
    drop(h);
}

#[test]
fn expiry_and_cancel_refund_and_free_concurrency() {
    let clock = ManualClock::new();
    let mut c = cfg(1);
    c.tenant_default = LimitSpec {
        tokens_per_minute: Some(1_000),
        max_concurrent: Some(3),
        ..LimitSpec::UNLIMITED
    };
    let mut a: Admission<u32, &str> = Admission::new(c);
    let d = dispatched(a.admit(&req("a", 0, 100), 1, clock.now()));
    let mut short = req("a", 0, 300);
    short.max_wait = Some(Duration::from_secs(2));
    let Admit::Queued { deadline, .. } = a.admit(&short, 2, clock.now()) else {
        panic!()
    };
    assert_eq!(deadline, clock.now() + Duration::from_secs(2));
    let Admit::Queued { ticket, .. } = a.admit(&req("a", 0, 300), 3, clock.now()) else {
        panic!()
    };
    assert_eq!(
        a.rate_limit_headers(&"a", clock.now())
            .tokens
            .unwrap()
            .remaining,
        300
    );
    assert_eq!(a.next_deadline(), Some(deadline));
    // Cancel refunds at once.
    assert_eq!(a.cancel(ticket, clock.now()), Some(3));
    assert_eq!(
        a.rate_limit_headers(&"a", clock.now())
            .tokens
            .unwrap()
            .remaining,
        600
    );
    clock.advance(Duration::from_secs(2));
    let ex = a.expire(clock.now());
    assert_eq!(ex.len(), 1);
    assert_eq!(ex[0].item, 2);
    assert_eq!(ex[0].waited, Duration::from_secs(2));
    assert!(ex[0].retry_after.as_millis() > 0);
    assert_eq!(a.queued(), 0);
    // Tenant concurrency was released by expiry and cancel: two more fit besides `d`.
    a.complete(d.grant, 100, clock.now());
    let held: Vec<_> = (0..3)
        .map(|i| a.admit(&req("a", 0, 1), 10 + i, clock.now()))
        .collect();
    assert!(held.iter().all(|h| !matches!(h, Admit::Refused(_))));
    assert!(matches!(
        a.admit(&req("a", 0, 1), 20, clock.now()),
        Admit::Refused(_)
    ));
}

#[test]
fn dequeue_sets_aside_expired_entries() {
    let clock = ManualClock::new();
    let mut a: Admission<u32, &str> = Admission::new(cfg(1));
    let d = dispatched(a.admit(&req("a", 0, 1), 1, clock.now()));
    let mut r = req("a", 0, 1);
    r.max_wait = Some(Duration::from_millis(10));
    assert!(matches!(a.admit(&r, 2, clock.now()), Admit::Queued { .. }));
    assert!(matches!(
        a.admit(&req("a", 0, 1), 3, clock.now()),
        Admit::Queued { .. }
    ));
    clock.advance(Duration::from_millis(20));
    drop(d);
    assert_eq!(a.dequeue(clock.now()).unwrap().item, 3);
    let ex = a.expire(clock.now());
    assert_eq!(ex.iter().map(|e| e.item).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn shedding_and_signals() {
    let clock = ManualClock::new();
    let mut a: Admission<u32, &str> = Admission::new(cfg(4));
    a.set_shed_from(Some(Tier(2)));
    let r = refusal(a.admit(&req("a", 2, 1), 1, clock.now()));
    assert_eq!(r.reason, RefusalReason::Shed);
    let _d = dispatched(a.admit(&req("a", 1, 1), 2, clock.now()));
    let s = a.load_signals(0.3);
    assert_eq!(s.in_flight_ratio, 0.25);
    assert_eq!(s.kv_cache_usage, 0.3);
    a.set_shed_from(None);
    assert!(matches!(
        a.admit(&req("a", 2, 1), 3, clock.now()),
        Admit::Dispatch(_)
    ));
    let st = a.stats(clock.now());
    assert_eq!(st.in_flight, 1);
    assert_eq!(st.zone, LoadZone::BelowSafe);
}

#[test]
fn retry_after_follows_measured_drain() {
    let clock = ManualClock::new();
    let mut c = cfg(2);
    c.watermarks = Watermarks::new(2, 4, 6).unwrap();
    c.tiers = vec![WaitBudget {
        normal: Duration::from_secs(60),
        soft: Duration::from_secs(60),
    }];
    let mut a: Admission<u32, &str> = Admission::new(c);
    // Serve at 20/s for a while so the drain rate is measured.
    for i in 0..200 {
        clock.advance(Duration::from_millis(50));
        let d = dispatched(a.admit(&req("a", 0, 1), i, clock.now()));
        a.complete(d.grant, 1, clock.now());
    }
    let hold: Vec<_> = (0..2)
        .map(|i| dispatched(a.admit(&req("a", 0, 1), 1000 + i, clock.now())))
        .collect();
    for i in 0..4 {
        assert!(matches!(
            a.admit(&req("a", 0, 1), 2000 + i, clock.now()),
            Admit::Queued { .. }
        ));
    }
    let r = refusal(a.admit(&req("a", 0, 1), 3000, clock.now()));
    // 6 load − 4 soft + 1 = 3 items at ≈ 20/s ≈ 150 ms → the 250 ms floor; deeper load grows it.
    let ms = r.retry_after.unwrap().as_millis();
    assert!((250..=400).contains(&ms), "{ms}");
    clock.advance(Duration::from_secs(30));
    let r2 = refusal(a.admit(&req("a", 0, 1), 3001, clock.now()));
    assert!(
        r2.retry_after.unwrap().as_millis() > ms,
        "no drain for 30 s: longer wait"
    );
    drop(hold);
}
