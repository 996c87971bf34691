//! `levee drain`: what a Kubernetes preStop hook runs. It asks a gateway to drain and waits
//! until the gateway has nothing left to do, or the timeout passes. The gateway's drain has
//! two steps (see `server.drain_grace_ms`): first it stops advertising (`/readyz` answers
//! 503) while it still serves new requests normally, so that endpoints drop it without a
//! client seeing an error; then new requests get 503 + Retry-After while the queued and
//! in-flight ones run to completion. This command returns once the second step has begun
//! and nothing is queued or in flight. The admin token, if any, comes from
//! `LEVEE_ADMIN_TOKEN`.

use anyhow::Context;
use std::time::{Duration, Instant};

/// Arguments of `levee drain`.
#[derive(Debug, Clone, clap::Args)]
pub struct DrainArgs {
    /// The gateway's admin URL.
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    pub admin: String,
    /// Longest the whole drain may take, the gateway's `drain_grace_ms` included, in
    /// seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout_secs: u64,
}

fn with_token(req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    match std::env::var(levee_gateway::config::ADMIN_TOKEN_ENV) {
        Ok(t) if !t.is_empty() => req.bearer_auth(t),
        _ => req,
    }
}

/// What `/admin/state` says about the drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Progress {
    draining: bool,
    queued: i64,
    in_flight: i64,
}

impl Progress {
    fn of(state: &serde_json::Value) -> Progress {
        Progress {
            draining: state["draining"].as_bool().unwrap_or(false),
            queued: state["queued"].as_i64().unwrap_or(0),
            in_flight: state["in_flight"].as_i64().unwrap_or(0),
        }
    }

    /// New requests are refused and nothing is left to finish.
    fn done(self) -> bool {
        self.draining && self.queued <= 0 && self.in_flight <= 0
    }
}

/// Drains the gateway at `args.admin` and waits until it is idle.
pub async fn run_cli(args: DrainArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.timeout_secs);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let base = args.admin.trim_end_matches('/');
    let resp = with_token(client.post(format!("{base}/admin/drain")))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .with_context(|| format!("cannot reach the admin listener at {base}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        anyhow::bail!("{base}/admin/drain answered {status}: {body}");
    }
    let answer: serde_json::Value = resp.json().await.context("reading /admin/drain")?;
    let grace_ms = answer["grace_ms"].as_u64().unwrap_or(0);
    eprintln!(
        "levee drain: /readyz answers 503; serving for {grace_ms} ms while endpoints drop \
         this replica, then refusing new requests"
    );
    if Duration::from_millis(grace_ms) >= Duration::from_secs(args.timeout_secs) {
        eprintln!(
            "levee drain: warning: the grace ({grace_ms} ms) is not shorter than --timeout-secs {}",
            args.timeout_secs
        );
    }
    loop {
        let state: serde_json::Value = with_token(client.get(format!("{base}/admin/state")))
            .send()
            .await
            .with_context(|| format!("cannot read {base}/admin/state"))?
            .json()
            .await
            .context("reading /admin/state")?;
        let p = Progress::of(&state);
        if p.done() {
            eprintln!(
                "levee drain: drained in {:.1} s, nothing queued or in flight",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "after {} s: {} queued and {} in flight{}",
                args.timeout_secs,
                p.queued,
                p.in_flight,
                if p.draining {
                    ""
                } else {
                    " (still in its grace: raise --timeout-secs above server.drain_grace_ms)"
                }
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_only_once_refusing_and_idle() {
        let p = |draining, queued, in_flight| {
            Progress::of(&serde_json::json!({
                "draining": draining, "queued": queued, "in_flight": in_flight
            }))
        };
        assert!(!p(false, 0, 0).done(), "still in its grace");
        assert!(!p(true, 1, 0).done(), "a queued request runs to completion");
        assert!(!p(true, 0, 2).done());
        assert!(p(true, 0, 0).done());
        assert!(!Progress::of(&serde_json::json!({})).done());
    }
}
