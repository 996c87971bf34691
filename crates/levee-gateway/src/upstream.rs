//! Upstream backends: the pooled HTTP client, each backend's live counters, outlier
//! ejection, and the scraper that reads each backend's Prometheus metrics (vLLM or
//! llama.cpp names).

use crate::config::{read_ca_file, BackendConfig, BackendKind, OutlierConfig};
use crate::conn_pool::{ConnPool, Connector};
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use levee_policy::{
    AdaptiveConfig, AdaptiveLimit, BackendLimits, BackendReport, Budget, Outcome as BreakerOutcome,
    Timestamp,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The pooled client every proxied request and scrape goes through, for `http://` and
/// `https://` backends (TLS by rustls). Keep-alive connections are what make the proxy
/// cheap: a new TCP connect per request would cost more than the whole admission pipeline.
pub type HttpClient = Client<Connector, Full<Bytes>>;

/// How long an idle upstream connection stays in the pool.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// TLS settings: the public roots (Mozilla's, built in) and `extra` certificate authorities.
fn tls_config(
    extra: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    for c in extra {
        roots
            .add(c.clone())
            .map_err(|e| format!("a certificate authority is not usable: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS settings: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The shared upstream client for scrapes and counts, and the connector the backends'
/// own pools ([`ConnPool`]) dial proxied requests with (public roots only).
pub fn build_client() -> Result<(HttpClient, Connector), String> {
    build_client_trusting(&[])
}

/// A client and a connector for `https://` backends whose certificates chain to the public
/// roots or to `extra` (a private CA).
fn build_client_trusting(
    extra: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<(HttpClient, Connector), String> {
    let conn = connector_with(tls_config(extra)?);
    Ok((client_with(conn.clone()), conn))
}

fn connector_with(tls: rustls::ClientConfig) -> Connector {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(Duration::from_secs(2)));
    conn.set_keepalive(Some(Duration::from_secs(60)));
    conn.enforce_http(false);
    hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(conn)
}

fn client_with(conn: Connector) -> HttpClient {
    Client::builder(TokioExecutor::new())
        // Below the 5 s after which llama-server (cpp-httplib) and uvicorn (vLLM) close an
        // idle keep-alive connection: a pooled connection the server has just closed fails
        // the request sent on it (a 502 to the client, seen against llama-server).
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
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
    /// Whether the engine reported its KV use at all.
    pub kv_known: bool,
}

impl ReportedLoad {
    /// The report as the admission state reads it.
    pub fn as_report(&self) -> BackendReport {
        BackendReport {
            running: self.running,
            waiting: self.waiting,
            kv_usage: self.kv_known.then_some(self.kv_usage),
        }
    }
}

/// The largest sequence count a backend's gauges are taken to say.
const MAX_GAUGE: f64 = 1e9;

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
            // A gauge of a count or a ratio: NaN, infinities and negative values are a
            // broken (or hostile) backend's, and would poison the balancing.
            .filter(|v| v.is_finite() && *v >= 0.0)
        else {
            continue;
        };
        // A trailing timestamp would parse too; exposition from vLLM and llama.cpp has
        // none, and taking the last token keeps this parser allocation-free.
        if running.contains(&name) {
            load.running = (load.running + value).min(MAX_GAUGE);
            found = true;
        } else if waiting.contains(&name) {
            load.waiting = (load.waiting + value).min(MAX_GAUGE);
            found = true;
        } else if kv.contains(&name) {
            load.kv_usage = load.kv_usage.max(value.min(1.0));
            load.kv_known = true;
            found = true;
        }
    }
    found.then_some(load)
}

/// What a backend says about its own size: KV-cache tokens, the longest context a request
/// may use, and its sequence slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Learned {
    /// KV-cache capacity in tokens (vLLM: `num_gpu_blocks × block_size` from
    /// `vllm:cache_config_info`; llama.cpp: per-slot `n_ctx` × `total_slots` from `/props`).
    pub kv_tokens: Option<u64>,
    /// Longest prompt + completion of one request (vLLM: `max_model_len` in `/v1/models`;
    /// llama.cpp: the per-slot `n_ctx`).
    pub max_context: Option<u64>,
    /// Sequences it runs at once (llama.cpp: `total_slots`).
    pub slots: Option<u32>,
}

/// Reads `vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",...} 1`: the KV
/// cache in tokens. vLLM exports its cache settings as the labels of an info gauge.
pub fn parse_vllm_cache_tokens(text: &str) -> Option<u64> {
    let line = text
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let labels = &line[line.find('{')? + 1..line.rfind('}')?];
    let label = |name: &str| -> Option<u64> {
        labels
            .split(',')
            .find_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                (k.trim() == name).then(|| v.trim().trim_matches('"').parse::<f64>().ok())?
            })
            .map(|v| v as u64)
    };
    let blocks = label("num_gpu_blocks")?;
    let size = label("block_size")?;
    (blocks > 0 && size > 0).then(|| blocks.saturating_mul(size))
}

/// Reads `max_model_len` of `model` (or of the only model) from a `/v1/models` answer.
pub fn parse_max_model_len(body: &str, model: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let data = v.get("data")?.as_array()?;
    let pick = data
        .iter()
        .find(|m| m.get("id").and_then(|i| i.as_str()) == Some(model))
        .or_else(|| (data.len() == 1).then(|| &data[0]))?;
    pick.get("max_model_len")?.as_u64()
}

/// Reads llama.cpp's `/props`: `total_slots` and the per-slot context
/// (`default_generation_settings.n_ctx`, or a top-level `n_ctx`).
pub fn parse_llamacpp_props(body: &str) -> Learned {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return Learned::default();
    };
    let slots = v
        .get("total_slots")
        .and_then(|s| s.as_u64())
        .and_then(|s| u32::try_from(s).ok())
        .filter(|s| *s > 0);
    let n_ctx = v
        .get("default_generation_settings")
        .and_then(|g| g.get("n_ctx"))
        .or_else(|| v.get("n_ctx"))
        .and_then(|n| n.as_u64())
        .filter(|n| *n > 0);
    Learned {
        kv_tokens: n_ctx.map(|n| n * u64::from(slots.unwrap_or(1))),
        max_context: n_ctx,
        slots,
    }
}

/// What one answer of a backend (or its failure to answer) says about the backend.
///
/// The rule that separates backpressure from failure: a 429, or a 503 whose `Retry-After`
/// is short (at most `outlier.backpressure_retry_after_ms`) from a backend whose health
/// check passes, is the backend asking to slow down — it stays in routing and its breaker
/// does not count it. A 503 without `Retry-After`, with a longer one, or from a backend
/// whose health check fails, and a refused connection, mean it cannot serve now: it is
/// ejected at once. Other 5xx, broken connections and timeouts are failures, which eject
/// after `outlier.consecutive_failures` in a row and feed the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It answered (2xx, 3xx).
    Served,
    /// A 4xx other than 429: the request's fault, not the backend's.
    ClientError,
    /// Slow down: 429, or a short 503 from a healthy backend. With a Retry-After the
    /// backend is cooled down (out of routing, not counted as failing) for that long.
    Backpressure {
        /// The backend's own `Retry-After`.
        advised: Option<Duration>,
    },
    /// 5xx, a broken connection, a timeout.
    Failure,
    /// The backend cannot serve now (it said so, or nothing listens): eject at once, for
    /// `advised` if it gave a time.
    Unavailable {
        /// The backend's own `Retry-After`.
        advised: Option<Duration>,
    },
    /// The client left before the backend's answer said anything.
    Cancelled,
}

impl Verdict {
    /// Reads a response status; `advised` is its [`advised_retry`], `healthy` the backend's
    /// last health check.
    pub fn of_response(
        status: StatusCode,
        advised: Option<Duration>,
        healthy: bool,
        cfg: &OutlierConfig,
    ) -> Verdict {
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Verdict::Backpressure { advised };
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            let short = Duration::from_millis(cfg.backpressure_retry_after_ms);
            return match advised {
                Some(d) if healthy && d <= short => Verdict::Backpressure { advised },
                _ => Verdict::Unavailable { advised },
            };
        }
        if status.is_server_error() {
            Verdict::Failure
        } else if status.is_client_error() {
            Verdict::ClientError
        } else {
            Verdict::Served
        }
    }

    /// What the breaker counts.
    pub fn breaker_outcome(self) -> BreakerOutcome {
        match self {
            Verdict::Served => BreakerOutcome::Success,
            Verdict::ClientError => BreakerOutcome::ClientError,
            Verdict::Backpressure { .. } => BreakerOutcome::Backpressure,
            Verdict::Failure | Verdict::Unavailable { .. } => BreakerOutcome::BackendFailure,
            Verdict::Cancelled => BreakerOutcome::Cancelled,
        }
    }

    /// Whether another backend may do better: the request failed for a reason of this
    /// backend's, not of the request's.
    pub fn worth_another_backend(self) -> bool {
        matches!(
            self,
            Verdict::Backpressure { .. } | Verdict::Failure | Verdict::Unavailable { .. }
        )
    }
}

/// The wait a backend advises: `retry-after-ms`, else `Retry-After` in seconds (an
/// HTTP-date is not read: no advice then).
pub fn advised_retry(headers: &HeaderMap) -> Option<Duration> {
    let num = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    num("retry-after-ms")
        .map(|ms| Duration::from_secs_f64(ms / 1000.0))
        .or_else(|| num("retry-after").map(Duration::from_secs_f64))
}

/// Outlier-ejection state of one backend (pure: time comes in as arguments).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ejection {
    /// End of the current (or last) ejection; `None` if never ejected.
    until: Option<Timestamp>,
    /// Recent ejections; one is forgiven per `base_ejection_ms` spent back in routing.
    recent: u32,
    /// Failures in a row since the last success or ejection.
    failures_in_row: u32,
}

impl Ejection {
    /// Feeds one verdict at `now`; returns the end of the ejection it starts, if it starts
    /// one. Verdicts that arrive while ejected (requests sent before the ejection) change
    /// nothing.
    pub fn observe(
        &mut self,
        verdict: Verdict,
        now: Timestamp,
        cfg: &OutlierConfig,
    ) -> Option<Timestamp> {
        if !cfg.enabled || self.ejected_until(now).is_some() {
            return None;
        }
        let advised = match verdict {
            Verdict::Served => {
                self.failures_in_row = 0;
                return None;
            }
            Verdict::Backpressure { advised: Some(d) } if !d.is_zero() => {
                // A cool-down, not a failure: the ejection backoff does not grow.
                let length = d.min(Duration::from_millis(cfg.max_ejection_ms));
                let until = now.saturating_add(length);
                self.until = Some(until);
                return Some(until);
            }
            Verdict::ClientError | Verdict::Backpressure { .. } | Verdict::Cancelled => {
                return None
            }
            Verdict::Failure => {
                self.failures_in_row = self.failures_in_row.saturating_add(1);
                if cfg.consecutive_failures == 0 || self.failures_in_row < cfg.consecutive_failures
                {
                    return None;
                }
                None
            }
            Verdict::Unavailable { advised } => advised,
        };
        let base = Duration::from_millis(cfg.base_ejection_ms);
        if let Some(end) = self.until {
            let healthy_for = now.saturating_duration_since(end);
            let forgiven = healthy_for.as_nanos() / base.as_nanos().max(1);
            self.recent = self
                .recent
                .saturating_sub(u32::try_from(forgiven).unwrap_or(u32::MAX));
        }
        self.recent = self.recent.saturating_add(1);
        let grown = base.saturating_mul(self.recent);
        let length = advised
            .filter(|d| !d.is_zero())
            .unwrap_or(grown)
            .min(Duration::from_millis(cfg.max_ejection_ms));
        let until = now.saturating_add(length);
        self.until = Some(until);
        self.failures_in_row = 0;
        Some(until)
    }

    /// The end of the ejection in force at `now`, if any.
    pub fn ejected_until(&self, now: Timestamp) -> Option<Timestamp> {
        self.until.filter(|u| *u > now)
    }
}

/// One replica's slice of a backend's budget on a fleet of gateways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetSlice {
    /// What this replica may have in flight there.
    pub allowed: Budget,
    /// What the other live replicas hold there.
    pub others: Budget,
    /// Live replicas holding a slice of it, this one included.
    pub replicas: u32,
    /// The budget it was granted against (a KV budget of 0: not known then).
    pub budget: Budget,
    /// Whether it was granted by the shared state (false: this replica's part before its
    /// first grant).
    pub granted: bool,
    /// Whether the last grant is older than the lease: the shared state has not answered
    /// since and this replica keeps to that grant.
    pub lapsed: bool,
}

/// One upstream server and what levee knows about it right now.
#[derive(Debug)]
pub struct Backend {
    /// `model@url`, unique, used in metrics and admin state.
    pub id: String,
    /// The same id, as the admission state's key for this backend.
    pub key: Arc<str>,
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
    /// KV budget from config (0: learn it from the engine).
    max_kv_tokens: AtomicU64,
    /// What the engine said about its size.
    learned: Mutex<Learned>,
    /// On a fleet (`[state] backend = "redis"`): this replica's slice of the budget and
    /// what the other replicas hold (see [`Backend::set_fleet_slice`]).
    fleet: Mutex<Option<FleetSlice>>,
    /// False after `scrape.unhealthy_after` failed scrapes (or connect errors) in a row.
    pub healthy: AtomicBool,
    /// Failed scrapes in a row.
    pub scrape_failures: AtomicU32,
    /// Outlier ejection (see [`Backend::observe`]).
    ejection: Mutex<Ejection>,
    /// Last scraped load.
    pub load: Mutex<Option<ReportedLoad>>,
    /// Latency-driven cap (when `adaptive = true`); the effective cap is the smaller of it
    /// and `max_in_flight`.
    adaptive: Option<Mutex<AdaptiveLimit>>,
    adaptive_cap: AtomicU32,
    /// `base` + each proxied path, parsed once (see [`Backend::uri`]).
    uris: [Option<http::Uri>; PROXIED_PATHS.len()],
    /// Path of the active health check; empty: passive health only.
    health_path: String,
    /// Headers every request to it carries: its API key, its static headers.
    fixed_headers: HeaderMap,
    /// Its own client and connector when it trusts a private CA (`ca_file`); else the
    /// shared ones serve.
    own_client: Option<(HttpClient, Connector)>,
    /// Its keep-alive connections for proxied requests.
    pub(crate) pool: Arc<ConnPool>,
    /// What shaped the two fields above, to tell whether a reload changed them.
    upstream_settings: (
        Option<String>,
        std::collections::BTreeMap<String, String>,
        Option<std::path::PathBuf>,
    ),
}

/// The headers of `cfg` sent on every request to the backend: `Host` (written once here
/// rather than worked out from the URL on every request), `Authorization: Bearer` with the
/// key from `api_key_env` (marked sensitive), then the static `headers`. Values that cannot
/// be headers were refused when the config was checked; here they are skipped.
fn fixed_headers(cfg: &BackendConfig) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Some(host) = host_header(&cfg.url) {
        h.insert(http::header::HOST, host);
    }
    for (name, value) in &cfg.headers {
        if let (Ok(n), Ok(v)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(value),
        ) {
            h.insert(n, v);
        }
    }
    if let Some(var) = &cfg.api_key_env {
        let key = std::env::var(var).unwrap_or_default();
        if let Ok(mut v) = http::HeaderValue::from_str(&format!("Bearer {key}")) {
            v.set_sensitive(true);
            h.insert(http::header::AUTHORIZATION, v);
        }
    }
    h
}

/// The `Host` of requests to `url`: its host, and its port unless the scheme's default.
fn host_header(url: &str) -> Option<http::HeaderValue> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?;
    let default = match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    };
    let value = match uri.port_u16() {
        Some(p) if p != default => format!("{host}:{p}"),
        _ => host.to_string(),
    };
    http::HeaderValue::from_str(&value).ok()
}

/// Writes the request-scoped headers passed on to the backend into `h`: the request id
/// levee answers with, and the W3C trace context the client sent.
pub fn propagate(h: &mut HeaderMap, request: Option<&crate::request_log::RequestId>) {
    if let Some(id) = request {
        h.insert(crate::request_log::REQUEST_ID_HEADER, id.value.clone());
        if let Some(tp) = &id.traceparent {
            h.insert(crate::request_log::TRACEPARENT, tp.clone());
        }
        if let Some(ts) = &id.tracestate {
            h.insert(crate::request_log::TRACESTATE, ts.clone());
        }
    }
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
        let id = format!("{model}@{base}");
        let own_client = cfg.ca_file.as_ref().and_then(|path| {
            match read_ca_file(path).and_then(|cas| build_client_trusting(&cas)) {
                Ok(c) => Some(c),
                Err(e) => {
                    // Checked with the config; the file changed since.
                    tracing::error!(backend = %id, "ca_file: {e}; trusting the public roots only");
                    None
                }
            }
        });
        Backend {
            uris,
            health_path: cfg.health_path.clone(),
            fixed_headers: fixed_headers(cfg),
            own_client,
            pool: Arc::default(),
            upstream_settings: (
                cfg.api_key_env.clone(),
                cfg.headers.clone(),
                cfg.ca_file.clone(),
            ),
            key: Arc::from(id.as_str()),
            id,
            model: model.to_string(),
            base,
            kind: cfg.kind,
            upstream_model: cfg.upstream_model.clone(),
            max_in_flight: AtomicU32::new(cfg.max_in_flight),
            max_kv_tokens: AtomicU64::new(cfg.max_kv_tokens.unwrap_or(0)),
            learned: Mutex::new(Learned::default()),
            fleet: Mutex::new(None),
            healthy: AtomicBool::new(true),
            scrape_failures: AtomicU32::new(0),
            ejection: Mutex::new(Ejection::default()),
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
            && self.health_path == other.health_path
            && self.upstream_settings == other.upstream_settings
            && self.fixed_headers == other.fixed_headers
    }

    /// Takes the caps of a reloaded config (live state stays).
    pub fn set_config(&self, cfg: &BackendConfig) {
        self.max_in_flight
            .store(cfg.max_in_flight, Ordering::Relaxed);
        self.max_kv_tokens
            .store(cfg.max_kv_tokens.unwrap_or(0), Ordering::Relaxed);
    }

    /// Feeds one verdict to outlier ejection; returns the ejection's end if it ejected the
    /// backend now. The caller holds the backend's breaker open until then (see
    /// `Admission::eject`), which takes it out of routing and brings it back through probes.
    pub fn observe(
        &self,
        verdict: Verdict,
        now: Timestamp,
        cfg: &OutlierConfig,
    ) -> Option<Timestamp> {
        let until = self.ejection.lock().observe(verdict, now, cfg)?;
        tracing::warn!(
            backend = %self.id,
            ?verdict,
            for_ms = until.saturating_duration_since(now).as_millis() as u64,
            "backend ejected from routing"
        );
        Some(until)
    }

    /// Requests this backend may have in flight now: the configured cap, lowered by the
    /// adaptive limit and by the slots the engine says it has.
    pub fn cap(&self) -> u32 {
        let slots = self.learned.lock().slots.unwrap_or(u32::MAX);
        self.max_in_flight
            .load(Ordering::Relaxed)
            .min(self.adaptive_cap.load(Ordering::Relaxed))
            .min(slots)
    }

    /// The KV budget: from config, else learned from the engine; unknown until then.
    fn kv_budget(&self) -> Option<u64> {
        let configured = self.max_kv_tokens.load(Ordering::Relaxed);
        if configured > 0 {
            Some(configured)
        } else {
            self.learned.lock().kv_tokens
        }
    }

    /// The whole budget of the engine, as a fleet shares it: its request cap and its KV
    /// budget (0 while unknown).
    pub fn budget(&self) -> Budget {
        Budget {
            slots: u64::from(self.cap().max(1)),
            kv_tokens: self.kv_budget().unwrap_or(0),
        }
    }

    /// The limits the admission state applies: the request cap and the KV budget — alone,
    /// the engine's; on a fleet, this replica's slice of them (possibly none for now).
    pub fn limits(&self) -> BackendLimits {
        let cap = usize::try_from(self.cap()).unwrap_or(usize::MAX).max(1);
        let kv = self.kv_budget();
        match *self.fleet.lock() {
            None => BackendLimits {
                max_in_flight: cap,
                kv_tokens: kv,
            },
            Some(s) => BackendLimits {
                max_in_flight: cap.min(usize::try_from(s.allowed.slots).unwrap_or(usize::MAX)),
                // A KV budget learned since the slice was granted: an equal part of it until
                // the next renewal shares it.
                kv_tokens: kv.map(|k| {
                    if s.budget.kv_tokens == 0 {
                        k / u64::from(s.replicas.max(1))
                    } else {
                        k.min(s.allowed.kv_tokens)
                    }
                }),
            },
        }
    }

    /// Sets this replica's slice of the budget on a fleet.
    pub fn set_fleet_slice(&self, slice: FleetSlice) {
        *self.fleet.lock() = Some(slice);
    }

    /// This replica's slice on a fleet, if any.
    pub fn fleet_slice(&self) -> Option<FleetSlice> {
        *self.fleet.lock()
    }

    /// On a fleet: what the other replicas hold, the engine's whole KV budget and the
    /// replicas sharing it, for the admission state to read the engine's report (which
    /// covers the whole fleet) and to predict waits over the fleet's queue.
    pub fn fleet_view(&self) -> Option<levee_policy::FleetView> {
        self.fleet.lock().map(|s| levee_policy::FleetView {
            others: s.others,
            engine_kv: self.kv_budget(),
            replicas: s.replicas,
        })
    }

    /// What the engine said about its size.
    pub fn learned(&self) -> Learned {
        *self.learned.lock()
    }

    /// Whether the engine notices a client gone only on a stream. llama-server looks at a
    /// non-streamed request's connection only after a whole second with nothing else to do:
    /// with any other stream running, an abandoned one runs to its last token. So levee
    /// asks it for a stream in place of a non-streamed answer and reads that whole.
    pub fn cancels_only_streams(&self) -> bool {
        self.kind == BackendKind::Llamacpp
    }

    /// Whether requests may be routed here now.
    pub fn is_routable(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// The end of its ejection or cool-down in force at `now`, if any.
    pub fn ejected_until(&self, now: Timestamp) -> Option<Timestamp> {
        self.ejection.lock().ejected_until(now)
    }

    /// The last load report, if any.
    pub fn reported(&self) -> Option<ReportedLoad> {
        *self.load.lock()
    }

    /// Feeds one finished request to the adaptive limit (if on): its time to first byte and
    /// whether the backend failed it.
    pub fn adaptive_sample(&self, ttft: Option<Duration>, failed: bool, in_flight: usize) {
        let Some(a) = &self.adaptive else { return };
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

    /// The client that reaches this backend: its own (a private CA), else `shared`.
    pub fn client<'a>(&'a self, shared: &'a HttpClient) -> &'a HttpClient {
        self.own_client.as_ref().map_or(shared, |(c, _)| c)
    }

    /// The connector that dials this backend: its own (a private CA), else `shared`.
    pub(crate) fn connector<'a>(&'a self, shared: &'a Connector) -> &'a Connector {
        self.own_client.as_ref().map_or(shared, |(_, c)| c)
    }

    /// A request to this backend with its fixed headers (API key, static headers); the
    /// caller adds the request's own.
    pub fn request(
        &self,
        method: http::Method,
        uri: http::Uri,
        body: Bytes,
    ) -> http::Request<Full<Bytes>> {
        let mut req = http::Request::new(Full::new(body));
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = self.fixed_headers.clone();
        req
    }

    /// Checks the health path and reads `/metrics` once; updates load and health. Health is
    /// the health path's answer (`/health`: vLLM and llama-server both serve it; a crashed or
    /// restarting engine answers 503 there while its `/metrics` may still answer); metrics
    /// are best effort.
    /// Without a health path (passive health only) the backend stays healthy here and
    /// leaves routing only through its breaker and outlier ejection. Returns the load report
    /// it read, if it read one.
    pub async fn scrape(
        &self,
        client: &HttpClient,
        timeout: Duration,
        unhealthy_after: u32,
    ) -> Option<ReportedLoad> {
        let ok = if self.health_path.is_empty() {
            true
        } else {
            let health = tokio::time::timeout(timeout, self.get(client, &self.health_path)).await;
            matches!(health, Ok(Ok(_)))
        };
        let get = |path: &'static str| tokio::time::timeout(timeout, self.get(client, path));
        let mut reported = None;
        if ok {
            if let Ok(Ok(text)) = get("/metrics").await {
                reported = self.read_metrics(&text);
            }
            // The engine's size changes only when it restarts: read it until known.
            let known = self.learned.lock().max_context.is_some();
            if !known {
                match self.kind {
                    BackendKind::Vllm => {
                        if let Ok(Ok(body)) = get("/v1/models").await {
                            let model = self.upstream_model.as_deref().unwrap_or(&self.model);
                            self.learned.lock().max_context = parse_max_model_len(&body, model);
                        }
                    }
                    BackendKind::Llamacpp => {
                        if let Ok(Ok(body)) = get("/props").await {
                            let props = parse_llamacpp_props(&body);
                            let mut l = self.learned.lock();
                            l.max_context = props.max_context;
                            l.kv_tokens = props.kv_tokens;
                            l.slots = props.slots;
                        }
                    }
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
                // A restarted engine may come back with another size.
                *self.learned.lock() = Learned::default();
            }
        }
        reported
    }

    /// Takes the load figures (and vLLM's KV size) from `/metrics` text; the load figures,
    /// if it found them there.
    fn read_metrics(&self, text: &str) -> Option<ReportedLoad> {
        if self.kind == BackendKind::Vllm {
            if let Some(kv) = parse_vllm_cache_tokens(text) {
                self.learned.lock().kv_tokens = Some(kv);
            }
        }
        let l = parse_load(self.kind, text)?;
        *self.load.lock() = Some(l);
        Some(l)
    }

    /// How many tokens `prompt` takes as this engine counts it (its template and tokenizer):
    /// vLLM's `POST /tokenize` (`count`); llama-server's `POST /apply-template` for a chat,
    /// then `POST /tokenize` (`tokens`). The caller bounds the time.
    pub async fn count_prompt(
        &self,
        client: &HttpClient,
        prompt: &PromptSource,
    ) -> anyhow::Result<u64> {
        let model = self.upstream_model.as_deref().unwrap_or(&self.model);
        match (self.kind, prompt) {
            (BackendKind::Vllm, _) => {
                let v = self
                    .post(client, "/tokenize", vllm_tokenize_body(model, prompt))
                    .await?;
                v.get("count")
                    .and_then(serde_json::Value::as_u64)
                    .ok_or_else(|| anyhow::anyhow!("/tokenize answered without a `count`"))
            }
            (BackendKind::Llamacpp, PromptSource::Chat { messages, tools }) => {
                let mut body = serde_json::json!({ "messages": messages });
                if let Some(t) = tools {
                    body["tools"] = t.clone();
                }
                let v = self.post(client, "/apply-template", body).await?;
                let text = v
                    .get("prompt")
                    .and_then(serde_json::Value::as_str)
                    .ok_or_else(|| {
                        anyhow::anyhow!("/apply-template answered without a `prompt`")
                    })?;
                self.llamacpp_tokens(client, text).await
            }
            (BackendKind::Llamacpp, PromptSource::Text(text)) => {
                self.llamacpp_tokens(client, text).await
            }
        }
    }

    /// llama-server's count of `text` (special tokens added, as a completion does).
    async fn llamacpp_tokens(&self, client: &HttpClient, text: &str) -> anyhow::Result<u64> {
        let body = serde_json::json!({ "content": text, "add_special": true });
        let v = self.post(client, "/tokenize", body).await?;
        v.get("tokens")
            .and_then(serde_json::Value::as_array)
            .map(|t| t.len() as u64)
            .ok_or_else(|| anyhow::anyhow!("/tokenize answered without `tokens`"))
    }

    async fn post(
        &self,
        client: &HttpClient,
        path: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<serde_json::Value> {
        let uri: http::Uri = format!("{}{path}", self.base).parse()?;
        let body = Bytes::from(body.to_string());
        let send = || -> anyhow::Result<_> {
            let mut req = self.request(http::Method::POST, uri.clone(), body.clone());
            req.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            Ok(self.client(client).request(req))
        };
        // Once more on a fresh connection when the pooled one was closed under the request
        // (llama-server closes a keep-alive connection after a few requests): counting is
        // idempotent.
        let resp = match send()?.await {
            Ok(r) => r,
            Err(e) if e.is_connect() || closed_before_answer(&e) => send()?.await?,
            Err(e) => return Err(e.into()),
        };
        if !resp.status().is_success() {
            anyhow::bail!("{path} answered {}", resp.status());
        }
        // A count's answer lists the prompt's tokens: bounded, so a backend cannot make the
        // gateway buffer without end.
        let body = http_body_util::Limited::new(resp.into_body(), COUNT_ANSWER_LIMIT)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("{path}: {e}"))?
            .to_bytes();
        Ok(serde_json::from_slice(&body)?)
    }

    async fn get(&self, client: &HttpClient, path: &str) -> anyhow::Result<String> {
        let uri: http::Uri = format!("{}{path}", self.base).parse()?;
        let req = self.request(http::Method::GET, uri, Bytes::new());
        let resp = self.client(client).request(req).await?;
        if !resp.status().is_success() {
            anyhow::bail!("status {}", resp.status());
        }
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}

/// Whether the connection ended before a whole response head arrived (hyper's "incomplete
/// message"); the backend never answered.
pub(crate) fn closed_before_answer(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message();
        }
        source = err.source();
    }
    false
}

/// The largest answer to a count levee reads: a 1M-token prompt's token ids, and room.
const COUNT_ANSWER_LIMIT: usize = 16 << 20;

/// A prompt as an engine's tokenizer endpoint takes it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// A chat's messages and tool definitions, rendered through the model's template.
    Chat {
        /// `messages`.
        messages: serde_json::Value,
        /// `tools`, when the request has any.
        tools: Option<serde_json::Value>,
    },
    /// A completion's `prompt`.
    Text(String),
}

/// vLLM's `POST /tokenize` body for `prompt` on `model`: a chat with the reply's header
/// appended (as a chat completion renders it), or the plain prompt.
fn vllm_tokenize_body(model: &str, prompt: &PromptSource) -> serde_json::Value {
    match prompt {
        PromptSource::Chat { messages, tools } => {
            let mut body = serde_json::json!({
                "model": model,
                "messages": messages,
                "add_generation_prompt": true,
            });
            if let Some(t) = tools {
                body["tools"] = t.clone();
            }
            body
        }
        PromptSource::Text(text) => serde_json::json!({ "model": model, "prompt": text }),
    }
}

/// Shared list of backends; reload swaps entries but keeps the `Arc` of unchanged ones so
/// their in-flight counts survive.
pub type BackendRef = Arc<Backend>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_header_is_the_urls_host_and_any_port_but_the_default() {
        let h = |u: &str| host_header(u).map(|v| v.to_str().unwrap().to_string());
        assert_eq!(
            h("http://127.0.0.1:8000").as_deref(),
            Some("127.0.0.1:8000")
        );
        assert_eq!(h("http://engine.local").as_deref(), Some("engine.local"));
        assert_eq!(
            h("https://llm.internal:443/v1").as_deref(),
            Some("llm.internal")
        );
        assert_eq!(
            h("https://llm.internal:8443").as_deref(),
            Some("llm.internal:8443")
        );
        assert_eq!(h("http://[::1]:9000").as_deref(), Some("[::1]:9000"));
    }

    #[test]
    fn vllm_counts_a_chat_through_its_template_and_a_prompt_as_sent() {
        let chat = PromptSource::Chat {
            messages: serde_json::json!([{"role": "user", "content": "hi"}]),
            tools: Some(serde_json::json!([{"type": "function"}])),
        };
        assert_eq!(
            vllm_tokenize_body("m", &chat),
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "add_generation_prompt": true, "tools": [{"type": "function"}]})
        );
        assert_eq!(
            vllm_tokenize_body("m", &PromptSource::Text("once".into())),
            serde_json::json!({"model": "m", "prompt": "once"})
        );
    }

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
        for _ in 0..200 {
            b.adaptive_sample(Some(Duration::from_millis(10)), false, 32);
        }
        let steady = b.cap();
        for _ in 0..50 {
            b.adaptive_sample(Some(Duration::from_millis(200)), false, 32);
        }
        assert!(b.cap() < steady, "{} !< {steady}", b.cap());
        let before = b.cap();
        b.adaptive_sample(None, true, 32);
        assert!(b.cap() <= before);
        let plain = Backend::new("m", &BackendConfig::default());
        assert_eq!(plain.cap(), 64);
        assert_eq!(plain.adaptive_limit(), None);
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_nanos(1 + ms * 1_000_000)
    }

    #[test]
    fn backpressure_is_told_apart_from_failure() {
        let cfg = OutlierConfig::default(); // backpressure up to a 2 s Retry-After
        let v = |status: u16, ra: Option<u64>, healthy: bool| {
            let status = StatusCode::from_u16(status).unwrap();
            Verdict::of_response(status, ra.map(Duration::from_millis), healthy, &cfg)
        };
        let bp = |ms: Option<u64>| Verdict::Backpressure {
            advised: ms.map(Duration::from_millis),
        };
        assert_eq!(v(429, None, true), bp(None));
        assert_eq!(v(429, Some(60_000), false), bp(Some(60_000)));
        assert_eq!(v(503, Some(1_000), true), bp(Some(1_000)));
        let unavailable = |ms: Option<u64>| Verdict::Unavailable {
            advised: ms.map(Duration::from_millis),
        };
        // From a backend whose health check fails, even a short 503 is not backpressure.
        assert_eq!(v(503, Some(1_000), false), unavailable(Some(1_000)));
        assert_eq!(v(503, Some(30_000), true), unavailable(Some(30_000)));
        assert_eq!(v(503, None, true), unavailable(None));
        assert_eq!(v(500, None, true), Verdict::Failure);
        assert_eq!(v(502, Some(1_000), true), Verdict::Failure);
        assert_eq!(v(400, None, true), Verdict::ClientError);
        assert_eq!(v(200, None, true), Verdict::Served);
        assert_eq!(bp(None).breaker_outcome(), BreakerOutcome::Backpressure);
        assert_eq!(
            unavailable(None).breaker_outcome(),
            BreakerOutcome::BackendFailure
        );
        assert!(!Verdict::ClientError.worth_another_backend());
        assert!(unavailable(None).worth_another_backend());
    }

    #[test]
    fn advised_retry_reads_both_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(advised_retry(&h), None);
        h.insert("retry-after", http::HeaderValue::from_static("3"));
        assert_eq!(advised_retry(&h), Some(Duration::from_secs(3)));
        h.insert("retry-after-ms", http::HeaderValue::from_static("250"));
        assert_eq!(advised_retry(&h), Some(Duration::from_millis(250)));
        let mut h = HeaderMap::new();
        h.insert(
            "retry-after",
            http::HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(advised_retry(&h), None);
    }

    #[test]
    fn unavailable_ejects_at_once_for_the_advised_time() {
        let cfg = OutlierConfig::default();
        let mut e = Ejection::default();
        let until = e.observe(
            Verdict::Unavailable {
                advised: Some(Duration::from_secs(9)),
            },
            at(0),
            &cfg,
        );
        assert_eq!(until, Some(at(9_000)));
        assert_eq!(e.ejected_until(at(8_999)), Some(at(9_000)));
        assert_eq!(e.ejected_until(at(9_000)), None);
        // Answers to requests sent before the ejection do not eject again.
        assert_eq!(
            e.observe(Verdict::Unavailable { advised: None }, at(10), &cfg),
            None
        );
        // Advice past the cap is cut to max_ejection_ms.
        let mut e = Ejection::default();
        let until = e.observe(
            Verdict::Unavailable {
                advised: Some(Duration::from_secs(3_600)),
            },
            at(0),
            &cfg,
        );
        assert_eq!(until, Some(at(cfg.max_ejection_ms)));
    }

    #[test]
    fn ejection_grows_on_repeats_and_is_forgiven_with_time() {
        let cfg = OutlierConfig {
            base_ejection_ms: 1_000,
            max_ejection_ms: 2_500,
            ..OutlierConfig::default()
        };
        let down = Verdict::Unavailable { advised: None };
        let mut e = Ejection::default();
        assert_eq!(e.observe(down, at(0), &cfg), Some(at(1_000)));
        // Failing again as soon as it is back: twice as long, then capped.
        assert_eq!(e.observe(down, at(1_000), &cfg), Some(at(3_000)));
        assert_eq!(e.observe(down, at(3_000), &cfg), Some(at(5_500)));
        // Back for long enough, the count is forgiven one base period at a time.
        assert_eq!(e.observe(down, at(7_500), &cfg), Some(at(9_500)));
        assert_eq!(e.observe(down, at(60_000), &cfg), Some(at(61_000)));
    }

    #[test]
    fn backpressure_with_retry_after_cools_the_backend_without_growing_its_backoff() {
        let cfg = OutlierConfig {
            base_ejection_ms: 1_000,
            max_ejection_ms: 60_000,
            ..OutlierConfig::default()
        };
        let mut e = Ejection::default();
        let bp = |s: u64| Verdict::Backpressure {
            advised: Some(Duration::from_secs(s)),
        };
        assert_eq!(e.observe(bp(30), at(0), &cfg), Some(at(30_000)));
        assert_eq!(e.ejected_until(at(29_999)), Some(at(30_000)));
        assert_eq!(e.ejected_until(at(30_000)), None);
        // Capped by max_ejection_ms.
        assert_eq!(e.observe(bp(3_600), at(40_000), &cfg), Some(at(100_000)));
        // A failure ejection afterwards starts from the base: cool-downs are not failures.
        let mut e = Ejection::default();
        e.observe(bp(5), at(0), &cfg);
        let failure = Verdict::Unavailable { advised: None };
        assert_eq!(e.observe(failure, at(10_000), &cfg), Some(at(11_000)));
    }

    #[test]
    fn failures_in_a_row_eject_and_a_success_resets_the_run() {
        let cfg = OutlierConfig {
            consecutive_failures: 3,
            base_ejection_ms: 1_000,
            ..OutlierConfig::default()
        };
        let mut e = Ejection::default();
        for v in [Verdict::Failure, Verdict::Failure, Verdict::Served] {
            assert_eq!(e.observe(v, at(0), &cfg), None);
        }
        // Backpressure and client errors neither count nor reset.
        for v in [
            Verdict::Failure,
            Verdict::Backpressure { advised: None },
            Verdict::ClientError,
            Verdict::Failure,
        ] {
            assert_eq!(e.observe(v, at(1), &cfg), None);
        }
        assert_eq!(e.observe(Verdict::Failure, at(2), &cfg), Some(at(1_002)));
        let off = OutlierConfig {
            enabled: false,
            ..cfg
        };
        let mut e = Ejection::default();
        assert_eq!(
            e.observe(Verdict::Unavailable { advised: None }, at(0), &off),
            None
        );
    }

    #[test]
    fn parses_llamacpp_metrics() {
        let text = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 4\n\
                    llamacpp:kv_cache_usage_ratio 0.25\n";
        let l = parse_load(BackendKind::Llamacpp, text).unwrap();
        assert_eq!((l.running, l.waiting, l.kv_usage), (2.0, 4.0, 0.25));
    }
}
