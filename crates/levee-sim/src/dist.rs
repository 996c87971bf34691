//! Distributions of request sizes and think times.

use rand::RngExt;
use rand_distr::{Distribution, Exp, LogNormal, Normal};
use serde::{Deserialize, Serialize};

/// A distribution of a non-negative quantity (tokens, seconds), written in TOML as an inline
/// table: `{ dist = "lognormal", median = 500, sigma = 0.8 }`.
///
/// Every draw is clamped to `[min, max]` when those are set (and never below zero), so
/// heavy tails cannot produce absurd requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub enum Dist {
    /// Always `value`.
    Constant {
        /// The value.
        value: f64,
    },
    /// Uniform on `[min, max]`.
    Uniform {
        /// Lower bound.
        min: f64,
        /// Upper bound.
        max: f64,
    },
    /// Normal, clamped to `[min, max]` (default `[0, ∞)`).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std_dev: f64,
        /// Lower clamp.
        #[serde(default)]
        min: Option<f64>,
        /// Upper clamp.
        #[serde(default)]
        max: Option<f64>,
    },
    /// Log-normal: `median × e^(sigma × N(0,1))`, the usual shape of prompt lengths.
    Lognormal {
        /// The median.
        median: f64,
        /// Spread of the logarithm (0.5 = moderate tail, 1.5 = heavy tail).
        sigma: f64,
        /// Lower clamp.
        #[serde(default)]
        min: Option<f64>,
        /// Upper clamp.
        #[serde(default)]
        max: Option<f64>,
    },
    /// Exponential with the given mean.
    Exponential {
        /// The mean.
        mean: f64,
        /// Lower clamp.
        #[serde(default)]
        min: Option<f64>,
        /// Upper clamp.
        #[serde(default)]
        max: Option<f64>,
    },
}

impl Dist {
    /// Checks the parameters (finite, ordered, non-negative where needed).
    pub fn validate(&self) -> anyhow::Result<()> {
        let ok = match *self {
            Dist::Constant { value } => value.is_finite() && value >= 0.0,
            Dist::Uniform { min, max } => {
                min.is_finite() && max.is_finite() && 0.0 <= min && min <= max
            }
            Dist::Normal { mean, std_dev, .. } => {
                mean.is_finite() && std_dev.is_finite() && std_dev >= 0.0
            }
            Dist::Lognormal { median, sigma, .. } => {
                median.is_finite() && median > 0.0 && sigma.is_finite() && sigma >= 0.0
            }
            Dist::Exponential { mean, .. } => mean.is_finite() && mean > 0.0,
        };
        anyhow::ensure!(
            ok,
            "invalid distribution {self:?}: values must be finite, non-negative, min <= max, \
             and median/mean > 0 where they apply"
        );
        Ok(())
    }

    /// One draw.
    pub fn sample<R: RngExt + ?Sized>(&self, rng: &mut R) -> f64 {
        let (raw, lo, hi) = match *self {
            Dist::Constant { value } => (value, None, None),
            Dist::Uniform { min, max } => {
                if max > min {
                    (rng.random_range(min..=max), None, None)
                } else {
                    (min, None, None)
                }
            }
            Dist::Normal {
                mean,
                std_dev,
                min,
                max,
            } => {
                let v = Normal::new(mean, std_dev).map_or(mean, |d| d.sample(rng));
                (v, min, max)
            }
            Dist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => {
                let v = LogNormal::new(median.ln(), sigma).map_or(median, |d| d.sample(rng));
                (v, min, max)
            }
            Dist::Exponential { mean, min, max } => {
                let v = Exp::new(1.0 / mean).map_or(mean, |d| d.sample(rng));
                (v, min, max)
            }
        };
        let v = raw.max(lo.unwrap_or(0.0)).max(0.0);
        match hi {
            Some(hi) => v.min(hi),
            None => v,
        }
    }

    /// The mean (before clamping), for sizing and documentation.
    pub fn mean(&self) -> f64 {
        match *self {
            Dist::Constant { value } => value,
            Dist::Uniform { min, max } => (min + max) / 2.0,
            Dist::Normal { mean, .. } | Dist::Exponential { mean, .. } => mean,
            Dist::Lognormal { median, sigma, .. } => median * (sigma * sigma / 2.0).exp(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn mean_of(d: Dist) -> f64 {
        let mut rng = SmallRng::seed_from_u64(3);
        (0..20_000).map(|_| d.sample(&mut rng)).sum::<f64>() / 20_000.0
    }

    #[test]
    fn sample_means_match() {
        for d in [
            Dist::Constant { value: 5.0 },
            Dist::Uniform {
                min: 10.0,
                max: 30.0,
            },
            Dist::Normal {
                mean: 100.0,
                std_dev: 10.0,
                min: None,
                max: None,
            },
            Dist::Lognormal {
                median: 100.0,
                sigma: 0.5,
                min: None,
                max: None,
            },
            Dist::Exponential {
                mean: 2.0,
                min: None,
                max: None,
            },
        ] {
            let m = mean_of(d);
            assert!(
                (m - d.mean()).abs() / d.mean() < 0.03,
                "{d:?}: sample mean {m} vs {}",
                d.mean()
            );
        }
    }

    #[test]
    fn clamps_apply() {
        let d = Dist::Exponential {
            mean: 100.0,
            min: Some(10.0),
            max: Some(20.0),
        };
        let mut rng = SmallRng::seed_from_u64(1);
        for _ in 0..1000 {
            let v = d.sample(&mut rng);
            assert!((10.0..=20.0).contains(&v));
        }
    }
}
