//! levee-sim: floods a target with realistic LLM traffic and measures it correctly.

use std::path::PathBuf;

/// Command-line arguments of `levee sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Scenario file (TOML).
    pub scenario: PathBuf,
    /// Base URL of the target (gateway or engine).
    #[arg(long)]
    pub target: String,
    /// Directory for the JSON and HTML reports.
    #[arg(long, default_value = "levee-report")]
    pub out: PathBuf,
}

/// Runs `levee sim`.
pub async fn run_cli(_args: SimArgs) -> anyhow::Result<()> {
    anyhow::bail!("levee sim is not built yet")
}
