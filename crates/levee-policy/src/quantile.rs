//! Nearest-rank quantiles of measured samples.

/// The `q` quantile (0..=1, nearest rank) of `values`, sorting them in place; `None` when
/// there are none.
pub fn nearest_rank(values: &mut [f64], q: f64) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    nearest_rank_sorted(values, q)
}

/// [`nearest_rank`] of values already sorted by [`f64::total_cmp`].
pub(crate) fn nearest_rank_sorted(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (sorted.len() as f64 * q.clamp(0.0, 1.0)).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Values kept sorted by [`f64::total_cmp`] as they come and go, so that a quantile of a
/// sliding window costs a binary search and a shift, not a copy and a sort per change.
#[derive(Debug, Clone, Default)]
pub(crate) struct SortedSamples(Vec<f64>);

impl SortedSamples {
    /// Adds `v` after any equal values: a run of equal samples (an exact tokenizer's
    /// ratio of 1) grows at its end, and a run at the top moves nothing.
    pub(crate) fn insert(&mut self, v: f64) {
        let i = self.0.partition_point(|x| x.total_cmp(&v).is_le());
        self.0.insert(i, v);
    }

    /// Removes one value equal to `v`, the last of its run (under `total_cmp` equal values
    /// are the same bits, so which one goes does not matter; the last moves least).
    pub(crate) fn remove(&mut self, v: f64) {
        let end = self.0.partition_point(|x| x.total_cmp(&v).is_le());
        if end > 0 && self.0[end - 1].total_cmp(&v).is_eq() {
            self.0.remove(end - 1);
        }
    }

    /// The `q` quantile, nearest rank, as [`nearest_rank`] gives it.
    pub(crate) fn nearest_rank(&self, q: f64) -> Option<f64> {
        nearest_rank_sorted(&self.0, q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_is_the_ceiling_of_q_times_n() {
        let mut v = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 9.0, 8.0, 7.0, 6.0];
        assert_eq!(nearest_rank(&mut v, 0.9), Some(9.0));
        assert_eq!(nearest_rank(&mut v, 0.95), Some(10.0));
        assert_eq!(nearest_rank(&mut v, 0.0), Some(1.0));
        assert_eq!(nearest_rank(&mut [], 0.5), None);
    }

    proptest::proptest! {
        #[test]
        fn sorted_samples_give_the_quantiles_of_the_values_held(
            ops in proptest::collection::vec((proptest::bool::weighted(0.7), -4i32..40), 1..300),
            q in 0.0f64..=1.0,
        ) {
            let (mut kept, mut held) = (SortedSamples::default(), Vec::new());
            for (add, v) in ops {
                let v = f64::from(v) / 4.0;
                if add || held.is_empty() {
                    kept.insert(v);
                    held.push(v);
                } else {
                    let gone = held.remove(v.abs() as usize % held.len());
                    kept.remove(gone);
                }
                let mut all = held.clone();
                proptest::prop_assert_eq!(kept.nearest_rank(q), nearest_rank(&mut all, q));
            }
        }
    }
}
