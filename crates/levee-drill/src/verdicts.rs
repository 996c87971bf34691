//! The drill's verdicts: pure functions of run reports and independently measured
//! references, so that each can be shown failing on a synthetic report.
//!
//! - **goodput**: requests meeting the SLO per second during the flood (the seconds in which
//!   the scenario offers at least [`FLOOD_FACTOR`] × the knee, after the first seconds of
//!   each flood stretch, and outside the time an injected fault holds an engine down),
//!   against the knee measured without levee: met at ≥ 95%.
//! - **crashes**: engine crashes caused by overload (all crashes minus injected ones): met at 0.
//! - **premium**: premium requests that succeeded, over those within the premium tenants'
//!   quota: met at ≥ 99.9%. A request refused as over quota (429 `rate_limit_exceeded`) is
//!   excused only up to the number a client-side rate check of the schedule finds over the
//!   configured quota, so a gateway cannot excuse its own failures by calling them over quota.
//!   A 4xx other than 429 that the engine itself returned for an invalid request (e.g. a
//!   context overflow) leaves the denominator; a 4xx levee produced (its answer carries
//!   `x-levee-error-origin`, recorded as `4xx:<status>:levee`) is never excused.
//! - **isolation**: the quiet tenants' success within 1 point of a calm run (the same
//!   traffic with the flooder at its normal rate) and their p99 TTFT at most 10% above it,
//!   against the calm run through the same contender and against every baseline's calm run
//!   (measured without levee) that served the quiet tenants: one whose p99 is infinite
//!   failed them itself and vouches for nothing, so it is stated and set aside. A contender
//!   whose own calm run failed them misses. A failed request counts as an infinitely late
//!   first token: with `k` failures in `n`, the p99 is the request at rank `ceil(0.99 n)`
//!   with the failures placed last, infinite when that rank falls among them. Each p99 is
//!   stated with its distribution-free 95% interval (the verdict reads the p99 itself).
//! - **flooder's share**: a flooder's goodput over the run at least an equal share of its
//!   tier's (the scenario's tenants of its tier): isolation not bought by starving it.
//! - **suspect reference**: when a contender's flood goodput exceeds the knee by more than
//!   [`SUSPECT_MARGIN`], the knee is not the best a protected fleet achieves, and the drill
//!   says so instead of printing a triumph.
//! - **retry amplification**: attempts per scheduled request, stated for every contender.

use levee_sim::report::{Group, Report, Second};
use std::fmt::Write as _;

/// The flood is where the scenario offers at least this multiple of the knee.
pub const FLOOD_FACTOR: f64 = 1.5;
/// Goodput during the flood must reach this share of the knee.
pub const GOODPUT_TARGET: f64 = 0.95;
/// Premium success target over its in-quota requests.
pub const PREMIUM_TARGET: f64 = 0.999;
/// Largest fall of the quiet tenants' success rate, in points (as a fraction).
pub const ISOLATION_SUCCESS_POINTS: f64 = 0.01;
/// Largest rise of the quiet tenants' p99 TTFT, as a fraction of the calm run's.
pub const ISOLATION_TTFT_RISE: f64 = 0.10;

/// One contender's result on one target.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// The figure, in words.
    pub measured: String,
    /// Whether the target is met; `None` when the row only states a figure.
    pub met: Option<bool>,
}

impl Check {
    fn judged(measured: String, met: bool) -> Self {
        Self {
            measured,
            met: Some(met),
        }
    }
}

/// Seconds of the run (by index into the report's timeseries) over which flood goodput is
/// measured.
///
/// `offered_at(t)` is the scenario's offered rate at `t` seconds; a second is in the window
/// when the offered rate at its middle is at least [`FLOOD_FACTOR`] × `knee_rps`, it is not
/// among the first `warm_s` seconds of a flood stretch, and it does not overlap any of the
/// `down` intervals (start, end in seconds) in which an injected fault holds an engine down.
pub fn flood_window(
    duration_s: f64,
    offered_at: &dyn Fn(f64) -> f64,
    knee_rps: f64,
    warm_s: f64,
    down: &[(f64, f64)],
) -> Vec<u32> {
    let mut window = Vec::new();
    let mut stretch_start: Option<f64> = None;
    let seconds = duration_s.ceil().max(0.0) as u32;
    for s in 0..seconds {
        let (a, b) = (f64::from(s), f64::from(s) + 1.0);
        if offered_at(a + 0.5) < FLOOD_FACTOR * knee_rps {
            stretch_start = None;
            continue;
        }
        let started = *stretch_start.get_or_insert(a);
        let warm = a < started + warm_s;
        let held_down = down.iter().any(|&(from, to)| a < to && b > from);
        if !warm && !held_down {
            window.push(s);
        }
    }
    window
}

/// Requests meeting the SLO per second over `window` (a second missing from the report's
/// timeseries counts as zero); `None` for an empty window.
pub fn window_goodput(report: &Report, window: &[u32]) -> Option<f64> {
    window_mean(report, window, |s| s.good)
}

/// The mean per second of one of the report's per-second counts over `window` (a second
/// missing from the timeseries counts 0); `None` for an empty window.
pub fn window_mean(report: &Report, window: &[u32], count: fn(&Second) -> u64) -> Option<f64> {
    if window.is_empty() {
        return None;
    }
    let sum: u64 = window
        .iter()
        .map(|&t| report.timeseries.iter().find(|s| s.t == t).map_or(0, count))
        .sum();
    Some(sum as f64 / window.len() as f64)
}

/// Goodput during the flood against the knee: met at `target` (a share of the knee,
/// [`GOODPUT_TARGET`] for simulated engines).
pub fn goodput(report: &Report, window: &[u32], knee_rps: f64, target: f64) -> Option<Check> {
    let g = window_goodput(report, window)?;
    let ratio = if knee_rps > 0.0 { g / knee_rps } else { 0.0 };
    // Rounded down to a tenth of a point: a share just under the target never reads as
    // the target itself beside a MISS.
    let pct = (ratio * 1000.0).floor() / 10.0;
    Some(Check::judged(
        format!("{g:.1} req/s = {pct:.1}%"),
        ratio >= target,
    ))
}

/// Overload crashes (injected ones are stated apart and never count).
pub fn crashes(total: u64, injected: u64) -> Check {
    let overload = total.saturating_sub(injected);
    let measured = if injected > 0 {
        format!("{overload} (+{injected} injected)")
    } else {
        overload.to_string()
    };
    Check::judged(measured, overload == 0)
}

/// Independent counts of the premium requests a gateway may rightly refuse, from the
/// schedule: over the tenant's quota, and too long for the engines' context.
#[derive(Debug, Clone, Copy)]
pub struct PremiumExcuses {
    /// Premium requests a rate check of the schedule finds over quota.
    pub over_quota: u64,
    /// Premium requests whose prompt and `max_tokens` exceed the engines' context.
    pub over_context: u64,
}

/// Premium success over its in-quota requests.
pub fn premium(report: &Report, excuses: PremiumExcuses) -> Option<Check> {
    let g = report.per_tier.get("premium")?;
    if g.requests == 0 {
        return None;
    }
    let refused_as_over_quota = refusals_with_code(&g.errors, "rate_limit_exceeded");
    let excused = refused_as_over_quota.min(excuses.over_quota);
    // An invalid request the engine itself refused is the client's fault, not the fleet's;
    // so is one levee refused itself, as far as the schedule has requests too long for the
    // engines that the engines did not refuse. Beyond that count, levee's own 4xx is the
    // gateway's failure.
    let by_engine = engine_client_errors(&g.errors);
    let by_levee =
        levee_client_errors(&g.errors).min(excuses.over_context.saturating_sub(by_engine));
    let invalid = by_engine + by_levee;
    let in_quota = g.requests.saturating_sub(excused + invalid);
    let rate = if in_quota == 0 {
        1.0
    } else {
        (g.ok as f64 / in_quota as f64).min(1.0)
    };
    Some(Check::judged(
        format!("{:.2}% of {in_quota}", rate * 100.0),
        rate >= PREMIUM_TARGET,
    ))
}

/// The p99 TTFT of a group where a failed request counts as an infinitely late first
/// token. With `k` failures among `n` requests, the failures are placed last and the p99 is
/// the request at rank `ceil(0.99 n)` (from 1) of all `n`: infinite when that rank falls
/// among the failures, else the success at that rank, read from the group's slowest
/// successes (`ttft_slowest_ms`; a report without them gives the slowest success, an upper
/// bound).
pub fn p99_ttft_counting_failures(g: &Group) -> f64 {
    let n = g.requests;
    let successes = g.ttft.count.min(n);
    let rank = (99 * n).div_ceil(100);
    if n == 0 || rank > successes {
        return f64::INFINITY;
    }
    let from_top = (successes - rank) as usize;
    g.ttft_slowest_ms
        .get(from_top)
        .copied()
        .unwrap_or(g.ttft.max)
}

/// The 99th percentile's distribution-free 95% interval for [`p99_ttft_counting_failures`]:
/// the requests at ranks `0.99 n ∓ 1.96 √(0.99 · 0.01 · n)` (rounded outwards, the upper one
/// rank further: the count of requests below the true percentile is binomial), failures
/// last as infinitely late. The upper end is `None` when that rank lies past the last
/// request — the sample then bounds the percentile only from below (below about 560
/// requests) — and infinite when it falls among the failures. `None` when the report
/// does not keep the slowest requests that far down (reports of older builds).
fn p99_interval_counting_failures(g: &Group) -> Option<(f64, Option<f64>)> {
    let n = g.requests;
    if n == 0 {
        return None;
    }
    let successes = g.ttft.count.min(n);
    let mean = 0.99 * n as f64;
    let spread = 1.96 * (mean * 0.01).sqrt();
    let low_rank = ((mean - spread).floor() as u64).max(1);
    let high_rank = (mean + spread).ceil() as u64 + 1;
    // The successful request at `rank` (from 1, ascending), failures placed last.
    let at = |rank: u64| -> Option<f64> {
        if rank > successes {
            return Some(f64::INFINITY);
        }
        g.ttft_slowest_ms.get((successes - rank) as usize).copied()
    };
    let low = at(low_rank)?;
    let high = if high_rank > n {
        None
    } else {
        Some(at(high_rank)?)
    };
    Some((low, high))
}

/// A p99 in words, with its 95% interval when the report allows one: `3709 ms [3412–4135+]`,
/// a `+` where the interval reaches past the slowest request (a success: past a failure the
/// end is `∞`). An infinite p99 has no interval to state.
fn p99_text(p99: f64, g: &Group) -> String {
    if !p99.is_finite() {
        return "∞ (failures)".into();
    }
    let bound = |v: f64| {
        if v.is_finite() {
            format!("{v:.0}")
        } else {
            "∞".into()
        }
    };
    let failures = g.ttft.count < g.requests;
    match p99_interval_counting_failures(g) {
        Some((low, Some(high))) => format!("{p99:.0} ms [{}–{}]", bound(low), bound(high)),
        Some((low, None)) if failures => format!("{p99:.0} ms [{}–∞]", bound(low)),
        Some((low, None)) => {
            let slowest = g.ttft_slowest_ms.first().copied().unwrap_or(g.ttft.max);
            format!("{p99:.0} ms [{}–{}+]", bound(low), bound(slowest))
        }
        None => format!("{p99:.0} ms"),
    }
}

/// Whether the quiet tenants (`flood`) kept the success and p99 TTFT of a `calm` run (both
/// p99s counting failures as infinitely late).
pub fn isolation(calm: &Group, flood: &Group) -> Check {
    let before = p99_ttft_counting_failures(calm);
    let after = p99_ttft_counting_failures(flood);
    if !before.is_finite() || before <= 0.0 {
        return Check::judged(
            format!(
                "no calm reference (the calm run's p99 is ∞: {:.1}% succeeded)",
                calm.success_rate * 100.0
            ),
            false,
        );
    }
    let fell = calm.success_rate - flood.success_rate;
    let success_ok = fell <= ISOLATION_SUCCESS_POINTS + 1e-12;
    let ttft_ok = after <= before * (1.0 + ISOLATION_TTFT_RISE);
    let rise = if after.is_finite() {
        format!(" ({:+.0}%)", (after / before - 1.0) * 100.0)
    } else {
        String::new()
    };
    Check::judged(
        format!(
            "success {:.1}→{:.1}%, p99 TTFT {}→{}{rise}",
            calm.success_rate * 100.0,
            flood.success_rate * 100.0,
            p99_text(before, calm),
            p99_text(after, flood),
        ),
        success_ok && ttft_ok,
    )
}

/// [`isolation`] against the contender's `own` calm run and each of the `baselines`' calm
/// runs (label, quiet group) that served the quiet tenants (a finite p99 counting failures
/// last); the others are stated as no reference. Met when every judged reference is met.
pub fn isolation_against(own: &Group, baselines: &[(&str, &Group)], flood: &Group) -> Check {
    let mine = isolation(own, flood);
    let mut met = mine.met == Some(true);
    let mut measured = format!("vs its own calm run: {}", mine.measured);
    for (who, calm) in baselines {
        if p99_ttft_counting_failures(calm).is_finite() {
            let c = isolation(calm, flood);
            met &= c.met == Some(true);
            let _ = write!(measured, "; vs the {who} calm run: {}", c.measured);
        } else {
            let _ = write!(
                measured,
                "; the {who} calm run is no reference ({:.1}% of the quiet requests succeeded)",
                calm.success_rate * 100.0
            );
        }
    }
    Check::judged(measured, met)
}

/// Whether `flooder` was served at least an equal share of its tier's goodput over the run
/// (`tier`: the tier's tenants, itself included): its neighbours' isolation must not be
/// bought by starving it. A tenant that sends less than an equal share leaves the rest to the
/// others, so a flooder beside quiet neighbours gets more than that; one held below it while
/// they got theirs was held back for them. Stated without a verdict when its tier served
/// nothing.
pub fn flooder_share(report: &Report, flooder: &str, tier: &[String]) -> Check {
    let goodput = |t: &str| report.per_tenant.get(t).map_or(0.0, |g| g.goodput_rps);
    let total: f64 = tier.iter().map(|t| goodput(t)).sum();
    let mine = goodput(flooder);
    if total <= 0.0 || tier.is_empty() {
        return Check {
            measured: format!("{mine:.2} req/s (its tier served nothing)"),
            met: None,
        };
    }
    let equal = 1.0 / tier.len() as f64;
    let others: Vec<f64> = tier
        .iter()
        .filter(|t| *t != flooder)
        .map(|t| goodput(t))
        .collect();
    let range = match (
        others.iter().copied().reduce(f64::min),
        others.iter().copied().reduce(f64::max),
    ) {
        (Some(lo), Some(hi)) => format!("; the others {lo:.2}–{hi:.2} each"),
        _ => String::new(),
    };
    Check::judged(
        format!(
            "{mine:.2} req/s = {:.0}% of its tier's {total:.2} (an equal share: {:.0}%){range}",
            100.0 * mine / total,
            100.0 * equal
        ),
        mine / total >= equal - 1e-9,
    )
}

/// A contender whose flood goodput beats the knee by more than this is evidence that the
/// knee is not the best a protected fleet achieves.
pub const SUSPECT_MARGIN: f64 = 0.05;

/// The warning the drill prints instead of a triumph when a contender's flood goodput
/// exceeds the knee by more than [`SUSPECT_MARGIN`]; `None` when every contender is within
/// it. `flood` holds each contender's label and flood goodput (req/s).
pub fn suspect_reference(knee_rps: f64, flood: &[(&str, Option<f64>)]) -> Option<String> {
    let over: Vec<String> = flood
        .iter()
        .filter_map(|&(who, g)| {
            let g = g?;
            (g > knee_rps * (1.0 + SUSPECT_MARGIN))
                .then(|| format!("{who} {g:.1} req/s = {:.0}%", 100.0 * g / knee_rps))
        })
        .collect();
    (!over.is_empty()).then(|| {
        format!(
            "the reference is suspect: {} of the knee ({knee_rps:.1} req/s) in the flood, more \
             than {:.0}% above the best the capped sweep found; the knee understates this \
             fleet's capacity, so goodput percentages against it overstate",
            over.join(", "),
            SUSPECT_MARGIN * 100.0
        )
    })
}

/// Requests that failed with a 4xx other than 429 which the server behind the target
/// returned for an invalid request (e.g. a context overflow): the key `4xx:<status>`. A 4xx
/// levee produced itself (`4xx:<status>:levee`) is not among them.
pub fn engine_client_errors(errors: &std::collections::BTreeMap<String, u64>) -> u64 {
    count_where(errors, |k| k.starts_with("4xx:") && !k.ends_with(":levee"))
}

/// A 429's error key read: `429:<code>`, or `429:<code>:<check>` when levee named the
/// check that refused. `None` for any other key.
pub fn refusal(key: &str) -> Option<(&str, Option<&str>)> {
    let rest = key.strip_prefix("429:")?;
    Some(match rest.split_once(':') {
        Some((code, check)) => (code, Some(check)),
        None => (rest, None),
    })
}

/// The errors counted under the keys `keep` takes.
fn count_where(
    errors: &std::collections::BTreeMap<String, u64>,
    keep: impl Fn(&str) -> bool,
) -> u64 {
    errors
        .iter()
        .filter(|(k, _)| keep(k))
        .map(|(_, v)| *v)
        .sum()
}

/// 429s with error code `code`, whether or not levee named the check.
pub fn refusals_with_code(errors: &std::collections::BTreeMap<String, u64>, code: &str) -> u64 {
    count_where(errors, |k| refusal(k).is_some_and(|(c, _)| c == code))
}

/// 429s levee answered by a tenant's own quota (its request or token rate, its
/// concurrency, or its heavy requests' share: the check levee names starts `tenant_` or
/// `heavy_`): a contract the gateway keeps, not capacity it lacks.
pub fn tenant_quota_refusals(errors: &std::collections::BTreeMap<String, u64>) -> u64 {
    count_where(errors, |k| {
        refusal(k)
            .and_then(|(_, check)| check)
            .is_some_and(|check| check.starts_with("tenant_") || check.starts_with("heavy_"))
    })
}

/// 4xx answers other than 429 that levee produced itself (excused in the premium verdict
/// only as far as the schedule has requests too long for the engines: [`premium`]).
pub fn levee_client_errors(errors: &std::collections::BTreeMap<String, u64>) -> u64 {
    count_where(errors, |k| k.starts_with("4xx:") && k.ends_with(":levee"))
}

/// With engines that preempt instead of crashing, overload shows as slowness: the p99 TTFT
/// of the requests served against the scenario's TTFT objective. `None` when nothing was
/// served.
pub fn ttft_within_slo(report: &Report, slo_ms: f64) -> Option<Check> {
    let t = report.latency.ttft;
    (t.count > 0).then(|| {
        Check::judged(
            format!("{:.0} ms (of {} served)", t.p99, t.count),
            t.p99 <= slo_ms,
        )
    })
}

/// Attempts per scheduled request (1.0 = no retry).
pub fn amplification(report: &Report) -> Check {
    let a = if report.totals.scheduled > 0 {
        report.totals.attempts as f64 / report.totals.scheduled as f64
    } else {
        0.0
    };
    Check {
        measured: format!("{a:.2}×"),
        met: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_sim::report::{slowest_kept, Percentiles, Second};

    pub(crate) fn report_with(seconds: Vec<Second>) -> Report {
        Report {
            schema: levee_sim::report::SCHEMA.into(),
            scenario: "synthetic".into(),
            description: String::new(),
            seed: 1,
            target: "http://127.0.0.1:1".into(),
            started_at: String::new(),
            duration_s: seconds.len() as f64,
            wall_s: seconds.len() as f64,
            client: "none".into(),
            slo: levee_sim::report::SloSpec {
                ttft_ms: Some(2000.0),
                tpot_ms: None,
                e2e_ms: None,
            },
            totals: Default::default(),
            rates: Default::default(),
            latency: Default::default(),
            errors: Default::default(),
            per_tier: Default::default(),
            per_group: Default::default(),
            per_tenant: Default::default(),
            first_sends_ms: Default::default(),
            per_class: Default::default(),
            timeseries: seconds,
            metrics: Vec::new(),
            faults: Vec::new(),
            tasks: None,
        }
    }

    fn group(requests: u64, ok: u64, p99: f64) -> Group {
        Group {
            requests,
            ok,
            good: ok,
            success_rate: if requests == 0 {
                1.0
            } else {
                ok as f64 / requests as f64
            },
            ttft: Percentiles {
                count: ok,
                p99,
                max: p99,
                ..Percentiles::default()
            },
            ttft_slowest_ms: vec![p99; slowest_kept(requests).min(ok) as usize],
            ..Group::default()
        }
    }

    #[test]
    fn the_flood_window_skips_warm_up_calm_seconds_and_downtime() {
        // 1x for 5 s, 10x for 10 s, 1x for 5 s; knee 10 req/s.
        let offered = |t: f64| {
            if (5.0..15.0).contains(&t) {
                100.0
            } else {
                10.0
            }
        };
        let w = flood_window(20.0, &offered, 10.0, 2.0, &[]);
        assert_eq!(w, (7..15).collect::<Vec<_>>());
        // An engine down from 9.5 s to 11 s takes seconds 9 and 10 out.
        let w = flood_window(20.0, &offered, 10.0, 2.0, &[(9.5, 11.0)]);
        assert_eq!(w, vec![7, 8, 11, 12, 13, 14]);
        // Never above 1.5x: no window, and no goodput verdict.
        let w = flood_window(20.0, &|_| 14.0, 10.0, 2.0, &[]);
        assert!(w.is_empty());
        assert!(goodput(&report_with(Vec::new()), &w, 10.0, GOODPUT_TARGET).is_none());
    }

    #[test]
    fn goodput_fails_below_95_percent_of_the_knee_and_counts_missing_seconds_as_zero() {
        let sec = |t, good| Second {
            t,
            good,
            ..Second::default()
        };
        let window = [2, 3, 4, 5];
        let r = report_with((0..8).map(|t| sec(t, 20)).collect());
        assert_eq!(
            goodput(&r, &window, 20.0, GOODPUT_TARGET).unwrap().met,
            Some(true)
        );
        let r = report_with((0..8).map(|t| sec(t, 18)).collect());
        assert_eq!(
            goodput(&r, &window, 20.0, GOODPUT_TARGET).unwrap().met,
            Some(false)
        );
        // 90% of the knee meets a real engine's 0.90 target, not the simulated one's 0.95.
        assert_eq!(goodput(&r, &window, 20.0, 0.90).unwrap().met, Some(true));
        // Just under the target reads as under it.
        let just_under = goodput(&r, &window, 18.0 / 0.9497, GOODPUT_TARGET).unwrap();
        assert_eq!(just_under.met, Some(false));
        assert_eq!(just_under.measured, "18.0 req/s = 94.9%");
        // A collapse (seconds with nothing recorded) is a zero, not a gap.
        let r = report_with(vec![sec(2, 20), sec(3, 20)]);
        assert_eq!(window_goodput(&r, &window), Some(10.0));
        assert_eq!(
            goodput(&r, &window, 20.0, GOODPUT_TARGET).unwrap().met,
            Some(false)
        );
    }

    #[test]
    fn an_injected_crash_is_not_an_overload_crash() {
        assert_eq!(crashes(1, 1).met, Some(true));
        assert_eq!(crashes(1, 1).measured, "0 (+1 injected)");
        assert_eq!(crashes(2, 1).met, Some(false));
        assert_eq!(crashes(1, 0).met, Some(false));
        assert_eq!(crashes(0, 0).met, Some(true));
    }

    fn over_quota(n: u64) -> PremiumExcuses {
        PremiumExcuses {
            over_quota: n,
            over_context: 0,
        }
    }

    #[test]
    fn premium_fails_when_in_quota_requests_fail_and_over_quota_refusals_are_capped() {
        let mut r = report_with(Vec::new());
        let mut g = group(1000, 1000, 100.0);
        r.per_tier.insert("premium".into(), g.clone());
        assert_eq!(premium(&r, over_quota(0)).unwrap().met, Some(true));
        // Two failures in a thousand: 99.8%.
        g.ok = 998;
        r.per_tier.insert("premium".into(), g.clone());
        assert_eq!(premium(&r, over_quota(0)).unwrap().met, Some(false));
        // 100 refused as over quota, and the schedule really was 100 over: excused.
        g.ok = 900;
        g.errors.insert("429:rate_limit_exceeded".into(), 100);
        r.per_tier.insert("premium".into(), g.clone());
        assert_eq!(premium(&r, over_quota(100)).unwrap().met, Some(true));
        // The same refusals when the schedule was only 10 over quota: 90 in-quota failures.
        let c = premium(&r, over_quota(10)).unwrap();
        assert_eq!(c.met, Some(false), "{}", c.measured);
        // levee names the quota that refused: the same excuse.
        g.errors.clear();
        g.errors
            .insert("429:rate_limit_exceeded:tenant_requests".into(), 60);
        g.errors
            .insert("429:rate_limit_exceeded:tenant_tokens".into(), 40);
        r.per_tier.insert("premium".into(), g.clone());
        assert_eq!(premium(&r, over_quota(100)).unwrap().met, Some(true));
        // A capacity refusal is never excused, whatever check made it.
        g.errors.clear();
        g.errors
            .insert("429:capacity_overload:predicted_wait".into(), 100);
        r.per_tier.insert("premium".into(), g.clone());
        assert_eq!(premium(&r, over_quota(100)).unwrap().met, Some(false));
        // No premium traffic: no verdict.
        r.per_tier.clear();
        assert!(premium(&r, over_quota(0)).is_none());
    }

    #[test]
    fn refusals_are_counted_by_code_with_or_without_the_check() {
        let errors: std::collections::BTreeMap<String, u64> = [
            ("429:queue_timeout", 2),
            ("429:queue_timeout:queue_timeout", 3),
            ("429:queue_timeouts_elsewhere", 100),
            ("4xx:429", 100),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(refusals_with_code(&errors, "queue_timeout"), 5);
        assert_eq!(refusals_with_code(&errors, "capacity_overload"), 0);
    }

    #[test]
    fn tenant_quota_refusals_are_those_levee_names_for_a_tenant() {
        let errors: std::collections::BTreeMap<String, u64> = [
            ("429:rate_limit_exceeded:tenant_requests", 2),
            ("429:rate_limit_exceeded:tenant_tokens", 3),
            ("429:rate_limit_exceeded:heavy_concurrency", 4),
            ("429:rate_limit_exceeded:global_requests", 100),
            ("429:capacity_overload:soft_watermark", 100),
            ("429:queue_timeout", 100),
            ("4xx:400:levee", 100),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(tenant_quota_refusals(&errors), 9);
    }

    #[test]
    fn isolation_fails_on_starvation_on_lost_success_and_on_slower_first_tokens() {
        let calm = group(1000, 1000, 200.0);
        assert_eq!(isolation(&calm, &group(1000, 1000, 215.0)).met, Some(true));
        // p99 TTFT +15%.
        assert_eq!(isolation(&calm, &group(1000, 1000, 230.0)).met, Some(false));
        // Two points of success lost, p99 unchanged.
        assert_eq!(isolation(&calm, &group(1000, 980, 200.0)).met, Some(false));
        // Total starvation: nothing succeeded, so there is no TTFT sample at all; the p99 of
        // the successes (0 ms) must not pass as "faster".
        let starved = group(1000, 0, 0.0);
        assert_eq!(p99_ttft_counting_failures(&starved), f64::INFINITY);
        assert_eq!(isolation(&calm, &starved).met, Some(false));
        // Half failed while the survivors were fast: failures count as infinitely late.
        assert_eq!(isolation(&calm, &group(1000, 500, 50.0)).met, Some(false));
        // No calm reference: cannot be met.
        assert_eq!(
            isolation(&group(10, 0, 0.0), &group(10, 10, 1.0)).met,
            Some(false)
        );
    }

    /// A group of `n` requests whose successful TTFTs are 1, 2, … ms, the last `failed`
    /// of them failures, keeping the slowest as a report does.
    fn ranked(n: u64, failed: u64) -> Group {
        let ok = n - failed;
        let mut g = group(n, ok, ok as f64);
        g.ttft_slowest_ms = (1..=ok)
            .rev()
            .take(slowest_kept(n) as usize)
            .map(|v| v as f64)
            .collect();
        g
    }

    #[test]
    fn the_p99_interval_takes_the_ranks_two_deviations_around_it() {
        // 1,000 requests: ranks 990 ∓ 6.2, rounded outwards, the upper one rank further.
        let g = ranked(1000, 0);
        assert_eq!(p99_ttft_counting_failures(&g), 990.0);
        assert_eq!(
            p99_interval_counting_failures(&g),
            Some((983.0, Some(998.0)))
        );
        // 350 requests: the upper rank (351) lies past the last request, so the sample
        // bounds the percentile only from below; the printout marks it.
        let g = ranked(350, 0);
        assert_eq!(p99_interval_counting_failures(&g), Some((342.0, None)));
        assert!(
            p99_text(347.0, &g).ends_with("[342–350+]"),
            "{}",
            p99_text(347.0, &g)
        );
        // Failures placed last: the upper rank falls among them.
        let g = ranked(1000, 5);
        assert_eq!(
            p99_interval_counting_failures(&g),
            Some((983.0, Some(f64::INFINITY)))
        );
        // 350 requests, one failed: the interval's upper end lies past the failure.
        let g = ranked(350, 1);
        assert_eq!(p99_text(347.0, &g), "347 ms [342–∞]");
        // An infinite p99 states no interval.
        assert_eq!(p99_text(f64::INFINITY, &ranked(100, 5)), "∞ (failures)");
        // A report that kept only the `n / 100 + 1` slowest cannot place the lower end.
        let mut g = ranked(1000, 0);
        g.ttft_slowest_ms.truncate(11);
        assert_eq!(p99_interval_counting_failures(&g), None);
        assert_eq!(p99_text(990.0, &g), "990 ms");
    }

    #[test]
    fn a_report_keeps_enough_of_the_slowest_to_place_every_p99_interval() {
        // `slowest_kept` (levee-sim) and the interval's lower rank are computed apart: for
        // any size, with or without failures, what a report keeps must reach the lower end.
        for n in 1..=5_000u64 {
            for failed in [0, n / 200, n / 50] {
                let g = ranked(n, failed);
                assert!(
                    p99_interval_counting_failures(&g).is_some(),
                    "{n} requests, {failed} failed: {} kept",
                    g.ttft_slowest_ms.len()
                );
            }
        }
    }

    #[test]
    fn a_flooder_held_below_an_equal_share_of_its_tier_misses() {
        let mut r = report_with(Vec::new());
        let tier: Vec<String> = ["noisy", "a", "b", "c"].map(String::from).to_vec();
        let set = |r: &mut Report, rates: [f64; 4]| {
            for (t, g) in tier.iter().zip(rates) {
                let mut group = group(100, 100, 100.0);
                group.goodput_rps = g;
                r.per_tenant.insert(t.clone(), group);
            }
        };
        // Quiet neighbours served their 1.7 req/s, the flooder the rest: more than a quarter.
        set(&mut r, [3.0, 1.7, 1.6, 1.8]);
        let c = flooder_share(&r, "noisy", &tier);
        assert_eq!(c.met, Some(true), "{}", c.measured);
        assert!(
            c.measured
                .starts_with("3.00 req/s = 37% of its tier's 8.10 (an equal share: 25%)"),
            "{}",
            c.measured
        );
        // Held to 1.2 req/s while they got theirs: isolation bought by starving it.
        set(&mut r, [1.2, 1.7, 1.6, 1.8]);
        assert_eq!(flooder_share(&r, "noisy", &tier).met, Some(false));
        // Everyone backlogged and served alike: exactly an equal share is met.
        set(&mut r, [2.0, 2.0, 2.0, 2.0]);
        assert_eq!(flooder_share(&r, "noisy", &tier).met, Some(true));
        // Nothing served: stated, not judged.
        set(&mut r, [0.0; 4]);
        assert_eq!(flooder_share(&r, "noisy", &tier).met, None);
    }

    #[test]
    fn the_isolation_p99_places_failures_last_at_rank_ceil_99_percent() {
        // 1000 requests, 9 failed (under 1%): rank 990 of 1000 is the success at rank 990
        // of the 991 successes, the second slowest. Their own p99 (200 ms) must not pass for it.
        let mut flood = group(1000, 991, 200.0);
        flood.ttft_slowest_ms = vec![6000.0, 5000.0, 210.0, 205.0, 200.0];
        assert_eq!(p99_ttft_counting_failures(&flood), 5000.0);
        let calm = group(1000, 1000, 200.0);
        let c = isolation(&calm, &flood);
        assert_eq!(c.met, Some(false), "{}", c.measured);
        // 11 failures of 1000: rank 990 falls among the failures (successes end at 989).
        let g = group(1000, 989, 100.0);
        assert_eq!(p99_ttft_counting_failures(&g), f64::INFINITY);
        // 10 failures of 1000: rank 990 is the slowest success.
        let mut g = group(1000, 990, 100.0);
        g.ttft_slowest_ms = vec![300.0, 120.0];
        assert_eq!(p99_ttft_counting_failures(&g), 300.0);
        // No failures, 1000 requests: rank 990 is the 11th slowest.
        let mut g = group(1000, 1000, 100.0);
        g.ttft_slowest_ms = (0..11).map(|i| 500.0 - f64::from(i)).collect();
        assert_eq!(p99_ttft_counting_failures(&g), 490.0);
        // A calm reference that itself failed cannot vouch for anything.
        let c = isolation(&group(100, 50, 100.0), &group(100, 100, 100.0));
        assert_eq!(c.met, Some(false), "{}", c.measured);
    }

    #[test]
    fn isolation_is_judged_against_every_baseline_calm_run_that_served_the_quiet_tenants() {
        let own = group(1000, 1000, 300.0);
        let flood = group(1000, 1000, 320.0);
        // Within 10% of its own calm run; the capped calm run lost a fifth of the quiet
        // requests, so it vouches for nothing and is set aside (stated).
        let failed = group(1000, 800, 100.0);
        let c = isolation_against(&own, &[("capped", &failed)], &flood);
        assert_eq!(c.met, Some(true), "{}", c.measured);
        assert!(
            c.measured
                .contains("capped calm run is no reference (80.0%"),
            "{}",
            c.measured
        );
        // A baseline that served them faster in calm is a reference: +7% against its own
        // calm run is +60% against the unprotected one.
        let fast = group(1000, 1000, 200.0);
        let c = isolation_against(&own, &[("capped", &failed), ("unprotected", &fast)], &flood);
        assert_eq!(c.met, Some(false), "{}", c.measured);
        assert!(
            c.measured.contains(
                "vs the unprotected calm run: success 100.0→100.0%, p99 TTFT 200 ms [200–200]→320 ms [320–320] (+60%)"
            ),
            "{}",
            c.measured
        );
        // Its own calm run failing the quiet tenants is a miss whatever the baselines did.
        let c = isolation_against(
            &failed,
            &[("unprotected", &group(1000, 1000, 400.0))],
            &flood,
        );
        assert_eq!(c.met, Some(false), "{}", c.measured);
        // Lost success is a miss against its own calm run even with no baseline.
        let c = isolation_against(&own, &[], &group(1000, 980, 300.0));
        assert_eq!(c.met, Some(false), "{}", c.measured);
    }

    #[test]
    fn a_contender_above_the_knee_by_more_than_5_percent_makes_the_reference_suspect() {
        assert!(suspect_reference(10.0, &[("capped", Some(9.8)), ("levee", Some(10.5))]).is_none());
        let w = suspect_reference(10.0, &[("capped", Some(9.8)), ("levee", Some(12.0))]).unwrap();
        assert!(
            w.contains("suspect") && w.contains("levee 12.0 req/s = 120%"),
            "{w}"
        );
        assert!(!w.contains("capped 9.8"), "{w}");
        // No flood window: no figure, no warning.
        assert!(suspect_reference(10.0, &[("levee", None)]).is_none());
    }

    #[test]
    fn an_engines_invalid_request_leaves_the_premium_denominator_and_levees_own_does_not() {
        let mut r = report_with(Vec::new());
        let mut g = group(1000, 990, 100.0);
        // The engine refused 10 requests as too long for its context: the client's fault.
        g.errors.insert("4xx:400".into(), 10);
        r.per_tier.insert("premium".into(), g.clone());
        let c = premium(&r, over_quota(0)).unwrap();
        assert_eq!(c.met, Some(true), "{}", c.measured);
        assert!(c.measured.ends_with("of 990"), "{}", c.measured);
        assert_eq!(engine_client_errors(&g.errors), 10);
        // The same 10 refused by levee itself: failures of the gateway, never excused.
        g.errors.clear();
        g.errors.insert("4xx:400:levee".into(), 10);
        r.per_tier.insert("premium".into(), g.clone());
        let c = premium(&r, over_quota(0)).unwrap();
        assert_eq!(c.met, Some(false), "{}", c.measured);
        assert_eq!(levee_client_errors(&g.errors), 10);
        assert_eq!(engine_client_errors(&g.errors), 0);
        // Unless the schedule itself has that many requests too long for the engines: levee
        // refused what the engines would have.
        let too_long = |n| PremiumExcuses {
            over_quota: 0,
            over_context: n,
        };
        let c = premium(&r, too_long(10)).unwrap();
        assert_eq!(c.met, Some(true), "{}", c.measured);
        assert!(c.measured.ends_with("of 990"), "{}", c.measured);
        // Only as many as the schedule has, less those the engines refused themselves.
        let c = premium(&r, too_long(6)).unwrap();
        assert_eq!(c.met, Some(false), "{}", c.measured);
        g.errors.insert("4xx:400".into(), 4);
        g.ok = 986;
        r.per_tier.insert("premium".into(), g.clone());
        let c = premium(&r, too_long(10)).unwrap();
        assert_eq!(c.met, Some(false), "{}", c.measured);
        assert!(c.measured.ends_with("of 990"), "{}", c.measured);
    }

    #[test]
    fn the_preempt_latency_verdict_fails_past_the_slo() {
        let mut r = report_with(Vec::new());
        assert!(ttft_within_slo(&r, 2000.0).is_none());
        r.latency.ttft.count = 100;
        r.latency.ttft.p99 = 1900.0;
        assert_eq!(ttft_within_slo(&r, 2000.0).unwrap().met, Some(true));
        r.latency.ttft.p99 = 2100.0;
        assert_eq!(ttft_within_slo(&r, 2000.0).unwrap().met, Some(false));
    }

    #[test]
    fn amplification_is_attempts_per_scheduled_request() {
        let mut r = report_with(Vec::new());
        r.totals.scheduled = 100;
        r.totals.attempts = 250;
        assert_eq!(amplification(&r).measured, "2.50×");
        assert_eq!(amplification(&r).met, None);
    }
}
