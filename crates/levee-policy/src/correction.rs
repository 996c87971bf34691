//! A prompt estimate corrected by what the engine counted.
//!
//! levee counts a prompt before admitting it (a model's tokenizer, or about four characters
//! per token), but the engine's own count decides what its KV cache holds: another
//! tokenizer, a chat template with its own tokens, CJK text at about a token per character,
//! code and JSON at yet other rates. Every answer with `usage.prompt_tokens` tells how far
//! off the estimate was. [`PromptCorrection`] keeps the recent ratios `engine ÷ estimate`
//! of one model and scales each new estimate by a high quantile of them (the 95th
//! percentile by default), so a reservation covers the engine's count for nearly every
//! request, and follows the ratio when the traffic's mix drifts.
//!
//! Samples older than the window are dropped, but the latest [`MIN_SAMPLES`] are always
//! kept: with no recent traffic the correction stays what it last was rather than falling
//! back to no correction at all (the text did not become easier to tokenize).

use crate::clock::Timestamp;
use crate::quantile::SortedSamples;
use std::collections::VecDeque;
use std::time::Duration;

/// Samples the correction needs before it departs from 1.
pub const MIN_SAMPLES: usize = 8;
/// Samples kept at most (the oldest go first).
const MAX_SAMPLES: usize = 1024;
/// Bounds of one sample's ratio and of the factor: an estimate is never scaled below half
/// nor above eight times.
const MIN_FACTOR: f64 = 0.5;
const MAX_FACTOR: f64 = 8.0;

/// One model's correction of its prompt estimates.
#[derive(Debug, Clone)]
pub struct PromptCorrection {
    window: Duration,
    quantile: f64,
    samples: VecDeque<(Timestamp, f64)>,
    /// The same ratios, sorted: a note costs a binary search and a shift instead of a copy
    /// and a sort of the whole window (one note per served request).
    sorted: SortedSamples,
    factor: f64,
    /// The low counterpart of `factor` (the 5th percentile): how little the engine may
    /// count, for checks that must not refuse what the engine would take.
    low: f64,
}

impl Default for PromptCorrection {
    /// A minute's samples, the 95th percentile.
    fn default() -> Self {
        PromptCorrection::new(Duration::from_secs(60), 0.95)
    }
}

impl PromptCorrection {
    /// Keeps samples `window` long and scales by their `quantile` (0..=1).
    pub fn new(window: Duration, quantile: f64) -> Self {
        PromptCorrection {
            window,
            quantile: quantile.clamp(0.0, 1.0),
            samples: VecDeque::new(),
            sorted: SortedSamples::default(),
            factor: 1.0,
            low: MIN_FACTOR,
        }
    }

    /// Records that a prompt levee estimated at `estimate` tokens counted `actual` at the
    /// engine, at `now`.
    pub fn note(&mut self, estimate: u64, actual: u64, now: Timestamp) {
        if estimate == 0 || actual == 0 {
            return;
        }
        let ratio = (actual as f64 / estimate as f64).clamp(MIN_FACTOR, MAX_FACTOR);
        if self.samples.len() >= MAX_SAMPLES {
            if let Some((_, old)) = self.samples.pop_front() {
                self.sorted.remove(old);
            }
        }
        self.samples.push_back((now, ratio));
        self.sorted.insert(ratio);
        self.refresh(now);
    }

    /// Drops samples older than the window (keeping the latest [`MIN_SAMPLES`]) and
    /// recomputes the factor.
    fn refresh(&mut self, now: Timestamp) {
        while self.samples.len() > MIN_SAMPLES
            && self
                .samples
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > self.window)
        {
            if let Some((_, old)) = self.samples.pop_front() {
                self.sorted.remove(old);
            }
        }
        if self.samples.len() < MIN_SAMPLES {
            self.factor = 1.0;
            self.low = MIN_FACTOR;
            return;
        }
        self.factor = (self.sorted.nearest_rank(self.quantile))
            .unwrap_or(1.0)
            .clamp(MIN_FACTOR, MAX_FACTOR);
        self.low = (self.sorted.nearest_rank(1.0 - self.quantile))
            .unwrap_or(MIN_FACTOR)
            .clamp(MIN_FACTOR, MAX_FACTOR);
    }

    /// The factor estimates are scaled by now.
    pub fn factor(&self) -> f64 {
        self.factor
    }

    /// Samples held.
    pub fn samples(&self) -> usize {
        self.samples.len()
    }

    /// `estimate` scaled by the factor, rounded up.
    pub fn correct(&self, estimate: u64) -> u64 {
        scale(estimate, self.factor)
    }
}

/// What a prompt's text is mostly made of. Tokenizers count each kind at its own rate
/// (prose at about a token per word, code and JSON at a token per symbol or two, CJK at
/// about a token per character), so an estimate errs by a different factor for each, and
/// one factor learned over a mix would over-reserve the kinds it errs least on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TextKind {
    /// Mostly letters and spaces.
    Prose,
    /// A fifth or more of the non-space characters are ASCII digits or punctuation (code,
    /// JSON, tables).
    Symbols,
    /// A third or more of the non-space characters are CJK (Han, Kana, Hangul).
    Dense,
}

impl TextKind {
    /// Every kind, in index order.
    pub const ALL: [TextKind; 3] = [TextKind::Prose, TextKind::Symbols, TextKind::Dense];

    /// The kind of a text with `dense` CJK characters, `symbols` ASCII digits and
    /// punctuation, and `other` non-space characters besides.
    pub fn of_counts(dense: u64, symbols: u64, other: u64) -> TextKind {
        let total = dense + symbols + other;
        if total > 0 && dense * 3 >= total {
            TextKind::Dense
        } else if total > 0 && symbols * 5 >= total {
            TextKind::Symbols
        } else {
            TextKind::Prose
        }
    }

    /// Its label value (`prose`, `symbols`, `dense`).
    pub fn as_str(self) -> &'static str {
        match self {
            TextKind::Prose => "prose",
            TextKind::Symbols => "symbols",
            TextKind::Dense => "dense",
        }
    }

    /// Its position among the kinds (`0..TextKind::COUNT`), for tables kept per kind.
    pub fn index(self) -> usize {
        self as usize
    }

    /// How many kinds there are.
    pub const COUNT: usize = 3;
}

/// One model's corrections, one [`PromptCorrection`] per [`TextKind`]. A kind with too few
/// samples of its own borrows the largest factor the others learned (at least 1): a kind
/// levee has not yet seen the engine count is not assumed to be the easiest.
#[derive(Debug, Clone, Default)]
pub struct PromptCorrections {
    kinds: [PromptCorrection; TextKind::COUNT],
}

impl PromptCorrections {
    /// Records the engine's count `actual` of a prompt of `kind` levee estimated at
    /// `estimate`, at `now`.
    pub fn note(&mut self, kind: TextKind, estimate: u64, actual: u64, now: Timestamp) {
        self.kinds[kind.index()].note(estimate, actual, now);
    }

    /// The factor estimates of `kind` are scaled by now.
    pub fn factor(&self, kind: TextKind) -> f64 {
        let own = &self.kinds[kind.index()];
        if own.samples() >= MIN_SAMPLES {
            return own.factor();
        }
        self.kinds
            .iter()
            .filter(|c| c.samples() >= MIN_SAMPLES)
            .map(PromptCorrection::factor)
            .fold(1.0, f64::max)
    }

    /// `estimate` of `kind` scaled by its factor, rounded up.
    pub fn correct(&self, kind: TextKind, estimate: u64) -> u64 {
        scale(estimate, self.factor(kind))
    }

    /// The least the engine is likely to count for a prompt levee estimated at `estimate`,
    /// whatever its kind: scaled by the lowest low quantile (the 5th percentile of the ratios) of
    /// every kind with samples, the estimate itself while none has them. A check that
    /// refuses (the context window) uses it, so that an estimate the engine's counts show to
    /// err high refuses nothing the engine would take. Every kind, not only the prompt's
    /// own: a kind is a whole prompt's majority, and a prompt that mixes kinds (a
    /// conversation of Chinese questions and English answers is `Dense` from a third CJK)
    /// counts at a ratio between theirs, below its own kind's low quantile.
    pub fn floor(&self, estimate: u64) -> u64 {
        let low = self
            .kinds
            .iter()
            .filter(|c| c.samples() >= MIN_SAMPLES)
            .map(|c| c.low)
            .reduce(f64::min)
            .unwrap_or(1.0);
        (estimate as f64 * low).floor() as u64
    }
}

/// `estimate` × `factor`, rounded up (a millionth of a token of floating-point slack is not
/// a token).
fn scale(estimate: u64, factor: f64) -> u64 {
    (estimate as f64 * factor - 1e-6).ceil().max(0.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    #[test]
    fn the_reservation_follows_a_drifting_ratio() {
        let clock = ManualClock::new();
        let mut c = PromptCorrection::new(Duration::from_secs(60), 0.95);
        let estimate = 1_000;
        // Too few samples: no correction.
        for _ in 0..MIN_SAMPLES - 1 {
            c.note(estimate, 3_000, clock.now());
        }
        assert_eq!(c.correct(estimate), estimate);
        let mut c = PromptCorrection::new(Duration::from_secs(60), 0.95);
        // Two minutes where the engine counts what levee estimates: one answer a second.
        for _ in 0..120 {
            c.note(estimate, 1_000, clock.now());
            clock.advance(Duration::from_secs(1));
        }
        assert_eq!(c.correct(estimate), 1_000);
        // The mix drifts (more CJK text): the engine's count climbs from 1.0× to 3.0× of
        // the estimate over two minutes. The reservation follows, never below what a
        // minute-old sample asked for, and reaches the new ratio.
        let mut last = c.correct(estimate);
        for s in 0..=120u64 {
            let actual = 1_000 + s * 2_000 / 120;
            c.note(estimate, actual, clock.now());
            let reserved = c.correct(estimate);
            assert!(reserved >= last, "{reserved} < {last} at {s} s");
            let minute_ago = 1_000 + s.saturating_sub(60) * 2_000 / 120;
            assert!(reserved >= minute_ago, "{reserved} < {minute_ago} at {s} s");
            assert!(reserved <= actual, "{reserved} > {actual} at {s} s");
            last = reserved;
            clock.advance(Duration::from_secs(1));
        }
        // At the end of the drift, the 95th percentile of the last minute.
        assert_eq!(c.correct(estimate), 2_950);
        // The ratio stays at 3.0×: within a window the reservation is its own.
        for _ in 0..60 {
            c.note(estimate, 3_000, clock.now());
            clock.advance(Duration::from_secs(1));
        }
        assert_eq!(c.correct(estimate), 3_000);
        // A quiet hour: the correction holds (no evidence the text got easier).
        clock.advance(Duration::from_secs(3_600));
        c.refresh(clock.now());
        assert_eq!(c.correct(estimate), 3_000);
        // It drifts back down to 1.5×: after a window of the new mix, the reservation is
        // the new ratio's.
        for _ in 0..61 {
            c.note(estimate, 1_500, clock.now());
            clock.advance(Duration::from_secs(1));
        }
        assert_eq!(c.correct(estimate), 1_500);
        // A high quantile: one sample in twenty far above the rest is covered.
        let mut c = PromptCorrection::new(Duration::from_secs(60), 0.95);
        for i in 0..100 {
            let actual = if i % 20 == 0 { 2_000 } else { 1_000 };
            c.note(estimate, actual, clock.now());
        }
        assert_eq!(c.correct(estimate), 1_000);
        let mut c = PromptCorrection::new(Duration::from_secs(60), 0.95);
        for i in 0..100 {
            let actual = if i % 10 == 0 { 2_000 } else { 1_000 };
            c.note(estimate, actual, clock.now());
        }
        assert_eq!(c.correct(estimate), 2_000);
    }

    #[test]
    fn each_kind_of_text_keeps_its_own_factor() {
        let clock = ManualClock::new();
        let mut c = PromptCorrections::default();
        // Nothing learned: no correction for any kind.
        for k in TextKind::ALL {
            assert_eq!(c.correct(k, 1_000), 1_000);
        }
        // Prose counts as estimated, code at 1.8×: each kind its own factor, so prose is
        // not reserved at code's rate.
        for _ in 0..50 {
            c.note(TextKind::Prose, 1_000, 1_000, clock.now());
            c.note(TextKind::Symbols, 1_000, 1_800, clock.now());
            clock.advance(Duration::from_millis(500));
        }
        assert_eq!(c.correct(TextKind::Prose, 1_000), 1_000);
        assert_eq!(c.correct(TextKind::Symbols, 1_000), 1_800);
        // A kind never seen borrows the largest factor learned.
        assert_eq!(c.correct(TextKind::Dense, 1_000), 1_800);
        for _ in 0..MIN_SAMPLES {
            c.note(TextKind::Dense, 1_000, 1_200, clock.now());
        }
        assert_eq!(c.correct(TextKind::Dense, 1_000), 1_200);
        // The floor: the estimate until a kind has samples, then the lowest low quantile
        // of any kind: a prompt mixing code into prose counts somewhere between the two.
        let fresh = PromptCorrections::default();
        assert_eq!(fresh.floor(1_000), 1_000);
        // Code counts 1.8x here, prose 1x: a prompt of either is refused only past 1x.
        assert_eq!(c.floor(1_000), 1_000);
        let mut cjk = PromptCorrections::default();
        for _ in 0..50 {
            // Chinese questions alone count 3.6x levee's estimate, English 0.9x.
            cjk.note(TextKind::Dense, 1_000, 3_600, clock.now());
            cjk.note(TextKind::Prose, 1_000, 900, clock.now());
        }
        // A conversation of Chinese questions and English answers, `Dense` by its share of
        // CJK, that the engine counts at 1.9x: not refused as if it counted 3.6x.
        assert_eq!(cjk.correct(TextKind::Dense, 1_000), 3_600);
        assert_eq!(cjk.floor(1_000), 900);
    }

    #[test]
    fn text_kinds_by_their_characters() {
        assert_eq!(TextKind::of_counts(0, 0, 0), TextKind::Prose);
        assert_eq!(TextKind::of_counts(0, 10, 90), TextKind::Prose);
        assert_eq!(TextKind::of_counts(0, 20, 80), TextKind::Symbols);
        assert_eq!(TextKind::of_counts(34, 0, 66), TextKind::Dense);
        assert_eq!(TextKind::of_counts(30, 30, 40), TextKind::Symbols);
    }

    proptest::proptest! {
        /// The factors kept in step note by note are those of the window's ratios sorted
        /// afresh (as each note computed them before).
        #[test]
        fn the_factors_are_the_window_quantiles(
            notes in proptest::collection::vec((1u64..4_000, 1u64..4_000, 0u64..3_000), 1..1_500),
        ) {
            let mut c = PromptCorrection::new(Duration::from_secs(60), 0.95);
            let mut now = Timestamp::ZERO;
            for (estimate, actual, gap_ms) in notes {
                now = now + Duration::from_millis(gap_ms);
                c.note(estimate, actual, now);
                let mut window: Vec<f64> = c.samples.iter().map(|(_, r)| *r).collect();
                if window.len() >= MIN_SAMPLES {
                    let high = crate::nearest_rank(&mut window, 0.95).unwrap_or(1.0);
                    let low = crate::nearest_rank(&mut window, 1.0 - 0.95).unwrap_or(MIN_FACTOR);
                    proptest::prop_assert_eq!(c.factor, high.clamp(MIN_FACTOR, MAX_FACTOR));
                    proptest::prop_assert_eq!(c.low, low.clamp(MIN_FACTOR, MAX_FACTOR));
                }
            }
        }
    }
}
