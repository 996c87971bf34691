//! The files under deploy/ agree with what levee exports: every metric the Grafana dashboard
//! and the alert rules name is one `/metrics` serves, and the Kubernetes config is valid.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

use levee_gateway::metrics::Metrics;
use levee_gateway::Config;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn deploy(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(rel)
}

/// Every sample name `/metrics` can serve: each registered family's name with the suffixes
/// its type gives its samples. (The exposition itself leaves out families that have no
/// series yet, so it cannot be the list.)
fn exported() -> BTreeSet<String> {
    let metrics = Metrics::with_shared_state();
    let mut names = BTreeSet::new();
    for (name, kind) in metrics.families() {
        let suffixes: &[&str] = match kind {
            "counter" => &["_total", "_created"],
            // A histogram's family name is how people refer to it in prose.
            "histogram" => &["", "_bucket", "_sum", "_count", "_created"],
            _ => &[""],
        };
        for s in suffixes {
            names.insert(format!("{name}{s}"));
        }
    }
    // Each family the exposition does show is among them.
    for line in metrics.encode().lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|r| r.split(' ').next())
        {
            assert!(
                metrics.families().any(|(n, _)| n == name),
                "{name} is not listed"
            );
        }
    }
    names
}

/// Every `levee_...` identifier in a text.
fn named(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(pos) = text[i..].find("levee_") {
        let start = i + pos;
        let boundary = start == 0 || {
            let c = bytes[start - 1];
            !(c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.')
        };
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

#[test]
fn dashboards_and_alerts_name_only_exported_metrics() {
    let exported = exported();
    assert!(exported.contains("levee_requests_total"), "{exported:?}");
    assert!(exported.contains("levee_request_ttft_seconds_bucket"));
    for file in ["grafana/levee.json", "prometheus/alerts.yml"] {
        let text = std::fs::read_to_string(deploy(file)).unwrap();
        if file.ends_with(".json") {
            serde_json::from_str::<serde_json::Value>(&text).expect("the dashboard is JSON");
        }
        let used = named(&text);
        assert!(used.len() >= 8, "{file} names only {used:?}");
        let unknown: Vec<_> = used.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics levee does not export: {unknown:?}"
        );
    }
}

#[test]
fn the_name_scan_finds_what_it_must() {
    let found = named("rate(levee_abandoned_total[5m]) / levee_x{a=\"levee_y\"} not_levee_z");
    let want: BTreeSet<String> = ["levee_abandoned_total", "levee_x", "levee_y"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(found, want);
}

#[test]
fn kubernetes_config_is_valid() {
    let cfg = Config::load(&deploy("kubernetes/levee.toml")).unwrap();
    assert!(!cfg.listen.admin.ip().is_loopback());
    // The autoscaler's ceiling is the number of backends levee knows about.
    let backends = cfg.models[0].backends.len();
    assert_eq!(cfg.autoscale.max_replicas as usize, backends);
    let keda = std::fs::read_to_string(deploy("kubernetes/keda.yaml")).unwrap();
    assert!(
        keda.contains(&format!("maxReplicaCount: {backends}")),
        "{keda}"
    );
    assert!(keda.contains(&format!("minReplicaCount: {}", cfg.autoscale.min_replicas)));
    // The query sums the replicas' offered load and sizes it as levee does: slots per
    // backend at the target utilization, plus the warm pool.
    let b = &cfg.models[0].backends[0];
    let query = format!(
        "query: ceil(sum(levee_offered_load{{model=\"{}\"}}) / ({} * {})) + {}",
        cfg.models[0].name,
        b.max_in_flight,
        cfg.autoscale.target_utilization,
        cfg.autoscale.warm_pool
    );
    assert!(keda.contains(&query), "{query} in {keda}");
    let hold = cfg.autoscale.scale_in_hold_ms / 1000;
    assert!(keda.contains(&format!("stabilizationWindowSeconds: {hold}")));
}

#[test]
fn minimal_config_is_one_tenant_one_model_one_backend_and_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../levee.minimal.toml");
    let cfg = Config::load(&path).unwrap();
    assert_eq!(cfg.tenants.len(), 1);
    assert_eq!(cfg.models.len(), 1);
    assert_eq!(cfg.models[0].backends.len(), 1);
    // Everything else is the default: the file sets nothing more.
    let defaults = Config {
        tenants: cfg.tenants.clone(),
        models: cfg.models.clone(),
        ..Config::default()
    };
    assert_eq!(cfg, defaults);
    // The key in the file's comments is the one its hash stands for.
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("Bearer sk-levee-minimal"));
    assert_eq!(
        cfg.tenants[0].key_sha256,
        [levee_gateway::hash_key("sk-levee-minimal")]
    );
}

#[test]
fn compose_config_is_the_minimal_one_bound_for_a_container() {
    let compose = Config::load(&deploy("compose/config/levee.toml")).unwrap();
    let minimal =
        Config::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../levee.minimal.toml"))
            .unwrap();
    assert!(compose.listen.public.ip().is_unspecified());
    assert!(compose.listen.admin.ip().is_unspecified());
    assert_eq!(compose.tenants, minimal.tenants);
    assert_eq!(compose.models[0].name, minimal.models[0].name);
    assert_eq!(compose.models[0].backends[0].url, "http://engine:8000");
    let yaml = std::fs::read_to_string(deploy("compose/compose.yaml")).unwrap();
    assert!(
        yaml.contains("\"--model\", \"llama\""),
        "the engine serves the model"
    );
    assert!(yaml.contains("./config:/etc/levee:ro"));
}
