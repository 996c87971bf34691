//! The drill's tables, as text for the terminal and as HTML for the report page.

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

/// The verdicts as text: each target, then each contender's mark and figure.
pub(crate) fn render_verdicts(rows: &[VerdictRow], labels: &[&str]) -> String {
    let mut s = String::from("targets (MET / MISS per contender):\n");
    for r in rows {
        let _ = writeln!(s, "  {}", r.target);
        for (who, c) in labels.iter().zip(&r.checks) {
            let mark = match c.met {
                Some(true) => "MET ",
                Some(false) => "MISS",
                None => "    ",
            };
            let _ = writeln!(s, "    [{mark}] {who:<12} {}", c.measured);
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
        let t = verdicts::refusals_with_code(&o.report.errors, "queue_timeout");
        let all = o.report.rate_limited();
        if all == 0 {
            "0".into()
        } else {
            format!("{t} ({:.1}%)", 100.0 * t as f64 / all as f64)
        }
    });
    // A single tenant past its contract is refused by its own quota however idle the fleet:
    // told apart, so a low goodput is read for what it is.
    row("  of which tenants' own quotas", &|o| {
        verdicts::tenant_quota_refusals(&o.report.errors).to_string()
    });
    // Premium must not fail: what failed it, by cause (levee names the check that refused).
    row("premium failures, by cause", &|o| {
        o.report
            .per_tier
            .get("premium")
            .map_or_else(|| "-".into(), |g| by_cause(&g.errors))
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

/// The contenders side by side: a title, the contenders, and the rows.
pub(crate) struct Table {
    pub title: String,
    pub labels: Vec<String>,
    pub rows: Vec<Row>,
}

/// The contenders side by side.
pub(crate) fn side_by_side(
    scenario: &Scenario,
    sweep: &Sweep,
    runs: &[(Contender, Outcome)],
) -> Table {
    let mut rows = served_rows(runs);
    rows.extend(failure_rows(scenario, runs));
    Table {
        title: format!(
            "{}: {} (1x = the knee, {:.1} req/s)",
            scenario.name, scenario.description, sweep.knee_rps
        ),
        labels: runs.iter().map(|(w, _)| w.label().to_string()).collect(),
        rows,
    }
}

/// The side-by-side table as text.
pub(crate) fn text_table(t: &Table) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}\n", t.title);
    // Each column as wide as its longest cell and two spaces, at least 14.
    let widths: Vec<usize> = (0..t.labels.len())
        .map(|i| {
            let cells = t.rows.iter().filter_map(|(_, c)| c.get(i));
            std::iter::once(&t.labels[i])
                .chain(cells)
                .map(|c| c.chars().count() + 2)
                .fold(14, usize::max)
        })
        .collect();
    let _ = write!(s, "{:<30}", "");
    for (label, w) in t.labels.iter().zip(&widths) {
        let _ = write!(s, "{label:>w$}");
    }
    let _ = writeln!(s);
    for (name, cells) in &t.rows {
        let _ = write!(s, "{name:<30}");
        for (c, w) in cells.iter().zip(&widths) {
            let _ = write!(s, "{c:>w$}");
        }
        let _ = writeln!(s);
    }
    s
}

/// What the report page leads with.
pub(crate) struct Lead<'a> {
    pub labels: &'a [&'a str],
    pub rows: &'a [VerdictRow],
    pub suspect: Option<&'a str>,
    pub table: &'a Table,
    /// How the knee was measured, and the steps.
    pub method: &'a str,
    pub steps: &'a str,
}

/// The verdicts as an HTML table: targets down, contenders across, each cell MET or MISS in
/// colour with its figure.
fn verdict_html(labels: &[&str], rows: &[VerdictRow]) -> String {
    let esc = levee_sim::report::escape_html;
    let mut h = String::from("<table class=\"verdicts\"><thead><tr><th>target</th>");
    for l in labels {
        let _ = write!(h, "<th>{}</th>", esc(l));
    }
    h.push_str("</tr></thead><tbody>");
    for r in rows {
        let _ = write!(h, "<tr><th>{}</th>", esc(&r.target));
        for c in &r.checks {
            let (class, mark) = match c.met {
                Some(true) => ("met", "MET"),
                Some(false) => ("miss", "MISS"),
                None => ("info", ""),
            };
            let _ = write!(
                h,
                "<td class=\"{class}\"><b>{mark}</b> {}</td>",
                esc(&c.measured)
            );
        }
        h.push_str("</tr>");
    }
    h.push_str("</tbody></table>");
    h
}

/// The side-by-side table as HTML.
fn table_html(t: &Table) -> String {
    let esc = levee_sim::report::escape_html;
    let mut h = String::from("<table class=\"side\"><thead><tr><th></th>");
    for l in &t.labels {
        let _ = write!(h, "<th>{}</th>", esc(l));
    }
    h.push_str("</tr></thead><tbody>");
    for (name, cells) in &t.rows {
        let _ = write!(h, "<tr><th>{}</th>", esc(name.trim()));
        for c in cells {
            let _ = write!(h, "<td>{}</td>", esc(c));
        }
        h.push_str("</tr>");
    }
    h.push_str("</tbody></table>");
    h
}

/// The page's lead: verdicts, the suspect-reference warning, the side-by-side table, the
/// capacity measurement.
pub(crate) fn lead_html(lead: &Lead<'_>, scenario: &Scenario, knee: f64) -> String {
    let esc = levee_sim::report::escape_html;
    let style = "<style>table.verdicts,table.side{border-collapse:collapse;margin:0.5em 0 \
                 1.5em}table.verdicts th,table.verdicts td,table.side th,table.side td{border:\
                 1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}\
                 table.side td{text-align:right;font-variant-numeric:tabular-nums}\
                 td.met{background:#e3f6e3}td.met b{color:#17731f}td.miss{background:#fde4e4}\
                 td.miss b{color:#b3141a}.suspect{background:#fff3cd;border:1px solid #e0b100;\
                 padding:8px;font-weight:bold}</style>";
    let warning = lead.suspect.map_or(String::new(), |w| {
        format!("<p class=\"suspect\">Warning: {}</p>", esc(w))
    });
    format!(
        "{style}<p>{}: {} — 1x = the knee, {knee:.1} req/s.</p><h2>Verdicts</h2>{warning}{}\
         <h2>Side by side</h2>{}<h2>Capacity (the knee)</h2><p>{}</p><pre>{}</pre>\
         <p>Dashed lines: grey where the offered load changes (as a multiple of the knee), red \
         where an engine crashed. A line stops where its run has no data. In-process logs: \
         drill.log.</p>",
        esc(&scenario.name),
        esc(&scenario.description),
        verdict_html(lead.labels, lead.rows),
        table_html(lead.table),
        esc(lead.method),
        esc(lead.steps)
    )
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

/// Failures by kind, the three largest first (`429:` dropped: the row says what refused):
/// `capacity_overload:predicted_wait 3, timeout 1`; `0` when none.
fn by_cause(errors: &std::collections::BTreeMap<String, u64>) -> String {
    let mut kinds: Vec<(&String, &u64)> = errors.iter().filter(|(_, n)| **n > 0).collect();
    if kinds.is_empty() {
        return "0".into();
    }
    kinds.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let mut out: Vec<String> = kinds
        .iter()
        .take(3)
        .map(|(k, n)| format!("{} {n}", cause(k)))
        .collect();
    let rest: u64 = kinds.iter().skip(3).map(|(_, n)| **n).sum();
    if rest > 0 {
        out.push(format!("other {rest}"));
    }
    out.join(", ")
}

/// An error key as a cause: a 429 by the check levee named (`429:rate_limit_exceeded:
/// tenant_requests` → `tenant_requests`: each check belongs to one code), else by its code.
fn cause(key: &str) -> &str {
    match verdicts::refusal(key) {
        Some((code, check)) => check.unwrap_or(code),
        None => key,
    }
}

fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_table_has_a_coloured_cell_per_contender_and_target() {
        let rows = [VerdictRow {
            target: "goodput <≥ 95%>".into(),
            checks: vec![
                Check {
                    measured: "1.0 req/s".into(),
                    met: Some(false),
                },
                Check {
                    measured: "9.9 req/s".into(),
                    met: Some(true),
                },
                Check {
                    measured: "2.0×".into(),
                    met: None,
                },
            ],
        }];
        let h = verdict_html(&["unprotected", "capped", "levee"], &rows);
        assert!(
            h.contains("<th>unprotected</th><th>capped</th><th>levee</th>"),
            "{h}"
        );
        assert!(
            h.contains("<td class=\"miss\"><b>MISS</b> 1.0 req/s</td>"),
            "{h}"
        );
        assert!(
            h.contains("<td class=\"met\"><b>MET</b> 9.9 req/s</td>"),
            "{h}"
        );
        assert!(h.contains("<td class=\"info\"><b></b> 2.0×</td>"), "{h}");
        assert!(h.contains("goodput &lt;≥ 95%&gt;"), "{h}");
        let t = Table {
            title: String::new(),
            labels: vec!["a".into()],
            rows: vec![("  429s".into(), vec!["3".into()])],
        };
        assert!(table_html(&t).contains("<tr><th>429s</th><td>3</td></tr>"));
    }

    #[test]
    fn a_long_cell_widens_its_column_instead_of_running_into_the_next() {
        let t = Table {
            title: "t".into(),
            labels: vec!["a".into(), "b".into()],
            rows: vec![(
                "causes".into(),
                vec![
                    "5xx:503 172".into(),
                    "rate_limit_exceeded:tenant_requests 68".into(),
                ],
            )],
        };
        let text = text_table(&t);
        assert!(
            text.contains("   5xx:503 172  rate_limit_exceeded:tenant_requests 68"),
            "{text}"
        );
    }

    #[test]
    fn failures_by_cause_name_the_largest_first_and_sum_the_rest() {
        let errors = |kinds: &[(&str, u64)]| {
            kinds
                .iter()
                .map(|(k, n)| (k.to_string(), *n))
                .collect::<std::collections::BTreeMap<_, _>>()
        };
        assert_eq!(by_cause(&errors(&[])), "0");
        assert_eq!(by_cause(&errors(&[("timeout", 0)])), "0");
        assert_eq!(
            by_cause(&errors(&[
                ("timeout", 1),
                ("429:capacity_overload:predicted_wait", 3),
                ("429:queue_timeout:queue_timeout", 2),
                ("5xx:503", 1),
                ("broken_stream", 4),
            ])),
            "broken_stream 4, predicted_wait 3, queue_timeout 2, other 2"
        );
    }
}
