//! The contenders and one run of a scenario through one of them.

use crate::fleet::{Fleet, FleetStats};
use crate::haproxy::Haproxy;
use crate::operator::gateway_config;
use crate::passthrough::Passthrough;
pub(crate) use crate::setup::Setup;
use anyhow::Context;
use levee_sim::report::{Marker, Report};
use levee_sim::Scenario;

/// The contenders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contender {
    Unprotected,
    Capped,
    Haproxy,
    Levee,
    /// levee with the `--compare-config` configuration.
    LeveeCompare,
}

impl Contender {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Contender::Unprotected => "unprotected",
            Contender::Capped => "capped",
            Contender::Haproxy => "haproxy",
            Contender::Levee => "levee",
            Contender::LeveeCompare => "levee-compare",
        }
    }

    pub(crate) fn what(self) -> &'static str {
        match self {
            Contender::Unprotected => "plain round-robin pass-through",
            Contender::Capped => {
                "capped pass-through (operator-formula cap per engine, FIFO queue with a wait \
                 budget, passive health, one retry)"
            }
            Contender::Haproxy => {
                "HAProxy (leastconn, maxconn = the same cap, queue with the same wait budget, \
                 health checks, redispatch)"
            }
            Contender::Levee => "levee",
            Contender::LeveeCompare => "levee with the --compare-config configuration",
        }
    }
}

/// One run's outcome.
pub(crate) struct Outcome {
    pub report: Report,
    pub fleet: FleetStats,
    pub crash_markers: Vec<Marker>,
}

/// Runs `scenario` through `who` on a fresh fleet.
pub(crate) async fn run_contender(
    who: Contender,
    scenario: &Scenario,
    setup: &Setup<'_>,
) -> anyhow::Result<Outcome> {
    let fleet = Fleet::start(setup).await?;
    let result = run_on(who, scenario, setup, &fleet).await;
    let stats = fleet.stop().await;
    let (report, crash_markers) = result?;
    Ok(Outcome {
        report,
        fleet: stats,
        crash_markers,
    })
}

async fn run_on(
    who: Contender,
    scenario: &Scenario,
    setup: &Setup<'_>,
    fleet: &Fleet,
) -> anyhow::Result<(Report, Vec<Marker>)> {
    match who {
        Contender::Unprotected | Contender::Capped => {
            let proxy = if who == Contender::Capped {
                Passthrough::start_capped(fleet.urls(), setup.cap()?).await?
            } else {
                Passthrough::start(fleet.urls()).await?
            };
            let target = fleet.target(proxy.base_url());
            let r = fleet.run(scenario, &target, &setup.opts).await;
            proxy.shutdown().await;
            r
        }
        Contender::Haproxy => {
            let path = setup.out.join("haproxy.cfg");
            let h = Haproxy::start(&fleet.urls(), &setup.cap()?, &path).await?;
            let r = fleet
                .run(scenario, &fleet.target(h.base_url()), &setup.opts)
                .await;
            h.stop().await;
            r
        }
        Contender::Levee | Contender::LeveeCompare => {
            let text = match (who, setup.compare_text) {
                (Contender::LeveeCompare, Some(text)) => text,
                (Contender::LeveeCompare, None) => {
                    anyhow::bail!("the compared levee runs only with --compare-config")
                }
                _ => setup.gateway_text,
            };
            let gws = Gateways::start(scenario, setup, text, &fleet.urls()).await?;
            let mut target = fleet.target(gws.base_url());
            target.metrics.extend(gws.metrics());
            let r = fleet.run(scenario, &target, &setup.opts).await;
            gws.stop().await;
            r
        }
    }
}

/// levee as one gateway, or as replicas sharing Redis behind a round-robin front.
pub(crate) struct Gateways {
    replicas: Vec<levee_gateway::GatewayHandle>,
    front: Option<Passthrough>,
    /// The Redis URL and key prefix to clean up after replicas.
    shared: Option<(String, String)>,
}

impl Gateways {
    pub(crate) async fn start(
        scenario: &Scenario,
        setup: &Setup<'_>,
        gateway_text: &str,
        urls: &[String],
    ) -> anyhow::Result<Self> {
        let mut cfg = gateway_config(gateway_text, scenario, urls)?;
        let shared = (setup.replicas > 1).then(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let prefix = format!("levee-drill-{}-{nanos}:", std::process::id());
            (setup.redis_url.clone(), prefix)
        });
        let mut gws = Self {
            replicas: Vec::new(),
            front: None,
            shared: shared.clone(),
        };
        for i in 0..setup.replicas.max(1) {
            if let Some((url, prefix)) = &shared {
                cfg.state.backend = levee_gateway::config::StateBackend::Redis;
                cfg.state.url = url.clone();
                cfg.state.key_prefix = prefix.clone();
                cfg.state.replica_id = format!("drill-{i}");
            }
            match levee_gateway::start(cfg.clone()).await {
                Ok(gw) => gws.replicas.push(gw),
                Err(e) => {
                    gws.stop().await;
                    return Err(e).context("starting the drill's gateway");
                }
            }
        }
        if shared.is_some() {
            let fronted = gws.replicas.iter().map(|g| g.public_url()).collect();
            match Passthrough::start(fronted).await {
                Ok(front) => gws.front = Some(front),
                Err(e) => {
                    gws.stop().await;
                    return Err(e);
                }
            }
        }
        Ok(gws)
    }

    /// Where clients send: the front, or the one gateway.
    pub(crate) fn base_url(&self) -> String {
        match (&self.front, self.replicas.first()) {
            (Some(front), _) => front.base_url(),
            (None, Some(gw)) => gw.public_url(),
            (None, None) => String::new(),
        }
    }

    /// Every replica's metrics endpoint, for the run's report.
    pub(crate) fn metrics(&self) -> Vec<(String, String)> {
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, gw)| {
                let name = if self.replicas.len() == 1 {
                    "gateway".to_string()
                } else {
                    format!("gateway{i}")
                };
                (name, format!("{}/metrics", gw.admin_url()))
            })
            .collect()
    }

    /// Stops the front and every replica, then deletes the run's keys from Redis.
    pub(crate) async fn stop(self) {
        if let Some(front) = self.front {
            front.shutdown().await;
        }
        for gw in self.replicas {
            gw.shutdown().await;
        }
        if let Some((url, prefix)) = self.shared {
            if let Err(e) = delete_keys(&url, &prefix).await {
                tracing::warn!("cleaning the drill's keys {prefix}* from {url}: {e:#}");
            }
        }
    }
}

/// Deletes every key under `prefix`; how many there were.
async fn delete_keys(url: &str, prefix: &str) -> anyhow::Result<u64> {
    let store = levee_store::RedisStore::new(url, prefix, std::time::Duration::from_secs(5))?;
    Ok(store.clear().await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many keys there are under `prefix`.
    async fn keys_under(url: &str, prefix: &str) -> usize {
        let client = redis::Client::open(url).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.len()
    }

    #[tokio::test]
    async fn two_replicas_share_redis_behind_a_round_robin_front_and_leave_no_keys() {
        let url = "redis://127.0.0.1:6379";
        let up = match redis::Client::open(url) {
            Ok(c) => c.get_multiplexed_async_connection().await.is_ok(),
            Err(_) => false,
        };
        if !up {
            assert!(
                std::env::var("LEVEE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "LEVEE_REQUIRE_REDIS=1 but no Redis at {url}"
            );
            eprintln!("SKIPPED: no Redis at {url}");
            return;
        }
        let mut engines = Vec::new();
        for _ in 0..2 {
            let e =
                levee_engine::spawn(crate::drill_engine_config(), "127.0.0.1:0".parse().unwrap());
            engines.push(e.await.unwrap());
        }
        let urls: Vec<String> = engines.iter().map(|e| e.base_url()).collect();
        let scenario = levee_sim::scenarios::builtin("steady").unwrap();
        let setup = Setup {
            engines: 2,
            backends: Vec::new(),
            engine: crate::drill_engine_config(),
            gateway_text: crate::SHIPPED_GATEWAY_CONFIG,
            compare_text: None,
            opts: levee_sim::RunOptions::default(),
            cap: None,
            out: std::env::temp_dir(),
            replicas: 2,
            redis_url: url.into(),
        };
        let gws = Gateways::start(&scenario, &setup, setup.gateway_text, &urls)
            .await
            .unwrap();
        assert_eq!(gws.replicas.len(), 2);
        let (_, prefix) = gws.shared.clone().unwrap();
        let client = reqwest::Client::new();
        for _ in 0..4 {
            let status = client
                .post(format!("{}/v1/chat/completions", gws.base_url()))
                .bearer_auth(&scenario.tenants[0].api_key)
                .json(&serde_json::json!({
                    "model": scenario.request.model,
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 4,
                }))
                .send()
                .await
                .unwrap()
                .status();
            assert_eq!(status, 200);
        }
        // The front took turns: each replica served two, and both kept their limits in the
        // same Redis under the run's own prefix.
        for m in gws.metrics() {
            let text = client.get(&m.1).send().await.unwrap().text().await.unwrap();
            let served = levee_sim::scrape::parse_gauges(&text, &["levee_requests_total".into()]);
            assert_eq!(served.get("levee_requests_total"), Some(&2.0), "{}", m.0);
        }
        assert!(keys_under(url, &prefix).await > 0);
        gws.stop().await;
        assert_eq!(keys_under(url, &prefix).await, 0);
        for e in engines {
            e.shutdown().await.unwrap();
        }
    }
}
