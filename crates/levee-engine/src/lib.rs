//! levee-engine: a simulated GPU inference server for tests and drills.
//!
//! An OpenAI-compatible server (`/v1/chat/completions`, `/v1/completions`, `/v1/models`)
//! whose timing and memory follow a model of continuous batching on a GPU with a KV cache
//! ([`gpu`]), with vLLM's metric names on `/metrics`, `/health`, and an admin API to inject
//! faults. See `docs/engine.md` for the contract.
//!
//! In-process use (tests, the drill):
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let mut config = levee_engine::EngineConfig::profile("tiny-fast")?;
//! config.time_scale = 10.0;
//! let engine = levee_engine::spawn(config, "127.0.0.1:0".parse()?).await?;
//! let url = format!("{}/v1/chat/completions", engine.base_url());
//! # let _ = url;
//! println!("running: {}", engine.stats().running);
//! engine.shutdown().await?;
//! # Ok(()) }
//! ```

pub mod config;
pub mod gpu;
mod kv;
mod metrics;
mod scheduler;
mod server;
pub mod tokenizer;
pub mod tokens;

pub use config::{EngineConfig, GpuParams, OverloadMode, KV_BLOCK_SIZE, PROFILE_NAMES};
pub use scheduler::{EngineState, EngineStats, Faults, FaultsUpdate};
pub use server::AdminState;
pub use tokenizer::TokenizerKind;
pub use tokens::{estimate_chat_prompt_tokens, estimate_prompt_tokens};

use anyhow::Context as _;
use scheduler::{Command, Shared};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long [`EngineHandle::shutdown`] waits for connections to close before cutting them.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running engine: its address, its state, and the way to stop it.
///
/// Dropping the handle stops the engine too (without waiting).
pub struct EngineHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop_server: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    scheduler: Option<JoinHandle<()>>,
    /// The `/metrics` gauges' refresher ([`EngineConfig::metrics_refresh_secs`]).
    refresher: JoinHandle<()>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("addr", &self.addr)
            .field("profile", &self.shared.config.profile)
            .finish_non_exhaustive()
    }
}

/// Starts an engine listening on `bind` (use `127.0.0.1:0` for an ephemeral port) with its
/// scheduler task; returns once it accepts connections.
pub async fn spawn(config: EngineConfig, bind: SocketAddr) -> anyhow::Result<EngineHandle> {
    config.validate()?;
    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .with_context(|| format!("levee engine: cannot listen on {bind}"))?;
    let addr = listener
        .local_addr()
        .context("levee engine: cannot read the bound address")?;
    let (shared, scheduler) = scheduler::start(config);
    let scheduler = tokio::spawn(scheduler);
    let refresher = tokio::spawn(scheduler::refresh_gauges(shared.clone()));
    let app = server::router(shared.clone());
    let (stop_server, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stopped.await;
        });
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "levee engine: the HTTP server failed");
        }
    });
    Ok(EngineHandle {
        addr,
        shared,
        stop_server: Some(stop_server),
        server: Some(server),
        scheduler: Some(scheduler),
        refresher,
    })
}

impl EngineHandle {
    /// The address the engine listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR` (without `/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// What the engine is doing now (published after every step and command).
    pub fn stats(&self) -> EngineStats {
        self.shared.stats_now()
    }

    /// Waits until the published stats satisfy `pred` and returns them; gives up with an
    /// error if the engine stops first. Use it instead of polling in tests.
    pub async fn wait_for(
        &self,
        mut pred: impl FnMut(&EngineStats) -> bool,
    ) -> anyhow::Result<EngineStats> {
        let mut rx: watch::Receiver<EngineStats> = self.shared.stats.clone();
        let stats = rx
            .wait_for(|s| pred(s) || s.state == EngineState::Stopped)
            .await
            .map_err(|_| anyhow::anyhow!("levee engine: stopped while waiting for a state"))?
            .clone()
            .at(self.shared.clock.now());
        anyhow::ensure!(
            pred(&stats),
            "levee engine: stopped while waiting for a state"
        );
        Ok(stats)
    }

    /// Simulated time since the engine started.
    pub fn sim_now(&self) -> Duration {
        self.shared.clock.now()
    }

    /// The same JSON `GET /admin/state` answers.
    pub fn admin_state(&self) -> AdminState {
        server::admin_state_of(&self.shared)
    }

    /// Crashes ordered from outside (`POST /admin/crash` or [`Self::crash_now`]) so far; the
    /// rest of [`EngineStats::crashes`] came from KV-cache overload.
    pub fn injected_crashes(&self) -> u64 {
        self.shared.injected_crashes.load(Ordering::Relaxed)
    }

    /// Inference requests answered 503 `engine_unavailable` because the engine was down
    /// after a crash: traffic a router sent to a dead backend.
    pub fn refused_while_down(&self) -> u64 {
        self.shared.metrics.failures("unavailable")
    }

    /// Of [`Self::refused_while_down`], those that arrived after the engine had already
    /// answered a refusal in the same down period: traffic a router sent to a backend that
    /// had told it it was down. (The engine orders refusals as it answers them; one the router
    /// sent while the first answer was on the wire counts too, so this errs against the
    /// router.)
    pub fn refused_after_first_failure(&self) -> u64 {
        self.shared.down_log.lock().after_first
    }

    /// Crashes the engine now, as `POST /admin/crash` does.
    pub fn crash_now(&self) {
        let _ = self.shared.commands.send(Command::Crash);
    }

    /// Changes the injected faults, as `POST /admin/faults` does.
    pub fn set_faults(&self, update: &FaultsUpdate) -> anyhow::Result<Faults> {
        self.shared.update_faults(update)
    }

    /// Clears every injected fault (latency, error rate, hang), as `POST /admin/clear` does.
    pub fn clear_faults(&self) -> anyhow::Result<Faults> {
        self.shared.update_faults(&FaultsUpdate {
            added_latency_ms: Some(0.0),
            error_rate: Some(0.0),
            hang: Some(false),
        })
    }

    /// Stops the engine: in-flight requests fail, connections close, tasks end.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.refresher.abort();
        let _ = self.shared.commands.send(Command::Shutdown);
        if let Some(stop) = self.stop_server.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.scheduler.take() {
            task.await
                .context("levee engine: the scheduler task panicked")?;
        }
        if let Some(mut task) = self.server.take() {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
            {
                // Connections that outlive the grace period (say, a hung client) are cut.
                task.abort();
            }
        }
        Ok(())
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.refresher.abort();
        let _ = self.shared.commands.send(Command::Shutdown);
        if let Some(stop) = self.stop_server.take() {
            let _ = stop.send(());
        }
    }
}

/// Command-line arguments of `levee engine`. Every GPU flag overrides the profile's value.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Profile: small, a100-7b, tiny-fast, zero.
    #[arg(long, default_value = "small", conflicts_with = "config")]
    pub profile: String,
    /// A TOML file holding an `EngineConfig` (instead of a named profile), such as one
    /// written by `levee sim calibrate`; flags still override it.
    #[arg(long, visible_alias = "profile-file")]
    pub config: Option<std::path::PathBuf>,
    /// Served model name (default: the profile's).
    #[arg(long)]
    pub model: Option<String>,
    /// Simulated seconds per real second.
    #[arg(long)]
    pub time_scale: Option<f64>,
    /// How prompt tokens are counted: the engine's own tokenizer, or levee's fallback
    /// rule exactly (for tests).
    #[arg(long, value_enum)]
    pub tokenizer: Option<TokenizerKind>,
    /// Simulated seconds between refreshes of the `/metrics` gauges (0 = live).
    #[arg(long)]
    pub metrics_refresh_secs: Option<f64>,
    /// What happens when KV demand passes capacity.
    #[arg(long, value_enum)]
    pub overload: Option<OverloadMode>,
    /// Simulated seconds a crashed engine stays down.
    #[arg(long)]
    pub restart_secs: Option<f64>,
    /// KV-cache capacity in tokens.
    #[arg(long)]
    pub kv_capacity_tokens: Option<u32>,
    /// Most sequences in the running batch.
    #[arg(long)]
    pub max_running_seqs: Option<u32>,
    /// Most prompt tokens prefilled per step.
    #[arg(long)]
    pub max_batched_prefill_tokens: Option<u32>,
    /// Longest prompt + completion accepted.
    #[arg(long)]
    pub max_model_len: Option<u32>,
    /// Prefill cost per prompt token, simulated microseconds.
    #[arg(long)]
    pub prefill_us_per_token: Option<f64>,
    /// Fixed decode-step cost, simulated milliseconds.
    #[arg(long)]
    pub decode_base_ms: Option<f64>,
    /// Decode-step cost per running sequence, simulated milliseconds.
    #[arg(long)]
    pub decode_per_seq_ms: Option<f64>,
    /// Shortest natural completion, tokens.
    #[arg(long)]
    pub output_tokens_min: Option<u32>,
    /// Longest natural completion, tokens.
    #[arg(long)]
    pub output_tokens_max: Option<u32>,
}

impl EngineArgs {
    /// The configuration these arguments describe: the profile, then each flag given.
    pub fn to_config(&self) -> anyhow::Result<EngineConfig> {
        let mut c = match &self.config {
            Some(path) => EngineConfig::from_toml_file(path)?,
            None => EngineConfig::profile(&self.profile)?,
        };
        let g = &mut c.gpu;
        macro_rules! set {
            ($($dst:expr => $src:expr),* $(,)?) => {$(if let Some(v) = $src.clone() { $dst = v; })*};
        }
        set! {
            c.model => self.model,
            c.time_scale => self.time_scale,
            c.tokenizer => self.tokenizer,
            c.metrics_refresh_secs => self.metrics_refresh_secs,
            c.output_tokens_min => self.output_tokens_min,
            c.output_tokens_max => self.output_tokens_max,
            g.overload => self.overload,
            g.restart_secs => self.restart_secs,
            g.kv_capacity_tokens => self.kv_capacity_tokens,
            g.max_running_seqs => self.max_running_seqs,
            g.max_batched_prefill_tokens => self.max_batched_prefill_tokens,
            g.max_model_len => self.max_model_len,
            g.prefill_us_per_token => self.prefill_us_per_token,
            g.decode_base_ms => self.decode_base_ms,
            g.decode_per_seq_ms => self.decode_per_seq_ms,
        }
        c.validate()?;
        Ok(c)
    }
}

/// Runs `levee engine` until interrupted (Ctrl-C).
pub async fn run_cli(args: EngineArgs) -> anyhow::Result<()> {
    let config = args.to_config()?;
    let bind = SocketAddr::new(args.host, args.port);
    let summary = format!(
        "profile {} model {} overload {:?} kv {} tokens max_seqs {} time_scale {}",
        config.profile,
        config.model,
        config.gpu.overload,
        config.gpu.kv_capacity_tokens,
        config.gpu.max_running_seqs,
        config.time_scale
    );
    let engine = spawn(config, bind).await?;
    tracing::info!(
        "levee engine listening on {} ({summary})",
        engine.base_url()
    );
    tokio::signal::ctrl_c()
        .await
        .context("levee engine: cannot wait for Ctrl-C")?;
    tracing::info!("levee engine: shutting down");
    engine.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn args(line: &[&str]) -> anyhow::Result<EngineConfig> {
        let cli = Cli::try_parse_from(std::iter::once("engine").chain(line.iter().copied()))?;
        cli.engine.to_config()
    }

    #[test]
    fn flags_override_the_profile() {
        let c = args(&[]).unwrap();
        assert_eq!(c, EngineConfig::small());
        assert_eq!(c.tokenizer, TokenizerKind::Engine);
        let c = args(&[
            "--tokenizer",
            "levee-rule",
            "--metrics-refresh-secs",
            "0",
            "--profile",
            "a100-7b",
            "--overload",
            "crash",
            "--restart-secs",
            "12",
            "--time-scale",
            "10",
            "--max-running-seqs",
            "32",
            "--decode-per-seq-ms",
            "0.25",
            "--model",
            "m",
        ])
        .unwrap();
        assert_eq!(c.profile, "a100-7b");
        assert_eq!(c.tokenizer, TokenizerKind::LeveeRule);
        assert_eq!(c.metrics_refresh_secs, 0.0);
        assert_eq!(c.gpu.overload, OverloadMode::Crash);
        assert_eq!(c.gpu.restart_secs, 12.0);
        assert_eq!(c.time_scale, 10.0);
        assert_eq!(c.gpu.max_running_seqs, 32);
        assert_eq!(c.gpu.decode_per_seq_ms, 0.25);
        assert_eq!(c.model, "m");
        assert_eq!(
            c.gpu.kv_capacity_tokens,
            EngineConfig::a100_7b().gpu.kv_capacity_tokens
        );
    }

    #[test]
    fn bad_flags_say_what_is_wrong() {
        let err = args(&["--profile", "h100"]).unwrap_err().to_string();
        assert!(err.contains("unknown engine profile"), "{err}");
        let err = args(&["--max-model-len", "999999"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_model_len"), "{err}");
        assert!(args(&["--overload", "explode"]).is_err());
    }
}
