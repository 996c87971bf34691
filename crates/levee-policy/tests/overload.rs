//! A steady overload in time: a fleet simulated on a manual clock around the one admission
//! path. Three tiers together offer three times what the fleet serves, for ten minutes;
//! service times vary (most requests short, some long). What admission must do: refuse the
//! excess at arrival — not let requests wait out their budget in the queue (a queue timeout
//! costs the client the whole wait and the fleet nothing) — and keep the fleet busy.
//!
//! Deterministic (seeded arrivals and service times, manual time): the figures do not depend
//! on the machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Running;
use levee_policy::*;
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};
use std::sync::Arc;
use std::time::Duration;

const STEP: Duration = Duration::from_millis(10);
const RUN: Duration = Duration::from_secs(600);
const SLOTS: usize = 64;
/// The backend's KV budget: an average request (about 450 tokens here) fits about 40 times
/// over, so tokens bind before slots do when long prompts come together.
const KV_TOKENS: u64 = 18_000;
/// Median service time; lognormal with σ = 0.8 (mean ≈ 1.38 × the median).
const SERVICE_MEDIAN_S: f64 = 1.0;
const SERVICE_SIGMA: f64 = 0.8;

/// Prompt tokens: lognormal (median 300, σ 0.6, at most 3,000); completion budgets 50–250.
const PROMPT_MEDIAN: f64 = 300.0;
const PROMPT_SIGMA: f64 = 0.6;

/// One tenant: tier and share of the offered load.
const TENANTS: [(&str, u8, f64); 6] = [
    ("p0", 0, 0.05),
    ("p1", 0, 0.05),
    ("s0", 1, 0.25),
    ("s1", 1, 0.25),
    ("f0", 2, 0.2),
    ("f1", 2, 0.2),
];

#[derive(Debug, Default)]
struct Counts {
    served: u64,
    refused_at_arrival: u64,
    queue_timeouts: u64,
    /// KV token-seconds held by running requests.
    busy_token_secs: f64,
}

type Adm = Admission<u64, &'static str>;

fn simulate(seed: u64, overload: f64) -> Counts {
    let clock = ManualClock::new();
    let mut adm: Adm = Admission::new(AdmissionConfig::new());
    let mut lane = LaneConfig::new(Watermarks {
        safe: SLOTS as u64,
        soft: 4 * SLOTS as u64,
        hard: 8 * SLOTS as u64,
    });
    lane.queue_max_len = 8 * SLOTS;
    adm.set_model(
        "m",
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane,
        },
    );
    adm.set_backends(
        &"m",
        vec![(
            Arc::from("b0"),
            BackendLimits {
                max_in_flight: SLOTS,
                kv_tokens: Some(KV_TOKENS),
            },
        )],
    );
    let service = LogNormal::new(SERVICE_MEDIAN_S.ln(), SERVICE_SIGMA).unwrap();
    let mean_service = SERVICE_MEDIAN_S * (SERVICE_SIGMA * SERVICE_SIGMA / 2.0).exp();
    // Mean tokens held per request: the lognormal prompt's mean (capped tails ignored) plus
    // the mean completion budget.
    let mean_tokens = PROMPT_MEDIAN * (PROMPT_SIGMA * PROMPT_SIGMA / 2.0).exp() + 150.0;
    let concurrent = (SLOTS as f64).min(KV_TOKENS as f64 / mean_tokens);
    let capacity = concurrent / mean_service;

    // (arrival ms, tenant index), in time order.
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut arriving: Vec<(u64, usize)> = Vec::new();
    for (i, (_, _, share)) in TENANTS.iter().enumerate() {
        let gap = Exp::new(capacity * overload * share).unwrap();
        let mut t = 0.0;
        loop {
            t += gap.sample(&mut rng);
            if t >= RUN.as_secs_f64() {
                break;
            }
            arriving.push(((t * 1000.0) as u64, i));
        }
    }
    arriving.sort();
    let mut arriving = arriving.into_iter().peekable();

    let mut fleet = Fleet {
        rng,
        service,
        prompt: LogNormal::new(PROMPT_MEDIAN.ln(), PROMPT_SIGMA).unwrap(),
        running: Running::default(),
        counts: Counts::default(),
    };
    let start = clock.now();
    while clock.now().saturating_duration_since(start) < RUN + Duration::from_secs(60) {
        let now = clock.now();
        fleet.finish_until(&mut adm, now);
        for e in adm.expire(&"m", now) {
            assert_eq!(e.reason, RefusalReason::QueueTimeout);
            fleet.counts.queue_timeouts += 1;
        }
        while let Some(d) = adm.dequeue(&"m", now) {
            fleet.start(d.grant, now);
        }
        let elapsed_ms = now.saturating_duration_since(start).as_millis() as u64;
        while let Some((_, i)) = arriving.next_if(|(t, _)| *t <= elapsed_ms) {
            let (tenant, tier, _) = TENANTS[i];
            let req = AdmissionRequest {
                tenant,
                model: "m",
                tier: Tier(tier),
                prompt_tokens: fleet.prompt.sample(&mut fleet.rng).min(3_000.0) as u64,
                completion_tokens: fleet.rng.random_range(50..250),
                max_wait: None,
                session: None,
                answered_at_end: false,
            };
            match adm.admit(&req, 0, now) {
                Admit::Dispatch(d) => fleet.start(d.grant, now),
                Admit::Queued { .. } => {}
                Admit::Refused(_) => fleet.counts.refused_at_arrival += 1,
            }
        }
        clock.advance(STEP);
    }
    fleet.counts
}

/// The fleet: requests hold a slot for their service time; each grant is settled then.
struct Fleet {
    rng: SmallRng,
    service: LogNormal<f64>,
    prompt: LogNormal<f64>,
    running: Running,
    counts: Counts,
}

impl Fleet {
    fn start(&mut self, grant: Grant<&'static str>, now: Timestamp) {
        let s = self.service.sample(&mut self.rng).min(30.0);
        self.counts.busy_token_secs += s * grant.tokens() as f64;
        self.running.start(grant, now + Duration::from_secs_f64(s));
        self.counts.served += 1;
    }

    fn finish_until(&mut self, adm: &mut Adm, now: Timestamp) {
        self.running.finish_until(adm, now);
    }
}

/// The share of the backend's KV budget held by running requests over the run.
fn kv_use(c: &Counts) -> f64 {
    c.busy_token_secs / (KV_TOKENS as f64 * RUN.as_secs_f64())
}

fn report(c: &Counts) -> String {
    let refusals = c.refused_at_arrival + c.queue_timeouts;
    format!(
        "served {}, refused at arrival {}, queue timeouts {} ({:.1}% of refusals), \
         KV budget in use {:.1}%",
        c.served,
        c.refused_at_arrival,
        c.queue_timeouts,
        100.0 * c.queue_timeouts as f64 / refusals.max(1) as f64,
        100.0 * kv_use(c),
    )
}

#[test]
fn a_steady_overload_is_refused_at_arrival_not_by_queue_timeouts() {
    for seed in [1, 2, 3] {
        let c = simulate(seed, 3.0);
        let line = report(&c);
        println!("seed {seed}: {line}");
        let refusals = c.refused_at_arrival + c.queue_timeouts;
        assert!(
            (c.queue_timeouts as f64) < 0.05 * refusals as f64,
            "seed {seed}: {line}"
        );
        // The fleet stays busy: measured 76–77% of the KV budget in use (the rest: the 5%
        // headroom, the burst room the fair-share rule keeps free for other tenants, and long
        // prompts waiting for room); this guards against a policy that refuses far more.
        assert!(kv_use(&c) >= 0.7, "seed {seed}: {line}");
    }
}
