//! What one client connection may hold: a place under the listener's caps (all
//! connections, and per client IP), and a watch on its activity that closes it when it has
//! no request for too long (no first request within `server.header_read_timeout_ms`, none
//! in progress for `server.idle_timeout_ms`) or has served
//! `server.max_requests_per_connection` requests. Without these an idle HTTP/2 connection
//! (the preface, SETTINGS, then silence) or an HTTP/1 keep-alive one holds a descriptor for
//! as long as its client likes, and a few hundred of them take the listeners down.

use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Why a connection was not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The listener holds its cap of open connections.
    Global,
    /// The client's IP holds its cap.
    PerIp,
}

impl Refused {
    /// The `reason` label of `levee_connections_refused_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Refused::Global => "max_connections",
            Refused::PerIp => "max_connections_per_ip",
        }
    }
}

/// The open connections of one listener, counted in total and per client IP.
#[derive(Debug)]
pub struct ConnLimits {
    max: usize,
    max_per_ip: usize,
    open: AtomicUsize,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    closed: Notify,
    /// `levee_open_connections{listener}`.
    gauge: Gauge,
}

impl ConnLimits {
    /// Caps of `max` connections in all and `max_per_ip` per IP (0: no per-IP cap).
    pub fn new(max: usize, max_per_ip: usize, gauge: Gauge) -> Arc<ConnLimits> {
        Arc::new(ConnLimits {
            max: max.max(1),
            max_per_ip,
            open: AtomicUsize::new(0),
            per_ip: Mutex::new(HashMap::new()),
            closed: Notify::new(),
            gauge,
        })
    }

    /// A place for a connection from `ip`, held until the returned guard drops.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnSlot, Refused> {
        let mut per_ip = self.per_ip.lock();
        if self.open.load(Ordering::Relaxed) >= self.max {
            return Err(Refused::Global);
        }
        let n = per_ip.entry(ip).or_insert(0);
        if self.max_per_ip > 0 && *n >= self.max_per_ip {
            return Err(Refused::PerIp);
        }
        *n += 1;
        self.open.fetch_add(1, Ordering::Relaxed);
        self.gauge.inc();
        Ok(ConnSlot {
            limits: self.clone(),
            ip,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Client IPs with a connection open now.
    pub fn ips(&self) -> usize {
        self.per_ip.lock().len()
    }

    /// Waits until every connection has closed.
    pub async fn all_closed(&self) {
        loop {
            let closed = self.closed.notified();
            if self.open() == 0 {
                return;
            }
            closed.await;
        }
    }
}

/// A connection's place under its listener's caps.
#[derive(Debug)]
pub struct ConnSlot {
    limits: Arc<ConnLimits>,
    ip: IpAddr,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        let mut per_ip = self.limits.per_ip.lock();
        if let Some(n) = per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                per_ip.remove(&self.ip);
            }
        }
        self.limits.gauge.dec();
        if self.limits.open.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.limits.closed.notify_waiters();
        }
    }
}

/// The connection cap to use: `configured`, or with 0 three quarters of what the process's
/// open-file limit leaves after 128 descriptors for backends, the shared store and files
/// (the rest of the descriptors are what requests to the backends use).
pub fn effective_max(configured: usize, open_file_limit: Option<u64>) -> usize {
    if configured > 0 {
        return configured;
    }
    let limit = open_file_limit.unwrap_or(4096);
    let usable = limit.saturating_sub(128).max(64) * 3 / 4;
    usize::try_from(usable).unwrap_or(usize::MAX).max(16)
}

/// The soft open-file limit of this process (`/proc/self/limits`), where it can be read.
pub fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// What the activity watch of a connection is bounded by.
#[derive(Debug, Clone, Copy)]
pub struct IdlePolicy {
    /// A connection's first request must arrive within this.
    pub first_request: Duration,
    /// A connection with no request in progress for this long is closed.
    pub idle: Duration,
    /// Requests served on one connection before it is closed (0: no limit).
    pub max_requests: u64,
}

/// Requests in progress on one connection and when the last one ended.
///
/// A request's start and end wake nothing: the watch ([`Activity::expired`]) reads the
/// figures again when its deadline passes (while a request is in progress, once per idle
/// period) and closes at the same moments as if it had been woken. Only the request that
/// spends the connection's budget, and once the connection is closing every request's end,
/// wake it: a wake-up per request start and end cost each request two more polls of its
/// connection's task and a timer taken out of the wheel and put back.
#[derive(Debug)]
pub struct Activity {
    started: Instant,
    active: AtomicU32,
    served: AtomicU64,
    /// Milliseconds from `started` to the end of the last request.
    last_end_ms: AtomicU64,
    /// Requests served before the connection closes (0: no limit).
    max_requests: u64,
    /// The connection is closing: each request's end wakes [`Activity::quiet_for`].
    closing: AtomicBool,
    changed: Notify,
}

impl Activity {
    /// A new connection's activity, none yet; it closes after `max_requests` (0: never).
    pub fn new(max_requests: u64) -> Arc<Activity> {
        Arc::new(Activity {
            started: Instant::now(),
            active: AtomicU32::new(0),
            served: AtomicU64::new(0),
            last_end_ms: AtomicU64::new(0),
            max_requests,
            closing: AtomicBool::new(false),
            changed: Notify::new(),
        })
    }

    /// A request began; it is in progress until the guard drops (with its response body).
    pub fn begin(self: &Arc<Self>) -> RequestActive {
        self.active.fetch_add(1, Ordering::Relaxed);
        let served = self.served.fetch_add(1, Ordering::Relaxed) + 1;
        if self.max_requests > 0 && served >= self.max_requests {
            self.changed.notify_one();
        }
        RequestActive(self.clone())
    }

    /// Resolves when the connection should be closed gracefully: no first request in
    /// time, idle too long, or its request budget spent (once its last request is over).
    pub async fn expired(&self, policy: &IdlePolicy) {
        loop {
            // The wait is built in a block so that it is the future's only state (a
            // connection holds this future for its whole life); the change is registered
            // before the state is read, so a change after the read still wakes it.
            let wait = {
                let changed = self.changed.notified();
                match self.deadline(policy) {
                    None => return,
                    Some(deadline) => tokio::time::timeout_at(deadline, changed),
                }
            };
            let _ = wait.await;
        }
    }

    /// When the connection expires if nothing changes first; `None`: it has.
    fn deadline(&self, policy: &IdlePolicy) -> Option<Instant> {
        let served = self.served.load(Ordering::Relaxed);
        let active = self.active.load(Ordering::Relaxed);
        if policy.max_requests > 0 && served >= policy.max_requests {
            // hyper finishes the request in progress, then closes.
            return None;
        }
        let now = Instant::now();
        let deadline = if active > 0 {
            // Busy: nothing can expire before an idle period after now.
            now + policy.idle
        } else if served == 0 {
            self.started + policy.first_request
        } else {
            let last = Duration::from_millis(self.last_end_ms.load(Ordering::Relaxed));
            self.started + last + policy.idle
        };
        (active > 0 || deadline > now).then_some(deadline)
    }

    /// Marks the connection closing: from now on each request's end wakes
    /// [`Activity::quiet_for`].
    pub fn closing(&self) {
        self.closing.store(true, Ordering::Release);
    }
}

impl Activity {
    /// Resolves once no request has been in progress on the connection for `bound` (call
    /// [`Activity::closing`] first).
    pub async fn quiet_for(&self, bound: Duration) {
        loop {
            let changed = self.changed.notified();
            if self.active.load(Ordering::Relaxed) > 0 {
                changed.await;
                continue;
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(bound) => {
                    if self.active.load(Ordering::Relaxed) == 0 {
                        return;
                    }
                }
            }
        }
    }
}

/// A request in progress on its connection (see [`Activity::begin`]).
#[derive(Debug)]
pub struct RequestActive(Arc<Activity>);

impl Drop for RequestActive {
    fn drop(&mut self) {
        let a = &self.0;
        let ms = u64::try_from(a.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        a.last_end_ms.store(ms, Ordering::Relaxed);
        a.active.fetch_sub(1, Ordering::Relaxed);
        if a.closing.load(Ordering::Acquire) {
            a.changed.notify_one();
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request counted as in progress until it is sent
    /// (or its connection goes).
    pub struct TrackedBody {
        #[pin]
        inner: axum::body::Body,
        active: RequestActive,
    }
}

impl TrackedBody {
    /// `inner`, keeping `active` alive as long as it is.
    pub fn new(inner: axum::body::Body, active: RequestActive) -> TrackedBody {
        TrackedBody { inner, active }
    }
}

impl hyper::body::Body for TrackedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_hold_in_total_and_per_ip_and_free_on_drop() {
        let l = ConnLimits::new(3, 2, Gauge::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = l.admit(a).unwrap();
        let _a2 = l.admit(a).unwrap();
        assert_eq!(l.admit(a).unwrap_err(), Refused::PerIp);
        let _b1 = l.admit(b).unwrap();
        assert_eq!(l.admit(b).unwrap_err(), Refused::Global);
        drop(a1);
        assert_eq!(l.open(), 2);
        let _b2 = l.admit(b).unwrap();
        assert_eq!(l.ips(), 2);
        assert_eq!(
            ConnLimits::new(1, 0, Gauge::default()).admit(a).map(|_| ()),
            Ok(())
        );
    }

    #[test]
    fn the_automatic_cap_leaves_descriptors_for_backends() {
        assert_eq!(effective_max(500, Some(300)), 500, "an explicit cap wins");
        let auto = effective_max(0, Some(300));
        assert!(auto < 300 - 64, "{auto}");
        assert_eq!(effective_max(0, Some(20_000)), (20_000 - 128) * 3 / 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_requests_expires_and_one_in_use_does_not() {
        let policy = IdlePolicy {
            first_request: Duration::from_secs(5),
            idle: Duration::from_secs(60),
            max_requests: 3,
        };
        // No first request: closed after `first_request`.
        let a = Activity::new(policy.max_requests);
        let t0 = Instant::now();
        a.expired(&policy).await;
        assert_eq!(t0.elapsed(), Duration::from_secs(5));
        // A request in progress for 10 minutes keeps it; idle after it ends counts from then.
        let a = Activity::new(policy.max_requests);
        let r = a.begin();
        let watch = tokio::spawn({
            let a = a.clone();
            async move { a.expired(&policy).await }
        });
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert!(!watch.is_finished());
        drop(r);
        let ended = Instant::now();
        watch.await.unwrap();
        assert_eq!(ended.elapsed(), Duration::from_secs(60));
        // The request budget: expired once spent.
        let a = Activity::new(policy.max_requests);
        for _ in 0..3 {
            drop(a.begin());
        }
        let t0 = Instant::now();
        a.expired(&policy).await;
        assert_eq!(t0.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn the_request_that_spends_the_budget_wakes_the_watch_at_once() {
        let policy = IdlePolicy {
            first_request: Duration::from_secs(5),
            idle: Duration::from_secs(60),
            max_requests: 3,
        };
        let a = Activity::new(policy.max_requests);
        let watch = tokio::spawn({
            let a = a.clone();
            async move { a.expired(&policy).await }
        });
        tokio::task::yield_now().await;
        let t0 = Instant::now();
        let _held: Vec<_> = (0..3).map(|_| a.begin()).collect();
        watch.await.unwrap();
        assert_eq!(
            t0.elapsed(),
            Duration::ZERO,
            "not at the next periodic look"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn once_closing_a_request_end_starts_the_quiet_period() {
        let a = Activity::new(0);
        let r = a.begin();
        a.closing();
        let quiet = tokio::spawn({
            let a = a.clone();
            async move { a.quiet_for(Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_secs(100)).await;
        assert!(!quiet.is_finished());
        drop(r);
        let ended = Instant::now();
        tokio::time::timeout(Duration::from_secs(60), quiet)
            .await
            .expect("woken by the request's end")
            .unwrap();
        assert_eq!(ended.elapsed(), Duration::from_secs(5));
    }
}
