//! `levee drill`: the whole story in one command — runs the drill: capacity sweep,
//! contenders, verdicts, report.
//!
//! 1. **Capacity: the best a protected fleet achieves** ([`capacity`]). A short low-rate
//!    sample of the scenario's mix gives the prompt sizes the servers report; the operator
//!    formula caps each engine at ⌊KV tokens ÷ p95(prompt + max_tokens)⌋ (at most its
//!    `max_num_seqs`); open-loop steps of rising rate go through that competent capped proxy
//!    on fresh engines, past flat steps, until goodput falls or plateaus. The knee — the
//!    mean goodput of two repeats of the best crash-free step on other arrival seeds (its
//!    own reading, the luckiest of many, left out) — is the reference and the scenario's
//!    `1x`.
//! 2. **The contenders, same flood, same seed, fresh engines each**: a plain round-robin
//!    pass-through (unprotected); the competent capped pass-through (the formula's cap, a
//!    FIFO queue with a wait budget, passive health, one retry); HAProxy configured the same
//!    way when `haproxy` is on the PATH; and levee with one fixed operator configuration
//!    (`drill-gateway.toml`, or `--gateway-config FILE`), as one gateway or `--replicas N`
//!    sharing Redis.
//! 3. **Calm runs** when a tenant floods: the same traffic with the flooder at its normal
//!    rate, through every contender, the references of isolation.
//! 4. **Verdicts** ([`verdicts`]) side by side, a report page, JSON reports, and the logs of
//!    the in-process gateways and engines in `drill.log`. If a contender's flood goodput
//!    beats the knee by more than 5%, the drill says the reference is suspect.
//!
//! `--overload preempt` runs every contender on engines that preempt and recompute instead
//! of crashing; `--calibrate-config` measures the capacity and prints a gateway
//! configuration for the fleet by the shipped configuration's formula ([`operator`]).

mod capacity;
mod contender;
mod fleet;
mod haproxy;
mod operator;
mod passthrough;
mod render;
mod setup;
mod tenants;
#[cfg(test)]
mod tests;
mod verdicts;

use anyhow::Context;
use capacity::{Sweep, Timing};
use contender::{Contender, Outcome, Setup};
use levee_engine::{EngineConfig, OverloadMode};
use levee_sim::report::{Marker, Report};
use levee_sim::{RunOptions, Scenario};
use passthrough::Cap;
use render::VerdictRow;
use std::path::PathBuf;
use verdicts::Check;

pub use operator::gateway_config;

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
    /// A second levee configuration, run as one more contender on the same knee, the same
    /// flood and the same calm run: what one setting changes, side by side in one run
    /// (e.g. the shipped configuration without its tiers' latency objectives).
    #[arg(long, value_name = "FILE")]
    pub compare_config: Option<PathBuf>,
    /// A time-scaled drill: the scenario's timeline at a fifth (rates unchanged), a shorter
    /// capacity sweep; under three minutes for the shipped flash-crowd on 2 cores.
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
    /// What the simulated engines do when their KV cache overflows: `crash` (a CUDA
    /// out-of-memory: everything in flight fails, the engine restarts) or `preempt` (vLLM's
    /// preempt-and-recompute: slower, never crashes). Every contender runs on the same kind.
    #[arg(long, value_enum, default_value = "crash")]
    pub overload: OverloadMode,
    /// Run levee as this many in-process gateway replicas sharing Redis (`[state] backend =
    /// "redis"`, a key prefix of its own per run, deleted after) behind a plain round-robin
    /// front.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// The Redis the replicas share (with `--replicas` above 1).
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
    /// Measure the fleet's capacity (the drill's own method) and print a gateway
    /// configuration for it by the formula in the shipped configuration's comments, then
    /// stop. With `--backend`, for those servers.
    #[arg(long)]
    pub calibrate_config: bool,
    /// The `kind` of the `--backend` servers in the configuration `--calibrate-config`
    /// prints.
    #[arg(long, default_value = "llamacpp", value_parser = ["llamacpp", "vllm"])]
    pub backend_kind: String,
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

/// Everything the drill decides before its first run.
struct Plan {
    args: DrillArgs,
    timing: Timing,
    scenario: Scenario,
    gateway_text: String,
    /// The `--compare-config` configuration's text.
    compare_text: Option<String>,
    /// levee's configuration with placeholder backends: checked before any run, and the
    /// quotas the premium verdict's client-side check applies.
    gateway: levee_gateway::Config,
    engine: EngineConfig,
    engines: usize,
    flooders: Vec<String>,
    contenders: Vec<Contender>,
    /// The capped baselines' limits, once the capacity is measured.
    cap: Option<Cap>,
}

impl Plan {
    fn new(args: DrillArgs) -> anyhow::Result<Self> {
        anyhow::ensure!(args.engines >= 1, "--engines must be at least 1");
        anyhow::ensure!(args.replicas >= 1, "--replicas must be at least 1");
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
        let timing = match (args.quick, external) {
            (true, _) => capacity::QUICK,
            (false, false) => capacity::FULL,
            (false, true) => capacity::EXTERNAL,
        };
        let mut scenario = levee_sim::load_scenario(&args.scenario)?;
        if let Some(seed) = args.seed {
            scenario.seed = seed;
        }
        scenario.scale_time(timing.time_scale);
        let gateway_text = match &args.gateway_config {
            Some(path) => std::fs::read_to_string(path).with_context(|| {
                format!("cannot read the gateway configuration {}", path.display())
            })?,
            None => SHIPPED_GATEWAY_CONFIG.to_string(),
        };
        let compare_text = match &args.compare_config {
            Some(path) => Some(std::fs::read_to_string(path).with_context(|| {
                format!("cannot read the compared configuration {}", path.display())
            })?),
            None => None,
        };
        anyhow::ensure!(
            !external || scenario.faults.is_empty(),
            "scenario {:?} injects faults, which need simulated engines; --backend servers \
             cannot take them",
            scenario.name
        );
        // Fail before any run if the configuration does not fit the scenario (unless the
        // drill only measures the capacity to write a configuration).
        let gateway = if args.calibrate_config {
            levee_gateway::Config::default()
        } else {
            gateway_config(&gateway_text, &scenario, &placeholders(engines))?
        };
        if let Some(text) = &compare_text {
            gateway_config(text, &scenario, &placeholders(engines))
                .context("the --compare-config configuration")?;
        }
        let mut engine = engine_of(&args)?;
        engine.gpu.restart_secs *= timing.time_scale;
        let flooders = scenario
            .tenants
            .iter()
            .filter(|t| tenants::is_flooder(&scenario, t))
            .map(|t| t.name.clone())
            .collect();
        Ok(Self {
            args,
            timing,
            scenario,
            gateway_text,
            contenders: contenders(compare_text.is_some()),
            compare_text,
            gateway,
            engine,
            engines,
            flooders,
            cap: None,
        })
    }

    fn external(&self) -> bool {
        !self.args.backends.is_empty()
    }

    fn setup(&self) -> Setup<'_> {
        Setup {
            engines: self.engines,
            backends: self.args.backends.clone(),
            engine: self.engine.clone(),
            gateway_text: &self.gateway_text,
            compare_text: self.compare_text.as_deref(),
            // A contender's flood waits for its last requests as long as the client
            // would (the runner's default drain: the client's timeout and a second), so
            // every request ends by itself — answered, refused or timed out — and none is
            // counted a failure because the drill stopped watching: a drain shorter than a
            // request's ordinary life (2 s in a quick drill, against streams of 2–4 s)
            // cancelled healthy premium requests. The wait ends as soon as nothing is open.
            opts: RunOptions {
                progress: !self.args.quiet,
                ..RunOptions::default()
            },
            cap: self.cap,
            out: self.args.out.clone(),
            replicas: self.args.replicas,
            redis_url: self.args.redis_url.clone(),
        }
    }

    fn announce(&self) {
        let fleet_words = if self.external() {
            format!(
                "{} running servers ({}; profile {:?}: {} sequences each)",
                self.engines,
                self.args.backends.join(", "),
                self.engine.profile,
                self.engine.gpu.max_running_seqs
            )
        } else {
            format!(
                "{} simulated engines ({} KV tokens, {} sequences each, {} on KV overflow)",
                self.engines,
                self.engine.gpu.kv_capacity_tokens,
                self.engine.gpu.max_running_seqs,
                match self.engine.gpu.overload {
                    OverloadMode::Crash => "crash",
                    OverloadMode::Preempt => "preempt and recompute",
                }
            )
        };
        eprintln!(
            "levee drill{}: scenario {:?}, {fleet_words}; logs in {}",
            if self.args.quick { " --quick" } else { "" },
            self.scenario.name,
            self.args.out.join("drill.log").display(),
        );
        if !self.contenders.contains(&Contender::Haproxy) {
            eprintln!("      haproxy is not on the PATH: the HAProxy contender is skipped");
        }
    }

    fn method(&self) -> String {
        capacity::method(&self.timing, capacity::wait_budget(&self.scenario))
    }
}

/// `http://127.0.0.1:1`, `:2`, …: backends for checking a configuration before any run.
fn placeholders(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("http://127.0.0.1:{}", 1 + i))
        .collect()
}

/// Who runs the flood: HAProxy only where it is installed, the compared levee only with
/// `--compare-config`.
fn contenders(compare: bool) -> Vec<Contender> {
    let mut c = vec![Contender::Unprotected, Contender::Capped];
    if haproxy::available() {
        c.push(Contender::Haproxy);
    }
    c.push(Contender::Levee);
    if compare {
        c.push(Contender::LeveeCompare);
    }
    c
}

/// The engine every run uses: the drill's simulated GPU (with `--overload`), or the
/// `--backend-profile`.
fn engine_of(args: &DrillArgs) -> anyhow::Result<EngineConfig> {
    Ok(match &args.backend_profile {
        Some(path) => {
            let mut profile = EngineConfig::from_toml_file(path)?;
            // A real server's answers end at EOS or max_tokens; the profile's natural length
            // is the calibration's. The capacity guess assumes max_tokens.
            profile.output_tokens_min = u32::MAX;
            profile.output_tokens_max = u32::MAX;
            profile
        }
        None => {
            let mut e = drill_engine_config();
            e.gpu.overload = args.overload;
            e
        }
    })
}

/// What the runs produced.
struct Runs {
    sweep: Sweep,
    outcomes: Vec<(Contender, Outcome)>,
    calm: Vec<(Contender, Outcome)>,
}

/// Step 1: the capacity; sets the scenario's `1x` and the baselines' cap.
async fn measure(plan: &mut Plan, total_steps: usize) -> anyhow::Result<Sweep> {
    eprintln!(
        "[1/{total_steps}] capacity: the best goodput through the competent capped proxy, \
         steps of rising rate, the best run twice more, on {}",
        if plan.external() {
            "the servers"
        } else {
            "fresh engines"
        },
    );
    let sweep = capacity::measure_knee(&plan.scenario, &plan.setup(), &plan.timing).await?;
    plan.scenario.capacity_rps = sweep.knee_rps;
    plan.cap = Some(capacity::competent_cap(
        &sweep.cap,
        plan.engines,
        capacity::wait_budget(&plan.scenario),
    ));
    eprintln!(
        "      knee: {:.1} req/s within the SLO, {} (1x from here on)",
        sweep.knee_rps,
        sweep.knee_words()
    );
    Ok(sweep)
}

/// The capacity, then every contender, then the calm references.
async fn run_all(plan: &mut Plan) -> anyhow::Result<Runs> {
    let n = plan.contenders.len();
    let total_steps = 1 + n + if plan.flooders.is_empty() { 0 } else { n };
    let sweep = measure(plan, total_steps).await?;
    let setup = plan.setup();
    let mut step = 1;
    let mut outcomes = Vec::new();
    for &who in &plan.contenders {
        step += 1;
        eprintln!(
            "[{step}/{total_steps}] {}: {}",
            plan.scenario.name,
            who.what()
        );
        outcomes.push((
            who,
            contender::run_contender(who, &plan.scenario, &setup).await?,
        ));
    }
    let mut calm = Vec::new();
    if !plan.flooders.is_empty() {
        let calm_scenario = tenants::calm_flooders(&plan.scenario);
        for &who in &plan.contenders {
            step += 1;
            eprintln!(
                "[{step}/{total_steps}] calm reference ({} at its normal rate): {}",
                plan.flooders.join(", "),
                who.what()
            );
            calm.push((
                who,
                contender::run_contender(who, &calm_scenario, &setup).await?,
            ));
        }
    }
    Ok(Runs {
        sweep,
        outcomes,
        calm,
    })
}

/// Runs `levee drill`.
pub async fn run_cli(args: DrillArgs) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let mut plan = Plan::new(args)?;
    let out = plan.args.out.clone();
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create the output directory {}", out.display()))?;
    if plan.args.calibrate_config {
        return calibrate(&mut plan).await;
    }
    let gw_copy = out.join("gateway.toml");
    std::fs::write(&gw_copy, &plan.gateway_text)
        .with_context(|| format!("cannot write {}", gw_copy.display()))?;
    if let Some(text) = &plan.compare_text {
        let path = out.join("gateway-compare.toml");
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    plan.announce();
    let runs = run_all(&mut plan).await?;
    let judged = judge(&plan, &runs);
    let labels: Vec<&str> = plan.contenders.iter().map(|c| c.label()).collect();
    let table = render::side_by_side(&plan.scenario, &runs.sweep, &runs.outcomes);
    let mut verdict_text = render::render_verdicts(&judged.rows, &labels);
    if let Some(warning) = &judged.suspect {
        verdict_text.push_str(&format!("WARNING: {warning}\n"));
    }
    let sweep_text = capacity::render_sweep(&runs.sweep, &plan.method());
    println!(
        "{sweep_text}\n\n{}\n{verdict_text}",
        render::text_table(&table)
    );
    let html = write_page(&plan, &runs, &judged, &table)?;
    let summary_path = out.join("drill.json");
    let summary = summary_json(&plan, &runs, &judged);
    std::fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", summary_path.display()))?;
    println!(
        "report: {}  (runs: {}/*.json, summary: {}, gateway config: {}, logs: {})  — {:.0} s",
        html.display(),
        out.display(),
        summary_path.display(),
        gw_copy.display(),
        out.join("drill.log").display(),
        started.elapsed().as_secs_f64()
    );
    let levee_at = plan.contenders.iter().position(|&c| c == Contender::Levee);
    let levee_missed = judged
        .rows
        .iter()
        .any(|r| levee_at.and_then(|i| r.checks.get(i)).and_then(|c| c.met) == Some(false));
    if plan.args.strict && levee_missed {
        anyhow::bail!("levee missed a drill target (see the verdicts above)");
    }
    Ok(())
}

/// `--calibrate-config`: the capacity, then a configuration for the fleet by the formula.
async fn calibrate(plan: &mut Plan) -> anyhow::Result<()> {
    plan.announce();
    let sweep = measure(plan, 1).await?;
    eprintln!("{}", capacity::render_sweep(&sweep, &plan.method()));
    let urls = if plan.external() {
        plan.args.backends.clone()
    } else {
        placeholders(plan.engines)
    };
    let fleet = operator::Fleet {
        urls,
        kind: if plan.external() {
            plan.args.backend_kind.clone()
        } else {
            "vllm".into()
        },
        max_in_flight: plan.engine.gpu.max_running_seqs,
    };
    let e2e_ms = sweep.knee_e2e_p99_ms().unwrap_or(0.0);
    let text = operator::calibrated_config(
        &fleet,
        &operator::Basis {
            capacity_rps: sweep.knee_rps,
            ttft_slo_ms: plan.scenario.slo.ttft_ms.unwrap_or(2000.0),
            e2e_p99_ms: e2e_ms,
            model: plan.scenario.request.model.clone(),
            measured: format!(
                "levee drill --calibrate-config, scenario {:?}, {}",
                plan.scenario.name,
                today()
            ),
        },
        &plan.scenario,
    );
    let path = plan.args.out.join("calibrated-gateway.toml");
    std::fs::write(&path, &text).with_context(|| format!("cannot write {}", path.display()))?;
    print!("{text}");
    eprintln!("written to {}", path.display());
    Ok(())
}

/// Today's date as an HTTP date without the time, e.g. `Tue, 01 Dec 2026`.
fn today() -> String {
    let full = httpdate::fmt_http_date(std::time::SystemTime::now());
    full.get(..16).unwrap_or(&full).to_string()
}

/// The verdicts and the window they were judged over.
struct Judged {
    window: Vec<u32>,
    rows: Vec<VerdictRow>,
    /// Why the knee may not be the best a protected fleet achieves, if a contender beat it.
    suspect: Option<String>,
}

/// One check per contender, or `None` when no contender has a figure.
fn per_contender(
    outcomes: &[(Contender, Outcome)],
    f: &dyn Fn(&Outcome) -> Option<Check>,
) -> Option<Vec<Check>> {
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
}

/// The seconds of the flood over which goodput is judged.
fn flood_window(plan: &Plan, knee: f64) -> Vec<u32> {
    let scenario = &plan.scenario;
    let down: Vec<(f64, f64)> = scenario
        .faults
        .iter()
        .filter(|f| f.action == levee_sim::scenario::FaultAction::Crash)
        .map(|f| (f.at_s, f.at_s + plan.engine.gpu.restart_secs + 1.0))
        .collect();
    verdicts::flood_window(
        scenario.duration_s(),
        &|t| scenario.offered_rps_at(t),
        knee,
        plan.timing.flood_warm_s,
        &down,
    )
}

fn judge(plan: &Plan, runs: &Runs) -> Judged {
    let knee = runs.sweep.knee_rps;
    let window = flood_window(plan, knee);
    let outcomes = &runs.outcomes;
    let mut rows: Vec<VerdictRow> = Vec::new();
    let mut push = |target: String, checks: Option<Vec<Check>>| {
        if let Some(checks) = checks {
            rows.push(VerdictRow { target, checks });
        }
    };
    let target = plan.args.goodput_target;
    push(
        format!(
            "goodput in the flood ≥ {:.0}% of the knee ({knee:.1} req/s, {} s window)",
            target * 100.0,
            window.len()
        ),
        per_contender(outcomes, &|o| {
            verdicts::goodput(&o.report, &window, knee, target)
        }),
    );
    let preempt = plan.engine.gpu.overload == OverloadMode::Preempt && !plan.external();
    if preempt {
        let slo = plan.scenario.slo.ttft_ms;
        push(
            format!(
                "p99 TTFT of served requests ≤ the SLO ({} ms)",
                slo.map_or("-".into(), |s| format!("{s:.0}"))
            ),
            per_contender(outcomes, &|o| verdicts::ttft_within_slo(&o.report, slo?)),
        );
    } else {
        push(
            "0 overload crashes (injected ones stated apart)".into(),
            per_contender(outcomes, &|o| {
                Some(verdicts::crashes(o.fleet.crashes, o.fleet.injected_crashes))
            }),
        );
    }
    // Requests too long for the engines, by the engines' own rule on the schedule's sizes:
    // known for the drill's simulated engines only (a real server's tokenizer is its own).
    let over_context = if plan.external() {
        0
    } else {
        // The schedule already ran, so it builds; were it not to, nothing is excused.
        operator::premium_over_context(&plan.scenario, plan.engine.gpu.max_model_len)
            .unwrap_or_else(|e| {
                tracing::warn!("premium requests too long for the engines not counted: {e:#}");
                0
            })
    };
    let excuses = |o: &Outcome| verdicts::PremiumExcuses {
        over_quota: operator::premium_over_quota(
            &o.report.first_sends_ms,
            &plan.scenario,
            &plan.gateway,
        ),
        over_context,
    };
    push(
        format!(
            "premium ≥ {:.1}% of its in-quota requests (requests too long for the engines apart)",
            verdicts::PREMIUM_TARGET * 100.0
        ),
        per_contender(outcomes, &|o| verdicts::premium(&o.report, excuses(o))),
    );
    rows.extend(isolation_rows(plan, runs));
    for (flooder, tier) in tenants::flooders_with_tier(&plan.scenario) {
        rows.push(VerdictRow {
            target: format!(
                "{flooder}'s goodput over the run ≥ an equal share of its tier's ({}): \
                 isolation not bought by starving it",
                tier.join(", ")
            ),
            checks: outcomes
                .iter()
                .map(|(_, o)| verdicts::flooder_share(&o.report, &flooder, &tier))
                .collect(),
        });
    }
    rows.push(VerdictRow {
        target: "retry amplification (attempts / scheduled)".into(),
        checks: outcomes
            .iter()
            .map(|(_, o)| verdicts::amplification(&o.report))
            .collect(),
    });
    let flood: Vec<(&str, Option<f64>)> = outcomes
        .iter()
        .map(|(who, o)| (who.label(), verdicts::window_goodput(&o.report, &window)))
        .collect();
    let suspect = verdicts::suspect_reference(knee, &flood);
    if suspect.is_some() {
        // Against a knee a contender beat, a goodput share proves nothing: no MET, no MISS.
        if let Some(row) = rows.first_mut().filter(|r| r.target.starts_with("goodput")) {
            row.target
                .push_str(" — no verdict: the reference is suspect");
            for c in &mut row.checks {
                c.met = None;
            }
        }
    }
    Judged {
        window,
        rows,
        suspect,
    }
}

/// One contender's isolation check against its own calm run and the baselines' (every
/// contender but levee, either configuration).
fn isolation_check(group: &tenants::QuietGroup, runs: &Runs, who: Contender, o: &Outcome) -> Check {
    let Some(flood) = group.of(&o.report) else {
        return Check {
            measured: "- (no such tenants)".into(),
            met: None,
        };
    };
    let calm_of = |c: Contender| {
        let run = runs.calm.iter().find(|(w, _)| *w == c)?;
        group.of(&run.1.report)
    };
    let Some(own) = calm_of(who) else {
        return Check {
            measured: "- (no calm run)".into(),
            met: None,
        };
    };
    let baselines: Vec<(&str, &levee_sim::report::Group)> = runs
        .calm
        .iter()
        .filter(|(c, _)| *c != who && !matches!(c, Contender::Levee | Contender::LeveeCompare))
        .filter_map(|(c, _)| Some((c.label(), calm_of(*c)?)))
        .collect();
    verdicts::isolation_against(own, &baselines, flood)
}

/// One isolation row per quiet group.
fn isolation_rows(plan: &Plan, runs: &Runs) -> Vec<VerdictRow> {
    tenants::quiet_groups(&plan.scenario)
        .iter()
        .map(|group| VerdictRow {
            target: format!(
                "{} vs calm (its own, and each baseline's that served them): success −≤1 pt, \
                 p99 TTFT +≤10% (failures last) while {} floods",
                group.name,
                plan.flooders.join(", ")
            ),
            checks: runs
                .outcomes
                .iter()
                .map(|(who, o)| isolation_check(group, runs, *who, o))
                .collect(),
        })
        .collect()
}

/// The page's markers: the offered-load phases and injected faults.
fn page_markers(scenario: &Scenario, knee: f64) -> Vec<Marker> {
    let mut markers: Vec<Marker> = scenario
        .phase_changes()
        .into_iter()
        .map(|at_s| Marker {
            at_s,
            label: format!("{:.1}x", scenario.offered_rps_at(at_s + 1e-6) / knee),
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
    markers
}

/// Writes every run's JSON report and `report.html`; returns the page's path.
fn write_page(
    plan: &Plan,
    runs: &Runs,
    judged: &Judged,
    table: &render::Table,
) -> anyhow::Result<PathBuf> {
    let mut pages: Vec<(String, &Report)> = Vec::new();
    let mut run_markers: Vec<Vec<Marker>> = Vec::new();
    for (who, o) in &runs.outcomes {
        pages.push((who.label().to_string(), &o.report));
        run_markers.push(o.crash_markers.clone());
    }
    for (who, o) in &runs.calm {
        pages.push((format!("{} (calm)", who.label()), &o.report));
        run_markers.push(o.crash_markers.clone());
    }
    for (label, report) in &pages {
        let file = plan
            .args
            .out
            .join(format!("{}.json", label.replace([' ', '(', ')'], "")));
        levee_sim::report::write_json(report, &file)?;
    }
    let labels: Vec<&str> = plan.contenders.iter().map(|c| c.label()).collect();
    let page = levee_sim::report::Page {
        title: Some(format!("levee drill: {}", plan.scenario.name)),
        lead_html: render::lead_html(
            &render::Lead {
                labels: &labels,
                rows: &judged.rows,
                suspect: judged.suspect.as_deref(),
                table,
                method: &plan.method(),
                steps: &capacity::render_steps(&runs.sweep),
            },
            &plan.scenario,
            runs.sweep.knee_rps,
        ),
        markers: page_markers(&plan.scenario, runs.sweep.knee_rps),
        run_markers,
    };
    let page_runs: Vec<(&str, &Report)> = pages.iter().map(|(l, r)| (l.as_str(), *r)).collect();
    let html = plan.args.out.join("report.html");
    levee_sim::report::write_page(&page_runs, &page, &html)?;
    Ok(html)
}

/// A capacity step in `drill.json`.
fn step_json(s: &capacity::SweepStep) -> serde_json::Value {
    serde_json::json!({
        "cap_per_engine": s.cap,
        "conversations_rps": s.rate,
        "seed": s.seed,
        "offered_rps": s.offered_rps,
        "goodput_rps": s.goodput_rps,
        "crashed": s.crashed,
    })
}

/// `drill.json`: the method, the sweep, every run's figures and the verdicts.
fn summary_json(plan: &Plan, runs: &Runs, judged: &Judged) -> serde_json::Value {
    let over_quota = |o: &Outcome| {
        operator::premium_over_quota(&o.report.first_sends_ms, &plan.scenario, &plan.gateway)
    };
    let op = &runs.sweep.cap;
    serde_json::json!({
        "scenario": plan.scenario.name,
        "quick": plan.args.quick,
        "engines": plan.engines,
        "overload": format!("{:?}", plan.engine.gpu.overload).to_lowercase(),
        "replicas": plan.args.replicas,
        "backends": plan.args.backends,
        "contenders": plan.contenders.iter().map(|c| c.label()).collect::<Vec<_>>(),
        "goodput_target": plan.args.goodput_target,
        "capacity": {
            "method": plan.method(),
            "operator_cap": {
                "samples": op.samples, "p95_prompt_plus_max_tokens": op.p95_tokens,
                "kv_tokens": op.kv_tokens, "max_num_seqs": op.max_num_seqs,
                "per_engine": op.per_engine,
            },
            "knee_rps": runs.sweep.knee_rps,
            "knee": runs.sweep.knee_words(),
            "steps": runs.sweep.steps.iter().map(step_json).collect::<Vec<_>>(),
            "confirmations": runs.sweep.confirmations.iter().map(|c| serde_json::json!({
                "runs": c.runs.iter().map(step_json).collect::<Vec<_>>(),
                "knee_rps": c.knee_rps(),
            })).collect::<Vec<_>>(),
        },
        "flood_window_s": judged.window,
        "reference_suspect": judged.suspect,
        "runs": runs.outcomes.iter().chain(runs.calm.iter()).map(|(who, o)| serde_json::json!({
            "contender": who.label(),
            "scenario": o.report.scenario,
            "engine_crashes": o.fleet.crashes,
            "injected_crashes": o.fleet.injected_crashes,
            "sent_to_down_engine": o.fleet.sent_to_down,
            "sent_to_down_engine_after_first_failure": o.fleet.sent_after_failure,
            "premium_over_quota_estimate": over_quota(o),
            "goodput_rps": o.report.rates.goodput_rps,
            "flood_goodput_rps": verdicts::window_goodput(&o.report, &judged.window),
            "success_rate": o.report.rates.success_rate,
            "p99_ttft_ms": o.report.latency.ttft.p99,
            "attempts": o.report.totals.attempts,
            "scheduled": o.report.totals.scheduled,
            "errors": o.report.errors,
        })).collect::<Vec<_>>(),
        "verdicts": judged.rows.iter().map(|r| serde_json::json!({
            "target": r.target,
            "results": plan.contenders.iter().zip(&r.checks).map(|(who, c)| serde_json::json!({
                "contender": who.label(), "measured": c.measured, "met": c.met,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}
