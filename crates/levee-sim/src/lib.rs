//! levee-sim: floods a target with realistic LLM traffic and measures it correctly.
//!
//! - [`Scenario`] (TOML) says what to send: phases of offered load, arrival process,
//!   request classes, tenants, sessions, client behaviour, SLO, faults.
//! - [`run`] sends it open loop (every request at its intended time, whatever happened to
//!   earlier ones) and returns a [`Report`]: latencies from the intended send time
//!   (corrected) beside those from the actual send, goodput against the SLO, errors by
//!   kind, per-second series, scraped gauges, per tier/tenant/class breakdowns.
//! - [`report::write_json`] / [`report::write_html`] save it; [`report::compare_table`]
//!   puts runs side by side.
//!
//! The library API (used by `levee drill`) is documented in `docs/sim.md`.

pub mod arrivals;
pub mod calibrate;
pub mod dist;
mod exchange;
pub mod faults;
mod recorder;
pub mod report;
mod runner;
pub mod scenario;
pub mod scenarios;
pub mod scrape;
pub mod text;

pub use report::Report;
pub use runner::{run, RunOptions, Target};
pub use scenario::Scenario;

use anyhow::Context;
use std::path::{Path, PathBuf};

/// Command-line arguments of `levee sim`.
///
/// `levee sim SCENARIO --target URL` runs a flood; `levee sim compare A.json B.json`
/// compares reports.
#[derive(Debug, Clone, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SimArgs {
    /// Other `levee sim` commands.
    #[command(subcommand)]
    pub command: Option<SimCommand>,
    /// Scenario: a TOML file, or the name of a shipped scenario (steady, flash-crowd,
    /// slow-poison, retry-storm, noisy-neighbor, backend-failure).
    pub scenario: Option<String>,
    /// Base URL of the target (gateway or engine), e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub target: Option<String>,
    /// Directory for the JSON and HTML reports.
    #[arg(long, default_value = "levee-report")]
    pub out: PathBuf,
    /// Overrides the scenario's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Multiplies every rate of the scenario (overrides its rate_scale).
    #[arg(long)]
    pub rate_scale: Option<f64>,
    /// What "1x" means, in requests per second (overrides the scenario's capacity_rps).
    #[arg(long)]
    pub capacity_rps: Option<f64>,
    /// Multiplies the scenario's timeline (phase lengths, times inside phases, fault
    /// times): 0.5 runs a 60 s scenario in 30 s at the same rates.
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// Model name to send (overrides the scenario's and its classes').
    #[arg(long)]
    pub model: Option<String>,
    /// A /metrics URL to scrape, as NAME=URL (repeatable), e.g.
    /// gateway=http://127.0.0.1:9090/metrics.
    #[arg(long = "metrics", value_name = "NAME=URL")]
    pub metrics: Vec<String>,
    /// Admin base URL of an engine, for the scenario's faults (repeatable, in engine order).
    #[arg(long = "engine-admin", value_name = "URL")]
    pub engine_admin: Vec<String>,
    /// Seconds to wait for in-flight requests after the schedule ends (default: client
    /// timeout + 1).
    #[arg(long)]
    pub drain_s: Option<f64>,
    /// No live progress line.
    #[arg(long)]
    pub quiet: bool,
    /// Print the scenario (after overrides) as TOML and exit without sending anything.
    #[arg(long)]
    pub print_scenario: bool,
}

/// Subcommands of `levee sim`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum SimCommand {
    /// Compare reports side by side: a table on stdout, optionally an HTML page.
    Compare {
        /// JSON reports written by `levee sim` (two or more).
        #[arg(required = true, num_args = 2..)]
        reports: Vec<PathBuf>,
        /// Also write an HTML comparison page here.
        #[arg(long)]
        html: Option<PathBuf>,
    },
    /// List the shipped scenarios.
    List,
    /// Measure a real OpenAI-compatible server (closed-loop sweep over concurrency, prefill
    /// cost against prompt length) and fit an engine profile for `levee engine
    /// --profile-file`.
    Calibrate(calibrate::CalibrateArgs),
}

/// A short label for a report file: its stem, or its directory's name for the default
/// `DIR/report.json`.
fn report_label(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if stem == "report" || stem.is_empty() {
        if let Some(dir) = path.parent().and_then(|d| d.file_name()) {
            return dir.to_string_lossy().into_owned();
        }
    }
    if stem.is_empty() {
        path.display().to_string()
    } else {
        stem
    }
}

/// Loads a scenario from a path, or by shipped name when no such file exists.
pub fn load_scenario(spec: &str) -> anyhow::Result<Scenario> {
    let path = Path::new(spec);
    if path.exists() {
        return Scenario::from_file(path);
    }
    if scenarios::builtin_toml(spec).is_some() {
        return scenarios::builtin(spec);
    }
    anyhow::bail!(
        "scenario {spec:?} is neither a file nor a shipped scenario ({})",
        scenarios::names().join(", ")
    )
}

/// Runs `levee sim`.
pub async fn run_cli(args: SimArgs) -> anyhow::Result<()> {
    match args.command {
        Some(SimCommand::Compare { reports, html }) => {
            let loaded = reports
                .iter()
                .map(|p| report::read_json(p))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let labels: Vec<String> = reports.iter().map(|p| report_label(p)).collect();
            let runs: Vec<(&str, &Report)> = labels
                .iter()
                .map(String::as_str)
                .zip(loaded.iter())
                .collect();
            print!("{}", report::compare_table(&runs));
            if let Some(path) = html {
                report::write_html(&runs, &path)?;
                println!("comparison page: {}", path.display());
            }
            return Ok(());
        }
        Some(SimCommand::Calibrate(args)) => return calibrate::run_cli(args).await,
        Some(SimCommand::List) => {
            for (name, text) in scenarios::BUILTIN {
                let description = Scenario::from_toml_str(text)
                    .map(|s| s.description)
                    .unwrap_or_default();
                println!("{name:<18}{description}");
            }
            return Ok(());
        }
        None => {}
    }
    let spec = args
        .scenario
        .context("give a scenario (a TOML file or a shipped name; `levee sim list` shows them)")?;
    let mut scenario = load_scenario(&spec)?;
    if let Some(seed) = args.seed {
        scenario.seed = seed;
    }
    if let Some(scale) = args.rate_scale {
        scenario.rate_scale = scale;
    }
    if let Some(capacity) = args.capacity_rps {
        scenario.capacity_rps = capacity;
    }
    if let Some(f) = args.time_scale {
        anyhow::ensure!(
            f.is_finite() && f > 0.0,
            "--time-scale must be > 0 (got {f})"
        );
        scenario.scale_time(f);
    }
    scenario.validate()?;
    if args.print_scenario {
        print!("{}", scenario.to_toml_string()?);
        return Ok(());
    }
    let base_url = args.target.context(
        "give --target URL, the gateway or engine to flood (e.g. http://127.0.0.1:8080)",
    )?;
    let metrics = args
        .metrics
        .iter()
        .map(|m| {
            m.split_once('=')
                .map(|(n, u)| (n.to_string(), u.to_string()))
                .with_context(|| format!("--metrics {m:?}: write NAME=URL"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let target = Target {
        base_url,
        metrics,
        engine_admin: args.engine_admin,
    };
    // Ctrl-C stops the flood and still writes the report of what happened so far.
    let stop = tokio_util::sync::CancellationToken::new();
    let on_ctrl_c = stop.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("levee sim: interrupted; finishing the report (Ctrl-C again to abort)");
            on_ctrl_c.cancel();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        }
    });
    let opts = RunOptions {
        progress: !args.quiet,
        stop: Some(stop),
        model: args.model,
        drain: args
            .drain_s
            .map(|s| std::time::Duration::from_secs_f64(s.max(0.0))),
        ..RunOptions::default()
    };
    let report = run(&scenario, &target, &opts).await?;
    print!("{}", report.summary());
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create report directory {}", args.out.display()))?;
    let json = args.out.join("report.json");
    report::write_json(&report, &json)?;
    let html = args.out.join("report.html");
    report::write_html(&[(scenario.name.as_str(), &report)], &html)?;
    println!("reports: {} {}", json.display(), html.display());
    Ok(())
}
