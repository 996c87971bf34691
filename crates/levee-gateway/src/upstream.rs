//! Upstream backends: the pooled HTTP client, each backend's live counters, and the
//! scraper that reads each backend's Prometheus metrics (vLLM or llama.cpp names).

use crate::config::{BackendConfig, BackendKind};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use levee_policy::{AdaptiveConfig, AdaptiveLimit};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The pooled client every proxied request and scrape goes through. Keep-alive connections
/// are what make the proxy cheap: a new TCP connect per request would cost more than the
/// whole admission pipeline.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Builds the shared upstream client.
pub fn build_client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(Duration::from_secs(2)));
    conn.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(4096)
        .build(conn)
}

/// What a backend last said about its own load (from its `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct ReportedLoad {
    /// Sequences being decoded (`vllm:num_requests_running`, `llamacpp:requests_processing`).
    pub running: f64,
    /// Sequences waiting inside the engine (`vllm:num_requests_waiting`,
    /// `llamacpp:requests_deferred`).
    pub waiting: f64,
    /// KV-cache use in [0, 1] (`vllm:kv_cache_usage_perc`, `llamacpp:kv_cache_usage_ratio`).
    pub kv_usage: f64,
}

/// Parses Prometheus text exposition and picks the load figures of one backend kind.
/// Series with labels are summed (a vLLM with several model labels reports one each).
pub fn parse_load(kind: BackendKind, text: &str) -> Option<ReportedLoad> {
    let (running, waiting, kv): (&[&str], &[&str], &[&str]) = match kind {
        BackendKind::Vllm => (
            &["vllm:num_requests_running"],
            &["vllm:num_requests_waiting"],
            &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        ),
        BackendKind::Llamacpp => (
            &["llamacpp:requests_processing"],
            &["llamacpp:requests_deferred"],
            &["llamacpp:kv_cache_usage_ratio"],
        ),
    };
    let mut load = ReportedLoad::default();
    let mut found = false;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let Some(value) = line
            .rsplit(' ')
            .find(|s| !s.is_empty())
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        // A trailing timestamp would parse too; exposition from vLLM and llama.cpp has
        // none, and taking the last token keeps this parser allocation-free.
        if running.contains(&name) {
            load.running += value;
            found = true;
        } else if waiting.contains(&name) {
            load.waiting += value;
            found = true;
        } else if kv.contains(&name) {
            load.kv_usage = load.kv_usage.max(value);
            found = true;
        }
    }
    found.then_some(load)
}

/// One upstream server and what levee knows about it right now.
#[derive(Debug)]
pub struct Backend {
    /// `model/url`, unique, used in metrics and admin state.
    pub id: String,
    /// Public model name this backend serves.
    pub model: String,
    /// Base URL without a trailing slash.
    pub base: String,
    /// Metrics dialect.
    pub kind: BackendKind,
    /// Model name to send upstream.
    pub upstream_model: Option<String>,
    /// Cap on requests levee sends at once (may change on reload).
    pub max_in_flight: AtomicU32,
    /// Requests levee has sent and not yet finished. Changed only under the model lane's
    /// lock so dispatch decisions see a consistent figure.
    pub in_flight: AtomicU32,
    /// False after `scrape.unhealthy_after` failed scrapes (or connect errors) in a row.
    pub healthy: AtomicBool,
    /// Failed scrapes in a row.
    pub scrape_failures: AtomicU32,
    /// Last scraped load.
    pub load: Mutex<Option<ReportedLoad>>,
    /// Latency-driven cap (when `adaptive = true`); the effective cap is the smaller of it
    /// and `max_in_flight`.
    adaptive: Option<Mutex<AdaptiveLimit>>,
    adaptive_cap: AtomicU32,
    /// `base` + each proxied path, parsed once (see [`Backend::uri`]).
    uris: [Option<http::Uri>; PROXIED_PATHS.len()],
}

/// The paths requests are proxied to.
const PROXIED_PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

impl Backend {
    /// The upstream URI of `path` on this backend (parsed once per backend for the proxied
    /// paths).
    pub fn uri(&self, path: &str) -> Result<http::Uri, String> {
        if let Some(i) = PROXIED_PATHS.iter().position(|p| *p == path) {
            if let Some(u) = &self.uris[i] {
                return Ok(u.clone());
            }
        }
        format!("{}{path}", self.base)
            .parse()
            .map_err(|e| format!("bad backend URL {}{path}: {e}", self.base))
    }

    /// Creates the runtime view of a configured backend.
    pub fn new(model: &str, cfg: &BackendConfig) -> Backend {
        let base = cfg.url.trim_end_matches('/').to_string();
        let uris = PROXIED_PATHS.map(|p| format!("{base}{p}").parse().ok());
        Backend {
            uris,
            id: format!("{model}@{base}"),
            model: model.to_string(),
            base,
            kind: cfg.kind,
            upstream_model: cfg.upstream_model.clone(),
            max_in_flight: AtomicU32::new(cfg.max_in_flight),
            in_flight: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            scrape_failures: AtomicU32::new(0),
            load: Mutex::new(None),
            adaptive: cfg.adaptive.then(|| {
                let max = usize::try_from(cfg.max_in_flight)
                    .unwrap_or(usize::MAX)
                    .max(1);
                Mutex::new(AdaptiveLimit::new(AdaptiveConfig {
                    initial: max.div_ceil(2),
                    min: 1,
                    max,
                    ..AdaptiveConfig::default()
                }))
            }),
            adaptive_cap: AtomicU32::new(if cfg.adaptive {
                cfg.max_in_flight.div_ceil(2).max(1)
            } else {
                u32::MAX
            }),
        }
    }

    /// Whether `other` (built from a new config) can reuse this backend's live state.
    pub fn same_settings(&self, other: &Backend) -> bool {
        self.id == other.id
            && self.kind == other.kind
            && self.upstream_model == other.upstream_model
            && self.adaptive.is_some() == other.adaptive.is_some()
    }

    /// Requests this backend may have in flight now.
    pub fn cap(&self) -> u32 {
        self.max_in_flight
            .load(Ordering::Relaxed)
            .min(self.adaptive_cap.load(Ordering::Relaxed))
    }

    /// Feeds one finished request to the adaptive limit (if on): its time to first byte and
    /// whether the backend failed it.
    pub fn adaptive_sample(&self, ttft: Option<Duration>, failed: bool) {
        let Some(a) = &self.adaptive else { return };
        let in_flight = usize::try_from(self.in_flight.load(Ordering::Relaxed)).unwrap_or(0);
        let mut a = a.lock();
        let limit = match (ttft, failed) {
            (_, true) => a.on_sample(Duration::ZERO, in_flight, true),
            (Some(t), false) => a.on_sample(t, in_flight + 1, false),
            (None, false) => return,
        };
        self.adaptive_cap
            .store(u32::try_from(limit).unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    /// The adaptive cap, if adaptive limiting is on.
    pub fn adaptive_limit(&self) -> Option<u32> {
        self.adaptive
            .as_ref()
            .map(|_| self.adaptive_cap.load(Ordering::Relaxed))
    }

    /// Load score used to pick among backends with free capacity: our own outstanding
    /// count first (always fresh), the engine's own queue and KV pressure as tie-breakers
    /// (they lag by a scrape interval).
    pub fn score(&self) -> f64 {
        let own = f64::from(self.in_flight.load(Ordering::Relaxed));
        let cap = f64::from(self.cap().max(1));
        let reported = self
            .load
            .lock()
            .map(|l| l.waiting / cap + l.kv_usage)
            .unwrap_or(0.0);
        own / cap + reported * 0.5
    }

    /// Checks `/health` and reads `/metrics` once; updates load and health. Health is the
    /// `/health` answer (vLLM and llama-server both serve it; a crashed or restarting engine
    /// answers 503 there while its `/metrics` may still answer); metrics are best effort.
    pub async fn scrape(&self, client: &HttpClient, timeout: Duration, unhealthy_after: u32) {
        let health = tokio::time::timeout(timeout, self.get(client, "/health")).await;
        let ok = matches!(health, Ok(Ok(_)));
        if ok {
            if let Ok(Ok(text)) = tokio::time::timeout(timeout, self.get(client, "/metrics")).await
            {
                if let Some(l) = parse_load(self.kind, &text) {
                    *self.load.lock() = Some(l);
                }
            }
        }
        if ok {
            self.scrape_failures.store(0, Ordering::Relaxed);
            self.healthy.store(true, Ordering::Relaxed);
        } else {
            let n = self.scrape_failures.fetch_add(1, Ordering::Relaxed) + 1;
            if n >= unhealthy_after {
                self.healthy.store(false, Ordering::Relaxed);
            }
        }
    }

    async fn get(&self, client: &HttpClient, path: &str) -> anyhow::Result<String> {
        let uri: http::Uri = format!("{}{path}", self.base).parse()?;
        let req = http::Request::get(uri).body(Full::new(Bytes::new()))?;
        let resp = client.request(req).await?;
        if !resp.status().is_success() {
            anyhow::bail!("status {}", resp.status());
        }
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}

/// Shared list of backends; reload swaps entries but keeps the `Arc` of unchanged ones so
/// their in-flight counts survive.
pub type BackendRef = Arc<Backend>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_metrics() {
        let text = "# HELP x\nvllm:num_requests_running{model_name=\"m\"} 3.0\n\
                    vllm:num_requests_waiting{model_name=\"m\"} 7\n\
                    vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\nother 1\n";
        let l = parse_load(BackendKind::Vllm, text).unwrap();
        assert_eq!(l.running, 3.0);
        assert_eq!(l.waiting, 7.0);
        assert_eq!(l.kv_usage, 0.5);
        assert!(parse_load(BackendKind::Llamacpp, text).is_none());
    }

    #[test]
    fn adaptive_cap_shrinks_when_latency_rises() {
        let b = Backend::new(
            "m",
            &BackendConfig {
                max_in_flight: 64,
                adaptive: true,
                ..BackendConfig::default()
            },
        );
        assert_eq!(b.cap(), 32);
        b.in_flight.store(32, Ordering::Relaxed);
        for _ in 0..200 {
            b.adaptive_sample(Some(Duration::from_millis(10)), false);
        }
        let steady = b.cap();
        for _ in 0..50 {
            b.adaptive_sample(Some(Duration::from_millis(200)), false);
        }
        assert!(b.cap() < steady, "{} !< {steady}", b.cap());
        let before = b.cap();
        b.adaptive_sample(None, true);
        assert!(b.cap() <= before);
        let plain = Backend::new("m", &BackendConfig::default());
        assert_eq!(plain.cap(), 64);
        assert_eq!(plain.adaptive_limit(), None);
    }

    #[test]
    fn parses_llamacpp_metrics() {
        let text = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 4\n\
                    llamacpp:kv_cache_usage_ratio 0.25\n";
        let l = parse_load(BackendKind::Llamacpp, text).unwrap();
        assert_eq!((l.running, l.waiting, l.kv_usage), (2.0, 4.0, 0.25));
    }
}
