//! Scenarios: what traffic to send, described in TOML.
//!
//! Every field has a default, so the smallest scenario is an empty file (10 s of Poisson
//! arrivals at `capacity_rps`). Unknown fields are errors that name the field. The format is
//! documented field by field in `docs/sim.md`.

use crate::dist::Dist;
use crate::text::TextMix;
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A whole scenario: arrivals over time, what each request looks like, who sends it, how
/// clients behave, what counts as good, and what goes wrong on purpose.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scenario {
    /// Short name, shown in reports.
    pub name: String,
    /// One line on what the scenario shows.
    pub description: String,
    /// Seed of every random choice: the same seed gives the same schedule.
    pub seed: u64,
    /// What `"1x"` means in a rate, in requests per second. Tune this to the fleet under test
    /// and every phase scales with it.
    pub capacity_rps: f64,
    /// Multiplies every rate (after `capacity_rps`); `--rate-scale` overrides it.
    pub rate_scale: f64,
    /// The arrival process (how arrivals are spread around the rate).
    pub arrival: Arrival,
    /// Phases run one after another; the run lasts their total duration.
    pub phases: Vec<Phase>,
    /// Request classes, mixed by weight.
    pub classes: Vec<Class>,
    /// Tenants (API keys), mixed by share.
    pub tenants: Vec<Tenant>,
    /// Multi-turn conversations.
    pub sessions: Sessions,
    /// How clients time out and retry.
    pub client: ClientConfig,
    /// What a good request is.
    pub slo: Slo,
    /// The request path and model.
    pub request: RequestConfig,
    /// Prometheus endpoints to scrape during the run.
    pub metrics: MetricsConfig,
    /// Faults to inject at given times.
    pub faults: Vec<Fault>,
}

impl Default for Scenario {
    fn default() -> Self {
        Self {
            name: "unnamed".into(),
            description: String::new(),
            seed: 42,
            capacity_rps: 10.0,
            rate_scale: 1.0,
            arrival: Arrival::default(),
            phases: vec![Phase::Steady {
                duration_s: 10.0,
                rps: Rate::Multiple(1.0),
            }],
            classes: vec![Class::default()],
            tenants: vec![Tenant::default()],
            sessions: Sessions::default(),
            client: ClientConfig::default(),
            slo: Slo::default(),
            request: RequestConfig::default(),
            metrics: MetricsConfig::default(),
            faults: Vec::new(),
        }
    }
}

impl Scenario {
    /// Parses and validates a scenario. Errors name the offending field.
    pub fn from_toml_str(text: &str) -> anyhow::Result<Self> {
        let scenario: Scenario = toml::from_str(text).context("the scenario is not valid")?;
        scenario.validate()?;
        Ok(scenario)
    }

    /// Reads, parses and validates a scenario file.
    pub fn from_file(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read scenario file {}", path.display()))?;
        Self::from_toml_str(&text).with_context(|| format!("in {}", path.display()))
    }

    /// The scenario as TOML (what `from_toml_str` reads back).
    pub fn to_toml_string(&self) -> anyhow::Result<String> {
        toml::to_string(self).context("cannot serialise the scenario as TOML")
    }

    /// Stretches (factor > 1) or compresses the run's timeline: phase lengths and the times
    /// inside phases, tenants' own phases and fault times. Rates, request sizes, think
    /// times, timeouts and SLOs are unchanged. `levee drill` uses it to fit two runs in
    /// its time budget.
    pub fn scale_time(&mut self, factor: f64) {
        let f = if factor.is_finite() && factor > 0.0 {
            factor
        } else {
            1.0
        };
        for p in self.phases.iter_mut() {
            p.scale_time(f);
        }
        for t in self.tenants.iter_mut() {
            for p in t.phases.iter_mut().flatten() {
                p.scale_time(f);
            }
        }
        for fault in self.faults.iter_mut() {
            fault.at_s *= f;
            if let Some(d) = fault.duration_s.as_mut() {
                *d *= f;
            }
        }
    }

    /// Total duration of all phases, in seconds.
    pub fn duration_s(&self) -> f64 {
        self.phases.iter().map(Phase::duration_s).sum()
    }

    /// Requests per second the scenario offers `t` seconds into the run, sessions' later
    /// turns counted at their expected number ([`Scenario::turns_per_arrival`]; when they
    /// come depends on the answers): the share tenants' phases plus every tenant's own
    /// phases.
    pub fn offered_rps_at(&self, t: f64) -> f64 {
        let rps = |r: Rate| self.resolve(r);
        let mut total = 0.0;
        if self.tenants.iter().any(|x| x.share > 0.0) {
            total += phases_rate_at(&self.phases, t, &rps);
        }
        for tenant in &self.tenants {
            if let Some(phases) = &tenant.phases {
                total += phases_rate_at(phases, t, &rps);
            }
        }
        total
    }

    /// Times (seconds from the start) at which the offered load changes phase, the share
    /// traffic's and each tenant's own, sorted, without the start and the end.
    pub fn phase_changes(&self) -> Vec<f64> {
        let end = self.duration_s();
        let mut times = Vec::new();
        let lists =
            std::iter::once(&self.phases).chain(self.tenants.iter().flat_map(|t| &t.phases));
        for phases in lists {
            let mut at = 0.0;
            for p in phases {
                at += p.duration_s();
                if at < end - 1e-9 {
                    times.push(at);
                }
            }
        }
        times.sort_by(f64::total_cmp);
        times.dedup_by(|a, b| (*a - *b).abs() < 1e-6);
        times
    }

    /// Requests per second that a [`Rate`] means in this scenario (after `rate_scale`),
    /// every turn of a session counted: the unit a fleet's capacity is measured in.
    pub fn resolve(&self, rate: Rate) -> f64 {
        rate.rps(self.capacity_rps) * self.rate_scale
    }

    /// Requests each arrival is expected to bring: 1, plus the later turns of the share of
    /// arrivals that start a session (`share × (mean turns − 1)`, the distribution's mean
    /// before clamping). New conversations arrive at a rate divided by this, so that a rate
    /// counts every turn.
    pub fn turns_per_arrival(&self) -> f64 {
        let s = &self.sessions;
        let share = if s.share.is_finite() {
            s.share.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let later = (s.turns.mean() - 1.0).max(0.0);
        1.0 + share * later
    }

    /// Checks what serde cannot: positive durations, weights that add up to something,
    /// distributions with sane parameters.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.capacity_rps.is_finite() && self.capacity_rps > 0.0,
            "capacity_rps must be > 0 (got {})",
            self.capacity_rps
        );
        anyhow::ensure!(
            self.rate_scale.is_finite() && self.rate_scale >= 0.0,
            "rate_scale must be >= 0 (got {})",
            self.rate_scale
        );
        if let Process::Gamma = self.arrival.process {
            anyhow::ensure!(
                self.arrival.burstiness > 0.0,
                "arrival.burstiness must be > 0 (got {})",
                self.arrival.burstiness
            );
        }
        validate_phases(&self.phases, "phases")?;
        anyhow::ensure!(!self.classes.is_empty(), "classes: give at least one class");
        anyhow::ensure!(
            self.classes.iter().any(|c| c.weight > 0.0),
            "classes: at least one class needs weight > 0"
        );
        for (i, c) in self.classes.iter().enumerate() {
            anyhow::ensure!(
                c.weight >= 0.0 && (0.0..=1.0).contains(&c.slow_share),
                "classes[{i}] ({}): weight must be >= 0 and slow_share in [0, 1]",
                c.name
            );
            for (field, d) in [
                ("prompt_tokens", &c.prompt_tokens),
                ("max_tokens", &c.max_tokens),
                ("slow_prompt_tokens", &c.slow_prompt_tokens),
                ("slow_max_tokens", &c.slow_max_tokens),
            ] {
                d.validate()
                    .with_context(|| format!("classes[{i}].{field} ({})", c.name))?;
            }
        }
        anyhow::ensure!(
            !self.tenants.is_empty(),
            "tenants: give at least one tenant"
        );
        anyhow::ensure!(
            self.tenants
                .iter()
                .any(|t| t.share > 0.0 || t.phases.is_some()),
            "tenants: at least one tenant needs share > 0 or its own phases"
        );
        for (i, t) in self.tenants.iter().enumerate() {
            anyhow::ensure!(t.share >= 0.0, "tenants[{i}].share must be >= 0");
            if let Some(phases) = &t.phases {
                validate_phases(phases, &format!("tenants[{i}].phases"))?;
            }
            if let Some(c) = &t.class {
                anyhow::ensure!(
                    self.classes.iter().any(|k| &k.name == c),
                    "tenants[{i}].class: no class named {c:?} under [[classes]]"
                );
            }
        }
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.sessions.share),
            "sessions.share must be in [0, 1]"
        );
        self.sessions.turns.validate().context("sessions.turns")?;
        self.sessions
            .think_time_s
            .validate()
            .context("sessions.think_time_s")?;
        if let Some(d) = &self.sessions.follow_up_tokens {
            d.validate().context("sessions.follow_up_tokens")?;
        }
        anyhow::ensure!(
            self.sessions.context_tokens != Some(0),
            "sessions.context_tokens must be > 0 (or left out)"
        );
        anyhow::ensure!(self.client.timeout_s > 0.0, "client.timeout_s must be > 0");
        anyhow::ensure!(
            self.client.max_attempts >= 1,
            "client.max_attempts must be >= 1"
        );
        anyhow::ensure!(
            self.client.max_in_flight >= 1,
            "client.max_in_flight must be >= 1"
        );
        for (i, f) in self.faults.iter().enumerate() {
            if matches!(f.action, FaultAction::Post) {
                anyhow::ensure!(f.url.is_some(), "faults[{i}]: action \"post\" needs a url");
            }
        }
        Ok(())
    }
}

/// The rate of a list of phases run one after another, `t` seconds from their start (0 past
/// their end).
fn phases_rate_at(phases: &[Phase], t: f64, rps: &dyn Fn(Rate) -> f64) -> f64 {
    let mut start = 0.0;
    for p in phases {
        let d = p.duration_s();
        if t >= start && t < start + d {
            return p.rate_at(t - start, rps);
        }
        start += d;
    }
    0.0
}

fn validate_phases(phases: &[Phase], path: &str) -> anyhow::Result<()> {
    anyhow::ensure!(!phases.is_empty(), "{path}: give at least one phase");
    for (i, p) in phases.iter().enumerate() {
        let d = p.duration_s();
        anyhow::ensure!(
            d.is_finite() && d > 0.0,
            "{path}[{i}].duration_s must be > 0 (got {d})"
        );
    }
    Ok(())
}

/// A rate: a number is requests per second; a string `"2.5x"` is a multiple of the
/// scenario's `capacity_rps`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RateRepr", into = "RateRepr")]
pub enum Rate {
    /// Absolute requests per second.
    Rps(f64),
    /// A multiple of `capacity_rps`.
    Multiple(f64),
}

impl Rate {
    /// Requests per second, given what `1x` is.
    pub fn rps(self, capacity_rps: f64) -> f64 {
        match self {
            Rate::Rps(r) => r,
            Rate::Multiple(m) => m * capacity_rps,
        }
    }
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum RateRepr {
    Number(f64),
    Text(String),
}

impl TryFrom<RateRepr> for Rate {
    type Error = String;
    fn try_from(value: RateRepr) -> Result<Self, Self::Error> {
        let rate = match value {
            RateRepr::Number(n) => Rate::Rps(n),
            RateRepr::Text(s) => {
                let t = s.trim();
                let number = t.strip_suffix('x').or_else(|| t.strip_suffix('X'));
                match number.map(|n| n.trim().parse::<f64>()) {
                    Some(Ok(m)) => Rate::Multiple(m),
                    _ => {
                        return Err(format!(
                            "rate {s:?}: write a number of requests per second (50) or a \
                             multiple of capacity_rps (\"2.5x\")"
                        ))
                    }
                }
            }
        };
        let value = match rate {
            Rate::Rps(v) | Rate::Multiple(v) => v,
        };
        if value.is_finite() && value >= 0.0 {
            Ok(rate)
        } else {
            Err(format!("rate must be a finite number >= 0, got {value}"))
        }
    }
}

impl From<Rate> for RateRepr {
    fn from(rate: Rate) -> Self {
        match rate {
            Rate::Rps(r) => RateRepr::Number(r),
            Rate::Multiple(m) => RateRepr::Text(format!("{m}x")),
        }
    }
}

/// One phase of the offered load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Phase {
    /// A constant rate.
    Steady {
        /// Length of the phase.
        duration_s: f64,
        /// The rate.
        rps: Rate,
    },
    /// A rate moving linearly from `from_rps` to `to_rps`.
    Ramp {
        /// Length of the phase.
        duration_s: f64,
        /// Rate at the start.
        from_rps: Rate,
        /// Rate at the end.
        to_rps: Rate,
    },
    /// `from_rps` until `at_s` (from the phase start), then `to_rps`.
    Step {
        /// Length of the phase.
        duration_s: f64,
        /// Rate before the step.
        from_rps: Rate,
        /// Rate after the step.
        to_rps: Rate,
        /// When the step happens, from the start of the phase.
        at_s: f64,
    },
    /// `base_rps`, with `peak_rps` from `at_s` for `length_s` seconds.
    Spike {
        /// Length of the phase.
        duration_s: f64,
        /// Rate outside the spike.
        base_rps: Rate,
        /// Rate during the spike.
        peak_rps: Rate,
        /// Start of the spike, from the start of the phase.
        at_s: f64,
        /// Length of the spike.
        length_s: f64,
    },
    /// `mean_rps + amplitude_rps × sin(2π t / period_s)`, never below zero.
    Sine {
        /// Length of the phase.
        duration_s: f64,
        /// Middle of the wave.
        mean_rps: Rate,
        /// Height of the wave above and below the middle.
        amplitude_rps: Rate,
        /// Length of one full wave.
        period_s: f64,
    },
}

impl Phase {
    /// Multiplies every time of the phase (length, step and spike times, sine period).
    pub fn scale_time(&mut self, f: f64) {
        match self {
            Phase::Steady { duration_s, .. } | Phase::Ramp { duration_s, .. } => *duration_s *= f,
            Phase::Step {
                duration_s, at_s, ..
            } => {
                *duration_s *= f;
                *at_s *= f;
            }
            Phase::Spike {
                duration_s,
                at_s,
                length_s,
                ..
            } => {
                *duration_s *= f;
                *at_s *= f;
                *length_s *= f;
            }
            Phase::Sine {
                duration_s,
                period_s,
                ..
            } => {
                *duration_s *= f;
                *period_s *= f;
            }
        }
    }

    /// Length of the phase in seconds.
    pub fn duration_s(&self) -> f64 {
        match self {
            Phase::Steady { duration_s, .. }
            | Phase::Ramp { duration_s, .. }
            | Phase::Step { duration_s, .. }
            | Phase::Spike { duration_s, .. }
            | Phase::Sine { duration_s, .. } => *duration_s,
        }
    }

    /// The rate (requests per second) at `t` seconds into the phase, where `rps` turns a
    /// [`Rate`] into requests per second.
    pub fn rate_at(&self, t: f64, rps: &dyn Fn(Rate) -> f64) -> f64 {
        let r = match self {
            Phase::Steady { rps: r, .. } => rps(*r),
            Phase::Ramp {
                duration_s,
                from_rps,
                to_rps,
            } => {
                let f = (t / duration_s).clamp(0.0, 1.0);
                rps(*from_rps) + (rps(*to_rps) - rps(*from_rps)) * f
            }
            Phase::Step {
                from_rps,
                to_rps,
                at_s,
                ..
            } => {
                if t < *at_s {
                    rps(*from_rps)
                } else {
                    rps(*to_rps)
                }
            }
            Phase::Spike {
                base_rps,
                peak_rps,
                at_s,
                length_s,
                ..
            } => {
                if t >= *at_s && t < at_s + length_s {
                    rps(*peak_rps)
                } else {
                    rps(*base_rps)
                }
            }
            Phase::Sine {
                mean_rps,
                amplitude_rps,
                period_s,
                ..
            } => {
                let period = period_s.max(1e-3);
                rps(*mean_rps) + rps(*amplitude_rps) * (std::f64::consts::TAU * t / period).sin()
            }
        };
        r.max(0.0)
    }
}

/// How arrivals are spread around the rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Arrival {
    /// `constant` (evenly spaced), `poisson` (memoryless) or `gamma` (bursty or smooth).
    pub process: Process,
    /// For `gamma`: the index of dispersion of arrival counts (variance / mean). 1 is as
    /// bursty as Poisson, 4 is burstier, 0.25 smoother.
    pub burstiness: f64,
}

impl Default for Arrival {
    fn default() -> Self {
        Self {
            process: Process::Poisson,
            burstiness: 1.0,
        }
    }
}

/// The arrival process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Process {
    /// Evenly spaced arrivals.
    Constant,
    /// Exponential gaps: independent arrivals.
    Poisson,
    /// Gamma-distributed gaps with shape `1 / burstiness`.
    Gamma,
}

/// A kind of request and its share of the traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Class {
    /// Name, used in the per-class breakdown.
    pub name: String,
    /// Relative weight in the mix.
    pub weight: f64,
    /// Prompt length in tokens.
    pub prompt_tokens: Dist,
    /// `max_tokens` of the request (the engine generates up to this many).
    pub max_tokens: Dist,
    /// Ask for a server-sent-event stream (`stream: true`); needed for TTFT and ITL.
    pub stream: bool,
    /// Share (0..1) of this class's requests that are slow: long context and long output.
    pub slow_share: f64,
    /// Prompt length of a slow request.
    pub slow_prompt_tokens: Dist,
    /// `max_tokens` of a slow request.
    pub slow_max_tokens: Dist,
    /// Model name sent; defaults to `request.model`.
    pub model: Option<String>,
    /// This class's client behaviour instead of `client.behaviour` (e.g. `async` long jobs
    /// beside interactive chat).
    pub behaviour: Option<Behaviour>,
    /// What this class's prompts are written in (`"english"`, `"cjk"`, `"code"`, `"mixed"`,
    /// or weights such as `{ cjk = 0.8, english = 0.2 }`); a tenant's own `text` wins.
    /// Default: English.
    pub text: Option<TextMix>,
    /// Extra JSON fields merged into this class's request bodies after `request.extra`
    /// (e.g. `ignore_eos = true`: the engine runs every answer to its `max_tokens`).
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Default for Class {
    fn default() -> Self {
        Self {
            name: "chat".into(),
            weight: 1.0,
            prompt_tokens: Dist::Constant { value: 200.0 },
            max_tokens: Dist::Constant { value: 100.0 },
            stream: true,
            slow_share: 0.0,
            slow_prompt_tokens: Dist::Constant { value: 8000.0 },
            slow_max_tokens: Dist::Constant { value: 1000.0 },
            model: None,
            behaviour: None,
            text: None,
            extra: BTreeMap::new(),
        }
    }
}

/// A tenant: an API key, its share of the traffic and a tier for reporting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tenant {
    /// Name, used in the per-tenant breakdown.
    pub name: String,
    /// Bearer token sent as `Authorization: Bearer <api_key>`.
    pub api_key: String,
    /// Relative share of the scenario's `phases` traffic (0 = none).
    pub share: f64,
    /// Tier label (e.g. `premium`, `standard`, `free`), for the per-tier breakdown. The
    /// gateway decides the real tier from the key; this label only groups results.
    pub tier: String,
    /// Optional label pooling tenants into one breakdown (`per_group` in the report), e.g.
    /// `"quiet"` for every tenant that is not the noisy neighbour: one latency distribution
    /// over all of them holds more samples than any tenant's alone.
    pub group: Option<String>,
    /// Extra traffic of this tenant alone, on top of its share: e.g. a noisy neighbour.
    pub phases: Option<Vec<Phase>>,
    /// Every request of this tenant is of this class (by name), its sizes drawn from the
    /// tenant's own generator: adding or removing such a tenant leaves everyone else's
    /// requests exactly as they were (e.g. async long jobs beside interactive traffic).
    pub class: Option<String>,
    /// What this tenant's prompts are written in, whatever their class (see
    /// [`Class::text`]); e.g. a tenant whose users write Chinese.
    pub text: Option<TextMix>,
}

impl Default for Tenant {
    fn default() -> Self {
        Self {
            name: "default".into(),
            api_key: "sk-levee-default".into(),
            share: 1.0,
            tier: "standard".into(),
            group: None,
            phases: None,
            class: None,
            text: None,
        }
    }
}

/// Multi-turn conversations: a share of arrivals starts a session whose later turns follow
/// the previous answer after a think time, with the whole history as prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Sessions {
    /// Share (0..1) of arrivals that start a session; 0 disables sessions.
    pub share: f64,
    /// Turns per session, the first included.
    pub turns: Dist,
    /// Seconds between an answer and the next question.
    pub think_time_s: Dist,
    /// Tokens of a later turn's new question; the class's `prompt_tokens` if left out. A
    /// session that opens with a long document or instructions and goes on with short
    /// questions sets it apart from the opening's size.
    pub follow_up_tokens: Option<Dist>,
    /// The client's context window, if it keeps to one: a turn whose history plus its
    /// `max_tokens` would not fit drops its oldest history first, as chat clients do.
    pub context_tokens: Option<u32>,
}

impl Default for Sessions {
    fn default() -> Self {
        Self {
            share: 0.0,
            turns: Dist::Constant { value: 3.0 },
            think_time_s: Dist::Exponential {
                mean: 2.0,
                min: None,
                max: None,
            },
            follow_up_tokens: None,
            context_tokens: None,
        }
    }
}

/// How a client behaves when a request fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Behaviour {
    /// Never retry.
    None,
    /// Retry at once after a timeout or error, no backoff, no budget: the retry storm.
    Naive,
    /// levee-client's policy: full-jitter backoff, Retry-After, retry budget.
    Backoff,
    /// An async client: submits the request to `POST /v1/tasks` (not streamed), polls
    /// `GET /v1/tasks/{id}` at the interval the gateway advises (`poll_after_ms`), and takes
    /// the result from the finished task. The report counts task outcomes and the error of
    /// the ETA the gateway gave at submission. No retries.
    Async,
}

/// Client behaviour: timeouts, retries, concurrency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// `none`, `naive` or `backoff`.
    pub behaviour: Behaviour,
    /// A client gives up on an attempt after this long and disconnects.
    pub timeout_s: f64,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// `backoff`: upper bound of the first retry delay.
    pub backoff_base_ms: u64,
    /// `backoff`: no retry delay is longer (a Retry-After may be).
    pub backoff_cap_ms: u64,
    /// `backoff`: a Retry-After longer than this makes the client give up.
    pub max_retry_after_s: f64,
    /// `backoff`: share of requests that may be retried (per tenant).
    pub budget_ratio: f64,
    /// `backoff`: retries allowed per second regardless of traffic (per tenant).
    pub budget_min_per_sec: f64,
    /// `backoff`: most retry tokens saved up (per tenant).
    pub budget_max_tokens: f64,
    /// Most requests in flight at once: a safety bound on sockets. A request that must wait
    /// for a slot is sent late and its lag is recorded (never dropped).
    pub max_in_flight: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            behaviour: Behaviour::None,
            timeout_s: 30.0,
            max_attempts: 3,
            backoff_base_ms: 250,
            backoff_cap_ms: 10_000,
            max_retry_after_s: 30.0,
            budget_ratio: 0.1,
            budget_min_per_sec: 1.0,
            budget_max_tokens: 10.0,
            max_in_flight: 8192,
        }
    }
}

/// Service-level objectives: a request is good when it succeeded and met every set bound.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Slo {
    /// Most time to first token, from the intended send time.
    pub ttft_ms: Option<f64>,
    /// Most mean time per output token after the first.
    pub tpot_ms: Option<f64>,
    /// Most end-to-end time, from the intended send time.
    pub e2e_ms: Option<f64>,
}

impl Default for Slo {
    fn default() -> Self {
        Self {
            ttft_ms: Some(2000.0),
            tpot_ms: Some(100.0),
            e2e_ms: Some(30_000.0),
        }
    }
}

/// Model name sent by default: the simulated engine's default model (its `small` and
/// `a100-7b` profiles), so that a scenario runs against `levee engine` as it is.
pub const DEFAULT_MODEL: &str = "levee-sim-7b";

/// Where requests go and what they ask for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestConfig {
    /// Path on the target, `/v1/chat/completions` by default.
    pub path: String,
    /// Model name in every request (a class may override it).
    pub model: String,
    /// Extra JSON fields merged into every request body (e.g. `temperature`).
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Default for RequestConfig {
    fn default() -> Self {
        Self {
            path: "/v1/chat/completions".into(),
            model: DEFAULT_MODEL.into(),
            extra: BTreeMap::new(),
        }
    }
}

/// Prometheus scraping during the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Scrape period.
    pub interval_ms: u64,
    /// Gauge names to keep (summed over label sets).
    pub gauges: Vec<String>,
    /// `/metrics` URLs scraped besides those of the target (`name = url`).
    pub urls: BTreeMap<String, String>,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1000,
            gauges: DEFAULT_GAUGES.iter().map(|s| s.to_string()).collect(),
            urls: BTreeMap::new(),
        }
    }
}

/// Gauges scraped by default: vLLM's names (the simulated engine serves the same) and the
/// gateway's (`docs/gateway.md`): requests queued, proxied now, and the degradation level.
pub const DEFAULT_GAUGES: &[&str] = &[
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "levee_queued",
    "levee_in_flight",
    "levee_degrade_level",
];

/// A fault injected at a time: a JSON body POSTed to a URL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// When, in seconds from the start of the run.
    pub at_s: f64,
    /// What to do. Named actions build the engine admin call; `post` sends `body` to `url`.
    pub action: FaultAction,
    /// Which engine (index into the target's engine admin URLs) for named actions.
    #[serde(default)]
    pub engine: usize,
    /// Full URL to POST to; for named actions it replaces the engine admin URL + path.
    #[serde(default)]
    pub url: Option<String>,
    /// JSON body; for named actions, fields merged over the built body.
    #[serde(default)]
    pub body: Option<serde_json::Value>,
    /// `slow`: latency added before each new request reaches the engine's scheduler, in
    /// (simulated) milliseconds; default 100.
    #[serde(default)]
    pub latency_ms: Option<f64>,
    /// `errors`: share of new requests that fail at once with 500; default 0.5.
    #[serde(default)]
    pub error_rate: Option<f64>,
    /// For `hang`, `slow` and `errors`: the simulator sends `recover` this many seconds
    /// later (none = until an explicit `recover`). A crash ends by itself (engine restart).
    #[serde(default)]
    pub duration_s: Option<f64>,
}

/// A named fault, or a generic POST.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultAction {
    /// The engine crashes as on a GPU out-of-memory: in-flight requests fail, it answers 503
    /// until it has restarted.
    Crash,
    /// The engine accepts requests and never answers.
    Hang,
    /// The engine delays new requests by `latency_ms`.
    Slow,
    /// The engine fails `error_rate` of requests with 500.
    Errors,
    /// The engine's injected faults (latency, errors, hang) are cleared.
    Recover,
    /// POST `body` to `url`, nothing more.
    Post,
}
