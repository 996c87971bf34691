//! `levee sim calibrate`: measure a real OpenAI-compatible server and fit an engine profile.
//!
//! The sweep is closed loop: at each concurrency level `c` (1, 2, 4, 8, 16 by default), `c`
//! workers each send a streaming chat request, wait for its end, and send the next, until
//! the level's time or request budget runs out. Every prompt is new text (a unique id first,
//! then seeded English prose), so no prefix cache makes the server look faster than it is,
//! except in the warm probe, which measures that cache on purpose.
//! Per level it records requests per second, time to first token, inter-token latency and
//! output tokens per second. A second, short series at concurrency 1 measures TTFT against
//! prompt length: the prefill cost; a third, whether a prompt arriving during another's
//! prefill delays the other's first token (the pair probe).
//!
//! The fit maps the measurements onto the simulated engine's step model (a step costs
//! `prefill_base_ms` for each prompt it prefills, `prefill_us_per_token × prefilled`, and
//! the decode cost of its batch):
//! - `decode_ms_by_batch`: the median inter-token gap measured at each level that fits in
//!   the batch is the decode cost of that batch size, with straight lines between levels.
//!   A step's cost is not one line over all batch sizes on every engine: llama.cpp on a CPU
//!   pays much more going from one sequence to two than from two to four;
//! - `decode_base_ms`, `decode_per_seq_ms`: the least-squares line through those gaps, a
//!   summary, and the cost of each sequence past the largest level measured;
//! - `prefill_us_per_token`: slope of TTFT (concurrency 1) against prompt tokens;
//! - `first_token_next_step`: the pair probe (the sweep's prompt alone, then with a second
//!   one sent a quarter of its TTFT later): set when the first of the pair takes more than
//!   1.5× its TTFT alone, i.e. its first token waited for the second's prefill;
//! - `prefill_base_ms`: what each new prompt costs beyond its tokens (the chat template's
//!   tokens, tokenizing): the sweep's TTFT at concurrency 1 less its prompt's tokens at that
//!   slope and one decode step of one sequence, two with `first_token_next_step` (without a
//!   level 1, the prefill line at zero tokens less the steps);
//! - `prefix_caching`, `cached_prefill_cost`: the warm probe (the longest prompt of the
//!   prefill series sent twice, the same text): the TTFT the repeat saved over what skipping
//!   every token the simulated engine would find cached would save; a repeat that saves less
//!   than a tenth of that is no prefix cache;
//! - `max_running_seqs`: the slots the server reports (llama.cpp's `/props`), else the
//!   level at which throughput stops growing;
//! - KV capacity and `max_model_len`: what the server reports (`/props` for llama.cpp,
//!   `/v1/models` and `vllm:cache_config_info` for vLLM), else a default.
//!
//! Token counts are in the simulated engine's units (its own tokenizer and chat template,
//! [`levee_engine::tokenizer`]; the prompts are English prose): the profile exists to make
//! the simulator reproduce the server's timing for the same request text, whatever the
//! server's own tokenizer.

use crate::exchange::{attempt, http_client, HttpClient};
use crate::recorder::Kind;
use crate::text::{self, TextKind};
use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use levee_engine::{tokenizer, EngineConfig, KV_BLOCK_SIZE};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Command-line arguments of `levee sim calibrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct CalibrateArgs {
    /// Base URL of the server to measure, e.g. http://127.0.0.1:8081.
    #[arg(long)]
    pub target: String,
    /// Model name to send (default: the first model of the target's `/v1/models`).
    #[arg(long)]
    pub model: Option<String>,
    /// Concurrency levels of the sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub levels: Vec<u32>,
    /// Seconds each level sends new requests (in-flight ones are then awaited).
    #[arg(long, default_value_t = 15.0)]
    pub level_secs: f64,
    /// Most requests one level sends.
    #[arg(long, default_value_t = 400)]
    pub max_requests_per_level: u32,
    /// Slices each level is cut into; the levels take turns slice by slice (1, 2, 4, 8,
    /// 16, 1, 2, …), so that the machine's changing load bends no single level.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Prompt length of the sweep's requests, in simulated-engine tokens.
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: u32,
    /// Output tokens of every request (sent as `max_tokens` with `ignore_eos`).
    #[arg(long, default_value_t = 32)]
    pub output_tokens: u32,
    /// Prompt lengths of the prefill series (concurrency 1), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,128,256,512")]
    pub prefill_lengths: Vec<u32>,
    /// Requests per prompt length in the prefill series.
    #[arg(long, default_value_t = 5)]
    pub prefill_repeats: u32,
    /// Seed of the prompt text.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Write the fitted engine profile (TOML, loaded by `levee engine --profile-file`) here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Name of the fitted profile (shown by the engine in `/admin/state`).
    #[arg(long, default_value = "calibrated")]
    pub name: String,
    /// Write the measurements (JSON) here.
    #[arg(long)]
    pub sweep_json: Option<PathBuf>,
    /// Compare this run with an earlier sweep (JSON): prints both side by side and fails
    /// unless req/s and p50 TTFT are within `--tolerance` at every level.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    /// Largest relative difference `--compare` accepts (0.2 = 20%).
    #[arg(long, default_value_t = 0.2)]
    pub tolerance: f64,
    /// Skip the prefill series (only the concurrency sweep).
    #[arg(long)]
    pub no_prefill: bool,
}

/// What the server says about itself (all optional: servers differ).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// Sequences it runs at once (llama.cpp's `total_slots`).
    pub slots: Option<u32>,
    /// Longest sequence one request may use (llama.cpp's per-slot `n_ctx`, vLLM's
    /// `max_model_len`).
    pub max_model_len: Option<u32>,
    /// KV-cache capacity in tokens, over all sequences.
    pub kv_capacity_tokens: Option<u32>,
}

/// One concurrency level of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LevelResult {
    /// Closed-loop workers.
    pub concurrency: u32,
    /// Requests that completed.
    pub completed: u32,
    /// Requests that failed (any status but 2xx, a cut stream, a timeout).
    pub failed: u32,
    /// The failed requests by how they failed (`connect`, `5xx:503`, `broken_stream`, …).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub failures: std::collections::BTreeMap<String, u32>,
    /// Completed requests per second of the level's wall time.
    pub rps: f64,
    /// Output tokens per second.
    pub tokens_per_s: f64,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile time to first token, ms.
    pub ttft_p90_ms: f64,
    /// Median gap between tokens, ms.
    pub itl_p50_ms: f64,
}

/// TTFT of a prompt length at concurrency 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillPoint {
    /// Prompt tokens (simulated-engine units).
    pub prompt_tokens: u32,
    /// Median time to first token, ms.
    pub ttft_p50_ms: f64,
}

/// Whether a prompt's first token waits for a prompt that arrives during its prefill: the
/// sweep's prompt alone, then the same with a second one sent a quarter of that TTFT later.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairProbe {
    /// Median TTFT of the prompt alone, ms.
    pub alone_ttft_p50_ms: f64,
    /// How long after the first the second request was sent, ms.
    pub stagger_ms: f64,
    /// Median TTFT of the first of the pair, ms.
    pub first_of_pair_ttft_p50_ms: f64,
}

impl PairProbe {
    /// The first of a pair waits for the second's prefill when its TTFT grows by more than
    /// half: an engine that emits a prompt's first token from its own prefill step leaves it
    /// about where it was alone (the second waits for that step), one that emits it a step
    /// later (llama.cpp with context checkpoints) prefills the second in that step and about
    /// doubles it.
    pub fn first_token_waits_for_next_step(&self) -> bool {
        self.alone_ttft_p50_ms > 0.0
            && self.first_of_pair_ttft_p50_ms > 1.5 * self.alone_ttft_p50_ms
    }
}

/// A prompt sent twice in a row, the same text both times, at concurrency 1: how much of
/// its prefill the server's prefix cache saves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarmProbe {
    /// Prompt tokens (simulated-engine units).
    pub prompt_tokens: u32,
    /// Median TTFT of the first send, ms.
    pub cold_ttft_p50_ms: f64,
    /// Median TTFT of the repeat, ms.
    pub warm_ttft_p50_ms: f64,
}

impl WarmProbe {
    /// What a cached prompt token still costs, as a fraction of a computed one, given the
    /// prefill cost per token (µs): the TTFT the repeat saved, over what skipping every
    /// token the simulated engine would find cached (all but the last block's worth: at most
    /// `prompt − 1` tokens, in whole 16-token blocks) would save. 0 = a cached token is
    /// free (vLLM), 1 = no saving; `None` without a prefill cost to compare with.
    pub fn cached_prefill_cost(&self, prefill_us_per_token: f64) -> Option<f64> {
        let cached =
            f64::from(self.prompt_tokens.saturating_sub(1) / KV_BLOCK_SIZE * KV_BLOCK_SIZE);
        let full_saving_ms = cached * prefill_us_per_token / 1000.0;
        (full_saving_ms > 0.0).then(|| {
            let saved = self.cold_ttft_p50_ms - self.warm_ttft_p50_ms;
            (1.0 - saved / full_saving_ms).clamp(0.0, 1.0)
        })
    }
}

/// Everything one calibration run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sweep {
    /// The server measured.
    pub target: String,
    /// The model sent.
    pub model: String,
    /// Prompt tokens of the concurrency sweep.
    pub prompt_tokens: u32,
    /// Output tokens of every request.
    pub output_tokens: u32,
    /// What the server said about itself.
    pub server: ServerInfo,
    /// The concurrency sweep, in level order.
    pub levels: Vec<LevelResult>,
    /// The prefill series.
    pub prefill: Vec<PrefillPoint>,
    /// The staggered pair (absent with `--no-prefill`, and in sweeps written before it).
    #[serde(default)]
    pub pair: Option<PairProbe>,
    /// The repeated prompt (absent with `--no-prefill`, and in sweeps written before it).
    #[serde(default)]
    pub warm: Option<WarmProbe>,
}

/// Runs `levee sim calibrate`.
pub async fn run_cli(args: CalibrateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.levels.is_empty() && args.levels.iter().all(|&c| c >= 1),
        "--levels must list concurrency levels >= 1, e.g. 1,2,4,8,16"
    );
    anyhow::ensure!(
        args.level_secs.is_finite() && args.level_secs > 0.0,
        "--level-secs must be > 0 (got {})",
        args.level_secs
    );
    anyhow::ensure!(
        args.output_tokens >= 2,
        "--output-tokens must be at least 2 (inter-token latency needs two tokens)"
    );
    // Read a comparison sweep first: a bad path should fail before minutes of measuring.
    let reference = match &args.compare {
        Some(path) => Some(read_sweep(path)?),
        None => None,
    };
    let sweep = measure(&args).await?;
    print!("{}", sweep_table(&sweep));
    if let Some(path) = &args.sweep_json {
        let text = serde_json::to_string_pretty(&sweep).context("cannot encode the sweep")?;
        std::fs::write(path, text)
            .with_context(|| format!("cannot write the sweep to {}", path.display()))?;
        println!("sweep: {}", path.display());
    }
    if let Some(path) = &args.out {
        let profile = fit(&sweep, &args.name)?;
        let command: Vec<String> = std::env::args().collect();
        let text = profile_toml(&profile, &sweep, &command.join(" "))?;
        std::fs::write(path, text)
            .with_context(|| format!("cannot write the profile to {}", path.display()))?;
        println!(
            "profile {}: prefill {:.1} us/token, decode {:.2} ms + {:.2} ms/seq, {} seqs, \
             {} KV tokens, max_model_len {}",
            path.display(),
            profile.gpu.prefill_us_per_token,
            profile.gpu.decode_base_ms,
            profile.gpu.decode_per_seq_ms,
            profile.gpu.max_running_seqs,
            profile.gpu.kv_capacity_tokens,
            profile.gpu.max_model_len
        );
    }
    if let Some(reference) = reference {
        let verdict = compare(&reference, &sweep, args.tolerance);
        print!("{}", verdict.table);
        anyhow::ensure!(
            verdict.pass,
            "fidelity: req/s or p50 TTFT differ by more than {:.0}% at some level (see the table)",
            args.tolerance * 100.0
        );
    }
    Ok(())
}

fn read_sweep(path: &std::path::Path) -> anyhow::Result<Sweep> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the sweep {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a sweep written by `levee sim calibrate --sweep-json`",
            path.display()
        )
    })
}

/// Runs the prefill series and the concurrency sweep against `args.target`.
pub async fn measure(args: &CalibrateArgs) -> anyhow::Result<Sweep> {
    let client = http_client();
    let base = args.target.trim_end_matches('/').to_string();
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&client, &base).await?,
    };
    let server = server_info(&client, &base).await;
    let prompts = Arc::new(PromptMaker::new(args.seed));
    // A fresh server pays one-time costs on its first request (buffers, caches): one
    // request first, not measured.
    let warm_up = one_request(&client, &base, prompts.body(&model, args.prompt_tokens, 2)).await;
    anyhow::ensure!(
        warm_up.ok,
        "calibrate: the first request to {base}/v1/chat/completions (model {model:?}) failed; \
         is the server up and serving that model?"
    );
    let mut prefill = Vec::new();
    if !args.no_prefill {
        for &len in &args.prefill_lengths {
            let mut ttfts = Vec::new();
            for _ in 0..args.prefill_repeats.max(1) {
                let body = prompts.body(&model, len, 2);
                let one = one_request(&client, &base, body).await;
                if let Some(t) = one.ttft_ms {
                    ttfts.push(t);
                }
            }
            anyhow::ensure!(
                !ttfts.is_empty(),
                "calibrate: every request of {len} prompt tokens to {base} failed; is the \
                 server up and is the prompt within its context?"
            );
            prefill.push(PrefillPoint {
                prompt_tokens: len,
                ttft_p50_ms: quantile(&mut ttfts, 0.5),
            });
        }
    }
    let (pair, warm) = if args.no_prefill {
        (None, None)
    } else {
        (
            Some(pair_probe(&client, &base, &model, &prompts, args).await?),
            Some(warm_probe(&client, &base, &model, &prompts, args).await?),
        )
    };
    // Each level runs in `rounds` slices, the levels taking turns, so that a change in the
    // machine's load (other work on the same cores) spreads over every level instead of
    // bending the curve at one.
    let rounds = args.rounds.max(1);
    let slice = Slice {
        secs: args.level_secs / f64::from(rounds),
        max_requests: args.max_requests_per_level.div_ceil(rounds),
    };
    let mut measured: Vec<(Vec<Timed>, f64)> = vec![(Vec::new(), 0.0); args.levels.len()];
    for _ in 0..rounds {
        for (i, &c) in args.levels.iter().enumerate() {
            let (done, wall) = run_level(&client, &base, &model, &prompts, args, c, slice).await;
            measured[i].0.extend(done);
            measured[i].1 += wall;
        }
    }
    let mut levels = Vec::new();
    for (&c, (done, wall)) in args.levels.iter().zip(&measured) {
        let level = summarize(c, done, *wall);
        anyhow::ensure!(
            level.completed > 0,
            "calibrate: no request completed at concurrency {c} ({} failed) against {base}",
            level.failed
        );
        levels.push(level);
    }
    Ok(Sweep {
        target: base,
        model,
        prompt_tokens: args.prompt_tokens,
        output_tokens: args.output_tokens,
        server,
        levels,
        prefill,
        pair,
        warm,
    })
}

/// Measures [`WarmProbe`] with the longest prompt of the prefill series: a new prompt, then
/// the same body again, `prefill_repeats` times (a new prompt each time).
async fn warm_probe(
    client: &HttpClient,
    base: &str,
    model: &str,
    prompts: &PromptMaker,
    args: &CalibrateArgs,
) -> anyhow::Result<WarmProbe> {
    let len = args
        .prefill_lengths
        .iter()
        .copied()
        .max()
        .unwrap_or(args.prompt_tokens);
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..args.prefill_repeats.max(1) {
        let body = prompts.body(model, len, 2);
        let first = one_request(client, base, body.clone()).await;
        let again = one_request(client, base, body).await;
        if let (Some(c), Some(w)) = (first.ttft_ms, again.ttft_ms) {
            cold.push(c);
            warm.push(w);
        }
    }
    anyhow::ensure!(
        !cold.is_empty(),
        "calibrate: every pair of the repeated-prompt probe to {base} failed"
    );
    Ok(WarmProbe {
        prompt_tokens: len,
        cold_ttft_p50_ms: quantile(&mut cold, 0.5),
        warm_ttft_p50_ms: quantile(&mut warm, 0.5),
    })
}

/// Measures [`PairProbe`]: the sweep's prompt alone, then the same prompt with a second one
/// sent a quarter of its TTFT alone later (during its prefill), `prefill_repeats` times each.
async fn pair_probe(
    client: &HttpClient,
    base: &str,
    model: &str,
    prompts: &PromptMaker,
    args: &CalibrateArgs,
) -> anyhow::Result<PairProbe> {
    let repeats = args.prefill_repeats.max(1);
    let mut alone = Vec::new();
    for _ in 0..repeats {
        let one = one_request(client, base, prompts.body(model, args.prompt_tokens, 2)).await;
        alone.extend(one.ttft_ms);
    }
    anyhow::ensure!(
        !alone.is_empty(),
        "calibrate: every request of the pair probe's first series to {base} failed"
    );
    let alone_ttft_p50_ms = quantile(&mut alone, 0.5);
    let stagger = Duration::from_secs_f64(alone_ttft_p50_ms / 4.0 / 1000.0);
    let mut first = Vec::new();
    for _ in 0..repeats {
        let a = one_request(client, base, prompts.body(model, args.prompt_tokens, 2));
        let b = async {
            tokio::time::sleep(stagger).await;
            one_request(client, base, prompts.body(model, args.prompt_tokens, 2)).await
        };
        let (a, _) = tokio::join!(a, b);
        first.extend(a.ttft_ms);
    }
    anyhow::ensure!(
        !first.is_empty(),
        "calibrate: every request of the pair probe's pairs to {base} failed"
    );
    Ok(PairProbe {
        alone_ttft_p50_ms,
        stagger_ms: stagger.as_secs_f64() * 1000.0,
        first_of_pair_ttft_p50_ms: quantile(&mut first, 0.5),
    })
}

/// How long one slice of a level runs, and the most requests it sends.
#[derive(Debug, Clone, Copy)]
struct Slice {
    secs: f64,
    max_requests: u32,
}

/// One request's timings.
#[derive(Debug, Clone)]
struct Timed {
    ok: bool,
    /// How it failed (a `Report::errors` key), when it did.
    failure: Option<String>,
    ttft_ms: Option<f64>,
    itl_ms: Vec<f64>,
    tokens: u32,
}

/// Longest wait for one request before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

async fn one_request(client: &HttpClient, base: &str, body: String) -> Timed {
    let failed = |why: &str| Timed {
        ok: false,
        failure: Some(why.to_string()),
        ttft_ms: None,
        itl_ms: Vec::new(),
        tokens: 0,
    };
    let body = Bytes::from(body);
    let start = Instant::now();
    let deadline = start + REQUEST_TIMEOUT;
    // One more try when no answer came at all: llama-server closes a keep-alive connection
    // after a few requests, and the pooled connection the request went out on may be one it
    // has just closed (levee's gateway does the same). Timed from the first try.
    let mut tries_left = 2;
    let result = loop {
        tries_left -= 1;
        let Ok(request) = http::Request::post(format!("{base}/v1/chat/completions"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.clone()))
        else {
            return failed("bad_request");
        };
        let admitted = AtomicBool::new(false);
        let Ok(result) =
            tokio::time::timeout_at(deadline, attempt(client, request, start, &admitted, false))
                .await
        else {
            return failed("timeout");
        };
        if result.kind != Kind::Connect || tries_left == 0 {
            break result;
        }
    };
    let failure = match result.kind.error_key() {
        Some(key) => Some(key),
        None if result.first_token_ns.is_none() => Some("no_token".to_string()),
        None => None,
    };
    Timed {
        ok: failure.is_none(),
        failure,
        ttft_ms: result.first_token_ns.map(|ns| ns as f64 / 1e6),
        itl_ms: result
            .itl_us
            .iter()
            .map(|&us| f64::from(us) / 1e3)
            .collect(),
        tokens: result.tokens,
    }
}

/// Runs one slice of a level: its requests and its wall time in seconds.
async fn run_level(
    client: &HttpClient,
    base: &str,
    model: &str,
    prompts: &Arc<PromptMaker>,
    args: &CalibrateArgs,
    concurrency: u32,
    slice: Slice,
) -> (Vec<Timed>, f64) {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(slice.secs);
    let budget = Arc::new(std::sync::atomic::AtomicU32::new(slice.max_requests));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let base = base.to_string();
        let model = model.to_string();
        let prompts = prompts.clone();
        let budget = budget.clone();
        let (prompt_tokens, output_tokens) = (args.prompt_tokens, args.output_tokens);
        workers.spawn(async move {
            let mut done = Vec::new();
            while Instant::now() < deadline
                && budget
                    .fetch_update(
                        std::sync::atomic::Ordering::Relaxed,
                        std::sync::atomic::Ordering::Relaxed,
                        |n| n.checked_sub(1),
                    )
                    .is_ok()
            {
                let body = prompts.body(&model, prompt_tokens, output_tokens);
                done.push(one_request(&client, &base, body).await);
            }
            done
        });
    }
    let mut all = Vec::new();
    while let Some(joined) = workers.join_next().await {
        // A worker cannot panic short of a bug; its requests are then simply missing.
        if let Ok(done) = joined {
            all.extend(done);
        }
    }
    (all, start.elapsed().as_secs_f64())
}

fn summarize(concurrency: u32, all: &[Timed], wall_secs: f64) -> LevelResult {
    let wall_secs = wall_secs.max(1e-9);
    let ok: Vec<&Timed> = all.iter().filter(|t| t.ok).collect();
    let mut ttfts: Vec<f64> = ok.iter().filter_map(|t| t.ttft_ms).collect();
    let mut itls: Vec<f64> = ok.iter().flat_map(|t| t.itl_ms.iter().copied()).collect();
    let tokens: u64 = ok.iter().map(|t| u64::from(t.tokens)).sum();
    let completed = u32::try_from(ok.len()).unwrap_or(u32::MAX);
    LevelResult {
        concurrency,
        completed,
        failed: u32::try_from(all.len() - ok.len()).unwrap_or(u32::MAX),
        failures: all.iter().filter_map(|t| t.failure.clone()).fold(
            std::collections::BTreeMap::new(),
            |mut m, k| {
                *m.entry(k).or_insert(0) += 1;
                m
            },
        ),
        rps: f64::from(completed) / wall_secs,
        tokens_per_s: tokens as f64 / wall_secs,
        ttft_p50_ms: quantile(&mut ttfts, 0.5),
        ttft_p90_ms: quantile(&mut ttfts, 0.9),
        itl_p50_ms: quantile(&mut itls, 0.5),
    }
}

/// The `q` quantile (nearest rank) of `values`; 0 when empty.
fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = (q * values.len() as f64).ceil() as usize;
    values[rank.clamp(1, values.len()) - 1]
}

/// Makes unique prompts of a given length (simulated-engine tokens).
struct PromptMaker {
    rng: std::sync::Mutex<SmallRng>,
    next_id: std::sync::atomic::AtomicU64,
}

/// Template tokens of a one-message chat in the simulated engine.
const CHAT_TEMPLATE_TOKENS: u32 =
    tokenizer::CHAT_TOKENS_PER_PROMPT + tokenizer::CHAT_TOKENS_PER_MESSAGE;

impl PromptMaker {
    fn new(seed: u64) -> Self {
        Self {
            rng: std::sync::Mutex::new(SmallRng::seed_from_u64(seed)),
            next_id: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Text of exactly `tokens` simulated-engine tokens (at least the id's): a unique id,
    /// then English prose.
    fn text(&self, tokens: u32) -> String {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The id line ends in a newline, which merges with nothing after it.
        let mut out = format!("Request {id}:\n");
        let seed = match self.rng.lock() {
            Ok(mut g) => g.random(),
            Err(poisoned) => poisoned.into_inner().random(),
        };
        let rest = tokens.saturating_sub(tokenizer::count_text(&out));
        text::write(
            TextKind::English,
            rest,
            &mut SmallRng::seed_from_u64(seed),
            &mut out,
        );
        out
    }

    /// A streaming chat body whose prompt is `prompt_tokens` simulated-engine tokens.
    fn body(&self, model: &str, prompt_tokens: u32, output_tokens: u32) -> String {
        let content = self.text(prompt_tokens.saturating_sub(CHAT_TEMPLATE_TOKENS).max(8));
        serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": output_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string()
    }
}

async fn get_text(client: &HttpClient, url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    let response = tokio::time::timeout(Duration::from_secs(10), client.get(uri))
        .await
        .ok()?
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    let bytes = Limited::new(response.into_body(), 4 << 20)
        .collect()
        .await
        .ok()?
        .to_bytes();
    String::from_utf8(bytes.to_vec()).ok()
}

async fn get_json(client: &HttpClient, url: &str) -> Option<serde_json::Value> {
    serde_json::from_str(&get_text(client, url).await?).ok()
}

async fn first_model(client: &HttpClient, base: &str) -> anyhow::Result<String> {
    let models = get_json(client, &format!("{base}/v1/models"))
        .await
        .with_context(|| {
            format!("calibrate: cannot read {base}/v1/models; is the server up? (or give --model)")
        })?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("calibrate: {base}/v1/models lists no model; give --model"))
}

fn as_u32(v: &serde_json::Value) -> Option<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok())
}

/// What the server says about its slots, context and KV cache: llama.cpp's `/props`, or
/// vLLM's `max_model_len` and `vllm:cache_config_info`.
async fn server_info(client: &HttpClient, base: &str) -> ServerInfo {
    let mut info = ServerInfo::default();
    if let Some(props) = get_json(client, &format!("{base}/props")).await {
        info.slots = as_u32(&props["total_slots"]);
        // llama.cpp reports the context of one slot here.
        info.max_model_len = as_u32(&props["default_generation_settings"]["n_ctx"]);
        if let (Some(slots), Some(ctx)) = (info.slots, info.max_model_len) {
            info.kv_capacity_tokens = slots.checked_mul(ctx);
        }
    }
    if info.max_model_len.is_none() {
        if let Some(models) = get_json(client, &format!("{base}/v1/models")).await {
            info.max_model_len = as_u32(&models["data"][0]["max_model_len"]);
        }
    }
    if info.kv_capacity_tokens.is_none() {
        if let Some(text) = get_text(client, &format!("{base}/metrics")).await {
            info.kv_capacity_tokens = vllm_kv_capacity(&text);
        }
    }
    info
}

/// `block_size × num_gpu_blocks` from vLLM's `vllm:cache_config_info` line.
fn vllm_kv_capacity(metrics: &str) -> Option<u32> {
    let line = metrics
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let label = |name: &str| -> Option<u32> {
        let start = line.find(&format!("{name}=\""))? + name.len() + 2;
        let len = line[start..].find('"')?;
        line[start..start + len].parse().ok()
    };
    label("block_size")?.checked_mul(label("num_gpu_blocks")?)
}

/// Least-squares line `y = a + b·x`; `None` with fewer than two distinct x.
fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let b = sxy / sxx;
    Some((my - b * mx, b))
}

/// The concurrency at which throughput stops growing: the lowest level within 10% of the
/// best req/s.
fn throughput_knee(levels: &[LevelResult]) -> Option<u32> {
    let best = levels.iter().map(|l| l.rps).fold(0.0, f64::max);
    levels
        .iter()
        .filter(|l| l.rps >= 0.9 * best)
        .map(|l| l.concurrency)
        .min()
}

/// A measured cached-token cost at or above this is no prefix cache at all.
const NO_PREFIX_CACHE: f64 = 0.9;

/// Context length assumed when the server does not say.
const DEFAULT_MAX_MODEL_LEN: u32 = 4096;

/// Fits an engine profile to a sweep (see the module docs for how each field is found).
pub fn fit(sweep: &Sweep, name: &str) -> anyhow::Result<EngineConfig> {
    let slots = sweep
        .server
        .slots
        .or_else(|| throughput_knee(&sweep.levels))
        .context("calibrate: the sweep has no level to find the batch size from")?
        .max(1);
    // Decode: the median inter-token gap at each level that fits in the batch.
    let mut decode: Vec<(f64, f64)> = sweep
        .levels
        .iter()
        .filter(|l| l.concurrency <= slots && l.itl_p50_ms > 0.0)
        .map(|l| (f64::from(l.concurrency), l.itl_p50_ms))
        .collect();
    decode.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (decode_base_ms, decode_per_seq_ms) = match fit_line(&decode) {
        Some((a, b)) if b >= 0.0 && a >= 0.0 => (a, b),
        // A falling or negative line is noise: a flat step at the mean gap is the honest fit.
        _ => {
            let mean = decode.iter().map(|p| p.1).sum::<f64>() / decode.len().max(1) as f64;
            (mean, 0.0)
        }
    };
    // Prefill: TTFT at concurrency 1 grows with the prompt by the prefill cost.
    let prefill: Vec<(f64, f64)> = sweep
        .prefill
        .iter()
        .map(|p| (f64::from(p.prompt_tokens), p.ttft_p50_ms))
        .collect();
    let (prefill_at_zero_ms, prefill_us_per_token) = fit_line(&prefill)
        .map(|(at_zero, slope_ms)| (at_zero, (slope_ms * 1000.0).max(0.0)))
        .unwrap_or((0.0, 0.0));
    // The step cost of each batch size up to the largest level measured: the gaps measured,
    // straight lines between them (a CPU engine's cost is not one line over all batches).
    let last_measured = decode.last().map_or(0, |p| p.0 as u32);
    let decode_ms_by_batch: Vec<f64> = (1..=last_measured)
        .map(|b| round_to(interpolate(&decode, f64::from(b)), 2))
        .collect();
    // TTFT alone is what any prompt costs, its tokens, and one decode step. The slope comes
    // from the prefill series; the level from the sweep's own TTFT at concurrency 1 when
    // there is one (its prompt length is the one the sweep runs, and a CPU's cost per
    // prompt token is not one line from 16 to 512 tokens), else from the series' line.
    let one_step_ms = decode_ms_by_batch
        .first()
        .copied()
        .unwrap_or(decode_base_ms + decode_per_seq_ms);
    let alone_ms = sweep
        .levels
        .iter()
        .find(|l| l.concurrency == 1 && l.ttft_p50_ms > 0.0)
        .map_or(
            prefill_at_zero_ms + prefill_us_per_token * f64::from(sweep.prompt_tokens) / 1000.0,
            |l| l.ttft_p50_ms,
        );
    // With the first token a step after the prefill, TTFT alone holds two steps.
    let first_token_next_step = sweep
        .pair
        .as_ref()
        .is_some_and(PairProbe::first_token_waits_for_next_step);
    let steps_in_ttft = if first_token_next_step { 2.0 } else { 1.0 };
    let prefill_base_ms = (alone_ms
        - prefill_us_per_token * f64::from(sweep.prompt_tokens) / 1000.0
        - steps_in_ttft * one_step_ms)
        .max(0.0);
    // Prefix cache: how much of a repeated prompt's prefill the server skipped. Saving
    // less than a tenth of what skipping the cached tokens would save is no prefix cache.
    let cached_cost = sweep
        .warm
        .as_ref()
        .and_then(|w| w.cached_prefill_cost(prefill_us_per_token));
    let max_model_len = sweep.server.max_model_len.unwrap_or(DEFAULT_MAX_MODEL_LEN);
    let kv = sweep
        .server
        .kv_capacity_tokens
        .unwrap_or_else(|| slots.saturating_mul(max_model_len));
    let kv_capacity_tokens = (kv / KV_BLOCK_SIZE).max(1) * KV_BLOCK_SIZE;
    let mut config = EngineConfig::small();
    config.profile = name.to_string();
    config.model = sweep.model.clone();
    config.output_tokens_min = sweep.output_tokens;
    config.output_tokens_max = sweep.output_tokens;
    let g = &mut config.gpu;
    g.prefill_us_per_token = round_to(prefill_us_per_token, 1);
    g.decode_base_ms = round_to(decode_base_ms, 2);
    g.decode_per_seq_ms = round_to(decode_per_seq_ms, 2);
    g.decode_ms_by_batch = decode_ms_by_batch;
    g.prefill_base_ms = round_to(prefill_base_ms, 2);
    g.first_token_next_step = first_token_next_step;
    if let Some(cost) = cached_cost {
        g.prefix_caching = cost < NO_PREFIX_CACHE;
        g.cached_prefill_cost = round_to(cost, 2);
    }
    g.max_running_seqs = slots;
    g.kv_capacity_tokens = kv_capacity_tokens;
    g.max_model_len = max_model_len.min(kv_capacity_tokens);
    // A prompt is prefilled in the step that admits it, as llama.cpp does.
    g.max_batched_prefill_tokens = g.max_model_len;
    config.validate()?;
    Ok(config)
}

/// `y` at `x` on the broken line through `points` (sorted by x): flat before the first.
/// Only called with `x` up to the last point's.
fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
    let Some(&(x0, y0)) = points.first() else {
        return 0.0;
    };
    if x <= x0 {
        return y0;
    }
    for pair in points.windows(2) {
        let ((xa, ya), (xb, yb)) = (pair[0], pair[1]);
        if x <= xb {
            return ya + (yb - ya) * (x - xa) / (xb - xa);
        }
    }
    points.last().map_or(y0, |p| p.1)
}

/// `v` rounded to `decimals` places; dividing last keeps the result the closest double to
/// the decimal, so the profile reads `2118.2`, not `2118.2000000000003`.
fn round_to(v: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (v * scale).round() / scale
}

/// The profile as TOML, with a header saying where it came from and the command that
/// wrote it.
fn profile_toml(profile: &EngineConfig, sweep: &Sweep, command: &str) -> anyhow::Result<String> {
    let body = toml::to_string(profile).context("cannot encode the profile as TOML")?;
    Ok(format!(
        "# Engine profile fitted by `levee sim calibrate` against {} (model {}).\n\
         # Written by: {command}\n\
         # Load it with `levee engine --profile-file FILE`. Token counts are the simulated\n\
         # engine's (its own tokenizer), so the same request text takes the same time.\n\
         {body}",
        sweep.target, sweep.model
    ))
}

/// The sweep as a text table.
pub fn sweep_table(sweep: &Sweep) -> String {
    let mut out = format!(
        "calibrate {} (model {}, prompt {} tokens, output {} tokens)\n",
        sweep.target, sweep.model, sweep.prompt_tokens, sweep.output_tokens
    );
    let s = &sweep.server;
    out.push_str(&format!(
        "server says: slots {}, max_model_len {}, KV tokens {}\n",
        opt(s.slots),
        opt(s.max_model_len),
        opt(s.kv_capacity_tokens)
    ));
    if !sweep.prefill.is_empty() {
        out.push_str("prefill (concurrency 1):");
        for p in &sweep.prefill {
            out.push_str(&format!(
                "  {} tok → TTFT {:.1} ms",
                p.prompt_tokens, p.ttft_p50_ms
            ));
        }
        out.push('\n');
    }
    if let Some(w) = &sweep.warm {
        out.push_str(&format!(
            "repeated prompt ({} tok): TTFT {:.1} ms new, {:.1} ms again\n",
            w.prompt_tokens, w.cold_ttft_p50_ms, w.warm_ttft_p50_ms
        ));
    }
    if let Some(p) = &sweep.pair {
        out.push_str(&format!(
            "pair: TTFT alone {:.1} ms; first of two sent {:.0} ms apart {:.1} ms ({})\n",
            p.alone_ttft_p50_ms,
            p.stagger_ms,
            p.first_of_pair_ttft_p50_ms,
            if p.first_token_waits_for_next_step() {
                "waits for the second's prefill: first token a step after the prefill"
            } else {
                "unaffected: first token from its own prefill step"
            }
        ));
    }
    out.push_str(&format!(
        "{:>5} {:>6} {:>6} {:>8} {:>9} {:>10} {:>10} {:>9}\n",
        "conc", "ok", "failed", "req/s", "tok/s", "TTFT p50", "TTFT p90", "ITL p50"
    ));
    for l in &sweep.levels {
        out.push_str(&format!(
            "{:>5} {:>6} {:>6} {:>8.2} {:>9.1} {:>8.1}ms {:>8.1}ms {:>7.1}ms\n",
            l.concurrency,
            l.completed,
            l.failed,
            l.rps,
            l.tokens_per_s,
            l.ttft_p50_ms,
            l.ttft_p90_ms,
            l.itl_p50_ms
        ));
    }
    for l in sweep.levels.iter().filter(|l| !l.failures.is_empty()) {
        let how: Vec<String> = l
            .failures
            .iter()
            .map(|(k, n)| format!("{k} ×{n}"))
            .collect();
        out.push_str(&format!(
            "failed at concurrency {}: {}\n",
            l.concurrency,
            how.join(", ")
        ));
    }
    out
}

fn opt(v: Option<u32>) -> String {
    v.map_or_else(|| "?".into(), |v| v.to_string())
}

/// Two sweeps side by side, and whether they agree.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// The side-by-side table.
    pub table: String,
    /// True when every level of the reference was measured in the candidate and its req/s
    /// and p50 TTFT are within the tolerance.
    pub pass: bool,
}

/// Relative difference of `candidate` from `reference`.
fn rel_diff(reference: f64, candidate: f64) -> f64 {
    if reference == 0.0 {
        if candidate == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (candidate - reference).abs() / reference.abs()
    }
}

/// Compares a candidate sweep (say, the fitted simulated engine) with a reference (the
/// real server) level by level: req/s and p50 TTFT must each be within `tolerance`.
pub fn compare(reference: &Sweep, candidate: &Sweep, tolerance: f64) -> Verdict {
    let mut table = format!(
        "fidelity: reference {} vs candidate {} (tolerance {:.0}%)\n{:>5} {:>10} {:>10} {:>7} \
         {:>12} {:>12} {:>7} {:>6}\n",
        reference.target,
        candidate.target,
        tolerance * 100.0,
        "conc",
        "ref req/s",
        "cand req/s",
        "diff",
        "ref TTFT",
        "cand TTFT",
        "diff",
        "ok"
    );
    let mut pass = !reference.levels.is_empty();
    for r in &reference.levels {
        let Some(c) = candidate
            .levels
            .iter()
            .find(|c| c.concurrency == r.concurrency)
        else {
            table.push_str(&format!(
                "{:>5} not measured in the candidate\n",
                r.concurrency
            ));
            pass = false;
            continue;
        };
        let d_rps = rel_diff(r.rps, c.rps);
        let d_ttft = rel_diff(r.ttft_p50_ms, c.ttft_p50_ms);
        let ok = d_rps <= tolerance && d_ttft <= tolerance;
        pass &= ok;
        table.push_str(&format!(
            "{:>5} {:>10.2} {:>10.2} {:>6.0}% {:>10.1}ms {:>10.1}ms {:>6.0}% {:>6}\n",
            r.concurrency,
            r.rps,
            c.rps,
            d_rps * 100.0,
            r.ttft_p50_ms,
            c.ttft_p50_ms,
            d_ttft * 100.0,
            if ok { "yes" } else { "NO" }
        ));
    }
    table.push_str(if pass {
        "fidelity: PASS\n"
    } else {
        "fidelity: FAIL\n"
    });
    Verdict { table, pass }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(concurrency: u32, rps: f64, ttft: f64, itl: f64) -> LevelResult {
        LevelResult {
            concurrency,
            completed: 10,
            failed: 0,
            failures: Default::default(),
            rps,
            tokens_per_s: rps * 32.0,
            ttft_p50_ms: ttft,
            ttft_p90_ms: ttft,
            itl_p50_ms: itl,
        }
    }

    fn sweep(levels: Vec<LevelResult>, server: ServerInfo) -> Sweep {
        Sweep {
            target: "http://x".into(),
            model: "m".into(),
            prompt_tokens: 64,
            output_tokens: 32,
            server,
            levels,
            prefill: vec![
                PrefillPoint {
                    prompt_tokens: 100,
                    ttft_p50_ms: 20.0 + 100.0 * 0.3,
                },
                PrefillPoint {
                    prompt_tokens: 500,
                    ttft_p50_ms: 20.0 + 500.0 * 0.3,
                },
            ],
            pair: None,
            warm: None,
        }
    }

    #[test]
    fn fit_recovers_the_step_model_from_exact_measurements() {
        // ITL = 10 + 2·c ms up to 4 slots; beyond, the batch is full (ITL flat).
        // TTFT alone at the sweep's 64 prompt tokens: 8 ms for any prompt + 64 × 0.3 ms +
        // one 12 ms step.
        let levels = vec![
            level(1, 2.0, 39.2, 12.0),
            level(2, 3.5, 31.0, 14.0),
            level(4, 5.5, 33.0, 18.0),
            level(8, 5.6, 400.0, 18.0),
        ];
        let server = ServerInfo {
            slots: Some(4),
            max_model_len: Some(1000),
            kv_capacity_tokens: Some(4000),
        };
        let c = fit(&sweep(levels.clone(), server), "t").unwrap();
        assert_eq!(c.profile, "t");
        assert_eq!(c.model, "m");
        assert!((c.gpu.decode_base_ms - 10.0).abs() < 1e-6, "{:?}", c.gpu);
        assert!((c.gpu.decode_per_seq_ms - 2.0).abs() < 1e-6, "{:?}", c.gpu);
        assert!(
            (c.gpu.prefill_us_per_token - 300.0).abs() < 1e-6,
            "{:?}",
            c.gpu
        );
        assert_eq!(c.gpu.max_running_seqs, 4);
        // The measured step costs, the missing batch of 3 on the line between 2 and 4.
        assert_eq!(c.gpu.decode_ms_by_batch, vec![12.0, 14.0, 16.0, 18.0]);
        // What any prompt costs beyond its tokens.
        assert!((c.gpu.prefill_base_ms - 8.0).abs() < 1e-6, "{:?}", c.gpu);
        // KV rounded down to whole blocks; the context kept.
        assert_eq!(c.gpu.kv_capacity_tokens, 4000 / 16 * 16);
        assert_eq!(c.gpu.max_model_len, 1000);
        // The profile reads back through the engine's own loader.
        let text =
            profile_toml(&c, &sweep(levels.clone(), ServerInfo::default()), "levee x").unwrap();
        assert!(text.contains("# Written by: levee x\n"), "{text}");
        assert_eq!(EngineConfig::from_toml_str(&text).unwrap(), c);

        // Without /props the batch size is the throughput knee.
        let c = fit(&sweep(levels, ServerInfo::default()), "t").unwrap();
        assert_eq!(c.gpu.max_running_seqs, 4);
        assert_eq!(c.gpu.max_model_len, DEFAULT_MAX_MODEL_LEN);
    }

    #[test]
    fn a_repeated_prompt_gives_the_cost_of_a_cached_token() {
        // Prefill 300 µs a token (the sweep() helper's series). A 257-token prompt: the
        // simulated engine would find 256 of its tokens cached, saving 76.8 ms.
        let levels = vec![level(1, 2.0, 39.2, 12.0), level(2, 3.5, 31.0, 14.0)];
        let mut s = sweep(levels, ServerInfo::default());
        let warm = |cold, warm| WarmProbe {
            prompt_tokens: 257,
            cold_ttft_p50_ms: cold,
            warm_ttft_p50_ms: warm,
        };
        // Saved all of it: cached tokens are free.
        s.warm = Some(warm(100.0, 23.2));
        let g = fit(&s, "t").unwrap().gpu;
        assert!(g.prefix_caching);
        assert_eq!(g.cached_prefill_cost, 0.0);
        // Saved a quarter: a cached token still costs three quarters.
        s.warm = Some(warm(100.0, 80.8));
        let g = fit(&s, "t").unwrap().gpu;
        assert!(g.prefix_caching);
        assert_eq!(g.cached_prefill_cost, 0.75);
        // Saved nothing (or the repeat was slower): no prefix cache.
        s.warm = Some(warm(100.0, 104.0));
        let g = fit(&s, "t").unwrap().gpu;
        assert!(!g.prefix_caching);
        assert_eq!(g.cached_prefill_cost, 1.0);
        // Not measured: the engine's defaults.
        s.warm = None;
        let g = fit(&s, "t").unwrap().gpu;
        assert_eq!(
            (g.prefix_caching, g.cached_prefill_cost),
            (EngineConfig::small().gpu.prefix_caching, 0.0)
        );
        // A prompt of one block or less has nothing to find cached.
        assert_eq!(
            WarmProbe {
                prompt_tokens: 16,
                cold_ttft_p50_ms: 10.0,
                warm_ttft_p50_ms: 5.0
            }
            .cached_prefill_cost(300.0),
            None
        );
    }

    #[test]
    fn a_pair_whose_first_waits_for_the_second_sets_first_token_next_step() {
        // TTFT alone 51.2 ms = 64 × 0.3 ms + 20 ms per prompt and one 12 ms step, or 8 ms
        // per prompt and two steps.
        let levels = vec![level(1, 2.0, 51.2, 12.0), level(2, 3.5, 90.0, 14.0)];
        let server = ServerInfo {
            slots: Some(2),
            ..ServerInfo::default()
        };
        let mut s = sweep(levels, server);
        let probe = |first| PairProbe {
            alone_ttft_p50_ms: 51.2,
            stagger_ms: 12.8,
            first_of_pair_ttft_p50_ms: first,
        };
        // The first of the pair barely moved: its first token comes from its own step.
        s.pair = Some(probe(60.0));
        let c = fit(&s, "t").unwrap();
        assert!(!c.gpu.first_token_next_step);
        assert!((c.gpu.prefill_base_ms - 20.0).abs() < 1e-6, "{:?}", c.gpu);
        // It about doubled: the first token comes a step later, and TTFT alone holds that
        // second step, so the cost per prompt is one step less.
        s.pair = Some(probe(95.0));
        let c = fit(&s, "t").unwrap();
        assert!(c.gpu.first_token_next_step);
        assert!((c.gpu.prefill_base_ms - 8.0).abs() < 1e-6, "{:?}", c.gpu);
    }

    #[test]
    fn a_noisy_falling_decode_line_fits_a_flat_step() {
        let levels = vec![level(1, 2.0, 30.0, 15.0), level(2, 3.5, 31.0, 13.0)];
        let server = ServerInfo {
            slots: Some(2),
            ..ServerInfo::default()
        };
        let c = fit(&sweep(levels, server), "t").unwrap();
        assert_eq!(c.gpu.decode_per_seq_ms, 0.0);
        assert!((c.gpu.decode_base_ms - 14.0).abs() < 1e-6);
    }

    #[test]
    fn compare_fails_past_the_tolerance_and_on_missing_levels() {
        let real = sweep(
            vec![level(1, 2.0, 30.0, 12.0), level(4, 5.0, 100.0, 18.0)],
            ServerInfo::default(),
        );
        let close = sweep(
            vec![level(1, 2.2, 27.0, 12.0), level(4, 4.5, 115.0, 18.0)],
            ServerInfo::default(),
        );
        let v = compare(&real, &close, 0.2);
        assert!(v.pass, "{}", v.table);
        // TTFT 25% off at one level.
        let far = sweep(
            vec![level(1, 2.2, 27.0, 12.0), level(4, 4.5, 125.0, 18.0)],
            ServerInfo::default(),
        );
        let v = compare(&real, &far, 0.2);
        assert!(!v.pass && v.table.contains("NO"), "{}", v.table);
        // req/s 25% off.
        let slow = sweep(
            vec![level(1, 1.5, 30.0, 12.0), level(4, 5.0, 100.0, 18.0)],
            ServerInfo::default(),
        );
        assert!(!compare(&real, &slow, 0.2).pass);
        let missing = sweep(vec![level(1, 2.0, 30.0, 12.0)], ServerInfo::default());
        let v = compare(&real, &missing, 0.2);
        assert!(!v.pass && v.table.contains("not measured"), "{}", v.table);
    }

    #[test]
    fn prompts_are_unique_and_sized_in_engine_tokens() {
        let p = PromptMaker::new(1);
        let a: serde_json::Value = serde_json::from_str(&p.body("m", 64, 8)).unwrap();
        let b: serde_json::Value = serde_json::from_str(&p.body("m", 64, 8)).unwrap();
        let (ta, tb) = (
            a["messages"][0]["content"].as_str().unwrap(),
            b["messages"][0]["content"].as_str().unwrap(),
        );
        assert_ne!(ta, tb);
        assert_ne!(ta[..12], tb[..12], "the id comes first: no shared prefix");
        let tokens = levee_engine::TokenizerKind::Engine
            .render_chat(
                &[tokenizer::Message::from_json(&a["messages"][0])],
                None,
                true,
            )
            .len();
        assert_eq!(tokens, 64);
        assert_eq!(a["ignore_eos"], true);
        assert_eq!(a["max_tokens"], 8);
    }

    #[test]
    fn vllm_cache_config_gives_the_kv_capacity() {
        let text = "# TYPE vllm:cache_config_info gauge\n\
                    vllm:cache_config_info{block_size=\"16\",model_name=\"m\",num_gpu_blocks=\"100\"} 1\n";
        assert_eq!(vllm_kv_capacity(text), Some(1600));
        assert_eq!(vllm_kv_capacity("vllm:num_requests_running 0\n"), None);
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let mut v = vec![5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(quantile(&mut v, 0.5), 3.0);
        assert_eq!(quantile(&mut v, 0.9), 5.0);
        assert_eq!(quantile(&mut [], 0.5), 0.0);
    }
}
