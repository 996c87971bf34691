//! The gateway's periodic work, off the request path: scraping backends, re-evaluating
//! degradation, the autoscaling figures, per-backend gauges and the shared store's
//! heartbeat. Each lane's lock is taken only briefly, one lane at a time.

use crate::gateway::Gateway;
use crate::metrics::{BackendLabel, ModelLabel};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Spawns the scraper, the degradation ticker, the autoscaling and gauges ticker and, with a
/// shared store, the heartbeat and the renewal of the backend slices (each on its own
/// period); they end when the gateway stops.
pub(crate) fn spawn(gw: &Arc<Gateway>) {
    let stop = gw.stopped_token();
    if let Some(shared) = gw.shared().cloned() {
        let (stop, weak, beating) = (stop.clone(), Arc::downgrade(gw), shared.clone());
        tokio::spawn(async move {
            loop {
                beating.beat().await;
                let Some(gw) = weak.upgrade() else { break };
                share_demand(&gw, &beating).await;
                drop(gw);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(beating.heartbeat_interval()) => {}
                }
            }
        });
        let (stop, weak) = (gw.stopped_token(), Arc::downgrade(gw));
        tokio::spawn(async move {
            loop {
                let Some(gw) = weak.upgrade() else { break };
                renew_slices(&gw, &shared).await;
                drop(gw);
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(shared.slice_renew_interval()) => {}
                }
            }
        });
    }
    tokio::spawn(scrape_loop(Arc::downgrade(gw), stop.clone()));
    every(gw, Duration::from_millis(250), |g| {
        g.update_degrade();
    });
    every(gw, Duration::from_secs(1), |g| {
        g.update_scaling();
        g.refresh_backend_metrics();
    });
}

/// Renews this replica's slice of every backend's budget (a fleet on Redis), all at once,
/// each waiting at most the decision timeout (then the current slice stays), and hands the
/// slices to the lanes.
async fn renew_slices(gw: &Gateway, shared: &crate::shared::Shared) {
    let now = gw.now();
    let lanes = gw.lanes();
    let jobs = lanes.iter().flat_map(|lane| {
        lane.backends().into_iter().map(move |b| async move {
            let limits = b.limits();
            let admitting = levee_policy::Budget {
                slots: u64::try_from(limits.max_in_flight).unwrap_or(u64::MAX),
                kv_tokens: limits.kv_tokens.unwrap_or(0),
            };
            let slice = shared
                .renew_slice(&b.key, b.budget(), &lane.demand(&b.key), admitting, now)
                .await;
            b.set_fleet_slice(slice);
            lane.slice_changed(&b);
        })
    });
    futures::future::join_all(jobs).await;
    let keys: Vec<Arc<str>> = lanes
        .iter()
        .flat_map(|l| l.backends().into_iter().map(|b| b.key.clone()))
        .collect();
    shared.retain_slices(&keys);
}

/// Publishes this replica's demand for every model to the fleet and takes the others': the
/// replica recommendation is the fleet's (see `autoscale.rs`).
async fn share_demand(gw: &Gateway, shared: &crate::shared::Shared) {
    let lanes = gw.lanes();
    let jobs = lanes.iter().filter_map(|lane| {
        let (rate, queued) = gw.scaling().local_demand(&lane.model)?;
        Some(async move {
            let others = shared.fleet_demand(&lane.model, rate, queued).await;
            gw.scaling().set_fleet_demand(&lane.model, others);
        })
    });
    futures::future::join_all(jobs).await;
}

/// Runs `tick` on the gateway every `period` until it stops.
fn every(gw: &Arc<Gateway>, period: Duration, tick: impl Fn(&Gateway) + Send + 'static) {
    let weak = Arc::downgrade(gw);
    let stop = gw.stopped_token();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(period) => {}
            }
            let Some(gw) = weak.upgrade() else { break };
            tick(&gw);
        }
    });
}

/// Scrapes every backend each `scrape.interval_ms`. The first scrape runs at once: a backend
/// that is down at start must not draw traffic until three scrapes have failed.
async fn scrape_loop(weak: std::sync::Weak<Gateway>, stop: tokio_util::sync::CancellationToken) {
    let mut first = true;
    loop {
        if !first {
            let Some(gw) = weak.upgrade() else { break };
            let interval = Duration::from_millis(gw.config().scrape.interval_ms.max(50));
            drop(gw);
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
        first = false;
        let Some(gw) = weak.upgrade() else { break };
        if gw.config().scrape.interval_ms != 0 {
            scrape_all(&gw).await;
        }
    }
}

/// One scrape of every backend of every lane, then a wake of every lane (a backend that came
/// back may have room for queued requests; one that went away may leave its lane unable to
/// serve them). The gauges follow every second.
async fn scrape_all(gw: &Gateway) {
    let cfg = gw.config();
    let timeout = Duration::from_millis(cfg.scrape.timeout_ms.max(10));
    let n = cfg.scrape.unhealthy_after.max(1);
    let lanes = gw.lanes();
    let jobs = lanes.iter().flat_map(|lane| {
        lane.backends().into_iter().map(move |b| async move {
            let reported = b.scrape(gw.client(), timeout, n).await;
            lane.scraped(&b, reported);
        })
    });
    futures::future::join_all(jobs).await;
    for lane in lanes {
        lane.wake();
    }
}

impl Gateway {
    /// Samples every lane and updates its backend replica recommendation.
    pub fn update_scaling(&self) {
        let cfg = self.config();
        let now = self.now();
        for lane in self.lanes() {
            if lane.is_retired() {
                continue;
            }
            let (stats, queued) = lane.view(|l| (l.backend_stats(now), l.queued()));
            let busy: usize = stats.iter().map(|s| s.in_flight).sum();
            let slots: usize = stats.iter().map(|s| s.request_cap).sum();
            let per_replica = slots / stats.len().max(1);
            let sample = crate::autoscale::LaneSample {
                queued: queued as u64,
                busy_slots: busy as u64,
                slots_per_replica: u32::try_from(per_replica).unwrap_or(u32::MAX),
            };
            let snap = self
                .scaling()
                .observe(&lane.model, sample, &cfg.autoscale, now);
            let label = ModelLabel {
                model: lane.model.to_string(),
            };
            let m = self.metrics();
            m.recommended_replicas
                .get_or_create(&label)
                .set(i64::from(snap.replicas));
            m.offered_load.get_or_create(&label).set(snap.offered_load);
        }
    }

    /// Re-evaluates each lane's automatic degradation level; returns the highest.
    pub fn update_degrade(&self) -> u8 {
        let now = self.now();
        let rt = self.runtime();
        let hard = u64::from(rt.cfg.queue.hard);
        let mut top = 0;
        for lane in self.lanes() {
            let slo = rt.models.get(&*lane.model).and_then(|m| m.ttft_slo);
            let signals = lane.signals(hard, slo, now);
            let level = self.observe_degradation(&lane, signals, now);
            self.metrics().degrade_level(&lane.model, level);
            top = top.max(level);
        }
        top
    }

    /// Updates each lane's load gauge and its backends' gauges from its admission state.
    pub(crate) fn refresh_backend_metrics(&self) {
        let now = self.now();
        for lane in self.lanes() {
            let (stats, load) = lane.view(|l| (l.backend_stats(now), l.load()));
            self.metrics()
                .lane_load
                .get_or_create(&ModelLabel {
                    model: lane.model.to_string(),
                })
                .set(i64::try_from(load).unwrap_or(i64::MAX));
            for b in lane.backends() {
                let st = stats.iter().find(|s| s.id == b.key);
                backend_gauges(self, &b, st, now);
            }
        }
    }
}

/// One backend's gauges: levee's counts from the admission state, the engine's own report.
fn backend_gauges(
    gw: &Gateway,
    b: &crate::upstream::Backend,
    st: Option<&levee_policy::BackendStats>,
    now: levee_policy::Timestamp,
) {
    let m = gw.metrics();
    let l = BackendLabel {
        backend: b.id.clone(),
    };
    let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    if let Some(st) = st {
        m.backend_in_flight
            .get_or_create(&l)
            .set(as_i64(st.in_flight as u64));
        m.backend_tokens_in_flight
            .get_or_create(&l)
            .set(as_i64(st.tokens_in_flight));
        if let Some(kv) = st.kv_tokens {
            m.backend_kv_budget.get_or_create(&l).set(as_i64(kv));
        }
        let state = st.breaker.state.as_gauge();
        m.breaker_state.get_or_create(&l).set(state);
        m.observe_breaker(&b.id, state, st.breaker.opened_total, now);
    }
    m.backend_max_in_flight
        .get_or_create(&l)
        .set(i64::from(b.max_in_flight.load(Ordering::Relaxed)));
    m.backend_healthy
        .get_or_create(&l)
        .set(i64::from(b.is_routable()));
    if let Some(load) = b.reported() {
        m.backend_load
            .get_or_create(&l)
            .set(load.running + load.waiting);
        m.backend_kv.get_or_create(&l).set(load.kv_usage);
    }
}
