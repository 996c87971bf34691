//! `levee drill`: the whole story in one command.
//!
//! It starts simulated engines in `crash` mode, measures what the fleet can serve, then floods
//! it twice with the same scenario and seed — once through a plain round-robin pass-through
//! (what an unprotected fleet runs) and once through levee — on fresh engines each time, and
//! prints the runs side by side with a verdict on each target.

use crate::passthrough::Passthrough;
use anyhow::Context;
use levee_engine::{EngineConfig, EngineHandle, OverloadMode};
use levee_sim::report::{Group, Report};
use levee_sim::scenario::{Phase, Rate, Scenario};
use levee_sim::{RunOptions, Target};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

/// Command-line arguments of `levee drill`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrillArgs {
    /// Shipped scenario name (`levee sim list`) or a scenario TOML file.
    #[arg(long, default_value = "flash-crowd")]
    pub scenario: String,
    /// Directory for `report.html`, `drill.json` and each run's JSON report.
    #[arg(long, default_value = "levee-drill")]
    pub out: PathBuf,
    /// How many simulated engines form the fleet.
    #[arg(long, default_value_t = 2)]
    pub engines: usize,
    /// Overrides the scenario's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Hide the live progress lines.
    #[arg(long)]
    pub quiet: bool,
    /// Exit with status 1 when a target is missed.
    #[arg(long)]
    pub strict: bool,
}

/// Requests in flight levee allows on one drill engine. The drill engine's KV cache holds
/// 24,576 tokens; at a mean of ~510 tokens per sequence (prompt + max_tokens), 32 sequences
/// stay well under it even with unlucky long prompts, while the engine's own limit (64
/// sequences, admitted optimistically) lets an unprotected flood overflow it.
const BACKEND_CAP: u32 = 32;

/// The simulated GPU every drill engine runs: the `small` profile in `crash` mode with a
/// faster decode, so that a drill of a few dozen seconds holds many request lifetimes.
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

struct Fleet {
    engines: Vec<EngineHandle>,
}

impl Fleet {
    async fn start(n: usize) -> anyhow::Result<Self> {
        let mut engines = Vec::with_capacity(n);
        for i in 0..n {
            let bind = "127.0.0.1:0".parse().context("loopback address")?;
            let e = levee_engine::spawn(drill_engine_config(), bind)
                .await
                .with_context(|| format!("starting drill engine {i}"))?;
            engines.push(e);
        }
        Ok(Self { engines })
    }

    fn urls(&self) -> Vec<String> {
        self.engines.iter().map(|e| e.base_url()).collect()
    }

    fn crashes(&self) -> u64 {
        self.engines.iter().map(|e| e.stats().crashes).sum()
    }

    fn target(&self, base_url: String) -> Target {
        let mut t = Target::new(base_url);
        for (i, e) in self.engines.iter().enumerate() {
            t.metrics
                .push((format!("engine{i}"), format!("{}/metrics", e.base_url())));
            t.engine_admin.push(e.base_url());
        }
        t
    }

    async fn stop(self) {
        for e in self.engines {
            if let Err(err) = e.shutdown().await {
                tracing::warn!("stopping a drill engine: {err:#}");
            }
        }
    }
}

/// How long requests still in flight after a run's last send may finish: longer than a
/// drill request's longest life behind levee (queue budget plus generation).
const DRAIN_S: f64 = 6.0;

/// Each tenant's request quota, as a multiple of its normal traffic (its share of 1x capacity).
const QUOTA_HEADROOM: f64 = 1.25;

/// The gateway configuration the drill runs levee with: every tenant of the scenario gets a
/// key, its tier, a request quota of [`QUOTA_HEADROOM`] × its normal traffic (what an
/// operator would contract) and at most three quarters of the fleet's slots;
/// every engine is a backend capped at [`BACKEND_CAP`]; the queue holds about one second of
/// the fleet's work.
pub fn drill_gateway_config(
    scenario: &Scenario,
    engine_urls: &[String],
    quotas: bool,
) -> anyhow::Result<levee_gateway::Config> {
    let model = &scenario.request.model;
    let fleet_cap = BACKEND_CAP as usize * engine_urls.len();
    let mut t = String::new();
    let _ = writeln!(
        t,
        r#"[listen]
public = "127.0.0.1:0"
admin = "127.0.0.1:0"

[ip_guard]
enabled = false

[tiers.premium]
priority = 0
queue_wait_ms = 1500
soft_queue_wait_ms = 1500
sheddable = false

[tiers.standard]
priority = 1
queue_wait_ms = 1000
soft_queue_wait_ms = 500
sheddable = false

[tiers.free]
priority = 2
queue_wait_ms = 1000
soft_queue_wait_ms = 0
sheddable = true

[queue]
safe = {safe}
soft = {soft}
hard = {hard}

[scrape]
interval_ms = 250
timeout_ms = 200
unhealthy_after = 3

[degrade]
enabled = false
"#,
        safe = fleet_cap,
        soft = fleet_cap + fleet_cap / 2,
        hard = fleet_cap * 2,
    );
    let mut seen = std::collections::BTreeSet::new();
    for tenant in &scenario.tenants {
        if !seen.insert(tenant.api_key.clone()) {
            continue;
        }
        let tier = match tenant.tier.as_str() {
            "premium" | "standard" | "free" => tenant.tier.as_str(),
            _ => "standard",
        };
        // A flooder starts at its contracted share: that is its quota. The others' normal
        // traffic is bursty, so they get headroom over it; premium contracts buy more.
        let headroom = if is_flooder(scenario, tenant) {
            1.0
        } else if tier == "premium" {
            2.0 * QUOTA_HEADROOM
        } else {
            QUOTA_HEADROOM
        };
        let quota_rps = normal_rps(scenario, tenant) * headroom;
        let (rpm, burst) = if quotas {
            // A few seconds' worth of burst: enough for bursty arrivals, not for a flood.
            (
                (quota_rps * 60.0).ceil().max(60.0),
                (quota_rps * 3.0).ceil().max(1.0),
            )
        } else {
            (0.0, 0.0)
        };
        let _ = writeln!(
            t,
            r#"[[tenants]]
name = {name:?}
tier = "{tier}"
key_sha256 = ["{hash}"]
requests_per_minute = {rpm}
requests_burst = {burst}
max_concurrency = {conc}
"#,
            name = tenant.name,
            hash = levee_gateway::hash_key(&tenant.api_key),
            // No tenant may hold more than three quarters of the fleet.
            conc = (fleet_cap * 3 / 4).max(1),
        );
    }
    let _ = writeln!(t, "[[models]]\nname = {model:?}\n");
    for url in engine_urls {
        let _ = writeln!(
            t,
            "[[models.backends]]\nkind = \"vllm\"\nurl = {url:?}\nmax_in_flight = {BACKEND_CAP}\n"
        );
    }
    levee_gateway::Config::from_toml_str(&t).map_err(|errors| {
        anyhow::anyhow!(
            "the drill's gateway configuration is invalid:\n  {}",
            errors.join("\n  ")
        )
    })
}

/// One run of the drill, labelled for the tables.
struct Run {
    label: &'static str,
    report: Report,
    crashes: u64,
}

/// A scenario that offers `rps_multiple` × capacity steadily for `secs`, with the scenario's
/// classes, tenants (those with their own schedule left out) and client behaviour.
fn steady_variant(base: &Scenario, name: &str, rps_multiple: f64, secs: f64) -> Scenario {
    let mut s = base.clone();
    s.name = format!("{} ({name})", base.name);
    s.phases = vec![Phase::Steady {
        duration_s: secs,
        rps: Rate::Multiple(rps_multiple),
    }];
    s.tenants.retain(|t| !is_flooder(base, t));
    s.faults.clear();
    s
}

/// A tenant with its own schedule that at some point sends at least the fleet's whole
/// capacity by itself: the noisy neighbour the others must be isolated from.
fn is_flooder(scenario: &Scenario, tenant: &levee_sim::scenario::Tenant) -> bool {
    let Some(phases) = &tenant.phases else {
        return false;
    };
    let rps = |r: &Rate| match r {
        Rate::Rps(x) => *x,
        Rate::Multiple(m) => m * scenario.capacity_rps,
    };
    let peak = phases
        .iter()
        .map(|p| match p {
            Phase::Steady { rps: r, .. } => rps(r),
            Phase::Ramp {
                from_rps, to_rps, ..
            }
            | Phase::Step {
                from_rps, to_rps, ..
            } => rps(from_rps).max(rps(to_rps)),
            Phase::Spike {
                base_rps, peak_rps, ..
            } => rps(base_rps).max(rps(peak_rps)),
            Phase::Sine {
                mean_rps,
                amplitude_rps,
                ..
            } => rps(mean_rps) + rps(amplitude_rps),
        })
        .fold(0.0, f64::max);
    peak >= scenario.capacity_rps
}

/// Requests per second a tenant sends in normal times: its share of 1x capacity, or for a
/// tenant with its own schedule, the rate that schedule starts at.
fn normal_rps(scenario: &Scenario, tenant: &levee_sim::scenario::Tenant) -> f64 {
    let to_rps = |r: Rate| match r {
        Rate::Rps(x) => x,
        Rate::Multiple(m) => m * scenario.capacity_rps,
    };
    match &tenant.phases {
        Some(phases) => phases.first().map_or(0.0, |p| p.rate_at(0.0, &to_rps)),
        None => {
            let total: f64 = scenario
                .tenants
                .iter()
                .filter(|t| t.phases.is_none())
                .map(|t| t.share)
                .sum();
            if total > 0.0 {
                scenario.capacity_rps * tenant.share / total
            } else {
                0.0
            }
        }
    }
}

/// The same scenario with every flooder calm: sending all along at the rate it starts at
/// (its normal share) instead of flooding. What the quiet tenants see in normal times.
fn calm_flooders(base: &Scenario) -> Scenario {
    let mut s = base.clone();
    s.name = format!("{} (flooder calm)", base.name);
    let total: f64 = base.phases.iter().map(|p| p.duration_s()).sum();
    for t in s.tenants.iter_mut() {
        if is_flooder(base, t) {
            let rps = normal_rps(base, t);
            t.phases = Some(vec![Phase::Steady {
                duration_s: total,
                rps: Rate::Rps(rps),
            }]);
        }
    }
    s
}

async fn run_levee(
    scenario: &Scenario,
    engines: usize,
    opts: &RunOptions,
    quotas: bool,
) -> anyhow::Result<(Report, u64)> {
    let fleet = Fleet::start(engines).await?;
    let cfg = drill_gateway_config(scenario, &fleet.urls(), quotas)?;
    let gw = levee_gateway::start(cfg)
        .await
        .context("starting the drill gateway")?;
    let mut target = fleet.target(gw.public_url());
    target
        .metrics
        .push(("gateway".into(), format!("{}/metrics", gw.admin_url())));
    let report = levee_sim::run(scenario, &target, opts).await;
    let crashes = fleet.crashes();
    gw.shutdown().await;
    fleet.stop().await;
    Ok((report?, crashes))
}

async fn run_unprotected(
    scenario: &Scenario,
    engines: usize,
    opts: &RunOptions,
) -> anyhow::Result<(Report, u64)> {
    let fleet = Fleet::start(engines).await?;
    let proxy = Passthrough::start(fleet.urls()).await?;
    let target = fleet.target(proxy.base_url());
    let report = levee_sim::run(scenario, &target, opts).await;
    let crashes = fleet.crashes();
    proxy.shutdown().await;
    fleet.stop().await;
    Ok((report?, crashes))
}

/// Requests per second the fleet completes when saturated through levee: the steady-state
/// completion rate (the first seconds, while the batch fills, are left out).
fn saturated_throughput(report: &Report) -> f64 {
    steady_rate(&report.timeseries).unwrap_or(report.rates.ok_rps)
}

/// Mean completions per second from the fourth second on, if the run lasted that long.
fn steady_rate(seconds: &[levee_sim::report::Second]) -> Option<f64> {
    let warm: Vec<_> = seconds.iter().filter(|s| s.t >= 3).collect();
    (!warm.is_empty()).then(|| warm.iter().map(|s| s.ok as f64).sum::<f64>() / warm.len() as f64)
}

/// Runs `levee drill`.
pub async fn run_cli(args: DrillArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.engines >= 1, "--engines must be at least 1");
    let started = std::time::Instant::now();
    let mut scenario = levee_sim::load_scenario(&args.scenario)?;
    if let Some(seed) = args.seed {
        scenario.seed = seed;
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create the output directory {}", args.out.display()))?;
    let opts = |drain_s: f64| RunOptions {
        progress: !args.quiet,
        drain: Some(Duration::from_secs_f64(drain_s)),
        ..RunOptions::default()
    };
    eprintln!(
        "levee drill: scenario {:?}, {} simulated engines (crash mode, {} KV tokens, {} seqs each)",
        scenario.name,
        args.engines,
        drill_engine_config().gpu.kv_capacity_tokens,
        drill_engine_config().gpu.max_running_seqs
    );

    // 1. Capacity: saturate the fleet through levee and measure what it completes.
    let mut probe = steady_variant(&scenario, "capacity probe", 3.0, 8.0);
    probe.capacity_rps = estimated_capacity(args.engines);
    probe.client.behaviour = levee_sim::scenario::Behaviour::None;
    eprintln!("[1/4] measuring the fleet's capacity (saturated, through levee)");
    let (probe_report, _) = run_levee(&probe, args.engines, &opts(2.0), false).await?;
    let capacity = saturated_throughput(&probe_report);
    anyhow::ensure!(
        capacity > 0.5,
        "the fleet completed almost nothing while saturated ({capacity:.2} req/s); the drill cannot go on"
    );
    scenario.capacity_rps = capacity;
    eprintln!("      capacity: {capacity:.1} req/s");

    // 2. The reference: the same fleet offered exactly its capacity or, when the scenario
    //    has a flooding tenant, the same traffic without the flooder.
    let has_flooders = scenario.tenants.iter().any(|t| is_flooder(&scenario, t));
    let (reference_label, reference) = if has_flooders {
        ("flooder calm", calm_flooders(&scenario))
    } else {
        (
            "1x capacity",
            steady_variant(&scenario, "1x capacity", 1.0, 12.0),
        )
    };
    eprintln!("[2/4] reference run: {reference_label} (through levee)");
    let (cap_report, cap_crashes) =
        run_levee(&reference, args.engines, &opts(DRAIN_S), true).await?;

    // 3. The flood, unprotected.
    eprintln!("[3/4] {}: unprotected round-robin", scenario.name);
    let (raw_report, raw_crashes) =
        run_unprotected(&scenario, args.engines, &opts(DRAIN_S)).await?;

    // 4. The flood, through levee.
    eprintln!("[4/4] {}: through levee", scenario.name);
    let (levee_report, levee_crashes) =
        run_levee(&scenario, args.engines, &opts(DRAIN_S), true).await?;

    let runs = [
        Run {
            label: reference_label,
            report: cap_report,
            crashes: cap_crashes,
        },
        Run {
            label: "unprotected",
            report: raw_report,
            crashes: raw_crashes,
        },
        Run {
            label: "levee",
            report: levee_report,
            crashes: levee_crashes,
        },
    ];
    let verdicts = verdicts(&scenario, &runs);
    println!("{}", side_by_side(&scenario, capacity, &runs));
    println!("{}", render_verdicts(&verdicts));

    for run in &runs {
        let file = args
            .out
            .join(format!("{}.json", run.label.replace(' ', "-")));
        levee_sim::report::write_json(&run.report, &file)?;
    }
    let pages: Vec<(&str, &Report)> = runs.iter().map(|r| (r.label, &r.report)).collect();
    let html = args.out.join("report.html");
    levee_sim::report::write_html(&pages, &html)?;
    let summary = serde_json::json!({
        "scenario": scenario.name,
        "engines": args.engines,
        "capacity_rps": capacity,
        "runs": runs.iter().map(|r| serde_json::json!({
            "label": r.label,
            "engine_crashes": r.crashes,
            "goodput_rps": r.report.rates.goodput_rps,
            "success_rate": r.report.rates.success_rate,
            "p99_ttft_ms": r.report.latency.ttft.p99,
            "errors": r.report.errors,
        })).collect::<Vec<_>>(),
        "verdicts": verdicts.iter().map(|v| serde_json::json!({
            "target": v.target, "measured": v.measured, "met": v.met,
        })).collect::<Vec<_>>(),
    });
    let summary_path = args.out.join("drill.json");
    std::fs::write(&summary_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("cannot write {}", summary_path.display()))?;
    println!(
        "report: {} (runs: {}/*.json, summary: {})  — {:.0} s",
        html.display(),
        args.out.display(),
        summary_path.display(),
        started.elapsed().as_secs_f64()
    );
    if args.strict && verdicts.iter().any(|v| !v.met) {
        anyhow::bail!("a drill target was missed (see the verdicts above)");
    }
    Ok(())
}

/// A first guess of the fleet's capacity, only used to size the saturation probe (the drill
/// measures the real figure): each engine holds [`BACKEND_CAP`] sequences of ~130 output
/// tokens at one decode step each.
fn estimated_capacity(engines: usize) -> f64 {
    let g = drill_engine_config().gpu;
    let step_s = (g.decode_base_ms + g.decode_per_seq_ms * f64::from(BACKEND_CAP)) / 1000.0;
    engines as f64 * f64::from(BACKEND_CAP) / (130.0 * step_s)
}

struct Verdict {
    target: String,
    measured: String,
    met: bool,
}

fn verdicts(scenario: &Scenario, runs: &[Run; 3]) -> Vec<Verdict> {
    let [cap, raw, levee] = runs;
    let mut out = Vec::new();
    let base = cap.report.rates.goodput_rps;
    let ratio = if base > 0.0 {
        levee.report.rates.goodput_rps / base
    } else {
        0.0
    };
    let flooders: Vec<&str> = scenario
        .tenants
        .iter()
        .filter(|t| is_flooder(scenario, t))
        .map(|t| t.name.as_str())
        .collect();
    if flooders.is_empty() {
        out.push(Verdict {
            target: "levee goodput under the flood ≥ 95% of goodput at 1x capacity".into(),
            measured: format!(
                "{:.1} vs {:.1} req/s = {:.1}%{}",
                levee.report.rates.goodput_rps,
                base,
                ratio * 100.0,
                shortfall(ratio, 0.95)
            ),
            met: ratio >= 0.95,
        });
    }
    out.push(Verdict {
        target: "no engine crash behind levee".into(),
        measured: format!("{} crashes", levee.crashes),
        met: levee.crashes == 0,
    });
    if let Some(p) = levee.report.per_tier.get("premium") {
        out.push(Verdict {
            target: "premium tier ≥ 99.9% successful behind levee".into(),
            measured: format!(
                "{:.2}% of {} requests{}",
                p.success_rate * 100.0,
                p.requests,
                shortfall(p.success_rate, 0.999)
            ),
            met: p.success_rate >= 0.999,
        });
    }
    let raw_ratio = if base > 0.0 {
        raw.report.rates.goodput_rps / base
    } else {
        0.0
    };
    out.push(Verdict {
        target: "the unprotected fleet shows the collapse (crashes or goodput falling)".into(),
        measured: format!(
            "{} crashes, goodput {:.1}% of the reference run",
            raw.crashes,
            raw_ratio * 100.0
        ),
        met: raw.crashes > 0 || raw_ratio < 0.95,
    });
    // Isolation: the quiet tenants' p99 TTFT with the flooder calm and flooding. Pooled by
    // the scenario's tenant groups when it names them (more samples, a steadier p99), else
    // tenant by tenant.
    if !flooders.is_empty() {
        let flooder_groups: Vec<&str> = scenario
            .tenants
            .iter()
            .filter(|t| is_flooder(scenario, t))
            .filter_map(|t| t.group.as_deref())
            .collect();
        let mut quiet: Vec<(String, &Group, &Group)> = Vec::new();
        for (name, before) in &cap.report.per_group {
            if let Some(after) = levee.report.per_group.get(name) {
                if !flooder_groups.contains(&name.as_str()) {
                    quiet.push((format!("group {name}"), before, after));
                }
            }
        }
        if quiet.is_empty() {
            for t in scenario.tenants.iter().filter(|t| !is_flooder(scenario, t)) {
                if let (Some(before), Some(after)) = (
                    cap.report.per_tenant.get(&t.name),
                    levee.report.per_tenant.get(&t.name),
                ) {
                    quiet.push((format!("tenant {}", t.name), before, after));
                }
            }
        }
        for (who, before, after) in quiet {
            let (b, a) = (before.ttft.p99, after.ttft.p99);
            let moved = if b > 0.0 { (a - b) / b } else { 0.0 };
            out.push(Verdict {
                target: format!(
                    "{who} p99 TTFT moves ≤ 10% while {} floods",
                    flooders.join(", ")
                ),
                measured: format!(
                    "{b:.0} ms → {a:.0} ms ({:+.1}%, {} and {} samples)",
                    moved * 100.0,
                    before.ttft.count,
                    after.ttft.count
                ),
                met: moved <= 0.10,
            });
        }
    }
    out
}

fn shortfall(measured: f64, target: f64) -> String {
    if measured >= target {
        String::new()
    } else {
        format!(
            " — short of the target by {:.2} points",
            (target - measured) * 100.0
        )
    }
}

fn render_verdicts(verdicts: &[Verdict]) -> String {
    let mut s = String::from("targets:\n");
    for v in verdicts {
        let _ = writeln!(
            s,
            "  [{}] {} — {}",
            if v.met { "MET " } else { "MISS" },
            v.target,
            v.measured
        );
    }
    s
}

fn side_by_side(scenario: &Scenario, capacity: f64, runs: &[Run; 3]) -> String {
    let mut rows: Vec<(String, [String; 3])> = Vec::new();
    let mut row = |name: &str, f: &dyn Fn(&Run) -> String| {
        rows.push((name.to_string(), [f(&runs[0]), f(&runs[1]), f(&runs[2])]));
    };
    row("offered req/s", &|r| {
        format!("{:.1}", r.report.rates.offered_rps)
    });
    row("goodput req/s", &|r| {
        format!("{:.1}", r.report.rates.goodput_rps)
    });
    row("goodput tokens/s", &|r| {
        format!("{:.0}", r.report.rates.goodput_tps)
    });
    row("success", &|r| pct(r.report.rates.success_rate));
    let mut tiers: Vec<String> = Vec::new();
    for r in runs {
        for t in r.report.per_tier.keys() {
            if !tiers.contains(t) {
                tiers.push(t.clone());
            }
        }
    }
    for tier in &tiers {
        row(&format!("success, {tier}"), &|r| {
            r.report
                .per_tier
                .get(tier)
                .map(|g| pct(g.success_rate))
                .unwrap_or_else(|| "-".into())
        });
    }
    row("p50 TTFT ms", &|r| ms(r.report.latency.ttft.p50));
    row("p99 TTFT ms", &|r| ms(r.report.latency.ttft.p99));
    row("engine crashes", &|r| r.crashes.to_string());
    row("429s", &|r| r.report.rate_limited().to_string());
    row("5xx", &|r| r.report.server_errors().to_string());
    row("timeouts", &|r| {
        r.report
            .errors
            .get("timeout")
            .copied()
            .unwrap_or(0)
            .to_string()
    });
    row("broken streams", &|r| {
        r.report
            .errors
            .get("broken_stream")
            .copied()
            .unwrap_or(0)
            .to_string()
    });
    row("retries sent", &|r| r.report.totals.retries.to_string());

    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nlevee drill — {} (fleet capacity measured at {:.1} req/s)\n",
        scenario.name, capacity
    );
    let _ = writeln!(
        s,
        "{:<22}{:>16}{:>16}{:>16}",
        "", runs[0].label, runs[1].label, runs[2].label
    );
    for (name, cells) in rows {
        let _ = writeln!(
            s,
            "{:<22}{:>16}{:>16}{:>16}",
            name, cells[0], cells[1], cells[2]
        );
    }
    s
}

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

fn ms(v: f64) -> String {
    format!("{v:.0}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noisy() -> Scenario {
        levee_sim::scenarios::builtin("noisy-neighbor").unwrap()
    }

    #[test]
    fn the_noisy_tenant_is_the_only_flooder() {
        let s = noisy();
        let flooders: Vec<&str> = s
            .tenants
            .iter()
            .filter(|t| is_flooder(&s, t))
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(flooders, ["noisy"]);
        // flash-crowd's premium tenant has its own schedule but never floods.
        let fc = levee_sim::scenarios::builtin("flash-crowd").unwrap();
        assert!(fc.tenants.iter().all(|t| !is_flooder(&fc, t)));
        assert!(fc.tenants.iter().any(|t| t.phases.is_some()));
    }

    #[test]
    fn normal_rates_follow_shares_and_starting_rates() {
        let mut s = noisy();
        s.capacity_rps = 40.0;
        let rate = |name: &str| normal_rps(&s, s.tenants.iter().find(|t| t.name == name).unwrap());
        // Three quiet tenants with equal shares split 1x; the noisy one starts at 0.25x.
        assert!((rate("quiet-a") - 40.0 / 3.0).abs() < 1e-9);
        assert!((rate("noisy") - 10.0).abs() < 1e-9);
    }

    #[test]
    fn calm_flooders_keep_the_flooder_at_its_share_for_the_whole_run() {
        let s = noisy();
        let calm = calm_flooders(&s);
        let total: f64 = s.phases.iter().map(|p| p.duration_s()).sum();
        let n = calm.tenants.iter().find(|t| t.name == "noisy").unwrap();
        let phases = n.phases.as_ref().unwrap();
        assert_eq!(phases.len(), 1);
        assert!((phases[0].duration_s() - total).abs() < 1e-9);
        assert!(!is_flooder(&calm, n));
        // The quiet tenants are untouched.
        for (a, b) in s.tenants.iter().zip(&calm.tenants) {
            if a.name != "noisy" {
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn steady_variant_drops_flooders_and_faults() {
        let s = levee_sim::scenarios::builtin("backend-failure").unwrap();
        let v = steady_variant(&s, "probe", 3.0, 8.0);
        assert!(v.faults.is_empty());
        assert_eq!(v.phases.len(), 1);
        assert!((v.phases[0].duration_s() - 8.0).abs() < 1e-9);
    }

    #[test]
    fn every_shipped_scenario_gives_a_valid_gateway_config() {
        let urls = vec![
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".to_string(),
        ];
        for name in levee_sim::scenarios::names() {
            let s = levee_sim::scenarios::builtin(name).unwrap();
            for quotas in [false, true] {
                let cfg = drill_gateway_config(&s, &urls, quotas)
                    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
                assert!(cfg.validate().is_empty(), "{name}: {:?}", cfg.validate());
                assert_eq!(cfg.models.len(), 1);
                assert_eq!(cfg.models[0].backends.len(), 2);
                for t in &cfg.tenants {
                    assert_eq!(t.requests_per_minute > 0, quotas, "{name}/{}", t.name);
                }
            }
        }
    }

    #[test]
    fn quotas_hold_a_flooder_to_its_share_and_give_premium_headroom() {
        let urls = vec!["http://127.0.0.1:1".to_string()];
        let rpm = |s: &Scenario, name: &str| {
            let cfg = drill_gateway_config(s, &urls, true).unwrap();
            let t = cfg.tenants.iter().find(|t| t.name == name).unwrap();
            f64::from(t.requests_per_minute)
        };
        let mut nn = noisy();
        nn.capacity_rps = 40.0;
        // The noisy tenant's share is 0.25x = 10 req/s: exactly its quota.
        assert_eq!(rpm(&nn, "noisy"), 600.0);
        assert!(rpm(&nn, "quiet-a") > 40.0 / 3.0 * 60.0);
        // flash-crowd's premium tenant keeps its own steady schedule: it gets premium
        // headroom, not a flooder's exact share.
        let mut fc = levee_sim::scenarios::builtin("flash-crowd").unwrap();
        fc.capacity_rps = 40.0;
        let acme = fc.tenants.iter().find(|t| t.tier == "premium").unwrap();
        let normal = normal_rps(&fc, acme) * 60.0;
        assert!(rpm(&fc, &acme.name) >= 2.0 * normal);
    }

    #[test]
    fn the_drill_engine_crashes_unprotected_but_not_at_levees_cap() {
        let g = drill_engine_config().gpu;
        assert_eq!(g.overload, OverloadMode::Crash);
        // levee's cap times a long sequence fits the cache; the engine's own limit does not.
        let long_seq = 700;
        assert!(BACKEND_CAP * long_seq <= g.kv_capacity_tokens);
        assert!(g.max_running_seqs * long_seq > g.kv_capacity_tokens);
    }

    #[test]
    fn saturated_throughput_skips_the_warm_up() {
        let seconds: Vec<levee_sim::report::Second> = (0..8u32)
            .map(|t| levee_sim::report::Second {
                t,
                ok: if t < 3 { 1 } else { 20 },
                ..Default::default()
            })
            .collect();
        assert_eq!(steady_rate(&seconds), Some(20.0));
        assert_eq!(steady_rate(&seconds[..3]), None);
    }
}
