//! The latency a backend delivers, learned from its own responses, and the per-tier
//! objectives it is held to.
//!
//! An engine that batches continuously runs one step for every sequence it holds: the more
//! sequences, the longer each step, so every running request's time per output token grows
//! with the batch; and a prompt's prefill runs in the steps it joins, so a request's time to
//! first token grows with the prompt tokens the engine has to prefill ahead of and with it.
//! Slots and KV tokens bound what an engine *can* hold; this bounds what it may hold while
//! keeping the latency its requests were promised.
//!
//! [`LatencyFit`] keeps two least-squares lines per backend over its last
//! [`LatencyFit::WINDOW`] responses: time per output token over the batch it was dispatched
//! into (`tpot = c + d·batch`), and time to first token over the prompt tokens being
//! prefilled there at dispatch, its own included (`ttft = a + b·tokens`). From them:
//! the largest batch whose predicted time per output token meets an objective
//! ([`LatencyFit::batch_cap`]), and the predicted time to first token of a prompt placed now
//! ([`LatencyFit::ttft_for`]). Before [`LatencyFit::MIN_SAMPLES`] responses nothing is
//! predicted and nothing capped. When every sample was taken at one batch size (a backend
//! held at one load) the line has no slope; the cap is then read from the proportional
//! bound `tpot ≤ batch × (mean tpot ÷ mean batch)` (a positive intercept only makes the
//! true slope smaller, so this errs low), and only while the mean misses the objective.

use std::collections::VecDeque;
use std::time::Duration;

/// The latency objectives of one tier: time to first token and time per output token
/// (`None`: no objective).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencySlo {
    /// Time to first token as the client sees it: from arrival, queue wait included.
    pub ttft: Option<Duration>,
    /// Time per output token after the first.
    pub tpot: Option<Duration>,
}

/// A least-squares line over a bounded window of samples, kept as running sums so that a
/// fit costs O(1).
#[derive(Debug, Clone, Default)]
struct Line {
    samples: VecDeque<(f64, f64)>,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

/// A fitted line: its means and slope (`None`: no spread in x).
#[derive(Debug, Clone, Copy)]
struct Fitted {
    mx: f64,
    my: f64,
    slope: Option<f64>,
}

impl Line {
    fn push(&mut self, x: f64, y: f64) {
        self.samples.push_back((x, y));
        self.add(x, y, 1.0);
        while self.samples.len() > LatencyFit::WINDOW {
            if let Some((x, y)) = self.samples.pop_front() {
                self.add(x, y, -1.0);
            }
        }
    }

    fn add(&mut self, x: f64, y: f64, sign: f64) {
        self.sx += sign * x;
        self.sy += sign * y;
        self.sxx += sign * x * x;
        self.sxy += sign * x * y;
    }

    fn fit(&self) -> Option<Fitted> {
        let n = self.samples.len();
        if n < LatencyFit::MIN_SAMPLES {
            return None;
        }
        let nf = n as f64;
        let (mx, my) = (self.sx / nf, self.sy / nf);
        let var = self.sxx / nf - mx * mx;
        // Spread below a thousandth of the mean's square is rounding, not spread.
        let slope =
            (var > 1e-3 * mx.abs().max(1.0).powi(2)).then(|| (self.sxy / nf - mx * my) / var);
        Some(Fitted { mx, my, slope })
    }
}

/// What one backend's responses say about its latency (see the module's documentation).
/// Pure: the caller feeds samples and asks for predictions.
#[derive(Debug, Clone, Default)]
pub struct LatencyFit {
    tpot: Line,
    ttft: Line,
}

/// The longest time any prediction gives.
const MAX_SECS: f64 = 600.0;

impl LatencyFit {
    /// Samples each line is fitted over (the newest).
    pub const WINDOW: usize = 256;
    /// Samples a line needs before it predicts anything.
    pub const MIN_SAMPLES: usize = 16;

    /// An empty fit.
    pub fn new() -> Self {
        LatencyFit::default()
    }

    /// Records one response: dispatched into a batch of `batch` requests (itself included)
    /// while `prefill_tokens` prompt tokens were being prefilled there (its own included);
    /// its time to first token and its time per output token after the first, when known.
    pub fn note(
        &mut self,
        batch: usize,
        prefill_tokens: u64,
        ttft: Option<Duration>,
        tpot: Option<Duration>,
    ) {
        if let Some(t) = ttft {
            self.ttft
                .push(prefill_tokens as f64, t.as_secs_f64().min(MAX_SECS));
        }
        if let Some(t) = tpot {
            self.tpot
                .push(batch.max(1) as f64, t.as_secs_f64().min(MAX_SECS));
        }
    }

    /// Responses with a time per output token held.
    pub fn tpot_samples(&self) -> usize {
        self.tpot.samples.len()
    }

    /// The predicted time per output token in a batch of `batch`; `None` before
    /// [`LatencyFit::MIN_SAMPLES`] responses.
    pub fn tpot_at(&self, batch: usize) -> Option<Duration> {
        let f = self.tpot.fit()?;
        let secs = match f.slope {
            Some(b) if b > 0.0 => f.my + b * (batch as f64 - f.mx),
            _ => f.my,
        };
        Some(Duration::from_secs_f64(secs.clamp(0.0, MAX_SECS)))
    }

    /// The largest batch whose predicted time per output token is within `slo` (at least
    /// 1); `None` when nothing bounds it: too few responses, or no slowdown with the batch
    /// measured while the mean meets `slo`.
    pub fn batch_cap(&self, slo: Duration) -> Option<usize> {
        let f = self.tpot.fit()?;
        let slo = slo.as_secs_f64();
        let cap = match f.slope {
            Some(b) if b > 0.0 => {
                let a = f.my - b * f.mx;
                (slo - a) / b
            }
            _ if f.my > slo && f.my > 0.0 => f.mx * slo / f.my,
            _ => return None,
        };
        Some(cap.clamp(1.0, 1e6).floor() as usize)
    }

    /// The predicted time to first token of a prompt dispatched where `prefill_tokens`
    /// prompt tokens (its own included) are being prefilled; `None` before
    /// [`LatencyFit::MIN_SAMPLES`] responses.
    pub fn ttft_for(&self, prefill_tokens: u64) -> Option<Duration> {
        let f = self.ttft.fit()?;
        let secs = match f.slope {
            Some(b) if b > 0.0 => f.my + b * (prefill_tokens as f64 - f.mx),
            _ => f.my,
        };
        Some(Duration::from_secs_f64(secs.clamp(0.0, MAX_SECS)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(v: f64) -> Duration {
        Duration::from_secs_f64(v / 1000.0)
    }

    proptest! {
        /// Responses whose time per token lies on `c + d·batch` give back that line, and the
        /// cap is the largest batch on it within the objective.
        #[test]
        fn a_batch_slowdown_on_a_line_caps_the_batch_where_it_meets_the_objective(
            c in 2.0f64..20.0,
            d in 0.1f64..3.0,
            slo in 5.0f64..100.0,
        ) {
            let mut fit = LatencyFit::new();
            for i in 0..64usize {
                let batch = 1 + i % 32;
                fit.note(batch, 100, None, Some(ms(c + d * batch as f64)));
            }
            let cap = fit.batch_cap(ms(slo)).unwrap();
            let on_line = |n: usize| c + d * n as f64;
            if on_line(1) <= slo {
                prop_assert!(on_line(cap) <= slo + 1e-6);
                prop_assert!(on_line(cap + 1) > slo - 1e-6);
            } else {
                prop_assert_eq!(cap, 1);
            }
            let p = fit.tpot_at(10).unwrap().as_secs_f64() * 1000.0;
            prop_assert!((p - on_line(10)).abs() < 1e-6);
        }

        /// Held at one batch size, a backend slower than the objective is capped below it
        /// (the proportional bound); one that meets it is not capped.
        #[test]
        fn without_spread_the_cap_is_the_proportional_bound(
            batch in 2usize..64,
            tpot in 5.0f64..50.0,
            slo in 5.0f64..50.0,
        ) {
            let mut fit = LatencyFit::new();
            for _ in 0..20 {
                fit.note(batch, 0, None, Some(ms(tpot)));
            }
            match fit.batch_cap(ms(slo)) {
                Some(cap) => {
                    prop_assert!(tpot > slo);
                    prop_assert!(cap < batch);
                    prop_assert_eq!(cap, ((batch as f64 * slo / tpot).floor() as usize).max(1));
                }
                None => prop_assert!(tpot <= slo),
            }
        }

        /// Time to first token grows with the prompt tokens being prefilled ahead: the fit
        /// predicts more for more tokens, and the line it was fed.
        #[test]
        fn ttft_follows_the_prefill_tokens_ahead(a in 10.0f64..200.0, b in 0.01f64..1.0) {
            let mut fit = LatencyFit::new();
            for i in 0..40u64 {
                let tokens = 100 + 137 * i;
                fit.note(1, tokens, Some(ms(a + b * tokens as f64)), None);
            }
            let short = fit.ttft_for(200).unwrap();
            let long = fit.ttft_for(4000).unwrap();
            prop_assert!(long > short);
            let want = a + b * 4000.0;
            prop_assert!((long.as_secs_f64() * 1000.0 - want).abs() < 1e-6);
        }
    }

    #[test]
    fn nothing_is_predicted_or_capped_before_enough_responses() {
        let mut fit = LatencyFit::new();
        for i in 0..LatencyFit::MIN_SAMPLES - 1 {
            fit.note(i + 1, 10, Some(ms(100.0)), Some(ms(500.0)));
        }
        assert_eq!(fit.batch_cap(ms(10.0)), None);
        assert_eq!(fit.ttft_for(10), None);
        assert_eq!(fit.tpot_at(4), None);
        fit.note(20, 10, Some(ms(100.0)), Some(ms(500.0)));
        assert!(fit.batch_cap(ms(10.0)).is_some());
        assert!(fit.ttft_for(10).is_some());
    }

    #[test]
    fn the_window_forgets_the_oldest_responses() {
        let mut fit = LatencyFit::new();
        for _ in 0..LatencyFit::WINDOW {
            fit.note(8, 0, None, Some(ms(80.0)));
        }
        for _ in 0..LatencyFit::WINDOW {
            fit.note(8, 0, None, Some(ms(8.0)));
        }
        // Only the fast responses remain: 8 ms per token meets 10 ms, nothing capped.
        assert_eq!(fit.batch_cap(ms(10.0)), None);
        let p = fit.tpot_at(8).unwrap().as_secs_f64() * 1000.0;
        assert!((p - 8.0).abs() < 1e-6, "{p}");
    }
}
