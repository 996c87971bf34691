//! The drill's tables as text.

use crate::capacity::Sweep;
use crate::contender::{Contender, Outcome};
use crate::verdicts::{self, Check};
use levee_sim::report::Report;
use levee_sim::Scenario;
use std::fmt::Write as _;

/// A row of the verdict table: a target and each contender's check.
pub(crate) struct VerdictRow {
    pub target: String,
    pub checks: Vec<Check>,
}

pub(crate) fn render_verdicts(rows: &[VerdictRow]) -> String {
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

/// A row of the side-by-side table: a name and one cell per contender.
pub(crate) type Row = (String, Vec<String>);

/// The side-by-side rows of what was served: rates, success, latency.
fn served_rows(runs: &[(Contender, Outcome)]) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
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
    rows
}

/// The side-by-side rows of what went wrong: crashes, refusals, errors.
fn failure_rows(scenario: &Scenario, runs: &[(Contender, Outcome)]) -> Vec<Row> {
    let mut rows: Vec<Row> = Vec::new();
    let mut row = |name: &str, f: &dyn Fn(&Outcome) -> String| {
        rows.push((name.to_string(), runs.iter().map(|(_, o)| f(o)).collect()));
    };
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
    row("invalid requests (engine 4xx)", &|o| {
        verdicts::engine_client_errors(&o.report.errors).to_string()
    });
    row("levee's own 4xx (not 429)", &|o| {
        verdicts::levee_client_errors(&o.report.errors).to_string()
    });
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

    rows
}

/// The contenders side by side, as text.
pub(crate) fn side_by_side(
    scenario: &Scenario,
    sweep: &Sweep,
    runs: &[(Contender, Outcome)],
) -> String {
    let mut rows = served_rows(runs);
    rows.extend(failure_rows(scenario, runs));
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
