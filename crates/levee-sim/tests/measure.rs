//! The measurement itself, against in-process servers on 127.0.0.1:0.
//!
//! Assertions are structural (counts, orderings, differences of a whole second) so that a
//! slow, shared machine cannot make them flaky; timings go to BENCHMARKS.md.

// Test helpers outside #[test] fns may unwrap too: a panic is the failure report we want.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use levee_sim::{report, RunOptions, Scenario, Target};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Default)]
struct Server {
    calls: AtomicU64,
    /// The call number that stalls every answer for one second.
    stall_at: Option<u64>,
    stall_until: Mutex<Option<Instant>>,
    /// `(api key, prompt words, time)` of each call.
    seen: Mutex<Vec<(String, usize, Instant)>>,
    faults: Mutex<Vec<serde_json::Value>>,
    /// `(api key, ignore_eos)` of each call.
    flags: Mutex<Vec<(String, Option<bool>)>>,
    /// Signalled on every call.
    called: tokio::sync::Notify,
}

async fn completions(
    State(s): State<Arc<Server>>,
    headers: HeaderMap,
    Json(body): Json<serde_json::Value>,
) -> Response {
    let n = s.calls.fetch_add(1, Ordering::SeqCst);
    s.called.notify_one();
    let key = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim_start_matches("Bearer ")
        .to_string();
    // Prompt tokens of every message's text as the simulated engine counts them (the
    // simulator sizes by it).
    let words = body["messages"]
        .as_array()
        .map_or(&[][..], |m| m.as_slice())
        .iter()
        .filter_map(|m| m["content"].as_str())
        .map(|c| levee_engine::tokenizer::count_text(c) as usize)
        .sum();
    s.seen
        .lock()
        .unwrap()
        .push((key.clone(), words, Instant::now()));
    let ignore_eos = body["ignore_eos"].as_bool();
    s.flags.lock().unwrap().push((key.clone(), ignore_eos));
    if s.stall_at == Some(n) {
        *s.stall_until.lock().unwrap() = Some(Instant::now() + Duration::from_secs(1));
    }
    let until = *s.stall_until.lock().unwrap();
    if let Some(until) = until {
        tokio::time::sleep_until(until).await;
    }
    match key.as_str() {
        "sk-429" => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after-ms", "50"), ("retry-after", "1")],
            r#"{"error":{"message":"full","type":"rate_limit_error","code":"capacity_overload","param":null}}"#,
        )
            .into_response(),
        "sk-503" => (StatusCode::SERVICE_UNAVAILABLE, "{}").into_response(),
        "sk-hang" => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            StatusCode::OK.into_response()
        }
        _ if body["stream"] == serde_json::Value::Bool(true) => {
            let tokens = body["max_tokens"].as_u64().unwrap_or(1);
            let stream = async_stream(tokens);
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(stream))
                .unwrap()
        }
        _ => Json(serde_json::json!({
            "choices": [{"message": {"content": "hi"}}],
            "usage": {"prompt_tokens": words, "completion_tokens": 5}
        }))
        .into_response(),
    }
}

fn async_stream(
    tokens: u64,
) -> impl futures::Stream<Item = Result<bytes::Bytes, std::convert::Infallible>> {
    use futures::StreamExt;
    let chunks =
        (0..tokens).map(|_| r#"data: {"choices":[{"delta":{"content":"x"}}]}"#.to_string());
    let tail = [
        format!(
            r#"data: {{"choices":[{{"delta":{{}},"finish_reason":"length"}}],"usage":{{"completion_tokens":{tokens}}}}}"#
        ),
        "data: [DONE]".to_string(),
    ];
    let all: Vec<String> = chunks.chain(tail).collect();
    tokio_stream::iter(all).then(|line| async move {
        tokio::time::sleep(Duration::from_millis(2)).await;
        Ok(bytes::Bytes::from(format!("{line}\n\n")))
    })
}

async fn metrics() -> &'static str {
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 7\nvllm:kv_cache_usage_perc 0.5\n"
}

async fn fault(
    State(s): State<Arc<Server>>,
    uri: axum::http::Uri,
    body: axum::body::Bytes,
) -> StatusCode {
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    s.faults
        .lock()
        .unwrap()
        .push(serde_json::json!({"path": uri.path(), "body": body}));
    StatusCode::OK
}

async fn serve(server: Server) -> (String, Arc<Server>) {
    let state = Arc::new(server);
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .route("/metrics", get(metrics))
        .route("/admin/{*action}", post(fault))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), state)
}

/// The sizes of the prompts the server was sent (characters of text), each once, smallest first.
fn prompt_sizes(server: &Server) -> Vec<usize> {
    let mut sizes: Vec<usize> = server.seen.lock().unwrap().iter().map(|s| s.1).collect();
    sizes.sort();
    sizes.dedup();
    sizes
}

fn quiet() -> RunOptions {
    RunOptions {
        progress: false,
        ..RunOptions::default()
    }
}

/// 50 req/s for 2 s, non-streaming; the 25th call stalls every answer for one second.
fn pause_scenario(max_in_flight: usize) -> Scenario {
    Scenario::from_toml_str(&format!(
        r#"
        name = "pause"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 2
        rps = 50
        [[classes]]
        stream = false
        prompt_tokens = {{ dist = "constant", value = 3 }}
        [client]
        timeout_s = 10
        max_in_flight = {max_in_flight}
        "#
    ))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_shows_in_corrected_latency_but_not_in_uncorrected() {
    let (url, _) = serve(Server {
        stall_at: Some(25),
        ..Server::default()
    })
    .await;
    // One request in flight at a time: the sender is held up by the stall, like a
    // closed-loop tool. Requests due during the stall go out late, after it.
    let r = levee_sim::run(&pause_scenario(1), &Target::new(&url), &quiet())
        .await
        .unwrap();
    assert_eq!(r.totals.scheduled, 100);
    assert_eq!(r.totals.completed, 100);
    assert_eq!(r.totals.ok, 100);
    let l = r.latency;
    // The stalled request itself waited the whole second, whichever way it is measured.
    assert!(l.e2e_uncorrected.max >= 990.0, "{:?}", l.e2e_uncorrected);
    assert!(l.e2e.max >= l.e2e_uncorrected.max);
    // About 50 requests were due during the stall: a quarter of the run waited 0..1 s.
    assert!(l.e2e.p90 >= 500.0, "corrected {:?}", l.e2e);
    assert!(l.schedule_lag.p90 >= 500.0, "lag {:?}", l.schedule_lag);
    // The uncorrected view hides it: those requests were fast once finally sent.
    assert!(
        l.e2e_uncorrected.p90 * 4.0 <= l.e2e.p90,
        "uncorrected {:?} vs corrected {:?}",
        l.e2e_uncorrected,
        l.e2e
    );

    // JSON round trip of a real report, and the HTML page is written.
    let dir = std::env::temp_dir().join(format!("levee-sim-test-{}", std::process::id()));
    let path = dir.join("pause.json");
    report::write_json(&r, &path).unwrap();
    assert_eq!(report::read_json(&path).unwrap(), r);
    let html = dir.join("pause.html");
    report::write_html(&[("pause", &r)], &html).unwrap();
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("<svg") && !page.contains("<script src"));
    // A comparison of two runs: side-by-side table plus overlay charts, then each run.
    let table = report::compare_table(&[("before", &r), ("after", &r)]);
    assert!(table.contains("before") && table.contains("goodput req/s"));
    assert!(
        table.contains("1.000"),
        "same run twice: ratios of 1\n{table}"
    );
    let both = dir.join("both.html");
    report::write_html(&[("before", &r), ("after", &r)], &both).unwrap();
    let page = std::fs::read_to_string(&both).unwrap();
    assert!(page.contains("Side by side"));
    assert!(page.matches("<svg").count() >= 2 + 2 * 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_keeps_sending_through_a_stall() {
    let (url, server) = serve(Server {
        stall_at: Some(25),
        ..Server::default()
    })
    .await;
    let r = levee_sim::run(&pause_scenario(8192), &Target::new(&url), &quiet())
        .await
        .unwrap();
    assert_eq!(r.totals.ok, 100);
    // Sends did not wait for answers: the server saw the calls due during the stall
    // arrive during it, so even the uncorrected figure shows the stall.
    let seen = server.seen.lock().unwrap();
    let stall_start = seen[25].2;
    let during = seen
        .iter()
        .filter(|(_, _, t)| *t > stall_start && *t < stall_start + Duration::from_millis(900))
        .count();
    assert!(during >= 20, "only {during} calls arrived during the stall");
    assert!(r.latency.e2e_uncorrected.p90 >= 300.0, "{:?}", r.latency);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_timed_and_counted_and_errors_are_split() {
    let (url, _) = serve(Server::default()).await;
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 1
        rps = 40
        [[classes]]
        stream = true
        max_tokens = { dist = "constant", value = 10 }
        [[tenants]]
        name = "good"
        api_key = "sk-good"
        share = 2
        tier = "premium"
        [[tenants]]
        name = "limited"
        api_key = "sk-429"
        share = 1
        tier = "free"
        [[tenants]]
        name = "broken"
        api_key = "sk-503"
        share = 1
        tier = "free"
        [[tenants]]
        name = "hung"
        api_key = "sk-hang"
        share = 1
        tier = "free"
        [client]
        timeout_s = 1.5
        [slo]
        ttft_ms = 60000
        tpot_ms = 60000
        "#,
    )
    .unwrap();
    let r = levee_sim::run(&scenario, &Target::new(&url), &quiet())
        .await
        .unwrap();
    let good = &r.per_tenant["good"];
    assert_eq!(r.totals.completed, 40);
    assert_eq!(good.ok, good.requests);
    assert!(good.requests > 5);
    assert_eq!(r.totals.ok, good.requests);
    assert_eq!(r.totals.output_tokens, 10 * good.requests);
    assert_eq!(r.latency.ttft.count, good.requests);
    assert_eq!(r.latency.itl.count, 9 * good.requests);
    assert_eq!(r.latency.tpot.count, good.requests);
    // Ten chunks 2 ms apart: the first token comes before the end.
    assert!(r.latency.ttft.p50 < r.latency.e2e.p50);
    assert_eq!(r.totals.good, good.requests);
    assert_eq!(
        r.errors.get("429:capacity_overload").copied(),
        Some(r.per_tenant["limited"].requests)
    );
    assert_eq!(
        r.errors.get("5xx:503").copied(),
        Some(r.per_tenant["broken"].requests)
    );
    assert_eq!(
        r.errors.get("timeout").copied(),
        Some(r.per_tenant["hung"].requests)
    );
    assert_eq!(r.per_tier["premium"].success_rate, 1.0);
    assert_eq!(r.per_tier["free"].success_rate, 0.0);
    let per_second: u64 = r.timeseries.iter().map(|s| s.offered).sum();
    assert_eq!(per_second, 40);
    let admitted: u64 = r.timeseries.iter().map(|s| s.admitted).sum();
    assert_eq!(admitted, good.requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naive_retries_at_once_and_backoff_waits_for_retry_after() {
    let (url, server) = serve(Server::default()).await;
    let text = |behaviour: &str, key: &str| {
        format!(
            r#"
            [arrival]
            process = "constant"
            [[phases]]
            kind = "steady"
            duration_s = 1.5
            rps = 2
            [[classes]]
            stream = false
            [[tenants]]
            api_key = "{key}"
            [client]
            behaviour = "{behaviour}"
            max_attempts = 3
            budget_ratio = 1.0
            budget_max_tokens = 100
            backoff_base_ms = 1
            backoff_cap_ms = 2
            "#
        )
    };
    let naive = Scenario::from_toml_str(&text("naive", "sk-503")).unwrap();
    let r = levee_sim::run(&naive, &Target::new(&url), &quiet())
        .await
        .unwrap();
    assert_eq!(r.totals.scheduled, 3);
    assert_eq!(r.totals.attempts, 9);
    assert_eq!(r.totals.retries, 6);
    assert_eq!(server.calls.load(Ordering::SeqCst), 9);
    assert_eq!(r.errors.get("5xx:503"), Some(&3));

    let (url, server) = serve(Server::default()).await;
    let backoff = Scenario::from_toml_str(&text("backoff", "sk-429")).unwrap();
    let r = levee_sim::run(&backoff, &Target::new(&url), &quiet())
        .await
        .unwrap();
    assert_eq!(r.totals.attempts, 9);
    assert_eq!(server.calls.load(Ordering::SeqCst), 9);
    assert_eq!(r.errors.get("429:capacity_overload"), Some(&3));
    // Requests are 500 ms apart; the first one's attempts must each follow the previous
    // answer by at least the 50 ms of retry-after-ms (the 2 ms backoff cap is overridden).
    let seen = server.seen.lock().unwrap();
    let mut times: Vec<Instant> = seen.iter().map(|s| s.2).collect();
    times.sort();
    let first = times[0];
    let chain: Vec<&Instant> = times
        .iter()
        .filter(|t| **t - first < Duration::from_millis(400))
        .collect();
    assert!(chain.len() <= 3);
    for pair in chain.windows(2) {
        assert!(
            *pair[1] - *pair[0] >= Duration::from_millis(50),
            "{:?}",
            times.iter().map(|t| *t - first).collect::<Vec<_>>()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_cancels_what_is_left_and_nothing_is_lost() {
    let (url, _) = serve(Server::default()).await;
    let scenario = Scenario::from_toml_str(
        r#"
        [[phases]]
        kind = "steady"
        duration_s = 0.5
        rps = 40
        [[tenants]]
        api_key = "sk-hang"
        [client]
        timeout_s = 60
        "#,
    )
    .unwrap();
    let opts = RunOptions {
        drain: Some(Duration::from_millis(200)),
        ..quiet()
    };
    let r = levee_sim::run(&scenario, &Target::new(&url), &opts)
        .await
        .unwrap();
    assert!(r.totals.scheduled > 0);
    assert_eq!(r.totals.completed, r.totals.scheduled);
    assert_eq!(r.errors.get("cancelled"), Some(&r.totals.scheduled));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_never_sent_for_want_of_slots_are_still_recorded() {
    let (url, server) = serve(Server::default()).await;
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 0.5
        rps = 40
        [[tenants]]
        api_key = "sk-hang"
        [client]
        timeout_s = 60
        max_in_flight = 2
        "#,
    )
    .unwrap();
    let opts = RunOptions {
        drain: Some(Duration::from_millis(200)),
        ..quiet()
    };
    let r = levee_sim::run(&scenario, &Target::new(&url), &opts)
        .await
        .unwrap();
    assert_eq!(r.totals.scheduled, 20);
    assert_eq!(r.totals.completed, 20);
    assert_eq!(r.totals.sent, 2);
    assert_eq!(server.calls.load(Ordering::SeqCst), 2);
    assert_eq!(r.errors.get("cancelled"), Some(&20));
    let offered: u64 = r.timeseries.iter().map(|s| s.offered).sum();
    assert_eq!(offered, 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_run_reports_what_happened_and_the_rest_as_cancelled() {
    let (url, server) = serve(Server::default()).await;
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 4
        rps = 20
        [[classes]]
        stream = false
        "#,
    )
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let opts = RunOptions {
        stop: Some(stop.clone()),
        ..quiet()
    };
    // Stop once the server has answered five calls (a signal, not a sleep).
    let watcher = server.clone();
    tokio::spawn(async move {
        while watcher.calls.load(Ordering::SeqCst) < 5 {
            watcher.called.notified().await;
        }
        stop.cancel();
    });
    let r = levee_sim::run(&scenario, &Target::new(&url), &opts)
        .await
        .unwrap();
    assert_eq!(r.totals.scheduled, 80);
    assert_eq!(r.totals.completed, 80);
    assert!(r.totals.sent < 80, "{}", r.summary());
    assert_eq!(
        r.errors.get("cancelled").copied().unwrap_or(0),
        80 - r.totals.ok
    );
    assert!(r.totals.ok >= 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_later_questions_take_their_own_size() {
    let (url, server) = serve(Server::default()).await;
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 1.0
        rps = 9         # 3 conversations of 3 turns a second
        [[classes]]
        stream = false
        prompt_tokens = { dist = "constant", value = 40 }
        [sessions]
        share = 1.0
        turns = { dist = "constant", value = 3 }
        think_time_s = { dist = "constant", value = 0.01 }
        follow_up_tokens = { dist = "constant", value = 3 }
        "#,
    )
    .unwrap();
    let r = levee_sim::run(&scenario, &Target::new(&url), &quiet())
        .await
        .unwrap();
    assert_eq!(r.totals.scheduled, 9);
    assert_eq!(r.totals.ok, 9);
    // The opening asks 40 tokens; each later turn resends it and the answers ("hi", 1
    // token) and asks 3: 40, 44, 48 tokens of text.
    assert_eq!(prompt_sizes(&server), vec![40, 44, 48]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_grow_prompts_and_metrics_and_faults_are_recorded() {
    let (url, server) = serve(Server::default()).await;
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 1.5
        rps = 12        # every turn counted: 4 conversations of 3 turns a second
        [[classes]]
        stream = false
        prompt_tokens = { dist = "constant", value = 10 }
        [sessions]
        share = 1.0
        turns = { dist = "constant", value = 3 }
        think_time_s = { dist = "constant", value = 0.01 }
        [metrics]
        interval_ms = 100
        [[faults]]
        at_s = 0.2
        action = "crash"
        [[faults]]
        at_s = 0.3
        action = "post"
        url = "URL/admin/anything"
        body = { custom = true }
        [[faults]]
        at_s = 0.4
        action = "errors"
        error_rate = 0.25
        duration_s = 0.2
        "#
        .replace("URL", &url)
        .as_str(),
    )
    .unwrap();
    let target = Target {
        base_url: url.clone(),
        metrics: vec![("engine-0".into(), format!("{url}/metrics"))],
        engine_admin: vec![url.clone()],
    };
    let r = levee_sim::run(&scenario, &target, &quiet()).await.unwrap();
    // Six sessions of three turns.
    assert_eq!(r.totals.scheduled, 18);
    assert_eq!(r.totals.ok, 18);
    // Turn n resends every earlier question (10 tokens) and answer ("hi", 1 token) and asks
    // a new question: 10, 21, 32 tokens of text.
    assert_eq!(prompt_sizes(&server), vec![10, 21, 32]);

    let waiting = r
        .metrics
        .iter()
        .find(|m| m.name == "vllm:num_requests_waiting" && m.source == "engine-0")
        .unwrap();
    assert!(waiting.points.len() >= 3);
    assert!(waiting.points.iter().all(|p| p[1] == 7.0));

    assert_eq!(r.faults.len(), 4);
    assert!(
        r.faults.iter().all(|f| f.status == Some(200)),
        "{:?}",
        r.faults
    );
    let got = server.faults.lock().unwrap().clone();
    assert_eq!(
        got,
        vec![
            serde_json::json!({"path": "/admin/crash", "body": {}}),
            serde_json::json!({"path": "/admin/anything", "body": {"custom": true}}),
            serde_json::json!({"path": "/admin/faults", "body": {"error_rate": 0.25}}),
            serde_json::json!({"path": "/admin/clear", "body": {}}),
        ]
    );
}

/// A class's own `extra` fields reach its requests' bodies, and only theirs.
#[tokio::test]
async fn a_class_sends_its_own_extra_fields() {
    let (url, server) = serve(Server::default()).await;
    let scenario = Scenario::from_toml_str(
        r#"
        [arrival]
        process = "constant"
        [[phases]]
        kind = "steady"
        duration_s = 1
        rps = 20
        [request]
        extra = { temperature = 0.0 }
        [[classes]]
        name = "chat"
        stream = false
        [[classes]]
        name = "long"
        weight = 0.0
        stream = false
        extra = { ignore_eos = true }
        [[tenants]]
        name = "plain"
        api_key = "sk-plain"
        share = 1
        [[tenants]]
        name = "long"
        api_key = "sk-long"
        share = 1
        class = "long"
        "#,
    )
    .unwrap();
    levee_sim::run(&scenario, &Target::new(&url), &quiet())
        .await
        .unwrap();
    let flags = server.flags.lock().unwrap().clone();
    let of = |key: &'static str| -> Vec<Option<bool>> {
        flags
            .iter()
            .filter(|(k, _)| k == key)
            .map(|f| f.1)
            .collect()
    };
    let (long, plain) = (of("sk-long"), of("sk-plain"));
    assert!(!long.is_empty() && !plain.is_empty(), "{flags:?}");
    assert!(long.iter().all(|f| *f == Some(true)), "{flags:?}");
    assert!(plain.iter().all(Option::is_none), "{flags:?}");
}
