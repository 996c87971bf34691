//! The policy [`Clock`] on tokio's time, so `#[tokio::test(start_paused = true)]` drives
//! every limiter and queue decision through virtual time.

use levee_policy::{Clock, Timestamp};

/// Monotonic time from tokio, measured from the moment the gateway was built.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }

    /// The tokio instant corresponding to a timestamp of this clock.
    pub fn instant_at(&self, t: Timestamp) -> tokio::time::Instant {
        self.origin + std::time::Duration::from_nanos(t.as_nanos())
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        let ns = self.origin.elapsed().as_nanos();
        // The +1 keeps the first timestamp after the origin distinct from "never".
        Timestamp::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX).saturating_add(1))
    }
}
