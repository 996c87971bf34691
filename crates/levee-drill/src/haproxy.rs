//! HAProxy as a contender, when `haproxy` is on the PATH: what an operator who knows their
//! load balancer configures without levee. `leastconn`, `maxconn` per server = the operator
//! formula's cap, the backend's FIFO queue with `timeout queue` = the same wait budget as
//! the capped pass-through, active health checks (`GET /health` every 500 ms, down after 3
//! failures, up after 2 successes), one retry that may go to another server
//! (`retries 1`, `option redispatch`). It listens on 127.0.0.1 only, on an ephemeral port,
//! and is stopped (killed, by its process id) at the end of each run. Its global `maxconn`
//! (8,000 client connections) needs about 16,000 file descriptors, within a default hard
//! limit of 20,000.

use crate::passthrough::Cap;
use anyhow::Context;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// Whether `haproxy` can be run.
pub(crate) fn available() -> bool {
    std::process::Command::new("haproxy")
        .arg("-v")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// HAProxy's configuration: listening on `127.0.0.1:port`, balancing over `backends`
/// (`http://host:port` base URLs) with the limits of `cap`.
pub(crate) fn config(port: u16, backends: &[String], cap: &Cap) -> anyhow::Result<String> {
    let mut servers = String::new();
    for (i, url) in backends.iter().enumerate() {
        let authority = url
            .strip_prefix("http://")
            .map(|a| a.trim_end_matches('/'))
            .filter(|a| !a.is_empty() && !a.contains('/'))
            .with_context(|| format!("HAProxy needs http://host:port backends, not {url:?}"))?;
        servers.push_str(&format!("    server engine{i} {authority}\n"));
    }
    Ok(format!(
        "# Written by levee drill: HAProxy as an operator would configure it without levee.\n\
         global\n    maxconn 8000\n\n\
         defaults\n    mode http\n    timeout connect 2s\n    timeout client 300s\n    \
         timeout server 300s\n    timeout http-request 10s\n    \
         timeout queue {queue_ms}ms\n    retries 1\n    option redispatch\n\n\
         frontend drill\n    bind 127.0.0.1:{port}\n    default_backend engines\n\n\
         backend engines\n    balance leastconn\n    option httpchk GET /health\n    \
         default-server check inter 500ms fall 3 rise 2 maxconn {maxconn}\n{servers}",
        queue_ms = cap.queue_timeout.as_millis(),
        maxconn = cap.per_backend,
    ))
}

/// A running HAProxy.
pub(crate) struct Haproxy {
    child: tokio::process::Child,
    port: u16,
}

impl Haproxy {
    /// Writes the configuration to `config_path` and starts HAProxy in the foreground; returns
    /// once it answers `GET /health` through a healthy server (within 20 s).
    pub(crate) async fn start(
        backends: &[String],
        cap: &Cap,
        config_path: &Path,
    ) -> anyhow::Result<Self> {
        // An ephemeral loopback port, freed just before HAProxy binds it.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        std::fs::write(config_path, config(port, backends, cap)?)
            .with_context(|| format!("cannot write {}", config_path.display()))?;
        let child = tokio::process::Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start haproxy")?;
        let mut h = Self { child, port };
        if let Err(e) = h.wait_healthy().await {
            h.stop().await;
            return Err(e);
        }
        Ok(h)
    }

    async fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!("haproxy exited at start ({status}); is its configuration valid?");
            }
            let answer = client
                .get(format!("{}/health", self.base_url()))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if answer.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "haproxy did not answer GET /health through a healthy server within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub(crate) fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Kills HAProxy (its own process, by id) and reaps it.
    pub(crate) async fn stop(mut self) {
        if let Err(e) = self.child.kill().await {
            tracing::warn!("stopping haproxy: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_caps_each_server_queues_with_the_wait_budget_and_binds_loopback() {
        let cap = Cap {
            per_backend: 12,
            queue_len: 24,
            queue_timeout: Duration::from_millis(1500),
            fail_after: 3,
            skip_for: Duration::from_secs(5),
        };
        let urls = [
            "http://127.0.0.1:8001".to_string(),
            "http://127.0.0.1:8002/".into(),
        ];
        let c = config(40000, &urls, &cap).unwrap();
        for line in [
            "bind 127.0.0.1:40000",
            "balance leastconn",
            "maxconn 12",
            "timeout queue 1500ms",
            "option redispatch",
            "option httpchk GET /health",
            "server engine0 127.0.0.1:8001",
            "server engine1 127.0.0.1:8002",
        ] {
            assert!(c.contains(line), "{line} missing from\n{c}");
        }
        assert!(config(1, &["https://x/y".to_string()], &cap).is_err());
    }
}
