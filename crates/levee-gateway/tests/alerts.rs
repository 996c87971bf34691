//! The alert rules (deploy/prometheus/alerts.yml) stay silent on what a healthy deployment
//! really exports: a gateway started in-process from the shipped configs (the Kubernetes
//! example, 8 backends listed and 2 running; the minimal config, 1 backend on the defaults),
//! limits in memory, serving a few requests. Its `/metrics` becomes an hour of Prometheus
//! series (gauges flat, counters growing at a steady rate) that `promtool test rules`
//! evaluates every alert over.
//!
//! Needs `promtool` (Debian package `prometheus`); without it the test skips, unless
//! LEVEE_REQUIRE_PROMTOOL=1.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is the report

mod common;

use levee_gateway::Config;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn promtool() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("promtool"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var("LEVEE_REQUIRE_PROMTOOL").as_deref() != Ok("1"),
            "promtool is required (LEVEE_REQUIRE_PROMTOOL=1) but not on PATH"
        );
        eprintln!("skipping: promtool not found (Debian package prometheus)");
    }
    found
}

/// A loopback address where nothing listens (a backend the autoscaler has not started).
fn nothing_listens() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}")
}

/// Turns an exposition into promtool input series over an hour at 15 s steps: gauges keep
/// their value, counters (and histogram parts) grow by it at each step.
fn input_series(exposition: &str, instance: &str) -> String {
    let mut out = String::new();
    for line in exposition.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = value.parse().unwrap();
        let name = series.split('{').next().unwrap();
        if name.ends_with("_created") {
            continue;
        }
        let extra = format!("job=\"levee\",instance=\"{instance}\"");
        let labelled = match series.strip_suffix('}') {
            Some(s) => format!("{s},{extra}}}"),
            None => format!("{series}{{{extra}}}"),
        };
        let growing = ["_total", "_bucket", "_count", "_sum"]
            .iter()
            .any(|s| name.ends_with(s));
        let values = if growing {
            format!("0+{value}x240")
        } else {
            format!("{value}x240")
        };
        out.push_str(&format!(
            "      - series: '{labelled}'\n        values: '{values}'\n"
        ));
    }
    out
}

fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|n| n.trim().to_string())
        .collect()
}

/// Runs promtool over the series of `exposition`, expecting every alert silent at 5, 30 and
/// 60 minutes; returns promtool's report on failure.
fn alerts_silent_on(exposition: &str, dir: &Path, promtool: &Path) -> Result<(), String> {
    let rules = repo("deploy/prometheus/alerts.yml");
    let names = alert_names(&std::fs::read_to_string(&rules).unwrap());
    assert!(names.len() >= 10, "{names:?}");
    let mut test = format!(
        "rule_files:\n  - {}\nevaluation_interval: 15s\ntests:\n  - interval: 15s\n    input_series:\n{}    alert_rule_test:\n",
        rules.canonicalize().unwrap().display(),
        input_series(exposition, "127.0.0.1:9090")
    );
    for t in ["5m", "30m", "60m"] {
        for n in &names {
            test.push_str(&format!(
                "      - alertname: {n}\n        eval_time: {t}\n        exp_alerts: []\n"
            ));
        }
    }
    let file = dir.join("silent.test.yml");
    std::fs::write(&file, test).unwrap();
    let out = std::process::Command::new(promtool)
        .args(["test", "rules"])
        .arg(&file)
        .output()
        .unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Starts `cfg` with `running` backends up (mocks) and the rest unreachable, sends a few
/// requests with `key`, waits until the scraper has marked the unreachable ones down, and
/// returns `/metrics`.
async fn exposition_of(mut cfg: Config, running: usize, key: &str) -> String {
    cfg.listen.public = "127.0.0.1:0".parse().unwrap();
    cfg.listen.admin = "127.0.0.1:0".parse().unwrap();
    cfg.scrape.interval_ms = 50;
    let mut mocks = Vec::new();
    for (i, b) in cfg.models[0].backends.iter_mut().enumerate() {
        if i < running {
            let m = common::mock().await;
            b.url = m.url();
            mocks.push(m);
        } else {
            b.url = nothing_listens();
        }
    }
    let model = cfg.models[0].name.clone();
    let listed = cfg.models[0].backends.len();
    let gw = levee_gateway::start(cfg).await.unwrap();
    let c = common::client();
    let admin = gw.admin_url();
    // Until the scraper has marked the missing backends down.
    let mut down = 0;
    for _ in 0..500 {
        let state: serde_json::Value = c
            .get(format!("{admin}/admin/state"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        down = state["models"][0]["backends"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["healthy"] == false)
            .count();
        if down == listed - running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(down, listed - running, "backends marked down");
    for i in 0..5 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.public_url()))
            .bearer_auth(key)
            .json(&serde_json::json!({"model": model, "max_tokens": 4,
                "messages": [{"role": "user", "content": format!("hello {i}")}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    // The periodic figures, as their tickers would have them by the first scrape.
    gw.gateway().update_scaling();
    gw.gateway().update_degrade();
    let text = c
        .get(format!("{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    gw.shutdown().await;
    text
}

#[tokio::test]
async fn alerts_stay_silent_on_a_healthy_in_memory_deployment() {
    let Some(promtool) = promtool() else { return };
    let dir = std::env::temp_dir().join(format!("levee-alerts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let k8s = Config::load(&repo("deploy/kubernetes/levee.toml")).unwrap();
    assert_eq!(k8s.models[0].backends.len(), 8);
    let text = exposition_of(k8s, 2, "replace-me-standard").await;
    assert!(text.contains("levee_backend_healthy"), "{text}");
    assert!(!text.contains("levee_state_shared"), "in memory: {text}");
    assert!(text.contains("levee_recommended_replicas{"), "{text}");
    let k8s = alerts_silent_on(&text, &dir, &promtool);

    let minimal = Config::load(&repo("levee.minimal.toml")).unwrap();
    let key = "sk-levee-minimal";
    let text = exposition_of(minimal, 1, key).await;
    let minimal = alerts_silent_on(&text, &dir, &promtool);
    let _ = std::fs::remove_dir_all(&dir);
    k8s.map_err(|e| format!("Kubernetes example: {e}")).unwrap();
    minimal.map_err(|e| format!("minimal config: {e}")).unwrap();
}

#[test]
fn series_conversion_keeps_labels_and_grows_counters() {
    let text = "# TYPE levee_queued gauge\nlevee_queued 3\n\
                levee_requests_total{tenant=\"a\",outcome=\"ok\"} 2\n\
                levee_requests_created{tenant=\"a\"} 1.7e9\n# EOF\n";
    let s = input_series(text, "x:1");
    assert!(s.contains("'levee_queued{job=\"levee\",instance=\"x:1\"}'\n        values: '3x240'"));
    assert!(s.contains(
        "'levee_requests_total{tenant=\"a\",outcome=\"ok\",job=\"levee\",instance=\"x:1\"}'\n        values: '0+2x240'"
    ));
    assert!(!s.contains("_created"));
}
