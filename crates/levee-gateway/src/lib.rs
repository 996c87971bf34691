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
mod reassemble;
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
    /// Serve the public listener on this many single-threaded event loops, a thread each,
    /// instead of tokio's work-stealing runtime (0, the default). Less CPU per request, but a
    /// loop the kernel puts off holds up every connection it has: only for a gateway with
    /// cores of its own.
    #[arg(long, env = "LEVEE_EVENT_LOOPS", default_value_t = 0)]
    pub event_loops: usize,
}

/// Validates a configuration file; `Err` holds one human-readable line per problem, each
/// naming the path of the offending field.
pub fn check_config_file(path: &std::path::Path) -> Result<String, Vec<String>> {
    Config::load(path).map(|c| c.summary())
}
