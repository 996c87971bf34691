//! What a contender's run needs besides the scenario: the fleet to start, the gateway's
//! configuration, the run's options and the capped baselines' limits.

use crate::passthrough::Cap;
use anyhow::Context;
use levee_engine::EngineConfig;
use levee_sim::RunOptions;
use std::path::PathBuf;

/// Everything a run needs besides the scenario.
pub(crate) struct Setup<'a> {
    pub engines: usize,
    /// External servers (`--backend`); empty for simulated engines.
    pub backends: Vec<String>,
    pub engine: EngineConfig,
    pub gateway_text: &'a str,
    /// The `--compare-config` configuration, for the compared levee.
    pub compare_text: Option<&'a str>,
    pub opts: RunOptions,
    /// The capped baselines' limits (set once the capacity is measured).
    pub cap: Option<Cap>,
    /// Where HAProxy's generated configuration is written.
    pub out: PathBuf,
    /// levee replicas sharing Redis behind a round-robin front (1: one gateway, no Redis).
    pub replicas: usize,
    pub redis_url: String,
}

impl Setup<'_> {
    pub(crate) fn cap(&self) -> anyhow::Result<Cap> {
        self.cap
            .context("the capped baselines run after the capacity measurement sets their cap")
    }
}
