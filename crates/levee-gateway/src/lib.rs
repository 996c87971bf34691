//! levee-gateway: the HTTP server that applies levee's admission pipeline.
//!
//! In-process use (tests, the drill):
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let mut cfg = levee_gateway::Config::default();
//! cfg.listen.public = "127.0.0.1:0".parse()?;
//! cfg.listen.admin = "127.0.0.1:0".parse()?;
//! // ... tenants, models ...
//! let gw = levee_gateway::start(cfg).await?;
//! println!("gateway at {}", gw.public_url());
//! gw.shutdown().await;
//! # Ok(()) }
//! ```

mod admin;
mod autoscale;
mod client_request;
pub mod clock;
pub mod config;
pub mod conn;
mod conn_pool;
mod degrade;
pub mod egress;
pub mod error;
pub mod fuzzing;
mod gateway;
mod lane;
mod lite;
pub mod metrics;
#[cfg(feature = "otel")]
pub mod otel;
mod pipeline;
mod proxy;
mod queue_updates;
pub mod reload;
mod request_log;
mod response_cache;
mod routes;
mod runtime;
mod server;
mod session;
pub mod shared;
pub mod task_store;
pub mod task_store_redis;
mod tasks;
mod tokenize;
mod upkeep;
pub mod upstream;

pub use config::{hash_key, Config};
pub use error::{ErrorCode, GatewayError, Origin};
pub use gateway::Gateway;
pub use server::{serve_cli, start, GatewayHandle};

use std::path::PathBuf;

/// Command-line arguments of `levee serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Configuration file (TOML).
    #[arg(long, default_value = "levee.toml")]
    pub config: PathBuf,
    /// Threads serving the public listener, each running its own single-threaded event loop
    /// over its own connections (0: one per core). The admin listener and the gateway's
    /// periodic work run on the first.
    #[arg(long, env = "LEVEE_WORKERS", default_value_t = 0)]
    pub workers: usize,
}

/// Validates a configuration file; `Err` holds one human-readable line per problem, each
/// naming the path of the offending field.
pub fn check_config_file(path: &std::path::Path) -> Result<String, Vec<String>> {
    Config::load(path).map(|c| c.summary())
}
