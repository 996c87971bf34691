//! Lanes deciding in parallel, each under its own lock, over the limits they share: a quota
//! shared by two lanes is never overspent however their decisions interleave, and what one
//! lane refunds the other can spend.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_policy::*;
use parking_lot::Mutex;
use std::sync::Arc;

fn lane(model: &str) -> LaneAdmission<u32, &'static str> {
    let cfg = AdmissionConfig::new();
    let mut l = LaneConfig::new(Watermarks::new(10_000, 20_000, 30_000).unwrap());
    l.kv_headroom = 0.0;
    let mut a = LaneAdmission::new(
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane: l,
        },
        &cfg,
    );
    a.lane_mut().set_backends(vec![(
        Arc::from(format!("{model}-b0").as_str()),
        BackendLimits {
            max_in_flight: 1_000_000,
            kv_tokens: None,
        },
    )]);
    a
}

fn req(model: &'static str) -> AdmissionRequest<&'static str> {
    AdmissionRequest {
        tenant: "t",
        model,
        tier: Tier(0),
        prompt_tokens: 10,
        completion_tokens: 0,
        max_wait: None,
        session: None,
        answered_at_end: false,
    }
}

/// A tenant's quota of `quota` requests and `quota × 10` tokens with time frozen: two lanes
/// on two threads, each sending twice the quota, admit exactly the quota between them.
fn race(quota: u64, per_thread: usize) -> (usize, usize) {
    let cfg = AdmissionConfig::new();
    let shared = Arc::new(SharedLimits::<&'static str>::from_config(&cfg));
    let tenant = shared.set_tenant(
        "t",
        TenantSpec {
            limits: LimitSpec {
                requests_per_minute: Some(quota),
                request_burst: Some(quota),
                tokens_per_minute: Some(quota * 10),
                token_burst: Some(quota * 10),
                max_concurrent: None,
            },
            weight: 1,
        },
    );
    let now = Timestamp::from_nanos(1_000_000_000);
    let lanes = [
        Arc::new(Mutex::new(lane("a"))),
        Arc::new(Mutex::new(lane("b"))),
    ];
    let admitted: Vec<usize> = std::thread::scope(|sc| {
        let handles: Vec<_> = lanes
            .iter()
            .zip(["a", "b"])
            .map(|(l, model)| {
                let (shared, tenant, l) = (shared.clone(), tenant.clone(), l.clone());
                sc.spawn(move || {
                    let mut n = 0;
                    let mut grants = Vec::new();
                    for i in 0..per_thread {
                        let d = l
                            .lock()
                            .admit_as(&shared, &tenant, &req(model), i as u32, now);
                        if let Admit::Dispatch(d) = d {
                            n += 1;
                            grants.push(d.grant);
                        }
                    }
                    let mut lane = l.lock();
                    for g in grants {
                        lane.complete(
                            &shared,
                            g,
                            Completion {
                                outcome: Outcome::Success,
                                actual_tokens: None,
                                generated: None,
                            },
                            now,
                        );
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (admitted[0], admitted[1])
}

#[test]
fn two_lanes_never_overspend_a_shared_quota() {
    for _ in 0..20 {
        let (a, b) = race(500, 1_000);
        assert_eq!(a + b, 500, "lane a {a} + lane b {b} against a quota of 500");
    }
}

#[test]
fn a_refund_in_one_lane_is_spendable_in_another() {
    let cfg = AdmissionConfig::new();
    let shared = SharedLimits::<&'static str>::from_config(&cfg);
    let tenant = shared.set_tenant(
        "t",
        TenantSpec {
            limits: LimitSpec {
                requests_per_minute: Some(1),
                request_burst: Some(1),
                ..LimitSpec::UNLIMITED
            },
            weight: 1,
        },
    );
    let now = Timestamp::from_nanos(1_000_000_000);
    let (mut a, mut b) = (lane("a"), lane("b"));
    let Admit::Dispatch(d) = a.admit_as(&shared, &tenant, &req("a"), 0, now) else {
        panic!("the first request passes");
    };
    assert!(matches!(
        b.admit_as(&shared, &tenant, &req("b"), 1, now),
        Admit::Refused(Refusal {
            reason: RefusalReason::RequestRate(Scope::Tenant),
            ..
        })
    ));
    a.refund(&shared, d.grant, now);
    assert!(matches!(
        b.admit_as(&shared, &tenant, &req("b"), 2, now),
        Admit::Dispatch(_)
    ));
}

fn done() -> Completion {
    Completion {
        outcome: Outcome::Success,
        actual_tokens: None,
        generated: None,
    }
}

/// The gateway-wide limits `global` with time frozen: two lanes on two threads, each
/// sending `per_thread` requests of 10 tokens, keep what they admitted until the end.
fn global_race(global: LimitSpec, per_thread: usize) -> (usize, usize) {
    let mut cfg = AdmissionConfig::new();
    cfg.global = global;
    let shared = Arc::new(SharedLimits::<&'static str>::from_config(&cfg));
    let tenant = shared.tenant(&"t", Timestamp::ZERO);
    let now = Timestamp::from_nanos(1_000_000_000);
    let admitted: Vec<usize> = std::thread::scope(|sc| {
        let handles: Vec<_> = ["a", "b"]
            .into_iter()
            .map(|model| {
                let (shared, tenant) = (shared.clone(), tenant.clone());
                sc.spawn(move || {
                    let mut l = lane(model);
                    let mut grants = Vec::new();
                    for i in 0..per_thread {
                        if let Admit::Dispatch(d) =
                            l.admit_as(&shared, &tenant, &req(model), i as u32, now)
                        {
                            grants.push(d.grant);
                        }
                    }
                    let n = grants.len();
                    for g in grants {
                        l.complete(&shared, g, done(), now);
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (admitted[0], admitted[1])
}

fn global_rate(requests: u64, tokens: u64) -> LimitSpec {
    LimitSpec {
        requests_per_minute: Some(requests),
        request_burst: Some(500),
        tokens_per_minute: Some(tokens),
        token_burst: Some(5_000),
        max_concurrent: None,
    }
}

#[test]
fn two_lanes_never_overspend_the_global_quota_taken_one_request_at_a_time() {
    // 500 a minute is far under two requests per millisecond: no slices, exact sharing.
    for _ in 0..20 {
        let (a, b) = global_race(global_rate(500, 5_000), 1_000);
        assert_eq!(a + b, 500, "lane a {a} + lane b {b} against a burst of 500");
    }
}

#[test]
fn two_lanes_never_overspend_the_global_quota_taken_in_slices() {
    // 6M requests and 60M tokens a minute: each lane takes 100 requests (1,000 tokens) at a
    // time, and still the two admit exactly the burst between them.
    for _ in 0..20 {
        let (a, b) = global_race(global_rate(6_000_000, 60_000_000), 1_000);
        assert_eq!(a + b, 500, "lane a {a} + lane b {b} against a burst of 500");
    }
}

#[test]
fn a_lane_refused_after_taking_its_global_share_gives_it_back() {
    let mut cfg = AdmissionConfig::new();
    cfg.global = LimitSpec {
        requests_per_minute: Some(2),
        request_burst: Some(2),
        ..LimitSpec::UNLIMITED
    };
    let shared = SharedLimits::<&'static str>::from_config(&cfg);
    let tenant = shared.tenant(&"t", Timestamp::ZERO);
    let now = Timestamp::from_nanos(1_000_000_000);
    // Lane a's model allows one request a minute.
    let mut a = lane("a");
    a.set_spec(ModelSpec {
        limits: LimitSpec {
            requests_per_minute: Some(1),
            request_burst: Some(1),
            ..LimitSpec::UNLIMITED
        },
        lane: a.lane().config().clone(),
    });
    let mut b = lane("b");
    assert!(matches!(
        a.admit_as(&shared, &tenant, &req("a"), 0, now),
        Admit::Dispatch(_)
    ));
    assert!(matches!(
        a.admit_as(&shared, &tenant, &req("a"), 1, now),
        Admit::Refused(Refusal {
            reason: RefusalReason::RequestRate(Scope::Model),
            ..
        })
    ));
    // The global request lane a took before its model refused is spendable in lane b.
    assert!(matches!(
        b.admit_as(&shared, &tenant, &req("b"), 2, now),
        Admit::Dispatch(_)
    ));
    assert!(matches!(
        b.admit_as(&shared, &tenant, &req("b"), 3, now),
        Admit::Refused(Refusal {
            reason: RefusalReason::RequestRate(Scope::Global),
            ..
        })
    ));
}

#[test]
fn global_permits_a_lane_keeps_in_reserve_go_to_another_before_a_refusal() {
    let mut cfg = AdmissionConfig::new();
    cfg.global.max_concurrent = Some(1_024); // pools take 4 permits at a time
    let shared = SharedLimits::<&'static str>::from_config(&cfg);
    let tenant = shared.tenant(&"t", Timestamp::ZERO);
    let now = Timestamp::from_nanos(1_000_000_000);
    let (mut a, mut b) = (lane("a"), lane("b"));
    let mut grants_a = Vec::new();
    for i in 0..3 {
        let Admit::Dispatch(d) = a.admit_as(&shared, &tenant, &req("a"), i, now) else {
            panic!("lane a's request {i} passes");
        };
        grants_a.push(d.grant);
    }
    let mut grants_b = Vec::new();
    for i in 0..1_021 {
        let Admit::Dispatch(d) = b.admit_as(&shared, &tenant, &req("b"), i, now) else {
            panic!("lane b's request {i} passes: lane a's spare permit must come back");
        };
        grants_b.push(d.grant);
    }
    for (l, m) in [(&mut a, "a"), (&mut b, "b")] {
        assert!(matches!(
            l.admit_as(&shared, &tenant, &req(m), 9_999, now),
            Admit::Refused(Refusal {
                reason: RefusalReason::Concurrency(Scope::Global),
                ..
            })
        ));
    }
    for g in grants_a {
        a.complete(&shared, g, done(), now);
    }
    for g in grants_b {
        b.complete(&shared, g, done(), now);
    }
    // What a lane keeps in reserve is not reported as in use.
    assert_eq!(shared.global_headers(now).concurrency, Some((0, 1_024)));
}
