//! The recorder: one task owns every histogram and counter; request tasks send it one
//! [`Record`] per finished request, so the hot path takes no lock.

use crate::report::{
    slowest_kept, Group, Latency, MetricSeries, Percentiles, Rates, Report, Second, SloSpec,
    TaskSummary, Totals, SCHEMA,
};
use crate::scenario::{Scenario, Slo};
use hdrhistogram::Histogram;
use std::collections::BTreeMap;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    /// 2xx and a complete body.
    Ok,
    /// 429 with this `error.code` (or `error.type`, or `unknown`).
    RateLimited(String),
    /// Another non-2xx status.
    Status(u16),
    /// A non-2xx status other than 429 that a levee gateway produced itself (its answer
    /// carries `x-levee-error-origin`), not one it relayed from the server behind it.
    LeveeStatus(u16),
    /// The client gave up waiting.
    Timeout,
    /// No response: refused, reset, or failed before the status line.
    Connect,
    /// 2xx, then the body broke off before the end.
    BrokenStream,
    /// The run ended first.
    Cancelled,
    /// An async client's task ended in this state (not `succeeded`), or its submission or
    /// polling failed (`refused`, `lost`).
    Task(&'static str),
}

impl Kind {
    /// Key in `Report::errors`; `None` for success.
    pub(crate) fn error_key(&self) -> Option<String> {
        Some(match self {
            Kind::Ok => return None,
            Kind::RateLimited(code) => format!("429:{code}"),
            Kind::Status(s) if *s >= 500 => format!("5xx:{s}"),
            Kind::Status(s) => format!("4xx:{s}"),
            Kind::LeveeStatus(s) if *s >= 500 => format!("5xx:{s}"),
            Kind::LeveeStatus(s) => format!("4xx:{s}:levee"),
            Kind::Timeout => "timeout".into(),
            Kind::Connect => "connect".into(),
            Kind::BrokenStream => "broken_stream".into(),
            Kind::Cancelled => "cancelled".into(),
            Kind::Task(state) => format!("task:{state}"),
        })
    }
}

/// One finished request (all its attempts). Times are nanoseconds from the run's start.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub intended_ns: u64,
    /// `None` when the request was cancelled before its first send.
    pub first_sent_ns: Option<u64>,
    /// Send time of the last attempt (equal to the first without retries).
    pub last_sent_ns: u64,
    /// Send times of retries, for the attempts-per-second series.
    pub retry_sent_ns: Vec<u64>,
    pub done_ns: u64,
    pub first_token_ns: Option<u64>,
    pub tokens: u32,
    /// Gaps between content chunks, microseconds.
    pub itl_us: Vec<u32>,
    pub kind: Kind,
    /// Whether any attempt got a 2xx status.
    pub admitted: bool,
    pub attempts: u32,
    pub tenant: u16,
    pub class: u16,
    /// An async client's task, when the request was one.
    pub task: Option<TaskOutcome>,
}

/// How an async client's task went.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskOutcome {
    /// `succeeded`, `failed`, `cancelled`, `expired`, `refused`, `unfinished`, `lost`.
    pub state: &'static str,
    /// Whether the submission was answered 202.
    pub accepted: bool,
    /// The ETA (seconds) the 202 gave.
    pub eta_s: Option<f64>,
    /// Submission to result, seconds.
    pub took_s: f64,
}

#[derive(Default)]
struct TaskAcc {
    summary: TaskSummary,
    abs_ms: Option<Histogram<u64>>,
    rel_milli_pct: Option<Histogram<u64>>,
    took_us: Option<Histogram<u64>>,
}

/// Auto-resizing histograms: memory follows the largest value actually seen. Made once and
/// cloned, so that the only fallible constructor call is in `Recorder::new`.
#[derive(Clone)]
struct Protos {
    fine: Histogram<u64>,
    coarse: Histogram<u64>,
}

fn us(ns: u64) -> u64 {
    ns / 1000
}

#[derive(Default)]
struct GroupAcc {
    requests: u64,
    ok: u64,
    good: u64,
    ttft: Option<Histogram<u64>>,
    e2e: Option<Histogram<u64>>,
    errors: BTreeMap<String, u64>,
}

impl GroupAcc {
    fn finish(&self, duration_s: f64) -> Group {
        let p = |h: &Option<Histogram<u64>>| {
            h.as_ref()
                .map(Percentiles::from_histogram)
                .unwrap_or_default()
        };
        Group {
            requests: self.requests,
            ok: self.ok,
            good: self.good,
            success_rate: if self.requests == 0 {
                1.0
            } else {
                self.ok as f64 / self.requests as f64
            },
            goodput_rps: self.good as f64 / duration_s.max(1e-9),
            ttft: p(&self.ttft),
            ttft_slowest_ms: self
                .ttft
                .as_ref()
                .map(|h| slowest_ms(h, slowest_kept(self.requests)))
                .unwrap_or_default(),
            e2e: p(&self.e2e),
            errors: self.errors.clone(),
        }
    }
}

/// The `n` largest values of a histogram of microseconds, in milliseconds, largest first.
fn slowest_ms(h: &Histogram<u64>, n: u64) -> Vec<f64> {
    let recorded: Vec<(u64, u64)> = h
        .iter_recorded()
        .map(|v| {
            (
                h.highest_equivalent(v.value_iterated_to()),
                v.count_at_value(),
            )
        })
        .collect();
    let mut out = Vec::new();
    for &(value, count) in recorded.iter().rev() {
        let left = n.saturating_sub(out.len() as u64);
        if left == 0 {
            break;
        }
        out.extend(std::iter::repeat_n(
            value as f64 / 1000.0,
            count.min(left) as usize,
        ));
    }
    out
}

fn second(seconds: &mut Vec<SecondAcc>, ns: u64) -> &mut SecondAcc {
    let i = (ns / 1_000_000_000) as usize;
    if seconds.len() <= i {
        seconds.resize_with(i + 1, SecondAcc::default);
    }
    &mut seconds[i]
}

#[derive(Default)]
struct SecondAcc {
    s: Second,
    ttft: Option<Histogram<u64>>,
    e2e: Option<Histogram<u64>>,
    lag: Option<Histogram<u64>>,
}

fn record_into(h: &mut Option<Histogram<u64>>, value: u64, proto: &Histogram<u64>) {
    // An auto-resizing histogram only fails on values beyond u64 range; ignoring is safe.
    let _ = h.get_or_insert_with(|| proto.clone()).record(value.max(1));
}

/// Everything measured so far.
pub(crate) struct Recorder {
    protos: Protos,
    slo: Slo,
    tenants: Vec<(String, String)>,
    classes: Vec<String>,
    totals: Totals,
    ttft: Histogram<u64>,
    ttft_uncorrected: Histogram<u64>,
    e2e: Histogram<u64>,
    e2e_uncorrected: Histogram<u64>,
    itl: Histogram<u64>,
    tpot: Histogram<u64>,
    lag: Histogram<u64>,
    errors: BTreeMap<String, u64>,
    seconds: Vec<SecondAcc>,
    per_tenant: Vec<GroupAcc>,
    /// Per tenant: when each logical request was first sent (ns since the start).
    first_sends: Vec<Vec<u64>>,
    per_class: Vec<GroupAcc>,
    /// Tier names, sorted, and the tier index of each tenant (no string work per record).
    tiers: Vec<String>,
    tier_of: Vec<usize>,
    per_tier: Vec<GroupAcc>,
    /// Group labels, sorted, and the group index of each tenant (`None`: no group).
    groups: Vec<String>,
    group_of: Vec<Option<usize>>,
    per_group: Vec<GroupAcc>,
    tasks: Option<TaskAcc>,
}

impl Recorder {
    pub(crate) fn new(scenario: &Scenario) -> anyhow::Result<Self> {
        let fine =
            Histogram::new(3).map_err(|e| anyhow::anyhow!("cannot make a histogram: {e}"))?;
        let coarse =
            Histogram::new(2).map_err(|e| anyhow::anyhow!("cannot make a histogram: {e}"))?;
        let histogram = || fine.clone();
        let (tiers, tier_of) = label_index(scenario.tenants.iter().map(|t| Some(&t.tier)));
        let (groups, group_of) = label_index(scenario.tenants.iter().map(|t| t.group.as_ref()));
        Ok(Self {
            slo: scenario.slo,
            tenants: scenario
                .tenants
                .iter()
                .map(|t| (t.name.clone(), t.tier.clone()))
                .collect(),
            classes: scenario.classes.iter().map(|c| c.name.clone()).collect(),
            totals: Totals::default(),
            ttft: histogram(),
            ttft_uncorrected: histogram(),
            e2e: histogram(),
            e2e_uncorrected: histogram(),
            itl: histogram(),
            tpot: histogram(),
            lag: histogram(),
            errors: BTreeMap::new(),
            seconds: Vec::new(),
            per_tenant: scenario
                .tenants
                .iter()
                .map(|_| GroupAcc::default())
                .collect(),
            first_sends: scenario.tenants.iter().map(|_| Vec::new()).collect(),
            per_class: scenario
                .classes
                .iter()
                .map(|_| GroupAcc::default())
                .collect(),
            per_tier: tiers.iter().map(|_| GroupAcc::default()).collect(),
            tier_of: tier_of.into_iter().map(|t| t.unwrap_or(0)).collect(),
            tiers,
            per_group: groups.iter().map(|_| GroupAcc::default()).collect(),
            group_of,
            groups,
            tasks: None,
            protos: Protos {
                fine: fine.clone(),
                coarse,
            },
        })
    }

    /// Whether a successful request met the SLO.
    fn meets_slo(&self, ttft_ms: f64, tpot_ms: Option<f64>, e2e_ms: f64) -> bool {
        self.slo.ttft_ms.is_none_or(|max| ttft_ms <= max)
            && self.slo.e2e_ms.is_none_or(|max| e2e_ms <= max)
            && match (self.slo.tpot_ms, tpot_ms) {
                (Some(max), Some(t)) => t <= max,
                _ => true,
            }
    }

    pub(crate) fn record(&mut self, r: Record) {
        if let Some(task) = r.task {
            let fine = &self.protos.fine;
            let acc = self.tasks.get_or_insert_with(TaskAcc::default);
            acc.summary.submitted += 1;
            if task.accepted {
                acc.summary.accepted += 1;
            }
            *acc.summary
                .outcomes
                .entry(task.state.to_string())
                .or_default() += 1;
            if task.state == "succeeded" {
                record_into(&mut acc.took_us, (task.took_s * 1e6) as u64, fine);
                if let Some(eta) = task.eta_s {
                    let err = (eta - task.took_s).abs();
                    acc.summary.eta_samples += 1;
                    // Recorded in ms (and milli-percent) so that the report's µs → ms
                    // summary reads as seconds (and percent).
                    record_into(&mut acc.abs_ms, (err * 1e3) as u64, fine);
                    let rel = err / task.took_s.max(1e-3) * 100.0;
                    record_into(&mut acc.rel_milli_pct, (rel * 1e3) as u64, fine);
                }
            }
        }
        let t = &mut self.totals;
        t.scheduled += 1;
        t.completed += 1;
        t.attempts += u64::from(r.attempts);
        t.retries += u64::from(r.attempts.saturating_sub(1));
        second(&mut self.seconds, r.intended_ns).s.offered += 1;
        if let Some(sent) = r.first_sent_ns {
            if let Some(sends) = self.first_sends.get_mut(usize::from(r.tenant)) {
                sends.push(sent);
            }
            self.totals.sent += 1;
            let lag = sent.saturating_sub(r.intended_ns);
            let _ = self.lag.record(us(lag).max(1));
            let sec = second(&mut self.seconds, sent);
            sec.s.sent += 1;
            sec.s.attempts += 1;
            record_into(&mut sec.lag, us(lag), &self.protos.coarse);
        }
        for &retry in &r.retry_sent_ns {
            second(&mut self.seconds, retry).s.attempts += 1;
        }

        let mut good = false;
        let mut good_tokens = 0u64;
        let (mut ttft_us, mut e2e_us) = (None, None);
        if r.kind == Kind::Ok {
            let first = r.first_token_ns.unwrap_or(r.done_ns);
            let ttft = us(first.saturating_sub(r.intended_ns));
            let e2e = us(r.done_ns.saturating_sub(r.intended_ns));
            let _ = self.ttft.record(ttft.max(1));
            let _ = self
                .ttft_uncorrected
                .record(us(first.saturating_sub(r.last_sent_ns)).max(1));
            let _ = self.e2e.record(e2e.max(1));
            let _ = self
                .e2e_uncorrected
                .record(us(r.done_ns.saturating_sub(r.last_sent_ns)).max(1));
            for &gap in &r.itl_us {
                let _ = self.itl.record(u64::from(gap).max(1));
            }
            let tpot_us = (r.tokens > 1 && r.first_token_ns.is_some())
                .then(|| us(r.done_ns.saturating_sub(first)) / u64::from(r.tokens - 1));
            if let Some(tpot) = tpot_us {
                let _ = self.tpot.record(tpot.max(1));
            }
            good = self.meets_slo(
                ttft as f64 / 1000.0,
                tpot_us.map(|v| v as f64 / 1000.0),
                e2e as f64 / 1000.0,
            );
            self.totals.ok += 1;
            self.totals.output_tokens += u64::from(r.tokens);
            if good {
                good_tokens = u64::from(r.tokens);
                self.totals.good += 1;
                self.totals.good_tokens += good_tokens;
            }
            ttft_us = Some(ttft);
            e2e_us = Some(e2e);
        } else {
            self.totals.failed += 1;
        }
        let error = r.kind.error_key();
        if let Some(key) = &error {
            *self.errors.entry(key.clone()).or_default() += 1;
        }

        let coarse = &self.protos.coarse;
        let sec = second(&mut self.seconds, r.done_ns);
        sec.s.completed += 1;
        if r.admitted {
            sec.s.admitted += 1;
        }
        match &r.kind {
            Kind::Ok => {
                sec.s.ok += 1;
                if good {
                    sec.s.good += 1;
                    sec.s.good_tokens += good_tokens;
                }
            }
            Kind::RateLimited(_) => sec.s.rate_limited += 1,
            Kind::Status(s) | Kind::LeveeStatus(s) if *s >= 500 => sec.s.server_errors += 1,
            Kind::Timeout => sec.s.timeouts += 1,
            Kind::Connect | Kind::BrokenStream => sec.s.connect_errors += 1,
            Kind::Status(_) | Kind::LeveeStatus(_) | Kind::Cancelled | Kind::Task(_) => {
                sec.s.other_errors += 1
            }
        }
        if let Some(v) = ttft_us {
            record_into(&mut sec.ttft, v, coarse);
        }
        if let Some(v) = e2e_us {
            record_into(&mut sec.e2e, v, coarse);
        }

        let tier = self.tier_of.get(usize::from(r.tenant)).copied();
        let group = self.group_of.get(usize::from(r.tenant)).copied().flatten();
        let fine = &self.protos.fine;
        let groups = [
            self.per_tenant.get_mut(usize::from(r.tenant)),
            self.per_class.get_mut(usize::from(r.class)),
            tier.and_then(|t| self.per_tier.get_mut(t)),
            group.and_then(|g| self.per_group.get_mut(g)),
        ];
        for g in groups.into_iter().flatten() {
            g.requests += 1;
            if r.kind == Kind::Ok {
                g.ok += 1;
            }
            if good {
                g.good += 1;
            }
            if let Some(v) = ttft_us {
                record_into(&mut g.ttft, v, fine);
            }
            if let Some(v) = e2e_us {
                record_into(&mut g.e2e, v, fine);
            }
            if let Some(key) = &error {
                *g.errors.entry(key.clone()).or_default() += 1;
            }
        }
    }

    /// The report. `duration_s` is the scheduled length; rates are per scheduled second.
    pub(crate) fn finish(self, header: ReportHeader, metrics: Vec<MetricSeries>) -> Report {
        let d = header.duration_s.max(1e-9);
        let t = self.totals;
        let per_sec = |n: u64| n as f64 / d;
        let ms = |h: &Option<Histogram<u64>>, q: f64| {
            h.as_ref()
                .filter(|h| !h.is_empty())
                .map_or(0.0, |h| h.value_at_quantile(q) as f64 / 1000.0)
        };
        let timeseries = self
            .seconds
            .iter()
            .enumerate()
            .map(|(i, acc)| Second {
                t: i as u32,
                ttft_p50: ms(&acc.ttft, 0.5),
                ttft_p99: ms(&acc.ttft, 0.99),
                e2e_p50: ms(&acc.e2e, 0.5),
                e2e_p99: ms(&acc.e2e, 0.99),
                lag_p99: ms(&acc.lag, 0.99),
                ..acc.s.clone()
            })
            .collect();
        let named = |accs: &[GroupAcc], names: &[String]| {
            accs.iter()
                .zip(names)
                .map(|(g, n)| (n.clone(), g.finish(d)))
                .collect::<BTreeMap<_, _>>()
        };
        let tenant_names: Vec<String> = self.tenants.iter().map(|(n, _)| n.clone()).collect();
        let first_sends_ms = tenant_names
            .iter()
            .zip(self.first_sends)
            .map(|(n, mut sends)| {
                sends.sort_unstable();
                (
                    n.clone(),
                    sends.into_iter().map(|ns| ns / 1_000_000).collect(),
                )
            })
            .collect();
        Report {
            schema: SCHEMA.into(),
            scenario: header.scenario,
            description: header.description,
            seed: header.seed,
            target: header.target,
            started_at: header.started_at,
            duration_s: header.duration_s,
            wall_s: header.wall_s,
            client: header.client,
            slo: SloSpec {
                ttft_ms: self.slo.ttft_ms,
                tpot_ms: self.slo.tpot_ms,
                e2e_ms: self.slo.e2e_ms,
            },
            totals: t,
            rates: Rates {
                offered_rps: per_sec(t.scheduled),
                sent_rps: per_sec(t.sent),
                attempts_rps: per_sec(t.attempts),
                ok_rps: per_sec(t.ok),
                goodput_rps: per_sec(t.good),
                goodput_tps: per_sec(t.good_tokens),
                output_tps: per_sec(t.output_tokens),
                success_rate: if t.completed == 0 {
                    1.0
                } else {
                    t.ok as f64 / t.completed as f64
                },
            },
            latency: Latency {
                ttft: Percentiles::from_histogram(&self.ttft),
                ttft_uncorrected: Percentiles::from_histogram(&self.ttft_uncorrected),
                e2e: Percentiles::from_histogram(&self.e2e),
                e2e_uncorrected: Percentiles::from_histogram(&self.e2e_uncorrected),
                itl: Percentiles::from_histogram(&self.itl),
                tpot: Percentiles::from_histogram(&self.tpot),
                schedule_lag: Percentiles::from_histogram(&self.lag),
            },
            errors: self.errors,
            per_tier: named(&self.per_tier, &self.tiers),
            per_group: named(&self.per_group, &self.groups),
            per_tenant: named(&self.per_tenant, &tenant_names),
            first_sends_ms,
            per_class: named(&self.per_class, &self.classes),
            tasks: self.tasks.map(|acc| {
                let p = |h: &Option<Histogram<u64>>| {
                    h.as_ref()
                        .map(Percentiles::from_histogram)
                        .unwrap_or_default()
                };
                TaskSummary {
                    eta_abs_error_s: p(&acc.abs_ms),
                    eta_rel_error_pct: p(&acc.rel_milli_pct),
                    time_to_result: p(&acc.took_us),
                    ..acc.summary
                }
            }),
            timeseries,
            metrics,
            faults: header.faults,
        }
    }
}

/// What the report says about the run that the recorder does not know.
pub(crate) struct ReportHeader {
    pub scenario: String,
    pub description: String,
    pub seed: u64,
    pub target: String,
    pub started_at: String,
    pub duration_s: f64,
    pub wall_s: f64,
    pub client: String,
    pub faults: Vec<crate::report::FaultRecord>,
}

/// The distinct labels (sorted) and, for each item, the index of its label (`None` for an
/// item without one): per-record accounting then indexes a vector instead of hashing text.
fn label_index<'a>(
    labels: impl Iterator<Item = Option<&'a String>> + Clone,
) -> (Vec<String>, Vec<Option<usize>>) {
    let mut names: Vec<String> = labels.clone().flatten().cloned().collect();
    names.sort();
    names.dedup();
    let index = labels
        .map(|l| l.and_then(|l| names.iter().position(|n| n == l)))
        .collect();
    (names, index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_values_come_largest_first_and_stop_at_n() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).unwrap();
        for us in [1_000, 2_000, 2_000, 9_000] {
            h.record(us).unwrap();
        }
        let s = slowest_ms(&h, 3);
        assert_eq!(s.len(), 3);
        assert!(
            (s[0] - 9.0).abs() < 0.01 && (s[1] - 2.0).abs() < 0.01,
            "{s:?}"
        );
        assert!((s[2] - 2.0).abs() < 0.01, "{s:?}");
        assert_eq!(slowest_ms(&h, 10).len(), 4);
    }

    #[test]
    fn a_levee_refusal_is_keyed_apart_from_a_relayed_one() {
        assert_eq!(Kind::Status(400).error_key().unwrap(), "4xx:400");
        assert_eq!(Kind::LeveeStatus(400).error_key().unwrap(), "4xx:400:levee");
        assert_eq!(Kind::LeveeStatus(503).error_key().unwrap(), "5xx:503");
    }
}
