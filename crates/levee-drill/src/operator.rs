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
