//! The self-contained HTML report: tables and inline SVG charts (drawn with plotters), no
//! script, no external resource, so it opens offline and can be attached to an incident.

use crate::report::Report;
use anyhow::Context;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;

type Series = (String, Vec<(f64, f64)>);

/// A vertical line across every chart of a page: where the offered load changes phase, or
/// where a fault hit (e.g. an engine crash).
#[derive(Debug, Clone, PartialEq)]
pub struct Marker {
    /// Seconds from the start of the run.
    pub at_s: f64,
    /// Short text drawn by the line.
    pub label: String,
    /// A fault (drawn red) rather than a phase change (drawn grey).
    pub fault: bool,
}

/// What a page shows besides the runs: an HTML section placed first (e.g. a drill's verdicts
/// and side-by-side table, already escaped) and markers on every chart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Page {
    /// Page title.
    pub title: Option<String>,
    /// HTML inserted right after the title.
    pub lead_html: String,
    /// Vertical lines on every chart.
    pub markers: Vec<Marker>,
    /// More lines on the charts of one run only (by position in the runs), e.g. the crashes
    /// that run saw.
    pub run_markers: Vec<Vec<Marker>>,
}

const WIDTH: u32 = 900;
const HEIGHT: u32 = 320;

/// Draws one line chart as an SVG string. Empty series are skipped; an all-empty chart
/// still draws its axes so the page layout stays the same.
fn line_chart(
    title: &str,
    y_desc: &str,
    series: &[Series],
    markers: &[Marker],
) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("cannot draw chart {title:?}: {e}");
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let x_max = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.0))
            .fold(1.0f64, f64::max);
        let y_max = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.1))
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);
        let y_max = if y_max <= 0.0 { 1.0 } else { y_max * 1.1 };
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc(y_desc)
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(|e| err(&e))?;
        for m in markers.iter().filter(|m| m.at_s >= 0.0 && m.at_s <= x_max) {
            let color = if m.fault {
                RED.mix(0.8)
            } else {
                BLACK.mix(0.35)
            };
            chart
                .draw_series(DashedLineSeries::new(
                    [(m.at_s, 0.0), (m.at_s, y_max)],
                    6,
                    4,
                    color.stroke_width(1),
                ))
                .map_err(|e| err(&e))?;
            chart
                .draw_series(std::iter::once(Text::new(
                    m.label.clone(),
                    (m.at_s, y_max * 0.97),
                    ("sans-serif", 11).into_font().color(&color),
                )))
                .map_err(|e| err(&e))?;
        }
        for (i, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            // One line per stretch with data: no straight line across a gap.
            for (k, stretch) in stretches(points).into_iter().enumerate() {
                let drawn = chart
                    .draw_series(LineSeries::new(stretch, color.stroke_width(2)))
                    .map_err(|e| err(&e))?;
                if k == 0 {
                    drawn.label(name.as_str()).legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    });
                }
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

/// The points split where the series has no data: wherever the step to the next point is
/// over 1.5 times the series' usual step (its median).
fn stretches(points: &[(f64, f64)]) -> Vec<Vec<(f64, f64)>> {
    let mut steps: Vec<f64> = points.windows(2).map(|w| w[1].0 - w[0].0).collect();
    steps.sort_by(f64::total_cmp);
    let usual = steps.get(steps.len() / 2).copied().unwrap_or(1.0);
    let mut out: Vec<Vec<(f64, f64)>> = Vec::new();
    for (i, &p) in points.iter().enumerate() {
        let gap = i > 0 && p.0 - points[i - 1].0 > 1.5 * usual;
        match out.last_mut() {
            Some(last) if !gap => last.push(p),
            _ => out.push(vec![p]),
        }
    }
    out
}

fn per_second(r: &Report, f: fn(&crate::report::Second) -> f64) -> Vec<(f64, f64)> {
    r.timeseries
        .iter()
        .map(|s| (f64::from(s.t), f(s)))
        .collect()
}

/// Like [`per_second`], without the seconds that had no sample (a latency of 0 there would
/// draw a false dip).
fn per_second_present(r: &Report, f: fn(&crate::report::Second) -> f64) -> Vec<(f64, f64)> {
    per_second(r, f).into_iter().filter(|p| p.1 > 0.0).collect()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn run_section(
    out: &mut String,
    label: &str,
    r: &Report,
    markers: &[Marker],
) -> anyhow::Result<()> {
    let _ = writeln!(
        out,
        "<h2>{}</h2><p>{} — seed {}, target {}, started {}, client <b>{}</b></p>",
        escape(label),
        escape(&r.description),
        r.seed,
        escape(&r.target),
        escape(&r.started_at),
        escape(&r.client)
    );
    let _ = writeln!(out, "<pre>{}</pre>", escape(&r.summary()));
    out.push_str(&line_chart(
        "Offered, sent, admitted and goodput",
        "requests / s",
        &[
            ("offered".into(), per_second(r, |s| s.offered as f64)),
            (
                "attempts (with retries)".into(),
                per_second(r, |s| s.attempts as f64),
            ),
            (
                "admitted (2xx)".into(),
                per_second(r, |s| s.admitted as f64),
            ),
            ("ok".into(), per_second(r, |s| s.ok as f64)),
            ("goodput (met SLO)".into(), per_second(r, |s| s.good as f64)),
        ],
        markers,
    )?);
    out.push_str(&line_chart(
        "Latency percentiles (from intended send time)",
        "ms",
        &[
            ("TTFT p50".into(), per_second_present(r, |s| s.ttft_p50)),
            ("TTFT p99".into(), per_second_present(r, |s| s.ttft_p99)),
            ("e2e p50".into(), per_second_present(r, |s| s.e2e_p50)),
            ("e2e p99".into(), per_second_present(r, |s| s.e2e_p99)),
            (
                "schedule lag p99".into(),
                per_second_present(r, |s| s.lag_p99),
            ),
        ],
        markers,
    )?);
    out.push_str(&line_chart(
        "Errors by kind",
        "requests / s",
        &[
            ("429".into(), per_second(r, |s| s.rate_limited as f64)),
            ("5xx".into(), per_second(r, |s| s.server_errors as f64)),
            ("timeouts".into(), per_second(r, |s| s.timeouts as f64)),
            (
                "connection".into(),
                per_second(r, |s| s.connect_errors as f64),
            ),
            ("other".into(), per_second(r, |s| s.other_errors as f64)),
        ],
        markers,
    )?);
    let mut names: Vec<&str> = r.metrics.iter().map(|m| m.name.as_str()).collect();
    names.sort();
    names.dedup();
    for name in names {
        let series: Vec<Series> = r
            .metrics
            .iter()
            .filter(|m| m.name == name)
            .map(|m| {
                (
                    m.source.clone(),
                    m.points.iter().map(|p| (p[0], p[1])).collect(),
                )
            })
            .collect();
        out.push_str(&line_chart(name, name, &series, markers)?);
    }
    if !r.errors.is_empty() {
        out.push_str("<table><tr><th>error</th><th>count</th></tr>");
        for (k, v) in &r.errors {
            let _ = write!(out, "<tr><td>{}</td><td>{v}</td></tr>", escape(k));
        }
        out.push_str("</table>");
    }
    if let Some(t) = &r.tasks {
        let _ = write!(
            out,
            "<h3>Async tasks</h3><table><tr><th>submitted</th><th>accepted</th>{}<th>ETA error p50</th><th>ETA error p90</th><th>time to result p50</th></tr><tr><td>{}</td><td>{}</td>{}<td>{:.2} s ({:.0}%)</td><td>{:.2} s ({:.0}%)</td><td>{:.0} ms</td></tr></table>",
            t.outcomes
                .keys()
                .map(|k| format!("<th>{}</th>", escape(k)))
                .collect::<String>(),
            t.submitted,
            t.accepted,
            t.outcomes
                .values()
                .map(|v| format!("<td>{v}</td>"))
                .collect::<String>(),
            t.eta_abs_error_s.p50,
            t.eta_rel_error_pct.p50,
            t.eta_abs_error_s.p90,
            t.eta_rel_error_pct.p90,
            t.time_to_result.p50,
        );
    }
    Ok(())
}

/// The runs' headline figures as an HTML table (the rows of [`compare_table`]).
fn compare_html(runs: &[(&str, &Report)]) -> String {
    let mut h = String::from("<table><tr><th></th>");
    for (label, _) in runs {
        let _ = write!(h, "<th>{}</th>", escape(label));
    }
    h.push_str("</tr>");
    for (name, cells) in crate::report::compare_rows(runs) {
        let _ = write!(h, "<tr><th>{}</th>", escape(&name));
        for c in cells {
            let _ = write!(h, "<td>{}</td>", escape(&c));
        }
        h.push_str("</tr>");
    }
    h.push_str("</table>");
    h
}

/// Writes an HTML page for one or more runs. With several runs, the page starts with the
/// side-by-side table and charts that overlay the runs' goodput and p99 TTFT, then shows
/// each run in full.
pub fn write_html(runs: &[(&str, &Report)], path: &Path) -> anyhow::Result<()> {
    write_page(runs, &Page::default(), path)
}

/// Escapes text for HTML (for a [`Page::lead_html`] built from plain text).
pub fn escape_html(s: &str) -> String {
    escape(s)
}

/// [`write_html`] with a lead section first and markers on every chart.
pub fn write_page(runs: &[(&str, &Report)], page: &Page, path: &Path) -> anyhow::Result<()> {
    let mut out = String::new();
    let markers = &page.markers[..];
    let title = match &page.title {
        Some(t) => escape(t),
        None => format!(
            "levee sim: {}",
            runs.iter()
                .map(|(l, _)| escape(l))
                .collect::<Vec<_>>()
                .join(" vs ")
        ),
    };
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title>\
         <style>body{{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}}\
         pre{{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}}\
         table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}\
         svg{{display:block;margin:1em 0}}</style></head><body><h1>{title}</h1>"
    );
    out.push_str(&page.lead_html);
    if runs.len() > 1 {
        let _ = writeln!(
            out,
            "<h2>Side by side: every run</h2>{}",
            compare_html(runs)
        );
        let overlay = |f: fn(&crate::report::Second) -> f64| -> Vec<Series> {
            runs.iter()
                .map(|(l, r)| (l.to_string(), per_second(r, f)))
                .collect()
        };
        out.push_str(&line_chart(
            "Goodput (requests meeting the SLO)",
            "requests / s",
            &overlay(|s| s.good as f64),
            markers,
        )?);
        out.push_str(&line_chart(
            "TTFT p99 (from intended send time)",
            "ms",
            &runs
                .iter()
                .map(|(l, r)| (l.to_string(), per_second_present(r, |s| s.ttft_p99)))
                .collect::<Vec<_>>(),
            markers,
        )?);
    }
    for (i, (label, r)) in runs.iter().enumerate() {
        let mut own = markers.to_vec();
        own.extend(page.run_markers.get(i).into_iter().flatten().cloned());
        run_section(&mut out, label, r, &own)?;
    }
    out.push_str("</body></html>\n");
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create directory {}", dir.display()))?;
    }
    std::fs::write(path, out).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_series_is_split_where_it_has_no_data() {
        let points = [(0.0, 1.0), (1.0, 2.0), (2.0, 2.0), (6.0, 3.0), (7.0, 1.0)];
        let s = stretches(&points);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].len(), 3);
        assert_eq!(s[1], vec![(6.0, 3.0), (7.0, 1.0)]);
        assert_eq!(stretches(&[(0.0, 1.0)]).len(), 1);
        assert!(stretches(&[]).is_empty());
    }
}
