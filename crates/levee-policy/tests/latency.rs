//! The latency cap in time: the same-tier flood of `isolation.rs`, on engines that batch
//! continuously. Each backend prefills one prompt at a time (a prompt placed while another
//! prefills waits for it), and each decode step takes longer the more sequences it runs:
//! `step(n) = STEP_BASE × (1 + n / slots)`. A request's time to first token is its wait in
//! levee, its wait for the prefills ahead of it, its own prefill and one decode step; it then
//! holds its slot for 199 more steps at the batch it joined. The lane learns each backend's
//! latency from the responses (levee-policy's `LatencyFit`) under a time per output token
//! objective, and is compared with the same lane without one.
//!
//! Deterministic (seeded arrivals, manual time): the figures do not depend on the machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

/// The same-tier flood of `isolation.rs` (not the rest of the shared test code).
#[allow(dead_code)]
#[path = "common/same_tier.rs"]
mod same_tier;

use levee_policy::*;
use same_tier::{arrivals, Mix, Quiet, NAMES, RUN};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// One prompt's prefill on an engine of 16 slots (600 tokens at 20,000 tokens/s); an engine
/// of more slots prefills that much faster.
const PREFILL_16: Duration = Duration::from_millis(30);
/// Output tokens of every request.
const COMPLETION: u32 = 200;
/// A decode step of an empty batch; a full one (`slots_per_backend` sequences) takes twice
/// as long: 2 s of service at a full batch, 1.5 s at half a batch.
const STEP_BASE: Duration = Duration::from_millis(5);
/// The time per output token objective the lane holds its backends to (a batch of 90% of
/// the slots at most).
const TPOT_SLO: Duration = Duration::from_micros(9_500);
const STEP: Duration = Duration::from_millis(10);
type Adm = Admission<(&'static str, Timestamp), &'static str>;

/// One backend's engine: when its prefill is free, and the sequences it runs.
#[derive(Debug, Default)]
struct Engine {
    prefill_free: Option<Timestamp>,
    running: usize,
}

/// A request running on an engine, settled at its end with what its response showed.
struct Run {
    grant: Grant<&'static str>,
    ttft: Duration,
    tpot: Duration,
}

/// The fleet: requests run on their backend's engine until their end; each grant is settled
/// then, after the lane has seen its latency.
struct Fleet {
    slots: usize,
    engines: HashMap<Arc<str>, Engine>,
    ends: BinaryHeap<Reverse<(Timestamp, u64)>>,
    runs: HashMap<u64, Run>,
    next_id: u64,
    quiet: Quiet,
}

impl Fleet {
    fn new(slots: usize) -> Self {
        Fleet {
            slots,
            engines: HashMap::new(),
            ends: BinaryHeap::new(),
            runs: HashMap::new(),
            next_id: 0,
            quiet: Quiet::default(),
        }
    }

    fn start(
        &mut self,
        (tenant, arrived): (&'static str, Timestamp),
        grant: Grant<&'static str>,
        now: Timestamp,
    ) {
        let backend = grant.backend().expect("dispatched").clone();
        let slots = self.slots;
        let e = self.engines.entry(backend).or_default();
        e.running += 1;
        let begin = e.prefill_free.map_or(now, |f| f.max(now));
        let prefilled = begin + PREFILL_16.mul_f64(16.0 / slots as f64);
        e.prefill_free = Some(prefilled);
        let tpot = STEP_BASE.mul_f64(1.0 + e.running as f64 / slots as f64);
        let first = prefilled + tpot;
        let end = first + tpot * (COMPLETION - 1);
        if tenant == "flooder" {
            self.quiet.flooder_served += 1;
        } else {
            self.quiet
                .ttft
                .push(first.saturating_duration_since(arrived));
            self.quiet.tpot.push(tpot);
        }
        self.next_id += 1;
        self.ends.push(Reverse((end, self.next_id)));
        let ttft = first.saturating_duration_since(now);
        self.runs.insert(self.next_id, Run { grant, ttft, tpot });
    }

    fn finish_until(&mut self, adm: &mut Adm, now: Timestamp) {
        while let Some(Reverse((end, id))) = self.ends.peek().copied() {
            if end > now {
                break;
            }
            self.ends.pop();
            let Some(run) = self.runs.remove(&id) else {
                continue;
            };
            if let Some(e) = run.grant.backend().and_then(|b| self.engines.get_mut(b)) {
                e.running -= 1;
            }
            adm.observe(&run.grant, Some(run.ttft), Some(run.tpot));
            let done = Completion {
                outcome: Outcome::Success,
                actual_tokens: None,
                generated: None,
            };
            adm.complete(run.grant, done, now);
        }
    }
}

fn simulate(mix: Mix, with_flooder: bool, objective: bool) -> Quiet {
    let clock = ManualClock::new();
    let mut cfg = AdmissionConfig::new();
    // One tier for everyone: the flooder and its neighbours are peers.
    cfg.tiers = vec![WaitBudget {
        normal: Duration::from_secs(30),
        soft: Duration::from_secs(10),
    }];
    let mut adm: Adm = Admission::new(cfg);
    let mut lane = LaneConfig::new(Watermarks {
        safe: 40,
        soft: 120,
        hard: 200,
    });
    lane.queue_max_len = 200;
    if objective {
        lane.slo = vec![LatencySlo {
            ttft: None,
            tpot: Some(TPOT_SLO),
        }];
    }
    adm.set_model(
        "m",
        ModelSpec {
            limits: LimitSpec::UNLIMITED,
            lane,
        },
    );
    let backends = (0..2)
        .map(|i| {
            (
                Arc::from(format!("b{i}").as_str()),
                BackendLimits {
                    max_in_flight: mix.slots_per_backend,
                    kv_tokens: Some(mix.slots_per_backend as u64 * 1_000),
                },
            )
        })
        .collect();
    adm.set_backends(&"m", backends);

    // (arrival ms, tenant), in time order.
    let mut arriving: Vec<(u64, &'static str)> = Vec::new();
    for (i, q) in NAMES.iter().take(mix.quiet).enumerate() {
        arriving.extend(
            arrivals(mix.quiet_rate, mix.seed + 1 + i as u64)
                .into_iter()
                .map(|t| (t, *q)),
        );
    }
    if with_flooder {
        arriving.extend(
            arrivals(mix.flood_rate, mix.seed)
                .into_iter()
                .map(|t| (t, "flooder")),
        );
    }
    arriving.sort();
    let mut arriving = arriving.into_iter().peekable();

    let mut fleet = Fleet::new(mix.slots_per_backend);
    let start = clock.now();
    while clock.now().saturating_duration_since(start) < RUN + Duration::from_secs(60) {
        let now = clock.now();
        fleet.finish_until(&mut adm, now);
        for e in adm.expire(&"m", now) {
            if e.item.0 != "flooder" {
                fleet.quiet.failed += 1;
            }
        }
        while let Some(d) = adm.dequeue(&"m", now) {
            fleet.start(d.item, d.grant, now);
        }
        let elapsed_ms = now.saturating_duration_since(start).as_millis() as u64;
        while let Some((_, tenant)) = arriving.next_if(|(t, _)| *t <= elapsed_ms) {
            let req = AdmissionRequest {
                tenant,
                model: "m",
                tier: Tier(0),
                prompt_tokens: 600,
                completion_tokens: 200,
                max_wait: None,
                session: None,
                answered_at_end: false,
            };
            match adm.admit(&req, (tenant, now), now) {
                Admit::Dispatch(d) => fleet.start(d.item, d.grant, now),
                Admit::Queued { .. } => {}
                Admit::Refused(_) => {
                    if tenant != "flooder" {
                        fleet.quiet.failed += 1;
                    }
                }
            }
        }
        while let Some(d) = adm.dequeue(&"m", now) {
            fleet.start(d.item, d.grant, now);
        }
        clock.advance(STEP);
    }
    fleet.quiet
}

/// The figures of one mix: the quiet tenants alone, beside the flooder, and beside it
/// without the objective (no latency cap).
struct Figures {
    alone: Quiet,
    flooded: Quiet,
    uncapped: Quiet,
}

fn figures(mix: Mix) -> Figures {
    Figures {
        alone: simulate(mix, false, true),
        flooded: simulate(mix, true, true),
        uncapped: simulate(mix, true, false),
    }
}

fn line(mix: &Mix, f: &mut Figures) -> String {
    let ttft = |q: &mut Quiet| q.p99();
    let tpot = |q: &mut Quiet| q.p99_tpot();
    format!(
        "{:>2} quiet x {}/s ({:.0}% of the fleet), {} slots, flood {}/s: quiet p99 TTFT alone {:?}, \
         flooded {:?} (without the objective {:?}); quiet p99 time per token alone {:?}, \
         flooded {:?} (without {:?}; objective {:?}); quiet failed {} / {}; flooder served \
         {:.2}/s (without {:.2}/s; weighted share {:.2}/s)",
        mix.quiet,
        mix.quiet_rate,
        100.0 * mix.quiet_share(),
        2 * mix.slots_per_backend,
        mix.flood_rate,
        ttft(&mut f.alone),
        ttft(&mut f.flooded),
        ttft(&mut f.uncapped),
        tpot(&mut f.alone),
        tpot(&mut f.flooded),
        tpot(&mut f.uncapped),
        TPOT_SLO,
        f.alone.failed,
        f.flooded.failed,
        f.flooded.flooder_rate(),
        f.uncapped.flooder_rate(),
        mix.flooder_share(),
    )
}

/// Mixes where the quiet tenants' p99 TTFT holds within +10% beside the flooder.
const MIXES: [Mix; 2] = [
    // 6 quiet tenants at 1/s: 38% of the fleet at 2 s of service.
    Mix {
        quiet: 6,
        quiet_rate: 1.0,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 100,
    },
    // 6 quiet tenants at 1.5/s: 56%.
    Mix {
        quiet: 6,
        quiet_rate: 1.5,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 600,
    },
];

/// Mixes where it does not: on a busier fleet the cap leaves fewer slots than the engine
/// has, and the flooder's prompts, prefilled one at a time, still delay the quiet ones.
const OUTSIDE: [Mix; 2] = [
    // 12 quiet tenants at 1/s: 75%.
    Mix {
        quiet: 12,
        quiet_rate: 1.0,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 700,
    },
    // A bigger fleet and a harder flood: 128 slots, 6 quiet tenants at 4/s (38%).
    Mix {
        quiet: 6,
        quiet_rate: 4.0,
        flood_rate: 100.0,
        slots_per_backend: 64,
        seed: 500,
    },
];

/// Beside a same-tier flooder, each backend's batch is capped where its learned slowdown
/// meets the objective: the quiet tenants' p99 time per token stays within it, none of their
/// requests fail, and inside the envelope their p99 TTFT moves by at most 10%.
#[test]
fn the_latency_cap_holds_the_quiet_tenants_latency_beside_a_flooder() {
    for (inside, mix) in MIXES
        .iter()
        .map(|m| (true, *m))
        .chain(OUTSIDE.iter().map(|m| (false, *m)))
    {
        let mut f = figures(mix);
        let l = line(&mix, &mut f);
        assert_eq!(f.alone.failed + f.flooded.failed, 0, "{l}");
        assert!(f.flooded.p99_tpot() <= TPOT_SLO, "{l}");
        if inside {
            let (a, b) = (f.alone.p99(), f.flooded.p99());
            assert!(b.as_secs_f64() <= 1.10 * a.as_secs_f64(), "{l}");
        }
    }
}

/// The figures behind BENCHMARKS.md (asserts nothing):
/// `cargo test -p levee-policy --test latency -- --ignored --nocapture`.
#[test]
#[ignore = "prints figures; run on demand"]
fn figures_of_every_mix() {
    for (inside, mix) in MIXES
        .iter()
        .map(|m| (true, *m))
        .chain(OUTSIDE.iter().map(|m| (false, *m)))
    {
        let mut f = figures(mix);
        let (a, b) = (f.alone.p99(), f.flooded.p99());
        let verdict = if b.as_secs_f64() <= 1.10 * a.as_secs_f64() {
            "holds"
        } else {
            "MISS: quiet p99 TTFT more than +10%"
        };
        let side = if inside { "inside " } else { "outside" };
        println!("{side} {}: {verdict}", line(&mix, &mut f));
    }
}
