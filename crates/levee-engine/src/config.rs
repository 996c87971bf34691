//! Engine configuration: the GPU model's parameters, named profiles, and validation.

use crate::tokenizer::TokenizerKind;
use serde::{Deserialize, Serialize};

/// What the engine does when the running sequences need more KV cache than it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum OverloadMode {
    /// vLLM's behaviour: evict the newest running sequence (its KV is freed and it is
    /// recomputed later from the front of the queue). Slower, but KV never exceeds capacity.
    Preempt,
    /// A simulated CUDA out-of-memory: every in-flight request (running and waiting) fails,
    /// the engine answers 503 for `restart_secs` simulated seconds, then comes back empty.
    Crash,
}

/// Tokens per KV-cache block: vLLM's default `block_size`. The cache is paged in whole
/// blocks, so [`GpuParams::kv_capacity_tokens`] must be a multiple of it; the engine
/// describes its cache as `vllm:cache_config_info{block_size, num_gpu_blocks}` with
/// `block_size × num_gpu_blocks = kv_capacity_tokens` exactly.
pub const KV_BLOCK_SIZE: u32 = 16;

/// Parameters of the simulated GPU (continuous batching over a paged KV cache).
///
/// Times are simulated: they are divided by [`EngineConfig::time_scale`] to get wall time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GpuParams {
    /// KV-cache capacity in tokens, summed over all running sequences
    /// (each holds `prompt + generated so far` tokens). A whole number of
    /// [`KV_BLOCK_SIZE`]-token blocks.
    pub kv_capacity_tokens: u32,
    /// Most sequences in the running batch (vLLM's `max_num_seqs`).
    pub max_running_seqs: u32,
    /// Most prompt tokens prefilled in one step (vLLM's `max_num_batched_tokens`); a single
    /// prompt larger than this is still admitted alone.
    pub max_batched_prefill_tokens: u32,
    /// Longest sequence (prompt + completion) accepted; longer requests get a 400.
    /// Must not exceed `kv_capacity_tokens`.
    pub max_model_len: u32,
    /// Prefill cost per prompt token, in simulated microseconds.
    pub prefill_us_per_token: f64,
    /// Fixed cost of one decode step, in simulated milliseconds.
    pub decode_base_ms: f64,
    /// Extra decode-step cost per running sequence, in simulated milliseconds.
    pub decode_per_seq_ms: f64,
    /// Measured decode-step cost by batch size, in simulated milliseconds: entry `i` is a
    /// step over `i + 1` sequences; past the last entry the cost grows by
    /// `decode_per_seq_ms` per sequence. Empty (the default): `decode_base_ms +
    /// decode_per_seq_ms × batch`. For engines whose step cost is not a line in the batch,
    /// such as llama.cpp on a CPU (`levee sim calibrate` fills it).
    pub decode_ms_by_batch: Vec<f64>,
    /// Fixed extra cost of each prompt a step prefills, in simulated milliseconds: what a
    /// new request costs beyond its tokens (llama.cpp on a CPU: the chat template's tokens,
    /// tokenizing). Two prompts taken in by one step cost it twice. Default 0.
    pub prefill_base_ms: f64,
    /// A prompt's first token comes at the end of the step *after* the one that prefills it,
    /// not at the end of that step. llama.cpp with context checkpoints (models with
    /// sliding-window attention, such as Gemma 3) prefills a prompt's last few tokens in a
    /// step of their own, and a prompt that arrived meanwhile is prefilled in that same
    /// step: two prompts arriving close together both wait for both. `levee sim calibrate`
    /// sets it when a second request sent during the first one's prefill delays the first
    /// one's first token. Default false.
    pub first_token_next_step: bool,
    /// Keep the KV blocks of sequences that left the batch, keyed by their token prefix,
    /// until the cache needs them (evicted least recently released first); a prompt that
    /// starts with cached blocks prefills only the rest (vLLM's automatic prefix caching,
    /// on by default since its V1 engine). Default true.
    pub prefix_caching: bool,
    /// What a prompt token found in the prefix cache still costs, as a fraction of
    /// `prefill_us_per_token`: 0 (the default) is vLLM (cached tokens are not computed);
    /// `levee sim calibrate` measures it on a real server from the TTFT of a repeated
    /// prompt against a new one.
    pub cached_prefill_cost: f64,
    /// What happens when KV demand passes capacity.
    pub overload: OverloadMode,
    /// How long a crashed engine stays down, in simulated seconds.
    pub restart_secs: f64,
}

impl GpuParams {
    /// KV-cache blocks of [`KV_BLOCK_SIZE`] tokens (vLLM's `num_gpu_blocks`).
    pub fn kv_blocks(&self) -> u32 {
        self.kv_capacity_tokens / KV_BLOCK_SIZE
    }

    /// Cost of one decode step over `batch` sequences, in simulated milliseconds.
    pub fn decode_ms(&self, batch: usize) -> f64 {
        let table = &self.decode_ms_by_batch;
        match (table.get(batch.saturating_sub(1)), table.last()) {
            (Some(&ms), _) => ms,
            (None, Some(&last)) => last + self.decode_per_seq_ms * (batch - table.len()) as f64,
            (None, None) => self.decode_base_ms + self.decode_per_seq_ms * batch as f64,
        }
    }
}

impl Default for GpuParams {
    fn default() -> Self {
        EngineConfig::small().gpu
    }
}

/// Everything that configures one simulated engine.
///
/// `Default` is the `small` profile. Build one with [`EngineConfig::profile`] and adjust
/// fields; [`EngineConfig::validate`] is called by [`crate::spawn`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Profile this config started from (informational; shown in `/admin/state`).
    pub profile: String,
    /// The served model name; requests naming another model get a 404 like vLLM's.
    pub model: String,
    /// Simulated seconds per wall-clock second (10 = ten simulated seconds each real second).
    pub time_scale: f64,
    /// Shortest natural completion length (tokens) before `max_tokens` caps it.
    pub output_tokens_min: u32,
    /// Longest natural completion length (tokens) before `max_tokens` caps it.
    pub output_tokens_max: u32,
    /// How prompt tokens are counted: `"engine"` (default), the engine's own tokenizer
    /// (`crate::tokenizer`), which levee does not reproduce; or `"levee-rule"`, levee's
    /// fallback rule exactly, for tests that need levee and the engine to agree.
    pub tokenizer: TokenizerKind,
    /// How often the `/metrics` gauges (`vllm:num_requests_running`,
    /// `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`) are refreshed, in simulated
    /// seconds: between refreshes they show the value as of the last one, as a real
    /// engine's gauges lag behind it. 0 = live (refreshed after every step). Default 2.
    pub metrics_refresh_secs: f64,
    /// The GPU model.
    pub gpu: GpuParams,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self::small()
    }
}

/// Default of [`EngineConfig::metrics_refresh_secs`]: a real engine's gauges lag a few
/// seconds (vLLM's logging interval is of that order).
pub const DEFAULT_METRICS_REFRESH_SECS: f64 = 2.0;

/// Names accepted by [`EngineConfig::profile`].
pub const PROFILE_NAMES: &[&str] = &["small", "a100-7b", "tiny-fast", "zero"];

impl EngineConfig {
    /// A modest GPU (think an L4 serving a 7B model): 16k KV tokens, 64 sequences,
    /// decode 20 ms + 0.5 ms per sequence, prefill 150 µs per token, 30 s restart.
    pub fn small() -> Self {
        Self {
            profile: "small".into(),
            model: "levee-sim-7b".into(),
            time_scale: 1.0,
            output_tokens_min: 64,
            output_tokens_max: 256,
            tokenizer: TokenizerKind::Engine,
            metrics_refresh_secs: DEFAULT_METRICS_REFRESH_SECS,
            gpu: GpuParams {
                kv_capacity_tokens: 16_384,
                max_running_seqs: 64,
                max_batched_prefill_tokens: 4096,
                max_model_len: 4096,
                prefill_us_per_token: 150.0,
                decode_base_ms: 20.0,
                decode_per_seq_ms: 0.5,
                decode_ms_by_batch: Vec::new(),
                prefill_base_ms: 0.0,
                first_token_next_step: false,
                prefix_caching: true,
                cached_prefill_cost: 0.0,
                overload: OverloadMode::Preempt,
                restart_secs: 30.0,
            },
        }
    }

    /// An A100-80GB serving a 7B model with vLLM defaults: ~110k KV tokens, 256 sequences,
    /// decode 12 ms + 0.1 ms per sequence, prefill 50 µs per token, 60 s restart (model load).
    pub fn a100_7b() -> Self {
        Self {
            profile: "a100-7b".into(),
            model: "levee-sim-7b".into(),
            time_scale: 1.0,
            output_tokens_min: 64,
            output_tokens_max: 512,
            tokenizer: TokenizerKind::Engine,
            metrics_refresh_secs: DEFAULT_METRICS_REFRESH_SECS,
            gpu: GpuParams {
                kv_capacity_tokens: 110_000,
                max_running_seqs: 256,
                max_batched_prefill_tokens: 8192,
                max_model_len: 8192,
                prefill_us_per_token: 50.0,
                decode_base_ms: 12.0,
                decode_per_seq_ms: 0.1,
                decode_ms_by_batch: Vec::new(),
                prefill_base_ms: 0.0,
                first_token_next_step: false,
                prefix_caching: true,
                cached_prefill_cost: 0.0,
                overload: OverloadMode::Preempt,
                restart_secs: 60.0,
            },
        }
    }

    /// A tiny engine for tests: 2,048 KV tokens, 8 sequences, decode 10 ms + 1 ms per
    /// sequence, prefill 100 µs per token, completions of 8–16 tokens, 5 s restart.
    pub fn tiny_fast() -> Self {
        Self {
            profile: "tiny-fast".into(),
            model: "levee-sim-tiny".into(),
            time_scale: 1.0,
            output_tokens_min: 8,
            output_tokens_max: 16,
            tokenizer: TokenizerKind::Engine,
            metrics_refresh_secs: DEFAULT_METRICS_REFRESH_SECS,
            gpu: GpuParams {
                kv_capacity_tokens: 2048,
                max_running_seqs: 8,
                max_batched_prefill_tokens: 2048,
                max_model_len: 1024,
                prefill_us_per_token: 100.0,
                decode_base_ms: 10.0,
                decode_per_seq_ms: 1.0,
                decode_ms_by_batch: Vec::new(),
                prefill_base_ms: 0.0,
                first_token_next_step: false,
                prefix_caching: true,
                cached_prefill_cost: 0.0,
                overload: OverloadMode::Preempt,
                restart_secs: 5.0,
            },
        }
    }

    /// No simulated delay and practically unlimited memory: for benchmarking what sits in
    /// front of the engine (the gateway), where the engine must cost nothing. No prefix
    /// cache (a cache that never fills would keep every block of every request).
    pub fn zero() -> Self {
        Self {
            profile: "zero".into(),
            model: "levee-sim-7b".into(),
            time_scale: 1.0,
            output_tokens_min: 16,
            output_tokens_max: 16,
            tokenizer: TokenizerKind::Engine,
            metrics_refresh_secs: DEFAULT_METRICS_REFRESH_SECS,
            gpu: GpuParams {
                // The largest whole number of blocks in u32::MAX / 2.
                kv_capacity_tokens: (u32::MAX / 2) / KV_BLOCK_SIZE * KV_BLOCK_SIZE,
                max_running_seqs: 1_000_000,
                max_batched_prefill_tokens: u32::MAX / 2,
                max_model_len: 1_000_000,
                prefill_us_per_token: 0.0,
                decode_base_ms: 0.0,
                decode_per_seq_ms: 0.0,
                decode_ms_by_batch: Vec::new(),
                prefill_base_ms: 0.0,
                first_token_next_step: false,
                // Its cache never fills, so nothing would ever be evicted: every block of every
                // request would stay in memory.
                prefix_caching: false,
                cached_prefill_cost: 0.0,
                overload: OverloadMode::Preempt,
                restart_secs: 0.0,
            },
        }
    }

    /// The profile with this name (see [`PROFILE_NAMES`]).
    pub fn profile(name: &str) -> anyhow::Result<Self> {
        match name {
            "small" => Ok(Self::small()),
            "a100-7b" => Ok(Self::a100_7b()),
            "tiny-fast" => Ok(Self::tiny_fast()),
            "zero" => Ok(Self::zero()),
            other => anyhow::bail!(
                "unknown engine profile {other:?}: choose one of {}",
                PROFILE_NAMES.join(", ")
            ),
        }
    }

    /// Reads a config from TOML (fields left out take the `small` profile's values; unknown
    /// fields are errors naming the field).
    pub fn from_toml_str(text: &str) -> anyhow::Result<Self> {
        let config: Self =
            toml::from_str(text).map_err(|e| anyhow::anyhow!("engine config: {e}"))?;
        config.validate()?;
        Ok(config)
    }

    /// Reads a config from a TOML file (see [`EngineConfig::from_toml_str`]).
    pub fn from_toml_file(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("engine config: cannot read {}: {e}", path.display()))?;
        Self::from_toml_str(&text).map_err(|e| anyhow::anyhow!("{}: {e:#}", path.display()))
    }

    /// Checks that the parameters describe an engine that can make progress.
    pub fn validate(&self) -> anyhow::Result<()> {
        let g = &self.gpu;
        let finite_non_negative = |name: &str, v: f64| -> anyhow::Result<()> {
            anyhow::ensure!(
                v.is_finite() && v >= 0.0,
                "engine config: {name} must be a finite number >= 0, got {v}"
            );
            Ok(())
        };
        finite_non_negative("gpu.prefill_us_per_token", g.prefill_us_per_token)?;
        finite_non_negative("gpu.decode_base_ms", g.decode_base_ms)?;
        finite_non_negative("gpu.decode_per_seq_ms", g.decode_per_seq_ms)?;
        finite_non_negative("gpu.prefill_base_ms", g.prefill_base_ms)?;
        anyhow::ensure!(
            (0.0..=1.0).contains(&g.cached_prefill_cost),
            "engine config: gpu.cached_prefill_cost must be between 0 and 1, got {}",
            g.cached_prefill_cost
        );
        for (i, &ms) in g.decode_ms_by_batch.iter().enumerate() {
            finite_non_negative(&format!("gpu.decode_ms_by_batch[{i}]"), ms)?;
        }
        finite_non_negative("gpu.restart_secs", g.restart_secs)?;
        finite_non_negative("metrics_refresh_secs", self.metrics_refresh_secs)?;
        anyhow::ensure!(
            self.time_scale.is_finite() && self.time_scale > 0.0,
            "engine config: time_scale must be a finite number > 0, got {}",
            self.time_scale
        );
        anyhow::ensure!(
            g.kv_capacity_tokens >= KV_BLOCK_SIZE
                && g.kv_capacity_tokens.is_multiple_of(KV_BLOCK_SIZE),
            "engine config: gpu.kv_capacity_tokens ({}) must be a whole number (>= 1) of \
             {KV_BLOCK_SIZE}-token KV blocks; use {} or {}",
            g.kv_capacity_tokens,
            (g.kv_capacity_tokens / KV_BLOCK_SIZE).max(1) * KV_BLOCK_SIZE,
            (g.kv_capacity_tokens / KV_BLOCK_SIZE + 1) * KV_BLOCK_SIZE
        );
        anyhow::ensure!(
            g.max_running_seqs >= 1,
            "engine config: gpu.max_running_seqs must be at least 1"
        );
        anyhow::ensure!(
            g.max_batched_prefill_tokens >= 1,
            "engine config: gpu.max_batched_prefill_tokens must be at least 1"
        );
        anyhow::ensure!(
            g.max_model_len >= 2,
            "engine config: gpu.max_model_len must be at least 2 (one prompt token, one output)"
        );
        anyhow::ensure!(
            g.max_model_len <= g.kv_capacity_tokens,
            "engine config: gpu.max_model_len ({}) exceeds gpu.kv_capacity_tokens ({}): a \
             request that long could never be scheduled; raise the capacity or lower the length",
            g.max_model_len,
            g.kv_capacity_tokens
        );
        anyhow::ensure!(
            self.output_tokens_min >= 1 && self.output_tokens_min <= self.output_tokens_max,
            "engine config: need 1 <= output_tokens_min ({}) <= output_tokens_max ({})",
            self.output_tokens_min,
            self.output_tokens_max
        );
        anyhow::ensure!(!self.model.is_empty(), "engine config: model name is empty");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_is_valid() {
        for name in PROFILE_NAMES {
            let cfg = EngineConfig::profile(name).unwrap();
            cfg.validate().unwrap();
            assert_eq!(&cfg.profile, name);
        }
        assert!(EngineConfig::profile("h100").is_err());
    }

    #[test]
    fn validate_rejects_unschedulable_lengths() {
        let mut cfg = EngineConfig::tiny_fast();
        cfg.gpu.max_model_len = cfg.gpu.kv_capacity_tokens + 1;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("max_model_len"), "{err}");
        let mut cfg = EngineConfig::tiny_fast();
        cfg.time_scale = 0.0;
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn kv_capacity_is_whole_blocks() {
        for name in PROFILE_NAMES {
            let g = EngineConfig::profile(name).unwrap().gpu;
            assert_eq!(
                g.kv_blocks() * KV_BLOCK_SIZE,
                g.kv_capacity_tokens,
                "{name}"
            );
        }
        let mut cfg = EngineConfig::tiny_fast();
        cfg.gpu.kv_capacity_tokens = 2050;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.contains("kv_capacity_tokens") && err.contains("2048 or 2064"),
            "{err}"
        );
        cfg.gpu.kv_capacity_tokens = 8;
        cfg.gpu.max_model_len = 4;
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn config_reads_toml_with_defaults_and_names_unknown_fields() {
        let c = EngineConfig::from_toml_str(
            "model = \"m\"\ntime_scale = 10.0\n[gpu]\noverload = \"crash\"\nrestart_secs = 7.5\n",
        )
        .unwrap();
        assert_eq!(c.model, "m");
        assert_eq!(c.gpu.overload, OverloadMode::Crash);
        assert_eq!(c.gpu.restart_secs, 7.5);
        assert_eq!(
            c.gpu.kv_capacity_tokens,
            EngineConfig::small().gpu.kv_capacity_tokens
        );
        let err = EngineConfig::from_toml_str("[gpu]\nkv_capacity = 5\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("kv_capacity"), "{err}");
        let err = EngineConfig::from_toml_str("time_scale = -1.0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("time_scale"), "{err}");
    }

    #[test]
    fn the_shipped_profile_files_load() {
        let c = EngineConfig::from_toml_str(include_str!(
            "../../../profiles/llamacpp-gemma3-270m-2core.toml"
        ))
        .unwrap();
        assert_eq!(c.tokenizer, TokenizerKind::Engine);
        assert!(c.gpu.prefix_caching);
    }

    #[test]
    fn config_round_trips_through_json_and_rejects_unknown_fields() {
        let cfg = EngineConfig::a100_7b();
        let json = serde_json::to_string(&cfg).unwrap();
        let back: EngineConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, cfg);
        let bad = r#"{"modle": "x"}"#;
        assert!(serde_json::from_str::<EngineConfig>(bad).is_err());
        let partial: EngineConfig = serde_json::from_str(r#"{"time_scale": 10.0}"#).unwrap();
        assert_eq!(partial.time_scale, 10.0);
        assert_eq!(partial.gpu, EngineConfig::small().gpu);
    }
}
