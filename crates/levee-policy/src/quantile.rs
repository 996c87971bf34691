//! Nearest-rank quantiles of measured samples.

/// The `q` quantile (0..=1, nearest rank) of `values`, sorting them in place; `None` when
/// there are none.
pub fn nearest_rank(values: &mut [f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let rank = (values.len() as f64 * q.clamp(0.0, 1.0)).ceil() as usize;
    Some(values[rank.clamp(1, values.len()) - 1])
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
}
