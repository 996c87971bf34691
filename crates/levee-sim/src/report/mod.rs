//! The report of a run: what was offered, what came back, how fast, and what failed.
//!
//! The JSON form (`write_json` / `read_json`) is the schema documented in `docs/sim.md`
//! under the name in [`SCHEMA`]. All latencies are milliseconds; all rates per second over
//! the scheduled duration of the run.

use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Name and version of the JSON schema; bumped on any incompatible change.
pub const SCHEMA: &str = "levee-sim-report/1";

/// The report of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// Scenario name.
    pub scenario: String,
    /// Scenario description.
    pub description: String,
    /// Seed used.
    pub seed: u64,
    /// Base URL flooded.
    pub target: String,
    /// Wall-clock start, as an HTTP date.
    pub started_at: String,
    /// Scheduled length of the run (the phases), seconds.
    pub duration_s: f64,
    /// Real length including the drain of in-flight requests, seconds.
    pub wall_s: f64,
    /// Client behaviour (`none`, `naive`, `backoff`).
    pub client: String,
    /// The SLO that defines goodput.
    pub slo: SloSpec,
    /// Counts over the whole run.
    pub totals: Totals,
    /// Rates over the scheduled duration.
    pub rates: Rates,
    /// Latency distributions.
    pub latency: Latency,
    /// Failed requests by kind: `429:<code>` (`429:<code>:<check>` when a levee gateway named
    /// the check that refused in `x-levee-refusal`), `5xx:<status>`, `4xx:<status>` (relayed from
    /// the server behind the target, or answered by a target that is not levee),
    /// `4xx:<status>:levee` (a levee gateway's own refusal: its answer carried
    /// `x-levee-error-origin`), `timeout`, `connect`, `broken_stream`, `cancelled`.
    pub errors: BTreeMap<String, u64>,
    /// Breakdown by tenant tier label.
    pub per_tier: BTreeMap<String, Group>,
    /// Breakdown by the tenants' `group` label (tenants without one are left out).
    #[serde(default)]
    pub per_group: BTreeMap<String, Group>,
    /// Breakdown by tenant name.
    pub per_tenant: BTreeMap<String, Group>,
    /// Per tenant: when each logical request (every session turn) was first sent, in ms
    /// since the start, in order; retries are not included. What the client sent, for quota
    /// checks made independently of the gateway that answered.
    #[serde(default)]
    pub first_sends_ms: BTreeMap<String, Vec<u64>>,
    /// Breakdown by request class.
    pub per_class: BTreeMap<String, Group>,
    /// One entry per second of the run (and of the drain).
    pub timeseries: Vec<Second>,
    /// Scraped gauges over time.
    pub metrics: Vec<MetricSeries>,
    /// Faults injected and how the admin endpoint answered.
    pub faults: Vec<FaultRecord>,
    /// Async clients' tasks (classes with `behaviour = "async"`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<TaskSummary>,
}

/// What happened to the tasks of async clients.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSummary {
    /// Submissions tried.
    pub submitted: u64,
    /// Submissions answered 202.
    pub accepted: u64,
    /// Tasks by final outcome: `succeeded`, `failed`, `cancelled`, `expired`, `refused`
    /// (no 202), `unfinished` (the run ended first), `lost` (polling failed).
    pub outcomes: BTreeMap<String, u64>,
    /// Tasks whose 202 carried an ETA and that succeeded (the ETA error's sample).
    pub eta_samples: u64,
    /// |ETA − actual time to result|, seconds.
    pub eta_abs_error_s: Percentiles,
    /// |ETA − actual| ÷ actual, in percent.
    pub eta_rel_error_pct: Percentiles,
    /// Time from submission to result of succeeded tasks, ms.
    pub time_to_result: Percentiles,
}

/// The SLO, echoed from the scenario.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloSpec {
    /// Most TTFT (ms), if set.
    pub ttft_ms: Option<f64>,
    /// Most TPOT (ms), if set.
    pub tpot_ms: Option<f64>,
    /// Most end-to-end (ms), if set.
    pub e2e_ms: Option<f64>,
}

/// Counts over the whole run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Totals {
    /// Requests scheduled (first turns from the schedule plus later session turns).
    pub scheduled: u64,
    /// Requests whose first attempt was sent (the rest were cancelled at the end while
    /// still waiting for a send slot).
    pub sent: u64,
    /// HTTP attempts made, retries included.
    pub attempts: u64,
    /// Retries (attempts beyond the first).
    pub retries: u64,
    /// Requests with a final outcome recorded; always equals `scheduled`.
    pub completed: u64,
    /// Requests that got a 2xx answer and a complete body.
    pub ok: u64,
    /// `ok` requests that met the SLO.
    pub good: u64,
    /// Output tokens of `ok` requests.
    pub output_tokens: u64,
    /// Output tokens of `good` requests.
    pub good_tokens: u64,
    /// Requests that failed (any error, cancellations included).
    pub failed: u64,
}

/// Rates per second over the scheduled duration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// Scheduled requests per second (the offered load).
    pub offered_rps: f64,
    /// First attempts sent per second (achieved send rate).
    pub sent_rps: f64,
    /// Attempts per second, retries included (what the server saw).
    pub attempts_rps: f64,
    /// Successful requests per second.
    pub ok_rps: f64,
    /// Requests per second that met the SLO.
    pub goodput_rps: f64,
    /// Output tokens per second of requests that met the SLO.
    pub goodput_tps: f64,
    /// Output tokens per second of all successful requests.
    pub output_tps: f64,
    /// `ok / completed`.
    pub success_rate: f64,
}

/// Summary of one latency distribution, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
    pub max: f64,
}

impl Percentiles {
    /// Summarises a histogram of microseconds.
    pub fn from_histogram(h: &hdrhistogram::Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Self {
            count: h.len(),
            mean: h.mean() / 1000.0,
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        }
    }
}

/// The latency distributions of a run.
///
/// "Corrected" figures count from each request's intended send time, so a sender that fell
/// behind (or a stall that delayed sends) shows up in them; "uncorrected" ones count from
/// the actual send of the last attempt, as a closed-loop tool would report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Latency {
    /// Time to first token, from the intended send time (successful requests).
    pub ttft: Percentiles,
    /// Time to first token, from the actual send of the last attempt.
    pub ttft_uncorrected: Percentiles,
    /// End to end, from the intended send time (successful requests).
    pub e2e: Percentiles,
    /// End to end, from the actual send of the last attempt.
    pub e2e_uncorrected: Percentiles,
    /// Gaps between consecutive content chunks of streams.
    pub itl: Percentiles,
    /// Time per output token after the first, per request.
    pub tpot: Percentiles,
    /// Actual first send minus intended send: how late the simulator was.
    pub schedule_lag: Percentiles,
}

/// Results of a group of requests (a tier, a tenant or a class).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    /// Requests.
    pub requests: u64,
    /// Successful requests.
    pub ok: u64,
    /// Requests that met the SLO.
    pub good: u64,
    /// `ok / requests` (1 when there were none).
    pub success_rate: f64,
    /// Requests per second that met the SLO.
    pub goodput_rps: f64,
    /// TTFT from intended send time, successful requests.
    pub ttft: Percentiles,
    /// The slowest successful requests' TTFTs (ms, slowest first): the
    /// [`slowest_kept`]`(requests)` largest, enough to place a 99th percentile that counts
    /// failures as infinitely late, and the lower end of its 95% interval.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ttft_slowest_ms: Vec<f64>,
    /// End to end from intended send time, successful requests.
    pub e2e: Percentiles,
    /// Failures by kind (same keys as `Report::errors`).
    pub errors: BTreeMap<String, u64>,
}

/// One second of the run. Sent counts go by send time, outcomes by completion time,
/// offered by intended time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Second {
    /// Seconds from the start.
    pub t: u32,
    /// Requests intended for this second.
    pub offered: u64,
    /// First attempts sent.
    pub sent: u64,
    /// Attempts sent, retries included.
    pub attempts: u64,
    /// Requests finished (any outcome).
    pub completed: u64,
    /// Requests that got a 2xx status (admitted by the target).
    pub admitted: u64,
    /// Successful requests.
    pub ok: u64,
    /// Requests that met the SLO.
    pub good: u64,
    /// Output tokens of good requests.
    pub good_tokens: u64,
    /// 429 answers (final outcomes).
    pub rate_limited: u64,
    /// 5xx answers.
    pub server_errors: u64,
    /// Client timeouts.
    pub timeouts: u64,
    /// Connection failures and broken streams.
    pub connect_errors: u64,
    /// Other failures (other 4xx, cancellations).
    pub other_errors: u64,
    /// TTFT median, ms (corrected).
    pub ttft_p50: f64,
    /// TTFT 99th percentile, ms (corrected).
    pub ttft_p99: f64,
    /// End-to-end median, ms (corrected).
    pub e2e_p50: f64,
    /// End-to-end 99th percentile, ms (corrected).
    pub e2e_p99: f64,
    /// Schedule lag 99th percentile, ms.
    pub lag_p99: f64,
}

/// A scraped gauge over time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricSeries {
    /// Which endpoint (e.g. `gateway`, `engine-0`).
    pub source: String,
    /// Gauge name.
    pub name: String,
    /// `[seconds from start, value]` pairs (value summed over label sets).
    pub points: Vec<[f64; 2]>,
}

/// A fault that was injected.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRecord {
    /// Scheduled time, seconds.
    pub at_s: f64,
    /// Action name.
    pub action: String,
    /// URL posted to.
    pub url: String,
    /// Body posted.
    pub body: serde_json::Value,
    /// HTTP status of the answer, if any.
    pub status: Option<u16>,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// How many of a group's slowest successful TTFTs its report keeps
/// ([`Group::ttft_slowest_ms`]) for `requests` requests: the 1% above the 99th percentile, the
/// percentile itself, and two standard deviations of the count above it further down (the
/// lower end of the percentile's distribution-free 95% interval).
pub fn slowest_kept(requests: u64) -> u64 {
    let above = requests as f64 / 100.0;
    (above + 2.0 * above.sqrt()).ceil() as u64 + 2
}

/// Writes a report as pretty JSON, creating parent directories.
pub fn write_json(report: &Report, path: &Path) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create directory {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(report).context("cannot serialise the report")?;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// Reads a report written by [`write_json`].
pub fn read_json(path: &Path) -> anyhow::Result<Report> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read report {}", path.display()))?;
    let report: Report = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a levee sim report ({SCHEMA}); was it written by another version?",
            path.display()
        )
    })?;
    Ok(report)
}

mod html;

pub use html::{escape_html, write_html, write_page, Marker, Page};

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

impl Report {
    /// Failed requests whose error key starts with `prefix` (`"429"`, `"5xx"`, `"timeout"`).
    pub fn errors_with_prefix(&self, prefix: &str) -> u64 {
        self.errors
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| *v)
            .sum()
    }

    /// Requests that ended in a 429, whatever its code.
    pub fn rate_limited(&self) -> u64 {
        self.errors_with_prefix("429")
    }

    /// Requests that ended in a 5xx.
    pub fn server_errors(&self) -> u64 {
        self.errors_with_prefix("5xx")
    }

    /// A human summary table (what `levee sim` prints at the end).
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let t = &self.totals;
        let r = &self.rates;
        let l = &self.latency;
        let _ = writeln!(
            s,
            "scenario {} (seed {}) against {} — {:.0} s scheduled, {:.1} s wall, client {}",
            self.scenario, self.seed, self.target, self.duration_s, self.wall_s, self.client
        );
        let _ = writeln!(
            s,
            "requests   scheduled {}  sent {}  attempts {} (retries {})  ok {}  good {}  failed {}",
            t.scheduled, t.sent, t.attempts, t.retries, t.ok, t.good, t.failed
        );
        let _ = writeln!(
            s,
            "rates /s   offered {:.1}  sent {:.1}  attempts {:.1}  ok {:.1}  goodput {:.1} req/s, {:.0} tok/s  success {}",
            r.offered_rps, r.sent_rps, r.attempts_rps, r.ok_rps, r.goodput_rps, r.goodput_tps, pct(r.success_rate)
        );
        let _ = writeln!(
            s,
            "{:<22}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
            "latency (ms)", "p50", "p90", "p99", "p99.9", "max", "n"
        );
        for (name, p) in [
            ("ttft", l.ttft),
            ("ttft (uncorrected)", l.ttft_uncorrected),
            ("e2e", l.e2e),
            ("e2e (uncorrected)", l.e2e_uncorrected),
            ("itl", l.itl),
            ("tpot", l.tpot),
            ("schedule lag", l.schedule_lag),
        ] {
            let _ = writeln!(
                s,
                "{:<22}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10}",
                name, p.p50, p.p90, p.p99, p.p999, p.max, p.count
            );
        }
        if !self.errors.is_empty() {
            let list: Vec<String> = self
                .errors
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = writeln!(s, "errors     {}", list.join("  "));
        }
        for (title, groups) in [("tier", &self.per_tier), ("tenant", &self.per_tenant)] {
            if groups.len() > 1 {
                for (name, g) in groups {
                    let _ = writeln!(
                        s,
                        "{title:<7}{name:<16} requests {:>7}  success {:>8}  goodput {:>8.1}/s  p99 ttft {:>9.1} ms",
                        g.requests, pct(g.success_rate), g.goodput_rps, g.ttft.p99
                    );
                }
            }
        }
        if let Some(t) = &self.tasks {
            let list: Vec<String> = t.outcomes.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(
                s,
                "tasks      submitted {}  accepted {}  {}",
                t.submitted,
                t.accepted,
                list.join("  ")
            );
            let _ = writeln!(
                s,
                "task ETA   error p50 {:.2} s ({:.0}%)  p90 {:.2} s ({:.0}%)  over {} tasks; time to result p50 {:.0} ms p99 {:.0} ms",
                t.eta_abs_error_s.p50,
                t.eta_rel_error_pct.p50,
                t.eta_abs_error_s.p90,
                t.eta_rel_error_pct.p90,
                t.eta_samples,
                t.time_to_result.p50,
                t.time_to_result.p99
            );
        }
        for f in &self.faults {
            let _ = writeln!(
                s,
                "fault      t={:.1}s {} {} -> {}",
                f.at_s,
                f.action,
                f.url,
                f.status
                    .map(|c| c.to_string())
                    .or_else(|| f.error.clone())
                    .unwrap_or_default()
            );
        }
        s
    }
}

/// The headline figures of several runs side by side: per row, its name and one cell per
/// run (`None` where the run has no such figure, e.g. a tier it did not see).
pub fn compare_figures(runs: &[(&str, &Report)]) -> Vec<(String, Vec<Option<f64>>)> {
    type Row = (&'static str, fn(&Report) -> f64);
    let rows: &[Row] = &[
        ("offered req/s", |r| r.rates.offered_rps),
        ("sent req/s", |r| r.rates.sent_rps),
        ("attempts req/s", |r| r.rates.attempts_rps),
        ("ok req/s", |r| r.rates.ok_rps),
        ("goodput req/s", |r| r.rates.goodput_rps),
        ("goodput tok/s", |r| r.rates.goodput_tps),
        ("success %", |r| r.rates.success_rate * 100.0),
        ("ttft p50 ms", |r| r.latency.ttft.p50),
        ("ttft p99 ms", |r| r.latency.ttft.p99),
        ("ttft p99 uncorr. ms", |r| r.latency.ttft_uncorrected.p99),
        ("e2e p99 ms", |r| r.latency.e2e.p99),
        ("tpot p50 ms", |r| r.latency.tpot.p50),
        ("schedule lag p99 ms", |r| r.latency.schedule_lag.p99),
        ("429s", |r| r.rate_limited() as f64),
        ("5xx", |r| r.server_errors() as f64),
        ("timeouts", |r| {
            r.errors.get("timeout").copied().unwrap_or(0) as f64
        }),
        ("connect / broken", |r| {
            (r.errors_with_prefix("connect") + r.errors_with_prefix("broken_stream")) as f64
        }),
        ("cancelled", |r| r.errors_with_prefix("cancelled") as f64),
        ("retries", |r| r.totals.retries as f64),
    ];
    let mut out: Vec<(String, Vec<Option<f64>>)> = rows
        .iter()
        .map(|(name, f)| {
            (
                name.to_string(),
                runs.iter().map(|(_, r)| Some(f(r))).collect(),
            )
        })
        .collect();
    // Per-tier success, which is what an operator asks first after an incident.
    let mut tiers: Vec<&String> = runs.iter().flat_map(|(_, r)| r.per_tier.keys()).collect();
    tiers.sort();
    tiers.dedup();
    for tier in tiers {
        out.push((
            format!("success {tier} %"),
            runs.iter()
                .map(|(_, r)| r.per_tier.get(tier).map(|g| g.success_rate * 100.0))
                .collect(),
        ));
    }
    out
}

/// [`compare_figures`] with each cell as text (`-` where a run has no such figure).
pub fn compare_rows(runs: &[(&str, &Report)]) -> Vec<(String, Vec<String>)> {
    compare_figures(runs)
        .into_iter()
        .map(|(name, cells)| {
            let cells = cells
                .into_iter()
                .map(|c| c.map_or_else(|| "-".to_string(), |v| format!("{v:.2}")))
                .collect();
            (name, cells)
        })
        .collect()
}

/// The headline figures of several runs side by side, as a text table (`levee sim
/// compare`). The last column is the ratio of the last run to the first.
pub fn compare_table(runs: &[(&str, &Report)]) -> String {
    let mut s = String::new();
    let _ = write!(s, "{:<22}", "");
    for (label, _) in runs {
        let short: String = label.chars().take(15).collect();
        let _ = write!(s, "{short:>16}");
    }
    if runs.len() >= 2 {
        let _ = write!(s, "{:>12}", "last/first");
    }
    let _ = writeln!(s);
    for (name, cells) in compare_figures(runs) {
        let _ = write!(s, "{name:<22}");
        for c in &cells {
            match c {
                Some(v) => {
                    let _ = write!(s, "{v:>16.2}");
                }
                None => {
                    let _ = write!(s, "{:>16}", "-");
                }
            }
        }
        // The ratio of the last run to the first, except on the per-tier rows.
        let tier_row = name.starts_with("success ") && name != "success %";
        if let (false, [Some(a), .., Some(b)]) = (tier_row, cells.as_slice()) {
            if *a != 0.0 {
                let _ = write!(s, "{:>12.3}", b / a);
            } else {
                let _ = write!(s, "{:>12}", "-");
            }
        }
        let _ = writeln!(s);
    }
    s
}
