//! Same-tier isolation in time: a fleet simulated on a manual clock around the one admission
//! path. Requests hold a backend slot for their service time; a request's time to first
//! token is its wait in levee plus a fixed prefill. Quiet tenants send Poisson traffic well
//! within the fleet; a flooder of the SAME tier, with no quota to stop it, sends 2.5× the
//! fleet's capacity. Its quiet neighbours' p99 TTFT must move by at most 10% against the same
//! run without the flooder, none of their requests may fail, and the flooder must still be
//! served at least its weighted share of the fleet. (`latency.rs` runs the same mixes on
//! engines whose decode slows with the batch and whose prefills delay each other.)
//!
//! Deterministic (seeded arrivals, manual time): the figures do not depend on the machine.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::same_tier::{arrivals, Mix, Quiet, NAMES, RUN, SERVICE};
use common::Running;
use levee_policy::*;
use std::sync::Arc;
use std::time::Duration;

const PREFILL: Duration = Duration::from_millis(100);
const STEP: Duration = Duration::from_millis(10);
type Adm = Admission<(&'static str, Timestamp), &'static str>;

/// The fleet: requests hold a slot until their end; each grant is settled then.
struct Fleet {
    running: Running,
    quiet: Quiet,
}

impl Fleet {
    fn start(
        &mut self,
        (tenant, arrived): (&'static str, Timestamp),
        grant: Grant<&'static str>,
        now: Timestamp,
    ) {
        if tenant == "flooder" {
            self.quiet.flooder_served += 1;
        } else {
            self.quiet
                .ttft
                .push(now.saturating_duration_since(arrived) + PREFILL);
        }
        self.running.start(grant, now + SERVICE);
    }

    fn finish_until(&mut self, adm: &mut Adm, now: Timestamp) {
        self.running.finish_until(adm, now);
    }
}

fn simulate(mix: Mix, with_flooder: bool, preempt: bool) -> Quiet {
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
    lane.preempt = preempt;
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

    let mut fleet = Fleet {
        running: Running::default(),
        quiet: Quiet::default(),
    };
    let start = clock.now();
    while clock.now().saturating_duration_since(start) < RUN + Duration::from_secs(60) {
        let now = clock.now();
        fleet.finish_until(&mut adm, now);
        for e in adm.expire(&"m", now) {
            if e.item.0 != "flooder" {
                fleet.quiet.failed += 1;
            }
        }
        dispatch(&mut adm, &mut fleet, now);
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
                answered_at_end: true,
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
        dispatch(&mut adm, &mut fleet, now);
        clock.advance(STEP);
    }
    fleet.quiet
}

/// Starts what may go, then cuts short what the lane names (cut short at once: nothing of it
/// reached anyone, as a request's answer does only when it ends), queues it again, and starts
/// what may go then.
fn dispatch(adm: &mut Adm, fleet: &mut Fleet, now: Timestamp) {
    for _ in 0..1_000 {
        while let Some(d) = adm.dequeue(&"m", now) {
            fleet.start(d.item, d.grant, now);
        }
        let Some(run) = adm.preempt(&"m", now) else {
            return;
        };
        let grant = fleet
            .running
            .take_run(run)
            .expect("the lane names a running request");
        let tenant = *grant.tenant();
        assert_eq!(
            tenant, "flooder",
            "only a tenant over its share is cut short"
        );
        fleet.quiet.flooder_served -= 1;
        fleet.quiet.preempted += 1;
        // Refused (its queue full): it is answered with an error, as the flooder's others.
        let _ = adm.requeue(grant, (tenant, now), now);
    }
    panic!("the lane keeps naming requests to cut short at {now:?}: it takes back what it places");
}

/// Checks one mix: the quiet tenants alone and beside the flooder. `Err` says what missed.
fn judge(mix: Mix, preempt: bool) -> (String, Result<(), String>) {
    let mut alone = simulate(mix, false, preempt);
    let mut flooded = simulate(mix, true, preempt);
    let (a, f) = (alone.p99(), flooded.p99());
    let line = format!(
        "{:>2} quiet x {}/s ({:.0}% of the fleet), {} slots, flood {}/s: quiet p99 TTFT alone \
         {:?}, beside the flooder {:?} ({:+.0}%); quiet failed {} / {}; flooder served {:.2}/s (weighted share {:.2}/s, cut short {:.2}/s)",
        mix.quiet,
        mix.quiet_rate,
        100.0 * mix.quiet_share(),
        2 * mix.slots_per_backend,
        mix.flood_rate,
        a,
        f,
        100.0 * (f.as_secs_f64() / a.as_secs_f64() - 1.0),
        alone.failed,
        flooded.failed,
        flooded.flooder_rate(),
        mix.flooder_share(),
        flooded.preempted as f64 / RUN.as_secs_f64(),
    );
    let mut misses = Vec::new();
    if alone.failed > 0 || flooded.failed > 0 {
        misses.push("quiet requests failed");
    }
    if alone.ttft.len() != flooded.ttft.len() {
        misses.push("quiet requests served differ");
    }
    if f.as_secs_f64() > a.as_secs_f64() * 1.10 {
        misses.push("quiet p99 TTFT more than +10%");
    }
    if flooded.flooder_rate() < mix.flooder_share() {
        misses.push("flooder below its weighted share");
    }
    let verdict = if misses.is_empty() {
        Ok(())
    } else {
        Err(misses.join(", "))
    };
    (line, verdict)
}

/// Mixes inside the envelope: the quiet tenants' load plus its bursts fits beside what the
/// flooder's weighted share takes. Outside it the bound does not hold, and this file does
/// not pretend otherwise: [`OUTSIDE`] are such mixes, whose figures `figures_of_every_mix`
/// prints, misses included.
const MIXES: [Mix; 6] = [
    // 6 quiet tenants at 1/s: 12 of 32 slots on average; the flooder sends 80 slots' worth.
    Mix {
        quiet: 6,
        quiet_rate: 1.0,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 100,
    },
    // Fewer, busier neighbours: 3 at 2/s.
    Mix {
        quiet: 3,
        quiet_rate: 2.0,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 200,
    },
    // Many small neighbours: 10 at 0.5/s.
    Mix {
        quiet: 10,
        quiet_rate: 0.5,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 300,
    },
    // Two sparse neighbours, silent for up to tens of seconds between requests.
    Mix {
        quiet: 2,
        quiet_rate: 0.2,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 400,
    },
    // A bigger fleet and a harder flood: 128 slots, 200 slots' worth of flood.
    Mix {
        quiet: 6,
        quiet_rate: 4.0,
        flood_rate: 100.0,
        slots_per_backend: 64,
        seed: 500,
    },
    // 6 quiet tenants at 1.5/s: 56% of the fleet.
    Mix {
        quiet: 6,
        quiet_rate: 1.5,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 600,
    },
];

#[test]
fn a_same_tier_flooder_moves_its_quiet_neighbours_p99_ttft_by_at_most_ten_percent() {
    for mix in MIXES {
        let (line, verdict) = judge(mix, false);
        if let Err(miss) = verdict {
            panic!("{mix:?}: {miss}: {line}");
        }
    }
}

/// With preemption on ([`LaneConfig::preempt`]), the bound holds on every mix of the
/// envelope and on three beyond it — the case (3 quiet tenants at 60% of the fleet,
/// the fourth flooding at 20× its share), 8 quiet tenants at 62.5%, and 6 at 75% of 128
/// slots — and the flooder is served more than without it. The other three stay misses
/// (`figures_of_every_mix` prints them): at 75% of 32 slots no rule serves the flooder its
/// share without delaying the quiet tenants (the frontier below), and at 69% the quiet
/// tenants' own bursts outgrow what can be taken back.
#[test]
fn with_preemption_the_bound_holds_beyond_the_envelope_and_the_flooder_gains() {
    for mix in MIXES.iter().chain([&OUTSIDE[0], &OUTSIDE[2], &OUTSIDE[5]]) {
        let (line, verdict) = judge(*mix, true);
        if let Err(miss) = verdict {
            panic!("{mix:?}: {miss}: {line}");
        }
        let off = simulate(*mix, true, false);
        assert_eq!(
            off.preempted, 0,
            "{mix:?}: preemption off cut requests short"
        );
        let without = off.flooder_rate();
        let with = simulate(*mix, true, true).flooder_rate();
        assert!(
            with > without,
            "{mix:?}: flooder {with:.2}/s with preemption, {without:.2}/s without"
        );
    }
}

/// Mixes outside the envelope: busier quiet tenants, up to 75% of the fleet.
const OUTSIDE: [Mix; 6] = [
    // 3 quiet tenants at 60% of the fleet, the fourth flooding at 20× its weighted share:
    // the same-tier case levee's isolation was first tried on. Its two targets pull apart
    // on these slots: the quiet tenants' 99th-percentile burst (Poisson, mean 19.2 slots)
    // reaches 30 of the 32, while the flooder's share is 8 slots on average, and a slot it
    // holds when a burst comes was taken up to 2 s before (no preemption).
    Mix {
        quiet: 3,
        quiet_rate: 3.2,
        flood_rate: 80.0,
        slots_per_backend: 16,
        seed: 1100,
    },
    // The same three at 75% of the fleet.
    Mix {
        quiet: 3,
        quiet_rate: 4.0,
        flood_rate: 80.0,
        slots_per_backend: 16,
        seed: 1300,
    },
    // 8 quiet tenants at 1.25/s: 62.5% of the fleet.
    Mix {
        quiet: 8,
        quiet_rate: 1.25,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 800,
    },
    // 10 quiet tenants at 1.1/s: 69% of the fleet.
    Mix {
        quiet: 10,
        quiet_rate: 1.1,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 900,
    },
    // 12 quiet tenants at 1/s: 75% of the fleet.
    Mix {
        quiet: 12,
        quiet_rate: 1.0,
        flood_rate: 40.0,
        slots_per_backend: 16,
        seed: 700,
    },
    // 6 quiet tenants at 8/s on 128 slots: 75% of the fleet.
    Mix {
        quiet: 6,
        quiet_rate: 8.0,
        flood_rate: 100.0,
        slots_per_backend: 64,
        seed: 1000,
    },
];

/// The figures behind BENCHMARKS.md, inside and outside the envelope, misses included
/// (asserts nothing): `cargo test -p levee-policy --test isolation -- --ignored --nocapture`.
#[test]
#[ignore = "prints figures; run on demand"]
fn figures_of_every_mix() {
    for (inside, mix) in MIXES
        .iter()
        .map(|m| (true, m))
        .chain(OUTSIDE.iter().map(|m| (false, m)))
    {
        for preempt in [false, true] {
            let (line, verdict) = judge(*mix, preempt);
            let verdict = match verdict {
                Ok(()) => "holds".to_string(),
                Err(miss) => format!("MISS: {miss}"),
            };
            println!(
                "{} {} {line}: {verdict}",
                if inside { "inside " } else { "outside" },
                if preempt { "preempting" } else { "admission " },
            );
        }
    }
}

/// What admission rules other than levee's could give on a mix: the reference the misses
/// above are read against. Nothing of levee runs here. The fleet is the same (its slots, a
/// request holding one for [`SERVICE`], TTFT = wait + [`PREFILL`], [`STEP`]s of time); the
/// quiet tenants' arrivals are the same; a quiet request takes a free slot first (in
/// arrival order), and the flooder is always backlogged.
mod frontier {
    use super::*;
    use std::collections::VecDeque;

    /// The quiet tenants' arrivals (ms), merged, as `simulate` draws them.
    fn quiet_arrivals(mix: Mix) -> Vec<u64> {
        let mut all: Vec<u64> = (0..mix.quiet)
            .flat_map(|i| arrivals(mix.quiet_rate, mix.seed + 1 + i as u64))
            .collect();
        all.sort();
        all
    }

    fn ms(d: Duration) -> u64 {
        d.as_millis() as u64
    }

    /// What a rule gave.
    #[derive(Debug)]
    pub(super) struct Outcome {
        /// The flooder's requests completed per second.
        pub flooder_rate: f64,
        /// Its requests cut short per second (their work lost).
        pub aborted_rate: f64,
        pub quiet_p99: Duration,
    }

    /// An online rule: the flooder may start a request while fewer than `slots - headroom`
    /// slots are busy; with `preempt`, a quiet request that finds every slot busy takes the
    /// slot of the flooder's youngest running request, which goes back to its queue.
    pub(super) fn online(mix: Mix, headroom: usize, preempt: bool) -> Outcome {
        let slots = 2 * mix.slots_per_backend;
        let (service, step, run) = (ms(SERVICE), ms(STEP), ms(RUN));
        let mut arriving = quiet_arrivals(mix).into_iter().peekable();
        let mut waiting = VecDeque::new();
        let (mut quiet_ends, mut flooder_starts) = (Vec::new(), Vec::new());
        let (mut completed, mut aborted) = (0usize, 0usize);
        let mut ttft = Vec::new();
        let mut t = 0;
        while t < run + ms(Duration::from_secs(60)) {
            quiet_ends.retain(|&end| end > t);
            let before = flooder_starts.len();
            flooder_starts.retain(|&start| start + service > t);
            completed += before - flooder_starts.len();
            // Seen at the step it falls in, as `simulate` sees it.
            while arriving.next_if(|&a| a <= t).is_some() {
                waiting.push_back(t);
            }
            while let Some(&a) = waiting.front() {
                if quiet_ends.len() + flooder_starts.len() >= slots {
                    let youngest = (0..flooder_starts.len()).max_by_key(|&i| flooder_starts[i]);
                    match youngest.filter(|_| preempt) {
                        Some(i) => {
                            flooder_starts.swap_remove(i);
                            aborted += 1;
                        }
                        None => break,
                    }
                }
                waiting.pop_front();
                ttft.push(Duration::from_millis(t - a) + PREFILL);
                quiet_ends.push(t + service);
            }
            while t < run && quiet_ends.len() + flooder_starts.len() + headroom < slots {
                flooder_starts.push(t);
            }
            t += step;
        }
        Outcome {
            flooder_rate: completed as f64 / RUN.as_secs_f64(),
            aborted_rate: aborted as f64 / RUN.as_secs_f64(),
            // With no quiet tenant, nobody waited.
            quiet_p99: if ttft.is_empty() {
                Duration::ZERO
            } else {
                common::same_tier::p99(&mut ttft)
            },
        }
    }

    /// The most a flooder could complete per second without delaying any quiet request if
    /// it knew every arrival to come: it starts a request whenever a slot stays free for the
    /// whole [`SERVICE`] ahead, earliest first (in [`STEP`]s).
    pub(super) fn clairvoyant(mix: Mix) -> f64 {
        let slots = 2 * mix.slots_per_backend;
        let (hold, step) = ((ms(SERVICE) / ms(STEP)) as usize, ms(STEP));
        let steps = (ms(RUN) / step) as usize;
        let mut busy = vec![0usize; steps + hold];
        for a in quiet_arrivals(mix) {
            let from = (a / step) as usize;
            for b in &mut busy[from..from + hold] {
                *b += 1;
            }
        }
        let (mut t, mut started) = (0, 0usize);
        while t < steps {
            match busy[t..t + hold].iter().rposition(|&b| b >= slots) {
                Some(full) => t += full + 1,
                None => {
                    for b in &mut busy[t..t + hold] {
                        *b += 1;
                    }
                    started += 1;
                }
            }
        }
        started as f64 / RUN.as_secs_f64()
    }
}

/// The frontier behind BENCHMARKS.md's reading of the misses (asserts nothing): on each
/// mix, the flooder's completions and the quiet p99 TTFT under admission rules that hold
/// back a fixed headroom, the same with preemption of the flooder's youngest request, and
/// the clairvoyant ceiling: `cargo test --release -p levee-policy --test isolation --
/// --ignored --nocapture frontier`.
#[test]
#[ignore = "prints figures; run on demand"]
fn figures_of_the_frontier() {
    for mix in MIXES.iter().chain(OUTSIDE.iter()) {
        let alone = frontier::online(
            Mix {
                flood_rate: 0.0,
                ..*mix
            },
            2 * mix.slots_per_backend,
            false,
        );
        println!(
            "{} quiet x {}/s ({:.0}% of the fleet), {} slots: quiet p99 TTFT alone {:?}; flooder's weighted share {:.2}/s; clairvoyant ceiling {:.2}/s",
            mix.quiet,
            mix.quiet_rate,
            100.0 * mix.quiet_share(),
            2 * mix.slots_per_backend,
            alone.quiet_p99,
            mix.flooder_share(),
            frontier::clairvoyant(*mix),
        );
        for preempt in [false, true] {
            for headroom in [0, 2, 4, 6, 8, 10, 12] {
                let o = frontier::online(*mix, headroom, preempt);
                println!(
                    "    headroom {headroom:>2}{}: flooder {:.2}/s (cut short {:.2}/s), quiet p99 TTFT {:?}",
                    if preempt { ", preempting" } else { "" },
                    o.flooder_rate,
                    o.aborted_rate,
                    o.quiet_p99,
                );
            }
        }
    }
}

/// The reference's own check, on cases whose answer is known: with no quiet tenant every
/// rule fills the fleet (32 slots of 2 s: 16/s), and with preemption no quiet request waits.
#[test]
fn the_frontier_reference_gives_the_known_answers() {
    let mut mix = OUTSIDE[0];
    let full = (2 * mix.slots_per_backend) as f64 / SERVICE.as_secs_f64();
    mix.quiet = 0;
    assert!((frontier::clairvoyant(mix) - full).abs() < 0.1);
    assert!((frontier::online(mix, 0, false).flooder_rate - full).abs() < 0.1);
    let busy = OUTSIDE[0];
    let o = frontier::online(busy, 0, true);
    assert_eq!(o.quiet_p99, PREFILL, "{o:?}");
    assert!(o.aborted_rate > 0.0, "{o:?}");
    // Without preemption and without headroom, the same quiet tenants wait.
    assert!(frontier::online(busy, 0, false).quiet_p99 > PREFILL);
}
