//! `levee drill`: the whole story in one command.
//!
//! 1. **Capacity, without levee.** A saturating sweep straight at fresh simulated engines
//!    (through the plain round-robin proxy, no limit anywhere): open-loop steps of rising
//!    rate with the scenario's own request mix (classes, sessions), no retries. Each step
//!    runs on freshly started engines; its goodput is the requests meeting the scenario's
//!    SLO per second after a warm-up. A step in which an engine crashes ends the sweep and
//!    does not count; so does the first step that adds less than 2% over the best. The
//!    knee — the best goodput of a crash-free step — is the reference, and the scenario's
//!    `1x` is set to it. Against running servers (`--backend`, e.g. real llama-servers) the
//!    steps are longer, each waits until the servers are idle, and the sweep ends after two
//!    flat steps in a row (a real server's speed follows the machine's load).
//! 2. **Three contenders, same flood, same seed, fresh engines each**: a plain round-robin
//!    pass-through (unprotected), a capped pass-through (each engine capped at its sequence
//!    capacity, one FIFO queue: nginx `max_conns` + `queue`), and levee with one fixed
//!    operator configuration (`drill-gateway.toml`, or `--gateway-config FILE`).
//! 3. **Calm runs** when a tenant floods: the same traffic with the flooder at its normal
//!    rate, through the capped pass-through and through levee, the reference of isolation.
//! 4. **Verdicts** ([`verdicts`]) side by side, a report page, JSON reports, and the logs of
//!    the in-process gateway and engines in `drill.log`.

mod verdicts;

use crate::passthrough::{Cap, Passthrough};
use anyhow::Context;
use levee_engine::{EngineConfig, EngineHandle, OverloadMode};
use levee_sim::report::{Marker, Page, Report};
use levee_sim::scenario::{Behaviour, Phase, Rate, Scenario, Tenant};
use levee_sim::{RunOptions, Target};
use rand::SeedableRng;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;
use verdicts::Check;

/// Command-line arguments of `levee drill`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrillArgs {
    /// Shipped scenario name (`levee sim list`) or a scenario TOML file.
    #[arg(long, default_value = "flash-crowd")]
    pub scenario: String,
    /// Directory for `report.html`, `drill.json`, `drill.log` and each run's JSON report.
    #[arg(long, default_value = "levee-drill")]
    pub out: PathBuf,
    /// How many simulated engines form the fleet.
    #[arg(long, default_value_t = 2)]
    pub engines: usize,
    /// Overrides the scenario's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// levee's configuration for the drill (its backends are pointed at the drill's
    /// engines); default: the shipped `drill-gateway.toml`.
    #[arg(long, value_name = "FILE")]
    pub gateway_config: Option<PathBuf>,
    /// A time-scaled drill: the scenario's timeline at a fifth (rates unchanged), a shorter
    /// capacity sweep; under a minute for the shipped flash-crowd.
    #[arg(long)]
    pub quick: bool,
    /// Hide the live progress lines.
    #[arg(long)]
    pub quiet: bool,
    /// Exit with status 1 when a target is missed.
    #[arg(long)]
    pub strict: bool,
    /// Flood these running servers instead of simulated engines (repeat once per server),
    /// e.g. the llama-servers `bench/real-backend.sh` starts. They are not restarted between
    /// runs: each run waits until they are healthy and idle, and a server that is not
    /// healthy after a run counts as crashed. Needs `--backend-profile`.
    #[arg(long = "backend", value_name = "URL", requires = "backend_profile")]
    pub backends: Vec<String>,
    /// An engine profile describing each `--backend` server (as `levee sim calibrate`
    /// writes): it places the capacity sweep's first steps and caps the capped baseline at
    /// the server's sequences (`max_running_seqs`).
    #[arg(long, value_name = "FILE", requires = "backends")]
    pub backend_profile: Option<PathBuf>,
    /// Goodput target of the flood, as a share of the knee (0.95 for simulated engines; the
    /// design's target for a real engine is 0.90).
    #[arg(long, default_value_t = verdicts::GOODPUT_TARGET)]
    pub goodput_target: f64,
}

/// The gateway configuration shipped for the drill's fleet; its comments give the formula
/// of every number.
pub const SHIPPED_GATEWAY_CONFIG: &str = include_str!("../drill-gateway.toml");

/// The simulated GPU every drill engine runs: the `small` profile in `crash` mode with a
/// faster decode, so that a drill of a few dozen seconds holds many request lifetimes. It
/// admits up to 64 sequences (its `max_num_seqs`) optimistically, and 64 sequences of
/// ~500 tokens overflow its 24,576-token cache: what crashes it is tokens, not requests.
pub fn drill_engine_config() -> EngineConfig {
    let mut c = EngineConfig::small();
    c.profile = "drill".into();
    c.gpu.overload = OverloadMode::Crash;
    c.gpu.kv_capacity_tokens = 24_576;
    c.gpu.max_running_seqs = 64;
    c.gpu.prefill_us_per_token = 50.0;
    c.gpu.decode_base_ms = 10.0;
    c.gpu.decode_per_seq_ms = 0.25;
    c.gpu.restart_secs = 15.0;
    c
}

/// How long things last: the full drill or `--quick`.
#[derive(Debug, Clone, Copy)]
struct Timing {
    /// Factor on the scenario's timeline and the engines' restart time.
    time_scale: f64,
    /// Sweep: rates tried, as multiples of the first estimate.
    ladder: &'static [f64],
    /// Sweep: length of one step, and the first seconds of it left out.
    step_s: f64,
    step_warm_s: f64,
    /// Sweep: it ends after this many steps in a row add less than 2% over the best.
    flat_steps_to_stop: u32,
    /// After a run's last scheduled send, how long requests still in flight may finish.
    drain_s: f64,
    /// First seconds of a flood stretch left out of the goodput window.
    flood_warm_s: f64,
}

const FULL: Timing = Timing {
    time_scale: 1.0,
    ladder: &[0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 1.75],
    step_s: 10.0,
    step_warm_s: 4.0,
    flat_steps_to_stop: 1,
    drain_s: 6.0,
    flood_warm_s: 2.0,
};

/// Real servers (`--backend`) on CPUs serve a few requests per second, each lasting
/// seconds, at a speed that follows the machine's load: longer sweep steps, so that a
/// step's goodput counts enough requests, and one flat step does not end the sweep.
const EXTERNAL: Timing = Timing {
    time_scale: 1.0,
    ladder: &[0.4, 0.55, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 1.75],
    step_s: 30.0,
    step_warm_s: 8.0,
    flat_steps_to_stop: 2,
    drain_s: 10.0,
    flood_warm_s: 2.0,
};

const QUICK: Timing = Timing {
    time_scale: 0.2,
    ladder: &[0.5, 0.75, 1.0, 1.25],
    step_s: 5.0,
    step_warm_s: 2.0,
    flat_steps_to_stop: 1,
    drain_s: 2.0,
    flood_warm_s: 1.0,
};

/// The capped baseline's queue: as long as the fleet's slots, and a wait as long as
/// levee's longest tier wait in the shipped configuration.
fn capped_limits(engine: &EngineConfig, engines: usize) -> Cap {
    Cap {
        per_backend: engine.gpu.max_running_seqs,
        queue_len: engine.gpu.max_running_seqs as usize * engines,
        queue_timeout: Duration::from_millis(1500),
    }
}

/// The servers a run floods.
enum Fleet {
    /// Simulated engines, started fresh for each run.
    Simulated(Vec<EngineHandle>),
    /// Servers someone else runs (`--backend`): the same ones in every run.
    External(Vec<String>),
}

/// What a fleet went through in one run.
#[derive(Debug, Clone, Copy, Default)]
struct FleetStats {
    crashes: u64,
    injected_crashes: u64,
    /// Requests answered 503 because their engine was down after a crash.
    sent_to_down: u64,
    /// Of those, the ones that arrived after the engine had already answered a refusal in
    /// the same down period (the router had been told).
    sent_after_failure: u64,
}

impl Fleet {
    /// Fresh simulated engines, or the external servers once they are healthy and idle.
    async fn start(setup: &Setup<'_>) -> anyhow::Result<Self> {
        if !setup.backends.is_empty() {
            wait_ready(&setup.backends).await?;
            return Ok(Self::External(setup.backends.clone()));
        }
        let mut engines = Vec::with_capacity(setup.engines);
        for i in 0..setup.engines {
            let bind = "127.0.0.1:0".parse().context("loopback address")?;
            let e = levee_engine::spawn(setup.engine.clone(), bind)
                .await
                .with_context(|| format!("starting drill engine {i}"))?;
            engines.push(e);
        }
        Ok(Self::Simulated(engines))
    }

    fn urls(&self) -> Vec<String> {
        match self {
            Self::Simulated(engines) => engines.iter().map(|e| e.base_url()).collect(),
            Self::External(urls) => urls.clone(),
        }
    }

    /// Crashes so far, per simulated engine (external servers are checked at the end).
    fn crash_counts(&self) -> Vec<u64> {
        match self {
            Self::Simulated(engines) => engines.iter().map(|e| e.stats().crashes).collect(),
            Self::External(_) => Vec::new(),
        }
    }

    fn target(&self, base_url: String) -> Target {
        let mut t = Target::new(base_url);
        for (i, url) in self.urls().iter().enumerate() {
            t.metrics
                .push((format!("engine{i}"), format!("{url}/metrics")));
            if let Self::Simulated(_) = self {
                t.engine_admin.push(url.clone());
            }
        }
        t
    }

    /// Runs the scenario against `target` and notes, every 100 ms, which engine crashed
    /// when (for the charts; the counts come from the engines themselves).
    async fn run(
        &self,
        scenario: &Scenario,
        target: &Target,
        opts: &RunOptions,
    ) -> anyhow::Result<(Report, Vec<Marker>)> {
        let start = std::time::Instant::now();
        let run = levee_sim::run(scenario, target, opts);
        tokio::pin!(run);
        let mut seen = self.crash_counts();
        let mut markers = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let report = loop {
            tokio::select! {
                r = &mut run => break r?,
                _ = tick.tick() => {
                    for (i, c) in self.crash_counts().into_iter().enumerate() {
                        if c > seen[i] {
                            seen[i] = c;
                            markers.push(Marker {
                                at_s: start.elapsed().as_secs_f64(),
                                label: format!("engine {i} crashed"),
                                fault: true,
                            });
                        }
                    }
                }
            }
        };
        Ok((report, markers))
    }

    /// Ends a run: stops simulated engines, checks external servers' health, and says
    /// what the fleet went through. An external server that does not answer `/health`
    /// with 200 after the run counts as one crash.
    async fn stop(self) -> FleetStats {
        let mut s = FleetStats::default();
        match self {
            Self::Simulated(engines) => {
                for e in engines {
                    s.crashes += e.stats().crashes;
                    s.injected_crashes += e.injected_crashes();
                    s.sent_to_down += e.refused_while_down();
                    s.sent_after_failure += e.refused_after_first_failure();
                    if let Err(err) = e.shutdown().await {
                        tracing::warn!("stopping a drill engine: {err:#}");
                    }
                }
            }
            Self::External(urls) => {
                let client = reqwest::Client::new();
                for url in &urls {
                    if !healthy(&client, url).await {
                        tracing::warn!("{url} is not healthy after the run: counted as a crash");
                        s.crashes += 1;
                    }
                }
            }
        }
        s
    }
}

/// Whether a server answers `GET /health` with 200 within 5 s.
async fn healthy(client: &reqwest::Client, url: &str) -> bool {
    let answer = client
        .get(format!("{url}/health"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    answer.is_ok_and(|r| r.status().is_success())
}

/// Sequences an external server is running or holding back, from its Prometheus metrics
/// (llama.cpp's or vLLM's names); `None` when it exports neither.
async fn busy_sequences(client: &reqwest::Client, url: &str) -> Option<f64> {
    let text = client
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let kinds = [
        levee_gateway::config::BackendKind::Llamacpp,
        levee_gateway::config::BackendKind::Vllm,
    ];
    kinds.into_iter().find_map(|kind| {
        levee_gateway::upstream::parse_load(kind, &text).map(|l| l.running + l.waiting)
    })
}

/// Longest wait for external servers to become healthy and idle before a run.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// Waits until every external server is healthy and runs nothing (the previous run's
/// abandoned requests finished), so that every run starts from the same state.
async fn wait_ready(urls: &[String]) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
    for url in urls {
        loop {
            let idle = healthy(&client, url).await
                && busy_sequences(&client, url).await.is_none_or(|n| n == 0.0);
            if idle {
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "backend {url} is not healthy and idle after {} s (GET {url}/health and its \
                 /metrics); is it running?",
                READY_TIMEOUT.as_secs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(())
}

/// The three contenders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    Unprotected,
    Capped,
    Levee,
}

impl Contender {
    const ALL: [Contender; 3] = [Contender::Unprotected, Contender::Capped, Contender::Levee];

    fn label(self) -> &'static str {
        match self {
            Contender::Unprotected => "unprotected",
            Contender::Capped => "capped",
            Contender::Levee => "levee",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Contender::Unprotected => "plain round-robin pass-through",
            Contender::Capped => "capped pass-through (max_conns per engine + FIFO queue)",
            Contender::Levee => "levee",
        }
    }
}

/// One run's outcome.
struct Outcome {
    report: Report,
    fleet: FleetStats,
    crash_markers: Vec<Marker>,
}

/// Everything a run needs besides the scenario.
struct Setup<'a> {
    engines: usize,
    /// External servers (`--backend`); empty for simulated engines.
    backends: Vec<String>,
    engine: EngineConfig,
    gateway_text: &'a str,
    opts: RunOptions,
}

async fn run_contender(
    who: Contender,
    scenario: &Scenario,
    setup: &Setup<'_>,
) -> anyhow::Result<Outcome> {
    let fleet = Fleet::start(setup).await?;
    let result = match who {
        Contender::Unprotected | Contender::Capped => {
            let proxy = if who == Contender::Capped {
                Passthrough::start_capped(fleet.urls(), capped_limits(&setup.engine, setup.engines))
                    .await?
            } else {
                Passthrough::start(fleet.urls()).await?
            };
            let target = fleet.target(proxy.base_url());
            let r = fleet.run(scenario, &target, &setup.opts).await;
            proxy.shutdown().await;
            r
        }
        Contender::Levee => {
            let cfg = gateway_config(setup.gateway_text, scenario, &fleet.urls())?;
            let gw = levee_gateway::start(cfg)
                .await
                .context("starting the drill's gateway")?;
            let mut target = fleet.target(gw.public_url());
            target
                .metrics
                .push(("gateway".into(), format!("{}/metrics", gw.admin_url())));
            let r = fleet.run(scenario, &target, &setup.opts).await;
            gw.shutdown().await;
            r
        }
    };
    let stats = fleet.stop().await;
    let (report, crash_markers) = result?;
    Ok(Outcome {
        report,
        fleet: stats,
        crash_markers,
    })
}

/// levee's configuration for a run: the given TOML with its listeners on ephemeral loopback
/// ports and the scenario model's backends pointed at the drill's engines in order (a
/// missing backend entry copies the first). A scenario tenant whose key the configuration
/// does not list is added with the quotas of the first listed tenant of its tier label.
pub fn gateway_config(
    text: &str,
    scenario: &Scenario,
    engine_urls: &[String],
) -> anyhow::Result<levee_gateway::Config> {
    let invalid = |errors: Vec<String>| {
        anyhow::anyhow!(
            "the drill's gateway configuration is invalid:\n  {}",
            errors.join("\n  ")
        )
    };
    let mut cfg = levee_gateway::Config::from_toml_str(text).map_err(invalid)?;
    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().context("loopback address")?;
    cfg.listen.public = loopback;
    cfg.listen.admin = loopback;
    let model_name = &scenario.request.model;
    let known: Vec<String> = cfg.models.iter().map(|m| m.name.clone()).collect();
    let model = cfg
        .models
        .iter_mut()
        .find(|m| &m.name == model_name)
        .with_context(|| {
            format!(
                "the gateway configuration has no [[models]] entry named {model_name:?} (the \
                 scenario's model); it has {known:?}"
            )
        })?;
    let template = model.backends.first().cloned().with_context(|| {
        format!("model {model_name:?} in the gateway configuration has no backends to copy")
    })?;
    model.backends = engine_urls
        .iter()
        .enumerate()
        .map(|(i, url)| {
            let mut b = model
                .backends
                .get(i)
                .cloned()
                .unwrap_or_else(|| template.clone());
            b.url = url.clone();
            b
        })
        .collect();
    for tenant in &scenario.tenants {
        let hash = levee_gateway::hash_key(&tenant.api_key);
        if cfg.tenants.iter().any(|t| t.key_sha256.contains(&hash)) {
            continue;
        }
        let like = cfg
            .tenants
            .iter()
            .find(|t| t.tier == tenant.tier)
            .cloned()
            .with_context(|| {
                format!(
                    "scenario tenant {:?}: its key is not in the gateway configuration, and no \
                     tenant of its tier {:?} is there to copy quotas from; add it to the \
                     configuration",
                    tenant.name, tenant.tier
                )
            })?;
        cfg.tenants.push(levee_gateway::config::TenantConfig {
            name: format!("drill-{}", tenant.name),
            key_sha256: vec![hash],
            key_env: Vec::new(),
            ..like
        });
    }
    let errors = cfg.validate();
    if !errors.is_empty() {
        return Err(invalid(errors));
    }
    Ok(cfg)
}

/// One step of the capacity sweep.
#[derive(Debug, Clone, Copy, PartialEq)]
struct SweepStep {
    offered_rps: f64,
    goodput_rps: f64,
    crashed: bool,
}

/// The capacity sweep's result.
#[derive(Debug, Clone, PartialEq)]
struct Sweep {
    steps: Vec<SweepStep>,
    knee_rps: f64,
}

/// The scenario's request mix offered steadily at `rps` for `secs`: its classes and sessions
/// from one tenant, no retries, no faults.
fn sweep_scenario(base: &Scenario, rps: f64, secs: f64) -> Scenario {
    let mut s = base.clone();
    s.name = format!("{} (capacity sweep at {rps:.1} req/s)", base.name);
    s.phases = vec![Phase::Steady {
        duration_s: secs,
        rps: Rate::Rps(rps),
    }];
    s.rate_scale = 1.0;
    s.tenants = vec![Tenant::default()];
    s.faults.clear();
    s.client.behaviour = Behaviour::None;
    s.client.max_attempts = 1;
    s
}

/// A first guess of the fleet's capacity for the scenario's mix, only to place the sweep's
/// steps: per engine, the sequences whose prompt and output fit the KV cache (at most its
/// sequence limit), each producing its output at one decode step per token.
fn estimated_capacity(scenario: &Scenario, engines: usize, engine: &EngineConfig) -> f64 {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(scenario.seed);
    let total_weight: f64 = scenario.classes.iter().map(|c| c.weight.max(0.0)).sum();
    let (mut prompt, mut output) = (0.0, 0.0);
    for c in &scenario.classes {
        let w = c.weight.max(0.0) / total_weight.max(1e-9);
        let n = 500;
        let (mut p, mut o) = (0.0, 0.0);
        for _ in 0..n {
            p += c.prompt_tokens.sample(&mut rng);
            let natural = f64::from(
                engine.output_tokens_min
                    + (engine.output_tokens_max - engine.output_tokens_min) / 2,
            );
            o += c.max_tokens.sample(&mut rng).min(natural);
        }
        prompt += w * p / f64::from(n);
        output += w * o / f64::from(n);
    }
    let g = &engine.gpu;
    let per_seq = (prompt + output).max(1.0);
    // Arrivals are random: keep the cache 60% full on average so that bursts fit.
    let seqs = (0.6 * f64::from(g.kv_capacity_tokens) / per_seq).min(f64::from(g.max_running_seqs));
    let step_s = (g.decode_base_ms + g.decode_per_seq_ms * seqs) / 1000.0;
    engines as f64 * seqs / (output.max(1.0) * step_s)
}

/// One step of the sweep: `rps` of the scenario's mix on fresh engines behind the plain
/// proxy; goodput over `window` (seconds of the step).
async fn sweep_step(
    scenario: &Scenario,
    setup: &Setup<'_>,
    timing: &Timing,
    rps: f64,
    opts: &RunOptions,
    window: &[u32],
) -> anyhow::Result<SweepStep> {
    let s = sweep_scenario(scenario, rps, timing.step_s);
    let fleet = Fleet::start(setup).await?;
    let proxy = Passthrough::start(fleet.urls()).await?;
    let target = fleet.target(proxy.base_url());
    let run = fleet.run(&s, &target, opts).await;
    proxy.shutdown().await;
    let crashed = fleet.stop().await.crashes > 0;
    let (report, _) = run?;
    Ok(SweepStep {
        offered_rps: rps,
        goodput_rps: verdicts::window_goodput(&report, window).unwrap_or(0.0),
        crashed,
    })
}

async fn measure_knee(
    scenario: &Scenario,
    setup: &Setup<'_>,
    timing: &Timing,
) -> anyhow::Result<Sweep> {
    let estimate = estimated_capacity(scenario, setup.engines, &setup.engine);
    let mut steps: Vec<SweepStep> = Vec::new();
    let opts = RunOptions {
        drain: Some(Duration::from_millis(500)),
        ..setup.opts.clone()
    };
    let window: Vec<u32> = (timing.step_warm_s as u32..timing.step_s as u32).collect();
    let mut rates: Vec<f64> = timing.ladder.iter().map(|m| estimate * m).collect();
    let mut i = 0;
    let mut flat_steps = 0;
    while i < rates.len() {
        let rps = rates[i];
        let step = sweep_step(scenario, setup, timing, rps, &opts, &window).await?;
        eprintln!(
            "      {rps:>6.1} req/s offered → {:>6.1} req/s within the SLO{}",
            step.goodput_rps,
            if step.crashed {
                "  (an engine crashed)"
            } else {
                ""
            }
        );
        let best_before = steps
            .iter()
            .filter(|s| !s.crashed)
            .map(|s| s.goodput_rps)
            .fold(0.0, f64::max);
        let saturated = step.crashed || step.goodput_rps < 0.8 * rps;
        steps.push(step);
        if i == 0 && saturated && steps.len() == 1 {
            // The first guess was already past the knee: start lower.
            rates[0] = rps * 0.5;
            continue;
        }
        if i > 0 && step.goodput_rps < best_before * 1.02 {
            flat_steps += 1;
        } else {
            flat_steps = 0;
        }
        if step.crashed || flat_steps >= timing.flat_steps_to_stop {
            break;
        }
        i += 1;
    }
    let knee = steps
        .iter()
        .filter(|s| !s.crashed)
        .map(|s| s.goodput_rps)
        .fold(0.0, f64::max);
    anyhow::ensure!(
        knee > 0.5,
        "the capacity sweep found no crash-free step with goodput (steps: {steps:?}); the \
         engines cannot serve this scenario's mix within its SLO"
    );
    Ok(Sweep {
        steps,
        knee_rps: knee,
    })
}

/// A tenant with its own schedule that at some point sends at least the fleet's whole
/// capacity by itself: the noisy neighbour the others must be isolated from. (The drill
/// knows the scenario; levee's configuration does not.)
fn is_flooder(scenario: &Scenario, tenant: &Tenant) -> bool {
    let Some(phases) = &tenant.phases else {
        return false;
    };
    let total: f64 = phases.iter().map(Phase::duration_s).sum();
    let steps = (total * 10.0).ceil() as u32;
    (0..steps).any(|i| {
        let t = f64::from(i) / 10.0;
        let mut start = 0.0;
        for p in phases {
            if t < start + p.duration_s() {
                return p.rate_at(t - start, &|r| scenario.resolve(r)) >= scenario.capacity_rps;
            }
            start += p.duration_s();
        }
        false
    })
}

/// The same scenario with every flooder calm: sending all along at the rate it starts at.
fn calm_flooders(base: &Scenario) -> Scenario {
    let mut s = base.clone();
    s.name = format!("{} (flooder calm)", base.name);
    let total = base.duration_s();
    for t in s.tenants.iter_mut() {
        if is_flooder(base, t) {
            let first = t
                .phases
                .as_ref()
                .and_then(|p| p.first())
                .map_or(0.0, |p| p.rate_at(0.0, &|r| base.resolve(r)));
            t.phases = Some(vec![Phase::Steady {
                duration_s: total,
                rps: Rate::Rps(first),
            }]);
        }
    }
    s
}

/// Premium requests that a client-side rate check with each premium tenant's configured
/// quota finds over it, given `sends` (per tenant name: when each request was first sent, in
/// ms, in order — from the client's own record of a run, every session turn included): the
/// independent bound on how many premium refusals may be excused as over quota.
fn premium_over_quota(
    sends: &std::collections::BTreeMap<String, Vec<u64>>,
    scenario: &Scenario,
    cfg: &levee_gateway::Config,
) -> u64 {
    use levee_policy::{Gcra, Quota, Timestamp};
    let mut over = 0;
    for tenant in scenario.tenants.iter().filter(|t| t.tier == "premium") {
        let hash = levee_gateway::hash_key(&tenant.api_key);
        let Some(conf) = cfg.tenants.iter().find(|t| t.key_sha256.contains(&hash)) else {
            continue;
        };
        if conf.requests_per_minute == 0 {
            continue;
        }
        let burst = if conf.requests_burst == 0 {
            conf.requests_per_minute
        } else {
            conf.requests_burst
        };
        let mut gcra = Gcra::new(
            Quota::per_minute(u64::from(conf.requests_per_minute)).with_burst(u64::from(burst)),
        );
        for &ms in sends.get(&tenant.name).into_iter().flatten() {
            if gcra.check(Timestamp::from_nanos(ms * 1_000_000)).is_err() {
                over += 1;
            }
        }
    }
    over
}

/// A row of the verdict table: a target and each contender's check.
struct VerdictRow {
    target: String,
    checks: Vec<Check>,
}

/// Runs `levee drill`.
pub async fn run_cli(args: DrillArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.engines >= 1, "--engines must be at least 1");
    anyhow::ensure!(
        args.goodput_target > 0.0 && args.goodput_target <= 1.0,
        "--goodput-target must be in (0, 1], e.g. 0.9 (got {})",
        args.goodput_target
    );
    let external = !args.backends.is_empty();
    let engines = if external {
        args.backends.len()
    } else {
        args.engines
    };
    let started = std::time::Instant::now();
    let timing = match (args.quick, args.backends.is_empty()) {
        (true, _) => QUICK,
        (false, true) => FULL,
        (false, false) => EXTERNAL,
    };
    let mut scenario = levee_sim::load_scenario(&args.scenario)?;
    if let Some(seed) = args.seed {
        scenario.seed = seed;
    }
    scenario.scale_time(timing.time_scale);
    let gateway_text = match &args.gateway_config {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the gateway configuration {}", path.display()))?,
        None => SHIPPED_GATEWAY_CONFIG.to_string(),
    };
    anyhow::ensure!(
        !external || scenario.faults.is_empty(),
        "scenario {:?} injects faults, which need simulated engines; --backend servers \
         cannot take them",
        scenario.name
    );
    let placeholder: Vec<String> = (0..engines)
        .map(|i| format!("http://127.0.0.1:{}", 1 + i))
        .collect();
    // Fail before any run if the configuration does not fit the scenario.
    let cfg_check = gateway_config(&gateway_text, &scenario, &placeholder)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create the output directory {}", args.out.display()))?;
    let gw_copy = args.out.join("gateway.toml");
    std::fs::write(&gw_copy, &gateway_text)
        .with_context(|| format!("cannot write {}", gw_copy.display()))?;
    let mut engine = match &args.backend_profile {
        Some(path) => {
            let mut profile = EngineConfig::from_toml_file(path)?;
            // A real server's answers end at EOS or max_tokens; the profile's natural length
            // is the calibration's. The capacity guess assumes max_tokens.
            profile.output_tokens_min = u32::MAX;
            profile.output_tokens_max = u32::MAX;
            profile
        }
        None => drill_engine_config(),
    };
    engine.gpu.restart_secs *= timing.time_scale;
    let setup = Setup {
        engines,
        backends: args.backends.clone(),
        engine: engine.clone(),
        gateway_text: &gateway_text,
        opts: RunOptions {
            progress: !args.quiet,
            drain: Some(Duration::from_secs_f64(timing.drain_s)),
            ..RunOptions::default()
        },
    };
    let flooders: Vec<String> = scenario
        .tenants
        .iter()
        .filter(|t| is_flooder(&scenario, t))
        .map(|t| t.name.clone())
        .collect();
    let total_steps = 4 + if flooders.is_empty() { 0 } else { 2 };
    let fleet_words = if external {
        format!(
            "{engines} running servers ({}; profile {:?}: {} sequences each)",
            args.backends.join(", "),
            engine.profile,
            engine.gpu.max_running_seqs
        )
    } else {
        format!(
            "{engines} simulated engines ({} KV tokens, {} sequences each, crash on KV \
             overflow)",
            engine.gpu.kv_capacity_tokens, engine.gpu.max_running_seqs
        )
    };
    eprintln!(
        "levee drill{}: scenario {:?}, {fleet_words}; logs in {}",
        if args.quick { " --quick" } else { "" },
        scenario.name,
        args.out.join("drill.log").display(),
    );

    eprintln!(
        "[1/{total_steps}] capacity without levee: open-loop steps straight at {}",
        if external {
            "the servers"
        } else {
            "fresh engines"
        },
    );
    let sweep = measure_knee(&scenario, &setup, &timing).await?;
    scenario.capacity_rps = sweep.knee_rps;
    eprintln!(
        "      knee: {:.1} req/s within the SLO (1x from here on)",
        sweep.knee_rps
    );

    let mut step = 1;
    let mut outcomes = Vec::new();
    for who in Contender::ALL {
        step += 1;
        eprintln!("[{step}/{total_steps}] {}: {}", scenario.name, who.what());
        outcomes.push((who, run_contender(who, &scenario, &setup).await?));
    }
    let mut calm: Vec<(Contender, Outcome)> = Vec::new();
    if !flooders.is_empty() {
        let calm_scenario = calm_flooders(&scenario);
        for who in [Contender::Capped, Contender::Levee] {
            step += 1;
            eprintln!(
                "[{step}/{total_steps}] calm reference ({} at its normal rate): {}",
                flooders.join(", "),
                who.what()
            );
            calm.push((who, run_contender(who, &calm_scenario, &setup).await?));
        }
    }

    // References and verdicts.
    let down: Vec<(f64, f64)> = scenario
        .faults
        .iter()
        .filter(|f| f.action == levee_sim::scenario::FaultAction::Crash)
        .map(|f| (f.at_s, f.at_s + engine.gpu.restart_secs + 1.0))
        .collect();
    let window = verdicts::flood_window(
        scenario.duration_s(),
        &|t| scenario.offered_rps_at(t),
        sweep.knee_rps,
        timing.flood_warm_s,
        &down,
    );
    let over_quota =
        |o: &Outcome| premium_over_quota(&o.report.first_sends_ms, &scenario, &cfg_check);
    let quiet_groups = quiet_groups(&scenario);
    let mut rows: Vec<VerdictRow> = Vec::new();
    let per = |f: &dyn Fn(&Outcome) -> Option<Check>| -> Option<Vec<Check>> {
        let v: Vec<Option<Check>> = outcomes.iter().map(|(_, o)| f(o)).collect();
        v.iter().any(Option::is_some).then(|| {
            v.into_iter()
                .map(|c| {
                    c.unwrap_or(Check {
                        measured: "-".into(),
                        met: None,
                    })
                })
                .collect()
        })
    };
    if let Some(checks) =
        per(&|o| verdicts::goodput(&o.report, &window, sweep.knee_rps, args.goodput_target))
    {
        rows.push(VerdictRow {
            target: format!(
                "goodput in the flood ≥ {:.0}% of the knee ({:.1} req/s, {} s window)",
                args.goodput_target * 100.0,
                sweep.knee_rps,
                window.len()
            ),
            checks,
        });
    }
    if let Some(checks) =
        per(&|o| Some(verdicts::crashes(o.fleet.crashes, o.fleet.injected_crashes)))
    {
        rows.push(VerdictRow {
            target: "0 overload crashes (injected ones stated apart)".into(),
            checks,
        });
    }
    if let Some(checks) = per(&|o| verdicts::premium(&o.report, over_quota(o))) {
        rows.push(VerdictRow {
            target: format!(
                "premium ≥ {:.1}% of its in-quota requests",
                verdicts::PREMIUM_TARGET * 100.0
            ),
            checks,
        });
    }
    for who_group in &quiet_groups {
        let checks = outcomes
            .iter()
            .map(|(who, o)| {
                let reference = calm.iter().find(|(c, _)| c == who).map(|(_, c)| c);
                match (
                    reference.and_then(|c| who_group.of(&c.report)),
                    who_group.of(&o.report),
                ) {
                    (Some(before), Some(after)) => verdicts::isolation(before, after),
                    _ => Check {
                        measured: "- (no calm run)".into(),
                        met: None,
                    },
                }
            })
            .collect();
        rows.push(VerdictRow {
            target: format!(
                "{} vs calm: success −≤1 pt, p99 TTFT +≤10% while {} floods",
                who_group.name,
                flooders.join(", ")
            ),
            checks,
        });
    }
    if let Some(checks) = per(&|o| Some(verdicts::amplification(&o.report))) {
        rows.push(VerdictRow {
            target: "retry amplification (attempts / scheduled)".into(),
            checks,
        });
    }

    let table = side_by_side(&scenario, &sweep, &outcomes);
    let verdict_text = render_verdicts(&rows);
    let sweep_at = if external {
        "the running servers (a plain round-robin proxy)"
    } else {
        "fresh engines"
    };
    let sweep_text = render_sweep(&sweep, &timing, sweep_at);
    println!("{sweep_text}\n{table}\n{verdict_text}");

    // Files.
    let mut pages: Vec<(String, &Report)> = Vec::new();
    let mut run_markers: Vec<Vec<Marker>> = Vec::new();
    for (who, o) in &outcomes {
        pages.push((who.label().to_string(), &o.report));
        run_markers.push(o.crash_markers.clone());
    }
    for (who, o) in &calm {
        pages.push((format!("{} (calm)", who.label()), &o.report));
        run_markers.push(o.crash_markers.clone());
    }
    for (label, report) in &pages {
        let file = args
            .out
            .join(format!("{}.json", label.replace([' ', '(', ')'], "")));
        levee_sim::report::write_json(report, &file)?;
    }
    let mut markers: Vec<Marker> = scenario
        .phase_changes()
        .into_iter()
        .map(|at_s| Marker {
            at_s,
            label: format!(
                "{:.1}x",
                scenario.offered_rps_at(at_s + 1e-6) / sweep.knee_rps
            ),
            fault: false,
        })
        .collect();
    for f in &scenario.faults {
        markers.push(Marker {
            at_s: f.at_s,
            label: format!(
                "{} engine {} (injected)",
                levee_sim::faults::action_name(f.action),
                f.engine
            ),
            fault: true,
        });
    }
    let esc = levee_sim::report::escape_html;
    let lead_html = format!(
        "<h2>Verdicts</h2><pre>{}</pre><h2>Side by side</h2><pre>{}</pre>\
         <h2>Capacity without levee</h2><pre>{}</pre>\
         <p>Dashed lines: grey where the offered load changes (as a multiple of the knee), red \
         where an engine crashed. In-process logs: drill.log.</p>",
        esc(&verdict_text),
        esc(&table),
        esc(&sweep_text)
    );
    let page = Page {
        title: Some(format!("levee drill: {}", scenario.name)),
        lead_html,
        markers,
        run_markers,
    };
    let page_runs: Vec<(&str, &Report)> = pages.iter().map(|(l, r)| (l.as_str(), *r)).collect();
    let html = args.out.join("report.html");
    levee_sim::report::write_page(&page_runs, &page, &html)?;
    let summary = serde_json::json!({
        "scenario": scenario.name,
        "quick": args.quick,
        "engines": engines,
        "backends": args.backends,
        "goodput_target": args.goodput_target,
        "capacity": {
            "method": "open-loop steps straight at the fleet (fresh simulated engines per \
                       step, or the --backend servers once idle) through a plain round-robin \
                       proxy, \
                       the scenario's mix without retries; goodput = requests meeting the SLO \
                       per second after the warm-up; crashed steps do not count",
            "knee_rps": sweep.knee_rps,
            "steps": sweep.steps.iter().map(|s| serde_json::json!({
                "offered_rps": s.offered_rps,
                "goodput_rps": s.goodput_rps,
                "crashed": s.crashed,
            })).collect::<Vec<_>>(),
        },
        "flood_window_s": window,
        "runs": outcomes.iter().chain(calm.iter()).map(|(who, o)| serde_json::json!({
            "contender": who.label(),
            "scenario": o.report.scenario,
            "engine_crashes": o.fleet.crashes,
            "injected_crashes": o.fleet.injected_crashes,
            "sent_to_down_engine": o.fleet.sent_to_down,
            "sent_to_down_engine_after_first_failure": o.fleet.sent_after_failure,
            "premium_over_quota_estimate": over_quota(o),
            "goodput_rps": o.report.rates.goodput_rps,
            "flood_goodput_rps": verdicts::window_goodput(&o.report, &window),
            "success_rate": o.report.rates.success_rate,
            "p99_ttft_ms": o.report.latency.ttft.p99,
            "attempts": o.report.totals.attempts,
            "scheduled": o.report.totals.scheduled,
            "errors": o.report.errors,
        })).collect::<Vec<_>>(),
        "verdicts": rows.iter().map(|r| serde_json::json!({
            "target": r.target,
            "results": Contender::ALL.iter().zip(&r.checks).map(|(who, c)| serde_json::json!({
                "contender": who.label(), "measured": c.measured, "met": c.met,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    let summary_path = args.out.join("drill.json");
    std::fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", summary_path.display()))?;
    println!(
        "report: {}  (runs: {}/*.json, summary: {}, gateway config: {}, logs: {})  — {:.0} s",
        html.display(),
        args.out.display(),
        summary_path.display(),
        gw_copy.display(),
        args.out.join("drill.log").display(),
        started.elapsed().as_secs_f64()
    );
    let levee_missed = rows
        .iter()
        .any(|r| r.checks.get(2).and_then(|c| c.met) == Some(false));
    if args.strict && levee_missed {
        anyhow::bail!("levee missed a drill target (see the verdicts above)");
    }
    Ok(())
}

/// The quiet tenants whose isolation is judged: the scenario's tenant groups without a
/// flooder in them, or else each tenant that does not flood.
struct QuietGroup {
    name: String,
    group: Option<String>,
    tenant: Option<String>,
}

impl QuietGroup {
    fn of<'r>(&self, r: &'r Report) -> Option<&'r levee_sim::report::Group> {
        match (&self.group, &self.tenant) {
            (Some(g), _) => r.per_group.get(g),
            (None, Some(t)) => r.per_tenant.get(t),
            (None, None) => None,
        }
    }
}

fn quiet_groups(scenario: &Scenario) -> Vec<QuietGroup> {
    let flooders: Vec<&Tenant> = scenario
        .tenants
        .iter()
        .filter(|t| is_flooder(scenario, t))
        .collect();
    if flooders.is_empty() {
        return Vec::new();
    }
    let flooder_groups: Vec<&str> = flooders.iter().filter_map(|t| t.group.as_deref()).collect();
    let mut groups: Vec<&str> = scenario
        .tenants
        .iter()
        .filter_map(|t| t.group.as_deref())
        .filter(|g| !flooder_groups.contains(g))
        .collect();
    groups.sort();
    groups.dedup();
    if !groups.is_empty() {
        return groups
            .into_iter()
            .map(|g| QuietGroup {
                name: format!("group {g}"),
                group: Some(g.to_string()),
                tenant: None,
            })
            .collect();
    }
    scenario
        .tenants
        .iter()
        .filter(|t| !is_flooder(scenario, t))
        .map(|t| QuietGroup {
            name: format!("tenant {}", t.name),
            group: None,
            tenant: Some(t.name.clone()),
        })
        .collect()
}

/// The sweep as text; `at` says what the steps went straight at.
fn render_sweep(sweep: &Sweep, timing: &Timing, at: &str) -> String {
    let mut s = format!(
        "capacity without levee: open-loop steps of {:.0} s straight at {at}, the scenario's \
         mix, no retries; goodput = requests within the SLO per second after {:.0} s\n",
        timing.step_s, timing.step_warm_s
    );
    for st in &sweep.steps {
        let _ = writeln!(
            s,
            "  offered {:>6.1} req/s → goodput {:>6.1} req/s{}",
            st.offered_rps,
            st.goodput_rps,
            if st.crashed {
                "  (a server crashed: not counted)"
            } else {
                ""
            }
        );
    }
    let _ = write!(s, "  knee: {:.1} req/s", sweep.knee_rps);
    s
}

fn render_verdicts(rows: &[VerdictRow]) -> String {
    let mut s = String::from("targets (MET / MISS per contender):\n");
    for r in rows {
        let _ = writeln!(s, "  {}", r.target);
        for (who, c) in Contender::ALL.iter().zip(&r.checks) {
            let mark = match c.met {
                Some(true) => "MET ",
                Some(false) => "MISS",
                None => "    ",
            };
            let _ = writeln!(s, "    [{mark}] {:<12} {}", who.label(), c.measured);
        }
    }
    s
}

fn side_by_side(scenario: &Scenario, sweep: &Sweep, runs: &[(Contender, Outcome)]) -> String {
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut row = |name: &str, f: &dyn Fn(&Outcome) -> String| {
        rows.push((name.to_string(), runs.iter().map(|(_, o)| f(o)).collect()));
    };
    row("offered req/s", &|o| {
        format!("{:.1}", o.report.rates.offered_rps)
    });
    row("goodput req/s", &|o| {
        format!("{:.1}", o.report.rates.goodput_rps)
    });
    row("goodput tokens/s", &|o| {
        format!("{:.0}", o.report.rates.goodput_tps)
    });
    row("success", &|o| pct(o.report.rates.success_rate));
    let mut tiers: Vec<String> = Vec::new();
    for (_, o) in runs {
        for t in o.report.per_tier.keys() {
            if !tiers.contains(t) {
                tiers.push(t.clone());
            }
        }
    }
    for tier in &tiers {
        row(&format!("success, {tier}"), &|o| {
            o.report
                .per_tier
                .get(tier)
                .map(|g| pct(g.success_rate))
                .unwrap_or_else(|| "-".into())
        });
    }
    row("p50 TTFT ms", &|o| {
        format!("{:.0}", o.report.latency.ttft.p50)
    });
    row("p99 TTFT ms", &|o| {
        format!("{:.0}", o.report.latency.ttft.p99)
    });
    row("overload crashes", &|o| {
        o.fleet
            .crashes
            .saturating_sub(o.fleet.injected_crashes)
            .to_string()
    });
    if !scenario.faults.is_empty() {
        row("injected crashes", &|o| {
            o.fleet.injected_crashes.to_string()
        });
    }
    row("sent to a down engine", &|o| {
        o.fleet.sent_to_down.to_string()
    });
    row("  after its first failure", &|o| {
        o.fleet.sent_after_failure.to_string()
    });
    if runs
        .iter()
        .any(|(_, o)| engine_queue_peak(&o.report).is_some())
    {
        row("engines' own queue, peak", &|o| {
            engine_queue_peak(&o.report).map_or_else(|| "-".into(), |q| format!("{q:.0}"))
        });
    }
    row("429s", &|o| o.report.rate_limited().to_string());
    row("  of which queue timeouts", &|o| {
        let t = o
            .report
            .errors
            .get("429:queue_timeout")
            .copied()
            .unwrap_or(0);
        let all = o.report.rate_limited();
        if all == 0 {
            "0".into()
        } else {
            format!("{t} ({:.1}%)", 100.0 * t as f64 / all as f64)
        }
    });
    row("5xx", &|o| o.report.server_errors().to_string());
    row("timeouts", &|o| {
        o.report
            .errors
            .get("timeout")
            .copied()
            .unwrap_or(0)
            .to_string()
    });
    row("broken streams", &|o| {
        o.report
            .errors
            .get("broken_stream")
            .copied()
            .unwrap_or(0)
            .to_string()
    });
    row("attempts / scheduled", &|o| {
        verdicts::amplification(&o.report).measured
    });

    let mut s = String::new();
    let _ = writeln!(
        s,
        "levee drill — {}: {} (1x = the knee, {:.1} req/s)\n",
        scenario.name, scenario.description, sweep.knee_rps
    );
    let _ = write!(s, "{:<24}", "");
    for (who, _) in runs {
        let _ = write!(s, "{:>14}", who.label());
    }
    let _ = writeln!(s);
    for (name, cells) in rows {
        let _ = write!(s, "{name:<24}");
        for c in cells {
            let _ = write!(s, "{c:>14}");
        }
        let _ = writeln!(s);
    }
    s
}

/// The most requests the engines held waiting inside themselves at one scrape, summed over
/// engines (vLLM's `num_requests_waiting`, llama.cpp's `requests_deferred`); `None` when
/// no engine's queue was scraped.
fn engine_queue_peak(report: &Report) -> Option<f64> {
    let series: Vec<&levee_sim::report::MetricSeries> = report
        .metrics
        .iter()
        .filter(|m| m.source.starts_with("engine"))
        .filter(|m| m.name == "llamacpp:requests_deferred" || m.name == "vllm:num_requests_waiting")
        .collect();
    let scrapes = series.iter().map(|m| m.points.len()).max()?;
    (0..scrapes)
        .map(|i| {
            series
                .iter()
                .filter_map(|m| m.points.get(i))
                .map(|p| p[1])
                .sum::<f64>()
        })
        .reduce(f64::max)
}

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urls(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("http://127.0.0.1:{}", 1 + i))
            .collect()
    }

    #[test]
    fn the_flooders_are_found_from_the_scenario_not_from_the_gateway_config() {
        let mut s = levee_sim::scenarios::builtin("noisy-neighbor").unwrap();
        s.capacity_rps = 20.0;
        let flooders: Vec<&str> = s
            .tenants
            .iter()
            .filter(|t| is_flooder(&s, t))
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(flooders, ["noisy"]);
        // flash-crowd's premium tenants have their own schedules but never flood.
        let fc = levee_sim::scenarios::builtin("flash-crowd").unwrap();
        assert!(fc.tenants.iter().all(|t| !is_flooder(&fc, t)));
        // The calm variant keeps the flooder at its starting rate all along.
        let calm = calm_flooders(&s);
        let n = calm.tenants.iter().find(|t| t.name == "noisy").unwrap();
        assert!(!is_flooder(&calm, n));
        let groups = quiet_groups(&s);
        assert_eq!(groups.len(), 1);
        assert_eq!(groups[0].group.as_deref(), Some("quiet"));
    }

    #[test]
    fn the_noisy_neighbour_floods_inside_the_quiet_tenants_tier() {
        let s = levee_sim::scenarios::builtin("noisy-neighbor").unwrap();
        let noisy = s.tenants.iter().find(|t| t.name == "noisy").unwrap();
        assert!(s
            .tenants
            .iter()
            .filter(|t| t.name.starts_with("quiet"))
            .all(|t| t.tier == noisy.tier));
    }

    #[test]
    fn the_shipped_config_fits_every_shipped_scenario_without_knowing_the_flooder() {
        for name in levee_sim::scenarios::names() {
            let s = levee_sim::scenarios::builtin(name).unwrap();
            let cfg = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(2))
                .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(cfg.models[0].backends.len(), 2);
            assert_eq!(cfg.models[0].backends[1].url, "http://127.0.0.1:2");
            // Every backend is capped at the engine's sequence capacity.
            for b in &cfg.models[0].backends {
                assert_eq!(b.max_in_flight, drill_engine_config().gpu.max_running_seqs);
            }
            // Quotas depend on the tier alone: the flooder gets the same as its peers.
            for t in &cfg.tenants {
                let peer = cfg.tenants.iter().find(|p| p.tier == t.tier).unwrap();
                assert_eq!(
                    (t.requests_per_minute, t.requests_burst, t.max_concurrency),
                    (
                        peer.requests_per_minute,
                        peer.requests_burst,
                        peer.max_concurrency
                    ),
                    "{name}/{}",
                    t.name
                );
            }
        }
    }

    #[test]
    fn unknown_keys_get_their_tiers_quotas_and_more_engines_copy_the_first_backend() {
        let mut s = levee_sim::scenarios::builtin("steady").unwrap();
        s.tenants[0].api_key = "sk-somebody-new".into();
        s.tenants[0].tier = "free".into();
        let cfg = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(3)).unwrap();
        let added = cfg
            .tenants
            .iter()
            .find(|t| t.key_sha256 == [levee_gateway::hash_key("sk-somebody-new")])
            .unwrap();
        let free = cfg.tenants.iter().find(|t| t.tier == "free").unwrap();
        assert_eq!(added.requests_per_minute, free.requests_per_minute);
        assert_eq!(cfg.models[0].backends.len(), 3);
        // A tier the configuration lacks is an error that says what to do.
        s.tenants[0].tier = "platinum".into();
        let e = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(2)).unwrap_err();
        assert!(
            format!("{e:#}").contains("add it to the configuration"),
            "{e:#}"
        );
    }

    #[test]
    fn the_sweep_sends_the_mix_without_retries_tenants_or_faults() {
        let base = levee_sim::scenarios::builtin("crash-mid-flood").unwrap();
        let s = sweep_scenario(&base, 12.0, 10.0);
        assert!(s.faults.is_empty());
        assert_eq!(s.client.behaviour, Behaviour::None);
        assert_eq!(s.classes, base.classes);
        assert_eq!(s.sessions, base.sessions);
        assert!((s.offered_rps_at(5.0) - 12.0).abs() < 1e-9);
        assert!(estimated_capacity(&base, 2, &drill_engine_config()) > 1.0);
    }

    #[test]
    fn premium_over_quota_counts_only_what_exceeds_the_configured_rate() {
        let mut s = levee_sim::scenarios::builtin("flash-crowd").unwrap();
        s.capacity_rps = 30.0;
        let cfg = gateway_config(SHIPPED_GATEWAY_CONFIG, &s, &urls(2)).unwrap();
        // What a client sends on the schedule: first turns at their arrival times.
        let sends = |s: &Scenario| {
            let schedule = levee_sim::arrivals::build(s).unwrap();
            let mut out = std::collections::BTreeMap::<String, Vec<u64>>::new();
            for a in &schedule.arrivals {
                let name = &s.tenants[usize::from(a.tenant)].name;
                out.entry(name.clone())
                    .or_default()
                    .push(a.at_ns / 1_000_000);
            }
            out
        };
        // Each premium tenant peaks at 0.3x = 9 req/s, under its 15 req/s quota.
        assert_eq!(premium_over_quota(&sends(&s), &s, &cfg), 0);
        // At 10x the capacity, most of their traffic is over quota.
        s.capacity_rps = 300.0;
        let over = premium_over_quota(&sends(&s), &s, &cfg);
        assert!(over > 1000, "{over}");
    }

    #[test]
    fn every_shipped_flood_has_sessions_a_heavy_tail_and_both_stream_kinds() {
        for name in [
            "flash-crowd",
            "noisy-neighbor",
            "heavy-tail",
            "crash-mid-flood",
        ] {
            let s = levee_sim::scenarios::builtin(name).unwrap();
            assert!(s.sessions.share > 0.0, "{name}");
            assert!(s.classes.iter().any(|c| c.stream), "{name}");
            assert!(s.classes.iter().any(|c| !c.stream), "{name}");
            assert!(
                s.classes
                    .iter()
                    .any(|c| matches!(c.prompt_tokens, levee_sim::dist::Dist::Lognormal { .. })),
                "{name}"
            );
        }
        // heavy-tail: about 10% of requests at >= 3,000 prompt tokens, all within context.
        let s = levee_sim::scenarios::builtin("heavy-tail").unwrap();
        let sched = levee_sim::arrivals::build(&s).unwrap();
        let long = sched
            .arrivals
            .iter()
            .filter(|a| a.prompt_tokens >= 3000)
            .count() as f64;
        let share = long / sched.arrivals.len() as f64;
        assert!((0.08..0.13).contains(&share), "{share}");
        let ctx = drill_engine_config().gpu.max_model_len;
        assert!(sched
            .arrivals
            .iter()
            .all(|a| a.prompt_tokens + a.max_tokens <= ctx));
        // crash-mid-flood crashes an engine while the flood is on.
        let c = levee_sim::scenarios::builtin("crash-mid-flood").unwrap();
        let f = &c.faults[0];
        assert!(c.offered_rps_at(f.at_s) >= 5.0 * c.capacity_rps);
    }
}
