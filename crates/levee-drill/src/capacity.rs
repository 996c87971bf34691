//! The fleet's capacity: the reference every goodput verdict is judged against, and the
//! operator formula that caps the competent baseline.
//!
//! 1. **A sample of traffic.** The scenario's mix at a low rate for a short while through a
//!    plain proxy that notes, per answered request, the prompt tokens the *server* reported
//!    (`usage.prompt_tokens`) and the request's `max_tokens` — what an operator reads from
//!    access logs.
//! 2. **The operator formula.** Per engine, cap = ⌊KV tokens ÷ p95(prompt + max_tokens)⌋ of
//!    the sample, at most the engine's `max_num_seqs` (at least 1): at the cap, even a batch
//!    of 95th-percentile requests fits the KV cache.
//! 3. **The sweep.** Open-loop steps of rising rate (the scenario's mix, no retries) through
//!    the competent capped proxy ([`crate::passthrough`]: that cap, a FIFO queue with the
//!    wait budget, passive health, one retry on connect failure), each on fresh engines.
//!    A step's rate counts new conversations (a scenario's sessions bring later turns on
//!    top; the step prints the requests it offered after its warm-up, every turn counted).
//!    A step's goodput is the requests meeting the SLO per second after its warm-up. The
//!    first step (half the first estimate) is halved, up to three times, while it is far
//!    past the knee (a crash, or goodput under half its rate); from there the
//!    sweep rises and goes on past flat steps until goodput falls (10% below the best), or until
//!    [`Timing::flat_steps_to_stop`] steps in a row add nothing (2% over the best): a
//!    plateau. A step in which an engine crashed does not count.
//! 4. **Higher caps.** The formula keeps even a batch of 95th-percentile requests in the KV
//!    cache, so on a heavy-tailed mix it leaves most of the cache idle. An operator who
//!    measured would raise it: the sweep goes on at caps of 1.5×, 2.25×, … the formula's (up
//!    to `max_num_seqs`), one step each, offered 1.5× the best goodput so far, until a cap
//!    crashes an engine or two caps in a row add under 2%. After a crash, the gap between
//!    the highest crash-free cap and the one that crashed is halved, a step at a time (up to
//!    three), so the knee does not hang on one lucky or unlucky step at the crashing cap.
//! 5. **The knee** is the best a protected fleet achieves, confirmed. The best crash-free
//!    step (at any cap) is the highest of all the sweep's noisy readings (a step's window
//!    counts a hundred-odd requests, ±10%), so on its own it reads high: the winner's curse.
//!    It is run twice more, each on fresh engines, at its cap and rate of new conversations,
//!    with the arrival seed + 1 and + 2 (the same seed would replay the same arrivals); the
//!    knee is the mean of the two repeats. The first reading is left out: it was chosen for
//!    being the highest, so any average with it would keep part of its luck (the median of
//!    the three, tried first, still reads about half a step's deviation high). A repeat
//!    that crashes an engine, or serves nothing within the SLO, means the cap is not one a
//!    protected fleet runs at. The gap between it and the highest crash-free cap below is
//!    then halved as in 4 (a step at a time, up to three in all, each at the rate of the
//!    step that did not hold): a held step ends the halving, a crash lowers the gap's top.
//!    Then the best step below the cap that did not hold is confirmed the same way. Without
//!    the halving, a cap that crashed in a repeat dropped the knee to the next cap the sweep
//!    happened to try, a third lower, leaving the caps between untried.

use crate::contender::Setup;
use crate::fleet::Fleet;
use crate::passthrough::{Cap, Passthrough, Sample};
use crate::verdicts;
use levee_engine::EngineConfig;
use levee_sim::scenario::{Behaviour, Phase, Rate, Scenario, Tenant};
use levee_sim::RunOptions;
use rand::SeedableRng;
use std::fmt::Write as _;
use std::time::Duration;

/// How long things last: the full drill, `--quick`, or running servers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// Factor on the scenario's timeline and the engines' restart time.
    pub time_scale: f64,
    /// Sample run: its length, and its rate as a share of the first capacity estimate.
    pub sample_s: f64,
    pub sample_share: f64,
    /// Sweep: length of one step, and the first seconds of it left out.
    pub step_s: f64,
    pub step_warm_s: f64,
    /// Sweep: the first step's rate and each rise, as shares of the first estimate.
    pub first_step: f64,
    pub rise: f64,
    /// Sweep: it ends after this many steps in a row add less than 2% over the best.
    pub flat_steps_to_stop: u32,
    /// Sweep: most steps.
    pub max_steps: u32,
    /// Sample run: after its last scheduled send, how long requests still in flight may
    /// finish (a size is noted when its answer ends). The sweep's steps count goodput by
    /// completion inside their window, which closes before the step's end; the contenders'
    /// floods wait for the client's timeout.
    pub drain_s: f64,
    /// First seconds of a flood stretch left out of the goodput window.
    pub flood_warm_s: f64,
}

pub(crate) const FULL: Timing = Timing {
    time_scale: 1.0,
    sample_s: 20.0,
    sample_share: 0.3,
    step_s: 15.0,
    step_warm_s: 5.0,
    first_step: 0.5,
    rise: 0.1,
    flat_steps_to_stop: 3,
    max_steps: 16,
    drain_s: 6.0,
    flood_warm_s: 2.0,
};

/// Real servers (`--backend`) on CPUs serve a few requests per second, each lasting
/// seconds, at a speed that follows the machine's load: longer steps, so that a step's
/// goodput counts enough requests.
pub(crate) const EXTERNAL: Timing = Timing {
    time_scale: 1.0,
    sample_s: 40.0,
    sample_share: 0.3,
    step_s: 30.0,
    step_warm_s: 8.0,
    first_step: 0.5,
    rise: 0.15,
    flat_steps_to_stop: 3,
    max_steps: 12,
    drain_s: 10.0,
    flood_warm_s: 2.0,
};

pub(crate) const QUICK: Timing = Timing {
    time_scale: 0.2,
    sample_s: 8.0,
    sample_share: 0.3,
    step_s: 8.0,
    step_warm_s: 3.0,
    first_step: 0.5,
    rise: 0.2,
    flat_steps_to_stop: 2,
    max_steps: 8,
    drain_s: 2.0,
    flood_warm_s: 1.0,
};

/// Passive health of the capped baseline: a backend that failed this many times in a row
/// (no answer, or a 5xx) is skipped for [`SKIP_FOR`].
pub(crate) const FAIL_AFTER: u32 = 3;
pub(crate) const SKIP_FOR: Duration = Duration::from_secs(5);

/// The operator formula's inputs and result.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OperatorCap {
    /// Requests in the sample with a reported prompt size.
    pub samples: usize,
    /// p95 of prompt (as the server reported it) + `max_tokens`, in tokens.
    pub p95_tokens: u32,
    /// One engine's KV cache, in tokens.
    pub kv_tokens: u32,
    /// One engine's `max_num_seqs`.
    pub max_num_seqs: u32,
    /// The cap: ⌊kv_tokens ÷ p95_tokens⌋, within 1..=max_num_seqs.
    pub per_engine: u32,
}

/// The operator formula (see the module documentation) over `sample`: per request, the
/// prompt tokens the server reported and the request's `max_tokens` (absent: the rest of
/// the context, as the engine assumes).
pub(crate) fn operator_cap(
    engine: &EngineConfig,
    sample: &[(u32, Option<u32>)],
) -> anyhow::Result<OperatorCap> {
    let mut sizes: Vec<u32> = sample
        .iter()
        .map(|&(prompt, max)| {
            let max = max.unwrap_or(engine.gpu.max_model_len.saturating_sub(prompt));
            prompt.saturating_add(max)
        })
        .collect();
    anyhow::ensure!(
        !sizes.is_empty(),
        "the sample run got no answer that reported usage.prompt_tokens; the operator formula \
         needs the server's own prompt sizes"
    );
    sizes.sort_unstable();
    // Nearest rank: the smallest size with at least 95% of the sample at or below it.
    let rank = (95 * sizes.len()).div_ceil(100).max(1);
    let p95 = sizes[rank - 1].max(1);
    let g = &engine.gpu;
    Ok(OperatorCap {
        samples: sizes.len(),
        p95_tokens: p95,
        kv_tokens: g.kv_capacity_tokens,
        max_num_seqs: g.max_running_seqs,
        per_engine: (g.kv_capacity_tokens / p95).clamp(1, g.max_running_seqs.max(1)),
    })
}

/// The competent capped baseline's limits: the operator formula's cap per engine, a FIFO
/// queue as long as the fleet's slots with a wait budget of `wait`, passive health.
pub(crate) fn competent_cap(op: &OperatorCap, engines: usize, wait: Duration) -> Cap {
    Cap {
        per_backend: op.per_engine,
        queue_len: op.per_engine as usize * engines,
        queue_timeout: wait,
        fail_after: FAIL_AFTER,
        skip_for: SKIP_FOR,
    }
}

/// The wait budget of every queue in the drill's baselines: three quarters of the
/// scenario's TTFT objective (1.5 s of a 2 s objective), what levee's premium tier waits
/// in the calibrated configuration.
pub(crate) fn wait_budget(scenario: &Scenario) -> Duration {
    Duration::from_secs_f64(0.75 * scenario.slo.ttft_ms.unwrap_or(2000.0) / 1000.0)
}

/// One step of the capacity sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SweepStep {
    /// The proxy's cap per engine in this step.
    pub cap: u32,
    /// New conversations a second the step was run at (what [`sweep_scenario`] was given).
    pub rate: f64,
    /// The seed of the step's arrivals and mix.
    pub seed: u64,
    /// Requests offered a second in the step's window (by intended time, every turn of a
    /// session counted).
    pub offered_rps: f64,
    pub goodput_rps: f64,
    pub crashed: bool,
    /// 99th-percentile end to end of the step's successful requests, ms.
    pub e2e_p99_ms: f64,
}

/// A sweep step confirmed: run twice more (see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Confirmation {
    /// The sweep's step, then its two repeats (its cap and rate, its seed + 1 and + 2).
    pub runs: [SweepStep; 3],
}

impl Confirmation {
    /// Whether both repeats held: no engine crashed and each served something within the
    /// SLO.
    fn held(&self) -> bool {
        self.runs[1..]
            .iter()
            .all(|s| !s.crashed && s.goodput_rps > 0.0)
    }

    /// The mean goodput of the two repeats, when both held.
    pub(crate) fn knee_rps(&self) -> Option<f64> {
        self.held()
            .then(|| (self.runs[1].goodput_rps + self.runs[2].goodput_rps) / 2.0)
    }

    /// The mean p99 end to end of the two repeats, when both held.
    fn e2e_p99_ms(&self) -> Option<f64> {
        self.held()
            .then(|| (self.runs[1].e2e_p99_ms + self.runs[2].e2e_p99_ms) / 2.0)
    }

    /// The three goodputs in run order, e.g. `12.9 (the sweep's), 0 (an engine crashed)
    /// and 11.2 req/s`.
    pub(crate) fn goodputs(&self) -> String {
        let g: Vec<String> = self
            .runs
            .iter()
            .map(|s| {
                if s.crashed {
                    "0 (an engine crashed)".to_string()
                } else {
                    format!("{:.1}", s.goodput_rps)
                }
            })
            .collect();
        format!("{} (the sweep's), {} and {} req/s", g[0], g[1], g[2])
    }
}

/// The capacity measurement's result.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sweep {
    pub cap: OperatorCap,
    pub steps: Vec<SweepStep>,
    /// The knee's confirmations, in order: the last one gave the knee; any before it had a
    /// repeat that did not hold and moved the knee to a lower cap.
    pub confirmations: Vec<Confirmation>,
    /// The mean goodput of the last confirmation's repeats (0: none held).
    pub knee_rps: f64,
}

impl Sweep {
    /// The p99 end to end at the knee: the mean of its repeats' (none: no knee).
    pub(crate) fn knee_e2e_p99_ms(&self) -> Option<f64> {
        self.confirmations.last().and_then(Confirmation::e2e_p99_ms)
    }

    /// How the knee was reached, e.g. `the mean of two repeats of the best step, cap 20 per
    /// engine at 7.1 conversations/s: 12.9 (the sweep's), 11.2 and 10.8 req/s`.
    pub(crate) fn knee_words(&self) -> String {
        match self.confirmations.last() {
            Some(c) => format!(
                "the mean of two repeats of the best step, cap {} per engine at {:.1} \
                 conversations/s: {}",
                c.runs[0].cap,
                c.runs[0].rate,
                c.goodputs()
            ),
            None => "no step confirmed".to_string(),
        }
    }
}

/// The scenario's request mix for `secs`, `rps` new conversations a second (each bringing
/// its later turns, if the scenario has sessions): its classes and sessions from one tenant,
/// no retries, no faults. The sweep steps by conversations, not requests: in a step of a few
/// seconds most sessions' later turns come after it ends, so a step offered `r` requests a
/// second by the scenario's count would send far fewer and never reach the knee.
pub(crate) fn sweep_scenario(base: &Scenario, rps: f64, secs: f64) -> Scenario {
    let mut s = base.clone();
    s.name = format!("{} (capacity sweep at {rps:.1} conversations/s)", base.name);
    s.phases = vec![Phase::Steady {
        duration_s: secs,
        rps: Rate::Rps(rps * base.turns_per_arrival()),
    }];
    s.rate_scale = 1.0;
    s.tenants = vec![Tenant::default()];
    s.faults.clear();
    s.client.behaviour = Behaviour::None;
    s.client.max_attempts = 1;
    s
}

/// A first guess of the fleet's capacity for the scenario's mix, only to place the sample
/// and the sweep's steps: per engine, `seqs` sequences at once (at most those whose prompt
/// and output fit 60% of the KV cache), each producing its output at one decode step per
/// token.
pub(crate) fn estimated_capacity(
    scenario: &Scenario,
    engines: usize,
    engine: &EngineConfig,
    seqs: u32,
) -> f64 {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(scenario.seed);
    let total_weight: f64 = scenario.classes.iter().map(|c| c.weight.max(0.0)).sum();
    let (mut prompt, mut output) = (0.0, 0.0);
    let natural = f64::from(
        engine.output_tokens_min + (engine.output_tokens_max - engine.output_tokens_min) / 2,
    );
    for c in &scenario.classes {
        let w = c.weight.max(0.0) / total_weight.max(1e-9);
        let n = 500;
        let (mut p, mut o) = (0.0, 0.0);
        for _ in 0..n {
            p += c.prompt_tokens.sample(&mut rng);
            o += c.max_tokens.sample(&mut rng).min(natural);
        }
        prompt += w * p / f64::from(n);
        output += w * o / f64::from(n);
    }
    let g = &engine.gpu;
    let per_seq = (prompt + output).max(1.0);
    let seqs = (0.6 * f64::from(g.kv_capacity_tokens) / per_seq).min(f64::from(seqs.max(1)));
    let step_s = (g.decode_base_ms + g.decode_per_seq_ms * seqs) / 1000.0;
    engines as f64 * seqs / (output.max(1.0) * step_s)
}

/// The sample run: the scenario's mix at `rps` for the timing's sample length on a fresh
/// fleet, through a proxy that notes the server's reported sizes.
async fn sample_sizes(
    scenario: &Scenario,
    setup: &Setup<'_>,
    timing: &Timing,
    rps: f64,
) -> anyhow::Result<Vec<(u32, Option<u32>)>> {
    let mut s = sweep_scenario(scenario, rps, timing.sample_s);
    s.name = format!("{} (sample at {rps:.1} req/s)", scenario.name);
    let fleet = Fleet::start(setup).await?;
    let sample = Sample::default();
    let proxy = Passthrough::start_sampling(fleet.urls(), sample.clone()).await?;
    let opts = RunOptions {
        drain: Some(Duration::from_secs_f64(timing.drain_s)),
        ..setup.opts.clone()
    };
    let run = fleet.run(&s, &fleet.target(proxy.base_url()), &opts).await;
    proxy.shutdown().await;
    fleet.stop().await;
    run?;
    let sizes = sample
        .lock()
        .map_err(|_| anyhow::anyhow!("the sample log was poisoned"))?
        .clone();
    Ok(sizes)
}

/// One step of the sweep: `rps` new conversations a second of the scenario's mix, its
/// arrivals drawn from `seed`, on a fresh fleet behind the capped proxy; goodput over
/// `window` (seconds of the step).
async fn sweep_step(
    scenario: &Scenario,
    setup: &Setup<'_>,
    timing: &Timing,
    cap: Cap,
    rps: f64,
    seed: u64,
    window: &[u32],
) -> anyhow::Result<SweepStep> {
    let mut s = sweep_scenario(scenario, rps, timing.step_s);
    s.seed = seed;
    let opts = RunOptions {
        drain: Some(Duration::from_millis(500)),
        ..setup.opts.clone()
    };
    let fleet = Fleet::start(setup).await?;
    let proxy = Passthrough::start_capped(fleet.urls(), cap).await?;
    let target = fleet.target(proxy.base_url());
    let run = fleet.run(&s, &target, &opts).await;
    proxy.shutdown().await;
    let crashed = fleet.stop().await.crashes > 0;
    let (report, _) = run?;
    Ok(SweepStep {
        cap: cap.per_backend,
        rate: rps,
        seed,
        // What the step offered in the window, every turn counted (by intended time).
        offered_rps: verdicts::window_mean(&report, window, |s| s.offered).unwrap_or(0.0),
        goodput_rps: verdicts::window_goodput(&report, window).unwrap_or(0.0),
        crashed,
        e2e_p99_ms: report.latency.e2e.p99,
    })
}

/// Whether the sweep has seen enough: goodput fell 10% below the best, or the last
/// `flat` steps each added less than 2% over the best before them.
fn sweep_done(steps: &[SweepStep], flat: u32) -> bool {
    let good: Vec<f64> = steps
        .iter()
        .map(|s| if s.crashed { 0.0 } else { s.goodput_rps })
        .collect();
    let best = good.iter().copied().fold(0.0, f64::max);
    let Some(&last) = good.last() else {
        return false;
    };
    if best > 0.0 && last < 0.9 * best {
        return true;
    }
    let flat = flat as usize;
    good.len() > flat
        && (good.len() - flat..good.len()).all(|i| {
            let before = good[..i].iter().copied().fold(0.0, f64::max);
            good[i] < before * 1.02
        })
}

/// Measures the knee (see the module documentation); `progress` prints each step.
pub(crate) async fn measure_knee(
    scenario: &Scenario,
    setup: &Setup<'_>,
    timing: &Timing,
) -> anyhow::Result<Sweep> {
    let engine = &setup.engine;
    let rough = estimated_capacity(scenario, setup.engines, engine, engine.gpu.max_running_seqs);
    let sample_rps = (rough * timing.sample_share).max(0.2);
    eprintln!(
        "      sample: {sample_rps:.1} req/s for {:.0} s, sizes as the server reports them",
        timing.sample_s
    );
    let sizes = sample_sizes(scenario, setup, timing, sample_rps).await?;
    let op = operator_cap(engine, &sizes)?;
    eprintln!(
        "      operator cap: {} KV tokens ÷ p95 {} tokens (prompt + max_tokens, {} answers) = \
         {} per engine (max_num_seqs {})",
        op.kv_tokens, op.p95_tokens, op.samples, op.per_engine, op.max_num_seqs
    );
    let competent = competent_cap(&op, setup.engines, wait_budget(scenario));
    let estimate = estimated_capacity(scenario, setup.engines, engine, op.per_engine);
    let window: Vec<u32> = (timing.step_warm_s as u32..timing.step_s as u32).collect();
    let seed = scenario.seed;
    let run = |rps: f64| sweep_step(scenario, setup, timing, competent, rps, seed, &window);
    // The capped proxy at another cap per engine, its queue as long as the fleet's slots.
    let capped = |cap: u32| Cap {
        per_backend: cap,
        queue_len: cap as usize * setup.engines,
        ..competent
    };
    let mut steps: Vec<SweepStep> = Vec::new();
    // The first step: halved (up to three times) while it is far past the knee (an engine
    // crashed, or its goodput was under half its rate of new conversations).
    let mut first = estimate * timing.first_step;
    for halvings in 0.. {
        let step = run(first).await?;
        print_step(&step, NOT_COUNTED);
        steps.push(step);
        if (!step.crashed && step.goodput_rps >= 0.5 * first) || halvings == 3 {
            break;
        }
        first /= 2.0;
    }
    // The climb, from the first step kept, in rises of the same share of it.
    let climb_from = steps.len() - 1;
    let mut k = 1.0;
    while !sweep_done(&steps[climb_from..], timing.flat_steps_to_stop)
        && (steps.len() as u32) < timing.max_steps
    {
        let step = run(first * (1.0 + k * timing.rise / timing.first_step)).await?;
        print_step(&step, NOT_COUNTED);
        steps.push(step);
        k += 1.0;
    }
    raise_cap(&mut steps, &op, timing, |cap, rps| {
        sweep_step(scenario, setup, timing, capped(cap), rps, seed, &window)
    })
    .await?;
    let confirmations = confirm_knee(&mut steps, |cap, rps, seed| {
        sweep_step(scenario, setup, timing, capped(cap), rps, seed, &window)
    })
    .await?;
    let knee = confirmations
        .last()
        .and_then(Confirmation::knee_rps)
        .unwrap_or(0.0);
    anyhow::ensure!(
        knee > 0.0,
        "the capacity sweep found no crash-free step with goodput that held when run again \
         (steps: {steps:?}; confirmations: {confirmations:?}); the engines cannot serve this \
         scenario's mix within its SLO"
    );
    Ok(Sweep {
        cap: op,
        steps,
        confirmations,
        knee_rps: knee,
    })
}

/// The knee's confirmation (see the module documentation): the best crash-free step run
/// twice more by `step(cap, rate, seed)`, at its cap and rate of new conversations, with
/// its seed + 1 and + 2; the knee is the mean of the two repeats. When a repeat crashed an
/// engine or served nothing within the SLO, the gap below that cap is narrowed (its steps
/// added to `steps`) and the best step below it is confirmed instead, and so on down.
/// Returns the confirmations in order; the last one gives the knee if its repeats held
/// (none: no step to confirm).
async fn confirm_knee<F, Fut>(
    steps: &mut Vec<SweepStep>,
    step: F,
) -> anyhow::Result<Vec<Confirmation>>
where
    F: Fn(u32, f64, u64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<SweepStep>>,
{
    let held = |s: &&SweepStep| !s.crashed && s.goodput_rps > 0.0;
    let mut confirmations = Vec::new();
    let mut below = u32::MAX;
    let mut narrowing = 0;
    while let Some(&best) = steps
        .iter()
        .filter(|s| s.cap < below)
        .filter(held)
        .max_by(|a, b| a.goodput_rps.total_cmp(&b.goodput_rps))
    {
        eprintln!(
            "      the best step again (cap {}, {:.1} conversations/s), twice, on arrival seeds \
             {} and {}:",
            best.cap,
            best.rate,
            best.seed.wrapping_add(1),
            best.seed.wrapping_add(2)
        );
        let mut runs = [best; 3];
        for (i, run) in runs.iter_mut().enumerate().skip(1) {
            *run = step(best.cap, best.rate, best.seed.wrapping_add(i as u64)).await?;
            print_step(run, NOT_HELD);
        }
        let confirmation = Confirmation { runs };
        let confirmed = confirmation.held();
        confirmations.push(confirmation);
        if confirmed {
            break;
        }
        eprintln!(
            "      a repeat did not hold: cap {} is not one a protected fleet runs at; the gap \
             below it narrowed, then the best step below it confirmed",
            best.cap
        );
        below = best.cap;
        // Halve the gap between `below` and the highest crash-free cap under it until a
        // step holds (a new candidate) or the gap closes.
        while narrowing < NARROWING_STEPS {
            let Some(low) = steps
                .iter()
                .filter(|s| s.cap < below)
                .filter(held)
                .map(|s| s.cap)
                .max()
            else {
                break;
            };
            if below - low <= 1 {
                break;
            }
            let s = step(low + (below - low) / 2, best.rate, best.seed).await?;
            print_step(&s, NOT_COUNTED);
            steps.push(s);
            narrowing += 1;
            if !s.crashed {
                break;
            }
            below = s.cap;
        }
    }
    Ok(confirmations)
}

/// The best goodput of a crash-free step (0 when none).
fn best_goodput(steps: &[SweepStep]) -> f64 {
    steps
        .iter()
        .filter(|s| !s.crashed)
        .map(|s| s.goodput_rps)
        .fold(0.0, f64::max)
}

/// The caps above the operator's that the knee tries: 1.5× the last, rounded, distinct, up
/// to `max_num_seqs`.
fn higher_caps(op: &OperatorCap) -> Vec<u32> {
    let mut caps = Vec::new();
    let mut c = f64::from(op.per_engine);
    loop {
        c *= 1.5;
        let last = caps.last().map_or(op.per_engine, |&l| l);
        let next = (c.round() as u32).max(last + 1).min(op.max_num_seqs);
        if last >= next {
            return caps;
        }
        caps.push(next);
    }
}

/// Most steps spent narrowing the gap between the highest crash-free cap and the first that
/// crashed.
const NARROWING_STEPS: u32 = 3;

/// The higher caps' steps (see the module documentation), each offered 1.5× the best
/// goodput so far; `step(cap, rps)` runs one. When a cap crashes an engine, the gap between
/// it and the highest cap that did not is halved, one step at a time (up to
/// [`NARROWING_STEPS`]): a crash lowers the top of the gap, a gain raises its bottom, a step
/// that adds under 2% ends the search. Without it the knee would hang on whether the one
/// step at the first crashing cap was lucky.
async fn raise_cap<F, Fut>(
    steps: &mut Vec<SweepStep>,
    op: &OperatorCap,
    timing: &Timing,
    step: F,
) -> anyhow::Result<()>
where
    F: Fn(u32, f64) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<SweepStep>>,
{
    let room = |steps: &[SweepStep]| (steps.len() as u32) < timing.max_steps + 6;
    let try_cap = |steps: &[SweepStep], cap: u32| {
        let best = best_goodput(steps);
        let run = step(cap, (best * 1.5).max(0.2));
        async move {
            let s = run.await?;
            print_step(&s, NOT_COUNTED);
            anyhow::Ok((s, !s.crashed && s.goodput_rps >= best * 1.02))
        }
    };
    let mut flat = 0;
    let mut below = op.per_engine;
    let mut above = None;
    for cap in higher_caps(op) {
        if !room(&steps[..]) {
            return Ok(());
        }
        let (s, gained) = try_cap(&steps[..], cap).await?;
        steps.push(s);
        if s.crashed {
            above = Some(cap);
            break;
        }
        below = cap;
        flat = if gained { 0 } else { flat + 1 };
        if flat == 2 {
            return Ok(());
        }
    }
    let Some(mut above) = above else {
        return Ok(());
    };
    for _ in 0..NARROWING_STEPS {
        if above - below <= 1 || !room(&steps[..]) {
            break;
        }
        let cap = below + (above - below) / 2;
        let (s, gained) = try_cap(&steps[..], cap).await?;
        steps.push(s);
        if s.crashed {
            above = cap;
        } else if gained {
            below = cap;
        } else {
            break;
        }
    }
    Ok(())
}

/// What a step that crashed an engine means: in the sweep, nothing counted; in a
/// confirmation, the cap not held.
const NOT_COUNTED: &str = "not counted";
const NOT_HELD: &str = "the cap not held";

fn print_step(step: &SweepStep, crashed: &str) {
    eprintln!(
        "      cap {:>3}: {:>6.1} req/s offered → {:>6.1} req/s within the SLO{}",
        step.cap,
        step.offered_rps,
        step.goodput_rps,
        if step.crashed {
            format!("  (an engine crashed: {crashed})")
        } else {
            String::new()
        }
    );
}

/// How the knee was measured, in one paragraph (terminal, JSON and page).
pub(crate) fn method(timing: &Timing, wait: Duration) -> String {
    format!(
        "the best goodput a protected fleet achieves: open-loop steps of {:.0} s (goodput = \
         requests within the SLO per second after {:.0} s) of the scenario's mix without \
         retries (a step's rate counts new conversations; sessions add their later turns), \
         through the competent capped proxy — per engine ⌊KV tokens ÷ p95(prompt + \
         max_tokens)⌋ at most max_num_seqs, prompts as the server reported them in a {:.0} s \
         sample; one FIFO queue with a {:.1} s wait; a backend failing {FAIL_AFTER} times in \
         a row skipped for {:.0} s; one retry on connect failure — each step on a fresh fleet, \
         the first halved while far past the knee, then rising until goodput falls 10% below \
         the best or {} steps in a row add under 2%; then at caps of 1.5×, 2.25×, … the \
         formula's (up to max_num_seqs), one step each offered 1.5× the best so far, until a \
         cap crashes an engine or two caps add under 2%, then halving the gap below a crashing \
         cap (up to {NARROWING_STEPS} steps); the knee is the mean goodput of two repeats of \
         the best crash-free step (at any cap) on fresh engines with other arrival seeds, its \
         own reading left out as the luckiest of many (a repeat that crashes an engine or \
         serves nothing: the gap below its cap halved as above, then the best step below it \
         confirmed the same way)",
        timing.step_s,
        timing.step_warm_s,
        timing.sample_s,
        wait.as_secs_f64(),
        SKIP_FOR.as_secs_f64(),
        timing.flat_steps_to_stop
    )
}

/// The sweep as text, headed by its method.
pub(crate) fn render_sweep(sweep: &Sweep, method: &str) -> String {
    format!("capacity (the knee): {method}\n{}", render_steps(sweep))
}

/// The operator cap and the sweep's steps as text.
pub(crate) fn render_steps(sweep: &Sweep) -> String {
    let op = &sweep.cap;
    let mut s = format!(
        "  operator cap per engine: {} KV tokens ÷ p95 {} tokens ({} sampled answers) = {} \
         (max_num_seqs {})\n",
        op.kv_tokens, op.p95_tokens, op.samples, op.per_engine, op.max_num_seqs
    );
    for st in &sweep.steps {
        s.push_str(&step_line(st, NOT_COUNTED));
    }
    for c in &sweep.confirmations {
        let best = &c.runs[0];
        let _ = writeln!(
            s,
            "  the best step again (cap {}, {:.1} conversations/s), on arrival seeds {} and {}:",
            best.cap, best.rate, c.runs[1].seed, c.runs[2].seed
        );
        for st in &c.runs[1..] {
            s.push_str(&step_line(st, NOT_HELD));
        }
        if c.knee_rps().is_none() {
            let _ = writeln!(
                s,
                "  {}: a repeat did not hold, the best step at a lower cap instead",
                c.goodputs()
            );
        }
    }
    let _ = write!(
        s,
        "  knee: {:.1} req/s, {}",
        sweep.knee_rps,
        sweep.knee_words()
    );
    s
}

/// One step's line in [`render_steps`].
fn step_line(st: &SweepStep, crashed: &str) -> String {
    format!(
        "  cap {:>3}: offered {:>6.1} req/s → goodput {:>6.1} req/s{}\n",
        st.cap,
        st.offered_rps,
        st.goodput_rps,
        if st.crashed {
            format!("  (a server crashed: {crashed})")
        } else {
            String::new()
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_operator_cap_is_kv_over_the_p95_size_within_max_num_seqs() {
        let mut e = crate::drill_engine_config();
        e.gpu.kv_capacity_tokens = 24_576;
        e.gpu.max_running_seqs = 64;
        // 100 requests: 95 of 1,000 tokens (prompt 800 + max_tokens 200), 5 of 4,000.
        let mut sample = vec![(800, Some(200)); 95];
        sample.extend(vec![(3800, Some(200)); 5]);
        let op = operator_cap(&e, &sample).unwrap();
        assert_eq!(op.p95_tokens, 1000);
        assert_eq!(op.per_engine, 24);
        // One more long one moves the 95th percentile to 4,000 tokens: 6 per engine.
        sample.push((3800, Some(200)));
        assert_eq!(operator_cap(&e, &sample).unwrap().per_engine, 6);
        // Short requests: capped at max_num_seqs.
        assert_eq!(operator_cap(&e, &[(10, Some(10))]).unwrap().per_engine, 64);
        // No max_tokens: the rest of the context.
        let op = operator_cap(&e, &[(100, None)]).unwrap();
        assert_eq!(op.p95_tokens, e.gpu.max_model_len);
        assert!(operator_cap(&e, &[]).is_err());
    }

    #[test]
    fn higher_caps_rise_by_half_to_max_num_seqs() {
        let op = |per_engine, max_num_seqs| OperatorCap {
            samples: 1,
            p95_tokens: 1,
            kv_tokens: 1,
            max_num_seqs,
            per_engine,
        };
        assert_eq!(higher_caps(&op(6, 64)), vec![9, 14, 20, 30, 46, 64]);
        assert_eq!(higher_caps(&op(64, 64)), Vec::<u32>::new());
        assert_eq!(higher_caps(&op(1, 3)), vec![2, 3]);
    }

    #[test]
    fn the_cap_rises_until_a_crash_then_the_gap_below_it_is_halved() {
        let op = OperatorCap {
            samples: 1,
            p95_tokens: 1,
            kv_tokens: 1,
            max_num_seqs: 64,
            per_engine: 6,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let first = SweepStep {
            cap: 6,
            rate: 2.0,
            seed: 42,
            offered_rps: 4.0,
            goodput_rps: 3.0,
            crashed: false,
            e2e_p99_ms: 0.0,
        };
        // Goodput grows with the cap; caps from `crash_at` up crash an engine.
        let sweep = |crash_at: u32| {
            let mut steps = vec![first];
            rt.block_on(raise_cap(&mut steps, &op, &FULL, |cap, rps| async move {
                Ok(SweepStep {
                    cap,
                    rate: rps,
                    seed: 42,
                    offered_rps: rps,
                    goodput_rps: f64::from(cap) / 2.0,
                    crashed: cap >= crash_at,
                    e2e_p99_ms: 0.0,
                })
            }))
            .unwrap();
            steps
        };
        // 20 crashes: 17 (between 14 and 20) gains, 18 crashes, and no cap is left between.
        let steps = sweep(18);
        let caps: Vec<u32> = steps.iter().map(|s| s.cap).collect();
        assert_eq!(caps, vec![6, 9, 14, 20, 17, 18]);
        assert_eq!(best_goodput(&steps), 8.5);
        // Each offered 1.5× the best before it.
        assert_eq!(steps[1].offered_rps, 4.5);
        assert_eq!(steps[2].offered_rps, 6.75);
        assert_eq!(steps[4].offered_rps, 10.5);
        // 14 crashes already: the gap down to 9 is halved at most three times.
        let caps: Vec<u32> = sweep(10).iter().map(|s| s.cap).collect();
        assert_eq!(caps, vec![6, 9, 14, 11, 10]);
        // A narrowing step that adds under 2% ends the search.
        let mut steps = vec![first];
        rt.block_on(raise_cap(&mut steps, &op, &FULL, |cap, rps| async move {
            Ok(SweepStep {
                cap,
                rate: rps,
                seed: 42,
                offered_rps: rps,
                goodput_rps: f64::from(cap.min(9)),
                crashed: cap >= 14,
                e2e_p99_ms: 0.0,
            })
        }))
        .unwrap();
        let caps: Vec<u32> = steps.iter().map(|s| s.cap).collect();
        assert_eq!(caps, vec![6, 9, 14, 11]);
    }

    #[test]
    fn the_sweep_goes_past_flat_steps_until_goodput_falls_or_a_plateau() {
        let step = |g: f64| SweepStep {
            cap: 8,
            rate: 0.0,
            seed: 42,
            offered_rps: 0.0,
            goodput_rps: g,
            crashed: false,
            e2e_p99_ms: 0.0,
        };
        let steps: Vec<SweepStep> = [5.0, 7.0, 9.0, 9.1].map(step).to_vec();
        // One flat step does not end it.
        assert!(!sweep_done(&steps, 3));
        let mut more = steps.clone();
        more.extend([9.15, 9.0].map(step));
        assert!(sweep_done(&more, 3));
        // A fall of 10% ends it at once.
        let mut fell = steps.clone();
        fell.push(step(8.0));
        assert!(sweep_done(&fell, 3));
        // A crashed step counts as no goodput.
        let mut crashed = steps;
        crashed.push(SweepStep {
            crashed: true,
            ..step(12.0)
        });
        assert!(sweep_done(&crashed, 3));
    }

    /// A sweep step: `cap`, goodput `g`, at 2 conversations/s a cap unit, seed 42.
    fn step_at(cap: u32, g: f64, crashed: bool) -> SweepStep {
        SweepStep {
            cap,
            rate: f64::from(cap) / 2.0,
            seed: 42,
            offered_rps: 0.0,
            goodput_rps: g,
            crashed,
            e2e_p99_ms: f64::from(cap),
        }
    }

    /// Confirms `steps` with repeats that `repeat(cap, seed)` answers as (goodput, crashed);
    /// returns the sweep and the calls made (cap, rate, seed).
    fn confirmed(
        mut steps: Vec<SweepStep>,
        repeat: impl Fn(u32, u64) -> (f64, bool),
    ) -> (Sweep, Vec<(u32, f64, u64)>) {
        let calls = std::cell::RefCell::new(Vec::new());
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let confirmations = rt
            .block_on(confirm_knee(&mut steps, |cap, rate, seed| {
                calls.borrow_mut().push((cap, rate, seed));
                let (g, crashed) = repeat(cap, seed);
                let s = SweepStep {
                    rate,
                    seed,
                    e2e_p99_ms: 1000.0 + g,
                    ..step_at(cap, g, crashed)
                };
                async move { Ok(s) }
            }))
            .unwrap();
        let knee_rps = confirmations
            .last()
            .and_then(Confirmation::knee_rps)
            .unwrap_or(0.0);
        let sweep = Sweep {
            cap: OperatorCap {
                samples: 1,
                p95_tokens: 1,
                kv_tokens: 1,
                max_num_seqs: 64,
                per_engine: 6,
            },
            steps,
            confirmations,
            knee_rps,
        };
        (sweep, calls.into_inner())
    }

    #[test]
    fn the_knee_is_the_mean_of_two_repeats_of_the_best_step_on_other_seeds() {
        // Cap 9's 12.9 is the best crash-free step (cap 14's crashed); run again it
        // serves 10.8 and 11.2: the lucky 12.9 is left out, the knee is their mean, 11.0.
        let steps = vec![
            step_at(6, 8.0, false),
            step_at(9, 12.9, false),
            step_at(14, 20.0, true),
        ];
        let (sweep, calls) = confirmed(steps, |_, seed| {
            (if seed == 43 { 10.8 } else { 11.2 }, false)
        });
        // The same cap and rate of new conversations, the seed + 1 and + 2.
        assert_eq!(calls, vec![(9, 4.5, 43), (9, 4.5, 44)]);
        assert_eq!(sweep.confirmations.len(), 1);
        assert!((sweep.knee_rps - 11.0).abs() < 1e-9);
        // The knee's end to end is its repeats' mean.
        assert!((sweep.knee_e2e_p99_ms().unwrap() - 1011.0).abs() < 1e-9);
        assert_eq!(
            sweep.knee_words(),
            "the mean of two repeats of the best step, cap 9 per engine at 4.5 \
             conversations/s: 12.9 (the sweep's), 10.8 and 11.2 req/s"
        );
        // Repeats above the original: still their mean, not the original's nor the median.
        let (sweep, _) = confirmed(vec![step_at(9, 10.0, false)], |_, seed| {
            (if seed == 43 { 13.0 } else { 11.0 }, false)
        });
        assert!((sweep.knee_rps - 12.0).abs() < 1e-9);
    }

    #[test]
    fn a_repeat_that_crashes_an_engine_moves_the_knee_to_a_lower_cap() {
        // Cap 14's 12.9 is the best step; one repeat serves 14.0 but crashed an engine, so
        // cap 14 is not held whatever the other gives: cap 9's step is confirmed instead.
        let steps = vec![step_at(9, 11.0, false), step_at(14, 12.9, false)];
        let (sweep, calls) = confirmed(steps, |cap, seed| match (cap, seed) {
            (14, 43) => (14.0, true),
            (14, _) => (12.5, false),
            (_, 43) => (10.0, false),
            _ => (10.4, false),
        });
        // Cap 14's repeats, the gap 9–14 halved at cap 11 (at cap 14's rate, the sweep's
        // seed), then cap 9's repeats: cap 11's 10.4 is below cap 9's 11.0.
        assert_eq!(
            calls,
            vec![
                (14, 7.0, 43),
                (14, 7.0, 44),
                (11, 7.0, 42),
                (9, 4.5, 43),
                (9, 4.5, 44)
            ]
        );
        assert_eq!(sweep.steps.last().map(|s| s.cap), Some(11));
        assert_eq!(
            sweep.confirmations[0].goodputs(),
            "12.9 (the sweep's), 0 (an engine crashed) and 12.5 req/s"
        );
        assert_eq!(sweep.confirmations[0].knee_rps(), None);
        assert!((sweep.knee_rps - 10.2).abs() < 1e-9);
        // A repeat serving nothing within the SLO does not hold either.
        let (sweep, _) = confirmed(vec![step_at(9, 11.0, false)], |_, seed| {
            (if seed == 43 { 0.0 } else { 11.0 }, false)
        });
        assert_eq!(sweep.knee_rps, 0.0);
    }

    #[test]
    fn when_a_cap_does_not_hold_the_best_step_at_a_lower_cap_is_confirmed() {
        // Cap 14's 12.5 is the best step, but its repeats crash: next is
        // the best step below cap 14, cap 9's 11.0 (not cap 20's crash-free 10.0, above
        // the cap that failed).
        let steps = vec![
            step_at(6, 8.0, false),
            step_at(9, 11.0, false),
            step_at(14, 12.5, false),
            step_at(20, 10.0, false),
        ];
        let (sweep, calls) = confirmed(steps, |cap, seed| {
            if cap >= 11 {
                (12.0, true)
            } else {
                (if seed == 43 { 10.0 } else { 10.5 }, false)
            }
        });
        // The gap 9–14 halved at cap 11, which crashes, then at 10, which holds but
        // serves less than cap 9.
        assert_eq!(
            calls,
            vec![
                (14, 7.0, 43),
                (14, 7.0, 44),
                (11, 7.0, 42),
                (10, 7.0, 42),
                (9, 4.5, 43),
                (9, 4.5, 44)
            ]
        );
        assert_eq!(sweep.confirmations.len(), 2);
        assert_eq!(sweep.confirmations[0].knee_rps(), None);
        assert!((sweep.knee_rps - 10.25).abs() < 1e-9);
        assert_eq!(sweep.confirmations[1].runs[0].cap, 9);
        // Every cap failing: no knee (the sweep then says so).
        let (sweep, calls) = confirmed(vec![step_at(6, 8.0, false)], |_, _| (8.0, true));
        assert_eq!(calls.len(), 2);
        assert_eq!(sweep.knee_rps, 0.0);
        assert!(sweep.knee_e2e_p99_ms().is_none());
        // No crash-free step with goodput: nothing to confirm.
        let (sweep, calls) = confirmed(vec![step_at(6, 8.0, true)], |_, _| (8.0, false));
        assert!(calls.is_empty() && sweep.confirmations.is_empty());
    }

    #[test]
    fn the_caps_between_one_that_did_not_hold_and_the_next_tried_are_searched() {
        // Cap 20's 12.0 is the best step, but a repeat crashes an engine; the sweep tried
        // nothing between 14 and 20. Halved: cap 17 crashes, cap 15 holds and beats cap
        // 14's reading, so cap 15 is confirmed (not cap 14, a quarter lower).
        let steps = vec![
            step_at(9, 8.0, false),
            step_at(14, 10.0, false),
            step_at(20, 12.0, false),
            step_at(30, 0.0, true),
        ];
        let (sweep, calls) = confirmed(steps, |cap, _| match cap {
            17.. => (11.5, true),
            15 | 16 => (10.8, false),
            _ => (9.5, false),
        });
        assert_eq!(
            calls,
            vec![
                (20, 10.0, 43),
                (20, 10.0, 44),
                (17, 10.0, 42),
                (15, 10.0, 42),
                (15, 10.0, 43),
                (15, 10.0, 44)
            ]
        );
        let caps: Vec<u32> = sweep.steps.iter().map(|s| s.cap).collect();
        assert_eq!(caps, vec![9, 14, 20, 30, 17, 15]);
        assert_eq!(sweep.confirmations.len(), 2);
        assert!((sweep.knee_rps - 10.8).abs() < 1e-9);
        // When cap 15 does not hold either, the gap below it (14–15) is closed: cap 14 is
        // confirmed.
        let (sweep, calls) = confirmed(
            vec![
                step_at(9, 8.0, false),
                step_at(14, 10.0, false),
                step_at(20, 12.0, false),
            ],
            |cap, seed| match (cap, seed) {
                (17.., _) => (11.5, true),
                (15, 42) => (10.8, false),
                (15, _) => (10.8, true),
                _ => (9.5, false),
            },
        );
        let tried: Vec<u32> = calls.iter().map(|c| c.0).collect();
        assert_eq!(tried, vec![20, 20, 17, 15, 15, 15, 14, 14]);
        assert!((sweep.knee_rps - 9.5).abs() < 1e-9);
        assert_eq!(sweep.confirmations.last().map(|c| c.runs[0].cap), Some(14));
        // Every cap in the gap crashing: three halving steps at most, then the best below.
        let (sweep, calls) = confirmed(
            vec![step_at(4, 3.0, false), step_at(40, 12.0, false)],
            |cap, _| if cap > 4 { (11.0, true) } else { (3.0, false) },
        );
        let tried: Vec<u32> = calls.iter().map(|c| c.0).collect();
        assert_eq!(tried, vec![40, 40, 22, 13, 8, 4, 4]);
        assert!((sweep.knee_rps - 3.0).abs() < 1e-9);
    }
}
