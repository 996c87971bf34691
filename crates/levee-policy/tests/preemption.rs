//! Preemption's rules under random traffic (`LaneConfig::preempt`): the lane names only a
//! request that is running and whose answer has not started, never one of a higher priority
//! than every waiting one, never while a slot is free, and a lane that places what it takes
//! back settles: the dispatch-and-preempt loop ends. With preemption off nothing is named.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_policy::*;
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

fn ts(ms: u64) -> Timestamp {
    Timestamp::ZERO + Duration::from_millis(ms)
}

/// A request running on the simulated fleet.
struct Running {
    grant: Grant<u8>,
    answered: bool,
}

/// One random run: `ops` are (kind, tenant, streamed, step in ms).
fn run(preempt: bool, ops: &[(u8, u8, bool, u64)]) {
    let mut cfg = AdmissionConfig::new();
    cfg.tiers = vec![
        WaitBudget {
            normal: Duration::from_secs(30),
            soft: Duration::from_secs(10),
        };
        2
    ];
    let mut a: Admission<u32, u8> = Admission::new(cfg);
    let mut lane = LaneConfig::new(Watermarks {
        safe: 40,
        soft: 80,
        hard: 120,
    });
    lane.queue_max_len = 100;
    lane.preempt = preempt;
    a.set_model(
        0,
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane,
        },
    );
    a.set_backends(
        &0,
        (0..2)
            .map(|i| {
                let limits = BackendLimits {
                    max_in_flight: 4,
                    kv_tokens: Some(8_000),
                };
                (Arc::from(format!("b{i}").as_str()), limits)
            })
            .collect(),
    );
    let mut running: HashMap<u32, Running> = HashMap::new();
    let mut streamed: HashMap<u32, bool> = HashMap::new();
    let (mut now, mut id) = (1u64, 0u32);
    for &(kind, tenant, stream, dt) in ops {
        now += dt;
        let t = ts(now);
        match kind {
            // Arrivals, mostly of tenant 0 (the flooder), in two tiers.
            0..=4 => {
                id += 1;
                let tenant = if kind <= 2 { 0 } else { tenant % 4 };
                let req = AdmissionRequest {
                    tenant,
                    model: 0,
                    tier: Tier(tenant % 2),
                    prompt_tokens: 300,
                    completion_tokens: 200,
                    max_wait: None,
                    session: None,
                    answered_at_end: !stream,
                };
                streamed.insert(id, stream);
                if let Admit::Dispatch(d) = a.admit(&req, id, t) {
                    running.insert(
                        d.item,
                        Running {
                            grant: d.grant,
                            answered: false,
                        },
                    );
                }
            }
            // The oldest running request ends.
            5 => {
                if let Some(&k) = running.keys().min() {
                    let r = running.remove(&k).unwrap();
                    let done = Completion {
                        outcome: Outcome::Success,
                        actual_tokens: None,
                        generated: None,
                    };
                    a.complete(r.grant, done, t);
                }
            }
            // A streamed request's first event.
            6 => {
                let first = running
                    .iter_mut()
                    .filter(|(k, r)| !r.answered && streamed[*k])
                    .min_by_key(|(k, _)| **k);
                if let Some((_, r)) = first {
                    a.answered(&mut r.grant);
                    r.answered = true;
                }
            }
            _ => {
                let _ = a.expire(&0, t);
            }
        }
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(rounds < 200, "the lane keeps placing what it takes back");
            while let Some(d) = a.dequeue(&0, t) {
                running.insert(
                    d.item,
                    Running {
                        grant: d.grant,
                        answered: false,
                    },
                );
            }
            let Some(named) = a.preempt(&0, t) else { break };
            assert!(preempt, "preemption is off, yet a request was named");
            let lane = a.lane(&0).unwrap();
            assert_eq!(
                lane.in_flight(),
                8,
                "a request was named while a slot was free"
            );
            let (&k, _) = running
                .iter()
                .find(|(_, r)| r.grant.run() == Some(named))
                .expect("the named request is running");
            let r = running.remove(&k).unwrap();
            assert!(!r.answered, "a request whose answer started was named");
            let waiting_top = lane
                .backlogged()
                .map(|(tier, _, _, _)| tier)
                .min()
                .expect("a request was named while nothing waits");
            assert!(
                r.grant.tier() >= waiting_top,
                "a request of a higher priority than every waiting one was named"
            );
            assert!(a.requeue(r.grant, k, t).is_ok(), "the queue has room");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn preemption_names_only_running_unanswered_requests_and_settles(
        ops in prop::collection::vec((0u8..9, 0u8..4, any::<bool>(), 0u64..400), 1..400),
    ) {
        run(true, &ops);
        run(false, &ops);
    }
}
