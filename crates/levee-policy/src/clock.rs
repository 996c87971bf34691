//! Time, injected. Every decision in this crate takes a [`Timestamp`] instead of reading a
//! clock, so tests replay exact schedules with a [`ManualClock`] and production passes
//! [`SystemClock::now`].

use std::ops::{Add, Sub};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// A point on a monotonic clock, in nanoseconds since that clock's origin.
///
/// Timestamps from one [`Clock`] compare meaningfully; all [`SystemClock`]s in a process share
/// one origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The clock's origin.
    pub const ZERO: Timestamp = Timestamp(0);
    /// The far future; a deadline that never passes.
    pub const MAX: Timestamp = Timestamp(u64::MAX);

    /// A timestamp `nanos` after the origin.
    pub const fn from_nanos(nanos: u64) -> Self {
        Timestamp(nanos)
    }

    /// Nanoseconds since the origin.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at [`Timestamp::MAX`].
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_nanos(d)))
    }

    /// `self - d`, saturating at the origin.
    pub fn saturating_sub(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_sub(duration_nanos(d)))
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, rhs: Duration) -> Timestamp {
        self.saturating_add(rhs)
    }
}

impl Sub<Timestamp> for Timestamp {
    type Output = Duration;
    /// Saturating: a later `rhs` gives zero.
    fn sub(self, rhs: Timestamp) -> Duration {
        self.saturating_duration_since(rhs)
    }
}

/// A duration in whole nanoseconds, saturating at `u64::MAX` (584 years).
pub(crate) fn duration_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A source of monotonic time.
pub trait Clock: Send + Sync {
    /// The current time. Never goes backwards.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// A clock that moves only when told to. Clones share the same time, so a test can hand one
/// clone to the code under test and advance another.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    nanos: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at the origin.
    pub fn new() -> Self {
        Self::default()
    }

    /// A clock at `t`.
    pub fn starting_at(t: Timestamp) -> Self {
        ManualClock {
            nanos: Arc::new(AtomicU64::new(t.0)),
        }
    }

    /// Moves time forward by `d`.
    pub fn advance(&self, d: Duration) {
        let add = duration_nanos(d);
        let _ = self
            .nanos
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_add(add))
            });
    }

    /// Sets the time to `t` if `t` is later than now (time never goes backwards).
    pub fn set(&self, t: Timestamp) {
        self.nanos.fetch_max(t.0, Ordering::AcqRel);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.nanos.load(Ordering::Acquire))
    }
}

/// The production clock: `quanta`'s TSC-based clock (calibrated against the OS monotonic
/// clock once per process, on first use — up to ~200 ms — and falling back to the OS clock
/// where the TSC is not reliable). A read costs well under half of `std::time::Instant::now`
/// on this project's VMs (see BENCHMARKS.md). All `SystemClock`s share one origin. Reads on
/// different cores can differ by the TSC skew between them (nanoseconds); every decision in
/// this crate tolerates a timestamp slightly older than one already seen.
#[derive(Debug, Clone)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin: u64,
}

fn shared_tsc() -> &'static (quanta::Clock, u64) {
    static SHARED: OnceLock<(quanta::Clock, u64)> = OnceLock::new();
    SHARED.get_or_init(|| {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        (clock, origin)
    })
}

impl SystemClock {
    /// A system clock (all share one origin). The first one calibrates the TSC.
    pub fn new() -> Self {
        let (clock, origin) = shared_tsc();
        SystemClock {
            clock: clock.clone(),
            origin: *origin,
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Timestamp {
        Timestamp(self.clock.delta_as_nanos(self.origin, self.clock.raw()))
    }
}

/// A clock on `std::time::Instant` (the OS monotonic clock), for platforms or tests where a
/// calibrated TSC is unwanted. All `StdClock`s share one origin.
#[derive(Debug, Clone, Copy, Default)]
pub struct StdClock;

fn std_origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

impl StdClock {
    /// A std clock (all share one origin).
    pub fn new() -> Self {
        let _ = std_origin();
        StdClock
    }
}

impl Clock for StdClock {
    fn now(&self) -> Timestamp {
        Timestamp(duration_nanos(std_origin().elapsed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new();
        let b = a.clone();
        a.advance(Duration::from_millis(5));
        assert_eq!(b.now(), Timestamp::from_nanos(5_000_000));
        b.set(Timestamp::from_nanos(1));
        assert_eq!(a.now(), Timestamp::from_nanos(5_000_000), "never backwards");
    }

    #[test]
    fn system_clocks_are_monotonic_and_agree() {
        let c = SystemClock::new();
        let s = StdClock::new();
        let (a0, s0) = (c.now(), s.now());
        std::thread::sleep(Duration::from_millis(20));
        let (a1, s1) = (c.now(), s.now());
        assert!(a1 > a0 && s1 > s0);
        let (da, ds) = ((a1 - a0).as_secs_f64(), (s1 - s0).as_secs_f64());
        // Both saw the 20 ms sleep; the bound is loose because the thread can be preempted
        // between the paired reads on a busy machine.
        assert!(da >= 0.019 && ds >= 0.019, "tsc {da} vs std {ds}");
        assert!(
            (da - ds).abs() < 0.02_f64.max(0.5 * ds),
            "tsc {da} vs std {ds}"
        );
    }

    #[test]
    fn timestamp_arithmetic_saturates() {
        let t = Timestamp::from_nanos(10);
        assert_eq!(t - Timestamp::from_nanos(20), Duration::ZERO);
        assert_eq!(Timestamp::MAX + Duration::from_secs(1), Timestamp::MAX);
        assert_eq!(t.saturating_sub(Duration::from_secs(1)), Timestamp::ZERO);
    }
}
