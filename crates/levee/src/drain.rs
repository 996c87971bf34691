//! `levee drain`: what a Kubernetes preStop hook runs. It asks a gateway to drain (its
//! `/readyz` turns 503 so the Service stops sending it traffic; queued requests are answered
//! 503 with Retry-After) and waits until its in-flight requests have finished, or the
//! timeout passes. The admin token, if any, comes from `LEVEE_ADMIN_TOKEN`.

use anyhow::Context;
use std::time::{Duration, Instant};

/// Arguments of `levee drain`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrainArgs {
    /// The gateway's admin URL.
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub admin: String,
    /// Longest wait for in-flight requests, in seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
}

fn with_token(req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    match std::env::var(levee_gateway::config::ADMIN_TOKEN_ENV) {
        Ok(t) if !t.is_empty() => req.bearer_auth(t),
        _ => req,
    }
}

/// Drains the gateway at `args.admin` and waits for its in-flight requests.
pub async fn run_cli(args: DrainArgs) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let base = args.admin.trim_end_matches('/');
    let resp = with_token(client.post(format!("{base}/admin/drain")))
        .send()
        .await
        .with_context(|| format!("cannot reach the admin listener at {base}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        anyhow::bail!("{base}/admin/drain answered {status}: {body}");
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    loop {
        let state: serde_json::Value = with_token(client.get(format!("{base}/admin/state")))
            .send()
            .await
            .with_context(|| format!("cannot read {base}/admin/state"))?
            .json()
            .await
            .context("reading /admin/state")?;
        let in_flight = state["in_flight"].as_i64().unwrap_or(0);
        if in_flight <= 0 {
            eprintln!("levee drain: drained, nothing in flight");
            return Ok(());
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "{in_flight} requests still in flight after {} s",
                args.timeout_secs
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
