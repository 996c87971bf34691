//! What the drill takes from levee's configuration: the configuration for a run, and the
//! premium quotas an independent client-side check applies.

use anyhow::Context;
use levee_sim::Scenario;

/// levee's configuration for a run: the given TOML with its listeners on ephemeral loopback
/// ports and the scenario model's backends pointed at the drill's engines in order (a
/// missing backend entry copies the first). A scenario tenant whose key the configuration
/// does not list is added with the quotas of the first listed tenant of its tier label.
pub fn gateway_config(
    text: &str,
    scenario: &Scenario,
    engine_urls: &[String],
) -> anyhow::Result<levee_gateway::Config> {
    let invalid = |errors: Vec<String>| {
        anyhow::anyhow!(
            "the drill's gateway configuration is invalid:\n  {}",
            errors.join("\n  ")
        )
    };
    let mut cfg = levee_gateway::Config::from_toml_str(text).map_err(invalid)?;
    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().context("loopback address")?;
    cfg.listen.public = loopback;
    cfg.listen.admin = loopback;
    let model_name = &scenario.request.model;
    let known: Vec<String> = cfg.models.iter().map(|m| m.name.clone()).collect();
    let model = cfg
        .models
        .iter_mut()
        .find(|m| &m.name == model_name)
        .with_context(|| {
            format!(
                "the gateway configuration has no [[models]] entry named {model_name:?} (the \
                 scenario's model); it has {known:?}"
            )
        })?;
    let template = model.backends.first().cloned().with_context(|| {
        format!("model {model_name:?} in the gateway configuration has no backends to copy")
    })?;
    model.backends = engine_urls
        .iter()
        .enumerate()
        .map(|(i, url)| {
            let mut b = model
                .backends
                .get(i)
                .cloned()
                .unwrap_or_else(|| template.clone());
            b.url = url.clone();
            b
        })
        .collect();
    for tenant in &scenario.tenants {
        let hash = levee_gateway::hash_key(&tenant.api_key);
        if cfg.tenants.iter().any(|t| t.key_sha256.contains(&hash)) {
            continue;
        }
        let like = cfg
            .tenants
            .iter()
            .find(|t| t.tier == tenant.tier)
            .cloned()
            .with_context(|| {
                format!(
                    "scenario tenant {:?}: its key is not in the gateway configuration, and no \
                     tenant of its tier {:?} is there to copy quotas from; add it to the \
                     configuration",
                    tenant.name, tenant.tier
                )
            })?;
        cfg.tenants.push(levee_gateway::config::TenantConfig {
            name: format!("drill-{}", tenant.name),
            key_sha256: vec![hash],
            key_env: Vec::new(),
            ..like
        });
    }
    let errors = cfg.validate();
    if !errors.is_empty() {
        return Err(invalid(errors));
    }
    Ok(cfg)
}

pub(crate) fn premium_over_quota(
    sends: &std::collections::BTreeMap<String, Vec<u64>>,
    scenario: &Scenario,
    cfg: &levee_gateway::Config,
) -> u64 {
    use levee_policy::{Gcra, Quota, Timestamp};
    let mut over = 0;
    for tenant in scenario.tenants.iter().filter(|t| t.tier == "premium") {
        let hash = levee_gateway::hash_key(&tenant.api_key);
        let Some(conf) = cfg.tenants.iter().find(|t| t.key_sha256.contains(&hash)) else {
            continue;
        };
        if conf.requests_per_minute == 0 {
            continue;
        }
        let burst = if conf.requests_burst == 0 {
            conf.requests_per_minute
        } else {
            conf.requests_burst
        };
        let mut gcra = Gcra::new(
            Quota::per_minute(u64::from(conf.requests_per_minute)).with_burst(u64::from(burst)),
        );
        for &ms in sends.get(&tenant.name).into_iter().flatten() {
            if gcra.check(Timestamp::from_nanos(ms * 1_000_000)).is_err() {
                over += 1;
            }
        }
    }
    over
}

/// Premium requests of the run's schedule that no engine of `max_model_len` tokens takes:
/// the prompt as the engine counts it (the simulator writes exactly the scheduled number of
/// engine tokens, plus the chat template's on the chat path) and `max_tokens` together over
/// the context, the engine's own rule — an estimate independent of levee's, to weigh
/// levee's own 400s against. `scenario` must be the one the run used (its schedule is
/// rebuilt from its seed). Sessions' later turns are not in the schedule and are not
/// counted (the estimate errs low there); a request both too long and over its tenant's
/// quota counts in both estimates (high there, by at most those few).
pub(crate) fn premium_over_context(scenario: &Scenario, max_model_len: u32) -> anyhow::Result<u64> {
    use levee_engine::tokenizer::{CHAT_TOKENS_PER_MESSAGE, CHAT_TOKENS_PER_PROMPT};
    let template = if scenario.request.path.ends_with("/chat/completions") {
        CHAT_TOKENS_PER_PROMPT + CHAT_TOKENS_PER_MESSAGE
    } else {
        0
    };
    let schedule = levee_sim::arrivals::build(scenario)?;
    let over = schedule
        .arrivals
        .iter()
        .filter(|a| {
            scenario
                .tenants
                .get(usize::from(a.tenant))
                .is_some_and(|t| t.tier == "premium")
        })
        .filter(|a| {
            u64::from(a.prompt_tokens) + u64::from(template) + u64::from(a.max_tokens)
                > u64::from(max_model_len)
        })
        .count();
    Ok(over as u64)
}

/// The fleet a calibrated configuration is for.
pub(crate) struct Fleet {
    /// The backends' base URLs.
    pub urls: Vec<String>,
    /// `vllm` or `llamacpp`.
    pub kind: String,
    /// Each backend's sequence slots (`max_num_seqs`, llama-server's `--parallel`).
    pub max_in_flight: u32,
}

/// What the configuration's numbers are derived from.
pub(crate) struct Basis {
    /// C: the knee the drill's capacity method measured, req/s.
    pub capacity_rps: f64,
    /// T: the traffic's TTFT objective, ms.
    pub ttft_slo_ms: f64,
    /// E: the 99th-percentile end to end at the knee, ms.
    pub e2e_p99_ms: f64,
    /// The model name clients send.
    pub model: String,
    /// How and when C was measured, for the file's comments.
    pub measured: String,
}

/// One tier's numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TierContract {
    pub queue_wait_ms: u64,
    pub soft_queue_wait_ms: u64,
    pub requests_per_minute: u32,
    pub requests_burst: u32,
    pub max_concurrency: u32,
}

/// The tiers, their share of C, and their waits as shares of T (queue, soft).
const TIERS: [(&str, f64, f64, f64); 3] = [
    ("premium", 0.5, 0.75, 0.75),
    ("standard", 0.4, 0.5, 0.25),
    ("free", 0.2, 0.5, 0.0),
];

/// The formula (the shipped configuration's comments say it in words): a tier's quota is its
/// share of C per minute, its burst 2 s of that rate (at least 8 requests, so that a bursty
/// client at a low rate is not refused for its second request), its concurrency the 99.9th
/// percentile of what that rate keeps outstanding over the tier's wait plus E (a Poisson
/// count whose mean is rate × stay, Little's law: a client at its contract rate is refused
/// for concurrency at most one time in a thousand), at least 4 and at most what the gateway
/// holds at once (the fleet's slots S and its hard queue mark: a larger quota never binds).
pub(crate) fn contract(tier: usize, basis: &Basis, slots: u32) -> TierContract {
    let (_, share, wait, soft) = TIERS[tier];
    let rate = share * basis.capacity_rps;
    let queue_wait_ms = (wait * basis.ttft_slo_ms).round() as u64;
    let stay_s = (queue_wait_ms as f64 + basis.e2e_p99_ms) / 1000.0;
    let (_, _, hard) = watermarks(basis, slots);
    TierContract {
        queue_wait_ms,
        soft_queue_wait_ms: (soft * basis.ttft_slo_ms).round() as u64,
        requests_per_minute: (60.0 * rate).round().max(1.0) as u32,
        requests_burst: ((2.0 * rate).ceil() as u32).max(8),
        max_concurrency: poisson_quantile(rate * stay_s, CONCURRENCY_QUANTILE)
            .clamp(4, (slots + hard).max(4)),
    }
}

/// How rarely a client at its contract rate may find its concurrency quota full.
const CONCURRENCY_QUANTILE: f64 = 0.999;

/// The smallest k with P(X ≤ k) ≥ `q` for X ~ Poisson(`mean`), summed in logarithms so that
/// no term underflows at a large mean.
fn poisson_quantile(mean: f64, q: f64) -> u32 {
    if mean <= 0.0 {
        return 0;
    }
    let target = q.ln();
    let (mut log_term, mut log_cdf) = (-mean, -mean);
    let mut k = 0u32;
    while log_cdf < target && k < u32::MAX {
        k += 1;
        log_term += mean.ln() - f64::from(k).ln();
        let (hi, lo) = (log_cdf.max(log_term), log_cdf.min(log_term));
        log_cdf = hi + (lo - hi).exp().ln_1p();
    }
    k
}

/// The queue watermarks for `slots` sequence slots: safe = S, soft = 1.5 S, hard = the
/// larger of 2 S and S + what the fleet serves in twice premium's wait.
pub(crate) fn watermarks(basis: &Basis, slots: u32) -> (u32, u32, u32) {
    let premium_wait_s = TIERS[0].2 * basis.ttft_slo_ms / 1000.0;
    let burst = (2.0 * basis.capacity_rps * premium_wait_s).ceil() as u32;
    (
        slots,
        (slots * 3).div_ceil(2),
        (2 * slots).max(slots + burst),
    )
}

/// A gateway configuration for `fleet` by the formula, with the scenario's tenants.
pub(crate) fn calibrated_config(fleet: &Fleet, basis: &Basis, scenario: &Scenario) -> String {
    use std::fmt::Write as _;
    let slots = fleet.max_in_flight * fleet.urls.len() as u32;
    let (safe, soft, hard) = watermarks(basis, slots);
    let mut s = format!(
        "# levee's configuration for this fleet, derived by `levee drill --calibrate-config`.\n\
         # C = {c:.1} req/s: the fleet's capacity by the drill's own method ({measured}).\n\
         # T = {t:.0} ms: the traffic's TTFT objective. E = {e:.0} ms: the p99 end to end at C.\n\
         # S = {n} backends × {m} slots = {slots}.\n\
         #   backend max_in_flight = its slots; queue: safe = S, soft = 1.5 S, hard = max(2 S,\n\
         #   S + 2 × C × premium's wait); tier waits: premium 0.75 T, standard and free 0.5 T\n\
         #   (soft: 0.75 T, 0.25 T, 0); quotas: premium 0.5 C, standard 0.4 C, free 0.2 C per\n\
         #   second (× 60 per minute), burst 2 s of it (≥ 8), concurrency = the 99.9th\n\
         #   percentile of Poisson(rate × (wait + E)) (4 ≤ it ≤ S + hard); every tier's\n\
         #   ttft_slo_ms = T.\n\n\
         [listen]\npublic = \"127.0.0.1:8080\"\nadmin = \"127.0.0.1:9090\"\n\n\
         [ip_guard]\nenabled = false  # the drill's clients share 127.0.0.1; decide for your edge\n\n\
         [scrape]\ninterval_ms = 250\ntimeout_ms = 200\nunhealthy_after = 3\n\n\
         [degrade]\nenabled = false\n\n",
        c = basis.capacity_rps,
        measured = basis.measured,
        t = basis.ttft_slo_ms,
        e = basis.e2e_p99_ms,
        n = fleet.urls.len(),
        m = fleet.max_in_flight,
    );
    for (i, (name, ..)) in TIERS.iter().enumerate() {
        let k = contract(i, basis, slots);
        let _ = write!(
            s,
            "[tiers.{name}]\npriority = {i}\nqueue_wait_ms = {}\nsoft_queue_wait_ms = {}\n\
             sheddable = {}\nttft_slo_ms = {}\n\n",
            k.queue_wait_ms,
            k.soft_queue_wait_ms,
            *name == "free",
            basis.ttft_slo_ms.round() as u64,
        );
    }
    let _ = write!(
        s,
        "[queue]\nsafe = {safe}\nsoft = {soft}\nhard = {hard}\n\n\
         # Keys are stored as SHA-256: printf %s 'sk-...' | sha256sum\n"
    );
    for tenant in &scenario.tenants {
        let Some(i) = TIERS.iter().position(|(n, ..)| *n == tenant.tier) else {
            continue;
        };
        let k = contract(i, basis, slots);
        let _ = write!(
            s,
            "[[tenants]]\nname = {:?}\ntier = {:?}\nkey_sha256 = [{:?}]\n\
             requests_per_minute = {}\nrequests_burst = {}\nmax_concurrency = {}\n\n",
            tenant.name,
            tenant.tier,
            levee_gateway::hash_key(&tenant.api_key),
            k.requests_per_minute,
            k.requests_burst,
            k.max_concurrency
        );
    }
    let _ = write!(s, "[[models]]\nname = {:?}\n", basis.model);
    for url in &fleet.urls {
        let _ = write!(
            s,
            "\n[[models.backends]]\nkind = {:?}\nurl = {url:?}\nmax_in_flight = {}\n",
            fleet.kind, fleet.max_in_flight
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_poisson_quantile_is_the_first_count_whose_cdf_reaches_it() {
        // Reference values from the exact pmf (e^-m m^k / k!, summed with lgamma).
        for (mean, k) in [(1.0, 5), (4.0, 11), (10.0, 21), (14.2, 27), (37.8, 58)] {
            assert_eq!(poisson_quantile(mean, 0.999), k, "mean {mean}");
        }
        // A mean whose e^-m underflows a double.
        assert_eq!(poisson_quantile(1000.0, 0.999), 1099);
        assert_eq!(poisson_quantile(0.0, 0.999), 0);
    }

    #[test]
    fn a_tier_at_its_contract_rate_is_not_held_to_the_fleets_slots() {
        // Two four-slot servers: a premium rate of 1.5/s keeps about 8 outstanding over its
        // wait and E, which a cap at the 8 slots refuses at ordinary peaks.
        let basis = |capacity_rps, e2e_p99_ms| Basis {
            capacity_rps,
            ttft_slo_ms: 2000.0,
            e2e_p99_ms,
            model: String::new(),
            measured: String::new(),
        };
        let premium = contract(0, &basis(3.0, 4000.0), 8);
        let mean = 1.5 * (1.5 + 4.0);
        assert_eq!(premium.max_concurrency, poisson_quantile(mean, 0.999));
        assert!(f64::from(premium.max_concurrency) > mean && premium.max_concurrency > 8);
        // Never above what the gateway holds at once, never below 4.
        let (_, _, hard) = watermarks(&basis(3.0, 1e7), 8);
        assert_eq!(contract(0, &basis(3.0, 1e7), 8).max_concurrency, 8 + hard);
        let tiny = basis(0.01, 8000.0);
        assert_eq!(contract(2, &tiny, 8).max_concurrency, 4);
    }
}
