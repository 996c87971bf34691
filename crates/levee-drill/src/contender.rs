//! The contenders and one run of a scenario through one of them.

use crate::fleet::{Fleet, FleetStats};
use crate::operator::gateway_config;
use crate::passthrough::{Cap, Passthrough};
use anyhow::Context;
use levee_engine::EngineConfig;
use levee_sim::report::{Marker, Report};
use levee_sim::{RunOptions, Scenario};
use std::time::Duration;

/// The three contenders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contender {
    Unprotected,
    Capped,
    Levee,
}

impl Contender {
    pub(crate) const ALL: [Contender; 3] =
        [Contender::Unprotected, Contender::Capped, Contender::Levee];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Contender::Unprotected => "unprotected",
            Contender::Capped => "capped",
            Contender::Levee => "levee",
        }
    }

    pub(crate) fn what(self) -> &'static str {
        match self {
            Contender::Unprotected => "plain round-robin pass-through",
            Contender::Capped => "capped pass-through (max_conns per engine + FIFO queue)",
            Contender::Levee => "levee",
        }
    }
}

/// One run's outcome.
pub(crate) struct Outcome {
    pub report: Report,
    pub fleet: FleetStats,
    pub crash_markers: Vec<Marker>,
}

/// Everything a run needs besides the scenario.
pub(crate) struct Setup<'a> {
    pub engines: usize,
    /// External servers (`--backend`); empty for simulated engines.
    pub backends: Vec<String>,
    pub engine: EngineConfig,
    pub gateway_text: &'a str,
    pub opts: RunOptions,
}

/// Runs `scenario` through `who` on a fresh fleet.
pub(crate) async fn run_contender(
    who: Contender,
    scenario: &Scenario,
    setup: &Setup<'_>,
) -> anyhow::Result<Outcome> {
    let fleet = Fleet::start(setup).await?;
    let result = match who {
        Contender::Unprotected | Contender::Capped => {
            let proxy = if who == Contender::Capped {
                Passthrough::start_capped(fleet.urls(), capped_limits(&setup.engine, setup.engines))
                    .await?
            } else {
                Passthrough::start(fleet.urls()).await?
            };
            let target = fleet.target(proxy.base_url());
            let r = fleet.run(scenario, &target, &setup.opts).await;
            proxy.shutdown().await;
            r
        }
        Contender::Levee => {
            let cfg = gateway_config(setup.gateway_text, scenario, &fleet.urls())?;
            let gw = levee_gateway::start(cfg)
                .await
                .context("starting the drill's gateway")?;
            let mut target = fleet.target(gw.public_url());
            target
                .metrics
                .push(("gateway".into(), format!("{}/metrics", gw.admin_url())));
            let r = fleet.run(scenario, &target, &setup.opts).await;
            gw.shutdown().await;
            r
        }
    };
    let stats = fleet.stop().await;
    let (report, crash_markers) = result?;
    Ok(Outcome {
        report,
        fleet: stats,
        crash_markers,
    })
}

/// levee's configuration for a run: the given TOML with its listeners on ephemeral loopback
/// ports and the scenario model's backends pointed at the drill's engines in order (a
/// missing backend entry copies the first). A scenario tenant whose key the configuration
/// /// The capped baseline's queue: as long as the fleet's slots, and a wait as long as
/// levee's longest tier wait in the shipped configuration.
fn capped_limits(engine: &EngineConfig, engines: usize) -> Cap {
    Cap {
        per_backend: engine.gpu.max_running_seqs,
        queue_len: engine.gpu.max_running_seqs as usize * engines,
        queue_timeout: Duration::from_millis(1500),
    }
}
