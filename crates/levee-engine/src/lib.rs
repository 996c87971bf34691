//! levee-engine: a simulated GPU inference server for tests and drills.

/// Command-line arguments of `levee engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Port to listen on (127.0.0.1).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
}

/// Runs `levee engine` until interrupted.
pub async fn run_cli(_args: EngineArgs) -> anyhow::Result<()> {
    anyhow::bail!("levee engine is not built yet")
}
