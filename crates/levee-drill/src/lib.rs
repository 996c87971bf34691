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

mod capacity;
mod contender;
mod fleet;
mod operator;
mod passthrough;
mod render;
mod tenants;
#[cfg(test)]
mod tests;
mod verdicts;

use anyhow::Context;
use capacity::{Sweep, Timing};
use contender::{Contender, Outcome, Setup};
use levee_engine::{EngineConfig, OverloadMode};
use levee_sim::report::{Marker, Page, Report};
use levee_sim::{RunOptions, Scenario};
use render::VerdictRow;
use std::path::PathBuf;
use std::time::Duration;
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

/// Everything the drill decides before its first run.
struct Plan {
    args: DrillArgs,
    timing: Timing,
    scenario: Scenario,
    gateway_text: String,
    /// levee's configuration with placeholder backends: checked before any run, and the
    /// quotas the premium verdict's client-side check applies.
    gateway: levee_gateway::Config,
    engine: EngineConfig,
    engines: usize,
    flooders: Vec<String>,
}

impl Plan {
    fn new(args: DrillArgs) -> anyhow::Result<Self> {
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
        let gateway = gateway_config(&gateway_text, &scenario, &placeholder)?;
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
            gateway,
            engine,
            engines,
            flooders,
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
            opts: RunOptions {
                progress: !self.args.quiet,
                drain: Some(Duration::from_secs_f64(self.timing.drain_s)),
                ..RunOptions::default()
            },
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
                "{} simulated engines ({} KV tokens, {} sequences each, crash on KV \
                 overflow)",
                self.engines, self.engine.gpu.kv_capacity_tokens, self.engine.gpu.max_running_seqs
            )
        };
        eprintln!(
            "levee drill{}: scenario {:?}, {fleet_words}; logs in {}",
            if self.args.quick { " --quick" } else { "" },
            self.scenario.name,
            self.args.out.join("drill.log").display(),
        );
    }
}

/// The engine every run uses: the drill's simulated GPU, or the `--backend-profile`.
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
        None => drill_engine_config(),
    })
}

/// What the runs produced.
struct Runs {
    sweep: Sweep,
    outcomes: Vec<(Contender, Outcome)>,
    calm: Vec<(Contender, Outcome)>,
}

/// The capacity sweep, then every contender, then the calm references.
async fn run_all(plan: &mut Plan) -> anyhow::Result<Runs> {
    let total_steps = 4 + if plan.flooders.is_empty() { 0 } else { 2 };
    eprintln!(
        "[1/{total_steps}] capacity without levee: open-loop steps straight at {}",
        if plan.external() {
            "the servers"
        } else {
            "fresh engines"
        },
    );
    let sweep = capacity::measure_knee(&plan.scenario, &plan.setup(), &plan.timing).await?;
    plan.scenario.capacity_rps = sweep.knee_rps;
    eprintln!(
        "      knee: {:.1} req/s within the SLO (1x from here on)",
        sweep.knee_rps
    );
    let setup = plan.setup();
    let mut step = 1;
    let mut outcomes = Vec::new();
    for who in Contender::ALL {
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
        for who in [Contender::Capped, Contender::Levee] {
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
    let gw_copy = out.join("gateway.toml");
    std::fs::write(&gw_copy, &plan.gateway_text)
        .with_context(|| format!("cannot write {}", gw_copy.display()))?;
    plan.announce();
    let runs = run_all(&mut plan).await?;
    let judged = judge(&plan, &runs);
    let table = render::side_by_side(&plan.scenario, &runs.sweep, &runs.outcomes);
    let mut verdict_text = render::render_verdicts(&judged.rows);
    if let Some(warning) = &judged.suspect {
        verdict_text.push_str(&format!("WARNING: {warning}\n"));
    }
    let sweep_at = if plan.external() {
        "the running servers (a plain round-robin proxy)"
    } else {
        "fresh engines"
    };
    let sweep_text = capacity::render_sweep(&runs.sweep, &plan.timing, sweep_at);
    println!("{sweep_text}\n{table}\n{verdict_text}");
    let texts = [verdict_text, table, sweep_text];
    let html = write_page(&plan, &runs, &texts)?;
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
    let levee_missed = judged
        .rows
        .iter()
        .any(|r| r.checks.get(2).and_then(|c| c.met) == Some(false));
    if plan.args.strict && levee_missed {
        anyhow::bail!("levee missed a drill target (see the verdicts above)");
    }
    Ok(())
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

fn judge(plan: &Plan, runs: &Runs) -> Judged {
    let scenario = &plan.scenario;
    let knee = runs.sweep.knee_rps;
    let down: Vec<(f64, f64)> = scenario
        .faults
        .iter()
        .filter(|f| f.action == levee_sim::scenario::FaultAction::Crash)
        .map(|f| (f.at_s, f.at_s + plan.engine.gpu.restart_secs + 1.0))
        .collect();
    let window = verdicts::flood_window(
        scenario.duration_s(),
        &|t| scenario.offered_rps_at(t),
        knee,
        plan.timing.flood_warm_s,
        &down,
    );
    let outcomes = &runs.outcomes;
    let mut rows: Vec<VerdictRow> = Vec::new();
    let target = plan.args.goodput_target;
    if let Some(checks) = per_contender(outcomes, &|o| {
        verdicts::goodput(&o.report, &window, knee, target)
    }) {
        rows.push(VerdictRow {
            target: format!(
                "goodput in the flood ≥ {:.0}% of the knee ({knee:.1} req/s, {} s window)",
                target * 100.0,
                window.len()
            ),
            checks,
        });
    }
    if let Some(checks) = per_contender(outcomes, &|o| {
        Some(verdicts::crashes(o.fleet.crashes, o.fleet.injected_crashes))
    }) {
        rows.push(VerdictRow {
            target: "0 overload crashes (injected ones stated apart)".into(),
            checks,
        });
    }
    let over_quota = |o: &Outcome| {
        operator::premium_over_quota(&o.report.first_sends_ms, scenario, &plan.gateway)
    };
    if let Some(checks) = per_contender(outcomes, &|o| verdicts::premium(&o.report, over_quota(o)))
    {
        rows.push(VerdictRow {
            target: format!(
                "premium ≥ {:.1}% of its in-quota requests",
                verdicts::PREMIUM_TARGET * 100.0
            ),
            checks,
        });
    }
    rows.extend(isolation_rows(plan, runs));
    if let Some(checks) = per_contender(outcomes, &|o| Some(verdicts::amplification(&o.report))) {
        rows.push(VerdictRow {
            target: "retry amplification (attempts / scheduled)".into(),
            checks,
        });
    }
    let flood: Vec<(&str, Option<f64>)> = outcomes
        .iter()
        .map(|(who, o)| (who.label(), verdicts::window_goodput(&o.report, &window)))
        .collect();
    let suspect = verdicts::suspect_reference(knee, &flood);
    Judged {
        window,
        rows,
        suspect,
    }
}

/// One isolation row per quiet group: each contender against its own calm run.
fn isolation_rows(plan: &Plan, runs: &Runs) -> Vec<VerdictRow> {
    tenants::quiet_groups(&plan.scenario)
        .iter()
        .map(|who_group| {
            let checks = runs
                .outcomes
                .iter()
                .map(|(who, o)| {
                    let calm_of = |c: Contender| {
                        let run = runs.calm.iter().find(|(w, _)| *w == c)?;
                        who_group.of(&run.1.report)
                    };
                    let Some(flood) = who_group.of(&o.report) else {
                        return Check {
                            measured: "- (no such tenants)".into(),
                            met: None,
                        };
                    };
                    let own = calm_of(*who).map(|calm| verdicts::isolation(calm, flood));
                    let capped =
                        calm_of(Contender::Capped).map(|calm| verdicts::isolation(calm, flood));
                    match (own, capped) {
                        (Some(own), Some(capped)) => Check {
                            measured: format!(
                                "vs its own calm run: {}; vs the capped calm run: {}",
                                own.measured, capped.measured
                            ),
                            met: Some(own.met == Some(true) && capped.met == Some(true)),
                        },
                        _ => Check {
                            measured: "- (no calm run)".into(),
                            met: None,
                        },
                    }
                })
                .collect();
            VerdictRow {
                target: format!(
                    "{} vs calm (its own and the capped one): success −≤1 pt, p99 TTFT +≤10% \
                     (failures last) while {} floods",
                    who_group.name,
                    plan.flooders.join(", ")
                ),
                checks,
            }
        })
        .collect()
}

/// Writes every run's JSON report and `report.html`; returns the page's path.
fn write_page(plan: &Plan, runs: &Runs, texts: &[String; 3]) -> anyhow::Result<PathBuf> {
    let scenario = &plan.scenario;
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
    let mut markers: Vec<Marker> = scenario
        .phase_changes()
        .into_iter()
        .map(|at_s| Marker {
            at_s,
            label: format!(
                "{:.1}x",
                scenario.offered_rps_at(at_s + 1e-6) / runs.sweep.knee_rps
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
    let [verdict_text, table, sweep_text] = texts;
    let lead_html = format!(
        "<h2>Verdicts</h2><pre>{}</pre><h2>Side by side</h2><pre>{}</pre>\
         <h2>Capacity without levee</h2><pre>{}</pre>\
         <p>Dashed lines: grey where the offered load changes (as a multiple of the knee), red \
         where an engine crashed. In-process logs: drill.log.</p>",
        esc(verdict_text),
        esc(table),
        esc(sweep_text)
    );
    let page = Page {
        title: Some(format!("levee drill: {}", scenario.name)),
        lead_html,
        markers,
        run_markers,
    };
    let page_runs: Vec<(&str, &Report)> = pages.iter().map(|(l, r)| (l.as_str(), *r)).collect();
    let html = plan.args.out.join("report.html");
    levee_sim::report::write_page(&page_runs, &page, &html)?;
    Ok(html)
}

/// `drill.json`: the method, the sweep, every run's figures and the verdicts.
fn summary_json(plan: &Plan, runs: &Runs, judged: &Judged) -> serde_json::Value {
    let over_quota = |o: &Outcome| {
        operator::premium_over_quota(&o.report.first_sends_ms, &plan.scenario, &plan.gateway)
    };
    serde_json::json!({
        "scenario": plan.scenario.name,
        "quick": plan.args.quick,
        "engines": plan.engines,
        "backends": plan.args.backends,
        "goodput_target": plan.args.goodput_target,
        "capacity": {
            "method": "open-loop steps straight at the fleet (fresh simulated engines per \
                       step, or the --backend servers once idle) through a plain round-robin \
                       proxy, \
                       the scenario's mix without retries; goodput = requests meeting the SLO \
                       per second after the warm-up; crashed steps do not count",
            "knee_rps": runs.sweep.knee_rps,
            "steps": runs.sweep.steps.iter().map(|s| serde_json::json!({
                "offered_rps": s.offered_rps,
                "goodput_rps": s.goodput_rps,
                "crashed": s.crashed,
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
            "results": Contender::ALL.iter().zip(&r.checks).map(|(who, c)| serde_json::json!({
                "contender": who.label(), "measured": c.measured, "met": c.met,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}
