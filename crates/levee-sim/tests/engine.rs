//! levee sim against the real simulated engine (in process, 127.0.0.1:0): the SSE stream it
//! really sends is parsed, its tokens counted, its gauges scraped, its crash recorded.

// Test helpers outside #[test] fns may unwrap too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use levee_sim::{RunOptions, Scenario, Target};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measures_the_simulated_engine_and_its_crash() {
    let mut config = levee_engine::EngineConfig::profile("tiny-fast").unwrap();
    config.time_scale = 10.0;
    config.gpu.restart_secs = 1000.0;
    let engine = levee_engine::spawn(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = engine.base_url();
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 2
        rps = 10
        [[classes]]
        prompt_tokens = { dist = "constant", value = 20 }
        max_tokens = { dist = "constant", value = 12 }
        stream = true
        [request]
        model = "levee-sim-tiny"
        [metrics]
        interval_ms = 200
        [[faults]]
        at_s = 1.0
        action = "crash"
        [slo]
        ttft_ms = 60000
        tpot_ms = 60000
        "#,
    )
    .unwrap();
    let target = Target {
        base_url: url.clone(),
        metrics: vec![("engine-0".into(), format!("{url}/metrics"))],
        engine_admin: vec![url.clone()],
    };
    let opts = RunOptions {
        progress: false,
        ..RunOptions::default()
    };
    let r = levee_sim::run(&scenario, &target, &opts).await.unwrap();
    assert_eq!(r.totals.scheduled, 20);
    assert_eq!(r.totals.completed, 20);
    assert_eq!(r.faults.len(), 1);
    assert_eq!(r.faults[0].status, Some(200), "{:?}", r.faults);
    assert_eq!(engine.stats().crashes, 1);
    // Before the crash the engine served; after it, it answers 503 until restarted, and
    // streams that were open were cut.
    assert!(r.totals.ok >= 5, "{}", r.summary());
    assert!(
        r.errors.get("5xx:503").copied().unwrap_or(0) >= 5,
        "{}",
        r.summary()
    );
    assert_eq!(
        r.totals.ok + r.totals.failed,
        r.totals.completed,
        "{}",
        r.summary()
    );
    // Token counts come from the usage chunk and match the content chunks (ITL gaps).
    assert!(r.totals.output_tokens >= 8 * r.totals.ok);
    assert_eq!(r.latency.itl.count, r.totals.output_tokens - r.totals.ok);
    assert!(r.latency.ttft.p50 <= r.latency.e2e.p50);
    assert!(r
        .metrics
        .iter()
        .any(|m| m.name == "vllm:num_requests_running" && !m.points.is_empty()));
    engine.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_counts_the_prompt_tokens_asked_for_in_every_text_kind() {
    let mut config = levee_engine::EngineConfig::profile("tiny-fast").unwrap();
    config.time_scale = 10.0;
    let engine = levee_engine::spawn(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = engine.base_url();
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 1
        rps = 16
        [[classes]]
        prompt_tokens = { dist = "uniform", min = 50, max = 400 }
        max_tokens = { dist = "constant", value = 4 }
        stream = false
        [[tenants]]
        name = "en"
        [[tenants]]
        name = "zh"
        text = "cjk"
        [[tenants]]
        name = "dev"
        text = "code"
        [[tenants]]
        name = "all"
        text = { mixed = 1, cjk = 1 }
        [request]
        model = "levee-sim-tiny"
        [slo]
        ttft_ms = 60000
        "#,
    )
    .unwrap();
    let schedule = levee_sim::arrivals::build(&scenario).unwrap();
    let asked: u64 = schedule
        .arrivals
        .iter()
        .map(|a| u64::from(a.prompt_tokens))
        .sum();
    let r = levee_sim::run(
        &scenario,
        &Target::new(&url),
        &RunOptions {
            progress: false,
            ..RunOptions::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(r.totals.ok, 16, "{}", r.summary());
    assert_eq!(r.per_tenant.len(), 4);
    // The engine counted each prompt's text as asked, plus its chat template (4 per
    // prompt, 5 for the one message).
    let metrics = plain_get(&format!("{url}/metrics")).await;
    let counted: f64 = metrics
        .lines()
        .find(|l| l.starts_with("vllm:prompt_tokens_total"))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(counted as u64, asked + 16 * 9);
    engine.shutdown().await.unwrap();
}

/// A GET over a plain TCP connection (the crate has no HTTP client among its test deps).
async fn plain_get(url: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap();
    let mut s = tokio::net::TcpStream::connect(host).await.unwrap();
    s.write_all(format!("GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_resend_their_history_and_hit_the_engines_prefix_cache() {
    let mut config = levee_engine::EngineConfig::profile("tiny-fast").unwrap();
    config.time_scale = 10.0;
    let engine = levee_engine::spawn(config, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = engine.base_url();
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 2
        rps = 6         # every turn counted: 2 conversations of 3 turns a second
        [[classes]]
        prompt_tokens = { dist = "constant", value = 60 }
        max_tokens = { dist = "constant", value = 8 }
        stream = true
        [sessions]
        share = 1.0
        turns = { dist = "constant", value = 3 }
        think_time_s = { dist = "constant", value = 0.01 }
        context_tokens = 1024
        [request]
        model = "levee-sim-tiny"
        [slo]
        ttft_ms = 60000
        "#,
    )
    .unwrap();
    let r = levee_sim::run(
        &scenario,
        &Target::new(&url),
        &RunOptions {
            progress: false,
            drain: Some(std::time::Duration::from_secs(10)),
            ..RunOptions::default()
        },
    )
    .await
    .unwrap();
    // Four sessions of three turns.
    assert_eq!(r.totals.ok, 12, "{}", r.summary());
    let metrics = plain_get(&format!("{url}/metrics")).await;
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap()
            .parse()
            .unwrap()
    };
    // Turn 2 resends turn 1 (69 prompt + 8 answer tokens: 4 whole blocks), turn 3 resends
    // turn 2 (its 69 + 8 + 5 + 60 + 5 = 147 prompt tokens and 8 more: 9 blocks). Each
    // session hits 4 + 9 blocks of 16 tokens.
    assert_eq!(value("vllm:prefix_cache_hits_total"), 4.0 * 13.0 * 16.0);
    let queries = value("vllm:prefix_cache_queries_total");
    assert_eq!(queries, value("vllm:prompt_tokens_total"));
    engine.shutdown().await.unwrap();
}
