//! How long a backend takes to prefill a prompt, measured from a lane's streamed responses.
//!
//! An engine without chunked prefill runs a prompt's whole prefill in one step, and every
//! request that arrives at that engine meanwhile waits for the step to end. The batch band
//! keeps interactive requests off a backend while a task's long prompt is being prefilled
//! there (see [`crate::Lane::fence_backend`]); this fit says for how long.
//!
//! Each streamed response gives one sample: its prompt (levee's estimate, in tokens) and its
//! time to first token. [`PrefillFit`] fits the least-squares line `ttft = a + b·tokens` over
//! the last [`PrefillFit::WINDOW`] samples: the slope `b` is the engine's prefill time per
//! token, and the intercept `a` is what any request waits besides its own prefill (the step
//! in progress when it arrives, one decode step). A prompt of `n` tokens is predicted to have
//! its first token `a + b·n` after dispatch — the time its prefill holds the engine, plus the
//! mean wait of an arrival, which errs on the long side.
//!
//! Before [`PrefillFit::MIN_SAMPLES`] samples the line is not trusted; the prediction is
//! then `n × min(ttft / tokens)` over the samples: since every time to first token includes
//! its prompt's whole prefill, each ratio bounds the per-token time from above, and the
//! smallest is the tightest such bound (long on small prompts, never short).

use std::collections::VecDeque;
use std::time::Duration;

/// A least-squares line of time to first token over prompt tokens, over a bounded window of
/// samples. Pure: the caller feeds samples and asks for predictions.
#[derive(Debug, Clone, Default)]
pub struct PrefillFit {
    samples: VecDeque<(f64, f64)>,
}

impl PrefillFit {
    /// Samples the line is fitted over (the newest).
    pub const WINDOW: usize = 256;
    /// Samples needed before anything is predicted.
    pub const MIN_SAMPLES: usize = 16;
    /// The longest prediction given.
    pub const MAX: Duration = Duration::from_secs(60);

    /// An empty fit.
    pub fn new() -> Self {
        PrefillFit::default()
    }

    /// Records a streamed response of `prompt_tokens` whose first token came `ttft` after it
    /// was sent.
    pub fn note(&mut self, prompt_tokens: u64, ttft: Duration) {
        self.samples
            .push_back((prompt_tokens as f64, ttft.as_secs_f64()));
        while self.samples.len() > Self::WINDOW {
            self.samples.pop_front();
        }
    }

    /// Samples held.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The `q` quantile (0..=1) of the times to first token held; `None` with none.
    pub fn ttft_quantile(&self, q: f64) -> Option<Duration> {
        let mut v: Vec<f64> = self.samples.iter().map(|(_, y)| *y).collect();
        let secs = crate::nearest_rank(&mut v, q)?;
        Some(Duration::from_secs_f64(
            secs.clamp(0.0, Self::MAX.as_secs_f64()),
        ))
    }

    /// The predicted time from dispatch to the first token of a prompt of `prompt_tokens`:
    /// `a + b·tokens` on the fitted line. With no spread in the prompts measured, or a slope
    /// that is not positive (prefill too cheap to show), the mean time to first token. With
    /// fewer than [`PrefillFit::MIN_SAMPLES`] samples, the upper bound `tokens × min(ttft /
    /// tokens)`; `None` with none. At most [`PrefillFit::MAX`].
    pub fn predict(&self, prompt_tokens: u64) -> Option<Duration> {
        let n = self.samples.len();
        if n < Self::MIN_SAMPLES {
            let per_token = self
                .samples
                .iter()
                .filter(|(x, _)| *x > 0.0)
                .map(|(x, y)| y / x)
                .min_by(f64::total_cmp)?;
            let secs = (per_token * prompt_tokens as f64).clamp(0.0, Self::MAX.as_secs_f64());
            return Some(Duration::from_secs_f64(secs));
        }
        let nf = n as f64;
        let mx = self.samples.iter().map(|(x, _)| x).sum::<f64>() / nf;
        let my = self.samples.iter().map(|(_, y)| y).sum::<f64>() / nf;
        let (sxy, sxx) = self.samples.iter().fold((0.0, 0.0), |(sxy, sxx), (x, y)| {
            (sxy + (x - mx) * (y - my), sxx + (x - mx) * (x - mx))
        });
        let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
        let secs = if slope > 0.0 {
            my + slope * (prompt_tokens as f64 - mx)
        } else {
            my
        };
        let secs = secs.clamp(0.0, Self::MAX.as_secs_f64());
        Some(Duration::from_secs_f64(secs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }

    proptest! {
        /// On samples that lie on a line of positive slope, the prediction anywhere is that
        /// line: the slope is the per-token prefill time, the intercept the fixed wait.
        #[test]
        fn samples_on_a_line_predict_the_line(
            a_ms in 0.0f64..200.0,
            b_us in 1.0f64..500.0,
            prompts in proptest::collection::vec(1u64..4000, 16..300),
            ask in 1u64..8000,
        ) {
            prop_assume!(prompts.iter().any(|p| *p != prompts[0]));
            let mut f = PrefillFit::new();
            for p in &prompts {
                let t = a_ms / 1000.0 + b_us * *p as f64 / 1e6;
                f.note(*p, Duration::from_secs_f64(t));
            }
            let want = a_ms + b_us * ask as f64 / 1000.0;
            let got = ms(f.predict(ask).unwrap());
            prop_assert!((got - want).abs() < 0.01 * want.max(1.0), "got {got} want {want}");
        }

        /// Waits that do not depend on the prompt (the step in progress at arrival) move the
        /// intercept, not the slope: a long prompt is predicted at least at its own line plus
        /// the least wait.
        #[test]
        fn waits_independent_of_the_prompt_do_not_shorten_a_long_prediction(
            b_us in 50.0f64..300.0,
            seed in any::<u64>(),
        ) {
            let mut x = seed | 1;
            let mut rnd = move |n: u64| {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                x % n
            };
            let mut f = PrefillFit::new();
            for _ in 0..PrefillFit::WINDOW {
                let p = 50 + rnd(1000);
                let wait_ms = 5.0 + rnd(30) as f64; // 5..35 ms, whatever the prompt
                let t = wait_ms / 1000.0 + b_us * p as f64 / 1e6;
                f.note(p, Duration::from_secs_f64(t));
            }
            let got = ms(f.predict(1500).unwrap());
            let floor = 5.0 + b_us * 1.5;
            let ceil = 35.0 + b_us * 1.5;
            // Least squares on 256 samples: within a few ms of the band the truth lies in.
            prop_assert!(got > floor - 10.0 && got < ceil + 10.0, "got {got}, truth in {floor}..{ceil}");
        }
    }

    #[test]
    fn before_enough_samples_the_tightest_per_token_bound() {
        let mut f = PrefillFit::new();
        assert_eq!(f.predict(1000), None);
        // 150 µs a token plus waits of 20-50 ms: the largest prompt bounds it best.
        let line = |p: u64, wait: u64| Duration::from_micros(150 * p + 1000 * wait);
        f.note(100, line(100, 50));
        let first = ms(f.predict(1500).unwrap());
        assert!((first - 1500.0 * 0.65).abs() < 0.01, "{first}");
        f.note(800, line(800, 20));
        let second = ms(f.predict(1500).unwrap());
        assert!((second - 1500.0 * 0.175).abs() < 0.01, "{second}");
        // Never below the true prefill of 225 ms.
        assert!(second >= 225.0);
    }

    #[test]
    fn the_window_forgets_old_samples() {
        let mut f = PrefillFit::new();
        for i in 0..PrefillFit::WINDOW as u64 {
            f.note(100 + i, Duration::from_millis(1000));
        }
        for i in 0..PrefillFit::WINDOW as u64 {
            let p = 100 + i * 7;
            f.note(p, Duration::from_micros(10_000 + 100 * p));
        }
        assert_eq!(f.len(), PrefillFit::WINDOW);
        let got = ms(f.predict(2000).unwrap());
        assert!((got - 210.0).abs() < 1.0, "{got}");
    }

    #[test]
    fn no_spread_or_no_slope_predicts_the_mean() {
        let mut f = PrefillFit::new();
        for i in 0..20u64 {
            f.note(300, Duration::from_millis(40 + 2 * (i % 5)));
        }
        assert_eq!(ms(f.predict(5000).unwrap()).round(), 44.0);
        let mut g = PrefillFit::new();
        for i in 0..20u64 {
            // Longer prompts answered sooner: no prefill cost to see.
            g.note(100 + 10 * i, Duration::from_millis(100 - i));
        }
        let mean = ms(g.predict(10_000).unwrap());
        assert!((mean - 90.5).abs() < 0.01, "{mean}");
    }
}
