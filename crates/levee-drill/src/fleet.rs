//! The servers a run floods: fresh simulated engines, or running servers (`--backend`).

use crate::setup::Setup;
use anyhow::Context;
use levee_engine::EngineHandle;
use levee_sim::report::{Marker, Report};
use levee_sim::{RunOptions, Scenario, Target};
use std::time::Duration;

/// The servers a run floods.
pub(crate) enum Fleet {
    /// Simulated engines, started fresh for each run.
    Simulated(Vec<EngineHandle>),
    /// Servers someone else runs (`--backend`): the same ones in every run.
    External(Vec<String>),
}

/// What a fleet went through in one run.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FleetStats {
    pub crashes: u64,
    pub injected_crashes: u64,
    /// Requests answered 503 because their engine was down after a crash.
    pub sent_to_down: u64,
    /// Of those, the ones that arrived after the engine had already answered a refusal in
    /// the same down period (the router had been told).
    pub sent_after_failure: u64,
}

impl Fleet {
    /// Fresh simulated engines, or the external servers once they are healthy and idle.
    pub(crate) async fn start(setup: &Setup<'_>) -> anyhow::Result<Self> {
        if !setup.backends.is_empty() {
            wait_ready(&setup.backends).await?;
            return Ok(Self::External(setup.backends.clone()));
        }
        let mut engines = Vec::with_capacity(setup.engines);
        for i in 0..setup.engines {
            let bind = "127.0.0.1:0".parse().context("loopback address")?;
            let e = levee_engine::spawn(setup.engine.clone(), bind)
                .await
                .with_context(|| format!("starting drill engine {i}"))?;
            engines.push(e);
        }
        Ok(Self::Simulated(engines))
    }

    pub(crate) fn urls(&self) -> Vec<String> {
        match self {
            Self::Simulated(engines) => engines.iter().map(|e| e.base_url()).collect(),
            Self::External(urls) => urls.clone(),
        }
    }

    /// Crashes so far, per simulated engine (external servers are checked at the end).
    fn crash_counts(&self) -> Vec<u64> {
        match self {
            Self::Simulated(engines) => engines.iter().map(|e| e.stats().crashes).collect(),
            Self::External(_) => Vec::new(),
        }
    }

    pub(crate) fn target(&self, base_url: String) -> Target {
        let mut t = Target::new(base_url);
        for (i, url) in self.urls().iter().enumerate() {
            t.metrics
                .push((format!("engine{i}"), format!("{url}/metrics")));
            if let Self::Simulated(_) = self {
                t.engine_admin.push(url.clone());
            }
        }
        t
    }

    /// Runs the scenario against `target` and notes, every 100 ms, which engine crashed
    /// when (for the charts; the counts come from the engines themselves).
    pub(crate) async fn run(
        &self,
        scenario: &Scenario,
        target: &Target,
        opts: &RunOptions,
    ) -> anyhow::Result<(Report, Vec<Marker>)> {
        let start = std::time::Instant::now();
        let run = levee_sim::run(scenario, target, opts);
        tokio::pin!(run);
        let mut seen = self.crash_counts();
        let mut markers = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let report = loop {
            tokio::select! {
                r = &mut run => break r?,
                _ = tick.tick() => {
                    for (i, c) in self.crash_counts().into_iter().enumerate() {
                        if c > seen[i] {
                            seen[i] = c;
                            markers.push(Marker {
                                at_s: start.elapsed().as_secs_f64(),
                                label: format!("engine {i} crashed"),
                                fault: true,
                            });
                        }
                    }
                }
            }
        };
        Ok((report, markers))
    }

    /// Ends a run: stops simulated engines, checks external servers' health, and says
    /// what the fleet went through. An external server that does not answer `/health`
    /// with 200 after the run counts as one crash.
    pub(crate) async fn stop(self) -> FleetStats {
        let mut s = FleetStats::default();
        match self {
            Self::Simulated(engines) => {
                for e in engines {
                    s.crashes += e.stats().crashes;
                    s.injected_crashes += e.injected_crashes();
                    s.sent_to_down += e.refused_while_down();
                    s.sent_after_failure += e.refused_after_first_failure();
                    if let Err(err) = e.shutdown().await {
                        tracing::warn!("stopping a drill engine: {err:#}");
                    }
                }
            }
            Self::External(urls) => {
                let client = reqwest::Client::new();
                for url in &urls {
                    if !healthy(&client, url).await {
                        tracing::warn!("{url} is not healthy after the run: counted as a crash");
                        s.crashes += 1;
                    }
                }
            }
        }
        s
    }
}

/// Whether a server answers `GET /health` with 200 within 5 s.
async fn healthy(client: &reqwest::Client, url: &str) -> bool {
    let answer = client
        .get(format!("{url}/health"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    answer.is_ok_and(|r| r.status().is_success())
}

/// Sequences an external server is running or holding back, from its Prometheus metrics
/// (llama.cpp's or vLLM's names); `None` when it exports neither.
async fn busy_sequences(client: &reqwest::Client, url: &str) -> Option<f64> {
    let text = client
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    // llama.cpp's and vLLM's names for running and waiting sequences.
    let names = [
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    ]
    .map(String::from);
    let gauges = levee_sim::scrape::parse_gauges(&text, &names);
    (!gauges.is_empty()).then(|| gauges.values().sum())
}

/// Longest wait for external servers to become healthy and idle before a run.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// Waits until every external server is healthy and runs nothing (the previous run's
/// abandoned requests finished), so that every run starts from the same state.
async fn wait_ready(urls: &[String]) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
    for url in urls {
        loop {
            let idle = healthy(&client, url).await
                && busy_sequences(&client, url).await.is_none_or(|n| n == 0.0);
            if idle {
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "backend {url} is not healthy and idle after {} s (GET {url}/health and its \
                 /metrics); is it running?",
                READY_TIMEOUT.as_secs()
            );
            // Not more often: a llama-server polled for its /metrics within every second
            // never notices that a non-streamed request's client has gone, and the wait
            // would last until the previous run's abandoned requests ended by themselves.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
    Ok(())
}
