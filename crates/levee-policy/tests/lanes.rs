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
