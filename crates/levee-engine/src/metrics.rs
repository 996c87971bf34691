//! Prometheus metrics in vLLM's names, so the gateway reads the simulator and a real vLLM
//! with the same code. Every time is in simulated seconds.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::borrow::Cow;
use std::sync::atomic::AtomicU64;

/// vLLM's buckets for `time_to_first_token_seconds`.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's buckets for `e2e_request_latency_seconds`.
const E2E_BUCKETS: [f64; 18] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0,
];

/// Label of `vllm:request_success_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct FinishLabel {
    pub finished_reason: &'static str,
}

/// Label of `levee_engine_requests_failed_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub reason: &'static str,
}

/// Labels of `vllm:cache_config_info`: how the KV cache is paged.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CacheConfigLabels {
    pub block_size: u32,
    pub num_gpu_blocks: u32,
}

/// The engine's metrics and the registry that renders them.
pub(crate) struct Metrics {
    registry: Registry,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_usage: Gauge<f64, AtomicU64>,
    /// The same value under the name vLLM used before 0.10, for older scrapers.
    pub gpu_cache_usage: Gauge<f64, AtomicU64>,
    pub ttft: Histogram,
    pub e2e: Histogram,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
    pub preemptions: Counter,
    pub crashes: Counter,
    pub cancelled: Counter,
    pub success: Family<FinishLabel, Counter>,
    pub failed: Family<ReasonLabel, Counter>,
}

impl Metrics {
    /// Metrics labelled `model_name=<model>` as vLLM labels its own, describing a KV cache of
    /// `num_gpu_blocks` blocks of `block_size` tokens.
    pub fn new(model: &str, block_size: u32, num_gpu_blocks: u32) -> Self {
        let mut registry = Registry::with_labels(
            [(Cow::Borrowed("model_name"), Cow::Owned(model.to_string()))].into_iter(),
        );
        let m = Self {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            gpu_cache_usage: Gauge::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            preemptions: Counter::default(),
            crashes: Counter::default(),
            cancelled: Counter::default(),
            success: Family::default(),
            failed: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "vllm:num_requests_running",
            "Number of requests in the running batch",
            m.running.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be scheduled (including preempted ones)",
            m.waiting.clone(),
        );
        registry.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 0 to 1 (1 = full)",
            m.kv_usage.clone(),
        );
        registry.register(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage, 0 to 1 (the name vLLM used before 0.10)",
            m.gpu_cache_usage.clone(),
        );
        // vLLM describes its cache config as the labels of a gauge that is always 1; the
        // gateway reads the KV budget from it (block_size × num_gpu_blocks tokens).
        let cache_config = Family::<CacheConfigLabels, Gauge>::default();
        cache_config
            .get_or_create(&CacheConfigLabels {
                block_size,
                num_gpu_blocks,
            })
            .set(1);
        registry.register(
            "vllm:cache_config_info",
            "Information of the KV cache config (block_size x num_gpu_blocks = KV tokens)",
            cache_config,
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Time to first token in simulated seconds",
            m.ttft.clone(),
        );
        registry.register(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in simulated seconds",
            m.e2e.clone(),
        );
        // The encoder appends `_total` to counters.
        registry.register(
            "vllm:prompt_tokens",
            "Prompt tokens of each request at its first admission (cached ones included)",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        registry.register(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_cache_queries.clone(),
        );
        registry.register(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            m.prefix_cache_hits.clone(),
        );
        registry.register(
            "vllm:num_preemptions",
            "Sequences preempted to make room in the KV cache",
            m.preemptions.clone(),
        );
        registry.register(
            "vllm:request_success",
            "Requests that completed, by finish reason",
            m.success.clone(),
        );
        registry.register(
            "levee_engine_crashes",
            "Simulated engine crashes (CUDA out-of-memory or injected)",
            m.crashes.clone(),
        );
        registry.register(
            "levee_engine_requests_failed",
            "Requests the engine failed, by reason",
            m.failed.clone(),
        );
        registry.register(
            "levee_engine_requests_cancelled",
            "Requests whose client went away before the end",
            m.cancelled.clone(),
        );
        Self { registry, ..m }
    }

    /// The Prometheus (OpenMetrics) text of every metric.
    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::with_capacity(4096);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// Sets the gauges that describe the engine's state: sequences running and waiting,
    /// and the KV cache's use (0..=1).
    pub fn set_gauges(&self, running: usize, waiting: usize, kv_usage: f64) {
        self.running.set(i64::try_from(running).unwrap_or(i64::MAX));
        self.waiting.set(i64::try_from(waiting).unwrap_or(i64::MAX));
        self.kv_usage.set(kv_usage);
        self.gpu_cache_usage.set(kv_usage);
    }

    /// Counts a request that failed for `reason`.
    pub fn fail(&self, reason: &'static str) {
        self.failed.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Requests failed for `reason` so far.
    pub fn failures(&self, reason: &'static str) -> u64 {
        self.failed.get_or_create(&ReasonLabel { reason }).get()
    }
}
